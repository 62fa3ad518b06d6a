#!/usr/bin/env python3
"""The server under load, beside llama.cpp's own `llama-server`, in one run.

    .venv/bin/python benchmarks/serve.py [--model smollm2-135m-instruct] [--concurrency 1 8 32]
        [--tokens 128] [--rounds 2] [--threads 2] [--dtype float32] [--skip-llama] [--out FILE]

One asyncio load generator drives every system the same way: `concurrency` clients, each sending
`rounds` streaming chat requests one after another (fixed prompts, `tokens` output tokens,
ignore_eos, greedy), and records per request the time to the first token and the gaps between
tokens. Systems, one at a time on the same GGUF and thread count:

1. `powerinfer serve` (Ray Serve HTTP, actor runtime), max_batch = the largest concurrency;
2. the same load on the engine handle called directly in this process (`ActorEngine.agenerate`,
   same configuration): the difference is the cost of the Serve hop (proxy, ingress, model
   deployment);
3. llama.cpp's `llama-server` (continuous batching, `--parallel` = the concurrency), built with
   CMake from the llama.cpp sources vendored in the llama-cpp-python 0.3.36 sdist into
   `benchmarks/.llama-server` on first use (a few minutes on 2 cores).

For the server it also reads the model's mean prefill time from the scheduler's counters (over
Ray, with this user's token), so that time to first token can be set against it.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent

LLAMA_VERSION = "0.3.36"
LLAMA_DIR = ROOT / "benchmarks" / ".llama-server"
PROMPTS = ["Tell me about the history of Paris.", "Write a short poem about the sea.",
           "Explain how a bicycle works.", "What should I pack for a trip to the mountains?",
           "Describe your favourite meal.", "How do plants make food from sunlight?",
           "Give me three tips for learning a new language.", "What is a black hole?"]


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


async def http_load(url: str, model: str, tokens: int, c: int, rounds: int,
                    warm: bool) -> tuple[list[dict], float]:
    """Streaming chat requests to an OpenAI-compatible server (after one unmeasured if warm)."""
    import httpx2 as httpx

    # a connection a request: llama-server drops idle kept-alive connections under load
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(i: int) -> dict:
            body = {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
            t0 = time.perf_counter()
            stamps, error, usage = [], None, None
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = str(chunk["error"].get("message"))
                        elif chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                            stamps.append(time.perf_counter())
                        usage = chunk.get("usage") or usage
            except Exception as e:  # noqa: BLE001 - counted as an error of this request
                error = f"{type(e).__name__}: {e}"
            out = result(t0, stamps, error)
            if usage and "tokens" in out:  # chunks that held text back carry no content
                out["tokens"] = usage["completion_tokens"]
            return out

        if warm:
            await one(0)
        return await drive(one, c, rounds)


def result(t0: float, stamps: list[float], error: str | None) -> dict:
    if error or not stamps:
        return {"error": error or "no tokens"}
    return {"tokens": len(stamps), "ttft": stamps[0] - t0,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])]}


# ---------------------------------------------------------------------------- the systems

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 600):
    import httpx2 as httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_ours(args, levels: list[int]) -> tuple[list[dict], dict]:
    port, grpc_port = free_port(), free_port()
    log = open(Path(tempfile.gettempdir()) / "powerinfer-bench-serve.log", "w")
    cmd = [str(Path(sys.executable).with_name("powerinfer")), "serve", "--model", args.model,
           "--name", "m", "--port", str(port), "--grpc-port", str(grpc_port), "--dtype",
           args.dtype, "--max-batch", str(max(levels)), "--max-queue", "1024",
           "--cold-executors", "1"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rows, prefill = [], {}
    try:
        wait_http(url + "/health", proc)
        import ray
        from ray import serve
        ray.init(address="auto", logging_level="error")
        handle = serve.get_deployment_handle("Model:m", app_name="powerinfer")
        for c in levels:
            before = handle.stats.remote().result()
            results, wall = asyncio.run(http_load(url, "m", args.tokens, c, args.rounds,
                                                  warm=c == levels[0]))
            after = handle.stats.remote().result()
            rows.append(summarize("powerinfer serve (HTTP)", c, results, wall))
            steps = after["prefill_steps"] - before["prefill_steps"]
            prefill[c] = (after["prefill_s"] - before["prefill_s"]) / max(steps, 1) * 1e3
            print(json.dumps(rows[-1]), flush=True)
        ray.shutdown()
    finally:
        stop(proc)
    return rows, prefill


def bench_handle(args, levels: list[int]) -> list[dict]:
    """The same load on the engine handle in this process: no proxy, no ingress, no replica."""
    from actors.handle import ActorEngine
    from powerinfer.config import Config, SamplingParams

    engine = ActorEngine(args.model, Config(runtime="actors", dtype=args.dtype,
                                            max_batch=max(levels), max_queue=1024))
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
            results, wall = asyncio.run(drive(one, c, args.rounds))
            rows.append(summarize("engine handle, no Serve", c, results, wall))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.shutdown()
        import ray
        ray.shutdown()
    return rows


def llama_server_binary() -> Path:
    """llama.cpp's server, built from the sources vendored in the llama-cpp-python sdist."""
    src = LLAMA_DIR / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    binary = src / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    print(f"building llama-server from llama-cpp-python {LLAMA_VERSION}'s sources into "
          f"{LLAMA_DIR} (a few minutes) ...", flush=True)
    LLAMA_DIR.mkdir(parents=True, exist_ok=True)
    sdist = LLAMA_DIR / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", "-d", str(LLAMA_DIR), f"llama-cpp-python=={LLAMA_VERSION}"],
                       check=True)
    subprocess.run(["tar", "xzf", sdist.name], cwd=LLAMA_DIR, check=True)
    subprocess.run(["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j",
                    str(os.cpu_count())], cwd=src, check=True)
    return binary


