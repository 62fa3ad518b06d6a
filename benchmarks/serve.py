#!/usr/bin/env python3
"""The serving engine under load, beside llama.cpp's own `llama-server`: seven scenarios, one run.

    .venv/bin/python benchmarks/serve.py [--scenarios load chat long kill hops memory models]
        [--model smollm2-135m-instruct] [--threads N] [--tuned "SERVE FLAGS"] [--skip-llama]
        [--skip-handle] [--out FILE]
        load:  [--concurrency 1 8 32 64] [--tokens 128] [--rounds 2]
        chat:  [--chat-conversations 8] [--chat-turns 4] [--chat-tokens 64] [--system-tokens 500]
        long:  [--long-tokens 2000] [--long-streams 8] [--long-stream-tokens 400]
        kill:  [--kill-seconds 40] [--kill-clients 8] (and --tokens)
        hops:  [--hop-requests 3] (and --tokens)
        memory: [--memory-streams 8] (and --tokens)
        models: [--models smollm2-135m-instruct smollm2-135m-instruct gemma3-270m gemma3-270m]
                [--model-setting cold_executors=0] (and --memory-streams, --tokens)

    # a quick check of every code path (minutes, not a measurement):
    .venv/bin/python benchmarks/serve.py --concurrency 1 2 --tokens 16 --rounds 1 \
        --chat-conversations 3 --chat-turns 3 --chat-tokens 16 --long-tokens 1000 \
        --long-streams 3 --long-stream-tokens 200 --kill-seconds 20 --kill-clients 4 \
        --hop-requests 2

Every system runs with its defaults, one at a time, on the same GGUF file (the model's Q4_1 file
for the default model): `powerinfer serve --model M` as a new user starts it (no --dtype, no
--max-batch: dtype auto, max_batch 64, max_queue 256, prefix cache on, prefill chunks of 512,
the model's own context), started afresh for each scenario (and each variant of a scenario) and
stopped, with its Ray instance, when it ends. `--tuned "FLAGS"` adds one labelled "tuned" row to
the load scenario (and a table to the memory scenario): a server started with those extra
`powerinfer serve` flags (`--tuned "--max-batch 8 --dtype float32"`; one flag alone as
`--tuned=--no-prefix-cache`), led by environment settings for the server's processes as a
shell takes them (`--tuned "RAY_SERVE_USE_GRPC_BY_DEFAULT=0 --max-batch 8"`). Requests are
streaming chat completions (`/v1/chat/completions`, "stream_options": {"include_usage": true}),
greedy, with `ignore_eos` so that every output has its fixed length. Times are measured by the
client: TTFT from sending a request to its first streamed token, ITL the gaps between its
tokens. The model deployment's `stats()` (running, waiting, kv_usage, kv_blocks, prefill and
decode counters, restarts, the group's pids) is read where a scenario says so, through a child
process of the benchmark joined to the server's Ray instance (in token mode, with this user's
~/.ray/auth_token): one such process a server, as Serve's handles keep process-wide routing
state that a second server in the same process would inherit. One scenario failing does not
stop the others (its traceback is printed; the exit status is then 1).

Scenarios (`--scenarios`, default all, in this order):

1. load: `--concurrency` levels (1 8 32 64), at each `c` clients, each sending `--rounds` (2)
   requests one after another (fixed short prompts, `--tokens` (128) output tokens; one
   unmeasured request before the first level, and before each llama-server). Rows: the
   server; the same load on the engine handle in this process (`ActorEngine.agenerate` with the
   server's defaults, Config(runtime="actors", max_queue=256): the difference is the cost of the
   Serve hops); `llama-server` (`--parallel` = c, `-c` = 256 * c); and the "tuned" server with
   `--tuned`; `--temperature T` samples every request at T (each system's own defaults for the
   other filters: ours the OpenAI API's, llama-server's its own; the handle's rows stay greedy).
   Columns: aggregate tok/s, ratio to llama-server, TTFT p50/p99, ITL p50/p99, the
   scheduler's mean prefill step (its counters), for our servers the CPU time (/proc/PID/stat)
   a generated token took in Serve's hops (the ingress and Serve's proxy) and in the model's
   processes (its replica, scheduler, executors, predictor), errors. While the server runs the
   highest level, stats() is sampled every 0.5 s: the peak share of KV blocks held (and of how
   many), the peak of running sequences, preemptions, and the requests that waited while blocks
   were free (the peak of "waiting" over samples with kv_usage < 0.9: admission, not memory,
   held them back).
2. chat: `--chat-conversations` (8) conversations of `--chat-turns` (4) turns, run concurrently,
   each conversation's turns one after another; every turn sends the whole history: a shared
   system prompt of about `--system-tokens` (500) tokens of plain English (its length in the
   model's tokenizer is printed), the previous user and assistant messages and a new user
   message (distinct per conversation and turn), `--chat-tokens` (64) output tokens. Systems:
   the server (prefix cache on), the server with --no-prefix-cache, llama-server --parallel 8
   (-c 8 * 2048, "cache_prompt": true). Table: TTFT p50 over the conversations for each turn,
   and the mean prompt tokens of turns 2.. found cached, from the usage of the final chunk
   (usage.prompt_tokens_details.cached_tokens; llama-server 0.3.36 reports the same number there
   and as "timings"."cache_n", which is read when usage lacks it; llama-server always computes
   a prompt's last token again, so it reports at most the prompt less one); the notes list each
   turn's cached and prompt tokens.
3. long ("long prompt interference"): after a warm-up with a long prompt of a third document,
   one long prompt (`--long-tokens` (2000) tokens of a plain-text document made of varied
   sentences, 16 output tokens) alone on the idle server: its TTFT; then `--long-streams` (8) streams decoding (`--long-stream-tokens` (400)
   tokens each, enough to outlast the test) and, once each has streamed 20 tokens, another long
   prompt of the same size (another document: only the instruction before it can be cached;
   the notes give each long prompt's cached tokens). Measured: its TTFT
   under load, and the streams' gaps between tokens before it was sent (p50) and during the
   window from its sending to its first token (p50, p99, max; a gap counts when it overlaps the
   window; the streams are cancelled once each has a token after that window). Systems: the
   server (chunked prefill, 512 a step), the server with --prefill-chunk 0 (a prompt in one
   step), llama-server --parallel 9 (-c 9 * 2600).
4. kill (the server only): `--kill-clients` (8) clients sending streaming requests back to back
   (`--tokens` tokens each) for `--kill-seconds` (40) s; at 1/4 of that (10 s) the model's cold
   executor is SIGKILLed (its pid from stats()["pids"]["cold.0"]), at 5/8 (25 s) its scheduler
   (pids["scheduler"], read again after the first rebuild). Reported: requests completed and
   failed (an HTTP status other than 200 or an error event), the longest gap between two tokens
   of one stream, whether every completed stream has exactly `--tokens` tokens (its usage and
   its chunks), whether the completions of one prompt agree (greedy), and for each kill the
   seconds until stats()["restarts"] increased and GET /health answered 200 again.
5. hops: at concurrency 1, `--hop-requests` (3) requests of `--tokens` tokens, one after another
   after one unmeasured, through (a) the engine handle in this process (as in load, before the
   server starts), (b) the model deployment's Serve handle, called from the benchmark's Ray
   process (`Model:m`.generate, streaming, with a GenerationRequest of chat messages),
   (c) HTTP through Serve's proxy and the ingress, (d) gRPC through the proxy (`Generate`, a text
   prompt): tok/s and TTFT of each; and during (c) the CPU time (/proc/PID/stat utime + stime)
   every process on the machine took, named by its command line (ray::ServeReplica:...:Ingress,
   ...:Model:m, ray::ProxyActor, ray::Scheduler, ray::HotExecutor, ray::ColdExecutor, raylet,
   gcs_server, this benchmark, ...), in ms of CPU per generated token, sorted.
6. memory: after `--memory-streams` (8) concurrent streams of `--tokens` tokens, the PSS
   (/proc/PID/smaps_rollup) of every process of the server's tree, by role, in three parts: the
   model's (its replica, scheduler, executors, predictor), Serve's and the driver's (controller,
   proxy, ingress, `powerinfer serve` itself: once per host, however many models) and Ray's own
   (GCS, raylet, dashboard, idle workers); whether each maps torch's library; the server's own
   memory lines; llama-server's one process after the same load (`--parallel` the same).
7. models: several models in one `powerinfer serve --config` (`--models`, by default SmolLM2
   and Gemma 3 270M, each twice, every setting the server's default), `--memory-streams` streams
   of `--tokens` tokens to every model at once: each model's tok/s and errors, then each one's
   PSS (its group's processes and its replica, from the deployment's memory()) against its bound
   (weights + KV cache pages in use + 512 MiB), and the rest of the server's tree (Ray, Serve,
   the driver) against 1 GiB.

llama-server is built with CMake from the llama.cpp sources vendored in the llama-cpp-python
0.3.36 sdist into `benchmarks/.llama-server` on first use (5-6 minutes on 2 cores): -march=native
(GGML_NATIVE) without AMX (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 in CMAKE_C_FLAGS and
CMAKE_CXX_FLAGS: its AMX path dies with "Illegal instruction" on Xeons with AMX), in a build
directory named after the flags; it runs with `-t --threads` (default: every core), continuous
batching (-cb where the binary has it) and, on a CPU with AMX, --no-repack (its AMX repacking
crashed on the Xeons tried before the build dropped AMX; not tried since). `--skip-llama` leaves
it out, `--skip-handle` the in-process engine rows. Each table is printed with a line stating
the date, the CPU, its cores, the model file and the settings; `--out FILE` writes everything as
JSON. A server's log is in the temp directory (powerinfer-bench-serve-PORT.log,
llama-server-PORT.log).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from types import SimpleNamespace


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # serve_app and protos, as the server imports them

LLAMA_VERSION = "0.3.36"
LLAMA_DIR = ROOT / "benchmarks" / ".llama-server"
PROMPTS = ["Tell me about the history of Paris.", "Write a short poem about the sea.",
           "Explain how a bicycle works.", "What should I pack for a trip to the mountains?",
           "Describe your favourite meal.", "How do plants make food from sunlight?",
           "Give me three tips for learning a new language.", "What is a black hole?"]
CHAT = "/v1/chat/completions"
LOG_DIR = Path(tempfile.gettempdir())


# ---------------------------------------------------------------------- the load generator

def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(name: str, c: int, results: list[dict], wall: float) -> dict:
    ok = [r for r in results if not r.get("error")]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["gaps"]]
    return {"system": name, "concurrency": c, "requests": len(results),
            "errors": len(results) - len(ok), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50_ms": pct(ttft, .5) * 1e3,
            "ttft_p99_ms": pct(ttft, .99) * 1e3, "itl_p50_ms": pct(itl, .5) * 1e3,
            "itl_p99_ms": pct(itl, .99) * 1e3,
            "error_kinds": sorted({r["error"][:80] for r in results if r.get("error")})}


async def drive(request, c: int, rounds: int) -> tuple[list[dict], float]:
    """c clients, each sending `rounds` requests in turn; `request(i)` returns one result."""
    results = []

    async def client(k):
        for j in range(rounds):
            results.append(await request(k * rounds + j))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(c)))
    return results, time.perf_counter() - t0


def result(t0: float, stamps: list[float], error: str | None, tokens: int | None = None) -> dict:
    """One request's outcome: its tokens, time to the first and the gaps between them."""
    if error or not stamps:
        return {"error": error or "no tokens"}
    return {"tokens": tokens if tokens is not None else len(stamps), "ttft": stamps[0] - t0,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])]}


