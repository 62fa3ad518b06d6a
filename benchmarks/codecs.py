#!/usr/bin/env python3
"""GGUF blocks written and read: the gguf package's numpy against `kquants`' torch ops, in turns.

    .venv/bin/python benchmarks/codecs.py [--rows 8192] [--cols 8192] [--turns 3] [--out FILE]

A load that widens a 4-bit file (a GPU's bf16 copy, a dense float configuration) dequantizes
every matrix, and `powerinfer synthetic --quant` quantizes every matrix. Both went through
`gguf.quants`, numpy over groups of 16 rows on one core; they now go through `kquants`' torch
ops, which give the same bytes and values (`tests/test_kernels.py`) and use every core torch
has. This times both on one (rows, cols) float32 matrix (by default a 70B-shaped attention
matrix, 67M weights), each way `--turns` times in alternating order; reported per block type:
the medians, in million weights a second, and their ratio.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from powerinfer.formats import kquants

QUANTIZE = ("Q4_0", "Q4_1", "Q8_0")
DEQUANTIZE = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import gguf

    x = torch.randn(a.rows, a.cols, generator=torch.Generator().manual_seed(0)).numpy()
    n = x.size
    rows = []
    jobs = [("quantize", k, lambda k=k: gguf.quants.quantize(x, gguf.GGMLQuantizationType[k]),
             lambda k=k: kquants.quantize(x, k)) for k in QUANTIZE]
    for k in DEQUANTIZE:
        raw = kquants.quantize(x, k)
        jobs.append(("dequantize", k,
                     lambda k=k, raw=raw: gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[k]),
                     lambda k=k, raw=raw: kquants.dequantize(raw, k, a.cols)))
    for op, k, numpy_way, torch_way in jobs:
        times = {"gguf numpy": [], "torch": []}
        for turn in range(a.turns):
            order = [("gguf numpy", numpy_way), ("torch", torch_way)]
            for name, fn in order if turn % 2 == 0 else order[::-1]:
                times[name].append(seconds(fn))
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {"op": op, "type": k, "numpy_mw_s": n / med["gguf numpy"] / 1e6,
               "torch_mw_s": n / med["torch"] / 1e6, "ratio": med["gguf numpy"] / med["torch"]}
        rows.append(row)
        print(f"{op:10s} {k:5s} gguf numpy {row['numpy_mw_s']:7.0f} Mw/s  torch "
              f"{row['torch_mw_s']:7.0f} Mw/s  {row['ratio']:5.2f}x", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": str(datetime.date.today()), "host": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "shape": [a.rows, a.cols], "numpy": np.__version__,
            "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
