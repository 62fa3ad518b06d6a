"""A cold executor without torch: where the kernel library's `cold_serve` loop answers every
message a cold executor can be sent, the process that answers them never imports torch.

`import torch` costs a process about 0.15 GiB of its own memory (its Python modules and
libtorch's static initialisers), and a served model's default group on a CPU runs two executors
(`group`), so torch in the cold one was most of what a model cost beyond its weights, KV cache
and 0.5 GB. Here the kernel library's torch-free build (`kernels.lite_path`: the same ops.cpp over
`csrc/lite.h`, a stand-in for the parts of ATen it uses) is loaded with ctypes and called through
its C entry points (`csrc/capi.h`); it gives the torch operators' floats bit for bit
(tests/test_cold_native.py).

How it loads: the shard is read and laid out by the same code as always (`cold_executor`, which
imports torch), run in a child process (`actors.pack`) that writes every tensor the native loop
takes into a memory file and exits. This process copies them into memory of its own (pinned first: first touch
puts them on its NUMA node, on 2 MiB pages), allocates its KV cache, maps its channels and the
group's RoPE tables, and from then on answers in C++. The child says whether the loop answers
everything: a dense split's block slices and heads whose projections are 16-row groups (a 4-bit
file with `weights="int4"`, a uniform model) do, prompts included; neuron records (a bundle's
predictor) and layers the loop leaves to Python do not, and for those the executor is the torch
one (`cold_executor.ColdExecutorImpl`), which the log says with the reason.
`POWERINFER_COLD_EXECUTOR=torch` asks for the torch one always."""
from __future__ import annotations

import ctypes
import faulthandler
import logging
import mmap
import os
import pickle
import resource
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

from cluster.topology import node_of, numa_pages, pin_threads, process_memory
from powerinfer.compat import resident, trim_heap
from powerinfer.cpu import LOOP_MODES, loop_times

from .channel import ChannelClosed, native_error
from .group_info import node_id
from .packed import Packed, Slot, Zeros
from .plane import STOP, PlaneSpec

log = logging.getLogger("powerinfer")

# numpy's type for each of `packed.DTYPES` (bfloat16 held as uint16)
_NP = (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.uint16, np.float32, np.bool_)


class Arr(NamedTuple):
    """A tensor argument: a numpy array and its element type (a code of DTYPES)."""
    array: np.ndarray
    dtype: int


# ---- the library's C entry points (csrc/capi.h) ----

PI_INT, PI_FLOAT, PI_TENSOR, PI_NONE, PI_TENSORS, PI_INTS, PI_FLOATS = range(7)


class PiArg(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("i", ctypes.c_int64), ("f", ctypes.c_double),
                ("data", ctypes.c_void_p), ("ndim", ctypes.c_int64),
                ("shape", ctypes.c_int64 * 4), ("strides", ctypes.c_int64 * 4)]


