"""A GGUF file's 4-bit and 8-bit matrices kept in their blocks on a GPU, read by Triton kernels.

`BlockLinear` is what `Config(weights="int4")` makes of attention's projections in the hot
executor on a GPU (`partial.hot_model`): a 70B layer's q, k, v and output matrices take 85 MB
in Q4_0 blocks where they took 302 MB in bf16, and the VRAM budget holds hot neurons in the
difference. Each part of a fused projection keeps one tensor's rows in its own type (neighbouring
parts of one type as one matrix, one launch):
- Q4_0/Q4_1 rows held split as a neuron record's gate and up rows are (`kernels.split_rows`:
  a row's nibbles, then its scales, then its minimums), Q8_0 rows as the file has them;
- one row of input (a decode step of one sequence): its products with every matrix row by the
  FFN kernels' `_gate_up_kernel` (each matrix row an ungated record of one row, all of them
  selected), split over the width, SPLIT_COLS columns a program, the partial sums added in
  float32: the bytes are read once, in runs, with no widened copy;
- up to MAX_ROWS rows (a batch's decode step): `triton_ffn._linear_kernel`, each program a tile
  of matrix rows dequantized in registers against every input row (`tl.dot`), the matrix read
  once;
- more rows (a prompt): the matrix widened to float32 WIDEN_BYTES at a time (`_widen_kernel`),
  each slice multiplied by the rows in one matmul.
The result is rounded once to the input's type, with the bias (in the model's type) added in
float32 first. With input sparsity (`InputSparse.sparsify_input`, one run of Q4_0/Q4_1 rows) a
one-row step reads a copy of the matrix held by input channel instead (`q4c_linear`). On a
machine without a GPU these kernels run under Triton's interpreter on CPU tensors
(`kernels.TRITON_ON_CPU`, tests).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..formats.q4 import q4_split
from . import triton_ffn as T
from .input_sparse import InputSparse

FORMATS = ("q4_0", "q4_1", "q8_0")  # the block types kept (others are widened at load)


CODES = {"q4_0": T.Q4_0S, "q4_1": T.Q4_1S, "q8_0": T.Q8_0}  # their row codes in the kernels


MAX_ROWS = T.MAX_ROWS  # up to this many input rows, the kernels; more are widened (a prompt)


BLOCK_N, BLOCK_K = 16, 128  # `_linear_kernel`'s tile: matrix rows, columns a step


WIDEN_BYTES = 8 << 20  # float32 rows a many-row step widens at a time


def held_rows(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """A tensor's rows (n, row bytes) in the file's `fmt` blocks -> as `BlockLinear` holds them."""
    return kernels.split_rows(rows, fmt) if fmt in kernels.Q4_FORMATS else rows


def linear(x: torch.Tensor, rows: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """x (B, dim) float -> (B, n) float32 = x W^T, W the n rows held (`held_rows`) in `fmt`."""
    n, B = rows.shape[0], x.shape[0]
    assert fmt in FORMATS and dim % 32 == 0 and x.shape[1] == dim, (fmt, dim, x.shape)
    if B == 0 or n == 0:
        return torch.zeros(B, n, dtype=torch.float32, device=x.device)
    f = CODES[fmt]
    rb = T._row_bytes(f, dim)
    assert rows.shape[1] == rb, (rows.shape, rb)
    if B > MAX_ROWS:  # a prompt: widened slices, one matmul each
        x32, out = x.float(), torch.empty(B, n, dtype=torch.float32, device=x.device)
        step = max(T.BLOCK_N, WIDEN_BYTES // (4 * dim) // T.BLOCK_N * T.BLOCK_N)
        for lo in range(0, n, step):
            part = rows[lo:lo + step]
            k = part.shape[0]
            w = torch.empty(k, dim, dtype=torch.float32, device=x.device)
            T._widen_kernel[(T.triton.cdiv(k, T.BLOCK_N), T.triton.cdiv(dim, T.BLOCK_K))](
                part, w, k, dim, rb, NROWS=1, ROW_BYTES=rb, FMT=f, DFMT=f, BLOCK_N=T.BLOCK_N,
                BLOCK_K=T.BLOCK_K)
            out[:, lo:lo + k] = x32 @ w.t()
        return out
    x = x.contiguous()
    if B > 1:  # a batch's decode step: each tile of the matrix against every row
        out = torch.empty(B, n, dtype=torch.float32, device=x.device)
        T._linear_kernel[(T.triton.cdiv(n, BLOCK_N),)](
            x, rows, out, B, dim, n, rb, FMT=f, RELU=False, BLOCK_B=max(16, T._pow2(B)),
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        return out
    # the sums at [n, 2n) of a scratch row (the kernel's gate half, unused here)
    sums = torch.zeros(2 * n, dtype=torch.float32, device=x.device)
    (bn, bk, warps), _ = T.SPLIT_TILES[False]
    cols = T.SPLIT_COLS
    T._gate_up_kernel[(T.triton.cdiv(n, bn), T.triton.cdiv(dim, cols))](
        x, rows, rows, sums, sums, dim, n, n, rb, FMT=f, ROW_BYTES=rb, GATED=False, SEL=0,
        BLOCK_N=bn, BLOCK_K=bk, COLS=cols, num_warps=warps)
    return sums[n:].view(1, n)


class BlockLinear(InputSparse, nn.Module):
    """x W^T + b over a fused projection's parts, each a tensor's rows in the file's Q4_0, Q4_1
    or Q8_0 blocks, on the device the Triton kernels run on (`linear`, one call for each run of
    parts of one type: `fmts`). One run of Q4_0 or Q4_1 rows takes input sparsity
    (`InputSparse.sparsify_input`): its one-row steps then read a q4c copy by `q4c_linear`."""

    def __init__(self, parts: list[tuple[torch.Tensor, str]], dim: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        # neighbouring parts of one type held as one matrix: one launch for them (q, k and v
        # of a Q4_0 file, gate and up)
        runs: list[tuple[list[torch.Tensor], str]] = []
        for rows, fmt in parts:
            assert fmt in FORMATS, fmt
            if runs and runs[-1][1] == fmt:
                runs[-1][0].append(rows)
            else:
                runs.append(([rows], fmt))
        self.in_features, self.fmts = dim, [fmt for _, fmt in runs]
        for i, (rows, fmt) in enumerate(runs):
            self.register_buffer(f"rows{i}", held_rows(torch.cat(rows), fmt).contiguous())
        self.out_features = sum(rows.shape[0] for rows, _ in parts)
        self.register_buffer("bias", bias)

    @property
    def sparsifiable(self) -> bool:  # (the Triton kernel's q4c kinds)
        return len(self.fmts) == 1 and self.fmts[0] in Q4C_FORMATS

    def _q4c(self) -> tuple[torch.Tensor, int]:
        # the rows' codes, scales and offsets (the file's blocks again) in the CPU kernel's q4c
        # layout, made on the host and held where the rows are
        fmt, rows = self.fmts[0], self.rows0
        q, d, z = q4_split(fmt.upper(), self.out_features, self.in_features,
                           kernels.join_rows(rows.cpu(), fmt).numpy())
        w, offsets = kernels.pack_q4c(*(torch.from_numpy(a) for a in (q, d, z)))
        return w.to(rows.device), int(offsets)

    q4c_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def _q4c_product(self, x: torch.Tensor, w: torch.Tensor, kind: int, t: float) -> torch.Tensor:
        """`q4c_linear` (float32). The channels kept are counted where the counter is on x's
        device (a host counter beside a GPU's step would wait for the device each step: not
        counted there)."""
        y = q4c_linear(x, w, self.out_features, kind, t)
        st = self.sparse_stats
        if st is not None and st.device == x.device:
            st[0] += int((x.abs() > t).sum())
            st[1] += x.numel()
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.sparse_product(x2) if x2.shape[0] == 1 else None
        if y is None:
            y = [linear(x2, getattr(self, f"rows{i}"), f, self.in_features)
                 for i, f in enumerate(self.fmts)]
            y = y[0] if len(y) == 1 else torch.cat(y, -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {'+'.join(self.fmts)}"


# ---------------------------------------------------------------- input sparsity (TEAL) on the GPU

Q4C_FORMATS = ("q4_0", "q4_1")  # the q4c kinds (`kernels.Q4C_KINDS`) the Triton kernel takes
Q4C_CHUNK = 512  # input channels a program adds up (its partial sums added atomically)


def q4c_linear(x: torch.Tensor, w: torch.Tensor, n: int, kind: int, threshold: float) -> torch.Tensor:
    """x (1, k) float -> (1, n) float32 = x' W^T, x' the input with every entry at or under
    `threshold` in magnitude zeroed, W an (n, k) Q4_0/Q4_1 matrix in the CPU kernel's q4c layout
    (`kernels.pack_q4c`, csrc/input_sparse.h: per block of 32 input channels the rows' f16
    scales (and offsets), then each channel's 4-bit codes for every row as one run). The input-
    sparse product of the GPU: each program takes 64 rows (half a pass) of Q4C_CHUNK channels
    and loads, of each channel's run, the 32 bytes of its rows only where the channel is kept,
    and a block's scales only where one of its channels is: the masked lanes issue no memory
    request, so the bytes read follow the kept channels (a channel's 32 bytes are one 32-byte
    sector). No host synchronisation (the kept channels are not gathered first), so a CUDA graph holds it.
    Its sums are the dense product's over the zeroed input up to float32 rounding (added in
    another order)."""
    k = x.shape[-1]
    assert kernels.Q4C_KINDS[kind] in Q4C_FORMATS and k % 32 == 0 and x.numel() == k, \
        (kind, x.shape)
    rows = kernels.q4c_rows(n)
    head = 2 * rows * (2 if kind == 1 else 1)
    block_bytes = head + 16 * rows
    assert w.numel() == k // 32 * block_bytes, (w.numel(), k, n, kind)
    y = torch.zeros(1, rows, dtype=torch.float32, device=x.device)
    chunk = min(Q4C_CHUNK, k)
    _q4c_kernel[(rows // 64, T.triton.cdiv(k, chunk))](
        x.reshape(-1).contiguous(), w, y, k, rows, block_bytes, head, float(threshold),
        OFFSETS=kind == 1, CHUNK=chunk)
    return y[:, :n]


if T.triton is not None:
    triton, tl = T.triton, T.tl

    @triton.jit
    def _q4c_kernel(x, w, y, k, rows, block_bytes, head, threshold, OFFSETS: tl.constexpr,
                    CHUNK: tl.constexpr):
        # half g % 2 of pass g // 2 (bytes 32 (g % 2) .. + 31 of each run's line) over channels
        # [CHUNK s, CHUNK (s + 1)); the line's byte b = 16 L + 4 m + t holds row 16 m + 4 L + t
        # of the pass (low nibble) and that row + 64 (high) (kernels._q4c_runs)
        g, s = tl.program_id(0), tl.program_id(1)
        j = tl.arange(0, 32)
        b = (g % 2) * 32 + j
        r_lo = (g // 2) * 128 + ((b % 16) // 4) * 16 + (b // 16) * 4 + b % 4
        r_hi = r_lo + 64
        ch = tl.arange(0, 32)
        acc_lo = tl.zeros([32], dtype=tl.float32)
        acc_hi = tl.zeros([32], dtype=tl.float32)
        for c0 in range(s * CHUNK, tl.minimum(k, (s + 1) * CHUNK), 32):
            xv = tl.load(x + c0 + ch).to(tl.float32)
            keep = tl.abs(xv) > threshold
            xs = tl.where(keep, xv, 0.0)
            base = (c0 // 32) * block_bytes  # (under 2 GiB: a 70B gate+up is 0.3)
            codes = tl.load(w + base + head + ch[:, None] * (rows // 2) + g * 32 + j[None, :],
                            mask=keep[:, None], other=0).to(tl.int32)
            s_lo = tl.sum(xs[:, None] * (codes & 15).to(tl.float32), axis=0)
            s_hi = tl.sum(xs[:, None] * (codes >> 4).to(tl.float32), axis=0)
            total = tl.sum(xs, axis=0)
            some = j < 32 * tl.max(keep.to(tl.int32), axis=0)  # any channel of the block kept
            d_lo = T._f16_at(w + base + 2 * r_lo, some)
            d_hi = T._f16_at(w + base + 2 * r_hi, some)
            if OFFSETS:  # Q4_1: w = d q + m
                m_lo = T._f16_at(w + base + 2 * rows + 2 * r_lo, some)
                m_hi = T._f16_at(w + base + 2 * rows + 2 * r_hi, some)
                acc_lo += d_lo * s_lo + m_lo * total
                acc_hi += d_hi * s_hi + m_hi * total
            else:  # Q4_0: w = d (q - 8)
                acc_lo += d_lo * (s_lo - 8.0 * total)
                acc_hi += d_hi * (s_hi - 8.0 * total)
        tl.atomic_add(y + r_lo, acc_lo)
        tl.atomic_add(y + r_hi, acc_hi)
