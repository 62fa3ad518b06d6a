#!/usr/bin/env python3
"""Two builds of the CPU kernel timed against each other: this checkout's and another's (a git
worktree with a change to `powerinfer/kernels/csrc`), one product at a time, in processes that
alternate.

    .venv/bin/python benchmarks/kernel_ab.py --other DIR [--product q4c|dense|records]
        [--quant q4_0] [--rows 12288] [--k 4096] [--sparsity 0.25] [--share 0.05]
        [--format q4_0] [--batch 1] [--rounds 6] [--seconds 2] [--threads N] [--json FILE]

Two builds cannot share a process (their operators have the same names), and a 2-core VM's
memory reads at rates that move by 1.6x within minutes, so the builds run in turns: each round
starts one process per build, this checkout's first, and each times calls of the product over
distinct random matrices of `--rows` x `--k` that together fill twice the last level cache (the
same seed in both, so the same bytes), for `--seconds` after a warm-up. `--product q4c`: the
input-sparse product (`kernels.linear_q4c`, the input's channels below the `--sparsity`
quantile in magnitude dropped); `dense`: the dense GEMV the default path runs over the same
zeroed input (q4x16; with `--quant q4_k` or `q6_k` a K-quant matrix in its own bits, q4kx16 or
q6kx16, as a Q4_K_M file's are held), over `--batch` input rows; `records`: the records
kernel's decode step (`kernels.neuron_ffn` through `NeuronSet`, as a model calls it) over
`--rows` neurons of a ReGLU FFN of width `--k` in
`--format`, a random `--share` of them selected (64 selections drawn, every computed neuron
firing), over as many layers as fill twice the last level cache (4 at least) in turn; with
`--batch B`, B input rows, each keeping its own `--share` of the neurons, drawn with a power
law's skew (neuron i of a random order picked with weight (i + 1)^-1.5, which gives the union
and overlap a 7B-shape bundle's predictors gave 4 and 8 rows: about 35% and 48% of the
neurons, each kept by 1.8 and 2.6 rows), the step over their union as a batch calls it. The
other tree builds its kernel into its own `powerinfer/kernels/_ext` on first use. Printed:
each build's microseconds a call, round by round, their medians, and the other build's speed
over this one's: the medians' ratio, and each round's (the two processes of a round a few
seconds apart, where the memory's rate changes less than over the whole run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child(a) -> dict:
    """Time the product with the kernel of the tree on PYTHONPATH: {"us": a call, "copies"}."""
    import torch

    import powerinfer
    from powerinfer import kernels
    from gemv import last_level_cache

    tree = Path(powerinfer.__file__).resolve().parents[1]
    assert tree == Path(a.tree).resolve(), f"imported {tree}, not {a.tree}: PYTHONPATH"
    assert kernels.available(), "the CPU kernel cannot run here"
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    n, k = a.rows, a.k
    if a.product == "records":
        return records(a, n, k, torch)
    dense_bytes = n * k * 9 // 16
    copies = max(2, -(-2 * last_level_cache() // dense_bytes))
    from powerinfer.formats.kquants import KQUANT_LAYOUTS, quantize
    kquant = a.quant.upper() if a.quant != "q4_0" else None  # (the dense product only)
    layout = KQUANT_LAYOUTS[kquant] if kquant else "q4x16"

    def matrix():
        if kquant:
            data = quantize((torch.randn(n, k) * 0.02).numpy(), kquant)
            return kernels.pack_kquant(torch.from_numpy(data), kquant)
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = torch.rand(n, k // 32) * 0.01 + 0.001
        zero = torch.zeros(n, k // 32)
        return (kernels.pack_q4c(q, scale, zero)[0] if a.product == "q4c"
                else kernels.pack_q4x16(q, scale, zero))

    mats = [matrix() for _ in range(copies)]
    x = torch.randn(a.batch if a.product == "dense" else 1, k)
    t = float(x.abs().quantile(a.sparsity)) if a.sparsity > 0 else 0.0
    kind = kernels.Q4C_KINDS.index(a.quant)
    dense_in = torch.where(x.abs() > t, x, 0.0)

    def call(w):
        if a.product == "q4c":
            kernels.linear_q4c(x, w, n, kind, t)
        else:
            kernels.linear_x16(dense_in, w, n, layout)

    for w in mats:  # warm-up
        call(w)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        for w in mats:
            call(w)
        calls += len(mats)
    return {"us": (time.perf_counter() - t0) / calls * 1e6, "copies": copies}


def records(a, n: int, k: int, torch) -> dict:
    from gemv import last_level_cache
    from kernel import firing_layers, random_masks  # (the kernel benchmark's records)
    layers = firing_layers(1, n, k, a.format)
    count = max(4, -(-2 * last_level_cache() // layers[0].records.nbytes))
    layers += firing_layers(count - 1, n, k, a.format)
    steps = [(layers[i % len(layers)], m) for i, m in enumerate(random_masks(n, a.share))]
    x = torch.rand(a.batch, 1, k) + 0.1
    keeps = [None] * len(steps)
    if a.batch > 1:  # each row its own share, the step over their union
        skew = 1.0 / (torch.arange(n) + 1.0) ** 1.5
        for i, (ffn, _) in enumerate(steps):
            order, rows = torch.randperm(n), torch.zeros(a.batch, n, dtype=torch.bool)
            for r in range(a.batch):
                rows[r, order[torch.multinomial(skew, round(a.share * n))]] = True
            steps[i], keeps[i] = (ffn, rows.any(0)), rows.view(a.batch, 1, n)
    for (ffn, m), keep in zip(steps, keeps):  # warm-up
        ffn(x, m, keep=keep)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        for (ffn, m), keep in zip(steps, keeps):
            ffn(x, m, keep=keep)
        calls += len(steps)
    return {"us": (time.perf_counter() - t0) / calls * 1e6, "copies": len(layers)}


def commit(tree: Path) -> str:
    """The tree's commit, "-dirty" where its files differ from it (what a build was made of)."""
    return subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"],
                          capture_output=True, text=True).stdout.strip() or "not a git checkout"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", required=True, help="the other checkout (its repository root)")
    ap.add_argument("--product", default="q4c", choices=["q4c", "dense", "records"])
    ap.add_argument("--quant", default="q4_0", choices=["q4_0", "q4_k", "q6_k"],
                    help="the matrices' blocks (Q4_0: what `pack_q4c` and `pack_q4x16` take; the "
                         "dense product also a K-quant's own)")
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--sparsity", type=float, default=0.25)
    ap.add_argument("--share", type=float, default=0.05,
                    help="records: the share of the neurons a step selects")
    ap.add_argument("--format", default="q4_0", choices=["q4_0", "q4_1", "i8"],
                    help="records: the records' format")
    ap.add_argument("--batch", type=int, default=1,
                    help="records: input rows a step, each keeping its own share; dense: input rows")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rows % 128 or a.k % 256:
        ap.error("--rows: a multiple of 128; --k: a multiple of 256")
    if a.quant != "q4_0" and a.product != "dense":
        ap.error("--quant q4_k/q6_k: the dense product only")
    if a.child:
        print(json.dumps(child(a)))
        return
    trees = {"this": ROOT, "other": Path(a.other).resolve()}
    if not (trees["other"] / "powerinfer" / "kernels" / "csrc").is_dir():
        ap.error(f"--other {a.other}: not a checkout of this project")
    args = [a.product, "--quant", a.quant, "--rows", str(a.rows), "--k", str(a.k), "--sparsity",
            str(a.sparsity), "--share", str(a.share), "--format", a.format, "--batch",
            str(a.batch), "--seconds", str(a.seconds), "--threads", str(a.threads)]
    times = {name: [] for name in trees}
    commits = {name: commit(tree) for name, tree in trees.items()}
    what = (f"records decode step, {a.rows} neurons of width {a.k} in {a.format}, {a.share:.0%} "
            f"selected" + (f" by each of {a.batch} rows" if a.batch > 1 else "")
            if a.product == "records" else
            f"{a.product} product, {a.rows} x {a.k} {a.quant}, {a.sparsity:.0%} of the input "
            "dropped" + (f", {a.batch} rows" if a.product == "dense" and a.batch > 1 else ""))
    print(f"{what}; this: {commits['this']}, other: {commits['other']}; {a.rounds} rounds\n")
    for r in range(a.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree))
            out = subprocess.run([sys.executable, str(HERE / "kernel_ab.py"), "--other", str(tree),
                                  "--product", *args, "--child", "--tree", str(tree)],
                                 env=env, capture_output=True, text=True, check=True, cwd=HERE)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            times[name].append(got["us"])
        print(f"round {r + 1}: this {times['this'][-1]:.1f} us a call, "
              f"other {times['other'][-1]:.1f}", flush=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    print("\n| build | us a call, sorted | median |")
    print("|---|---|---:|")
    for name, v in times.items():
        print(f"| {name} | {' '.join(f'{t:.1f}' for t in sorted(v))} | {med[name]:.1f} |")
    pairs = sorted(t / o for t, o in zip(times["this"], times["other"]))  # each round's
    print(f"\nthe other build's speed over this one's: {med['this'] / med['other']:.3f}x "
          f"(medians); round by round {' '.join(f'{p:.2f}' for p in pairs)}, "
          f"median {statistics.median(pairs):.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            settings = {k: v for k, v in vars(a).items()
                        if k not in ("other", "child", "tree", "json")}  # (no paths of the machine)
            json.dump(dict(settings, commits=commits, us=times, medians=med,
                           speed=med["this"] / med["other"], round_speeds=pairs), f, indent=1)


if __name__ == "__main__":
    main()
