"""Weight-only int4: GGUF's 4-bit blocks (Q4_0, Q4_1) kept 4-bit, applied to a finished model the
way gpt-fast applies quantization. Where the kernel library runs, a projection is a `Q4Linear`
(the file's blocks regrouped 16 rows at a time for the library's int4 GEMV, 2-3x torch's packed
int4 kernel at decode shapes); elsewhere an `Int4Linear` over torch's packed int4 CPU kernel.

A Q4_1 block of 32 weights stores `w = d * q + m` (q in 0..15); torch's kernel computes
`w = (q - 8) * scale + zero` per group of 32, so scale = d and zero = m + 8 d reproduce the file's
weights exactly (up to bf16 rounding of d and m); Q4_0 (`w = d * (q - 8)`) has zero = 0. Decode
then reads half a byte per weight instead of two, which is what bounds a token's time on a CPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..kernels.input_sparse import InputSparse
from ..formats.kquants import BLOCK_BYTES, KQUANT_LAYOUTS, widen_rows
from ..formats.q4 import GROUP, Q4_TYPES, q4_type
from .transformer import linear_f32, wide

if TYPE_CHECKING:
    from .transformer import Transformer


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W stored as packed int4 groups of 32; x: (..., K), computed in
    bfloat16."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        assert self.in_features % GROUP == 0, self.in_features
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        # (K/32, N, 2): per group and output row, [scale, zero]
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("scales_zeros", sz)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    def forward(self, x):
        shape = x.shape  # (torch's kernel takes bf16: float32 activations are rounded to it)
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).bfloat16(), self.packed,
                                              GROUP, self.scales_zeros)
        y = y.view(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class Q4Linear(InputSparse, nn.Module):
    """y = x W^T (+ b) with W a file's Q4_0/Q4_1 blocks regrouped 16 rows at a time
    (`kernels.pack_q4x16`: the same 4-bit codes, scales and offsets, the same bytes), run by the
    kernel library's int4 GEMV over the input rounded to 8 bits per block of 32 (ggml's
    activation rounding) for any number of rows (prefill runs it MAX_ROWS rows at a time). Its
    q4c copy (input sparsity): `kernels.q4c_of_q4x16`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        assert self.in_features % GROUP == 0, self.in_features
        self.register_buffer("packed", kernels.pack_q4x16(q, scale, zero))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _q4c(self) -> tuple[torch.Tensor, int]:
        w, offsets = kernels.q4c_of_q4x16(self.packed, self.out_features, self.in_features)
        return w, int(offsets)  # (Q4_1's kind has offsets, Q4_0's none)

    def forward(self, x):
        if (y := self.sparse_product(x)) is None:
            xx = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            y = kernels.linear_q4x16(xx, self.packed, self.out_features).to(x.dtype)  # in x's type
        return y if self.bias is None else y + self.bias


