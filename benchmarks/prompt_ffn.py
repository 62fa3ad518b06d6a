#!/usr/bin/env python3
"""A prompt's FFN step over neuron records: the time of one many-token step of one layer's share
of neurons (`sparse.NeuronSet` over every neuron, as a prompt runs it) for each record format,
beside the same neurons held in bf16 (the rows already wide: no widening, torch's matmuls) and
beside the path a 4-bit set took before (widened to float32 2,048 neurons at a time into fresh
tensors, then rounded to bf16), in one run.

    .venv/bin/python benchmarks/prompt_ffn.py [--dim 4096] [--neurons 5504] [--tokens 1 2 4 8 15 64 256]
        [--formats q4_0 q4_1 q8_0] [--threads N] [--out FILE]

Random SwiGLU weights; the input is bf16 (the model's dtype). A 7B layer has 11,008 neurons;
5,504 is one executor's half of a dense split on two cores.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from powerinfer import kernels
from powerinfer.model.sparse import NeuronSet


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def previous(s: NeuronSet, x: torch.Tensor) -> torch.Tensor:
    """The many-token path as it was: 2,048 neurons widened to float32 in a fresh tensor, the
    rows rounded to the set's dtype, then the matmuls."""
    y = 0
    for lo in range(0, len(s.idx), 2048):
        w = kernels.widen(s.records[lo:lo + 2048], s.fmt, 3, s.dim).to(s.dtype)
        g, u = x @ w[:, 0].t(), x @ w[:, 1].t()
        y = y + (torch.nn.functional.silu(g) * u) @ w[:, 2]
    return y


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--neurons", type=int, default=5504)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 15, 64, 256])
    ap.add_argument("--formats", nargs="+", default=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit("the kernel library does not run here")
    torch.manual_seed(0)
    k, dim = args.neurons, args.dim
    rows = tuple(torch.randn(k, dim) * 0.02 for _ in range(3))
    sets = {f: NeuronSet.from_rows("swiglu", torch.arange(k), f, torch.bfloat16, dim, rows=rows)
            for f in ["bf16", *args.formats]}
    result = {"date": str(datetime.date.today()), "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "dim": dim, "neurons": k, "rows": []}
    print("| tokens | bf16 rows (ms) | " + " | ".join(
        f"{f} (ms) | x bf16 | {f} before (ms)" for f in args.formats) + " |")
    for T in args.tokens:
        x = torch.randn(1, T, dim).bfloat16()
        base = timed(lambda: sets["bf16"](x), args.reps)
        row = {"tokens": T, "bf16_ms": base}
        cells = [f"{base:.1f}"]
        for f in args.formats:
            now = timed(lambda: sets[f](x), args.reps)
            before = timed(lambda: previous(sets[f], x), max(2, args.reps // 2)) if T > 1 else None
            row[f] = {"ms": now, "ratio_to_bf16": now / base, "before_ms": before}
            cells += [f"{now:.1f}", f"{now / base:.2f}", "-" if before is None else f"{before:.1f}"]
        result["rows"].append(row)
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
