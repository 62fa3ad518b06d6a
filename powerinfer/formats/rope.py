"""A model's RoPE tables from its arguments, in numpy: cos and sin (rows, head_dim) float32 in
the half-rotation layout (HF's rotate_half), computed in float64. One computation for every
process that fills them: the torch model (`Transformer.rope_ensure`) and the hot executor
without torch (`actors.hot_native`), which fill the group's shared tables as steps reach their
rows."""
from __future__ import annotations

import math

import numpy as np

ROPE_CHUNK = 1024  # rows computed at a time: a row has the same bits however its table was filled


def rope_table(a, max_seq: int, local: bool = False, lo: int = 0,
               hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (max_seq, head_dim) float32, or their rows [lo, hi); local: the sliding
    layers' table (base `rope_base_local`, never scaled, as Gemma 3's). Computed in whole chunks
    of ROPE_CHUNK rows, so that a row has the same bits whether its table was made whole or
    filled as positions were reached. `a`: the model's `ModelArgs`."""
    hi = max_seq if hi is None else hi
    c0 = lo // ROPE_CHUNK * ROPE_CHUNK
    parts = [_rows(a, max_seq, local, c, min(max_seq, c + ROPE_CHUNK))
             for c in range(c0, hi, ROPE_CHUNK)]
    if not parts:
        return np.empty((0, a.head_dim), np.float32), np.empty((0, a.head_dim), np.float32)
    cos, sin = (np.concatenate([p[k] for p in parts]) for k in (0, 1))
    return cos[lo - c0:hi - c0], sin[lo - c0:hi - c0]


def fill_rows(a, max_seq: int, filled: int, top: int, write) -> int:
    """Tables filled up to row `filled` made to hold position `top` (a step's largest): the rows
    from `filled` on, in whole chunks of ROPE_CHUNK, each table's given to `write(table, lo, hi,
    cos, sin)` (table 0 the global one, 1 the sliding layers' where the model has its own base);
    returns the rows filled now."""
    if filled >= max_seq or top < filled:
        return filled
    lo, hi = filled, min(max_seq, (top // ROPE_CHUNK + 1) * ROPE_CHUNK)
    for table in range(2 if a.rope_base_local else 1):
        write(table, lo, hi, *rope_table(a, max_seq, table == 1, lo, hi))
    return hi


def _rows(a, max_seq: int, local: bool, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [lo, hi) of a `rope_table` of max_seq rows."""
    d = a.head_dim
    base = a.rope_base_local if local else a.rope_base
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    mscale, scaling = 1.0, None if local else a.rope_scaling
    if scaling is not None and scaling[0] == "llama3":
        inv_freq = llama3_scaled(inv_freq, *scaling[1:])
    elif scaling is not None and scaling[0] == "linear":
        inv_freq = inv_freq / scaling[1]
    elif scaling is not None and scaling[0] == "longrope":
        # Phi-3: per-frequency factors, the long ones past the original context, and the
        # attention factor on cos and sin (llama.cpp picks by the context it is given)
        short, long, original, mscale = scaling[1:]
        factors = long if max_seq > original else short
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    freqs = np.outer(np.arange(lo, hi, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return ((np.cos(emb) * mscale).astype(np.float32),
            (np.sin(emb) * mscale).astype(np.float32))


def llama3_scaled(inv_freq: np.ndarray, factor, low_freq_factor, high_freq_factor,
                  original_max_pos) -> np.ndarray:
    """Llama 3.1's frequency scaling: long wavelengths slowed by `factor`, short ones kept, a
    smooth blend in between."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original_max_pos / low_freq_factor, original_max_pos / high_freq_factor
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(mid, blended, out)
