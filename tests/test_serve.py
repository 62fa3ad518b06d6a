"""The server as its users meet it: `powerinfer serve` started as a process with several models
from one config (the default model, Gemma 3, a small synthetic one, a synthetic one with two
replicas on disjoint cores (4-bit, its inputs sparse by its bundle), and a corrupt file), driven
by the official `openai` client, a gRPC client built from the generated stubs, raw HTTP, and a
fuzzer; faults are real (an actor process killed mid-stream, a client hanging up), and so is the
security check (a process without Ray's token is refused by the cluster's GCS).

The tests run in file order: the fault tests rebuild actor groups, the last one stops the
server with SIGTERM while a stream runs (which its drain time ends with an error event) and
checks that nothing is left behind.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
import torch
import yaml

from powerinfer import Config, PowerInfer
from powerinfer.compat import LOOPBACK_SWITCH, loopback_node
from powerinfer.sparsity.synthetic import write_synthetic
from serve_app.server import free_port
from conftest import FLOAT32_INT4

SMOL, TINY, BROKEN, GEMMA, TWIN = "smollm2", "tiny", "broken", "gemma3", "twin"
# Gemma 3 with its defaults (its K-quants in the kernel's blocks, bf16 activations), as a user
# serves it
GEMMA_CONFIG = {"max_seq_len": 512, "max_batch": 4, "cpu_threads": 1}
KEY = "test-key-5d1f0c"
MAX_BODY = 65536
APP = "powerinfer"
DRAIN_S = 2.0  # the server's --drain-timeout: its stop ends the responses in flight after this
POWERINFER = Path(sys.executable).with_name("powerinfer")


def ray_pids() -> set[int]:
    """Processes of any Ray instance on this machine."""
    out = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if any(k in cmd for k in ("raylet", "gcs_server", "ray::", "ray/dashboard",
                                      "ray/_private")):
                out.add(int(p.name))
    return out


def environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment as it started (OSError where it is gone)."""
    return dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes()
                .split(b"\0") if b"=" in kv)


class Server:
    def __init__(self, proc, port, grpc_port, log: Path):
        self.proc, self.log = proc, log
        self.url = f"http://127.0.0.1:{port}"
        self.port, self.grpc_port = port, grpc_port
        self.http = httpx.Client(base_url=self.url, timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"})
        from powerinfer.v1 import inference_pb2, inference_pb2_grpc
        self.pb = inference_pb2
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.md = [("authorization", f"Bearer {KEY}")]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_healthy(self, timeout=240):
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = httpx.get(self.url + "/health", timeout=10)
            if r.status_code == 200:
                return r.json()
            time.sleep(0.5)
        raise AssertionError(f"not healthy: {r.text}")

    def model_stats(self, name: str) -> dict:
        from ray import serve
        return serve.get_deployment_handle(f"Model:{name}", app_name=APP).stats.remote().result(
            timeout_s=60)


def join_servers_ray(log: Path, proc: subprocess.Popen):
    """Join the Ray instance the server logged it started (with this user's token: allowed);
    where that fails, stop the server (a fixture that raises has no teardown to do it).
    Not `address="auto"`: that joins whichever GCS Ray finds named in a process's command line
    on the machine (any of several, where another instance's processes are still about), not
    necessarily this server's."""
    import ray
    try:
        gcs = re.search(r"^Ray: a local instance at (\S+) ", log.read_text(errors="replace"), re.M)
        assert gcs, log.read_text(errors="replace")[-3000:]
        ray.shutdown()  # another module's local instance, if any
        # the server's instance asks for Ray's token: a client has to be in token mode too (Ray
        # reads the mode once, at import; reloaded as in powerinfer.compat.ray_init)
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import Config as RayConfig
        RayConfig.initialize("")
        with loopback_node():  # (the instance listens on 127.0.0.1 only)
            ray.init(address=gcs[1], logging_level="warning")
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        raise
    # Serve caches its controller client by job id, which repeats across the clusters one
    # process joins in turn (each server here is a new cluster): forget the last one's
    from ray.serve.context import _disconnect
    _disconnect()


def installed_gemma() -> Path | None:
    """Gemma 3 270M's file, or None where its packages are not installed (the server then runs
    without it, and only the checks that ask it something skip)."""
    from powerinfer.errors import ModelNotFoundError
    from powerinfer.formats.loader import resolve_model
    try:
        return resolve_model("gemma3-270m")
    except ModelNotFoundError:
        return None


def need_gemma(server):
    if GEMMA not in server.models:
        pytest.skip("Gemma 3 270M not installed (its packages: see the Makefile's setup)")


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    gemma_model_path = installed_gemma()
    d = tmp_path_factory.mktemp("serve")
    write_synthetic(d / "tiny.gguf", preset="tiny", seed=0)
    (d / "broken.gguf").write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64)
    config = d / "models.yaml"
    # each model's group on its own cores, as `powerinfer plan` lays a host out
    cores = sorted(os.sched_getaffinity(0))
    smol_cores, tiny_cores = (cores[:1], cores[1:]) if len(cores) > 1 else (cores, cores)
    cpulist = lambda cs: ",".join(map(str, cs))  # noqa: E731
    models = [
        # (a cold executor of its own, named: the fault tests kill it; the other models' entries
        # leave it open, and on their shared cores each runs as one executor)
        {"name": SMOL, "model": str(default_model_path), "max_seq_len": 512, "max_batch": 8,
         "max_queue": 8, "cpu_threads": 1, **FLOAT32_INT4, "cores": cpulist(smol_cores),
         "cold_executors": 1},
        {"name": TINY, "model": str(d / "tiny.gguf"), "max_seq_len": 512, "max_batch": 2,
         "max_queue": 1, "cores": cpulist(tiny_cores)},
        {"name": BROKEN, "model": str(d / "broken.gguf")}]
    if gemma_model_path is not None:  # a second real family beside SmolLM2, on the synthetic
        models.append({"name": GEMMA, "model": str(gemma_model_path),  # model's cores
                       **GEMMA_CONFIG, "cores": cpulist(tiny_cores)})
    if len(cores) > 1:  # a model with two replicas: two groups, each on its slice of two cores
        # (4-bit, with input sparsity from its bundle on every projection: the server's
        # POWERINFER_INPUT_SPARSE_MIN_ROWS below takes the tiny ones too)
        from powerinfer.sparsity.input_sparsity import calibrate_bundle
        write_synthetic(d / "twin.gguf", preset="tiny", seed=1, quant="q4_0", progress=False)
        calibrate_bundle(str(d / "twin.gguf"), str(d / "twin.bundle"), 0.25, tokens=512,
                         held_out=256, window=128, progress=False)
        # (a cold executor each, named: their input-sparse projections and their pinning are
        # tested across processes)
        models.append({"name": TWIN, "model": str(d / "twin.gguf"), "max_seq_len": 512,
                       "max_batch": 2, "replicas": 2, "cores": cpulist(cores[:2]),
                       "input_sparsity": str(d / "twin.bundle"), "cold_executors": 1})
    config.write_text(yaml.safe_dump({"max_body_bytes": MAX_BODY, "models": models}))
    port, grpc_port = free_port(), free_port()
    log = d / "server.log"
    before = ray_pids()
    started = time.monotonic()
    proc = subprocess.Popen([str(POWERINFER), "serve", "--config", str(config), "--port", str(port),
                             "--grpc-port", str(grpc_port), "--api-key", KEY,
                             "--drain-timeout", str(DRAIN_S)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "POWERINFER_INPUT_SPARSE_MIN_ROWS": "0"})
    s = Server(proc, port, grpc_port, log)
    s.ray_before = before
    s.cores = {SMOL: set(smol_cores), TINY: set(tiny_cores), GEMMA: set(tiny_cores),
               TWIN: set(cores[:2])}
    s.models = [m["name"] for m in models]
    # the models the server runs as one executor each (their entries leave it open and their
    # groups would have more executors than their shared cores: `settings.share_cores`)
    from serve_app.settings import ServeSettings
    s.one_executor = {m.name for m in ServeSettings.from_dict({"models": models}).models
                      if m.chosen}
    deadline = time.time() + 300
    while "HTTP (OpenAI API)" not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"the server exited:\n{s.tail()}"
        assert time.time() < deadline, f"the server did not start:\n{s.tail()}"
        time.sleep(0.5)
    s.start_s = time.monotonic() - started
    join_servers_ray(log, proc)
    yield s
    import ray
    ray.shutdown()
    s.channel.close()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


