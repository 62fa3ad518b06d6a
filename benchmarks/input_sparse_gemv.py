#!/usr/bin/env python3
"""Input-sparse 4-bit products on the CPU: the q4c product (`kernels.linear_q4c`, each input
channel's weights together, only the kept channels read) against the dense GEMV that the
default path runs (`kernels.linear_q4x16`, or q4kx16 and q6kx16 for a K-quant file's Q4_K and
Q6_K rows), the same matrices, in one run, in turns.

    .venv/bin/python benchmarks/input_sparse_gemv.py [--threads N] [--shapes 7b smollm2]
        [--quant q4_0|q4_k|q6_k] [--sparsity 0 0.25 0.4 0.5 0.7] [--turns 3] [--cpu-isa avx2]
        [--from-cache] [--rows 64] [--walks] [--json FILE]

Each shape is a decode step's projections that share an input (TEAL sparsifies each input once):
q/k/v fused, the output projection, gate/up fused (the 7B shape's 4096 -> 12288, 4096, 22016;
SmolLM2's 576 -> 960, 576, 3072). Distinct copies of each that fill twice the last level cache (at
least 4 of a 7B matrix, 64 of a SmolLM2 one), so that the products read from memory. The input is
Gaussian with its channels below the sparsity's quantile in magnitude zeroed by the kernel's
threshold, so each row keeps 1 - s of its channels. With --from-cache, each product is also
timed on a matrix of the same width whose rows fit in a quarter of the last level cache, read
again and again: its rate of work without the memory's latency (the bytes it reads over its
time), beside the read rate; where that rate is near the read rate, skipping bytes saves little
time. "floor" is the bytes a product must read (every scale of a block with a kept channel and
the kept channels' codes; the dense one all of them) at the read rate of a plain sum over 256 MiB
or 4x the last level cache (`gemv.read_rate`), measured in the same run. With --rows 64, each
matrix is cut to 64 rows and read from the cache: what a call costs beside its rows (its input
dropped, rounded and paired, the threads' start), which a 4,096-row product pays as well.
With --walks, the q4c product is also timed in each turn walking its matrix pass by pass
(`kernels.q4c_walk("passes")`: a block's runs side by side, the walk before the VNNI bodies'
quad-by-quad one), and the JSON keeps every turn's times: where a machine's memory reads fast
at some times and slowly at others, the turns sorted by the dense product's time show both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from powerinfer import kernels

from gemv import last_level_cache, read_rate, seconds  # the other GEMV benchmarks' timing

SHAPES = {  # name: (k, [(projection, rows)])
    "7b": (4096, [("qkv", 12288), ("o", 4096), ("gate_up", 22016)]),
    "smollm2": (576, [("qkv", 960), ("o", 576), ("gate_up", 3072)]),
}


def q4c_read_bytes(n: int, k: int, x: torch.Tensor, threshold: float) -> int:
    """Bytes the q4c product reads for one row x: each block with a kept channel reads its rows'
    scales and its kept channels' codes (a Q4_K matrix's: a byte of scale and one of minimum a
    row and block, and each super-block's f16 d and dmin a row; a Q6_K matrix's: a byte of scale
    a row per 16 channels, 6-bit codes, each super-block's f16 d a row)."""
    rows = kernels.q4c_rows(n)
    kept = (x.abs() > threshold).view(-1, 32)
    blocks = int(kept.any(1).sum())
    super_blocks = int(kept.view(-1, 8 * 32).any(1).sum()) if QUANT in ("q4_k", "q6_k") else 0
    if QUANT == "q6_k":
        return blocks * rows * 2 + int(kept.sum()) * rows * 3 // 4 + super_blocks * rows * 2
    return blocks * rows * 2 + int(kept.sum()) * rows // 2 + super_blocks * rows * 4


QUANT = "q4_0"  # --quant


