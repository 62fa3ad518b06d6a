#!/usr/bin/env python3
"""The actor runtime against the in-process engine, in one run.

    .venv/bin/python benchmarks/runtime.py [--model M] [--bundle B] [--tokens 32]
        [--cold 1,2] [--batches 1,4,8] [--synthetic-layers 4] [--skip-synthetic] [--compile]
        [--rounds 5] [--weights W] [--cold-weights W] [--predictors layer,ffn] [--out FILE]
        [--warm-ahead [--workdir DIR]]

1. Hop latency: a round trip over the shared-memory channels (one 576-float message each way)
   between two processes, spinning first and blocking at once, next to a Ray actor call.
2. Decode: tokens/s of one greedy request through the actor runtime versus the in-process
   engine with the same plan (`--bundle`: the sparse engine with the bundle's predictors and
   placement; none: every neuron computed), after a warm-up; the overhead is 1 - ratio. With a
   bundle, the lookahead predictor (layer input, sent before attention) and the same-layer one
   (FFN input) both run, with the hot executor's wait for masks per step: the share of the
   predictor's time left on the critical path. Also each side's median time to the first token
   of a request (its start: prompt, first step, and the way in and out).
3. Scaling: the same comparison on a synthetic 7B-shape ReLU model (bf16, `--synthetic-layers`
   deep, every neuron computed) for each count of cold executors in `--cold`.
4. Batching: total tokens/s of B concurrent greedy requests through the actor runtime, and of B
   prompts decoded together by the in-process engine (prefill included in both).
5. In turns (`--rounds`, the figure to quote on a shared VM): for the first configuration, the
   in-process engine and the actor runtime alternately in the same process, a stream each and
   then each batch, `--rounds` times; the ratios are medians of each turn's pair
   (`interleaved`). Then one stream with its events read from the scheduler's token ring (this
   process is on its node) and from Ray's stream alone, in turns, with each process's CPU time
   a token (`stream_paths`).
6. Where an actor step's time goes (`step_breakdown`), per step of one more request, from the
   actors' own counters: the scheduler's step (sent to answered), the hot executor's work and its
   waits (for the cold executors' partial sums, for masks, and between steps for the scheduler),
   each cold executor's busy time and wait, and each process's CPU time a step (every thread:
   the executors' spinning waits count, they hold their cores); printed as a table per run.
   Then the hot executor's native layer loop by phase over one more request (`hot_phases`: its
   projections, attention, FFN, and its waits for the cold executors' answers, for attention
   and for the FFN), and each cold executor's answers and waits.
7. `--warm-ahead` (alone): the cold executors warming the records the lookahead masks select
   while the hot side attends, against not, in turns (`warm_ahead`): on --model with --bundle,
   and on a synthetic 7B shape in Q4_0 with a bundle made for it (`--workdir` keeps both):

    .venv/bin/python benchmarks/runtime.py --warm-ahead --bundle smol.bundle --cold 1 \
        --synthetic-layers 2 --rounds 5 --workdir warm

Both sides run the default configuration (`Config()` resolved for this machine and file: bf16
with int4 weights and an 8-bit head on a CPU with native bf16 and a Q4 file); with `--compile`
both compile their decode step.

The GPU comparison (hybrid against layer offload and all-GPU) is `benchmarks/gpu.py`.
The in-process engine uses every core of the machine; the actor runtime pins its hot executor
and cold executors to disjoint core sets (see `cluster/topology.py`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from actors.channel import Channel, create, segment_path
from powerinfer import Config, PowerInfer, kernels
from powerinfer.engine.params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _echo(a, b, spin):
    ca, cb = Channel(a, spin_us=spin), Channel(b, writer=True, spin_us=spin)
    while True:
        w = ca.wait()
        if w[0] < 0:
            return
        cb.put(ca.view(torch.float32, (576,)))
        cb.publish(int(w[0]))


def hop_latency(n: int = 3000) -> dict:
    out = {}
    for label, spin in (("shm spin", 1000.0), ("shm block", 0.0)):
        a, b = (segment_path(os.getpid(), "bench", f"{x}{int(spin)}") for x in "ab")
        create(a, 1 << 16)
        create(b, 1 << 16)
        try:
            p = mp.get_context("spawn").Process(target=_echo, args=(a, b, spin))
            p.start()
            ca, cb = Channel(a, writer=True, spin_us=spin), Channel(b, spin_us=spin)
            x = torch.randn(576)
            for i in range(n + 200):
                if i == 200:
                    t = time.perf_counter()
                ca.put(x)
                ca.publish(i)
                cb.wait()
            out[label] = (time.perf_counter() - t) / n * 1e6
            ca.publish(-1)
            p.join()
        finally:
            a.unlink(missing_ok=True)
            b.unlink(missing_ok=True)
    import ray
    from powerinfer.compat import ray_init
    ray_init()

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, x):
            return x

    e = Echo.remote()
    x = torch.randn(576).numpy()
    for _ in range(50):
        ray.get(e.echo.remote(x))
    t = time.perf_counter()
    for _ in range(300):
        ray.get(e.echo.remote(x))
    out["ray actor call"] = (time.perf_counter() - t) / 300 * 1e6
    ray.kill(e)
    return out


def decode_speed(pi: PowerInfer, tokens: int) -> tuple[float, float]:
    """Tokens/s of greedy decode after the prompt (the prefill is excluded), after a warm-up
    request of the same length, and the median time to the first token in ms over 5 more
    requests (the request's start: its prompt, its first step, and the way in and out)."""
    params = dict(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    # a warm-up as long as the timed stream: each sequence length's first step builds what the
    # libraries cache per shape (on a GPU, the attention's plan for each new key length), and
    # that belongs outside the window
    pi.generate(PROMPT, **params)
    tok_s = stream_speed(pi, tokens)
    starts = []
    for _ in range(5):
        t0 = time.perf_counter()
        pi.generate(PROMPT, **dict(params, max_new_tokens=1))  # a request of one token
        starts.append((time.perf_counter() - t0) * 1e3)
    return tok_s, statistics.median(starts)


def cpu_s(pid: int) -> float:
    """Seconds on a CPU of every thread of process `pid` so far (/proc/PID/task/*/schedstat;
    0 where it is gone). An executor's spinning waits count: they hold their core."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total * 1e-9


def step_breakdown(pi: PowerInfer, tokens: int, batch: int = 1) -> dict[str, float]:
    """ms per step of one greedy request of `tokens` tokens through the actor runtime (its one
    prefill step among them; with `batch`, that many concurrent requests, `batched`), from the
    counters' deltas over the request: `scheduler step` is
    the scheduler's time from sending a step to having its tokens (its own share: that minus
    the hot executor's step); `hot work` the hot executor's step less its waits; `hot waits
    for cold` / `for masks` inside its step; `hot idle between steps` waiting for the next one;
    per cold executor its wait for work (counted in the channel, natively too) and its busy time
    as the step period (the request's wall time over its steps) less that wait: its native loop
    answers a decode without returning to Python, where its own busy counter is kept.
    Then each process's CPU time a step (`cpu_s`: every thread; this one's as the caller's)."""
    pids = {name: pid for name, pid in pi.engine.stats()["pids"].items() if pid}
    pids["caller (this process)"] = os.getpid()
    cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
    before = pi.engine.stats()["actors"]
    t0 = time.perf_counter()
    if batch == 1:
        pi.generate(PROMPT, max_new_tokens=tokens, temperature=0, ignore_eos=True)
    else:
        batched(pi, batch, tokens, warm=False)
    wall = time.perf_counter() - t0
    cpu1 = {name: cpu_s(pid) for name, pid in pids.items()}
    after = pi.engine.stats()["actors"]

    def d(name, key):
        return after[name].get(key, 0.0) - before[name].get(key, 0.0)

    steps = max(d("hot", "steps"), 1)
    ms = lambda v: v / steps * 1e3  # noqa: E731
    sched = d("scheduler", "decode_s") + d("scheduler", "prefill_s")
    hot = d("hot", "step_s")
    waits = d("hot", "part_wait_s") + d("hot", "mask_wait_s")
    out = {"steps": steps, "step period": ms(wall), "scheduler step": ms(sched),
           "scheduler's own share": ms(sched - hot),
           "hot step": ms(hot), "hot work": ms(hot - waits),
           "hot waits for cold": ms(d("hot", "part_wait_s")), "hot waits for masks": ms(d("hot", "mask_wait_s")),
           "hot idle between steps": ms(d("hot", "ctl_wait_s"))}
    for name in sorted(k for k in after if k.startswith("cold")):
        out[f"{name} busy (period - waits)"] = ms(wall - d(name, "wait_s"))
        out[f"{name} waits"] = ms(d(name, "wait_s"))
    if "predictor" in after:
        out["predictor busy"] = ms(d("predictor", "busy_s"))
    for name in pids:
        out[f"CPU: {name}"] = ms(cpu1[name] - cpu0[name])
    return out


def hot_phases(pi: PowerInfer, tokens: int) -> dict[str, float]:
    """ms per native loop call of the hot executor by phase (`kernels.loop_profile` in its
    process), and each cold executor's loop (its waits for messages and its answers, per hot
    loop call), over one more greedy request of `tokens` tokens (its prompt's step among them
    where that runs in the loop); empty where the hot executor's loop is not native."""
    import ray

    actors = pi.engine.group.actors
    cold = [a for name, a in sorted(actors.items()) if name.startswith("cold")]
    execs = [actors["hot"], *cold]
    ray.get([a.loop_profile.remote("start") for a in execs])
    pi.generate(PROMPT, max_new_tokens=tokens, temperature=0, ignore_eos=True)
    hot, *colds = ray.get([a.loop_profile.remote("stop") for a in execs])
    calls = hot.pop("calls", 0)
    if not calls:
        return {}
    # (a cold executor's too: a step's layers; a count per call where it counts)
    per_call = lambda k, v: v / calls * (1 if k in kernels.COUNTS else 1e3)  # noqa: E731
    out = {"calls": calls, **{k: per_call(k, v) for k, v in hot.items() if v}}
    for i, c in enumerate(colds):
        out.update({f"cold.{i} {k.removeprefix('cold: ')}": per_call(k, v) for k, v in c.items()
                    if k != "calls" and v})
    return out


def print_breakdown(rows: list[dict]):
    """The step breakdowns of `compare`'s rows as one table (ms per step)."""
    rows = [r for r in rows if "breakdown_ms_per_step" in r]
    if not rows:
        return
    cols = [(r["breakdown_ms_per_step"], f"{r['model']}, {r['cold_executors']} cold") for r in rows]
    cols += [(b, f"{r['model']}, {r['cold_executors']} cold, batch {n}")
             for r in rows for n, b in r.get("batched_breakdown_ms_per_step", {}).items()]
    keys = list(dict.fromkeys(k for b, _ in cols for k in b if k != "steps"))
    print("| ms per step | " + " | ".join(label for _, label in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{b.get(k, float('nan')):.2f}" for b, _ in cols) + " |")
    cols = [(r["hot_loop_ms_per_call"], f"{r['model']}, {r['cold_executors']} cold") for r in rows
            if r.get("hot_loop_ms_per_call")]
    if cols:
        print("\n| the hot executor's loop, ms per call | "
              + " | ".join(label for _, label in cols) + " |")
        print("|---|" + "---:|" * len(cols))
        for k in dict.fromkeys(k for b, _ in cols for k in b if k != "calls"):
            print(f"| {k} | " + " | ".join(f"{b.get(k, 0.0):.3f}" for b, _ in cols) + " |")


def print_turns(rows: list[dict]):
    """The measurement in turns (`interleaved`) as a table."""
    for r in rows:
        if "interleaved" not in r:
            continue
        t = r["interleaved"]
        print(f"| {r['model']}, {r['cold_executors']} cold, {t['rounds']} turns | in process tok/s "
              "| actors tok/s | actors / in process (median of turns) | each turn |")
        print("|---|---:|---:|---:|---|")
        for k, v in t.items():
            if k != "rounds":
                print(f"| {k} | {v['in_process_tok_s']:.1f} | {v['actors_tok_s']:.1f} | "
                      f"{v['ratio']:.2f} | {', '.join(map(str, v['ratios']))} |")
        if "stream_paths" in r:
            sp = r["stream_paths"]
            procs = list(sp["ring"]["cpu_ms_per_token"])
            print(f"| one stream's events ({sp['ring_vs_ray']:.2f}x through the ring) | tok/s | "
                  "each turn | " + " | ".join(f"CPU ms/token: {p}" for p in procs) + " |")
            print("|---|---:|---|" + "---:|" * len(procs))
            for k in ("ring", "ray stream"):
                v = sp[k]
                print(f"| {k} | {v['tok_s']:.1f} | {', '.join(map(str, v['turns']))} | " +
                      " | ".join(f"{v['cpu_ms_per_token'][p]:.2f}" for p in procs) + " |")


def batched(pi: PowerInfer, batch: int, tokens: int, warm: bool = True) -> float:
    """Total tokens/s of `batch` concurrent greedy requests (prefill included), after one
    untimed round of the same shape (a compiled step compiles for it there)."""
    if warm:
        batched(pi, batch, 4, warm=False)
    e = pi.engine
    ids = pi.tokenize(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    counts = [0] * batch

    def run(i):
        for _ in e.generate(ids, params):
            counts[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def batched_local(pi: PowerInfer, batch: int, tokens: int) -> float:
    """Total tokens/s of `batch` copies of the prompt decoded together in process (prefill
    included, as for the actor runtime's concurrent requests), after one untimed round."""
    pi.generate([PROMPT] * batch, max_new_tokens=4, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    pi.generate([PROMPT] * batch, max_new_tokens=tokens, temperature=0, ignore_eos=True)
    return batch * tokens / (time.perf_counter() - t0)


def stream_speed(pi: PowerInfer, tokens: int) -> float:
    """Tokens/s of one greedy stream after its first token (no warm-up: see `interleaved`)."""
    first, n = None, 0
    for _ in pi.stream(PROMPT, max_new_tokens=tokens, temperature=0, ignore_eos=True):
        n += 1
        if first is None:
            first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def interleaved(local: PowerInfer, pi: PowerInfer, tokens: int, batches: list[int],
                rounds: int) -> dict:
    """The two engines measured in turns, `rounds` times, in this one process: a stream each
    (decode), then `batches` concurrent requests each; the ratios are the medians of each
    round's pair. Measurements minutes apart on a shared VM drift by more than the difference
    looked for (BENCHMARKS.md); turns a second apart see the same machine. The idle engine
    holds no core: the group's readers sleep after their spin, the in-process threads too."""
    pairs = {"decode": []} | {f"batch {b}": [] for b in batches}
    for _ in range(rounds):
        pairs["decode"].append((stream_speed(local, tokens), stream_speed(pi, tokens)))
        for b in batches:
            pairs[f"batch {b}"].append((batched_local(local, b, tokens), batched(pi, b, tokens)))
    out = {"rounds": rounds}
    for k, v in pairs.items():
        out[k] = {"in_process_tok_s": statistics.median(a for a, _ in v),
                  "actors_tok_s": statistics.median(b for _, b in v),
                  "ratio": statistics.median(b / a for a, b in v),
                  "ratios": [round(b / a, 3) for a, b in v]}
    return out


def stream_paths(pi: PowerInfer, tokens: int, rounds: int) -> dict:
    """One stream's tokens/s with its events read from the scheduler's `TokenRing` (a caller on
    its node, the default) and from Ray's stream alone (as a caller on another node reads them),
    in turns, `rounds` times, with each process's CPU time a token over the turn."""
    import actors.follow as follow

    default = follow.TOKEN_RING
    pids = dict(pi.engine.stats()["pids"], caller=os.getpid())
    got = {"ring": [], "ray stream": []}
    cpu = {k: {p: [] for p in pids} for k in got}
    try:
        for r in range(rounds):
            for path in list(got)[::1 if r % 2 == 0 else -1]:  # which goes first alternates
                follow.TOKEN_RING = path == "ring"
                before = {p: cpu_s(pid) for p, pid in pids.items()}
                got[path].append(stream_speed(pi, tokens))
                for p, pid in pids.items():
                    cpu[path][p].append((cpu_s(pid) - before[p]) / tokens * 1e3)
    finally:
        follow.TOKEN_RING = default
    out = {k: {"tok_s": statistics.median(v), "turns": [round(x, 1) for x in v],
               "cpu_ms_per_token": {p: round(statistics.median(c), 3) for p, c in cpu[k].items()}}
           for k, v in got.items()}
    out["ring_vs_ray"] = statistics.median(a / b for a, b in zip(got["ring"], got["ray stream"]))
    return out


def warm_ahead(model: str, base: dict, tokens: int, rounds: int, cold: int = 1) -> dict:
    """The cold executors warming the records of the lookahead masks ahead of the step (the
    default) against not (`POWERINFER_WARM_AHEAD=0`), with a bundle: two groups of the same
    configuration, measured in turns (`rounds` streams each, which goes first alternating; the
    idle group's readers sleep), then each one's step breakdown and native loop phases (the
    cold executors' warming and records warmed among them) over one more request."""
    env = os.environ.get("POWERINFER_WARM_AHEAD")
    groups = {}
    try:
        for name, flag in (("off", "0"), ("on", "1")):
            os.environ["POWERINFER_WARM_AHEAD"] = flag
            groups[name] = PowerInfer.from_pretrained(model, Config(
                **base, runtime="actors", cold_executors=cold, predictor="layer"))
            assert groups[name].engine.group.spec.warm_ahead == (flag == "1")
            groups[name].generate(PROMPT, max_new_tokens=tokens, temperature=0, ignore_eos=True)
        speeds = {k: [] for k in groups}
        for r in range(rounds):
            for k in list(groups)[::1 if r % 2 == 0 else -1]:
                speeds[k].append(stream_speed(groups[k], tokens))
        out = {"rounds": rounds, "cold_executors": cold}
        for k, pi in groups.items():
            # (a short request first: the waits in progress since the group was last busy end
            # there, outside the counters' window)
            pi.generate(PROMPT, max_new_tokens=2, temperature=0, ignore_eos=True)
            out[k] = {"tok_s": statistics.median(speeds[k]),
                      "turns": [round(x, 2) for x in speeds[k]],
                      "breakdown_ms_per_step": step_breakdown(pi, 2 * tokens),
                      "loop_ms_per_call": hot_phases(pi, 2 * tokens)}
        out["on_vs_off"] = statistics.median(a / b for a, b in zip(speeds["on"], speeds["off"]))
        return out
    finally:
        for pi in groups.values():
            pi.close()
        if env is None:
            os.environ.pop("POWERINFER_WARM_AHEAD", None)
        else:
            os.environ["POWERINFER_WARM_AHEAD"] = env


def synthetic_with_bundle(layers: int, workdir: str) -> tuple[Path, Path]:
    """A synthetic 7B-shape ReLU model of `layers` layers in Q4_0 (90% of its neurons idle a
    token) and a bundle for it (profiled on the calibration corpus, lookahead predictors
    trained), in `workdir` (reused when there) or a fresh temporary directory."""
    from powerinfer.formats.bundle import Bundle
    from powerinfer.sparsity.profile import ProfileOptions, profile
    from powerinfer.sparsity.synthetic import write_synthetic
    from powerinfer.sparsity.train import train_predictors

    d = Path(workdir or tempfile.mkdtemp(prefix="powerinfer-warm-"))
    d.mkdir(parents=True, exist_ok=True)
    path, bundle = d / f"synthetic-7b-{layers}-q4_0.gguf", d / f"synthetic-7b-{layers}-q4_0.bundle"
    if not path.exists():
        write_synthetic(path, "7b", n_layers=layers, quant="q4_0")
    if not (bundle / "predictors.layer.json").exists():
        b = profile(str(path), "lee", bundle, ProfileOptions(tokens=2048, window=256, samples=4000),
                    dtype="bfloat16")
        train_predictors(b, "layer")
    Bundle.open(bundle)  # (complete)
    return path, bundle


def print_warm(w: dict, label: str):
    """`warm_ahead`'s result as two tables: tok/s, and ms per step (and per loop call) by part."""
    print(f"| {label}, {w['cold_executors']} cold, {w['rounds']} turns | tok/s | each turn |")
    print("|---|---:|---|")
    for k in ("off", "on"):
        print(f"| warming {k} | {w[k]['tok_s']:.2f} | {', '.join(map(str, w[k]['turns']))} |")
    print(f"| on / off (median of turns) | {w['on_vs_off']:.3f} | |")
    for part in ("breakdown_ms_per_step", "loop_ms_per_call"):
        keys = list(dict.fromkeys(k for s in ("off", "on") for k in w[s][part]))
        print(f"\n| {part} | warming off | warming on |\n|---|---:|---:|")
        for k in keys:
            cells = (f"{w[s][part].get(k, float('nan')):.3f}" for s in ("off", "on"))
            print(f"| {k} | " + " | ".join(cells) + " |")


def compare(model: str, base: dict, tokens: int, cold: list[int], batches: list[int],
            rounds: int = 5, predictors: tuple[str, ...] = ("layer", "ffn")) -> list[dict]:
    """Actor runtime against the in-process engine with the same plan, per cold-executor count;
    with a bundle also the same-layer predictor against the lookahead one (whether prediction
    stays off the critical path: the hot executor's wait for masks per step), of `predictors`
    (the bundle's trained ones)."""
    runs = [(n, predictors[0] if base.get("bundle") else "auto") for n in cold]
    if base.get("bundle") and len(predictors) > 1:
        runs.append((cold[0], predictors[1]))
    refs, rows = {}, []
    for n, predictor in runs:
        if predictor not in refs:
            local = PowerInfer.from_pretrained(model, Config(**base, predictor=predictor,
                                                             max_batch=max(batches)))
            refs[predictor] = decode_speed(local, tokens)  # (tok/s, first token ms)
            if (n, predictor) == runs[0]:
                local_batched = {b: batched_local(local, b, tokens) for b in batches}
                first_local = local  # kept for the measurement in turns
            del local
        ref, ref_start = refs[predictor]
        pi = PowerInfer.from_pretrained(model, Config(**base, runtime="actors", cold_executors=n,
                                                      predictor=predictor, max_batch=max(batches)))
        try:
            tok_s, start = decode_speed(pi, tokens)
            st = pi.engine.stats()
            hot = st["actors"]["hot"]
            row = {"model": Path(str(pi.checkpoint.path)).name, "cold_executors": n,
                   "predictor": predictor, "cores": st["cores"], "in_process_tok_s": ref,
                   "actors_tok_s": tok_s, "ratio": tok_s / ref,
                   "in_process_first_token_ms": ref_start, "actors_first_token_ms": start,
                   "step_ms": hot["step_s"] / max(hot["steps"], 1) * 1e3,
                   "mask_wait_ms_per_step": hot.get("mask_wait_s", 0) / max(hot["steps"], 1) * 1e3,
                   "part_wait_ms_per_step": hot["part_wait_s"] / max(hot["steps"], 1) * 1e3}
            if "predictor" in st["actors"]:
                p = st["actors"]["predictor"]
                row["predictor_busy_ms_per_step"] = p.get("busy_s", 0) / max(hot["steps"], 1) * 1e3
            row["breakdown_ms_per_step"] = step_breakdown(pi, 2 * tokens)
            row["hot_loop_ms_per_call"] = hot_phases(pi, 2 * tokens)
            if (n, predictor) == runs[0]:
                row["batched_tok_s"] = {b: batched(pi, b, tokens) for b in batches}
                row["in_process_batched_tok_s"] = local_batched
                row["batched_ratio"] = {b: row["batched_tok_s"][b] / local_batched[b] for b in batches}
                row["batched_breakdown_ms_per_step"] = {b: step_breakdown(pi, tokens, b) for b in batches if b > 1}
                if rounds:
                    row["interleaved"] = interleaved(first_local, pi, tokens, batches, rounds)
                    row["stream_paths"] = stream_paths(pi, 2 * tokens, rounds)
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            pi.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bundle", default="")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cold", default="1,2")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--synthetic-layers", type=int, default=4)
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="both sides compile their decode step (Config(compile=True))")
    ap.add_argument("--rounds", type=int, default=5,
                    help="turns of the in-process engine and the actor runtime measured "
                         "alternately in one process (0: none)")
    ap.add_argument("--weights", default="auto", choices=["auto", "dense", "int4"],
                    help="Config.weights on both sides")
    ap.add_argument("--cold-weights", default="auto", choices=["auto", "dense", "int4"],
                    help="Config.cold_weights of the actor runtime (a dense hot executor beside "
                         "4-bit cold executors: what a GPU group runs)")
    ap.add_argument("--predictors", default="layer,ffn",
                    help="with --bundle: the predictor of every run, then the one compared with it")
    ap.add_argument("--warm-ahead", action="store_true",
                    help="only the cold executors' warming off against on (`warm_ahead`): "
                         "--model with --bundle, and (unless --skip-synthetic) a synthetic 7B "
                         "shape in Q4_0 with a bundle made for it (profile, lookahead predictors)")
    ap.add_argument("--workdir", default="",
                    help="with --warm-ahead: keep the synthetic file and its bundle here, and "
                         "reuse them when they are there")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cold = [int(x) for x in args.cold.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    result = {"date": str(datetime.date.today()), "machine": platform.processor() or platform.machine(),
              "cores": len(os.sched_getaffinity(0))}
    result["hop_us"] = hop_latency()
    print("hop latency (us):", json.dumps(result["hop_us"]), flush=True)
    base = dict(max_seq_len=256, bundle=args.bundle, compile=args.compile, weights=args.weights,
                cold_weights=args.cold_weights)
    if args.warm_ahead:
        result["warm_ahead"] = {}
        if args.bundle:
            w = result["warm_ahead"][args.model] = warm_ahead(args.model, base, args.tokens,
                                                              args.rounds, cold[0])
            print_warm(w, args.model)
        if not args.skip_synthetic:
            path, bundle = synthetic_with_bundle(args.synthetic_layers, args.workdir)
            w = result["warm_ahead"]["synthetic_7b"] = warm_ahead(
                str(path), dict(base, bundle=str(bundle), dtype="bfloat16"), args.tokens // 2,
                args.rounds, cold[0])
            print_warm(w, f"synthetic 7B shape, {args.synthetic_layers} layers, Q4_0")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return
    result["default"] = compare(args.model, base, args.tokens, cold, batches, args.rounds,
                                tuple(args.predictors.split(",")))
    print_breakdown(result["default"])
    print_turns(result["default"])
    if not args.skip_synthetic:
        from powerinfer.sparsity.synthetic import write_synthetic
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "syn7b.gguf"
            write_synthetic(path, "7b", n_layers=args.synthetic_layers, progress=False)
            result["synthetic_7b"] = compare(str(path), dict(max_seq_len=256, dtype="bfloat16",
                                                             compile=args.compile),
                                             args.tokens // 2, cold, [1], args.rounds)
        print_breakdown(result["synthetic_7b"])
        print_turns(result["synthetic_7b"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
