// ---- 4-bit matrices held by input channel (`q4c`): products that read only the channels in use ----
// Included inside an ISA namespace of neuron_ffn.h.
//
// With input sparsity (TEAL) a decode step zeroes the input channels below a threshold, and
// channel j's weights (column j of W) are then never needed. In q4x16 a 64-byte line holds 8
// channels of 16 rows, so a skipped channel skips nothing. Here one channel's weights for all the
// rows are one run of bytes, read or not as a whole: runs of a few kilobytes, because memory
// read in shorter pieces with gaps between them is hardly faster than read whole (on an AVX2
// EPYC, half of a buffer read in 128-byte pieces took longer than all of it, in 4 KB pieces
// 0.57-0.86 of the time: benchmarks/input_sparse_gemv.py --gaps).
//
// An (n, k) Q4_0, Q4_1 or Q4_K matrix (the file's codes, scales and offsets, the same bytes as
// q4x16's and q4kx16's) is held as np = q4c_rows(n) rows (the extra rows zero). Block b (input
// channels 32b..32b+31) is one region:
//   [0, 2 np)           d: np f16 scales, row 0 first
//   [2 np, 4 np)        m: np f16 offsets (w = d * q + m; only in a matrix with offsets, Q4_1's;
//                       a Q4_0 block's w = d * (q - 8) needs none)
// or, for Q4_K (w = d * sc * q - dmin * mn, the block's 6-bit sc and mn, the super-block's d
// and dmin):
//   [0, np)             sc: np bytes, row 0 first
//   [np, 2 np)          mn: np bytes
//   then 32 runs of np/2 bytes, channel 0 first: channel j's codes for every row, 32 bytes per
//   64 rows. In those 32 bytes, row 16v + l (v = 0..3, l = 0..15) is at byte
//   (v & 1) * 8 + (l < 8 ? l : l + 8), in the low nibble for v < 2 and the high one for v >= 2:
//   the order in which AVX2's in-lane byte interleaves leave them (below).
// After the k / 32 regions a Q4_K matrix holds per super-block (256 channels) its rows' d (np f16)
// then their dmin (np f16): a row's block scale is d * sc, its offset -dmin * mn, computed in
// float as the q4kx16 product computes them (4.625 bits a weight, the q4kx16 bytes).
//
// The product pairs the kept channels of a block (an odd one with itself, its second input 0):
// the two channels' 32 bytes of 64 rows are split into nibbles and interleaved byte by byte, so
// that each 16-bit lane of a u8 x s8 pairwise product (`maddubs`) is one row's two products.
// Up to 8 pairs (a segment: at most 8 * 2 * 15 * 127 in 16 bits) are summed in 16 bits, widened
// and added in 32; a block's integer sums then meet the rows' floats as the q4x16 product's do
// (y = fma(sum, d * xd, y), then y = fma(m, xd * the inputs' sum, y), m = -8 d for Q4_0), block
// after block, so the two give the same floats for the same sparse input: a skipped block (no
// kept channel) adds exactly 0 there too. Threads take runs of 64 rows, as q4x16's take groups of
// rows. A block's runs are read side by side, 64 rows at a time, the next lines asked for ahead.
#ifndef Q4C_AHEAD
#define Q4C_AHEAD 8  // rows / 64 between a run's prefetch and its use
#endif
// Each kept run is also asked for into L2 this many passes ahead (prefetcht1), then into every
// level Q4C_AHEAD passes ahead: a block's 16-32 runs read side by side are more lines in flight
// than L1 keeps waiting for. On a 2-core Zen 5 VM (7B shapes, switched per call in one process)
// the products took 0.85-1.04x the time, most runs 0.91-0.98x (Q4_K and Q4_0, 0-50% input
// sparsity), 0.91-1.00x held to avx2; 12 and 20 passes were no better than 16.
#ifndef Q4C_FAR
#define Q4C_FAR 16
#endif

// Block b's kept channels for the products below: its region, and per pair its two channels'
// runs and their two 8-bit inputs as one 16-bit word (x0 the low byte); the pair count (0:
// no channel of the block kept, and q4x16 adds 0 * d xd + m * 0 there)
struct Q4CBlock {
  const uint8_t* r;
  int cnt;
  int cnt_a;  // (Q6_K) the pairs of channels 0..15, before those of 16..31
  const uint8_t* ra[16];
  const uint8_t* rb[16];
  int16_t x[16];
};

