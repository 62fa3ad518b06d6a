"""The serving contract without a server: the generated gRPC stubs match the .proto, serving
configs are validated with errors that name the problem, and request bodies are checked at the
edge the way the OpenAI API checks them."""
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from powerinfer.errors import ConfigError
from serve_app import openai_schema as oa
from serve_app.settings import ServeSettings

ROOT = Path(__file__).resolve().parent.parent
PROTO = "powerinfer/v1/inference.proto"  # under protos/


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", PROTO], cwd=ROOT, check=True)
    for name in ("inference_pb2.py", "inference_pb2_grpc.py"):
        fresh = (tmp_path / "powerinfer/v1" / name).read_text()
        assert (ROOT / "powerinfer/v1" / name).read_text() == fresh, \
            f"{name} is stale: run `make protos`"


def test_a_wheel_built_from_a_clean_tree_ships_the_stubs(tmp_path):
    """What `pip install .` (the container) or a wheel gets: powerinfer.v1 with its stubs,
    generated at build time from the .proto (setup.py), since a checkout has none committed."""
    import shutil
    import zipfile

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode:
        pytest.skip("not a git checkout: no list of the tracked files")
    files = listed.stdout.decode().split("\0")
    src = tmp_path / "src"
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    assert not list((src / "powerinfer/v1").glob("*_pb2*"))  # none in the tree
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True)
    wheel, = (tmp_path / "dist").glob("powerinfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"powerinfer/v1/inference_pb2.py", "powerinfer/v1/inference_pb2_grpc.py",
            "powerinfer/v1/inference_pb2.pyi"} <= names
    assert not any(n.startswith("protos/") for n in names)


def test_the_serve_config_file_builds_the_application():
    """`serve run serve_app/config.yaml` builds the app from these args."""
    from serve_app.app import GRPC_SERVICER, build_app
    cfg = yaml.safe_load((ROOT / "serve_app/config.yaml").read_text())
    assert cfg["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER]
    app_cfg, = cfg["applications"]
    assert app_cfg["import_path"] == "serve_app.app:build_app"
    assert build_app(app_cfg["args"]) is not None
    settings = ServeSettings.from_dict(app_cfg["args"])
    assert [m.name for m in settings.models] == ["smollm2-135m-instruct"]


@pytest.mark.parametrize("cfg,needle", [
    ({}, "'models'"),
    ({"models": []}, "at least one model"),
    ({"models": [{"name": "a"}]}, "'name' and a 'model'"),
    ({"models": [{"name": "a", "model": "x", "colde_executors": 2}]}, "colde_executors"),
    ({"models": [{"name": "a", "model": "x"}, {"name": "a", "model": "y"}]}, "repeated: a"),
    ({"models": [{"name": "../x", "model": "x"}]}, "model name"),
    ({"models": [{"name": "a", "model": "x", "device": "tpu"}]}, "device"),
    ({"models": [{"name": "a", "model": "x", "predictor_device": "gpu"}]}, "predictor_device"),
    ({"models": [{"name": "a", "model": "x"}], "max_body": 5}, "max_body"),
    ({"models": [{"name": "a", "model": "x"}], "stream_interval_ms": -1}, "stream_interval_ms"),
])
def test_bad_serving_configs_name_the_problem(cfg, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        ServeSettings.from_dict(cfg)


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("POWERINFER_API_KEY", "k1")
    assert ServeSettings.from_dict({"models": [{"name": "a", "model": "x"}]}).api_key == "k1"
    explicit = ServeSettings.from_dict({"models": [{"name": "a", "model": "x"}], "api_key": "k2"})
    assert explicit.api_key == "k2"


def test_request_bodies_map_to_engine_sampling():
    r = oa.ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "temperature": 0, "stop": "x", "top_k": -1, "logprobs": True,
        "top_logprobs": 2, "user": "someone", "unknown_field": 1})
    assert r.messages[0].as_template_input() == {"role": "system", "content": "ab"}
    assert r.engine_sampling() == {"max_tokens": 7, "temperature": 0.0, "top_k": 0, "stop": "x",
                                   "ignore_eos": False, "logprobs": 2}
    c = oa.CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "n": 2})
    assert c.prompts() == [[1, 2], [3]] and c.engine_sampling()["max_tokens"] == 16


