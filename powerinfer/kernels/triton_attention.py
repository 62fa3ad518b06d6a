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
A long context splits over programs (flash-decoding): where one program a sequence and KV head
would leave the GPU's multiprocessors idle (one sequence, 8 KV heads: 8 programs), a third grid
axis gives each (sequence, KV head) `splits` programs, program c reading the blocks c, c +
splits, ... of the sequence's range, so every split has work whatever the sequence's length in
a wider table. Each writes its running maximum, sum and unnormalised output in float32 to
scratch, then counts itself done on a per-(sequence, KV head) counter (an atomic add, release
and acquire); the program that counts last merges the splits' partials (each scaled by exp(its
maximum - the overall maximum)), stores the output and zeroes the counter for the next call. So
the step keeps one launch: launched one by one from Python, a second kernel to merge would cost
more than the split saves. The number of splits is an argument, not a compile-time constant, so
batches and contexts of every size share two compiled variants (split or not). Only the split whose blocks hold the token's position writes its key
and value, and no other split reads that block.
A prompt's steps (several tokens a sequence) keep torch's path. On a machine without a GPU the
kernel runs under Triton's interpreter on CPU tensors (`kernels.TRITON_ON_CPU`, tests).
"""
from __future__ import annotations

import torch

from .triton_ffn import _check, _pow2, multiprocessors, tl, triton

if triton is not None:

    @triton.jit
    def _decode_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, tables_ptr, pos_ptr,
                                 out_ptr, part_ptr, count_ptr, qkv_stride, out_stride, M, window,
                                 scale, k_sb, k_sh, v_sb, v_sh, splits, H: tl.constexpr,
                                 HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                                 G: tl.constexpr, GP: tl.constexpr, ROPE: tl.constexpr,
                                 SPLIT: tl.constexpr):
        s = tl.program_id(0)  # the sequence (its one token: row s)
        kh = tl.program_id(1)  # the KV head
        c = tl.program_id(2)  # the split: blocks c, c + splits, ... of the sequence's range
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
            cs = tl.load(cos_ptr + s * D + d)
            sn = tl.load(sin_ptr + s * D + d)
            qr = tl.load(row + qcol + half[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cs[None, :] + (qr * sign[None, :]) * sn[None, :]).to(dtype)
            kr = tl.load(row + H * D + kh * D + half).to(tl.float32)
            k = (k.to(tl.float32) * cs + (kr * sign) * sn).to(dtype)
        last = p // BS
        lo = p * 0
        if window > 0:
            lo = tl.maximum(p - window + 1, 0) // BS
        # the token's key and value into its block (keys (D, BS) a block and head, values (BS,
        # D)), by the split that reads that block
        if (last - lo) % splits == c:
            blk = tl.load(tables_ptr + s.to(tl.int64) * M + last).to(tl.int64)
            off = p % BS
            tl.store(k_ptr + blk * k_sb + kh * k_sh + d * BS + off, k.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + blk * v_sb + kh * v_sh + off * D + d, v.to(v_ptr.dtype.element_ty))
        tl.debug_barrier()  # the stores are seen by this program's loads of the same block
        t = tl.arange(0, BS)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        qf = q.to(tl.float32)
        for j in range(lo + c, last + 1, splits):
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
        out = out_ptr + s.to(tl.int64) * out_stride + qcol + d[None, :]
        if not SPLIT:
            tl.store(out, (acc / l_i[:, None]).to(dtype), mask=gm[:, None])
        else:
            # this split's partials: (sequence, KV head, split) rows of GP x (D + 2) float32
            head = s * HKV + kh
            part = part_ptr + (head * splits + c).to(tl.int64) * (GP * (D + 2))
            tl.store(part + g[:, None] * D + d[None, :], acc)
            tl.store(part + GP * D + g, m_i)
            tl.store(part + GP * D + GP + g, l_i)
            tl.debug_barrier()  # every thread's partials before the count's release
            done = tl.atomic_add(count_ptr + head, 1, sem="acq_rel", scope="gpu")
            if done == splits - 1:  # the last split of this sequence and head merges them all
                first = part_ptr + (head * splits).to(tl.int64) * (GP * (D + 2))
                # split 0 always has a block (the range's first), so its maximum is finite
                m_all = tl.load(first + GP * D + g, cache_modifier=".cg")
                l_all = tl.load(first + GP * D + GP + g, cache_modifier=".cg")
                a_all = tl.load(first + g[:, None] * D + d[None, :], cache_modifier=".cg")
                for o in range(1, splits):
                    other = first + o * (GP * (D + 2))
                    m_o = tl.load(other + GP * D + g, cache_modifier=".cg")
                    m_new = tl.maximum(m_all, m_o)
                    a = tl.exp(m_all - m_new)
                    b_ = tl.exp(m_o - m_new)  # 0 for a split with no blocks (m_o = -inf)
                    l_all = l_all * a + tl.load(other + GP * D + GP + g, cache_modifier=".cg") * b_
                    a_all = (a_all * a[:, None] + b_[:, None]
                             * tl.load(other + g[:, None] * D + d[None, :], cache_modifier=".cg"))
                    m_all = m_new
                tl.store(out, (a_all / l_all[:, None]).to(dtype), mask=gm[:, None])
                tl.atomic_xchg(count_ptr + head, 0)  # ready for the next call


def fits(head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes heads and blocks of these sizes (powers of two, 16 or more:
    `tl.dot`'s and `tl.arange`'s shapes)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_size))


# the split (flash-decoding): programs a multiprocessor the grid aims for, and the fewest blocks
# a split reads at the table's width (below it the merge's traffic costs more than it spreads)
SPLIT_PER_SM = 2


SPLIT_MIN_BLOCKS = 4


def splits_for(S: int, hkv: int, width: int, device: torch.device) -> int:
    """Programs per (sequence, KV head) for a decode step: enough for SPLIT_PER_SM programs on
    each multiprocessor (16 programs in all under the interpreter), each reading at least
    SPLIT_MIN_BLOCKS of the table's `width` blocks; 1 (no split) for short tables."""
    sms = 8 if device.type != "cuda" else multiprocessors(device)
    want = SPLIT_PER_SM * sms // max(S * hkv, 1)
    return max(1, min(want, width // SPLIT_MIN_BLOCKS))


_counters: dict = {}


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one a (sequence, KV head), kept per device and stream: the
    kernel's last split of each zeroes its own again, so one allocation serves every call that
    runs in that stream's order (a CUDA graph's replays among them)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    got = _counters.get(key)
    if got is None or got.numel() < n:
        got = _counters[key] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return got


def decode_attention(qkv: torch.Tensor, rope, pos: torch.Tensor, tables: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, n_heads: int, window: int,
                     scale: float, splits: int | None = None) -> torch.Tensor:
    """`model.paged_attention` for a decode step, in one launch: qkv (S, (H + 2 Hkv) D), one
    token a sequence in the tables' order; rope (cos, sin) (S, D) float32 or None; pos (S,);
    tables (S, M) int32; the layer's pools k (blocks, Hkv, D, bs) and v (blocks, Hkv, bs, D),
    written at each token's position -> (S, H D) in qkv's type. `splits`: programs per
    (sequence, KV head), `splits_for`'s when None."""
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
    GP = max(16, _pow2(group))
    if splits is None:
        splits = splits_for(S, hkv, tables.shape[1], qkv.device)
    part = count = out
    if splits > 1:
        part = torch.empty(S * hkv * splits * GP * (D + 2), dtype=torch.float32, device=qkv.device)
        count = _counter(qkv.device, S * hkv)
    cos, sin = (None, None) if rope is None else (r.contiguous().float() for r in rope)
    _decode_attention_kernel[(S, hkv, splits)](
        qkv, cos if cos is not None else qkv, sin if sin is not None else qkv, k_pool, v_pool,
        tables.contiguous(), pos.contiguous(), out, part, count, qkv.stride(0), out.stride(0),
        tables.shape[1], int(window), float(scale), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), splits, H=n_heads, HKV=hkv, D=D, BS=bs, G=group,
        GP=GP, ROPE=rope is not None, SPLIT=splits > 1, num_warps=4)
    return out
