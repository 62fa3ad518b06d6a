#!/usr/bin/env python3
"""An hour of faults: a served model under steady load while faults come one at a time, every
request accounted for, the server's resources back where they were, and the run as a plot.

    .venv/bin/python benchmarks/soak.py [--minutes 60] [--fault-every 300] [--streams 32]
        [--model smollm2-135m-instruct] [--flags "SERVE FLAGS"] [--faults KIND ...]
        [--warmup SECONDS] [--out FILE] [--plot FILE]

    # the suite's variant (tests/test_soak.py): 1.1 minutes, a fault every 6 s, 8 streams
    .venv/bin/python benchmarks/soak.py --minutes 1.1 --fault-every 6 --streams 8 --burst 200

`powerinfer serve --model M` (its defaults, and `--flags`) serves `--streams` clients, each
sending streaming chat completions back to back for `--minutes`: mixed lengths (16, 48 or 128
tokens, `ignore_eos`), three in five greedy over a fixed prompt set, the rest sampled with a
seed. Before the load, each prompt's greedy answer of 128 tokens is asked once on the idle
server: the undisturbed run every greedy request of the load must reproduce (its first tokens).

Every `--fault-every` seconds one fault, in turn (`--faults`, default all, in this order):

- `cold`, `hot`, `scheduler`, `predictor`: SIGKILL that actor of the model's group (its pid from
  the model deployment's stats(); `predictor` only where the group has one);
- `hangup`: a client reads three chunks of a stream and closes the connection: its batch slot
  must come free (the scheduler's cancelled count rises);
- `burst`: `--burst` non-streaming requests at once, past the queue: each answered 200 or 429;
- `malformed`: bodies that are not JSON, of the wrong types, or for a model that is not served:
  each a 4xx, never a 5xx;
- `long`: a prompt longer than the model's context: a 400 that says so;
- `ingress`: SIGKILL the ingress replica (Serve starts another; the streams it carried are cut:
  a client has to send them again);
- `replica`: SIGKILL the model deployment's replica process (Serve starts another; its group
  goes with it, and the streams in flight resume on the new one once it has loaded).

A load request ends in one of: `ok` (its [DONE], every token it asked for, and for a greedy one
the undisturbed text, or a text that parts from it at a close call: the two runs' tokens there
each among the other's 5 likeliest, within 1.0 of its pick, as a sum rounded in a batch of
another size moves a near-tie where the kernels are not batch-invariant (a GPU's; on a CPU, with
the defaults or a bundle, a sequence's tokens do not depend on its batch, and a served model's
runs count none), `clean` (an HTTP status with the server's error body, or an error event and
then [DONE]: the client can retry), `lost` (the connection dropped, a status without the
server's error body, or a stream that ended without its [DONE] or short of the tokens it asked
for, with no error), `corrupt` (completed with other text than the undisturbed run's that does
not part from it at a close call, for a greedy request). Requests lost while an ingress kill takes
effect (in flight then, or sent in the 10 s after it, which Serve's proxy may answer with a bare
500) are counted apart (`cut_by_ingress`).

Every 5 s the run samples the model's stats() (running, waiting, KV usage, restarts) and the PSS
of the server's process tree, and every 30 s the model's memory() (each process's own report):
the KV cache's pages in RAM. The KV pool is reserved at start and its pages become resident as
blocks are first written, so the tree's PSS rises with the pool's use up to "with its KV cache
full", as `powerinfer serve` prints it; what would be a leak is the rest. After the load the run
waits for the queue to drain and then checks that nothing is left over: the KV blocks in use
back to the baseline's, the server's PSS less the KV cache's resident pages within
`--pss-slack` (default 10%) of the baseline's, no `/dev/shm/powerinfer-*` segment, and one
process of each actor of the group (none of a replaced group left running). The baseline is
taken after the undisturbed run; with `--warmup S`, after S seconds of the same load without
faults, once drained: a served-and-drained state against another, so that what a process keeps
after its first busy minute (its heap's and its allocator's high-water mark under the streams,
which a replaced actor reaches again) is told apart from growth over the run. Both baselines are
reported.

Output: a summary table printed (and `--out` JSON with every request and sample); `--plot`
(default `benchmarks/plots/soak.png`): tokens/s and TTFT p50 over time, faults marked. The exit
status is 1 when a request was lost or corrupt, or something was left over.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as sv  # noqa: E402 - the server, the load generator's client and /proc readers

# the slowest to recover (a replica reloads its model) early, the quick ones last: a short run
# ends with nothing still being rebuilt
FAULTS = ("cold", "hangup", "replica", "hot", "burst", "ingress", "scheduler", "malformed",
          "predictor", "long")
PROMPTS = sv.PROMPTS
LENGTHS = (16, 48, 128)
HANGUP_TOKENS = 2048  # the hang-up fault's request (it reads three chunks, then closes)
SAMPLE_S = 5.0


# ------------------------------------------------------------------------------ requests

def body(prompt: str, tokens: int, greedy: bool, seed: int) -> dict:
    b = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    # a greedy request's tokens with their 5 likeliest, to tell a close call from corruption
    b.update({"temperature": 0, "logprobs": True, "top_logprobs": TOP} if greedy
             else {"temperature": 0.8, "seed": seed})
    return b


TOP = 5
CLOSE = 1.0  # log-probability: a close call's two tokens are within this of each other


def close_call(want: dict, got: dict) -> bool:
    """Whether two runs' tokens at their first parting (OpenAI logprobs entries) are a close
    call: each token among the other run's likeliest, within CLOSE of its pick."""
    top_w = {t["token"]: t["logprob"] for t in want.get("top_logprobs", ())}
    top_g = {t["token"]: t["logprob"] for t in got.get("top_logprobs", ())}
    return got["token"] in top_w and want["token"] in top_g and \
        want["logprob"] - top_w[got["token"]] <= CLOSE and \
        got["logprob"] - top_g[want["token"]] <= CLOSE


