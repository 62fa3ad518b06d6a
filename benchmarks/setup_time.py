#!/usr/bin/env python3
"""How long `make setup` takes on a fresh clone: its installs by uv (the default) against pip
alone (`PIP_ONLY=1`), in turns.

    python3 benchmarks/setup_time.py [--turns 1] [--out FILE]

Each setup runs in a fresh clone of this checkout's HEAD (committed work only) in a temporary
directory, from no `.venv` to the stamp `make setup` writes (torch's CPU build, the project with
its test extras, the models' packages, the CPU kernel built for this machine), then the clone
is removed. The two ways alternate within a turn (uv first in odd turns, pip first in even
ones). Both download what they install from the package indexes (uv's cache is off; pip's
cache is whatever this machine's pip keeps), so the network's speed is part of both.

Reported: each setup's wall time, the median per way and pip's over uv's.
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


def setup_once(way: str) -> float:
    with tempfile.TemporaryDirectory(prefix="powerinfer-setup-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        flags = ["PIP_ONLY=1"] if way == "pip" else []
        t0 = time.perf_counter()
        run = subprocess.run(["make", "setup", *flags], cwd=clone, capture_output=True,
                             text=True)
        took = time.perf_counter() - t0
        if run.returncode:
            raise SystemExit(f"make setup ({way}) failed:\n{run.stdout[-3000:]}"
                             f"{run.stderr[-3000:]}")
        if way == "uv" and not (clone / ".venv" / "bin" / "uv").exists():
            raise SystemExit("make setup did not install uv: its installs ran by pip")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from powerinfer.cpu import cpu_name
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    print(f"make setup on fresh clones of {head}, {cpu_name()}, "
          f"{len(os.sched_getaffinity(0))} cores")
    times: dict[str, list[float]] = {"uv": [], "pip": []}
    for turn in range(args.turns):
        for way in (("uv", "pip") if turn % 2 == 0 else ("pip", "uv")):
            took = setup_once(way)
            times[way].append(took)
            print(f"  turn {turn + 1}, {way}: {took:.1f} s", flush=True)
    med = {w: statistics.median(t) for w, t in times.items()}
    print(f"medians: uv {med['uv']:.1f} s, pip {med['pip']:.1f} s: "
          f"pip's over uv's {med['pip'] / med['uv']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "commit": head, "cpu": cpu_name(), "machine": platform.machine(),
            "date": datetime.date.today().isoformat(), "python": sys.version.split()[0],
            "times_s": times, "median_s": med, "pip_over_uv": med["pip"] / med["uv"]},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
