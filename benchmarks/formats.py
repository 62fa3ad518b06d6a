#!/usr/bin/env python3
"""What each CPU kernel weight format costs in quality: held-out perplexity of the default model
with its FFN neurons held in each format, beside the file's own weights, in one run.

    .venv/bin/python benchmarks/formats.py [--model M] [--tokens 4096] [--formats ...]

Every FFN becomes a hybrid FFN with every neuron computed (no predictor, so only the format
changes the numbers); gate/up rows in the format, down rows in `kernels.down_format` (Q8_0 beside
4-bit ones). Baselines: the dense model in float32 (a Q4_1 file's values exactly) and in bfloat16,
and the in-process int4 configuration (torch's int4 kernel over the file's blocks). Teacher-forced
over the Lee corpus's held-out split in windows of 256 tokens.
"""
from __future__ import annotations

import argparse
import datetime
import math
import platform

import torch
import torch.nn.functional as F

from powerinfer import Config, PowerInfer, kernels
from powerinfer.sparsity.corpus import load_corpus
from powerinfer.model.sparse import apply_hybrid_ffn

WINDOW = 256


def perplexity(model, ids: list[int]) -> float:
    nll, n = 0.0, 0
    model.setup_cache(1, WINDOW)  # one sequence in its own blocks (the model alone)
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, WINDOW):
            chunk = ids[s:s + WINDOW + 1]
            T = len(chunk) - 1
            logits = model(torch.tensor([chunk[:-1]]), torch.arange(T)[None])[0].float()
            nll += F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
            n += T
    return math.exp(nll / n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--formats", nargs="+", default=["f32", "bf16", "q4_1", "q4_0", "q8_0", "i8"])
    args = ap.parse_args()
    text = "\n".join(load_corpus("lee", "held_out").documents)
    rows = []

    def run(label, dtype, weights="dense", fmt=None):
        pi = PowerInfer.from_pretrained(args.model, Config(dtype=dtype, weights=weights,
                                                           max_seq_len=WINDOW + 8))
        if fmt is not None:
            ffn = pi.args.ffn_dim
            every = lambda i, x: torch.ones(*x.shape[:-1], ffn, dtype=torch.bool)  # noqa: E731
            apply_hybrid_ffn(pi.model, every, fmt=fmt)
        ids = pi.tokenize(text)[:args.tokens + 1]
        rows.append((label, perplexity(pi.model, ids)))
        print(f"{label}: {rows[-1][1]:.3f}", flush=True)

    run("dense float32 (the file's values)", "float32")
    run("dense bfloat16", "bfloat16")
    run("int4 in-process (torch int4 kernel, 8-bit head)", "bfloat16", "int4")
    for fmt in args.formats:
        down = kernels.down_format(fmt)
        dtype = "float32" if fmt == "f32" else "bfloat16"
        run(f"FFN neurons {fmt}" + (f" (down rows {down})" if down != fmt else "") + f", {dtype}",
            dtype, fmt=fmt)
    base = rows[0][1]
    print(f"\n# {datetime.date.today()} {platform.processor() or platform.machine()}, "
          f"{args.model}, Lee held-out, {args.tokens} tokens, windows of {WINDOW}")
    print("| weights | perplexity | vs the file's values |")
    print("|---|---:|---:|")
    for label, p in rows:
        print(f"| {label} | {p:.3f} | {p / base - 1:+.2%} |")


if __name__ == "__main__":
    main()
