#!/usr/bin/env python3
"""Whether a core here computes while its prefetched reads arrive: the bound the neuron kernel
works against, measured apart from the kernel.

    .venv/bin/python benchmarks/overlap.py [--share 0.15] [--layers 8] [--rounds 3]

One thread walks the records of a `--share` selection of a 7B-shape FFN layer (11,008 records of
9,472 bytes: a Q4_1 gate and up row and a Q8_0 down row, as the kernel holds a 4-bit file's
neurons), `--layers` layers rotated so the records come from memory, on 2 MiB pages. The whole
next record is prefetched into L2 while the current one is read, one line for each line. Three
loops over the same records:

- `reads`: each 64-byte line loaded (XORed), nothing computed;
- `compute`: the same loop with independent FMAs a line and no loads, over one record (no
  memory);
- `both`: the loads and the FMAs.
- `compute on the data` and `both on the data`: the same, but the FMAs take the line's bytes
  (widened to float) as their input, as a dot product's do, so each waits for its line.
- the kernel's order (`csrc/neuron_ffn.h`, `range_fmt`, every neuron firing), with the four down
  rows of a group read in one pass (the kernel before it spread them) or a quarter of each in
  each of four passes (the kernel now).

If the core overlaps the two, `both` takes about the longer of the other two; if it does not,
their sum. The FMAs a line (8, 16, 32 or 64) are the count whose `compute` comes closest to
`reads`, chosen in the first round.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import time

import torch

from powerinfer import kernels

SRC = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
// the accumulators and the XOR of what was loaded, summed and returned so that nothing is
// optimized away
inline double kept(const __m256* acc, __m256i x) {
  __m256 s = acc[0];
  for (int i = 1; i < 8; i++) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float f[8];
  alignas(32) int32_t v[8];
  _mm256_store_ps(f, s);
  _mm256_store_si256((__m256i*)v, x);
  double t = 0;
  for (int i = 0; i < 8; i++) t += f[i] + v[i];
  return t;
}
// records sel[j] of w (k, rb), the next one prefetched into L2 a line at a time; per line a
// load (LOAD) and W FMAs on 8 independent accumulators. fixed >= 0: that record only, nothing
// prefetched (the compute alone, in cache).
template <bool LOAD, int W, bool DEP = false>
double walk(const uint8_t* w, int64_t rb, const int64_t* sel, int64_t m, int64_t fixed) {
  __m256 acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm256_set1_ps(1.0f);
  const __m256 k = _mm256_set1_ps(0.5f), c = _mm256_set1_ps(1.0f);  // (each tends to 2)
  __m256i x = _mm256_setzero_si256();
  for (int64_t j = 0; j < m; j++) {
    const uint8_t* r = w + (fixed >= 0 ? fixed : sel[j]) * rb;
    const uint8_t* pf = fixed < 0 && j + 1 < m ? w + sel[j + 1] * rb : nullptr;
    for (int64_t o = 0; o < rb; o += 64) {
      if (pf) _mm_prefetch((const char*)(pf + o), _MM_HINT_T1);
      if (LOAD)
        x = _mm256_xor_si256(x, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(r + o)),
                                                 _mm256_loadu_si256((const __m256i*)(r + o + 32))));
      if (DEP) {  // the FMAs take the line's bytes as their input, as a dot product's do
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(r + o))));
        for (int q = 0; q < W; q++) acc[q % 8] = _mm256_fmadd_ps(v, k, acc[q % 8]);
      } else {
        for (int q = 0; q < W; q++) acc[q % 8] = _mm256_fmadd_ps(acc[q % 8], k, c);
      }
    }
  }
  return kept(acc, x);
}
// The kernel's order (csrc/neuron_ffn.h, range_fmt, every neuron firing): pass j reads the gate
// row of record j+1, the up row of record j-1 and, every fourth pass, the down rows of the four
// records before, side by side a line at a time; it brings into L2 the gate row of j+2 and the
// up and down rows of j, one prefetch for each line read. W FMAs on each line's bytes (DEP).
template <bool LOAD, int W, bool SPREAD>
double walk_kernel(const uint8_t* w, int64_t rb, int64_t gb, const int64_t* sel, int64_t m, int64_t fixed) {
  __m256 acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm256_set1_ps(1.0f);
  const __m256 k = _mm256_set1_ps(0.5f);
  __m256i x = _mm256_setzero_si256();
  const int64_t db = rb - 2 * gb;
  auto rec = [&](int64_t j) -> const uint8_t* {
    return j < 0 || j >= m ? nullptr : w + (fixed >= 0 ? fixed : sel[j]) * rb;
  };
  for (int64_t j = 0; j <= m; j++) {
    const uint8_t* rows[6];
    int64_t len[6];
    int nr = 0;
    if (auto r = rec(j + 1)) rows[nr] = r, len[nr++] = gb;
    if (auto r = rec(j - 1)) rows[nr] = r + gb, len[nr++] = gb;
    if (!SPREAD && j % 4 == 0)
      for (int64_t d = j - 4; d < j; d++)
        if (auto r = rec(d)) rows[nr] = r + 2 * gb, len[nr++] = db;
    if (SPREAD) {  // the four down rows before this window of four passes, a quarter a pass
      const int64_t g0 = j / 4 * 4 - 4, ql = (db / 64 + 3) / 4 * 64, lo = j % 4 * ql;
      const int64_t hi = std::min(db / 64 * 64, lo + ql);
      for (int64_t d = g0; d < g0 + 4 && hi > lo; d++)
        if (auto r = rec(d)) rows[nr] = r + 2 * gb + lo, len[nr++] = hi - lo;
    }
    const uint8_t* pf[3];
    int64_t plen[3];
    int np = 0;
    if (fixed < 0) {
      if (auto r = rec(j + 2)) pf[np] = r, plen[np++] = gb;
      if (auto r = rec(j)) pf[np] = r + gb, plen[np++] = gb + db;
    }
    int64_t total = 0, ptotal = 0, done = 0, issued = 0;
    for (int i = 0; i < nr; i++) total += len[i] / 64;
    for (int i = 0; i < np; i++) ptotal += (plen[i] + 63) / 64;
    auto prefetch_next = [&]() {
      int64_t q = issued++;
      for (int i = 0; i < np; i++) {
        const int64_t n = (plen[i] + 63) / 64;
        if (q < n) { _mm_prefetch((const char*)(pf[i] + 64 * q), _MM_HINT_T1); return; }
        q -= n;
      }
    };
    for (int64_t o = 0; done < total; o += 64)
      for (int i = 0; i < nr; i++) {
        if (o >= len[i]) continue;
        const uint8_t* l = rows[i] + o;
        done++;
        while (issued < ptotal && issued * total < done * ptotal) prefetch_next();
        if (LOAD) {
          x = _mm256_xor_si256(x, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)l),
                                                   _mm256_loadu_si256((const __m256i*)(l + 32))));
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)l)));
          for (int q = 0; q < W; q++) acc[q % 8] = _mm256_fmadd_ps(v, k, acc[q % 8]);
        } else {
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
          for (int q = 0; q < W; q++) acc[q % 8] = _mm256_fmadd_ps(v, k, acc[q % 8]);
        }
      }
  }
  return kept(acc, x);
}
// mode 0: reads; 1: compute (fmas a line); 2: both; 3, 4: compute, both, the FMAs on the line's
// bytes; 5, 6, 7: reads, compute, both in the kernel's order (gate rows of GATE bytes), its down
// rows spread a quarter a pass where `spread`
double run(torch::Tensor w, torch::Tensor sel, int64_t mode, int64_t fmas, bool spread) {
  const uint8_t* p = w.data_ptr<uint8_t>();
  const int64_t* s = sel.data_ptr<int64_t>();
  const int64_t rb = w.size(1), m = sel.numel();
  auto go = [&](auto n, auto sp) -> double {
    constexpr int W = decltype(n)::value;
    constexpr bool S = decltype(sp)::value;
    switch (mode) {
      case 0: return walk<true, 0>(p, rb, s, m, -1);
      case 1: return walk<false, W>(p, rb, s, m, 0);
      case 2: return walk<true, W>(p, rb, s, m, -1);
      case 3: return walk<false, W, true>(p, rb, s, m, 0);
      case 4: return walk<true, W, true>(p, rb, s, m, -1);
      case 5: return walk_kernel<true, 0, S>(p, rb, GATE, s, m, -1);
      case 6: return walk_kernel<false, W, S>(p, rb, GATE, s, m, 0);
      default: return walk_kernel<true, W, S>(p, rb, GATE, s, m, -1);
    }
  };
  auto with_w = [&](auto sp) -> double {
    switch (fmas) {
      case 8: return go(std::integral_constant<int, 8>{}, sp);
      case 16: return go(std::integral_constant<int, 16>{}, sp);
      case 32: return go(std::integral_constant<int, 32>{}, sp);
      default: return go(std::integral_constant<int, 64>{}, sp);
    }
  };
  return spread ? with_w(std::true_type{}) : with_w(std::false_type{});
}
"""
FMAS = (8, 16, 32, 64)  # per 64-byte line; the one whose compute comes closest to the reads is used
N_FF, RECORD = 11008, kernels.record_bytes("q4_1", 4096, gated=True)
GATE = kernels.row_bytes("q4_1", 4096)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--share", type=float, default=0.15)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from torch.utils.cpp_extension import load_inline
    op = load_inline("overlap", cpp_sources=[SRC.replace("GATE", str(GATE))], functions=["run"],
                     extra_cflags=["-O3", "-mavx2", "-mfma"], build_directory=tempfile.mkdtemp(),
                     verbose=False).run
    torch.set_num_threads(1)
    w = kernels.huge_empty((a.layers * N_FF, RECORD), torch.uint8)
    w.fill_(1)
    g = torch.Generator().manual_seed(0)
    m = round(a.share * N_FF)
    sels = [torch.randperm(N_FF, generator=g)[:m].sort().values + i * N_FF for i in range(a.layers)]

    def timed(mode: int, fmas: int = 8, spread: bool = False) -> float:
        ts = []
        for r in range(3 * a.layers):
            t = time.perf_counter()
            op(w, sels[r % a.layers], mode, fmas, spread)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    r0 = timed(0)
    fmas = min(FMAS, key=lambda f: abs(timed(1, f) - r0))
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, 1 thread, "
          f"{m} of {N_FF} records of {RECORD} bytes, {a.layers} layers rotated, {fmas} FMAs a line")
    print("| round | FMAs' input | reads, us | GB/s | compute, us | both, us | their sum | the longer | "
          "both / longer |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(a.rounds):
        r = timed(0)
        for label, mode in (("registers", 1), ("the line's bytes", 3)):
            c, b = timed(mode, fmas), timed(mode + 1, fmas)
            print(f"| {i + 1} | {label} | {r:.0f} | {m * RECORD / r / 1e3:.1f} | {c:.0f} | {b:.0f} | "
                  f"{r + c:.0f} | {max(r, c):.0f} | {b / max(r, c):.2f} |")
        for label, spread in (("the line's bytes, in the kernel's order, four down rows in one pass", False),
                              ("the same, the four down rows a quarter a pass", True)):
            r, c, b = timed(5, fmas, spread), timed(6, fmas, spread), timed(7, fmas, spread)
            print(f"| {i + 1} | {label} | {r:.0f} | {m * RECORD / r / 1e3:.1f} | "
                  f"{c:.0f} | {b:.0f} | {r + c:.0f} | {max(r, c):.0f} | {b / max(r, c):.2f} |")


if __name__ == "__main__":
    main()
