"""The dense reference model: one forward-pass definition for every supported architecture.

A block reads `h = h + attn(norm(h)); h = h + ffn(norm(h))`. The variants are switches in
`ModelArgs`: the LLaMA family (RMSNorm, RoPE, gated FFN with SwiGLU / ReGLU / dReLU; Mistral and
Qwen2 differ only in configuration) and OPT (LayerNorm, learned positions, ReLU FFN with biases).
The sparse engine replaces `Block.ffn` on a finished model; everything else is shared.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

FFN_ACTS = ("swiglu", "reglu", "dreglu", "relu")


@dataclass(slots=True)
class ModelArgs:
    arch: str  # "llama" (the LLaMA family) or "opt"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0: dim // n_heads
    ffn_act: str = "swiglu"  # swiglu: silu(g)*u, reglu: relu(g)*u, dreglu: relu(g)*relu(u), relu: relu(u)
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: tuple | None = None  # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_pos)
    max_seq_len: int = 2048  # the model's trained context
    qkv_bias: bool = False  # Qwen2, OPT, LLaMA with attention_bias
    o_bias: bool = False  # OPT, LLaMA with attention_bias
    ffn_bias: bool = False  # OPT
    sliding_window: int = 0  # Mistral: attend to the last `sliding_window` positions (0: all)
    tie_embeddings: bool = False
    # OPT switches
    layer_norm: bool = False  # LayerNorm with bias instead of RMSNorm
    learned_pos: bool = False  # learned absolute positions (offset 2) instead of RoPE

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        assert self.arch in ("llama", "opt"), self.arch
        assert self.ffn_act in FFN_ACTS, self.ffn_act
        assert self.n_heads % self.n_kv_heads == 0, (self.n_heads, self.n_kv_heads)

    @property
    def gated(self) -> bool:
        return self.ffn_act != "relu"


def _zeros(shape, dtype, device) -> torch.Tensor:
    """torch.zeros; on the CPU from calloc (numpy's zeros), whose large blocks are fresh zero
    pages: a KV cache is resident only as far as positions are written, not at allocation."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = int(np.prod(shape)) * dtype.itemsize
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)


class KVCache(nn.Module):
    """Static cache: rows are sequences (slots), positions index the time axis."""

    def __init__(self, batch: int, n_kv_heads: int, max_seq: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq, head_dim)
        self.register_buffer("k", _zeros(shape, dtype, device), persistent=False)
        self.register_buffer("v", _zeros(shape, dtype, device), persistent=False)

    def update(self, slots, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int):
        # slots: (B,) cache rows or None for rows 0..B-1; pos: (B, T); k, v: (B, H, T, D).
        # Writes the new entries, then returns each row's first kv_len positions.
        B = k.shape[0]
        rows = torch.arange(B, device=k.device) if slots is None else slots
        self.k[rows[:, None], :, pos] = k.transpose(1, 2)  # indexed view is (B, T, H, D)
        self.v[rows[:, None], :, pos] = v.transpose(1, 2)
        if slots is None:
            return self.k[:B, :, :kv_len], self.v[:B, :, :kv_len]
        return self.k[slots, :, :kv_len], self.v[slots, :, :kv_len]


