"""The dense reference model: one forward-pass definition for every supported architecture.

A block reads `h = h + attn(norm(h)); h = h + ffn(norm(h))`. The variants are switches in
`ModelArgs`: the LLaMA family (RMSNorm, RoPE, gated FFN with SwiGLU / ReGLU / dReLU; Mistral,
Qwen2, Qwen3 (q/k norms) and Phi-3 differ only in configuration), Gemma 3 (GeGLU, norms after
attention and the FFN too, q/k norms, scaled embeddings, sliding-window layers with their own RoPE
base), Falcon (attention and FFN in parallel off the layer input, LayerNorm, GELU or ReLU FFN)
and OPT (LayerNorm, learned positions, ReLU FFN with biases). The sparse engine replaces
`Block.ffn` on a finished model; everything else is shared.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..compat import resident
from ..cpu import bf16_arithmetic
from ..formats import rope
from ..formats.args import ModelArgs


def _zeros(shape, dtype, device) -> torch.Tensor:
    """torch.zeros; on the CPU from calloc (numpy's zeros), whose large blocks are fresh zero
    pages: a KV cache is resident only as far as its blocks are written, not at allocation."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = int(np.prod(shape)) * dtype.itemsize
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)


# Transformer.forward gives each step a KVTables.memo (False: none, as a baseline to time)
STEP_MEMO = True


# a decode step's attention where the Triton kernels run: one launch (`triton_attention`;
# False: torch's ops, as a baseline to time)
TRITON_ATTENTION = True


class KVTables(NamedTuple):
    """Where a step's tokens sit in the paged KV cache. The step's tokens, flattened row-major
    from (B, T), go sequence by sequence: sequence s owns tokens starts[s] .. starts[s+1] - 1,
    and its position p is in block tables[s, p // block_size] of every layer's cache."""
    starts: torch.Tensor  # (S + 1,) int64
    tables: torch.Tensor  # (S, M) int32
    # what every layer of the step would derive from these again (torch's `paged_attention`:
    # cache slots, the decode mask), kept for the step's other layers; None: nothing kept
    memo: dict | None = None


