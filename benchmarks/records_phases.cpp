// The records kernel's decode step in its two phases, on one thread, built against the kernel's
// own header for one instruction-set class: the gate and up rows' activations (`acts`), the
// fired neurons' down rows (`downs`), and the two in a row (a step), in nanoseconds a record,
// for a 7B-shape ReGLU layer's Q4_1 records (width 4096; every computed neuron fires). Where a
// step's time goes by phase, which the torch operator's one call does not show.
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -Ipowerinfer/kernels/csrc
//       benchmarks/records_phases.cpp -o records_phases    (one line)
//   ./records_phases HELD M [STRIDE]
//
// HELD records, M of them computed (every STRIDE-th, wrapping): 512 275 keeps them in L3 (2.6 MB
// read a step), 20000 4000 5 reads from memory (38 MB a step, more than a 32 MB L3). The best of
// 9 turns of 0.2 s each. The records sit on 2 MiB pages where Linux's transparent huge pages
// allow (madvise), as the product's do (`kernels.huge_empty`); `-DSMALL_PAGES` leaves them on
// 4 KiB pages. Build with -DISA_NS=avx512 and -mavx512f -mavx512bw -mavx512vl -mfma
// -mf16c for the AVX-512 class.
#ifndef ISA_NS
#define ISA_NS avx2
#endif
#include <chrono>
#include <cstdio>
#include <random>

#include "huge_pages.h"
#include "neuron_ffn.h"

using namespace powerinfer;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s HELD M [STRIDE]\n", argv[0]);
    return 2;
  }
  const int held = std::atoi(argv[1]), m = std::atoi(argv[2]);
  const int stride = argc > 3 ? std::atoi(argv[3]) : 1;
  const int64_t dim = 4096, nb = dim / 32, lead = row_bytes(Q4_1S, dim);
  const int64_t rec = 2 * lead + row_bytes(Q8_0, dim);  // gate, up, down
  const size_t bytes = whole_huge_pages((size_t)held * rec);
  uint8_t* w = huge_buffer(bytes);
  std::mt19937 g(1);
  std::uniform_real_distribution<float> U(0.5f, 1.0f);
  for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)g();  // random codes; the scales below
  for (int64_t r = 0; r < held; r++) {
    uint8_t* R = w + r * rec;
    for (int row = 0; row < 2; row++)  // split rows: codes, then nb scales d, then nb offsets m
      for (int64_t b = 0; b < nb; b++) {
        put_half(R + row * lead + dim / 2 + 2 * b, 0.001f * U(g));
        put_half(R + row * lead + dim / 2 + 2 * nb + 2 * b, 0.0f);
      }
    for (int64_t b = 0; b < nb; b++) put_half(R + 2 * lead + b * 34, 0.001f * U(g));
  }
  std::vector<float> x(dim);
  for (auto& v : x) v = U(g);  // positive input and codes: every gate opens, every neuron fires
  std::vector<int8_t> xq(dim), xp(permuted_stride(dim));
  std::vector<float> xd(nb), xs(nb);
  ISA_NS::quantize(x.data(), false, 1, dim, xq.data(), xd.data(), xs.data());
  permute_input(xq.data(), 1, dim, xp.data());
  std::vector<int64_t> sel(m), fired(m);
  for (int i = 0; i < m; i++) sel[i] = ((int64_t)i * stride) % held;
  FFNArgs a{x.data(), 1, dim, w, rec, nullptr, sel.data(), nullptr, m, 0.0f, REGLU, Q4_1};
  a.xq = xq.data(), a.xd = xd.data(), a.xs = xs.data();
  a.xp = xp.data(), a.xp_stride = permuted_stride(dim);
  std::vector<float> h(m), out(dim);
  int64_t nf = 0;
  auto time = [&](auto f) {  // ns a record, the best of 9 turns
    double best = 1e30;
    for (int turn = 0; turn < 9; turn++) {
      const auto t0 = std::chrono::steady_clock::now();
      int calls = 0;
      auto since = [&] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      };
      while (since() < 0.2) f(), calls++;
      const double s = since();
      best = std::min(best, s / calls / m * 1e9);
    }
    return best;
  };
  auto acts = [&] { nf = ISA_NS::acts(a, 0, m, h.data(), fired.data()); };
  auto downs = [&] {
    std::fill(out.begin(), out.end(), 0.0f);
    ISA_NS::downs(a, fired.data(), nf, h.data(), 0, nb, out.data());
  };
  const double t_acts = time(acts), t_downs = time(downs), t_step = time([&] { acts(), downs(); });
  uint64_t sum = 1469598103934665603ULL;  // the answer's bits (FNV-1a): the same floats, the same
  for (float f : out) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    sum = (sum ^ u) * 1099511628211ULL;
  }
  std::printf("%d of %d records (every %d-th), %ld fired, 1 thread: activations %.0f ns a record, "
              "down rows %.0f, the step %.0f (%.2f GB/s); answer %016lx\n",
              m, held, stride, (long)nf, t_acts, t_downs, t_step, rec / t_step, (unsigned long)sum);
}
