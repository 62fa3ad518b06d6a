"""A cold executor without torch: where the kernel library's `cold_serve` loop answers every
message a cold executor can be sent, the process that answers them never imports torch.

`import torch` costs a process about 0.15 GiB of its own memory (its Python modules and
libtorch's static initialisers), and a served model's default group on a CPU runs two executors
(`group`), so torch in the cold one was most of what a model cost beyond its weights, KV cache
and 0.5 GB. Here the kernel library's torch-free build (`kernels.lite_path`: the same ops.cpp over
`csrc/lite.h`, a stand-in for the parts of ATen it uses) is loaded with ctypes and called through
its C entry points (`csrc/capi.h`, through `clib`); it gives the torch operators' floats bit for
bit (tests/test_cold_native.py).

How it loads: the shard is read and laid out by the same code as always (`cold_executor`, which
imports torch), run in a child process (`actors.pack`) that writes every tensor the native loop
takes into a memory file and exits. This process copies them into memory of its own (pinned first: first touch
puts them on its NUMA node, on 2 MiB pages), allocates its KV cache, maps its channels and the
group's RoPE tables, and from then on answers in C++. The child says whether the loop answers
everything: a dense split's block slices and heads whose projections are 16-row groups (a 4-bit
file with `weights="int4"`, a uniform model) do, prompts included, and so do a bundle's neuron
records (a prompt's rows through `kernels.records_rows`, the product the in-process set runs);
layers the loop leaves to Python do not (e.g. a bias), and for those
the executor is the torch one (`cold_executor.ColdExecutorImpl`), which the log says with the
reason.
`POWERINFER_COLD_EXECUTOR=torch` asks for the torch one always."""
from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np

from cluster.topology import node_of, numa_pages, process_memory
from powerinfer.cpu import LOOP_MODES, loop_times

from . import clib
from .channel import ChannelClosed, native_error
from .group_info import node_id
from .plane import STOP, PlaneSpec

log = logging.getLogger("powerinfer")


def cold_executor(spec: PlaneSpec, rank: int, cores: tuple[int, ...], model, plan,
                  hot_share: float, threads: int = 0, weights: str = "dense", head: bool = True,
                  attention: bool = False):
    """A cold executor for these arguments (`cold_executor.ColdExecutorImpl`'s): torch-free
    where the native loop answers every message it can be sent, else the torch one."""
    why = torch_needed(weights)
    if why is None:
        got = ColdNativeImpl.load(spec, rank, cores, model, plan, hot_share, threads, weights,
                                  head, attention)
        if isinstance(got, ColdNativeImpl):
            return got
        why = got
    log.info("cold executor %d runs with torch: %s", rank, why)
    from .cold_executor import ColdExecutorImpl
    impl = ColdExecutorImpl(spec, rank, cores, model, plan, hot_share, threads, weights, head,
                            attention)
    impl.torch_why = why
    return impl


def torch_needed(weights: str) -> str | None:
    """Why the executor must be the torch one, where that is plain without loading (else the
    child's load says, `ColdExecutorImpl.native_only`); None where it may not need it."""
    if os.environ.get("POWERINFER_COLD_EXECUTOR", "auto") == "torch":
        return "POWERINFER_COLD_EXECUTOR=torch"
    if weights != "int4":
        return f"its neurons in {weights!r} weights answer a prompt's rows in Python"
    return None


