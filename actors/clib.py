"""The kernel library's torch-free build (`kernels.lite_path`) as the actors that run without
torch (`cold_native`, `pred_native`, `hot_native`) load and call it: its C entry points through ctypes
(csrc/capi.h), and the load of what such an actor holds, which a child process with torch does
(`actors.pack`) and hands over in a memory file."""
from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import pickle
import resource
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

from cluster.topology import pin_threads
from powerinfer.compat import on_idle, resident, trim_heap

from . import shard_cache
from .packed import Mapped, Packed, Slot, Zeros

# numpy's type for each of `packed.DTYPES` (bfloat16 held as uint16)
NP = (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.uint16, np.float32, np.bool_)


class Arr(NamedTuple):
    """A tensor argument: a numpy array and its element type (a code of DTYPES)."""
    array: np.ndarray
    dtype: int


# ---- the library's C entry points (csrc/capi.h) ----

# A torch-free role's process gives back the blocks its steps kept (`pilite::BlockCache`) once
# it has been idle this long (under 5% of a core over the period: its group has no step to run;
# an idle executor takes 1-1.5%, waking to look at its channels)
IDLE_RELEASE_S, IDLE_CPU_SHARE = 10.0, 0.05

PI_INT, PI_FLOAT, PI_TENSOR, PI_NONE, PI_TENSORS, PI_INTS, PI_FLOATS = range(7)


class PiArg(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("i", ctypes.c_int64), ("f", ctypes.c_double),
                ("data", ctypes.c_void_p), ("ndim", ctypes.c_int64),
                ("shape", ctypes.c_int64 * 4), ("strides", ctypes.c_int64 * 4)]


class PiArgs:
    """Arguments as the C entry points read them (`pi_cold_serve`, `pi_pred_serve`), built once
    (the arrays they point at are kept)."""

    def __init__(self, values: tuple):
        self.keep: list = []
        self.array = (PiArg * len(values))(*(self._one(v) for v in values))

    def set(self, i: int, v):
        """Argument i replaced by v (a step's own: the arrays it points at are the caller's to
        keep alive through the call, and nothing is kept here)."""
        n = len(self.keep)
        self.array[i] = self._one(v)
        del self.keep[n:]

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
        lib.pi_pred_serve.argtypes = lib.pi_cold_serve.argtypes
        lib.pi_pred_serve.restype = ctypes.c_int64
        lib.pi_hot_step.argtypes = [ctypes.POINTER(PiArg), ctypes.c_int64, ctypes.c_char_p,
                                    ctypes.c_int64]
        lib.pi_hot_step.restype = ctypes.c_int64
        self.err = ctypes.create_string_buffer(4096)
        for f in (lib.pi_isa, lib.pi_best_isa):
            f.argtypes, f.restype = [ctypes.c_char_p, ctypes.c_int64], None
        lib.pi_use_isa.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64]
        lib.pi_use_isa.restype = ctypes.c_int64
        lib.pi_set_threads.argtypes, lib.pi_set_threads.restype = [ctypes.c_int64], None
        lib.pi_loop_profile.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
        lib.pi_loop_profile.restype = ctypes.c_int64
        lib.pi_blocks.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
        lib.pi_blocks.restype = ctypes.c_int64

    @classmethod
    def started(cls, got: dict, cores, threads: int) -> "Library":
        """The build a loading child named (`got`: its `pack` report), at the child's
        instruction-set class, the calling thread's loops on `threads` of `cores` (0: all), as
        `cluster.topology.pin` sizes torch's."""
        lib = cls(got["library"])
        lib.use_isa(got["isa"])
        lib.set_threads(min(threads, len(cores)) if threads else len(cores))
        mib = os.environ.get("POWERINFER_KEPT_BLOCKS_MIB", "")
        if mib:  # (the kept blocks' cap; 0: none kept, every block freed as it was)
            lib.lib.pi_blocks(2, (ctypes.c_int64 * 4)(int(float(mib) * (1 << 20))))
        on_idle(IDLE_RELEASE_S, lib.release_blocks, IDLE_CPU_SHARE)
        return lib

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
        return self._serve(self.lib.pi_cold_serve, args, 6)

    def pred_serve(self, args: PiArgs) -> list[int]:
        """`pred_serve` (csrc/ops.cpp), as `cold_serve`: the words of the message it leaves."""
        return self._serve(self.lib.pi_pred_serve, args, 3)

    def hot_step(self, args: PiArgs):
        """`hot_step` (csrc/ops.cpp): one step of a hot executor, its logits written where its
        arguments say; a RuntimeError with the library's text for its errors."""
        if self.lib.pi_hot_step(args.array, len(args.array), self.err, 4096):
            raise RuntimeError(self.err.value.decode(errors="replace"))

    @staticmethod
    def _serve(fn, args: PiArgs, n_words: int) -> list[int]:
        words, err = (ctypes.c_int64 * n_words)(), ctypes.create_string_buffer(4096)
        if fn(args.array, len(args.array), words, err, 4096):
            raise RuntimeError(err.value.decode(errors="replace"))
        return list(words)

    def blocks(self) -> dict:
        """The blocks the library keeps for its steps' tensors (`pilite::BlockCache`): bytes
        kept now, the cap, blocks taken from them, blocks made anew."""
        out = (ctypes.c_int64 * 4)()
        self.lib.pi_blocks(0, out)
        return dict(zip(("kept_bytes", "cap_bytes", "reused", "made"), out))

    def release_blocks(self) -> int:
        """Frees the kept blocks, and gives the heap's free pages back to the system (an
        idle process's, `IDLE_RELEASE_S`); returns the bytes the blocks held."""
        n = self.lib.pi_blocks(1, (ctypes.c_int64 * 4)())
        trim_heap()
        return n

    def loop_profile(self, mode: int) -> list[int]:
        out = (ctypes.c_int64 * 64)()
        n = self.lib.pi_loop_profile(mode, out, 64)
        return list(out[:min(n, 64)])


