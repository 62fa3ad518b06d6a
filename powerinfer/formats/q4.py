"""GGUF Q4_0/Q4_1 blocks as codes, scales and zeros (what int4 weights keep packed)."""
from __future__ import annotations

import numpy as np

GROUP = 32


Q4_TYPES = ("Q4_0", "Q4_1")


def has_q4(info: dict) -> bool:
    """Whether a checkpoint's `info` lists 4-bit tensors int4 weights can keep packed."""
    return any(t in info.get("tensor_types", {}) for t in Q4_TYPES)


def q4_type(info: dict) -> str | None:
    """The 4-bit type most of a checkpoint's tensors have ("Q4_0" or "Q4_1"), or None."""
    types = info.get("tensor_types", {})
    have = [t for t in Q4_TYPES if t in types]
    return max(have, key=types.get) if have else None


def q4_blocks(t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF Q4_0/Q4_1 tensor (the gguf reader's) as `q4_split` gives it."""
    return q4_split(t.tensor_type.name, int(t.shape[1]), int(t.shape[0]), t.data)


def q4_split(kind: str, n: int, k: int, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bytes of an (n, k) Q4_0/Q4_1 tensor as (q uint8 (n, k), scale f32 (n, k/32), zero
    f32 (n, k/32))."""
    assert kind in Q4_TYPES, kind
    g = k // GROUP
    raw = np.asarray(data, dtype=np.uint8).reshape(n, g, -1)  # one block per row: header, 16 bytes
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., 4:20]
        zero = m + 8 * d
    else:
        qs = raw[..., 2:18]
        zero = np.zeros_like(d)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # low nibbles are weights 0..15, high 16..31
    return q.reshape(n, k), d, zero
