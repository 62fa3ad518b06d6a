#!/usr/bin/env python3
"""What loading a model in process costs: its time and its peak memory, against the load that
widens every tensor first, in turns.

    .venv/bin/python benchmarks/load_memory.py [--models smollm2-135m-instruct,gemma3-270m,FILE]
        [--turns 3] [--config default|int4|fp32|pipeline-fp32|pipeline-bf16] [--out FILE]

Each load runs in a fresh process (so that its peak is its own), `PowerInfer.from_pretrained`
with the configuration given (`default`: `Config()`; `int4`: bf16 activations over the file's
4-bit blocks, the default where the kernel runs; `fp32`: float32 dense), in two ways,
alternating within a turn:

- `now`: each tensor read straight into its parameter; the 4-bit configuration reads the
  projections, a stored embedding (and the tied head over it, or a K-quant file's head) as the
  file's blocks, and widens only what no block format takes (`partial.deferred_model`);
- `eager`: the load before it: every tensor widened to the model's type into a dict, the model
  built from it, and then (4-bit) its matrices replaced by the file's blocks.

`pipeline-fp32` and `pipeline-bf16` load the offline pipeline's dense model instead
(`model.load.load_model`, what profile, calibrate-input and eval run) in that type: `now` reads
each tensor straight into its parameter, `eager` reads them all into a dict first and then
copies them into the model (the pipeline's load before 2026-12-06).

Reported per model and way: the median load time, the process's peak resident memory
(VmHWM) and its resident memory after the load, and the ratios now / eager.
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
from powerinfer import Config, PowerInfer, api
if sys.argv[4].startswith("pipeline-"):
    import torch
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.model.load import build_model, load_model
    dtype = torch.bfloat16 if sys.argv[4] == "pipeline-bf16" else torch.float32
    t = time.perf_counter()
    if sys.argv[3] == "eager":
        model = build_model(load_checkpoint(sys.argv[2], dtype), dtype)[0]
    else:
        model = load_model(sys.argv[2], dtype)[0]
    summary = f"the offline pipeline's dense model in {dtype}"
else:
    if sys.argv[3] == "eager":
        api._read_in_place = lambda ck, config: False
    cfg = Config(max_seq_len=256, max_batch=1, **{"default": {},
                 "int4": dict(dtype="bfloat16", weights="int4"),
                 "fp32": dict(dtype="float32", weights="dense")}[sys.argv[4]])
    t = time.perf_counter()
    pi = PowerInfer.from_pretrained(sys.argv[2], cfg)
    summary = pi.config.summary()
s = time.perf_counter() - t
m = process_memory()  # (hwm, VmHWM: this process's own peak)
print(json.dumps({"load_s": s, "peak_mib": m["hwm"] / 2 ** 20, "after_mib": m["rss"] / 2 ** 20,
                  "config": summary}))
"""


def one(model: str, way: str, config: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), model, way, config],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"loading {model} ({way}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--config", default="default",
                    choices=("default", "int4", "fp32", "pipeline-fp32", "pipeline-bf16"))
    ap.add_argument("--ways", default="now,eager",
                    help="the ways to load (now, eager): `now` alone where the eager load would "
                         "not fit in memory")
    ap.add_argument("--out")
    args = ap.parse_args()
    ways = tuple(w for w in ("now", "eager") if w in args.ways.split(","))
    rows, raw = [], {}
    for model in args.models.split(","):
        got = {w: [] for w in ways}
        for turn in range(args.turns):
            for way in (ways if turn % 2 == 0 else ways[::-1]):
                got[way].append(one(model, way, args.config))
                print(f"{Path(model).name} {way}: {got[way][-1]}", file=sys.stderr, flush=True)
        raw[model] = got
        med = {w: {k: statistics.median(r[k] for r in v) for k in ("load_s", "peak_mib", "after_mib")}
               for w, v in got.items()}
        rows.append((Path(model).name, med, got[ways[0]][0]["config"]))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.machine())
    print(f"\n{cpu}, {len(os.sched_getaffinity(0))} cores, {datetime.date.today()}, "
          f"{args.turns} turns, config {args.config}\n")
    print("| model | load s, now / eager | peak RSS MiB, now / eager | RSS after MiB, now / eager |")
    print("|---|---:|---:|---:|")
    for name, m, _ in rows:
        if len(m) == 1:
            (w, r), = m.items()
            print(f"| {name} | {r['load_s']:.2f} ({w} alone) | {r['peak_mib']:.0f} | "
                  f"{r['after_mib']:.0f} |")
            continue
        n, e = m["now"], m["eager"]
        print(f"| {name} | {n['load_s']:.2f} / {e['load_s']:.2f} ({n['load_s'] / e['load_s']:.2f}x) "
              f"| {n['peak_mib']:.0f} / {e['peak_mib']:.0f} ({n['peak_mib'] / e['peak_mib']:.2f}x) "
              f"| {n['after_mib']:.0f} / {e['after_mib']:.0f} |")
    print("\nconfigurations:", "; ".join(f"{name}: {c}" for name, _, c in rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"date": str(datetime.date.today()),
                                              "argv": sys.argv[1:], "runs": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