class KVCache(nn.Module):
    """One layer's paged KV cache, of the heads its attention holds: blocks of `block_size`
    positions, shared by every sequence through their block tables (`powerinfer.engine.kv` deals the
    blocks out). Keys are stored transposed per block, (head_dim, block_size), values as rows:
    the CPU kernel then reads a query's scores over a block as vector multiply-adds, with no
    horizontal sums (csrc/attention.h)."""

    def __init__(self, num_blocks: int, n_kv_heads: int, block_size: int, head_dim: int, dtype,
                 device):
        super().__init__()
        self.register_buffer("k", _zeros((num_blocks, n_kv_heads, head_dim, block_size), dtype,
                                         device), persistent=False)
        self.register_buffer("v", _zeros((num_blocks, n_kv_heads, block_size, head_dim), dtype,
                                         device), persistent=False)

    @property
    def block_size(self) -> int:
        return self.k.shape[-1]

    def write(self, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # blocks, offsets: (N,) where each token goes; k, v: (N, Hkv, D)
        self.k[blocks, :, :, offsets] = k.to(self.k.dtype)
        self.v[blocks, :, offsets] = v.to(self.v.dtype)

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # blocks (..., n) -> keys and values (..., Hkv, n * block_size, D): a copy (the torch path's)
        k, v = self.k[blocks], self.v[blocks]  # (..., n, Hkv, D, bs), (..., n, Hkv, bs, D)
        *lead, n, hkv, d, bs = k.shape
        k = k.transpose(-1, -2).movedim(-4, -3).reshape(*lead, hkv, n * bs, d)
        v = v.movedim(-4, -3).reshape(*lead, hkv, n * bs, d)
        return k, v


@functools.cache
def _native_bf16() -> bool:
    return bf16_arithmetic(kernels.cpu_class("auto"))  # (held by POWERINFER_MAX_ISA, as torch is)


def emulated_bf16(x: torch.Tensor) -> bool:
    """Whether x is bf16 on a CPU without bf16 arithmetic (no AVX-512 BF16 or AMX), where torch
    emulates its bf16 GEMM: 4.7-6.5x float32's time for a 128-row product of SmolLM2's and a
    7B's shapes on an AVX2 EPYC Milan (`benchmarks/bf16_gemm.py`). Products of many rows
    there run in float32, a slice of the bf16 weights widened at a time, and round to bf16
    once, as torch's bf16 GEMM sums in float32 and rounds once."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not _native_bf16()


# input rows from which an emulated bf16 product runs in float32: 1.03-2.56x torch's bf16 GEMM at
# 16 rows over SmolLM2's and a 7B's shapes in two runs, 3.2-5.1x at 64; at 8 rows a 7B's FFN
# 0.58x and 0.93x (an AVX2 EPYC Milan, `benchmarks/bf16_gemm.py --rows R`)
WIDE_ROWS = 16
WIDE_SLICE_BYTES = 8 << 20  # float32 weight rows widened at a time


def wide(x: torch.Tensor) -> bool:
    """Whether x's product runs in float32: WIDE_ROWS rows or more, bf16, on a CPU that
    emulates bf16 (`emulated_bf16`)."""
    return x.numel() >= WIDE_ROWS * x.shape[-1] and emulated_bf16(x)


def linear_f32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, b) for bf16 x and w in float32 (`emulated_bf16`): WIDE_SLICE_BYTES of w's
    rows widened at a time (a 7B head whole would be 0.5 GB), each slice's sums rounded to bf16
    into the output."""
    out = x.new_empty(*x.shape[:-1], w.shape[0])
    x32 = x.float()
    step = max(1, WIDE_SLICE_BYTES // (w.shape[1] * 4))
    for lo in range(0, w.shape[0], step):
        hi = min(lo + step, w.shape[0])
        out[..., lo:hi] = F.linear(x32, w[lo:hi].float(), None if b is None else b[lo:hi].float())
    return out


class Linear(nn.Linear):
    """nn.Linear. For a single token under torch.compile on a CPU it is written as a
    multiply-reduce, which Inductor turns into one vectorised pass over the weight: the BLAS GEMV
    reaches about a third of the memory bandwidth there (BENCHMARKS.md), and decode is bound by
    reading weights. Many bf16 rows on a CPU that emulates bf16 run in float32 (`linear_f32`)."""

    def forward(self, x):
        if x.numel() == x.shape[-1] and x.device.type == "cpu" and torch.compiler.is_compiling():
            y = (self.weight.float() * x.float().unsqueeze(-2)).sum(-1).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if wide(x) and self.weight.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
            return linear_f32(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float, layer_norm: bool):
        super().__init__()
        self.eps, self.layer_norm = eps, layer_norm
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if layer_norm else None

    def forward(self, x):
        if self.layer_norm:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        if x.dtype == self.weight.dtype and _fused_cpu(x):
            return torch.ops.powerinfer.rms_norm(x, self.weight, self.eps)  # one call, same values
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def _fused_cpu(x: torch.Tensor) -> bool:
    """Whether an inference step on `x` runs the kernel library's fused ops (norms and one-token
    attention: a decode step's small ops cost more in dispatch than in arithmetic). Compiled
    steps call them too: Inductor's own kernels for the same ops took longer (SmolLM2
    bf16+int4+compile 171 -> 182 tok/s with the fused ops, and half the compile time). With
    autograd on, torch's run."""
    return (x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()
            and kernels.usable(x))


class Attention(nn.Module):
    """partial: a share of a layer's heads (a.n_heads of them, with their a.n_kv_heads), whose
    output projection is that of their columns, applied in float32 and answered in float32 so
    that the shares add up before one rounding (the actor runtime splits heads over processes)."""

    def __init__(self, a: ModelArgs, partial: bool = False, layer: int = 0):
        super().__init__()
        self.partial, self.layer = partial, layer
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.window, self.scale = a.window(layer), a.scale
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.wqkv = Linear(a.dim, q + 2 * kv, bias=a.qkv_bias)  # fused q, k, v
        self.wo = Linear(q, a.dim, bias=a.o_bias)
        self.q_norm = Norm(a.head_dim, a.norm_eps, False) if a.qk_norm else None
        self.k_norm = Norm(a.head_dim, a.norm_eps, False) if a.qk_norm else None
        self.kv_cache: KVCache | None = None

    def _qk_normed(self, qkv):  # (N, (H + 2 Hkv) D): each head's q and k through its norm
        qw, kw = self.q_norm.weight, self.k_norm.weight
        if qkv.dtype == qw.dtype and _fused_cpu(qkv):  # one call, the same values
            return torch.ops.powerinfer.qk_norm(qkv, qw, kw, self.n_heads, self.n_kv_heads,
                                                self.q_norm.eps)
        N, D = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.n_heads * D, self.n_kv_heads * D, self.n_kv_heads * D], dim=-1)
        q = self.q_norm(q.reshape(N, self.n_heads, D)).reshape(N, -1)
        k = self.k_norm(k.reshape(N, self.n_kv_heads, D)).reshape(N, -1)
        return torch.cat([q, k, v], dim=-1)

    def forward(self, x, rope, pos, kv: KVTables):
        # x: (B, T, dim), the step's tokens in kv's order; pos: (B*T,) their positions;
        # rope: (cos, sin) each (B*T, head_dim) float32 at those positions, or None
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B * T, -1)
        if self.q_norm is not None:
            qkv = self._qk_normed(qkv)
        # rope, the cache's update, attention: one call (the kernel library's on a CPU; for a
        # decode step where the Triton kernels run, `triton_attention`'s, in `paged_attention`)
        if _fused_cpu(x) and self.head_dim % 16 == 0 and not kernels.on_triton(x):
            none = qkv.new_empty(0, dtype=torch.float32)
            cos, sin = (none, none) if rope is None else rope
            c = self.kv_cache
            y = torch.ops.powerinfer.paged_attention(qkv, cos, sin, c.k, c.v, kv.tables, kv.starts, pos,
                                                     self.n_heads, self.window, self.scale)
        else:
            y = paged_attention(qkv, rope, pos, kv, self.kv_cache, self.n_heads, self.window,
                                self.scale)
        return self._out(y.view(B, T, self.n_heads * self.head_dim))

    def _out(self, y):  # y: (B, T, q_size) the heads' outputs
        return self.wo(y.float()) if self.partial else self.wo(y)


