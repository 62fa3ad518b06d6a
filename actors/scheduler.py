"""The scheduler actor as Ray sees it: the request queue, admission, cancellation and the token
streams of one model's group (`actors.batch_loop.BatchLoop` does the work).

Whoever holds a handle to an actor imports the module of its class (Ray loads the class to know
its methods), and the Serve ingress holds the scheduler's: it streams each request's tokens from
the scheduler itself. So this class imports nothing at module level, and its work, with torch and
the batching core behind it, is imported in the actor's own process only, when it starts.
"""
from __future__ import annotations

import contextlib


class Scheduler:
    def __init__(self, *args, **kwargs):
        from .batch_loop import BatchLoop
        self._work = BatchLoop(*args, **kwargs)

    async def ready(self) -> dict:
        return await self._work.ready()

    async def run(self) -> str:
        return await self._work.run()

    async def generate(self, rid: str, prompt: list[int], params, probe: bool = False,
                       resume: list[int] | None = None, ring: str | None = None):
        """The request's events, in lists (`BatchLoop.generate`); closed with this stream, so
        that a caller who goes away frees the request's slot at once."""
        stream = self._work.generate(rid, prompt, params, probe=probe, resume=resume, ring=ring)
        async with contextlib.aclosing(stream):
            async for events in stream:
                yield events

    async def cancel(self, rid: str) -> bool:
        return await self._work.cancel(rid)

    async def health(self, timeout: float = 30.0) -> dict:
        return await self._work.health(timeout)

    async def stats(self) -> dict:
        return await self._work.stats()

    async def stop(self) -> None:
        await self._work.stop()
