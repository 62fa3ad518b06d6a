#!/usr/bin/env python3
"""Where a decode token's time goes inside the native layer loop, against its floor.

    .venv/bin/python benchmarks/phases.py [--model M] [--bundle B] [--input-sparsity B]
        [--tokens 64] [--turns 3] [--cpu-isa avx2|avx512|avx512bf16] [--q4c-walk passes]
        [--out FILE]

The in-process engine's decode step with the default configuration (`Config()` resolved for
this machine and file) runs every layer in one native call (`hot_layers`). Its phases are timed
inside the kernel library (`kernels.loop_profile`: two clock reads a phase, on only while this
measures): the norms, the q/k/v projection, the attention (RoPE, the cache, the softmax), the
output projection, the FFN, and (in the actor runtime's hot executor) the exchanges. The output
head is timed by hooks around it; what is left of the token (embedding, the final norm, the
step's Python, sampling) is the rest. Each turn decodes `--tokens` greedy tokens after a prompt,
after a warm-up.

The floor is the bytes a token reads (every weight the step holds, the KV cache at the mean
context) at the read bandwidth of a reduction over 1 GiB, measured before each turn; each
part's GB/s is its bytes over its time.

`--bundle`: the sparse model as the engine loads it with that bundle (`Config(bundle=...)`, the
predictors on the FFN's input), each layer's predictor and neurons one step of the same loop.
Its FFN bytes are counted, not assumed: a pass through the modules before the turns records,
per layer, the neurons computed (their gate rows are read) and those that fired among them
(their up and down rows are read too); the predictors' weights as a decode step reads them
are added (`Predictors.decode_bytes`).

`--input-sparsity`: the projections' input sparsity from that bundle (`powerinfer
calibrate-input`; `Config(input_sparsity=...)`): a projection that took it reads, of its weights,
the share of input channels kept, as the warm-up's decode steps counted them
(`PowerInfer.input_sparsity_stats`, over every sparse projection). `--q4c-walk passes`: the
q4c products walk their matrices pass by pass (`kernels.q4c_walk`, set before the load, whose
timing of each size then sees it too): the baseline of the VNNI bodies' quad-by-quad walk.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from powerinfer import Config, PowerInfer, kernels
from powerinfer.engine.native import NativeDecode
from sparse_cpu import PROMPT, counting_pass, decode, dense_bytes, module_bytes, read_bandwidth


def decode_profiled(model, step, ids: list[int], n: int) -> tuple[list[float], dict]:
    """`sparse_cpu.decode` with the loop's phases counted over its decode steps alone (not the
    prompt's): (each step's seconds, `kernels.loop_profile`)."""
    times, _ = decode(model, ids, n, step, before_steps=lambda: kernels.loop_profile("start"))
    return times, kernels.loop_profile("stop")


def head_timer(model):
    """Hooks that add up the output head's seconds: (timer dict, the hooks' handles)."""
    t = {"s": 0.0, "t0": 0.0}

    def pre(mod, args):
        t["t0"] = time.perf_counter()

    def post(mod, args, out):
        t["s"] += time.perf_counter() - t["t0"]

    out = model.output
    return t, [out.register_forward_pre_hook(pre), out.register_forward_hook(post)]


def sparse_ffn_bytes(model, ids: list[int], n: int) -> float:
    """Bytes a decode token's sparse FFNs read, counted over n greedy tokens through the modules:
    gate rows of the neurons computed, up and down rows of those that fired among them, and the
    predictors' weights."""
    ffns, stats = counting_pass(model, ids, n)
    total = 0.0
    for f, s in zip(ffns, stats):
        fmt = next(x for x in (f.hot, f.cold) if x is not None and len(x.idx)).fmt
        lead = kernels.row_bytes(fmt, model.args.dim)
        rest = lead + kernels.row_bytes(kernels.down_format(fmt), model.args.dim)
        total += (s.computed * lead + s.hit * rest) / s.rows
    preds = {id(p): p for f in ffns if (p := getattr(f.masks, "__self__", None)) is not None}
    return total + sum(p.decode_bytes() for p in preds.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model file (default: the default model)")
    ap.add_argument("--bundle", default=None, help="a sparsity bundle: the sparse model's decode")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-isa", default="auto",
                    help="hold the CPU kernel to this class (avx2, avx512, avx512bf16; Config.cpu_isa)")
    ap.add_argument("--input-sparsity", default="off", metavar="BUNDLE",
                    help="the projections' input sparsity from this bundle (calibrate-input)")
    ap.add_argument("--q4c-walk", default="runs", choices=["runs", "passes"],
                    help="how the VNNI bodies walk a q4c matrix (kernels.q4c_walk): a baseline")
    a = ap.parse_args()
    if kernels.available():
        kernels.q4c_walk(a.q4c_walk)
    config = Config(bundle=a.bundle, predictor="ffn", cpu_isa=a.cpu_isa,
                    input_sparsity=a.input_sparsity) if a.bundle else \
        Config(cpu_isa=a.cpu_isa, input_sparsity=a.input_sparsity)
    pi = PowerInfer.from_pretrained(*([a.model] if a.model else []), config=config)
    model = pi.model
    step = NativeDecode.of(model)
    if step is None or not kernels.available():
        raise SystemExit("this model's decode step does not run in the native loop here")
    ids = pi.tokenizer.encode(PROMPT)
    decode_profiled(model, step, ids, 16)  # warm-up
    kv_len = len(ids) + a.tokens / 2
    parts = dense_bytes(model, kv_len)
    parts["FFN"] = (sparse_ffn_bytes(model, ids, a.tokens) if a.bundle
                    else sum(module_bytes(b.ffn) for b in model.layers))
    kept, seen = pi.input_sparsity_stats()  # (the warm-up's decode steps)
    for i in range(model.args.n_layers if seen else 0):  # what the sparse projections skip
        for owner, attr, _ in model.projections(i):
            m = getattr(owner, attr, None)  # (a sparse FFN holds neuron sets instead)
            if getattr(m, "sparse", None) is not None:
                part = "attention" if owner is model.layers[i].attn else "FFN"
                # (a K-quant projection's runs without a copy of their own read all their bytes)
                # (a Q4_0/Q4_1 projection is one run, its copy all of it)
                rest = getattr(m, "sparse_rest", None) or []
                dense_runs = [getattr(m, name).numel()
                              for (name, _, _), c in zip(m.segments[1:], rest) if c is None] if rest else []
                parts[part] -= (module_bytes(m) - sum(dense_runs)) * (1 - kept / seen)
    total_bytes = sum(parts.values())
    turns = []
    for _ in range(a.turns):
        bw = read_bandwidth(torch.float32)
        timer, hooks = head_timer(model)
        times, prof = decode_profiled(model, step, ids, a.tokens)
        for h in hooks:
            h.remove()
        n = len(times)
        ms = {k: v / n * 1e3 for k, v in prof.items() if k != "calls" and v}
        ms["output head"] = timer["s"] / n * 1e3
        token = sum(times) / n * 1e3
        rest = "the rest (embedding, final norm, the step's Python, sampling)"
        ms[rest] = token - sum(ms.values())
        floor = total_bytes / bw * 1e3
        turns.append({"bandwidth_gb_s": bw / 1e9, "token_ms": token, "floor_ms": floor,
                      "loops_per_token": prof["calls"] / n, "ms": ms})
        print(f"turn: {token:.2f} ms a token, floor {floor:.2f} ms ({floor / token:.0%}), "
              f"read bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    med = {k: statistics.median(t["ms"][k] for t in turns) for k in turns[0]["ms"]}
    token = statistics.median(t["token_ms"] for t in turns)
    bw = statistics.median(t["bandwidth_gb_s"] for t in turns)
    attn_ms = sum(med.get(k, 0.0) for k in ("q/k/v projection", "output projection"))
    rate = {"FFN": (parts["FFN"], med.get("FFN", 0.0)),
            "q/k/v and output projections": (parts["attention"], attn_ms),
            "output head": (parts["lm_head"], med["output head"])}
    name = Path(a.model).name if a.model else "default model"
    if a.bundle:
        name += f", sparse ({Path(a.bundle).name})"
    if seen:
        name += f", input sparsity {1 - kept / seen:.1%} of the sparse projections' channels"
        if a.q4c_walk != "runs":
            name += f" (q4c walked {a.q4c_walk})"
    print(f"\nkernel class {kernels.isa()}; {name}: {token:.2f} ms a token (median of {a.turns} turns of {a.tokens} tokens); "
          f"floor {total_bytes / 1e6:.1f} MB at {bw:.1f} GB/s = {total_bytes / bw / 1e6:.2f} ms "
          f"({total_bytes / bw / 1e6 / token:.0%} of the token)\n")
    print("| phase | ms a token | share |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {v / token:.1%} |")
    print("\n| part | MB a token | ms | GB/s | % of the read bandwidth |")
    print("|---|---:|---:|---:|---:|")
    for k, (b, t) in rate.items():
        if t > 0:
            print(f"| {k} | {b / 1e6:.1f} | {t:.3f} | {b / t / 1e6:.1f} | {b / t / 1e6 / bw:.0%} |")
    if a.out:
        Path(a.out).write_text(json.dumps({
            "date": str(datetime.date.today()), "host": platform.processor() or platform.machine(),
            "model": name, "threads": torch.get_num_threads(), "bytes": parts, "turns": turns},
            indent=1))


if __name__ == "__main__":
    main()
