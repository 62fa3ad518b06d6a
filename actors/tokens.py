"""A request's events from the scheduler to a caller on the same node, through shared memory.

Through Ray, each stream item a scheduler yields costs it a wake-up of its event loop, a hop to
the thread pool that reports the item, and the report itself; the caller pays the receipt and a
deserialization. On one SmolLM2 stream on 2 cores that was about 1.3 ms of CPU a token between
the two processes, taken from the executors' cores (BENCHMARKS.md). A caller on the scheduler's
node instead creates a `TokenRing` for its request and passes its name with the request: the
scheduler's loop appends each event to it (msgpack, a few microseconds) and wakes the reader with
a futex; the Ray call still carries the request, its cancellation when the caller goes away and
the actors' deaths (the reader, asleep, looks at the call every 50 ms), and ends when the
request does.

The ring is a channel segment (`actors.channel`, its header: messages published, the writer's
pid, closed, words) whose payload is an append-only log of records, each a 4-byte length and a
msgpack map: word 0 is the log's end in bytes, word 1 set means the log is full and the rest of
the request's events come on the Ray stream (a request longer than the log holds, logprobs and
all, is not cut short); word 2 is the reader's: set, it sleeps out an interval between two lists
it sends on (the Serve ingress's gathering), and the writer wakes it only for the request's last
event (so it wakes once a list, not once a token).
"""
from __future__ import annotations

import os
import struct
import time
import uuid
from pathlib import Path
from typing import Callable

import msgpack

from .channel import HEADER, PREFIX, SHM_DIR, Channel, create, segment_path

CAPACITY = 4 << 20  # tmpfs pages are allocated as the log reaches them
_LEN = struct.Struct("<I")
# the words: the log's end in bytes, whether it is full (the writer's), and whether the reader
# sleeps out an interval, woken by the request's last event only (the reader's)
END, FULL, HUSH = 0, 1, 2


def ends(event: dict) -> bool:
    """Whether `event` is a request's last: it finished, or it is an error."""
    return bool(event.get("finish_reason")) or "error" in event


class TokenRing:
    """The caller's end (`create`) or the scheduler's (`open`) of one request's ring."""

    def __init__(self, path: Path, writer: bool):
        self.path, self.ch = path, Channel(path, writer=writer)
        self.end = 0  # the writer's end of the log, or how far the reader has read
        self.full = False

    # ---- the caller's end ----
    @classmethod
    def create(cls, capacity: int | None = None) -> "TokenRing":
        """A ring for one request (its log `capacity` bytes, `CAPACITY` by default), named by
        this process (`channel.sweep` removes it if this process dies) and a random id."""
        path = segment_path(os.getpid(), "ring", uuid.uuid4().hex)
        create(path, capacity or CAPACITY)
        return cls(path, writer=False)

    def events(self, finished: Callable[[], bool], interval: float = 0.0):
        """The events in the lists they arrived in, until the request's last. Returns early,
        without it, when the log filled up or the call that carries the request ended first
        (`finished()`, asked while no event comes: the scheduler could not open the ring, or
        died): the rest, or what went wrong, is on the Ray stream.
        With an `interval` (seconds), a list goes out at most once per interval, the events
        that came meanwhile joined in it: the first and a list with the request's last event
        at once. Between two lists this reader sleeps out the interval, and the writer wakes it
        for the last event only (`HUSH`), so that it wakes once a list rather than once a token."""
        hdr = self.ch._hdr
        seen, batch, due = 0, [], None  # due: when the next list may go out (gathering)
        while True:
            if hdr[0] == seen:
                left = None if due is None else due - time.monotonic()
                if left is not None and left > 0:  # woken early only by the last event
                    self.ch.doze(seen, left)
                    continue
                if batch:  # (read while asleep, the interval now out)
                    yield batch
                    batch, due = [], time.monotonic() + interval
                    continue
                hdr[3 + HUSH], due = 0, None  # the next event is sent on as it comes
                slept = False
                while hdr[0] == seen:  # sleep at once: a spinning caller takes an executor's core
                    # the call is asked about only after 50 ms without an event (not each
                    # token: `ray.wait` costs more than the token's hand-over)
                    if slept and finished() and hdr[0] == seen:
                        return
                    self.ch.doze(seen)
                    slept = True
            seen = int(hdr[0])
            # full before end: the end stored with it is no older than the one read after
            full, end = bool(hdr[3 + FULL]), int(hdr[3 + END])
            data = self.ch._map[HEADER + self.end:HEADER + end]  # (a copy)
            self.end = end
            at = 0
            while at < len(data):
                (n,) = _LEN.unpack_from(data, at)
                ev = msgpack.unpackb(data[at + 4:at + 4 + n])
                if "top_logprobs" in ev:  # (pairs, as the Ray stream gives them)
                    ev["top_logprobs"] = [tuple(p) for p in ev["top_logprobs"]]
                batch.append(ev)
                at += 4 + n
            last = bool(batch) and ends(batch[-1])
            if batch and (last or full or due is None or time.monotonic() >= due):
                yield batch
                if last:
                    return
                batch = []
                if interval > 0:  # asleep until the interval is out, unless the end comes
                    due = time.monotonic() + interval
                    hdr[3 + HUSH] = 1
            if full:
                return

    def close(self):
        """Remove the name (if the scheduler has not) and drop this mapping."""
        self.path.unlink(missing_ok=True)
        self.ch.release()

    # ---- the scheduler's end ----
    @classmethod
    def open(cls, name: str) -> "TokenRing":
        """The ring the caller named (a file of this node's shared memory), its name removed at
        once: from here the two mappings are all that is left of it."""
        path = Path(name)
        if path.parent != SHM_DIR or not (path.name.startswith(PREFIX) and "-ring-" in path.name):
            raise ValueError(f"not a token ring: {name!r}")
        ring = cls(path, writer=True)
        path.unlink(missing_ok=True)
        return ring

    def append(self, event: dict) -> bool:
        """Appends `event` and wakes the reader; False (from then on) once the log is full: that
        event and the rest go by the Ray stream."""
        if self.full:
            return False
        data = msgpack.packb(event)
        at, n = self.end, 4 + len(data)
        if at + n > self.ch.capacity:
            self.full = True
            self.ch.publish(at, 1)
            return False
        self.ch._map[HEADER + at:HEADER + at + n] = _LEN.pack(len(data)) + data
        self.end = at + n
        self.ch.publish(self.end, 0, wake=ends(event) or not self.ch._hdr[3 + HUSH])
        return True
