"""GGUF blocks written and read. First the quantizers for the block types the `gguf` package
reads but cannot write: Q4_K and Q6_K, the two types of llama.cpp's Q4_K_M files, and Q5_K
(its Q5_K_M files'). Vectorized
over rows of float32 weights (Q4_K in numpy, Q6_K in torch); the bytes are GGUF's (ggml's
`block_q4_K` and `block_q6_K`), checked against `gguf.quants.dequantize` in the tests.

The scales are chosen the simple way (each sub-block's range, then the super-block's scale of
the scales), not by llama.cpp's iterative search: the error is within the format's bound (half a
step of each sub-block's grid, plus the 6-bit scale's rounding), a little above llama.cpp's.
They exist for speed benchmarks on the formats users have (`powerinfer synthetic --quant`).

`quantize(x, name)` also takes "Q4_0", "Q4_1", "Q8_0" (torch ops, byte for byte what `gguf`
writes) and the float types (through `gguf`). `dequantize(raw, name)` widens Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K and Q6_K rows with torch ops, value for value what `gguf.quants.dequantize` gives: `gguf`'s
numpy runs on one core over groups of 16 rows, and a 70B-shaped layer's matrices hold 900M
weights (`benchmarks/codecs.py` times both ways); the rest go through `gguf`.
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

log = logging.getLogger("powerinfer")


# GGUF type -> the layout that keeps its bytes 16 rows at a time
KQUANT_LAYOUTS = {"Q4_K": "q4kx16", "Q5_K": "q5kx16", "Q6_K": "q6kx16", "Q8_0": "q8x16",
                  "Q5_0": "q5x16", "Q5_1": "q5x16"}


QK_K = 256


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


CHUNK = 1 << 20  # values a step, so a step's temporaries stay a few MB


def _by_chunks(fn, src: torch.Tensor, out: torch.Tensor, per: int) -> torch.Tensor:
    """out[i] = fn(src[i]) over src's rows (blocks of `per` values each), CHUNK values a call."""
    step = max(1, CHUNK // per)
    for lo in range(0, src.shape[0], step):
        out[lo:lo + step] = fn(src[lo:lo + step])
    return out


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, n) float32, n a multiple of 256 -> (rows, n / 256 * 144) uint8 Q4_K blocks: per 256
    values, fp16 d and dmin, 8 sub-blocks of 32 with 6-bit scale and min, 4-bit quants;
    value = d * scale * q - dmin * min."""
    rows = x.shape[0]
    head, q = _k_grid(x, "Q4_K", 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c+1
    return np.concatenate([head, qs], axis=1).reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """(rows, n) float32, n a multiple of 256 -> (rows, n / 256 * 176) uint8 Q5_K blocks: Q4_K's
    with 5-bit quants, their fifth bits apart (qh: byte l's bit j that of sub-block j's value l)."""
    rows = x.shape[0]
    head, q = _k_grid(x, "Q5_K", 31)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([head, qh.astype(np.uint8), qs], axis=1).reshape(rows, -1)


def _k_grid(x: np.ndarray, name: str, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's grid over (rows, n) float32: per super-block of 256 its first 16 bytes
    (fp16 d and dmin, the 12 bytes of 6-bit sub-block scales and minimums) (blocks, 16), and
    its codes in 0..top (blocks, 8, 32) uint8."""
    n = x.shape[1]
    if n % QK_K:
        raise ValueError(f"{name} needs rows of a multiple of {QK_K} values, got {n}")
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0.0)  # a sub-block's offset is subtracted: min >= 0
    step = (b.max(-1) - lo) / top  # (nb, 8)
    d = _f16(step.max(-1) / 63)
    dmin = _f16(-lo.min(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63)
    scale, offset = df * sc, dminf * m  # the grid as stored
    q = np.divide(b + offset[..., None], scale[..., None], out=np.zeros_like(b),
                  where=scale[..., None] > 0)
    q = np.clip(np.rint(q), 0, top).astype(np.uint8)  # (nb, 8, 32)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.zeros((b.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           packed], axis=1), q


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, n) float32, n a multiple of 256 -> (rows, n / 256 * 210) uint8 Q6_K blocks: per 256
    values, 16 sub-blocks of 16 with an int8 scale, 6-bit quants in [-32, 31], an fp16 d;
    value = d * scale * q. (torch ops, a chunk of rows at a time: a model's head is 260M values.)"""
    rows, n = x.shape
    if n % QK_K:
        raise ValueError(f"Q6_K needs rows of a multiple of {QK_K} values, got {n}")
    src = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(-1, 16, 16)
    out = torch.empty(src.shape[0], 210, dtype=torch.uint8)
    return _by_chunks(_q6_k_blocks, src, out, QK_K).numpy().reshape(rows, -1)


def _q6_k_blocks(b: torch.Tensor) -> torch.Tensor:
    """(blocks, 16, 16) float32: 256 values a block as 16 sub-blocks -> (blocks, 210) uint8
    (`quantize_q6_k`)."""
    step = b.abs().amax(-1) / 31  # (nb, 16): the largest value lands on +-31
    d = (step.amax(-1) / 127).half()
    df = d.float()[:, None]
    sc = torch.where(df > 0, step / df, 0.0).round_().clamp_(0, 127)
    scale = (df * sc)[..., None]
    q = torch.where(scale > 0, b / scale, 0.0).round_().clamp_(-32, 31).add_(32)
    q = q.to(torch.uint8).reshape(-1, 2, 4, 32)  # 0..63
    # per half of 128 values, l in 0..31: q1..q4 are values l, l+32, l+64, l+96
    q1, q2, q3, q4 = q[:, :, 0], q[:, :, 1], q[:, :, 2], q[:, :, 3]
    ql = torch.cat([(q1 & 0xF) | ((q3 & 0xF) << 4), (q2 & 0xF) | ((q4 & 0xF) << 4)],
                   2).reshape(-1, 128)
    qh = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)).reshape(-1, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8),
                      d.view(torch.uint8).reshape(-1, 2)], 1)


