"""A hot executor without torch: where the kernel library's `hot_step` runs every step a hot
executor can be sent (the tokens' embeddings, the layer loop `hot_layers` with its exchanges,
the final norm and the head with the other executors' shares of it), the process that runs them
never imports torch.

A served model's group on a CPU is a hot executor, its cold executors and a scheduler; the
cold executors and the scheduler already ran without torch, so torch in the hot one was what a
model cost beyond its weights, KV cache and Python (`import torch`: about 0.15 GiB of a
process's own memory, and 2 s of CPU at every start). Here the executor is loaded by the same
code as always (`hot_executor.HotExecutorImpl`, with torch) in a child process
(`actors.pack`) that writes the step's arguments into a memory file and exits (or, for the same
model and shape again, read back from `shard_cache`); this process copies them into memory of
its own, allocates its KV cache, maps its channels and the group's RoPE tables, fills the
tables' rows as steps reach them (`formats.rope`: the torch model's own computation, bit for
bit), and runs each step in one C call through the torch-free build's entry points (`clib`).
The step's floats are the torch executor's native step's: the same functions
(tests/test_runtime.py compares the two groups' tokens and log-probabilities).

It runs a CPU group whose decode and prompt steps the native loop runs (a uniform LLaMA-family
model with every layer's heads and neurons in 16-row group layouts, the int4 default on a 4-bit
file; with a bundle, its hot neurons' records beside a predictor on the host, decode steps of at
most 64 rows) and no compiled step; else the executor is the torch one, and the
log and `ready()["torch_why"]` say why. `POWERINFER_HOT_EXECUTOR=torch` (read where the group is
built) asks for the torch one always."""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

import numpy as np

from cluster.topology import process_memory
from powerinfer.cpu import LOOP_MODES, loop_times
from powerinfer.formats.rope import fill_rows

from . import clib
from .channel import ChannelClosed, PeerDied, native_error
from .group_info import node_id
from .packed import DTYPES
from .plane import ERROR, OK, PREFILL, STOP, PlaneSpec, Reply, Step, receive, send

log = logging.getLogger("powerinfer")

STEP_ARGS = 7  # hot_step's own arguments, first: tokens, positions, starts, tables, last, prompt, out


def hot_executor(spec: PlaneSpec, cores: tuple[int, ...], model, config, plan, hot_share: float,
                 attention: bool = False, runtime: str = "auto"):
    """The hot executor for these arguments (`hot_executor.HotExecutorImpl`'s): torch-free where
    `hot_step` runs every step it can be sent, else the torch one. runtime: "torch" asks for the
    torch one (the group's `POWERINFER_HOT_EXECUTOR`)."""
    why = torch_needed(config, plan, runtime, model.args)
    if why is None:
        got = HotNativeImpl.load(spec, cores, model, config, plan, hot_share, attention)
        if isinstance(got, HotNativeImpl):
            return got
        why = got
    log.info("the hot executor runs with torch: %s", why)
    from .hot_executor import HotExecutorImpl
    impl = HotExecutorImpl(spec, cores, model, config, plan, hot_share, attention)
    impl.torch_why = why
    return impl


def torch_needed(config, plan, runtime: str, args) -> str | None:
    """Why the hot executor must be the torch one, where that is plain without loading (else the
    child's load says, `HotExecutorImpl.native_only`); None where it may not need it. args: the
    model's `ModelArgs`, whose shape may say so already."""
    if runtime == "torch" or os.environ.get("POWERINFER_HOT_EXECUTOR", "auto") == "torch":
        return "POWERINFER_HOT_EXECUTOR=torch"
    if config.device != "cpu":
        return f"it runs on {config.device!r}"
    if config.compile:
        return "its decode step is compiled (Config.compile)"
    if config.weights == "dense":
        # (dense projections are rows of the model's type, not 16-row groups, so its prompt
        # steps need the modules: said here, the loading child, its torch and its read of the
        # executor's share of the model are not spent only to say so)
        return ("its prompt steps run its Python modules (weights='dense': no layer in 16-row "
                "group layouts)")
    if (what := args.outside_native_loop()) is not None:
        # (Falcon's parallel branches, OPT's LayerNorm: the child would read the executor's
        # share of such a model, a large one's tens of GB, and find the same)
        return ("its decode step runs its Python modules (a layer the native loop does not "
                f"run: {what})")
    return None


