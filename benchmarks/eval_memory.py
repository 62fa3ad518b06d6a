#!/usr/bin/env python3
"""What `powerinfer eval` costs in memory and time with one copy of the model against two, in
turns, each run in a fresh process (so that its peak is its own).

    .venv/bin/python benchmarks/eval_memory.py --model FILE --bundle B [--tokens 512]
        [--window 256] [--dtype float32|bfloat16] [--turns 2] [--copies 1,2] [--out FILE]

`sparsity.evaluate.evaluate(copies=N)`: with 1, the dense pass runs first and keeps every held-out
token's log-probabilities, then the same model's FFNs are swapped for the sparse ones; with 2
(what `eval` always did before 2026-12-06), a second copy of the model is loaded for the sparse
variants and the dense model runs beside it window by window. Reported per way: the median time,
the process's peak resident memory (VmHWM), and the rows' perplexities (the same in both ways).
The bundle's `eval.json` and `quality.json` are written by each run, as `powerinfer eval` writes
them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from cluster.topology import process_memory
from powerinfer.formats.bundle import Bundle
from powerinfer.sparsity.evaluate import evaluate
model, bundle, tokens, window, dtype, copies = sys.argv[2:8]
t = time.perf_counter()
rows = evaluate(model, Bundle.open(bundle), tokens=int(tokens), window=int(window),
                progress=False, dtype=dtype, copies=int(copies))
s = time.perf_counter() - t
m = process_memory()  # (hwm, VmHWM: this process's own peak)
print(json.dumps({"eval_s": s, "peak_mib": m["hwm"] / 2 ** 20,
                  "ppl": {r["label"]: r["ppl"] for r in rows}}))
"""


def one(args, copies: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), args.model, args.bundle,
                        str(args.tokens), str(args.window), args.dtype, str(copies)],
                       capture_output=True, text=True, timeout=7200)
    if r.returncode:
        raise SystemExit(f"eval with {copies} copies failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--tokens", type=int, default=512, help="held-out tokens (0: all)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--copies", default="1,2",
                    help="the ways to run (1, 2): 1 alone where two copies would not fit")
    ap.add_argument("--out")
    args = ap.parse_args()
    ways = tuple(int(c) for c in args.copies.split(","))
    got = {c: [] for c in ways}
    for turn in range(args.turns):
        for c in (ways if turn % 2 == 0 else ways[::-1]):
            got[c].append(one(args, c))
            print(f"{c} copies: {got[c][-1]}", file=sys.stderr, flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.machine())
    print(f"\n{Path(args.model).name}, {args.dtype}, {args.tokens or 'all'} held-out tokens in "
          f"windows of {args.window}; {cpu}, {len(os.sched_getaffinity(0))} cores, "
          f"{datetime.date.today()}, {args.turns} turns\n")
    print("| copies of the model | eval s (median) | peak RSS MiB (median) | perplexities |")
    print("|---:|---:|---:|---|")
    for c, runs in got.items():
        ppl = ", ".join(f"{k} {v:.4f}" for k, v in runs[0]["ppl"].items())
        print(f"| {c} | {statistics.median(r['eval_s'] for r in runs):.1f} | "
              f"{statistics.median(r['peak_mib'] for r in runs):,.0f} | {ppl} |")
    if len(ways) == 2:
        a, b = (statistics.median(r["peak_mib"] for r in got[c]) for c in ways)
        same = all(r["ppl"] == got[ways[0]][0]["ppl"] for runs in got.values() for r in runs)
        print(f"\npeak {ways[0]} / {ways[1]} copies: {a / b:.2f}x; the same perplexities in every "
              f"run: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": str(datetime.date.today()),
                                              "argv": sys.argv[1:], "runs": got}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
