"""Ray's GCS memory as tasks accumulate: a local instance as `powerinfer serve` starts it (with
the project's cap on the task events the GCS keeps, `powerinfer.compat.LOCAL_RAY_CONFIG`)
against Ray's default, the same tasks in each.

A served request is a few actor tasks (the ingress's call into a model's replica, the replica's
into its scheduler) and Serve's control loop adds its own; the GCS keeps each task's events for
Ray's state API. This runs N small actor tasks in each instance (a fresh one per variant, in its
own process) and samples the GCS process's resident and proportional set size as they go.

    python benchmarks/gcs_memory.py --tasks 40000
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def gcs_memory() -> dict:
    import psutil
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "gcs_server":
                m = p.memory_full_info()
                return {"rss_mib": m.rss / 2**20, "pss_mib": m.pss / 2**20}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise RuntimeError("no GCS process among this process's children")


def run_variant(capped: bool, tasks: int, every: int) -> dict:
    import ray

    from powerinfer import compat
    if not capped:
        compat.LOCAL_RAY_CONFIG = {}  # Ray's default
    compat.ray_init()

    @ray.remote(num_cpus=0)
    class Echo:
        def call(self, i: int) -> int:
            return i

    a = Echo.remote()
    ray.get(a.call.remote(0))
    time.sleep(2)
    samples = [{"tasks": 0, **gcs_memory()}]
    t0 = time.perf_counter()
    for start in range(0, tasks, every):
        ray.get([a.call.remote(i) for i in range(start, min(tasks, start + every))])
        time.sleep(1.5)  # workers report task events every second
        samples.append({"tasks": min(tasks, start + every), **gcs_memory()})
        print(f"  {'capped' if capped else 'default'}: {samples[-1]['tasks']:>7,} tasks, GCS "
              f"RSS {samples[-1]['rss_mib']:.1f} MiB", flush=True)
    out = {"capped": capped, "config": compat.LOCAL_RAY_CONFIG, "samples": samples,
           "seconds": time.perf_counter() - t0}
    ray.shutdown()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=40_000)
    ap.add_argument("--every", type=int, default=5_000, help="tasks between samples")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gcs-memory.json"))
    ap.add_argument("--variant", choices=["capped", "default"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:  # one instance, in this process
        print(json.dumps(run_variant(args.variant == "capped", args.tasks, args.every)))
        return
    results = []
    for variant in ("default", "capped"):  # each in a process (and Ray instance) of its own
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--tasks",
                              str(args.tasks), "--every", str(args.every)],
                             capture_output=True, text=True, check=True)
        sys.stdout.write("".join(line + "\n" for line in out.stdout.splitlines()[:-1]))
        results.append(json.loads(out.stdout.splitlines()[-1]))
    print(f"\n{'variant':<9} {'GCS RSS at 0':>13} {'at ' + format(args.tasks, ','):>12} "
          f"{'growth':>8}")
    for r in results:
        a, b = r["samples"][0], r["samples"][-1]
        print(f"{'capped' if r['capped'] else 'default':<9} {a['rss_mib']:>10.1f} MiB "
              f"{b['rss_mib']:>8.1f} MiB {b['rss_mib'] - a['rss_mib']:>+7.1f}")
    Path(args.out).write_text(json.dumps({"tasks": args.tasks, "results": results,
                                          "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
