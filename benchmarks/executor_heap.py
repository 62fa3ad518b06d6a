#!/usr/bin/env python3
"""A prompt through an actor group whose torch-free executors keep their steps' large blocks
for the next layer's tensors (`pilite::BlockCache`, the default) against freeing each to
malloc as it goes (`POWERINFER_KEPT_BLOCKS_MIB=0`), in turns.

    .venv/bin/python benchmarks/executor_heap.py [--model smollm2-135m-instruct]
        [--layouts 1 0] [--lengths 2000] [--prompts 3] [--turns 3] [--against DIR] [--idle]
        [--out FILE]

Each (layout, way) runs in a fresh process with its own local Ray (the setting is read where
each executor starts), the ways alternated within a turn: `kept` (this checkout's defaults),
`freed` (this checkout, `POWERINFER_KEPT_BLOCKS_MIB=0`) and, with `--against DIR`, `against`:
the checkout in DIR (a worktree of an earlier commit, its kernel library built there), the same
measurements of its code. Where glibc's malloc gives a step's freed blocks back to the system
depends on where in the heap each lands (a small block that outlives a step keeps the heap's
top from shrinking), so `freed` is not the code before the cache: `--against` is. A layout is the
group's count of cold executors: 1 (the default group: a hot and a cold executor, one core
each on a 2-core host) or 0 (one executor with the whole model on every core). Each process
loads the model (`Config(runtime="actors", prefix_cache=False)`), runs one prompt of each
length unmeasured, then `--prompts` prompts of each length (a fresh first word each, so no
cached prefix; one output token), and reports per length the median time to the answer, and
per executor its page faults (minor: pages mapped afresh) and CPU seconds a prompt, from
/proc. With `--idle` it then waits out two of the executors' idle periods
(`actors.clib.IDLE_RELEASE_S`) and reports each executor's anonymous memory before and after:
what the kept blocks hold, and that an idle group gives them back.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = "The history of the city goes back many centuries, and its people " * 200  # (2,600 tokens)
WAYS = {"kept": "", "freed": "0"}  # POWERINFER_KEPT_BLOCKS_MIB ("": the default)


def proc(pid: int) -> dict:
    """A process's minor faults and CPU seconds (/proc/PID/stat) and anonymous memory (MiB)."""
    from powerinfer.compat import process_memory
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {"minflt": int(f[7]), "cpu_s": (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"),
            "anon_mib": process_memory(pid, pss=False)["anon"] / 2**20}


def child(model: str, cold: int, lengths: list[int], prompts: int, idle: bool) -> dict:
    """One process's measurements (the `--child` side)."""
    import ray

    from actors import clib
    from powerinfer import Config, PowerInfer
    pi = PowerInfer.from_pretrained(model, Config(runtime="actors", cold_executors=cold,
                                                  prefix_cache=False, max_seq_len=max(lengths) + 64))
    try:
        pids = {name: r["pid"] for name, r in pi.engine.group.info.items()
                if name == "hot" or name.startswith("cold")}
        ids = pi.tokenize(TEXT)
        out = {"roles": sorted(pids), "lengths": {}}
        for n in lengths:
            text = pi.detokenize(ids[:n])
            pi.generate("Then " + text, max_new_tokens=1, temperature=0)  # (unmeasured)
            before = {k: proc(p) for k, p in pids.items()}
            times = []
            for i in range(prompts):
                t0 = time.perf_counter()
                pi.generate(f"{i} " + text, max_new_tokens=1, temperature=0)
                times.append(time.perf_counter() - t0)
            after = {k: proc(p) for k, p in pids.items()}
            blocks = {k: ray.get(pi.engine.group.actors[k].stats.remote()).get("blocks")
                      for k in pids}
            out["lengths"][n] = {
                "prompt_ms": statistics.median(times) * 1e3, "prompt_ms_all": [t * 1e3 for t in times],
                **{f"{k} faults": (after[k]["minflt"] - before[k]["minflt"]) / prompts for k in pids},
                **{f"{k} cpu_s": (after[k]["cpu_s"] - before[k]["cpu_s"]) / prompts for k in pids},
                "blocks": blocks}
        if idle:
            busy = {k: proc(p)["anon_mib"] for k, p in pids.items()}
            time.sleep(2 * getattr(clib, "IDLE_RELEASE_S", 10.0) + 1)
            out["anon_mib_after_prompts"] = busy
            out["anon_mib_idle"] = {k: proc(p)["anon_mib"] for k, p in pids.items()}
        return out
    finally:
        pi.close()
        ray.shutdown()


def run_child(args, cold: int, way: str) -> dict:
    tree = args.against if way == "against" else str(ROOT)
    env = {**os.environ, "POWERINFER_KEPT_BLOCKS_MIB": WAYS.get(way, ""), "PYTHONPATH": tree}
    cmd = [sys.executable, __file__, "--child", "--tree", tree, "--model", args.model,
           "--layouts", str(cold), "--lengths", *map(str, args.lengths),
           "--prompts", str(args.prompts)]
    if args.idle:
        cmd.append("--idle")
    p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"child failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layouts", nargs="+", type=int, default=[1, 0],
                    help="cold executors of each group measured (0: one executor)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[2000])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--idle", action="store_true", help="also the executors' memory once idle")
    ap.add_argument("--against", default=None,
                    help="another checkout (an earlier commit's worktree) measured as a third way")
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if max(args.lengths) > 2600:
        sys.exit("--lengths: at most 2,600 tokens (the text's)")
    if args.child:
        sys.path.insert(0, args.tree)
        print(json.dumps(child(args.model, args.layouts[0], args.lengths, args.prompts, args.idle)))
        return
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, {args.model}, "
          f"{os.cpu_count()} CPUs; each (layout, setting) a fresh process, alternated, "
          f"{args.turns} turns of {args.prompts} prompts", flush=True)
    ways = [*WAYS, *(["against"] if args.against else [])]
    runs = []
    for turn in range(args.turns):
        for cold in args.layouts:
            for setting in ways:
                r = run_child(args, cold, setting)
                runs.append({"turn": turn, "cold_executors": cold, "setting": setting, **r})
                for n, m in r["lengths"].items():
                    faults = ", ".join(f"{k} {m[f'{k} faults']:,.0f}" for k in r["roles"])
                    cpu = ", ".join(f"{k} {m[f'{k} cpu_s']:.2f}" for k in r["roles"])
                    print(f"turn {turn}: {cold} cold, {setting}, {n} tokens: "
                          f"{m['prompt_ms']:.0f} ms; faults a prompt: {faults}; CPU s: {cpu}; "
                          f"kept blocks MiB: " + ", ".join(
                              f"{k} {b['kept_bytes'] / 2**20:.1f}" for k, b in m["blocks"].items()
                              if b), flush=True)
                if args.idle:
                    print(f"  anonymous MiB after the prompts {r['anon_mib_after_prompts']}, "
                          f"idle {r['anon_mib_idle']}", flush=True)
    print("\n| group | prompt tokens | way | prompt ms (median of turns) | page faults a prompt "
          "(median) | CPU s a prompt, every executor (median) | against kept, ms |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for cold in args.layouts:
        for n in map(str, args.lengths):
            med = {}
            for setting in ways:
                rs = [r for r in runs if r["cold_executors"] == cold and r["setting"] == setting]
                ms = statistics.median(r["lengths"][n]["prompt_ms"] for r in rs)
                faults = statistics.median(sum(r["lengths"][n][f"{k} faults"] for k in r["roles"])
                                           for r in rs)
                cpu = statistics.median(sum(r["lengths"][n][f"{k} cpu_s"] for k in r["roles"])
                                        for r in rs)
                med[setting] = ms
                ratio = "" if setting == "kept" else f"{ms / med['kept']:.2f}x"
                group = "one executor" if cold == 0 else f"hot + {cold} cold"
                print(f"| {group} | {n} | {setting} | {ms:.0f} | {faults:,.0f} | {cpu:.2f} | "
                      f"{ratio} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": str(datetime.date.today()),
                                              "machine": platform.processor(),
                                              "cpus": os.cpu_count(), "args": vars(args),
                                              "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