class HotNativeImpl:
    """The executor: its model in memory of its own, each step run by `hot_step` through the C
    entry points. Its calls are the torch executor's (`ready`, `run`, `stats`, `loop_profile`;
    the torch ones' diagnostics say they are not here)."""

    @classmethod
    def load(cls, spec, cores, model, config, plan, hot_share, attention) -> "HotNativeImpl | str":
        """The executor, or why some step needs Python (the child's word: then the torch
        executor loads instead)."""
        kwargs = dict(spec=spec, cores=cores, model=model, config=config, plan=plan,
                      hot_share=hot_share, attention=attention)
        got = clib.load("actors.hot_executor:HotExecutorImpl", kwargs, cores, "hot",
                        "hot executor's model")
        if isinstance(got, str):
            return got
        impl = cls.__new__(cls)
        impl._init(spec, cores, config.cpu_threads, got, model.args)
        return impl

    def _init(self, spec: PlaneSpec, cores, threads: int, loaded: clib.Loaded, model_args):
        faulthandler.enable()  # a native crash leaves its Python stack in the log
        got = loaded.got
        self.spec, self.cores = spec, tuple(cores)
        self.threads = {"load": threading.get_native_id()}
        self.load_s, self.load_cpu_s = loaded.load_s, loaded.load_cpu_s
        self.cached = got["cached"]
        self.lib = clib.Library.started(got, cores, threads)
        self.info, self.parts, self.described = got["ready"], got["parts"], got["stats"]
        self.memory = loaded.memory
        self.ctl, self.out = spec.open("ctl"), spec.open("out", writer=True)
        self.x = spec.open("x", writer=True)
        self.part_chs = [spec.open(f"part.{k}") for k in range(spec.n_cold)]
        # a predictor's: the layers' inputs out, their masks back (`hot_layers`' `predict`)
        self.predicting = got["predicting"]
        self.pred_in = spec.open("pred_in", writer=True) if self.predicting else None
        self.mask = spec.open("mask") if self.predicting else None
        self.input_stats = np.zeros(2, np.int64) if got["sparse_stats"] else None
        self.kv: list[np.ndarray] = []
        self.mapped: list[np.ndarray] = []  # tensors read in the model file's own pages
        # the group's RoPE tables, which this process fills as steps reach their rows
        self.model_args = model_args
        self.rope = spec.rope_arrays(writer=True)
        self.rope_filled = 0
        glob, local = self.rope
        slots = {"x.base": self.x.base, "x.capacity": self.x.capacity,
                 "spin_us": self.part_chs[0].spin_us if self.part_chs else self.x.spin_us,
                 "num_blocks": spec.num_blocks,
                 "rope_cos": clib.Arr(glob[0], 7), "rope_sin": clib.Arr(glob[1], 7),
                 "rope_cos_local": clib.Arr(local[0], 7), "rope_sin_local": clib.Arr(local[1], 7),
                 "sparse_stats": None if self.input_stats is None else clib.Arr(self.input_stats, 4)}
        named = [(f"part.{k}", p) for k, p in enumerate(self.part_chs)]
        if self.predicting:
            named += [("pred_in", self.pred_in), ("mask", self.mask)]
        for name, ch in named:
            slots |= {f"{name}.base": ch.base, f"{name}.capacity": ch.capacity,
                      f"{name}.state": clib.Arr(ch._st, 4)}
        fixed = tuple(clib.unpack(v, self.memory, slots, self.kv, self.mapped) for v in got["args"])
        self.args = clib.PiArgs((None,) * STEP_ARGS + fixed)
        self.steps, self.step_s, self.native_prompt_steps = 0, 0.0, 0
        self._counted = (0, 0)

    # ---- the role's calls ----

    def ready(self) -> dict:
        return {**self.info, "cores": list(self.cores), "pid": os.getpid(),
                "load_s": self.load_s, "load_cpu_s": self.load_cpu_s, "isa": self.lib.isa(),
                "node_id": node_id(),
                "shard_cached": self.cached, "torch": "torch" in sys.modules, "torch_why": ""}

    def run(self) -> str:
        self.threads["loop"] = threading.get_native_id()
        try:
            while True:
                step = receive(self.ctl, Step)
                if step.op == STOP:
                    self.x.publish(STOP)
                    if self.pred_in is not None:
                        self.pred_in.publish(STOP)
                    return "stopped"
                t0 = time.perf_counter()
                try:
                    self._step(step)
                except Exception as e:  # a bug or a bad step: report it, the group is rebuilt
                    if isinstance(e, RuntimeError) and (gone := native_error(e)) is not None:
                        raise gone from None
                    self._error(f"{type(e).__name__}: {e}")
                    raise
                send(self.out, Reply(OK, step.K, *self._input_counts()))
                self.steps += 1
                self.native_prompt_steps += step.op == PREFILL
                self.step_s += time.perf_counter() - t0
        except (PeerDied, ChannelClosed) as e:
            self._error(str(e))
            return f"failed: {e}"

    def _step(self, step: Step):
        spec, ctl = self.spec, self.ctl
        N = step.B * step.T
        at = spec.ctl_layout(N, step.S, step.M)
        pos = ctl.array(np.int64, (N,), at.positions)
        self._rope_ensure(pos)
        arrays = (ctl.array(np.int64, (N,), at.tokens), pos,
                  ctl.array(np.int64, (step.S + 1,), at.starts),
                  ctl.array(np.int32, (step.S, step.M), at.tables),
                  ctl.array(np.int64, (step.K,), at.last))
        out = self.out.array(np.float32, (step.K, spec.vocab))
        for i, a in enumerate(arrays):
            self.args.set(i, clib.Arr(a, DTYPES.index(str(a.dtype))))
        self.args.set(5, step.T > 1)  # (a prompt step of one token runs as a decode row, as in torch's)
        self.args.set(6, clib.Arr(out, 7))
        self.lib.hot_step(self.args)

    def _rope_ensure(self, pos: np.ndarray):
        """The RoPE tables' rows up to the largest of the step's positions, in whole chunks, as
        `Transformer.rope_ensure` fills them (the cold executors read them too)."""
        if pos.size == 0:
            return

        def write(table, lo, hi, cos, sin):
            self.rope[table][0][lo:hi], self.rope[table][1][lo:hi] = cos, sin
        self.rope_filled = fill_rows(self.model_args, self.spec.max_seq, self.rope_filled,
                                     int(pos.max()), write)

    def _input_counts(self) -> tuple[int, int]:
        if self.input_stats is None:
            return 0, 0
        kept, seen = int(self.input_stats[0]), int(self.input_stats[1])
        before, self._counted = self._counted, (kept, seen)
        return kept - before[0], seen - before[1]

    def _error(self, text: str):
        data = text.encode()[:self.out.capacity]
        self.out.put_bytes(data)
        send(self.out, Reply(ERROR, len(data)))

    def prompts_natively(self, enabled: bool):
        if not enabled:
            raise RuntimeError("this hot executor runs without torch: its prompt steps have no "
                               "Python modules (POWERINFER_HOT_EXECUTOR=torch runs the torch one)")

    def steps_in_segments(self, enabled: bool):
        return False  # (no Python modules to launch segments of)

    def profile(self, steps: int):
        raise RuntimeError("this hot executor runs without torch: no torch profile "
                           "(loop_profile has its native loop's phases)")

    def profile_table(self) -> str | None:
        return None

    def loop_profile(self, mode: str = "read") -> dict:
        """As the torch executor's (`kernels.loop_profile`)."""
        return loop_times(self.lib.loop_profile(LOOP_MODES[mode]))

    def stats(self) -> dict:
        held = clib.held(self.memory, self.mapped, self.kv)
        out = {"steps": self.steps, "step_s": self.step_s, "ctl_wait_s": self.ctl.wait_s,
               "threads": dict(self.threads), "native_prompt_steps": self.native_prompt_steps,
               "part_wait_s": sum(p.wait_s for p in self.part_chs), **self.described,
               "device": "cpu", "memory": process_memory(),
               "held_bytes": held["weight_bytes"] + held["kv_bytes"], **held,
               "blocks": self.lib.blocks()}
        if self.input_stats is not None:
            out["input_sparse_stats"] = [int(self.input_stats[0]), int(self.input_stats[1])]
        if self.mask is not None:
            out["mask_wait_s"] = self.mask.wait_s
        return out
