"""Quantizers for the GGUF block types the `gguf` package reads but cannot write: Q4_K and Q6_K,
the two types of llama.cpp's Q4_K_M files. Vectorized numpy over rows of float32 weights; the
bytes are GGUF's (ggml's `block_q4_K` and `block_q6_K`), checked against `gguf.quants.dequantize`
in the tests.

The scales are chosen the simple way (each sub-block's range, then the super-block's scale of
the scales), not by llama.cpp's iterative search: the error is within the format's bound (half a
step of each sub-block's grid, plus the 6-bit scale's rounding), a little above llama.cpp's.
They exist for speed benchmarks on the formats users have (`powerinfer synthetic --quant`).

`quantize(x, name)` also takes "Q4_0", "Q4_1", "Q8_0" and the float types, through `gguf`.
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, n) float32, n a multiple of 256 -> (rows, n / 256 * 144) uint8 Q4_K blocks: per 256
    values, fp16 d and dmin, 8 sub-blocks of 32 with 6-bit scale and min, 4-bit quants;
    value = d * scale * q - dmin * min."""
    rows, n = x.shape
    if n % QK_K:
        raise ValueError(f"Q4_K needs rows of a multiple of {QK_K} values, got {n}")
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0.0)  # a sub-block's offset is subtracted: min >= 0
    step = (b.max(-1) - lo) / 15  # (nb, 8)
    d = _f16(step.max(-1) / 63)
    dmin = _f16(-lo.min(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63)
    scale, offset = df * sc, dminf * m  # the grid as stored
    q = np.divide(b + offset[..., None], scale[..., None], out=np.zeros_like(b),
                  where=scale[..., None] > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)  # (nb, 8, 32)
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.zeros((b.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c+1
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                          packed, qs], axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, n) float32, n a multiple of 256 -> (rows, n / 256 * 210) uint8 Q6_K blocks: per 256
    values, 16 sub-blocks of 16 with an int8 scale, 6-bit quants in [-32, 31], an fp16 d;
    value = d * scale * q."""
    rows, n = x.shape
    if n % QK_K:
        raise ValueError(f"Q6_K needs rows of a multiple of {QK_K} values, got {n}")
    b = x.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(b).max(-1) / 31  # (nb, 16): the largest value lands on +-31
    d = _f16(step.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 127)
    scale = df * sc
    q = np.divide(b, scale[..., None], out=np.zeros_like(b), where=scale[..., None] > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # 0..63
    # per half of 128 values, l in 0..31: q1..q4 are values l, l+32, l+64, l+96
    q1, q2, q3, q4 = q[:, :, 0], q[:, :, 1], q[:, :, 2], q[:, :, 3]
    ql = np.concatenate([(q1 & 0xF) | ((q3 & 0xF) << 4), (q2 & 0xF) | ((q4 & 0xF) << 4)],
                        axis=2).reshape(-1, 128)
    qh = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8),
                          d.view(np.uint8).reshape(-1, 2)], axis=1)
    return out.reshape(rows, -1)


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    """x (rows, n) float32 in GGUF type `name` ("Q4_K", "Q6_K", or one `gguf` writes)."""
    if name == "Q4_K":
        return quantize_q4_k(x)
    if name == "Q6_K":
        return quantize_q6_k(x)
    import gguf

    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])
