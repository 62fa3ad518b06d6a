"""Predictor actor: owns the bundle's predictors and answers each decode layer's input with the
per-row masks of the neurons predicted to fire (PowerInfer's rule, logits >= 0).

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
        self.preds = plan.load_predictors(run_dtype(spec.torch_dtype))  # as the in-process engine
        self.input = self.preds.input
        self.x, self.mask = spec.open("pred_in"), spec.open("mask", writer=True)
        self.busy_s, self.calls = 0.0, 0

    def ready(self) -> dict:
        return {"cores": list(self.cores), "input": self.input, "ranks": self.preds.ranks,
                "pid": os.getpid(), "node_id": node_id()}

    @torch.inference_mode()
    def run(self) -> str:
        try:
            while True:
                got = receive(self.x, PredictorInput)
                if got.op == STOP:
                    return "stopped"
                t0 = time.perf_counter()
                x = self.x.view(torch.float32, (got.B, self.spec.dim))
                self.mask.put(self.preds.active(got.layer, x))
                send(self.mask, Masks(got.layer, got.B))
                self.busy_s += time.perf_counter() - t0
                self.calls += 1
        except ChannelClosed:
            return "closed"

    def stats(self) -> dict:
        return {"input": self.input, "busy_s": self.busy_s, "wait_s": self.x.wait_s,
                "calls": self.calls, "memory": process_memory()}
