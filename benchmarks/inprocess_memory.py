#!/usr/bin/env python3
"""Memory of the in-process engine (`PowerInfer.from_pretrained(model)` with the defaults), each
model in a fresh process: what a Python API or CLI user's process holds.

    .venv/bin/python benchmarks/inprocess_memory.py [--models smollm2-135m-instruct gemma3-270m]
        [--tokens 32] [--out FILE]

For each model, read from /proc/self/smaps_rollup: after `import powerinfer` (torch included),
after the load, and after one greedy chat of `--tokens` tokens: resident memory (Rss), its
anonymous part (what no file backs: copies, heap, the KV cache's written blocks) and the file
pages mapped (the model file's among them). To compare two versions of the code, run it from
each checkout in turn (the figures are per process and do not depend on the machine's load).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
def mem():
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        k, v = line.split(":", 1)
        if k in ("Rss", "Anonymous", "Pss_File", "Pss_Anon"):
            out[k] = int(v.split()[0]) / 1024
    return out
import powerinfer
from powerinfer import Config, PowerInfer
got = {"imported": mem()}
pi = PowerInfer.from_pretrained(sys.argv[1], Config())
got["loaded"] = mem()
pi.chat([{"role": "user", "content": "What is the capital of France?"}],
        max_new_tokens=int(sys.argv[2]), temperature=0)
got["after a chat"] = mem()
got["config"] = pi.config.summary()
print("RESULT " + json.dumps(got))
"""


def measure(model: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, model, str(tokens)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{model}: the measuring process failed\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip() or "?"
    results = {}
    print(f"{datetime.date.today()} · {platform.processor() or platform.machine()} · code {rev}\n")
    print("| model | stage | Rss MiB | anonymous MiB | file pages (PSS) MiB |")
    print("|---|---|---:|---:|---:|")
    for m in a.models:
        r = results[m] = measure(m, a.tokens)
        for stage in ("imported", "loaded", "after a chat"):
            s = r[stage]
            print(f"| {m} | {stage} | {s['Rss']:.0f} | {s['Anonymous']:.0f} | "
                  f"{s.get('Pss_File', 0):.0f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"date": str(datetime.date.today()), "code": rev,
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
