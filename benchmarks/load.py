#!/usr/bin/env python3
"""How long a model takes to load, the header's parse against the reader it replaced, in turns.

    .venv/bin/python benchmarks/load.py [--models smollm2-135m-instruct,gemma3-270m] [--turns 3]
        [--out FILE]

For each model, `--turns` times, in alternating order within a turn (one process, the file in the
page cache for both):

- `parse`: opening the GGUF file and reading its header and tensor listing (`loader.open_gguf`);
- `load, defaults`: `PowerInfer.from_pretrained(model)` with the default configuration (on a file
  with K-quants that reads its header, its converted copy's, and the original's blocks beside the
  copy: three files' headers, some more than once);
- `load, fp32 dense`: `Config(dtype="float32", weights="dense")`, one file.

Each is measured two ways: `before`, the reader as it was (a `gguf.GGUFReader` call per array
element: a vocabulary's tokens, scores and merges one at a time, and every open parsed anew), and
`now` (an array's elements sliced from one view; one load parses each file once). Reported: the
median of the turns of each and their ratio. A vocabulary's size decides the gap: SmolLM2 has
49,152 tokens and 48,900 merges, Gemma 3 262,144 tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def reader_before():
    """The reader as it was: the stock element-by-element walk over arrays, no parse shared
    within a load."""
    import gguf

    from powerinfer import api, compat

    cls = compat.reader_class()
    saved = cls._get_field_parts, api.parsed_once
    cls._get_field_parts = gguf.GGUFReader._get_field_parts  # the stock walk, with no wrapper
    api.parsed_once = contextlib.nullcontext
    try:
        yield
    finally:
        cls._get_field_parts, api.parsed_once = saved


def timed(fn) -> float:
    gc.collect()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    del out
    gc.collect()
    return dt


def measure(model: str, turns: int) -> list[dict]:
    from powerinfer import Config, PowerInfer
    from powerinfer.formats.gguf import open_gguf
    from powerinfer.formats.loader import resolve_model

    path = resolve_model(model)
    cases = {
        "parse": lambda: open_gguf(path),
        "load, defaults": lambda: PowerInfer.from_pretrained(path, Config()),
        "load, fp32 dense": lambda: PowerInfer.from_pretrained(
            path, Config(dtype="float32", weights="dense")),
    }
    cases["load, defaults"]()  # a converted copy, where the file needs one, made before timing
    times = {(c, w): [] for c in cases for w in ("before", "now")}
    for turn in range(turns):
        for case, fn in cases.items():
            for which in (("before", "now") if turn % 2 == 0 else ("now", "before")):
                with reader_before() if which == "before" else contextlib.nullcontext():
                    times[case, which].append(timed(fn))
        print(f"{model}: turn {turn + 1}/{turns} done", file=sys.stderr, flush=True)
    rows = []
    for case in cases:
        b, n = (statistics.median(times[case, w]) for w in ("before", "now"))
        rows.append({"model": model, "case": case, "before_s": round(b, 3), "now_s": round(n, 3),
                     "speedup": round(b / n, 2), "turns": {w: [round(x, 3) for x in times[case, w]]
                                                           for w in ("before", "now")}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here too")
    a = ap.parse_args()
    rows = [r for m in a.models.split(",") for r in measure(m, a.turns)]
    print(f"\n{platform.processor() or platform.machine()}, {datetime.date.today()}, "
          f"median of {a.turns} turns\n")
    print("| model | case | before (s) | now (s) | speedup |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['case']} | {r['before_s']:.2f} | {r['now_s']:.2f} | "
              f"**{r['speedup']:.2f}x** |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
