"""A decode step's attention over the paged KV cache as one Triton kernel (the GPU's path).

torch's `model.paged_attention` takes about fifteen launches a layer for a decode step (the
q/k/v views, RoPE on q and k, the cache's two index writes, the gather of every sequence's
blocks into a copy, the casts, the mask, scaled_dot_product_attention): on a GPU, where the
hybrid runtime's hot executor launches its step from Python, the launches are the step's cost,
not the device's work (BENCHMARKS.md, "What the hot executor's step is made of").
`decode_attention` does a decode step (one token a sequence) in one launch: a program per
sequence and KV head
1. applies RoPE to its token's query heads (the KV head's group) and key, rounded to the
   activations' type as `model.apply_rope` rounds;
2. writes the key and value into the sequence's block for its position (keys transposed per
   block, values as rows: `KVCache`'s layout);
3. reads the sequence's blocks in order (those the window reaches), with scores q.k * scale of
   the group's heads, masked past the token's position and outside the window, in an online
   softmax, the products in float32 (decode reads each key and value once: the cost is the
   reads, not the arithmetic);
4. stores the heads' outputs in the activations' type.
A prompt's steps (several tokens a sequence) keep torch's path. On a machine without a GPU the
kernel runs under Triton's interpreter on CPU tensors (`kernels.TRITON_ON_CPU`, tests).
"""
from __future__ import annotations

import torch

from .triton_ffn import _check, _pow2, triton, tl


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, tables_ptr, pos_ptr,
                                 out_ptr, qkv_stride, out_stride, M, window, scale,
                                 k_sb, k_sh, v_sb, v_sh, H: tl.constexpr, HKV: tl.constexpr,
                                 D: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                                 GP: tl.constexpr, ROPE: tl.constexpr):
        s = tl.program_id(0)  # the sequence (its one token: row s)
        kh = tl.program_id(1)  # the KV head
        p = tl.load(pos_ptr + s)
        d = tl.arange(0, D)
        g = tl.arange(0, GP)
        gm = g < G
        row = qkv_ptr + s.to(tl.int64) * qkv_stride
        qcol = (kh * G + g)[:, None] * D
        q = tl.load(row + qcol + d[None, :], mask=gm[:, None], other=0.0)
        k = tl.load(row + H * D + kh * D + d)
        v = tl.load(row + (H + HKV) * D + kh * D + d)
        dtype = q.dtype
        if ROPE:  # x cos + rotate_half(x) sin in float32, rounded to the activations' type
            half = (d + D // 2) % D
            sign = tl.where(d < D // 2, -1.0, 1.0)
            c = tl.load(cos_ptr + s * D + d)
            sn = tl.load(sin_ptr + s * D + d)
            qr = tl.load(row + qcol + half[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * c[None, :] + (qr * sign[None, :]) * sn[None, :]).to(dtype)
            kr = tl.load(row + H * D + kh * D + half).to(tl.float32)
            k = (k.to(tl.float32) * c + (kr * sign) * sn).to(dtype)
        # the token's key and value into its block (keys (D, BS) a block and head, values (BS, D))
        blk = tl.load(tables_ptr + s.to(tl.int64) * M + p // BS).to(tl.int64)
        off = p % BS
        tl.store(k_ptr + blk * k_sb + kh * k_sh + d * BS + off, k.to(k_ptr.dtype.element_ty))
        tl.store(v_ptr + blk * v_sb + kh * v_sh + off * D + d, v.to(v_ptr.dtype.element_ty))
        tl.debug_barrier()  # the stores are seen by this program's loads of the same block
        t = tl.arange(0, BS)
        lo = p * 0
        if window > 0:
            lo = tl.maximum(p - window + 1, 0) // BS
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        qf = q.to(tl.float32)
        for j in range(lo, p // BS + 1):
            b = tl.load(tables_ptr + s.to(tl.int64) * M + j).to(tl.int64)
            keys = tl.load(k_ptr + b * k_sb + kh * k_sh + d[:, None] * BS + t[None, :])  # (D, BS)
            sc = tl.dot(qf, keys.to(tl.float32), input_precision="ieee") * scale  # (GP, BS)
            kp = j * BS + t
            ok = kp <= p
            if window > 0:
                ok &= kp > p - window
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            vals = tl.load(v_ptr + b * v_sb + kh * v_sh + t[:, None] * D + d[None, :])  # (BS, D)
            acc = acc * alpha[:, None] + tl.dot(pr, vals.to(tl.float32), input_precision="ieee")
            m_i = m_new
        y = acc / l_i[:, None]
        tl.store(out_ptr + s.to(tl.int64) * out_stride + qcol + d[None, :], y.to(dtype),
                 mask=gm[:, None])


def fits(head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes heads and blocks of these sizes (powers of two, 16 or more:
    `tl.dot`'s and `tl.arange`'s shapes)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_size))


def decode_attention(qkv: torch.Tensor, rope, pos: torch.Tensor, tables: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, n_heads: int, window: int,
                     scale: float) -> torch.Tensor:
    """`model.paged_attention` for a decode step, in one launch: qkv (S, (H + 2 Hkv) D), one
    token a sequence in the tables' order; rope (cos, sin) (S, D) float32 or None; pos (S,);
    tables (S, M) int32; the layer's pools k (blocks, Hkv, D, bs) and v (blocks, Hkv, bs, D),
    written at each token's position -> (S, H D) in qkv's type."""
    _check(qkv, k_pool)
    S = qkv.shape[0]
    _, hkv, D, bs = k_pool.shape
    assert tables.shape[0] == S and v_pool.shape[1:] == (hkv, bs, D), (qkv.shape, tables.shape)
    assert fits(D, bs), (D, bs)
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dtype == qkv.dtype
    out = torch.empty(S, n_heads * D, dtype=qkv.dtype, device=qkv.device)
    if S == 0:
        return out
    qkv = qkv.contiguous()
    group = n_heads // hkv
    cos, sin = (None, None) if rope is None else (r.contiguous().float() for r in rope)
    _decode_attention_kernel[(S, hkv)](
        qkv, cos if cos is not None else qkv, sin if sin is not None else qkv, k_pool, v_pool,
        tables.contiguous(), pos.contiguous(), out, qkv.stride(0), out.stride(0), tables.shape[1],
        int(window), float(scale), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0),
        v_pool.stride(1), H=n_heads, HKV=hkv, D=D, BS=bs, G=group, GP=max(16, _pow2(group)),
        ROPE=rope is not None, num_warps=4)
    return out
