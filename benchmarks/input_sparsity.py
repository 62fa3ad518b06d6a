#!/usr/bin/env python3
"""What activation sparsity in every projection's input costs in quality on the real models
(TEAL's method, `powerinfer.sparsity.input_sparsity`), before any kernel reads fewer columns.

    .venv/bin/python benchmarks/input_sparsity.py [--models smollm2-135m-instruct gemma3-270m]
        [--sparsity 0.25 0.4 0.5] [--calib-tokens 8192] [--tokens 8192] [--window 256]
        [--greedy-tokens 32] [--allocations uniform greedy] [--greedy-calib-tokens 1024]
        [--variants "attention + gate/up" "+ down"] [--criteria magnitude weighted]
        [--out FILE] [--plot FILE]

Per model (float32, dense, every setting else the file's): thresholds calibrated on the Lee
corpus's calibration part (`--calib-tokens`), one per projection input and layer at each target:
every input at the target (`uniform`), or TEAL's block-wise greedy allocation (`greedy`: within
each block the share raised where the block's output loses least per weight saved, each block
run alone over `--greedy-calib-tokens` of the calibration text); measured on its held-out part,
which the calibration did not see (`--tokens`, in windows of `--window`): perplexity against the
dense model's, top-1 agreement and KL divergence of the next-token distribution, and the realised
model-wide sparsity (the projections' weights not read). Two variants a target:
- `attention + gate/up`: q/k/v, the output projection, and the FFN's gate/up inputs;
- `+ down`: the FFN's down input too (its neuron activations: the FFN's neuron sparsity, by
  magnitude, an oracle of a predictor's).
Two criteria (`--criteria`, uniform allocation): `magnitude` (TEAL's: an entry zeroed where |x|
is at most its threshold) and `weighted` (WINA's: |x| times the norm of the weights its channel
multiplies, calibrated the same way: `column_norms`).
And greedy agreement with dense decoding over a fixed set of prompts (each prompt dense, then
`--greedy-tokens` decode steps with sparse inputs): the tokens before the first difference, and
the share of continuations equal throughout. A plot of the curves.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from powerinfer.model.load import load_model
from powerinfer.sparsity.corpus import load_corpus, token_windows
from powerinfer.sparsity.input_sparsity import (PARTS, calibrate, column_norms, greedy,
                                                greedy_allocation, held_out_quality,
                                                sample_magnitudes)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "To make a cup of tea, first",
           "import numpy as np\n\ndef softmax(x):", "The largest planet in the solar system",
           "Dear Sir or Madam, I am writing to"]
VARIANTS = {"attention + gate/up": ("qkv", "o", "gate_up"), "+ down": PARTS}


def run_model(name: str, args) -> dict:
    t0 = time.time()
    model, tok, path = load_model(name)
    calib = token_windows(tok, load_corpus("lee", "calibration"), args.window, args.calib_tokens)
    held = token_windows(tok, load_corpus("lee", "held_out"), args.window, args.tokens)
    hists = sample_magnitudes(model, calib)
    norms = column_norms(model) if "weighted" in args.criteria else None
    weighted = sample_magnitudes(model, calib, scales=norms) if norms else None
    variants, meta, scales = {}, {"dense": ("dense", 0.0, ())}, {}
    chosen = {k: v for k, v in VARIANTS.items() if k in args.variants}
    allocated = {}
    if "greedy" in args.allocations:  # one greedy path per set of inputs, every target on it
        few = calib[:max(1, args.greedy_calib_tokens // args.window)]
        t1 = time.time()
        allocated = {label: greedy_allocation(model, few, hists, args.sparsity, parts)
                     for label, parts in chosen.items()}
        print(f"  {name}: greedy allocation over {sum(map(len, few))} tokens in "
              f"{time.time() - t1:.0f} s", flush=True)
    for target in args.sparsity:
        for label, parts in chosen.items():
            for alloc in args.allocations:
                if "magnitude" not in args.criteria:
                    continue
                full = label if alloc == "uniform" else f"greedy: {label}"
                vname = f"{full} @ {target:.0%}"
                variants[vname] = (calibrate(hists, target, parts) if alloc == "uniform"
                                   else allocated[label][target])
                meta[vname] = (full, target, parts)
            if weighted:  # (uniform allocation)
                full = f"weighted: {label}"
                vname = f"{full} @ {target:.0%}"
                variants[vname] = calibrate(weighted, target, parts)
                scales[vname] = norms
                meta[vname] = (full, target, parts)
    quality = held_out_quality(model, held, variants, scales=scales)
    prompts = [tok.encode(p, parse_special=False) for p in PROMPTS]
    want = [greedy(model, p, args.greedy_tokens) for p in prompts]
    rows = []
    for vname, row in quality.items():
        label, target, parts = meta[vname]
        th = variants.get(vname)
        agree = []
        for p, w in zip(prompts, want):
            got = w if th is None else greedy(model, p, args.greedy_tokens, th,
                                              scales.get(vname))
            agree.append(next((i for i, (a, b) in enumerate(zip(got, w)) if a != b), len(w)))
        rows.append({"variant": label, "target": target, "parts": list(parts),
                     "calibrated": target if th else 0.0,
                     **row, "greedy_before_difference": sum(agree) / len(agree),
                     "greedy_equal": sum(a == args.greedy_tokens for a in agree) / len(agree)})
        r = rows[-1]
        print(f"  {name:<24} {vname:<28} ppl {r['ppl']:8.3f} ({r['ppl_delta']:+6.1%})  top-1 "
              f"{r['top1']:6.1%}  KL {r['kl']:.4f}  realised {r['realised']:5.1%}  greedy equal "
              f"{r['greedy_equal']:4.0%}, {r['greedy_before_difference']:4.1f} tokens before a "
              f"difference", flush=True)
    return {"model": name, "file": path.name, "layers": model.args.n_layers,
            "calib_tokens": sum(map(len, calib)), "held_out_tokens": sum(map(len, held)),
            "seconds": round(time.time() - t0, 1), "rows": rows}


def plot(results: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in results:
        labels = list(dict.fromkeys(r["variant"] for r in res["rows"] if r["variant"] != "dense"))
        for label, style in zip(labels, ("-o", "--s", "-.^", ":v", "-D", "--x")):
            rows = [r for r in res["rows"] if r["variant"] in ("dense", label)]
            xs = [r["realised"] * 100 for r in rows]
            a.plot(xs, [r["ppl_delta"] * 100 for r in rows], style,
                   label=f"{res['model']}: {label}")
            b.plot(xs, [r["greedy_before_difference"] for r in rows], style,
                   label=f"{res['model']}: {label}")
    a.axhline(2, color="grey", lw=0.8, ls=":")
    a.text(1, 2.3, "+2% (the bundles' guardrail)", fontsize=8, color="grey")
    a.set_xlabel("realised model-wide input sparsity, % of the projections' weights")
    a.set_ylabel("held-out perplexity, % over dense")
    b.set_xlabel("realised model-wide input sparsity, %")
    b.set_ylabel("greedy tokens before the first difference (of 32)")
    a.legend(fontsize=7)
    fig.suptitle("Input sparsity in every projection: quality, by allocation and criterion")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--sparsity", nargs="+", type=float, default=[0.25, 0.4, 0.5])
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--allocations", nargs="+", default=["uniform", "greedy"],
                    choices=["uniform", "greedy"],
                    help="every input at the target, or TEAL's block-wise greedy allocation")
    ap.add_argument("--greedy-calib-tokens", type=int, default=1024,
                    help="the calibration tokens the greedy allocation runs each block over")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--criteria", nargs="+", default=["magnitude"],
                    choices=["magnitude", "weighted"],
                    help="TEAL's |x|, and WINA's |x| times its channel's weight norm")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=str(Path(__file__).parent / "plots" / "input_sparsity.png"))
    args = ap.parse_args()
    results = [run_model(m, args) for m in args.models]
    out = {"date": datetime.date.today().isoformat(),
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
           "threads": torch.get_num_threads(),
           "args": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
           "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
