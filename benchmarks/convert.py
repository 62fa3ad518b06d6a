#!/usr/bin/env python3
"""A K-quant file's converted copy: the tensors it converted alone against the whole file, in turns.

    .venv/bin/python benchmarks/convert.py [--models gemma3-270m,FILE.gguf] [--turns 3]
        [--out FILE]

A GGUF file with block types the CPU kernel cannot read (K-quants, Q5) is converted once to
types it can (`powerinfer.model.convert`). The copy holds only the converted tensors; the model
reads the others from the original (`now`). Earlier versions copied every tensor (`whole`), which
loads without the original but doubles the model on disk and in the page cache: a Q4_0 file whose
only K-quant is its Q6_K output head (llama.cpp's choice for Q4_0) was copied whole for one
tensor. For each model and turn, in alternating order (one process, the original in the page
cache):

- `convert`: `convert(model, out, whole=...)`, the copy's seconds and bytes;
- `load`: `PowerInfer.from_pretrained(copy, Config())`, the defaults from the copy;
- a check that both loads decode the same greedy tokens (the same bytes are read).

Reported: medians of the turns and the ratios whole / now.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("whole", "now")


def timed(fn):
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def measure(model: str, turns: int, tokens: int) -> dict:
    from powerinfer import Config, PowerInfer
    from powerinfer.formats.loader import resolve_model
    from powerinfer.model.convert import convert

    path = resolve_model(model) if not Path(model).is_file() else Path(model)
    work = Path(tempfile.mkdtemp(prefix="convert-bench-"))
    times = {(c, w): [] for c in ("convert", "load") for w in WAYS}
    sizes, said = {}, {}
    for turn in range(turns):
        for way in (WAYS if turn % 2 == 0 else WAYS[::-1]):
            out = work / f"{way}.gguf"
            out.unlink(missing_ok=True)
            dt, summary = timed(lambda: convert(path, out, progress=False, whole=way == "whole"))
            summary["model"] = str(path.resolve())  # as `converted` records it: the original
            out.with_suffix(".json").write_text(json.dumps(summary))
            times["convert", way].append(dt)
            sizes[way] = out.stat().st_size
            dt, pi = timed(lambda: PowerInfer.from_pretrained(out, Config()))
            times["load", way].append(dt)
            said[way] = pi.generate("The capital of France is", max_new_tokens=tokens,
                                    temperature=0)
            pi.close()
            del pi
        print(f"{path.name}: turn {turn + 1}/{turns} done", file=sys.stderr, flush=True)
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    if said["whole"] != said["now"]:
        raise SystemExit(f"{path.name}: the two copies decoded differently: {said}")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": path.name, "file_bytes": path.stat().st_size, "copy_bytes": sizes,
            **{f"{c}_{w}_s": round(med[c, w], 3) for c, w in med},
            "turns": {f"{c}_{w}": [round(x, 3) for x in v] for (c, w), v in times.items()},
            "same_tokens": True, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gemma3-270m",
                    help="comma-separated installed names or GGUF files with K-quants")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens compared")
    ap.add_argument("--out", default=None, help="write the rows as JSON here too")
    a = ap.parse_args()
    rows = [measure(m, a.turns, a.tokens) for m in a.models.split(",")]
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    print(f"\n{platform.processor() or platform.machine()}, {datetime.date.today()}, "
          f"median of {a.turns} turns\n")
    print("| model | file (MiB) | copy, whole (MiB) | copy, now (MiB) | convert whole / now (s) "
          "| load whole / now (s) | same tokens |\n|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        c = r["copy_bytes"]
        print(f"| {r['model']} | {mib(r['file_bytes'])} | {mib(c['whole'])} | {mib(c['now'])} "
              f"({c['now'] / c['whole']:.2f}x) | {r['convert_whole_s']:.2f} / "
              f"{r['convert_now_s']:.2f} (**{r['convert_whole_s'] / r['convert_now_s']:.2f}x**) | "
              f"{r['load_whole_s']:.2f} / {r['load_now_s']:.2f} "
              f"({r['load_whole_s'] / r['load_now_s']:.2f}x) | {r['same_tokens']} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
