"""Cold-neuron executor: owns one shard of every layer's cold neurons and returns partial sums.

Pinned to its core set first, then reads its rows from the model file, and only those
(`partial.read_neuron_set`: gate/up rows and rows of the transposed down matrix, copied into its
own memory, so first touch puts them on its NUMA node), as the CPU kernel's neuron-major
records: in the model's precision, or in the file's 4-bit blocks with weights "int4". Per message on `x`: prefill computes every neuron of the shard (dense); decode
computes the neurons active in any row and keeps, per row, the ones that row's predictor chose
(`sparse.decode_rows`, the in-process engine's operator, on the kernel).

Where the group splits attention (a CPU group, `plane.splits_attention`, `plane.split_kv`), it also
holds, per layer, the attention of its KV heads and their query heads (`partial.attention_slice`)
with their paged KV cache (the same block ids as every other executor's), and answers each ATTN
message with their share of the output projection.

Where the kernel library runs, the messages that need no Python (decode steps of the layers
held as block slices or neuron records, with a predictor's masks or without, of its heads, and
of the head's rows) are answered by its `cold_serve` loop, in C++ from one wait to the next; it
hands back the first message that needs Python (a prompt's rows in other layouts, STOP). A
layer's answer then costs its matrix products and the hand-off, not a dozen Python calls.
With lookahead masks (the predictor reads the layer's input, before attention), that loop
watches the predictor's `mask` channel while it waits and warms the records a layer's masks
select into its caches before the FFN input arrives: the hot side's attention hides the
reads, and the step's answer computes from the caches.
"""
from __future__ import annotations

import faulthandler
import os
import time

import torch

from cluster.topology import node_of, numa_pages, pin, process_memory
from powerinfer import kernels
from powerinfer.compat import trim_heap
from powerinfer.formats.source import ModelFile
from powerinfer.model.transformer import KVCache, KVTables, held_bytes, host_parts, rope_tables
from powerinfer.engine.partial import attention_slice, read_head, read_neuron_set
from powerinfer.engine.plan import SparsePlan
from powerinfer.engine.native import (NO_ATTENTION, NO_FFN, attention_entry, ffn_entry, input_sparse_args,
                                     runs)
from powerinfer.model.quant import KQuantLinear, neuron_format
from powerinfer.model.sparse import BlockSlice, decode_rows, ffn_w1
from powerinfer.sparsity.input_sparsity import attach_parts

from .group_info import node_id
from .channel import native_error
from .plane import (ATTN, DECODE, HEAD, PREFILL, Answering, FFNInput, Partial, PlaneSpec, head_ranges, receive,
                    send, split_kv)


