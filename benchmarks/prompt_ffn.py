#!/usr/bin/env python3
"""A prompt's FFN step over neuron records: the time of one many-token step of one layer's share
of neurons (`sparse.NeuronSet` over every neuron, as a prompt runs it: on the CPU the kernel
library's `records_rows`) for each record format, beside two torch paths over the same neurons,
in one run: the rows held in bf16 (already wide: no widening, torch's matmuls
`NeuronSet.PROMPT_ROWS` rows at a time, `NeuronSet._widened_rows`), and each format's rows
widened and multiplied in one product over all the step's rows (`unchunked`: what the step ran
before its products took PROMPT_ROWS rows at a time, and up to 4 rows the decode kernel).

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


def unchunked(s: NeuronSet, x: torch.Tensor) -> torch.Tensor:
    """The many-token step as it was before its products took PROMPT_ROWS rows at a time: up to
    4 rows through the decode kernel, more widened in one product over all of them (whose floats
    moved with the row count)."""
    n = x.shape[0] * x.shape[1]
    if n <= 4:
        return kernels.neuron_ffn(x.reshape(n, -1), s.records, s.all, None, s.bias32, 0.0, s.act,
                                  s.fmt)
    s.PROMPT_ROWS = n
    try:
        return s._widened_rows(x, 0.0, None)
    finally:
        del s.PROMPT_ROWS


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
    print("| tokens | bf16 rows, torch (ms) | " + " | ".join(
        f"{f} (ms) | x bf16 | {f} unchunked (ms) | {f} / unchunked" for f in args.formats) + " |")
    for T in args.tokens:
        x = torch.randn(1, T, dim).bfloat16()
        base = timed(lambda: sets["bf16"]._widened_rows(x, 0.0, None), args.reps)
        row = {"tokens": T, "bf16_ms": base}
        cells = [f"{base:.1f}"]
        for f in args.formats:
            now = timed(lambda: sets[f](x), args.reps)
            before = timed(lambda: unchunked(sets[f], x), args.reps) if T > 1 else None
            row[f] = {"ms": now, "ratio_to_bf16": now / base, "unchunked_ms": before}
            cells += [f"{now:.1f}", f"{now / base:.2f}", "-" if before is None else f"{before:.1f}",
                      "-" if before is None else f"{now / before:.2f}"]
        result["rows"].append(row)
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
