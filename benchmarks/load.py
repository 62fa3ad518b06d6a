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

Then, for each model, what a served model's replica runs before its group starts
(`actors.prepare.prepare`, in a one-off task with torch: "auto" resolved, the table, the
tokenizer, the KV pool and the plan) with each file's header parsed once (`parsed_once`, as it
runs now) against parsed at every open (as it ran before), in turns, each after a warm-up call.

Each is measured three ways (`reader`): `stock`, the stock reader (a `gguf.GGUFReader` call per
array element: a vocabulary's tokens, scores and merges one at a time, and every open parsed
anew); `views` (an array's elements sliced from one view, all of them at the parse; one load
parses each file once; the metadata decoded at every ask); and `now` (the elements' views made
when asked for, an array decoded whole, a reader's metadata decoded once). Reported: the median
of the turns of each and the ratios. A vocabulary's size decides the gap: SmolLM2 has
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


WAYS = ("stock", "views", "now")


@contextlib.contextmanager
def reader(way: str):
    """The header's reader as it was (`stock`: gguf's element-by-element walk over arrays, no parse
    shared within a load, the metadata decoded at every ask; `views`: an array's elements sliced
    from one view, all made at the parse, a parse shared within a load, the metadata decoded at
    every ask) or as it is (`now`: the elements' views made when asked for, an array decoded
    whole, a reader's metadata decoded once)."""
    import gguf

    from powerinfer import api, compat
    from powerinfer.formats import gguf as ours

    if way == "now":
        yield
        return
    cls = compat.reader_class()
    saved = cls._build_fields, cls._get_field_parts, api.parsed_once, ours.gguf_metadata
    cls._build_fields = gguf.GGUFReader._build_fields

    def decoded_each_time(reader) -> dict:
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}

    ours.gguf_metadata = decoded_each_time
    if way == "stock":
        cls._get_field_parts = gguf.GGUFReader._get_field_parts  # the stock walk, no wrapper
        api.parsed_once = contextlib.nullcontext
    try:
        yield
    finally:
        cls._build_fields, cls._get_field_parts, api.parsed_once, ours.gguf_metadata = saved


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
    times = {(c, w): [] for c in cases for w in WAYS}
    for turn in range(turns):
        for case, fn in cases.items():
            for way in (WAYS if turn % 2 == 0 else WAYS[::-1]):
                with reader(way):
                    times[case, way].append(timed(fn))
        print(f"{model}: turn {turn + 1}/{turns} done", file=sys.stderr, flush=True)
    rows = []
    for case in cases:
        med = {w: statistics.median(times[case, w]) for w in WAYS}
        rows.append({"model": model, "case": case, **{f"{w}_s": round(med[w], 3) for w in WAYS},
                     "speedup": round(med["stock"] / med["now"], 2),
                     "speedup_views": round(med["views"] / med["now"], 2),
                     "turns": {w: [round(x, 3) for x in times[case, w]] for w in WAYS}})
    return rows


def measure_prepare(model: str, turns: int) -> dict:
    """A replica's `prepare` with the header parsed once against at every open, in turns."""
    from actors.prepare import prepare
    from powerinfer import Config
    from powerinfer.formats import gguf as ours
    from powerinfer.formats.loader import resolve_model

    path = str(resolve_model(model))
    prepare(path, Config(), False)  # (a converted copy, where the file needs one, made first)
    times = {"each open": [], "once": []}
    saved = ours.parsed_once
    for turn in range(turns):
        for way in (("each open", "once") if turn % 2 == 0 else ("once", "each open")):
            ours.parsed_once = contextlib.nullcontext if way == "each open" else saved
            try:
                times[way].append(timed(lambda: prepare(path, Config(), False)))
            finally:
                ours.parsed_once = saved
    med = {w: statistics.median(t) for w, t in times.items()}
    return {"model": model, "each_open_s": round(med["each open"], 3),
            "once_s": round(med["once"], 3), "speedup": round(med["each open"] / med["once"], 2),
            "turns": {w: [round(x, 3) for x in t] for w, t in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here too")
    a = ap.parse_args()
    rows = [r for m in a.models.split(",") for r in measure(m, a.turns)]
    prepared = [measure_prepare(m, a.turns) for m in a.models.split(",")]
    print(f"\n{platform.processor() or platform.machine()}, {datetime.date.today()}, "
          f"median of {a.turns} turns\n")
    print("| model | case | stock (s) | views (s) | now (s) | now vs stock | now vs views |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['case']} | {r['stock_s']:.2f} | {r['views_s']:.2f} | "
              f"{r['now_s']:.2f} | **{r['speedup']:.2f}x** | **{r['speedup_views']:.2f}x** |")
    print("\nA served replica's `prepare`, its files' headers parsed at each open (before) and "
          "once:\n\n| model | each open (s) | once (s) | once vs each open |\n|---|---:|---:|---:|")
    for r in prepared:
        print(f"| {r['model']} | {r['each_open_s']:.2f} | {r['once_s']:.2f} | "
              f"**{r['speedup']:.2f}x** |")
    if a.out:
        Path(a.out).write_text(json.dumps({"loads": rows, "prepare": prepared}, indent=1))


if __name__ == "__main__":
    main()
