#!/usr/bin/env python3
"""What a burst of requests leaves resident in a served model's processes, and how soon it goes.

    .venv/bin/python benchmarks/burst_memory.py [--model M] [--burst 400] [--tokens 8]
        [--wait 30] [--bursts 1] [--smaps] [--out FILE]

Starts `powerinfer serve --model M` with its defaults, warms it with 8 streams, then sends
`--burst` streamed requests at once (those past the queue answered 429, as a client's burst
is), and reads each process's PSS by role (`soak.pss_by_role`: the ingress, Serve's proxy, the
model replica, the scheduler, ...) after the warm-up, right after the burst, and every 5 s for
`--wait` seconds. The processes give a burst's freed heap back themselves
(`powerinfer.compat.HeapTrim`), within one period of their check (10 s) after it stops growing.
`--bursts N` sends N bursts, each waited for (a second one tells a high-water mark from growth
per burst); `--smaps` prints, after each burst's wait, where each role's PSS moved since the
warm-up or the burst before, by kind of mapping (/proc/PID/smaps: the brk heap, 1 MiB anonymous
mappings, which are Python's object arenas, other anonymous memory (glibc's thread arenas and
large blocks, stacks), files).
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


def mappings(pid: int) -> dict[str, float]:
    """A process's PSS (MiB) by kind of mapping, from /proc/PID/smaps."""
    out: dict[str, float] = {}
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                name = head[5] if len(head) > 5 else ""
                kind = ("the brk heap" if name == "[heap]" else
                        "1 MiB anonymous (Python's arenas)" if not name and hi - lo == 1 << 20 else
                        "other anonymous" if not name else
                        f"file {name.rsplit('/', 1)[-1][:48]}" if name.startswith("/") else name)
            elif head[0] == "Pss:" and kind is not None:
                out[kind] = out.get(kind, 0.0) + int(head[1]) / 1024
    return out


def smaps_by_role(server) -> dict[str, dict[str, float]]:
    got = {}
    for pid, cmd in sv.server_tree(server).items():
        role = sv.role_of(cmd)[0]
        if role in ROLES and role not in got:
            try:
                got[role] = mappings(pid)
            except OSError:  # (gone)
                pass
    return got


def moved(before: dict, after: dict, at_least: float = 0.5) -> list[str]:
    """Each role's kinds of mapping whose PSS moved by at least `at_least` MiB."""
    lines = []
    for role in ROLES:
        a, b = before.get(role, {}), after.get(role, {})
        for kind in sorted(set(a) | set(b), key=lambda k: b.get(k, 0) - a.get(k, 0), reverse=True):
            d = b.get(kind, 0) - a.get(kind, 0)
            if abs(d) >= at_least:
                lines.append(f"    {role}: {kind} {a.get(kind, 0):.1f} -> {b.get(kind, 0):.1f} MiB "
                             f"({d:+.1f})")
    return lines


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
    ap.add_argument("--bursts", type=int, default=1)
    ap.add_argument("--smaps", action="store_true", help="where each role's PSS moved, by mapping")
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
        maps = [smaps_by_role(server)] if args.smaps else []
        for k in range(args.bursts):
            answered = burst(server, args.burst, args.tokens)
            nth = f" {k + 1}" if args.bursts > 1 else ""
            read(f"after the burst{nth} ({answered} of {args.burst} answered)", server)
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.wait:
                time.sleep(5)
                read(f"{time.monotonic() - t0:.0f} s after{nth}", server)
            if args.smaps:
                maps.append(smaps_by_role(server))
                print(f"  where the PSS moved, {'the warm-up' if k == 0 else f'burst {k}'} to "
                      f"{args.wait:.0f} s after burst {k + 1}:", flush=True)
                print("\n".join(moved(maps[-2], maps[-1])) or "    nothing past 0.5 MiB")
    print(f"\n| PSS MiB ({args.model}, a burst of {args.burst}) | " + " | ".join(ROLES) + " |")
    print("|---|" + "---:|" * len(ROLES))
    for r in rows:
        print(f"| {r['when']} | " + " | ".join(f"{r[k]:.0f}" for k in ROLES) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": str(datetime.date.today()), "machine": platform.processor() or platform.machine(),
            "model": args.model, "burst": args.burst, "tokens": args.tokens, "rows": rows,
            "smaps": maps}, indent=1))


if __name__ == "__main__":
    main()