class FFN(nn.Module):
    """Dense FFN. `neurons(x)` is the per-neuron activation vector the sparse engine predicts."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.act, self.ffn_dim = a.ffn_act, a.ffn_dim
        width = 2 * a.ffn_dim if a.gated else a.ffn_dim
        self.w1 = Linear(a.dim, width, bias=a.ffn_bias)  # gated: [gate; up] fused, else up (fc1)
        self.w2 = Linear(a.ffn_dim, a.dim, bias=a.ffn_bias)  # down (fc2)

    def neurons(self, x):  # x: (B, T, dim) -> (B, T, ffn_dim)
        h = self.w1(x)
        if self.act == "relu":
            return F.relu(h)
        if self.act == "gelu":
            return F.gelu(h)
        gate, up = h.split(self.ffn_dim, dim=-1)
        if self.act == "swiglu":
            return F.silu(gate) * up
        if self.act == "reglu":
            return F.relu(gate) * up
        if self.act == "geglu":
            return F.gelu(gate, approximate="tanh") * up
        return F.relu(gate) * F.relu(up)  # dreglu

    def forward(self, x, layer_input=None):
        # layer_input: the block's input, which a sparse FFN's lookahead predictor reads
        return self.w2(self.neurons(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer: int = 0):
        super().__init__()
        self.layer, self.parallel = layer, a.parallel
        self.rope = 1 if a.local(layer) else 0  # which of `Transformer.ropes`' tables it reads
        self.attn_norm = Norm(a.dim, a.norm_eps, a.layer_norm)
        self.attn = Attention(a, layer=layer)
        self.ffn_norm = Norm(a.dim, a.norm_eps, a.layer_norm)
        self.ffn = FFN(a)
        # Gemma 3: each branch's output normed before it joins the residual
        self.post_attn_norm = Norm(a.dim, a.norm_eps, False) if a.post_norms else None
        self.post_ffn_norm = Norm(a.dim, a.norm_eps, False) if a.post_norms else None

    def forward(self, x, rope, pos, kv: KVTables):
        # rope: the (cos, sin) rows of this layer's table (`Transformer.ropes`), or None
        y = self.attn(self.attn_norm(x), rope, pos, kv)
        if self.post_attn_norm is not None:
            y = self.post_attn_norm(y)
        if self.parallel:  # both branches read the layer input
            return x + y + self.ffn(self.ffn_norm(x), x)
        h = x + y
        y = self.ffn(self.ffn_norm(h), x)
        if self.post_ffn_norm is not None:
            y = self.post_ffn_norm(y)
        return h + y


def _embedding(n: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without the random init when built on the meta device (`from_weights`):
    there it would import torch's decompositions, some 50 MB in every process, for nothing."""
    w = torch.empty(n, dim)
    return nn.Embedding(n, dim, _weight=w) if w.device.type == "meta" else nn.Embedding(n, dim)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = _embedding(a.vocab_size, a.dim)
        # OPT keeps two unused rows in front of its position table (HF's offset of 2)
        self.pos_embeddings = _embedding(a.position_rows, a.dim) if a.learned_pos else None
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.n_layers))
        self.norm = Norm(a.dim, a.norm_eps, a.layer_norm)
        self.output = Linear(a.dim, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_seq = 0
        self.rows: torch.Tensor | None = None  # setup_cache's blocks of each batch row

    def setup_pool(self, num_blocks: int, block_size: int, max_seq: int,
                   ropes: tuple | None = None):
        """Allocate every layer's paged KV cache: `num_blocks` blocks of `block_size` positions
        (each attention caches only the KV heads it holds), for positions below max_seq. ropes:
        the memory of the RoPE tables where the caller has it (an actor group's segment, which
        the cold executors read too: `rope_tables`' shapes, rows not yet filled), on a CPU."""
        a, w = self.args, self.norm.weight  # the model's dtype and device
        if getattr(self, "rope_filled", None) is not None:  # set up again: a native step made
            self.rope_ensure(self.max_seq - 1)  # on the old tables reads them still, so whole
        for b in self.layers:
            b.attn.kv_cache = KVCache(num_blocks, b.attn.n_kv_heads, block_size, b.attn.head_dim,
                                      w.dtype, w.device)
        self.max_seq, self.rows = max_seq, None
        if not a.learned_pos:
            # the tables' rows are filled as steps reach their positions (`rope_ensure`): a
            # model's whole context took its tables' size in every process that attends, read or
            # not (Gemma 3: cos and sin of two bases for 32,768 positions, 128 MiB); a device's
            # tables are filled whole (its CUDA graphs read them without a step's check)
            given = ropes if ropes is not None and w.device.type == "cpu" else None
            for k, end in enumerate(("", "_local")[:2 if a.rope_base_local else 1]):
                for j, kind in enumerate(("rope_cos", "rope_sin")):
                    t = torch.empty(max_seq, a.head_dim, device=w.device) if given is None \
                        else given[k][j]
                    self.register_buffer(kind + end, t, persistent=False)
            self.rope_filled = 0
            if w.device.type != "cpu":
                self.rope_ensure(max_seq - 1)

    def setup_cache(self, max_batch: int, max_seq: int, block_size: int = 16):
        """A KV cache for `max_batch` rows of `max_seq` positions, each row its own blocks: what
        a caller that runs rows as sequences needs (`forward` without tables; idempotent for the
        same or smaller sizes). A server deals blocks out instead (`setup_pool`)."""
        per = -(-max_seq // block_size)
        if self.rows is not None and max_batch <= self.rows.shape[0] and per <= self.rows.shape[1]:
            return
        self.setup_pool(max_batch * per, block_size, max_seq)
        device = self.norm.weight.device
        self.rows = torch.arange(max_batch * per, dtype=torch.int32, device=device).view(max_batch, per)

    def row_tables(self, B: int, T: int, slots: torch.Tensor | None = None) -> KVTables:
        """KVTables for a (B, T) step whose row b is sequence b, in the blocks `setup_cache` gave
        row b (or row slots[b])."""
        assert self.rows is not None, "setup_cache first (or pass tables from a block manager)"
        dev = self.norm.weight.device
        if self.rows.device != dev:  # (a plain attribute: a model moved after setup_cache)
            self.rows = self.rows.to(dev)
        return KVTables(torch.arange(0, B * T + 1, T, device=dev),
                        self.rows[:B] if slots is None else self.rows[slots])

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, kv: KVTables | None = None,
                last: torch.Tensor | None = None):
        # tokens, pos: (B, T) int64, the step's tokens (flattened, in kv's order; kv None: row b
        # is sequence b in its `setup_cache` blocks). Returns fp32 logits (B, T, vocab), or
        # (K, 1, vocab) at the flat token indices `last` (K,) (a prompt needs its last token's).
        B, T = tokens.shape
        kv = self.row_tables(B, T) if kv is None else kv
        if STEP_MEMO and not torch.compiler.is_compiling():  # this step's memo, for its layers
            kv = KVTables(kv.starts, kv.tables, {})
        flat = pos.reshape(-1)
        h = self.tok_embeddings(tokens)
        if self.args.embed_scale:  # in the activations' dtype, as Gemma's reference scales
            h = h * torch.tensor(self.args.embed_scale, dtype=h.dtype)
        ropes = self.ropes(flat)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(pos + 2)
        for block in self.layers:
            h = block(h, ropes[block.rope], flat, kv)
        if last is not None:
            h = h.reshape(B * T, -1)[last].unsqueeze(1)
            if h.shape[0] == 0:  # a step of prompt chunks that sample nothing: no head to run
                return h.new_zeros(0, 1, self.args.vocab_size, dtype=torch.float32)
        return self.output(self.norm(h)).float()

    def rope_ensure(self, pos: "torch.Tensor | np.ndarray | int"):
        """Fill the RoPE tables' rows up to the largest of the positions `pos` (a step's), in
        whole chunks of `formats.rope.ROPE_CHUNK` rows: every step calls it before its layers
        read the rows (`ropes`; the native loops' and the compiled steps' callers)."""
        if getattr(self, "rope_filled", self.max_seq) >= self.max_seq:
            return
        if not isinstance(pos, int):
            if pos.size == 0 if isinstance(pos, np.ndarray) else pos.numel() == 0:
                return
            pos = int(pos.max())

        def write(table, lo, hi, cos, sin):
            end = ("", "_local")[table]
            getattr(self, "rope_cos" + end)[lo:hi].copy_(torch.from_numpy(cos))
            getattr(self, "rope_sin" + end)[lo:hi].copy_(torch.from_numpy(sin))
        with torch.inference_mode():  # (tables made under it are written only under it)
            self.rope_filled = rope.fill_rows(self.args, self.max_seq, self.rope_filled, pos, write)

    def ropes(self, flat: torch.Tensor) -> tuple:
        """(global, local) (cos, sin) rows at positions `flat` (local: the sliding layers' own
        table, or the global one again); (None, None) with learned positions."""
        if self.pos_embeddings is not None:
            return None, None
        if not torch.compiler.is_compiling():  # (a compiled step's caller fills them)
            self.rope_ensure(flat)
        rope = (self.rope_cos[flat].float(), self.rope_sin[flat].float())
        if not self.args.rope_base_local:
            return rope, rope
        return rope, (self.rope_cos_local[flat].float(), self.rope_sin_local[flat].float())

    @classmethod
    def from_weights(cls, args: ModelArgs, weights: dict[str, torch.Tensor], dtype, device):
        with torch.device("meta"):
            model = cls(args)
        model = allocated(model, dtype, device)  # allocated in dtype, never touched
        if args.tie_embeddings:  # each module has its own storage now: tie again
            model.output.weight = model.tok_embeddings.weight
        model.load_weights(weights)
        return model.eval().requires_grad_(False)

    def load_weights(self, w: dict[str, torch.Tensor], skip=None):
        """Copy canonical weights (see loader.TENSOR_NAMES) into the model, fusing q/k/v and
        gate/up. Raises ValueError naming the tensor on a missing name or a shape mismatch.
        Parts already held another way (a quantized embedding or projection, a FFN replaced by
        neuron sets) are skipped: their module has no plain weight or is no `nn.Linear`. So is
        a parameter whose first canonical tensor `skip` (a predicate on names) holds: left as
        it is, to be replaced or loaded by a later call."""
        a = self.args

        def put(param: torch.Tensor | None, *parts: str):
            if param is None or (skip is not None and skip(parts[0])):
                return
            missing = [p for p in parts if p not in w]
            if missing:
                raise ValueError(f"missing tensor {missing[0]}")
            if hasattr(w, "read_into"):  # a lazy source: each part read straight into place
                shapes = [tuple(w.shape(p)) for p in parts]
                if (sum(x[0] for x in shapes), *shapes[0][1:]) != tuple(param.shape):
                    raise ValueError(f"tensor {'+'.join(parts)} has shapes {shapes}, "
                                     f"expected {tuple(param.shape)} together")
                off = 0
                with torch.no_grad():
                    for p, x in zip(parts, shapes):
                        w.read_into(p, param[off:off + x[0]])
                        off += x[0]
                return
            src = torch.cat([w[p] for p in parts]) if len(parts) > 1 else w[parts[0]]
            if src.shape != param.shape:
                raise ValueError(f"tensor {'+'.join(parts)} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(src)

        put(getattr(self.tok_embeddings, "weight", None), "embed")
        if self.pos_embeddings is not None:
            put(self.pos_embeddings.weight, "pos_embed")
        put(self.norm.weight, "norm")
        if a.layer_norm:
            put(self.norm.bias, "norm_b")
        if not a.tie_embeddings and isinstance(self.output, nn.Linear):
            put(self.output.weight, "output")
        for i, b in enumerate(self.layers):
            p = f"{i}."
            put(b.attn_norm.weight, p + "attn_norm")
            put(getattr(b.ffn_norm, "weight", None), p + "ffn_norm")  # (a HybridFFN holds its own)
            if a.layer_norm:
                put(b.attn_norm.bias, p + "attn_norm_b")
                put(getattr(b.ffn_norm, "bias", None), p + "ffn_norm_b")
            if a.post_norms:
                put(b.post_attn_norm.weight, p + "post_attn_norm")
                put(b.post_ffn_norm.weight, p + "post_ffn_norm")
            attn = b.attn
            if getattr(attn, "q_norm", None) is not None:
                put(attn.q_norm.weight, p + "q_norm")
                put(attn.k_norm.weight, p + "k_norm")
            for owner, attr, names in self.projections(i):
                linear = getattr(owner, attr, None)
                if not isinstance(linear, nn.Linear):
                    continue
                put(linear.weight, *names)
                if linear.bias is not None:
                    put(linear.bias, *(n + "_b" for n in names))

    def projections(self, i: int) -> list[tuple[nn.Module, str, tuple[str, ...]]]:
        """Block i's projections as (owner, attribute, canonical tensors fused into its weight):
        the one place that says what is fused (loading and int4 conversion both read it)."""
        b, a, p = self.layers[i], self.args, f"{i}."
        parts = [(b.attn, "wqkv", ("q", "k", "v")), (b.attn, "wo", ("o",)),
                 (b.ffn, "w1", ("gate", "up") if a.gated else ("up",)), (b.ffn, "w2", ("down",))]
        return [(owner, attr, tuple(p + n for n in names)) for owner, attr, names in parts]


def allocated(model: nn.Module, dtype: torch.dtype, device) -> nn.Module:
    """A model built on the meta device with its parameters and buffers allocated on `device`
    (floating point ones in `dtype`), uninitialized and so not resident until written: what
    `model.to(dtype).to_empty(device=device)` gives, without its path through torch's Python
    references for meta tensors, which imports torch.fx's symbolic shapes and sympy (34 MiB of
    a process's own memory, in every process that builds a model)."""
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                  device=device)
                table[name] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) \
                    else new
    return model


