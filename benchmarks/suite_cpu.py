#!/usr/bin/env python3
"""Where a command's CPU goes, by kind of process: the test suite's, a server start's.

    .venv/bin/python benchmarks/suite_cpu.py [--every 0.25] [--out FILE] -- CMD [ARGS...]
    .venv/bin/python benchmarks/suite_cpu.py -- .venv/bin/python -m pytest -q

Runs CMD and, until it exits, reads every process's CPU time (user + system, /proc/PID/stat)
every `--every` seconds, keyed by pid and start time, with the last command line seen (a Ray
worker renames itself to its actor's class once it holds one). Then it sums the CPU of the
processes that started during the run by kind (`KINDS`: each actor role, Ray's own services,
the loading children of the torch-free roles, the test process itself), and reports the
machine's busy and idle time over the run from /proc/stat, so the two can be set side by side:
a 2-core machine that is 80% busy for 15 minutes spent 24 minutes of CPU. Processes that lived
between two readings are missed (a short `python -c` at most), and a process that started
before the run (a kernel thread, the machine's agents) counts only in the machine's busy time.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import time

import serve as sv

from powerinfer.cpu import machine_jiffies

# (kind, pattern in the command line): the first that matches names the process
KINDS = (
    ("the command (the test process)", None),  # the pid run here
    ("hot executor", r"ray::HotExecut"), ("cold executor", r"ray::ColdExecut"),
    ("predictor", r"ray::PredictorA"), ("scheduler", r"ray::Scheduler"),
    ("Serve replica (models, ingress)", r"ray::ServeRepli"), ("Serve proxy", r"ray::ProxyActor"),
    ("Serve controller", r"ray::ServeController"),
    ("a torch-free role's loading child", r"actors\.pack "),
    ("Ray task worker (a served model's prepare, ...)", r"ray::IDLE|default_worker"),
    ("Ray: dashboard and its agents", r"dashboard|ray::DashboardAgent|ray::RuntimeEnvAgent"),
    ("Ray: GCS, raylet, log monitor", r"gcs_server|raylet|log_monitor"),
    ("Triton's compiler", r"triton"),
    ("other processes it started", r""),
)


def kind(cmd: str, pid: int, root: int) -> str:
    for name, pattern in KINDS:
        if pattern is None:
            if pid == root:
                return name
        elif re.search(pattern, cmd):
            return name
    return KINDS[-1][0]


def processes() -> dict[str, tuple[float, str, int]]:
    """key "pid:start" -> (CPU seconds, command line, pid) of every process now (a pid can be
    used again in a long run; with its start time it names one process)."""
    tick = os.sysconf("SC_CLK_TCK")
    return {f"{pid}:{fields[19]}": ((int(fields[11]) + int(fields[12])) / tick,
                                    " ".join(argv) or stat[stat.find("(") + 1:stat.rfind(")")], pid)
            for pid, stat, fields, argv in sv.proc_entries()}


def machine_times() -> tuple[int, int]:
    busy, every = machine_jiffies()
    return busy, every - busy  # busy, idle (+ iowait)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=0.25, help="seconds between readings")
    ap.add_argument("--out", help="a JSON file for the totals")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given (after --)")
    before = set(processes())
    busy0, idle0 = machine_times()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    seen: dict[str, tuple[float, str, int]] = {}
    while True:
        for key, value in processes().items():
            if key not in before and value[2] != os.getpid():
                seen[key] = value if key not in seen or value[0] >= seen[key][0] else seen[key]
        if proc.poll() is not None:
            break
        time.sleep(args.every)
    wall = time.perf_counter() - t0
    busy1, idle1 = machine_times()
    tick = os.sysconf("SC_CLK_TCK")
    busy, idle = (busy1 - busy0) / tick, (idle1 - idle0) / tick
    by_kind: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for cpu, line, pid in seen.values():
        k = kind(line, pid, proc.pid)
        by_kind[k] += cpu
        count[k] += 1
    total = sum(by_kind.values())
    print(f"\n## CPU by kind of process ({datetime.date.today()})\n")
    print(f"- Machine: {sv.machine()}; "
          f"command exit status {proc.returncode}")
    print(f"- Wall {wall:.0f} s; the machine busy {busy:.0f} s of CPU, idle {idle:.0f} s "
          f"({100 * busy / max(busy + idle, 1e-9):.0f}% busy); the processes the run started "
          f"{total:.0f} s ({len(seen)} processes)\n")
    print("| kind of process | processes | CPU s | share |")
    print("|---|---:|---:|---:|")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {count[k]} | {v:.1f} | {100 * v / max(total, 1e-9):.0f}% |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": str(datetime.date.today()), "machine": sv.machine(), "wall_s": wall,
                       "busy_s": busy, "idle_s": idle, "cpus": os.cpu_count(),
                       "returncode": proc.returncode,
                       "by_kind": {k: {"processes": count[k], "cpu_s": round(v, 2)}
                                   for k, v in by_kind.items()}}, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
