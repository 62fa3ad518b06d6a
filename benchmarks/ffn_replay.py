#!/usr/bin/env python3
"""A sparse model's decode-step FFN calls, caught and replayed: where the sparse FFN's time goes
between its predictor, its neuron records and the two together, from memory and from the caches.

    .venv/bin/python benchmarks/ffn_replay.py --model M --bundle B [--tokens 24] [--rounds 8]
        [--predictor ffn|layer] [--by-frequency] [--json FILE]

The in-process engine decodes `--tokens` greedy tokens through its modules (not the native loop,
so that each layer's `kernels.predicted_ffn` call is seen), and every call's arguments are kept.
Then, in turns, each way over all the calls in their order (every layer's records in turn, as a
token reads them: from memory), per token:
- the fused step: the predictor, its rule and the records in one call (what a decode runs);
- its two halves one after the other for each layer (`pred_logits`, then `neuron_ffn` over the
  mask): whether the fused op costs more than its parts;
- the predictors alone, and the records alone over the masks the predictors gave;
- one layer's records over its first mask, called as many times: the same work with its records
  mostly in the last level cache, the kernel's rate without the memory's.
With --by-frequency, also the records alone over the second half of the calls, in the file's
order and reordered by how often the first half's masks picked each neuron (a layer's records,
its masks and its biases permuted alike; the most picked first, dealt in turn to the two halves
of the order, as the kernel's two threads split a step's neurons; and the most picked first
without dealing, all in the first thread's half): whether the neurons that a power law picks
most, read from one place, come faster than scattered among the others.
The read rate of a reduction over 1 GiB is measured before and after the rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from powerinfer import Config, PowerInfer, kernels

from sparse_cpu import read_bandwidth  # (a reduction over 1 GiB, as phases.py measures it)

PROMPT = "Explain how a CPU cache works."


def frequency_ways(steps, masks, layers: int, records) -> tuple[dict, float, torch.Tensor]:
    """--by-frequency: the records alone over the second half of the calls, in the file's order
    and with each layer's records (and biases) permuted by its picks over the first half, the
    most picked first: every other rank to each half of the order (the two threads' halves), and
    undealt. Returns those ways by name, the tokens they cover, and the share of the first half's
    picks that the most picked neurons hold (the mean over the layers, by rank)."""
    half = len(steps) // 2 // layers * layers
    if not half:
        raise SystemExit("--by-frequency: two tokens' calls at least (--tokens)")
    second = list(zip(steps[half:], masks[half:]))
    picks, orders = {}, {}
    for (_, _, _, _, _, _, rec, *_), m in zip(steps[:half], masks[:half]):
        picks[id(rec)] = picks.get(id(rec), 0) + m.to(torch.int64)
    for (_, _, _, _, _, _, rec, bias, *_) in steps[:half]:
        if id(rec) not in orders:
            ranked = torch.argsort(-picks[id(rec)], stable=True)
            orders[id(rec)] = [(order, kernels.huge(rec[order].contiguous()),
                                None if bias is None else bias[order].contiguous())
                               for order in (torch.cat([ranked[0::2], ranked[1::2]]), ranked)]
    x, _, _, _, _, _, rec, bias, thr, act, fmt = steps[half]
    order, rec2, bias2 = orders[id(rec)][0]
    same = kernels.neuron_ffn(x, rec, masks[half], None, bias, thr, act, fmt)
    moved = kernels.neuron_ffn(x, rec2, masks[half][order], None, bias2, thr, act, fmt)
    assert torch.allclose(same, moved, rtol=1e-3, atol=1e-3 * float(same.abs().max())), \
        "the reordered records give another FFN output"

    def file_order():
        for (x, _, _, _, _, _, rec, bias, thr, act, fmt), m in second:
            records(x, rec, m, bias, thr, act, fmt)

    def by_picks(which: int):
        def run():
            for (x, _, _, _, _, _, rec, _, thr, act, fmt), m in second:
                order, rec2, bias2 = orders[id(rec)][which]
                records(x, rec2, m[order], bias2, thr, act, fmt)
        return run

    share = torch.stack([torch.sort(p.double(), descending=True).values.cumsum(0) / p.sum()
                         for p in picks.values()]).mean(0)
    return {"the records alone, the second half of the calls, the file's order": file_order,
            "the same, records ordered by the first half's picks, dealt to the threads":
                by_picks(0),
            "the same, the most picked first (the first thread's)": by_picks(1)}, \
        len(second) / layers, share


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--predictor", default="ffn", choices=["ffn", "layer"])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--by-frequency", action="store_true",
                    help="also replay the second half of the calls over records ordered by how "
                         "often the first half picked each neuron, beside the file's order")
    ap.add_argument("--json")
    a = ap.parse_args()
    assert kernels.available(), "the CPU kernel cannot run here"
    pi = PowerInfer.from_pretrained(a.model, config=Config(bundle=a.bundle, predictor=a.predictor))
    pi.engine._decode = pi.engine._forward  # the modules: each layer's call goes through Python
    caught, real = [], kernels.predicted_ffn

    def spy(*args):
        caught.append(tuple(t.clone() if isinstance(t, torch.Tensor) and t.numel() < 1 << 17 else t
                            for t in args))
        return real(*args)

    kernels.predicted_ffn = spy
    try:
        for _ in pi._run([pi._ids(PROMPT)], a.tokens, dict(temperature=0.0, ignore_eos=True)):
            pass
    finally:
        kernels.predicted_ffn = real
    steps = [c for c in caught if c[0].shape[0] == 1]  # decode rows (a prompt's are not caught)
    assert steps, "no decode step ran through kernels.predicted_ffn (see HybridFFN.predicted_records)"
    layers = pi.model.args.n_layers
    tokens = len(steps) / layers
    masks = [(kernels.pred_logits(p, w1, w2, pf) >= pt)[0] for (_, p, w1, w2, pf, pt, *_) in steps]

    def records(x, rec, m, bias, thr, act, fmt):
        kernels.neuron_ffn(x, rec, m, None, bias, thr, act, fmt)

    def fused():
        for s in steps:
            real(*s)

    def halves():
        for (x, p, w1, w2, pf, pt, rec, bias, thr, act, fmt) in steps:
            records(x, rec, (kernels.pred_logits(p, w1, w2, pf) >= pt)[0], bias, thr, act, fmt)

    def predictors():
        for (_, p, w1, w2, pf, *_) in steps:
            kernels.pred_logits(p, w1, w2, pf)

    def records_alone():
        for (x, _, _, _, _, _, rec, bias, thr, act, fmt), m in zip(steps, masks):
            records(x, rec, m, bias, thr, act, fmt)

    def one_layer():
        x, _, _, _, _, _, rec, bias, thr, act, fmt = steps[0]
        for _ in steps:
            records(x, rec, masks[0], bias, thr, act, fmt)

    ways = {"the fused step (predictor, rule, records)": fused,
            "its halves, one after the other a layer": halves,
            "the predictors alone": predictors,
            "the records alone, over the predictors' masks": records_alone,
            "one layer's records, again and again (from the caches)": one_layer}
    per_token = dict.fromkeys(ways, tokens)  # the tokens each way's round covers
    if a.by_frequency:
        late_ways, late_tokens, share = frequency_ways(steps, masks, layers, records)
        ways.update(late_ways)
        per_token.update(dict.fromkeys(late_ways, late_tokens))
    times = {k: [] for k in ways}
    before = read_bandwidth(torch.float32) / 1e9
    for r in range(a.rounds + 1):
        for k, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            if r:  # (the first round warms up)
                times[k].append((time.perf_counter() - t0) / per_token[k])
    after = read_bandwidth(torch.float32) / 1e9
    picked = statistics.mean(int(m.sum()) for m in masks)
    print(f"{Path(a.model).name}, {layers} layers, {len(steps)} layer steps of {a.tokens} tokens; "
          f"{picked:.0f} of {masks[0].numel()} neurons picked a layer step; kernel {kernels.isa()}, "
          f"{torch.get_num_threads()} threads; {a.rounds} rounds in turns (median); read rate "
          f"{before:.1f} GB/s before, {after:.1f} after\n")
    if a.by_frequency:
        n = share.numel()
        print("the first half's picks held by the most picked neurons: " + ", ".join(
            f"{q:.0%} of the neurons {float(share[int(q * n) - 1]):.0%}"
            for q in (0.05, 0.1, 0.2, 0.5)) + "\n")
    print("| way | ms a token |")
    print("|---|---:|")
    out = {}
    for k, v in times.items():
        out[k] = statistics.median(v) * 1e3
        print(f"| {k} | {out[k]:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(isa=kernels.isa(), layer_steps=len(steps), picked=picked,
                           read_gbs=[before, after],
                           ms_a_token=out, rounds=times), f, indent=1)


if __name__ == "__main__":
    main()