class PiArgs:
    """Arguments as `pi_cold_serve` reads them, built once (the arrays they point at are kept)."""

    def __init__(self, values: tuple):
        self.keep: list = []
        self.array = (PiArg * len(values))(*(self._one(v) for v in values))

    def _tensor(self, t: Arr) -> PiArg:
        a = t.array
        assert a.ndim <= 4, a.shape
        shape = (ctypes.c_int64 * 4)(*a.shape)
        strides = (ctypes.c_int64 * 4)(*(s // a.itemsize for s in a.strides))
        self.keep.append(a)
        return PiArg(PI_TENSOR, t.dtype, 0.0, a.ctypes.data if a.size else None, a.ndim, shape,
                     strides)

    def _one(self, v) -> PiArg:
        if isinstance(v, Arr):
            return self._tensor(v)
        if v is None:
            return PiArg(PI_NONE)
        if isinstance(v, (bool, int, np.integer)):
            return PiArg(PI_INT, int(v))
        if isinstance(v, (float, np.floating)):
            return PiArg(PI_FLOAT, 0, float(v))
        if isinstance(v, (list, tuple)):
            if not v:
                return PiArg(PI_INTS, 0)
            if all(isinstance(x, Arr) for x in v):
                items = (PiArg * len(v))(*(self._tensor(x) for x in v))
                self.keep.append(items)
                return PiArg(PI_TENSORS, len(v), 0.0, ctypes.addressof(items))
            if all(isinstance(x, (bool, int, np.integer)) for x in v):
                a = np.asarray(v, np.int64)
                self.keep.append(a)
                return PiArg(PI_INTS, len(v), 0.0, a.ctypes.data)
            a = np.asarray(v, np.float64)
            self.keep.append(a)
            return PiArg(PI_FLOATS, len(v), 0.0, a.ctypes.data)
        raise TypeError(f"no C argument for {type(v).__name__}")


class Library:
    """The kernel library's torch-free build, loaded with ctypes."""

    def __init__(self, path: str):
        self.lib = lib = ctypes.CDLL(path)
        lib.pi_cold_serve.argtypes = [ctypes.POINTER(PiArg), ctypes.c_int64,
                                      ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_int64]
        lib.pi_cold_serve.restype = ctypes.c_int64
        for f in (lib.pi_isa, lib.pi_best_isa):
            f.argtypes, f.restype = [ctypes.c_char_p, ctypes.c_int64], None
        lib.pi_use_isa.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64]
        lib.pi_use_isa.restype = ctypes.c_int64
        lib.pi_set_threads.argtypes, lib.pi_set_threads.restype = [ctypes.c_int64], None
        lib.pi_loop_profile.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
        lib.pi_loop_profile.restype = ctypes.c_int64

    def isa(self) -> str:
        out = ctypes.create_string_buffer(32)
        self.lib.pi_isa(out, 32)
        return out.value.decode()

    def use_isa(self, want: str):
        err = ctypes.create_string_buffer(1024)
        if self.lib.pi_use_isa(want.encode(), err, 1024):
            raise RuntimeError(err.value.decode())

    def set_threads(self, n: int):
        """The calling thread's parallel loops run on n threads (OpenMP's are per thread)."""
        self.lib.pi_set_threads(n)

    def cold_serve(self, args: PiArgs) -> list[int]:
        """`cold_serve` (see csrc/ops.cpp): the words of the message it leaves to the caller; a
        RuntimeError with the library's text for its errors (a channel closed, a peer died)."""
        words, err = (ctypes.c_int64 * 6)(), ctypes.create_string_buffer(4096)
        if self.lib.pi_cold_serve(args.array, len(args.array), words, err, 4096):
            raise RuntimeError(err.value.decode(errors="replace"))
        return list(words)

    def loop_profile(self, mode: int) -> list[int]:
        out = (ctypes.c_int64 * 64)()
        n = self.lib.pi_loop_profile(mode, out, 64)
        return list(out[:min(n, 64)])


# ---- the executor ----

def cold_executor(spec: PlaneSpec, rank: int, cores: tuple[int, ...], model, plan,
                  hot_share: float, threads: int = 0, weights: str = "dense", head: bool = True,
                  attention: bool = False):
    """A cold executor for these arguments (`cold_executor.ColdExecutorImpl`'s): torch-free
    where the native loop answers every message it can be sent, else the torch one."""
    why = torch_needed(plan, weights)
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


def torch_needed(plan, weights: str) -> str | None:
    """Why the executor must be the torch one, where that is plain without loading (else the
    child's load says, `ColdExecutorImpl.native_only`); None where it may not need it."""
    if os.environ.get("POWERINFER_COLD_EXECUTOR", "auto") == "torch":
        return "POWERINFER_COLD_EXECUTOR=torch"
    if plan.predictor_input is not None:
        return "a predictor's neuron records answer a prompt's rows in Python"
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
        faulthandler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        pin_threads(cores)  # (the child inherits it; the memory below is touched here first)
        kwargs = dict(spec=spec, rank=rank, cores=cores, model=model, plan=plan,
                      hot_share=hot_share, threads=threads, weights=weights, head=head,
                      attention=attention)
        fd = os.memfd_create(f"powerinfer-cold-{rank}", os.MFD_CLOEXEC)
        try:
            got = _run_child(fd, kwargs)
            if "why" in got:
                return got["why"]
            impl = cls.__new__(cls)
            impl._init(spec, rank, cores, threads, got, fd)
        finally:
            os.close(fd)
        trim_heap()  # (the child's report and its unpickling, freed)
        child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        impl.load_s = time.perf_counter() - t0
        impl.load_cpu_s = time.process_time() - c0 + (child1.ru_utime - child0.ru_utime) + \
            (child1.ru_stime - child0.ru_stime)
        return impl

    def _init(self, spec: PlaneSpec, rank: int, cores, threads: int, got: dict, fd: int):
        self.spec, self.rank, self.cores = spec, rank, tuple(cores)
        self.lib = Library(got["library"])
        self.lib.use_isa(got["isa"])
        self.lib.set_threads(min(threads, len(cores)) if threads else len(cores))
        self.info, self.parts = got["ready"], got["parts"]
        self.memory = _copy_out(fd, got["size"])
        self.x, self.part = spec.open("x"), spec.open(f"part.{rank}", writer=True)
        self.ahead = spec.open("mask") if got["ahead"] else None
        self.input_stats = np.zeros(2, np.int64) if got["sparse_stats"] else None
        self.kv: list[np.ndarray] = []
        rope = spec.rope_arrays() if spec.ropes else None
        slots = {"x_base": self.x.base, "part_base": self.part.base,
                 "part_capacity": self.part.capacity, "spin_us": self.x.spin_us,
                 "ahead": self.ahead.base if self.ahead is not None else 0,
                 **{f"rope_{part}{kind}": None if rope is None else Arr(rope[i][j], 7)
                    for i, kind in enumerate(("", "_local")) for j, part in enumerate(("cos", "sin"))},
                 "sparse_stats": None if self.input_stats is None else Arr(self.input_stats, 4)}
        state = Arr(self.x._st, 4)  # the reader's state, which the loop updates
        self.args = PiArgs((state, *(self._value(v, slots) for v in got["args"])))
        self.busy_s, self.steps = 0.0, 0

    def _value(self, v, slots: dict):
        if isinstance(v, Slot):
            return slots[str(v)]
        if isinstance(v, Packed):
            n = int(np.prod(v.shape))
            a = np.frombuffer(self.memory, _NP[v.dtype], n, v.offset).reshape(v.shape)
            return Arr(a, v.dtype)
        if isinstance(v, Zeros):  # (calloc's fresh pages: resident as they are written)
            a = np.zeros(v.shape, _NP[v.dtype])
            self.kv.append(a)
            return Arr(a, v.dtype)
        if isinstance(v, list):
            return [self._value(x, slots) for x in v]
        return v

    def ready(self) -> dict:
        kv = sum(a.nbytes for a in self.kv)
        return {**self.info, "pid": os.getpid(), "load_s": self.load_s,
                "load_cpu_s": self.load_cpu_s, "isa": self.lib.isa(),
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
               "weight_bytes": len(self.memory), "kv_bytes": sum(a.nbytes for a in self.kv),
               "weight_resident": resident(_address(self.memory), len(self.memory)),
               "kv_resident": sum(resident(a.ctypes.data, a.nbytes) for a in self.kv)}
        if self.input_stats is not None:
            out["input_sparse_stats"] = [int(self.input_stats[0]), int(self.input_stats[1])]
        return out


def _address(m: mmap.mmap) -> int:
    return np.frombuffer(m, np.uint8, 1).ctypes.data if len(m) else 0


def _run_child(fd: int, kwargs: dict, role: str = "actors.cold_executor:ColdExecutorImpl") -> dict:
    """What `role` holds, loaded and written into the memory file fd by a child process with
    torch (`actors.pack`); what it says of it. Its errors (a typed load error) are raised here as
    themselves."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-m", "actors.pack", role, str(fd)],
                         input=pickle.dumps(kwargs), stdout=subprocess.PIPE, pass_fds=(fd,),
                         env=env, check=False)
    try:
        got = pickle.loads(run.stdout)
    except Exception:  # noqa: BLE001 - the child died before it could say
        raise RuntimeError(f"loading the cold executor's shard failed (exit status "
                           f"{run.returncode}; its error is in this actor's log)") from None
    if "error" in got:
        raise got["error"]
    return got


def _copy_out(fd: int, size: int) -> mmap.mmap:
    """The memory file's bytes in anonymous memory of this process (2 MiB pages where it can),
    copied from its end a chunk at a time, each chunk's pages freed from the file once copied:
    the two never hold the whole shard at once."""
    m = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    view, chunk, end = memoryview(m), 64 << 20, size
    while end > 0:
        start = max(0, end - chunk)
        at = start
        while at < end:
            n = os.preadv(fd, [view[at:end]], at)
            if n <= 0:
                raise RuntimeError("the cold executor's shard file ended early")
            at += n
        os.ftruncate(fd, start)
        end = start
    view.release()
    return m