inline int q4c_block(const Q4CArgs& a, int64_t b, int64_t np, Q4CBlock& k) {
  const int32_t first = a.first[b];
  k.cnt = a.first[b + 1] - first;
  if (k.cnt == 0) return 0;
  k.r = a.w + b * q4c_region(np, a.kind);
  const uint8_t* nib = k.r + (a.kind == Q4C_Q4_1 ? 4 : 2) * np;
  const int64_t run = a.kind == Q4C_Q6_K ? 3 * np / 4 : np / 2;  // a channel's bytes
  k.cnt_a = 0;
  for (int i = 0; i < k.cnt; i++) {
    const Q4CPair c = a.pairs[first + i];
    k.ra[i] = nib + c.j0 * run;
    k.rb[i] = nib + c.j1 * run;
    k.x[i] = (int16_t)(uint16_t)((uint8_t)c.x0 | ((uint16_t)(uint8_t)c.x1 << 8));
    k.cnt_a += c.j0 < 16;
  }
  return k.cnt;
}

// The first block after b with a kept channel (k filled; k.cnt 0 where none is left), and its
// Q4_K super-block's d and dmin where the product has not asked for them yet (else null)
inline void q4c_next(const Q4CArgs& a, int64_t b, int64_t np, const uint8_t* kt, Q4CBlock& k,
                     const uint8_t*& ks) {
  const int64_t nb = a.k / 32;
  k.cnt = 0, ks = nullptr;
  for (int64_t c = b + 1; c < nb; c++)
    if (q4c_block(a, c, np, k)) {
      if (kt && c / 8 != b / 8) ks = kt + q4c_tail_sb(np, a.kind) * (c / 8);
      return;
    }
}

// A Q4_K matrix's super-blocks' d and dmin, after its blocks (the end of the blocks otherwise)
inline const uint8_t* q4c_tail(const Q4CArgs& a, int64_t np) { return a.w + a.k / 32 * q4c_region(np, a.kind); }

// The lines of a block's scales (and offsets) for `passes` passes of 64 rows from pass p (r: the
// block's region); with ks (a Q4_K matrix's d and dmin of the block's super-block, given at the
// first block of it the product reads) theirs too, which the super-block's later blocks find cached
PREFETCHES void q4c_prefetch_scales(const Q4CArgs& a, const uint8_t* r, const uint8_t* ks, int64_t np,
                                    int64_t p, int passes) {
  if (a.kind == Q4C_Q4_K) {  // a byte a row of sc and of mn; a f16 a row of d and dmin
    for (int64_t o = 0; o < 64 * passes; o += 64) {
      _mm_prefetch((const char*)r + 64 * p + o, _MM_HINT_T0);
      _mm_prefetch((const char*)r + np + 64 * p + o, _MM_HINT_T0);
    }
    if (ks) {
      for (int64_t o = 0; o < 128 * passes; o += 64) {
        _mm_prefetch((const char*)ks + 128 * p + o, _MM_HINT_T0);
        _mm_prefetch((const char*)ks + 2 * np + 128 * p + o, _MM_HINT_T0);
      }
    }
    return;
  }
  for (int64_t o = 0; o < 128 * passes; o += 64) {
    _mm_prefetch((const char*)r + 128 * p + o, _MM_HINT_T0);
    if (a.kind == Q4C_Q4_1) _mm_prefetch((const char*)r + 2 * np + 128 * p + o, _MM_HINT_T0);
  }
}

// All of a block's lines for `passes` passes of 64 rows from pass p: its scales (as above) and
// each kept channel's run of nibbles (32 bytes a pass; two passes may straddle two lines)
PREFETCHES void q4c_prefetch_block(const Q4CArgs& a, const Q4CBlock& k, const uint8_t* ks, int64_t np,
                                   int64_t p, int passes) {
  q4c_prefetch_scales(a, k.r, ks, np, p, passes);
  for (int i = 0; i < k.cnt; i++) {
    _mm_prefetch((const char*)k.ra[i] + 32 * p, _MM_HINT_T0);
    _mm_prefetch((const char*)k.rb[i] + 32 * p, _MM_HINT_T0);
    if (passes == 2) {
      _mm_prefetch((const char*)k.ra[i] + 32 * p + 63, _MM_HINT_T0);
      _mm_prefetch((const char*)k.rb[i] + 32 * p + 63, _MM_HINT_T0);
    }
  }
}

