"""The GPU half of the sparse FFN as Triton kernels: the hot neurons' FFN and the predictor.

The FFN kernel reads the same neuron-major records the CPU kernel keeps (`kernels.pack`: per
neuron [gate row][up row][down row], so a neuron's rows lie side by side and a program reads
each row with coalesced loads), in their own format:
- plain rows (float32, bfloat16; float16 too on a GPU);
- the file's 4-bit blocks (GGUF Q4_0/Q4_1, gate and up, held split: `kernels.split_rows`) with
  Q8_0 down rows, or Q8_0 rows
  throughout, dequantized in registers.

A decode row (one row of input) of block-format records is split over the width, in two
launches (`DECODE_SPLIT`): a program of `_gate_up_kernel` adds its neurons' gate and up dot
products over `SPLIT_COLS` columns to a float32 scratch (each block's bytes loaded as one run, its
scale once, the input's columns met in the blocks' order), then a program of `_down_kernel`
takes a slice of the output columns and a run of the selection: it applies the activation to
the sums, accumulates the fired neurons' down rows in registers and adds them to the output
once (an atomic add a column for each run, not one for each neuron tile).

Otherwise (plain records, several rows, or `DECODE_SPLIT` off) one program takes a tile of
selected neurons and every row of the batch (1 to 64): for a decode row `TILE_PLAIN` /
`TILE_BLOCKS` (16 neurons x 1024 columns a step for plain rows, 8 x 512 for blocks: the fastest
of a sweep on an H200), for several rows BLOCK_N x BLOCK_K (16 x 128), whose `tl.dot` operands
fit shared memory:
1. gate dot products over the width, then the neurons whose gate cannot let them fire in any
   row (ReGLU, dReLU) are masked out of the next loads;
2. up dot products (plus the up bias), the activation and the firing threshold, the per-row
   keep masks;
3. their down rows, read only for neurons that fired in some row, scaled and added to the
   float32 output with atomic adds.
No intermediate of the layer's width is written. The math is `csrc/neuron_ffn.h`'s (`activations`
and `gate_open`), except that the input is not quantized to 8 bits for the block formats: a GPU
has the float units to spare, so the rows are dequantized and met by the input as it is.

Selections: an index list (int32 positions in the set, with its length in a device tensor, so a
selection made on the device needs no host round trip) is the fast path: its programs are full.
A bool mask over the set is compacted to that list on the device first (`compact`), or run as it
is (`mask_path=True`: one program per block of the set, masked loads skip unselected rows).

The predictor (`predict`): per layer relu(x fc1^T) fc2^T, then either PowerInfer's rule
(logit >= threshold) or each row's top k (the k-th largest logit found by bisection over the
floats' ordered bit patterns, so the rows keep exactly the neurons `torch.topk` would, ties
included), then per-row keep masks and the union as an index list with its count, made in the
same pass by atomic reservations, in the form the FFN kernel reads.

On a machine without a GPU these kernels run under Triton's interpreter (`TRITON_INTERPRET=1`,
set before this module is imported) on CPU tensors: that is how the tests check them everywhere.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("powerinfer")


try:  # the GPU path's own dependency (the `gpu` extra); torch is the fallback without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - where triton is not installed
    triton = tl = None


ACTS = ("relu", "reglu", "dreglu", "swiglu", "geglu", "gelu")  # as kernels.ACTS


PLAIN, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3


# a record's 4-bit gate/up rows, held split (`kernels.split_rows`: nibbles, then scales, then
# minimums); a plain matrix keeps GGUF's blocks
Q4_0S, Q4_1S = 4, 5


RECORD_CODES = {Q4_0: Q4_0S, Q4_1: Q4_1S}


BLOCK_FORMATS = {"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0}


PLAIN_TYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


FORMATS = (*PLAIN_TYPES, *BLOCK_FORMATS)  # record formats the FFN kernel reads


MAX_ROWS = 64  # batch rows per call (more are run MAX_ROWS at a time)


BLOCK_N, BLOCK_K = 16, 128  # neurons per program (more keep a GPU busy); columns a step (x32)


# a decode row's (B = 1) tile of the FFN kernel, (neurons, columns a step, warps), by record
# format, from `benchmarks/gpu.py --kernels --sweep` on an H200 (BENCHMARKS.md): plain records
# read 1024 columns a step (4-8x the bytes in flight of 128), block formats 512 over 8 neurons
TILE_PLAIN, TILE_BLOCKS = (16, 1024, 4), (8, 512, 4)


# a decode row split over the width (`_gate_up_kernel`, then `_down_kernel`): each gate/up
# program takes SPLIT_COLS columns of its neurons' rows, each down program a slice of the output
# and a run of the neurons; by record kind, plain [True] or block formats [False]: whether a
# decode row takes this path, and its tiles (neurons, columns a step, warps) for gate/up and
# for down; the down kernel's programs a multiprocessor. From `benchmarks/gpu.py --kernels
# --sweep split` on an H200 (BENCHMARKS.md): Q4_0 records 4.5x faster than in one launch at 10%
# selected, 6.8x at 100%; bf16 records as fast split as in one launch on the device, but one
# launch more from Python (10% selected: 215 against 128 us), so they keep one launch
DECODE_SPLIT = {True: False, False: True}


SPLIT_COLS = 1024


SPLIT_TILES = {True: ((32, 128, 8), (16, 256, 4)), False: ((8, 512, 4), (16, 256, 4))}


DOWN_PER_SM = 8


def down_programs(device: torch.device) -> int:
    """Programs the split decode row's down kernel aims for (column slices x neuron groups):
    DOWN_PER_SM a multiprocessor on a GPU, 16 under the interpreter (several groups still)."""
    return 16 if device.type != "cuda" else DOWN_PER_SM * multiprocessors(device)


def multiprocessors(device: torch.device) -> int:
    """The multiprocessors of a CUDA device (the current one for a device without an index)."""
    return _multiprocessors(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _multiprocessors(index: int) -> int:  # (asked once a device, not at every decode call)
    return torch.cuda.get_device_properties(index).multi_processor_count


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str = "cuda") -> bool:
    """Whether these kernels run on tensors of `device`: Triton installed, and the device a GPU
    (or, under the interpreter, the CPU)."""
    if triton is None:
        return False
    return torch.device(device).type == ("cpu" if interpreted() else "cuda")


_said: set = set()


def format_for(weight: torch.Tensor, q4_type: str | None = None) -> str | None:
    """The record format neuron sets over weights like `weight` take on its device: the file's
    block type (q4_type "Q4_0", "Q4_1", "Q8_0") or the weights' precision where these kernels
    run there, else None (torch's gathered matmuls). Says once per process which path runs."""
    dev = weight.device
    fmt = None
    if available(dev):
        fmt = (q4_type.lower() if q4_type is not None and q4_type.lower() in BLOCK_FORMATS
               else next((f for f, dt in PLAIN_TYPES.items() if dt == weight.dtype), None))
    if dev.type not in _said:
        _said.add(dev.type)
        if fmt is not None:
            log.info("sparse FFN and predictors on %s: Triton kernels (triton %s%s)", dev.type,
                     triton.__version__, ", interpreted" if interpreted() else "")
        else:
            why = ("triton is not installed" if triton is None
                   else f"Triton does not run on {dev.type} here" if not available(dev)
                   else f"no Triton kernel for {weight.dtype}")
            log.info("sparse FFN and predictors on %s: torch (%s)", dev.type, why)
    return fmt


def _row_bytes(fmt: int, dim: int) -> int:
    return {Q4_0: dim // 32 * 18, Q4_1: dim // 32 * 20, Q8_0: dim // 32 * 34, Q4_0S: dim // 32 * 18,
            Q4_1S: dim // 32 * 20}[fmt]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if triton is not None:

    @triton.jit
    def _f16_at(p, mask):
        # a little-endian float16 at byte pointers p -> float32
        lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _rows(w, rec, off, cols, mask, nb, FMT: tl.constexpr):
        # rows starting `off` (elements for plain records, bytes for blocks) into records whose
        # starts are `rec` (BLOCK_N, 1), columns `cols` (1, BLOCK_K) -> float32 (BLOCK_N, BLOCK_K);
        # nb: blocks of 32 a row (where the split rows' scales start)
        # (constexpr branches, one return: the compiler types every statement after a return)
        if FMT == 0:
            v = tl.load(w + rec + off + cols, mask=mask, other=0).to(tl.float32)
        else:
            blk, j = cols // 32, cols % 32
            if FMT == 3:  # Q8_0: f16 scale, 32 int8
                b = w + rec + off + blk * 34
                q = tl.load(b + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
                v = q.to(tl.float32) * _f16_at(b, mask)
            elif FMT == 1:  # Q4_0: f16 scale, 16 bytes: weight j the low nibble of byte j % 16
                # (j < 16), else the high one
                b = w + rec + off + blk * 18
                q = (tl.load(b + 2 + j % 16, mask=mask, other=0) >> ((j // 16) * 4)) & 15
                v = (q.to(tl.float32) - 8.0) * _f16_at(b, mask)
            elif FMT == 2:  # Q4_1: f16 scale, f16 minimum, 16 bytes
                b = w + rec + off + blk * 20
                q = (tl.load(b + 4 + j % 16, mask=mask, other=0) >> ((j // 16) * 4)) & 15
                v = q.to(tl.float32) * _f16_at(b, mask) + _f16_at(b + 2, mask)
            else:  # split Q4_0 (4) or Q4_1 (5): nibbles 16 bytes a block, then scales, then minimums
                r = w + rec + off
                q = (tl.load(r + blk * 16 + j % 16, mask=mask, other=0) >> ((j // 16) * 4)) & 15
                d = _f16_at(r + nb * 16 + blk * 2, mask)
                if FMT == 4:
                    v = (q.to(tl.float32) - 8.0) * d
                else:
                    v = q.to(tl.float32) * d + _f16_at(r + nb * 18 + blk * 2, mask)
        return v

    @triton.jit
    def _mm_t(a, b, BLOCK_B: tl.constexpr):
        # a (BLOCK_B, K) float32, b (N, K) float32 -> a b^T (BLOCK_B, N) in float32
        if BLOCK_B == 1:
            y = tl.sum(a * b, axis=1)[None, :]
        else:
            y = tl.dot(a, tl.trans(b), input_precision="ieee")
        return y

    @triton.jit
    def _mm(a, b, BLOCK_B: tl.constexpr):
        # a (BLOCK_B, N), b (N, K) -> a b (BLOCK_B, K) in float32
        if BLOCK_B == 1:
            y = tl.sum(tl.trans(a) * b, axis=0)[None, :]
        else:
            y = tl.dot(a, b, input_precision="ieee")
        return y

    @triton.jit
    def _sigmoid(z):
        e = tl.exp(-tl.abs(z))  # never overflows
        return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    @triton.jit
    def _gelu_tanh(g):
        # 0.5 g (1 + tanh(z)) = g sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3)
        return g * _sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))

    @triton.jit
    def _activation(gate, up, threshold, ACT: tl.constexpr):
        # the activation h, zero where its firing score does not pass a threshold > 0
        # (csrc/neuron_ffn.h's `activations`); gate is unused for ReLU and GELU
        if ACT == 0:  # ReLU
            h = tl.maximum(up, 0.0)
            score = h
        elif ACT == 1:  # ReGLU
            score = tl.maximum(gate, 0.0)
            h = score * up
        elif ACT == 2:  # dReLU
            h = tl.maximum(gate, 0.0) * tl.maximum(up, 0.0)
            score = h
        elif ACT == 3:  # SwiGLU
            s = gate * _sigmoid(gate)
            score = tl.abs(s)
            h = s * up
        elif ACT == 4:  # GeGLU (tanh GELU)
            s = _gelu_tanh(gate)
            score = tl.abs(s)
            h = s * up
        else:  # GELU (erf)
            h = 0.5 * up * (1.0 + tl.erf(up * 0.7071067811865476))
            score = tl.abs(h)
        if threshold > 0:
            h = tl.where(score > threshold, h, 0.0)
        return h

    @triton.jit
    def _selected(sel_ptr, count_ptr, pos, k, SEL: tl.constexpr):
        # positions `pos` of a selection -> (valid, neuron): SEL 0 every neuron of the set, 1 an
        # index list (its length at count_ptr), 2 a bool mask over the set
        if SEL == 1:
            valid = pos < tl.load(count_ptr)
            neuron = tl.load(sel_ptr + pos, mask=valid, other=0).to(tl.int64)
        elif SEL == 2:
            valid = (pos < k) & (tl.load(sel_ptr + pos, mask=pos < k, other=0) != 0)
            neuron = pos.to(tl.int64)
        else:
            valid = pos < k
            neuron = pos.to(tl.int64)
        return valid, neuron

    @triton.jit
    def _ffn_kernel(x_ptr, w_ptr, sel_ptr, count_ptr, keep_ptr, bias_ptr, out_ptr,
                    B, dim, k, rec_stride, keep_stride, threshold,
                    ACT: tl.constexpr, FMT: tl.constexpr, DFMT: tl.constexpr,
                    ROW_BYTES: tl.constexpr, GATED: tl.constexpr, SEL: tl.constexpr,
                    KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_B: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # SEL: 0 every neuron of the set, 1 an index list (its length at count_ptr), 2 a mask;
        # KEEP: 0 none, 1 by position in the selection, 2 by neuron (keep_ptr (B, keep_stride))
        pid = tl.program_id(0)
        pos = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        valid, neuron = _selected(sel_ptr, count_ptr, pos, k, SEL)
        if tl.sum(valid.to(tl.int32)) > 0:
            rows = tl.arange(0, BLOCK_B)
            rmask = rows < B
            rec = (neuron * rec_stride)[:, None]
            # offsets of the up and down rows in a record (elements or bytes)
            if FMT == 0:
                up_off = dim if GATED else 0
                down_off = 2 * dim if GATED else dim
            else:
                up_off = ROW_BYTES if GATED else 0
                down_off = 2 * ROW_BYTES if GATED else ROW_BYTES
            gate = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
            if GATED:
                for k0 in range(0, dim, BLOCK_K):
                    cols = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(x_ptr + rows[:, None] * dim + cols[None, :],
                                mask=rmask[:, None] & (cols < dim)[None, :], other=0).to(tl.float32)
                    wg = _rows(w_ptr, rec, 0, cols[None, :], valid[:, None] & (cols < dim)[None, :], dim // 32, FMT)
                    gate += _mm_t(x, wg, BLOCK_B)
                # neurons no row's gate lets fire (ReGLU, dReLU, a threshold): no up or down read
                # (`gate_open`): ReGLU's relu(g) and dReLU's g must pass 0 (and the threshold),
                # SwiGLU's |silu(g)| and GeGLU's |gelu(g)| the threshold
                if ACT == 1:
                    score = tl.where(rmask[:, None], gate, -1.0)
                    valid &= tl.max(score, axis=0) > tl.maximum(threshold, 0.0)
                elif ACT == 2:
                    valid &= tl.max(tl.where(rmask[:, None], gate, -1.0), axis=0) > 0.0
                elif threshold > 0:
                    if ACT == 3:
                        s = tl.abs(gate * _sigmoid(gate))
                    else:
                        s = tl.abs(_gelu_tanh(gate))
                    valid &= tl.max(tl.where(rmask[:, None], s, 0.0), axis=0) > threshold
            for k0 in range(0, dim, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rows[:, None] * dim + cols[None, :],
                            mask=rmask[:, None] & (cols < dim)[None, :], other=0).to(tl.float32)
                wu = _rows(w_ptr, rec, up_off, cols[None, :], valid[:, None] & (cols < dim)[None, :], dim // 32, FMT)
                up += _mm_t(x, wu, BLOCK_B)
            if HAS_BIAS:
                up += tl.load(bias_ptr + neuron, mask=valid, other=0)[None, :]
            h = _activation(gate, up, threshold, ACT)
            keep = rmask[:, None] & valid[None, :]
            if KEEP == 1:
                keep &= tl.load(keep_ptr + rows[:, None] * keep_stride + pos[None, :],
                                mask=keep, other=0) != 0
            elif KEEP == 2:
                keep &= tl.load(keep_ptr + rows[:, None] * keep_stride + neuron[None, :],
                                mask=keep, other=0) != 0
            h = tl.where(keep, h, 0.0)
            fired = tl.max(tl.abs(h), axis=0) > 0  # down rows read only for these
            if tl.sum(fired.to(tl.int32)) > 0:
                for k0 in range(0, dim, BLOCK_K):
                    cols = k0 + tl.arange(0, BLOCK_K)
                    wd = _rows(w_ptr, rec, down_off, cols[None, :], fired[:, None] & (cols < dim)[None, :], dim // 32, DFMT)
                    part = _mm(h, wd, BLOCK_B)
                    tl.atomic_add(out_ptr + rows[:, None] * dim + cols[None, :], part,
                                  mask=rmask[:, None] & (cols < dim)[None, :])

    @triton.jit
    def _q8_0_blocks(r, blk, mask):
        # Q8_0 blocks blk (NB,) of rows at byte pointers r (BLOCK_N, 1), mask (BLOCK_N, NB) ->
        # their 32 int8 weights each as float32 (BLOCK_N, NB, 32) and their f16 scales (BLOCK_N, NB)
        b = r + blk[None, :] * 34
        j = tl.arange(0, 32)
        q = tl.load(b[:, :, None] + 2 + j[None, None, :], mask=mask[:, :, None], other=0)
        return q.to(tl.int8, bitcast=True).to(tl.float32), _f16_at(b, mask)

    @triton.jit
    def _dot_step(r, c0, x_ptr, dim, valid, nb, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
        # a decode row's products with rows starting at byte or element pointers r (BLOCK_N, 1),
        # columns c0 .. c0 + BLOCK_K: plain rows (BLOCK_N, BLOCK_K) products; block formats
        # (BLOCK_N, BLOCK_K // 32) block sums, each block's bytes loaded as one run (its weights
        # met by the input's columns in the same order) and its scale once
        if FMT == 0:
            cols = c0 + tl.arange(0, BLOCK_K)
            cm = cols < dim
            x = tl.load(x_ptr + cols, mask=cm, other=0).to(tl.float32)
            p = tl.load(r + cols[None, :], mask=valid[:, None] & cm[None, :], other=0).to(tl.float32) * x[None, :]
        else:
            blk = c0 // 32 + tl.arange(0, BLOCK_K // 32)
            bm = blk < nb
            m2 = valid[:, None] & bm[None, :]
            if FMT == 3:  # Q8_0 blocks
                j = tl.arange(0, 32)
                q, d = _q8_0_blocks(r, blk, m2)
                x = tl.load(x_ptr + blk[:, None] * 32 + j[None, :], mask=bm[:, None], other=0).to(tl.float32)
                p = tl.sum(q * x[None, :, :], axis=2) * d
            else:  # split 4-bit rows: block blk's 16 bytes hold weights i (low nibble) and 16 + i
                i = tl.arange(0, 16)
                q = tl.load(r[:, :, None] + blk[None, :, None] * 16 + i[None, None, :],
                            mask=m2[:, :, None], other=0)
                xo = x_ptr + blk[:, None] * 32 + i[None, :]
                xlo = tl.load(xo, mask=bm[:, None], other=0).to(tl.float32)
                xhi = tl.load(xo + 16, mask=bm[:, None], other=0).to(tl.float32)
                s = tl.sum((q & 15).to(tl.float32) * xlo[None, :, :] + (q >> 4).to(tl.float32) * xhi[None, :, :], axis=2)
                xs = tl.sum(xlo + xhi, axis=1)[None, :]  # (the offsets' share: -8 d or m a weight)
                d = _f16_at(r + nb * 16 + blk[None, :] * 2, m2)
                if FMT == 4:
                    p = (s - 8.0 * xs) * d
                else:
                    p = s * d + _f16_at(r + nb * 18 + blk[None, :] * 2, m2) * xs
        return p

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, sel_ptr, count_ptr, gu_ptr, dim, k, cap, rec_stride,
                        FMT: tl.constexpr, ROW_BYTES: tl.constexpr, GATED: tl.constexpr,
                        SEL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        COLS: tl.constexpr):
        # a decode row, split: program (i, s) adds the gate and up dot products of the selection's
        # neurons i*BLOCK_N .. over columns s*COLS .. (s+1)*COLS to gu (gate at [0, cap), up at
        # [cap, 2 cap), by position; zeroed by the caller)
        pos = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid, neuron = _selected(sel_ptr, count_ptr, pos, k, SEL)
        if tl.sum(valid.to(tl.int32)) > 0:
            r = w_ptr + (neuron * rec_stride)[:, None]
            if FMT == 0:
                up_off = dim if GATED else 0
                accg = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            else:
                up_off = ROW_BYTES if GATED else 0
                accg = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
            accu = tl.zeros_like(accg)
            c_lo = tl.program_id(1) * COLS
            for c in range(0, COLS, BLOCK_K):
                if GATED:
                    accg += _dot_step(r, c_lo + c, x_ptr, dim, valid, dim // 32, FMT, BLOCK_K)
                accu += _dot_step(r + up_off, c_lo + c, x_ptr, dim, valid, dim // 32, FMT, BLOCK_K)
            if GATED:
                tl.atomic_add(gu_ptr + pos, tl.sum(accg, axis=1), mask=valid)
            tl.atomic_add(gu_ptr + cap + pos, tl.sum(accu, axis=1), mask=valid)

    @triton.jit
    def _down_kernel(gu_ptr, w_ptr, sel_ptr, count_ptr, keep_ptr, bias_ptr, out_ptr, dim, k, cap,
                     rec_stride, threshold, ACT: tl.constexpr, DFMT: tl.constexpr,
                     ROW_BYTES: tl.constexpr, GATED: tl.constexpr, SEL: tl.constexpr,
                     KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUPS):
        # a decode row, split: program (s, g) owns output columns s*BLOCK_K .. and the g-th of
        # GROUPS runs of the selection's positions; for each BLOCK_N of them it applies the
        # activation to the summed gate and up (and bias), keeps the row's own (KEEP as
        # `_ffn_kernel`'s), and accumulates the fired neurons' down rows times their activations
        # in registers; one atomic add a column at the end (GROUPS adds a column in all, where
        # one a neuron tile would make every program of a column wait on the same addresses)
        if SEL == 1:
            total = tl.load(count_ptr)
        else:
            total = k
        per = tl.cdiv(tl.cdiv(total, GROUPS), BLOCK_N) * BLOCK_N
        lo = tl.program_id(1) * per
        hi = tl.minimum(lo + per, total)
        if DFMT == 0:
            down_off = 2 * dim if GATED else dim
            cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
            cm = cols < dim
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            down_off = 2 * ROW_BYTES if GATED else ROW_BYTES
            blk = tl.program_id(0) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
            bm = blk < dim // 32
            j = tl.arange(0, 32)
            acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid, neuron = _selected(sel_ptr, count_ptr, pos, k, SEL)
            valid &= pos < hi
            gate = tl.load(gu_ptr + pos, mask=valid, other=0)
            up = tl.load(gu_ptr + cap + pos, mask=valid, other=0)
            if HAS_BIAS:
                up += tl.load(bias_ptr + neuron, mask=valid, other=0)
            h = _activation(gate, up, threshold, ACT)
            keep = valid
            if KEEP == 1:
                keep &= tl.load(keep_ptr + pos, mask=valid, other=0) != 0
            elif KEEP == 2:
                keep &= tl.load(keep_ptr + neuron, mask=valid, other=0) != 0
            h = tl.where(keep, h, 0.0)
            fired = tl.abs(h) > 0  # the down rows read only for these
            r = w_ptr + (neuron * rec_stride)[:, None] + down_off
            if DFMT == 0:
                v = tl.load(r + cols[None, :], mask=fired[:, None] & cm[None, :], other=0)
                acc += v.to(tl.float32) * h[:, None]
            else:  # Q8_0 blocks, the scale folded into the activation
                q, d = _q8_0_blocks(r, blk, fired[:, None] & bm[None, :])
                acc += q * (h[:, None] * d)[:, :, None]
        if hi > lo:
            part = tl.sum(acc, axis=0)
            if DFMT == 0:
                tl.atomic_add(out_ptr + cols, part, mask=cm)
            else:
                tl.atomic_add(out_ptr + blk[:, None] * 32 + j[None, :], part, mask=bm[:, None])

    @triton.jit
    def _compact_kernel(mask_ptr, n, idx_ptr, count_ptr, BLOCK: tl.constexpr):
        # the positions of a bool mask's set entries: each program reserves its share of the
        # list with one atomic add (blocks land in any order, each block's in order)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        on = (tl.load(mask_ptr + offs, mask=offs < n, other=0) != 0).to(tl.int32)
        total = tl.sum(on)
        if total > 0:
            base = tl.atomic_add(count_ptr, total)
            at = base + tl.cumsum(on, 0) - 1
            tl.store(idx_ptr + at, offs, mask=on != 0)

    @triton.jit
    def _widen_kernel(w_ptr, out_ptr, n, dim, rec_stride, NROWS: tl.constexpr,
                      ROW_BYTES: tl.constexpr, FMT: tl.constexpr, DFMT: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # records (n, bytes) -> float32 (n, NROWS, dim): the last row in DFMT
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs < n)[:, None] & (cols < dim)[None, :]
        rec = (offs.to(tl.int64) * rec_stride)[:, None]
        for r in tl.static_range(NROWS):
            if r == NROWS - 1:
                v = _rows(w_ptr, rec, r * ROW_BYTES, cols[None, :], mask, dim // 32, DFMT)
            else:
                v = _rows(w_ptr, rec, r * ROW_BYTES, cols[None, :], mask, dim // 32, FMT)
            tl.store(out_ptr + (offs.to(tl.int64)[:, None] * NROWS + r) * dim + cols[None, :], v, mask=mask)

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, out_ptr, B, dim, n, row_stride, FMT: tl.constexpr,
                       RELU: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        # x (B, dim) -> out (B, n) float32 = x W^T (RELU: relu of it), W's rows `row_stride`
        # apart (elements for plain rows, bytes for blocks) in FMT (`_rows`): program i takes
        # rows i*BLOCK_N .. against every row of x. The predictor's first matrix (plain rows),
        # and `triton_linear`'s matrices in a file's blocks for a batch's rows
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_B)
        rec = (offs.to(tl.int64) * row_stride)[:, None]
        nm, bm = offs < n, rows < B
        acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, dim, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cm = cols < dim
            x = tl.load(x_ptr + rows[:, None] * dim + cols[None, :], mask=bm[:, None] & cm[None, :],
                        other=0).to(tl.float32)
            w = _rows(w_ptr, rec, 0, cols[None, :], nm[:, None] & cm[None, :], dim // 32, FMT)
            acc += _mm_t(x, w, BLOCK_B)
        if RELU:
            acc = tl.maximum(acc, 0.0)
        tl.store(out_ptr + rows[:, None] * n + offs[None, :], acc, mask=bm[:, None] & nm[None, :])

    @triton.jit
    def _logits_kernel(h_ptr, fc2_ptr, thr_ptr, logits_ptr, keep_ptr, idx_ptr, count_ptr,
                       B, r, n, row_stride, FMT: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SELECT: tl.constexpr,
                       STORE: tl.constexpr):
        # logits = h fc2^T: h (B, r), fc2 (n, r) in FMT (plain rows, or Q8_0's), its rows
        # `row_stride` apart (elements, or bytes for blocks); STORE: write them (B, n); SELECT:
        # per-row keep = logits >= thr[row] (B, n) and the union's positions appended at idx_ptr
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_B)
        rmask = rows < B
        rec = (offs.to(tl.int64) * row_stride)[:, None]
        acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, r, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + rows[:, None] * r + cols[None, :],
                        mask=rmask[:, None] & (cols < r)[None, :], other=0)
            w = _rows(fc2_ptr, rec, 0, cols[None, :], (offs < n)[:, None] & (cols < r)[None, :],
                      r // 32, FMT)
            acc += _mm_t(h, w, BLOCK_B)
        both = rmask[:, None] & (offs < n)[None, :]
        at = rows[:, None] * n + offs[None, :]
        if STORE:
            tl.store(logits_ptr + at, acc, mask=both)
        if SELECT:
            _select(acc, rows, rmask, offs, both, at, thr_ptr, keep_ptr, idx_ptr, count_ptr)

    @triton.jit
    def _select(v, rows, rmask, offs, both, at, thr_ptr, keep_ptr, idx_ptr, count_ptr):
        # keep = v >= thr[row] per row (stored at `at` as int8), and the union of the block's
        # kept positions appended at idx_ptr after a reservation of slots in count_ptr
        thr = tl.load(thr_ptr + rows, mask=rmask, other=0)
        keep = both & (v >= thr[:, None])
        tl.store(keep_ptr + at, keep.to(tl.int8), mask=both)
        on = (tl.max(keep.to(tl.int32), axis=0) > 0).to(tl.int32)
        total = tl.sum(on)
        if total > 0:
            base = tl.atomic_add(count_ptr, total)
            tl.store(idx_ptr + base + tl.cumsum(on, 0) - 1, offs, mask=on != 0)

    @triton.jit
    def _key(v):
        # float32 -> int32 keys in the floats' order
        b = v.to(tl.int32, bitcast=True)
        return tl.where(b < 0, b ^ 0x7FFFFFFF, b)

    @triton.jit
    def _kth_kernel(logits_ptr, thr_ptr, n, k, BLOCK: tl.constexpr):
        # per row: the k-th largest logit, by bisection over the keys (32 steps, exact)
        row = tl.program_id(0)
        lo = tl.full((), -2147483648, tl.int64)  # count(key >= lo) >= k always holds
        hi = tl.full((), 2147483648, tl.int64)  # and never at hi
        for _ in range(33):
            mid = lo + (hi - lo) // 2  # (hi > lo: no rounding of negatives to differ)
            cnt = tl.zeros((), tl.int64)
            for c0 in range(0, n, BLOCK):
                offs = c0 + tl.arange(0, BLOCK)
                v = tl.load(logits_ptr + row.to(tl.int64) * n + offs, mask=offs < n, other=0)
                cnt += tl.sum(((_key(v).to(tl.int64) >= mid) & (offs < n)).to(tl.int64))
            ok = cnt >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        # the float whose key is lo
        kb = lo.to(tl.int32)
        bits = tl.where(kb < 0, kb ^ 0x7FFFFFFF, kb)
        tl.store(thr_ptr + row, bits.to(tl.float32, bitcast=True))


def _check(*ts: torch.Tensor):
    if triton is None:
        raise RuntimeError("the Triton kernels need the triton package (the `gpu` extra)")
    for t in ts:
        if t is not None and not available(t.device):
            raise RuntimeError(f"the Triton kernels run on a GPU (or on the CPU under "
                               f"TRITON_INTERPRET=1), not on {t.device}")


def compact(mask: torch.Tensor, count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A (n,) bool mask -> (indices, count): int32 (n,) whose first count[0] entries are the
    set positions (grouped by blocks of 1024, in order within each), count int32 (1,); both
    on the mask's device, made without a host round trip. count: a zeroed (1,) int32 to count
    in (the caller's, zeroed with its other buffers: one launch less)."""
    _check(mask)
    n = mask.shape[0]
    idx = torch.empty(n, dtype=torch.int32, device=mask.device)
    if count is None:
        count = torch.zeros(1, dtype=torch.int32, device=mask.device)
    if n:
        block = 1024
        _compact_kernel[(triton.cdiv(n, block),)](mask.contiguous().view(torch.uint8), n, idx,
                                                   count, BLOCK=block)
    return idx, count


def _plain(records: torch.Tensor, fmt: str, rows: int, dim: int) -> torch.Tensor:
    # plain records as their own numbers, (k, rows * dim)
    return records.view(PLAIN_TYPES[fmt]).view(records.shape[0], rows * dim)


def neuron_ffn(x: torch.Tensor, records: torch.Tensor, sel: torch.Tensor | None,
               keep: torch.Tensor | None, bias: torch.Tensor | None, threshold: float,
               act: str, fmt: str, count: torch.Tensor | None = None,
               mask_path: bool = False) -> torch.Tensor:
    """One decode step of a neuron set, as `kernels.neuron_ffn`: x (B, dim) float; records
    (k, bytes) uint8 (`kernels.pack`; gate/up in `fmt`, down in Q8_0 beside block formats);
    sel: None (every neuron), (m,) integer positions into the set (the first count[0] of them
    when `count` is given), or a (k,) bool mask (compacted to positions on the device, unless
    mask_path); keep: per-row masks, (B, m) by position with positions, (B, k) by neuron with a
    mask; bias (k,) or None -> (B, dim) in x's dtype (summed in float32, rounded once)."""
    _check(x, records)
    if fmt not in FORMATS:
        raise ValueError(f"Triton FFN formats: {FORMATS}, got {fmt!r}")
    B, dim = x.shape
    if B > MAX_ROWS:
        return torch.cat([neuron_ffn(x[r:r + MAX_ROWS], records, sel,
                                     None if keep is None else keep[r:r + MAX_ROWS], bias,
                                     threshold, act, fmt, count, mask_path)
                          for r in range(0, B, MAX_ROWS)])
    gated = act not in ("relu", "gelu")
    nrows = 3 if gated else 2
    k = records.shape[0]
    # positions the call's programs cover (an index list's length may be known only on the device)
    cap = sel.shape[0] if sel is not None and sel.dtype != torch.bool else k
    split = B == 1 and DECODE_SPLIT[fmt in PLAIN_TYPES]
    # the float32 sums, the compacted mask's count and (split) the gate and up sums zeroed by
    # one launch (a decode step's call is short enough that each launch shows)
    zeroed = torch.zeros(B * dim + 1 + (2 * cap if split else 0), dtype=torch.float32,
                         device=x.device)
    out = zeroed[:B * dim].view(B, dim)
    if B == 0 or k == 0:
        return out.to(x.dtype)
    keep_mode, keep_t = 0, None
    if sel is None:  # (keep: by neuron, which is by position here)
        sel_mode, sel_t, cnt = 0, records, None
        if keep is not None:
            keep_mode, keep_t = 2, keep
    elif sel.dtype == torch.bool and not mask_path:  # the fast path: the mask as positions
        sel_t, cnt = compact(sel, zeroed[B * dim:B * dim + 1].view(torch.int32))
        sel_mode = 1
        if keep is not None:
            keep_mode, keep_t = 2, keep
    elif sel.dtype == torch.bool:
        sel_mode, sel_t, cnt = 2, sel.contiguous().view(torch.uint8), None
        if keep is not None:
            keep_mode, keep_t = 2, keep
    else:
        sel_mode, sel_t = 1, sel.contiguous()
        cnt = (count if count is not None
               else torch.tensor([sel.shape[0]], dtype=torch.int32, device=x.device))
        if keep is not None:
            keep_mode, keep_t = 1, keep
    if cap == 0:
        return out.to(x.dtype)
    if keep_t is not None:
        keep_t = keep_t.reshape(B, -1).contiguous().view(torch.uint8)
    if fmt in PLAIN_TYPES:
        w, f, df, rb, stride = _plain(records, fmt, nrows, dim), PLAIN, PLAIN, 0, nrows * dim
    else:
        assert dim % 32 == 0, dim
        df = Q8_0 if fmt in ("q4_0", "q4_1") else BLOCK_FORMATS[fmt]
        f = RECORD_CODES.get(BLOCK_FORMATS[fmt], df)
        w, rb, stride = records, _row_bytes(f, dim), records.shape[1]
    cnt_t = cnt if cnt is not None else out
    keep_p = keep_t if keep_t is not None else out
    bias_p = bias if bias is not None else out
    x = x.contiguous()
    if split:
        gu = zeroed[B * dim + 1:]
        cols = SPLIT_COLS
        (bn, bk, warps), (dbn, dbk, dwarps) = SPLIT_TILES[fmt in PLAIN_TYPES]
        _gate_up_kernel[(triton.cdiv(cap, bn), triton.cdiv(dim, cols))](
            x, w, sel_t, cnt_t, gu, dim, k, cap, stride, FMT=f, ROW_BYTES=rb, GATED=gated,
            SEL=sel_mode, BLOCK_N=bn, BLOCK_K=bk, COLS=cols, num_warps=warps)
        slices = triton.cdiv(dim, dbk)
        groups = max(1, min(triton.cdiv(cap, dbn), down_programs(x.device) // slices))
        _down_kernel[(slices, groups)](
            gu, w, sel_t, cnt_t, keep_p, bias_p, out, dim, k, cap, stride, float(threshold),
            ACT=ACTS.index(act), DFMT=df, ROW_BYTES=rb, GATED=gated, SEL=sel_mode,
            KEEP=keep_mode, HAS_BIAS=bias is not None, BLOCK_N=dbn, BLOCK_K=dbk, GROUPS=groups,
            num_warps=dwarps)
        return out.to(x.dtype)
    block_b = 1 if B == 1 else max(16, _pow2(B))
    # several rows multiply through tl.dot, whose operands must fit shared memory: the small tile
    bn, bk, warps = (TILE_PLAIN if fmt in PLAIN_TYPES else TILE_BLOCKS) if B == 1 else \
        (BLOCK_N, BLOCK_K, 4)
    _ffn_kernel[(triton.cdiv(cap, bn),)](
        x, w, sel_t, cnt_t, keep_p, bias_p, out, B, dim, k, stride,
        0 if keep_t is None else keep_t.shape[1], float(threshold),
        ACT=ACTS.index(act), FMT=f, DFMT=df, ROW_BYTES=rb, GATED=gated, SEL=sel_mode,
        KEEP=keep_mode, HAS_BIAS=bias is not None, BLOCK_B=block_b, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps)
    return out.to(x.dtype)


def widen(records: torch.Tensor, fmt: str, rows: int, dim: int) -> torch.Tensor:
    """Records (n, bytes) -> (n, rows, dim), as `kernels.widen` on the device: a view for plain
    formats, else float32 dequantized by a kernel (the last row in Q8_0 beside 4-bit rows)."""
    if fmt in PLAIN_TYPES:
        return records.view(PLAIN_TYPES[fmt]).view(records.shape[0], rows, dim)
    _check(records)
    n = records.shape[0]
    out = torch.empty(n, rows, dim, dtype=torch.float32, device=records.device)
    f = BLOCK_FORMATS[fmt]
    df = f if rows == 1 else (Q8_0 if fmt in ("q4_0", "q4_1") else f)
    f = RECORD_CODES.get(f, f)  # (a plain matrix, rows == 1, is read as its last row: df)
    if n:
        _widen_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(dim, BLOCK_K))](
            records.contiguous(), out, n, dim, records.shape[1], NROWS=rows,
            ROW_BYTES=_row_bytes(f, dim), FMT=f, DFMT=df, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def predictor_logits(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """relu(x fc1^T) fc2^T: x (B, dim), fc1 (r, dim), fc2 (n, r) -> (B, n) float32 (each matrix
    plain, or its rows as Q8_0 blocks: see `predict`)."""
    return predict(x, fc1, fc2, store_logits=True)[3]


def _matrix(w: torch.Tensor, cols: int) -> tuple[int, int]:
    """(format, row stride) of a predictor matrix of `cols` columns: plain rows (elements), or
    uint8 rows of Q8_0 blocks (bytes: 34 a block of 32 columns)."""
    if w.dtype == torch.uint8:
        assert cols % 32 == 0 and w.shape[1] == cols // 32 * 34, (w.shape, cols)
        return Q8_0, w.shape[1]
    assert w.shape[1] == cols, (w.shape, cols)
    return PLAIN, cols


def predict(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, threshold: float = 0.0,
            top_k: int | None = None, store_logits: bool = False):
    """One layer's predictor on the device -> (keep, idx, count, logits): keep (B, n) bool, each
    row's selected neurons (logit >= threshold, or its top_k largest logits, ties kept); idx
    int32 (n,) whose first count[0] entries are the union's positions (the FFN kernel's index
    list); count int32 (1,); logits (B, n) float32 when asked for (or with top_k), else None.
    fc1 (r, dim) and fc2 (n, r) are plain matrices, or uint8 rows of Q8_0 blocks (what
    `Predictors` holds on a GPU: `kernels.quantize_rows`), each weight widened as it is read."""
    _check(x, fc1, fc2)
    B, dim = x.shape
    r, n = fc1.shape[0], fc2.shape[0]
    (fmt1, stride1), (fmt2, stride2) = _matrix(fc1, dim), _matrix(fc2, r)
    if B > MAX_ROWS:
        raise ValueError(f"the predictor kernels take up to {MAX_ROWS} rows, got {B}")
    dev = x.device
    block_b = 1 if B == 1 else max(16, _pow2(B))
    hidden = torch.empty(B, r, dtype=torch.float32, device=dev)
    _linear_kernel[(triton.cdiv(r, 32),)](x.contiguous(), fc1.contiguous(), hidden, B, dim, r,
                                          stride1, FMT=fmt1, RELU=True, BLOCK_B=block_b,
                                          BLOCK_N=32, BLOCK_K=BLOCK_K)
    keep = torch.zeros(B, n, dtype=torch.bool, device=dev)
    idx = torch.empty(n, dtype=torch.int32, device=dev)
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    store = store_logits or top_k is not None
    logits = torch.empty(B, n, dtype=torch.float32, device=dev) if store else None
    if top_k is not None:
        if not 0 < top_k <= n:
            raise ValueError(f"top_k must be in 1..{n}, got {top_k}")
        thr = torch.empty(B, dtype=torch.float32, device=dev)
    else:
        thr = torch.full((B,), float(threshold), dtype=torch.float32, device=dev)
    grid = (triton.cdiv(n, 64),)
    fc2 = fc2.contiguous()
    if top_k is not None:  # the logits first, then each row's k-th largest, then the selection
        _logits_kernel[grid](hidden, fc2, thr, logits, keep, idx, count, B, r, n, stride2,
                             FMT=fmt2, BLOCK_B=block_b, BLOCK_N=64, BLOCK_K=64, SELECT=False,
                             STORE=True)
        _kth_kernel[(B,)](logits, thr, n, top_k, BLOCK=1024)
        _select_stored(logits, thr, keep, idx, count)
        return keep, idx, count, logits
    _logits_kernel[grid](hidden, fc2, thr, logits if store else hidden, keep.view(torch.int8),
                         idx, count, B, r, n, stride2, FMT=fmt2, BLOCK_B=block_b, BLOCK_N=64,
                         BLOCK_K=64, SELECT=True, STORE=store)
    return keep, idx, count, logits


if triton is not None:

    @triton.jit
    def _select_kernel(logits_ptr, thr_ptr, keep_ptr, idx_ptr, count_ptr, B, n,
                       BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_B)
        rmask = rows < B
        both = rmask[:, None] & (offs < n)[None, :]
        at = rows[:, None] * n + offs[None, :]
        v = tl.load(logits_ptr + at, mask=both, other=0)
        _select(v, rows, rmask, offs, both, at, thr_ptr, keep_ptr, idx_ptr, count_ptr)


def _select_stored(logits, thr, keep, idx, count):
    B, n = logits.shape
    _select_kernel[(triton.cdiv(n, 64),)](logits, thr, keep.view(torch.int8), idx, count, B, n,
                                          BLOCK_B=_pow2(B), BLOCK_N=64)