def test_a_named_function_is_one_call_and_tokenize_takes_the_chats_tools():
    ask = {"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f"}}]}
    spec = lambda **kw: oa.ChatCompletionRequest.model_validate({**ask, **kw}).tool_spec  # noqa: E731
    assert spec()["parallel"] and spec(tool_choice="required")["parallel"]
    assert not spec(parallel_tool_calls=False)["parallel"]
    # (its grammar let the model call it again and again)
    named = spec(tool_choice={"type": "function", "function": {"name": "f"}})
    assert named["choice"] == "f" and not named["parallel"]
    t = oa.TokenizeRequest.model_validate(ask)
    assert t.tool_spec == {**spec(), "parallel": True}
    assert oa.TokenizeRequest.model_validate({"model": "m", "prompt": "x"}).tool_spec is None
    with pytest.raises(ValidationError, match="tools go with messages"):
        oa.TokenizeRequest.model_validate({"model": "m", "prompt": "x", "tools": ask["tools"]})


@pytest.mark.parametrize("body,needle", [
    ({"model": "m", "messages": [], "max_tokens": 1}, "at least 1"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]}, "assistant"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "needs tools"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "name"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f"}}],
      "response_format": {"type": "json_object"}}, "constrains"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5},
     "less than or equal to 2"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}, "stream"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 17}, "16"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -100}},
     "logit_bias is not supported"),
    ({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "type 'image_url': the models served here take text only"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]},
     "the schema of an object"),
])
def test_chat_bodies_the_engine_cannot_honour_are_refused(body, needle):
    with pytest.raises(ValidationError, match=needle):
        oa.ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize("field,value,needle", [
    ("max_tokens", True, "valid integer"), ("max_tokens", "5", "valid integer"),
    ("max_tokens", 5.0, "valid integer"), ("n", True, "valid integer"),
    ("seed", "7", "valid integer"), ("stream", "no", "valid boolean"),
    ("stream", 1, "valid boolean"), ("temperature", "0.5", "valid number"),
    ("stop_token_ids", [True], "valid integer"), ("logprobs", 1, "valid boolean")])
def test_a_fields_json_type_is_held_as_openai_holds_it(field, value, needle):
    # (pydantic's lax mode read `"max_tokens": true` as 1 and `"stream": "no"` as false)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(ValidationError, match=needle):
        oa.ChatCompletionRequest.model_validate_json(json.dumps(body))
    with pytest.raises(ValidationError, match="prompt"):  # not token 1
        oa.CompletionRequest.model_validate_json('{"model": "m", "prompt": [true]}')
    # an integer where a number is asked stays a number
    ok = oa.ChatCompletionRequest.model_validate_json(json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1,
         "top_p": 1}))
    assert ok.temperature == 1.0 and isinstance(ok.temperature, float)


def test_completion_choices_are_bounded():
    with pytest.raises(ValidationError, match="choices"):
        oa.CompletionRequest.model_validate({"model": "m", "prompt": ["a"] * 9, "n": 2})


def test_replicas_split_their_models_cores():
    from serve_app.settings import ModelSpec as Spec

    m = Spec(name="m", model="smollm2-135m-instruct", replicas=2, cores="0-4")
    assert [m.replica_cores(i) for i in (0, 1)] == ["0,1,2", "3,4"]
    assert m.config(1).cores == "3,4"
    assert Spec(name="one", model="x", cores="0-3").config(0).cores == "0-3"
    with pytest.raises(ConfigError, match="3 replicas need a core each; it has 2"):
        Spec(name="m", model="x", replicas=3, cores="0,1")
    with pytest.raises(ConfigError, match="replicas must be a positive integer"):
        Spec(name="m", model="x", replicas=0)
    with pytest.raises(ConfigError, match="cores must be a cpulist"):
        Spec(name="m", model="x", cores="zero")