// A pair's two runs of codes for 64 rows (their low and high nibbles' bytes, in the runs' order)
// against its two 8-bit inputs (xx): acc[v] (rows 16v + 0..15, 16 bits) += each row's two
// products, the codes of the pair interleaved byte by byte for `maddubs`
__attribute__((always_inline)) inline void pair_products_256(__m256i alo, __m256i ahi, __m256i blo, __m256i bhi, __m256i xx, __m256i* acc) {
  acc[0] = _mm256_add_epi16(acc[0], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(alo, blo), xx));
  acc[1] = _mm256_add_epi16(acc[1], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(alo, blo), xx));
  acc[2] = _mm256_add_epi16(acc[2], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(ahi, bhi), xx));
  acc[3] = _mm256_add_epi16(acc[3], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(ahi, bhi), xx));
}

// sum[2v], sum[2v + 1] (rows 16v + 0..7, 8..15, 32 bits) += acc[v]
__attribute__((always_inline)) inline void widen_sums_256(const __m256i* acc, __m256i* sum) {
  for (int v = 0; v < 4; v++) {
    sum[2 * v] = _mm256_add_epi32(sum[2 * v], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[v])));
    sum[2 * v + 1] = _mm256_add_epi32(sum[2 * v + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[v], 1)));
  }
}

inline void q4c_passes_256(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  const int64_t nb = a.k / 32, np = q4c_rows(a.n);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  Q4CBlock k;
  const uint8_t* kt = a.kind == Q4C_Q4_K ? q4c_tail(a, np) : nullptr;
  int64_t sb_read = -1;  // the last super-block whose d and dmin were asked for
  __m256i xs[16];  // the pairs' inputs, two bytes a pair
  Q4CBlock nk;  // the next block with a kept channel
  const uint8_t* nks;
  for (int64_t b = 0; b < nb; b++) {
    if (q4c_block(a, b, np, k) == 0) continue;
    const int cnt = k.cnt;
    const uint8_t* r = k.r;
    const uint8_t* ks = kt ? kt + 4 * np * (b / 8) : nullptr;  // a Q4_K matrix's d and dmin here
    const uint8_t* ks_new = ks && b / 8 != sb_read ? ks : nullptr;
    sb_read = b / 8;
    const uint8_t* const* ra = k.ra;
    const uint8_t* const* rb = k.rb;
    for (int i = 0; i < cnt; i++) xs[i] = _mm256_set1_epi16(k.x[i]);
    const __m256 vxd = _mm256_set1_ps(a.xd[b]), vxs = _mm256_set1_ps(a.xs[b]);
    // the next block's first passes are asked for over this one's last: a thread's share of a
    // run can be a few passes (the output projection's 4,096 rows: 32 a thread of two), and
    // without them a quarter of its bytes came unannounced, at every block
    q4c_next(a, b, np, kt, nk, nks);
    for (int64_t p = p_begin; p < p_end; p++) {
      const bool ahead = p + Q4C_AHEAD < p_end, far = p + Q4C_FAR < p_end;
      if (ahead) {
        q4c_prefetch_scales(a, r, ks_new, np, p + Q4C_AHEAD, 1);
      } else if (nk.cnt && p + Q4C_AHEAD - p_end + p_begin < p_end) {
        const int64_t pn = p + Q4C_AHEAD - p_end + p_begin;
        q4c_prefetch_block(a, nk, nks, np, pn, 1);
      }
      __m256i sum[8];  // rows 64p + 8i .. + 7, in 32 bits
      for (int i = 0; i < 8; i++) sum[i] = _mm256_setzero_si256();
      for (int s = 0; s < cnt; s += 8) {
        const int e = std::min(s + 8, cnt);
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        for (int i = s; i < e; i++) {
          const uint8_t *pa = ra[i] + 32 * p, *pb = rb[i] + 32 * p;
          if (ahead && (p & 1) == 0) {
            _mm_prefetch((const char*)pa + 32 * Q4C_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)pb + 32 * Q4C_AHEAD, _MM_HINT_T0);
            if (far) {
              _mm_prefetch((const char*)pa + 32 * Q4C_FAR, _MM_HINT_T1);
              _mm_prefetch((const char*)pb + 32 * Q4C_FAR, _MM_HINT_T1);
            }
          }
          const __m256i va = _mm256_loadu_si256((const __m256i*)pa), vb = _mm256_loadu_si256((const __m256i*)pb);
          const __m256i xx = xs[i];
          const __m256i alo = _mm256_and_si256(va, mask), ahi = _mm256_and_si256(_mm256_srli_epi16(va, 4), mask);
          const __m256i blo = _mm256_and_si256(vb, mask), bhi = _mm256_and_si256(_mm256_srli_epi16(vb, 4), mask);
          pair_products_256(alo, ahi, blo, bhi, xx, acc);
        }
        widen_sums_256(acc, sum);
      }
      for (int i = 0; i < 8; i++) {
        const int64_t row = 64 * p + 8 * i;
        __m256 d, m;
        if (a.kind == Q4C_Q4_K) {  // d * sc and -dmin * mn
          const __m256 sd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ks + 2 * row)));
          const __m256 sm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ks + 2 * np + 2 * row)));
          d = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(r + row)))));
          m = _mm256_xor_ps(_mm256_mul_ps(sm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                  _mm_loadl_epi64((const __m128i*)(r + np + row))))), _mm256_set1_ps(-0.0f));
        } else {
          d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + 2 * row)));
          m = a.kind == Q4C_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + 2 * np + 2 * row)))
                                 : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        }
        __m256 acc_y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_mul_ps(d, vxd), _mm256_loadu_ps(y + row));
        _mm256_storeu_ps(y + row, _mm256_fmadd_ps(m, vxs, acc_y));
      }
    }
  }
}

