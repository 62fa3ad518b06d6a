"""The console script and load errors, run as a user would."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from powerinfer import ModelLoadError
from powerinfer.formats.loader import load_checkpoint, resolve_model

CLI = [sys.executable, "-m", "powerinfer.cli"]


def run(*args, stdin=None):
    """The console script in a process of its own, as a user runs it."""
    return subprocess.run(CLI + list(args), capture_output=True, text=True, input=stdin, timeout=300)


def test_generate_answers_paris():  # the one subprocess smoke test of the entry point
    # llama.cpp's flags: -t is the thread count, --temp the temperature
    r = run("generate", "-m", "smollm2-135m-instruct", "-p", "The capital of France is",
            "-n", "8", "--temp", "0", "-t", "1", "-c", "256")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_chat_reads_turns_from_stdin(monkeypatch, capsys):
    import io

    from powerinfer.cli import main
    monkeypatch.setattr(sys, "stdin", io.StringIO(
        "What is the capital of France?\n/reset\nWhat is the capital of Germany?\n"))
    # the fp32 reference: the 135M model's bf16 first answer here is not about Paris
    assert main(["chat", "--temp", "0", "-n", "30", "--dtype", "float32", "--weights", "dense"]) == 0
    first, second = capsys.readouterr().out.strip().splitlines()[:2]
    assert "Paris" in first and "Berlin" in second


def test_info_prints_architecture(capsys):
    from powerinfer.cli import main
    assert main(["info", "--model", "smollm2-135m-instruct"]) == 0
    out = capsys.readouterr().out
    for needle in ("llama", "layers            30", "Q4_1: 210", "swiglu", "9 / 3"):
        assert needle in out

@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model("smollm2-135m-instruct")


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_wrong_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match=r"bad.gguf: not a GGUF file"):
        load_checkpoint(bad)


def test_a_gguf_of_another_version_is_named_as_such(tmp_path, gguf_path):
    raw = bytearray(gguf_path.read_bytes()[:4096])
    raw[4:8] = (99).to_bytes(4, "little")  # (it was "corrupt or truncated")
    (tmp_path / "v99.gguf").write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"v99.gguf: GGUF version 99, which this build does "
                                             r"not read \(it reads versions 2, 3\)"):
        load_checkpoint(tmp_path / "v99.gguf")


@pytest.mark.parametrize("size", [64, 1_000_000, 90_000_000])
def test_truncated_gguf(tmp_path, gguf_path, size):
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src:
        cut.write_bytes(src.read(size))
    with pytest.raises(ModelLoadError, match="cut.gguf: corrupt or truncated"):
        load_checkpoint(cut)


def test_cli_reports_load_error_and_exits_1(tmp_path, capsys):
    from powerinfer.cli import main
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    assert main(["generate", "--model", str(bad), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "error: cannot load model" in err and "bad.gguf" in err and "Traceback" not in err


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ModelLoadError, match="unknown architecture model_type='gpt_neox'"):
        load_checkpoint(tmp_path)


def test_tensor_shape_mismatch_names_tensor(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from powerinfer import PowerInfer

    cfg = dict(model_type="llama", vocab_size=32, hidden_size=16, num_hidden_layers=1,
               num_attention_heads=2, intermediate_size=32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"tensor embed has shape \(32, 8\), expected \(32, 16\)"):
        PowerInfer.from_pretrained(tmp_path)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_config_error():
    from powerinfer import Config, ConfigError, PowerInfer

    with pytest.raises(ConfigError, match="no CUDA device"):
        PowerInfer.from_pretrained(config=Config(device="cuda"))


def test_a_model_name_given_to_the_constructor_says_how_to_load_it():
    from powerinfer import Config, PowerInfer

    with pytest.raises(TypeError, match=r"PowerInfer\.from_pretrained\(name_or_path, config\)"):
        PowerInfer("smollm2-135m-instruct", Config())


def test_an_amount_of_memory_must_be_a_finite_number():
    import argparse

    from powerinfer import Config, ConfigError
    from powerinfer.config import gib

    assert gib("1.5") == 1.5 and gib("0") == 0
    for bad in ("nan", "inf", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a finite number of GiB"):
            gib(bad)
    with pytest.raises(ConfigError, match="vram_budget_gb must be a finite number"):
        Config(vram_budget_gb=float("nan"))
    for kw, needle in [({"compile": "false"}, "compile must be true or false"),
                       ({"max_batch": "8"}, "max_batch must be an integer"),
                       ({"max_batch": 1.5}, "max_batch must be an integer"),
                       ({"kv_cache_gb": "1"}, "kv_cache_gb must be a number"),
                       ({"cores": 3}, "cores must be a string")]:
        with pytest.raises(ConfigError, match=needle):  # ("false" was true; "8" a TypeError)
            Config(**kw)
    assert Config(vram_budget_gb=4, resources=[("a", 1)]).vram_budget_gb == 4
    r = run("solve", "--bundle", "b", "--vram-budget", "nan")  # (a traceback before)
    assert r.returncode == 2 and "--vram-budget: 'nan' is not a finite number of GiB" in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["eval", "--bundle", "b", "--window", "0"], "--window: '0' is less than 2"),
    (["eval", "--bundle", "b", "--tokens", "-5"], "--tokens: '-5' is less than 0"),
    (["profile", "--out", "b", "--samples", "0"], "--samples: '0' is less than 1"),
    (["calibrate-input", "--bundle", "b", "--held-out", "0"], "--held-out: '0' is less than 1"),
    (["solve", "--bundle", "b", "--vram-budget", "1", "--group", "0"], "'0' is less than 1"),
    (["solve", "--bundle", "b", "--vram-budget", "1", "--time-limit", "nan"],
     "--time-limit: 'nan' is not a finite number above 0"),
    (["train-predictors", "--bundle", "b", "--epochs", "0"], "'0' is less than 1"),
    (["synthetic", "--out", "x", "--layers", "0"], "--layers: '0' is less than 1"),
    (["generate", "-p", "x", "--max-tokens", "0"], "--max-tokens/-n: '0' is less than 1"),
    (["generate", "-p", "x", "--threads", "two"], "--threads/-t: invalid whole_number value: 'two'"),
    (["train-predictors", "--bundle", "b", "--ranks", "16,,32"],
     "--ranks: '16,,32' is not a comma-separated list of whole numbers"),
    (["train-predictors", "--bundle", "b", "--ranks", "0"], "each rank must be at least 1"),
    (["train-predictors", "--bundle", "b", "--recall", "1.5"], "--recall: '1.5' is not in (0, 1]"),
    (["profile", "--out", "b", "--dtype", "foo"], "--dtype: invalid choice: 'foo'"),
    (["synthetic", "--out", "x", "--seed", "-1"], "--seed: '-1' is less than 0"),
    (["serve", "--drain-timeout", "-1"],
     "--drain-timeout: '-1' is not a finite number of seconds, 0 or more"),
    (["serve", "--request-timeout", "inf"], "--request-timeout: 'inf' is not a finite number"),
])
def test_a_count_out_of_range_is_named_before_anything_runs(argv, needle, capsys):
    # (`eval --window 0` ended in a RuntimeError after loading the model, and `--tokens -5`
    # ran on a corpus cut short at its end)
    from powerinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_file_the_command_cannot_write_is_named_without_a_traceback(tmp_path, capsys):
    from powerinfer.cli import main
    from powerinfer.formats.bundle import Bundle

    out = tmp_path / "no" / "such" / "folder" / "s.gguf"
    assert main(["synthetic", "--preset", "tiny", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "error: No such file or directory" in err and "Traceback" not in err, err
    # export-pwri onto its own model file: refused (it overwrote the model, orphaning its bundle)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    Bundle.create(tmp_path / "b", {"file": "m.gguf", "size": 4, "sha256": "0", "n_layers": 1,
                                   "dim": 1, "ffn_dim": 1})
    assert main(["export-pwri", "-m", str(model), "--bundle", str(tmp_path / "b"),
                 "--out", str(model)]) == 1
    assert "is the model file itself" in capsys.readouterr().err
    assert model.read_bytes() == b"GGUF"


def test_serve_names_a_missing_model_before_it_starts_ray(tmp_path):
    # (it started Ray and Serve, then a replica failed; a path was also refused as a bad name)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    missing = str(tmp_path / "nowhere.gguf")
    t0 = time.monotonic()
    r = subprocess.run(CLI + ["serve", "--model", missing], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode != 0 and time.monotonic() - t0 < 60
    assert f"cannot load model {missing}: no such file or folder" in r.stderr, r.stderr
    assert "Ray" not in r.stdout + r.stderr


def test_a_kv_cache_past_the_hosts_memory_is_a_config_error():
    from powerinfer import Config, ConfigError, PowerInfer

    with pytest.raises(ConfigError, match=r"kv_cache_gb=100000 is more than this host's"):
        PowerInfer.from_pretrained(config=Config(kv_cache_gb=100000))  # (a raw MemoryError)
    # too small for a sequence: named at load (it loaded, and every prompt was refused as past
    # max_seq_len)
    with pytest.raises(ConfigError, match=r"kv_cache_gb=0.0001 holds 0 of this model's KV "
                                          r"blocks .* too few for a sequence"):
        PowerInfer.from_pretrained(config=Config(kv_cache_gb=0.0001))
    # a pool smaller than the context: a long prompt's error names the pool, not max_seq_len
    from powerinfer.errors import InvalidRequestError
    block = 30 * 2 * 3 * 64 * 16 * 4 / 2**30  # SmolLM2's float32 KV block: 30 layers, 3 heads
    pi = PowerInfer.from_pretrained(config=Config(kv_cache_gb=4 * block, dtype="float32"))
    with pytest.raises(InvalidRequestError, match=r"the context holds 48 \(the KV cache's size: "
                                                  r"kv_cache_gb="):
        pi.generate("word " * 80, max_new_tokens=1)


def test_a_bad_predictor_device_is_a_config_error():
    from powerinfer import Config, ConfigError

    with pytest.raises(ConfigError, match="predictor_device must be auto or cpu, got 'gpu'"):
        Config(predictor_device="gpu")
    assert Config(predictor_device="cpu").predictor_device == "cpu"


def test_the_library_imports_nothing_built_on_it():
    """powerinfer/ is the core: the actor runtime and the server depend on it and register
    themselves through entry points; no module of the library imports them."""
    import ast

    root = Path(__file__).resolve().parent.parent / "powerinfer"
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n.split(".")[0] in ("actors", "serve_app", "cluster") for n in names), \
                (f.name, names)
    from powerinfer.errors import ConfigError
    from powerinfer.runtimes import engine_class
    assert engine_class("actors").__name__ == "ActorEngine"  # found through its entry point
    # one not registered: the error lists those that are and says how one registers
    with pytest.raises(ConfigError, match=r"runtime 'mpi' is not installed \(installed: actors;"
                                          r".*pip install -e \."):
        engine_class("mpi")


def test_a_local_ray_start_that_times_out_is_cleaned_up_and_tried_once_more(monkeypatch):
    # Ray gives a local raylet a fixed 30 s to register and leaves the half-started node's
    # processes running when it does not (seen on a loaded 2-core machine): the processes the
    # failed attempt started are stopped, and the start is tried once more; other errors are not
    import ray

    from powerinfer import compat
    calls, started = [], []

    def init(**kw):
        calls.append(kw)
        if len(calls) == 1:  # a process of the failed attempt (named as Ray's log monitor),
            # and one another thread started meanwhile, which is not Ray's to stop
            sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
            started.append(subprocess.Popen(sleep + ["ray/_private/log_monitor.py"]))
            started.append(subprocess.Popen(sleep))
            raise Exception("The current node timed out during startup. This could happen "
                            "because some of the raylet failed to startup or the GCS has "
                            "become overloaded.")
        if len(calls) == 3:
            raise ValueError("something else")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    compat.ray_init()
    assert len(calls) == 2 and calls[1] == calls[0]
    started[0].wait(timeout=15)  # stopped, not left behind (it sleeps 120 s: TimeoutExpired)
    assert started[1].poll() is None  # not Ray's: left running
    started[1].kill()
    started[1].wait()
    with pytest.raises(ValueError, match="something else"):
        compat.ray_init()
    assert len(calls) == 3


def test_a_gguf_without_a_vocabulary_names_the_missing_key():
    from powerinfer.formats.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="metadata lacks tokenizer.ggml.tokens: no tokenizer"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ValueError, match="metadata lacks tokenizer.ggml.scores"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


def test_rays_token_file_is_this_users_alone(tmp_path, monkeypatch):
    # (Ray writes ~/.ray/auth_token with the umask: commonly readable by every user of the
    # machine, any of whom could then run code in the cluster as this user)
    from powerinfer.compat import private_ray_token

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    token = tmp_path / "ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert private_ray_token(create=False) is None and not token.exists()  # (a joiner's)
    assert private_ray_token() == token
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    assert token.parent.stat().st_mode & 0o077 == 0
    made = token.read_text()
    token.chmod(0o644)
    assert private_ray_token() == token and token.stat().st_mode & 0o777 == 0o600
    assert token.read_text() == made  # (kept: the cluster's nodes hold it)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 64)
    assert private_ray_token() is None


def test_a_loads_line_names_where_it_runs_not_where_a_budget_could_run_it():
    # (device "auto" with a VRAM budget on a host without a GPU said "on a GPU", and two lines
    # later that nothing was placed on one)
    import torch

    from powerinfer import Config

    where = "on a GPU" if torch.cuda.is_available() else "on the CPU"
    for cfg in (Config(vram_budget_gb=4), Config(device="auto")):
        assert cfg.summary().startswith(where + ", CPU kernel"), cfg.summary()
    assert Config(device="cpu", vram_budget_gb=0).summary().startswith("on the CPU")


def test_the_help_gives_every_commands_defaults_and_names_every_command(capsys):
    # (the defaults were in the code only; `synthetic --preset` named no choice; the top-level
    # description left out calibrate-input and the server's commands)
    from powerinfer.cli import PRESET_NAMES, main
    from powerinfer.sparsity.synthetic import PRESETS

    assert set(PRESET_NAMES) == set(PRESETS)
    for argv, needles in ((["--help"], ["calibrate-input", "serve, plan, ray-start"]),
                          (["profile", "--help"], ["(default 16384)", "(default 512)"]),
                          (["synthetic", "--help"], ["{7b,13b,70b,tiny}", "(default 0.9)"]),
                          (["generate", "--help"], ["(default 0.8)", "the text to complete"])):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        for n in needles:
            assert n in out, (argv, n)


def test_export_pwri_takes_an_installed_models_name(tmp_path, capsys):
    # (a short name was "No such file or directory"; the default model is SwiGLU, refused by
    # what the original runs, not as a model that cannot load)
    from powerinfer.cli import main
    from powerinfer.formats.bundle import Bundle
    from powerinfer.formats.loader import DEFAULT_MODEL, resolve_model
    from powerinfer.formats.bundle import model_record
    from powerinfer.formats.loader import load_checkpoint

    path = resolve_model(DEFAULT_MODEL)
    Bundle.create(tmp_path / "b", model_record(path, load_checkpoint(path,
                                                                     with_weights=False).args))
    assert main(["export-pwri", "-m", DEFAULT_MODEL, "--bundle", str(tmp_path / "b"),
                 "--out", str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert "cannot be written as a PWRI file" in err and "No such file" not in err, err


def test_an_invalid_request_names_its_field_across_processes():
    """Ray pickles an error from the scheduler to the replica; the field at fault stays named
    (an HTTP error body's `param`)."""
    import pickle

    from powerinfer.errors import InvalidRequestError
    e = pickle.loads(pickle.dumps(InvalidRequestError("JSON schema: no", param="response_format")))
    assert isinstance(e, InvalidRequestError) and isinstance(e, ValueError)
    assert (str(e), e.param) == ("JSON schema: no", "response_format")
    assert pickle.loads(pickle.dumps(InvalidRequestError("plain"))).param is None
