#!/usr/bin/env python3
"""What a bf16 product of many rows costs on this CPU, torch's own bf16 GEMM against the same
product in float32 (the bf16 weights widened a slice at a time, the sums rounded to bf16 once:
`powerinfer.model.transformer.linear_f32`), in the same run, and how far apart their answers
are. Where the CPU has no bf16 arithmetic (no AVX-512 BF16 or AMX) torch emulates its bf16
GEMM, and the model's many-row products (a prompt's, `powerinfer eval`'s and the profile's in
bf16) take the float32 way (`emulated_bf16`); where it has, they stay bf16.

    .venv/bin/python benchmarks/bf16_gemm.py [--rows 128] [--repeat 10]

Shapes: SmolLM2's (576 wide, 1,536 FFN neurons, its 49,152-token head) and a 7B's (4,096 wide,
11,008 neurons), each as (rows x in) @ (out x in)^T. Prints a Markdown table (ms a product, the
ratio, the largest difference in bf16 ulps' share of elements) and whether this CPU computes
bf16 natively.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
import torch.nn.functional as F

from powerinfer.cpu import cpu_name
from powerinfer.model.transformer import emulated_bf16, linear_f32

SHAPES = {"SmolLM2 FFN up (576 -> 1,536)": (576, 1536),
          "SmolLM2 FFN down (1,536 -> 576)": (1536, 576),
          "SmolLM2 q projection (576 -> 576)": (576, 576),
          "SmolLM2 head (576 -> 49,152)": (576, 49152),
          "7B FFN up (4,096 -> 11,008)": (4096, 11008),
          "7B q projection (4,096 -> 4,096)": (4096, 4096)}


def best_ms(f, repeat: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128,
                    help="input rows a product (a prompt's tokens)")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    emulated = emulated_bf16(torch.zeros(1, dtype=torch.bfloat16))
    print(f"{datetime.date.today()}, {cpu_name()} ({platform.machine()}), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, bf16 arithmetic "
          f"{'emulated' if emulated else 'native'}; {args.rows} rows, best of {args.repeat}\n")
    print("| product | torch bf16 GEMM, ms | float32 (linear_f32), ms | speed-up "
          "| elements apart |")
    print("|---|---:|---:|---:|---:|")
    for name, (k, n) in SHAPES.items():
        x = torch.randn(args.rows, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
        a = best_ms(lambda: F.linear(x, w), args.repeat)
        b = best_ms(lambda: linear_f32(x, w, None), args.repeat)
        apart = float((F.linear(x, w) != linear_f32(x, w, None)).float().mean())
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {apart:.2%} |")


if __name__ == "__main__":
    main()
