"""One batching core for both runtimes: continuous batching over the paged KV cache, as
schedule, run, postprocess.

`Batcher` holds the sequences waiting and those running, and deals out the pool's blocks
(`kv.BlockManager`). A sequence is its tokens (prompt, then output) and how many of them are in
the cache (`computed`); each step brings every running sequence closer: one token for those
decoding, a chunk of at most `prefill_chunk` prompt tokens a step for those being prefilled
(chunked prefill, so that a long prompt shares steps with the streams already running; while
streams decode, the chunk is cut to keep a step within `pace` times a decode step), and
the new sequences that fit, each starting after the longest cached prefix of its prompt
(prefix caching). A step is flat: its tokens sequence by sequence, with each sequence's block
table (`model.KVTables`). A sequence whose tokens are all computed is sampled.

When the pool cannot hold the running sequences' next tokens, the newest is preempted: its
blocks go back (the full ones stay cached) and it waits at the front of the queue, to be
prefilled again from its tokens (recomputation, as vLLM does); nobody fails.

`schedule()` returns the next `Step`, a runtime runs it (the in-process `Engine`, or the actor
runtime's scheduler through the hot executor), and `postprocess(step, logits)` samples the rows
that are due, applies the stop rules, frees the blocks of finished sequences and returns what
each produced. Plain Python bookkeeping and small numpy arrays: no model, no device, no torch.
"""
from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..config import Config
from ..errors import InvalidRequestError
from ..formats.tokenizer import StreamDecoder, Tokenizer
from . import grammar
from .grammar import matcher
from .kv import BlockManager, Blocks
from .params import SamplingParams
from .sampling import host_array, logprobs, sample, token_generator


@dataclass(eq=False)  # identity: two requests with the same prompt are two sequences
class Sequence:
    prompt: list[int]
    params: SamplingParams
    decoder: StreamDecoder
    eog_ids: frozenset[int]
    seed: int = 0  # its output token i is drawn by token_generator(seed, i)
    output: list[int] = field(default_factory=list)
    pending: str = ""  # decoded text held back because it may begin a stop string
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    key: object = None  # the caller's handle (a request, an index)
    blocks: Blocks = field(default_factory=Blocks)  # what it holds of the KV pool
    computed: int = 0  # its tokens whose keys and values are in the cache
    cached: int = 0  # prompt tokens found in the prefix cache at its first admission
    admitted: bool = False  # it has been admitted once (a preempted one comes back)
    matcher: object = None  # SamplingParams.grammar's llguidance matcher, following the output
    stops: "StopMatcher | None" = None  # the stop strings' matcher, from the first token on

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def recent(self, n: int) -> list[int]:
        """The last n tokens, prompt included (for the repetition penalty)."""
        return (self.prompt[-n:] + self.output)[-n:] if n else []

    def push(self, token: int) -> str:
        """Record a sampled token; returns the text that is now final."""
        p, m = self.params, self.matcher
        self.output.append(token)
        if m is not None and not m.consume_token(token):
            raise RuntimeError(f"token {token} leaves the grammar: {m.get_error()}")
        if token in p.stop_token_ids or (token in self.eog_ids and not p.ignore_eos):
            return self.finish("stop", self.pending)
        piece = self.decoder.push(token)
        self.pending += piece
        if p.stop:
            if self.stops is None:
                self.stops = StopMatcher(p.stop)
            at = self.stops.feed(piece)
            if at is not None:  # (where the match starts, from the end of the text so far)
                return self.finish("stop", self.pending[:len(self.pending) - at])
        if m is not None and m.is_stopped():  # the grammar is complete and admits nothing more
            return self.finish("stop", self.pending)
        if len(self.output) >= p.max_tokens:
            return self.finish("length", self.pending)
        cut = len(self.pending) - (self.stops.held if self.stops else 0)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text

    def finish(self, reason: str, text: str) -> str:
        self.finish_reason, self.pending = reason, ""
        return text

    def replay(self, tokens: list[int]) -> str:
        """Record tokens sampled before (a request resumed after its group failed): the stop
        rules and the detokenizer end where they were; returns the text they made final."""
        return "".join(self.push(t) for t in tokens)


