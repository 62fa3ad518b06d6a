"""Device buffers that two actors on one GPU share through CUDA IPC (CuPy's runtime bindings).

Where the predictor shares the hot executor's GPU, the decode layer's predictor input and the
predicted masks stay in device memory instead of crossing the host:

    buffer     written by           read by
    pred_in    hot executor         predictor      (B, dim) float32: the layer input
    mask       predictor            hot executor   (B, ffn_dim) bool: the masks

The host channels still carry the messages (`plane.PredictorInput`, `plane.Masks`), and the
masks' host copy, which the cold executors read; only the payloads above move off them.

The hot executor allocates each buffer with a plain cudaMalloc (`cupy.cuda.runtime.malloc`,
never a memory pool: an IPC handle names a whole allocation, not a piece of a pooled one) and
exports its handle; the predictor opens it (`ipcOpenMemHandle`). Both see it as a torch tensor
(`__cuda_array_interface__`, no copy). Each buffer has an interprocess event: its writer records
the event on its stream after the writes (`publish`) and then publishes on the host channel; its
reader makes its stream wait for the event (`consume`) before reading: the order is kept on the
device, with no CPU waiting for it. (The predictor's copy of the masks to the host, which the
cold executors need, is synchronous: its CPU waits there for the hot executor's stream to
reach the input, and for its own kernels.) A writer rewrites a buffer only after its reader has
answered the message that used it, and that answer comes after the reader's stream was done with
the buffer (the predictor's answer follows its synchronous copy of the masks to the host; the hot
executor's next input is recorded behind the layer that read the masks): one buffer each is
enough, as on the host channels.
"""
from __future__ import annotations

import torch

try:  # the GPU extra
    import cupy
    from cupy.cuda import runtime as _rt
    _WHY = ""
except ImportError as e:  # CPU installs; or a CuPy built for another CUDA
    cupy = _rt = None
    _WHY = f"{type(e).__name__}: {e}"

ALIGN = 256  # cudaMalloc's own alignment; every view starts on it


def available() -> bool:
    """CuPy imports and sees a CUDA device."""
    if cupy is None:
        return False
    try:
        return _rt.getDeviceCount() > 0
    except Exception:  # no driver
        return False


class _Raw:
    """A device pointer as `__cuda_array_interface__` (torch wraps it without a copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


class DeviceBuffer:
    """One shared device buffer and its event. `DeviceBuffer(nbytes)` allocates (the owner);
    `DeviceBuffer.open(handle)` maps the owner's (a peer on the same GPU)."""

    def __init__(self, nbytes: int, *, _opened: tuple | None = None):
        if cupy is None:
            raise RuntimeError(f"device buffers need CuPy (the gpu extra: pip install "
                               f"'powerinfer[gpu]'), which did not import ({_WHY}); "
                               f"Config(predictor_device='cpu') keeps the predictor off the GPU")
        self.device = torch.cuda.current_device()
        flags = _rt.eventDisableTiming | _rt.eventInterprocess
        if _opened is None:
            self.nbytes, self.owner = int(nbytes), True
            self.ptr = _rt.malloc(max(self.nbytes, 1))
            self.event = _rt.eventCreateWithFlags(flags)
        else:
            mem, ev, self.nbytes = _opened
            self.owner = False
            self.ptr = _rt.ipcOpenMemHandle(mem)
            self.event = _rt.ipcOpenEventHandle(ev)
        dev = torch.device("cuda", self.device)
        self._bytes = torch.as_tensor(_Raw(self.ptr, self.nbytes), device=dev)
        self._views: dict[tuple, torch.Tensor] = {}

    @classmethod
    def open(cls, handle: tuple) -> "DeviceBuffer":
        return cls(0, _opened=handle)

    def handle(self) -> tuple:
        """(memory handle, event handle, bytes): what a peer opens; picklable."""
        assert self.owner, "only the allocating process exports a buffer"
        return (_rt.ipcGetMemHandle(self.ptr), _rt.ipcGetEventHandle(self.event), self.nbytes)

    def view(self, dtype: torch.dtype, shape) -> torch.Tensor:
        """The buffer's first bytes as a tensor of dtype and shape (no copy)."""
        key = (dtype, tuple(shape))
        v = self._views.get(key)
        if v is None:
            n = dtype.itemsize * int(torch.Size(shape).numel())
            assert n <= self.nbytes, (n, self.nbytes)
            v = self._views[key] = self._bytes[:n].view(dtype).view(shape)
        return v

    def publish(self):
        """After this process queued its writes: record the event on its current stream."""
        _rt.eventRecord(self.event, torch.cuda.current_stream().cuda_stream)

    def consume(self):
        """Before this process reads: its current stream waits for the peer's last record."""
        _rt.streamWaitEvent(torch.cuda.current_stream().cuda_stream, self.event, 0)

    def close(self):
        if self.ptr is None:
            return
        self._views.clear()
        self._bytes = None
        torch.cuda.synchronize(self.device)
        if self.owner:
            _rt.free(self.ptr)
        else:
            _rt.ipcCloseMemHandle(self.ptr)
        _rt.eventDestroy(self.event)
        self.ptr = None


def predictor_buffers(batch: int, dim: int, ffn_dim: int) -> dict[str, DeviceBuffer]:
    """The hot executor's two buffers for `batch` rows (see the module's text). The peer closes
    its mappings first (or exits); the owner frees them when it exits."""
    def size(n):
        return (n + ALIGN - 1) // ALIGN * ALIGN
    pred_in = DeviceBuffer(size(batch * dim * 4))
    try:
        return {"pred_in": pred_in, "mask": DeviceBuffer(size(batch * ffn_dim))}
    except BaseException:
        pred_in.close()
        raise