def matrices(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random (n, k) matrix in the dense layout (q4x16, or q4kx16 for Q4_K), its q4c copy, and
    the bytes the dense product reads."""
    if QUANT == "q6_k":  # random codes and 8-bit scales; small f16 d (210 bytes a block)
        sb = torch.randint(0, 256, (n, k // 256, 210), dtype=torch.uint8)
        sb[..., 208:210] = (torch.rand(n, k // 256, 1) * 0.001 + 0.0001).half().view(torch.uint8)
        dense = kernels.pack_kquant(sb.view(n, -1), "Q6_K")
        return dense, kernels.q6kc_of_q6kx16(dense, n, k), dense.numel()
    if QUANT == "q4_k":  # random codes, 6-bit scales and minimums; small f16 d and dmin
        sb = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8)
        dd = (torch.rand(n, k // 256, 2) * 0.01 + 0.001).half().view(torch.uint8)
        sb[..., 0:4] = dd.view(n, k // 256, 4)
        dense = kernels.pack_kquant(sb.view(n, -1), "Q4_K")
        return dense, kernels.q4kc_of_q4kx16(dense, n, k), dense.numel()
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // 32) * 0.01 + 0.001
    zero = torch.zeros(n, k // 32)
    return kernels.pack_q4x16(q, scale, zero), kernels.pack_q4c(q, scale, zero)[0], n * k * 9 // 16


def gaps(mib: int = 256):
    """One core reading half of a buffer in pieces kept at random, against reading it all: the
    kept bytes' rate by piece size, with and without a software prefetch two pieces ahead."""
    src = Path(__file__).with_name("read_gaps.cpp")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "read_gaps"
        subprocess.run(["g++", "-O2", "-mavx2", str(src), "-o", str(exe)], check=True)

        def rate(keep: float, piece: int, ahead: int, side: int = 0) -> float:
            return float(subprocess.run([str(exe), str(mib), str(keep), str(piece), str(ahead), str(side)],
                                        check=True, capture_output=True, text=True).stdout.split()[0])

        whole = rate(1.0, 4096, 0)
        print(f"one core reading {mib} MiB whole: {whole:.1f} GB/s\n")
        print("| piece | half kept: GB/s of kept bytes | time against reading it all "
              "| with a prefetch 2 pieces ahead | time against reading it all |")
        print("|---:|---:|---:|---:|---:|")
        for piece in (128, 512, 1024, 2048, 4096, 8192):
            r0, r2 = rate(0.5, piece, 0), rate(0.5, piece, 2)
            print(f"| {piece} B | {r0:.1f} | {0.5 * whole / r0:.2f} | {r2:.1f} | {0.5 * whole / r2:.2f} |",
                  flush=True)
        # the q4c product's pattern: a 12,288-row matrix's 6 KB runs, three in four kept (25%
        # input sparsity), read side by side a line at a time as a block's kept runs are
        print("\n| 6 KB runs, 3/4 kept, read | GB/s of kept bytes "
              "| with a prefetch (one run ahead; side by side, 4 lines ahead in each) |")
        print("|---|---:|---:|")
        for side in (0, 1, 4, 24):
            label = "one after another" if side == 0 else f"{side} side by side, a line each in turn"
            print(f"| {label} | {rate(0.75, 6144, 0, side):.1f} | {rate(0.75, 6144, 4 if side else 1, side):.1f} |",
                  flush=True)
        print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.25, 0.4, 0.5, 0.7])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--quant", default="q4_0", choices=["q4_0", "q4_k", "q6_k"],
                    help="the matrices' blocks: a Q4_0 file's, or a Q4_K_M file's Q4_K or Q6_K "
                         "rows")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--cpu-isa", default="auto", choices=["auto", *kernels.ISAS],
                    help="hold the kernel to this class (a lower one than the CPU's best: "
                         "labelled as such in the output)")
    ap.add_argument("--from-cache", action="store_true",
                    help="also time each product on the first rows of its matrix that fit in a "
                         "quarter of the last level cache, read again and again: the products' "
                         "own rate of work, beside the memory's")
    ap.add_argument("--rows", type=int, default=0,
                    help="each matrix cut to this many rows (a multiple of 128, a q4c pass), four copies read "
                         "again and again from the cache: a call's fixed costs (its input "
                         "dropped, rounded and paired; the threads' start) beside its rows' work")
    ap.add_argument("--walks", action="store_true",
                    help="also time the q4c product walking pass by pass (the walk before the "
                         "VNNI bodies' quad by quad one; the same floats), in the same turns")
    ap.add_argument("--gaps", action="store_true",
                    help="first, one core's read rate of a buffer read in pieces with gaps "
                         "(benchmarks/read_gaps.cpp, built with g++): why q4c keeps whole columns")
    a = ap.parse_args()
    if a.rows % 128:
        ap.error("--rows: a multiple of 128")
    global QUANT
    QUANT = a.quant
    if a.gaps:
        gaps()
    assert kernels.available(), "the CPU kernel cannot run here"
    kernels.hold(a.cpu_isa)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rate, read_bytes = read_rate()
    read_gbs, llc = rate / 1e9, last_level_cache()
    held = "" if kernels.isa() == kernels.best_isa() else \
        f" (held; this CPU's best: {kernels.best_isa()})"
    print(f"threads {a.threads}, kernel ISA {kernels.isa()}{held}; read rate (sum over "
          f"{read_bytes / 2**20:.0f} MiB): {read_gbs:.1f} GB/s; last level cache "
          f"{llc / 2**20:.0f} MiB; {a.turns} turns, the median; {a.quant} blocks\n")
    dense_layout = {"q4_k": "q4kx16", "q6_k": "q6kx16"}.get(a.quant, "q4x16")
    if a.from_cache:
        print("(from the cache: the first rows of each matrix that fit in a quarter of the last "
              "level cache, a multiple of 128, read again and again: the products' own rate)\n")
    print(f"| shape | projection (rows x k) | sparsity | dense {dense_layout} ms | q4c ms | q4c vs dense "
          "| q4c bytes | q4c at its floor |"
          + (" dense from the cache, GB/s | q4c from the cache, GB/s |" if a.from_cache else "")
          + (" q4c pass by pass ms | quad by quad vs pass by pass |" if a.walks else ""))
    print("|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if a.from_cache else "")
          + ("---:|---:|" if a.walks else ""))
    rows_out = []
    for shape in a.shapes:
        k, projs = SHAPES[shape]
        for name, n in projs:
            if a.rows:
                n = min(n, a.rows)
            # distinct copies that together fill twice the last level cache (at least 4 of a
            # 7B matrix, 64 of a SmolLM2 one), so that the products read from memory
            # Q4_0: 4.5 bits a weight (Q4_K as held: 4.625, Q6_K 6.5625)
            dense_bytes = n * k * 105 // 128 if a.quant == "q6_k" else n * k * 9 // 16
            copies = 4 if a.rows else max(4 if shape == "7b" else 64, -(-2 * llc // dense_bytes))
            mats = []
            for _ in range(copies):
                wd, wc, dense_bytes = matrices(n, k)
                mats.append((wd, wc))
            if a.from_cache:  # its first rows (a multiple of 128) that fit in a quarter of the cache
                n_c = min(n, max(128, llc // 4 // (dense_bytes // n) // 128 * 128))
                cached = matrices(n_c, k)[:2]
            kind = kernels.Q4C_KINDS.index(a.quant)
            x = torch.randn(1, k)
            calls = max(3, int(2e8 // (dense_bytes * copies)))
            for s in a.sparsity:
                t = float(x.abs().quantile(s)) if s > 0 else 0.0
                dense_in = torch.where(x.abs() > t, x, 0.0)  # the same kept values, read densely
                turns = []
                for _ in range(a.turns):
                    td = seconds(lambda: [kernels.linear_x16(dense_in, wd, n, dense_layout) for wd, _ in mats], calls)
                    tc = seconds(lambda: [kernels.linear_q4c(x, wc, n, kind, t) for _, wc in mats], calls)
                    turn = [td / copies, tc / copies]
                    if a.walks:
                        before = kernels.q4c_walk("passes")
                        tp = seconds(lambda: [kernels.linear_q4c(x, wc, n, kind, t) for _, wc in mats], calls)
                        kernels.q4c_walk(before)
                        turn.append(tp / copies)
                    turns.append(turn)
                td, tc = (statistics.median(v) for v in list(zip(*turns))[:2])
                nbytes = q4c_read_bytes(n, k, x, t)
                floor = nbytes / (read_gbs * 1e9)
                row = dict(shape=shape, projection=name, rows=n, k=k, sparsity=s, threads=a.threads, quant=a.quant,
                           dense_ms=td * 1e3, q4c_ms=tc * 1e3, ratio=td / tc, q4c_bytes=nbytes,
                           dense_bytes=dense_bytes, floor_share=floor / tc, read_gbs=read_gbs,
                           dense_floor_share=dense_bytes / (read_gbs * 1e9) / td)
                if a.walks:
                    tp = statistics.median(v[2] for v in turns)
                    row.update(passes_ms=tp * 1e3, turns_ms=[[v * 1e3 for v in turn] for turn in turns])
                if a.from_cache:  # the same products read again and again from the cache, in turns
                    wd, wc = cached
                    reps = max(20, int(4e8 // (dense_bytes * n_c // n)))
                    hot = [(seconds(lambda: kernels.linear_x16(dense_in, wd, n_c, dense_layout),
                                    reps),
                            seconds(lambda: kernels.linear_q4c(x, wc, n_c, kind, t), reps))
                           for _ in range(a.turns)]
                    hd, hc = (statistics.median(v) for v in zip(*hot))
                    row.update(cached_rows=n_c, cached_dense_gbs=dense_bytes * n_c / n / hd / 1e9,
                               cached_q4c_gbs=q4c_read_bytes(n_c, k, x, t) / hc / 1e9)
                rows_out.append(row)
                print(f"| {shape} | {name} ({n} x {k}) | {s:.0%} | {td * 1e3:.3f} | {tc * 1e3:.3f} | "
                      f"{td / tc:.2f}x | {nbytes / 1e6:.2f} MB | {floor / tc:.0%} |"
                      + (f" {row['cached_dense_gbs']:.1f} | {row['cached_q4c_gbs']:.1f} |"
                         if a.from_cache else "")
                      + (f" {tp * 1e3:.3f} | {tp / tc:.2f}x |" if a.walks else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(isa=kernels.isa(), read_gbs=read_gbs, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