class StopMatcher:
    """Stop strings found in text that comes in pieces, each character looked at once per string
    (Knuth-Morris-Pratt): finding them by searching the text held back, and what to hold back by
    trying each prefix of each string, cost the square of a string's length a token, so that one
    request with a long stop string held up every sequence of its batch."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fail = [self._failure(s) for s in stops]
        self.state = [0] * len(stops)  # each string's longest prefix the text now ends with

    @staticmethod
    def _failure(s: str) -> list[int]:
        """f[i]: the longest proper prefix of s[:i + 1] that is also its suffix."""
        f, k = [0] * len(s), 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = f[k - 1]
            if s[i] == s[k]:
                k += 1
            f[i] = k
        return f

    def feed(self, text: str) -> int | None:
        """Take the text's next piece. Where a stop string now ends in it (the first to end),
        how many characters from the end of the text so far that string starts; else None."""
        for j, c in enumerate(text):
            for i, s in enumerate(self.stops):
                k, f = self.state[i], self.fail[i]
                while k and c != s[k]:
                    k = f[k - 1]
                if c == s[k]:
                    k += 1
                if k == len(s):
                    return len(text) - j - 1 + len(s)
                self.state[i] = k
        return None

    @property
    def held(self) -> int:
        """The characters at the end of the text that may begin a stop string."""
        return max(self.state, default=0)


@dataclass
class Step:
    """One step: `counts[i]` new tokens of seqs[i], flat, sequence by sequence."""
    seqs: list[Sequence]
    counts: list[int]
    tokens: np.ndarray  # (S, 1) int64 when every sequence brings one token (decode), else (1, N)
    positions: np.ndarray  # like tokens
    starts: np.ndarray  # (S + 1,) int64: sequence i's tokens are starts[i] .. starts[i+1] - 1
    tables: np.ndarray  # (S, M) int32 block tables
    sampled: list[Sequence]  # the sequences whose tokens are all computed after it: one logits row each
    last: np.ndarray  # (K,) int64: the flat index of each sampled sequence's last token

    @property
    def decode(self) -> bool:
        return self.tokens.shape[1] == 1

    @property
    def prefill_tokens(self) -> int:
        """Tokens of the step that are not one-token decode rows."""
        return sum(n for n in self.counts if n > 1)

    def parts(self, apart: bool) -> list["Step"]:
        """The step as a runner computes it: whole, or (apart: a sparse model, whose one-token
        rows compute only their predicted neurons where a prompt computes every one, so that a
        sequence's tokens do not depend on what it shares a step with) its one-token rows and
        its prompt chunks as two steps. Their sampled rows, in order, are this step's."""
        one = sum(n == 1 for n in self.counts)  # they come first (`make_step`)
        if not apart or one in (0, len(self.counts)):
            return [self]
        rows = list(zip(self.seqs, self.counts))
        return [make_step(rows[:one]), make_step(rows[one:])]


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


PACE_MIN_CHUNK = 32  # prompt tokens a paced step prefills at least (progress on any machine)


PACE_EMA = 0.2  # weight of the newest step in the paced step's running estimates


class Batcher:
    """max_batch: sequences running at once; max_seq: positions a sequence may reach;
    prefill_chunk: prompt tokens a step at most (0: a whole prompt in one step); pace: while
    sequences decode, a step's prompt chunk is cut so that the step takes about `pace` times a
    decode step (the decoding streams' gap between tokens grows by that factor at most, on any
    machine), from the runner's times (`observe`), down to PACE_MIN_CHUNK tokens; with nothing
    decoding, or pace 0, chunks are prefill_chunk tokens; sparse: the model's
    decode rows compute their predicted neurons only, where a prompt computes every one: a
    sequence computed again (preempted, resumed) then catches up on its output one token a step,
    as a decode row, so that its cache holds what it held, and only the prompt's blocks are
    keyed for reuse (a later prompt reusing them computes what it would have computed)."""

    def __init__(self, blocks: BlockManager, max_batch: int, max_seq: int, prefill_chunk: int = 0,
                 sparse: bool = False, pace: float = 0.0):
        self.blocks, self.max_batch, self.max_seq = blocks, max_batch, max_seq
        self.prefill_chunk, self.sparse, self.pace = prefill_chunk, sparse, pace
        self.decode_s: float | None = None  # a decode step's seconds, as the runner timed them
        self.token_s: float | None = None  # a prompt token's seconds, beyond the decode rows'
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.preemptions = 0

    def add(self, seq: Sequence, front: bool = False):
        """Queue a sequence (one whose `blocks` were reserved by its owner, a probe, is admitted
        ahead of the others and over max_batch)."""
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    # a health probe holds a block its owner reserved outside the pool and is admitted over
    # max_batch: it is not a request, and is counted apart
    @property
    def running_requests(self) -> int:
        return sum(not s.blocks.reserved for s in self.running)

    @property
    def waiting_requests(self) -> int:
        return sum(not s.blocks.reserved for s in self.waiting)

    @property
    def probes(self) -> int:
        return len(self.running) + len(self.waiting) - self.running_requests - self.waiting_requests

    @property
    def queued(self) -> int:
        """Requests that will still wait once the next steps admit what max_batch allows (a
        waiting probe is admitted over it: not counted)."""
        return self.waiting_requests - max(0, self.max_batch - self.running_requests)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out (cancelled or finished) and free its blocks; False if unknown."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        else:
            return False
        self.blocks.release(seq.blocks)
        return True

    def observe(self, step: "Step", seconds: float):
        """The runner's time for a step, for pacing the chunks of the next."""
        def ema(old, new):
            return new if old is None else old + PACE_EMA * (new - old)

        tokens = step.prefill_tokens
        if not tokens:
            self.decode_s = ema(self.decode_s, seconds)
        elif len(step.seqs) == sum(n > 1 for n in step.counts) or self.decode_s is not None:
            rows = self.decode_s if any(n == 1 for n in step.counts) else 0.0
            self.token_s = ema(self.token_s, max(seconds - rows, 0.0) / tokens)

    def _budget(self) -> float:
        """Prompt tokens this step may prefill."""
        full = self.prefill_chunk or float("inf")
        if not (self.pace > 1 and self.prefill_chunk and self.decode_s and self.token_s):
            return full
        if not any(s.num_tokens - s.computed == 1 for s in self.running):
            return full  # nobody decodes: prefill at full speed
        return min(full, max(PACE_MIN_CHUNK,
                             int((self.pace - 1) * self.decode_s / self.token_s)))

    def schedule(self) -> Step | None:
        budget = self._budget()  # prompt tokens this step
        rows: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running):  # the running, oldest first
            s = self.running[i]
            n = self._next_count(s, s.computed, budget)
            if n == 0:
                i += 1
                continue
            while not self.blocks.grow(s.blocks, s.computed + n):
                victim = next(v for v in reversed(self.running) if not v.blocks.reserved)
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
            if s in self.running:
                rows.append((s, n))
                budget -= n if n > 1 else 0
                i += 1
        running = self.running_requests  # (a probe is extra)
        while self.waiting and not preempted:  # then the waiting that fit, in order
            s = self.waiting[0]
            if not s.blocks.reserved and (running >= self.max_batch or budget < 1):
                break
            hit = [] if s.blocks.reserved else self.blocks.match(self._keyed(s))
            if self.sparse and hit and len(s.prompt) - len(hit) * self.blocks.block_size == 1:
                hit.pop()  # (a sparse model's prompt tail is never one token: `_next_count`)
            n = self._next_count(s, len(hit) * self.blocks.block_size, budget)
            if n == 0:
                break
            if not s.blocks.reserved:
                if not self.blocks.can_admit(hit, len(hit) * self.blocks.block_size + n):
                    break
                s.computed = self.blocks.admit(s.blocks, hit, s.tokens, not s.admitted)
                if not s.admitted:
                    s.cached = s.computed
                ok = self.blocks.grow(s.blocks, s.computed + n)
                assert ok, "can_admit promised the blocks"
            s.admitted = True
            running += not s.blocks.reserved
            self.waiting.popleft()
            self.running.append(s)
            rows.append((s, n))
            budget -= n if n > 1 else 0
        return make_step(rows) if rows else None

    def _next_count(self, s: Sequence, computed: int, budget: float) -> int:
        """The tokens s computes in this step, from `computed`: the rest of its tokens, in
        chunks of the budget (0 when none is left), or one (a decode row)."""
        n = s.num_tokens - computed
        if n > 1 and self.sparse and computed >= len(s.prompt):
            return 1  # its output, computed again: as it was, one decode row a step
        if n > 1:
            if self.sparse:  # the prompt alone is prefilled
                n = len(s.prompt) - computed
            rest = n
            n = int(min(n, budget))
            if self.sparse and n > 0:
                # a sparse model's chunk of one prompt token would run as a decode row (its
                # predicted neurons), where the same token among others runs every neuron:
                # no chunk, nor what a chunk leaves, is one token (one past the budget), unless
                # one is all there is
                n = min(max(n, 2), rest)
                if rest - n == 1:
                    n = rest
        return n

    def _keyed(self, s: Sequence) -> list[int]:
        """The tokens of s whose blocks are keyed for reuse (a sparse model's: the prompt's)."""
        return s.prompt if self.sparse else s.tokens

    def _preempt(self, s: Sequence):
        self.running.remove(s)
        self.blocks.release(s.blocks)
        s.computed = 0
        self.waiting.appendleft(s)
        self.preemptions += 1

    def postprocess(self, step: Step, logits,
                    allowed: "grammar.Masks | None | bool" = False) -> list[Output]:
        # logits: (K, vocab) float32 on the host, one row per step.sampled (a numpy array, or
        # a CPU tensor read as one); allowed: the constrained rows' masks if the runtime
        # computed them already (`grammar.masks(step_matchers(step))`)
        logits = host_array(logits)
        for s, n in zip(step.seqs, step.counts):
            s.computed += n
            keyed = self._keyed(s)
            self.blocks.commit(s.blocks, keyed, min(s.computed, len(keyed)))
        outs = []
        if allowed is False:
            allowed = grammar.masks(step_matchers(step), logits.shape[1])
        held = grammar.apply(allowed, logits)  # logits itself when no row is constrained
        for j, s in enumerate(step.sampled):
            first = not s.output
            try:
                token, text = sample_next(s, held[j])
            except RuntimeError as e:  # this sequence's distribution is broken, not the batch
                s.finish("error", "")
                outs.append(Output(s, -1, "", "error", first,
                                   error=f"sampling failed with these parameters: {e}"))
                continue
            out = Output(s, token, text, s.finish_reason, first)
            if s.params.logprobs is not None:
                out.logprob, out.top_logprobs = logprobs(logits[j], token, s.params.logprobs)
            outs.append(out)
            if not s.finished and s.num_tokens > self.max_seq:  # no cache room for the next one
                outs.append(Output(s, -1, s.finish("length", s.pending), "length"))
        for s in step.sampled:
            if s.finished:
                self.remove(s)
        return outs