def bench_llama(args, levels: list[int], gguf: str) -> list[dict]:
    binary = llama_server_binary()
    rows = []
    for c in levels:
        port = free_port()
        # 256 positions a slot: the chat prompt (under 64 tokens) and the output
        cmd = [str(binary), "-m", gguf, "-t", str(args.threads), "--parallel", str(c),
               "-c", str(256 * c), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
        if "amx_tile" in Path("/proc/cpuinfo").read_text():
            cmd.append("--no-repack")  # llama.cpp's AMX repacking crashes on Xeons we tried
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", proc)
            results, wall = asyncio.run(http_load(url, "m", args.tokens, c, args.rounds,
                                                  warm=True))
            rows.append(summarize(f"llama-server {LLAMA_VERSION}", c, results, wall))
            print(json.dumps(rows[-1]), flush=True)
        finally:
            stop(proc)
    return rows


# ---------------------------------------------------------------------------------- report

def table(rows: list[dict], prefill: dict) -> str:
    llama = {r["concurrency"]: r for r in rows if r["system"].startswith("llama-server")}
    out = ["| system | concurrency | tok/s (aggregate) | vs llama-server | TTFT p50 / p99 ms | "
           "ITL p50 / p99 ms | mean prefill ms | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["system"])):
        ref = llama.get(r["concurrency"])
        ratio = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ref else "-"
        pre = f"{prefill[r['concurrency']]:.0f}" if r["system"].startswith("powerinfer") and \
            r["concurrency"] in prefill else "-"
        out.append(f"| {r['system']} | {r['concurrency']} | {r['tok_s']:.1f} | {ratio} | "
                   f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                   f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {pre} | {r['errors']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-handle", action="store_true")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    from powerinfer.loader import resolve_model
    gguf = str(resolve_model(args.model))
    started = datetime.datetime.now()
    rows, prefill = bench_ours(args, args.concurrency)
    if not args.skip_handle:
        rows += bench_handle(args, args.concurrency)
    if not args.skip_llama:
        rows += bench_llama(args, args.concurrency, gguf)
    print(f"\n- Date: {started:%Y-%m-%d}; machine: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; model: {Path(gguf).name}; {args.tokens} tokens a request, "
          f"{args.rounds} requests a client; powerinfer {args.dtype}, llama-server "
          f"{args.threads} threads\n")
    print(table(rows, prefill))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "prefill_ms": prefill}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