def http_client():
    import httpx2 as httpx

    # a connection a request: llama-server drops idle kept-alive connections under load
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=600, limits=limits)


def chat_body(messages: list[dict] | str, tokens: int, temperature: float = 0.0,
              model: str = "m") -> dict:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {"model": model, "max_tokens": tokens, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": True,
            "messages": messages}


def new_record() -> dict:
    return {"t0": None, "t1": None, "stamps": [], "text": "", "chunks": 0, "usage": None,
            "timings": None, "error": None, "status": None, "body": None, "done": False,
            "dropped": None}


async def sse_request(client, url: str, body: dict, rec: dict | None = None,
                      on_token=None) -> dict:
    """One streaming request, recorded into `rec` as it goes (a cancelled request keeps what it
    had): the time of each chunk with text, the text, the chunks with a choice, the usage and
    llama-server's timings of the last chunk that had them, an error (status, error event,
    exception); apart, the status and the body of a response other than 200, whether [DONE]
    came, the exception that dropped the connection, and when it ended. Chunks that hold text
    back (an incomplete character) have no stamp."""
    rec = new_record() if rec is None else rec
    rec["t0"] = time.perf_counter()
    try:
        async with client.stream("POST", url + CHAT, json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["body"] = (await r.aread()).decode(errors="replace")[:200]
                rec["error"] = f"HTTP {r.status_code}: {rec['body']}"
                return rec
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    rec["done"] = True
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]
                    rec["error"] = str(err.get("message") if isinstance(err, dict) else err)
                    continue
                if chunk.get("choices"):
                    rec["chunks"] += 1
                    piece = chunk["choices"][0].get("delta", {}).get("content")
                    logprobs = (chunk["choices"][0].get("logprobs") or {}).get("content")
                    if logprobs:  # (where the request asked for them)
                        rec.setdefault("logprobs", []).extend(logprobs)
                    if piece:
                        rec["stamps"].append(time.perf_counter())
                        rec["text"] += piece
                        if on_token:
                            on_token()
                rec["usage"] = chunk.get("usage") or rec["usage"]
                rec["timings"] = chunk.get("timings") or rec["timings"]
    except Exception as e:  # noqa: BLE001 - counted as an error of this request
        rec["error"] = rec["dropped"] = f"{type(e).__name__}: {e}"
    finally:
        rec["t1"] = time.perf_counter()
    return rec


def outcome(rec: dict) -> dict:
    usage = rec.get("usage") or {}
    return result(rec["t0"], rec["stamps"], rec["error"], usage.get("completion_tokens"))


def cached_tokens(rec: dict) -> int | None:
    """Prompt tokens the server reused: OpenAI's usage field, else llama-server's timings."""
    details = (rec.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return details["cached_tokens"]
    return (rec.get("timings") or {}).get("cache_n")


def prompt_tokens(rec: dict) -> int | None:
    n = (rec.get("usage") or {}).get("prompt_tokens")
    if n is None and rec.get("timings"):
        n = rec["timings"].get("prompt_n", 0) + rec["timings"].get("cache_n", 0)
    return n


async def http_load(url: str, tokens: int, c: int, rounds: int,
                    warm: bool, temperature: float = 0.0, model: str = "m"
                    ) -> tuple[list[dict], float]:
    """Streaming chat requests to an OpenAI-compatible server (after one unmeasured if warm)."""
    async with http_client() as client:
        async def one(i: int) -> dict:
            return outcome(await sse_request(client, url, chat_body(PROMPTS[i % len(PROMPTS)],
                                                                    tokens, temperature, model)))

        if warm:
            await one(0)
        return await drive(one, c, rounds)


# ---------------------------------------------------------------------------- the systems

def free_port() -> int:
    """A port Ray's own processes will not take before the server binds it (one of the
    ephemeral range did, and a served benchmark's proxy could not start)."""
    from serve_app.server import free_port
    return free_port()


def http_status(url: str, timeout: float = 5) -> int | None:
    import httpx2 as httpx
    try:
        return httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError:
        return None


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}; {log}:\n{tail}")
        if http_status(url) == 200:
            return
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout} s (log: {log})")


