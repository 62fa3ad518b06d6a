"""The engine handle: the narrow interface the Serve app and the Python API use (generate
stream, tokenize, health, stats), over one model's actor group, which it supervises.

When an actor of the group dies or fails (any of them, the scheduler included), a monitor
thread (or the failing request itself) tears the group down and starts a new one, and requests
that arrive meanwhile wait for it (up to NEW_WAIT_S; at once a retryable error if an attempt of
the rebuild has failed, as when the group's resources are gone). The requests in flight are not
lost: each one's prompt, its sampling parameters (with a seed fixed at the start, so that a
sampled request draws what it would have drawn) and the tokens its caller has had are kept, and
once the new group is up the request is sent again with those tokens to resume from: the
scheduler replays them, prefills prompt and tokens, and the stream goes on where it stopped. The
caller sees a pause; a request ends with a retryable `EngineFailedError` only if the rebuild fails
or takes longer than RESUME_WAIT_S. The caller's side of this is `actors.follow` (`follow` for
the async callers: `agenerate`, and the Serve ingress, which streams from the scheduler itself and
asks the model deployment for the group to resume on; `follow_sync` for the sync `generate`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from typing import AsyncIterator, Iterator

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster.topology import numa_resources
from powerinfer.compat import ray_init, trim_heap
from powerinfer.config import Config
from powerinfer.engine.params import SamplingParams
from powerinfer.engine.plan import log_input_sparsity
from powerinfer.errors import ConfigError, EngineFailedError

from .follow import Flight, follow, follow_sync, target
from .group import ActorGroup, wants_gpu
from .plane import SPIN_US
from .prepare import prepared

log = logging.getLogger("powerinfer")
REBUILD_WAIT_S = 300
RESUME_WAIT_S = 120  # a request in flight waits this long for the rebuilt group
NEW_WAIT_S = 30  # a new request waits this long (less than a client's usual timeout)

class ActorEngine:
    def __init__(self, model: str, config: Config, spin_us: float = SPIN_US):
        ray_init(resources=numa_resources())  # a local instance advertises the NUMA nodes
        # the configuration decided, the file's table, tokenizer and plan (`prepare`: in a task
        # where this process has no torch, as a served model's replica has not)
        done, table, stored_tokenizer, self.tokenizer = prepared(model, config, wants_gpu(config))
        self.config, self.args, self.path, self.plan = done.config, done.args, done.path, done.plan
        self.kv_blocks, self.max_seq, self.input_sparsity = done.kv_blocks, done.max_seq, \
            done.input_sparsity
        self._stored = {"model": table, "tokenizer": stored_tokenizer}  # to every group's actors
        self._spin = spin_us
        self.restarts, self.last_failure, self.rebuild_failures = 0, None, 0
        self._failures_before = 0  # rebuild_failures when the current rebuild began
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._closing = threading.Event()  # set once by shutdown(): wakes the monitor at once
        self.group = self._new_group()
        if self.input_sparsity is not None:  # what the executors took of the thresholds
            taken = [i.get("input_sparse", (0, 0)) for i in self.group.info.values()]
            for role, i in self.group.info.items():  # each size's timing (`attach`), per executor
                for line in i.get("input_timings", ()):
                    log.info("%s: %s", role, line)
            try:
                log_input_sparsity(self.input_sparsity, sum(t[0] for t in taken),
                                   sum(t[1] for t in taken), self.config, self.plan.inputs[1])
            except ConfigError:
                self.group.stop()
                raise
        trim_heap()  # the tokenizer's build and the table's parse, freed, stay resident otherwise
        self._ready.set()
        self._monitor = threading.Thread(target=self._watch, name="group-monitor", daemon=True)
        self._monitor.start()

    def _new_group(self, wait_for_resources: bool = True) -> ActorGroup:
        return ActorGroup(self.args, self._stored, self.config, self.plan, self.max_seq,
                          self.kv_blocks, self._spin).start(wait_for_resources)

    # ---- the interface ----
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos)

    def generate(self, prompt: list[int], params: SamplingParams,
                 request_id: str | None = None) -> Iterator[dict]:
        """Stream events ({"text", "token", "finish_reason"}) for one request; raises a
        PowerInferError subclass on failure (retryable ones carry `retryable = True`)."""
        f, at = self.open(prompt, params, request_id)
        # closed with this generator: a caller that stops early cancels the request at once
        with contextlib.closing(follow_sync(f, at, lambda failed, why: self.replacement(failed["id"], why))) as events:
            for batch in events:
                yield from batch

    async def agenerate(self, prompt: list[int], params: SamplingParams,
                        request_id: str | None = None) -> AsyncIterator[list[dict]]:
        """`generate` for asyncio callers, in lists of the events that arrived together (a
        caller that falls behind gets fewer, larger items)."""
        import asyncio
        loop = asyncio.get_running_loop()
        f, at = await loop.run_in_executor(None, self.open, prompt, params, request_id)

        async def replace(failed: dict, why: str) -> dict:
            return await loop.run_in_executor(None, self.replacement, failed["id"], why)

        async for events in follow(f, at, replace):
            yield events

    # ---- for a client that streams from the scheduler itself (the Serve ingress) ----
    def open(self, prompt: list[int], params: SamplingParams,
             request_id: str | None = None) -> tuple[Flight, dict]:
        """A request to follow (`follow`), and the target to stream it from."""
        return self._flight(prompt, params, request_id), target(self._group(NEW_WAIT_S))

    def replacement(self, failed: str, why: str) -> dict:
        """The target to resume on after the group whose scheduler is `failed` (an actor id)
        failed: this engine's new group if it was its own (the rebuild starts here if nobody
        noticed yet), else the serving one (it was another replica's, or is replaced already).
        The retryable EngineFailedError when there is none in time."""
        group = self.group
        scheduler = group.actors.get("scheduler")  # none once a rebuild has stopped the group
        if scheduler is not None and scheduler._actor_id.hex() == failed:
            self._rebuild(group, why)
        else:
            group = None
        return target(self._group(RESUME_WAIT_S, group))

    @staticmethod
    def _flight(prompt: list[int], params: SamplingParams, request_id: str | None) -> Flight:
        if not params.greedy and params.seed is None:  # drawn here: a resumed request keeps it
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        return Flight(request_id or uuid.uuid4().hex, list(prompt), params)

    @property
    def state(self) -> str:
        """"ready", "rebuilding" (requests wait for the new group) or "closed"."""
        if self._closed:
            return "closed"
        return "ready" if self._ready.is_set() else "rebuilding"

    def health(self, timeout: float = 30.0) -> dict:
        """A one-token probe through every actor of the group (the data path, not a ping)."""
        group = self._group()
        try:
            out = ray.get(group.scheduler.health.remote(timeout), timeout=timeout + 5)
        except (RayActorError, RayTaskError, ray.exceptions.GetTimeoutError) as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {**out, "restarts": self.restarts, "actors": len(group.actors)}

    def stats(self) -> dict:
        group = self._group()
        return {"restarts": self.restarts, "last_failure": self.last_failure,
                "cores": group.cores.describe() if group.cores else None,
                "pids": {name: info.get("pid") for name, info in group.info.items()},
                "nodes": {name: info.get("node_id") for name, info in group.info.items()},
                "isa": {name: info["isa"] for name, info in group.info.items() if "isa" in info},
                "actors": group.stats()}

    def input_sparsity_stats(self) -> tuple[int, int]:
        """Input sparsity so far in the executors' decode steps: (input channels kept, channels
        seen) over every sparse projection they hold; (0, 0) where it is off."""
        kept = seen = 0
        for s in self._group().stats().values():
            k, n = s.get("input_sparse_stats", (0, 0))
            kept, seen = kept + k, seen + n
        return kept, seen

    def memory(self) -> dict:
        """What the model's group costs in host memory, from each actor's own report: per
        process its proportional set size (`pss`: a page shared between processes, a mapped
        file's or a library's, divided among them; its resident size where /proc does not say)
        and what it holds of the model in host memory, the weights and the KV cache's blocks
        (`host_parts`); the rest of a process is its own cost (Python, torch, Ray's worker)."""
        out = {}
        for name, s in self._group().stats().items():
            if "memory" in s:
                out[name] = {"pss": s["memory"]["pss"],
                             **{k: s.get(f"{k}_bytes", 0) for k in ("weight", "kv")},
                             **{f"{k}_resident": s.get(f"{k}_resident", 0) for k in ("weight", "kv")}}
        return out

    def shutdown(self):
        """Stop the group (after a rebuild in progress, so that it leaves nothing behind)."""
        self._ready.wait(REBUILD_WAIT_S)
        with self._lock:
            self._closing.set()
        # the monitor is gone before this returns: a caller may shut Ray down next, and a call
        # into Ray's worker during or after its shutdown ends the whole process (from its C++)
        if threading.current_thread() is not self._monitor:
            self._monitor.join()
        with self._lock:
            self.group.stop()

    @property
    def _closed(self) -> bool:
        return self._closing.is_set()

    # ---- supervision ----
    def _group(self, wait_s: float = REBUILD_WAIT_S, failed: ActorGroup | None = None
               ) -> ActorGroup:
        """The serving group (not `failed`: the one that replaces it); during a rebuild, waits
        up to wait_s for the new one, and gives up at once when an attempt of this rebuild has
        failed (say, its resources are gone: a request would otherwise wait on a group that
        may never come)."""
        deadline = time.monotonic() + wait_s
        while not (self._ready.wait(0.2) and self.group is not failed):
            if self._closed:
                break
            if self.rebuild_failures > self._failures_before:
                raise EngineFailedError(f"the model's actor group could not be rebuilt "
                                        f"({self.last_failure}); it is retried, send the "
                                        "request again later")
            if time.monotonic() > deadline:
                raise EngineFailedError(f"the model's actor group is being rebuilt "
                                        f"({self.last_failure}) and was not up within "
                                        f"{wait_s:g} s; send the request again shortly")
        if self._closed:
            raise EngineFailedError("the engine was shut down")
        return self.group

    def _rebuild(self, broken: ActorGroup, why: str):
        """Replace `broken` (once, whoever notices first) in a background thread."""
        with self._lock:
            if broken is not self.group or not self._ready.is_set() or self._closed:
                return
            self._ready.clear()
            self.last_failure, self._failures_before = broken.name_failure(why), self.rebuild_failures
        threading.Thread(target=self._replace, args=(broken,), daemon=True).start()

    def _replace(self, broken: ActorGroup):
        broken.stop()
        while True:
            try:
                group = self._new_group(wait_for_resources=False)
                break
            except Exception as e:  # noqa: BLE001 - keep trying; new requests wait meanwhile
                failure = f"rebuild failed: {type(e).__name__}: {e}"
                if failure != self.last_failure:  # (each new reason once, not every 2 s)
                    log.warning("%s; retried every 2 s", failure)
                self.last_failure = failure
                self.rebuild_failures += 1  # the requests waiting to resume give up
                time.sleep(2)
        log.info("the model's actor group is rebuilt (%d rebuild attempts failed before)",
                 self.rebuild_failures - self._failures_before)
        with self._lock:
            self.group = group
            self.restarts += 1
            self._ready.set()
            if self._closed:
                group.stop()

    def _watch(self):
        while not self._closing.wait(0.5):
            # the caller shut Ray down under an engine it did not close: a call into Ray's worker
            # after its shutdown ends the whole process (exit 1, from Ray's C++), so stop here
            if self._closed or not ray.is_initialized():
                return
            group = self.group
            try:
                why = group.broken() if self._ready.is_set() else None
            except Exception as e:  # noqa: BLE001 - the monitor must outlive any one check
                why = f"the group could not be checked: {type(e).__name__}: {e}"
            if why:
                self._rebuild(group, why)
