"""Predictor actor: owns the bundle's predictors and answers each decode layer's input with the
per-row masks of the neurons predicted to fire (PowerInfer's rule, logits >= 0).

Where it shares the hot executor's GPU (`PlaneSpec.device_predictor`) it runs there, reading
its input from and writing the masks to device buffers the hot executor allocated
(`device_buffers`, CUDA IPC), and copies the masks to the host for the cold executors.

In lookahead mode its input is the layer input, sent before attention, so the masks are computed
while the hot executor runs attention; in same-layer mode it is the residual entering the FFN,
and the hot executor waits for it. `stats()` reports how long the hot side waited for masks.
"""
from __future__ import annotations

import os
import time

import torch

from cluster.topology import pin, process_memory
from powerinfer.plan import SparsePlan
from powerinfer.predictor import run_dtype

from .group_info import node_id
from .channel import ChannelClosed
from .plane import STOP, Masks, PlaneSpec, PredictorInput, receive, send


class PredictorActor:
    def __init__(self, spec: PlaneSpec, cores: tuple[int, ...], plan: SparsePlan, threads: int = 0):
        pin(cores, threads)
        self.spec, self.cores = spec, cores
        # on the hot executor's GPU where it shares it (`spec.device_predictor`), else the host
        self.device = torch.device("cuda" if spec.device_predictor else "cpu")
        # the dtype the in-process engine runs them in on the same device: the same masks
        self.preds = plan.load_predictors(run_dtype(spec.torch_dtype, self.device), self.device)
        self.input = self.preds.input
        self.x, self.mask = spec.open("pred_in"), spec.open("mask", writer=True)
        if self.device.type == "cuda":
            self.mask.register_with_cuda()  # the masks' copy for the cold executors: DMA
        self.buffers = None  # the hot executor's device buffers, once attached
        self.busy_s, self.calls = 0.0, 0

    def ready(self) -> dict:
        return {"cores": list(self.cores), "input": self.input, "ranks": self.preds.ranks,
                "device": str(self.device), "pid": os.getpid(), "node_id": node_id()}

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

    @torch.inference_mode()
    def run(self) -> str:
        try:
            while True:
                got = receive(self.x, PredictorInput)
                if got.op == STOP:
                    return "stopped"
                t0 = time.perf_counter()
                # the host copy (synchronous from a device: the reads of pred_in are done
                # before the answer lets the hot executor write it again)
                self.mask.put(self._predict(got))
                send(self.mask, Masks(got.layer, got.B))
                self.busy_s += time.perf_counter() - t0
                self.calls += 1
        except ChannelClosed:
            return "closed"

    def stats(self) -> dict:
        out = {"input": self.input, "device": str(self.device), "busy_s": self.busy_s,
               "wait_s": self.x.wait_s, "calls": self.calls, "memory": process_memory()}
        if self.device.type == "cuda":  # its matrices on the GPU, beside the hot executor's
            out["device_bytes"] = torch.cuda.memory_allocated()
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        return out
