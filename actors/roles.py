"""The executors and the predictor as Ray sees them: classes that import nothing of torch, each
building its role's implementation (`hot_executor`, `cold_executor`, `predictor`, which do) in
its own process, and passing its calls through.

The process that starts a group (a served model's replica, `actors.handle`) needs the classes,
not what they compute: with these it never imports torch, which costs a process about 0.15 GiB
of its own memory and 2 s of CPU at each start. Ray names each process after the class here
(`ray::HotExecutor`, `ray::ColdExecutor`, `ray::PredictorActor`). The calls are the group's
control calls (start, stats, profiles); the layer loop runs over shared memory, not through
them."""
from __future__ import annotations


class HotExecutor:
    def __init__(self, *args, **kwargs):
        from .hot_executor import HotExecutorImpl
        self.impl = HotExecutorImpl(*args, **kwargs)

    def ready(self) -> dict:
        return self.impl.ready()

    def run(self) -> str:
        return self.impl.run()

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

    def stats(self) -> dict:
        return self.impl.stats()


class ColdExecutor:
    def __init__(self, *args, **kwargs):
        from .cold_executor import ColdExecutorImpl
        self.impl = ColdExecutorImpl(*args, **kwargs)

    def ready(self) -> dict:
        return self.impl.ready()

    def run(self) -> str:
        return self.impl.run()

    def loop_profile(self, mode: str = "read") -> dict:
        return self.impl.loop_profile(mode)

    def stats(self) -> dict:
        return self.impl.stats()


class PredictorActor:
    def __init__(self, *args, **kwargs):
        from .predictor import PredictorImpl
        self.impl = PredictorImpl(*args, **kwargs)

    def ready(self) -> dict:
        return self.impl.ready()

    def run(self) -> str:
        return self.impl.run()

    def attach(self, handles: dict) -> bool:
        return self.impl.attach(handles)

    def stats(self) -> dict:
        return self.impl.stats()
