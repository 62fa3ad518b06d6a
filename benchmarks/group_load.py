#!/usr/bin/env python3
"""How long an actor group takes to start, its torch-free roles loading through their child
process against reading what a child packed before from the shard cache, in turns.

    .venv/bin/python benchmarks/group_load.py [--model smollm2-135m-instruct] [--bundle B]
        [--dtype auto] [--weights auto] [--turns 3] [--out FILE]

A group is started again whenever one of its actors dies, and a served model's whenever its
replica does, with the same model and shape each time. Each load runs in a fresh process (its
own local Ray, started before the clock), `PowerInfer.from_pretrained(model,
Config(runtime="actors", bundle=B, dtype=D, weights=W))`, in two ways alternated within a turn:

- `child`: `POWERINFER_SHARD_CACHE=off`, each torch-free role (the cold executors, a bundle's
  predictor) starts its loading child, which imports torch and packs the shard, as on a first
  load (with `--weights dense` the roles run with torch, and the hot executor says so before
  any child);
- `cache`: the shard cache of an earlier load of the same group (made once, before the turns,
  unmeasured), each such role reads its packed bytes back.

Reported per way: the median group start (wall), and per role its own load (wall and CPU, the
child's included) and whether it came from the cache.
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one(model: str, bundle: str | None, dtype: str, weights: str) -> dict:
    """One group's start in this process (the `--child` side)."""
    import ray

    from cluster.topology import numa_resources
    from powerinfer import Config, PowerInfer
    from powerinfer.compat import ray_init
    ray_init(resources=numa_resources())  # (as the engine starts it: before the clock)
    t0 = time.perf_counter()
    config = Config(runtime="actors", bundle=bundle or "", dtype=dtype, weights=weights)
    pi = PowerInfer.from_pretrained(model, config)
    start_s = time.perf_counter() - t0
    try:
        out = pi.generate("The capital of France is", max_new_tokens=4, temperature=0)
        roles = {name: {k: r.get(k) for k in ("load_s", "load_cpu_s", "shard_cached", "torch")}
                 for name, r in pi.engine.group.info.items()}
        return {"start_s": start_s, "roles": roles, "text": out}
    finally:
        pi.close()
        ray.shutdown()


def run(model: str, bundle: str | None, cache: str, dtype: str, weights: str) -> dict:
    env = dict(os.environ, POWERINFER_SHARD_CACHE=cache)
    argv = [sys.executable, __file__, "--child", "--model", model, "--dtype", dtype,
            "--weights", weights] + (["--bundle", bundle] if bundle else [])
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not line:
        raise SystemExit(f"a load failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the runs as JSON here too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.model, a.bundle, a.dtype, a.weights)))
        return
    with tempfile.TemporaryDirectory(prefix="group-load-shards-") as cache:
        first = run(a.model, a.bundle, cache, a.dtype, a.weights)  # (fills the cache)
        runs: dict[str, list] = {"child": [], "cache": []}
        for turn in range(a.turns):
            for way in (("child", "cache") if turn % 2 == 0 else ("cache", "child")):
                r = run(a.model, a.bundle, "off" if way == "child" else cache, a.dtype, a.weights)
                runs[way].append(r)
                print(f"turn {turn + 1} {way}: group {r['start_s']:.2f} s; " + ", ".join(
                    f"{n} {x['load_s']:.2f} s ({x['load_cpu_s']:.2f} CPU)"
                    + (" cached" if x.get("shard_cached") else "")
                    for n, x in r["roles"].items() if x.get("load_s") is not None), flush=True)
    texts = {r["text"] for rs in runs.values() for r in rs} | {first["text"]}
    print(f"\n{a.model}{' with ' + Path(a.bundle).name if a.bundle else ''}, dtype {a.dtype}, "
          f"weights {a.weights}, "
          f"{a.turns} turns (medians); the same greedy text every load: {len(texts) == 1}")
    print("| way | group start s | " + " | ".join(
        f"{n} load s (CPU s)" for n, x in first["roles"].items() if x.get("load_s") is not None) + " |")
    for way, rs in runs.items():
        cells = []
        for n, x in first["roles"].items():
            if x.get("load_s") is None:
                continue
            cells.append(f"{statistics.median(r['roles'][n]['load_s'] for r in rs):.2f} "
                         f"({statistics.median(r['roles'][n]['load_cpu_s'] for r in rs):.2f})")
        print(f"| {way} | {statistics.median(r['start_s'] for r in rs):.2f} | " + " | ".join(cells) + " |")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "argv": sys.argv[1:], "first": first, "runs": runs, "same_text": len(texts) == 1}, indent=1))


if __name__ == "__main__":
    main()
