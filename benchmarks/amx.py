#!/usr/bin/env python3
"""Whether our bf16 paths use AMX where the CPU has it, and what it is worth for prefill.

    .venv/bin/python benchmarks/amx.py [--preset 7b] [--layers 4] [--prompt 512] [--runs 3]
        [--out FILE]

The bf16 prompt path (more than `KernelLinear.KERNEL_ROWS` rows) multiplies with torch's matmul,
which oneDNN serves; oneDNN picks AMX by itself on a CPU that has it (it asks Linux for the tile
state). This script measures, in child processes on the same cores, one with oneDNN free to use
whatever the CPU has and one held to AVX-512 BF16 (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`):

- `probe`: the implementation oneDNN chose for a bf16 matmul (its verbose line names the ISA:
  an `amx` in it, `brg_matmul:avx10_1_512_amx` or `avx512_core_amx` by oneDNN's version, is AMX);
- `gemm`: a prompt-sized bf16 matmul (prompt x dim @ dim x ffn), GFLOP/s;
- `prefill`: the in-process engine's prefill of a `--prompt`-token prompt (one forward over it,
  fresh, `Engine.logits`) on a synthetic model of `--preset`'s shape (its first `--layers`
  blocks, bf16), tokens/s, the median of `--runs` after a warm-up.

The ratio of the two children is what AMX is worth here. On a CPU without AMX both children run
the same code (the ratio is about 1), which says so. Decode (one row) runs the kernel library's
AVX-512 GEMV, not oneDNN, and does not change with the ISA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from powerinfer.cpu import cpu_name

ROOT = Path(__file__).resolve().parent.parent
CAPS = {"native": None, "avx512_bf16": "AVX512_CORE_BF16"}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def child(a) -> dict:
    """One ISA's measurements (run in a process whose environment holds oneDNN's cap)."""
    import torch

    out = {"isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA", "native"), "threads": torch.get_num_threads()}
    x = torch.randn(a.prompt, 4096, dtype=torch.bfloat16)
    w = torch.randn(4096, 11008, dtype=torch.bfloat16)
    for _ in range(3):
        x @ w
    times = []
    for _ in range(10):
        t = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - t)
    out["gemm_gflops"] = 2 * a.prompt * 4096 * 11008 / statistics.median(times) / 1e9

    from powerinfer import Config, PowerInfer
    pi = PowerInfer.from_pretrained(a.model, Config(dtype="bfloat16", weights="dense",
                                                    max_seq_len=a.prompt + 16, max_batch=1))
    ids = [(7 * i) % 1000 + 300 for i in range(a.prompt)]
    pi.engine.logits(ids)  # warm-up
    times = []
    for _ in range(a.runs):
        t = time.perf_counter()
        pi.engine.logits(ids)
        times.append(time.perf_counter() - t)
    out["prefill_tok_s"] = a.prompt / statistics.median(times)
    out["prefill_runs_s"] = times
    return out


def probe(cap: str | None) -> str:
    """The oneDNN implementation of a bf16 matmul under `cap` (its verbose line), or why none."""
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if cap:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    code = ("import torch; a = torch.randn(64, 512, dtype=torch.bfloat16); "
            "b = torch.randn(512, 512, dtype=torch.bfloat16); a @ b")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    lines = [ln for ln in run.stdout.splitlines() if ",exec," in ln and "matmul" in ln]
    if not lines:
        return "no oneDNN matmul ran (torch took another path for bf16 here)"
    fields = lines[-1].split(",")
    impl = next((f for f in fields if ":" in f and ("brg" in f or "gemm" in f or "jit" in f)), None)
    return impl or lines[-1][:200]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    flags = cpu_flags()
    result = {"date": str(datetime.date.today()), "cpu": cpu_name(),
              "cores": len(os.sched_getaffinity(0)),
              "amx": sorted(f for f in flags if f.startswith("amx")),
              "avx512_bf16": "avx512_bf16" in flags, "preset": a.preset, "layers": a.layers,
              "prompt": a.prompt, "runs": {}}
    import torch
    result["torch"] = torch.__version__
    from powerinfer.sparsity.synthetic import write_synthetic
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / f"synthetic-{a.preset}.gguf"
        write_synthetic(model, a.preset, n_layers=a.layers)
        for name, cap in CAPS.items():
            env = dict(os.environ)
            env.pop("ONEDNN_MAX_CPU_ISA", None)
            if cap:
                env["ONEDNN_MAX_CPU_ISA"] = cap
            result["runs"][name] = {"probe": probe(cap)}
            run = subprocess.run([sys.executable, __file__, "--child", "--model", str(model),
                                  "--prompt", str(a.prompt), "--runs", str(a.runs)],
                                 env=env, capture_output=True, text=True, timeout=1800)
            if run.returncode != 0:
                result["runs"][name]["error"] = run.stderr.strip().splitlines()[-1:]
            else:
                result["runs"][name].update(json.loads(run.stdout.strip().splitlines()[-1]))
            print(name, json.dumps(result["runs"][name]), flush=True)
    r = result["runs"]
    if all("prefill_tok_s" in v for v in r.values()):
        result["native_vs_avx512_bf16"] = {
            "gemm": r["native"]["gemm_gflops"] / r["avx512_bf16"]["gemm_gflops"],
            "prefill": r["native"]["prefill_tok_s"] / r["avx512_bf16"]["prefill_tok_s"]}
        print(json.dumps(result["native_vs_avx512_bf16"]), flush=True)
    if not result["amx"]:
        print("this CPU has no AMX: both children ran the same code", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
