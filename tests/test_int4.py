"""Weight-only int4: the file's 4-bit blocks are reproduced exactly, and the int4 model tracks
the dense one (on random GGUF checkpoints and on the real default model)."""
import gguf
import numpy as np
import pytest
import torch

from checkpoints import build_hf_model, llama_family_config, write_llama_gguf
from conftest import CPU_CLASSES
from greedy import assert_same_or_near_tie
from powerinfer import Config, PowerInfer
from powerinfer.errors import ConfigError
from powerinfer.compat import gguf_reader
from powerinfer.formats.gguf import dequantize
from powerinfer import kernels
from powerinfer.model.quant import Int4Linear, Q4Linear
from powerinfer.formats.q4 import q4_blocks

FOUR_BIT = (Int4Linear, Q4Linear)

Q = gguf.GGMLQuantizationType


def reconstruct(q, scale, zero):  # torch's int4 formula: (q - 8) * scale + zero, groups of 32
    n, k = q.shape
    w = (q.reshape(n, k // 32, 32).astype(np.float32) - 8) * scale[..., None] + zero[..., None]
    return w.reshape(n, k)


@pytest.fixture(scope="module", params=[Q.Q4_0, Q.Q4_1], ids=["Q4_0", "Q4_1"])
def q4_file(request, tmp_path_factory):
    cfg = llama_family_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("q4") / "model.gguf"
    write_llama_gguf(path, build_hf_model(cfg, seed=5), qtype=request.param)
    return path


def test_blocks_reproduce_the_files_weights(q4_file):
    reader = gguf_reader(q4_file)
    checked = 0
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_0", "Q4_1"):
            ref = dequantize(t)
            np.testing.assert_allclose(reconstruct(*q4_blocks(t)), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
            checked += 1
    assert checked >= 14  # q, k, v, o, gate, up, down in each of 2 layers


@pytest.mark.parametrize("cls", FOUR_BIT, ids=lambda c: c.__name__)
@pytest.mark.parametrize("rows", [1, 3, 70])  # decode, a small batch, a prefill past MAX_ROWS
def test_int4_linear_matches_bf16_dense(q4_file, cls, rows):
    if cls is Q4Linear and not kernels.available():
        pytest.skip("the kernel library cannot run on this machine")
    t = next(t for t in gguf_reader(q4_file).tensors if t.name == "blk.0.ffn_gate.weight")
    q, scale, zero = (torch.from_numpy(a) for a in q4_blocks(t))
    layer = cls(q, scale, zero, None)
    x = torch.randn(rows, 1, layer.in_features)
    w = torch.from_numpy(dequantize(t))
    ref = x @ w.T
    out = layer(x.bfloat16()).float()
    assert out.shape == ref.shape
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_int4_model_tracks_dense_model(q4_file):
    dense = PowerInfer.from_pretrained(q4_file, config=Config(dtype="float32", weights="dense", max_batch=1))
    int4 = PowerInfer.from_pretrained(q4_file, config=Config(dtype="bfloat16", weights="int4", max_batch=1))
    assert sum(isinstance(m, FOUR_BIT) for m in int4.model.modules()) == 8
    tokens = [5, 17, 99, 150, 33, 2, 250, 7]
    a, b = dense.engine.logits(tokens, every=True), int4.engine.logits(tokens, every=True)
    assert (a - b).abs().max() <= 0.03 * a.abs().max()


def test_int4_needs_bf16_or_float32_and_4bit_weights(tmp_path):
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        Config(weights="int4", dtype="float16")
    cfg = llama_family_config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "f32.gguf"
    write_llama_gguf(path, build_hf_model(cfg, seed=1))
    from powerinfer import ModelLoadError
    with pytest.raises(ModelLoadError, match="Q4_0/Q4_1"):
        PowerInfer.from_pretrained(path, config=Config(dtype="bfloat16", weights="int4"))


@pytest.mark.slow
def test_int4_real_model_answers_and_agrees_with_dense():
    dense = PowerInfer.from_pretrained(config=Config(dtype="float32", weights="dense", max_batch=1))
    int4 = PowerInfer.from_pretrained(config=Config(dtype="bfloat16", weights="int4", max_batch=1))
    ids = dense.tokenize("The capital of France is a city called")
    a, b = dense.engine.logits(ids, every=True), int4.engine.logits(ids, every=True)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    assert "Paris" in int4.generate("The capital of France is", max_new_tokens=8, temperature=0)


@pytest.mark.parametrize("isa", CPU_CLASSES)
def test_defaults_are_the_fastest_setting_without_warm_up(isa, caplog):
    # on every class the kernel builds for (held to each below this CPU's best), a 4-bit file
    # runs its blocks with bf16 activations (measured fastest on AVX2 as well as with native bf16,
    # BENCHMARKS.md); a file with nothing 4-bit runs bf16 where bf16 is native, else float32
    at = lambda **kw: Config(cpu_isa=isa, **kw).resolve(has_q4=True)  # noqa: E731
    assert (at().dtype, at().weights, at().cpu_isa) == ("bfloat16", "int4", isa)
    assert Config().resolve(has_q4=True).cpu_isa == "auto"  # each process's own best
    plain = Config(cpu_isa=isa).resolve(has_q4=False)
    assert (plain.dtype, plain.weights) == ("bfloat16" if isa == "avx512bf16" else "float32", "dense")
    assert at(runtime="actors").weights == "int4"  # the actor runtime runs int4 too
    assert at(dtype="float32").weights == "dense"  # the reference, asked for
    # float16 asked for: dense weights (the kernel's int4 takes bf16 or float32; it was a
    # ConfigError about int4, which the user had not asked for), and the local runtime only
    assert at(dtype="float16", device="cpu").weights == "dense"
    with pytest.raises(ConfigError, match="'float16' runs on the CPU in the local runtime only"):
        at(dtype="float16", device="cpu", runtime="actors")
    assert at(weights="dense").dtype == plain.dtype  # dense asked for: as a plain file
    with caplog.at_level("INFO", logger="powerinfer"):
        pi = PowerInfer.from_pretrained(config=Config(cpu_isa=isa))  # the default model, Q4_1
    assert (pi.config.dtype, pi.config.weights, pi.config.compile) == ("bfloat16", "int4", False)
    assert kernels.isa() == isa  # the process runs the class asked for
    assert any(isinstance(m, FOUR_BIT) for m in pi.model.modules())
    # the load's log line says what it runs
    assert f"CPU kernel {isa}, bfloat16 activations, int4 weights" in caplog.text
    assert "Q4_1 210" in caplog.text


def test_a_class_the_cpu_lacks_is_refused_at_load():
    with pytest.raises(ConfigError, match="cpu_isa"):
        Config(cpu_isa="avx1024")
    above = kernels.ISAS[kernels.ISAS.index(kernels.best_isa()) + 1:]
    if not above:
        pytest.skip("this CPU runs every class the kernel builds for")
    with pytest.raises(ConfigError, match=f"runs at most {kernels.best_isa()!r}"):
        Config(cpu_isa=above[0]).resolve(has_q4=True)


HELD = """
import logging, sys, ctypes
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
from powerinfer import Config, PowerInfer, kernels
from powerinfer.errors import ConfigError
from actors import clib
lite = clib.Library(kernels.library(lite=True))
best = ctypes.create_string_buffer(32)
lite.lib.pi_best_isa(best, 32)
print("classes", kernels.best_isa(), kernels.isa(), best.value.decode(), lite.isa())
for above in kernels.ISAS[kernels.ISAS.index(kernels.best_isa()) + 1:]:
    try:
        Config(cpu_isa=above).resolve(has_q4=True)
    except ConfigError as e:
        print("refused", above, e)
PowerInfer.from_pretrained(config=Config(max_batch=1, max_seq_len=64))
"""


@pytest.mark.parametrize("cap", ["avx2", "avx1024"])
def test_the_environment_holds_a_process_to_a_lower_class(cap):
    # POWERINFER_MAX_ISA, set before a process starts: the process (and those it starts) run
    # as on a CPU of that class, `auto` included, in the torch build and the torch-free one (a
    # suite or benchmark on a newer CPU runs an older one's paths throughout); a name that is
    # not a class is named in a warning and holds nothing
    if not kernels.available():
        pytest.skip("the kernel library does not run here")
    import os
    import subprocess
    import sys
    env = dict(os.environ, POWERINFER_MAX_ISA=cap)
    out = subprocess.run([sys.executable, "-c", HELD], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    classes = next(line for line in out.stdout.splitlines() if line.startswith("classes "))
    isa = classes.split()[1]
    assert classes == f"classes {isa} {isa} {isa} {isa}", out.stdout
    # (a name that is not a class: the CPU's own, which this process's may be held below)
    assert isa == "avx2" if cap == "avx2" else \
        kernels.ISAS.index(isa) >= kernels.ISAS.index(kernels.best_isa()), out.stdout
    refused = kernels.ISAS[kernels.ISAS.index(isa) + 1:]
    for above in refused:
        assert f"refused {above} " in out.stdout and f"runs at most {isa!r}" in out.stdout
    assert f"CPU kernel {isa}, bfloat16 activations, int4 weights" in out.stdout, out.stdout
    if cap != "avx2":
        assert "POWERINFER_MAX_ISA='avx1024' is not one of avx2, avx512, avx512bf16: ignored" \
            in out.stdout + out.stderr


@pytest.mark.parametrize("isa", CPU_CLASSES)
def test_float32_activations_over_4_bit_weights(default_model_path, isa):
    # float32 activations with the file's 4-bit blocks (asked for): the kernel's integer dot
    # products are the same, so the same greedy tokens as bf16 activations up to near ties, and
    # the KV cache is float32
    ref = PowerInfer.from_pretrained(config=Config(cpu_isa=isa, max_batch=1, max_seq_len=256))
    f32 = PowerInfer.from_pretrained(config=Config(cpu_isa=isa, dtype="float32", weights="int4",
                                                   max_batch=1, max_seq_len=256))
    assert any(isinstance(m, FOUR_BIT) for m in f32.model.modules())
    assert f32.model.layers[0].attn.kv_cache.k.dtype == torch.float32
    ids = f32.tokenize("Water boils at a temperature of")
    want = [e.token for e in ref._run([ids], 16, dict(temperature=0, ignore_eos=True))]
    got = [e.token for e in f32._run([ids], 16, dict(temperature=0, ignore_eos=True))]
    assert_same_or_near_tie(ref, ids, want, got, 0.5)