def test_models_that_share_too_few_cores_run_as_one_executor_each():
    # the default group is two executors that spin on the plane while the other computes; where
    # models' groups together have more executors than their shared cores (or a group has one
    # core), each model whose entry leaves it open runs as one executor with the whole model, on
    # its share of the cores; an entry's own cold_executors, a bundle, a GPU or a VRAM budget,
    # and groups on disjoint cores or sent elsewhere by their resources, stay as they are
    from serve_app.settings import ModelSpec as Spec

    def chosen(*entries):
        models = ServeSettings.from_dict({"models": [{"model": "x", **e} for e in entries]}).models
        return {m.name: (m.base.cold_executors, m.base.cpu_threads, m.chosen) for m in models}

    alone = chosen({"name": "a", "cores": "0,1"})
    assert alone == {"a": (1, 0, "")}
    four = chosen(*({"name": f"m{i}", "cores": "0,1"} for i in range(4)))
    assert {v[:2] for v in four.values()} == {(0, 1)}
    assert four["m0"][2] == ("one executor with the whole model, 1 thread (4 groups share 2 "
                             "cores (0-1); a models file's cold_executors, or --cold-executors "
                             "with --model, chooses)")
    # four groups on 16 cores have cores enough; two on 3 split them (at least one thread each)
    assert {v[:2] for v in chosen(*({"name": f"m{i}", "cores": "0-15"}
                                    for i in range(4))).values()} == {(1, 0)}
    assert {v[:2] for v in chosen({"name": "a", "cores": "0-2"}, {"name": "b", "cores": "1-3"},
                                  {"name": "c", "cores": "2"}).values()} == {(0, 1)}
    assert chosen({"name": "a", "cores": "0-3"}, {"name": "b", "cores": "0-3", "cpu_threads": 3},
                  {"name": "c", "cores": "0-3"})["b"][:2] == (0, 3)
    # the cores left over go to the first models: where every group sharing them is chosen,
    # none idle and none shared by two threads
    five = chosen(*({"name": f"m{i}", "cores": "0-7"} for i in range(5)))
    assert [v[:2] for v in five.values()] == [(0, 2)] * 3 + [(0, 1)] * 2
    one_core = chosen({"name": "a", "cores": "5"})["a"]
    assert one_core[:2] == (0, 1) and "its group has 1 core (5)" in one_core[2]
    # each of two replicas on one core of its own
    assert chosen({"name": "r", "cores": "0,1", "replicas": 2})["r"][:2] == (0, 1)
    kept = chosen({"name": "a", "cores": "0,1", "cold_executors": 1},
                  {"name": "b", "cores": "0,1", "bundle": "b.bundle"},
                  {"name": "c", "cores": "0,1", "vram_budget_gb": 1.0},
                  {"name": "d", "cores": "0,1", "device": "cuda"})
    assert {k: v[0] for k, v in kept.items()} == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert chosen({"name": "a", "cores": "0,1"}, {"name": "b", "cores": "2,3"}) == \
        {"a": (1, 0, ""), "b": (1, 0, "")}
    assert chosen({"name": "a", "cores": "0,1"},
                  {"name": "b", "cores": "0,1", "resources": {"big-box": 1}})["a"][0] == 1
    # no cores named and resources that send it to another kind of node: its cores are not
    # this process's, and it is left as it is
    assert {v[0] for v in chosen({"name": "a", "resources": {"big-box": 1}},
                                 {"name": "b", "resources": {"big-box": 1}}).values()} == {1}
    # nor is it counted against a model of the same resources that names its cores
    assert chosen({"name": "a", "resources": {"big-box": 1}},
                  {"name": "b", "cores": "0,1", "resources": {"big-box": 1}})["b"][0] == 1
    # resolved once: a spec already chosen keeps its setting when settings are built again
    # (Serve's application gets them pickled; a config file's args are read again)
    import pickle
    first = ServeSettings.from_dict({"models": [{"name": "a", "model": "x", "cores": "0"},
                                                {"name": "b", "model": "x", "cores": "0"}]})
    again = ServeSettings(models=pickle.loads(pickle.dumps(first.models)))
    assert [(m.settings, m.chosen) for m in again.models] == \
        [(m.settings, m.chosen) for m in first.models]
    assert all(isinstance(m, Spec) and m.base.cold_executors == 0 and m.chosen
               for m in again.models)


def test_a_models_entry_sets_any_config_field_and_nothing_else():
    # the entry's settings are Config's own fields (derived, not copied: a field Config gains is
    # a setting at once), with the server's defaults where they differ; the runtime is the
    # server's, and a name Config does not know is refused with the model named
    from dataclasses import fields

    from powerinfer.config import Config
    from serve_app.settings import CONFIG_FIELDS, ServeSettings

    assert set(CONFIG_FIELDS) == {f.name for f in fields(Config)} - {"runtime", "cores", "resources"}
    entry = {"name": "m", "model": "x", "weights": "dense", "cuda_graphs": False,
             "vram_budget_gb": 2.5, "max_batch": 4, "cores": "0", "resources": {"gpu-box": 1}}
    spec, = ServeSettings.from_dict({"models": [entry]}).models
    c = spec.config()
    assert (c.runtime, c.weights, c.cuda_graphs, c.vram_budget_gb, c.max_batch, c.cores) == \
        ("actors", "dense", False, 2.5, 4, "0")
    assert c.resources == (("gpu-box", 1.0),) and c.max_queue == 256  # the server's default
    for bad, needle in (({"runtime": "local"}, "unknown setting.*runtime"),
                        ({"dtpye": "float32"}, "model 'm': unknown setting.*dtpye"),
                        ({"weights": "int3"}, "weights")):
        with pytest.raises(ConfigError, match=needle):
            ServeSettings.from_dict({"models": [{"name": "m", "model": "x", **bad}]})


