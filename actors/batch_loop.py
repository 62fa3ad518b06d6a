"""The scheduler actor's work (`actors.scheduler.Scheduler` is what Ray sees): the request queue and
admission control, cancellation, and token streaming back to callers, around the batching core the
in-process engine runs too (`powerinfer.engine.batching`: continuous batching over the paged KV
cache, prefix caching, chunked prefill, sampling and stop rules). It holds the pool's bookkeeping
(`powerinfer.engine.kv`); the executors hold the blocks.

Each iteration runs the core's next step: every running sequence's next token or prompt chunk,
and the waiting requests that fit. Steps go to the hot executor on `ctl` and logits come back
on `out`; the loop runs in its own thread, callers' streams are asyncio queues fed from it. A
full queue answers "overloaded"; a cancelled request frees its blocks at the next iteration; a
dead or failed executor ends every request with a retryable error that says how far it got
(its owner resumes it on the rebuilt group, `actors.handle`) and stops the loop.

Stream items are lists of events (what arrived since the caller last read), each a dict:
{"text", "token", "finish_reason"} or {"error", "message", "retryable"}. A request's first token
event also has "queue_s" (its wait to be admitted) and "cached_tokens" (prompt tokens found in
the prefix cache); its last, where input sparsity skipped channels in its decode steps,
"input_sparsity" ({"kept", "seen"}: the input channels the hot executor's projections read and
had); with `SamplingParams.logprobs` set, token events have "logprob" and
"top_logprobs" ([(token, logprob)], most likely first). A request may bring `resume`, tokens it
was sampled before on a group that failed: they are replayed (not sent again) and prefilled with
its prompt, and the stream goes on from there.

No torch here: the step's arrays, the logits and the sampling are numpy's, so the scheduler's
process costs a model none of torch's import time and memory (`tests/test_layers.py`).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from cluster.topology import pin_threads, process_memory

from powerinfer.compat import HeapTrim, trim_heap
from powerinfer.config import Config
from powerinfer.engine.params import SamplingParams
from powerinfer.engine import batching
from powerinfer.engine import grammar
from powerinfer.engine.batching import Batcher, Output, Sequence, new_sequence, step_matchers
from powerinfer.errors import InvalidRequestError
from powerinfer.engine.kv import BlockManager, Blocks
from powerinfer.formats.tokenizer import Tokenizer

from .group_info import node_id
from .channel import ChannelClosed, PeerDied
from .plane import DECODE, ERROR, PREFILL, STOP, PlaneSpec, Reply, Step, receive, send
from .tokens import TokenRing, ends


@dataclass(eq=False)
class Request:
    id: str
    seq: Sequence
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    ring: TokenRing | None = None  # a caller on this node reads the events there
    # input sparsity: the input channels its decode steps' sparse projections kept and saw (the
    # hot executor's count, one-row steps: a batch's rows stay dense)
    kept: int = 0
    seen: int = 0

    def emit(self, event: dict):
        if self.ring is not None and self.ring.append(event):
            if ends(event):  # the stream's end, for the Ray call to return
                self.loop.call_soon_threadsafe(self.events.put_nowait, None)
            return
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def fail(self, kind: str, message: str, retryable: bool):
        self.emit({"error": kind, "message": message, "retryable": retryable})


class Later:
    """A value computed once, when first asked for."""

    def __init__(self, make):
        self._make, self._done, self._value = make, False, None

    def value(self):
        if not self._done:
            self._value, self._done = self._make(), True
        return self._value


class GroupFailure(Exception):
    """An executor of the group died or failed: nothing more can run on this group."""


class BatchLoop:
    def __init__(self, spec: PlaneSpec, vocab: int, tokenizer: Tokenizer, config: Config,
                 cores: tuple[int, ...] = (), spare: tuple[int, ...] = (), sparse: bool = False):
        # sparse: decode rows compute their predicted neurons only: steps mixing them with
        # prompt chunks run as two (`batching.Step.parts`)
        # the driver's tokenizer and the vocabulary's size: this process never parses the
        # model file, and never imports torch (its steps and logits are numpy arrays)
        self.tokenizer, self.cores, self.sparse = tokenizer, cores, sparse
        if spare:  # Ray's threads and the event loop that streams tokens out: off the hot core
            pin_threads(spare)
        self.spec, self.config, self.vocab = spec, config, vocab
        self.max_seq = spec.max_seq
        self.ctl, self.out = spec.open("ctl", writer=True), spec.open("out")
        self.probe_block = spec.num_blocks - 1  # reserved for health probes
        self.blocks = BlockManager(spec.num_blocks - 1, spec.block_size, config.prefix_cache)
        self.batcher = Batcher(self.blocks, config.max_batch, self.max_seq, config.prefill_chunk,
                               sparse, config.prefill_pace)
        self.by_id: dict[str, Request] = {}  # waiting and running
        self.cv = threading.Condition()
        self.broken: str | None = None
        self.stopping = False
        self.counters = {"requests": 0, "ring_requests": 0, "finished": 0, "cancelled": 0,
                         "rejected": 0, "failed": 0, "tokens": 0, "prefill_steps": 0,
                         "decode_steps": 0, "decode_rows": 0, "widest_decode": 0, "prefill_tokens": 0,
                         "prefill_s": 0.0, "decode_s": 0.0}
        self.done: asyncio.Future | None = None
        # the tokenizer's unpickling leaves its parse's buffers freed but resident (Gemma 3's
        # 262,144 pieces and 513,511 merges: about 220 MiB): given back
        trim_heap()
        self.heap = HeapTrim()  # a burst's freed heap, given back when the loop goes idle
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()

    async def ready(self) -> dict:
        return {"max_batch": self.config.max_batch, "max_queue": self.config.max_queue,
                "max_seq": self.max_seq, "blocks": self.blocks.num_blocks, "pid": os.getpid(),
                "node_id": node_id()}

    async def run(self) -> str:
        """Returns when the loop ends: the owner's monitor learns of a failure this way."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.thread.join)
        return self.broken or "stopped"

    # ---- requests (event-loop side) ----
    async def generate(self, rid: str, prompt: list[int], params: SamplingParams,
                       probe: bool = False, resume: list[int] | None = None,
                       ring: str | None = None):
        # ring: a caller on this node reads the events from that `TokenRing` (this stream then
        # yields only what the ring could not hold) and the call returns when the request ends
        loop = asyncio.get_running_loop()
        out = None
        try:
            out = TokenRing.open(ring) if ring else None
        except (OSError, ValueError) as e:  # (the caller learns it here: the call ends)
            yield [{"error": "invalid_request", "message": f"token ring: {e}", "retryable": False}]
            return
        try:
            if params.grammar is None:
                seq = new_sequence(prompt, params, self.tokenizer, self.vocab, self.max_seq)
            else:  # compiling a grammar (and, once, the tokenizer's index) takes a while
                seq = await loop.run_in_executor(None, new_sequence, prompt, params,
                                                 self.tokenizer, self.vocab, self.max_seq)
            if resume:
                seq.replay(resume)
                if seq.finished or seq.num_tokens > self.max_seq:
                    raise InvalidRequestError("a resumed request had already ended")
        except InvalidRequestError as e:
            problem = {"error": "invalid_request", "message": str(e), "retryable": False,
                       "param": e.param}
            if out is None or not out.append(problem):
                yield [problem]
            return
        req = Request(rid, seq, asyncio.Queue(), loop, ring=out)
        seq.key = req
        if probe:  # its own block, outside the pool: a probe is admitted even when it is full
            seq.blocks = Blocks([self.probe_block], reserved=True)
        with self.cv:
            problem = self._admit_problem(rid, probe or bool(resume))
            if problem is None:
                self.by_id[rid] = req
                self.batcher.add(seq, front=probe)
                self.counters["requests"] += 1
                self.counters["ring_requests"] += out is not None
                self.cv.notify()
        if problem is not None:
            if out is None or not out.append(problem):
                yield [problem]
            return
        ended = False
        try:
            while not ended:
                batch = [await req.events.get()]
                while not req.events.empty():
                    batch.append(req.events.get_nowait())
                ended = any(e is None or ends(e) for e in batch)  # None: it ended in the ring
                batch = [e for e in batch if e is not None]
                if batch:
                    yield batch
        finally:
            if not ended:  # the caller went away: free the slot
                self._cancel(rid)

    def _admit_problem(self, rid: str, exempt: bool) -> dict | None:
        # exempt from the queue's bound: health probes, and requests resumed after a failure
        # (admitted once already: they are not new load)
        if self.broken:
            return {"error": "engine_failed", "retryable": True,
                    "message": f"the model's actor group failed ({self.broken}); it is being rebuilt"}
        if rid in self.by_id:
            return {"error": "invalid_request", "retryable": False,
                    "message": f"request id {rid!r} is already running"}
        # requests that arrived together wait here until the loop admits them
        queued = self.batcher.queued
        if not exempt and queued >= self.config.max_queue:
            self.counters["rejected"] += 1
            return {"error": "overloaded", "retryable": True,
                    "message": f"overloaded: {queued} requests already wait to be admitted "
                               f"(Config.max_queue={self.config.max_queue})"}
        return None

    async def cancel(self, rid: str) -> bool:
        return self._cancel(rid)

    def _cancel(self, rid: str) -> bool:
        with self.cv:
            req = self.by_id.get(rid)
            if req is None:
                return False
            req.cancelled = True
            self.cv.notify()
            return True

    async def health(self, timeout: float = 30.0) -> dict:
        """One token through every actor of the group (the probe's own block, greedy)."""
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        events = []
        gen = self.generate(f"health-{time.monotonic_ns()}", [self.tokenizer.bos_id or 0], params,
                            probe=True)
        async with asyncio.timeout(timeout):
            async for batch in gen:
                events += batch
        err = next((e for e in events if "error" in e), None)
        return {"ok": err is None and any(e.get("token", -1) >= 0 for e in events),
                "latency_ms": (time.perf_counter() - t0) * 1e3,
                **({"error": err["message"]} if err else {})}

    async def stats(self) -> dict:
        with self.cv:
            c = dict(self.counters)
            b, kv = self.batcher, self.blocks
            # requests only: a health probe is counted apart, so that a server at rest reads 0
            # running whatever its probes do
            c.update(waiting=b.waiting_requests, running=b.running_requests, probes=b.probes,
                     broken=self.broken,
                     preemptions=b.preemptions, kv_blocks=kv.num_blocks,
                     kv_blocks_free=kv.available, kv_usage=kv.usage,
                     prefix_queries=kv.queries, prefix_hits=kv.hits)
        steps = c["decode_steps"]
        c["decode_ms_per_step"] = c["decode_s"] / steps * 1e3 if steps else 0.0
        c["mean_batch"] = c["decode_rows"] / steps if steps else 0.0
        c["memory"] = process_memory()
        return c

    async def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 10)

    # ---- the loop (its own thread): schedule, run, postprocess ----
    def _loop(self):
        # the loop thread (not Ray's threads of this process) shares the hot executor's cores:
        # the two take turns, lockstep, so neither waits for the other's core to come free
        if self.cores:
            os.sched_setaffinity(0, self.cores)
        try:
            while True:
                if self.batcher.idle:  # (a hint, read unlocked) no step to run: nothing waits on
                    self.heap(idle=True)  # the trim
                with self.cv:
                    while self.batcher.idle and not self.stopping:
                        self.cv.wait()
                    if self.stopping:
                        break
                    self._drop_cancelled()
                    step = self.batcher.schedule()
                if step is None:  # nothing admissible now (no room): wait for a change
                    with self.cv:
                        self.cv.wait(0.01)
                    continue
                t0 = time.perf_counter()
                parts = step.parts(self.sparse)
                # grammar masks of the step's constrained rows, computed while it runs
                masks = Later(lambda: grammar.masks(step_matchers(step), self.vocab))
                logits = self._run(parts[0], masks) if len(parts) == 1 else \
                    np.concatenate([self._run(p, masks).copy() for p in parts])
                with self.cv:
                    outs = self.batcher.postprocess(step, logits, masks.value())
                self._emit(outs, t0)
                kind, took = "decode" if step.decode else "prefill", time.perf_counter() - t0
                self.batcher.observe(step, took)
                self.counters[f"{kind}_steps"] += 1
                self.counters[f"{kind}_s"] += took
                self.counters["decode_rows"] += len(step.seqs) if step.decode else 0
                if step.decode:  # (the most rows one decode step ran)
                    self.counters["widest_decode"] = max(self.counters["widest_decode"], len(step.seqs))
                self.counters["prefill_tokens"] += step.prefill_tokens
            self.ctl.publish(STOP)
        except GroupFailure as e:
            self.broken = str(e)
            with self.cv:
                for r in self.by_id.values():  # every waiting and running request
                    r.fail("engine_failed", f"the model's actor group failed: {e}; it is being "
                           "rebuilt, send the request again", True)
                    self.counters["failed"] += 1
                self.by_id.clear()

    def _drop_cancelled(self):
        for req in [r for r in self.by_id.values() if r.cancelled]:
            if self.batcher.remove(req.seq):
                req.emit({"text": "", "token": -1, "finish_reason": "cancelled"})
                self.counters["cancelled"] += 1
            del self.by_id[req.id]

    def _emit(self, outs: list[Output], t0: float):
        for out in outs:
            req: Request = out.seq.key
            if out.error:
                req.fail("invalid_request", out.error, False)
            else:
                event = {"text": out.text, "token": out.token, "finish_reason": out.finish_reason}
                if out.finish_reason and req.seen:
                    event["input_sparsity"] = {"kept": req.kept, "seen": req.seen}
                if out.first:
                    event["queue_s"] = t0 - req.arrived
                    event["cached_tokens"] = out.seq.cached
                if out.logprob is not None:
                    event["logprob"], event["top_logprobs"] = out.logprob, out.top_logprobs
                req.emit(event)
                self.counters["tokens"] += out.token >= 0
            if out.finish_reason:  # the output that ends its sequence
                self.counters["failed" if out.error else "finished"] += 1
                with self.cv:
                    self.by_id.pop(req.id, None)

    def _run(self, step: batching.Step, meanwhile: "Later") -> np.ndarray:
        """The step on the hot executor; its logits (K, vocab), a view of `out`. `meanwhile`
        is done while the executors compute."""
        B, T = step.tokens.shape
        (S, M), K = step.tables.shape, len(step.sampled)
        at = self.spec.ctl_layout(B * T, S, M)
        self.ctl.put(step.tokens, at.tokens)
        self.ctl.put(step.positions, at.positions)
        self.ctl.put(step.starts, at.starts)
        self.ctl.put(step.tables, at.tables)
        self.ctl.put(step.last, at.last)
        send(self.ctl, Step(DECODE if step.decode else PREFILL, B, T, S, M, K))
        meanwhile.value()
        try:
            reply = receive(self.out, Reply)
        except (PeerDied, ChannelClosed) as e:
            raise GroupFailure(f"hot executor: {e}") from None
        if reply.status == ERROR:
            text = bytes(self.out.array(np.uint8, (reply.n,)))
            raise GroupFailure(text.decode(errors="replace"))
        if reply.seen and step.decode and len(step.seqs) == 1:  # (only one-row steps skip channels)
            req = step.seqs[0].key
            req.kept, req.seen = req.kept + reply.kept, req.seen + reply.seen
        return self.out.array(np.float32, (K, self.vocab))
