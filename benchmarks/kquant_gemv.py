#!/usr/bin/env python3
"""A K-quant file's matrices on the CPU: kept in their own bits against converted, in one run.

    .venv/bin/python benchmarks/kquant_gemv.py [--threads N] [--rows 12288] [--cols 4096]
        [--kinds Q4_K Q5_K Q6_K Q5_0]

A Q4_K_M file stores most matrices in Q4_K (4.5 bits a weight) and the rest (v and down in some
layers, the output head) in Q6_K (6.5625 bits); a Q5_K_M file the same over Q5_K (5.5 bits); where
a row is not whole super-blocks of 256, llama.cpp falls back to Q5_0 (5.5 bits). The
kernel's first way to read them was a converted copy: Q4_K as Q4_1 blocks (5 bits:
`quant.Q4Linear`'s q4x16 GEMV), Q5_K, Q6_K and Q5_0 as Q8_0 (8.5 bits: `quant.KernelLinear`'s rows,
and 16 rows at a time, q8x16, as a 4-bit load holds the copy's Q8_0: `quant.q8_0_linear`). This
times one token's product over 4 distinct matrices of
the given shape (a LLaMA-7B layer's fused q/k/v by default; 4 do not fit in cache) each way,
against the plain sum over 256 MiB as the read-bandwidth floor.
"""
from __future__ import annotations

import argparse
import os

import torch
from gguf import GGMLQuantizationType, dequantize

from powerinfer import kernels
from powerinfer.model.convert import q4_k_to_q4_1
from powerinfer.formats.kquants import KQUANT_LAYOUTS, quantize
from powerinfer.model.quant import KQuantLinear, KernelLinear, Q4Linear, q8_0_linear
from powerinfer.formats.q4 import q4_split

from gemv import cache_note, read_rate, seconds  # the other GEMV benchmarks' timing


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--kinds", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q5_0"],
                    choices=["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
    a = ap.parse_args()
    assert kernels.available(), "the CPU kernel cannot run here"
    torch.set_num_threads(a.threads)
    n, k, count = a.rows, a.cols, 4
    rate, read_bytes = read_rate()
    read_gbs = rate / 1e9
    print(f"threads {a.threads}; kernel ISA {kernels.isa()}; read bandwidth (sum over {read_bytes / 2**20:.0f} MiB): "
          f"{read_gbs:.1f} GB/s{cache_note()}\n")
    print("| file's type | held as | bytes read | time | GB/s | share of read bandwidth | time vs converted |")
    print("|---|---|---:|---:|---:|---:|---:|")
    x = torch.randn(1, k).bfloat16()
    torch.manual_seed(0)
    for kind in a.kinds:
        data = [quantize((torch.randn(n, k) * 0.02).numpy(), kind) for _ in range(count)]
        kept = [KQuantLinear([(torch.from_numpy(d), kind)], k, None) for d in data]
        if kind == "Q4_K":
            conv = [Q4Linear(*(torch.from_numpy(t) for t in q4_split("Q4_1", n, k, q4_k_to_q4_1(d))), None)
                    for d in data]
            conv_name, conv_bytes = "Q4_1 blocks, q4x16 GEMV (converted)", sum(m.packed.numel() for m in conv)
        else:
            conv = [KernelLinear(torch.from_numpy(dequantize(d, GGMLQuantizationType[kind])).reshape(n, k),
                                 None, "q8_0") for d in data]
            conv_name, conv_bytes = "Q8_0 rows, row GEMV (converted)", sum(m.records.numel() for m in conv)
        base = seconds(lambda: [m(x) for m in conv])
        rows = []
        if kind != "Q4_K":  # the copy's Q8_0 as a 4-bit load holds it: 16 rows at a time
            q8 = [q8_0_linear(torch.from_numpy(quantize(dequantize(d, GGMLQuantizationType[kind])
                                                        .reshape(n, k), "Q8_0")), k) for d in data]
            rows.append(("Q8_0 in q8x16 (converted, as int4 holds it)",
                         seconds(lambda: [m(x) for m in q8]), sum(m.nbytes for m in q8)))
        s = seconds(lambda: [m(x) for m in kept])
        nbytes = sum(m.nbytes for m in kept)
        for name, t, b in ((conv_name, base, conv_bytes), *rows,
                           (f"{KQUANT_LAYOUTS[kind]} (its own blocks)", s, nbytes)):
            print(f"| {kind} | {name} | {b / 2**20:.0f} MiB | {t * 1e3:.2f} ms | {b / t / 1e9:.1f} | "
                  f"{b / t / 1e9 / read_gbs:.0%} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