// ---- A Q6_K matrix held by input channel (kind Q4C_Q6_K) ----
// (n, k) Q6_K (w = d * sc * (q - 32), q in 0..63, an 8-bit sc a row per 16 channels, a f16 d a
// row per super-block of 256: the q6kx16 bytes, 6.5625 bits a weight). Block b is one region:
//   [0, np)        the rows' sc of channels 32b..32b+15, a byte a row, row 0 first
//   [np, 2 np)     those of channels 32b+16..32b+31
//   then 32 runs of 3 np / 4 bytes, channel 0 first: the low 4 bits of channel j's codes as a
//   Q4 run above (np / 2 bytes, 32 a pass of 64 rows), then their top 2 bits, 16 bytes a pass:
//   byte i of a pass holds, from bit 0, those of the codes at bytes i and i + 16 of the pass's
//   low nibbles, then at bytes i and i + 16 of its high ones.
// After the blocks, per super-block its rows' d (np f16).
// q4c_product pairs a Q6_K matrix's channels within each 16 (those of 0..15 first), so that a
// block's two halves sum apart: per pair the codes (u8, 0..63) against the two inputs in
// `maddubs` (16-bit sums of at most 2 * 63 * 127), two pairs summed in 16 bits, then widened. A
// row's block gives t = (sum_a - 32 x16_a) sc_a + (sum_b - 32 x16_b) sc_b in 32-bit integers and
// y = fma(t, d * xd, y): the q6kx16 product's integers and floats, block after block, for the
// same sparse input (a block with no kept channel adds 0 there too).

// All of a block's lines for `passes` passes of 64 rows from pass p: the two halves' scales, its
// super-block's d (ks, where not asked for yet) and each kept channel's runs
PREFETCHES void q6c_prefetch_block(const Q4CBlock& k, const uint8_t* ks, int64_t np, int64_t p, int passes) {
  for (int64_t o = 0; o < 64 * passes; o += 64) {
    _mm_prefetch((const char*)k.r + 64 * p + o, _MM_HINT_T0);
    _mm_prefetch((const char*)k.r + np + 64 * p + o, _MM_HINT_T0);
  }
  if (ks)
    for (int64_t o = 0; o < 128 * passes; o += 64) _mm_prefetch((const char*)ks + 128 * p + o, _MM_HINT_T0);
  for (int i = 0; i < k.cnt; i++) {
    for (const uint8_t* run : {k.ra[i], k.rb[i]}) {
      _mm_prefetch((const char*)run + 32 * p, _MM_HINT_T0);
      _mm_prefetch((const char*)run + 32 * (p + passes) - 1, _MM_HINT_T0);
      _mm_prefetch((const char*)run + np / 2 + 16 * p, _MM_HINT_T0);
    }
  }
}