class KQuantLinear(InputSparse, nn.Module):
    """y = x W^T (+ b) with W a K-quant file's rows as it stores them, Q4_K or Q6_K (a Q4_K_M
    file's two types) or Q5_K (a Q5_K_M file's), regrouped 16 rows at a time
    (`kernels.pack_kquant`: 4.625, 6.5625 and 5.625 bits a weight, where the converted copy's
    Q4_1 and Q8_0 blocks take 5 and 8.5), run by the kernel
    library's GEMVs over the input rounded to 8 bits per block of 32, MAX_ROWS rows a call. Q8_0
    rows (an 8-bit output head) are kept the same way (q8x16).
    `parts`: (rows, GGUF type) stacked in order, as a fused projection's q, k and v (v may be
    Q6_K beside a Q4_K q and k: one GEMV per run of parts of one type)."""

    def __init__(self, parts: list[tuple[torch.Tensor, str]], in_features: int,
                 bias: torch.Tensor | None):
        super().__init__()
        self.in_features = in_features
        runs: list[tuple[list[torch.Tensor], str]] = []
        for raw, kind in parts:
            if runs and runs[-1][1] == kind:
                runs[-1][0].append(raw)
            else:
                runs.append(([raw], kind))
        self.segments = []  # (buffer name, rows, layout)
        for i, (raws, kind) in enumerate(runs):
            raw = torch.cat(raws) if len(raws) > 1 else raws[0]
            self.register_buffer(f"packed{i}", kernels.pack_kquant(raw, kind))
            self.segments.append((f"packed{i}", raw.shape[0], KQUANT_LAYOUTS[kind]))
        self.out_features = sum(n for _, n, _ in self.segments)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).numel() for name, _, _ in self.segments)

    # the layouts a q4c copy holds, and their kinds (`kernels.Q4C_KINDS`)
    Q4C_OF = {KQUANT_LAYOUTS["Q4_K"]: "q4_k", KQUANT_LAYOUTS["Q6_K"]: "q6_k"}
    # the copies of the runs after the first (None for a run no copy holds), made with `sparse`
    sparse_rest: list | None = None

    @property
    def sparsifiable(self) -> bool:
        """Whether its first run of rows is Q4_K or Q6_K, which a q4c copy can hold. The runs
        after it (a fused q/k/v's Q6_K v, as a Q4_K_M file has in half its layers) take copies
        of their own where they are of those types, and are otherwise computed densely over the
        same zeroed input (`sparse_product`)."""
        return self.segments[0][2] in self.Q4C_OF

    @property
    def sparse_rows(self) -> int:
        return self.segments[0][1]

    def _copy(self, name: str, n: int, layout: int) -> tuple[torch.Tensor, int]:
        """A run of rows in the q4c layout, and its kind: the file's codes and scales as they are
        (`kernels.q4kc_of_q4kx16`: 4.625 bits a weight; `kernels.q6kc_of_q6kx16`: 6.5625)."""
        kind = self.Q4C_OF[layout]
        of = kernels.q4kc_of_q4kx16 if kind == "q4_k" else kernels.q6kc_of_q6kx16
        return of(getattr(self, name), n, self.in_features), kernels.Q4C_KINDS.index(kind)

    def _q4c(self) -> tuple[torch.Tensor, int]:
        return self._copy(*self.segments[0])  # (of the first run's rows)

    def sparsify_input(self, threshold: float | None, stats: torch.Tensor | None = None):
        super().sparsify_input(threshold, stats)
        self.sparse_rest = None if threshold is None else [
            self._copy(*seg) if seg[2] in self.Q4C_OF else None for seg in self.segments[1:]]

    def sparse_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """As `InputSparse.sparse_product`; each run after the first from its own copy (the
        channels counted once, by the first), or where it has none the dense product over x with
        the entries at or under the threshold zeroed, as the copies read it: the whole is the
        dense product over one zeroed input (the native loops do the same)."""
        y = super().sparse_product(x)
        if y is None or len(self.segments) == 1:
            return y
        t, xz, ys = self.sparse[2], None, [y.reshape(1, -1)]
        for (name, n, layout), copy in zip(self.segments[1:], self.sparse_rest):
            if copy is not None:
                ys.append(kernels.linear_q4c(x, copy[0], n, copy[1], t).reshape(1, n))
                continue
            if xz is None:  # (dropped as the copies drop them: not over t, a NaN too)
                xz = x.masked_fill(~(x.float().abs() > t), 0).reshape(1, self.in_features)
            ys.append(self._dense(xz, [(name, n, layout)])[0].to(x.dtype))
        return torch.cat(ys, -1).reshape(*x.shape[:-1], self.out_features)

    def _dense(self, x: torch.Tensor, segments: list) -> list[torch.Tensor]:
        """x (f32 or bf16) times each of these runs of rows: the kernel library's GEMVs (f32)."""
        return [kernels.linear_x16(x, getattr(self, name), n, layout) for name, n, layout in segments]

    def rows(self, lo: int, hi: int, copy: bool = False) -> "KQuantLinear":
        """Its output rows lo:hi (lo a multiple of 16, one run of one type): the groups that
        hold them, a view of the same bytes (copied with `copy`, so the rest can be freed)."""
        name, n, layout = self.segments[0]
        assert len(self.segments) == 1 and lo % 16 == 0 and 0 <= lo < hi <= n, (self.segments, lo, hi)
        out = KQuantLinear.__new__(KQuantLinear)
        nn.Module.__init__(out)
        out.in_features, out.out_features, out.segments = self.in_features, hi - lo, [(name, hi - lo, layout)]
        keep = (lambda t: t.clone()) if copy else (lambda t: t)
        out.register_buffer(name, keep(getattr(self, name)[lo // 16:-(-hi // 16)]))
        out.bias = None if self.bias is None else nn.Parameter(keep(self.bias.detach()[lo:hi]), requires_grad=False)
        return out

    def forward(self, x):
        if (y := self.sparse_product(x)) is not None:
            return y if self.bias is None else y + self.bias
        xx = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        ys = self._dense(xx, self.segments)
        y = (ys[0] if len(ys) == 1 else torch.cat(ys, -1)).to(x.dtype)
        return y if self.bias is None else y + self.bias


def int4_linear(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                bias: torch.Tensor | None) -> nn.Module:
    """A 4-bit projection (`q4_split`'s triple): a Q4Linear where the kernel library runs, else
    an Int4Linear."""
    return (Q4Linear if kernels.available() else Int4Linear)(q, scale, zero, bias)


class KernelLinear(nn.Module):
    """y = x W^T (+ b) with W's rows in a CPU kernel format (`kernels.FORMATS`, e.g. q8_0 for an
    8-bit output head): up to KERNEL_ROWS input rows run the kernel's matrix-vector
    product, which reads each row once in its format; longer inputs (prefill) widen W a chunk of
    rows at a time into one reused buffer and multiply in the input's dtype."""

    WIDEN_BYTES = 8 << 20  # widened rows a long input holds at a time (see NeuronSet's)
    # up to this many input rows the kernel's GEMV runs, above it widened rows: a 16,000 x 4,096
    # Q8_0 matrix, 2 threads, took 13.4 / 12.8 ms for 8 rows, 21.9 / 12.7 for 16, 61.9 / 26.8 for 64
    KERNEL_ROWS = 8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fmt, self.code = fmt, kernels.FORMATS.index(fmt)
        self.register_buffer("records", kernels.huge(kernels.quantize_rows(weight, fmt)))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_records(cls, records: torch.Tensor, fmt: str, in_features: int,
                     bias: torch.Tensor | None = None) -> "KernelLinear":
        """Over rows already in `fmt` (a file's Q8_0 blocks, say), shared, not copied."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.out_features, out.in_features = records.shape[0], in_features
        out.fmt, out.code = fmt, kernels.FORMATS.index(fmt)
        out.register_buffer("records", records)
        out.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        return out

    @property
    def weight(self) -> torch.Tensor:
        """W (out, in): a view of the records for f32/bf16, else widened to float32."""
        return kernels.widen(self.records, self.fmt, 1, self.in_features)[:, 0]

    def forward(self, x):
        shape, rows = x.shape, x.reshape(-1, self.in_features)
        # (a compiled decode step keeps to the kernel: the reused buffer is the eager path's)
        compiling = torch.compiler.is_compiling()
        f32 = wide(rows)  # (`transformer.linear_f32`)
        if rows.shape[0] <= (kernels.MAX_ROWS if compiling else self.KERNEL_ROWS):
            y = torch.ops.powerinfer.linear(rows.contiguous(), self.records, self.code)
            y = y.to(x.dtype)
        elif self.fmt in kernels.PLAIN_FORMATS or compiling:  # one widening
            w = kernels.widen(self.records, self.fmt, 1, self.in_features)[:, 0].to(x.dtype)
            y = linear_f32(rows, w, None) if f32 and not compiling else rows @ w.t()
        else:  # widened WIDEN_BYTES at a time into one reused buffer in the input's dtype (in
            # float32 for many bf16 rows where the CPU emulates bf16, rounded to bf16 once)
            y = rows.new_empty(rows.shape[0], self.out_features)
            xw = rows.float() if f32 else rows
            for lo, hi, w in kernels.widened(self.records, self.fmt, 1, self.in_features,
                                             xw.dtype, self.WIDEN_BYTES):
                if f32:
                    y[:, lo:hi] = xw @ w[:, 0].t()
                else:
                    torch.matmul(rows, w[:, 0].t(), out=y[:, lo:hi])
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class KernelEmbedding(nn.Module):
    """Token embeddings held as rows in a kernel format (a file's Q8_0 or 4-bit blocks, kept as
    they are): a lookup widens only the rows of the tokens asked for, to `dtype`. With tied
    embeddings the output head is a `KernelLinear.from_records` over the same rows."""

    def __init__(self, records: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype):
        super().__init__()
        self.fmt, self.dim, self.dtype = fmt, dim, dtype
        self.register_buffer("records", records)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.records.index_select(0, tokens.reshape(-1))
        x = kernels.widen(rows, self.fmt, 1, self.dim)[:, 0].to(self.dtype)
        return x.view(*tokens.shape, self.dim)


class BlockEmbedding(nn.Module):
    """Token embeddings held as the file's GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K
    rows) on whatever device holds them, a GPU's above all: a lookup gathers the tokens' rows
    and widens them with torch ops (`kquants.widen_rows`: no host work, so a CUDA graph holds
    it), the values the model's type would hold. A 70B-shaped vocabulary of 32,000 rows takes 147 MB in
    Q4_0 against 524 MB in bf16, bytes a GPU's budget then gives to hot neurons."""

    def __init__(self, rows: torch.Tensor, kind: str, dim: int, dtype: torch.dtype):
        super().__init__()
        if kind not in BLOCK_BYTES:
            raise ValueError(f"no block embedding for {kind} rows (of {', '.join(BLOCK_BYTES)})")
        self.kind, self.dim, self.dtype = kind, dim, dtype
        self.register_buffer("rows", rows.contiguous())  # (vocab, row bytes) uint8

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raw = self.rows.index_select(0, tokens.reshape(-1))
        return widen_rows(raw, self.kind, self.dim).to(self.dtype).view(*tokens.shape, self.dim)


def apply_kernel_linears(model: "Transformer", head: str = "bf16") -> int:
    """On a CPU where the kernel runs, every projection still held as a bf16 `nn.Linear` becomes
    a bf16 KernelLinear (the kernel's GEMV reads a bf16 matrix at 3-4x the rate of torch's eager
    one on the CPUs measured, see BENCHMARKS.md), and a bf16 output head a KernelLinear in `head`
    (q8_0: half the bytes of the largest single read of a small model's decode step). Returns
    how many were replaced."""
    if not kernels.usable(model.norm.weight):
        return 0

    def bf16(m) -> bool:
        return isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16

    done = 0
    for i in range(len(model.layers)):
        for owner, attr, _ in model.projections(i):
            m = getattr(owner, attr, None)
            if bf16(m):
                setattr(owner, attr, KernelLinear(m.weight.detach(), m.bias, "bf16"))
                done += 1
    # (an 8-bit head with float32 activations too: int4's, which keeps no float matrix)
    if bf16(model.output) or (head == "q8_0" and isinstance(model.output, nn.Linear)):
        w, b = model.output.weight.detach(), model.output.bias
        model.output = kernel_head(w, head) if b is None else KernelLinear(w, b, head)
        done += 1
    return done


def kernel_head(weight: torch.Tensor, fmt: str) -> nn.Module:
    """An output head over a float weight in a kernel format: q8_0 rows as `q8_0_linear` holds
    them, else a KernelLinear."""
    if fmt == "q8_0" and weight.shape[1] % 32 == 0:
        return q8_0_linear(kernels.quantize_rows(weight, "q8_0"), weight.shape[1])
    return KernelLinear(weight, None, fmt)


def q8_0_linear(rows: torch.Tensor, dim: int) -> KQuantLinear:
    """A matrix over Q8_0 rows (n, dim / 32 * 34) uint8 for the kernel library: the same codes
    and scales regrouped 16 rows at a time (a KQuantLinear in the q8x16 layout), which read at
    1.35-3.7x the row GEMV's rate from 576 to 4,096 columns (`benchmarks/head_gemv.py`; the
    short rows of a small model's head and projections gain most)."""
    return KQuantLinear([(rows, "Q8_0")], dim, None)


def block_format(weights: str, info: dict) -> str | None:
    """The GGUF block type a sparse FFN's neuron records keep under `weights` ("int4": that of
    the file's FFN tensors where the kernels read it as it is, Q4_0, Q4_1 or Q8_0
    (`info["ffn_type"]`), else the file's main 4-bit type; None: the model's type)."""
    if weights != "int4":
        return None
    ffn = info.get("ffn_type")
    if ffn in (*Q4_TYPES, "Q8_0"):
        return ffn
    return None if ffn else q4_type(info)


def neuron_format(weights: str, info: dict, like: torch.Tensor) -> str | None:
    """The kernel format of a sparse FFN's neuron sets (`kernels.format_for`): with weights
    "int4", the file's block type (`block_format`), otherwise the precision of `like`."""
    if weights != "int4":
        return kernels.format_for(like)
    return kernels.format_for(like, block_format(weights, info))


def apply_int4(model: "Transformer", q4: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> int:
    """Replace each projection whose source tensors are all 4-bit with a 4-bit one (`int4_linear`).

    q4 maps canonical tensor names (loader.TENSOR_NAMES) to `q4_blocks` triples, rows already in
    the model's order (a dict, or `partial.StoredQ4` reading them from the file when asked). Returns the number of layers replaced."""
    replaced = 0
    for i in range(len(model.layers)):
        for owner, attr, names in model.projections(i):
            if not all(n in q4 for n in names) or not isinstance(getattr(owner, attr, None), nn.Linear):
                continue  # kept in float, or no longer a linear layer (a HybridFFN's neuron sets)
            parts = [q4[n] for n in names]  # (each read once: q4 may read them when asked)
            q, scale, zero = (torch.from_numpy(np.concatenate([b[j] for b in parts]))
                              for j in range(3))
            dense = getattr(owner, attr)
            assert q.shape == dense.weight.shape, (names, q.shape, dense.weight.shape)
            bias = None if dense.bias is None else dense.bias.detach()
            setattr(owner, attr, int4_linear(q, scale, zero, bias))
            replaced += 1
    return replaced
