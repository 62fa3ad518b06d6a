"""One batching core for both runtimes: continuous batching as schedule, run, postprocess.

`Batcher` holds the sequences waiting for a KV slot and those running, and the cache-room rule.
`schedule()` returns the next `Step` (a prefill of the waiting sequences that got a slot, or else
one decode step over every running sequence), a runtime runs it (the in-process `Engine`, or the
actor runtime's scheduler through the hot executor), and `postprocess(step, logits)` samples each
row, applies the stop rules, frees the slots of finished sequences and returns what each row
produced. Plain Python bookkeeping and small CPU tensors: no model, no device.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .config import Config, SamplingParams
from .errors import InvalidRequestError
from .sampling import logprobs, make_generator, sample
from .tokenizer import StreamDecoder, Tokenizer


@dataclass(eq=False)  # identity: two requests with the same prompt are two sequences
class Sequence:
    prompt: list[int]
    params: SamplingParams
    decoder: StreamDecoder
    eog_ids: frozenset[int]
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    pending: str = ""  # decoded text held back because it may begin a stop string
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    slot: int = -1  # its KV cache row while it is scheduled
    key: object = None  # the caller's handle (a request, an index)

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


@dataclass
class Step:
    prefill: bool  # a prefill of newly admitted sequences, else one decode step
    seqs: list[Sequence]
    tokens: torch.Tensor  # (B, T) int64, right-padded
    positions: torch.Tensor  # (B, T) int64
    slots: torch.Tensor  # (B,) int64 KV rows
    kv_len: int  # cache positions the step attends over
    last: torch.Tensor  # (B,) int64, each prompt's last position (prefill; zeros for decode)


@dataclass
class Output:
    """What one row of a step produced."""
    seq: Sequence
    token: int  # -1 when the sequence ended without a new token (context full, or an error)
    text: str  # the text that became final
    finish_reason: str | None
    first: bool = False  # the sequence's first token (its prefill)
    logprob: float | None = None  # with SamplingParams.logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None  # this row's sampling failed (its sequence is finished)


class Batcher:
    def __init__(self, max_batch: int, max_seq: int):
        self.max_batch, self.max_seq = max_batch, max_seq
        self.free = list(range(max_batch))  # slots >= max_batch are reserved by their callers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence, front: bool = False):
        """Queue a sequence (with seq.slot set beforehand when it brings a reserved slot)."""
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    @property
    def queued(self) -> int:
        """Sequences that will still wait for a slot once the free ones are handed out."""
        return len(self.waiting) - len(self.free)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out (cancelled or finished) and free its slot; False if unknown."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        else:
            return False
        if 0 <= seq.slot < self.max_batch:
            self.free.append(seq.slot)
            self.free.sort()
        seq.slot = -1
        return True

    def schedule(self) -> Step | None:
        admit = []
        for seq in list(self.waiting):
            if seq.slot < 0 and self.free:
                seq.slot = self.free.pop(0)
            if seq.slot >= 0:
                self.waiting.remove(seq)
                admit.append(seq)
        if admit:
            self.running += admit
            lens = [len(s.prompt) for s in admit]
            B, T = len(admit), max(lens)
            tokens = torch.zeros(B, T, dtype=torch.int64)
            for i, s in enumerate(admit):
                tokens[i, :lens[i]] = torch.tensor(s.prompt)
            return Step(True, admit, tokens, torch.arange(T).expand(B, T), self._slots(admit), T,
                        torch.tensor(lens) - 1)
        if not self.running:
            return None
        seqs = list(self.running)
        positions = [s.num_tokens - 1 for s in seqs]
        return Step(False, seqs, torch.tensor([[s.output[-1]] for s in seqs]),
                    torch.tensor(positions)[:, None], self._slots(seqs), max(positions) + 1,
                    torch.zeros(len(seqs), dtype=torch.int64))

    @staticmethod
    def _slots(seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs])

    def postprocess(self, step: Step, logits: torch.Tensor) -> list[Output]:
        # logits: (B, vocab) on the CPU, one row per step.seqs
        outs = []
        for j, s in enumerate(step.seqs):
            try:
                token, text = sample_next(s, logits[j])
            except RuntimeError as e:  # this sequence's distribution is broken, not the batch
                s.finish("error", "")
                outs.append(Output(s, -1, "", "error", step.prefill,
                                   error=f"sampling failed with these parameters: {e}"))
                continue
            out = Output(s, token, text, s.finish_reason, step.prefill)
            if s.params.logprobs is not None:
                out.logprob, out.top_logprobs = logprobs(logits[j], token, s.params.logprobs)
            outs.append(out)
            if not s.finished and s.num_tokens > self.max_seq:  # no cache room for the next one
                outs.append(Output(s, -1, s.finish("length", s.pending), "length"))
        for s in step.seqs:
            if s.finished:
                self.remove(s)
        return outs


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
