#!/usr/bin/env python3
"""One layer's sparse decode step taken apart, beside the same layer's dense FFN, in one run.

    .venv/bin/python benchmarks/sparse_layer.py [--model NAME|FILE] --bundle B [--layer N]
        [--predictor ffn|layer] [--calls 2000]

Loads the model twice, dense and with the bundle (the in-process engine's defaults: bf16 and the
file's 4-bit blocks where the CPU runs bf16), takes a prompt's true inputs to one layer's FFN, and
times, per call with that layer's weights warm in the cache (the cost of the work, not of the
memory): the sparse layer's whole predicted step (`kernels.predicted_ffn`), its predictor's two
GEMVs alone, the neuron kernel over the neurons the predictor picks, the kernel over every
neuron, and the dense FFN module. A table and the share the predictor picks.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from powerinfer import Config, PowerInfer, kernels
from powerinfer.model.sparse import HybridFFN

PROMPT = "The history of computing is a story of ideas that took decades to mature."


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(50, calls // 20)):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def ffn_inputs(pi: PowerInfer, layer: int):
    """The residual entering the layer's FFN and the layer's input, at the prompt's last token."""
    seen = {}
    block = pi.model.layers[layer]
    hook = block.ffn.register_forward_pre_hook(lambda m, a: seen.update(h=a[0], x=a[1]))
    try:
        pi.engine.logits(pi.tokenize(PROMPT))
    finally:
        hook.remove()
    return seen["h"][:, -1], seen["x"][:, -1]  # (1, dim) each


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--predictor", default="ffn", choices=["ffn", "layer"])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    base = Config(max_batch=1, max_seq_len=256)
    dense = PowerInfer.from_pretrained(args.model, base)
    sp = PowerInfer.from_pretrained(args.model, replace(base, bundle=args.bundle, predictor=args.predictor))
    f = sp.model.layers[args.layer].ffn
    assert isinstance(f, HybridFFN), "the bundle's model has no sparse layers"
    found = f.predicted_records()
    assert found is not None, "this layer's decode step is not one kernel call (see HybridFFN.predicted_records)"
    s, preds, (fc1, fc2, fmt) = found
    with torch.inference_mode():
        h, layer_in = ffn_inputs(sp, args.layer)
        p = layer_in if args.predictor == "layer" else h
        x = f.norm(h)
        picked = preds.active(args.layer, p)[0]
        every = torch.ones_like(picked)
        dense_ffn = dense.model.layers[args.layer].ffn
        xd = dense.model.layers[args.layer].ffn_norm(h).view(1, 1, -1)
        rows = {
            "predicted step (predictor + kernel, one call)": lambda: kernels.predicted_ffn(
                x, p, fc1, fc2, fmt, preds.threshold, s.records, None, f.threshold, s.act, s.fmt),
            "the predictor's two GEMVs": lambda: kernels.pred_logits(p, fc1, fc2, fmt),
            "the neuron kernel, the picked neurons": lambda: kernels.neuron_ffn(
                x, s.records, picked, None, None, f.threshold, s.act, s.fmt),
            "the neuron kernel, every neuron": lambda: kernels.neuron_ffn(
                x, s.records, every, None, None, f.threshold, s.act, s.fmt),
            "the dense FFN (its module)": lambda: dense_ffn(xd),
        }
        times = {k: per_call_us(fn, args.calls) for k, fn in rows.items()}
    a = sp.model.args
    print(f"{sp.checkpoint.path.name}, layer {args.layer} of {a.n_layers} (dim {a.dim}, ffn {a.ffn_dim}), "
          f"{torch.get_num_threads()} threads, records {s.fmt} ({s.records.shape[1]} bytes a neuron), "
          f"predictor {fmt} rank {preds.fc1[args.layer].shape[0]}, picks {float(picked.float().mean()):.1%}")
    print("| part | us a call | vs the dense FFN |")
    print("|---|---:|---:|")
    ref = times["the dense FFN (its module)"]
    for k, t in times.items():
        print(f"| {k} | {t:.1f} | {t / ref:.2f}x |")


if __name__ == "__main__":
    main()