def step_matchers(step: Step) -> list:
    """The grammar matcher (or None) of each row of the step's logits."""
    return [s.matcher for s in step.sampled]


# A step's block tables are at least this wide (zeros past a table's end, as for a shorter
# row's): a compiled step specializes a size of 1, and a table of one block would compile a
# second graph when its sequences reach a second block
MIN_TABLE_BLOCKS = 2


def make_step(rows: list[tuple[Sequence, int]]) -> Step:
    """A step of `n` new tokens of each (sequence, n): one-token rows first, then prompt chunks.
    Its arrays are numpy's (the in-process engine wraps them as tensors without a copy; the
    actor runtime's scheduler copies them into its channel without torch)."""
    rows = sorted(rows, key=lambda r: r[1] > 1)  # (stable)
    seqs, counts = [s for s, _ in rows], [n for _, n in rows]
    tokens, positions, sampled, last = [], [], [], []
    for s, n in rows:
        tokens += s.tokens[s.computed:s.computed + n]
        positions += range(s.computed, s.computed + n)
        if s.computed + n == s.num_tokens:
            sampled.append(s)
            last.append(len(tokens) - 1)
    width = max(MIN_TABLE_BLOCKS, *(len(s.blocks.table) for s in seqs))
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.blocks.table)] = s.blocks.table
    shape = (len(seqs), 1) if all(n == 1 for n in counts) else (1, len(tokens))
    starts = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    ints = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return Step(seqs, counts, ints(tokens).reshape(shape), ints(positions).reshape(shape),
                starts, tables, sampled, ints(last))