def proc_entries():
    """(pid, /proc/PID/stat text, its fields after the command name, argv) of every process
    that is still there when read."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = [a.decode(errors="replace")
                    for a in (d / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        yield int(d.name), stat, stat[stat.rindex(")") + 2:].split(), argv


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    return {pid: (int(fields[1]), " ".join(argv)) for pid, _, fields, argv in proc_entries()}


def descendants(pid: int) -> dict[int, str]:
    procs, found, todo = processes(), {}, [pid]
    while todo:
        p = todo.pop()
        for child, (parent, cmd) in procs.items():
            if parent == p and child not in found:
                found[child] = cmd
                todo.append(child)
    return found


def stop(proc: subprocess.Popen):
    """SIGTERM, then what is left of the process and its descendants SIGKILLed by pid."""
    children = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline:
        now = processes()
        alive = [p for p in children if p in now and now[p][1] == children[p]]  # not reused
        if not alive:
            return
        time.sleep(0.5)
    for p in alive:
        print(f"  (killing pid {p}, left by {proc.args[0]}: {children[p][:80]})", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def gcs_address(pid: int) -> str:
    """The address of the Ray instance the server started (not another one on this machine)."""
    for cmd in descendants(pid).values():
        if cmd.split(" ")[0].endswith("/raylet"):
            for a in cmd.split():
                if a.startswith("--gcs-address="):
                    return a.split("=", 1)[1]
    return "auto"


def ray_agent(address: str, conn):
    """A child process joined to a server's Ray instance, answering (id, command, keywords) on
    `conn`: "stats" and "memory" (a model deployment's stats() and memory(): the keyword
    `model`, default "m", names it), "hop" (requests through its Serve handle), "close". A
    process of its own for each server: Serve's handles keep routers and their replicas in
    process-wide state that outlives ray.shutdown(), so that a second server reached from one
    process would be routed to the first one's dead replica. `powerinfer serve` starts
    Ray with token authentication: a client has to be in token mode too (the token is this
    user's ~/.ray/auth_token)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    import ray
    from ray import serve

    from powerinfer.compat import loopback_node
    with loopback_node():  # (a server's own instance listens on 127.0.0.1 only)
        ray.init(address=address, logging_level="error")
    handles = {}

    def handle_of(model: str):
        if model not in handles:
            handles[model] = serve.get_deployment_handle(f"Model:{model}", app_name="powerinfer")
        return handles[model]

    try:
        while True:
            rid, cmd, kw = conn.recv()
            if cmd == "close":
                break
            try:
                handle = handle_of(kw.pop("model", "m"))
                if cmd in ("stats", "memory"):  # (the model deployment's methods of that name)
                    out = getattr(handle, cmd).remote().result(timeout_s=kw["timeout"])
                else:
                    out = asyncio.run(serve_handle_load(handle, **kw))
                conn.send((rid, True, out))
            except Exception as e:  # noqa: BLE001 - raised again in the caller
                conn.send((rid, False, f"{type(e).__name__}: {e}"))
    finally:
        ray.shutdown()


class RayAgent:
    """The benchmark's side of `ray_agent`: calls from any thread, one at a time."""

    def __init__(self, address: str):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=ray_agent, args=(address, child), daemon=True)
        self.proc.start()
        self.lock, self.next = threading.Lock(), 0

    def call(self, cmd: str, wait: float, **kw):
        """The command's answer; `wait` is how long it may take (the pipe waits 60 s more)."""
        with self.lock:
            self.next += 1
            self.conn.send((self.next, cmd, kw))
            deadline = time.time() + wait + 60
            while time.time() < deadline:
                if not self.conn.poll(1):
                    if not self.proc.is_alive():
                        raise RuntimeError(f"the Ray agent exited ({self.proc.exitcode})")
                    continue
                rid, ok, out = self.conn.recv()
                if rid != self.next:
                    continue  # the answer to a call that timed out
                if not ok:
                    raise RuntimeError(out)
                return out
            raise TimeoutError(f"{cmd}: no answer from the Ray agent in {wait + 60} s")

    def close(self):
        with contextlib.suppress(OSError):
            with self.lock:
                self.conn.send((0, "close", {}))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def tuned_parts(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """`--tuned`'s words split: the leading NAME=VALUE ones (the server's environment, as a
    shell takes them), and its `powerinfer serve` flags."""
    words, env = list(words), {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


@contextlib.contextmanager
def our_server(args, flags: list[str] = (), config: Path | None = None):
    """A `powerinfer serve --model M` (defaults, and `flags`, led by NAME=VALUE words for its
    environment: `tuned_parts`; or the models file `config`), with a Ray agent joined to its Ray
    instance for the model deployments' stats(); both stopped on the way out."""
    env, flags = tuned_parts(flags)
    port, grpc_port = free_port(), free_port()
    log = LOG_DIR / f"powerinfer-bench-serve-{port}.log"
    what = ["--config", str(config)] if config else ["--model", args.model, "--name", "m"]
    cmd = [str(Path(sys.executable).with_name("powerinfer")), "serve", *what,
           "--port", str(port), "--grpc-port", str(grpc_port), *flags]
    shown = shlex.join([f"{k}={v}" for k, v in env.items()] + cmd[1:])
    print(f"  starting: {shown} (log {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env})
    agent = None
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        agent = RayAgent(gcs_address(proc.pid))

        def stats(timeout: float = 30) -> dict:
            return agent.call("stats", timeout, timeout=timeout)

        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, grpc_port=grpc_port,
                              proc=proc, agent=agent, stats=stats, log=log)
    finally:
        if agent:
            agent.close()
        stop(proc)


class Sampler(threading.Thread):
    """stats() every `period` seconds, in a thread, until stopped."""

    def __init__(self, stats, period: float = 0.5):
        super().__init__(daemon=True)
        self.stats, self.period, self.samples, self.failures = stats, period, [], []
        self.done = threading.Event()

    def run(self):
        while True:
            try:
                self.samples.append(self.stats(10))
            except Exception as e:  # noqa: BLE001 - reported with the samples
                self.failures.append(f"{type(e).__name__}: {e}"[:120])
            if self.done.wait(self.period):
                return

    def finish(self) -> list[dict]:
        self.done.set()
        self.join()
        return self.samples


def bench_handle(args, levels: list[int], rounds: int,
                 label: str = "engine handle, no Serve") -> list[dict]:
    """The same load on the engine handle in this process (its own Ray instance): no proxy, no
    ingress, no replica; the server's defaults."""
    from actors.handle import ActorEngine
    from powerinfer.config import Config
    from powerinfer.engine.params import SamplingParams

    engine = ActorEngine(args.model, Config(runtime="actors", max_queue=256))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in PROMPTS]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    async def one(i: int) -> dict:
        t0, stamps, error = time.perf_counter(), [], None
        try:
            async for events in engine.agenerate(prompts[i % len(prompts)], params):
                now = time.perf_counter()
                stamps += [now for ev in events if ev["token"] >= 0]
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        return result(t0, stamps, error)

    rows = []
    try:
        asyncio.run(one(0))  # warm-up
        for c in levels:
            results, wall = asyncio.run(drive(one, c, rounds))
            rows.append(summarize(label, c, results, wall))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.shutdown()
        import ray
        ray.shutdown()
    return rows


# -march=native without AMX: on Xeons with AMX, ggml's AMX path runs without asking Linux for
# the tile state (arch_prctl ARCH_REQ_XCOMP_PERM) and the first step dies with "Illegal
# instruction"; an explicit -mno-* wins over -march=native whatever the order (GCC and Clang)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
# llama-server held to an older class (`--llama-isa`), as `--tuned "--cpu-isa avx2"` holds ours:
# an EPYC Rome/Milan's (avx2) or a Cascade Lake's (avx512: AVX-512 F/BW/VL with VNNI, no BF16)
_OLDER = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
          "-DGGML_BMI2=ON"]
LLAMA_ISAS = {"native": [], "avx2": _OLDER, "avx512": _OLDER + ["-DGGML_AVX512=ON",
                                                                "-DGGML_AVX512_VNNI=ON"]}
LLAMA_ISA = "native"  # --llama-isa
LLAMA_NO_REPACK = False  # --llama-no-repack


def llama_server_binary() -> Path:
    """llama.cpp's server, built from the sources vendored in the llama-cpp-python sdist, in a
    build directory named after the CMake flags (a build made with other flags is not reused);
    for `LLAMA_ISA`'s class (this CPU's without AMX, or an older one's)."""
    src = LLAMA_DIR / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    flags = [f for f in LLAMA_CMAKE if LLAMA_ISA == "native" or f != "-DGGML_NATIVE=ON"]
    flags += LLAMA_ISAS[LLAMA_ISA]
    build = "build-" + hashlib.sha1(" ".join(flags).encode()).hexdigest()[:10]
    binary = src / build / "bin" / "llama-server"
    if binary.exists():
        return binary
    print(f"building llama-server from llama-cpp-python {LLAMA_VERSION}'s sources into "
          f"{src / build} (a few minutes) ...", flush=True)
    LLAMA_DIR.mkdir(parents=True, exist_ok=True)
    sdist = LLAMA_DIR / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", "-d", str(LLAMA_DIR), f"llama-cpp-python=={LLAMA_VERSION}"],
                       check=True)
    if not (src / "CMakeLists.txt").exists():
        subprocess.run(["tar", "xzf", sdist.name], cwd=LLAMA_DIR, check=True)
    subprocess.run(["cmake", "-S", ".", "-B", build, *flags], cwd=src, check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j",
                    str(os.cpu_count())], cwd=src, check=True, stdout=subprocess.DEVNULL)
    return binary


@functools.cache
def llama_flags(binary: Path) -> tuple[str, ...]:
    """-cb where this llama-server has it (continuous batching: on by default in recent ones)."""
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    return ("-cb",) if "--cont-batching" in help_text else ()


