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
import sys
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
                                     rms_weight, runs)
from powerinfer.model.quant import KQuantLinear, neuron_format
from powerinfer.model.sparse import BlockSlice, decode_rows, ffn_w1
from powerinfer.sparsity.input_sparsity import attach_parts

from .group_info import node_id
from .sealed import unseal
from .channel import native_error
from .packed import AHEAD, ROPE, Slot
from .plane import (ATTN, DECODE, HEAD, PREFILL, Answering, FFNInput, Partial, PlaneSpec, head_ranges, receive,
                    send, split_kv)


class ColdExecutorImpl(Answering):
    def __init__(self, spec: PlaneSpec, rank: int, cores: tuple[int, ...], model: ModelFile,
                 plan: SparsePlan, hot_share: float, threads: int = 0, weights: str = "dense",
                 head: bool = True, attention: bool = False, packing: bool = False):
        """packing: load for a torch-free executor (`cold_native`), which maps no channel here:
        the KV cache and the channels' addresses are its own (`pack`)."""
        faulthandler.enable()  # a native crash (the CPU kernel) leaves its Python stack in the log
        pin(cores, threads)
        kernels.hold(spec.isa)  # the model's instruction-set class
        model = unseal(model)
        self.spec, self.rank, self.cores, self.packing = spec, rank, cores, packing
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
                                     dtype, "meta" if packing else "cpu")
            # (global, local) tables: Gemma 3's sliding layers have their own RoPE base; the
            # group's, whose rows the hot executor fills before it sends a step that reads them
            # (its own, whole, where the shared-memory filesystem has no room for them)
            self.rope = (ROPE if packing and spec.ropes else spec.rope_tables()) or \
                (None if a.learned_pos else rope_tables(a, spec.max_seq))
        # input sparsity: its 4-bit projections read only the input channels over their
        # thresholds in decode steps (its heads' q/k/v and output columns, a dense split's
        # gate+up rows), as the hot executor's do
        self.input_sparse, self.input_stats, self.input_timings = (0, 0), None, []
        if plan.inputs is not None and weights == "int4":
            parts = [(i, p, m) for i, att in enumerate(self.attn) for p, m in (("qkv", att.wqkv), ("o", att.wo))]
            parts += [(i, "gate_up", ffn_w1(s)) for i, s in enumerate(self.sets)]
            held = held_bytes(*self.sets, *self._head(), *(p for m in self.attn for p in (m.wqkv, m.wo)))
            taken, small, self.input_stats = attach_parts(parts, *plan.inputs,
                                                          timings=self.input_timings, held_bytes=held)
            self.input_sparse = (taken, small)
        src.close()
        trim_heap()  # the load's transients, freed, stay resident otherwise
        self.load_s = time.perf_counter() - t0
        self.load_cpu_s = time.process_time() - c0  # without the time other processes took
        self.neurons = sum(len(s.idx) for s in self.sets)
        # the predictor's masks, watched (never consumed: the hot executor is their reader) where
        # they come out before attention (lookahead): the records they select are warmed while
        # the hot side attends (`cold_serve`'s `ahead`)
        ahead = plan.predictor_input == "layer" and spec.warm_ahead
        if packing:
            self.x = self.part = None
            self.ahead = AHEAD if ahead else None
        else:
            self.x, self.part = spec.open("x"), spec.open(f"part.{rank}", writer=True)
            self.ahead = spec.open("mask") if ahead else None
        self.busy_s, self.steps = 0.0, 0
        self.native = self._native_args(a.ffn_act)

    def ready(self) -> dict:
        return {**self._described(), "pid": os.getpid(), "load_s": self.load_s,
                "isa": kernels.isa(), "load_cpu_s": self.load_cpu_s,
                "held_bytes": held_bytes(*self.sets, *self._head(), *self.attn),
                "numa_bytes": numa_pages(),
                "node": node_of(self.cores), "node_id": node_id(),
                # whether this process imported torch, and why it holds its shard with it
                # (`cold_native.cold_executor`)
                "torch": "torch" in sys.modules, "torch_why": getattr(self, "torch_why", "")}

    def _described(self) -> dict:
        """What `ready` says of the shard (the torch-free executor says the same)."""
        return {"rank": self.rank, "cores": list(self.cores), "neurons": self.neurons,
                "format": self.fmt or "torch",
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
                "input_sparse": list(self.input_sparse), "input_timings": self.input_timings}

    def native_only(self) -> str | None:
        """Why some message this executor can be sent is answered in Python (with its torch
        modules), or None where `cold_serve` answers every one, prompts and batches of any size
        included: a dense split's block slices and heads whose projections are 16-row groups,
        neuron records without a bias (a bundle's; prompts through `kernels.records_rows`,
        decode steps 64 rows a call), a head of 16-row groups (or steps of at most 64 rows).
        Then a torch-free executor can hold the shard (`cold_native`)."""
        if self.native is None:
            return "the native loop answers none of its messages"
        for i, (s, th) in enumerate(zip(self.sets, self.thresholds)):
            e = ffn_entry(s, th)
            if e is None or e[2] not in (1, 2) or (e[2] == 1 and (e[4] >= 0 or e[5] >= 0)):
                return f"layer {i}'s neurons answer a prompt's rows in Python"
        if self.attn and self._variants() is None:
            return "its q/k norms are not RMSNorms of the model's type"
        for i, m in enumerate(self.attn):
            e = attention_entry(m)
            if e is None or e[1] >= 0 or (e[3].numel() and e[4] >= 0) or e[7] >= 0:
                return f"layer {i}'s heads answer a prompt's rows in Python"
        if self.head is not None:
            r = runs(self.head)
            if not self.native_head or (r[0][1] >= 0 and self.spec.batch > 64):
                return "its rows of the output head are answered in Python"
        return None

    def pack(self, fd: int) -> dict:
        """For a torch-free executor (`cold_native`, this process its loading child): the native
        loop's arguments with every tensor written into the memory file fd (`Packed`; a KV cache
        as `Zeros`, what only the executor knows as `Slot`s), and what `ready` and `stats` say;
        or {"why": ...} where some message needs Python (`native_only`)."""
        from .pack import pack_args
        why = self.native_only()
        if why is not None:
            return {"why": why}
        slots = {} if self.input_stats is None else {id(self.input_stats): "sparse_stats"}
        args, end = pack_args(self.native, fd, slots)
        weights = held_bytes(*self.sets, *self._head(),
                             *(p for m in self.attn for p in (m.wqkv, m.wo)))
        return {"args": args, "size": end, "library": kernels.library(lite=True), "isa": kernels.isa(),
                "ahead": self.ahead is not None, "sparse_stats": self.input_stats is not None,
                "ready": {**self._described(), "held_bytes": weights},
                "parts": {"held_bytes": held_bytes(*self.sets, *self._head())}}

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
        variants = self._variants() if self.attn else None  # (None: Python attends)
        attn = ([attention_entry(m) or NO_ATTENTION for m in self.attn] if variants is not None
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
        x, part = self.x, self.part
        where = (Slot("x_base"), Slot("part_base"), Slot("part_capacity"), Slot("spin_us")) \
            if self.packing else (x.base, part.base, part.capacity, x.spin_us)
        return (where[0], where[1], where[2], self.spec.dim,
                dtype == torch.bfloat16, where[3], [DECODE, HEAD, ATTN, PREFILL],
                kernels.ACTS.index(act), *(cols(ffn, j) for j in range(8)), self.spec.ffn_dim,
                *(cols(attn, j) for j in range(10)), n_heads, cos, sin, self.args.sliding_window,
                scale, *((None, 0, 0) if head is None else head),
                (self.ahead if self.packing else self.ahead.base) if self.ahead is not None else 0,
                *input_sparse_args(zip(self.attn or [None] * len(self.sets), self.sets), self.input_stats),
                *(variants or ([], [], [], [])), self.args.norm_eps)

    def _variants(self) -> tuple | None:
        """`cold_serve`'s lists of the layers' own attention variants, as `hot_layers` takes them
        (Gemma 3's sliding windows and local RoPE table, q/k norms; empty lists for a uniform
        model): (q/k norms, RoPE cos and sin tables, windows); None where a norm is not one the
        loop computes."""
        a, dtype = self.args, self.spec.torch_dtype
        norms = []
        if a.qk_norm:
            norms = [rms_weight(n, dtype) for m in self.attn for n in (m.q_norm, m.k_norm)]
            if any(w is None for w in norms):
                return None
        if a.uniform or self.rope is None:
            return norms, [], [], []
        tables = [self.rope[a.local(i)] for i in range(a.n_layers)]
        return (norms, [t[0] for t in tables], [t[1] for t in tables],
                [a.window(i) for i in range(a.n_layers)])

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

