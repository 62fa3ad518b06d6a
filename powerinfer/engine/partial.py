"""Building a share of a model from its file, reading only that share: what the actor
runtime's executors hold (a cold executor: its shard of every layer's cold neurons; the hot
executor: embeddings, attention, norms, the output head and the hot neurons).

Tensors come from the checkpoint's `TensorSource` (the file's memory map): a neuron set reads
its neurons' gate and up rows and its columns of the down projection, one layer at a time, and
no process ever holds a dequantized copy of the whole model. Where the kernel has the file's
format the rows stay in it: 4-bit gate and up rows are the file's blocks, copied as they are
(down rows are requantized to Q8_0, see `kernels.down_format`), and a Q8_0 or 4-bit token
embedding stays in its blocks, shared with a tied output head.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..errors import ConfigError
from ..formats import kquants
from ..formats.args import ModelArgs
from ..formats.kquants import BLOCK_BYTES
from ..formats.q4 import Q4_TYPES
from ..formats.source import LazyWeights, ModelFile, TensorSource
from ..model.quant import (
    BlockEmbedding,
    KernelEmbedding,
    KernelLinear,
    KQuantLinear,
    block_format,
    int4_linear,
    kernel_head,
    neuron_format,
    q8_0_linear,
)
from ..model.sparse import BlockSlice, HybridFFN, NeuronSet
from ..model.transformer import Attention, Norm, Transformer, allocated
from .plan import BLOCK

# GGUF types whose rows the kernel reads as they are stored
STORED_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


class StoredQ4(Mapping):
    """A TensorSource's 4-bit tensors as the name -> `q4_blocks` triple mapping `apply_int4`
    reads: each read from the file (`TensorSource.q4`) when asked for, and not kept."""

    def __init__(self, source: TensorSource):
        self.source = source

    def __getitem__(self, name: str):
        if name not in self:
            raise KeyError(name)
        return self.source.q4(name)

    def __contains__(self, name) -> bool:
        return name in self.source.names and self.source.kind(name) in Q4_TYPES

    def __iter__(self):
        return (n for n in self.source.names if n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def deferred_model(ckpt, dtype: torch.dtype, blocks: bool, ffn: bool) -> tuple[Transformer, set[str]]:
    """The in-process model over the file's tensors, each read (and widened to `dtype`) straight
    into its parameter: (the model, the canonical tensors not read yet). With `blocks` (the 4-bit
    configuration) what it may hold as the file's blocks is not read yet: the projections'
    matrices (with `ffn`, the FFN's are read: a bundle's neuron sets are made from them), the
    output head, and a token embedding stored in a kernel format; their parameters are allocated
    and left untouched (not resident) for what replaces them with the file's blocks
    (`keep_kquant_blocks`, `apply_int4`, `keep_stored_blocks`: a tied head goes with the
    embedding, an untied one in a K-quant file's Q6_K), and `load_weights(..., skip=)` reads
    what none of them took afterwards (an untied Q8_0 or 4-bit head, widened and then made
    8-bit by `apply_kernel_linears`, as before). A whole model widened to 16 bits at load and then
    dropped cost SmolLM2 0.9 s, and a 7B-shape file its resident size seven times over at the
    peak; a dense model read into a dict of tensors first held it twice."""
    a, src = ckpt.args, ckpt.source
    with torch.device("meta"):
        model = Transformer(a)
    later = set()
    if blocks:
        later = {n for i in range(a.n_layers) for _, attr, parts in model.projections(i)
                 if not (ffn and attr in ("w1", "w2")) for n in parts}
        later.add("output")
        if kernels.available() and "embed" in src.names and src.kind("embed") in STORED_FORMATS:
            later.add("embed")
    model = allocated(model, dtype, "cpu")  # allocated in dtype, filled below
    if a.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.load_weights(LazyWeights(src, dtype), skip=later.__contains__)
    return model.eval().requires_grad_(False), later


def kquant_linear(src: TensorSource, parts: list[tuple[str, tuple[int, int] | None]], dim: int,
                  bias: torch.Tensor | None,
                  cols: tuple[int, int] | None = None) -> KQuantLinear | None:
    """A fused projection over the rows (lo, hi) (None: all) of tensors a file stores in Q4_K,
    Q5_K, Q6_K or Q8_0 (`TensorSource.kquant_rows`: a converted copy's original, else the file
    itself), kept in those bytes, over their columns `cols` (whole blocks, a K-quant's of 256;
    None: all `dim`); None where a part is stored otherwise or the kernel library does not run
    here."""
    if not kernels.available():
        return None
    rows = [src.kquant_rows(n, r, cols) for n, r in parts]  # (None: not whole blocks either)
    return None if any(r is None for r in rows) else KQuantLinear(rows, dim, bias)


def kquant_head(src: TensorSource, a: ModelArgs,
                rows: tuple[int, int] | None = None) -> KQuantLinear | None:
    """Rows lo:hi (None: all) of an untied output head a K-quant file stores in its own blocks
    (Q6_K in a Q4_K_M file), else None."""
    return None if a.tie_embeddings else kquant_linear(src, [("output", rows)], a.dim, None)


def dense_block(ckpt) -> int:
    """The neurons a dense split of this checkpoint's FFNs cuts at (`SparsePlan.block`): 256
    where down is read in a K-quant file's own super-blocks of 256 columns, else a GGUF block."""

    src, a = ckpt.source, ckpt.args
    kq = src.kquant if src is not None else None
    if kq is None or a.ffn_dim % 256 or "0.down" not in kq.names:
        return BLOCK
    return 256


def keep_kquant_blocks(model: Transformer, src: TensorSource) -> int:
    """The in-process engine's 4-bit configuration over a K-quant file (a Q4_K_M or Q5_K_M one)
    or a file's Q8_0 projections: each projection still held in float whose tensors the file
    stores in Q4_K, Q5_K, Q6_K or Q8_0 becomes a KQuantLinear over those bytes (4.625, 5.625,
    6.56 and 8.5 bits a weight; a converted copy's blocks take 5 and 8.5), and so does an
    untied output head. Returns how many were replaced."""
    done = 0
    for i in range(len(model.layers)):
        for owner, attr, names in model.projections(i):
            m = getattr(owner, attr, None)
            if isinstance(m, nn.Linear) and (
                    k := kquant_linear(src, [(n, None) for n in names], m.in_features,
                                       None if m.bias is None else m.bias.detach())) is not None:
                setattr(owner, attr, k)
                done += 1
    if isinstance(model.output, nn.Linear) and (k := kquant_head(src, model.args)) is not None:
        model.output = k
        done += 1
    return done


def keep_stored_blocks(model: Transformer, src: TensorSource, dtype: torch.dtype) -> int:
    """The in-process engine's 4-bit configuration, what is left: each projection still held in
    float whose tensors are all Q8_0 or 4-bit in the file becomes a q8_0 KernelLinear
    (`q8_0_rows`), and a Q8_0/4-bit token embedding stays in its blocks (a tied head over the
    same rows), as the hot executor holds them. Returns how many were replaced."""
    if not kernels.available():
        return 0
    done = 0
    for i in range(len(model.layers)):
        for owner, attr, names in model.projections(i):
            m = getattr(owner, attr, None)
            if not isinstance(m, nn.Linear) or m.bias is not None:
                continue
            rows = q8_0_rows(src, [(n, None) for n in names])
            if rows is None:
                continue
            setattr(owner, attr, q8_0_linear(rows, m.in_features))
            done += 1
    fmt = STORED_FORMATS.get(src.kind("embed")) if "embed" in src.names else None
    if fmt is not None and isinstance(model.tok_embeddings, nn.Embedding):
        stored_embedding(model, src, fmt, dtype)
        done += 1
    return done


def q8_0_rows(src: TensorSource, parts: list[tuple[str, tuple[int, int] | None]]) -> torch.Tensor | None:
    """One matrix of Q8_0 records over the rows (lo, hi) (None: all) of tensors stored in Q8_0
    or 4-bit blocks, or None where a part is stored otherwise. Q8_0 rows are the file's own
    bytes; 4-bit ones are widened and written as Q8_0 (the 4-bit grid onto an 8-bit one: an
    error of at most half a Q8_0 step). A fused projection whose parts the file stores in
    different block types (a Q4_K_M file's q and k in Q4_K, v in Q6_K in some layers) is then one
    8.5-bit matrix for the kernel's GEMV, not a bf16 one of twice the bytes."""
    if not all(n in src.names and (src.kind(n) == "Q8_0" or src.kind(n) in Q4_TYPES)
               for n, _ in parts):
        return None
    out = []
    for n, r in parts:
        lo, hi = r or (0, src.shape(n)[0])
        if src.kind(n) == "Q8_0" and n.rsplit(".", 1)[-1] not in ("q", "k"):
            out.append(src.raw_rows(n, torch.arange(lo, hi)))
        else:  # 4-bit, or q/k whose rows a GGUF file stores permuted: read whole, in order
            out.append(kernels.quantize_rows(src.get(n, torch.float32)[lo:hi], "q8_0"))
    return torch.cat(out)  # (a matrix regroups them: `q8_0_linear`)


def stored_embedding(model: Transformer, src: TensorSource, fmt: str, dtype: torch.dtype):
    """The token embedding as the file's `fmt` blocks (a KernelEmbedding widening to `dtype`),
    and a tied output head over the same rows. The embedding reads the file's pages where the
    source maps them (a step looks up a few rows; a copy cost a model its whole table, 170 MiB
    for Gemma 3's 262,144 rows, in every process that embeds), unless a tied 4-bit head reads
    the same rows: then both share one copy (its GEMV reads every row at every step)."""
    a = model.args
    shared = a.tie_embeddings and fmt != "q8_0"  # (a Q8_0 head regroups its rows: a copy)
    mapped = None if shared else src.mapped_rows("embed")
    rows = None
    if mapped is None or a.tie_embeddings:
        rows = kernels.huge(src.raw_rows("embed", torch.arange(a.vocab_size)))
    model.tok_embeddings = KernelEmbedding(rows if mapped is None else mapped, fmt, a.dim, dtype)
    if a.tie_embeddings:
        model.output = stored_head(rows, fmt, a.dim)


def stored_head(rows: torch.Tensor, fmt: str, dim: int) -> nn.Module:
    """An output head over rows in a kernel format: Q8_0 rows as `q8_0_linear` holds them (a
    copy of the same bytes beside the embedding's), else a KernelLinear over the rows themselves."""
    return q8_0_linear(rows, dim) if fmt == "q8_0" else KernelLinear.from_records(rows, fmt, dim)


def read_neuron_set(src: TensorSource, a: ModelArgs, layer: int, idx: torch.Tensor,
                    fmt: str | None, dtype: torch.dtype,
                    every_step: bool = False) -> NeuronSet | BlockSlice:
    """Neurons idx of one layer's FFN, read from the file: their gate and up rows and their
    columns of down. Gate and up rows stored in `fmt` itself are kept as the file's bytes.
    every_step: all of them are computed at every step (no predictor), so a range of whole
    4-bit blocks becomes a `BlockSlice` (see `block_slice`)."""
    gated, p = a.gated, f"{layer}."
    names = [p + "gate", p + "up"] if gated else [p + "up"]
    if every_step and (s := block_slice(src, a, layer, idx, fmt, dtype)) is not None:
        return s

    def read(name):
        if fmt is not None and STORED_FORMATS.get(src.kind(name)) == fmt:
            return src.raw_rows(name, idx)
        return src.rows(name, idx, dtype)

    up_b = src.rows(p + "up_b", idx, dtype) if p + "up_b" in src.names else None
    if fmt in kernels.PLAIN_FORMATS:  # records of plain numbers: each row read straight into place
        rec = kernels.huge_empty((len(idx), len(names) + 1, a.dim), kernels.PLAIN_FORMATS[fmt])
        for j, name in enumerate(names):
            src.rows_into(name, idx, rec[:, j])
        src.down_rows(layer, idx, rec.dtype, rec[:, -1])
        return NeuronSet.from_rows(a.ffn_act, idx, fmt, dtype, a.dim, up_b,
                                   records=rec.view(len(idx), rec.shape[1] * a.dim).view(torch.uint8))
    w1 = [read(n) for n in names]
    gate, up = (w1[0], w1[1]) if gated else (None, w1[0])
    down_t = src.down_rows(layer, idx, dtype)
    if fmt is None:  # the torch path: plain rows in the model's dtype
        return NeuronSet.from_rows(a.ffn_act, idx, None, dtype, a.dim, up_b, (gate, up, down_t))
    return NeuronSet.from_rows(a.ffn_act, idx, fmt, dtype, a.dim, up_b,
                               records=kernels.pack(gate, up, down_t, fmt))


def read_head(src: TensorSource, a: ModelArgs, lo: int, hi: int, dtype: torch.dtype,
               int4: bool) -> nn.Module:
    """Rows lo:hi of the output head, read from the file as `hot_model` holds the whole head on
    a CPU (then `quant.apply_kernel_linears`): a tied head over a quantized embedding in the
    file's blocks with `int4`, else the rows in `dtype`, a KernelLinear where the kernel library
    runs bf16 (Q8_0 with `int4`)."""
    tied = a.tie_embeddings
    name = "embed" if tied else "output"
    idx = torch.arange(lo, hi)
    fmt = STORED_FORMATS.get(src.kind(name)) if int4 and tied else None
    if int4 and (k := kquant_head(src, a, (lo, hi))) is not None:
        return k
    if fmt is not None:
        return stored_head(src.raw_rows(name, idx), fmt, a.dim)
    weight = src.rows(name, idx, dtype)
    if kernels.usable(weight) and (int4 or dtype == torch.bfloat16):
        return kernel_head(weight, "q8_0" if int4 else "bf16")
    lin = nn.Linear(a.dim, hi - lo, bias=False, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


def head_rows(head: nn.Module, lo: int, hi: int, shared: bool) -> nn.Module:
    """Rows lo:hi of a built output head (a KernelLinear or an nn.Linear). shared: its weights
    are the embedding's too (tied), so a view keeps nothing more alive; else the rows are
    copied and the rest of the head can be freed."""
    if isinstance(head, KQuantLinear):  # its groups, copied (a head's own bytes, never the
        return head.rows(lo, hi, copy=True)  # embedding's: the rest is freed)
    keep = (lambda t: t) if shared else (lambda t: t.clone())
    bias = None if head.bias is None else keep(head.bias.detach()[lo:hi])
    if isinstance(head, KernelLinear):
        return KernelLinear.from_records(keep(head.records[lo:hi]), head.fmt, head.in_features, bias)
    lin = nn.Linear(head.in_features, hi - lo, bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(keep(head.weight.detach()[lo:hi]), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def block_slice(src: TensorSource, a: ModelArgs, layer: int, idx: torch.Tensor,
                fmt: str | None, dtype: torch.dtype) -> BlockSlice | None:
    """Neurons idx as a BlockSlice when they are a range lo..hi of whole blocks, the layer's
    gate and up are 4-bit or Q8_0 in the file, and the kernel library runs them (fmt: a kernel
    format of the file's blocks): gate and up one GEMV of 16-row groups over the file's own
    blocks (`_stored_rows`: int4 where both are 4-bit, else one Q8_0 matrix, as the whole
    model's projections are held: Gemma 3 270M's FFNs are mostly Q8_0); down's columns lo..hi
    the same where down is 4-bit too, else one Q8_0 matrix (a Q4_K_M file's more-bits layers
    keep down in Q6_K, which a bundle stores as Q8_0: its bytes as they are); else None."""
    p = f"{layer}."
    names = [p + "gate", p + "up"] if a.gated else [p + "up"]
    down = p + "down"
    if (fmt not in ("q4_0", "q4_1", "q8_0") or not kernels.available() or len(idx) == 0
            or down not in src.names
            or any(n not in src.names or src.kind(n) not in (*Q4_TYPES, "Q8_0") for n in names)):
        return None
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    if lo % 32 or hi % 32 or not torch.equal(idx, torch.arange(lo, hi)):
        return None
    # a K-quant file's own blocks where its original has them (down's columns: whole
    # super-blocks of 256, as a plan for such a file cuts them: `dense_block`)
    w1 = _stored_rows(src, [(n, (lo, hi)) for n in names], a.dim, None)
    if w1 is None:
        return None
    if (k := kquant_linear(src, [(down, None)], hi - lo, None, (lo, hi))) is not None:
        w2 = k
    elif src.kind(down) in Q4_TYPES:
        w2 = _stacked_int4([src.q4_part(down, (0, a.dim), (lo, hi))])
    elif src.kind(down) == "Q8_0":  # the columns' blocks, as stored
        rows = src.raw_rows(down, torch.arange(a.dim))
        w2 = q8_0_linear(rows[:, lo // 32 * 34:hi // 32 * 34].contiguous(), hi - lo)
    elif src.raw_rows(down, torch.arange(1)) is not None:  # another block type: onto Q8_0
        cols = src.get(down, torch.float32)[:, lo:hi]
        w2 = q8_0_linear(kernels.quantize_rows(cols, "q8_0"), hi - lo)
    else:  # plain numbers
        return None
    up_b = src.rows(p + "up_b", idx, dtype) if p + "up_b" in src.names else None
    return BlockSlice(a.ffn_act, idx.clone(), w1, w2, up_b)


def _stacked_int4(blocks: list[tuple], bias: torch.Tensor | None = None) -> nn.Module:
    """One 4-bit projection over `q4` triples stacked by rows (q, k and v; gate and up)."""
    return int4_linear(*(torch.from_numpy(np.concatenate([b[j] for b in blocks])) for j in range(3)),
                       bias)


def _stored_projection(src: TensorSource, names: tuple[str, ...], dtype) -> torch.nn.Module | None:
    """An attention projection straight from the file's blocks (`_stored_rows`), or None."""
    bias = None
    if all(n + "_b" in src.names for n in names):
        bias = torch.cat([src.get(n + "_b", dtype) for n in names])
    return _stored_rows(src, [(n, None) for n in names], src.shape(names[0])[1], bias)


def _stored_rows(src: TensorSource, parts: list[tuple[str, tuple[int, int] | None]], dim: int,
                 bias: torch.Tensor | None) -> torch.nn.Module | None:
    """A fused projection over the rows (lo, hi) (None: all) of tensors of `dim` columns, from
    the file's blocks: one int4 GEMV where every part is 4-bit, one Q8_0 matrix where they mix
    4-bit and Q8_0 (`q8_0_rows`; no bias there), else None. A converted copy's parts that its
    original stores in Q4_K/Q6_K are read from there instead (`kquant_linear`)."""
    if (k := kquant_linear(src, parts, dim, bias)) is not None:
        return k
    if all(src.kind(n) in Q4_TYPES for n, _ in parts):
        return _stacked_int4([src.q4_part(n, r or (0, src.shape(n)[0]), (0, dim)) for n, r in parts],
                             bias)
    if bias is None and kernels.available() and (rows := q8_0_rows(src, parts)) is not None:
        return q8_0_linear(rows, dim)
    return None


def attention_slice(src: TensorSource, a: ModelArgs, layer: int, kv: tuple[int, int],
                    dtype: torch.dtype, int4: bool) -> Attention:
    """Layer's attention over KV heads kv[0]..kv[1] and the query heads that share them, read
    from the file: their rows of q, k and v and their columns of the output projection, in the
    file's 4-bit blocks with `int4` where it has them, else in `dtype` (a kernel library
    matrix where it runs: the actor runtime's executors split heads this way). An
    Attention(partial=True): it answers its share of the output projection in float32, with no
    output bias; its KV cache is the caller's to set."""
    group, hd, p = a.n_heads // a.n_kv_heads, a.head_dim, f"{layer}."
    (k0, k1), dim = kv, a.dim
    h0, h1 = k0 * group, k1 * group
    rows = {"q": (h0 * hd, h1 * hd), "k": (k0 * hd, k1 * hd), "v": (k0 * hd, k1 * hd)}
    sub = dataclasses.replace(a, n_heads=h1 - h0, n_kv_heads=k1 - k0, head_dim=hd, o_bias=False)
    with torch.device("meta"):
        attn = Attention(sub, partial=True, layer=layer)
    if attn.q_norm is not None:  # over each head's width: every share holds the whole norm
        attn.q_norm = _norm(src.get(p + "q_norm", dtype), a.norm_eps)
        attn.k_norm = _norm(src.get(p + "k_norm", dtype), a.norm_eps)
    bias = None
    if a.qkv_bias:
        bias = torch.cat([src.get(p + n + "_b", dtype)[lo:hi] for n, (lo, hi) in rows.items()])
    if int4 and (m := _stored_rows(src, [(p + n, r) for n, r in rows.items()], dim, bias)) is not None:
        attn.wqkv = m
    else:
        w = torch.cat([src.get(p + n, dtype)[lo:hi] for n, (lo, hi) in rows.items()])
        attn.wqkv = _plain_linear(w, bias)
    if int4 and src.kind(p + "o") in Q4_TYPES:
        attn.wo = _stacked_int4([src.q4_part(p + "o", (0, dim), rows["q"])])
    else:
        attn.wo = _plain_linear(src.get(p + "o", dtype)[:, rows["q"][0]:rows["q"][1]].contiguous(),
                                None)
    return attn


def _norm(weight: torch.Tensor, eps: float) -> Norm:
    norm = Norm(weight.shape[0], eps, False)
    norm.weight = nn.Parameter(weight, requires_grad=False)
    return norm


def _plain_linear(w: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """y = x w^T (+ bias): a KernelLinear where the kernel library runs the weights' precision,
    else an nn.Linear over them."""
    fmt = kernels.format_for(w)
    if fmt is not None:
        return KernelLinear(w, bias, fmt)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def device_projection(src: TensorSource, names: tuple[str, ...],
                      dtype: torch.dtype) -> nn.Module | None:
    """A projection kept in the file's blocks for the Triton kernels (`triton_linear`): where
    every fused tensor is Q4_0, Q4_1 or Q8_0 (each part in its own); else None (the model's
    type, as `device_fixed_bytes` counts it)."""
    from ..kernels.triton_linear import BlockLinear

    fmts = [STORED_FORMATS.get(src.kind(n)) for n in names]
    if None in fmts:
        return None
    bias = None
    if all(n + "_b" in src.names for n in names):
        bias = torch.cat([src.get(n + "_b", dtype) for n in names])
    return BlockLinear([(src.block_rows(n), f) for n, f in zip(names, fmts)],
                       src.shape(names[0])[1], bias)


def keep_device_blocks(model: Transformer, src: TensorSource, dtype: torch.dtype) -> int:
    """Each projection still a plain matrix (attention's, a dense FFN's and an untied head; not
    a HybridFFN's neuron sets) made a `device_projection` over the file's blocks, and an untied
    token embedding a `device_embedding`, on the device its matrix was; the others stay.
    Returns the number replaced."""
    mats = [(owner, attr, names) for i in range(len(model.layers))
            for owner, attr, names in model.projections(i)]
    if not model.args.tie_embeddings:
        mats.append((model, "output", ("output",)))
    replaced = 0
    for owner, attr, names in mats:
        old = getattr(owner, attr, None)
        if not isinstance(old, nn.Linear):
            continue
        m = device_projection(src, names, dtype)
        if m is not None:
            setattr(owner, attr, m.to(old.weight.device))
            replaced += 1
    old = model.tok_embeddings
    if isinstance(old, nn.Embedding) and (m := device_embedding(src, model.args, dtype)) is not None:
        model.tok_embeddings = m.to(old.weight.device)
        replaced += 1
    return replaced


def device_bytes(src: TensorSource, projections: list[tuple[str, ...]], dtype_bytes: int) -> int:
    """Bytes of fused projections (each a tuple of tensor names) as a GPU holds them under
    `Config(weights="int4")` (`device_projection`: one whose tensors are all Q4_0/Q4_1/Q8_0 in
    their blocks, any other in the model's type), with their biases."""
    total = 0
    for names in projections:
        blocks = all(src.kind(n) in STORED_FORMATS for n in names)
        for n in names:
            rows, dim = src.shape(n)
            total += (rows * kernels.row_bytes(STORED_FORMATS[src.kind(n)], dim) if blocks
                      else rows * dim * dtype_bytes)
            total += src.shape(n + "_b")[0] * dtype_bytes if n + "_b" in src.names else 0
    return total


def device_fixed_bytes(src: TensorSource, a: ModelArgs, dtype_bytes: int) -> dict[str, int]:
    """The parts of `solver.gpu_bytes` a GPU's hot executor holds in the file's blocks under
    `Config(weights="int4")` (`device_bytes`): every layer's attention matrices, and an untied
    output head ("lm_head") and token embedding ("embeddings", `device_embedding`)."""
    out = {"attention": device_bytes(src, [names for i in range(a.n_layers) for names in
                                           ((f"{i}.q", f"{i}.k", f"{i}.v"), (f"{i}.o",))],
                                     dtype_bytes)}
    if not a.tie_embeddings:
        out["lm_head"] = device_bytes(src, [("output",)], dtype_bytes)
        if src.kind("embed") in BLOCK_BYTES:  # (`device_embedding`; learned positions widen)
            rows, dim = src.shape("embed")
            out["embeddings"] = (rows * kquants.row_bytes(src.kind("embed"), dim)
                                 + a.position_rows * a.dim * dtype_bytes)
    return out


def device_embedding(src: TensorSource, a: ModelArgs, dtype: torch.dtype) -> nn.Module | None:
    """An untied token embedding kept in the file's blocks on a GPU (`BlockEmbedding`, where
    `kquants` widens its type: `device_fixed_bytes` counts it so); else None (the model's type:
    a tied one is the head's rows, which the head's GEMV reads whole)."""
    kind = src.kind("embed")
    if a.tie_embeddings or kind not in BLOCK_BYTES:
        return None
    return BlockEmbedding(src.block_rows("embed"), kind, a.dim, dtype)


def hot_formats(weights: str, info: dict, dtype: torch.dtype,
                device: torch.device) -> tuple[str | None, bool, bool]:
    """What a hot executor on `device` keeps under `Config.weights`: (its neuron sets' kernel
    format (`quant.neuron_format`), whether its attention and head keep a 4-bit file's blocks
    on the CPU kernel, whether attention and an untied head keep them for the Triton kernels).
    Where the neuron sets run on the Triton kernels (a GPU), "int4" is the neurons' records and
    those matrices in the file's blocks (`device_projection`), and an untied embedding too
    (`device_embedding`; a tied one is widened to `dtype`).
    A 4-bit file's neurons on a GPU where the Triton kernels do not run are a ConfigError: the
    placement counted them at their records' bytes (`budget.gpu_neuron_format`)."""

    like = torch.empty(0, dtype=dtype, device=device)
    fmt = neuron_format(weights, info, like)
    want = block_format(weights, info)
    if device.type != "cpu" and want is not None and fmt != want.lower():
        raise ConfigError(f"weights='int4' on a GPU keeps the hot neurons in the file's {want} "
                          f"records for the Triton kernels, and they do not run on {device} "
                          f"here (install the `gpu` extra, or use weights='dense')")
    triton = kernels.on_triton(like)
    return fmt, weights == "int4" and not triton, triton and want is not None


def hot_model(ckpt: ModelFile, dtype: torch.dtype, hot: list[torch.Tensor],
              predictor_input: str, thresholds, fmt: str | None, int4: bool,
              quantized_embedding: bool, every_step: bool = False,
              kv: tuple[int, int] | None = None, device_blocks: bool = False) -> Transformer:
    """The model the hot executor runs, read from the file without its cold neurons: each
    layer's FFN a HybridFFN holding only the neurons hot[i] marks (no cold set), attention in
    4-bit blocks with `int4` (where the file has them), and with `quantized_embedding` a
    token embedding kept in the file's Q8_0/4-bit blocks (tied: the output head over the same
    rows). With `kv`, each layer's attention holds only KV heads kv[0]..kv[1] and their query
    heads (`attention_slice`: the cold executors hold the others). With `device_blocks`,
    attention's matrices, an untied head and its embedding stay in the file's blocks for the
    Triton kernels and torch's gathers (`device_projection`, `device_embedding`: a GPU's,
    `Config(weights="int4")`). Built on the CPU in `dtype`."""
    a, src = ckpt.args, ckpt.source
    with torch.device("meta"):
        model = Transformer(a)
    for block in model.layers:  # no dense FFN: its hot neurons are read below
        block.ffn = nn.Identity()
    int4_layers = {}
    if kv is not None:  # a slice of each layer's heads, built below
        for block in model.layers:
            block.attn = nn.Identity()
    elif int4 or device_blocks:
        stored = _stored_projection if int4 else device_projection
        for i in range(a.n_layers):
            for owner, attr, names in model.projections(i)[:2]:  # attention's
                m = stored(src, names, dtype)
                if m is not None:
                    setattr(owner, attr, nn.Identity())  # placed after the others are loaded
                    int4_layers[(i, attr)] = m
    embed_fmt = STORED_FORMATS.get(src.kind("embed")) if quantized_embedding else None
    if embed_fmt is not None:
        model.tok_embeddings = nn.Identity()
        if a.tie_embeddings:
            model.output = nn.Identity()
    head = kquant_head(src, a) if int4 else None
    embedding = None
    if device_blocks and not a.tie_embeddings:  # (a tied head is the embedding's rows)
        head = device_projection(src, ("output",), dtype)
        embedding = device_embedding(src, a, dtype)
    if head is not None:
        model.output = nn.Identity()
    if embedding is not None:
        model.tok_embeddings = nn.Identity()
    model = allocated(model, dtype, "cpu")  # allocated in dtype, filled once below
    if a.tie_embeddings and embed_fmt is None:
        model.output.weight = model.tok_embeddings.weight
    model.load_weights(LazyWeights(src, dtype))
    for (i, attr), m in int4_layers.items():
        setattr(model.layers[i].attn, attr, m)
    if kv is not None:
        for i, block in enumerate(model.layers):
            block.attn = attention_slice(src, a, i, kv, dtype, int4)
    if embed_fmt is not None:
        stored_embedding(model, src, embed_fmt, dtype)
    if head is not None:
        model.output = head
    if embedding is not None:
        model.tok_embeddings = embedding
    for i, block in enumerate(model.layers):
        idx = hot[i].nonzero().squeeze(-1)
        hot_set = read_neuron_set(src, a, i, idx, fmt, dtype, every_step)
        down_b = src.get(f"{i}.down_b", dtype) if f"{i}.down_b" in src.names else None
        t = 0.0 if thresholds is None else float(thresholds[i])
        block.ffn = HybridFFN.from_sets(i, block.ffn_norm, a.ffn_dim, hot_set, None, down_b,
                                        None, predictor_input, t)
        block.ffn_norm = nn.Identity()
    return model.eval().requires_grad_(False)