def held_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct tensor storages (parameters and buffers) the modules hold: what a
    process keeps of a model, a tied or shared tensor counted once."""
    return sum(st.nbytes() for st in _storages(*modules).values())


def host_parts(*modules: nn.Module) -> dict[str, int]:
    """The host memory the modules hold, as `held_bytes` counts it, in two parts: the KV cache's
    blocks (`KVCache` buffers) and the rest (weights, norms, RoPE tables); and of each the bytes
    in RAM now (`resident_bytes`: a KV cache's untouched blocks, or a mapped file's pages not
    yet read, are not)."""
    caches = [c for m in modules for c in m.modules() if isinstance(c, KVCache)]
    kv = _storages(*caches, device="cpu")
    weights = [st for ptr, st in _storages(*modules, device="cpu").items() if ptr not in kv]
    return {"weight_bytes": sum(st.nbytes() for st in weights),
            "kv_bytes": sum(st.nbytes() for st in kv.values()),
            "weight_resident": sum(map(resident_bytes, weights)),
            "kv_resident": sum(map(resident_bytes, kv.values()))}


def _storages(*modules: nn.Module, device: str | None = None) -> dict:
    """The distinct storages of the modules' parameters and buffers, by address (none on
    "meta"; with `device`, only those on that kind of device)."""
    out = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if t.device.type != "meta" and device in (None, t.device.type):
                out.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    return out


def resident_bytes(storage) -> int:
    """Bytes of a host storage's pages in RAM now (`compat.resident`)."""
    return resident(storage.data_ptr(), storage.nbytes())