def parting(rec: dict, want: dict) -> str | None:
    """For a greedy request whose text is not the undisturbed run's: "close" where the two
    part at a close call (`close_call`: a sum in another order, as a batch of another size
    rounds it where the kernels are not batch-invariant, moved a near-tie), else None. A stream
    resumed from the wrong place or state parts at once and far."""
    mine, theirs = rec.get("logprobs") or [], want.get("logprobs") or []
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a["token"] != b["token"]:
            rec["parted"] = {"at": i, "undisturbed": a, "this": b}  # (kept in --out)
            return "close" if close_call(a, b) else None
    rec["parted"] = {"at": None, "tokens": len(mine), "undisturbed_tokens": len(theirs)}
    return None


def classify(rec: dict, reference: dict[str, dict]) -> str:
    if rec["status"] is not None and rec["status"] != 200:
        # a status code with the server's error body (OpenAI's shape), before any token; not
        # a bare one (say, a 500 of Serve's proxy itself)
        return "clean" if (rec["body"] or "").lstrip().startswith('{"error"') else "lost"
    if rec["dropped"] or not rec["done"]:
        return "lost"
    if rec["error"]:
        return "clean"  # an error event, then [DONE]
    got = (rec["usage"] or {}).get("completion_tokens")
    if got != rec["tokens"]:
        return "lost"
    want = reference[rec["prompt"]]
    if rec["greedy"] and not want["text"].startswith(rec["text"]):
        if parting(rec, want) == "close":
            rec["close_call"] = True
            return "ok"
        return "corrupt"
    return "ok"


# -------------------------------------------------------------------------------- faults

def group_pid(server, role: str) -> int | None:
    return sv.ready_stats(server)["pids"].get(role)


def pid_of(server, needle: str) -> int | None:
    return next((p for p, cmd in sv.server_tree(server).items() if needle in cmd), None)


