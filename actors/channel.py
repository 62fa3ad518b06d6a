"""The data plane: one-writer shared-memory channels with sequence numbers.

A channel is one file in /dev/shm mapped by its writer and its readers:

    [0:8)     seq      messages published so far (the futex word is its low half)
    [8:16)    pid      the writer's process id (readers check it is alive while they wait)
    [16:24)   closed   set by the group to stop every waiter
    [24:128)  words    up to 13 int64 words describing the message
    [128:)    payload  tensors, each at a 64-byte aligned offset

The writer copies the payload, stores the words, then bumps `seq` and wakes sleepers with a
futex on the same word; a reader spins on `seq` for `spin_us` and then sleeps in the futex.
The spin yields the core on every turn (`sched_yield`): a process that shares the core (the
scheduler on the hot executor's, Ray's own threads) runs at once instead of after a time slice,
and a core with nothing else to run keeps the reader awake, so a message that arrives within the
spin is read in microseconds rather than after the wake-up of a sleeping CPU (tens of
microseconds on a VM; the hot executor's attention between two layers outlasts a short spin).
Readers use the payload in place (no copy). A compiled step sends and receives through the kernel
library's `ch_send`/`ch_recv`, which do the same from C++ over the same mapping (`base`) and the
reader's `state` ([messages consumed, nanoseconds waited], shared with this class). Channels
carry no acknowledgement: every use in the runtime is lockstep (a writer publishes message n+1
only after a reply that proves its readers are done with message n), so one buffer per channel is
enough. torch is imported only when a tensor is asked for (`view`, `put`, `state`): a token
ring's reader (the Serve ingress) maps its channel without it.

Ordering: the payload is stored before `seq`, and x86 keeps stores in order (TSO); a weaker
memory model would need a release fence before the bump.

Segments are created by the group's owner under /dev/shm/powerinfer-<owner pid>-<group>-<name>,
and their names are unlinked as soon as every actor has mapped them: from then on a crash
anywhere leaves nothing behind. `sweep()` removes segments of owners that died during setup.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "powerinfer-"
HEADER = 128
WORDS = 13
ALIGN = 64

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}[platform.machine()]
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word lives in a shared mapping


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_DOZE = _Timespec(0, 50_000_000)  # a futex wait's limit (`Channel.doze`)


class ChannelClosed(Exception):
    """The group closed the channel (shutdown)."""


class PeerDied(Exception):
    """The process writing a channel died while a reader waited on it."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def segment_path(owner: int, group: str, name: str) -> Path:
    return SHM_DIR / f"{PREFIX}{owner}-{group}-{name}"


