"""The engine handle: the narrow interface the Serve app and the Python API use (generate
stream, tokenize, health, stats), over one model's actor group, which it supervises.

When an actor of the group dies or fails, the requests it was serving end with a retryable
`EngineFailedError`; a monitor thread (or the failing request itself) tears the group down and
starts a new one, and requests that arrive meanwhile wait for it.
"""
from __future__ import annotations

import contextlib
import threading
import time
import types
import uuid
from typing import AsyncIterator, Iterator

import ray
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError

from cluster.topology import numa_resources
from powerinfer.compat import ray_init
from powerinfer.config import Config, SamplingParams
from powerinfer.batching import context_length
from powerinfer.errors import (EngineFailedError, InvalidRequestError, OverloadedError,
                               PowerInferError)
from powerinfer.convert import kernel_ready
from powerinfer.loader import load_checkpoint
from powerinfer.budget import plan_for
from powerinfer.plan import SparsePlan
from powerinfer.quant import has_q4
from powerinfer.tokenizer import Tokenizer

from .group import ActorGroup, wants_gpu
from .plane import SPIN_US

ERRORS = {"overloaded": OverloadedError, "engine_failed": EngineFailedError,
          "invalid_request": InvalidRequestError}
REBUILD_WAIT_S = 300


def _cancel(group: ActorGroup, rid: str):
    """Tell the scheduler the caller went away; nothing to do if the group is gone."""
    scheduler = group.actors.get("scheduler")
    if scheduler is not None:
        scheduler.cancel.remote(rid)


class ActorEngine:
    def __init__(self, model: str, config: Config, spin_us: float = SPIN_US):
        # block types the CPU kernel cannot read (K-quants): a converted copy, made once
        ckpt = kernel_ready(load_checkpoint(model, with_weights=False), config)
        config = config.resolve(has_q4(ckpt.info))  # every actor gets the decided configuration
        self.tokenizer = Tokenizer.from_source(ckpt.tokenizer_source)
        self.args, self.config, self.path = ckpt.args, config, ckpt.path
        self.model = ckpt.model_file()  # parsed once here; the executors read through it
        self.max_seq = context_length(ckpt.args, config)
        ray_init(resources=numa_resources())  # a local instance advertises the NUMA nodes
        self.plan = (plan_for(config, ckpt.args, ckpt.path, self.max_seq, wants_gpu(config))
                     or SparsePlan.dense(ckpt.args))
        self._spin = spin_us
        self.restarts, self.last_failure = 0, None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._closed = False
        self.group = self._new_group()
        self._ready.set()
        self._monitor = threading.Thread(target=self._watch, name="group-monitor", daemon=True)
        self._monitor.start()

    def _new_group(self) -> ActorGroup:
        return ActorGroup(self.model, self.tokenizer, self.config, self.plan, self.max_seq,
                          self._spin).start()

    # ---- the interface ----
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos)

    def generate(self, prompt: list[int], params: SamplingParams,
                 request_id: str | None = None) -> Iterator[dict]:
        """Stream events ({"text", "token", "finish_reason"}) for one request; raises a
        PowerInferError subclass on failure (retryable ones carry `retryable = True`)."""
        group, rid = self._group(), request_id or uuid.uuid4().hex
        with self._request(group, rid) as req:
            for ref in group.scheduler.generate.remote(rid, list(prompt), params):
                for ev in self._events(group, ray.get(ref)):
                    req.ended = req.ended or bool(ev["finish_reason"])
                    yield ev

    async def agenerate(self, prompt: list[int], params: SamplingParams,
                        request_id: str | None = None) -> AsyncIterator[list[dict]]:
        """`generate` for asyncio callers (the Serve app), in lists of the events that arrived
        together (a caller that falls behind gets fewer, larger items)."""
        import asyncio
        group = await asyncio.get_running_loop().run_in_executor(None, self._group)
        rid = request_id or uuid.uuid4().hex
        with self._request(group, rid) as req:
            async for ref in group.scheduler.generate.remote(rid, list(prompt), params):
                events = list(self._events(group, await ref))
                req.ended = req.ended or any(ev["finish_reason"] for ev in events)
                yield events

    @contextlib.contextmanager
    def _request(self, group: ActorGroup, rid: str):
        """Around one request's stream: errors the stream reports end it; an actor's death
        becomes a retryable EngineFailedError (and a rebuild); a caller that stops reading
        before the end cancels the request."""
        req = types.SimpleNamespace(ended=False)
        try:
            yield req
            req.ended = True
        except PowerInferError:
            req.ended = True
            raise
        except TaskCancelledError:  # the caller's own call was cancelled (a client hung up;
            raise  # Ray cancels the scheduler's stream with it): not a failure of the group
        except (RayActorError, RayTaskError) as e:
            req.ended = True
            raise self._failed(group, e) from None
        finally:
            if not req.ended:
                _cancel(group, rid)

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
                "actors": group.stats()}

    def shutdown(self):
        """Stop the group (after a rebuild in progress, so that it leaves nothing behind)."""
        self._ready.wait(REBUILD_WAIT_S)
        with self._lock:
            self._closed = True
            self.group.stop()

    # ---- supervision ----
    def _events(self, group: ActorGroup, batch: list[dict]) -> Iterator[dict]:
        for ev in batch:
            if "error" in ev:
                err = ERRORS.get(ev["error"], PowerInferError)(ev["message"])
                if ev["error"] == "engine_failed":
                    self._rebuild(group, ev["message"])
                raise err
            yield ev

    def _failed(self, group: ActorGroup, e: Exception) -> EngineFailedError:
        msg = f"an actor of the model's group died ({type(e).__name__})"
        self._rebuild(group, msg)
        return EngineFailedError(f"{msg}; the group is being rebuilt, send the request again")

    def _group(self) -> ActorGroup:
        if not self._ready.wait(REBUILD_WAIT_S):
            raise EngineFailedError("the model's actor group is still being rebuilt")
        if self._closed:
            raise EngineFailedError("the engine was shut down")
        return self.group

    def _rebuild(self, broken: ActorGroup, why: str):
        """Replace `broken` (once, whoever notices first) in a background thread."""
        with self._lock:
            if broken is not self.group or not self._ready.is_set() or self._closed:
                return
            self._ready.clear()
            self.last_failure = why
        threading.Thread(target=self._replace, args=(broken,), daemon=True).start()

    def _replace(self, broken: ActorGroup):
        broken.stop()
        while True:
            try:
                group = self._new_group()
                break
            except Exception as e:  # noqa: BLE001 - keep trying; requests wait meanwhile
                self.last_failure = f"rebuild failed: {type(e).__name__}: {e}"
                time.sleep(2)
        with self._lock:
            self.group = group
            self.restarts += 1
            self._ready.set()
            if self._closed:
                group.stop()

    def _watch(self):
        while not self._closed:
            time.sleep(0.5)
            group = self.group
            try:
                why = group.broken() if self._ready.is_set() else None
            except Exception as e:  # noqa: BLE001 - the monitor must outlive any one check
                why = f"the group could not be checked: {type(e).__name__}: {e}"
            if why:
                self._rebuild(group, why)