def kill(pid: int | None) -> str:
    if pid is None:
        return "skipped: no such process"
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL pid {pid}"


async def hangup(server, client) -> str:
    before = (await asyncio.to_thread(sv.ready_stats, server)).get("cancelled", 0)
    # (long: a request of 128 tokens could finish before its cancel crossed the proxy, the
    # ingress and the replica on a busy host, and then nothing is cancelled: seen once on two
    # cores shared with other work. 2,048 tokens take tens of seconds at the load's pace)
    async with client.stream("POST", server.url + sv.CHAT,
                             json=body(PROMPTS[0], HANGUP_TOKENS, True, 0)) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: {")
            if n >= 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline:
        if (await asyncio.to_thread(sv.ready_stats, server)).get("cancelled", 0) > before:
            return "ok: the scheduler cancelled it"
        await asyncio.sleep(0.5)
    return "failed: not cancelled within 60 s"


async def burst(server, client, n: int) -> str:
    b = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
         "temperature": 0}

    async def one():
        try:
            return (await client.post(server.url + sv.CHAT, json=b)).status_code
        except Exception as e:  # noqa: BLE001 - counted
            return type(e).__name__

    codes = await asyncio.gather(*(one() for _ in range(n)))
    count = {str(c): codes.count(c) for c in set(codes)}
    bad = {c: k for c, k in count.items() if c not in ("200", "429")}
    return ("ok: " if not bad else "failed: ") + json.dumps(count, sort_keys=True)


async def malformed(server, client) -> str:
    url, h = server.url + sv.CHAT, {"content-type": "application/json"}
    cases = [("not JSON", dict(content=b"{not json", headers=h)),
             ("wrong types", dict(json={"model": "m", "messages": "hello", "max_tokens": "x"})),
             ("no messages", dict(json={"model": "m"})),
             ("unknown model", dict(json={"model": "nope", "messages": [
                 {"role": "user", "content": "hi"}]}))]
    got = {}
    for name, kw in cases:
        got[name] = (await client.post(url, **kw)).status_code
    bad = {k: v for k, v in got.items() if not 400 <= v < 500}
    return ("ok: " if not bad else "failed: ") + json.dumps(got)


