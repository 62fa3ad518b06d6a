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
float32 first. On a machine without a GPU these kernels run under Triton's interpreter on CPU
tensors (`kernels.TRITON_ON_CPU`, tests).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from . import triton_ffn as T

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


class BlockLinear(nn.Module):
    """x W^T + b over a fused projection's parts, each a tensor's rows in the file's Q4_0, Q4_1
    or Q8_0 blocks, on the device the Triton kernels run on (`linear`, one call for each run of
    parts of one type: `fmts`)."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = [linear(x2, getattr(self, f"rows{i}"), f, self.in_features)
             for i, f in enumerate(self.fmts)]
        y = y[0] if len(y) == 1 else torch.cat(y, -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {'+'.join(self.fmts)}"