// A run's lines for pass p + ahead (its low nibbles: a line every two passes; its top bits: every
// four), into every level, and where `far` those of pass p + Q4C_FAR into L2
PREFETCHES void q6c_prefetch_run(const uint8_t* run, int64_t np, int64_t p, bool ahead, bool far) {
  if (ahead && (p & 1) == 0) _mm_prefetch((const char*)run + 32 * (p + Q4C_AHEAD), _MM_HINT_T0);
  if (ahead && (p & 3) == 0) _mm_prefetch((const char*)run + np / 2 + 16 * (p + Q4C_AHEAD), _MM_HINT_T0);
  if (far && (p & 1) == 0) _mm_prefetch((const char*)run + 32 * (p + Q4C_FAR), _MM_HINT_T1);
  if (far && (p & 3) == 0) _mm_prefetch((const char*)run + np / 2 + 16 * (p + Q4C_FAR), _MM_HINT_T1);
}

// A run's codes of pass p as bytes 0..63 in the low nibbles' order (lo) and the high ones' (hi)
inline void q6c_codes_256(const uint8_t* run, int64_t np, int64_t p, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(run + 32 * p));
  const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(run + np / 2 + 16 * p)));
  // each byte's two bits onto bits 4-5 (32-bit shifts: what crosses a byte lands outside the mask):
  // bytes 0..15 of the low nibbles take bits 0-1, bytes 16..31 bits 2-3; of the high ones 4-5, 6-7
  lo = _mm256_or_si256(_mm256_and_si256(v, mask),
                       _mm256_and_si256(_mm256_sllv_epi32(h, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), m30));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                       _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), m30));
}

// sum[i] (rows 64p + 8i .. + 7, 32 bits) += the products of the block's pairs [s0, s1) for pass p
inline void q6c_half_256(const Q4CBlock& k, int s0, int s1, int64_t np, int64_t p, bool ahead, bool far,
                         __m256i* sum) {
  for (int s = s0; s < s1; s += 2) {
    const int e = std::min(s + 2, s1);
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                      _mm256_setzero_si256()};
    for (int i = s; i < e; i++) {
      q6c_prefetch_run(k.ra[i], np, p, ahead, far);
      q6c_prefetch_run(k.rb[i], np, p, ahead, far);
      __m256i alo, ahi, blo, bhi;
      q6c_codes_256(k.ra[i], np, p, alo, ahi);
      q6c_codes_256(k.rb[i], np, p, blo, bhi);
      pair_products_256(alo, ahi, blo, bhi, _mm256_set1_epi16(k.x[i]), acc);
    }
    widen_sums_256(acc, sum);
  }
}

inline void q6c_passes_256(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  const int64_t nb = a.k / 32, np = q4c_rows(a.n);
  const uint8_t* kt = q4c_tail(a, np);
  Q4CBlock k, nk;  // this block, the next with a kept channel
  const uint8_t* nks;
  for (int64_t b = 0; b < nb; b++) {
    if (q4c_block(a, b, np, k) == 0) continue;
    const uint8_t* r = k.r;
    const uint8_t* ks = kt + 2 * np * (b / 8);  // the rows' d of the block's super-block
    const __m256 vxd = _mm256_set1_ps(a.xd[b]);
    const __m256i xa = _mm256_set1_epi32(32 * a.x16[2 * b]), xb = _mm256_set1_epi32(32 * a.x16[2 * b + 1]);
    q4c_next(a, b, np, kt, nk, nks);
    for (int64_t p = p_begin; p < p_end; p++) {
      const bool ahead = p + Q4C_AHEAD < p_end, far = p + Q4C_FAR < p_end;
      if (ahead) {
        _mm_prefetch((const char*)r + 64 * (p + Q4C_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)r + np + 64 * (p + Q4C_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)ks + 128 * (p + Q4C_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)ks + 128 * (p + Q4C_AHEAD) + 64, _MM_HINT_T0);
      } else if (nk.cnt && p + Q4C_AHEAD - p_end + p_begin < p_end) {
        q6c_prefetch_block(nk, nks, np, p + Q4C_AHEAD - p_end + p_begin, 1);
      }
      __m256i sa[8], sb[8];
      for (int i = 0; i < 8; i++) sa[i] = sb[i] = _mm256_setzero_si256();
      q6c_half_256(k, 0, k.cnt_a, np, p, ahead, far, sa);
      q6c_half_256(k, k.cnt_a, k.cnt, np, p, ahead, far, sb);
      for (int i = 0; i < 8; i++) {
        const int64_t row = 64 * p + 8 * i;
        const __m256i sca = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(r + row)));
        const __m256i scb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(r + np + row)));
        const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(sa[i], xa), sca),
                                           _mm256_mullo_epi32(_mm256_sub_epi32(sb[i], xb), scb));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ks + 2 * row)));
        _mm256_storeu_ps(y + row, _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, vxd),
                                                  _mm256_loadu_ps(y + row)));
      }
    }
  }
}