def _blocks32(x: torch.Tensor, name: str) -> torch.Tensor:
    """(rows, 32) float32 blocks -> (rows, bytes) uint8 of `name` (Q4_0, Q4_1, Q8_0), the
    arithmetic of `gguf.quants`' numpy (itself ggml's reference) op for op in float32."""
    def half(v):  # (rows, 1) float32 -> its fp16 bytes (rows, 2), rounded to nearest even
        return v.half().view(torch.uint8)

    def nibbles(q):  # codes 0..15, (rows, 32) -> (rows, 16): weight i low, weight i + 16 high
        q = q.to(torch.uint8)
        return q[:, :16] | (q[:, 16:] << 4)

    if name == "Q8_0":
        d = x.abs().amax(1, keepdim=True) / 127
        v = x * torch.where(d == 0, 0.0, 1 / d)
        a = v.abs()
        fl = a.floor()
        q = torch.sign(v) * (fl + (2 * (a - fl)).floor())  # roundf: half away from zero
        return torch.cat([half(d), q.to(torch.int8).view(torch.uint8)], 1)
    if name == "Q4_0":
        m = x.gather(1, x.abs().argmax(1, keepdim=True))  # the largest magnitude, signed
        d = m / -8
        q = (x * torch.where(d == 0, 0.0, 1 / d) + 8.5).trunc().clamp_(0, 15)
        return torch.cat([half(d), nibbles(q)], 1)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)  # Q4_1
    d = (hi - lo) / 15
    q = ((x - lo) * torch.where(d == 0, 0.0, 1 / d) + 0.5).trunc().clamp_(0, 15)
    return torch.cat([half(d), half(lo), nibbles(q)], 1)


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    """x (rows, n) float32 in GGUF type `name` ("Q4_K", "Q5_K", "Q6_K", Q4_0, Q4_1, Q8_0, or one `gguf`
    writes)."""
    if name == "Q4_K":
        return quantize_q4_k(x)
    if name == "Q5_K":
        return quantize_q5_k(x)
    if name == "Q6_K":
        return quantize_q6_k(x)
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        return blocks32(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), name).numpy()
    import gguf

    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])


def row_bytes(name: str, n: int) -> int:
    """Bytes of a row of n values in GGUF block type `name` (a key of BLOCK_BYTES)."""
    bb = BLOCK_BYTES[name]
    return n // (32 if bb < 100 else QK_K) * bb


def blocks32(w: torch.Tensor, name: str) -> torch.Tensor:
    """(rows, n) floats, n a multiple of 32 -> (rows, row_bytes(name, n)) uint8 blocks of `name`
    (Q4_0, Q4_1, Q8_0), with torch ops on w's own device: the bytes the gguf package writes."""
    rows, n = w.shape
    if n % 32:
        raise ValueError(f"{name} needs rows of a multiple of 32 values, got {n}")
    src = w.detach().float().reshape(-1, 32)
    out = torch.empty(src.shape[0], BLOCK_BYTES[name], dtype=torch.uint8, device=w.device)
    return _by_chunks(lambda c: _blocks32(c, name), src, out, 32).view(rows, -1)