def paged_attention(qkv, rope, pos, kv: KVTables, cache: KVCache, n_heads: int, window: int,
                    scale: float) -> torch.Tensor:
    """torch's version of the kernel library's `paged_attention` (the same math, with gathered
    copies of each sequence's blocks: the path on a GPU, or where the library cannot run).
    qkv (N, (H + 2 Hkv) D) the step's tokens in kv's order; rope (cos, sin) (N, D) or None; pos
    (N,): each token sees positions [pos - window + 1, pos] (window 0: [0, pos]) -> (N, H D)."""
    N, (Hkv, D) = qkv.shape[0], cache.k.shape[1:3]
    bs = cache.block_size
    if (TRITON_ATTENTION and N == kv.tables.shape[0] and qkv.dtype == cache.k.dtype
            and kernels.on_triton(qkv)):
        from ..kernels import triton_attention
        if triton_attention.fits(D, bs):
            return triton_attention.decode_attention(qkv, rope, pos, kv.tables, cache.k, cache.v,
                                                     n_heads, window, scale)
    q, k, v = qkv.split([n_heads * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(N, n_heads, D), k.view(N, Hkv, D), v.view(N, Hkv, D)
    if rope is not None:
        cos, sin = (r.unsqueeze(1) for r in rope)  # (N, 1, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    S = kv.tables.shape[0]
    # the step's index work, the same for each layer: done by its first layer (on each device)
    memo = {} if kv.memo is None else kv.memo
    slots = memo.get(("slots", bs, pos.device))
    if slots is None:
        seq = torch.repeat_interleave(torch.arange(S, device=pos.device), kv.starts.diff(),
                                      output_size=N)
        slots = memo[("slots", bs, pos.device)] = (kv.tables[seq, pos // bs].long(), pos % bs)
    cache.write(*slots, k, v)

    def attend(q, pos, blocks, key=None):  # q (S', T', H, D), pos (S', T'), blocks (S', n) long
        keys, values = cache.gather(blocks)  # (S', Hkv, n * bs, D)
        mask = None if key is None else memo.get(key)
        if mask is None:
            key_pos = torch.arange(keys.shape[-2], device=pos.device)
            mask = key_pos <= pos[..., None]  # (S', T', L)
            if window:
                mask &= key_pos > pos[..., None] - window
            mask = mask.unsqueeze(1)
            if key is not None:
                memo[key] = mask
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                           attn_mask=mask, scale=scale, enable_gqa=n_heads != Hkv)
        return y.transpose(1, 2)  # (S', T', H, D)

    if N == S:  # one token a sequence (decode): one product over every sequence's blocks
        blocks = memo.get(("blocks", pos.device))
        if blocks is None:
            blocks = memo[("blocks", pos.device)] = kv.tables.long()
        return attend(q.unsqueeze(1), pos.unsqueeze(1), blocks,
                      ("mask", window, bs, pos.device)).reshape(N, n_heads * D)
    out, starts = [], kv.starts.tolist()
    for s, (a, b) in enumerate(zip(starts, starts[1:])):
        if b > a:
            n = -(-(int(pos[a:b].max()) + 1) // bs)
            out.append(attend(q[None, a:b], pos[None, a:b], kv.tables[s:s + 1, :n].long())[0])
    return torch.cat(out).reshape(N, n_heads * D)


def rope_tables(a: ModelArgs, max_seq: int) -> tuple:
    """(global, local) `rope_table`s, as `Block.rope` indexes them: local is the global one
    unless the sliding layers have their own base."""
    glob = rope_table(a, max_seq)
    return glob, rope_table(a, max_seq, True) if a.rope_base_local else glob


def rope_table(a: ModelArgs, max_seq: int, local: bool = False, lo: int = 0, hi: int | None = None):
    """`formats.rope.rope_table` as float32 tensors: cos/sin (max_seq, head_dim), or their rows
    [lo, hi)."""
    return tuple(torch.from_numpy(t) for t in rope.rope_table(a, max_seq, local, lo, hi))


def apply_rope(x, cos, sin):
    # x: (..., D); cos, sin broadcast to it
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
