"""A request's decoding settings (`SamplingParams`) and token sampling, in llama.cpp's order:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. top-p and min-p look at the
untempered distribution, as llama.cpp does."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidRequestError
from .grammar import Grammar

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 is greedy; llama.cpp's defaults otherwise."""

    max_tokens: int = 128
    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off; applied over the last `repetition_window` tokens
    repetition_window: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    grammar: Grammar | None = None  # hold the output to a JSON schema, regex, choices or grammar

    def __post_init__(self):
        problems = []
        if self.max_tokens < 1:
            problems.append("max_tokens must be >= 1")
        if self.temperature < 0:
            problems.append("temperature must be >= 0")
        if self.top_k < 0:
            problems.append("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append("top_p must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            problems.append("min_p must be in [0, 1)")
        if self.repetition_penalty <= 0:
            problems.append("repetition_penalty must be > 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop must be non-empty strings")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            problems.append("grammar must be a powerinfer.engine.grammar.Grammar")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if problems:
            raise InvalidRequestError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_params(**kw) -> SamplingParams:
    """Build SamplingParams from keyword arguments, accepting lists and a single stop string."""
    stop = kw.pop("stop", None) or ()
    kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    kw["stop_token_ids"] = tuple(kw.pop("stop_token_ids", None) or ())
    unknown = set(kw) - set(SamplingParams.__dataclass_fields__)
    if unknown:
        raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    return SamplingParams(**{k: v for k, v in kw.items() if v is not None})


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
