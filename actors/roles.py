"""The executors and the predictor as Ray sees them: classes that import nothing of torch, each
building its role's implementation (`hot_executor`, `cold_executor`, `predictor`, which do, or
their torch-free kinds `hot_native`, `cold_native` and `pred_native`, which do not) in its own
process, and
passing its calls through.

The process that starts a group (a served model's replica, `actors.handle`) needs the classes,
not what they compute: with these it never imports torch, which costs a process about 0.15 GiB
of its own memory and 2 s of CPU at each start. Ray names each process after the class here
(`ray::HotExecutor`, `ray::ColdExecutor`, `ray::PredictorActor`). The calls are the group's
control calls (start, stats, profiles); the layer loop runs over shared memory, not through
them."""
from __future__ import annotations

import importlib
import queue
import threading
from concurrent.futures import Future


class _ComputeThread:
    """Runs the calls given to it one at a time on one daemon thread of its own (a daemon: a
    loop still waiting on its channels never holds up the process's exit)."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="compute", daemon=True).start()

    def _serve(self):
        while True:
            fn, args, kwargs, done = self.calls.get()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                done.set_exception(e)

    def call(self, fn, *args, **kwargs):
        done = Future()
        self.calls.put((fn, args, kwargs, done))
        return done.result()


class _Role:
    """Builds IMPL (a module of this package, a class in it) in this process; the calls every
    role answers.

    The implementation is built, pinned to its cores, and runs its loop on one thread of its
    own (`compute`), whatever thread Ray runs each call on. torch's parallel loops run on
    OpenMP, which gives each thread that starts one a team of workers of its own: a load on
    the actor's main thread and a loop on one of its call threads made two teams, twice the
    threads the process's cores hold, and GNU OpenMP then lets a worker spin only briefly
    before it sleeps, so every parallel loop of the step paid a wake-up. A whole SmolLM2 on two
    cores decoded at 64-70 tok/s so, against 270-305 with its load and loop on one thread."""
    IMPL: tuple[str, str]

    def __init__(self, *args, **kwargs):
        module, name = self.IMPL
        self.compute = _ComputeThread()
        cls = getattr(importlib.import_module(module, __package__), name)
        self.impl = self.compute.call(cls, *args, **kwargs)

    def ready(self) -> dict:
        return self.impl.ready()

    def run(self) -> str:
        return self.compute.call(self.impl.run)

    def stats(self) -> dict:
        return self.impl.stats()


class HotExecutor(_Role):
    IMPL = ".hot_native", "hot_executor"  # (torch-free where its steps run natively: see there)

    def prompts_natively(self, enabled: bool):
        return self.impl.prompts_natively(enabled)

    def steps_in_segments(self, enabled: bool):
        return self.impl.steps_in_segments(enabled)

    def profile(self, steps: int):
        return self.impl.profile(steps)

    def profile_table(self) -> str | None:
        return self.impl.profile_table()

    def loop_profile(self, mode: str = "read") -> dict:
        return self.impl.loop_profile(mode)


class ColdExecutor(_Role):
    IMPL = ".cold_native", "cold_executor"  # (torch-free where its loop answers all: see there)

    def loop_profile(self, mode: str = "read") -> dict:
        return self.impl.loop_profile(mode)


class PredictorActor(_Role):
    IMPL = ".pred_native", "predictor"  # (torch-free where its loop answers all: see there)

    def attach(self, handles: dict) -> bool:
        return self.impl.attach(handles)
