#!/usr/bin/env python3
"""An 8-bit output head on the CPU: Q8_0 rows read a row at a time against the q8x16 layout.

    .venv/bin/python benchmarks/head_gemv.py [--threads N] [--isas avx512bf16 avx512 avx2]

A small model's output head is the largest single read of its decode step, and its rows are
short (SmolLM2: 49,152 rows of 576; Gemma 3 270M: 262,144 of 640): the row GEMV
(`quant.KernelLinear`) pays each row's sums and stores for 18-20 blocks. The q8x16 layout
(`quant.KQuantLinear` over Q8_0 rows: the same codes and scales, 16 rows a vector) is what the
engine holds such a head in now. This times both, in one run, on the heads of the models this
project ships and of a 7B shape, for 1 and 8 input rows, under each instruction set asked for,
against the plain sum over 256 MiB as the read-bandwidth floor; both answer the same products
(their largest difference relative to the largest output is printed).
"""
from __future__ import annotations

import argparse
import os

import torch

from powerinfer import kernels
from powerinfer.model.quant import KQuantLinear, KernelLinear

from gemv import cache_note, read_rate, seconds  # the other GEMV benchmarks' timing

HEADS = {"SmolLM2-135M": (49152, 576), "Gemma 3 270M": (262144, 640), "7B shape": (32000, 4096)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--isas", nargs="+", default=[None], help="kernel ISAs to time (default: the best)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    a = ap.parse_args()
    assert kernels.available(), "the CPU kernel cannot run here"
    torch.set_num_threads(a.threads)
    rate, read_bytes = read_rate()
    read_gbs = rate / 1e9
    print(f"threads {a.threads}; read bandwidth (sum over {read_bytes / 2**20:.0f} MiB): "
          f"{read_gbs:.1f} GB/s{cache_note()}\n")
    print("| head | rows x dim | ISA | input rows | Q8_0 rows, row GEMV | q8x16 | GB/s (q8x16) "
          "| share of read bandwidth | speed-up | max difference |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    for name, (n, dim) in HEADS.items():
        rows = kernels.quantize_rows(torch.randn(n, dim) * 0.05, "q8_0")
        by_row = KernelLinear.from_records(rows, "q8_0", dim)
        grouped = KQuantLinear([(rows, "Q8_0")], dim, None)
        for isa in a.isas:
            before = torch.ops.powerinfer.use_isa(isa) if isa else None
            try:
                for B in a.batch:
                    x = torch.randn(B, dim).bfloat16()
                    want, got = by_row(x.float()), grouped(x.float())
                    diff = float((want - got).abs().max() / want.abs().max())
                    t_row, t_grp = seconds(lambda: by_row(x)), seconds(lambda: grouped(x))
                    gbs = grouped.nbytes / t_grp / 1e9
                    print(f"| {name} | {n:,} x {dim} | {isa or kernels.isa()} | {B} | "
                          f"{t_row * 1e3:.2f} ms | {t_grp * 1e3:.2f} ms | {gbs:.1f} | "
                          f"{gbs / read_gbs:.0%} | {t_row / t_grp:.2f}x | {diff:.1e} |")
            finally:
                if before is not None:
                    torch.ops.powerinfer.use_isa(before)


if __name__ == "__main__":
    main()