@contextlib.contextmanager
def llama_server(args, gguf: str, parallel: int, ctx: int):
    binary = llama_server_binary()
    port = free_port()
    log = LOG_DIR / f"llama-server-{port}.log"
    cmd = [str(binary), "-m", gguf, "-t", str(args.threads), "--parallel", str(parallel),
           "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
           *llama_flags(binary)]
    if LLAMA_NO_REPACK:  # (its weights repacked for this CPU is llama.cpp's default; an AMX
        # build's AMX repacking crashed on Xeons with AMX, and our builds leave AMX out)
        cmd.append("--no-repack")
    print(f"  starting: llama-server {shlex.join(cmd[1:])} (log {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


LLAMA_NAME = f"llama-server {LLAMA_VERSION}"


# ------------------------------------------------------------------------------ scenarios

def load_ours(args, server, label: str, levels: list[int]) -> tuple[list[dict], dict]:
    rows, memory = [], {}
    for c in levels:
        before = server.stats()
        sampler = Sampler(server.stats) if c == max(levels) else None
        if sampler:
            sampler.start()
        cpu_before = cpu_snapshot()
        results, wall = asyncio.run(http_load(server.url, args.tokens, c, args.rounds,
                                              warm=c == levels[0],
                                              temperature=args.temperature))
        cpu = cpu_report(cpu_before, cpu_snapshot(), sum(r.get("tokens") or 0 for r in results))
        samples = sampler.finish() if sampler else []
        after = server.stats()
        row = summarize(label, c, results, wall)
        # CPU ms a token: Serve's hops (the ingress and the proxy) against the model's group
        row["cpu_ms_per_token"] = {
            part: sum(e["ms_per_token"] for e in cpu if any(n in e["process"] for n in names))
            for part, names in (("hops", ("Ingress", "ProxyActor")),
                                ("model", ("Executor", "Scheduler", "Predictor", "Model:")))}
        steps = after["prefill_steps"] - before["prefill_steps"]
        row["prefill_ms"] = (after["prefill_s"] - before["prefill_s"]) / max(steps, 1) * 1e3
        row["prefix_hits"] = after["prefix_hits"] - before["prefix_hits"]
        if sampler:
            free = [s for s in samples if s and s.get("kv_usage", 1) < 0.9]
            memory = {"concurrency": c, "samples": len(samples),
                      "failed_samples": sampler.failures[:3],
                      "peak_kv_usage": max((s.get("kv_usage", 0) for s in samples), default=0),
                      "kv_blocks": after.get("kv_blocks"),
                      "peak_running": max((s.get("running", 0) for s in samples), default=0),
                      "peak_waiting": max((s.get("waiting", 0) for s in samples), default=0),
                      "waited_with_free_blocks": max((s.get("waiting", 0) for s in free),
                                                     default=0),
                      "preemptions": after["preemptions"] - before["preemptions"]}
            row["memory"] = memory
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    return rows, memory


def scenario_load(args, gguf: str) -> dict:
    levels = args.concurrency
    rows, memory = [], {}
    with our_server(args) as server:
        r, memory[SERVE] = load_ours(args, server, SERVE, levels)
        rows += r
    if args.tuned:
        label = f"powerinfer serve, tuned: {args.tuned}"
        with our_server(args, shlex.split(args.tuned)) as server:
            r, memory[label] = load_ours(args, server, label, levels)
            rows += r
    if not args.skip_handle:
        rows += bench_handle(args, levels, args.rounds)
    if not args.skip_llama:
        for c in levels:
            # 256 positions a slot: the chat prompt (under 64 tokens) and the output
            with llama_server(args, gguf, c, 256 * c) as url:
                results, wall = asyncio.run(http_load(url, args.tokens, c, args.rounds,
                                                      warm=True, temperature=args.temperature))
            rows.append(summarize(LLAMA_NAME, c, results, wall))
            print(json.dumps(rows[-1]), flush=True)

    llama = {r["concurrency"]: r for r in rows if r["system"] == LLAMA_NAME}
    out = ["| system | concurrency | tok/s (aggregate) | vs llama-server | TTFT p50 / p99 ms | "
           "ITL p50 / p99 ms | mean prefill ms | CPU ms a token: Serve's hops / the model | "
           "errors |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {SERVE: 0, "engine handle, no Serve": 2, LLAMA_NAME: 3}
    for r in sorted(rows, key=lambda r: (r["concurrency"], order.get(r["system"], 1))):
        ref = llama.get(r["concurrency"])
        ratio = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ref else "-"
        pre = f"{r['prefill_ms']:.0f}" if "prefill_ms" in r else "-"
        cpu = r.get("cpu_ms_per_token")
        cpu = f"{cpu['hops']:.2f} / {cpu['model']:.2f}" if cpu else "-"
        out.append(f"| {r['system']} | {r['concurrency']} | {r['tok_s']:.1f} | {ratio} | "
                   f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                   f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {pre} | {cpu} | "
                   f"{r['errors']} |")
    notes = []
    for label, m in memory.items():
        if not m:
            continue
        held = m["peak_kv_usage"] * (m["kv_blocks"] or 0)
        notes.append(f"- {label} at concurrency {m['concurrency']} ({m['samples']} samples of "
                     f"stats(), 0.5 s apart): peak KV usage {m['peak_kv_usage']:.1%} "
                     f"({held:.0f} of {m['kv_blocks']} blocks), peak running "
                     f"{m['peak_running']}, peak waiting {m['peak_waiting']}, requests waiting "
                     f"while blocks were free (kv_usage < 0.9): {m['waited_with_free_blocks']}, "
                     f"preemptions {m['preemptions']}" +
                     (f"; failed samples: {m['failed_samples']}" if m["failed_samples"] else ""))
    for r in rows:
        if r["error_kinds"]:
            notes.append(f"- errors of {r['system']} at {r['concurrency']}: {r['error_kinds']}")
    settings = (f"load: {args.tokens} tokens a request, {args.rounds} requests a client, "
                f"streaming chat, greedy, ignore_eos; powerinfer serve defaults"
                + (f" (tuned row: {args.tuned})" if args.tuned else "")
                + ("" if args.skip_llama else f"; llama-server -t {args.threads} --parallel c "
                   "-c 256*c"))
    return {"settings": settings, "table": "\n".join(out + [""] + notes), "rows": rows,
            "memory": memory}


SERVE = "powerinfer serve"

SYSTEM_SENTENCES = [
    "You are the help desk assistant of the Riverside Public Library, a small library in a "
    "market town with a reading room, a children's corner and a local history archive.",
    "Answer the visitor's questions politely and briefly, in plain English, and say so when "
    "you do not know something instead of guessing.",
    "The library opens at nine in the morning from Monday to Saturday and closes at six in the "
    "evening, except on Thursdays, when it stays open until eight.",
    "It is closed on Sundays and on public holidays, and during the first week of January, "
    "when the staff count the books and repair the shelves.",
    "Anyone who lives, works or studies in the district may join for free by showing a document "
    "with their name and address, such as a bank statement or a letter from a school.",
    "Members may borrow up to twelve books, four films and two board games at a time.",
    "Books are lent for three weeks and films and games for one week, and each loan may be "
    "renewed twice, online, by telephone or at the front desk, unless someone else has "
    "reserved the item.",
    "There are no fines for late returns, but a member who keeps an item more than six weeks "
    "past its date cannot borrow anything else until it comes back.",
    "Lost or damaged items are replaced at the price printed on the label inside the cover.",
    "The reading room has forty seats, free wireless internet and six computers, which members "
    "may book for two hours a day.",
    "Printing costs ten pence a page in black and white and forty pence a page in colour, and "
    "the printer on the first floor also scans documents for free.",
    "The children's corner holds a story time every Tuesday and Friday at half past ten, and a "
    "homework club for older pupils on weekday afternoons during the school term.",
    "The local history archive keeps old maps, parish records, newspapers going back to 1850 "
    "and photographs of the town, which visitors may study by appointment.",
    "Food is not allowed in the reading room, but visitors may drink water from closed bottles "
    "and use the small cafe next to the entrance.",
    "The building has step-free access, a lift to every floor, an accessible toilet and a "
    "hearing loop at the front desk.",
    "When a question concerns a member's own account, ask them to speak to the staff at the "
    "front desk, because you cannot see or change any account.",
]
TOPICS = ["joining the library", "borrowing films", "the reading room computers",
          "printing a document", "story time for children", "the local history archive",
          "returning a book late", "visiting with a wheelchair", "the opening hours",
          "renewing a loan", "the homework club", "lost books"]
TURNS = ["I have a question about {t}. What should I know first?",
         "Thank you. Is there anything about {t} that costs money?",
         "Can you give me one practical tip about {t}?",
         "Please sum up what you told me about {t} in two sentences.",
         "One last thing about {t}: who can I ask if I need more help?",
         "And is there anything else about {t} that visitors often forget?"]


@functools.cache
def tokenizer(gguf: str):
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.formats.tokenizer import Tokenizer
    return Tokenizer.from_source(load_checkpoint(gguf, with_weights=False).tokenizer_source)


def n_tokens(gguf: str, text: str) -> int:
    return len(tokenizer(gguf).encode(text, add_bos=False))


def system_prompt(gguf: str, target: int) -> tuple[str, int]:
    """The fixed paragraph, its sentences repeated in order until `target` tokens."""
    sentences, k = [], 0
    while n_tokens(gguf, " ".join(sentences)) < target:
        sentences.append(SYSTEM_SENTENCES[k % len(SYSTEM_SENTENCES)])
        k += 1
    text = " ".join(sentences)
    return text, n_tokens(gguf, text)


async def conversations(url: str, system: str, args) -> list[list[dict]]:
    """Each conversation's turns: TTFT, cached and prompt tokens, error."""
    async with http_client() as client:
        await sse_request(client, url, chat_body("Hello! Who are you?", 8))  # warm-up

        async def conversation(k: int) -> list[dict]:
            history, turns = [{"role": "system", "content": system}], []
            topic = TOPICS[k % len(TOPICS)] + (f" (question set {k // len(TOPICS) + 1})"
                                               if k >= len(TOPICS) else "")
            for t in range(args.chat_turns):
                history.append({"role": "user",
                                "content": TURNS[t % len(TURNS)].format(t=topic)})
                rec = await sse_request(client, url, chat_body(list(history), args.chat_tokens))
                out = outcome(rec)
                turns.append({"ttft": out.get("ttft"), "error": out.get("error"),
                              "cached": cached_tokens(rec), "prompt_tokens": prompt_tokens(rec),
                              "tokens": out.get("tokens")})
                history.append({"role": "assistant", "content": rec["text"]})
            return turns

        return list(await asyncio.gather(*(conversation(k)
                                           for k in range(args.chat_conversations))))


def scenario_chat(args, gguf: str) -> dict:
    system, n_system = system_prompt(gguf, args.system_tokens)
    print(f"  chat: the shared system prompt is {n_system} tokens ({len(system)} characters)",
          flush=True)
    runs = []
    with our_server(args) as server:
        runs.append((SERVE + " (prefix cache)", asyncio.run(conversations(server.url, system,
                                                                          args))))
    with our_server(args, ["--no-prefix-cache"]) as server:
        runs.append((SERVE + " --no-prefix-cache",
                     asyncio.run(conversations(server.url, system, args))))
    if not args.skip_llama:
        n = args.chat_conversations
        with llama_server(args, gguf, n, 2048 * n) as url:
            runs.append((LLAMA_NAME + " (cache_prompt)",
                         asyncio.run(conversations(url, system, args))))
    T = args.chat_turns
    out = ["| system | " + " | ".join(f"turn {t + 1}" for t in range(T)) +
           f" TTFT p50 ms | mean cached tokens turns 2-{T} | errors |",
           "|---|" + "---:|" * (T + 2)]
    rows, notes = [], []
    for name, convs in runs:
        ttft = [pct([c[t]["ttft"] for c in convs if c[t]["ttft"] is not None], .5) * 1e3
                for t in range(T)]
        later = [c[t]["cached"] for c in convs for t in range(1, T) if c[t]["cached"] is not None]
        cached = sum(later) / len(later) if later else float("nan")
        errors = sum(1 for c in convs for t in c if t["error"])
        out.append(f"| {name} | " + " | ".join(f"{x:.0f}" for x in ttft) +
                   f" | {cached:.0f} | {errors} |")
        per_turn = [[c[t]["cached"] for c in convs] for t in range(T)]
        prompts = [[c[t]["prompt_tokens"] for c in convs] for t in range(T)]
        notes.append(f"- {name}: cached tokens per turn (each conversation) {per_turn}; prompt "
                     f"tokens {prompts}")
        kinds = sorted({t["error"][:80] for c in convs for t in c if t["error"]})
        if kinds:
            notes.append(f"- errors of {name}: {kinds}")
        rows.append({"system": name, "ttft_p50_ms": ttft, "mean_cached_later_turns": cached,
                     "errors": errors, "turns": convs})
    settings = (f"chat: {args.chat_conversations} conversations x {args.chat_turns} turns, "
                f"shared system prompt of {n_system} tokens, {args.chat_tokens} output tokens "
                f"a turn, greedy, ignore_eos; powerinfer serve defaults"
                + ("" if args.skip_llama else f"; llama-server -t {args.threads} --parallel "
                   f"{args.chat_conversations} -c {2048 * args.chat_conversations}"))
    return {"settings": settings, "table": "\n".join(out + [""] + notes), "rows": rows,
            "system_prompt_tokens": n_system}


SUBJECTS = ["The old lighthouse keeper", "A young engineer from the coast", "The city council",
            "Our neighbour's patient dog", "The slow brown river", "A travelling merchant",
            "The village baker", "A group of curious students", "The night train to the north",
            "The museum curator", "A small fishing boat"]
VERBS = ["noticed", "repaired", "described", "carried home", "painted", "measured", "forgot",
         "praised", "visited", "studied", "collected", "announced", "questioned"]
OBJECTS = ["a broken clock", "the northern bridge", "three wooden chairs",
           "the harvest festival", "an unusual map", "the morning newspaper",
           "a basket of green apples", "the east wall of the castle", "a forgotten letter",
           "the winter timetable", "a pair of silver keys", "the garden behind the school",
           "a long list of names", "the storm warning", "a blue umbrella", "the price of bread",
           "an old photograph of the harbour"]
WHEN = ["before sunrise", "after the long meeting", "during the first snow of the year",
        "on a quiet Sunday", "while everyone else was asleep", "at the end of the summer",
        "just before the market opened"]


def document(gguf: str, target: int, seed: int) -> tuple[str, int]:
    """A plain-text report of about `target` tokens: varied sentences in paragraphs of six;
    another seed starts and goes on differently."""
    sentences, i = [], 0
    text = ""
    while True:
        s = (f"{SUBJECTS[(i + seed) % 11]} {VERBS[(3 * i + 5 * seed) % 13]} "
             f"{OBJECTS[(7 * i + 2 * seed) % 17]} {WHEN[(5 * i + seed) % 7]}.")
        sentences.append(s)
        i += 1
        text = "\n\n".join(" ".join(sentences[j:j + 6]) for j in range(0, len(sentences), 6))
        if n_tokens(gguf, text) >= target:
            break
    return text, n_tokens(gguf, text)


LONG_ASK = "Read this report and list the three events in it that matter most.\n\n"


async def interference(url: str, docs: list[str], args) -> dict:
    async with http_client() as client:
        # warm-up: a long prompt of a third document, so that "alone" is not the first one
        await sse_request(client, url, chat_body(LONG_ASK + docs[2], 16))
        alone = await sse_request(client, url, chat_body(LONG_ASK + docs[0], 16))
        recs = [new_record() for _ in range(args.long_streams)]
        started = asyncio.Event()

        def counted():
            if all(len(r["stamps"]) >= 20 for r in recs):
                started.set()

        streams = [asyncio.create_task(sse_request(
            client, url, chat_body(PROMPTS[k % len(PROMPTS)], args.long_stream_tokens), rec,
            counted)) for k, rec in enumerate(recs)]
        try:
            await asyncio.wait_for(started.wait(), 600)
            t_send = time.perf_counter()
            under = await sse_request(client, url, chat_body(LONG_ASK + docs[1], 16))
            t_first = under["stamps"][0] if under["stamps"] else time.perf_counter()
            # every stream's gap across the window ends with a token after the first one
            deadline = time.perf_counter() + 60
            while time.perf_counter() < deadline and not all(
                    r["stamps"] and r["stamps"][-1] > t_first for r in recs if not r["error"]):
                await asyncio.sleep(0.05)
            alive = sum(1 for r, t in zip(recs, streams) if not t.done())
        finally:
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    before, during = [], []
    for r in recs:
        for a, b in zip(r["stamps"], r["stamps"][1:]):
            if b <= t_send:
                before.append(b - a)
            elif a < t_first:
                during.append(b - a)
    return {"alone_ttft": outcome(alone).get("ttft"), "alone_error": alone["error"],
            "alone_cached": cached_tokens(alone), "alone_prompt": prompt_tokens(alone),
            "under_ttft": outcome(under).get("ttft"), "under_error": under["error"],
            "under_cached": cached_tokens(under), "under_prompt": prompt_tokens(under),
            "itl_before_p50": pct(before, .5), "itl_during_p50": pct(during, .5),
            "itl_during_p99": pct(during, .99), "itl_during_max": max(during, default=float("nan")),
            "gaps_before": len(before), "gaps_during": len(during),
            "streams_alive_after": alive, "stream_errors": [r["error"] for r in recs
                                                            if r["error"]]}


def scenario_long(args, gguf: str) -> dict:
    docs = [document(gguf, args.long_tokens, seed) for seed in (0, 1, 2)]
    print(f"  long: documents of {docs[0][1]} and {docs[1][1]} tokens", flush=True)
    docs = [d for d, _ in docs]
    runs = []
    with our_server(args) as server:
        runs.append((SERVE + " (chunked prefill)", asyncio.run(interference(server.url, docs,
                                                                            args))))
    with our_server(args, ["--prefill-chunk", "0"]) as server:
        runs.append((SERVE + " --prefill-chunk 0",
                     asyncio.run(interference(server.url, docs, args))))
    if not args.skip_llama:
        n = args.long_streams + 1
        with llama_server(args, gguf, n, 2600 * n) as url:
            runs.append((LLAMA_NAME, asyncio.run(interference(url, docs, args))))
    out = ["| system | long TTFT alone ms | long TTFT under load ms (ratio) | stream ITL p50 "
           "before ms | ITL p50 / p99 / max during ms |", "|---|---:|---:|---:|---:|"]
    notes = []

    def ms(x):
        return "-" if x is None or x != x else f"{x * 1e3:.0f}"
    for name, r in runs:
        ratio = (f" ({r['under_ttft'] / r['alone_ttft']:.1f}x)"
                 if r["under_ttft"] and r["alone_ttft"] else "")
        out.append(f"| {name} | {ms(r['alone_ttft'])} | {ms(r['under_ttft'])}{ratio} | "
                   f"{r['itl_before_p50'] * 1e3:.1f} | {r['itl_during_p50'] * 1e3:.1f} / "
                   f"{r['itl_during_p99'] * 1e3:.1f} / {r['itl_during_max'] * 1e3:.1f} |")
        notes.append(f"- {name}: long prompt {r['alone_prompt']} / {r['under_prompt']} tokens "
                     f"(cached {r['alone_cached']} / {r['under_cached']}); gaps counted before "
                     f"{r['gaps_before']}, during {r['gaps_during']}; streams still running "
                     f"after {r['streams_alive_after']} of {args.long_streams}"
                     + "".join(f"; {k}: {r[k]}" for k in ("alone_error", "under_error",
                                                           "stream_errors") if r[k]))
    settings = (f"long: a {args.long_tokens}-token prompt (16 output tokens) alone, then beside "
                f"{args.long_streams} streams of {args.long_stream_tokens} tokens once each has "
                f"20; powerinfer serve defaults (prefill chunk 512)"
                + ("" if args.skip_llama else f"; llama-server -t {args.threads} --parallel "
                   f"{args.long_streams + 1} -c {2600 * (args.long_streams + 1)}"))
    return {"settings": settings, "table": "\n".join(out + [""] + notes),
            "rows": [{"system": n, **r} for n, r in runs]}


def ready_stats(server, wait: float = 180) -> dict:
    """stats() once the model answers them again ({} or an error while its group is rebuilt)."""
    deadline = time.perf_counter() + wait
    while True:
        try:
            st = server.stats(10)
            if st.get("pids"):
                return st
        except Exception:  # noqa: BLE001 - rebuilding: retry
            if time.perf_counter() > deadline:
                raise
        if time.perf_counter() > deadline:
            raise TimeoutError(f"stats() without pids for {wait} s: {st}")
        time.sleep(0.2)


def killer(server, t0: float, times: list[float], log: list[dict]):
    """SIGKILL the cold executor, then the scheduler (pids read again after the first rebuild);
    time each recovery: stats()["restarts"] up by one, then GET /health 200."""
    try:
        for at, target in zip(times, ["cold.0", "scheduler"]):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            st = ready_stats(server)
            pid, restarts = st["pids"][target], st["restarts"]
            os.kill(pid, signal.SIGKILL)
            t_kill = time.perf_counter()
            ev = {"target": target, "pid": pid, "at_s": t_kill - t0, "restarts_s": None,
                  "healthy_s": None, "saw_unhealthy": False, "stats_missing": []}
            log.append(ev)
            while time.perf_counter() < t_kill + 180:
                code = http_status(server.url + "/health")
                ev["saw_unhealthy"] |= code != 200
                if ev["restarts_s"] is None:
                    try:
                        st = server.stats(10)
                    except Exception:  # noqa: BLE001
                        st = {}
                    missing = [k for k in ("restarts", "pids") if k not in st]
                    if missing and not ev["stats_missing"]:
                        ev["stats_missing"] = missing  # {} while the group is rebuilt
                    if st.get("restarts", restarts) > restarts:
                        ev["restarts_s"] = time.perf_counter() - t_kill
                        ev["pids_after"] = st.get("pids")
                if ev["restarts_s"] is not None and code == 200:
                    ev["healthy_s"] = time.perf_counter() - t_kill
                    break
                time.sleep(0.1)
            print(f"  kill: {json.dumps(ev)}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported in the table
        log.append({"target": "error", "error": f"{type(e).__name__}: {e}"})
        traceback.print_exc()


async def kill_load(url: str, args, t0: float) -> list[dict]:
    recs = []
    async with http_client() as client:
        async def client_loop(k: int):
            while time.perf_counter() < t0 + args.kill_seconds:
                rec = await sse_request(client, url, chat_body(PROMPTS[k % len(PROMPTS)],
                                                               args.tokens))
                rec["prompt"] = k % len(PROMPTS)
                recs.append(rec)

        await asyncio.gather(*(client_loop(k) for k in range(args.kill_clients)))
    return recs


def scenario_kill(args, gguf: str) -> dict:
    times = [args.kill_seconds * 10 / 40, args.kill_seconds * 25 / 40]
    # (a cold executor named: it is killed; on one core the server would run one executor)
    with our_server(args, ["--cold-executors", "1"]) as server:
        asyncio.run(http_load(server.url, 8, 1, 1, warm=False))  # warm-up
        before = server.stats()
        log: list[dict] = []
        t0 = time.perf_counter()
        thread = threading.Thread(target=killer, args=(server, t0, times, log), daemon=True)
        thread.start()
        recs = asyncio.run(kill_load(server.url, args, t0))
        wall = time.perf_counter() - t0
        thread.join(timeout=400)
        after = ready_stats(server)
    done = [r for r in recs if not r["error"]]
    failed = [r for r in recs if r["error"]]
    exact = [r for r in done if (r["usage"] or {}).get("completion_tokens") == args.tokens]
    exact_chunks = [r for r in done if r["chunks"] == args.tokens]
    gaps = [(b - a, r) for r in recs for a, b in zip(r["stamps"], r["stamps"][1:])]
    longest = max(gaps, key=lambda g: g[0], default=(float("nan"), None))[0]
    texts: dict[int, set] = {}
    for r in done:
        texts.setdefault(r["prompt"], set()).add(r["text"])
    several = {p: len(t) for p, t in texts.items()
               if sum(1 for r in done if r["prompt"] == p) > 1}
    agree = sum(1 for n in several.values() if n == 1)
    out = ["| kill | pid | at s | restarts +1 after s | /health 200 after s | /health went "
           "non-200 |", "|---|---:|---:|---:|---:|---|"]
    for ev in log:
        def s(x):
            return "not within 180 s" if x is None else f"{x:.1f}"
        if "error" in ev:
            out.append(f"| failed: {ev['error']} | | | | | |")
            continue
        out.append(f"| {ev['target']} | {ev['pid']} | {ev['at_s']:.1f} | {s(ev['restarts_s'])} | "
                   f"{s(ev['healthy_s'])} | {'yes' if ev['saw_unhealthy'] else 'no'} |")
    summary = {"requests": len(recs), "completed": len(done), "failed": len(failed),
               "exact_tokens": len(exact), "exact_chunks": len(exact_chunks),
               "longest_gap_s": longest, "prompts_agreeing": agree,
               "prompts_with_several": len(several),
               "restarts": (after.get("restarts", 0) - before.get("restarts", 0)),
               "failure_kinds": sorted({r["error"][:100] for r in failed}),
               "wall_s": wall, "kills": log}
    notes = [f"- requests: {len(recs)}, completed {len(done)}, failed {len(failed)}; completed "
             f"with exactly {args.tokens} tokens: {len(exact)} of {len(done)} by usage, "
             f"{len(exact_chunks)} by chunks; longest gap between two tokens of one stream "
             f"{longest:.2f} s; prompts whose completions all agree (greedy): {agree} of "
             f"{len(several)} with more than one; restarts over the run {summary['restarts']}"]
    if failed:
        notes.append(f"- failures: {summary['failure_kinds']}")
    missing = {k for ev in log for k in ev.get("stats_missing", ())}
    if missing:
        notes.append(f"- stats() lacked {sorted(missing)} for a while after a kill (the group "
                     "was being rebuilt)")
    settings = (f"kill: {args.kill_clients} clients, back-to-back streaming requests of "
                f"{args.tokens} tokens for {args.kill_seconds} s; SIGKILL cold.0 at "
                f"{times[0]:.0f} s, the scheduler at {times[1]:.0f} s; powerinfer serve defaults")
    return {"settings": settings, "table": "\n".join(out + [""] + notes), "summary": summary}


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds so far) of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    return {pid: (process_name(pid, argv, stat), (int(fields[11]) + int(fields[12])) / tick)
            for pid, stat, fields, argv in proc_entries()}


def process_name(pid: int, argv: list[str], stat: str) -> str:
    if pid == os.getpid():
        return "this benchmark"
    if not argv:
        return stat[stat.index("(") + 1:stat.rindex(")")]  # a kernel thread
    first = argv[0]
    if first.startswith("ray::"):
        return first.split(" ")[0].split(".")[0]  # ray::Class, ray::Class.method while it runs
    base = Path(first.split(" ")[0]).name
    if base.startswith("python") and "multiprocessing.spawn" in " ".join(argv):
        return "this benchmark's Ray agent"
    if base.startswith("python") and len(argv) > 2 and argv[1] == "-c":
        return f"{base} -c {argv[2][:40]}"
    if base.startswith("python") and len(argv) > 1:
        script = next((a for a in argv[1:] if not a.startswith("-")), argv[1])
        if script.endswith("powerinfer") or "powerinfer" in Path(script).name:
            return "powerinfer " + " ".join(argv[2:3])
        return f"{base} {Path(script).name}"
    if base == "powerinfer":
        return "powerinfer " + " ".join(argv[1:2])
    return base


def cpu_report(before: dict, after: dict, tokens: int) -> list[dict]:
    by_name: dict[str, dict] = {}
    for pid, (name, t) in after.items():
        spent = t - before.get(pid, (name, 0.0))[1]
        if spent <= 0:
            continue
        e = by_name.setdefault(name, {"process": name, "pids": [], "cpu_s": 0.0})
        e["pids"].append(pid)
        e["cpu_s"] += spent
    rows = sorted(by_name.values(), key=lambda e: -e["cpu_s"])
    for e in rows:
        e["ms_per_token"] = e["cpu_s"] / max(tokens, 1) * 1e3
    return rows


async def serve_handle_load(handle, tokens: int, n: int) -> tuple[list[dict], float]:
    """Hop (b), in the Ray agent: requests through the model deployment's Serve handle."""
    from serve_app.request import GenerationRequest

    handle = handle.options(stream=True)
    sampling = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}

    async def one(i: int) -> dict:
        t0, stamps, error = time.perf_counter(), [], None
        req = GenerationRequest([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                sampling, uuid.uuid4().hex)
        try:
            async for item in handle.generate.remote(req):
                if "error" in item:
                    error = str(item["error"])
                    break
                now = time.perf_counter()
                stamps += [now for ev in item["events"] if ev["token"] >= 0]
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        return result(t0, stamps, error)

    await one(0)
    return await drive(one, 1, n)


async def grpc_load(args, port: int, n: int) -> tuple[list[dict], float]:
    import grpc

    from powerinfer.v1 import inference_pb2 as pb
    from powerinfer.v1 import inference_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        sampling = pb.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

        async def one(i: int) -> dict:
            t0, stamps, error, tokens = time.perf_counter(), [], None, None
            try:
                async for resp in stub.Generate(pb.GenerateRequest(
                        model="m", text=PROMPTS[i % len(PROMPTS)], sampling=sampling)):
                    now = time.perf_counter()
                    stamps += [now] * len(resp.tokens)
                    if resp.HasField("usage"):
                        tokens = resp.usage.completion_tokens
            except grpc.RpcError as e:
                error = f"{e.code()}: {e.details()}"
            return result(t0, stamps, error, tokens)

        await one(0)
        return await drive(one, 1, n)


async def http_hop(url: str, args, n: int) -> tuple[list[dict], float, list[dict]]:
    async with http_client() as client:
        async def one(i: int) -> dict:
            return outcome(await sse_request(client, url, chat_body(PROMPTS[i % len(PROMPTS)],
                                                                    args.tokens)))

        await one(0)
        before = cpu_snapshot()
        results, wall = await drive(one, 1, n)
        after = cpu_snapshot()
    tokens = sum(r.get("tokens", 0) for r in results if not r.get("error"))
    return results, wall, cpu_report(before, after, tokens)


def scenario_hops(args, gguf: str) -> dict:
    n = args.hop_requests
    rows = [dict(path="(a) engine handle, in process",
                 **bench_handle(args, [1], n, "(a) engine handle, in process")[0])]
    with our_server(args) as server:
        results, wall = server.agent.call("hop", 600, tokens=args.tokens, n=n)
        rows.append(dict(summarize("(b) Serve handle of Model:m", 1, results, wall)))
        results, wall, cpu = asyncio.run(http_hop(server.url, args, n))
        rows.append(dict(summarize("(c) HTTP: proxy, ingress, model", 1, results, wall)))
        results, wall = asyncio.run(grpc_load(args, server.grpc_port, n))
        rows.append(dict(summarize("(d) gRPC: proxy, ingress, model", 1, results, wall)))
    base = rows[0]["tok_s"]
    out = ["| path | tok/s | vs (a) | TTFT p50 ms | ITL p50 ms | errors |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['system']} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | "
                   f"{r['ttft_p50_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['errors']} |")
        if r["error_kinds"]:
            out.append(f"|   errors: {r['error_kinds']} | | | | | |")
    tokens = rows[2]["tokens"]
    total = sum(e["cpu_s"] for e in cpu)
    out += ["", f"CPU during (c), {tokens} tokens in {rows[2]['wall_s']:.1f} s "
                f"({rows[2]['wall_s'] / max(tokens, 1) * 1e3:.1f} ms of wall time a token, "
                f"{os.cpu_count()} cores):", "",
            "| process | pids | CPU ms per token | share |", "|---|---|---:|---:|"]
    for e in cpu:
        if e["ms_per_token"] < 0.05:
            continue
        pids = ", ".join(map(str, e["pids"][:4])) + (" ..." if len(e["pids"]) > 4 else "")
        out.append(f"| {e['process']} | {pids} | {e['ms_per_token']:.2f} | "
                   f"{e['cpu_s'] / total:.0%} |")
    out.append(f"| all | | {total / max(tokens, 1) * 1e3:.2f} | 100% |")
    settings = (f"hops: concurrency 1, {n} requests of {args.tokens} tokens after one "
                f"unmeasured, greedy, ignore_eos; powerinfer serve defaults; (d) is Generate "
                f"with the text prompt, the others the chat template")
    return {"settings": settings, "table": "\n".join(out), "rows": rows, "cpu": cpu}


# ---------------------------------------------------------------------------------- report

# ------------------------------------------------------------------------------- memory

def pss_mib(pid: int) -> float | None:
    """A process's proportional set size (its own pages, plus its share of those it shares)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def server_tree(server) -> dict[int, str]:
    """pid -> command line of a server started by `our_server` and of its descendants."""
    return {server.proc.pid: " ".join(server.proc.args), **descendants(server.proc.pid)}


def maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


ROLES = (("ServeReplica:powerinfer:Ingress", "ingress", "serve"),
         ("ServeReplica:powerinfer:Model:", "model replica", "model"),
         ("ray::Scheduler", "scheduler", "model"), ("ray::HotExecutor", "hot executor", "model"),
         ("ray::ColdExecutor", "cold executor", "model"),
         ("ray::PredictorActor", "predictor", "model"),
         ("ray::ProxyActor", "Serve proxy", "serve"),
         ("ray::ServeController", "Serve controller", "serve"),
         (" serve --model", "powerinfer serve (driver)", "serve"))


def role_of(cmd: str) -> tuple[str, str]:
    """(role, part) of a process of the server's tree: part "model" (one model's), "serve"
    (Serve's and the driver's: once per host), or "ray" (Ray's own)."""
    for needle, role, part in ROLES:
        if needle in cmd:
            return role, part
    words = cmd.split(" ")
    word = words[1] if Path(words[0]).name.startswith("python") and len(words) > 1 else words[0]
    return f"Ray: {Path(word).name}"[:40], "ray"


def served_memory(args, flags: list[str] = ()) -> tuple[list[dict], list[str]]:
    """PSS of every process of `powerinfer serve` (defaults and `flags`) after the load, by role,
    and the server's own memory lines."""
    rows = []
    with our_server(args, flags) as server:
        asyncio.run(http_load(server.url, args.tokens, args.memory_streams, 1, warm=True))
        time.sleep(2)
        for pid, cmd in sorted(server_tree(server).items()):
            pss = pss_mib(pid)
            if pss is None or pss < 1:  # (gone, or a shell's wrapper)
                continue
            role, part = role_of(cmd)
            rows.append({"pid": pid, "role": role, "part": part, "pss_mib": round(pss, 1),
                         "torch": maps_torch(pid)})
        printed = [line.strip() for line in server.log.read_text(errors="replace").splitlines()
                   if line.strip().startswith(("memory:", "host:"))]
    return rows, printed


def memory_table(rows: list[dict]) -> tuple[list[str], dict]:
    by_part = {k: sum(r["pss_mib"] for r in rows if r["part"] == k) for k in ("model", "serve", "ray")}
    out = ["| process | part | PSS MiB | maps torch |", "|---|---|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["part"], -r["pss_mib"])):
        out.append(f"| {r['role']} | {r['part']} | {r['pss_mib']:.0f} | "
                   f"{'yes' if r['torch'] else 'no'} |")
    out.append(f"| **one model's processes** | model | {by_part['model']:.0f} | |")
    out.append(f"| **Serve, its proxy and ingress, the driver** | serve | {by_part['serve']:.0f} | |")
    out.append(f"| **Ray's own** | ray | {by_part['ray']:.0f} | |")
    out.append(f"| **all** | | {sum(by_part.values()):.0f} | |")
    return out, by_part


def scenario_memory(args, gguf: str) -> dict:
    """PSS of every process of `powerinfer serve` (defaults) after `--memory-streams` streams of
    `--tokens` tokens, by role, and whether each maps torch; the same for a server with the
    `--tuned` flags where given (its own table, labelled); beside llama-server's one process
    after the same load."""
    rows, printed = served_memory(args)
    tuned = served_memory(args, shlex.split(args.tuned)) if args.tuned else None
    llama = None
    if not args.skip_llama:
        n = args.memory_streams
        with llama_server(args, gguf, n, 2048 * n) as url:
            asyncio.run(http_load(url, args.tokens, n, 1, warm=True))
            port = url.rsplit(":", 1)[1]
            pid = next(p for p, (_, cmd) in processes().items()
                       if cmd.split(" ")[0].endswith("llama-server") and port in cmd)
            llama = pss_mib(pid)
    out, by_part = memory_table(rows)
    if llama is not None:
        out.append(f"| {LLAMA_NAME} (one process) | | {llama:.0f} | no |")
    notes = [f"- the server's own lines at start: {'; '.join(printed)}"] if printed else []
    result = {"rows": rows, "by_part_mib": by_part, "llama_mib": llama, "printed": printed}
    if tuned is not None:
        t_out, t_by_part = memory_table(tuned[0])
        notes += ["", f"tuned: `powerinfer serve --model M {args.tuned}`", "", *t_out, ""]
        if tuned[1]:
            notes.append(f"- the tuned server's own lines at start: {'; '.join(tuned[1])}")
        result["tuned"] = {"flags": args.tuned, "rows": tuned[0], "by_part_mib": t_by_part,
                           "printed": tuned[1]}
    settings = (f"memory: `powerinfer serve --model M` (defaults), PSS read from "
                f"/proc/PID/smaps_rollup after {args.memory_streams} concurrent streams of "
                f"{args.tokens} tokens; llama-server --parallel {args.memory_streams}")
    return {"settings": settings, "table": "\n".join(out + [""] + notes), **result}


def wait_models_ready(url: str, names: list[str], proc: subprocess.Popen, timeout: float = 900):
    """Until /health reports every model of `names` ready (a failed one raises)."""
    import httpx2 as httpx
    deadline, states = time.time() + timeout, {}
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(Exception):
            states = {m["id"]: m["status"] for m in httpx.get(f"{url}/health").json()["models"]}
        if any(states.get(n) == "failed" for n in names):
            raise RuntimeError(f"a model failed to load: {states}")
        if all(states.get(n) == "ready" for n in names):
            return
        time.sleep(1)
    raise RuntimeError(f"not every model ready after {timeout} s: {states}")


def scenario_models(args, gguf: str) -> dict:
    """Several models served by one `powerinfer serve` (`--models`: by default two families, two
    of each, every setting the server's default), all under load at once (`--memory-streams`
    streams of `--tokens` tokens to each): each one's rate and errors, then each one's memory
    (PSS of its processes: its group's and its replica's) against the issue's bound (its weights
    + its KV cache's pages in use + 0.5 GiB), and the rest of the server's tree (Ray, Serve, the
    driver) against 1 GiB a host."""
    from powerinfer.formats.loader import resolve_model
    import yaml
    # --model-setting KEY=VALUE: a setting of every model (a value read as YAML: 0, true, a name)
    settings = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.model_setting)}
    names, seen = [], {}
    for m in args.models:
        seen[m] = seen.get(m, 0) + 1
        names.append(f"{Path(m).stem.split('-')[0]}-{seen[m]}")

    def models_file(d: str) -> Path:
        config = Path(d) / "models.yaml"
        config.write_text(yaml.safe_dump({"models": [
            {"name": n, "model": str(resolve_model(m)), **settings}
            for n, m in zip(names, args.models)]}))
        return config

    rows = []
    with tempfile.TemporaryDirectory(prefix="powerinfer-bench-models-") as d, \
            our_server(args, config=models_file(d)) as server:
        wait_models_ready(server.url, names, server.proc)
        for n in names:  # one unmeasured request each
            asyncio.run(http_load(server.url, 8, 1, 1, warm=False, model=n))

        async def everyone():
            return await asyncio.gather(*(http_load(server.url, args.tokens, args.memory_streams,
                                                    1, warm=False, model=n) for n in names))

        t0 = time.perf_counter()
        loads = asyncio.run(everyone())
        wall = time.perf_counter() - t0
        time.sleep(2)
        tree = {pid: pss_mib(pid) for pid in server_tree(server)}
        total = sum(v for v in tree.values() if v)
        for n, (results, w) in zip(names, loads):
            mem = server.agent.call("memory", 120, timeout=120, model=n)
            s = summarize(n, args.memory_streams, results, w)
            pss = sum(p["pss"] for p in mem.values()) / 2**20
            weights = sum(p["weight"] for p in mem.values()) / 2**20
            kv = sum(p["kv_resident"] for p in mem.values()) / 2**20
            bound = weights + kv + 512
            rows.append({"model": n, "processes": len(mem), "tok_s": s["tok_s"],
                         "errors": s["errors"], "ttft_p50_ms": s["ttft_p50_ms"],
                         "pss_mib": pss, "weights_mib": weights, "kv_used_mib": kv,
                         "bound_mib": bound, "over_mib": pss - bound,
                         "own_mib": {k: round((p["pss"] - p["weight"] - p["kv_resident"]) / 2**20)
                                     for k, p in mem.items()}})
        printed = [line.strip() for line in server.log.read_text(errors="replace").splitlines()
                   if line.strip().startswith(("memory:", "host:"))]
    models_mib = sum(r["pss_mib"] for r in rows)
    rest = total - models_mib
    out = ["| model | processes | tok/s under load | errors | PSS MiB | weights | KV in use | "
           "bound (weights + KV + 512) | over the bound | each process's own MiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        own = ", ".join(f"{k} {v}" for k, v in r["own_mib"].items())
        out.append(f"| {r['model']} | {r['processes']} | {r['tok_s']:.1f} | {r['errors']} | "
                   f"{r['pss_mib']:.0f} | {r['weights_mib']:.0f} | {r['kv_used_mib']:.0f} | "
                   f"{r['bound_mib']:.0f} | {r['over_mib']:+.0f} | {own} |")
    bounds = sum(r["bound_mib"] for r in rows)
    out.append(f"| **the models** | {sum(r['processes'] for r in rows)} | "
               f"{sum(r['tok_s'] for r in rows):.1f} | {sum(r['errors'] for r in rows)} | "
               f"{models_mib:.0f} | | | {bounds:.0f} | {models_mib - bounds:+.0f} | |")
    out.append(f"| **Ray, Serve, the driver** (the rest of the tree) | | | | {rest:.0f} | | | "
               f"1024 | {rest - 1024:+.0f} | |")
    out.append(f"| **the server's tree** | {len(tree)} | | | {total:.0f} | | | "
               f"{bounds + 1024:.0f} | {total - bounds - 1024:+.0f} | |")
    notes = [f"- all {len(names)} models under load together for {wall:.1f} s"]
    if printed:
        notes.append(f"- the server's own lines at start: {'; '.join(printed)}")
    settings = (f"models: `powerinfer serve --config` with {', '.join(names)} (files "
                f"{', '.join(dict.fromkeys(args.models))}), "
                + (f"every model with {settings}, " if settings else "")
                + "every other setting the default; "
                f"{args.memory_streams} streams of {args.tokens} tokens to each model at once; "
                f"PSS from /proc/PID/smaps_rollup after the load")
    return {"settings": settings, "table": "\n".join(out + [""] + notes), "rows": rows,
            "total_mib": total, "rest_mib": rest, "wall_s": wall}


def answered_after(url: str, t0: float, timeout: float = 300) -> float:
    """Seconds from t0 until a one-token completion is answered 200 (asked every 0.1 s)."""
    import httpx2 as httpx
    body = {"model": "m", "prompt": "Hello", "max_tokens": 1}
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200:
                return time.perf_counter() - t0
        time.sleep(0.1)
    raise TimeoutError(f"no answer from {url} in {timeout} s")


def scenario_lifecycle(args, gguf: str) -> dict:
    """What an operator waits for: from the command to the first answer, from SIGKILL of the
    model's replica (Serve starts another, which builds a new actor group) to the next answer,
    and from SIGTERM to the server's exit; --lifecycle-turns servers one after another."""
    rows = []
    for turn in range(args.lifecycle_turns):
        t0 = time.perf_counter()
        with our_server(args) as server:
            start = answered_after(server.url, t0)
            replica = next(p for p, cmd in descendants(server.proc.pid).items()
                           if "ServeReplica:powerinfer:Model:" in cmd)
            t1 = time.perf_counter()
            os.kill(replica, signal.SIGKILL)
            back = answered_after(server.url, t1)
            t2 = time.perf_counter()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=120)
            rows.append({"start_s": start, "replica_back_s": back,
                         "stop_s": time.perf_counter() - t2, "exit_code": code})
        print(f"  turn {turn + 1}: {rows[-1]}", flush=True)
    out = ["| turn | command to first answer, s | replica SIGKILLed to next answer, s | "
           "SIGTERM to exit, s (code) |", "|---:|---:|---:|---:|"]
    out += [f"| {i + 1} | {r['start_s']:.1f} | {r['replica_back_s']:.1f} | {r['stop_s']:.1f} "
            f"({r['exit_code']}) |" for i, r in enumerate(rows)]
    return {"settings": f"lifecycle: `powerinfer serve --model M` (defaults), "
                        f"{args.lifecycle_turns} servers one after another",
            "table": "\n".join(out), "rows": rows}


SCENARIOS = {"load": scenario_load, "chat": scenario_chat, "long": scenario_long,
             "kill": scenario_kill, "hops": scenario_hops, "memory": scenario_memory,
             "models": scenario_models, "lifecycle": scenario_lifecycle}


def machine() -> str:
    names = [line.split(":", 1)[1].strip() for line in
             Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t")
    ap.add_argument("--tuned", default="", help="extra `powerinfer serve` flags (one string) "
                                                "for a labelled 'tuned' row in load and memory")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--llama-isa", choices=list(LLAMA_ISAS), default="native",
                    help="the class llama-server is built for: native (this CPU's, without AMX), "
                         "or avx2 / avx512 (an older CPU's, beside --tuned \"--cpu-isa ...\")")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama-server --no-repack (its weights not repacked for this CPU: what "
                         "runs on Xeons with AMX did before 2026-11-30)")
    ap.add_argument("--skip-handle", action="store_true", help="no in-process engine rows in load")
    ap.add_argument("--out", default=None, help="write every scenario's results as JSON here")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--tokens", type=int, default=128, help="output tokens a request (load, kill, "
                                                           "hops)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the load scenario's requests sampled at this temperature (each system "
                         "with its own defaults for top-k, top-p and min-p; 0: greedy)")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--chat-conversations", type=int, default=8)
    ap.add_argument("--chat-turns", type=int, default=4)
    ap.add_argument("--chat-tokens", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--long-streams", type=int, default=8)
    ap.add_argument("--long-stream-tokens", type=int, default=400)
    ap.add_argument("--kill-seconds", type=float, default=40)
    ap.add_argument("--kill-clients", type=int, default=8)
    ap.add_argument("--hop-requests", type=int, default=3)
    ap.add_argument("--memory-streams", type=int, default=8)
    ap.add_argument("--lifecycle-turns", type=int, default=3)
    ap.add_argument("--models", nargs="+",
                    default=["smollm2-135m-instruct"] * 2 + ["gemma3-270m"] * 2,
                    help="the models scenario's models, one entry each (twice: served twice)")
    ap.add_argument("--model-setting", action="append", default=[], metavar="KEY=VALUE",
                    help="the models scenario: a setting of every model in its models file "
                         "(e.g. cold_executors=0); repeat for more")
    args = ap.parse_args()
    if args.chat_turns < 2:
        ap.error("--chat-turns: at least 2")
    global LLAMA_ISA, LLAMA_NO_REPACK
    LLAMA_ISA, LLAMA_NO_REPACK = args.llama_isa, args.llama_no_repack

    from powerinfer.formats.loader import resolve_model
    gguf = str(resolve_model(args.model))
    started = datetime.datetime.now()
    results, failed = {}, []
    for name in [s for s in SCENARIOS if s in args.scenarios]:
        print(f"== {name}", flush=True)
        try:
            results[name] = SCENARIOS[name](args, gguf)
        except Exception:  # noqa: BLE001 - the other scenarios still run and report
            traceback.print_exc()
            failed.append(name)
    for name, r in results.items():
        print(f"\n### {name}\n\n- Date: {started:%Y-%m-%d}; machine: {machine()}; model: "
              f"{Path(gguf).name}; llama-server built for {LLAMA_ISA}"
              f"{', --no-repack' if LLAMA_NO_REPACK else ''}; {r['settings']}\n")
        print(r["table"])
    if failed:
        print(f"\nscenarios that failed: {', '.join(failed)}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": f"{started:%Y-%m-%d %H:%M}", "machine": machine(), "model": Path(gguf).name,
            # (a path given names only its file: a results file says nothing of the machine's
            # folders)
            "argv": [Path(a).name if os.sep in a else a for a in sys.argv[1:]],
            "failed": failed, "scenarios": results}, indent=1,
            default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