async def long_prompt(server, client) -> str:
    text = "the quick brown fox jumps over the lazy dog " * 3000  # ~27k tokens
    r = await client.post(server.url + sv.CHAT, json={
        "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4})
    ok = r.status_code == 400 and "context" in r.text
    return ("ok: " if ok else "failed: ") + f"HTTP {r.status_code} {r.text[:120]}"


async def fault(kind: str, server, client, args) -> str:
    # (what blocks, a stats() call through the Ray agent or a walk of /proc, runs in a thread:
    # the load's streams are read on this event loop)
    if kind in ("cold", "hot", "scheduler", "predictor"):
        role = "cold.0" if kind == "cold" else kind
        return kill(await asyncio.to_thread(group_pid, server, role))
    needle = {"replica": "ServeReplica:powerinfer:Model:",
              "ingress": "ServeReplica:powerinfer:Ingress"}
    if kind in needle:
        return kill(await asyncio.to_thread(pid_of, server, needle[kind]))
    if kind == "hangup":
        return await hangup(server, client)
    if kind == "burst":
        return await burst(server, client, args.burst)
    if kind == "malformed":
        return await malformed(server, client)
    if kind == "long":
        return await long_prompt(server, client)
    raise ValueError(kind)


# ------------------------------------------------------------------------------- the run

def server_pss(server) -> float:
    return sum(pss_by_role(server).values())


def pss_by_role(server) -> dict[str, float]:
    """The server's tree's PSS by role (`serve.py`'s roles: each actor kind, Serve's processes,
    Ray's own by program): where a growth is, when the total grows."""
    out: dict[str, float] = {}
    for pid, cmd in sv.server_tree(server).items():
        role = sv.role_of(cmd)[0]
        out[role] = out.get(role, 0.0) + (sv.pss_mib(pid) or 0.0)
    return out


def kv_resident_mib(server, by_actor: dict | None = None,
                   weights: dict | None = None) -> float | None:
    """The KV cache's pages in RAM, over the model's processes (their own reports); each
    actor's into `by_actor`, and the weights' pages in RAM (a mapped file's as they are first
    read: bounded by the weights) into `weights["mib"]`."""
    try:
        mem = server.agent.call("memory", 60, timeout=60)
    except Exception:  # noqa: BLE001 - loading or rebuilding: not known now
        return None
    if not mem:
        return None
    if by_actor is not None:
        by_actor.update({k: p.get("kv_resident", 0) / 2**20 for k, p in mem.items()})
    if weights is not None:
        weights["mib"] = sum(p.get("weight_resident", 0) for p in mem.values()) / 2**20
    return sum(p.get("kv_resident", 0) for p in mem.values()) / 2**20


def pss_less_kv(server, tries: int = 10, weights: dict | None = None) -> tuple[float, float | None]:
    """(the tree's PSS, the same less the KV cache's resident pages), read together; the
    weights' resident pages into `weights["mib"]` where given."""
    for _ in range(tries):
        kv = kv_resident_mib(server, weights=weights)
        pss = server_pss(server)
        if kv is not None:
            return pss, pss - kv
        time.sleep(3)
    return server_pss(server), None


def leftovers(server, baseline: dict) -> dict:
    """What the run left behind, against the baseline's."""
    roles = [sv.role_of(cmd)[0] for cmd in sv.server_tree(server).values()]
    actors = {r: roles.count(r) for r in ("hot executor", "cold executor", "scheduler",
                                          "predictor", "model replica", "ingress")}
    return {"shm_segments": sorted(p.name for p in Path("/dev/shm").glob("powerinfer-*")),
            "actors": actors, "extra_actors": {r: n for r, n in actors.items()
                                               if n > baseline["actors"].get(r, 0)}}


def settle(server, baseline: dict, wait: float = 120) -> dict:
    """Once the queue is empty and the group ready: the KV blocks in use and the PSS against the
    baseline's (the prefix cache's blocks are evictable: they count as free)."""
    deadline = time.perf_counter() + wait
    st = {}
    while time.perf_counter() < deadline:
        with contextlib.suppress(Exception):
            st = sv.ready_stats(server, wait=30)
            if st.get("running", 1) == 0 and st.get("waiting", 1) == 0 \
                    and st.get("kv_usage", 1) <= baseline["kv_usage"] + 1e-9:
                break
        time.sleep(1)
    weights = {}
    pss, rest = pss_less_kv(server, weights=weights)
    return {"pss_by_role": pss_by_role(server), "kv_usage": st.get("kv_usage"),
            "weight_resident_mib": weights.get("mib"),
            "running": st.get("running"),
            "waiting": st.get("waiting"), "restarts": st.get("restarts"),
            "pss_mib": pss, "pss_less_kv_mib": rest, **leftovers(server, baseline)}


async def run_load(server, args, reference: dict, t_end: float, records: list, faults: list,
                   kinds: list[str]):
    async with sv.http_client() as client:
        async def client_loop(k: int):
            rng = random.Random(k)
            while time.perf_counter() < t_end:
                p = rng.randrange(len(PROMPTS))
                greedy = rng.random() < 0.6
                rec = {"client": k, "prompt": PROMPTS[p], "greedy": greedy,
                       "tokens": rng.choice(LENGTHS)}
                records.append(rec)
                rec.update(sv.new_record())
                await sv.sse_request(client, server.url, body(PROMPTS[p], rec["tokens"], greedy,
                                                              rng.randrange(1 << 30)), rec)
                if rec["status"] not in (None, 200):
                    await asyncio.sleep(1)  # a 429 or 503: back off, as a client would

        async def fault_loop():
            if not kinds:
                return
            i = 0
            t0 = time.perf_counter()
            while True:
                at = t0 + (i + 1) * args.fault_every
                if at > t_end - min(args.fault_every / 2, 30):
                    return
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                kind = kinds[i % len(kinds)]
                ev = {"kind": kind, "t": time.perf_counter()}
                try:
                    ev["result"] = await fault(kind, server, client, args)
                except Exception as e:  # noqa: BLE001 - reported
                    ev["result"] = f"failed: {type(e).__name__}: {e}"[:300]
                ev["t_end"] = time.perf_counter()
                faults.append(ev)
                print(f"  {ev['t'] - t0:6.0f} s  fault {kind}: {ev['result']}", flush=True)
                i += 1

        await asyncio.gather(fault_loop(), *(client_loop(k) for k in range(args.streams)))


def sampler(server, stop: threading.Event, samples: list):
    n = 0
    while not stop.wait(SAMPLE_S):
        roles = pss_by_role(server)
        s = {"t": time.perf_counter(), "pss_mib": sum(roles.values()), "pss_by_role": roles}
        n += 1
        if n % 6 == 0:
            s["kv_by_actor"] = {}
            kv = kv_resident_mib(server, s["kv_by_actor"])
            if kv is not None:
                s["kv_resident_mib"] = kv
        with contextlib.suppress(Exception):
            st = server.stats(10)
            s.update({k: st.get(k) for k in ("running", "waiting", "kv_usage", "restarts")})
        s["replica"] = pid_of(server, "ServeReplica:powerinfer:Model:")  # (its pid)
        samples.append(s)


def rebuilds(samples: list[dict]) -> tuple[int, int]:
    """(group rebuilds, replica restarts) seen in the samples: a new replica starts its count of
    rebuilds again."""
    groups, replicas, last = 0, 0, None
    for s in samples:
        if s.get("restarts") is None:
            continue
        if last is not None and s.get("replica") != last.get("replica"):
            replicas += 1
        elif last is not None:
            groups += max(0, s["restarts"] - last["restarts"])
        last = s
    return groups, replicas


def buckets(records: list, t0: float, t1: float) -> list[dict]:
    """Tokens/s and TTFT p50 over time, in about 120 windows (5 s at least)."""
    width = max(5.0, (t1 - t0) / 120)
    out = []
    t = t0
    while t < t1:
        toks = sum(1 for r in records for s in r["stamps"] if t <= s < t + width)
        ttft = [r["stamps"][0] - r["t0"] for r in records
                if r["stamps"] and t <= r["t0"] < t + width]
        out.append({"t": t - t0 + width / 2, "tok_s": toks / width,
                    "ttft_p50": statistics.median(ttft) if ttft else None})
        t += width
    return out


def plot(path: Path, series: list[dict], samples: list[dict], faults: list[dict], t0: float,
         title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    x = [s["t"] / 60 for s in series]
    a.plot(x, [s["tok_s"] for s in series], color="tab:blue")
    a.set_ylabel("tokens/s (all streams)")
    b.plot([s["t"] / 60 for s in series if s["ttft_p50"] is not None],
           [s["ttft_p50"] for s in series if s["ttft_p50"] is not None], color="tab:orange")
    b.set_ylabel("TTFT p50 (s)")
    c.plot([(s["t"] - t0) / 60 for s in samples], [s["pss_mib"] for s in samples],
           color="tab:green", label="the server's PSS")
    kv = [s for s in samples if "kv_resident_mib" in s]
    c.plot([(s["t"] - t0) / 60 for s in kv], [s["pss_mib"] - s["kv_resident_mib"] for s in kv],
           color="tab:purple", marker=".", label="less the KV cache's pages in RAM")
    c.set_ylabel("MiB")
    c.legend(fontsize=8, loc="upper left")
    c.set_xlabel("minutes")
    for f in faults:
        for ax in (a, b, c):
            ax.axvline((f["t"] - t0) / 60, color="tab:red", alpha=0.4, lw=1)
        a.annotate(f["kind"], ((f["t"] - t0) / 60, a.get_ylim()[1]), rotation=90, fontsize=7,
                   va="top", ha="right", color="tab:red")
    a.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flags", default="", help="extra `powerinfer serve` flags (one string)")
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--fault-every", type=float, default=300, help="seconds between faults")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--burst", type=int, default=400, help="requests of the burst fault")
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--pss-slack", type=float, default=0.10)
    ap.add_argument("--warmup", type=float, default=0,
                    help="seconds of the load without faults before the baseline is taken (after "
                         "it drains): the memory check then compares a served-and-drained state "
                         "with another, so a process's high-water mark under the streams (its "
                         "heap, its allocator's arenas) is not counted as growth; 0: the baseline "
                         "after the undisturbed run alone")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=str(Path(__file__).parent / "plots" / "soak.png"))
    args = ap.parse_args()
    started = datetime.datetime.now()
    records, faults, samples, warm_records = [], [], [], []
    with sv.our_server(args, args.flags.split()) as server:
        # (a group without a predictor, or without cold executors, has none of them to kill)
        kinds = [k for k in args.faults if k not in ("predictor", "cold")
                 or group_pid(server, "cold.0" if k == "cold" else k)]
        print(f"  undisturbed run: {len(PROMPTS)} greedy answers of {max(LENGTHS)} tokens",
              flush=True)

        async def undisturbed() -> dict:  # together: batched, as the load's requests are
            async with sv.http_client() as client:
                recs = await asyncio.gather(*(sv.sse_request(
                    client, server.url, body(p, max(LENGTHS), True, 0)) for p in PROMPTS))
                for rec in recs:
                    assert rec["done"] and not rec["error"], rec
                return {p: {"text": rec["text"], "logprobs": rec.get("logprobs") or []}
                        for p, rec in zip(PROMPTS, recs)}

        reference = asyncio.run(undisturbed())

        def measured() -> dict:
            st = sv.ready_stats(server)
            weights = {}
            pss, rest = pss_less_kv(server, weights=weights)
            return {"kv_usage": st.get("kv_usage", 0.0), "restarts": st.get("restarts", 0),
                    "pss_mib": pss, "pss_less_kv_mib": rest, "pss_by_role": pss_by_role(server),
                    "weight_resident_mib": weights.get("mib"),
                    **leftovers(server, {"actors": {}})}

        cold = measured()  # after the undisturbed run alone
        if args.warmup > 0:  # the load without faults, then the baseline once it has drained
            print(f"  warm-up: {args.streams} streams for {args.warmup:g} s, no faults", flush=True)
            asyncio.run(run_load(server, args, reference, time.perf_counter() + args.warmup,
                                 warm_records, [], []))
            settle(server, cold)
            baseline = measured()
        else:
            baseline = cold
        stop = threading.Event()
        sampling = threading.Thread(target=sampler, args=(server, stop, samples), daemon=True)
        sampling.start()
        t0 = time.perf_counter()
        t_end = t0 + args.minutes * 60
        print(f"  load: {args.streams} streams for {args.minutes:g} min, a fault every "
              f"{args.fault_every:g} s ({', '.join(kinds)})", flush=True)
        asyncio.run(run_load(server, args, reference, t_end, records, faults, kinds))
        t1 = time.perf_counter()
        after = settle(server, baseline)
        stop.set()
        sampling.join(timeout=30)
    outcomes = {k: 0 for k in ("ok", "clean", "lost", "corrupt")}
    ingress_kills = [(f["t"], f["t_end"]) for f in faults if f["kind"] == "ingress"
                     and f["result"].startswith("SIGKILL")]
    cut = 0
    for r in records:
        r["outcome"] = classify(r, reference)
        # a stream through the ingress that was killed: cut by design (the client resends)
        if r["outcome"] == "lost" and any(r["t0"] <= b + 10 and r["t1"] >= a
                                          for a, b in ingress_kills):
            r["outcome"], cut = "cut_by_ingress", cut + 1
            continue
        outcomes[r["outcome"]] += 1
    warm = {k: 0 for k in ("ok", "clean", "lost", "corrupt")}  # (no fault there: none is cut)
    for r in warm_records:
        r["outcome"] = classify(r, reference)
        warm[r["outcome"]] += 1
    tokens = sum(len(r["stamps"]) for r in records)
    series = buckets(records, t0, t1)
    failed_faults = [f for f in faults if f["result"].startswith("failed")]
    left = {"shm_segments": after["shm_segments"], "extra_actors": after["extra_actors"],
            "kv_usage_after": after["kv_usage"], "kv_usage_before": baseline["kv_usage"],
            "pss_before_mib": round(baseline["pss_mib"]), "pss_after_mib": round(after["pss_mib"]),
            "pss_less_kv_before_mib": baseline["pss_less_kv_mib"],
            "pss_less_kv_after_mib": after["pss_less_kv_mib"],
            "weight_resident_before_mib": baseline["weight_resident_mib"],
            "weight_resident_after_mib": after["weight_resident_mib"],
            "pss_by_role_before_mib": baseline["pss_by_role"],
            "pss_by_role_after_mib": after["pss_by_role"],
            # the baseline after the undisturbed run alone, where a warm-up came after it
            "pss_less_kv_cold_mib": cold["pss_less_kv_mib"],
            "pss_by_role_cold_mib": cold["pss_by_role"]}
    clean_up = (not after["shm_segments"] and not after["extra_actors"]
                and after["kv_usage"] is not None
                and after["kv_usage"] <= baseline["kv_usage"] + 1e-9
                and None not in (baseline["pss_less_kv_mib"], after["pss_less_kv_mib"])
                and after["pss_less_kv_mib"] <= baseline["pss_less_kv_mib"] * (1 + args.pss_slack))
    groups, replicas = rebuilds(samples)
    close_calls = sum(bool(r.get("close_call")) for r in records)
    summary = {"requests": len(records), **outcomes, "close_calls": close_calls,
               "cut_by_ingress": cut, "tokens": tokens,
               "tok_s": tokens / (t1 - t0), "faults": len(faults),
               "faults_failed": len(failed_faults), "group_rebuilds": groups,
               "replica_restarts": replicas, "clean_up": clean_up, "warmup_s": args.warmup,
               "warmup": warm, **left}
    title = (f"soak: {args.model}, {args.streams} streams, {args.minutes:g} min, a fault every "
             f"{args.fault_every:g} s; {sv.machine()}, {started:%Y-%m-%d}")
    if args.plot:
        plot(Path(args.plot), series, samples, faults, t0, title)
    print(f"\n### soak\n\n- Date: {started:%Y-%m-%d}; machine: {sv.machine()}; model: "
          f"{args.model}; {args.streams} streams of mixed lengths ({', '.join(map(str, LENGTHS))} "
          f"tokens, 3 in 5 greedy) for {args.minutes:g} min, a fault every {args.fault_every:g} s"
          f"; `powerinfer serve` defaults{' + ' + args.flags if args.flags else ''}\n")
    without_roles = {k: v for k, v in left.items() if "role" not in k}
    print("| requests | ok | clean errors | lost | corrupt | cut by an ingress kill | tok/s | "
          "faults (failed) | groups rebuilt, replicas restarted | left over |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    print(f"| {len(records)} | {outcomes['ok']} | {outcomes['clean']} | {outcomes['lost']} | "
          f"{outcomes['corrupt']} | {cut} | {summary['tok_s']:.1f} | {len(faults)} "
          f"({len(failed_faults)}) | {groups}, {replicas} | "
          f"{'nothing' if clean_up else json.dumps(without_roles)} |")
    if close_calls:
        print(f"\n- of the ok greedy requests, {close_calls} parted from the undisturbed run's "
              f"text at a close call (both tokens among the other's {TOP} likeliest, within "
              f"{CLOSE} of its pick)")
    print("\n| at s | fault | result |\n|---:|---|---|")
    for f in faults:
        print(f"| {f['t'] - t0:.0f} | {f['kind']} | {f['result']} |")
    def mib(x):
        return "unknown" if x is None else f"{x:.0f}"
    if args.warmup > 0:
        print(f"\n- warm-up before the baseline: {sum(warm.values())} requests ({warm['ok']} ok, "
              f"{warm['clean']} clean errors, {warm['lost']} lost, {warm['corrupt']} corrupt) in "
              f"{args.warmup:g} s; PSS less the KV cache's pages after the undisturbed run alone "
              f"{mib(cold['pss_less_kv_mib'])} MiB, after the warm-up (the baseline) "
              f"{mib(baseline['pss_less_kv_mib'])}, after the load {mib(after['pss_less_kv_mib'])}")
        print("- PSS by role after the undisturbed run alone, MiB: " + ", ".join(
            f"{r} {v:.0f}" for r, v in sorted(cold["pss_by_role"].items(), key=lambda kv: -kv[1])))
    print(f"\n- PSS of the server's tree: {left['pss_before_mib']} MiB before the load, "
          f"{left['pss_after_mib']} after it; less the KV cache's resident pages "
          f"{mib(left['pss_less_kv_before_mib'])} -> {mib(left['pss_less_kv_after_mib'])}; "
          f"KV usage {left['kv_usage_before']} -> {left['kv_usage_after']}; of the rest, the "
          f"weights' pages in RAM (a mapped file's, as they are first read: bounded by the "
          f"weights) {mib(left['weight_resident_before_mib'])} -> "
          f"{mib(left['weight_resident_after_mib'])}")
    before, now = left["pss_by_role_before_mib"], left["pss_by_role_after_mib"]
    print("- PSS by role, MiB before -> after (the hot and cold executors' include their KV "
          "pages): " + ", ".join(f"{r} {before.get(r, 0):.0f} -> {now.get(r, 0):.0f}"
                                 for r in sorted(set(before) | set(now),
                                                 key=lambda r: -now.get(r, 0))))
    clean = sorted({(r["status"], (r["error"] or "")[:90]) for r in records
                    if r["outcome"] == "clean"}, key=str)
    if clean:
        print(f"- clean errors (status, message): {clean[:8]}")
    for kind in ("lost", "corrupt"):
        bad = [r for r in records if r["outcome"] == kind]
        if bad:
            print(f"- {kind}: " + "; ".join(
                f"t={r['t0'] - t0:.0f} s status {r['status']} done {r['done']} tokens "
                f"{(r['usage'] or {}).get('completion_tokens')}/{r['tokens']} "
                f"{r['dropped'] or r['error'] or ''}" for r in bad[:6]))
    if args.plot:
        print(f"- plot: {args.plot}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": f"{started:%Y-%m-%d %H:%M}", "machine": sv.machine(), "model": args.model,
            "argv": [Path(a).name if os.sep in a else a for a in sys.argv[1:]],
            "summary": summary, "faults": [{**f, "t": f["t"] - t0, "t_end": f["t_end"] - t0}
                                           for f in faults],
            "series": series, "samples": [{**s, "t": s["t"] - t0} for s in samples],
            "requests": [{k: v for k, v in r.items() if k not in ("stamps", "logprobs")} | {
                "t0": r["t0"] - t0, "t1": r.get("t1", r["t0"]) - t0, "n_stamps": len(r["stamps"])}
                for r in records]}, indent=1, default=str))
    return 0 if outcomes["lost"] == outcomes["corrupt"] == warm["lost"] == warm["corrupt"] == 0 \
        and clean_up else 1


if __name__ == "__main__":
    sys.exit(main())
