"""A caller's side of a request on an actor group (`follow`, `follow_sync`): the scheduler's
stream read, from a `TokenRing` on the scheduler's node or from Ray's stream elsewhere, and the
request resumed on the group that replaces a failed one. Kept apart from the engine handle, with
nothing of the engine behind it, so that the Serve ingress, which streams from the scheduler
itself, runs it without torch.

A request is resumed once per failure of the group it runs on, at most MAX_RESUMES times. One
attempt's bookkeeping (`_Attempt`) does this for every caller, in the two loops."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator

import ray
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError

from powerinfer.engine.params import SamplingParams
from powerinfer.errors import EngineFailedError, InvalidRequestError, OverloadedError, PowerInferError

from .tokens import TokenRing

if TYPE_CHECKING:
    from .group import ActorGroup

log = logging.getLogger("powerinfer")
ERRORS = {"overloaded": OverloadedError, "engine_failed": EngineFailedError,
          "invalid_request": InvalidRequestError}
MAX_RESUMES = 3  # a request that fails every group it runs on is not resumed forever
# a caller on the scheduler's node reads its events from a `TokenRing`; POWERINFER_TOKEN_RING=0
# reads them from Ray's stream, as a caller on another node does (a comparison)
TOKEN_RING = os.environ.get("POWERINFER_TOKEN_RING", "1") != "0"


@dataclasses.dataclass(eq=False)
class Flight:
    """One request in flight: what it needs to go on after its group fails."""
    rid: str
    prompt: list[int]
    params: SamplingParams
    sent: list[int] = dataclasses.field(default_factory=list)  # the tokens its caller has had
    resumes: int = 0

    def took(self, ev: dict):
        if ev["token"] >= 0:
            self.sent.append(ev["token"])

    def resumed(self):
        """Counts a resume; the retryable error once the request has failed too many groups."""
        self.resumes += 1
        if self.resumes > MAX_RESUMES:
            raise EngineFailedError(f"the request failed {self.resumes} groups in a row; send "
                                    "it again later")
        log.info("request %s resumes after %d tokens", self.rid, len(self.sent))


def target(group: ActorGroup) -> dict:
    """What a client streaming from a group's scheduler itself needs: the scheduler, its actor
    id, which names the group when the client reports it failed, and its node."""
    scheduler = group.actors["scheduler"]
    return {"scheduler": scheduler, "id": scheduler._actor_id.hex(),
            "node": group.info.get("scheduler", {}).get("node_id")}


class _Attempt:
    """One attempt of request f on the group at `at` (`target`), around the reading of its
    scheduler's stream (`follow`, `follow_sync`): `received` takes each list of events (the
    request's own error event is raised, as a PowerInferError, and ends it); the group's failure
    is kept as `why` and leaves the block quietly (the request is to be resumed, counted on f);
    a caller that stops reading before the end cancels the request. On the scheduler's node the
    attempt holds the request's `TokenRing` (`ring`, else None), closed when the block ends."""

    def __init__(self, f: Flight, at: dict):
        self.f, self.at, self.ended, self.why = f, at, False, None
        self.ring: TokenRing | None = None

    def stream(self):
        f, ring = self.f, self.ring
        return self.at["scheduler"].generate.remote(f.rid, f.prompt, f.params, resume=f.sent or None,
                                                    ring=None if ring is None else str(ring.path))

    def received(self, events: list[dict]) -> Iterator[list[dict]]:
        """The caller's lists of one list of events read: the list, its tokens counted on f. An
        error event is raised after the events before it, which go to the caller first: the
        scheduler reports its group's failure in the same list as the tokens it sampled just
        before (its ring's reader or Ray's stream join them), and the request resumes after
        those, which its caller must have had."""
        for k, ev in enumerate(events):
            if "error" in ev:
                self.ended = True  # (an error event ends the request on the scheduler too)
                if k:
                    yield events[:k]
                kind = ERRORS.get(ev["error"], PowerInferError)
                if kind is InvalidRequestError:  # (the request's field at fault, where named)
                    raise kind(ev["message"], param=ev.get("param"))
                raise kind(ev["message"])
            self.f.took(ev)
        self.ended = any(ev["finish_reason"] for ev in events)
        yield events

    def __enter__(self) -> "_Attempt":
        self.ring = TokenRing.create() if _local(self.at) else None
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if self.ring is not None:
            self.ring.close()
        if kind is None:  # the stream ended
            return False
        if issubclass(kind, EngineFailedError):
            self.why = str(e)
        # the caller's own call cancelled (a client hung up; Ray cancels the scheduler's stream
        # with it) is not a failure of the group
        elif issubclass(kind, (RayActorError, RayTaskError)) and not issubclass(kind, TaskCancelledError):
            self.ended, self.why = True, f"an actor of the model's group died ({kind.__name__})"
        if not self.ended:  # the caller stopped reading before the end
            self.at["scheduler"].cancel.remote(self.f.rid)
        if self.why is None:
            return False
        self.f.resumed()
        return True


