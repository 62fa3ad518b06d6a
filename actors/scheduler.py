"""Scheduler actor: the request queue and admission control, cancellation, and token streaming
back to callers, around the batching core the in-process engine runs too (`powerinfer.batching`:
continuous batching, KV slots, sampling and stop rules).

Each iteration runs the core's next step: a prefill of the waiting requests that got a free KV
slot (dense, batched, right-padded) or one decode step over every running sequence. Steps go
to the hot executor on `ctl` and logits come back on `out`; the loop runs in its own thread,
callers' streams are asyncio queues fed from it. A full queue answers "overloaded"; a
cancelled request frees its slot at the next iteration; a dead or failed executor ends every
request with a retryable error and stops the loop (the group is then rebuilt by its owner).

Stream items are lists of events (what arrived since the caller last read), each a dict:
{"text", "token", "finish_reason"} or {"error", "message", "retryable"}. A request's first token
event also has "queue_s" (its wait for a batch slot); with `SamplingParams.logprobs` set, token
events have "logprob" and "top_logprobs" ([(token, logprob)], most likely first).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from cluster.topology import pin_threads, process_memory

from powerinfer.config import Config, SamplingParams
from powerinfer import batching
from powerinfer.batching import Batcher, Output, Sequence, context_length, new_sequence
from powerinfer.errors import InvalidRequestError
from powerinfer.loader import ModelFile
from powerinfer.tokenizer import Tokenizer

from .group_info import node_id
from .channel import ChannelClosed, PeerDied
from .plane import DECODE, ERROR, PREFILL, STOP, PlaneSpec, Reply, Step, receive, send


@dataclass(eq=False)
class Request:
    id: str
    seq: Sequence
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)

    def emit(self, event: dict):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def fail(self, kind: str, message: str, retryable: bool):
        self.emit({"error": kind, "message": message, "retryable": retryable})


class GroupFailure(Exception):
    """An executor of the group died or failed: nothing more can run on this group."""


class Scheduler:
    def __init__(self, spec: PlaneSpec, model: ModelFile, tokenizer: Tokenizer, config: Config,
                 cores: tuple[int, ...] = (), spare: tuple[int, ...] = ()):
        # the driver's tokenizer and tensor table: this process never parses the model file
        self.tokenizer, self.cores = tokenizer, cores
        if spare:  # Ray's threads and the event loop that streams tokens out: off the hot core
            pin_threads(spare)
        self.spec, self.config, self.vocab = spec, config, model.args.vocab_size
        self.max_seq = min(context_length(model.args, config), spec.max_seq)
        self.ctl, self.out = spec.open("ctl", writer=True), spec.open("out")
        self.probe_slot = spec.batch - 1  # reserved for health probes
        self.batcher = Batcher(config.max_batch, self.max_seq)
        self.by_id: dict[str, Request] = {}  # waiting and running
        self.cv = threading.Condition()
        self.broken: str | None = None
        self.stopping = False
        self.counters = {"requests": 0, "finished": 0, "cancelled": 0, "rejected": 0,
                         "failed": 0, "tokens": 0, "prefill_steps": 0, "decode_steps": 0,
                         "decode_rows": 0, "prefill_s": 0.0, "decode_s": 0.0}
        self.done: asyncio.Future | None = None
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()

    async def ready(self) -> dict:
        return {"max_batch": self.config.max_batch, "max_queue": self.config.max_queue,
                "max_seq": self.max_seq, "pid": os.getpid(), "node_id": node_id()}

    async def run(self) -> str:
        """Returns when the loop ends: the owner's monitor learns of a failure this way."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.thread.join)
        return self.broken or "stopped"

    # ---- requests (event-loop side) ----
    async def generate(self, rid: str, prompt: list[int], params: SamplingParams,
                       probe: bool = False):
        loop = asyncio.get_running_loop()
        try:
            seq = new_sequence(prompt, params, self.tokenizer, self.vocab, self.max_seq)
        except InvalidRequestError as e:
            yield [{"error": "invalid_request", "message": str(e), "retryable": False}]
            return
        req = Request(rid, seq, asyncio.Queue(), loop)
        seq.key, seq.slot = req, self.probe_slot if probe else -1
        with self.cv:
            problem = self._admit_problem(rid, probe)
            if problem is None:
                self.by_id[rid] = req
                self.batcher.add(seq, front=probe)
                self.counters["requests"] += 1
                self.cv.notify()
        if problem is not None:
            yield [problem]
            return
        ended = False
        try:
            while not ended:
                batch = [await req.events.get()]
                while not req.events.empty():
                    batch.append(req.events.get_nowait())
                ended = any(e.get("finish_reason") or "error" in e for e in batch)
                yield batch
        finally:
            if not ended:  # the caller went away: free the slot
                self._cancel(rid)

    def _admit_problem(self, rid: str, probe: bool) -> dict | None:
        if self.broken:
            return {"error": "engine_failed", "retryable": True,
                    "message": f"the model's actor group failed ({self.broken}); it is being rebuilt"}
        if rid in self.by_id:
            return {"error": "invalid_request", "retryable": False,
                    "message": f"request id {rid!r} is already running"}
        # requests that arrived together wait here until the loop admits them to free slots
        queued = self.batcher.queued
        if not probe and queued >= self.config.max_queue:
            self.counters["rejected"] += 1
            return {"error": "overloaded", "retryable": True,
                    "message": f"overloaded: {queued} requests already wait for a batch slot "
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
        """One token through every actor of the group (probe slot, greedy)."""
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
            b = self.batcher
            c.update(waiting=len(b.waiting), running=len(b.running), broken=self.broken,
                     free_slots=len(b.free))
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
                with self.cv:
                    while self.batcher.idle and not self.stopping:
                        self.cv.wait()
                    if self.stopping:
                        break
                    self._drop_cancelled()
                    step = self.batcher.schedule()
                if step is None:
                    continue
                t0 = time.perf_counter()
                logits = self._run(step)
                with self.cv:
                    outs = self.batcher.postprocess(step, logits)
                self._emit(outs, t0)
                kind = "prefill" if step.prefill else "decode"
                self.counters[f"{kind}_steps"] += 1
                self.counters[f"{kind}_s"] += time.perf_counter() - t0
                self.counters["decode_rows"] += 0 if step.prefill else len(step.seqs)
            self.ctl.publish(STOP)
        except GroupFailure as e:
            self.broken = str(e)
            with self.cv:
                for r in self.by_id.values():  # every waiting and running request
                    r.fail("engine_failed", f"the model's actor group failed: {e}; it is being "
                           "rebuilt, send the request again", True)
                    self.counters["failed"] += 1
                self.by_id.clear()
                self.batcher = Batcher(self.config.max_batch, self.max_seq)

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
                if out.first:
                    event["queue_s"] = t0 - req.arrived
                if out.logprob is not None:
                    event["logprob"], event["top_logprobs"] = out.logprob, out.top_logprobs
                req.emit(event)
                self.counters["tokens"] += out.token >= 0
            if out.finish_reason:  # the output that ends its sequence
                self.counters["failed" if out.error else "finished"] += 1
                with self.cv:
                    self.by_id.pop(req.id, None)

    def _run(self, step: batching.Step) -> torch.Tensor:
        """The step on the hot executor; its logits (B, vocab), a view of `out`."""
        B, T = step.tokens.shape
        at = self.spec.ctl_layout(B, T)
        self.ctl.put(step.tokens, at.tokens)
        self.ctl.put(step.positions.contiguous(), at.positions)
        self.ctl.put(step.slots, at.slots)
        self.ctl.put(step.last, at.last)
        send(self.ctl, Step(PREFILL if step.prefill else DECODE, B, T, step.kv_len))
        try:
            reply = receive(self.out, Reply)
        except (PeerDied, ChannelClosed) as e:
            raise GroupFailure(f"hot executor: {e}") from None
        if reply.status == ERROR:
            text = bytes(self.out.view(torch.uint8, (reply.n,)).numpy())
            raise GroupFailure(text.decode(errors="replace"))
        return self.out.view(torch.float32, (B, self.vocab))
