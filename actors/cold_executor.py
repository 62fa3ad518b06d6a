"""Cold-neuron executor: owns one shard of every layer's cold neurons and returns partial sums.

Pinned to its core set first, then reads its rows from the model file, and only those
(`partial.read_neuron_set`: gate/up rows and rows of the transposed down matrix, copied into its
own memory, so first touch puts them on its NUMA node), as the CPU kernel's neuron-major
records: in the model's precision, or in the file's 4-bit blocks with weights "int4". Per message on `x`: prefill computes every neuron of the shard (dense); decode
computes the neurons active in any row and keeps, per row, the ones that row's predictor chose
(`sparse.decode_rows`, the in-process engine's operator, on the kernel).
"""
from __future__ import annotations

import faulthandler
import os
import time

import torch

from cluster.topology import node_of, numa_pages, pin, process_memory
from powerinfer.compat import trim_heap
from powerinfer.loader import ModelFile
from powerinfer.model import held_bytes
from powerinfer.partial import read_head, read_neuron_set
from powerinfer.plan import SparsePlan
from powerinfer.quant import neuron_format
from powerinfer.sparse import BlockSlice, decode_rows

from .group_info import node_id
from .channel import ChannelClosed
from .plane import HEAD, STOP, FFNInput, Partial, PlaneSpec, head_ranges, receive, send


class ColdExecutor:
    def __init__(self, spec: PlaneSpec, rank: int, cores: tuple[int, ...], model: ModelFile,
                 plan: SparsePlan, hot_share: float, threads: int = 0, weights: str = "dense",
                 head: bool = True):
        faulthandler.enable()  # a native crash (the CPU kernel) leaves its Python stack in the log
        pin(cores, threads)
        self.spec, self.rank, self.cores = spec, rank, cores
        t0, c0 = time.perf_counter(), time.process_time()
        a, src, dtype = model.args, model.source, spec.torch_dtype  # the driver's table: no parse
        self.fmt = neuron_format(weights, model.info, torch.empty(0, dtype=dtype))
        self.sets, self.thresholds = [], plan.thresholds
        for i in range(a.n_layers):  # only this shard's rows are read from the file
            cold = ~plan.hot_mask(i, hot_share)
            idx = plan.shards(i, cold, spec.n_cold)[rank]
            self.sets.append(read_neuron_set(src, a, i, idx, self.fmt, dtype,
                                             every_step=plan.predictor_input is None))
        # its rows of the output head: none on a GPU (the hot executor keeps them all), nor where
        # the cold executors share the hot executor's cores (hot_share 1)
        lo, hi = head_ranges(spec.vocab, spec.n_cold, hot_share)[1 + rank] if head else (0, 0)
        self.head = read_head(src, a, lo, hi, dtype, weights == "int4") if hi > lo else None
        self.head_rows = hi - lo
        src.close()
        trim_heap()  # the load's transients, freed, stay resident otherwise
        self.load_s = time.perf_counter() - t0
        self.load_cpu_s = time.process_time() - c0  # without the time other processes took
        self.neurons = sum(len(s.idx) for s in self.sets)
        self.x, self.part = spec.open("x"), spec.open(f"part.{rank}", writer=True)
        self.busy_s, self.steps = 0.0, 0

    def ready(self) -> dict:
        return {"rank": self.rank, "cores": list(self.cores), "neurons": self.neurons,
                "format": self.fmt or "torch", "pid": os.getpid(), "load_s": self.load_s,
                "load_cpu_s": self.load_cpu_s,
                "held_bytes": held_bytes(*self.sets, *self._head()), "head_rows": self.head_rows,
                "block_slices": sum(isinstance(s, BlockSlice) for s in self.sets),
                "numa_bytes": numa_pages(),
                "node": node_of(self.cores), "node_id": node_id()}

    @torch.inference_mode()
    def run(self) -> str:
        """The loop: until STOP or the group closes the channel."""
        spec, ffn_dim = self.spec, self.spec.ffn_dim
        try:
            while True:
                got = receive(self.x, FFNInput)
                if got.op == STOP:
                    return "stopped"
                t0 = time.perf_counter()
                if got.op == HEAD:  # its rows of the logits, for the rows the hot side sent
                    if self.head is not None:  # (an empty range among several: nothing to put)
                        x = self.x.view(spec.torch_dtype, (got.B, spec.dim))
                        self.part.put(self.head(x).float())
                    send(self.part, Partial(-1, got.B, 1))
                    self.busy_s += time.perf_counter() - t0
                    continue
                B, T = got.B, got.T
                x = self.x.view(spec.torch_dtype, (B, T, spec.dim))
                s = self.sets[got.layer]
                if T == 1:  # decode (and one-token prompts), as the in-process HybridFFN
                    off = spec.mask_offset(B * T)
                    rows = self.x.view(torch.bool, (B, ffn_dim), off) if got.masked else None
                    union = rows.any(0) if got.masked else None  # None: every neuron
                    y = decode_rows(s, x, union, rows, self.thresholds[got.layer])
                else:
                    y = s(x)
                self.part.put(y)
                send(self.part, Partial(got.layer, B * T, int(y.dtype == torch.float32)))
                self.busy_s += time.perf_counter() - t0
                self.steps += 1
        except ChannelClosed:
            return "closed"

    def stats(self) -> dict:
        return {"rank": self.rank, "busy_s": self.busy_s, "wait_s": self.x.wait_s,
                "messages": self.steps, "neurons": self.neurons, "memory": process_memory(),
                "held_bytes": held_bytes(*self.sets, *self._head())}

    def _head(self) -> list:
        return [] if self.head is None else [self.head]