def test_a_vram_budget_asks_for_the_gpu_where_there_is_one():
    # `powerinfer serve --model X --vram-budget N` (and an entry with vram_budget_gb) on a GPU
    # host needs no --device: a budget only a GPU can use makes the device "auto" (the GPU
    # where there is one, this CPU here); a device named stays, and without a budget it is cpu
    import torch

    from powerinfer.config import Config

    def device(**entry):
        spec, = ServeSettings.from_dict({"models": [{"name": "m", "model": "x", **entry}]}).models
        return spec.config().device

    assert device(vram_budget_gb=2.0) == "auto"
    assert device(vram_budget_gb=2.0, device="cpu") == "cpu"
    assert device() == "cpu" and device(device="cuda") == "cuda"
    resolved = Config(device="auto", vram_budget_gb=2.0).resolve(has_q4=True)
    assert resolved.torch_device.type == ("cuda" if torch.cuda.is_available() else "cpu")


HEAP_BURST = """
import ctypes, sys, time
from serve_app.grpc_host import _trim_heap_after_growth
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "trim":
    _trim_heap_after_growth(every_s=0.1, growth=8 << 20)
    time.sleep(0.3)  # (the process settled)
base = rss()
blocks = [libc.malloc(4000) for _ in range(50000)]  # 200 MB of a burst's small buffers
for b in blocks:
    ctypes.memset(b, 1, 4000)
grown = rss() - base  # (before the frees: the thread may trim as soon as they begin)
for b in blocks[:-1]:  # all freed but the last (the heap's top stays where it is)
    libc.free(b)
time.sleep(1.0)
print(grown >> 20, (rss() - base) >> 20)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc (Linux)")
def test_a_serve_process_gives_a_bursts_freed_heap_back():
    # what a burst of requests leaves in Serve's proxy and the ingress: its buffers freed but
    # resident. The thread the worker hook starts gives them back once the process has grown
    # (and without it they stay: the same run with no thread)
    got = {}
    for mode in ("trim", "none"):
        r = subprocess.run([sys.executable, "-c", HEAP_BURST, mode], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got[mode] = [int(v) for v in r.stdout.split()]  # MiB: the burst, a second after its frees
    assert got["none"][1] > 150, got  # freed, still resident
    assert got["trim"][0] > 150 and got["trim"][1] < 30, got


def test_a_streams_events_are_gathered_once_per_interval():
    # the ingress sends a stream's events on at most once per interval: what arrives meanwhile
    # is joined into the next list, nothing lost or reordered; the first list goes at once (the
    # time to the first token) and so does the one with the last event; an error from the
    # source is raised after what came before it, and a reader that stops early closes it
    import asyncio

    from serve_app.ingress import gathered

    async def source(gaps, fail=False, log=None):
        try:
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)
                last = i == len(gaps) - 1 and not fail
                yield [{"text": str(i), "token": i, "finish_reason": "length" if last else None}]
            if fail:
                raise ValueError("the group failed")
        finally:
            if log is not None:
                log.append("closed")

    async def read(src, interval):
        loop, out = asyncio.get_running_loop(), []
        t0 = loop.time()
        async for batch in gathered(src, interval):
            out.append((loop.time() - t0, [e["token"] for e in batch]))
        return out

    # 30 events 10 ms apart, a 50 ms interval: joined, in order, sent 50 ms apart or more
    got = asyncio.run(read(source([0.01] * 30), 0.05))
    assert [t for _, b in got for t in b] == list(range(30))
    assert len(got) < 30 and max(len(b) for _, b in got) > 1, got
    gaps = [b[0] - a[0] for a, b in zip(got, got[1:-1])]
    assert all(g >= 0.045 for g in gaps), gaps
    # a 1 s interval holds back neither the first event nor the last
    got = asyncio.run(read(source([0.0, 0.3]), 1.0))
    assert [b for _, b in got] == [[0], [1]] and got[0][0] < 0.25 and got[1][0] < 0.9, got
    # interval 0: the source's lists as they come
    got = asyncio.run(read(source([0.001] * 5), 0))
    assert [b for _, b in got] == [[i] for i in range(5)]

    async def failing():
        out = []
        with pytest.raises(ValueError, match="the group failed"):
            async for batch in gathered(source([0.01] * 6, fail=True), 0.05):
                out.extend(e["token"] for e in batch)
        return out
    assert asyncio.run(failing()) == list(range(6))

    async def early(interval):
        log = []
        agen = gathered(source([0.01] * 100, log=log), interval)
        async for _ in agen:
            break
        await agen.aclose()
        return log
    for interval in (0.05, 0):
        assert asyncio.run(early(interval)) == ["closed"], interval



@contextlib.contextmanager
def _health_server(answers: list[list[dict]]):
    """A real HTTP server whose /health gives each of `answers` in turn (the last one again):
    yields (what `_wait_loaded` takes as the front, the paths asked so far)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    asked = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            models = answers[min(len(asked), len(answers) - 1)]
            asked.append(self.path)
            body = json.dumps({"status": "?", "models": models}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield SimpleNamespace(local_url=f"http://127.0.0.1:{httpd.server_port}"), asked
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("down", ["unavailable", "rebuilding"])
def test_the_start_waits_for_a_replica_that_died_as_it_loaded(monkeypatch, down):
    # a model's replica killed as the server starts: /health says the model is not answering
    # (or rebuilding its group) while Serve starts another replica, which loads and is ready.
    # The start waits for it rather than report "no model loaded" and exit; a model that failed
    # to load is final, and one down past UNAVAILABLE_WAIT_S is reported as it is
    from serve_app import server

    def models(a, b=None):  # model "a" (and "b") in these states
        return [{"id": i, "status": st} for i, st in (("a", a), ("b", b)) if st]

    monkeypatch.setattr(server, "LOAD_POLL_S", 0.01)
    with _health_server([models("ready", "loading"), models("ready", down),
                         models("ready", down), models("ready", "loading"),
                         models("ready", "ready")]) as (front, asked):
        assert [s["status"] for s in server._wait_loaded(front)] == ["ready", "ready"]
        assert len(asked) == 5
    with _health_server([models("ready", "failed")]) as (front, asked):
        assert [s["status"] for s in server._wait_loaded(front)] == ["ready", "failed"]
        assert len(asked) == 1
    monkeypatch.setattr(server, "UNAVAILABLE_WAIT_S", 0.3)
    with _health_server([models("ready", down)]) as (front, asked):
        assert [s["status"] for s in server._wait_loaded(front)] == ["ready", down]
        assert len(asked) > 3


def test_a_loopback_server_without_a_key_answers_only_requests_naming_a_local_host():
    # served on 127.0.0.1 with no API key (the default), a request naming another host (a web
    # page's own name pointed at 127.0.0.1: DNS rebinding) is refused; with a key, or served on
    # another address, any name is taken (a reverse proxy in front may pass on its own)
    from types import SimpleNamespace

    from starlette.requests import Request

    from serve_app.errors import ApiError
    from serve_app.ingress import Ingress
    from serve_app.server import Frontend

    check = Ingress.func_or_class._check_host

    def request(host):
        headers = [(b"host", host.encode())] if host is not None else []
        return Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": headers})

    local = SimpleNamespace(local_only=True, api_key=b"")
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"):
        with pytest.raises(ApiError, match="is not this server's") as e:
            check(local, request(host))
        assert e.value.status == 403
    for host in ("localhost:8000", "LOCALHOST", "app.localhost", "127.0.0.1", "127.0.0.1:8000",
                 "[::1]:8000", "10.1.2.3:8000", None):
        check(local, request(host))
    for other in (SimpleNamespace(local_only=True, api_key=b"k"),
                  SimpleNamespace(local_only=False, api_key=b"")):
        check(other, request("proxy.example"))
    assert Frontend("127.0.0.1").loopback and Frontend("localhost").loopback
    assert Frontend("::1").loopback and not Frontend("0.0.0.0").loopback
    assert not Frontend("10.0.0.5").loopback


def test_the_printed_request_names_where_the_key_comes_from(monkeypatch):
    # (it said $POWERINFER_API_KEY for a key given with --api-key: pasted, it got a 401)
    from serve_app.server import Frontend, _curl

    models = [{"name": "a", "model": "x"}]
    monkeypatch.delenv("POWERINFER_API_KEY", raising=False)
    given = _curl(Frontend(), ServeSettings.from_dict({"models": models, "api_key": "s3"}), "a")
    assert 'Bearer KEY"' in given and "KEY: the server's API key" in given and "s3" not in given
    monkeypatch.setenv("POWERINFER_API_KEY", "s3")
    env = _curl(Frontend(), ServeSettings.from_dict({"models": models}), "a")
    assert 'Bearer $POWERINFER_API_KEY"' in env and "s3" not in env
    monkeypatch.delenv("POWERINFER_API_KEY")
    assert "Authorization" not in _curl(Frontend(), ServeSettings.from_dict({"models": models}),
                                        "a")
