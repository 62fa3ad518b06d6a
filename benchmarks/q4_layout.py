#!/usr/bin/env python3
"""Where a 4-bit row's time goes: the kernel's GEMV over Q4_0 rows as GGUF stores them (each
32-weight block an f16 scale then 16 bytes of nibbles, 18 bytes) against the same rows held
split (a row's nibbles together, 64 bytes serving four blocks in one load, and its scales
together, eight converted in one instruction), in one run, beside the Q8_0 GEMV of the same
matrices. Both 4-bit ways compute the same sums (the input rounded to 8 bits per block, integer
products, scaled per block); the split one is a prototype compiled here, not the product's path.

    .venv/bin/python benchmarks/q4_layout.py [--rows 12288] [--dim 4096] [--matrices 4] [--threads N]

Needs AVX512_VNNI (Zen 4, Ice Lake and later); says so and stops elsewhere.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time

import torch
from torch.utils.cpp_extension import load_inline

from powerinfer import kernels
from powerinfer.model.quant import KernelLinear

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#define AHEAD 8  // rows prefetched ahead: 2 (the kernel's) read 18.0 GB/s here, 4 19.2, 8 20.3

// y[i] = sum over blocks b of d[i,b] * xd[b] * (q[i,b] . xq[b]) + m[i,b] * xs[b], m = -8 d (Q4_0)
// nib: (n, dim/2) each block's 16 bytes of nibbles (low: weights 0-15, high: 16-31), blocks
// in order; d16: (n, dim/32) f16 scales; x4: the input's 8-bit values regrouped per 4 blocks:
// [block k's weights 0-15 for k in 0..3][their weights 16-31]; xd, xs: per block.
torch::Tensor gemv_split(torch::Tensor nib, torch::Tensor d16, torch::Tensor x4, torch::Tensor xd,
                         torch::Tensor xs) {
  const int64_t n = nib.size(0), nb = d16.size(1), dim = nb * 32;
  TORCH_CHECK(nb % 8 == 0, "a multiple of 8 blocks");
  auto y = torch::empty({n}, torch::kFloat);
  const uint8_t* W = nib.data_ptr<uint8_t>();
  const uint16_t* D = (const uint16_t*)d16.data_ptr<at::Half>();
  const int8_t* X = x4.data_ptr<int8_t>();
  const float *XD = xd.data_ptr<float>(), *XS = xs.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512i pick[2];
    for (int h = 0; h < 2; h++) {  // lanes 4k..4k+3 take block 4h + k's scale
      alignas(64) int idx[16];
      for (int l = 0; l < 16; l++) idx[l] = 4 * h + l / 4;
      pick[h] = _mm512_load_si512(idx);
    }
    for (int64_t i = begin; i < end; i++) {
      const uint8_t* w = W + i * (dim / 2);
      const uint16_t* d = D + i * nb;
      // the row after next, a line at a time over this row's loop (as the kernel's stages do)
      const uint8_t* pf = i + AHEAD < end ? W + (i + AHEAD) * (dim / 2) : nullptr;
      __m512 acc = _mm512_setzero_ps();
      __m256 accm = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; b += 8) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + b)));
        const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(dv, _mm256_loadu_ps(XD + b)));
        accm = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(-8.0f)), _mm256_loadu_ps(XS + b), accm);
        for (int h = 0; h < 2; h++) {  // four blocks: 64 bytes of nibbles
          if (pf) _mm_prefetch((const char*)(pf + (b + 4 * h) * 16), _MM_HINT_T1);
          const __m512i v = _mm512_loadu_si512(w + (b + 4 * h) * 16);
          const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
          const int8_t* x = X + (b + 4 * h) * 32;
          __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
          p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512(x + 64));
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(pick[h], s), acc);
        }
      }
      __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(accm), _mm256_extractf128_ps(accm, 1));
      m4 = _mm_hadd_ps(m4, m4);
      m4 = _mm_hadd_ps(m4, m4);
      Y[i] = _mm512_reduce_add_ps(acc) + _mm_cvtss_f32(m4);
    }
  });
  return y;
}
"""


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--matrices", type=int, default=4, help="distinct matrices, rotated (past the caches)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = open("/proc/cpuinfo").read()
    if not kernels.available() or "avx512_vnni" not in flags:
        raise SystemExit("needs the kernel library and AVX512_VNNI")
    ext = load_inline("q4_layout", cpp_sources=[SOURCE], functions=["gemv_split"],
                      extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                                    "-mf16c", "-mfma"], build_directory=tempfile.mkdtemp(),
                      verbose=False)
    n, k, nb = args.rows, args.dim, args.dim // 32
    torch.manual_seed(0)
    q4 = [KernelLinear(torch.randn(n, k), None, "q4_0") for _ in range(args.matrices)]
    q8 = [KernelLinear(torch.randn(n, k), None, "q8_0") for _ in range(args.matrices)]
    split = []
    for m in q4:  # the same blocks, held split: (n, nb, 18) -> scales (n, nb), nibbles (n, nb * 16)
        blocks = m.records.view(n, nb, 18)
        split.append((blocks[:, :, 2:].contiguous().view(n, nb * 16),
                      blocks[:, :, :2].contiguous().view(torch.float16).view(n, nb)))
    x = torch.randn(1, k)
    # the input as the kernel's dot products read it: 8 bits per block (ggml's rounding)
    xf = x.view(nb, 32)
    xd = xf.abs().amax(1) / 127
    xq = torch.where(xd[:, None] > 0, torch.round(xf / xd[:, None]), 0).clamp(-127, 127)
    xs = xd * xq.sum(1)
    x4 = xq.view(nb // 4, 4, 2, 16).transpose(1, 2).reshape(-1).to(torch.int8)
    xd, xs = xd.contiguous(), xs.contiguous()
    want = q4[0](x).view(-1)
    got = ext.gemv_split(*split[0], x4, xd, xs)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-4, f"the split layout's sums differ from the kernel's: {err}"
    rows = []
    for label, fn, nbytes in (
            ("Q8_0 rows (the kernel's GEMV)", lambda i: q8[i](x), q8[0].records.numel()),
            ("Q4_0 rows as GGUF stores them (the kernel's GEMV)", lambda i: q4[i](x), q4[0].records.numel()),
            ("Q4_0, nibbles and scales split (prototype)", lambda i: ext.gemv_split(*split[i], x4, xd, xs),
             split[0][0].numel() + split[0][1].numel() * 2)):
        t = timed(lambda: [fn(i) for i in range(args.matrices)], args.reps) / args.matrices
        rows.append((label, t, nbytes))
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {args.matrices} x {n} x {k}, one input row; "
          f"split vs kernel max relative difference {err:.1e}")
    print("| rows | ms per matrix | GB/s | x Q4_0 as stored |")
    print("|---|---:|---:|---:|")
    base = rows[1][1]
    for label, t, nbytes in rows:
        print(f"| {label} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} | {base / t:.2f} |")


if __name__ == "__main__":
    main()
