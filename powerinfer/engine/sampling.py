"""Token sampling by a request's `SamplingParams`, in llama.cpp's order: repetition penalty ->
top-k -> top-p -> min-p -> temperature -> draw. top-p and min-p look at the untempered
distribution, as llama.cpp does."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from .params import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, history: list[int], p: SamplingParams):
    # logits: (V,) float32, modified in place; history: the recent tokens to penalise.
    # CTRL-style: divide positive logits, multiply negative ones.
    if p.repetition_penalty == 1.0 or not history:
        return
    ids = torch.tensor(sorted(set(history)), dtype=torch.long)
    vals = logits[ids]
    logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def sample(logits: torch.Tensor, p: SamplingParams, history: list[int],
           generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits (V,)."""
    if p.greedy and (p.repetition_penalty == 1.0 or not history):
        # numpy's argmax (the same first maximum, NaN first as torch's): torch's took 530 us
        # over Gemma 3's 262,144 logits, numpy's 37 us
        return int(np.argmax(logits.float().numpy()))
    logits = logits.float().clone()
    apply_repetition_penalty(logits, history, p)
    if p.greedy:
        return int(np.argmax(logits.numpy()))
    if 0 < p.top_k < logits.numel():
        vals, idx = logits.topk(p.top_k)  # sorted, largest first
    else:
        vals, idx = logits.sort(descending=True)
    probs = torch.softmax(vals, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_p < 1.0:
        keep &= (probs.cumsum(-1) - probs) < p.top_p  # the smallest prefix reaching top_p
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    vals, idx = vals[keep], idx[keep]
    # from the largest logit down and in float64, so that a tiny temperature gives 0 and -inf
    # (float32 would round it to 0 and divide 0 by 0)
    probs = torch.softmax((vals - vals[0]).double() / p.temperature, dim=-1)
    return int(idx[torch.multinomial(probs, 1, generator=generator)])


def token_generator(seed: int, index: int) -> torch.Generator:
    """The generator that draws a sequence's output token `index`: seeded from (seed, index),
    so that a sequence's draws depend on nothing else (a request resumed in another process,
    after its group failed, continues with the draws it would have made)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its k most likely tokens with theirs, from one
    row of raw logits (V,) (before penalties and temperature, as OpenAI's API reports them)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(k) if k else None
    alts = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
    return float(lp[token]), alts