def widen_rows(raw: torch.Tensor, name: str, n: int) -> torch.Tensor:
    """(rows, row bytes) uint8 of GGUF type `name` (a key of BLOCK_BYTES) -> (rows, n) float32,
    with torch ops on the tensor's own device and no host synchronisation (a CUDA graph can
    hold it): the values `dequantize` gives."""
    bb = BLOCK_BYTES[name]
    return _widen(raw.reshape(-1, bb), name).view(-1, n)


def _widen(b: torch.Tensor, name: str) -> torch.Tensor:
    """(blocks, bytes) uint8 of `name` -> (blocks, values) float32, in `gguf.quants`' order of
    float32 operations (so the same values)."""
    def f16(lo, hi):  # the fp16 at bytes lo:hi of each block, (blocks, 1) float32
        return b[:, lo:hi].contiguous().view(torch.float16).float()

    def low_high(q):  # (blocks, 16) packed nibbles -> (blocks, 32): weight i low, i + 16 high
        return torch.cat([q & 15, q >> 4], 1)

    if name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * f16(0, 2)
    if name == "Q4_0":
        return f16(0, 2) * (low_high(b[:, 2:]).to(torch.int8) - 8).float()
    if name == "Q4_1":
        return f16(0, 2) * low_high(b[:, 4:]).float() + f16(2, 4)
    n = b.shape[0]
    if name in ("Q4_K", "Q5_K"):
        sc, mn, q = (q4_k_codes if name == "Q4_K" else q5_k_codes)(b)
        d = (f16(0, 2) * sc.float()).view(n, 8, 1)
        dm = (f16(2, 4) * mn.float()).view(n, 8, 1)
        return (d * q.float() - dm).view(n, QK_K)
    # Q6_K
    d = (f16(208, 210) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)
    q = (q6_k_codes(b).to(torch.int8) - 32).float().view(n, 16, 16)
    return (d * q).view(n, QK_K)


def q4_k_codes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks (..., 144) uint8 -> their 6-bit sub-block scales and minimums (..., 8) and
    4-bit codes (..., 8, 32) in weight order (w = d * sc[j] * q - dmin * mn[j] in sub-block j;
    ggml's block_q4_K: d, dmin (fp16), 12 bytes of scales and minimums, 128 of codes)."""
    sc, mn = _k_scales(b[..., 4:16])
    return sc, mn, _k_nibbles(b[..., 16:])


def q5_k_codes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K blocks (..., 176) uint8 -> their 6-bit sub-block scales and minimums (..., 8) and
    5-bit codes (..., 8, 32) in weight order (as Q4_K; ggml's block_q5_K: d, dmin, 12 bytes of
    scales and minimums, qh[32] (bit j of byte l: the fifth bit of sub-block j's weight l),
    qs[128] as Q4_K's)."""
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]
    high = torch.stack([(qh >> j) & 1 for j in range(8)], -2)  # (..., 8, 32)
    return sc, mn, _k_nibbles(b[..., 48:]) | (high << 4)


def _k_scales(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of a Q4_K or Q5_K block's packed 6-bit scales and minimums -> (..., 8) each."""
    sc = torch.cat([p[..., 0:4] & 63, (p[..., 8:12] & 15) | ((p[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of 4-bit codes (..., 128) -> (..., 8, 32): chunk c holds sub-blocks 2c (low
    nibbles) and 2c + 1 (high)."""
    qs = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([qs & 15, qs >> 4], -2).reshape(*qs.shape[:-2], 8, 32)


def q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks (..., 210) uint8 -> their 6-bit codes (..., 256) in 0..63 in weight order
    (w = d * sc[i // 16] * (q - 32); ggml's block_q6_K: ql[128], qh[64], scales[16], d)."""
    ql, qh = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32), b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    # per half of 128 weights, l in 0..31: weights l, l+32, l+64, l+96 from ql[l], ql[32+l]
    # (low, then high nibbles) and qh[l]'s bit pairs 0, 2, 4, 6
    low = torch.cat([ql & 15, ql >> 4], -2)  # (..., 2, 4, 32): quarter t of each half
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], -2)
    return (low | (high << 4)).reshape(*b.shape[:-1], 256)


def dequantize(raw: np.ndarray, name: str, n: int) -> torch.Tensor:
    """Rows of a GGUF tensor's bytes (any shape whose last axis holds whole rows of n values) in
    type `name` -> (rows, n) float32."""
    if name not in BLOCK_BYTES:
        import gguf

        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
        return torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(-1, n)
    bb = BLOCK_BYTES[name]
    per = 32 if bb < 100 else QK_K
    with warnings.catch_warnings():  # a file's read-only map: nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        b = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).reshape(-1, bb)
    return _by_chunks(lambda c: _widen(c, name), b, torch.empty(b.shape[0], per), per).view(-1, n)
