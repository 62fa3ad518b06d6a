#!/usr/bin/env python3
"""A prompt's attention over the paged KV cache, one layer: the CPU kernel against torch's path.

    .venv/bin/python benchmarks/attention.py [--tokens 2000] [--chunk 0] [--heads 9]
        [--kv-heads 3] [--dim 64] [--dtype bfloat16] [--runs 5]

One sequence of `--tokens` positions (SmolLM2's heads by default) attends causally over a paged
cache of 16-position blocks, in one step or in steps of `--chunk` tokens, as chunked prefill
runs it: `torch.ops.powerinfer.paged_attention` (the kernel the native loop and the modules
call) against `model.transformer.paged_attention` (torch's scaled_dot_product_attention over
gathered blocks, the path where the kernel does not run), the best of `--runs` each after a
warm-up, in the same process with torch's threads. Reports each one's ms, the kernel's rate
(2 multiply-adds a query, key and head position: the causal half only), the ratio, and how far
the two outputs are apart.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from powerinfer import kernels  # noqa: E402
from powerinfer.model.transformer import KVCache, KVTables, paged_attention  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=0, help="tokens a step (0: the whole prompt)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    if not kernels.available():
        sys.exit("the CPU kernel does not run here")
    H, Hkv, D, T, bs = a.heads, a.kv_heads, a.dim, a.tokens, 16
    dt = getattr(torch, a.dtype)
    chunk = a.chunk or T
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dt)
    blocks = -(-T // bs)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    cuts = list(range(0, T, chunk)) + [T]

    def kernel(cache):
        return torch.cat([torch.ops.powerinfer.paged_attention(
            qkv[s:e], torch.empty(0), torch.empty(0), cache.k, cache.v, tables,
            torch.tensor([0, e - s]), torch.arange(s, e), H, 0, D ** -0.5)
            for s, e in zip(cuts, cuts[1:])])

    def reference(cache):
        return torch.cat([paged_attention(qkv[s:e], None, torch.arange(s, e),
                                          KVTables(torch.tensor([0, e - s]), tables), cache, H, 0,
                                          D ** -0.5) for s, e in zip(cuts, cuts[1:])])

    out, ms = {}, {}
    for name, f in (("kernel", kernel), ("torch", reference)):
        cache = KVCache(blocks, Hkv, bs, D, dt, "cpu")
        out[name] = f(cache)
        times = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            f(cache)
            times.append(time.perf_counter() - t0)
        ms[name] = min(times) * 1e3
    flop = 2 * 2 * H * D * T * (T + 1) / 2
    gap = ((out["kernel"].float() - out["torch"].float()).abs().max()
           / out["torch"].float().abs().max()).item()
    print(f"{T} tokens in steps of {chunk}, {H} heads ({Hkv} KV) of {D}, {a.dtype}, "
          f"{torch.get_num_threads()} threads, kernel ISA {kernels.isa()}: kernel {ms['kernel']:.1f} "
          f"ms ({flop / ms['kernel'] / 1e6:.0f} GFLOP/s), torch {ms['torch']:.1f} ms, "
          f"torch / kernel {ms['torch'] / ms['kernel']:.2f}x; largest gap {gap:.2e} of the "
          f"largest output")


if __name__ == "__main__":
    main()
