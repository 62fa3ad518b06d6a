#!/usr/bin/env python3
"""What a burst of requests leaves resident in a served model's processes, and how soon it goes.

    .venv/bin/python benchmarks/burst_memory.py [--model M] [--burst 400] [--tokens 8]
        [--wait 30] [--out FILE]

Starts `powerinfer serve --model M` with its defaults, warms it with 8 streams, then sends
`--burst` streamed requests at once (those past the queue answered 429, as a client's burst
is), and reads each process's PSS by role (`soak.pss_by_role`: the ingress, Serve's proxy, the
model replica, the scheduler, ...) after the warm-up, right after the burst, and every 5 s for
`--wait` seconds. The processes give a burst's freed heap back themselves
(`powerinfer.compat.HeapTrim`), within one period of their check (10 s) after it stops growing.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import time
from pathlib import Path

import serve as sv
import soak

ROLES = ("ingress", "Serve proxy", "scheduler", "model replica", "Serve controller")


def burst(server, n: int, tokens: int) -> int:
    """n streamed chat requests at once; how many were answered (the rest got an error)."""
    async def run():
        async with sv.http_client() as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a joke."}],
                    "max_tokens": tokens, "stream": True}
            return await asyncio.gather(*(sv.sse_request(client, server.url, dict(body))
                                          for _ in range(n)), return_exceptions=True)
    recs = asyncio.run(run())
    return sum(1 for r in recs if isinstance(r, dict) and r.get("done") and not r.get("error"))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--burst", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--wait", type=float, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []

    def read(tag: str, server):
        pss = soak.pss_by_role(server)
        rows.append({"when": tag, **{r: round(pss.get(r, 0.0), 1) for r in ROLES}})
        print(f"  {tag}: " + ", ".join(f"{r} {rows[-1][r]:.0f}" for r in ROLES), flush=True)

    with sv.our_server(args) as server:
        burst(server, 8, 16)
        time.sleep(3)
        read("warm", server)
        answered = burst(server, args.burst, args.tokens)
        read(f"after the burst ({answered} of {args.burst} answered)", server)
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.wait:
            time.sleep(5)
            read(f"{time.monotonic() - t0:.0f} s after", server)
    print(f"\n| PSS MiB ({args.model}, a burst of {args.burst}) | " + " | ".join(ROLES) + " |")
    print("|---|" + "---:|" * len(ROLES))
    for r in rows:
        print(f"| {r['when']} | " + " | ".join(f"{r[k]:.0f}" for k in ROLES) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": str(datetime.date.today()), "machine": platform.processor() or platform.machine(),
            "model": args.model, "burst": args.burst, "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
