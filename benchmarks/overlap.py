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
// records sel[j] of w (k, rb), the next one prefetched into L2 a line at a time; per line a
// load (LOAD) and W FMAs on 8 independent accumulators. fixed >= 0: that record only, nothing
// prefetched (the compute alone, in cache).
template <bool LOAD, int W>
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
      for (int q = 0; q < W; q++) acc[q % 8] = _mm256_fmadd_ps(acc[q % 8], k, c);
    }
  }
  __m256 s = acc[0];
  for (int i = 1; i < 8; i++) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float f[8];
  alignas(32) int32_t v[8];
  _mm256_store_ps(f, s);
  _mm256_store_si256((__m256i*)v, x);
  double t = 0;
  for (int i = 0; i < 8; i++) t += f[i] + v[i];
  return t;  // (kept, so nothing is optimized away)
}
// mode 0: reads; 1: compute (fmas a line); 2: both
double run(torch::Tensor w, torch::Tensor sel, int64_t mode, int64_t fmas) {
  const uint8_t* p = w.data_ptr<uint8_t>();
  const int64_t* s = sel.data_ptr<int64_t>();
  const int64_t rb = w.size(1), m = sel.numel();
  auto go = [&](auto n) -> double {
    constexpr int W = decltype(n)::value;
    return mode == 1 ? walk<false, W>(p, rb, s, m, 0) : walk<true, W>(p, rb, s, m, -1);
  };
  if (mode == 0) return walk<true, 0>(p, rb, s, m, -1);
  switch (fmas) {
    case 8: return go(std::integral_constant<int, 8>{});
    case 16: return go(std::integral_constant<int, 16>{});
    case 32: return go(std::integral_constant<int, 32>{});
    default: return go(std::integral_constant<int, 64>{});
  }
}
"""
FMAS = (8, 16, 32, 64)  # per 64-byte line; the one whose compute comes closest to the reads is used
N_FF, RECORD = 11008, kernels.record_bytes("q4_1", 4096, gated=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--share", type=float, default=0.15)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from torch.utils.cpp_extension import load_inline
    op = load_inline("overlap", cpp_sources=[SRC], functions=["run"],
                     extra_cflags=["-O3", "-mavx2", "-mfma"], build_directory=tempfile.mkdtemp(),
                     verbose=False).run
    torch.set_num_threads(1)
    w = kernels.huge_empty((a.layers * N_FF, RECORD), torch.uint8)
    w.fill_(1)
    g = torch.Generator().manual_seed(0)
    m = round(a.share * N_FF)
    sels = [torch.randperm(N_FF, generator=g)[:m].sort().values + i * N_FF for i in range(a.layers)]

    def timed(mode: int, fmas: int = 8) -> float:
        ts = []
        for r in range(3 * a.layers):
            t = time.perf_counter()
            op(w, sels[r % a.layers], mode, fmas)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    r0 = timed(0)
    fmas = min(FMAS, key=lambda f: abs(timed(1, f) - r0))
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, 1 thread, "
          f"{m} of {N_FF} records of {RECORD} bytes, {a.layers} layers rotated, {fmas} FMAs a line")
    print("| round | reads, us | GB/s | compute, us | both, us | their sum | the longer | both / longer |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(a.rounds):
        r, c, b = timed(0), timed(1, fmas), timed(2, fmas)
        print(f"| {i + 1} | {r:.0f} | {m * RECORD / r / 1e3:.1f} | {c:.0f} | {b:.0f} | {r + c:.0f} | "
              f"{max(r, c):.0f} | {b / max(r, c):.2f} |")


if __name__ == "__main__":
    main()
