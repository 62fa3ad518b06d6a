// The q4c product (input sparsity's 4-bit matrix held by input channel, input_sparse.h) on one
// thread (or THREADS, each its share of the passes), built against the kernel's own header for
// one instruction-set class: a Q4_K matrix of N rows and 4096 input channels, a fraction S of
// each block's channels dropped at random, its kept runs read pass after pass as the product
// reads them. Prints the best of 9 turns of 0.2 s:
// microseconds a call and the kept bytes' rate, which the torch operator's call (its input
// quantized, its pairs made, its threads started) does not show on its own.
//
//   g++ -O3 -std=c++17 -fopenmp -mavx2 -mfma -mf16c -Ipowerinfer/kernels/csrc
//       benchmarks/q4c_walk.cpp -o q4c_walk    (one line)
//   ./q4c_walk N S [THREADS]
//
// N 1024 keeps the matrix in L3 (2.4 MB at S 0), N 22016 reads it from memory (a 7B gate and up,
// 52 MB at S 0; copies of a matrix over 8 MB filling 96 MiB are read in turn). The matrices sit
// on 2 MiB pages where Linux's transparent huge pages allow, as the product's copies do
// (`-DSMALL_PAGES`: 4 KiB pages). Build with -DISA_NS=avx512 and -mavx512f -mavx512bw -mavx512vl
// [-mavx512vnni] for the AVX-512 classes.
#ifndef ISA_NS
#define ISA_NS avx2
#endif
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "huge_pages.h"
#include "neuron_ffn.h"

using namespace powerinfer;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s N S [THREADS]\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]), k = 4096, nb = k / 32, np = q4c_rows(n);
  const double S = std::atof(argv[2]);
  const int threads = argc > 3 ? std::atoi(argv[3]) : 1;
  const int kind = Q4C_Q4_K;
  const size_t bytes = (size_t)q4c_bytes(n, k, kind);
  const size_t one = whole_huge_pages(bytes);
  // copies enough to fill 96 MiB (three times a 32 MiB L3), read in turn: none is still cached
  // when its turn comes again (one copy where it fits in the last level cache)
  const int copies = bytes > (8u << 20) ? (int)((96u << 20) / one + 1) : 1;
  uint8_t* w = huge_buffer(one * copies);
  std::mt19937 g(1);
  std::uniform_real_distribution<float> U(0.5f, 1.0f);
  for (int c = 0; c < copies; c++) {
    uint8_t* wc = w + one * c;
    for (size_t i = 0; i < bytes; i++) wc[i] = (uint8_t)g();  // codes, sc and mn: any bytes
    uint8_t* tail = wc + nb * q4c_region(np, kind);  // each super-block's d and dmin: finite halves
    for (int64_t i = 0; i < k / 256 * 2 * np; i++) put_half(tail + 2 * i, 0.001f * U(g));
  }
  // the kept channels: each dropped with probability S; paired as ops.cpp's add_pairs pairs them
  std::vector<float> xd(nb), xs(nb);
  std::vector<int32_t> first(nb + 1), x16(k / 16, 0);
  std::vector<Q4CPair> pairs;
  std::bernoulli_distribution drop(S);
  int64_t kept = 0, runs_read = 0;
  for (int64_t b = 0; b < nb; b++) {
    xd[b] = 0.01f * U(g), xs[b] = 0.1f * U(g);
    first[b] = (int32_t)pairs.size();
    std::vector<int> js;
    for (int j = 0; j < 32; j++)
      if (!drop(g)) js.push_back(j);
    kept += (int64_t)js.size();
    runs_read += (int64_t)js.size();
    const size_t p0 = pairs.size();
    for (size_t i = 0; i < js.size(); i += 2) {
      const int j0 = js[i], j1 = i + 1 < js.size() ? js[i + 1] : js[i];
      pairs.push_back(Q4CPair{(uint8_t)j0, (uint8_t)j1, (int8_t)(1 + g() % 120),
                              (int8_t)(i + 1 < js.size() ? 1 + g() % 120 : 0)});
    }
    if ((pairs.size() - p0) % 2) pairs.push_back(Q4CPair{pairs.back().j0, pairs.back().j0, 0, 0});
  }
  first[nb] = (int32_t)pairs.size();
  int64_t blocks_read = 0;
  for (int64_t b = 0; b < nb; b++) blocks_read += first[b + 1] > first[b];
  // what a call reads: the kept runs, the blocks' sc and mn, the super-blocks' d and dmin
  const double read =
      (double)runs_read * np / 2 + (double)blocks_read * 2 * np + k / 256 * 4.0 * np;
  Q4CArgs a{w, n, k, kind, xd.data(), xs.data(), pairs.data(), first.data(), x16.data(), true};
  std::vector<float> y(np);
  const int64_t passes = np / 128;
  double best = 1e30, check = 0;
  for (int turn = 0; turn < 9; turn++) {
    int64_t calls = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double el = 0;
    do {
      std::fill(y.begin(), y.end(), 0.0f);
      a.w = w + one * (calls % copies);
#pragma omp parallel num_threads(threads)
      {  // (each thread its share of the passes, as the operator's parallel_for gives them)
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        ISA_NS::q4c_passes(a, passes * t / T, passes * (t + 1) / T, y.data());
      }
      calls++;
      el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < 0.2);
    best = std::min(best, el / calls);
    a.w = w;
    std::fill(y.begin(), y.end(), 0.0f);
    ISA_NS::q4c_passes(a, 0, passes, y.data());
    check = 0;
    for (int64_t i = 0; i < n; i++) check += y[i];
  }
  std::printf("%d thread(s), rows %lld, dropped %.2f (kept %lld of %lld channels): "
              "%.1f us a call, %.2f MB read, "
              "%.1f GB/s; answer %.6g\n", threads, (long long)n, S, (long long)kept, (long long)k,
              1e6 * best, read / 1e6, read / best / 1e9, check);
  return 0;
}
