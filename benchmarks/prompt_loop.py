#!/usr/bin/env python3
"""A prompt's step in the native layer loop against the Python modules, in process, in turns.

    .venv/bin/python benchmarks/prompt_loop.py [--model smollm2-135m-instruct]
        [--dtypes float32 bfloat16] [--lengths 37 200 480] [--rounds 5] [--out FILE]

Every actor group runs its prompts in the native loop (`hot_layers`: its executors may not have
torch), and the in-process engine too where the loop takes them (`Engine._prompt`); the modules
are the reference it replaced. For each type and prompt length, the time to the first token of a
prompt (a fresh sequence, the prefix cache off) with each of the two steps, alternated
`--rounds` times after a warm-up; medians, the loop's time over the modules', and whether the
two gave the same first-token logits (float32: the modules' attention, norms and activations
differ from the loop's in their last bits, which the 4-bit kernel's 8-bit activations carry on;
bf16: the same floats where every rounding falls the same way). Also the loop's own
phases over the longest prompt (`kernels.loop_profile`). Defaults: int4 weights (the file's
4-bit blocks), the machine's threads.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from powerinfer import Config, PowerInfer, kernels  # noqa: E402
from logit_spread import chosen_logits  # noqa: E402

TEXT = "The history of the city goes back many centuries, and its people " * 200  # (2,600 tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[37, 200, 480])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, "
          f"{args.model}, int4 weights, {torch.get_num_threads()} threads, kernel ISA "
          f"{kernels.isa() if kernels.available() else 'none'}")
    print("| type | prompt tokens | modules, ms | native loop, ms | loop / modules | same logits |")
    print("|---|---:|---:|---:|---:|---|")
    results = []
    for dt in args.dtypes:
        pi = PowerInfer.from_pretrained(args.model, Config(
            dtype=dt, weights="int4", max_seq_len=max(args.lengths) + 32, prefix_cache=False))
        eng = pi.engine
        if eng.native is None or not eng.native.prompts:
            print(f"| {dt} | the native loop takes no prompt of this model here |")
            continue
        steps = {"modules": eng._forward, "loop": eng.native}
        ids_all = pi.tokenize(TEXT)
        if max(args.lengths) > len(ids_all):
            sys.exit(f"--lengths: at most {len(ids_all)} tokens (the text's)")
        for n in args.lengths:
            ids, times, logits = ids_all[:n], {k: [] for k in steps}, {}
            for k, f in steps.items():  # warm-up, and each step's logits
                eng._prompt = f
                logits[k] = chosen_logits(pi, ids, 1)[0][0]
            for _ in range(args.rounds):
                for k, f in steps.items():
                    eng._prompt = f
                    t = time.perf_counter()
                    list(pi._run([ids], 1, dict(temperature=0)))
                    times[k].append((time.perf_counter() - t) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            same = bool(torch.equal(logits["modules"], logits["loop"]))
            gap = float((logits["modules"] - logits["loop"]).abs().max())
            results.append({"dtype": dt, "tokens": n, "ms": med, "turns": times, "same": same,
                            "max_logit_gap": gap})
            print(f"| {dt} | {n} | {med['modules']:.1f} | {med['loop']:.1f} | "
                  f"{med['loop'] / med['modules']:.2f} | {'yes' if same else f'no ({gap:.3f})'} |",
                  flush=True)
        eng._prompt = eng.native
        ids = ids_all[:max(args.lengths)]
        kernels.loop_profile("start")
        list(pi._run([ids], 1, dict(temperature=0)))
        phases = {k: round(v * 1e3, 2) for k, v in kernels.loop_profile("stop").items()
                  if k != "calls" and v}
        results.append({"dtype": dt, "tokens": len(ids), "loop_phases_ms": phases})
        print(f"\n{dt}, the loop's phases over {len(ids)} tokens (ms): {phases}\n")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": str(datetime.date.today()),
                                              "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