class ColdNativeImpl:
    """The executor: its shard in memory of its own, answered by `cold_serve` through the C
    entry points. Its calls are the torch executor's (`ready`, `run`, `stats`, `loop_profile`)."""

    @classmethod
    def load(cls, spec, rank, cores, model, plan, hot_share, threads, weights, head,
             attention) -> "ColdNativeImpl | str":
        """The executor, or why the native loop cannot answer all its messages (the child's
        word: then the torch executor loads instead)."""
        kwargs = dict(spec=spec, rank=rank, cores=cores, model=model, plan=plan,
                      hot_share=hot_share, threads=threads, weights=weights, head=head,
                      attention=attention)
        got = clib.load("actors.cold_executor:ColdExecutorImpl", kwargs, cores, f"cold-{rank}",
                        f"cold executor {rank}'s shard")
        if isinstance(got, str):
            return got
        impl = cls.__new__(cls)
        impl._init(spec, rank, cores, threads, got)
        return impl

    def _init(self, spec: PlaneSpec, rank: int, cores, threads: int, loaded: clib.Loaded):
        got = loaded.got
        self.spec, self.rank, self.cores = spec, rank, tuple(cores)
        self.load_s, self.load_cpu_s = loaded.load_s, loaded.load_cpu_s
        self.cached = got["cached"]  # (read from the shard cache, not packed by a child)
        self.lib = clib.Library.started(got, cores, threads)
        self.info, self.parts = got["ready"], got["parts"]
        self.memory = loaded.memory
        self.x, self.part = spec.open("x"), spec.open(f"part.{rank}", writer=True)
        self.ahead = spec.open("mask") if got["ahead"] else None
        self.input_stats = np.zeros(2, np.int64) if got["sparse_stats"] else None
        self.kv: list[np.ndarray] = []
        self.mapped: list[np.ndarray] = []  # tensors read in the model file's own pages
        rope = spec.rope_arrays() if spec.ropes else None
        slots = {"x_base": self.x.base, "part_base": self.part.base,
                 "part_capacity": self.part.capacity, "spin_us": self.x.spin_us,
                 "num_blocks": spec.num_blocks,
                 "ahead": self.ahead.base if self.ahead is not None else 0,
                 **{f"rope_{part}{kind}": None if rope is None else clib.Arr(rope[i][j], 7)
                    for i, kind in enumerate(("", "_local")) for j, part in enumerate(("cos", "sin"))},
                 "sparse_stats": None if self.input_stats is None else clib.Arr(self.input_stats, 4)}
        state = clib.Arr(self.x._st, 4)  # the reader's state, which the loop updates
        self.args = clib.PiArgs((state, *(clib.unpack(v, self.memory, slots, self.kv, self.mapped)
                                          for v in got["args"])))
        self.busy_s, self.steps = 0.0, 0

    def ready(self) -> dict:
        kv = sum(a.nbytes for a in self.kv)
        return {**self.info, "pid": os.getpid(), "load_s": self.load_s,
                "load_cpu_s": self.load_cpu_s, "shard_cached": self.cached, "isa": self.lib.isa(),
                "held_bytes": self.info["held_bytes"] + kv, "numa_bytes": numa_pages(),
                "node": node_of(self.cores), "node_id": node_id(),
                "torch": "torch" in sys.modules, "torch_why": ""}

    def run(self) -> str:
        try:
            while True:
                seen, waited, t0 = self.x.seen, self.x.wait_s, time.perf_counter()
                words = self.lib.cold_serve(self.args)
                answered = self.x.seen - seen - 1  # (the last one is left to us)
                self.steps += answered
                if answered:
                    self.busy_s += time.perf_counter() - t0 - (self.x.wait_s - waited)
                if words[0] == STOP:
                    return "stopped"
                raise RuntimeError(
                    f"cold executor {self.rank}: message {words[:4]} (op, layer, rows, tokens) has "
                    "no native answer; POWERINFER_COLD_EXECUTOR=torch runs its executors with torch")
        except RuntimeError as e:
            err = native_error(e)
            if isinstance(err, ChannelClosed):
                return "closed"
            raise (err or e) from None

    def loop_profile(self, mode: str = "read") -> dict:
        """As the torch executor's (`kernels.loop_profile`)."""
        return loop_times(self.lib.loop_profile(LOOP_MODES[mode]))

    def stats(self) -> dict:
        out = {"rank": self.rank, "busy_s": self.busy_s, "wait_s": self.x.wait_s,
               "messages": self.steps, "neurons": self.info["neurons"],
               "memory": process_memory(), "held_bytes": self.parts["held_bytes"],
               **clib.held(self.memory, self.mapped, self.kv), "blocks": self.lib.blocks()}
        if self.input_stats is not None:
            out["input_sparse_stats"] = [int(self.input_stats[0]), int(self.input_stats[1])]
        return out
