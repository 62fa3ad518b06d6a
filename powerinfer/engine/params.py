"""A request's decoding settings (`SamplingParams`): plain data, checked when built, small to
pickle, with no tensor library behind them, so that a process that only forwards requests (the
Serve ingress) handles them without torch. `sampling` draws the tokens they ask for."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidRequestError
from .grammar import Grammar

MAX_LOGPROBS = 20
# a request's stop strings: at most this many, each at most this long (one of a million
# characters held a scheduler for minutes; one of a thousand costs nothing a token)
MAX_STOPS, MAX_STOP_CHARS = 16, 1024


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # (a bool is an int to Python)


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
    # OpenAI's, over the tokens generated so far: a token's logit less presence_penalty once it
    # has come, and frequency_penalty for each time it has (-2..2; 0: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    grammar: Grammar | None = None  # hold the output to a JSON schema, regex, choices or grammar

    def __post_init__(self):
        problems = []
        if not _integer(self.max_tokens):
            raise InvalidRequestError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.seed is not None and not _integer(self.seed):
            problems.append(f"seed must be an integer, got {self.seed!r:.40}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be token ids (integers >= 0)")
        if self.max_tokens < 1:
            problems.append("max_tokens must be >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # (NaN: not >= 0)
            problems.append("temperature must be a finite number >= 0")
        if self.top_k < 0:
            problems.append("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append("top_p must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            problems.append("min_p must be in [0, 1)")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            problems.append("repetition_penalty must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # (NaN too)
                problems.append(f"{name} must be in [-2, 2]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop must be non-empty strings")
        elif len(self.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            problems.append(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} "
                            "characters each")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            problems.append("grammar must be a powerinfer.engine.grammar.Grammar")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if problems:
            raise InvalidRequestError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether the tokens generated so far change the next one's logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def sampling_params(**kw) -> SamplingParams:
    """Build SamplingParams from keyword arguments, accepting lists and a single stop string."""
    stop = kw.pop("stop", None)  # ("" is an empty stop string, as [""] is: refused)
    kw["stop"] = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    kw["stop_token_ids"] = tuple(kw.pop("stop_token_ids", None) or ())
    unknown = set(kw) - set(SamplingParams.__dataclass_fields__)
    if unknown:
        raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    return SamplingParams(**{k: v for k, v in kw.items() if v is not None})
