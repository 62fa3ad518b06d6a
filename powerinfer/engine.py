"""The in-process engine: batched prefill, then decode steps over the running sequences.

Bookkeeping (`Sequence`: output, stop rules, incremental text) is plain Python; only
`Engine._forward` touches torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from .compat import compile_per_instance
from .config import Config, SamplingParams
from .errors import InvalidRequestError
from .model import Transformer
from .sampling import make_generator, sample
from .tokenizer import StreamDecoder, Tokenizer


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    decoder: StreamDecoder
    eog_ids: frozenset[int]
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    pending: str = ""  # decoded text held back because it may begin a stop string
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def recent(self, n: int) -> list[int]:
        """The last n tokens, prompt included (for the repetition penalty)."""
        return (self.prompt[-n:] + self.output)[-n:] if n else []

    def push(self, token: int) -> str:
        """Record a sampled token; returns the text that is now final."""
        p = self.params
        self.output.append(token)
        if token in p.stop_token_ids or (token in self.eog_ids and not p.ignore_eos):
            return self.finish("stop", self.pending)
        self.pending += self.decoder.push(token)
        for s in p.stop:
            at = self.pending.find(s)
            if at >= 0:
                return self.finish("stop", self.pending[:at])
        if len(self.output) >= p.max_tokens:
            return self.finish("length", self.pending)
        hold = max((k for s in p.stop for k in range(len(s), 0, -1)
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text

    def finish(self, reason: str, text: str) -> str:
        self.finish_reason, self.pending = reason, ""
        return text


@dataclass(slots=True)
class Event:
    index: int  # which request of the batch
    text: str
    token: int  # -1 when the sequence ended without a new token (its context is full)
    finish_reason: str | None


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: Config):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_seq = context_length(model.args, config)
        self.device = model.output.weight.device
        model.setup_cache(config.max_batch, self.max_seq)
        self._decode = self._forward
        if config.compile:
            self._decode = compile_per_instance(self._forward)

    def new_sequence(self, prompt: list[int], params: SamplingParams) -> Sequence:
        return new_sequence(prompt, params, self.tokenizer, self.model.args.vocab_size, self.max_seq)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> Iterator[Event]:
        """Generate for up to max_batch sequences together; yields events as tokens arrive."""
        assert 0 < len(seqs) <= self.config.max_batch, len(seqs)
        dev = self.device
        # prefill: right-padded batch; padding writes cache entries that decode overwrites
        lens = [len(s.prompt) for s in seqs]
        T = max(lens)
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, :lens[i]] = torch.tensor(s.prompt)
        pos = torch.arange(T).expand(len(seqs), T)
        last = torch.tensor(lens) - 1
        logits = self._forward(tokens.to(dev), pos.to(dev), T, None, last.to(dev))
        slots = list(range(len(seqs)))
        while True:
            yield from self._sample(seqs, slots, logits[:, -1])
            running = [i for i in slots if not seqs[i].finished]
            for i in running:  # out of cache room
                if seqs[i].num_tokens > self.max_seq:
                    yield Event(i, seqs[i].finish("length", seqs[i].pending), -1, "length")
            running = [i for i in running if not seqs[i].finished]
            if not running:
                return
            # decode: one token for every running sequence, each at its own position
            tokens = torch.tensor([[seqs[i].output[-1]] for i in running], device=dev)
            positions = [seqs[i].num_tokens - 1 for i in running]
            pos = torch.tensor(positions, device=dev)[:, None]
            kv_len = max(positions) + 1
            slot_t = None if running == list(range(len(running))) else torch.tensor(running, device=dev)
            logits = self._decode(tokens, pos, kv_len, slot_t, None)
            slots = running

    def _forward(self, tokens, pos, kv_len, slots, last):
        return self.model(tokens, pos, kv_len, slots, last)

    def _sample(self, seqs, rows, logits) -> Iterator[Event]:
        # logits: (len(rows), vocab)
        logits = logits.cpu()
        for j, i in enumerate(rows):
            token, text = sample_next(seqs[i], logits[j])
            yield Event(i, text, token, seqs[i].finish_reason)


def context_length(args, config: Config) -> int:
    """KV cache positions per sequence: Config.max_seq_len, or the model's context up to 2048."""
    n = config.max_seq_len or min(args.max_seq_len, 2048)
    return min(n, args.max_seq_len) if args.learned_pos else n


def new_sequence(prompt: list[int], params: SamplingParams, tokenizer: Tokenizer, vocab_size: int,
                 max_seq: int) -> Sequence:
    """A validated sequence; InvalidRequestError names what is wrong with the prompt."""
    if not prompt:
        raise InvalidRequestError("empty prompt")
    if len(prompt) >= max_seq:
        raise InvalidRequestError(f"prompt has {len(prompt)} tokens; the context holds "
                                  f"{max_seq} (Config.max_seq_len)")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} outside the vocabulary")
    gen = None if params.greedy else make_generator(params.seed)
    return Sequence(list(prompt), params, StreamDecoder(tokenizer), tokenizer.eog_ids, gen)


def sample_next(s: Sequence, logits: torch.Tensor) -> tuple[int, str]:
    """Sample s's next token from its logits (vocab,); returns it and the text now final."""
    history = s.recent(s.params.repetition_window) if s.params.repetition_penalty != 1 else []
    token = sample(logits, s.params, history, s.generator)
    return token, s.push(token)
