"""Token sampling by a request's `SamplingParams`, in llama.cpp's order: repetition penalty ->
top-k -> top-p -> min-p -> temperature -> draw. top-p and min-p look at the untempered
distribution, as llama.cpp does.

In numpy, not torch: the actor runtime's scheduler samples, and it runs without torch (a
process of a served model that does not pay torch's import and memory). A row of logits may
come as a numpy array or as a CPU tensor (the in-process engine's; read without a copy)."""
from __future__ import annotations

import hashlib

import numpy as np

from .params import SamplingParams


def host_array(logits) -> np.ndarray:
    """Logits as a float32 numpy array: an array as it is, a torch tensor (duck-typed, so that
    this module never imports torch) as its host memory."""
    if isinstance(logits, np.ndarray):
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)
    return logits.detach().float().cpu().numpy()


def apply_repetition_penalty(logits: np.ndarray, history: list[int], p: SamplingParams):
    # logits: (V,) float32, modified in place; history: the recent tokens to penalise.
    # CTRL-style: divide positive logits, multiply negative ones.
    if p.repetition_penalty == 1.0 or not history:
        return
    ids = np.array(sorted(set(history)), dtype=np.int64)
    vals = logits[ids]
    logits[ids] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def _descending(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of x (all of them when k is 0 or past its length), largest
    first; among equal values the lower index first."""
    if 0 < k < x.shape[0]:
        idx = np.argpartition(-x, k - 1)[:k]
        return idx[np.lexsort((idx, -x[idx]))]
    return np.argsort(-x, kind="stable")


def sample(logits, p: SamplingParams, history: list[int],
           generator: np.random.Generator | None) -> int:
    """Pick the next token from one row of logits (V,). A row with NaN, or with no token
    allowed (every logit -inf), raises RuntimeError: its sequence fails, not the batch."""
    x = host_array(logits)
    if p.greedy and (p.repetition_penalty == 1.0 or not history):
        return int(np.argmax(x))  # the first maximum, NaN first
    x = x.copy()
    apply_repetition_penalty(x, history, p)
    if p.greedy:
        return int(np.argmax(x))
    if np.isnan(x).any():
        raise RuntimeError("the logits hold NaN")
    idx = _descending(x, p.top_k)
    vals = x[idx]
    if not np.isfinite(vals[0]):
        raise RuntimeError("no token has a finite logit")
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    keep = np.ones(probs.shape, dtype=bool)
    if p.top_p < 1.0:
        keep &= (np.cumsum(probs) - probs) < p.top_p  # the smallest prefix reaching top_p
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    vals, idx = vals[keep], idx[keep]
    # from the largest logit down and in float64, so that a tiny temperature gives 0 and -inf
    # (float32 would round it to 0 and divide 0 by 0)
    z = (vals - vals[0]).astype(np.float64) / p.temperature
    w = np.cumsum(np.exp(z))
    draw = generator.random() if generator is not None else np.random.random()
    return int(idx[min(int(np.searchsorted(w, draw * w[-1], side="right")), len(w) - 1)])


def token_generator(seed: int, index: int) -> np.random.Generator:
    """The generator that draws a sequence's output token `index`: seeded from (seed, index),
    so that a sequence's draws depend on nothing else (a request resumed in another process,
    after its group failed, continues with the draws it would have made)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))


def logprobs(logits, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its k most likely tokens with theirs, from one
    row of raw logits (V,) (before penalties and temperature, as OpenAI's API reports them)."""
    x = host_array(logits)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum(dtype=np.float64))).astype(np.float32)
    alts = [(int(i), float(lp[i])) for i in _descending(lp, k)] if k else []
    return float(lp[token]), alts