#if defined(__AVX512BW__)
// pair_products_256 and widen_sums_256 in 512-bit registers, two passes (128 rows) at a time:
// acc[v]'s halves rows 16v + 0..15 of pass p, then of p + 1; sum[2v + h] those rows of pass p + h
__attribute__((always_inline)) inline void pair_products_512(__m512i alo, __m512i ahi, __m512i blo, __m512i bhi, __m512i xx, __m512i* acc) {
  acc[0] = _mm512_add_epi16(acc[0], _mm512_maddubs_epi16(_mm512_unpacklo_epi8(alo, blo), xx));
  acc[1] = _mm512_add_epi16(acc[1], _mm512_maddubs_epi16(_mm512_unpackhi_epi8(alo, blo), xx));
  acc[2] = _mm512_add_epi16(acc[2], _mm512_maddubs_epi16(_mm512_unpacklo_epi8(ahi, bhi), xx));
  acc[3] = _mm512_add_epi16(acc[3], _mm512_maddubs_epi16(_mm512_unpackhi_epi8(ahi, bhi), xx));
}

__attribute__((always_inline)) inline void widen_sums_512(const __m512i* acc, __m512i* sum) {
  for (int v = 0; v < 4; v++) {
    sum[2 * v] = _mm512_add_epi32(sum[2 * v], _mm512_cvtepi16_epi32(_mm512_castsi512_si256(acc[v])));
    sum[2 * v + 1] = _mm512_add_epi32(sum[2 * v + 1], _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(acc[v], 1)));
  }
}

// The same two passes (128 rows) at a time, as q4c_passes_512 does: each 256-bit half of a
// register holds what the 256-bit code holds for its pass; the same integers and floats.
inline void q6c_codes_512(const uint8_t* run, int64_t np, int64_t p, __m512i& lo, __m512i& hi) {
  const __m512i mask = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i v = _mm512_loadu_si512((const void*)(run + 32 * p));
  const __m512i h2 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(run + np / 2 + 16 * p)));
  const __m512i h = _mm512_shuffle_i64x2(h2, h2, 0x50);  // pass p's 16 bytes twice, then p + 1's
  lo = _mm512_or_si512(_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_sllv_epi32(h, _mm512_setr_epi32(
      4, 4, 4, 4, 2, 2, 2, 2, 4, 4, 4, 4, 2, 2, 2, 2)), m30));
  hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), _mm512_and_si512(_mm512_srlv_epi32(h,
      _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2)), m30));
}

// sum[2v + h] (rows 64 (p + h) + 16v .. + 15, 32 bits) += the block's pairs [s0, s1)
inline void q6c_half_512(const Q4CBlock& k, int s0, int s1, int64_t np, int64_t p, bool ahead, bool far,
                         __m512i* sum) {
  for (int s = s0; s < s1; s += 2) {
    const int e = std::min(s + 2, s1);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int i = s; i < e; i++) {
      for (const uint8_t* run : {k.ra[i], k.rb[i]}) {  // (two passes: every line of theirs)
        if (ahead) {
          _mm_prefetch((const char*)run + 32 * (p + Q4C_AHEAD), _MM_HINT_T0);
          _mm_prefetch((const char*)run + 32 * (p + Q4C_AHEAD) + 63, _MM_HINT_T0);
          _mm_prefetch((const char*)run + np / 2 + 16 * (p + Q4C_AHEAD), _MM_HINT_T0);
        }
        if (far) {
          _mm_prefetch((const char*)run + 32 * (p + Q4C_FAR), _MM_HINT_T1);
          _mm_prefetch((const char*)run + np / 2 + 16 * (p + Q4C_FAR), _MM_HINT_T1);
        }
      }
      __m512i alo, ahi, blo, bhi;
      q6c_codes_512(k.ra[i], np, p, alo, ahi);
      q6c_codes_512(k.rb[i], np, p, blo, bhi);
      pair_products_512(alo, ahi, blo, bhi, _mm512_set1_epi16(k.x[i]), acc);
    }
    widen_sums_512(acc, sum);
  }
}

