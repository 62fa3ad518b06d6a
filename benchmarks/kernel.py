#!/usr/bin/env python3
"""The CPU FFN kernel's achieved read bandwidth over the share of active neurons, beside the
machine's read bandwidth and the torch path it replaces, in one run.

    .venv/bin/python benchmarks/kernel.py [--dim 4096] [--ffn 11008] [--layers 4] [--rows 1]
        [--formats bf16 i8 q4_0 q4_1] [--threads N] [--consecutive] [--also-isa avx512]
        [--plot FILE] [--out FILE]

One FFN layer of the given shape per `--layers` (random weights, ReGLU: gate, up and down rows),
rotated through so that no step finds its rows in the caches. For each share of active neurons
(1% to 100%, a random sorted subset, the same for every method) and each weight format, the
median time of one decode step over `--rows` input rows; every computed neuron fires (its
activation is non-zero), so the kernel reads all three of its rows and the bytes are exact.
Baselines in the same run, on the same neurons: the torch path (`sparse.NeuronSet` without a
format: gathered gate/up rows, an embedding-bag over down rows) in bf16, and the dense bf16
FFN as torch's matmuls (`dense`, every neuron). Bandwidth: `sparse_cpu.read_bandwidth` (a
reduction over 1 GiB, best of 5).
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
from powerinfer.sparse import NeuronSet
from sparse_cpu import read_bandwidth  # the same reading as the sparse decode benchmark

SHARES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


def timed(fn, layers: int, reps: int) -> float:
    for i in range(layers):  # warm-up
        fn(i)
    times = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r % layers)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--formats", nargs="+", default=["bf16", "i8", "q4_0", "q4_1"],
                    help="kernel formats (4-bit ones keep down rows int8, see kernels.down_format)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--consecutive", action="store_true",
                    help="the first neurons instead of a random subset (one stream, no jumps)")
    ap.add_argument("--also-isa", default=None, choices=kernels.ISAS,
                    help="time every kernel format under this instruction set as well (an A/B "
                         "in the same run: avx512 has no VNNI, avx512bf16 does)")
    ap.add_argument("--plot", default=None, help="write the plot (PNG)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert kernels.available(), "the CPU FFN kernel cannot run here"
    d, n, L, B = args.dim, args.ffn, args.layers, args.rows
    g = torch.Generator().manual_seed(0)
    # (L, 2n, d) [gate; up] and (L, d, n) down, bf16; the input makes every gate and up positive
    # on the computed neurons' rows (rows of |N(0, 1)|, x > 0), so each computed neuron fires
    w1 = [torch.randn(2 * n, d, generator=g).abs_().mul_(0.02).bfloat16() for _ in range(L)]
    w2 = [torch.randn(d, n, generator=g).mul_(0.02).bfloat16() for _ in range(L)]
    x = torch.rand(B, 1, d, generator=g) + 0.1
    everyone = torch.arange(n)
    sets = {"torch": [NeuronSet("reglu", w1[i], None, w2[i], everyone) for i in range(L)]}
    for f in args.formats:
        sets[f] = [NeuronSet("reglu", w1[i], None, w2[i], everyone, f) for i in range(L)]
    dense = [torch.cat([w1[i], w2[i].t()]) for i in range(L)]  # the same bytes as one matmul
    del w1, w2
    results = []
    with torch.inference_mode():
        xb = x.bfloat16()
        t = timed(lambda i: (torch.relu(xb @ dense[i][:n].t()) * (xb @ dense[i][n:2 * n].t()))
                  @ dense[i][2 * n:], L, args.reps)
        dense_bytes = 3 * n * d * 2
        results.append({"method": "dense bf16 (torch matmul)", "share": 1.0, "ms": t * 1e3,
                        "gbs": dense_bytes / t / 1e9})
        for share in SHARES:
            m = max(1, round(share * n))
            sel = torch.arange(m) if args.consecutive else torch.randperm(n, generator=g)[:m].sort().values
            runs = [(name, ss, None) for name, ss in sets.items()]
            runs += [(name, ss, args.also_isa) for name, ss in sets.items()
                     if args.also_isa and name != "torch"]
            for name, ss, isa in runs:
                fmt = ss[0].fmt or "bf16"
                xin = xb if name == "torch" else x
                before = torch.ops.powerinfer.use_isa(isa) if isa else None
                try:
                    t = timed(lambda i: ss[i](xin, sel), L, args.reps)
                finally:
                    if isa:
                        torch.ops.powerinfer.use_isa(before)
                nbytes = len(sel) * kernels.record_bytes(fmt, d, gated=True)
                method = "torch path bf16" if name == "torch" else f"kernel {fmt}"
                results.append({"method": method + (f" ({isa})" if isa else ""),
                                "share": share, "ms": t * 1e3, "gbs": nbytes / t / 1e9})
    bw = read_bandwidth(torch.float32)
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, kernel ISA "
          f"{kernels.isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"read bandwidth {bw / 1e9:.1f} GB/s; d {d}, n_ff {n}, ReGLU, {B} row(s), {L} layers, "
          f"{'consecutive' if args.consecutive else 'random'} neurons")
    methods = list(dict.fromkeys(r["method"] for r in results if r["share"] < 1 or "dense" not in r["method"]))
    print("| active | " + " | ".join(methods) + " |")
    print("|---:|" + "---:|" * len(methods))
    for share in SHARES:
        cells = []
        for m in methods:
            r = next(r for r in results if r["method"] == m and r["share"] == share)
            cells.append(f"{r['ms']:.2f} ms, {r['gbs']:.1f} GB/s ({r['gbs'] * 1e9 / bw:.0%})")
        print(f"| {share:.0%} | " + " | ".join(cells) + " |")
    dn = results[0]
    print(f"dense bf16 FFN (torch matmul, every neuron): {dn['ms']:.2f} ms, {dn['gbs']:.1f} GB/s "
          f"({dn['gbs'] * 1e9 / bw:.0%} of the read bandwidth)")
    if args.plot:
        plot(results, methods, bw, args, Path(args.plot))
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth": bw, "isa": kernels.isa(),
                                              "results": results}, indent=1))


def plot(results, methods, bw, args, path: Path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for m in methods:
        rs = [r for r in results if r["method"] == m]
        ax.plot([r["share"] * 100 for r in rs], [r["gbs"] for r in rs], marker="o", label=m)
    ax.axhline(bw / 1e9, color="k", linestyle="--", label="read bandwidth")
    ax.axhline(results[0]["gbs"], color="gray", linestyle=":", label=results[0]["method"])
    ax.set_xscale("log")
    ax.set_xlabel("active neurons (%)")
    ax.set_ylabel("GB/s of weights read")
    ax.set_title(f"FFN decode step, d {args.dim}, n_ff {args.ffn}, {args.rows} row(s), "
                 f"{torch.get_num_threads()} threads")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