class Linear(nn.Linear):
    """nn.Linear. For a single token under torch.compile on a CPU it is written as a
    multiply-reduce, which Inductor turns into one vectorised pass over the weight: the BLAS GEMV
    reaches about a third of the memory bandwidth there (BENCHMARKS.md), and decode is bound by
    reading weights."""

    def forward(self, x):
        if x.numel() == x.shape[-1] and x.device.type == "cpu" and torch.compiler.is_compiling():
            y = (self.weight.float() * x.float().unsqueeze(-2)).sum(-1).to(x.dtype)
            return y if self.bias is None else y + self.bias
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

    def __init__(self, a: ModelArgs, partial: bool = False):
        super().__init__()
        self.partial = partial
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.wqkv = Linear(a.dim, q + 2 * kv, bias=a.qkv_bias)  # fused q, k, v
        self.wo = Linear(q, a.dim, bias=a.o_bias)
        self.kv_cache: KVCache | None = None

    def forward(self, x, rope, mask, slots, pos, kv_len: int):
        # x: (B, T, dim); rope: (cos, sin) each (B, 1, T, head_dim) or None; mask: (B, 1, T, kv_len)
        B, T, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qkv = self.wqkv(x)
        if T == 1 and _fused_cpu(x):  # rope, the cache's update and attention in one call
            none = qkv.new_empty(0, dtype=torch.float32)
            cos, sin = (none, none) if rope is None else (r[:, 0, 0].float() for r in rope)
            rows = torch.arange(B) if slots is None else slots
            y = torch.ops.powerinfer.decode_attention(
                qkv.view(B, -1), cos, sin, self.kv_cache.k, self.kv_cache.v, rows, pos[:, 0],
                mask[:, 0, 0], self.n_heads)
            return self._out(y.view(B, T, q_size))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k, v = self.kv_cache.update(slots, pos, k, v, kv_len)
        if T == 1 and (x.device.type == "cpu" or torch.compiler.is_compiling()):
            y = decode_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               enable_gqa=self.n_heads != self.n_kv_heads)
        return self._out(y.transpose(1, 2).reshape(B, T, q_size))

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
        gate, up = h.split(self.ffn_dim, dim=-1)
        if self.act == "swiglu":
            return F.silu(gate) * up
        if self.act == "reglu":
            return F.relu(gate) * up
        return F.relu(gate) * F.relu(up)  # dreglu

    def forward(self, x, layer_input=None):
        # layer_input: the block's input, which a sparse FFN's lookahead predictor reads
        return self.w2(self.neurons(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attn_norm = Norm(a.dim, a.norm_eps, a.layer_norm)
        self.attn = Attention(a)
        self.ffn_norm = Norm(a.dim, a.norm_eps, a.layer_norm)
        self.ffn = FFN(a)

    def forward(self, x, rope, mask, slots, pos, kv_len: int):
        h = x + self.attn(self.attn_norm(x), rope, mask, slots, pos, kv_len)
        return h + self.ffn(self.ffn_norm(h), x)


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
        self.pos_embeddings = _embedding(a.max_seq_len + 2, a.dim) if a.learned_pos else None
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = Norm(a.dim, a.norm_eps, a.layer_norm)
        self.output = Linear(a.dim, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch = self.max_seq = 0

    def setup_cache(self, max_batch: int, max_seq: int):
        """Allocate the static KV cache (idempotent for the same or smaller sizes)."""
        if max_batch <= self.max_batch and max_seq <= self.max_seq:
            return
        a, w = self.args, self.norm.weight  # the model's dtype and device
        self.max_batch, self.max_seq = max_batch, max_seq
        for b in self.layers:  # (an attention over a share of the heads caches only theirs)
            b.attn.kv_cache = KVCache(max_batch, b.attn.n_kv_heads, max_seq, b.attn.head_dim,
                                      w.dtype, w.device)
        if not a.learned_pos:
            cos, sin = rope_table(a, max_seq)
            self.register_buffer("rope_cos", cos.to(w.device), persistent=False)
            self.register_buffer("rope_sin", sin.to(w.device), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int,
                slots: torch.Tensor | None = None, last: torch.Tensor | None = None):
        # tokens, pos: (B, T) int64; slots: (B,) KV cache rows (None: 0..B-1); attends to cache
        # positions [0, kv_len). Returns fp32 logits (B, T, vocab), or (B, 1, vocab) at the
        # per-row positions `last` (B,) when given (prefill only needs each prompt's last token).
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(pos + 2)
        tables = None if self.pos_embeddings is not None else (self.rope_cos, self.rope_sin)
        rope, mask = attention_inputs(self.args, tables, pos, kv_len)
        for block in self.layers:
            h = block(h, rope, mask, slots, pos, kv_len)
        if last is not None:
            h = h[torch.arange(h.shape[0], device=h.device), last].unsqueeze(1)
        return self.output(self.norm(h)).float()

    @classmethod
    def from_weights(cls, args: ModelArgs, weights: dict[str, torch.Tensor], dtype, device):
        with torch.device("meta"):
            model = cls(args)
        model = model.to(dtype).to_empty(device=device)  # allocated in dtype, never touched
        if args.tie_embeddings:  # to_empty gives each module its own storage: tie again
            model.output.weight = model.tok_embeddings.weight
        model.load_weights(weights)
        return model.eval().requires_grad_(False)

    def load_weights(self, w: dict[str, torch.Tensor]):
        """Copy canonical weights (see loader.TENSOR_NAMES) into the model, fusing q/k/v and
        gate/up. Raises ValueError naming the tensor on a missing name or a shape mismatch.
        Parts already held another way (a quantized embedding or projection, a FFN replaced by
        neuron sets) are skipped: their module has no plain weight or is no `nn.Linear`."""
        a = self.args

        def put(param: torch.Tensor | None, *parts: str):
            if param is None:
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
            put(b.ffn_norm.weight, p + "ffn_norm")
            if a.layer_norm:
                put(b.attn_norm.bias, p + "attn_norm_b")
                put(b.ffn_norm.bias, p + "ffn_norm_b")
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

def held_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct tensor storages (parameters and buffers) the modules hold: what a
    process keeps of a model, a tied or shared tensor counted once."""
    seen, total = set(), 0
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            st = t.untyped_storage()
            if st.data_ptr() not in seen and t.device.type != "meta":
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def attention_inputs(a: ModelArgs, tables, pos: torch.Tensor, kv_len: int):
    """A step's rotary embedding and attention mask: tables (cos, sin) from `rope_table`, or
    None (learned positions); pos (B, T) -> (rope: (cos, sin) each (B, 1, T, head_dim) or None,
    mask (B, 1, T, kv_len) bool: the cache positions each query attends to)."""
    rope = None if tables is None else tuple(t[pos].unsqueeze(1) for t in tables)
    key_pos = torch.arange(kv_len, device=pos.device)
    mask = key_pos[None, None, :] <= pos[:, :, None]  # (B, T, kv_len)
    if a.sliding_window:
        mask &= key_pos[None, None, :] > pos[:, :, None] - a.sliding_window
    return rope, mask.unsqueeze(1)


def rope_table(a: ModelArgs, max_seq: int):
    """cos/sin tables (max_seq, head_dim) in the half-rotation layout (HF's rotate_half)."""
    d = a.head_dim
    inv_freq = 1.0 / (a.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if a.rope_scaling is not None:
        inv_freq = llama3_scaled(inv_freq, *a.rope_scaling[1:])
    t = torch.arange(max_seq, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def llama3_scaled(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_pos):
    # Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    # a smooth blend in between.
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original_max_pos / low_freq_factor, original_max_pos / high_freq_factor
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, out)


def decode_attention(q, k, v, mask):
    # q: (B, H, 1, D); k, v: (B, Hkv, L, D); mask: (B, 1, 1, L). One query per row: plain
    # matmuls cost less than the CPU flash kernel's setup, eager or fused by Inductor
    # (BENCHMARKS.md: 121 against 30-50 us a layer on the default model).
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.view(B, Hkv, H // Hkv, D).float()  # the query heads sharing each KV head
    scores = (qg @ k.float().transpose(-1, -2)) * D ** -0.5  # (B, Hkv, G, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype).view(B, H, 1, D)


def apply_rope(x, cos, sin):
    # x: (B, H, T, D); cos, sin: (B, 1, T, D)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
