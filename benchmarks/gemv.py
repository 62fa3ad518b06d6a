#!/usr/bin/env python3
"""Single-token matrix-vector products on the CPU: how close each way of computing y = W x comes
to the memory bandwidth, measured in one run. Decode reads every weight once per token, so this
bounds tokens/s.

    .venv/bin/python benchmarks/gemv.py [--threads N]

Each way runs over 60 distinct 3072x576 matrices (one SmolLM2 layer's fused gate/up; 60 of them
do not fit in cache), over the 49152x576 output head, and over 4 distinct 12288x4096 matrices (a
LLaMA-7B layer's fused q/k/v). "read" is a plain sum over 256 MiB (or 4x the last level cache
where that is larger, `read_rate`): the bandwidth floor
the others are compared to. Ways: torch's GEMV (aten, BLAS), the compiled multiply-reduce that
`model.Linear` becomes under torch.compile, torch's packed int4 kernel, the CPU kernel's GEMV
(`quant.KernelLinear`: powerinfer::linear over rows in bf16, Q8_0 or Q4_1, eager), and its int4
GEMV over 4-bit blocks regrouped 16 rows at a time (`quant.Q4Linear`, what `weights="int4"`
projections run on).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from powerinfer import kernels
from powerinfer.model.quant import KernelLinear, Q4Linear


def seconds(fn, n: int = 10) -> float:
    fn()
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def last_level_cache() -> int:
    """Bytes of the CPU's largest cache (`powerinfer.cpu.last_level_cache`): more than a
    benchmark's copies of a 7B matrix or a 256 MiB buffer on a server CPU, which then read from
    cache, not memory."""
    from powerinfer.cpu import last_level_cache as llc
    return llc()


def read_rate() -> tuple[float, int]:
    """(bytes/s, bytes) of a plain sum over a buffer of 256 MiB or four times the last level
    cache, whichever is larger: the read bandwidth from memory, the floor of a GEMV."""
    nbytes = max(256 * 2**20, 4 * last_level_cache())
    big = torch.randn(nbytes // 4)
    rate = nbytes / seconds(big.sum, 10)
    del big
    return rate, nbytes


def cache_note() -> str:
    """A line for a benchmark's header: how large the last level cache is, and that weights
    which take less than twice it read (partly) from cache rather than memory."""
    return (f"; last level cache {last_level_cache() / 2**20:.0f} MiB: weights under twice that "
            "read partly from cache, not memory")


@torch.compile(dynamic=False)
def multiply_reduce(x, w):  # what powerinfer.model.Linear does for one token under compile
    return (w.float() * x.float()).sum(-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rate, nbytes = read_rate()
    read_gbs = rate / 1e9
    print(f"threads {a.threads}; read bandwidth (sum over {nbytes / 2**20:.0f} MiB): "
          f"{read_gbs:.1f} GB/s{cache_note()}\n")
    print("| weights | way | bytes read | time | GB/s | share of read bandwidth |")
    print("|---|---|---:|---:|---:|---:|")
    assert kernels.available(), "the CPU kernel cannot run here"
    for shape, count in (((3072, 576), 60), ((49152, 576), 1), ((12288, 4096), 4)):
        n, k = shape
        for dtype in (torch.float32, torch.bfloat16):
            ws = [torch.randn(n, k).to(dtype) for _ in range(count)]
            x = torch.randn(k).to(dtype)
            nbytes = count * n * k * ws[0].element_size()
            ways = {"aten (BLAS GEMV)": lambda: [w @ x for w in ws],
                    "compiled multiply-reduce": lambda: [multiply_reduce(x, w) for w in ws]}
            if dtype == torch.bfloat16:
                kl = [KernelLinear(w, None, "bf16") for w in ws]
                ways["kernel GEMV (eager)"] = lambda: [m(x[None]) for m in kl]
            for way, fn in ways.items():
                s = seconds(fn)
                row = f"{count}x {n}x{k} {str(dtype)[6:]}"
                print(f"| {row} | {way} | {nbytes / 2**20:.0f} MiB | {s * 1e3:.2f} ms | "
                      f"{nbytes / s / 1e9:.1f} | {nbytes / s / 1e9 / read_gbs:.0%} |")
        # 4-bit groups of 32 (GGUF Q4_0/Q4_1 kept packed): half a byte per weight plus scales
        q = [torch.randint(0, 16, (n, k), dtype=torch.int32) for _ in range(count)]
        packed = [torch._convert_weight_to_int4pack_for_cpu(w, 1) for w in q]
        sz = torch.rand(k // 32, n, 2).bfloat16()
        x = torch.randn(1, k).bfloat16()
        nbytes = count * (n * k // 2 + sz.numel() * 2)
        s = seconds(lambda: [torch._weight_int4pack_mm_for_cpu(x, p, 32, sz) for p in packed])
        print(f"| {count}x {n}x{k} int4 | aten int4pack (bf16 x) | {nbytes / 2**20:.0f} MiB | "
              f"{s * 1e3:.2f} ms | {nbytes / s / 1e9:.1f} | {nbytes / s / 1e9 / read_gbs:.0%} |")
        scale = [torch.rand(n, k // 32) * 0.02 for _ in range(count)]
        ql = [Q4Linear(w.to(torch.uint8), d, 8 * d, None) for w, d in zip(q, scale)]
        nbytes = sum(m.packed.numel() for m in ql)
        s = seconds(lambda: [m(x) for m in ql])
        print(f"| {count}x {n}x{k} q4x16 | kernel int4 GEMV (Q4Linear, eager) | {nbytes / 2**20:.0f} MiB | "
              f"{s * 1e3:.2f} ms | {nbytes / s / 1e9:.1f} | {nbytes / s / 1e9 / read_gbs:.0%} |")
        for fmt in ("q8_0", "q4_1"):  # the kernel over GGUF blocks
            kl = [KernelLinear(torch.randn(n, k), None, fmt) for _ in range(count)]
            nbytes = sum(m.records.numel() for m in kl)
            s = seconds(lambda: [m(x) for m in kl])
            print(f"| {count}x {n}x{k} {fmt} | kernel GEMV (eager) | {nbytes / 2**20:.0f} MiB | "
                  f"{s * 1e3:.2f} ms | {nbytes / s / 1e9:.1f} | {nbytes / s / 1e9 / read_gbs:.0%} |")


if __name__ == "__main__":
    main()
