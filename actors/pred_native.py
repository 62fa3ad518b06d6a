"""A predictor without torch: where the kernel library's `pred_serve` loop answers every step
(each layer's predictor on the library's GEMV in one format, on the host), the process that
answers them never imports torch, as a torch-free cold executor (`cold_native`) does not.

A sparse model's group runs a predictor beside its executors, and `import torch` cost that
process about 0.15 GiB of its own memory, while what it holds is a few MiB of matrices. Here the
predictors are loaded by the same code as always (`predictor.PredictorImpl`, with torch) in a
child process (`actors.pack`) that writes the loop's matrices into a memory file and exits; this
process copies them into memory of its own and answers each decode step's masks in C++ through
the torch-free build's C entry points (`clib`), steps of any width, the values
`Predictors.active` gives bit for bit (tests/test_pred_native.py). On the hot executor's GPU, or
where some layer's predictor runs on torch's matmuls, the predictor is the torch one, and the log
says why. `POWERINFER_PREDICTOR=torch` asks for the torch one always."""
from __future__ import annotations

import logging
import os
import sys

import numpy as np

from cluster.topology import process_memory
from powerinfer.compat import resident

from . import clib
from .channel import ChannelClosed, native_error
from .group_info import node_id
from .plane import STOP, PlaneSpec

log = logging.getLogger("powerinfer")


def predictor(spec: PlaneSpec, cores: tuple[int, ...], plan, threads: int = 0):
    """The predictor for these arguments (`predictor.PredictorImpl`'s): torch-free where the
    native loop answers every step, else the torch one (its `ready()["torch_why"]` says why)."""
    why = torch_needed(spec)
    if why is None:
        got = PredNativeImpl.load(spec, cores, plan, threads)
        if isinstance(got, PredNativeImpl):
            return got
        why = got
    log.info("the predictor runs with torch: %s", why)
    from .predictor import PredictorImpl
    impl = PredictorImpl(spec, cores, plan, threads)
    impl.torch_why = why
    return impl


def torch_needed(spec: PlaneSpec) -> str | None:
    """Why the predictor must be the torch one, where that is plain without loading (else the
    child's load says, `PredictorImpl.pack`); None where it may not need it."""
    if os.environ.get("POWERINFER_PREDICTOR", "auto") == "torch":
        return "POWERINFER_PREDICTOR=torch"
    if spec.device_predictor:
        return "it runs on the hot executor's GPU"
    return None


class PredNativeImpl:
    """The predictor: its matrices in memory of its own, answered by `pred_serve` through the C
    entry points. Its calls are the torch predictor's (`ready`, `run`, `stats`)."""

    @classmethod
    def load(cls, spec, cores, plan, threads) -> "PredNativeImpl | str":
        """The predictor, or why the native loop cannot answer all its steps (the child's word:
        then the torch predictor loads instead)."""
        kwargs = dict(spec=spec, cores=cores, plan=plan, threads=threads)
        got = clib.load("actors.predictor:PredictorImpl", kwargs, cores, "predictor",
                        "predictor's matrices")
        if isinstance(got, str):
            return got
        impl = cls.__new__(cls)
        impl._init(spec, cores, threads, got)
        return impl

    def _init(self, spec: PlaneSpec, cores, threads: int, loaded: clib.Loaded):
        got = loaded.got
        self.spec, self.cores = spec, tuple(cores)
        self.load_s, self.load_cpu_s = loaded.load_s, loaded.load_cpu_s
        self.cached = got["cached"]  # (read from the shard cache, not packed by a child)
        self.lib = clib.Library.started(got, cores, threads)
        self.info = got["ready"]
        self.memory = loaded.memory
        self.x, self.mask = spec.open("pred_in"), spec.open("mask", writer=True)
        # the loop's [messages answered, nanoseconds on them], which it adds to as it runs
        self.counts = np.zeros(2, np.int64)
        slots = {"in_base": self.x.base, "mask_base": self.mask.base,
                 "mask_capacity": self.mask.capacity, "spin_us": self.x.spin_us}
        self.args = clib.PiArgs((clib.Arr(self.x._st, 4), clib.Arr(self.counts, 4),
                                 *(clib.unpack(v, self.memory, slots, [], []) for v in got["args"])))

    def attach(self, handles: dict) -> bool:
        raise RuntimeError("a predictor on the host maps no device buffers")

    def ready(self) -> dict:
        return {**self.info, "pid": os.getpid(), "node_id": node_id(), "load_s": self.load_s,
                "load_cpu_s": self.load_cpu_s, "shard_cached": self.cached, "isa": self.lib.isa(),
                "torch": "torch" in sys.modules, "torch_why": ""}

    def run(self) -> str:
        try:
            words = self.lib.pred_serve(self.args)
        except RuntimeError as e:
            err = native_error(e)
            if isinstance(err, ChannelClosed):
                return "closed"
            raise (err or e) from None
        if words[0] == STOP:
            return "stopped"
        raise RuntimeError(f"the predictor: message {words} (op, layer, rows) has no native "
                           "answer; POWERINFER_PREDICTOR=torch runs it with torch")

    def stats(self) -> dict:
        n = len(self.memory)
        return {"input": self.info["input"], "device": "cpu",
                "busy_s": float(self.counts[1]) * 1e-9, "wait_s": self.x.wait_s,
                "calls": int(self.counts[0]), "native": True, "memory": process_memory(),
                "weight_bytes": n, "kv_bytes": 0,
                "weight_resident": resident(clib.address(self.memory), n), "kv_resident": 0}
