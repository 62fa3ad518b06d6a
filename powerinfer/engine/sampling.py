"""Token sampling by a request's `SamplingParams`, in llama.cpp's order: repetition, presence and
frequency penalties -> top-k -> top-p -> min-p -> temperature -> draw. top-p and min-p look at the untempered
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
    # a penalty near 0 (or past float32's range) takes a logit past float32's largest: kept at
    # that bound, where an inf would leave no token with a finite logit and fail the request
    with np.errstate(over="ignore", divide="ignore"):
        out = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    big = np.finfo(np.float32).max
    logits[ids] = np.clip(out, -big, big)


def apply_output_penalties(logits: np.ndarray, output: list[int], p: SamplingParams):
    """OpenAI's presence and frequency penalties over the tokens generated so far (in place):
    each token that has come loses presence_penalty, and frequency_penalty times its count."""
    if not p.penalised or not output:
        return
    ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
    logits[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * counts


def _descending(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of x (all of them when k is 0 or past its length), largest
    first; among equal values the lower index first."""
    n = x.shape[0]
    if 0 < k < n:
        bar = x[np.argpartition(x, n - k)[n - k]]  # the k-th largest (not -x: a copy less)
        idx = np.flatnonzero(x >= bar)  # and every tie of it, to take the first ones
        return idx[np.lexsort((idx, -x[idx]))][:k]
    return np.argsort(-x, kind="stable")


def sample(logits, p: SamplingParams, history: list[int],
           generator: np.random.Generator | None, output: list[int] | None = None) -> int:
    """Pick the next token from one row of logits (V,). `history`: the recent tokens, prompt
    included (the repetition penalty); `output`: those generated so far (the presence and
    frequency penalties). A row with NaN, or with no token allowed (every logit -inf), raises
    RuntimeError: its sequence fails, not the batch."""
    x = host_array(logits)
    if p.greedy and (p.repetition_penalty == 1.0 or not history) and \
            not (p.penalised and output):
        return int(np.argmax(x))  # the first maximum, NaN first
    x = x.copy()
    apply_repetition_penalty(x, history, p)
    apply_output_penalties(x, output or [], p)
    if p.greedy:
        return int(np.argmax(x))
    if np.isnan(x).any():
        raise RuntimeError("the logits hold NaN")
    m = x.max()
    if not np.isfinite(m):
        raise RuntimeError("no token has a finite logit")
    idx = kept(x, m, p)
    z = (x if idx is None else x[idx]) - m  # from the largest logit down: <= 0
    if p.temperature < 1e-30:  # 1/T past float32's range: the largest (0 * inf would be NaN)
        j = int(np.argmax(z))
        return j if idx is None else int(idx[j])
    z *= np.float32(1.0 / p.temperature)
    w = np.exp(z).astype(np.float64)  # (exp in float32 is 3x float64's; the sum in float64)
    np.cumsum(w, out=w)
    draw = generator.random() if generator is not None else np.random.random()
    j = min(int(np.searchsorted(w, draw * w[-1], side="right")), len(w) - 1)
    return j if idx is None else int(idx[j])


def kept(x: np.ndarray, m: float, p: SamplingParams) -> np.ndarray | None:
    """The tokens p's filters keep from logits x (max m): top-k, then top-p and min-p over the
    untempered distribution (top-k's, renormalized, when it has one), largest first; None
    (every token, in order) when nothing filters. Without a top-k, only the tokens that can be
    kept are sorted: those past min-p's bar, or the fewest largest reaching top-p's mass (a
    whole sort of SmolLM2's 49,152 logits took 8 ms a row, on the scheduler's path, for every
    sampled request of the OpenAI API, whose top-k is 0: `benchmarks/sampling.py`)."""
    V = x.shape[0]
    if 0 < p.top_k < V:
        idx = _descending(x, p.top_k)
        e = np.exp(x[idx] - m)
        probs = e / e.sum()
    elif p.top_p >= 1.0 and p.min_p <= 0.0:
        return None
    else:
        e = np.exp(x - m)  # the largest is 1
        total = e.sum(dtype=np.float64)
        cand = np.flatnonzero(e >= p.min_p) if p.min_p > 0.0 else _mass(e, p.top_p * total)
        idx = cand[np.lexsort((cand, -x[cand]))]
        probs = e[idx] / total
    keep = np.ones(probs.shape, dtype=bool)
    if p.top_p < 1.0:
        keep &= (np.cumsum(probs) - probs) < p.top_p  # the smallest prefix reaching top_p
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    return idx[keep]


def _mass(e: np.ndarray, need: float) -> np.ndarray:
    """The k largest of e for the first k of 64, 256, ... whose sum reaches `need` (so they
    hold the sorted prefix that does), or every index."""
    k, n = 64, e.shape[0]
    while k < n:
        cand = np.argpartition(e, n - k)[n - k:]
        if e[cand].sum(dtype=np.float64) >= need:
            return cand
        k *= 4
    return np.arange(e.shape[0])


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
