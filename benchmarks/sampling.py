#!/usr/bin/env python3
"""What sampling a token costs the scheduler, a row at a time: `powerinfer.engine.sampling.sample`
against the same filters over a whole sorted row (torch's sort, as the scheduler sampled before
it ran without torch), in the same run, for SmolLM2's and Gemma 3's vocabularies.

    .venv/bin/python benchmarks/sampling.py [--rows 200]

The settings: the OpenAI API's defaults (temperature 1, no top-k, top-p 1, no min-p), top-p 0.9,
min-p 0.05 and top-k 40 (llama.cpp's CLI defaults), over the real models' logits: SmolLM2's and
Gemma 3's rows at every position of a prompt of about 100 tokens (the in-process engine's, in
float32), and a flat row (a standard normal scaled by 3: a nucleus of thousands of tokens, the
worst case for sorting only what can be kept). One thread, as the scheduler's loop runs. Prints a
Markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import platform
import time

import numpy as np
import torch

from powerinfer.engine.params import SamplingParams
from powerinfer.engine.sampling import sample, token_generator

SETTINGS = {"OpenAI defaults (top-k 0, top-p 1)": dict(top_k=0, top_p=1.0, min_p=0.0),
            "top-p 0.9": dict(top_k=0, top_p=0.9, min_p=0.0),
            "min-p 0.05": dict(top_k=0, top_p=1.0, min_p=0.05),
            "top-k 40, top-p 0.95, min-p 0.05": dict(top_k=40, top_p=0.95, min_p=0.05)}


def whole_sort(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """The filters over the whole row sorted (the scheduler's sampling before, in torch)."""
    if 0 < p.top_k < logits.numel():
        vals, idx = logits.topk(p.top_k)
    else:
        vals, idx = logits.sort(descending=True)
    probs = torch.softmax(vals, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_p < 1.0:
        keep &= (probs.cumsum(-1) - probs) < p.top_p
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    vals, idx = vals[keep], idx[keep]
    probs = torch.softmax((vals - vals[0]).double() / p.temperature, dim=-1)
    return int(idx[torch.multinomial(probs, 1, generator=generator)])


def timed(f, rows: int) -> float:
    f(0)
    t0 = time.perf_counter()
    for i in range(rows):
        f(i)
    return (time.perf_counter() - t0) / rows * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"\n### sampling a row\n\n- Date: {datetime.date.today()}; machine: "
          f"{platform.processor() or platform.machine()}, one thread; {args.rows} rows each\n")
    print("| logits | setting | sample() ms | whole sort (torch) ms | speed-up |")
    print("|---|---|---:|---:|---:|")
    for label, rows in model_rows(rng):
        tensors = [torch.from_numpy(r) for r in rows]
        for name, kw in SETTINGS.items():
            p = SamplingParams(temperature=1.0, **kw)
            new = timed(lambda i: sample(rows[i % len(rows)], p, [], token_generator(7, i)),
                        args.rows)
            seed = lambda i: int.from_bytes(hashlib.blake2b(f"7:{i}".encode(),  # noqa: E731
                                                            digest_size=8).digest(), "little")
            old = timed(lambda i: whole_sort(tensors[i % len(rows)], p,
                                             torch.Generator().manual_seed(seed(i))), args.rows)
            print(f"| {label} | {name} | {new:.3f} | {old:.3f} | {old / new:.1f}x |")


PROMPT = ("The history of the city begins with a small settlement on the river, where traders "
          "met to exchange salt, grain and cloth. Over the centuries it grew into a market town, "
          "then a seat of bishops, and later an industrial centre whose factories drew workers "
          "from the countryside. Today visitors come for its old bridge, its cathedral and")


def model_rows(rng) -> list[tuple[str, list[np.ndarray]]]:
    from powerinfer import Config, PowerInfer
    out = []
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        pi = PowerInfer.from_pretrained(name, Config(dtype="float32", weights="dense",
                                                     max_seq_len=512, max_batch=1))
        logits = pi.engine.logits(pi.tokenize(PROMPT), every=True).float().numpy()
        out.append((f"{name}, {len(logits)} positions ({logits.shape[1]:,} tokens)",
                    [np.ascontiguousarray(r) for r in logits]))
        out.append((f"flat (N(0, 3)), {logits.shape[1]:,} tokens",
                    [(rng.standard_normal(logits.shape[1]) * 3).astype(np.float32)]))
        del pi
    return out


if __name__ == "__main__":
    main()
