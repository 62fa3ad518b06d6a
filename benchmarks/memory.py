#!/usr/bin/env python3
"""Memory of the actor runtime, per process, beside llama.cpp on the same file, in one run.

    .venv/bin/python benchmarks/memory.py [--model M] [--cold 1,2,4] [--synthetic-layers 8]
        [--skip-synthetic] [--skip-llama] [--out FILE]

For each model (the default one; a synthetic 7B shape `--synthetic-layers` deep) and each count
of cold executors in `--cold`, it starts the model's actor group with the default configuration
(`Config(runtime="actors", cold_executors=n, max_seq_len=512, max_batch=4)`), runs one greedy
request, and reads from every actor: its peak and current resident memory (VmHWM, VmRSS), the
bytes of tensors it holds (weights, and the KV cache in the hot executor) and how long reading
its share of the file took.

- Fixed per-process overhead: the same group on the tiny synthetic model (a 9 MB file); each
  executor's resident memory minus the tensors it holds is what an executor costs with no
  model (Python, torch, Ray's worker). The scheduler holds no tensors: all of its memory
  (the tokenizer included) counts as its overhead.
- The bound checked: the group's summed steady RSS <= 1.3 x the file + the KV cache + the
  summed overhead; the summed peak <= 1.5 x the summed steady; each executor's load <= 2 x
  the time to read the whole file once (from the page cache: it was just read).
- Anchor: llama.cpp's `llama-server` (benchmarks/serve.py builds it) on the same file with the
  same context, resident memory after one request (it maps the file: its pages count).
- The driver (this process) is listed apart: it reads configuration and the tokenizer only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cluster.topology import process_memory  # noqa: E402
from powerinfer import Config, PowerInfer
from powerinfer.formats.loader import DEFAULT_MODEL, load_checkpoint, resolve_model
from powerinfer.sparsity.solver import gpu_bytes

MiB = 1 << 20
MAX_SEQ, MAX_BATCH = 512, 4
PROMPT = "The capital of France is"


def kv_bytes(args, config: Config) -> int:
    """The hot executor's KV cache: every layer's keys and values for each slot (the health
    probe's included) at the full context."""
    return gpu_bytes(args, dtype_bytes=config.torch_dtype.itemsize, batch=config.max_batch + 1,
                     context=config.max_seq_len)["kv_cache"]


def read_once(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * MiB):
            pass
    return time.perf_counter() - t0


def group(model: str, n_cold: int) -> dict:
    """Start the group, run one request, read every actor's memory."""
    config = Config(runtime="actors", cold_executors=n_cold, max_seq_len=MAX_SEQ,
                    max_batch=MAX_BATCH)
    t0 = time.perf_counter()
    pi = PowerInfer.from_pretrained(model, config)
    try:
        start_s = time.perf_counter() - t0
        pi.generate(PROMPT, max_new_tokens=8, temperature=0)
        engine = pi.engine
        st, info = engine.stats()["actors"], engine.group.info
        procs = {}
        for name, s in st.items():
            m = s["memory"]
            procs[name] = {"rss": m["rss"], "hwm": m["hwm"], "anon": m["anon"],
                           "file": m["file"], "held": s.get("held_bytes", 0),
                           "load_s": info.get(name, {}).get("load_s"),
                           "load_cpu_s": info.get(name, {}).get("load_cpu_s")}
        ckpt = load_checkpoint(model, with_weights=False)
        return {"model": Path(str(ckpt.path)).name, "file_bytes": ckpt.info["file_bytes"],
                "cold": n_cold, "start_s": start_s, "weights": engine.config.weights,
                "dtype": engine.config.dtype, "kv_bytes": kv_bytes(ckpt.args, engine.config),
                "procs": procs}
    finally:
        pi.close()


def role(name: str) -> str:
    return name.split(".")[0]


def overheads(tiny: dict) -> dict[str, int]:
    """Per role: resident memory minus the tensors held, on the tiny model's group."""
    out = {}
    for name, p in tiny["procs"].items():
        out[role(name)] = max(out.get(role(name), 0), p["rss"] - p["held"])
    return out


def check(run: dict, over: dict[str, int], read_s: float) -> dict:
    procs = run["procs"].values()
    steady, peak = sum(p["rss"] for p in procs), sum(p["hwm"] for p in procs)
    # the scheduler holds no tensors: all of its memory is its own (the tokenizer included)
    overhead = sum(p["rss"] if role(n) == "scheduler" else over[role(n)]
                   for n, p in run["procs"].items())
    bound = 1.3 * run["file_bytes"] + run["kv_bytes"] + overhead
    held = sum(p["held"] for p in procs) - run["kv_bytes"]
    executors = [p for n, p in run["procs"].items() if role(n) in ("hot", "cold")]
    load = max(p["load_s"] or 0 for p in executors)
    cpu = max(p["load_cpu_s"] or 0 for p in executors)
    return {"steady": steady, "peak": peak, "overhead": overhead, "bound": bound,
            "weights_held": held, "steady_ok": steady <= bound, "peak_ratio": peak / steady,
            "peak_ok": peak <= 1.5 * steady, "load_s": load, "load_cpu_s": cpu, "read_s": read_s,
            "load_ratio": cpu / read_s, "load_ok": cpu <= 2 * read_s}


def llama_rss(path: str, threads: int) -> dict | None:
    from serve import free_port, llama_server_binary, stop, wait_http

    binary = llama_server_binary()
    port = free_port()
    cmd = [str(binary), "-m", path, "-t", str(threads), "--parallel", str(MAX_BATCH),
           "-c", str(MAX_SEQ * MAX_BATCH), "--host", "127.0.0.1", "--port", str(port),
           "--no-webui"]
    log = Path(tempfile.mkdtemp()) / "llama-server.log"  # its output, quoted if it fails to start
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_http(url + "/health", proc, log)
        start_s = time.perf_counter() - t0
        body = json.dumps({"prompt": PROMPT, "n_predict": 8, "temperature": 0}).encode()
        urllib.request.urlopen(urllib.request.Request(url + "/completion", body), timeout=600).read()
        return {**process_memory(proc.pid), "start_s": start_s}
    finally:
        stop(proc)


def on_paper(over: dict[str, int], peak_ratio: float) -> str:
    """A 70B model (Llama-2-70B's shape) in a Q4_0 file, held the way this run measured:
    gate/up rows in the file's blocks, down rows in Q8_0 (`kernels.down_format`), attention as
    int4 (5 bits a weight with its bf16 scales and zeros), the head in Q8_0; the KV cache for 4
    slots of 4096 positions; the measured fixed cost per process and peak/steady ratio."""
    GB = 1e9
    dim, ff, layers, kv_heads, head_dim, vocab = 8192, 28672, 80, 8, 128, 32000
    attn = layers * (2 * dim * dim + 2 * dim * kv_heads * head_dim)
    gate_up, down, emb = layers * 2 * dim * ff, layers * dim * ff, vocab * dim
    file = (attn + gate_up + down + 2 * emb) * 4.5 / 8
    ffn = gate_up * 4.5 / 8 + down * 8.5 / 8
    held = ffn + attn * 5 / 8 + emb * 4.5 / 8 + emb * 8.5 / 8
    kv = layers * 2 * kv_heads * head_dim * 2 * 4 * 4096
    procs = 6  # hot, 4 cold, scheduler
    fixed = over.get("hot", 0) + 4 * over.get("cold", 0) + over.get("scheduler", 0)
    cpu_total = held + kv + fixed
    # with a 24 GB GPU: attention (4-bit on the device), the KV cache and the hottest FFN rows
    gpu_ffn = 24 * GB - attn * 4.5 / 8 - kv - 1.0 * GB  # 1 GB: CUDA context and workspace
    host = ffn - gpu_ffn + emb * 4.5 / 8 + fixed
    lines = ["| 70B Q4_0 | GB |", "|---|---:|",
             f"| file | {file / GB:.1f} |",
             f"| held, CPU only (x file) | {held / GB:.1f} ({held / file:.2f}) |",
             f"| FFN (gate/up Q4_0, down Q8_0) | {ffn / GB:.1f} |",
             f"| KV cache, 4 x 4096 positions | {kv / GB:.1f} |",
             f"| fixed, {procs} processes | {fixed / GB:.1f} |",
             f"| CPU only: steady / peak | {cpu_total / GB:.1f} / {cpu_total * peak_ratio / GB:.1f} |",
             f"| 24 GB GPU: FFN bytes on it (share of the FFN) | {gpu_ffn / GB:.1f} ({gpu_ffn / ffn:.0%}) |",
             f"| 24 GB GPU: host steady / peak | {host / GB:.1f} / {host * peak_ratio / GB:.1f} |"]
    return "\n".join(lines)


def mib(x: float) -> str:
    return f"{x / MiB:,.0f}"


def report(runs: list[dict], over: dict[str, int], checks: list[dict], llama: dict) -> str:
    lines = ["| model | cold | process | peak MiB | steady MiB | holds MiB | load s (CPU s) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in runs:
        for name, p in r["procs"].items():
            load = "" if p["load_s"] is None else f"{p['load_s']:.2f} ({p['load_cpu_s']:.2f})"
            lines.append(f"| {r['model']} | {r['cold']} | {name} | {mib(p['hwm'])} | "
                         f"{mib(p['rss'])} | {mib(p['held'])} | {load} |")
    lines += ["", "Fixed overhead per process (tiny model's group, resident minus held): "
              + ", ".join(f"{k} {mib(v)} MiB" for k, v in over.items()), "",
              "| model | cold | file MiB | KV MiB | weights held MiB (x file) | steady MiB | "
              "bound MiB | peak/steady | executor load s (CPU s) | read file s | start s | "
              "llama-server MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r, c in zip(runs, checks):
        ll = llama.get(r["model"])
        lines.append(
            f"| {r['model']} | {r['cold']} | {mib(r['file_bytes'])} | {mib(r['kv_bytes'])} | "
            f"{mib(c['weights_held'])} ({c['weights_held'] / r['file_bytes']:.2f}) | "
            f"{mib(c['steady'])} {'ok' if c['steady_ok'] else 'OVER'} | {mib(c['bound'])} | "
            f"{c['peak_ratio']:.2f} {'ok' if c['peak_ok'] else 'OVER'} | {c['load_s']:.2f} "
            f"({c['load_cpu_s']:.2f}) | "
            f"{c['read_s']:.2f} ({c['load_ratio']:.1f}x {'ok' if c['load_ok'] else 'OVER'}) | "
            f"{r['start_s']:.1f} | {mib(ll['rss']) if ll else 'n/a'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--cold", default="1,2,4")
    ap.add_argument("--synthetic-layers", type=int, default=8)
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from powerinfer.sparsity.synthetic import write_synthetic

    cold = [int(x) for x in args.cold.split(",")]
    out = {"date": str(datetime.date.today()), "machine": platform.processor() or platform.machine(),
           "cores": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as d:
        tiny = Path(d) / "tiny.gguf"
        write_synthetic(tiny, "tiny", progress=False)
        models = [str(resolve_model(args.model))]
        if not args.skip_synthetic:
            syn = Path(d) / f"synthetic-7b-{args.synthetic_layers}l.gguf"
            print(f"writing {syn.name} ...", flush=True)
            write_synthetic(syn, "7b", n_layers=args.synthetic_layers, progress=True)
            models.append(str(syn))
        over = overheads(group(str(tiny), max(cold)))
        print("overhead per process (MiB):", {k: round(v / MiB) for k, v in over.items()},
              flush=True)
        runs, checks, llama = [], [], {}
        for model in models:
            read_s = read_once(Path(model))  # the page cache holds it now: a warm read
            read_s = min(read_s, read_once(Path(model)))
            for n in cold:
                runs.append(group(model, n))
                checks.append(check(runs[-1], over, read_s))
                print(json.dumps({**runs[-1], **checks[-1]}), flush=True)
            if not args.skip_llama:
                llama[runs[-1]["model"]] = llama_rss(model, args.threads)
                print("llama-server:", json.dumps(llama[runs[-1]["model"]]), flush=True)
    out.update(runs=runs, checks=checks, overhead=over, llama=llama,
               driver=process_memory())
    print(report(runs, over, checks, llama))
    print(f"driver (this process): peak {mib(out['driver']['hwm'])} MiB, "
          f"steady {mib(out['driver']['rss'])} MiB")
    print(on_paper(over, max(c["peak_ratio"] for c in checks)))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
