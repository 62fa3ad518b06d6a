// ---- 4-bit matrices held by input channel (`q4c`): products that read only the channels in use ----
// Included inside an ISA namespace of neuron_ffn.h.
//
// With input sparsity (TEAL) a decode step zeroes the input channels below a threshold, and
// channel j's weights (column j of W) are then never needed. In q4x16 a 64-byte line holds 8
// channels of 16 rows, so a skipped channel skips nothing. Here one channel's weights for all the
// rows are one run of bytes, read or not as a whole: runs of a few kilobytes, because memory
// read in shorter pieces with gaps between them is hardly faster than read whole (on an AVX2
// EPYC, half of a buffer read in 128-byte pieces took as long as all of it, in 4 KB pieces 0.65
// of the time: benchmarks/input_sparse_gemv.py --gaps).
//
// An (n, k) Q4_0 or Q4_1 matrix (the file's codes, scales and offsets, the same bytes as q4x16's)
// is held as np = q4c_rows(n) rows (the extra rows zero). Block b (input channels 32b..32b+31) is
// one region:
//   [0, 2 np)           d: np f16 scales, row 0 first
//   [2 np, 4 np)        m: np f16 offsets (w = d * q + m; only in a matrix with offsets, Q4_1's;
//                       a Q4_0 block's w = d * (q - 8) needs none)
//   then 32 runs of np/2 bytes, channel 0 first: channel j's codes for every row, 32 bytes per
//   64 rows. In those 32 bytes, row 16v + l (v = 0..3, l = 0..15) is at byte
//   (v & 1) * 8 + (l < 8 ? l : l + 8), in the low nibble for v < 2 and the high one for v >= 2:
//   the order in which AVX2's in-lane byte interleaves leave them (below).
//
// The product pairs the kept channels of a block (an odd one with itself, its second input 0):
// the two channels' 32 bytes of 64 rows are split into nibbles and interleaved byte by byte, so
// that each 16-bit lane of a u8 x s8 pairwise product (`maddubs`) is one row's two products.
// Up to 8 pairs (a segment: at most 8 * 2 * 15 * 127 in 16 bits) are summed in registers for 64
// rows, then widened, scaled by the rows' d and the input block's scale, and added to the rows'
// floats; the segment's runs are read side by side, 64 rows at a time, from the first row to
// the last. Threads take blocks, each into its own rows of sums.
#ifndef Q4C_AHEAD
#define Q4C_AHEAD 8  // rows / 64 between a run's prefetch and its use
#endif

inline void q4c_blocks(const Q4CArgs& a, int64_t b0, int64_t b1, float* y) {
  const int64_t np = q4c_rows(a.n), half_n = np / 2, passes = np / 64;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; b++) {
    const int32_t p0 = a.first[b], p1 = a.first[b + 1];
    if (p0 == p1) continue;  // no channel of the block kept (its sums are 0)
    const uint8_t* r = a.w + b * q4c_region(np, a.offsets);
    const uint8_t* nib = r + (a.offsets ? 4 : 2) * np;
    const __m256 vxd = _mm256_set1_ps(a.xd[b]);
    for (int32_t s = p0; s < p1; s += 8) {
      const int32_t e = std::min(s + 8, p1);
      int32_t xsum = 0;  // the segment's inputs (Q4_0's q - 8: -8 times their sum)
      for (int32_t i = s; i < e; i++) xsum += a.pairs[i].x0 + a.pairs[i].x1;
      const __m256i corr = _mm256_set1_epi32(a.offsets ? 0 : -8 * xsum);
      const int cnt = e - s;
      const uint8_t *ra[8], *rb[8];  // the segment's runs
      __m256i xs[8];                 // and their inputs, two bytes a pair
      for (int i = 0; i < cnt; i++) {
        const Q4CPair c = a.pairs[s + i];
        ra[i] = nib + c.j0 * half_n;
        rb[i] = nib + c.j1 * half_n;
        xs[i] = _mm256_set1_epi16((int16_t)(uint16_t)((uint8_t)c.x0 | ((uint16_t)(uint8_t)c.x1 << 8)));
      }
      for (int64_t p = 0; p < passes; p++) {
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        const bool ahead = (p & 1) == 0 && p + Q4C_AHEAD < passes;
        if (p + Q4C_AHEAD < passes) {  // the scales of 64 rows: two lines
          _mm_prefetch((const char*)r + 128 * (p + Q4C_AHEAD), _MM_HINT_T0);
          _mm_prefetch((const char*)r + 128 * (p + Q4C_AHEAD) + 64, _MM_HINT_T0);
        }
        for (int i = 0; i < cnt; i++) {
          const uint8_t *pa = ra[i] + 32 * p, *pb = rb[i] + 32 * p;
          if (ahead) {
            _mm_prefetch((const char*)pa + 32 * Q4C_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)pb + 32 * Q4C_AHEAD, _MM_HINT_T0);
          }
          const __m256i va = _mm256_loadu_si256((const __m256i*)pa), vb = _mm256_loadu_si256((const __m256i*)pb);
          const __m256i xx = xs[i];
          const __m256i alo = _mm256_and_si256(va, mask), ahi = _mm256_and_si256(_mm256_srli_epi16(va, 4), mask);
          const __m256i blo = _mm256_and_si256(vb, mask), bhi = _mm256_and_si256(_mm256_srli_epi16(vb, 4), mask);
          acc[0] = _mm256_add_epi16(acc[0], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(alo, blo), xx));
          acc[1] = _mm256_add_epi16(acc[1], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(alo, blo), xx));
          acc[2] = _mm256_add_epi16(acc[2], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(ahi, bhi), xx));
          acc[3] = _mm256_add_epi16(acc[3], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(ahi, bhi), xx));
        }
        for (int v = 0; v < 4; v++) {  // rows 64p + 16v + 0..15
          const int64_t row = 64 * p + 16 * v;
          const __m256i lo = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[v])), corr);
          const __m256i hi = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[v], 1)), corr);
          const __m256 dlo = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + 2 * row))), vxd);
          const __m256 dhi = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + 2 * row + 16))), vxd);
          _mm256_storeu_ps(y + row, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), dlo, _mm256_loadu_ps(y + row)));
          _mm256_storeu_ps(y + row + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), dhi, _mm256_loadu_ps(y + row + 8)));
        }
      }
    }
    if (a.offsets) {  // + m * (xd * the block's inputs' sum), once a block
      const __m256 vxs = _mm256_set1_ps(a.xs[b]);
      for (int64_t row = 0; row < np; row += 8) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + 2 * np + 2 * row)));
        _mm256_storeu_ps(y + row, _mm256_fmadd_ps(m, vxs, _mm256_loadu_ps(y + row)));
      }
    }
  }
}