# ---- the load ----

class Loaded(NamedTuple):
    """What the loading child said (`got`: the role's `pack` report) and the memory its tensors
    now live in, this process's own; the load's seconds, wall and CPU (the child's included)."""
    got: dict
    memory: mmap.mmap
    load_s: float
    load_cpu_s: float


def load(role: str, kwargs: dict, cores, name: str, what: str) -> Loaded | str:
    """`role` (MODULE:CLASS, built with `kwargs` and packing=True) loaded by a child process
    (`run_child`), its tensors copied into memory of this process's own, pinned to `cores` first
    (first touch puts them on its NUMA node); or the child's word on why the role must run with
    torch. `name` names the memory file, `what` the load in errors."""
    faulthandler.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    pin_threads(cores)  # (the child inherits it; the memory below is touched here first)
    entry = shard_cache.key(role, kwargs)
    hit = shard_cache.fetch(entry)
    if hit is not None:  # (what a child packed for the same shard before)
        got, memory = hit
        if "why" in got:
            return got["why"]
        got = {**got, "cached": True}
        if "cores" in got.get("ready", {}):
            got["ready"] = {**got["ready"], "cores": list(cores)}
    else:
        fd = os.memfd_create(f"powerinfer-{name}", os.MFD_CLOEXEC)
        try:
            got = run_child(fd, kwargs, role, what)
            if "why" not in got:
                memory = copy_out(fd, got["size"], what)
        finally:
            os.close(fd)
        shard_cache.store(entry, got, None if "why" in got else memory, got.get("size", 0))
        if "why" in got:
            return got["why"]
        got["cached"] = False
    trim_heap()  # (the child's report and its unpickling, freed)
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - c0 + (child1.ru_utime - child0.ru_utime) + \
        (child1.ru_stime - child0.ru_stime)
    return Loaded(got, memory, time.perf_counter() - t0, cpu)


# the model files this process maps (`Mapped` tensors), each once, kept for its life
_FILES: dict[str, mmap.mmap] = {}


def mapped_file(path: str) -> mmap.mmap:
    """The file's read-only map in this process (one a file)."""
    if path not in _FILES:
        with open(path, "rb") as f:
            _FILES[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _FILES[path]


def unpack(v, memory: mmap.mmap, slots: dict, zeros: list, mapped: list):
    """A packed argument as the C entry points take it: a `Packed` tensor viewed in `memory`, a
    `Mapped` one in its file's map (kept in `mapped`: what the caller holds of its model beside
    its memory file), a `Zeros` allocated (and kept in `zeros`), a `Slot` from `slots`; lists
    walked."""
    if isinstance(v, Slot):
        return slots[str(v)]
    if isinstance(v, Packed):
        n = int(np.prod(v.shape))
        return Arr(np.frombuffer(memory, NP[v.dtype], n, v.offset).reshape(v.shape), v.dtype)
    if isinstance(v, Mapped):
        m, n = mapped_file(v.path), int(np.prod(v.shape))
        if v.offset + n * np.dtype(NP[v.dtype]).itemsize > len(m):
            raise ValueError(f"{v.path} is shorter than when it was loaded (a tensor at "
                             f"{v.offset} past its {len(m)} bytes): load the model again")
        a = np.frombuffer(m, NP[v.dtype], n, v.offset).reshape(v.shape)
        mapped.append(a)
        return Arr(a, v.dtype)
    if isinstance(v, Zeros):  # (calloc's fresh pages: resident as they are written)
        a = np.zeros([slots[d] if isinstance(d, Slot) else d for d in v.shape], NP[v.dtype])
        zeros.append(a)
        return Arr(a, v.dtype)
    if isinstance(v, list):
        return [unpack(x, memory, slots, zeros, mapped) for x in v]
    return v


def address(m: mmap.mmap) -> int:
    return np.frombuffer(m, np.uint8, 1).ctypes.data if len(m) else 0


def held(memory: mmap.mmap, mapped: list, kv: list) -> dict:
    """What a torch-free actor holds: its weights (its memory file, and the tensors it reads in
    the model file's pages, counted as the torch executors count their mapped tensors: whole,
    resident as read) and its KV arrays, in bytes and in bytes resident."""
    return {"weight_bytes": len(memory) + sum(a.nbytes for a in mapped),
            "kv_bytes": sum(a.nbytes for a in kv),
            "weight_resident": resident(address(memory), len(memory))
            + sum(resident(a.ctypes.data, a.nbytes) for a in mapped),
            "kv_resident": sum(resident(a.ctypes.data, a.nbytes) for a in kv)}


def run_child(fd: int, kwargs: dict, role: str, what: str) -> dict:
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
        raise RuntimeError(f"loading the {what} failed (exit status {run.returncode}; its error "
                           "is in this actor's log)") from None
    if "error" in got:
        raise got["error"]
    return got


def copy_out(fd: int, size: int, what: str) -> mmap.mmap:
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
                raise RuntimeError(f"the {what}'s memory file ended early")
            at += n
        os.ftruncate(fd, start)
        end = start
    view.release()
    return m
