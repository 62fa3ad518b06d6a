// How fast one core reads a buffer when it skips pieces of it: the share of pieces kept at random
// (`keep`), each piece `piece` bytes, with or without a software prefetch `ahead` pieces ahead.
// With `side` (optional, > 0) the kept pieces are read `side` at a time side by side, a 64-byte
// line of each in turn (the q4c product's runs), the prefetch `ahead` lines ahead in each.
// Built and run by benchmarks/input_sparse_gemv.py --gaps. Prints the kept bytes' read rate.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: read_gaps MIB KEEP PIECE AHEAD [SIDE]\n");
    return 2;
  }
  const size_t side = argc == 6 ? std::strtoull(argv[5], nullptr, 10) : 0;
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
    // (memory may have changed: without this the compiler may read the buffer once for all passes)
    asm volatile("" : : : "memory");
    __m256i acc = _mm256_setzero_si256();
    if (side) {
      for (size_t g = 0; g < kept.size(); g += side) {
        const size_t e = g + side < kept.size() ? g + side : kept.size();
        for (size_t o = 0; o < piece; o += 64)
          for (size_t i = g; i < e; i++) {
            const uint8_t* p = b + kept[i] + o;
            if (ahead && o + 64 * ahead < piece) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * ahead), _MM_HINT_T0);
            acc = _mm256_add_epi8(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
            acc = _mm256_add_epi8(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
          }
      }
    } else {
      for (size_t i = 0; i < kept.size(); i++) {
        if (ahead && i + ahead < kept.size())
          for (size_t o = 0; o < piece; o += 64) _mm_prefetch(reinterpret_cast<const char*>(b + kept[i + ahead] + o), _MM_HINT_T0);
        const uint8_t* p = b + kept[i];
        for (size_t o = 0; o < piece; o += 32) acc = _mm256_add_epi8(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o)));
      }
    }
    // every byte of every load in the answer, so that no load can be left out
    const __m256i s = _mm256_sad_epu8(acc, _mm256_setzero_si256());
    return static_cast<int>(_mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) + _mm256_extract_epi64(s, 2) +
                            _mm256_extract_epi64(s, 3));
  };
  int sink = pass();
  const int turns = 5;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < turns; i++) sink += pass();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / turns;
  std::printf("%.3f %d\n", kept.size() * static_cast<double>(piece) / s / 1e9, sink & 1);
  return 0;
}