def context_length(args, config: Config) -> int:
    """Positions a sequence may reach: the model's context, or Config.max_seq_len below it."""
    return min(config.max_seq_len or args.max_seq_len, args.max_seq_len)


def new_sequence(prompt: list[int], params: SamplingParams, tokenizer: Tokenizer, vocab_size: int,
                 max_seq: int, max_seq_by: str = "Config.max_seq_len") -> Sequence:
    """A validated sequence; InvalidRequestError names what is wrong with the prompt (and what
    bounds the context: `max_seq_by`)."""
    if not prompt:
        raise InvalidRequestError("empty prompt")
    if len(prompt) >= max_seq:
        raise InvalidRequestError(f"prompt has {len(prompt)} tokens; the context holds "
                                  f"{max_seq} ({max_seq_by})")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} outside the vocabulary")
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    seq = Sequence(list(prompt), params, StreamDecoder(tokenizer), tokenizer.eog_ids, seed)
    if params.grammar is not None:  # compiled here: a grammar the engine refuses is the request's error
        seq.matcher = matcher(tokenizer, vocab_size, params.grammar)
    return seq


def sample_next(s: Sequence, logits: np.ndarray) -> tuple[int, str]:
    """Sample s's next token from its logits (vocab,); returns it and the text now final."""
    history = s.recent(s.params.repetition_window) if s.params.repetition_penalty != 1 else []
    generator = None if s.params.greedy else token_generator(s.seed, len(s.output))
    token = sample(logits, s.params, history, generator, s.output)
    return token, s.push(token)