@pytest.fixture(scope="module")
def local_smol(default_model_path):
    threads = torch.get_num_threads()
    pi = PowerInfer.from_pretrained(default_model_path,
                                    Config(**FLOAT32_INT4, max_seq_len=512, cpu_threads=1))
    yield pi
    torch.set_num_threads(threads)


# (the served SmolLM2's group shares one core: its hot executor holds every neuron and head and
# computes the in-process engine's floats, prompts included, so its greedy text is the engine's;
# Germany's capital, as test_generation's, is "Berlin" in every configuration tried, where
# France's first two choices lie 0.08 apart)
QUESTION = [{"role": "user", "content": "What is the capital of Germany?"}]


def sse(text: str) -> list[str]:
    events = text.split("\n\n")
    assert events[-1] == "", repr(text[-100:])
    assert all(e.startswith("data: ") for e in events[:-1]), text[:500]
    return [e[len("data: "):] for e in events[:-1]]


def assert_error(r, status: int, *needles: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert "Traceback" not in r.text and 'File "' not in r.text
    for n in needles:
        assert n in err["message"], err
    return err


# ------------------------------------------------------------------------------ the happy path

def test_startup_reports_every_model(server, default_model_path):
    out = server.tail()
    ready = [m for m in server.models if m != BROKEN]
    assert all(f"{m}: ready" in out for m in ready), out
    assert f"{BROKEN}: failed" in out and "cannot load model" in out
    # its error said once, by name: not again as Ray's unhandled error with a traceback
    assert "Unhandled error" not in server.log.read_text(errors="replace"), server.tail()
    health = server.wait_healthy()
    assert health["status"] == "degraded"  # the broken model is reported; the others serve
    states = {m["id"]: m["status"] for m in health["models"]}
    assert states == {**{m: "ready" for m in ready}, BROKEN: "failed"}
    assert_memory_is_reported(server.log.read_text(errors="replace"), ready, server.one_executor,
                              default_model_path.stat().st_size / 2**30)
    # a line every 15 s while the models load (a first start said nothing for a minute)
    if server.start_s > 20:
        assert re.search(r"^  (loading [\w, -]+|starting the models' replicas): \d+ s$",
                         server.log.read_text(errors="replace"), re.M), server.tail()


def assert_memory_is_reported(out: str, ready: list[str], one: set[str], smol_file_gib: float):
    # once ready, each model's host memory (its processes' PSS now, and with its KV cache full:
    # the weights and the KV cache they hold, each process's own) and the host's total, which
    # holds every model's
    lines = out.splitlines()
    costs, parts = {}, {}
    for m in ready:
        at = lines.index(f"  {m}: ready, context 512")
        per = " a replica (2 replicas)" if m == TWIN else ""  # (the host counts both)
        got = re.fullmatch(rf"    memory{re.escape(per)}: ([\d.]+) GiB now "
                           r"\(PSS of its (\d+) processes\), "
                           r"([\d.]+) with its KV cache full: weights ([\d.]+), KV cache "
                           r"([\d.]+) in use of ([\d.]+), each process's own (.+)", lines[at + 1])
        assert got, lines[at:at + 2]  # (the two lines in one write: nothing between them)
        now, n, full, weights, kv_now, kv = float(got[1]), int(got[2]), *map(float, got.groups()[2:6])
        own = {k: float(v) for k, v in (part.split(" ") for part in got[7].split(", "))}
        roles = {"hot", "scheduler", "replica"} | (set() if m in one else {"cold.0"})
        assert set(own) == roles and len(own) == n, own
        assert kv_now <= kv and full == pytest.approx(now - kv_now + kv, abs=0.02)
        # every role costs something of its own but a torch-free hot executor, whose weights
        # count a tensor read in the model file's pages whole, as mapped, where only the rows
        # read are resident (Gemma 3's embedding: its own cost then about 0 or below)
        assert weights < now and all(0 < v < 1.5 for r, v in own.items() if r != "hot"), \
            lines[at + 1]
        assert -0.25 < own["hot"] < 1.5, lines[at + 1]
        # the scheduler holds no weights and imports no torch: its own cost is Python, Ray's
        # worker and the tokenizer (Gemma 3's was 0.34 GiB while the tokenizer's freed parse
        # buffers stayed resident, 0.17 since they are given back)
        assert own["scheduler"] < 0.25, lines[at + 1]
        # nor does the replica (it tokenizes and supervises: 0.25-0.35 GiB while it imported
        # torch to decide its group itself)
        assert own["replica"] < 0.25, lines[at + 1]
        costs[m], parts[m] = now * (2 if per else 1), (weights, kv)
    # SmolLM2 over its file's 4-bit blocks holds about the file (0.09 GiB; an 8-bit head beside
    # them), and a KV pool of 0.18 GiB (4,160 positions of 30 layers' 3 KV heads of 64 floats,
    # twice), as its load logged it
    smol_kv = re.search(rf"{SMOL} \S+ -- KV cache: .*?, ([\d.]+) GiB", out)
    assert 0.8 * smol_file_gib < parts[SMOL][0] < 2 * smol_file_gib and smol_kv, \
        (parts, out[-3000:])
    assert abs(parts[SMOL][1] - float(smol_kv[1])) <= 0.02, (parts, smol_kv[0])
    host = re.search(r"  host: ([\d.]+) GiB in (\d+) processes \(PSS\): the models ([\d.]+), "
                     r"Ray, Serve and this process ([\d.]+)", out)
    assert host, out[-3000:]
    # each model's figure is rounded to 0.01 GiB (a twin's counted twice), the host's sum of the
    # unrounded ones once more
    rounding = 0.005 * (sum(2 if m == TWIN else 1 for m in ready) + 1) + 1e-9
    assert float(host[3]) == pytest.approx(sum(costs.values()), abs=rounding)
    assert float(host[1]) > float(host[3]) and int(host[2]) >= 4 * len(ready)



def allowed_cores(pid: int) -> set[int]:
    from cluster.topology import parse_cpulist
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return set(parse_cpulist(line.split(":", 1)[1]))
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def test_each_models_executors_run_on_its_own_cores(server):
    pinned = {}
    for name in (m for m in server.models if m != BROKEN):
        pids = server.model_stats(name)["pids"]
        executors = {k: allowed_cores(p) for k, p in pids.items() if k in ("hot", "predictor")
                     or k.startswith("cold")}
        assert executors and all(c <= server.cores[name] for c in executors.values()), executors
        pinned[name] = set().union(*executors.values())
    if server.cores[SMOL] != server.cores[TINY]:  # more than one core here
        assert not pinned[SMOL] & pinned[TINY], pinned


def test_models_on_shared_cores_run_as_one_executor_each(server):
    # the server said at start which models it runs as one executor with the whole model and
    # why (their groups would have had more executors than cores: `settings.share_cores`), and
    # their groups hold no cold executor, while the model whose entry asks for one has it. On a
    # host of up to 4 cores the tiny model's are shared by at least 3 groups, and are chosen
    out = server.log.read_text(errors="replace")
    if len(os.sched_getaffinity(0)) <= 4:
        assert TINY in server.one_executor and SMOL not in server.one_executor
    for name in (m for m in server.models if m != BROKEN):
        roles = set(server.model_stats(name)["pids"])
        said = re.search(rf"^{name}: one executor with the whole model, \d+ threads? \((\d+ "
                         rf"groups share|its group has) \d+ cores? \([\d,-]+\); a models "
                         rf"file's cold_executors, or --cold-executors with --model, "
                         rf"chooses\)$", out, re.M)
        if name in server.one_executor:
            assert said and not any(r.startswith("cold") for r in roles), (name, roles)
            # once: the replica, whose log Ray forwards to the server's console, does not repeat it
            assert out.count(f"{name}: one executor with the whole model") == 1, name
        else:
            assert not said and "cold.0" in roles, (name, roles)


def test_two_replicas_hold_two_groups_on_disjoint_cores_and_share_the_load(server):
    # a model with two Serve replicas on one host: two actor groups, each on its slice of the
    # model's cores, with requests spread over both (each group's own counters)
    if TWIN not in server.models:
        pytest.skip("two replicas on disjoint cores need two cores")

    def one(i):
        r = server.http.post("/v1/completions", json={"model": TWIN, "prompt": f"hello {i}",
                                                       "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(24)))
    seen = {}
    for _ in range(60):  # each call reaches one replica; collect both
        st = server.model_stats(TWIN)
        seen[st["replica"]] = st
        if len(seen) == 2:
            break
    assert sorted(seen) == [0, 1], seen
    pinned = []
    for st in seen.values():
        assert st["requests"] > 0, seen  # each group served some of the requests
        pinned.append(set().union(*(allowed_cores(p) for k, p in st["pids"].items()
                                    if k == "hot" or k.startswith("cold"))))
    assert not pinned[0] & pinned[1] and pinned[0] | pinned[1] <= server.cores[TWIN], pinned
    assert seen[0]["pids"]["scheduler"] != seen[1]["pids"]["scheduler"]

def test_each_requests_input_sparsity_reaches_the_metrics(server):
    # the twin model serves with its bundle's input sparsity: each request's decode steps read
    # only the input channels over the thresholds, and /metrics observes the share they skipped
    # once a request (whichever replica served it), about the bundle's 25%
    if TWIN not in server.models:
        pytest.skip("the two-replica model needs two cores")
    from prometheus_client.parser import text_string_to_metric_families
    name = "powerinfer:input_sparsity_realised"

    def scrape() -> dict:
        text = httpx.get(server.url + "/metrics").text
        return {s.name: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name.startswith(name)
                and s.labels.get("model_name") == TWIN and "le" not in s.labels}

    before = scrape()
    for i in range(4):
        r = server.http.post("/v1/completions", json={"model": TWIN, "prompt": f"a story {i}",
                                                       "max_tokens": 8, "temperature": 0,
                                                       "ignore_eos": True})
        assert r.status_code == 200, r.text
    assert wait_for(lambda: scrape().get(name + "_count", 0) >= before.get(name + "_count", 0) + 4,
                    timeout=30), scrape()
    after = scrape()
    n = after[name + "_count"] - before.get(name + "_count", 0)
    share = (after[name + "_sum"] - before.get(name + "_sum", 0)) / n
    assert n == 4 and 0.1 < share < 0.5, (n, share)


def test_openai_client_chat_and_completions(server, local_smol):
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    want = local_smol.chat(QUESTION, max_new_tokens=16, temperature=0)

    r = client.chat.completions.create(model=SMOL, messages=QUESTION, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want  # the engine's own greedy output
    prompt = local_smol.tokenize(local_smol.tokenizer.apply_chat_template(QUESTION))
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")

    chunks = list(client.chat.completions.create(
        model=SMOL, messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == r.usage.prompt_tokens
    assert usage.completion_tokens == r.usage.completion_tokens
    # the same prompt again: its whole blocks (16 tokens each) but the last token come from the
    # prefix cache, and the answer is the same
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == (len(prompt) - 1) // 16 * 16 > 0, usage

    c = client.completions.create(model=SMOL, prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    full = c.choices[0].text
    assert "Paris" in full and c.usage.completion_tokens == 12
    stopped = client.completions.create(model=SMOL, prompt="The capital of France is",
                                        max_tokens=12, temperature=0, stop=["Paris"])
    assert stopped.choices[0].text == full.split("Paris")[0]
    assert stopped.choices[0].finish_reason == "stop"
    # OpenAI's presence and frequency penalties (they were refused): the engine's own output
    # with them, which they change
    said = "I like cats. I like cats. I like"  # (it goes on "I'm a cat. I'm a cat. ...")
    for kw in ({"presence_penalty": 1.5}, {"frequency_penalty": 0.8}):
        got = client.completions.create(model=SMOL, prompt=said, max_tokens=24, temperature=0,
                                        **kw).choices[0].text
        assert got == local_smol.generate(said, max_new_tokens=24, temperature=0, **kw)
        assert got != local_smol.generate(said, max_new_tokens=24, temperature=0)


def test_a_prefill_is_continued_with_continue_final_message(server):
    """vLLM's continue_final_message: the reply goes on from the assistant's last message; the
    prompt is the one /tokenize gives for it, which a completion of those tokens continues
    alike (by default the template closes that message and opens a new turn)."""
    h = server.http
    prefill = QUESTION + [{"role": "assistant", "content": "The capital of Germany is"}]
    ids = h.post("/tokenize", json={"model": SMOL, "messages": prefill,
                                    "continue_final_message": True}).json()["tokens"]
    closed = h.post("/tokenize", json={"model": SMOL, "messages": prefill}).json()["tokens"]
    assert len(closed) > len(ids) and closed[:len(ids) - 1] == ids[:-1]
    r = h.post("/v1/chat/completions", json={"model": SMOL, "messages": prefill, "max_tokens": 6,
                                             "temperature": 0, "continue_final_message": True,
                                             "add_generation_prompt": False}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    same = h.post("/v1/completions", json={"model": SMOL, "prompt": ids, "max_tokens": 6,
                                           "temperature": 0}).json()
    assert r["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    assert not r["choices"][0]["message"]["content"].lstrip().startswith("The capital")
    for extra, needle in (({"messages": QUESTION, "continue_final_message": True},
                           "the last message must be the assistant's"),
                          ({"messages": prefill, "continue_final_message": True,
                            "add_generation_prompt": True}, "add_generation_prompt must be false"),
                          ({"messages": QUESTION, "add_generation_prompt": False},
                           "leaves no turn")):
        assert_error(h.post("/v1/chat/completions", json={"model": SMOL, "max_tokens": 2, **extra}),
                     400, needle)


def test_seeds_reproduce_and_n_choices(server):
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    # the engine's own fields; every choice its 10 tokens (a draw of the end-of-generation
    # token would end one early, and the usage's sum would depend on the draws)
    ask = dict(model=SMOL, prompt="My favourite animal is", max_tokens=10, temperature=1.0,
               top_p=1.0, extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True})
    texts = [client.completions.create(seed=s, **ask).choices[0].text for s in (1, 1, 2, 3)]
    assert texts[0] == texts[1]
    assert len(set(texts[1:])) > 1
    one = client.completions.create(seed=1, **ask)
    two = client.completions.create(seed=1, n=2, **ask)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # a prompt counts once
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.choices[0].text == texts[0]  # choice i samples with seed + i
    assert two.choices[1].text == texts[2]


def test_logprobs(server):
    r = server.http.post("/v1/chat/completions", json={
        "model": SMOL, "messages": QUESTION, "max_tokens": 5, "temperature": 0,
        "logprobs": True, "top_logprobs": 3}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 5
    for t in content:
        top = t["top_logprobs"]
        assert len(top) == 3 and top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert abs(t["logprob"] - top[0]["logprob"]) < 1e-5  # greedy took the likeliest
        assert t["logprob"] <= 0
        assert bytes(t["bytes"]).decode(errors="replace") == t["token"]  # (U+FFFD: a part)
    assert "".join(t["token"] for t in content) == r["choices"][0]["message"]["content"]
    # each token's bytes, its part of a character that takes several (not U+FFFD's)
    assert b"".join(bytes(t["bytes"]) for t in content).decode() == \
        r["choices"][0]["message"]["content"]
    c = server.http.post("/v1/completions", json={
        "model": SMOL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
        "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert len(c["tokens"]) == len(c["token_logprobs"]) == len(c["top_logprobs"]) == 4
    assert c["text_offset"][0] == 0 and all(len(d) == 2 for d in c["top_logprobs"])


def test_sse_framing(server):
    r = server.http.post("/v1/chat/completions", json={
        "model": SMOL, "messages": QUESTION, "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"

    r = server.http.post("/v1/completions", json={
        "model": TINY, "prompt": "hello", "max_tokens": 5, "stream": True, "n": 2})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_grpc_matches_http(server):
    pb, stub, md = server.pb, server.stub, server.md
    greedy = pb.SamplingParams(max_tokens=12, temperature=0)
    out = list(stub.Generate(pb.GenerateRequest(model=SMOL, text="The capital of France is",
                                                sampling=greedy), metadata=md))
    http = server.http.post("/v1/completions", json={
        "model": SMOL, "prompt": "The capital of France is", "max_tokens": 12,
        "temperature": 0}).json()
    assert "".join(o.text for o in out) == http["choices"][0]["text"]
    last = out[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 12 == sum(len(o.tokens) for o in out)
    assert last.usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert 0 < last.timings.time_to_first_token_s <= last.timings.total_s
    assert last.timings.queue_s >= 0

    chat = list(stub.Chat(pb.ChatRequest(model=SMOL, messages=[pb.ChatMessage(
        role="user", content=QUESTION[0]["content"])], sampling=greedy), metadata=md))
    http_chat = server.http.post("/v1/chat/completions", json={
        "model": SMOL, "messages": QUESTION, "max_tokens": 12, "temperature": 0}).json()
    assert "".join(o.text for o in chat) == http_chat["choices"][0]["message"]["content"]

    ids = stub.Tokenize(pb.TokenizeRequest(model=SMOL, text="hello world"), metadata=md)
    tok = server.http.post("/tokenize", json={"model": SMOL, "prompt": "hello world"}).json()
    assert list(ids.token_ids) == tok["tokens"] and ids.max_model_len == tok["max_model_len"] == 512
    text = stub.Detokenize(pb.DetokenizeRequest(model=SMOL, token_ids=ids.token_ids), metadata=md)
    assert text.text == "hello world"
    assert server.http.post("/detokenize", json={"model": SMOL, "tokens": tok["tokens"]}
                            ).json() == {"prompt": "hello world"}
    by_id = list(stub.Generate(pb.GenerateRequest(
        model=SMOL, token_ids=pb.TokenIds(ids=ids.token_ids), sampling=greedy), metadata=md))
    assert by_id[-1].usage.prompt_tokens == len(ids.token_ids)

    models = {m.id: m for m in stub.ListModels(pb.ListModelsRequest(), metadata=md).models}
    assert set(models) == set(server.models)
    assert models[BROKEN].status == "failed" and "cannot load model" in models[BROKEN].error
    http_models = server.http.get("/v1/models").json()["data"]
    assert {m["id"]: m["status"] for m in http_models} == {m: models[m].status for m in models}
    assert stub.Health(pb.HealthRequest()).ok  # no key needed


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def test_structured_output_batched_with_free_text(server, local_smol):
    import jsonschema
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    free_want = local_smol.chat(QUESTION, max_new_tokens=16, temperature=0)
    calls = {  # sent together: the scheduler batches them, constrained rows beside a free one
        "greedy": lambda: client.chat.completions.create(
            model=SMOL, messages=ASK_PERSON, max_tokens=60, temperature=0,
            response_format=schema_format).choices[0].message.content,
        "sampled": lambda: "".join(c.choices[0].delta.content or "" for c in
                                   client.chat.completions.create(
            model=SMOL, messages=ASK_PERSON, max_tokens=60, temperature=1.0, seed=7, stream=True,
            extra_body={"guided_json": PERSON, "top_k": 0, "min_p": 0.0}) if c.choices),
        "regex": lambda: client.completions.create(
            model=SMOL, prompt="My phone number is", max_tokens=20, temperature=1.0, seed=3,
            extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"}).choices[0].text,
        "free": lambda: client.chat.completions.create(
            model=SMOL, messages=QUESTION, max_tokens=16, temperature=0).choices[0].message.content,
    }
    threads, out = [], {}
    for k, f in calls.items():
        threads.append(threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f())))
        threads[-1].start()
    for t in threads:
        t.join(timeout=120)
    for k in ("greedy", "sampled"):
        jsonschema.validate(json.loads(out[k]), PERSON)
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", out["regex"]), out["regex"]
    assert out["free"] == free_want  # untouched by its constrained neighbours
    # over gRPC, and a choice list
    pb = server.pb
    got = list(server.stub.Chat(pb.ChatRequest(model=SMOL, messages=[pb.ChatMessage(
        role="user", content=ASK_PERSON[0]["content"])], sampling=pb.SamplingParams(
        max_tokens=60, temperature=0, json_schema=json.dumps(PERSON))), metadata=server.md))
    assert json.loads("".join(o.text for o in got)) == json.loads(out["greedy"])
    need_gemma(server)  # (the rest asks the second family)
    got = list(server.stub.Generate(pb.GenerateRequest(model=GEMMA, text="Is water wet? Answer:",
                                                       sampling=pb.SamplingParams(
        max_tokens=8, temperature=1.0, seed=1, choice=pb.Choices(choices=["yes", "no"]))),
        metadata=server.md))
    assert "".join(o.text for o in got) in ("yes", "no")
    assert got[-1].finish_reason == pb.FINISH_REASON_STOP
    # what the engine cannot hold the output to is a 400 (and INVALID_ARGUMENT) naming it
    for extra, needle in (({"guided_regex": "a(b"}, "unclosed group"),
                          ({"response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "strict": True, "schema": {
                                  "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
                          ({"guided_choice": ["a"], "guided_regex": "a"}, "at most one")):
        r = server.http.post("/v1/chat/completions", json={"model": SMOL, "messages": QUESTION,
                                                          "max_tokens": 4, **extra})
        assert_error(r, 400, needle)
    # a json_schema format without its (optional) schema: any JSON (its default was refused)
    r = server.http.post("/v1/chat/completions", json={
        "model": SMOL, "messages": ASK_PERSON, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert r.status_code == 200, r.text
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(pb.GenerateRequest(model=SMOL, text="x", sampling=pb.SamplingParams(
            json_schema="{not json")), metadata=server.md))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid JSON" in e.value.details()


def test_the_ingress_the_replicas_and_the_schedulers_run_without_torch(server):
    # the ingress (HTTP and gRPC, streams read from the schedulers' token rings, structured
    # output checked, choices merged) loads nothing of the engine: after the requests above,
    # with a schema, streamed and over gRPC, no ingress process has torch's library mapped
    # (about 0.15 GiB of a process's own memory); nor does a model's replica (it tokenizes and
    # supervises its group: what the group is built from is decided in a one-off task,
    # `actors.prepare`), nor any model's scheduler (batching, sampling and grammar masks in
    # numpy); nor SmolLM2's executors, whose native loops run every step (its hot executor
    # keeps every head beside a cold executor on the same core: their exchanges in the loop)
    for name in (SMOL, TINY):
        pids = server.model_stats(name)["pids"]
        assert "libtorch" not in Path(f"/proc/{pids['scheduler']}/maps").read_text(), name
    smol = server.model_stats(SMOL)["pids"]
    for role in ("hot", "cold.0"):
        assert "libtorch" not in Path(f"/proc/{smol[role]}/maps").read_text(), role
    assert "libtorch" in Path("/proc/self/maps").read_text()  # (where it is mapped, it is found)
    ingress, replicas = [], []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"ServeReplica:powerinfer:Ingress" in cmd:
            ingress.append(p)
        elif b"ServeReplica:powerinfer:Model:" in cmd:
            replicas.append(p)
    assert ingress and len(replicas) >= 2, (ingress, replicas)
    for p in ingress + replicas:
        assert "libtorch" not in (p / "maps").read_text(), p


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}}}}]


def test_a_two_step_tool_conversation_with_the_openai_client(server):
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model=SMOL, tools=WEATHER, max_tokens=60, temperature=0)
    r = client.chat.completions.create(messages=messages, tool_choice="required", **ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call, = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and set(args) <= {"city", "unit"}
    # streamed: the client assembles the same call from the deltas
    with client.chat.completions.stream(messages=messages, tool_choice="required", **ask) as s:
        final = s.get_final_completion()
    streamed, = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == \
        (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    # cut at max_tokens inside the call: the call as far as it was written, its arguments a
    # prefix of the whole call's (the raw markup went out as content), streamed alike
    cuts = []
    n = r.usage.completion_tokens
    for k in sorted({max(k, 5) for k in (n - 1, n - 6, n - 10, n // 2)}, reverse=True):
        c = client.chat.completions.create(messages=messages, tool_choice="required",
                                           **{**ask, "max_tokens": k}).choices[0]
        assert c.finish_reason == "length" and "<tool_call>" not in (c.message.content or "")
        for t in c.message.tool_calls or ():
            assert t.function.name == "get_weather"
            assert call.function.arguments.startswith(t.function.arguments), t.function
            cuts.append((k, t.function.arguments))
    k, cut = next((k, a) for k, a in cuts if a and a != call.function.arguments)
    chunks = [ch.choices[0] for ch in client.chat.completions.create(
        messages=messages, tool_choice="required", stream=True, **{**ask, "max_tokens": k})]
    assert chunks[-1].finish_reason == "length"
    assert "".join(t.function.arguments or "" for ch in chunks
                   for t in ch.delta.tool_calls or ()) == cut
    assert "<tool_call>" not in "".join(ch.delta.content or "" for ch in chunks)
    # the tool's result goes back; the model answers from it
    result = json.dumps({"city": args["city"], "temperature_celsius": 18, "sky": "cloudy"})
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    r2 = client.chat.completions.create(messages=messages, tool_choice="none", **ask)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    count = lambda **kw: server.http.post("/tokenize", json={"model": SMOL, **kw}).json()["count"]  # noqa: E731
    # the prompt holds the question, the call and its result (tool_choice none: no tool list)
    assert r2.usage.prompt_tokens > count(messages=messages[:1]) + count(prompt=result) + \
        count(prompt=call.function.arguments)
    # /tokenize renders a tool conversation as the chat does (it left the call and the tools out)
    assert count(messages=messages, tools=WEATHER, tool_choice="none") == r2.usage.prompt_tokens
    assert count(messages=messages[:1], tools=WEATHER) == r.usage.prompt_tokens
    # a named function is called once (its grammar let the model call it again and again)
    for _ in range(2):
        one = client.chat.completions.create(
            messages=messages[:1], tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}},
            **{**ask, "temperature": 1.0, "max_tokens": 120})
        assert len(one.choices[0].message.tool_calls) == 1, one.choices[0].message
    # a named function on the second family, which writes calls as Python
    need_gemma(server)
    g = client.chat.completions.create(
        model=GEMMA, messages=messages[:1], tools=WEATHER, max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    gcall, = g.choices[0].message.tool_calls
    assert gcall.function.name == "get_weather"
    assert isinstance(json.loads(gcall.function.arguments)["city"], str)
    bad = server.http.post("/v1/chat/completions", json={
        "model": SMOL, "messages": messages[:1], "tools": WEATHER,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert_error(bad, 400, "nope")


HEALTH_CLIENT = """
import sys, grpc
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(sys.argv[1]))
for service in ("", "powerinfer.v1.Inference", "smollm2", "broken"):
    print(service or "-", h.HealthCheckResponse.ServingStatus.Name(stub.Check(
        h.HealthCheckRequest(service=service), timeout=30).status))
try:
    stub.Check(h.HealthCheckRequest(service="nope"), timeout=30)
except grpc.RpcError as e:
    print("nope", e.code().name)
watch = stub.Watch(h.HealthCheckRequest(service="tiny"), timeout=30)
print("watch", h.HealthCheckResponse.ServingStatus.Name(next(watch).status))
watch.cancel()
"""
REFLECTION_CLIENT = """
import sys, grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)
db = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(sys.argv[1]))
print(" ".join(sorted(db.get_services())))
service = db.FindFileContainingSymbol("powerinfer.v1.Inference")
print(" ".join(m.name for m in service.service[0].method))
"""


STUB_CLIENT = """
import json, sys, grpc
from powerinfer.v1 import inference_pb2 as pb, inference_pb2_grpc
stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(sys.argv[1]))
out = list(stub.Generate(pb.GenerateRequest(
    model="smollm2", text="The capital of France is",
    sampling=pb.SamplingParams(max_tokens=8, temperature=0)),
    metadata=[("authorization", "Bearer " + sys.argv[2])]))
print(len(out), out[-1].usage.completion_tokens)
print(json.dumps("".join(o.text for o in out)))
"""


def grpc_client(server, script: str, *args: str, cwd=None) -> list[str]:
    """A client in a process of its own; with cwd, outside the repository and its path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script, f"127.0.0.1:{server.grpc_port}", *args],
                         capture_output=True, text=True, timeout=120, cwd=cwd, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_the_installed_stubs_stream_from_outside_the_repository(server, tmp_path):
    counts, text = grpc_client(server, STUB_CLIENT, KEY, cwd=tmp_path)
    responses, tokens = map(int, counts.split())
    text = json.loads(text)
    assert responses > 1 and tokens == 8  # streamed, not one message
    http = server.http.post("/v1/completions", json={
        "model": SMOL, "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0}).json()
    assert text == http["choices"][0]["text"]


def test_standard_grpc_health_and_reflection_from_other_processes(server):
    """What a Kubernetes gRPC probe and grpcurl do: no key, no stubs of ours."""
    assert grpc_client(server, HEALTH_CLIENT) == ["- SERVING", "powerinfer.v1.Inference SERVING",
                                     "smollm2 SERVING", "broken NOT_SERVING", "nope NOT_FOUND",
                                     "watch SERVING"]
    services, methods = grpc_client(server, REFLECTION_CLIENT)
    assert {"powerinfer.v1.Inference", "grpc.health.v1.Health"} <= set(services.split())
    assert {"Generate", "Chat", "ListModels"} <= set(methods.split())


def test_two_models_at_once(server):
    def ask(model):
        return server.http.post("/v1/completions", json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        ).json()["choices"][0]["text"]

    alone = {m: ask(m) for m in (SMOL, TINY)}
    results, threads = [], []
    for m in [SMOL, TINY] * 3:
        threads.append(threading.Thread(target=lambda m=m: results.append((m, ask(m)))))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == sorted((m, alone[m]) for m in [SMOL, TINY] * 3)


def test_two_real_families_at_once_equal_their_in_process_engines(server, local_smol):
    need_gemma(server)
    # SmolLM2 (LLaMA) and Gemma 3 from one YAML file, asked concurrently over gRPC (token ids),
    # two requests each: each answer is its in-process engine's greedy output, up to a near-tie
    # of that engine's own logits (each group on one core computes its engine's floats: SmolLM2's
    # float32 to 1e-3, Gemma 3's bf16 to the bf16 tests' 0.5)
    from greedy import assert_same_or_near_tie
    gemma = PowerInfer.from_pretrained(installed_gemma(), Config(**GEMMA_CONFIG))
    local, tol = {SMOL: local_smol, GEMMA: gemma}, {SMOL: 1e-3, GEMMA: 0.5}
    prompts = {SMOL: "Once upon a time", GEMMA: "The capital of France is"}
    pb, n = server.pb, 8
    want = {}
    for m, pi in local.items():
        events = pi._run([pi.tokenize(prompts[m])], n, dict(temperature=0, ignore_eos=True))
        want[m] = [e.token for e in events if e.token >= 0]

    def ask(m):
        out = server.stub.Generate(pb.GenerateRequest(
            model=m, text=prompts[m], sampling=pb.SamplingParams(max_tokens=n, temperature=0,
                                                                 ignore_eos=True)),
            metadata=server.md, timeout=300)
        results.append((m, [t.token_id for o in out for t in o.tokens]))

    results = []
    threads = [threading.Thread(target=ask, args=(m,)) for m in [SMOL, GEMMA] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(m for m, _ in results) == sorted([SMOL, GEMMA] * 2)
    for m, got in results:
        pi = local[m]
        assert_same_or_near_tie(pi, pi.tokenize(prompts[m]), want[m], got, tol[m])
    assert "Paris" in gemma.detokenize(want[GEMMA]) or "capital" in gemma.detokenize(want[GEMMA])


def test_metrics(server):
    from prometheus_client.parser import text_string_to_metric_families
    smol = (("model_name", SMOL),)
    p = "powerinfer:"
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")

    def scrape() -> dict:
        r = httpx.get(server.url + "/metrics")  # no key needed
        assert r.status_code == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(r.text) for s in family.samples}

    # at rest the gauges read 0: a request an earlier test left (a client gone mid-stream is
    # cancelled at the scheduler's next step) ends within seconds, and one that never did fails;
    # one scrape a round, all three gauges read from it (health probes are not requests)
    deadline = time.time() + 30
    while True:
        samples = scrape()
        if not any(samples[(p + g, smol)] for g in gauges) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert samples[(p + "time_to_first_token_seconds_count", smol)] > 0
    assert samples[(p + "inter_token_latency_seconds_count", smol)] > 0
    assert samples[(p + "e2e_request_latency_seconds_count", smol)] > 0
    assert samples[(p + "request_queue_time_seconds_count", smol)] > 0
    assert samples[(p + "generation_tokens_total", smol)] >= 12
    assert samples[(p + "prompt_tokens_total", smol)] > 0
    assert samples[(p + "request_success_total", (("finished_reason", "length"),) + smol)] > 0
    for gauge in gauges:
        assert samples[(p + gauge, smol)] == 0, gauge
    # the ingress's count of the streams it is sending back to 0 after the tests before:
    # clients that hung up and requests that failed included
    assert samples[(p + "ingress_streams", ())] == 0
    assert samples[(p + "prefix_cache_queries_total", smol)] > 0
    assert 0 <= samples[(p + "prefix_cache_hits_total", smol)] <= \
        samples[(p + "prefix_cache_queries_total", smol)]
    assert samples[(p + "engine_restarts_total", smol)] == 0


# ------------------------------------------------------------------------------------- errors

def test_errors_have_status_codes_and_the_openai_shape(server):
    h = server.http
    chat = {"model": SMOL, "messages": QUESTION, "max_tokens": 2}
    assert_error(h.post("/v1/chat/completions", content=b"{not json"), 400, "JSON")
    e = assert_error(h.post("/v1/chat/completions", json={**chat, "temperature": -1}), 400)
    assert e["param"] == "temperature" and e["type"] == "invalid_request_error"
    assert_error(h.post("/v1/chat/completions", json={**chat, "messages": []}), 400)
    assert_error(h.post("/v1/completions", json={"model": TINY, "prompt": "x " * 600}), 400,
                 "context")
    assert_error(h.post("/v1/completions", json={"model": TINY, "prompt": [5, 10 ** 6]}), 400,
                 "vocabulary")
    assert_error(h.post("/v1/chat/completions", json={**chat, "model": "gpt-4"}), 404, "gpt-4")
    assert_error(h.get("/v1/models/gpt-4"), 404, "gpt-4")
    card = h.get(f"/v1/models/{SMOL}")  # OpenAI's "retrieve model"
    assert card.status_code == 200 and card.json()["id"] == SMOL, card.text
    assert card.json() == next(m for m in h.get("/v1/models").json()["data"] if m["id"] == SMOL)
    assert_error(h.post("/v1/chat/completions", json={**chat, "model": "/etc/passwd"}), 404)
    assert_error(h.post("/v1/chat/completions", json=chat, headers={"Authorization": ""}), 401)
    assert_error(h.post("/v1/chat/completions", json=chat,
                        headers={"Authorization": "Bearer wrong"}), 401, "invalid API key")
    assert_error(h.post("/v1/chat/completions", json=chat,
                        headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_error(h.get("/v1/models", headers={"Authorization": ""}), 401)
    big = {**chat, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    assert_error(h.post("/v1/chat/completions", json=big), 413)
    assert_error(h.get("/no/such/route"), 404)
    assert_error(h.post("/v1/chat/completions", json={**chat, "model": BROKEN}), 503,
                 "failed to load")
    assert_error(h.post("/v1/chat/completions", json={**chat, "tools": [{"type": "function"}]}),
                 400, "tools")
    e = assert_error(h.post("/v1/chat/completions", json={**chat,
                                                          "logit_bias": {"19556": -100}}),
                     400, "logit_bias is not supported")  # (it was ignored)
    assert not e["message"].startswith("Value error")  # (pydantic's words, not the API's)
    assert e["param"] == "logit_bias", e
    # a check of the whole request names its field too: a tool choice, a schema the grammar
    # engine cannot take
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    e = assert_error(h.post("/v1/chat/completions", json={
        **chat, "tools": weather,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}}), 400, "get_time")
    assert e["param"] == "tool_choice", e
    e = assert_error(h.post("/v1/chat/completions", json={**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "array", "uniqueItems": True}}}}), 400, "uniqueItems")
    assert e["param"] == "response_format", e
    # the field's own path, not pydantic's union member (`messages.0.content.str`)
    e = assert_error(h.post("/v1/chat/completions", json={
        **chat, "messages": [{"role": "user", "content": 5}]}), 400)
    assert e["param"] == "messages.0.content", e
    # the API's description and pages behind the key as every route (FastAPI's were open)
    for path in ("/openapi.json", "/docs"):
        assert_error(h.get(path, headers={"Authorization": ""}), 401)
        assert h.get(path).status_code == 200
    assert "/v1/chat/completions" in h.get("/openapi.json").json()["paths"]
    for stop in ("", [str(i) for i in range(17)], "x" * 1025):  # (a long one held the batch)
        assert_error(h.post("/v1/chat/completions", json={**chat, "stop": stop}), 400, "stop")
    # a long max_tokens is capped by the context, not refused
    r = h.post("/v1/completions", json={"model": TINY, "prompt": "hi", "max_tokens": 10 ** 9,
                                        "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 512
    assert httpx.get(server.url + "/health").status_code == 200  # open, like /metrics
    # extreme sampling values fail (if at all) their own request, never the model's group
    restarts = server.model_stats(TINY)["restarts"]
    odd = {"model": TINY, "prompt": "hello world, this is a test", "max_tokens": 3}
    assert h.post("/v1/completions", json={**odd, "temperature": 1e-300}).status_code == 200
    r = h.post("/v1/completions", json={**odd, "temperature": 1, "top_k": 0,
                                        "repetition_penalty": 1e-45})
    if r.status_code != 200:
        assert_error(r, 400, "sampling failed")
    assert h.post("/v1/completions", json=odd).status_code == 200
    assert server.model_stats(TINY)["restarts"] == restarts

    pb, stub = server.pb, server.stub
    ask = pb.GenerateRequest(model=SMOL, text="hi", sampling=pb.SamplingParams(max_tokens=2))
    cases = [(ask, [], grpc.StatusCode.UNAUTHENTICATED),
             (ask, [("authorization", "Bearer wrong")], grpc.StatusCode.UNAUTHENTICATED),
             (pb.GenerateRequest(model="gpt-4", text="hi"), server.md, grpc.StatusCode.NOT_FOUND),
             (pb.GenerateRequest(model=SMOL, text="hi", sampling=pb.SamplingParams(
                 temperature=-1)), server.md, grpc.StatusCode.INVALID_ARGUMENT),
             (pb.GenerateRequest(model=SMOL), server.md, grpc.StatusCode.INVALID_ARGUMENT),
             # max_tokens 0 set (it ran to the end of the context), and a stop string too long
             (pb.GenerateRequest(model=SMOL, text="hi", sampling=pb.SamplingParams(
                 max_tokens=0)), server.md, grpc.StatusCode.INVALID_ARGUMENT),
             (pb.GenerateRequest(model=SMOL, text="hi", sampling=pb.SamplingParams(
                 max_tokens=2, stop=["x" * 1025])), server.md, grpc.StatusCode.INVALID_ARGUMENT),
             (pb.GenerateRequest(model=BROKEN, text="hi"), server.md, grpc.StatusCode.UNAVAILABLE)]
    for req, md, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req, metadata=md))
        assert info.value.code() == code, (req, info.value.details())
        assert "Traceback" not in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.ListModels(pb.ListModelsRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # bytes that are no message of the method's type: INVALID_ARGUMENT naming the type (grpc's
    # own answer is UNKNOWN, which a client may retry), streaming or not
    for method, stream in (("Tokenize", False), ("Generate", True)):
        call = (server.channel.unary_stream if stream else server.channel.unary_unary)(
            f"/powerinfer.v1.Inference/{method}")
        with pytest.raises(grpc.RpcError) as info:
            r = call(b"\xff\xff\xff\xff not a message", metadata=server.md)
            list(r) if stream else r
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert f"powerinfer.v1.{method}Request" in info.value.details()
    assert stub.ListModels(pb.ListModelsRequest(), metadata=server.md).models  # still serving


def test_full_queue_answers_429_with_retry_after(server):
    # TINY decodes 2 sequences at once and queues 1 more: of 8 requests sent together, some are
    # refused at once
    body = {"model": TINY, "prompt": "hello", "max_tokens": 150, "ignore_eos": True}
    got = []
    threads = [threading.Thread(target=lambda: got.append(
        server.http.post("/v1/completions", json=body))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    codes = sorted(r.status_code for r in got)
    assert 200 in codes and 429 in codes and set(codes) == {200, 429}, codes
    refused = next(r for r in got if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert_error(refused, 429, "overloaded")

    pb = server.pb
    req = pb.GenerateRequest(model=TINY, text="hello", sampling=pb.SamplingParams(
        max_tokens=150, ignore_eos=True))
    codes = []

    def call():
        try:
            list(server.stub.Generate(req, metadata=server.md))
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes


@pytest.mark.slow
def test_fuzzed_bodies_never_get_a_5xx(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalar = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | \
        st.floats(allow_nan=False) | st.text(max_size=12)
    value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) |
                         st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6)
    small = st.integers(-3, 4) | st.sampled_from(["3", 2.5, [], {}, "x", -1e9, 0.0])
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                               "tool", "", "developer"]) | value,
                                     "content": st.text(max_size=30) | value})
    fields = {
        "model": st.sampled_from([TINY, TINY, "nope", ""]) | value,
        "messages": st.lists(message, max_size=3) | value,
        "prompt": st.text(max_size=30) | st.lists(st.integers(-3, 1100), max_size=6) | value,
        "temperature": st.floats(-1, 3) | value, "top_p": st.floats(-0.5, 1.5) | value,
        "top_k": st.integers(-2, 50) | value, "min_p": st.floats(-0.5, 1.5) | value,
        "n": st.integers(-1, 3) | value, "stop": st.text(max_size=3) | value,
        "seed": st.integers(-2 ** 65, 2 ** 65) | value, "stream": st.booleans() | value,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | value,
        "logprobs": st.booleans() | st.integers(-1, 7) | value,
        "top_logprobs": st.integers(-1, 7) | value, "repetition_penalty": st.floats(-1, 3) | value,
        "ignore_eos": st.booleans() | value, "stop_token_ids": st.lists(st.integers(-2, 5)) | value,
        "tokens": st.lists(st.integers(-5, 1100), max_size=6) | value,
        "add_special_tokens": value, "frequency_penalty": value,
        "max_completion_tokens": small,
        "response_format": st.fixed_dictionaries({
            "type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
            "json_schema": st.fixed_dictionaries({"schema": value, "strict": value})}) | value,
        "guided_json": value, "guided_regex": st.text(max_size=12) | value,
        "guided_choice": st.lists(st.text(max_size=4), max_size=3) | value,
        "guided_grammar": st.text(max_size=20) | value,
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | value,
        "parallel_tool_calls": value,
    }
    fields["tools"] = value | st.just(WEATHER)
    valid = {"/v1/chat/completions": {"model": TINY, "messages": [{"role": "user", "content": "hi"}]},
             "/v1/completions": {"model": TINY, "prompt": "hi"},
             "/tokenize": {"model": TINY, "prompt": "hi"},
             "/detokenize": {"model": TINY, "tokens": [5, 6]}}
    seen = {}

    @st.composite
    def request(draw):
        """A valid body with up to four fields replaced, removed or added; or any bytes."""
        path = draw(st.sampled_from(sorted(valid)))
        if draw(st.integers(0, 9)) == 0:
            return path, draw(st.one_of(value.map(json.dumps), st.binary(max_size=40)))
        body = dict(valid[path], max_tokens=draw(small))  # kept: an absent one runs long
        for k in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
            if k in body and draw(st.booleans()):
                del body[k]
            else:
                body[k] = draw(fields[k])
        return path, json.dumps(body)

    @settings(max_examples=500, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request())
    def check(req):
        path, data = req
        r = server.http.post(path, content=data, headers={"Content-Type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, data, r.text)
        assert "Traceback" not in r.text and 'File "' not in r.text
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert sum(seen.values()) >= 500 and seen.get(200) and seen.get(400), seen
    ok = server.http.post("/v1/chat/completions", json={"model": SMOL, "messages": QUESTION,
                                                         "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------- faults

def wait_for(predicate, timeout=60, every=0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def test_a_client_that_hangs_up_frees_its_slot(server):
    # a hang-up races Serve's cancellation of the call into the model's group: repeated at
    # several depths so that a cancellation mistaken for a failure (a group rebuild) shows
    st = server.model_stats(SMOL)
    before, restarts = st["cancelled"], st["restarts"]
    for n, depth in enumerate((1, 3, 6, 10), 1):
        with server.http.stream("POST", "/v1/chat/completions", json={
                "model": SMOL, "messages": QUESTION, "max_tokens": 300, "ignore_eos": True,
                "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(depth):
                next(line for line in lines if line)
        # the connection is closed here, mid-stream
        assert wait_for(lambda: (st := server.model_stats(SMOL)).get("cancelled") == before + n
                        and st["running"] == 0 and st["kv_usage"] == 0, timeout=20), \
            (depth, server.model_stats(SMOL), server.http.get("/v1/models").json())
    before += n
    assert server.model_stats(SMOL)["restarts"] == restarts

    # gRPC: the proxy cancels the call only if grpc notices the hang-up while the proxy waits
    # for a message, not while it writes one (serve_app.grpc_host.add_inference_servicer)
    pb = server.pb
    for n, depth in enumerate((1, 2, 3, 5, 8), 1):
        stream = server.stub.Generate(pb.GenerateRequest(
            model=SMOL, text="Tell me a story",
            sampling=pb.SamplingParams(max_tokens=300, ignore_eos=True)), metadata=server.md)
        for _ in range(depth):
            next(stream)
        stream.cancel()
        assert wait_for(lambda: (st := server.model_stats(SMOL)).get("cancelled") == before + n
                        and st["kv_usage"] == 0, timeout=20), (depth, server.model_stats(SMOL))
    assert server.model_stats(SMOL)["restarts"] == restarts
    assert "ignored GeneratorExit" not in server.log.read_text(errors="replace")


STORY_PROMPTS = ["Tell me a story about a dragon", "Write a poem about the sea", "Explain rain",
                 "List three fruits", "Describe Paris", "How do birds fly?", "What is a star?",
                 "Say something kind"]


def sse_text(lines: list[str]) -> tuple[str, list[dict]]:
    """The text of a streamed completion, and the error events it carried."""
    text, errors = "", []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            errors.append(chunk["error"])
        else:
            text += "".join(c["text"] for c in chunk["choices"])
    return text, errors


@pytest.mark.slow
def test_streams_survive_an_actor_killed_under_them(server):
    # streams of one model, over HTTP and gRPC, run while a cold executor of its group is killed
    # (tests/test_runtime.py kills each role under the engine: the hot executor, the scheduler
    # and the predictor too): none fails, each pauses while the group is rebuilt and ends with
    # the text an undisturbed run gives; a stream of the other model runs through untouched
    h, pb = server.http, server.pb

    def body(p, stream=False):
        return {"model": SMOL, "prompt": p, "max_tokens": 32, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    with ThreadPoolExecutor(len(STORY_PROMPTS)) as pool:  # undisturbed, batched as below
        want = list(pool.map(lambda p: h.post("/v1/completions", json=body(p)).json()[
            "choices"][0]["text"], STORY_PROMPTS))
    tiny_restarts = server.model_stats(TINY)["restarts"]
    other = []

    def other_stream():
        with httpx.Client(base_url=server.url, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"}) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": TINY, "prompt": "hello", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}) as r:
                other.extend(line for line in r.iter_lines() if line)

    t_other = threading.Thread(target=other_stream)
    t_other.start()
    before = server.model_stats(SMOL)
    lines = [[] for _ in STORY_PROMPTS]
    grpc_prompts = STORY_PROMPTS[:4]
    grpc_texts = [[] for _ in grpc_prompts]

    def run(i):
        with httpx.Client(base_url=server.url, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"}) as c:
            with c.stream("POST", "/v1/completions", json=body(STORY_PROMPTS[i], True)) as r:
                for line in r.iter_lines():
                    if line:
                        lines[i].append(line)

    def run_grpc(i):
        for r in server.stub.Generate(pb.GenerateRequest(
                model=SMOL, text=grpc_prompts[i], sampling=pb.SamplingParams(
                    max_tokens=32, temperature=0, ignore_eos=True)), metadata=server.md):
            grpc_texts[i].append(r.text)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STORY_PROMPTS))]
    threads += [threading.Thread(target=run_grpc, args=(i,)) for i in range(len(grpc_prompts))]
    for t in threads:
        t.start()
    assert wait_for(lambda: min(map(len, lines + grpc_texts)) >= 3, timeout=60), \
        [len(x) for x in lines + grpc_texts]
    os.kill(before["pids"]["cold.0"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    got = [sse_text(x) for x in lines]
    assert all(not errors for _, errors in got), [e for _, e in got if e]
    assert [text for text, _ in got] == want
    assert all(x[-1] == "data: [DONE]" for x in lines)
    assert ["".join(t) for t in grpc_texts] == want[:len(grpc_prompts)]
    assert wait_for(lambda: server.model_stats(SMOL).get("restarts") == before["restarts"] + 1,
                    timeout=60)
    t_other.join(timeout=300)
    assert other[-1] == "data: [DONE]" and not any('"error"' in e for e in other), other[-3:]
    assert server.model_stats(TINY)["restarts"] == tiny_restarts
    server.wait_healthy(timeout=60)


def test_the_servers_ray_keeps_few_tasks_events(server):
    # the server's own Ray instance keeps the events of few tasks (Ray's default: 100,000 tasks,
    # about 3 KiB each in its GCS, tens of MB an hour under load); this process joined that
    # instance and reads its settings
    from ray._raylet import Config

    from powerinfer.compat import LOCAL_RAY_CONFIG
    cap = LOCAL_RAY_CONFIG["task_events_max_num_task_in_gcs"]
    assert Config.task_events_max_num_task_in_gcs() == cap <= 10_000


def test_serves_controller_loops_once_a_second(server):
    # Serve's controller process runs with the server's control-loop interval (1 s, not Serve's
    # 0.1 s: its idle CPU a third), passed to it in the job's environment
    from serve_app.server import CONTROL_LOOP_ENV, CONTROL_LOOP_S
    pids = [pid for pid in ray_pids() - server.ray_before
            if b"ray::ServeController" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 1, pids
    env = environ(pids[0])
    assert env[CONTROL_LOOP_ENV.encode()] == CONTROL_LOOP_S.encode() == b"1.0"


def test_serve_passes_requests_over_its_replicas_grpc_servers(server):
    # the proxy reaches the ingress, and the ingress the model deployments, over the gRPC server
    # each replica runs (not as Ray tasks): every Serve process of the server starts with that
    # setting
    from serve_app.server import SERVE_TRANSPORT_ENV
    assert SERVE_TRANSPORT_ENV["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    seen = set()
    for pid in ray_pids() - server.ray_before:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = environ(pid)
        except OSError:  # (gone)
            continue
        role = next((r for r in (b"ProxyActor", b"Ingress", b"Model:", b"ServeController")
                     if r in cmd), None)
        if role is None:
            continue
        seen.add(role)
        for k, v in SERVE_TRANSPORT_ENV.items():
            assert env.get(k.encode()) == v.encode(), (role, k, env.get(k.encode()))
    assert seen == {b"ProxyActor", b"Ingress", b"Model:", b"ServeController"}, seen


# ----------------------------------------------------------------------------------- security

def test_ray_refuses_a_process_without_the_token(server, tmp_path):
    import ray
    # (the server's instance listens on loopback only: this is another process of the machine,
    # perhaps another user's, that has not the token)
    gcs = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env[LOOPBACK_SWITCH] = "0"  # it reaches the GCS: refused for want of the token
    env["HOME"] = str(tmp_path)
    env["RAY_NUM_REDIS_GET_RETRIES"] = "3"  # a refused read is retried once a second (20 s)
    code = ("import ray\n"
            "try:\n"
            f"    ray.init(address={gcs!r}, logging_level='error')\n"
            "    print('JOINED', ray.get(ray.remote(lambda: 1).remote()))\n"
            "except Exception as e:\n"
            "    print('REFUSED', type(e).__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert "REFUSED" in r.stdout and "JOINED" not in r.stdout, r.stdout + r.stderr[-2000:]
    assert "InvalidAuthToken" in r.stderr, r.stderr[-2000:]  # refused for the token, not unreached
    # nor can another user of the machine read it: Ray wrote it readable by all
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    assert os.environ.get("RAY_AUTH_TOKEN") or token.stat().st_mode & 0o077 == 0


def test_the_servers_ray_instance_listens_on_loopback_only(server):
    # its GCS, raylet, workers and agents, and the Prometheus exporters of Ray's autoscaler and
    # dashboard (fixed ports 44217 and 44227) and of its dashboard agent, which answer without
    # the token: none of them is reachable from the network
    import psutil
    pids = {server.proc.pid} | {p.pid for p in psutil.Process(server.proc.pid).children(
        recursive=True)}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
                 and c.pid in pids]
    ports = {c.laddr.port for c in listening}
    assert len(ports) >= 8, listening
    assert {c.laddr.ip for c in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


def test_a_second_server_on_the_same_ports_is_refused_before_it_starts(server):
    # (Serve's proxy binds with SO_REUSEPORT: a second server shared the first one's ports, the
    # kernel splitting connections between them, and reported the first one's models as its own)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for args, what in ((["--port", str(server.port), "--grpc-port", str(free_port())], "HTTP"),
                       (["--port", str(free_port()), "--grpc-port", str(server.grpc_port)],
                        "gRPC")):
        r = subprocess.run([str(POWERINFER), "serve", *args], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
        assert f"the {what} port" in r.stderr and "is taken" in r.stderr, r.stderr[-2000:]
        assert "Ray:" not in r.stdout  # refused before Ray started
    assert server.http.get("/v1/models").status_code == 200


def test_front_ends_listen_on_loopback_only(server):
    import psutil
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
                 and c.laddr.port in (server.port, server.grpc_port)]
    assert {c.laddr.port for c in listening} == {server.port, server.grpc_port}
    assert {c.laddr.ip for c in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


def test_a_servers_bodies_must_be_json(server):
    # a body that is not declared JSON (a browser's cross-site text/plain or form POST, sent
    # without a preflight) is not read as JSON. (This server has an API key, so it answers a
    # request naming any host: a proxy in front may pass on its own name; the loopback check
    # without a key is test_serve_config's)
    h = server.http
    chat = {"model": SMOL, "messages": QUESTION, "max_tokens": 1}
    assert h.get("/v1/models", headers={"Host": "proxy.example"}).status_code == 200
    body = json.dumps(chat).encode()
    for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        assert_error(h.post("/v1/chat/completions", content=body, headers={"Content-Type": kind}),
                     415, "application/json")
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = h.post("/v1/chat/completions", content=body, headers={"Content-Type": kind})
        assert r.status_code == 200, (kind, r.text)


def test_sigterm_refuses_new_requests_ends_a_stream_in_flight_and_leaves_nothing_behind(server):
    """A stop gives the responses in flight the drain time, refusing new requests meanwhile (503
    and gRPC UNAVAILABLE, health NOT_SERVING: a load balancer sends them elsewhere); a stream
    still running then ends with an error event and [DONE], not a cut connection."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import ray
    ray.shutdown()
    h, events, first = server.http, [], threading.Event()

    def stream():  # 8 choices of 480 tokens: seconds past the drain time on any CPU here
        with h.stream("POST", "/v1/chat/completions", json={
                "model": SMOL, "messages": QUESTION, "max_tokens": 480, "n": 8,
                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(120), events
    server.proc.send_signal(signal.SIGTERM)
    stopped = time.time()
    assert wait_for(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 503,
                    timeout=5), server.tail()
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "stopping"
    assert_error(h.post("/v1/chat/completions", json={"model": SMOL, "messages": QUESTION,
                                                      "max_tokens": 4}),
                 503, "the server is stopping")
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Chat(server.pb.ChatRequest(
            model=SMOL, messages=[server.pb.ChatMessage(role="user", content="Hi")]),
            metadata=server.md, timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in e.value.details()
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    reader.join(120)
    ended = time.time() - stopped
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["code"] == 503 and "the server is stopping: this response was ended after" in \
        err["message"], err
    assert ended < DRAIN_S + 4, ended
    assert server.proc.wait(timeout=120) == 0, server.tail()
    assert "8 generations in flight (a request's choices each): given up to 2 s" in \
        server.tail(), server.tail()
    assert wait_for(lambda: not (ray_pids() - server.ray_before), timeout=30), \
        ray_pids() - server.ray_before
    assert not list(Path("/dev/shm").glob("powerinfer-*"))


GCS_WATCH = """
import socket, sys, time
from serve_app.server import _exit_if_the_gcs_goes
watch = _exit_if_the_gcs_goes(sys.argv[1])
print("watching", flush=True)
if sys.argv[2] == "done":
    time.sleep(0.8)
    watch.set()
time.sleep(30)
print("still here", flush=True)
"""


def test_a_stop_whose_gcs_went_with_it_exits_at_once(tmp_path):
    """`kill -- -PGID`, or a service manager's stop of every process in its unit, stops Ray's own
    processes with the server's: its stop waited a minute for the gone GCS, then exited with
    Ray's error (seen with a served model: 61 s; now under a second, nothing left). While the
    application stops, a watch ends the process once the GCS's port refuses connections, and
    not once the stop is done (Ray's own shutdown then closes it). Here a socket stands for the
    GCS."""
    for then in ("gone", "gone, its console too", "done"):
        gcs = socket.socket()
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        proc = subprocess.Popen([sys.executable, "-c", GCS_WATCH,
                                 f"127.0.0.1:{gcs.getsockname()[1]}", then],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "watching\n"
        time.sleep(0.7)  # (answered meanwhile: the watch goes on)
        assert proc.poll() is None
        t0 = time.monotonic()
        if then.startswith("gone"):
            if then != "gone":  # a console the same signal stopped (`serve | tee`): the
                proc.stdout.close()  # watch's BrokenPipeError had ended it, and no exit came
            gcs.close()
            assert proc.wait(timeout=10) == 0 and time.monotonic() - t0 < 3
            if then == "gone":
                assert "Ray's own processes were stopped too" in proc.stdout.read()
        else:  # the stop done first: the GCS may go as Ray stops
            time.sleep(0.3)
            gcs.close()
            time.sleep(1.0)
            assert proc.poll() is None
            proc.kill()
            proc.wait()