class ColdExecutorImpl(Answering):
    def __init__(self, spec: PlaneSpec, rank: int, cores: tuple[int, ...], model: ModelFile,
                 plan: SparsePlan, hot_share: float, threads: int = 0, weights: str = "dense",
                 head: bool = True, attention: bool = False):
        faulthandler.enable()  # a native crash (the CPU kernel) leaves its Python stack in the log
        pin(cores, threads)
        kernels.hold(spec.isa)  # the model's instruction-set class
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
        # its KV heads of every layer, where the group splits attention
        self.args, self.attn, self.rope = a, [], None
        kv = split_kv(a.n_kv_heads, spec.n_cold, hot_share, attention)
        self.kv_heads = (0, 0) if kv is None else kv[1 + rank]
        if kv is not None:
            self.attn = [attention_slice(src, a, i, self.kv_heads, dtype, weights == "int4")
                         for i in range(a.n_layers)]
            for m in self.attn:
                m.kv_cache = KVCache(spec.num_blocks, m.n_kv_heads, spec.block_size, m.head_dim,
                                     dtype, "cpu")
            # (global, local) tables: Gemma 3's sliding layers have their own RoPE base; the
            # group's, whose rows the hot executor fills before it sends a step that reads them
            # (its own, whole, where the shared-memory filesystem has no room for them)
            self.rope = spec.rope_tables() or (None if a.learned_pos else rope_tables(a, spec.max_seq))
        # input sparsity: its 4-bit projections read only the input channels over their
        # thresholds in decode steps (its heads' q/k/v and output columns, a dense split's
        # gate+up rows), as the hot executor's do
        self.input_sparse, self.input_stats, self.input_timings = (0, 0), None, []
        if plan.inputs is not None and weights == "int4":
            parts = [(i, p, m) for i, att in enumerate(self.attn) for p, m in (("qkv", att.wqkv), ("o", att.wo))]
            parts += [(i, "gate_up", ffn_w1(s)) for i, s in enumerate(self.sets)]
            taken, small, self.input_stats = attach_parts(parts, *plan.inputs,
                                                          timings=self.input_timings)
            self.input_sparse = (taken, small)
        src.close()
        trim_heap()  # the load's transients, freed, stay resident otherwise
        self.load_s = time.perf_counter() - t0
        self.load_cpu_s = time.process_time() - c0  # without the time other processes took
        self.neurons = sum(len(s.idx) for s in self.sets)
        self.x, self.part = spec.open("x"), spec.open(f"part.{rank}", writer=True)
        # the predictor's masks, watched (never consumed: the hot executor is their reader) where
        # they come out before attention (lookahead): the records they select are warmed while
        # the hot side attends (`cold_serve`'s `ahead`)
        self.ahead = spec.open("mask") if plan.predictor_input == "layer" and spec.warm_ahead \
            else None
        self.busy_s, self.steps = 0.0, 0
        self.native = self._native_args(a.ffn_act)

    def ready(self) -> dict:
        return {"rank": self.rank, "cores": list(self.cores), "neurons": self.neurons,
                "format": self.fmt or "torch", "pid": os.getpid(), "load_s": self.load_s,
                "isa": kernels.isa(),
                "load_cpu_s": self.load_cpu_s,
                "held_bytes": held_bytes(*self.sets, *self._head(), *self.attn),
                "neuron_bytes": held_bytes(*self.sets),  # the cold neurons' records alone
                "head_rows": self.head_rows, "kv_heads": list(self.kv_heads),
                "head": None if self.head is None else type(self.head).__name__,
                "block_slices": sum(isinstance(s, BlockSlice) for s in self.sets),
                "kquant_matrices": sum(isinstance(m, KQuantLinear) for part in
                                       (*self.sets, *self._head(), *self.attn) for m in part.modules()),
                "native": self.native is not None,
                # layers whose attention steps the native loop answers
                "native_attention": self.native_attention if self.native is not None else 0,
                "native_head": self.native is not None and self.native_head,
                "numa_bytes": numa_pages(),
                "node": node_of(self.cores), "node_id": node_id(),
                "input_sparse": list(self.input_sparse), "input_timings": self.input_timings}

    def _native_args(self, act: str) -> tuple | None:
        """The arguments of the kernel library's `cold_serve` after its state (see there): the
        layers it can answer in C++ (block slices, neuron records without a bias, with a
        predictor's masks or without;
        heads whose projections `native.runs` takes, q/k/v in up to two runs), and its head rows, the
        others' entries empty; None where it can answer nothing."""
        dtype = self.spec.torch_dtype
        if not kernels.available() or dtype not in (torch.float32, torch.bfloat16):
            return None
        ffn = [ffn_entry(s, th) or NO_FFN for s, th in zip(self.sets, self.thresholds)]
        # (the native loop runs one window, one RoPE table and no q/k norms for every layer)
        attn = ([attention_entry(m) or NO_ATTENTION for m in self.attn] if self.args.uniform and self.attn
                else [NO_ATTENTION] * len(self.sets))
        head = runs(self.head) if self.head is not None else None
        head = head[0] if head is not None and len(head) == 1 else None
        self.native_attention = sum(x[0].numel() > 0 for x in attn)
        self.native_head = head is not None
        if (not any(f[2] for f in ffn) and not any(x[0].numel() for x in attn)
                and head is None):
            return None
        n_heads = self.attn[0].n_heads if self.attn else 0
        scale = self.attn[0].scale if self.attn else 1.0
        cos, sin = self.rope[0] if self.rope is not None else (None, None)
        cols = lambda rows, j: [r[j] for r in rows]  # noqa: E731
        return (self.x.base, self.part.base, self.part.capacity, self.spec.dim,
                dtype == torch.bfloat16, self.x.spin_us, [DECODE, HEAD, ATTN, PREFILL],
                kernels.ACTS.index(act), *(cols(ffn, j) for j in range(8)), self.spec.ffn_dim,
                *(cols(attn, j) for j in range(10)), n_heads, cos, sin, self.args.sliding_window,
                scale, *((None, 0, 0) if head is None else head),
                self.ahead.base if self.ahead is not None else 0,
                *input_sparse_args(zip(self.attn or [None] * len(self.sets), self.sets), self.input_stats))

    def _next(self) -> FFNInput:
        """The next message this loop answers in Python (the native loop answers the others)."""
        if self.native is None:
            return receive(self.x, FFNInput)
        seen, waited, t0 = self.x.seen, self.x.wait_s, time.perf_counter()
        try:
            words = torch.ops.powerinfer.cold_serve(self.x.state, *self.native)
        except RuntimeError as e:
            raise (native_error(e) or e) from None
        answered = self.x.seen - seen - 1  # the last one is left to us
        self.steps += answered
        if answered:
            self.busy_s += time.perf_counter() - t0 - (self.x.wait_s - waited)
        return FFNInput(*words)

    def _answer(self, got: FFNInput):
        """One message: its rows of the logits (HEAD), its heads' share of a layer's attention
        (ATTN), or its neurons' share of a layer's FFN (decode rows with or without masks, a
        prompt's rows), on `part`."""
        spec, ffn_dim = self.spec, self.spec.ffn_dim
        if got.op == HEAD:  # its rows of the logits, for the rows the hot side sent
            if self.head is not None:  # (an empty range among several: nothing to put)
                x = self.x.view(spec.torch_dtype, (got.B, spec.dim))
                self.part.put(self.head(x).float())
            send(self.part, Partial(-1, got.B))
            return
        B, T = got.B, got.T
        if got.op == ATTN:  # its heads' share of the attention output
            S, at = got.extra, spec.attn_layout(B * T, got.extra)
            pos = self.x.view(torch.int64, (B * T,), at.positions)
            kv = KVTables(self.x.view(torch.int64, (S + 1,), at.starts),
                          self.x.view(torch.int32, (S, got.width), at.tables))
            rope = None if self.rope is None else tuple(
                t[pos] for t in self.rope[self.args.local(got.layer)])
            y = self.attn[got.layer](self.x.view(spec.torch_dtype, (B, T, spec.dim)), rope, pos, kv)
        else:
            x = self.x.view(spec.torch_dtype, (B, T, spec.dim))
            s = self.sets[got.layer]
            if T == 1:  # decode (and one-token prompts), as the in-process HybridFFN
                off = spec.mask_offset(B * T)
                rows = self.x.view(torch.bool, (B, ffn_dim), off) if got.extra else None
                union = rows.any(0) if got.extra else None  # None: every neuron
                y = decode_rows(s, x, union, rows, self.thresholds[got.layer])
            else:
                y = s(x)
        self.part.put(y.float())
        send(self.part, Partial(got.layer, B * T))
        self.steps += 1

    def loop_profile(self, mode: str = "read") -> dict:
        """This process's native loop by phase (`kernels.loop_profile`: "start", "read", "stop"),
        a diagnostic: how long its answers take and how long it waits for the next message."""
        return kernels.loop_profile(mode)

    def stats(self) -> dict:
        out = {"rank": self.rank, "busy_s": self.busy_s, "wait_s": self.x.wait_s,
               "messages": self.steps, "neurons": self.neurons, "memory": process_memory(),
               "held_bytes": held_bytes(*self.sets, *self._head()),
               **host_parts(*self.sets, *self._head(), *self.attn)}
        if self.input_stats is not None:
            out["input_sparse_stats"] = [int(self.input_stats[0]), int(self.input_stats[1])]
        return out

    def _head(self) -> list:
        return [] if self.head is None else [self.head]