inline void q6c_passes_512(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  const int64_t nb = a.k / 32, np = q4c_rows(a.n);  // (p_end - p_begin even)
  const uint8_t* kt = q4c_tail(a, np);
  Q4CBlock k, nk;
  const uint8_t* nks;
  for (int64_t b = 0; b < nb; b++) {
    if (q4c_block(a, b, np, k) == 0) continue;
    const uint8_t* r = k.r;
    const uint8_t* ks = kt + 2 * np * (b / 8);
    const __m512 vxd = _mm512_set1_ps(a.xd[b]);
    const __m512i xa = _mm512_set1_epi32(32 * a.x16[2 * b]), xb = _mm512_set1_epi32(32 * a.x16[2 * b + 1]);
    q4c_next(a, b, np, kt, nk, nks);
    for (int64_t p = p_begin; p < p_end; p += 2) {
      const bool ahead = p + 1 + Q4C_AHEAD < p_end, far = p + 1 + Q4C_FAR < p_end;
      if (ahead) {
        _mm_prefetch((const char*)r + 64 * (p + Q4C_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)r + 64 * (p + Q4C_AHEAD) + 64, _MM_HINT_T0);
        _mm_prefetch((const char*)r + np + 64 * (p + Q4C_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)r + np + 64 * (p + Q4C_AHEAD) + 64, _MM_HINT_T0);
        for (int o = 0; o < 256; o += 64) _mm_prefetch((const char*)ks + 128 * (p + Q4C_AHEAD) + o, _MM_HINT_T0);
      } else if (nk.cnt && p + Q4C_AHEAD - p_end + p_begin + 1 < p_end) {
        q6c_prefetch_block(nk, nks, np, p + Q4C_AHEAD - p_end + p_begin, 2);
      }
      __m512i sa[8], sb[8];
      for (int i = 0; i < 8; i++) sa[i] = sb[i] = _mm512_setzero_si512();
      q6c_half_512(k, 0, k.cnt_a, np, p, ahead, far, sa);
      q6c_half_512(k, k.cnt_a, k.cnt, np, p, ahead, far, sb);
      for (int v = 0; v < 4; v++) {
        for (int h = 0; h < 2; h++) {
          const int64_t row = 64 * (p + h) + 16 * v;
          const __m512i sca = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(r + row)));
          const __m512i scb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(r + np + row)));
          const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(sa[2 * v + h], xa), sca),
                                             _mm512_mullo_epi32(_mm512_sub_epi32(sb[2 * v + h], xb), scb));
          const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ks + 2 * row)));
          _mm512_storeu_ps(y + row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, vxd),
                                                    _mm512_loadu_ps(y + row)));
        }
      }
    }
  }
}
#endif

