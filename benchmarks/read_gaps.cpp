// How fast one core reads a buffer when it skips pieces of it: the share of pieces kept at random
// (`keep`), each piece `piece` bytes, with or without a software prefetch `ahead` pieces ahead.
// Built and run by benchmarks/input_sparse_gemv.py --gaps. Prints the kept bytes' read rate.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: read_gaps MIB KEEP PIECE AHEAD\n");
    return 2;
  }
  const size_t bytes = std::strtoull(argv[1], nullptr, 10) << 20;
  const double keep = std::atof(argv[2]);
  const size_t piece = std::strtoull(argv[3], nullptr, 10);
  const size_t ahead = std::strtoull(argv[4], nullptr, 10);
  std::vector<uint8_t> buf(bytes + 4096);
  uint8_t* b = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 4095) & ~uintptr_t(4095));
  for (size_t i = 0; i < bytes; i += 64) b[i] = static_cast<uint8_t>(i >> 6);
  std::vector<size_t> kept;
  std::mt19937 g(0);
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t c = 0; c < bytes / piece; c++)
    if (u(g) < keep) kept.push_back(c * piece);
  auto pass = [&] {
    __m256i acc = _mm256_setzero_si256();
    for (size_t i = 0; i < kept.size(); i++) {
      if (ahead && i + ahead < kept.size())
        for (size_t o = 0; o < piece; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + kept[i + ahead] + o), _MM_HINT_T0);
      const uint8_t* p = b + kept[i];
      for (size_t o = 0; o < piece; o += 32) acc = _mm256_add_epi8(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o)));
    }
    return _mm256_extract_epi8(acc, 0);
  };
  int sink = pass();
  const int turns = 5;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < turns; i++) sink += pass();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / turns;
  std::printf("%.3f %d\n", kept.size() * static_cast<double>(piece) / s / 1e9, sink & 1);
  return 0;
}