def create(path: Path, capacity: int):
    """Create a zeroed segment of HEADER + capacity bytes (tmpfs allocates pages on first touch)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, HEADER + capacity)
    finally:
        os.close(fd)


def sweep() -> list[Path]:
    """Unlink segments whose owning process is gone; returns what was removed."""
    removed = []
    for p in SHM_DIR.glob(PREFIX + "*"):
        try:
            owner = int(p.name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(owner):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def native_error(e: Exception) -> Exception | None:
    """The ChannelClosed or PeerDied a native receive (`ch_recv`) raised as a RuntimeError, or
    None for any other error."""
    text = str(e)
    if "channel closed" in text:
        return ChannelClosed("the group closed a channel")
    if "peer died: " in text:
        return PeerDied(text.split("peer died: ", 1)[1].splitlines()[0])
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; it only waits to be reaped
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Channel:
    """One end of a channel. `writer=True` marks the process that publishes on it."""

    def __init__(self, path: Path, writer: bool = False, spin_us: float = 50.0):
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.capacity, self.spin = path, size - HEADER, spin_us * 1e-6
        self._hdr = np.frombuffer(self._map, dtype=np.int64, count=HEADER // 8)
        self._addr = self._hdr.ctypes.data
        self._views: dict[tuple, torch.Tensor] = {}  # building a view costs ~7 us; reuse them
        # [messages consumed (reader) or published (writer), nanoseconds waited]; segments start
        # fresh
        self._st = np.zeros(2, np.int64)
        self.spin_us = spin_us
        if writer:
            self._hdr[1] = os.getpid()

    @functools.cached_property
    def state(self) -> torch.Tensor:
        """`_st` as a tensor (the same memory), which the native ops update too."""
        import torch
        return torch.from_numpy(self._st)

    @functools.cached_property
    def _bytes(self) -> torch.Tensor:
        import torch
        return torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER)

    @property
    def base(self) -> int:
        """The mapping's address in this process (the native ops' handle on it)."""
        return self._addr

    @property
    def seen(self) -> int:
        return int(self._st[0])

    @property
    def wait_s(self) -> float:
        """Time spent waiting for messages, for stats."""
        return float(self._st[1]) * 1e-9

    # writer side
    def put(self, t, offset: int = 0, non_blocking: bool = False) -> int:
        """Copy t (a tensor, or a numpy array: a process without torch) into the payload at
        offset; returns the next aligned offset. non_blocking: a device tensor's copy queued on
        its stream (the writer synchronizes before it publishes)."""
        array = isinstance(t, np.ndarray)
        n = t.nbytes if array else t.numel() * t.element_size()
        assert offset % ALIGN == 0 and offset + n <= self.capacity, (offset, n, self.capacity)
        if array:
            self.array(t.dtype, t.shape, offset)[...] = t
        else:
            self.view(t.dtype, t.shape, offset).copy_(t, non_blocking=non_blocking)
        return align(offset + n)

    def put_bytes(self, data: bytes, offset: int = 0) -> int:
        import torch
        return self.put(torch.frombuffer(bytearray(data), dtype=torch.uint8), offset) if data else offset

    def publish(self, *words: int, wake: bool = True):
        """Stores the message's words and bumps `seq`; wakes the readers asleep on it unless
        `wake` is false (a reader that said it sleeps out a while, `tokens.TokenRing`: it reads
        the message when it wakes on its own)."""
        assert len(words) <= WORDS, words
        self._hdr[3:3 + len(words)] = words
        n = int(self._hdr[0]) + 1  # the writer alone counts; a native send may have too
        self._st[0] = n
        self._hdr[0] = n
        if wake:
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    # reader side
    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until the next message; returns its words (a view, valid until the next one)."""
        target, hdr = int(self._st[0]) + 1, self._hdr
        t0 = time.perf_counter()
        if hdr[0] < target:
            end, clock, yield_ = t0 + self.spin, time.perf_counter, os.sched_yield
            while hdr[0] < target and clock() < end:
                yield_()
            if hdr[0] < target:
                self._sleep(target, t0, timeout)
        self._st[1] += int((time.perf_counter() - t0) * 1e9)
        assert hdr[0] == target, (self.path.name, int(hdr[0]), target)  # lockstep: none skipped
        self._st[0] = target
        return hdr[3:3 + WORDS]

    def doze(self, seen: int, timeout: float | None = None):
        """Sleep while the count of messages published is `seen` (a futex wait on it), for at
        most 50 ms (or `timeout` seconds): a waiter's turn to look at anything else (its peer's
        liveness)."""
        limit = _DOZE if timeout is None else _Timespec(int(timeout), int(timeout % 1 * 1e9))
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr), _FUTEX_WAIT,
                      ctypes.c_uint32(seen & 0xFFFFFFFF), ctypes.byref(limit), None, 0)

    def _sleep(self, target: int, t0: float, timeout: float | None):
        hdr = self._hdr
        slept = False
        while hdr[0] < target:
            if hdr[2]:
                raise ChannelClosed(self.path.name)
            pid = int(hdr[1])
            # the writer's liveness is read from /proc (~40 us): only once a wait has run long
            if slept and pid and not pid_alive(pid):
                raise PeerDied(f"the process writing {self.path.name.split('-', 3)[-1]} "
                               f"(pid {pid}) died")
            if timeout is not None and time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"no message on {self.path.name} within {timeout:.1f} s")
            self.doze(target - 1)  # re-check liveness every 50 ms
            slept = True

    def view(self, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
        """The payload at offset as a tensor of dtype and shape (no copy)."""
        key = (dtype, tuple(shape), offset)
        v = self._views.get(key)
        if v is None:
            size = dtype.itemsize * int(np.prod(shape))
            v = self._views[key] = self._bytes[offset:offset + size].view(dtype).view(shape)
        return v

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        """The payload at offset as a numpy array of dtype and shape (no copy), as `view` gives
        a tensor."""
        dtype = np.dtype(dtype)
        key = ("numpy", dtype, tuple(shape), offset)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = np.frombuffer(self._map, dtype, int(np.prod(shape)),
                                                 HEADER + offset).reshape(shape)
        return v

    def close_all(self):
        """Mark the channel closed and wake its readers (group shutdown)."""
        self._hdr[2] = 1
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def register_with_cuda(self):
        """Page-lock this mapping for the current CUDA device (cudaHostRegister), so that copies
        between it and device memory are DMA transfers, asynchronous when asked."""
        if getattr(self, "_cuda_registered", False):
            return
        import torch
        err = int(torch.cuda.cudart().cudaHostRegister(self._addr, len(self._map), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {self.path.name} failed with CUDA error {err}")
        self._cuda_registered = True

    def release(self):
        """Drop this process's mapping (the views into it must be gone)."""
        if getattr(self, "_cuda_registered", False):
            import torch
            torch.cuda.cudart().cudaHostUnregister(self._addr)
            self._cuda_registered = False
        del self._hdr, self._views
        self.__dict__.pop("_bytes", None)
        try:
            self._map.close()
        except BufferError:  # a payload view is still alive; process exit releases it
            pass
