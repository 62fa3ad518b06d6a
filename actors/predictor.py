"""Predictor actor: owns the bundle's predictors and answers each decode layer's input with the
per-row masks of the neurons predicted to fire (PowerInfer's rule, logits >= 0).

Where it shares the hot executor's GPU (`PlaneSpec.device_predictor`) it runs there, reading
its input from and writing the masks to device buffers the hot executor allocated
(`device_buffers`, CUDA IPC), and copies the masks to the host for the cold executors.

In lookahead mode its input is the layer input, sent before attention, so the masks are computed
while the hot executor runs attention; in same-layer mode it is the residual entering the FFN,
and the hot executor waits for it. `stats()` reports how long the hot side waited for masks.

On a CPU where the kernel library runs and every layer's predictor runs on its GEMV
(`Predictors.kernel_format`), the loop is the library's `pred_serve`: each layer's masks in C++
from one wait to the next, the values `Predictors.active` gives.
"""
from __future__ import annotations

import os

import torch

from cluster.topology import pin, process_memory
from powerinfer import kernels
from powerinfer.engine.plan import SparsePlan
from powerinfer.model.predictor import run_dtype
from powerinfer.model.transformer import host_parts

from .group_info import node_id
from .channel import native_error
from .packed import Slot
from .plane import DECODE, Answering, Masks, PlaneSpec, PredictorInput, receive, send


class PredictorImpl(Answering):
    def __init__(self, spec: PlaneSpec, cores: tuple[int, ...], plan: SparsePlan, threads: int = 0,
                 packing: bool = False):
        """packing: load for a torch-free predictor (`pred_native`), which maps no channel here:
        this process is its loading child (`pack` writes what the native loop takes)."""
        pin(cores, threads)
        kernels.hold(spec.isa)  # the model's instruction-set class
        self.spec, self.cores = spec, cores
        # on the hot executor's GPU where it shares it (`spec.device_predictor`), else the host
        self.device = torch.device("cuda" if spec.device_predictor else "cpu")
        # the dtype the in-process engine runs them in on the same device: the same masks
        self.preds = plan.load_predictors(run_dtype(spec.torch_dtype, self.device), self.device)
        self.input = self.preds.input
        self.buffers = None  # the hot executor's device buffers, once attached
        self.busy_s, self.calls = 0.0, 0
        # the native loop's [messages answered, nanoseconds on them], which it adds to as it runs
        self.counts = torch.zeros(2, dtype=torch.int64)
        if packing:
            self.native = self._native_args((Slot("in_base"), Slot("mask_base"),
                                             Slot("mask_capacity"), Slot("spin_us")))
            return
        self.x, self.mask = spec.open("pred_in"), spec.open("mask", writer=True)
        if self.device.type == "cuda":
            self.mask.register_with_cuda()  # the masks' copy for the cold executors: DMA
        self.native = self._native_args((self.x.base, self.mask.base, self.mask.capacity,
                                         self.x.spin_us))

    def _native_args(self, channels: tuple) -> tuple | None:
        """`pred_serve`'s arguments after its state and counts (`channels`: the input's base,
        the masks' base and capacity, the input's spin), where every layer's predictor runs on
        the kernel library's GEMV in one format; else None (the loop runs in Python)."""
        preds, fmts = self.preds, {self.preds.kernel_format(i) for i in range(len(self.preds.fc1))}
        if self.device.type != "cpu" or not kernels.available() or len(fmts) != 1 or None in fmts:
            return None
        rows = [preds.kernel_rows(i) for i in range(len(preds.fc1))]
        in_base, mask_base, capacity, spin_us = channels
        return (in_base, mask_base, capacity, self.spec.dim, spin_us, DECODE,
                [r[0] for r in rows], [r[1] for r in rows], kernels.pred_code(fmts.pop()),
                float(preds.threshold))

    def pack(self, fd: int) -> dict:
        """For a torch-free predictor (`pred_native`, this process its loading child): the native
        loop's arguments with every tensor written into the memory file fd, and what `ready` and
        `stats` say; or {"why": ...} where the loop cannot answer every step."""
        from .pack import pack_args
        if self.native is None:
            return {"why": "its predictors do not all run on the kernel library's GEMV in one "
                           "format (or run on a GPU)"}
        args, end = pack_args(self.native, fd, {})
        return {"args": args, "size": end, "library": kernels.library(lite=True),
                "isa": kernels.isa(), "ready": self._described()}

    def _described(self) -> dict:
        return {"cores": list(self.cores), "input": self.input, "ranks": self.preds.ranks,
                "device": str(self.device), "native": self.native is not None, "isa": kernels.isa()}

    def ready(self) -> dict:
        return {**self._described(), "pid": os.getpid(), "node_id": node_id(), "torch": True,
                "torch_why": getattr(self, "torch_why", "")}

    def _next(self) -> PredictorInput:
        """The next message this loop answers in Python (the native loop answers the others)."""
        if self.native is None:
            return receive(self.x, PredictorInput)
        try:
            words = torch.ops.powerinfer.pred_serve(self.x.state, self.counts, *self.native)
        except RuntimeError as e:
            raise (native_error(e) or e) from None
        return PredictorInput(*words)

    def attach(self, handles: dict) -> bool:
        """Map the hot executor's device buffers (`device_buffers`), before the loop starts."""
        from .device_buffers import DeviceBuffer
        self.buffers = {k: DeviceBuffer.open(h) for k, h in handles.items()}
        return True

    def _predict(self, got: PredictorInput) -> torch.Tensor:
        B, dim = got.B, self.spec.dim
        if self.buffers is None:
            return self.preds.active(got.layer, self.x.view(torch.float32, (B, dim)))
        pred_in, mask = self.buffers["pred_in"], self.buffers["mask"]
        pred_in.consume()  # after the hot executor's copy into it, on the device
        keep = self.preds.active(got.layer, pred_in.view(torch.float32, (B, dim)))
        mask.view(torch.bool, keep.shape).copy_(keep)
        mask.publish()
        return keep

    def _answer(self, got: PredictorInput):
        # the host copy (synchronous from a device: the reads of pred_in are done before the
        # answer lets the hot executor write it again)
        self.mask.put(self._predict(got))
        send(self.mask, Masks(got.layer, got.B))
        self.calls += 1

    def stats(self) -> dict:
        out = {"input": self.input, "device": str(self.device),
               "busy_s": self.busy_s + float(self.counts[1]) * 1e-9, "wait_s": self.x.wait_s,
               "calls": self.calls + int(self.counts[0]), "native": self.native is not None,
               "memory": process_memory(), **host_parts(self.preds)}
        if self.device.type == "cuda":  # its matrices on the GPU, beside the hot executor's
            out["device_bytes"] = torch.cuda.memory_allocated()
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        return out