#if defined(__AVX512BW__)
// The same product two passes (128 rows) at a time in 512-bit registers: a run's 64 bytes for
// rows 64p..64p+127 are passes p and p+1 side by side, and every byte operation above works
// within 128-bit lanes, so each 256-bit half of a register holds what the 256-bit code holds for
// its pass (acc[v]'s halves: rows 16v..16v+15 of pass p, then of p+1). The same integer sums,
// and the same float operations on each row, so the same floats.
inline void q4c_passes_512(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  const int64_t nb = a.k / 32, np = q4c_rows(a.n);  // (p_end - p_begin even)
  const __m512i mask = _mm512_set1_epi8(0x0F);
  Q4CBlock k;
  const uint8_t* kt = a.kind == Q4C_Q4_K ? q4c_tail(a, np) : nullptr;
  int64_t sb_read = -1;  // the last super-block whose d and dmin were asked for
  __m512i xs[16];
  Q4CBlock nk;  // the next block with a kept channel
  const uint8_t* nks;
  for (int64_t b = 0; b < nb; b++) {
    if (q4c_block(a, b, np, k) == 0) continue;
    const int cnt = k.cnt;
    const uint8_t* r = k.r;
    const uint8_t* ks = kt ? kt + 4 * np * (b / 8) : nullptr;  // a Q4_K matrix's d and dmin here
    const uint8_t* ks_new = ks && b / 8 != sb_read ? ks : nullptr;
    sb_read = b / 8;
    const uint8_t* const* ra = k.ra;
    const uint8_t* const* rb = k.rb;
    for (int i = 0; i < cnt; i++) xs[i] = _mm512_set1_epi16(k.x[i]);
    const __m512 vxd = _mm512_set1_ps(a.xd[b]), vxs = _mm512_set1_ps(a.xs[b]);
    q4c_next(a, b, np, kt, nk, nks);  // (as above)
    for (int64_t p = p_begin; p < p_end; p += 2) {
      const bool ahead = p + 1 + Q4C_AHEAD < p_end, far = p + 1 + Q4C_FAR < p_end;
      if (ahead) {
        q4c_prefetch_scales(a, r, ks_new, np, p + Q4C_AHEAD, 2);
      } else if (nk.cnt && p + Q4C_AHEAD - p_end + p_begin + 1 < p_end) {
        const int64_t pn = p + Q4C_AHEAD - p_end + p_begin;
        q4c_prefetch_block(a, nk, nks, np, pn, 2);
      }
      __m512i sum[8];  // sum[2v + h]: rows 64 (p + h) + 16v .. + 15, in 32 bits
      for (int i = 0; i < 8; i++) sum[i] = _mm512_setzero_si512();
      for (int s = 0; s < cnt; s += 8) {
        const int e = std::min(s + 8, cnt);
        __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                          _mm512_setzero_si512()};
        for (int i = s; i < e; i++) {
          const uint8_t *pa = ra[i] + 32 * p, *pb = rb[i] + 32 * p;
          if (ahead) {  // (a run's 64 bytes may straddle two lines)
            _mm_prefetch((const char*)pa + 32 * Q4C_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)pa + 32 * Q4C_AHEAD + 63, _MM_HINT_T0);
            _mm_prefetch((const char*)pb + 32 * Q4C_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char*)pb + 32 * Q4C_AHEAD + 63, _MM_HINT_T0);
          }
          if (far) {  // (a line a run for the two passes)
            _mm_prefetch((const char*)pa + 32 * Q4C_FAR, _MM_HINT_T1);
            _mm_prefetch((const char*)pb + 32 * Q4C_FAR, _MM_HINT_T1);
          }
          const __m512i va = _mm512_loadu_si512((const void*)pa), vb = _mm512_loadu_si512((const void*)pb);
          const __m512i xx = xs[i];
          const __m512i alo = _mm512_and_si512(va, mask), ahi = _mm512_and_si512(_mm512_srli_epi16(va, 4), mask);
          const __m512i blo = _mm512_and_si512(vb, mask), bhi = _mm512_and_si512(_mm512_srli_epi16(vb, 4), mask);
          pair_products_512(alo, ahi, blo, bhi, xx, acc);
        }
        widen_sums_512(acc, sum);
      }
      for (int v = 0; v < 4; v++) {
        for (int h = 0; h < 2; h++) {
          const int64_t row = 64 * (p + h) + 16 * v;
          __m512 d, m;
          if (a.kind == Q4C_Q4_K) {  // d * sc and -dmin * mn
            const __m512 sd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ks + 2 * row)));
            const __m512 sm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ks + 2 * np + 2 * row)));
            d = _mm512_mul_ps(sd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(r + row)))));
            m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(sm, _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(r + np + row))))));
          } else {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(r + 2 * row)));
            m = a.kind == Q4C_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(r + 2 * np + 2 * row)))
                                   : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
          }
          __m512 acc_y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[2 * v + h]), _mm512_mul_ps(d, vxd), _mm512_loadu_ps(y + row));
          _mm512_storeu_ps(y + row, _mm512_fmadd_ps(m, vxs, acc_y));
        }
      }
    }
  }
}

// 512-bit over pairs of passes, the last odd one 256-bit (its rows' sums are the same either way)
inline void q4c_passes(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  const int64_t even = p_begin + (p_end - p_begin) / 2 * 2;
  const bool q6 = a.kind == Q4C_Q6_K;
  if (even > p_begin) (q6 ? q6c_passes_512 : q4c_passes_512)(a, p_begin, even, y);
  if (even < p_end) (q6 ? q6c_passes_256 : q4c_passes_256)(a, even, p_end, y);
}
#else
inline void q4c_passes(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  (a.kind == Q4C_Q6_K ? q6c_passes_256 : q4c_passes_256)(a, p_begin, p_end, y);
}
#endif
