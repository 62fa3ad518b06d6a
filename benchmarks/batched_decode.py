#!/usr/bin/env python3
"""Decode tokens/s of a batch of greedy streams in process, with the defaults and a bundle.

    .venv/bin/python benchmarks/batched_decode.py --model M [--bundle B] [--batches 1 4 8]
        [--tokens 64] [--runs 3] [--out FILE]

For each batch size B, B different prompts decoded together by `PowerInfer.generate` (each
decode step one call per layer over B rows: with a bundle, the records kernel over the union
of the rows' predicted neurons, each row keeping its own), after one untimed round: the tokens
generated over the time after the prompts' step (the prefill timed apart with one token). The
best of `--runs`. Run it from two checkouts in turns (PYTHONPATH) to compare kernels.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

from powerinfer import Config, PowerInfer

TOPICS = ("a lighthouse keeper", "a clockmaker", "a river pilot", "a beekeeper", "a cartographer",
          "a glassblower", "a night-train conductor", "a mountain guide")


def prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} who finds a message in a bottle."
            for i in range(n)]


def timed(pi: PowerInfer, batch: list[str], tokens: int) -> float:
    t0 = time.perf_counter()
    pi.generate(batch, max_new_tokens=tokens, temperature=0, ignore_eos=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bundle", default="")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = len(os.sched_getaffinity(0))
    pi = PowerInfer.from_pretrained(args.model, config=Config(
        cpu_threads=threads, max_batch=max(args.batches), max_seq_len=1024, prefix_cache=False,
        bundle=args.bundle))
    rows = []
    for b in args.batches:
        batch = prompts(b)
        timed(pi, batch, 4)  # warm-up
        # the decode's time: a run of `tokens` less a run of one token (its prefill and first)
        decode = min(timed(pi, batch, args.tokens) - timed(pi, batch, 1) for _ in range(args.runs))
        rows.append({"batch": b, "decode_tok_s": b * (args.tokens - 1) / decode})
        print(f"batch {b}: {rows[-1]['decode_tok_s']:.1f} tok/s decoded", flush=True)
    result = {"date": str(datetime.date.today()), "machine": platform.processor() or platform.machine(),
              "threads": threads, "model": args.model, "bundle": bool(args.bundle),
              "tokens": args.tokens, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
