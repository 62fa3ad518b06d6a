"""Hot executor: embeddings, attention and the KV cache, the hot neurons, the merge of the cold
partial sums, and lm_head. It runs the model's forward for each step the scheduler sends on
`ctl` and answers on `out`; inside the layer loop it talks to the predictor and the cold
executors through the data plane only.

The model is read from the file without its cold neurons (`partial.hot_model`): embeddings,
attention, norms and the output head, and each FFN a `HybridFFN` (the in-process sparse
engine's) holding only the hot neurons; the cold executors hold the rest. `RemoteFFN` sends the
FFN input out first, computes the hot neurons while the cold executors work, then adds their
partial sums. A decode step of a LLaMA-family model whose every layer the kernel library's
native loop runs takes that loop instead (`native.NativeDecode`: the same exchanges and sums in
one C++ call, `hot_layers`), and so does a step with prompt tokens where every layer's neurons
and heads are in 16-row group layouts (else it runs the modules).

On a GPU (`Config(device="cuda")`) the model is built on the host the same way and then moved
to the device: the device holds embeddings, attention, the KV cache, the hot
neurons and lm_head, nothing else. Every channel this process maps is page-locked with
cudaHostRegister. Device-to-host copies (the FFN input, the predictor's input where the
predictor is on the host, the logits) are
synchronous, which orders them before the publish that lets a peer read them; host-to-device
copies (tokens, masks where the predictor is on the host, cold partial sums) are asynchronous on
the one stream. A peer only
rewrites those buffers after a later publish of ours, which a synchronous copy queued behind
them precedes, so no copy can read a buffer being rewritten. Where the predictor shares the
GPU, the predictor input and the masks stay on the device (`device_buffers`: CUDA IPC buffers
ordered by interprocess events); the host channels carry the headers and the cold executors'
copy of the masks. A decode step on a GPU is replayed as CUDA graphs, one for each stretch
between these exchanges (`graphs.SegmentedDecode`, `Config.cuda_graphs`), on a stream of this
process's own.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
import traceback

import torch
from torch import nn

from cluster.topology import pin, process_memory
from powerinfer.config import Config
from powerinfer import kernels
from powerinfer.compat import compile_per_instance, trim_heap
from powerinfer.engine.load import checkpoint_of, whole_model
from powerinfer.formats.source import ModelFile
from powerinfer.model.transformer import KVCache, KVTables, held_bytes, host_parts
from powerinfer.engine.native import (NativeDecode, input_sparse_args, layer_args, layer_variants,
                                      native_model, rms_weight, runs)
from powerinfer.engine.partial import head_rows, hot_formats, hot_model
from powerinfer.engine.plan import SparsePlan
from powerinfer.model.quant import KernelEmbedding, apply_kernel_linears
from powerinfer.model.sparse import HybridFFN
from powerinfer.sparsity.input_sparsity import attach

from .graphs import SegmentedDecode
from .group_info import node_id
from .packed import Slot
from .sealed import unseal
from .channel import ChannelClosed, PeerDied, native_error
from .plane import (ATTN, DECODE, ERROR, HEAD, OK, PREFILL, STOP, FFNInput, Masks, Partial,
                    PlaneSpec, PredictorInput, Reply, Step, head_ranges, receive, send, split_kv)

log = logging.getLogger("powerinfer")


class DataPlane:
    """The hot executor's ends of the channels, with the per-layer timing it records. `native`:
    the FFN and head exchanges go through the kernel library's channel ops (`ch_send`,
    `ch_recv`): one C++ call each, which a compiled step calls from its generated code (on a
    CPU with the library loaded and no predictor). `native_masks`: with a predictor on the host
    and a CPU hot executor, a decode step's native layer loop exchanges the predictor's input
    and masks itself (its modules' path sends them from Python)."""

    def __init__(self, spec: PlaneSpec, predictor_input: str | None, device: torch.device):
        self.spec, self.device = spec, device
        self.ctl, self.out = spec.open("ctl"), spec.open("out", writer=True)
        self.x = spec.open("x", writer=True)
        self.parts = [spec.open(f"part.{k}") for k in range(spec.n_cold)]
        self.predicting = predictor_input is not None
        self.lookahead = predictor_input == "layer"
        self.native = device.type == "cpu" and not self.predicting and kernels.available()
        # a predictor on the host beside a CPU hot executor: the decode step's layer loop in
        # C++ sends the predictor's input and reads its masks too (`hot_layers`' `predict`)
        self.native_masks = device.type == "cpu" and self.predicting and kernels.available()
        if self.predicting:
            self.pred_in, self.mask = spec.open("pred_in", writer=True), spec.open("mask")
        # what a compiled step names the x channel and each part channel by: a slot number,
        # the same in every hot executor and run (so that Inductor's caches find a rebuilt
        # group's step compiled before), not the mapping's address (one plane a process)
        self.x_ref, self.part_refs = self.x.base, [p.base for p in self.parts]
        if self.native:
            for slot, ch in enumerate((self.x, *self.parts), start=1):
                torch.ops.powerinfer.ch_slot(slot, ch.base)
            self.x_ref, self.part_refs = 1, list(range(2, 2 + len(self.parts)))
        if device.type == "cuda":
            for ch in self.channels():
                ch.register_with_cuda()
        # the predictor on this GPU: its input and the masks in device buffers (CUDA IPC)
        self.buffers = None
        if self.predicting and spec.device_predictor:
            from .device_buffers import predictor_buffers
            self.buffers = predictor_buffers(spec.batch, spec.dim, spec.ffn_dim)

    def channels(self):
        yield from (self.ctl, self.out, self.x, *self.parts)
        if self.predicting:
            yield from (self.pred_in, self.mask)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def send_rows(self, x: torch.Tensor, op: int, layer: int, *more: torch.Tensor,
                  words: tuple = ()) -> torch.Tensor:
        """x (rows, T, dim) and `more` (see `PlaneSpec.attn_layout`) to every cold executor on
        `x` with the message's further `words` (native); returns the copy of x that later work
        must read, which keeps the send ahead of it in a compiled step."""
        return torch.ops.powerinfer.ch_send([x, *more], self.x_ref, self.x.capacity, op, layer,
                                            list(words))

    def partial(self, k: int, like: torch.Tensor, width: int) -> torch.Tensor:
        """Cold executor k's answer, float32 (like.shape[:-1], width) (native): read after
        `like`, the hot side's own share of the work."""
        p = self.parts[k]
        return torch.ops.powerinfer.ch_recv(like, p.state, self.part_refs[k], width, p.spin_us)

    def send_predictor_input(self, layer: int, h: torch.Tensor):
        self.put_predictor_input(h)
        self.publish_predictor_input(layer, h.shape[0])

    def put_predictor_input(self, h: torch.Tensor, non_blocking: bool = False):
        """The predictor's input rows (B, ..., dim) into its device buffer where it shares the
        GPU, else into the host channel (non_blocking: queued, synchronized before publishing)."""
        B = h.shape[0]
        if self.buffers is not None:
            self.buffers["pred_in"].view(torch.float32, (B, self.spec.dim)).copy_(h.reshape(B, -1))
        else:
            self.pred_in.put(h.reshape(B, -1).float(), non_blocking=non_blocking)

    def publish_predictor_input(self, layer: int, B: int):
        if self.buffers is not None:  # queued on the device; the predictor's stream waits for it
            self.buffers["pred_in"].publish()
        send(self.pred_in, PredictorInput(DECODE, layer, B))

    def recv_mask(self, B: int) -> torch.Tensor:
        got = receive(self.mask, Masks)
        assert got.B == B, (got, B)
        return self.mask.view(torch.bool, (B, self.spec.ffn_dim))  # on the host

    def device_mask(self, rows: torch.Tensor, wait: bool = True) -> torch.Tensor:
        """The masks `recv_mask` returned, on this process's device: the predictor's device
        buffer where it shares the GPU (this stream waits for its writes, unless `wait` is
        False: the caller made it wait), else a copy."""
        if self.buffers is None:
            return self.to_device(rows)
        buf = self.buffers["mask"]
        if wait:
            buf.consume()
        return buf.view(torch.bool, rows.shape)

    def stop(self):
        self.x.publish(STOP)
        if self.predicting:
            self.pred_in.publish(STOP)


class _Packed:
    """A channel as a loading child sees it (`PackingPlane`): its address, size, reader state
    and spin as `Slot`s, which the torch-free executor fills with its own mapping's."""

    def __init__(self, name: str, spin_us: str = "spin_us"):
        self.base, self.capacity = Slot(f"{name}.base"), Slot(f"{name}.capacity")
        self.state, self.spin_us = Slot(f"{name}.state"), Slot(spin_us)


class PackingPlane:
    """The data plane of a hot executor loaded for a torch-free one (`hot_native`, this process
    its loading child: `packing`): no channel mapped, each named by `Slot`s in the arguments it
    packs; a CPU group's (a predictor's on the host)."""

    def __init__(self, spec: PlaneSpec, predictor_input: str | None):
        self.spec, self.device = spec, torch.device("cpu")
        self.predicting = predictor_input is not None
        self.lookahead = predictor_input == "layer"
        self.native = kernels.available() and not self.predicting
        self.native_masks = kernels.available() and self.predicting
        self.buffers = None
        if self.predicting:
            self.pred_in, self.mask = _Packed("pred_in"), _Packed("mask")
        self.x = _Packed("x")
        self.parts = [_Packed(f"part.{k}") for k in range(spec.n_cold)]
        self.x_ref, self.part_refs = self.x.base, [p.base for p in self.parts]

    def channels(self):
        return iter(())


class RemoteFFN(nn.Module):
    def __init__(self, ffn: HybridFFN, io: DataPlane):
        super().__init__()
        ffn.drop_cold()  # the cold executors hold these neurons
        self.f, self.io = ffn, io

    def forward(self, h, layer_input):  # the layer input went to the predictor before attention
        # h: (B, T, dim) the residual entering the FFN
        f, io = self.f, self.io
        x = f.norm(h)
        B, T, dim = x.shape
        if io.native:  # no masks: every neuron; partial sums in float32, one rounding
            xs = io.send_rows(x, DECODE if T == 1 else PREFILL, f.layer)
            y = f.hot_part(xs)
            like = y if isinstance(y, torch.Tensor) else xs  # read the answers after our share
            for k in range(len(io.parts)):
                y = y + io.partial(k, like, dim)
            y = y.to(x.dtype)
            return y if f.down_b is None else y + f.down_b
        masked = io.predicting and T == 1
        rows = None
        if masked:
            if not io.lookahead:
                io.send_predictor_input(f.layer, h)
            rows = io.recv_mask(B)
        io.x.put(x)
        if masked:
            io.x.put(rows, io.spec.mask_offset(B * T))
        send(io.x, FFNInput(DECODE if T == 1 else PREFILL, f.layer, B, T, int(masked)))
        rows = None if rows is None else io.device_mask(rows)
        y = f.hot_part(x, None if rows is None else rows.any(0), rows)  # union None: every neuron
        for p in io.parts:  # float32 partial sums add up before one rounding
            receive(p, Partial)
            y = y + io.to_device(p.view(torch.float32, (B, T, dim)))
        y = y.to(x.dtype)
        return y if f.down_b is None else y + f.down_b


class RemoteAttention(nn.Module):
    """A layer's attention split by KV heads (on a CPU, native exchanges): its input goes out
    with the step's positions, sequence starts and block tables first, this process computes its
    own heads' share of the output projection while the cold executors compute theirs (each
    executor's pool holds its heads at the same block ids), then the float32 shares and the
    output bias add up before one rounding."""

    def __init__(self, own: nn.Module, io: DataPlane, layer: int, o_bias: torch.Tensor | None):
        super().__init__()
        self.own, self.io, self.layer = own, io, layer
        self.o_bias = None if o_bias is None else nn.Parameter(o_bias, requires_grad=False)

    def forward(self, x, rope, pos, kv):
        # x: (B, T, dim) the normed layer input; pos: (B*T,); kv: the step's KVTables
        io, dim = self.io, x.shape[-1]
        xs = io.send_rows(x, ATTN, self.layer, pos, kv.starts, kv.tables,
                          words=(kv.tables.shape[0], kv.tables.shape[1]))
        y = self.own(xs, rope, pos, kv)  # float32
        like = y  # read the answers after our share
        for k in range(len(io.parts)):
            y = y + io.partial(k, like, dim)
        if self.o_bias is not None:
            y = y + self.o_bias
        return y.to(x.dtype)


class RemoteHead(nn.Module):
    """The output head split by vocabulary rows (on a CPU): the rows go out on `x` first, this
    process computes its own share while the cold executors compute theirs, then the logits are
    put together. The head is the one large read at the end of a step, when the cold cores would
    otherwise wait."""

    def __init__(self, own: nn.Module, io: DataPlane, ranges: list[tuple[int, int]]):
        super().__init__()
        self.own, self.io, self.ranges = own, io, ranges

    def forward(self, x):  # (B, T, dim): the final norm's rows
        io, n = self.io, x.numel() // x.shape[-1]
        if io.native:
            xs = io.send_rows(x.reshape(n, -1), HEAD, -1)
            parts = [self.own(xs).float()]
            parts += [io.partial(k, parts[0], hi - lo) for k, (lo, hi) in enumerate(self.ranges[1:])]
            return torch.cat(parts, -1).view(*x.shape[:-1], self.ranges[-1][1])
        io.x.put(x.reshape(n, -1))
        send(io.x, FFNInput(HEAD, -1, n, 1, 0))
        parts = [self.own(x).float().reshape(n, -1)]
        for p, (lo, hi) in zip(io.parts, self.ranges[1:]):
            p.wait()
            parts.append(io.to_device(p.view(torch.float32, (n, hi - lo))))
        return torch.cat(parts, -1).view(*x.shape[:-1], self.ranges[-1][1])


class HotExecutorImpl:
    def __init__(self, spec: PlaneSpec, cores: tuple[int, ...], model: ModelFile, config: Config,
                 plan: SparsePlan, hot_share: float, attention: bool = False,
                 packing: bool = False):
        """packing: load for a torch-free executor (`hot_native`, this process its loading child), which
        maps no channel here and writes its step's arguments out (`pack`)."""
        faulthandler.enable()  # a native crash (the CPU kernel) leaves its Python stack in the log
        # the threads it loaded and loops on: one (`roles._Role.compute`: one OpenMP team)
        self.threads = {"load": threading.get_native_id()}
        pin(cores, config.cpu_threads)
        kernels.hold(spec.isa)  # the model's instruction-set class
        model = unseal(model)
        self.spec, self.cores, self.device = spec, cores, config.torch_device
        self.packing = packing
        t0, c0 = time.perf_counter(), time.process_time()
        if packing and (self.device.type != "cpu" or spec.device_predictor):
            raise ValueError("a torch-free hot executor runs a CPU group")
        self.io = PackingPlane(spec, plan.predictor_input) if packing else \
            DataPlane(spec, plan.predictor_input, self.device)
        if spec.n_cold == 0:  # the group's one executor: the whole model
            self._whole(model, config, plan)
        else:
            # attention split by KV heads over the executors (a CPU group)
            kv = split_kv(model.args.n_kv_heads, spec.n_cold, hot_share,
                          attention and (self.io.native or self.io.native_masks))
            self.kv_heads = (0, model.args.n_kv_heads) if kv is None else kv[0]
            m, o_bias = self._load(model, config, plan, hot_share, kv)
            self.model = self._wire(m, model.args, hot_share, kv, o_bias)
            self.hot_neurons = sum(len(b.ffn.f.hot.idx) for b in m.layers)
            self._decode = self._choose_decode(config, model.args, kv)
        if packing:  # (the torch-free executor allocates its own)
            self._meta_caches()
        self.load_s = time.perf_counter() - t0
        self.load_cpu_s = time.process_time() - c0  # without the time other processes took
        self._default_decode = self._decode
        self.steps, self.step_s = 0, 0.0
        self._counted = (0, 0)  # the input-sparsity counter at the last step's end
        self.native_prompts, self.native_prompt_steps = True, 0  # (see `prompts_natively`)
        # a profile `profile` asked for: decode steps left, the running profiler, its tables
        self._profile_left, self._profiler, self._profile_table = 0, None, None

    def _whole(self, ckpt: ModelFile, config: Config, plan: SparsePlan):
        """A one-executor group's model (`Config(cold_executors=0)`): the in-process engine's
        (`engine.load.whole_model`: every neuron, the file's 4-bit blocks kept, its layer loop in
        C++), over the group's KV pool and RoPE tables, stepped as the scheduler asks. Nothing
        is exchanged inside a step."""
        ck = checkpoint_of(ckpt, config)
        m = whole_model(ck, config, tokenizer=False, input_sparsity=False, plan=False).model
        self._attach_input_sparsity(m, plan, config.weights == "int4")
        ck.source.close()
        m.setup_pool(self.spec.num_blocks, self.spec.block_size, self.spec.max_seq,
                     self.spec.rope_tables(writer=True))
        trim_heap()  # the load's transients, freed, stay resident otherwise
        a = ckpt.args
        self.model, self.kv_heads, self.head_rows = m, (0, a.n_kv_heads), self.spec.vocab
        self.hot_neurons = a.n_layers * a.ffn_dim
        self.neuron_format = f"the whole model ({config.weights})"
        self.compiled, self.segments = config.compile, None
        self.native = None if config.compile else NativeDecode.of(m)
        self._decode = self.native or m.forward
        if config.compile:
            self._decode = compile_per_instance(m.forward, cpp_wrapper=True)

    def _attach_input_sparsity(self, model, plan: SparsePlan, int4: bool):
        """Input sparsity: its 4-bit projections read only the channels over their thresholds in
        decode steps (its heads' q/k/v and output columns, a dense split's gate+up rows; on a
        GPU the Q4_0/Q4_1 `BlockLinear`s, by `triton_linear.q4c_linear`; the cold executors do
        the same with theirs)."""
        self.input_sparse, self.input_timings = (0, 0), []
        if plan.inputs is not None and int4:
            self.input_sparse = attach(model, *plan.inputs, timings=self.input_timings)[:2]

    def _load(self, ckpt: ModelFile, config: Config, plan: SparsePlan, hot_share: float, kv):
        """The model this executor runs, read from the file without the cold neurons (nor the
        cold executors' heads), and each layer's output-projection bias where attention is
        split (added once, here)."""
        hot = [plan.hot_mask(i, hot_share) for i in range(plan.n_layers)]
        # the hot neurons' records: on a CPU for the kernel the cold executors run, on a GPU for
        # the Triton kernels (torch's gathered rows where Triton is missing); with int4 in the
        # file's blocks, and on a CPU its attention and head 4-bit too (on a GPU they widen)
        dtype = config.torch_dtype
        fmt, int4, device_blocks = hot_formats(config.weights, ckpt.info, dtype, self.device)
        self.neuron_format = fmt or str(dtype).removeprefix("torch.")  # (None: torch's rows)
        # with int4 on the CPU the embedding stays in the file's blocks (and a tied head reads
        # the same rows)
        model = hot_model(ckpt, dtype, hot, plan.predictor_input or "ffn", plan.thresholds, fmt,
                          int4, quantized_embedding=int4,
                          every_step=plan.predictor_input is None,
                          kv=None if kv is None else kv[0], device_blocks=device_blocks)
        o_bias = [ckpt.source.get(f"{i}.o_b", dtype) if kv is not None and ckpt.args.o_bias
                  else None for i in range(ckpt.args.n_layers)]
        if self.device.type == "cpu":  # the model is built on the host: the device decides
            apply_kernel_linears(model, head="q8_0" if int4 else "bf16")  # what is left in bf16
        self._attach_input_sparsity(model, plan, int4)
        ckpt.source.close()
        trim_heap()  # the load's transients, freed, stay resident otherwise
        return model, o_bias

    def _wire(self, model, args, hot_share: float, kv, o_bias):
        """The model's parts that exchange with the other actors: the head's rows split as the
        FFN's neurons are (no split where the cold executors share the hot executor's cores:
        its share is then every row), each FFN's cold neurons and each layer's attention heads
        (where split) answered by the cold executors, the lookahead predictor's input sent
        before attention; on the device, with its paged KV pool."""
        spec = self.spec
        self.head_rows = spec.vocab
        ranges = head_ranges(spec.vocab, spec.n_cold, hot_share)
        if self.device.type == "cpu" and ranges[0][1] < spec.vocab:
            model.output = RemoteHead(head_rows(model.output, *ranges[0],
                                                shared=args.tie_embeddings), self.io, ranges)
            self.head_rows = ranges[0][1]
        for i, block in enumerate(model.layers):
            block.ffn = RemoteFFN(block.ffn, self.io)  # drops the cold neurons
            if self.io.lookahead:  # the layer input goes to the predictor before attention
                block.register_forward_pre_hook(self._lookahead(i))
        if self.device.type != "cpu":  # (Module.to imports torch's fake tensors, and sympy)
            model.to(self.device)
        # (its heads' share of the cache; the RoPE tables in the group's segment, which it fills
        # as steps reach their rows and the cold executors read)
        model.setup_pool(spec.num_blocks, spec.block_size, spec.max_seq, spec.rope_tables(writer=True))
        if kv is not None:  # (the cache is its heads')
            for i, block in enumerate(model.layers):
                block.attn = RemoteAttention(block.attn, self.io, i, o_bias[i])
        return model

    def _choose_decode(self, config: Config, args, kv):
        """The decode step: compiled (Inductor's C++ calling the kernels and the channel ops;
        prefill stays eager, as in the in-process engine), its layer loop in C++ where every
        layer allows it (the eager step's per-op dispatch is most of a small model's step
        otherwise), in segments between the host exchanges (`graphs`: replayed as CUDA graphs
        on a GPU; on a CPU a diagnostic, `steps_in_segments`, launched op by op), or the
        modules' forward."""
        model, spec = self.model, self.spec
        decode = model.forward
        self.compiled = config.compile and self.io.native
        if self.compiled:  # the model's method (Ray wraps the actor's own)
            for ch in self.io.channels():  # fixed sizes: no guard ties them to a batch's
                torch._dynamo.mark_static(ch.state)
            decode = compile_per_instance(model.forward, cpp_wrapper=True)
        elif config.compile:
            log.warning("the hot executor runs its decode step eagerly: it compiles on a CPU "
                        "without a predictor only")
        self.native = None if self.compiled else self._native_step(args)
        if self.native is not None:
            decode = self.native  # (as the in-process engine takes it)
        self.segments = None
        if self.native is None and not self.compiled and not self.packing and \
                SegmentedDecode.supports(model, self.io) is None:
            graphs = self.device.type == "cuda" and config.cuda_graphs
            self.segments = SegmentedDecode(model, self.io, -(-spec.max_seq // spec.block_size),
                                            capture=graphs)
            if graphs:
                decode = self.segments
        return decode

    def _native_step(self, a) -> NativeDecode | None:
        """The decode step with its layer loop in C++ (`native.NativeDecode`, exchanging with the
        cold executors natively): a CPU group whose attention is split by heads or all here
        (a model with one KV head), with a predictor on the host or none (its input and masks
        exchanged in the loop as well), a model `hot_layers` runs (`native.native_model`, with
        its layers' own variants: Gemma 3's post-norms of the summed heads and parts, its
        windows and local RoPE table, q/k norms) without an output bias on its attention nor a
        down bias, every layer's heads and neurons in layouts the native loops run; else None
        (the step runs its Python modules)."""
        io, m, dtype = self.io, self.model, self.spec.torch_dtype
        if not (io.native or io.native_masks) or not native_model(a, dtype):
            return None
        variants = layer_variants(m, dtype)  # (Gemma 3's, Qwen3's: sent heads and parts alike)
        if variants is None:
            return None
        kv_split = isinstance(m.layers[0].attn, RemoteAttention)
        layers = []
        for block in m.layers:
            f, att = block.ffn.f, block.attn
            if isinstance(att, RemoteAttention):
                att = None if att.o_bias is not None else att.own
            elif kv_split:  # (every layer's heads split, or none)
                att = None
            if att is None or f.down_b is not None:
                return None
            layers.append((block.attn_norm, f.norm, f.hot if len(f.hot.idx) else None, f.threshold, att))
        args = layer_args(a, dtype, layers, layers[0][4].n_heads, m.rope_cos, m.rope_sin)
        predict, mask_state = [], None
        if io.native_masks:
            predict = [io.pred_in.base, io.pred_in.capacity, io.mask.base, int(io.lookahead), self.spec.ffn_dim,
                       int(kv_split)]
            mask_state = io.mask.state
        # (attention's op -1: every head here, no attention message sent)
        exchange = (io.x.base, io.x.capacity, [p.base for p in io.parts], [p.state for p in io.parts],
                    io.parts[0].spin_us, [DECODE, ATTN if kv_split else -1, PREFILL], predict,
                    mask_state)
        if args is None:
            return None
        step = NativeDecode(m, exchange, args, variants)
        step.input_sparse = input_sparse_args([(getattr(b.attn, "own", b.attn), b.ffn.f) for b in m.layers],
                                              getattr(m, "input_sparse_stats", None))
        return step

    def _meta_caches(self):
        """The KV caches' blocks left unallocated (meta: `pack` writes them as `Zeros`, which the
        torch-free executor allocates), the native step's arguments made again over them."""
        for block in self.model.layers:
            att = getattr(block.attn, "own", block.attn)
            c = att.kv_cache
            if c is not None:
                att.kv_cache = KVCache(c.k.shape[0], c.k.shape[1], c.block_size, c.k.shape[2],
                                       c.k.dtype, "meta")
        if self.spec.n_cold == 0:
            self.native = NativeDecode.of(self.model)
        elif self.native is not None:
            self.native = self._native_step(self.model.args)

    def native_only(self) -> str | None:
        """Why a step of this executor would need Python (its modules, torch), or None where
        `hot_step` runs every step it can be sent: a CPU group (a predictor's on the host) whose
        decode and prompt steps run the native layer loop (a uniform LLaMA-family model, every layer's
        heads and neurons in 16-row group layouts: the int4 default), an embedding and a head the
        kernel library reads, RMSNorm at the end."""
        m, native = self.model, self.native
        if self.compiled:
            return "its decode step is compiled (Config.compile)"
        if native is None:
            return "its decode step runs its Python modules (a layer the native loop does not run)"
        if not native.prompts:
            return "its prompt steps run its Python modules (a layer not in 16-row group layouts)"
        if native.sparse:
            return "its neurons' predictor runs in process"
        if m.pos_embeddings is not None:
            return "its embedding has positions"
        if self._embedding() is None:
            return "its embedding is not in a kernel format or the model's type"
        if rms_weight(m.norm, self.spec.torch_dtype) is None:
            return "its final norm is not an RMSNorm of the model's type"
        if self._head()[0] is None:
            return "its head is not one run of kernel-library rows"
        return None

    def _embedding(self) -> tuple | None:
        """(the embedding's rows, their kernel format's code or -1 for rows of the model's type)."""
        e = self.model.tok_embeddings
        if isinstance(e, KernelEmbedding):
            return e.records, kernels.FORMATS.index(e.fmt)
        if isinstance(e, nn.Embedding) and e.weight.dtype == self.spec.torch_dtype:
            return e.weight, -1
        return None

    def _head(self) -> tuple:
        """(this process's head rows' run `(weights, format, rows)` or None, the other
        executors' widths of the vocabulary after them)."""
        out = self.model.output
        own, widths = (out.own, [hi - lo for lo, hi in out.ranges[1:]]) \
            if isinstance(out, RemoteHead) else (out, [])
        r = runs(own)
        return (r[0] if r is not None and len(r) == 1 else None), widths

    def pack(self, fd: int) -> dict:
        """For a torch-free executor (`hot_native`, this process its loading child): `hot_step`'s
        arguments after the step's own (see csrc/capi.h) with every tensor written into the
        memory file fd (`pack.pack_args`; the KV caches as `Zeros`, the channels, the RoPE
        tables and the input-sparsity counter as `Slot`s), and what `ready` and `stats` say; or
        {"why": ...} where some step needs Python (`native_only`)."""
        from .pack import pack_args
        why = self.native_only()
        if why is not None:
            return {"why": why}
        m, native = self.model, self.native
        embed, embed_fmt = self._embedding()
        (head, head_fmt, head_n), widths = self._head()
        stats = getattr(m, "input_sparse_stats", None)
        slots = {id(getattr(m, f"rope_{k}{end}")): f"rope_{k}{end}" for k in ("cos", "sin")
                 for end in ("", "_local")[:2 if m.args.rope_base_local else 1]}
        if stats is not None:
            slots[id(stats)] = "sparse_stats"
        args = (embed, embed_fmt, float(m.args.embed_scale or 0.0), self.spec.torch_dtype == torch.bfloat16,
                rms_weight(m.norm, self.spec.torch_dtype), m.args.norm_eps, head, head_fmt, head_n,
                HEAD, widths, *native.args, *native.input_sparse)
        packed, end = pack_args(args, fd, slots)
        parts = host_parts(m)
        return {"args": packed, "size": end, "library": kernels.library(lite=True),
                "isa": kernels.isa(), "sparse_stats": stats is not None,
                "predicting": self.io.predicting,
                "ready": self._described(),
                "parts": {"held_bytes": held_bytes(m), **parts},
                "stats": {"hot_neurons": self.hot_neurons, "neuron_format": self.neuron_format}}

    def _lookahead(self, layer: int):
        def hook(block, args):
            if args[0].shape[1] == 1:
                self.io.send_predictor_input(layer, args[0])
        return hook

    def ready(self) -> dict:
        return {**self._described(), "pid": os.getpid(), "load_s": self.load_s,
                "load_cpu_s": self.load_cpu_s, "node_id": node_id(), "torch": True,
                "torch_why": getattr(self, "torch_why", "")}

    def _described(self) -> dict:
        """What `ready` says of what this executor holds and runs (a torch-free one's too)."""
        buffers = self.io.buffers or {}
        return {"cores": list(self.cores), "hot_neurons": self.hot_neurons,
                "device_buffers": {k: b.handle() for k, b in buffers.items()},
                "head_rows": self.head_rows, "kv_heads": list(self.kv_heads),
                "compiled": self.compiled, "native": self.native is not None,
                "device": str(self.device), "isa": kernels.isa(),
                "input_sparse": list(self.input_sparse), "input_timings": self.input_timings,
                **self._memory()}

    def _memory(self) -> dict:
        if self.device.type != "cuda":
            return {}
        shared = sum(b.nbytes for b in (self.io.buffers or {}).values())  # outside torch's pool
        return {"device_bytes": torch.cuda.memory_allocated(self.device) + shared,
                "device_peak_bytes": torch.cuda.max_memory_allocated(self.device) + shared,
                "device_buffer_bytes": shared}

    @torch.inference_mode()
    def run(self) -> str:
        self.threads["loop"] = threading.get_native_id()
        # on a GPU the steps run on a stream of their own, the one their CUDA graphs are captured
        # on: a capture on a second stream would hold a second cuBLAS workspace (32 MiB on an H200)
        stream = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (the load's copies, on the default stream)
            stream = torch.cuda.Stream(self.device)
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            return self._serve()

    def _serve(self) -> str:
        io, spec = self.io, self.spec
        try:
            while True:
                step = receive(io.ctl, Step)
                if step.op == STOP:
                    io.stop()
                    return "stopped"
                t0 = time.perf_counter()
                B, T, at = step.B, step.T, spec.ctl_layout(step.B * step.T, step.S, step.M)
                # the RoPE tables' rows up to the step's positions, before any path reads them
                # (the native loop's, a compiled step's; the cold executors hold their own)
                self.model.rope_ensure(io.ctl.view(torch.int64, (B * T,), at.positions))
                tokens, pos = (io.to_device(io.ctl.view(torch.int64, (B, T), o))
                               for o in (at.tokens, at.positions))
                kv = KVTables(io.to_device(io.ctl.view(torch.int64, (step.S + 1,), at.starts)),
                              io.to_device(io.ctl.view(torch.int32, (step.S, step.M), at.tables)))
                last = io.to_device(io.ctl.view(torch.int64, (step.K,), at.last))
                # a prompt's step through the native loop too where its layers allow it
                prompt = step.op == PREFILL
                native = self.native is not None and self.native.prompts and self.native_prompts
                run = (self.native if native else self.model) if prompt else self._decode
                self.native_prompt_steps += prompt and native
                if not prompt:
                    self._profile_start()
                try:
                    logits = run(tokens, pos, kv, last)
                except (PeerDied, ChannelClosed):
                    raise
                except Exception as e:  # a bug or a bad step: report it, the group is rebuilt
                    if (gone := native_error(e)) is not None:  # a native receive's
                        raise gone from None
                    self._error(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
                    raise
                io.out.put(logits.reshape(step.K, spec.vocab))
                send(io.out, Reply(OK, step.K, *self._input_counts()))
                self.steps += 1
                self.step_s += time.perf_counter() - t0
                if not prompt:
                    self._profile_count()
        except (PeerDied, ChannelClosed) as e:
            self._error(str(e))
            return f"failed: {e}"
        finally:
            self._profile_stop()

    def _input_counts(self) -> tuple[int, int]:
        """The input channels this executor's sparse projections kept and saw in the step just
        run (the counter's growth since the step before)."""
        stats = getattr(self.model, "input_sparse_stats", None)
        if stats is None:
            return 0, 0
        kept, seen = int(stats[0]), int(stats[1])
        before, self._counted = self._counted, (kept, seen)
        return kept - before[0], seen - before[1]

    def prompts_natively(self, enabled: bool):
        """Whether prompt steps take the native loop where it runs them (the default), or the
        Python modules: a diagnostic, the reference the native loop's prompt steps must equal."""
        self.native_prompts = bool(enabled)

    def steps_in_segments(self, enabled: bool):
        """Whether decode steps run in `graphs.SegmentedDecode`'s segments launched op by op (a
        diagnostic on a CPU: the sequence the GPU's CUDA graphs replay, checked against the
        modules' path), or as the executor chose (the default). False where it cannot."""
        if self.segments is None:
            return False
        self._decode = self.segments if enabled else self._default_decode
        return True

    def profile(self, steps: int):
        """Profile the next `steps` decode steps (torch.profiler: this process's ops and their
        device kernels); `profile_table` has the result once they ran (0 ends a profile now
        running at its next step; a prefill that comes between them is recorded too). A
        diagnostic: where the step's time goes on the hot side (launches, copies, waits)."""
        self._profile_left, self._profile_table = steps, None

    def profile_table(self) -> str | None:
        return self._profile_table

    def loop_profile(self, mode: str = "read") -> dict:
        """This process's native layer loop by phase (`kernels.loop_profile`: "start", "read",
        "stop"), a diagnostic: where the hot executor's steps go, its waits for the cold
        executors' answers apart for attention and for the FFN."""
        return kernels.loop_profile(mode)

    def _profile_start(self):
        """Before a decode step: start the profile `profile` asked for."""
        if self._profiler is None and self._profile_left > 0:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=acts)
            self._profiler.__enter__()

    def _profile_count(self):
        """After a decode step: count it; the last one asked for ends the profile."""
        if self._profiler is not None:
            self._profile_left -= 1
            if self._profile_left <= 0:
                self._profile_stop()

    def _profile_stop(self):
        """End a running profile (its steps counted, or the loop ending) and keep its tables."""
        prof, self._profiler = self._profiler, None
        if prof is None:
            return
        self._profile_left = 0
        prof.__exit__(None, None, None)
        avg = prof.key_averages()
        table = avg.table(sort_by="self_cpu_time_total", row_limit=80)
        if self.device.type == "cuda":
            table += "\n" + avg.table(sort_by="self_device_time_total", row_limit=25)
        self._profile_table = table

    def _error(self, text: str):
        data = text.encode()[:self.io.out.capacity]
        self.io.out.put_bytes(data)
        send(self.io.out, Reply(ERROR, len(data)))

    def stats(self) -> dict:
        io = self.io
        out = {"steps": self.steps, "step_s": self.step_s, "ctl_wait_s": io.ctl.wait_s,
               "threads": dict(self.threads),
               "native_prompt_steps": self.native_prompt_steps,
               "part_wait_s": sum(p.wait_s for p in io.parts), "hot_neurons": self.hot_neurons,
               "neuron_format": self.neuron_format, "device": str(self.device), "memory": process_memory(),
               "held_bytes": held_bytes(self.model), **host_parts(self.model), **self._memory()}
        if (counter := getattr(self.model, "input_sparse_stats", None)) is not None:
            out["input_sparse_stats"] = [int(counter[0]), int(counter[1])]
        if io.predicting:
            out["mask_wait_s"] = io.mask.wait_s
        if self.segments is not None:  # the decode steps in segments: replayed, launched
            out["graphs"] = self.segments.stats()
        if self.compiled:  # graphs its decode step has compiled (one per batch shape)
            from torch._dynamo.utils import counters
            out["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
        return out