async def follow(f: Flight, at: dict, replace, interval: float = 0.0) -> AsyncIterator[list[dict]]:
    """The events of request f, in the lists its scheduler sends them in, from the target `at`
    (`target`), and after its group fails (an actor died, or the scheduler reports the group
    broken) from the target `await replace(at, why)` gives, resumed where they stopped: the
    request is sent again with the tokens its caller has had. A caller that stops reading before
    the end cancels the request. The request's own errors end it, as PowerInferErrors; a
    failure of the group ends it only when it cannot be resumed (a retryable error). On the
    scheduler's node the events come through a `TokenRing` (Ray's stream carries what the ring
    could not hold, and the failures); elsewhere through Ray's stream. `interval` (seconds): the
    ring's reader sends a list on at most once per interval (`TokenRing.events`), asleep between
    them; Ray's stream is not gathered here (the caller does it)."""
    while True:
        with _Attempt(f, at) as attempt:
            stream = attempt.stream()
            if attempt.ring is not None:
                async for events in _ring_events(attempt.ring, stream, interval):
                    for got in attempt.received(events):
                        yield got
                if attempt.ended:
                    return
            async for ref in stream:
                for got in attempt.received(await ref):
                    yield got
            return
        at = await replace(at, attempt.why)


async def _ring_events(ring: TokenRing, stream, interval: float = 0.0) -> AsyncIterator[list[dict]]:
    """`ring.events` for an event loop: a thread sleeps on the ring and hands each list over.
    It stops when the events end, when the call ends first, or when this reader stops."""
    import asyncio

    loop, got = asyncio.get_running_loop(), asyncio.Queue()
    stop, ended = threading.Event(), _call_ended(stream)

    def finished() -> bool:
        return stop.is_set() or ended()

    def read():
        try:
            for events in ring.events(finished, interval):
                loop.call_soon_threadsafe(got.put_nowait, events)
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            loop.call_soon_threadsafe(got.put_nowait, e)
        finally:
            loop.call_soon_threadsafe(got.put_nowait, None)

    threading.Thread(target=read, name="token-ring", daemon=True).start()
    try:
        while (item := await got.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def follow_sync(f: Flight, at: dict, replace) -> Iterator[list[dict]]:
    """`follow` for a caller without an event loop, `replace(at, why)` a plain call, the events
    read in this thread (the ring's) or through Ray's blocking generator. Driving the
    async loop an item at a time instead cost the caller's process 1.3 ms of CPU a token against
    0.7 (one SmolLM2 stream on 2 cores, where that time comes out of the executors' cores)."""
    while True:
        with _Attempt(f, at) as attempt:
            stream = attempt.stream()
            if attempt.ring is not None:
                for events in attempt.ring.events(_call_ended(stream)):
                    yield from attempt.received(events)
                if attempt.ended:
                    return
            for ref in stream:
                yield from attempt.received(ray.get(ref))
            return
        at = replace(at, attempt.why)


def _node() -> str | None:
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _local(at: dict) -> bool:
    """Whether this caller reads the events of a request to target `at` from a token ring."""
    return TOKEN_RING and at.get("node") == _node()


def _call_ended(stream) -> Callable[[], bool]:
    """Whether the scheduler's call behind `stream` has returned (or failed), asked at once."""
    done = stream.completed()
    return lambda: bool(ray.wait([done], timeout=0)[0])
