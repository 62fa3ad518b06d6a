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
// q4x16's and q4kx16's) is held as np = q4c_rows(n) rows (a multiple of 128, the extra rows
// zero), in passes of 128 rows. Block b (input channels 32b..32b+31) is one region:
//   [0, 2 np)           d: np f16 scales, row 0 first
//   [2 np, 4 np)        m: np f16 offsets (w = d * q + m; only in a matrix with offsets, Q4_1's;
//                       a Q4_0 block's w = d * (q - 8) needs none)
// or, for Q4_K (w = d * sc * q - dmin * mn, the block's 6-bit sc and mn, the super-block's d
// and dmin):
//   [0, np)             sc: np bytes, row 0 first
//   [np, 2 np)          mn: np bytes
//   then 32 runs of np/2 bytes, channel 0 first: channel j's codes for every row, one 64-byte
//   line a pass. Byte 16 L + 4 m + t of a pass's line (L, m, t = 0..3) holds row 16 m + 4 L + t
//   of the pass in its low nibble and that row + 64 in its high one: the order in which two
//   byte interleaves of four lines (unpacklo/hi_epi8, then unpacklo/hi_epi16, within 128-bit
//   lanes) leave them, so that every sum below lands on 16 consecutive rows.
// After the k / 32 regions a Q4_K matrix holds per super-block (256 channels) its rows' d (np f16)
// then their dmin (np f16): a row's block scale is d * sc, its offset -dmin * mn, computed in
// float as the q4kx16 product computes them (4.625 bits a weight, the q4kx16 bytes).
//
// The product pairs the kept channels of a block (an odd one with itself, its second input 0;
// the pairs of a block made even with a pair of input 0 likewise). With VNNI (`dpbusd`, four u8
// x s8 products summed into a 32-bit lane) two pairs are a quad: their four lines interleaved
// byte by byte, then 16 bits by 16 bits, give four vectors whose 32-bit lanes each hold one
// row's four codes, against the four inputs in every lane. The whole byte is multiplied (its low
// code plus 16 times its high one); a second product over the high nibbles alone gives the high
// rows' sums, and the low rows' are the first minus 16 times them: 8 products, 8 interleaves, 4
// shifts and 4 masks a quad and pass, summed in 32 bits (see BENCHMARKS.md, "The q4c product
// four channels a lane"). Without VNNI the nibbles
// are split first and `maddubs` sums each row's pair of products in 16 bits; up to 8 pairs (a
// segment: at most 8 * 2 * 15 * 127) are summed so, then each 128-bit lane's four groups of four
// 16-bit sums are widened into the same 32-bit lanes. A block's integer sums then meet the rows'
// floats as the q4x16 product's do (y = fma(sum, d * xd, y), then y = fma(m, xd * the inputs'
// sum, y), m = -8 d for Q4_0), block after block, so the two give the same floats for the same
// sparse input: a skipped block (no kept channel) adds exactly 0 there too. Threads take passes.
// A block's runs are read side by side, a pass at a time, the next lines asked for ahead.
#ifndef Q4C_AHEAD
#define Q4C_AHEAD 4  // passes between a run's prefetch and its use
#endif
// On the AVX-512 classes each kept run is also asked for into L2 this many passes ahead
// (prefetcht1), then into every level Q4C_AHEAD passes ahead: a block's 16-32 runs read side by
// side are more lines in flight than L1 keeps waiting for (0.91-0.98x the time on a Zen 5). Not
// by the AVX2 body (0: none), which runs on the CPUs without AVX-512: on an AVX2-only EPYC Milan
// the requests into L2 cost more than they gave, a 7B gate/up from memory 1.06-1.19x as fast
// without them (40% and 25% of its channels dropped), its q/k/v the same (benchmarks/q4c_walk.cpp;
// BENCHMARKS.md, "The AVX2 q4c product without its requests into L2").
#ifndef Q4C_FAR
#if defined(__AVX512BW__)
#define Q4C_FAR 8
#else
#define Q4C_FAR 0
#endif
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
  const uint8_t* ta[16];  // (Q6_K) the two channels' runs of top bits
  const uint8_t* tb[16];
  int16_t x[16];
};

// A channel's bytes in a block's runs: a Q4 matrix's codes, a Q6_K matrix's low 4 bits (its top
// 2 bits are in runs of their own after those, np / 4 bytes each: Q4CBlock's ta, tb)
inline int64_t q4c_run(int64_t np) { return np / 2; }

inline int q4c_block(const Q4CArgs& a, int64_t b, int64_t np, Q4CBlock& k) {
  const int32_t first = a.first[b];
  k.cnt = a.first[b + 1] - first;
  if (k.cnt == 0) return 0;
  k.r = a.w + b * q4c_region(np, a.kind);
  const uint8_t* nib = k.r + (a.kind == Q4C_Q4_1 ? 4 : 2) * np;
  k.cnt_a = 0;
  for (int i = 0; i < k.cnt; i++) {
    const Q4CPair c = a.pairs[first + i];
    k.ra[i] = nib + c.j0 * q4c_run(np);
    k.rb[i] = nib + c.j1 * q4c_run(np);
    if (a.kind == Q4C_Q6_K) k.ta[i] = nib + 16 * np + c.j0 * np / 4, k.tb[i] = nib + 16 * np + c.j1 * np / 4;
    k.x[i] = (int16_t)(uint16_t)((uint8_t)c.x0 | ((uint16_t)(uint8_t)c.x1 << 8));
    k.cnt_a += c.j0 < 16;
  }
  return k.cnt;
}

// The first block after b with a kept channel (k filled; k.cnt 0 where none is left), and its
// K-quant super-block's values where the product has not asked for them yet (else null)
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

// A K-quant matrix's super-blocks' values (Q4_K's d and dmin, Q6_K's d), after its blocks (the end
// of the blocks otherwise)
inline const uint8_t* q4c_tail(const Q4CArgs& a, int64_t np) { return a.w + a.k / 32 * q4c_region(np, a.kind); }

// The lines of a block's scales (and offsets) for pass p (r: the block's region); with ks (a
// K-quant matrix's super-block values of the block's super-block: Q4_K's d and dmin, Q6_K's d,
// given at the first block of it the product reads) theirs too, which the super-block's later
// blocks find cached
PREFETCHES void q4c_prefetch_scales(const Q4CArgs& a, const uint8_t* r, const uint8_t* ks, int64_t np, int64_t p) {
  if (a.kind == Q4C_Q4_K || a.kind == Q4C_Q6_K) {  // a byte a row of sc and mn (Q6_K: of each half's sc)
    for (int64_t o = 0; o < 128; o += 64) {
      _mm_prefetch((const char*)r + 128 * p + o, _MM_HINT_T0);
      _mm_prefetch((const char*)r + np + 128 * p + o, _MM_HINT_T0);
    }
    for (int64_t o = 0; ks && o < 256; o += 64) {  // a f16 a row of d (and Q4_K's dmin)
      _mm_prefetch((const char*)ks + 256 * p + o, _MM_HINT_T0);
      if (a.kind == Q4C_Q4_K) _mm_prefetch((const char*)ks + 2 * np + 256 * p + o, _MM_HINT_T0);
    }
    return;
  }
  for (int64_t o = 0; o < 256; o += 64) {
    _mm_prefetch((const char*)r + 256 * p + o, _MM_HINT_T0);
    if (a.kind == Q4C_Q4_1) _mm_prefetch((const char*)r + 2 * np + 256 * p + o, _MM_HINT_T0);
  }
}

// All of a block's lines for pass p: its scales (as above) and each kept channel's line (a
// Q6_K channel's line of top bits too: 32 bytes a pass)
PREFETCHES void q4c_prefetch_block(const Q4CArgs& a, const Q4CBlock& k, const uint8_t* ks, int64_t np, int64_t p) {
  q4c_prefetch_scales(a, k.r, ks, np, p);
  for (int i = 0; i < k.cnt; i++) {
    _mm_prefetch((const char*)k.ra[i] + 64 * p, _MM_HINT_T0);
    _mm_prefetch((const char*)k.rb[i] + 64 * p, _MM_HINT_T0);
    if (a.kind == Q4C_Q6_K) {
      _mm_prefetch((const char*)k.ta[i] + 32 * p, _MM_HINT_T0);
      _mm_prefetch((const char*)k.tb[i] + 32 * p, _MM_HINT_T0);
    }
  }
}

// The walk every body below shares: block after block with a kept channel, pass after pass of
// [p_begin, p_end), each pass's scales asked for Q4C_AHEAD passes ahead, and over a block's last
// passes the next block's first ones: a thread's share of a run can be a few passes (the output
// projection's 4,096 rows: 16 a thread of two), and without them a quarter of its bytes came
// unannounced, at every block. body(k, ks, b, p, ahead, far): block k (ks its super-block's
// values, b its index), pass p; `ahead` and `far` whether pass p + Q4C_AHEAD and
// p + Q4C_FAR are still the thread's (its lines then asked for by the body).
template <int KIND, typename Body>
__attribute__((always_inline)) inline void q4c_walk(const Q4CArgs& a, int64_t p_begin, int64_t p_end, const Body& body) {
  const int64_t nb = a.k / 32, np = q4c_rows(a.n);
  const uint8_t* kt = KIND == Q4C_Q4_K || KIND == Q4C_Q6_K ? q4c_tail(a, np) : nullptr;
  int64_t sb_read = -1;  // the last super-block whose values were asked for
  Q4CBlock k, nk;  // this block, the next with a kept channel
  const uint8_t* nks;
  for (int64_t b = 0; b < nb; b++) {
    if (q4c_block(a, b, np, k) == 0) continue;
    const uint8_t* ks = kt ? kt + q4c_tail_sb(np, KIND) * (b / 8) : nullptr;
    const uint8_t* ks_new = ks && b / 8 != sb_read ? ks : nullptr;
    sb_read = b / 8;
    q4c_next(a, b, np, kt, nk, nks);
    for (int64_t p = p_begin; p < p_end; p++) {
      const bool ahead = p + Q4C_AHEAD < p_end, far = Q4C_FAR > 0 && p + Q4C_FAR < p_end;
      if (ahead) {
        q4c_prefetch_scales(a, k.r, ks_new, np, p + Q4C_AHEAD);
      } else if (nk.cnt && p + Q4C_AHEAD - p_end + p_begin < p_end) {
        q4c_prefetch_block(a, nk, nks, np, p + Q4C_AHEAD - p_end + p_begin);
      }
      body(k, ks, b, p, ahead, far);
    }
  }
}

// A pair's lines for pass p + Q4C_AHEAD into every level, and where `far` those of p + Q4C_FAR
// into L2
PREFETCHES void q4c_prefetch_pair(const uint8_t* pa, const uint8_t* pb, bool ahead, bool far) {
  if (ahead) {
    _mm_prefetch((const char*)pa + 64 * Q4C_AHEAD, _MM_HINT_T0);
    _mm_prefetch((const char*)pb + 64 * Q4C_AHEAD, _MM_HINT_T0);
  }
  if (far) {
    _mm_prefetch((const char*)pa + 64 * Q4C_FAR, _MM_HINT_T1);
    _mm_prefetch((const char*)pb + 64 * Q4C_FAR, _MM_HINT_T1);
  }
}

// ---- the rows' floats: a block's 32-bit sums of QV::LANES rows from `row` into y ----
// (the q4x16 / q4kx16 products' float operations on each row, in their order)
struct Q4CFloats {
  QV::F vxd, vxs;
  template <int KIND>
  __attribute__((always_inline)) inline void add(const uint8_t* r, const uint8_t* ks, int64_t np, int64_t row,
                                                 QV::I sum, float* y) const {
    if (KIND == Q4C_Q4_K) {  // d * sc and -dmin * mn
      const QV::F d = QV::fmul(QV::halves(ks + 2 * row), QV::i2f(QV::u8x(r + row)));
      const QV::F m = QV::fmul(QV::halves(ks + 2 * np + 2 * row), QV::i2f(QV::u8x(r + np + row)));
      QV::store(y + row, QV::fnma(m, vxs, QV::fma(QV::i2f(sum), QV::fmul(d, vxd), QV::fload(y + row))));
      return;
    }
    const QV::F d = QV::halves(r + 2 * row);
    const QV::F m = KIND == Q4C_Q4_1 ? QV::halves(r + 2 * np + 2 * row) : QV::fmul(d, QV::fset(-8.0f));
    QV::store(y + row, QV::fma(m, vxs, QV::fma(QV::i2f(sum), QV::fmul(d, vxd), QV::fload(y + row))));
  }
};

// A Q6_K block's sums of QV::LANES rows from `row` (sa, sb: its two halves'; xa, xb: 32 times
// their inputs' sums) into y: t = (sa - xa) sc_a + (sb - xb) sc_b, y = fma(t, d * xd, y)
__attribute__((always_inline)) inline void q6c_floats(const uint8_t* r, const uint8_t* ks, int64_t np, int64_t row,
                                                      QV::I sa, QV::I sb, QV::I xa, QV::I xb, QV::F vxd, float* y) {
  const QV::I t = QV::add32(QV::mul32(QV::sub32(sa, xa), QV::s8x(r + row)),
                            QV::mul32(QV::sub32(sb, xb), QV::s8x(r + np + row)));
  QV::store(y + row, QV::fma(QV::i2f(t), QV::fmul(QV::halves(ks + 2 * row), vxd), QV::fload(y + row)));
}

// ---- A Q6_K matrix held by input channel (kind Q4C_Q6_K) ----
// (n, k) Q6_K (w = d * sc * (q - 32), q in 0..63, an 8-bit sc a row per 16 channels, a f16 d a
// row per super-block of 256: the q6kx16 bytes, 6.5625 bits a weight). Block b is one region:
//   [0, np)        the rows' sc of channels 32b..32b+15, a byte a row, row 0 first
//   [np, 2 np)     those of channels 32b+16..32b+31
//   [2 np, 18 np)  32 runs of np / 2 bytes, channel 0 first: the low 4 bits of channel j's codes
//                  as a Q4 run above
//   [18 np, 26 np) 32 runs of np / 4 bytes: their top 2 bits, 32 bytes a pass: byte i holds,
//                  from bit 0, those of the codes in the low and the high nibble of byte i of
//                  the pass's line, then of byte i + 32
// After the blocks, per super-block its rows' d (np f16).
// q4c_product pairs a Q6_K matrix's channels within each 16 (those of 0..15 first, each half's
// pairs made even), so that a block's two halves sum apart: per pair the codes (u8, 0..63)
// against the two inputs in `maddubs` (16-bit sums of at most 2 * 63 * 127), two pairs summed in
// 16 bits, then widened; with VNNI two pairs a quad in `dpbusd`, as the Q4 products. A row's
// block gives t = (sum_a - 32 x16_a) sc_a + (sum_b - 32 x16_b) sc_b in 32-bit integers and
// y = fma(t, d * xd, y): the q6kx16 product's integers and floats, block after block, for the
// same sparse input (a block with no kept channel adds 0 there too).

// A run's lines for pass p + Q4C_AHEAD into every level (its top bits: a line every two passes),
// and where `far` those of pass p + Q4C_FAR into L2
PREFETCHES void q6c_prefetch_run(const uint8_t* run, const uint8_t* top, int64_t p, bool ahead, bool far) {
  if (ahead) {
    _mm_prefetch((const char*)run + 64 * (p + Q4C_AHEAD), _MM_HINT_T0);
    if ((p & 1) == 0) _mm_prefetch((const char*)top + 32 * (p + Q4C_AHEAD), _MM_HINT_T0);
  }
  if (far) {
    _mm_prefetch((const char*)run + 64 * (p + Q4C_FAR), _MM_HINT_T1);
    if ((p & 1) == 0) _mm_prefetch((const char*)top + 32 * (p + Q4C_FAR), _MM_HINT_T1);
  }
}

#if !defined(__AVX512BW__)
// ---- 256-bit (AVX2): a pass's line in two halves of 32 bytes ----
// (the products without VNNI: the nibbles split, `maddubs`, 16-bit sums, widened)
// acc[2 u + h] (16 bits) += a pair's products over its two channels' codes of the low (u = 0)
// and high (u = 1) rows (a byte each), bytes 8 h + 0..7 of each 128-bit lane
__attribute__((always_inline)) inline void split_products_256(__m256i alo, __m256i ahi, __m256i blo, __m256i bhi, __m256i xx, __m256i* acc) {
  acc[0] = _mm256_add_epi16(acc[0], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(alo, blo), xx));
  acc[1] = _mm256_add_epi16(acc[1], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(alo, blo), xx));
  acc[2] = _mm256_add_epi16(acc[2], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(ahi, bhi), xx));
  acc[3] = _mm256_add_epi16(acc[3], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(ahi, bhi), xx));
}

// the same over a pair's two 4-bit lines, their nibbles split first
__attribute__((always_inline)) inline void pair_products_256(__m256i va, __m256i vb, __m256i xx, __m256i* acc) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  split_products_256(_mm256_and_si256(va, mask), _mm256_and_si256(_mm256_srli_epi16(va, 4), mask),
                     _mm256_and_si256(vb, mask), _mm256_and_si256(_mm256_srli_epi16(vb, 4), mask), xx, acc);
}

// sum[4 u + 2 h + i] (32 bits) += acc[2 u + h]'s 16-bit lanes 4 i + 0..3 of each 128-bit lane
// (sign-extended): the low (u = 0) and high (u = 1) rows 16 (2 h + i) + 4 L + t
__attribute__((always_inline)) inline void widen_sums_256(const __m256i* acc, __m256i* sum) {
  for (int v = 0; v < 4; v++) {
    sum[2 * v] = _mm256_add_epi32(sum[2 * v], _mm256_srai_epi32(_mm256_unpacklo_epi16(acc[v], acc[v]), 16));
    sum[2 * v + 1] = _mm256_add_epi32(sum[2 * v + 1], _mm256_srai_epi32(_mm256_unpackhi_epi16(acc[v], acc[v]), 16));
  }
}

// Pass p of block k (ks its super-block's values) into y, in two halves (bytes 32 eta .. + 31 of
// each line: rows 16 g + 8 eta + 0..7 of each group g of 16, low and high); per half, segments
// of up to 8 pairs summed in 16 bits, then widened: sum[4 u + g] rows 64 u + 16 g + 8 eta + 0..7
template <int KIND>
inline void q4c_pass(const Q4CBlock& k, const uint8_t* ks, int64_t np, const Q4CFloats& fl, int64_t p, bool ahead,
                     bool far, float* y) {
  for (int i = 0; i < k.cnt; i++) q4c_prefetch_pair(k.ra[i] + 64 * p, k.rb[i] + 64 * p, ahead, far);
  for (int eta = 0; eta < 2; eta++) {
    __m256i sum[8];
    for (int i = 0; i < 8; i++) sum[i] = _mm256_setzero_si256();
    for (int s = 0; s < k.cnt; s += 8) {
      __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int i = s; i < std::min(s + 8, k.cnt); i++) {
        const __m256i va = _mm256_loadu_si256((const __m256i*)(k.ra[i] + 64 * p + 32 * eta));
        const __m256i vb = _mm256_loadu_si256((const __m256i*)(k.rb[i] + 64 * p + 32 * eta));
        pair_products_256(va, vb, _mm256_set1_epi16(k.x[i]), acc);
      }
      widen_sums_256(acc, sum);
    }
    for (int i = 0; i < 8; i++) fl.add<KIND>(k.r, ks, np, 128 * p + 64 * (i / 4) + 16 * (i % 4) + 8 * eta, sum[i], y);
  }
}

// A run's 6-bit codes of half eta of pass p as the bytes of a Q4 line (low nibble: the low rows'
// codes, high nibble's place: the high rows'), in two vectors: lo (low rows), hi (high rows);
// (split_products_256 takes them as they are)
inline void q6c_codes_256(const uint8_t* run, const uint8_t* top, int64_t p, int eta, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(run + 64 * p + 32 * eta));
  __m256i h = _mm256_loadu_si256((const __m256i*)(top + 32 * p));
  // bytes 0..31 of the line take bits 0-3 of the top bytes, bytes 32..63 bits 4-7: onto bits 4-5
  // (the low rows') and 6-7 (the high rows'), 16-bit shifts (what crosses a byte is masked off)
  if (eta == 0) h = _mm256_slli_epi16(h, 4);
  lo = _mm256_or_si256(_mm256_and_si256(v, mask), _mm256_and_si256(h, m30));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
}

// sum[4 u + g] (rows 64 u + 16 g + 8 eta + 0..7, 32 bits) += the block's pairs [s0, s1) over half eta of pass p
inline void q6c_half_256(const Q4CBlock& k, int s0, int s1, int64_t p, int eta, __m256i* sum) {
  for (int s = s0; s < s1; s += 2) {
    const int e = std::min(s + 2, s1);
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = s; i < e; i++) {
      __m256i alo, ahi, blo, bhi;
      q6c_codes_256(k.ra[i], k.ta[i], p, eta, alo, ahi);
      q6c_codes_256(k.rb[i], k.tb[i], p, eta, blo, bhi);
      split_products_256(alo, ahi, blo, bhi, _mm256_set1_epi16(k.x[i]), acc);
    }
    widen_sums_256(acc, sum);
  }
}

// Pass p of a Q6_K block k into y (xa, xb: 32 times its halves' input sums)
inline void q6c_pass(const Q4CBlock& k, const uint8_t* ks, int64_t np, QV::F vxd, QV::I xa, QV::I xb, int64_t p,
                     bool ahead, bool far, float* y) {
  for (int i = 0; i < k.cnt; i++) {
    q6c_prefetch_run(k.ra[i], k.ta[i], p, ahead, far);
    q6c_prefetch_run(k.rb[i], k.tb[i], p, ahead, far);
  }
  for (int eta = 0; eta < 2; eta++) {
    __m256i sa[8], sb[8];
    for (int i = 0; i < 8; i++) sa[i] = sb[i] = _mm256_setzero_si256();
    q6c_half_256(k, 0, k.cnt_a, p, eta, sa);
    q6c_half_256(k, k.cnt_a, k.cnt, p, eta, sb);
    for (int i = 0; i < 8; i++)
      q6c_floats(k.r, ks, np, 128 * p + 64 * (i / 4) + 16 * (i % 4) + 8 * eta, sa[i], sb[i], xa, xb, vxd, y);
  }
}

#else
// ---- 512-bit: a whole pass (a run's 64-byte line) a vector; each sum one 16-row group ----
// split_products_256 in 512-bit registers (each 256-bit half what it holds for its half line)
__attribute__((always_inline)) inline void split_products_512(__m512i alo, __m512i ahi, __m512i blo, __m512i bhi, __m512i xx, __m512i* acc) {
  acc[0] = _mm512_add_epi16(acc[0], _mm512_maddubs_epi16(_mm512_unpacklo_epi8(alo, blo), xx));
  acc[1] = _mm512_add_epi16(acc[1], _mm512_maddubs_epi16(_mm512_unpackhi_epi8(alo, blo), xx));
  acc[2] = _mm512_add_epi16(acc[2], _mm512_maddubs_epi16(_mm512_unpacklo_epi8(ahi, bhi), xx));
  acc[3] = _mm512_add_epi16(acc[3], _mm512_maddubs_epi16(_mm512_unpackhi_epi8(ahi, bhi), xx));
}

// sum[4 u + m] (32 bits) += acc[2 u + h]'s 16-bit lanes 4 (2 h + i) + 0..3 of each 128-bit lane
// (m = 2 h + i): rows 64 u + 16 m + 4 L + t, sign-extended
__attribute__((always_inline)) inline void widen_sums_512(const __m512i* acc, __m512i* sum) {
  for (int v = 0; v < 4; v++) {
    sum[2 * v] = _mm512_add_epi32(sum[2 * v], _mm512_srai_epi32(_mm512_unpacklo_epi16(acc[v], acc[v]), 16));
    sum[2 * v + 1] = _mm512_add_epi32(sum[2 * v + 1], _mm512_srai_epi32(_mm512_unpackhi_epi16(acc[v], acc[v]), 16));
  }
}

#if defined(__AVX512VNNI__)
// ---- VNNI: a quad (pairs i and i + 1 of a block) a `dpbusd` lane ----
// its four 8-bit inputs as each lane takes them (pair i's x0 x1, then pair i + 1's)
inline int32_t quad_inputs(const Q4CBlock& k, int i) {
  return (int32_t)((uint32_t)(uint16_t)k.x[i] | (uint32_t)(uint16_t)k.x[i + 1] << 16);
}

// The quad's four lines (channels a, b, c, d) interleaved byte by byte, then 16 bits by 16 bits
// (within 128-bit lanes): each 32-bit lane of q[m] one row's four codes (rows 16 m + 4 L + t)
__attribute__((always_inline)) inline void quad_lanes_512(__m512i va, __m512i vb, __m512i vc, __m512i vd, __m512i* q) {
  const __m512i ab0 = _mm512_unpacklo_epi8(va, vb), ab1 = _mm512_unpackhi_epi8(va, vb);
  const __m512i cd0 = _mm512_unpacklo_epi8(vc, vd), cd1 = _mm512_unpackhi_epi8(vc, vd);
  q[0] = _mm512_unpacklo_epi16(ab0, cd0), q[1] = _mm512_unpackhi_epi16(ab0, cd0);
  q[2] = _mm512_unpacklo_epi16(ab1, cd1), q[3] = _mm512_unpackhi_epi16(ab1, cd1);
}

// F[m] += a Q4 quad's whole bytes' products (low rows + 16 times the high rows'), H[m] += its
// high nibbles' (the high rows'), over its four lines (x4: quad_inputs)
__attribute__((always_inline)) inline void q4_quad_sums_512(__m512i va, __m512i vb, __m512i vc, __m512i vd, __m512i x4,
                                                            __m512i* F, __m512i* H) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512i q[4];
  quad_lanes_512(va, vb, vc, vd, q);
  for (int m = 0; m < 4; m++) {
    F[m] = _mm512_dpbusd_epi32(F[m], q[m], x4);
    H[m] = _mm512_dpbusd_epi32(H[m], _mm512_and_si512(_mm512_srli_epi16(q[m], 4), mask), x4);
  }
}
#endif

// sum[4 u + g] (rows 64 u + 16 g + 0..15 of pass p, 32 bits) += block k's pairs' products
template <int KIND>
__attribute__((always_inline)) inline void q4c_sums_512(const Q4CBlock& k, int64_t p, bool ahead, bool far, __m512i* sum) {
#if defined(__AVX512VNNI__)
  // F[m]: the whole bytes' sums (low rows + 16 high rows), H[m]: the high rows'
  __m512i F[4], H[4];
  for (int i = 0; i < 4; i++) F[i] = H[i] = _mm512_setzero_si512();
  for (int i = 0; i < k.cnt; i += 2) {  // (a block's pairs are even: a quad is two)
    const uint8_t *pa = k.ra[i] + 64 * p, *pb = k.rb[i] + 64 * p, *pc = k.ra[i + 1] + 64 * p, *pd = k.rb[i + 1] + 64 * p;
    q4c_prefetch_pair(pa, pb, ahead, far);
    q4c_prefetch_pair(pc, pd, ahead, far);
    q4_quad_sums_512(_mm512_loadu_si512((const void*)pa), _mm512_loadu_si512((const void*)pb),
                     _mm512_loadu_si512((const void*)pc), _mm512_loadu_si512((const void*)pd),
                     _mm512_set1_epi32(quad_inputs(k, i)), F, H);
  }
  for (int g = 0; g < 4; g++) {
    sum[g] = _mm512_sub_epi32(F[g], _mm512_slli_epi32(H[g], 4));
    sum[4 + g] = H[g];
  }
#else
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 8; i++) sum[i] = _mm512_setzero_si512();
  for (int s = 0; s < k.cnt; s += 8) {
    const int e = std::min(s + 8, k.cnt);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int i = s; i < e; i++) {
      const uint8_t *pa = k.ra[i] + 64 * p, *pb = k.rb[i] + 64 * p;
      q4c_prefetch_pair(pa, pb, ahead, far);
      const __m512i va = _mm512_loadu_si512((const void*)pa), vb = _mm512_loadu_si512((const void*)pb);
      const __m512i xx = _mm512_set1_epi16(k.x[i]);
      const __m512i alo = _mm512_and_si512(va, mask), ahi = _mm512_and_si512(_mm512_srli_epi16(va, 4), mask);
      const __m512i blo = _mm512_and_si512(vb, mask), bhi = _mm512_and_si512(_mm512_srli_epi16(vb, 4), mask);
      split_products_512(alo, ahi, blo, bhi, xx, acc);
    }
    widen_sums_512(acc, sum);
  }
#endif
}

// Pass p of block k (ks its super-block's values) into y: the whole line a vector
template <int KIND>
inline void q4c_pass(const Q4CBlock& k, const uint8_t* ks, int64_t np, const Q4CFloats& fl, int64_t p, bool ahead,
                     bool far, float* y) {
  __m512i sum[8];  // sum[4 u + g]: rows 128 p + 64 u + 16 g .. + 15, in 32 bits
  q4c_sums_512<KIND>(k, p, ahead, far, sum);
  for (int i = 0; i < 8; i++) fl.add<KIND>(k.r, ks, np, 128 * p + 16 * i, sum[i], y);
}

// The Q6_K product a pass a vector (as the 256-bit body: the same integers and floats)
inline void q6c_codes_512(const uint8_t* run, const uint8_t* top, int64_t p, __m512i& lo, __m512i& hi) {
  const __m512i mask = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i v = _mm512_loadu_si512((const void*)(run + 64 * p));
  const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(top + 32 * p)));
  // (as q6c_codes_256: the first 32 bytes' top bits shifted up by 4, the others' where they are)
  const __m512i h = _mm512_mask_slli_epi32(t, 0x00FF, t, 4);
  lo = _mm512_or_si512(_mm512_and_si512(v, mask), _mm512_and_si512(h, m30));
  hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
}

#if defined(__AVX512VNNI__)
// sum[4 u + m] (rows 64 u + 16 m + 0..15 of pass p, 32 bits) += the block's pairs [s0, s1) two at a
// time (a half's pairs are even): the four channels' 6-bit codes interleaved as q4c_sums_512's
// quads, each lane's four products in `dpbusd`
inline void q6c_half_512(const Q4CBlock& k, int s0, int s1, int64_t p, bool ahead, bool far, __m512i* sum) {
  for (int i = s0; i < s1; i += 2) {
    __m512i lo[4], hi[4];
    const uint8_t* runs[4] = {k.ra[i], k.rb[i], k.ra[i + 1], k.rb[i + 1]};
    const uint8_t* tops[4] = {k.ta[i], k.tb[i], k.ta[i + 1], k.tb[i + 1]};
    for (int c = 0; c < 4; c++) {
      q6c_prefetch_run(runs[c], tops[c], p, ahead, far);
      q6c_codes_512(runs[c], tops[c], p, lo[c], hi[c]);
    }
    const __m512i x4 = _mm512_set1_epi32(quad_inputs(k, i));
    for (int u = 0; u < 2; u++) {
      const __m512i* v = u ? hi : lo;
      __m512i q[4];
      quad_lanes_512(v[0], v[1], v[2], v[3], q);
      for (int m = 0; m < 4; m++) sum[4 * u + m] = _mm512_dpbusd_epi32(sum[4 * u + m], q[m], x4);
    }
  }
}
#else
inline void q6c_half_512(const Q4CBlock& k, int s0, int s1, int64_t p, bool ahead, bool far, __m512i* sum) {
  for (int s = s0; s < s1; s += 2) {
    const int e = std::min(s + 2, s1);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int i = s; i < e; i++) {
      q6c_prefetch_run(k.ra[i], k.ta[i], p, ahead, far);
      q6c_prefetch_run(k.rb[i], k.tb[i], p, ahead, far);
      __m512i alo, ahi, blo, bhi;
      q6c_codes_512(k.ra[i], k.ta[i], p, alo, ahi);
      q6c_codes_512(k.rb[i], k.tb[i], p, blo, bhi);
      const __m512i xx = _mm512_set1_epi16(k.x[i]);
      split_products_512(alo, ahi, blo, bhi, xx, acc);
    }
    widen_sums_512(acc, sum);
  }
}

#endif

// Pass p of a Q6_K block k into y (as the 256-bit body)
inline void q6c_pass(const Q4CBlock& k, const uint8_t* ks, int64_t np, QV::F vxd, QV::I xa, QV::I xb, int64_t p,
                     bool ahead, bool far, float* y) {
  __m512i sa[8], sb[8];
  for (int i = 0; i < 8; i++) sa[i] = sb[i] = _mm512_setzero_si512();
  q6c_half_512(k, 0, k.cnt_a, p, ahead, far, sa);
  q6c_half_512(k, k.cnt_a, k.cnt, p, ahead, far, sb);
  for (int i = 0; i < 8; i++) q6c_floats(k.r, ks, np, 128 * p + 16 * i, sa[i], sb[i], xa, xb, vxd, y);
}

#endif

#if defined(__AVX512VNNI__)
// ---- With VNNI, a Q4 matrix's quads run by run ----
// The walk above reads a block's 12-32 runs side by side, a line of each a pass, its sums in
// registers. Here each quad (two pairs) runs through all of a thread's passes before the next:
// its four runs read in order, each pass's 32-bit sums (8 vectors, 512 bytes; 32 KB at most)
// kept in L1 between quads, and the block's last quad adding its rows' floats as it goes, block
// after block as before (the same integers and floats). The lines are asked for by two cursors
// that run over the same order of lines ahead of the product, Q4C_NEAR quad-passes (into L1,
// with a block's scales) and Q4C_LEAD (into L2): memory reads that overlap the arithmetic, where
// the walk above left them mostly in series with it. A thread's passes are taken whole: cut into
// pieces of 32 (2 KB of a run), the walk ran 0.87-0.90x the speed of the one above over the 7B
// q/k/v at 25%, where whole it runs 1.07-1.14x. So it serves a thread's share of Q4C_RUNS_MIN
// to Q4C_RUNS_MAX passes, and the walk above the others: over fewer, a quad's set-up and the
// cursors' start weigh (SmolLM2's gate/up, 12 passes a thread of two, ran slower quad by
// quad); over more, the sums no longer fit in L1 beside the lines read (the 7B gate/up's 86
// passes a thread: 0.78-0.86x the speed pass by pass at 25% in three runs of four). And only
// where the kept channels make enough quads a block (q4c_runs_pay). See BENCHMARKS.md, "The q4c
// product's quads run by run".
constexpr int64_t Q4C_RUNS_MIN = 16, Q4C_RUNS_MAX = 64;
#ifndef Q4C_NEAR
#define Q4C_NEAR 40
#endif
#ifndef Q4C_LEAD
#define Q4C_LEAD 200
#endif

// A quad of a block: its four channels' runs, their 8-bit inputs as dpbusd takes them (x0 x1 of
// the first pair, then of the second), its block, whether it is the block's first, and then
// (where the block is the first the product reads of its super-block) the super-block's values
struct Q4CQuad {
  const uint8_t* r[4];
  const uint8_t* ks_new;
  int32_t x4;
  int32_t b;
  bool first;
};

// A cursor over the lines the product reads, from pass c0 of a thread's P: quad j, pass p
struct Q4CCursor {
  const Q4CQuad* q;
  int64_t nq, c0, P, j = 0, p = 0;
  const uint8_t* l[4];
  Q4CCursor(const Q4CQuad* q_, int64_t nq_, int64_t c0_, int64_t P_) : q(q_), nq(nq_), c0(c0_), P(P_) {
    for (int c = 0; c < 4; c++) l[c] = q[0].r[c] + 64 * c0;
  }
  // asks for its line of each run (into L1 with the block's scales where its quad is the
  // block's first: HINT _MM_HINT_T0; else into L2) and moves on a pass
  template <int HINT>
  __attribute__((always_inline)) inline void step(const Q4CArgs& a, int64_t np, int64_t region) {
    if (j >= nq) return;
    for (int c = 0; c < 4; c++) _mm_prefetch((const char*)l[c] + 64 * p, (_mm_hint)HINT);
    if (HINT == _MM_HINT_T0 && q[j].first) q4c_prefetch_scales(a, a.w + q[j].b * region, q[j].ks_new, np, c0 + p);
    if (++p == P) {
      p = 0;
      if (++j < nq)
        for (int c = 0; c < 4; c++) l[c] = q[j].r[c] + 64 * c0;
    }
  }
};

// Whether a call's blocks with a kept channel have 5.5 quads or more on average, which the walk
// quad by quad needs: with fewer the sums' loads and stores between quads weigh more than the
// reads saved (over the 7B q/k/v, 1.16-1.17x the speed pass by pass at 25% (6 quads a block),
// 0.99-1.02x at 40% (about 5), 0.84-0.88x at 50% (4)). (A block's pairs are even: its quads are
// half of them.)
constexpr int Q4C_RUNS_QUADS_X2 = 11;  // twice the least average
inline bool q4c_runs_pay(const Q4CArgs& a) {
  const int64_t nb = a.k / 32;
  int64_t blocks = 0;
  for (int64_t b = 0; b < nb; b++) blocks += a.first[b + 1] > a.first[b];
  return a.first[nb] >= Q4C_RUNS_QUADS_X2 * blocks;
}

// rows [128 p_begin, 128 p_end) of a Q4_0, Q4_1 or Q4_K product into y, quad by quad
template <int KIND>
inline void q4c_runs(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  const int64_t nb = a.k / 32, np = q4c_rows(a.n), region = q4c_region(np, KIND);
  const uint8_t* kt = KIND == Q4C_Q4_K ? q4c_tail(a, np) : nullptr;
  alignas(64) static thread_local __m512i acc[Q4C_RUNS_MAX * 8];  // pass p's F[m] at 8 p + m, H[m] at 8 p + 4 + m (32 KB)
  thread_local std::vector<Q4CQuad> quads;
  quads.clear();
  Q4CBlock k;
  for (int64_t b = 0, sb_read = -1; b < nb; b++) {
    if (q4c_block(a, b, np, k) == 0) continue;
    const uint8_t* ks_new = kt && b / 8 != sb_read ? kt + q4c_tail_sb(np, KIND) * (b / 8) : nullptr;
    sb_read = b / 8;
    for (int i = 0; i < k.cnt; i += 2)  // (a block's pairs are even)
      quads.push_back(Q4CQuad{{k.ra[i], k.rb[i], k.ra[i + 1], k.rb[i + 1]}, i == 0 ? ks_new : nullptr,
                              quad_inputs(k, i), (int32_t)b, i == 0});
  }
  const int64_t nq = (int64_t)quads.size();
  if (nq == 0) return;
  const Q4CQuad* Q = quads.data();
  const int64_t P = p_end - p_begin, c0 = p_begin;  // (at most Q4C_RUNS_MAX)
  Q4CCursor near(Q, nq, c0, P), lead(Q, nq, c0, P);
  for (int s = 0; s < Q4C_NEAR; s++) near.step<_MM_HINT_T0>(a, np, region);
  for (int s = 0; s < Q4C_LEAD; s++) lead.step<_MM_HINT_T1>(a, np, region);
  for (int64_t j = 0; j < nq; j++) {
    const Q4CQuad& qd = Q[j];
    const uint8_t *pa = qd.r[0] + 64 * c0, *pb = qd.r[1] + 64 * c0, *pc = qd.r[2] + 64 * c0, *pd = qd.r[3] + 64 * c0;
    const __m512i x4 = _mm512_set1_epi32(qd.x4);
    const int64_t b = qd.b;
    const uint8_t* r = a.w + b * region;
    const uint8_t* ks = kt ? kt + q4c_tail_sb(np, KIND) * (b / 8) : nullptr;
    const Q4CFloats fl{QV::fset(a.xd[b]), QV::fset(a.xs[b])};
    // the quad over the passes: its sums start at 0 in the block's first quad, and the block's
    // last adds its rows' floats as it goes (pass p's rows once its sums are whole)
    auto run = [&](auto first, auto last) __attribute__((always_inline)) {
      for (int64_t p = 0; p < P; p++) {
        near.step<_MM_HINT_T0>(a, np, region);
        lead.step<_MM_HINT_T1>(a, np, region);
        __m512i* A = acc + 8 * p;
        __m512i F[4], H[4];
        for (int m = 0; m < 4; m++)
          F[m] = first ? _mm512_setzero_si512() : A[m], H[m] = first ? _mm512_setzero_si512() : A[4 + m];
        q4_quad_sums_512(_mm512_loadu_si512((const void*)(pa + 64 * p)), _mm512_loadu_si512((const void*)(pb + 64 * p)),
                         _mm512_loadu_si512((const void*)(pc + 64 * p)), _mm512_loadu_si512((const void*)(pd + 64 * p)),
                         x4, F, H);
        if constexpr (decltype(last)::value) {
          for (int g = 0; g < 4; g++) {
            fl.add<KIND>(r, ks, np, 128 * (c0 + p) + 16 * g, _mm512_sub_epi32(F[g], _mm512_slli_epi32(H[g], 4)), y);
            fl.add<KIND>(r, ks, np, 128 * (c0 + p) + 64 + 16 * g, H[g], y);
          }
        } else {
          for (int m = 0; m < 4; m++) A[m] = F[m], A[4 + m] = H[m];
        }
      }
    };
    using yes = std::true_type;
    using no = std::false_type;
    const bool last = j + 1 == nq || Q[j + 1].first;
    if (qd.first)
      last ? run(yes{}, yes{}) : run(yes{}, no{});
    else
      last ? run(no{}, yes{}) : run(no{}, no{});
  }
}
#endif

// rows [128 p_begin, 128 p_end) of the product into y (the widest body this build has)
template <int KIND>
inline void q4c_kind_passes(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
#if defined(__AVX512VNNI__)
  if constexpr (KIND != Q4C_Q6_K)
    if (a.by_runs && p_end - p_begin >= Q4C_RUNS_MIN && p_end - p_begin <= Q4C_RUNS_MAX && q4c_runs_pay(a))
      return q4c_runs<KIND>(a, p_begin, p_end, y);
#endif
  const int64_t np = q4c_rows(a.n);
  q4c_walk<KIND>(a, p_begin, p_end, [&](const Q4CBlock& k, const uint8_t* ks, int64_t b, int64_t p, bool ahead,
                                        bool far) {
    if constexpr (KIND == Q4C_Q6_K)
      q6c_pass(k, ks, np, QV::fset(a.xd[b]), QV::dwords(32 * a.x16[2 * b]), QV::dwords(32 * a.x16[2 * b + 1]), p,
               ahead, far, y);
    else
      q4c_pass<KIND>(k, ks, np, Q4CFloats{QV::fset(a.xd[b]), QV::fset(a.xs[b])}, p, ahead, far, y);
  });
}

inline void q4c_passes(const Q4CArgs& a, int64_t p_begin, int64_t p_end, float* y) {
  switch (a.kind) {
    case Q4C_Q4_0: return q4c_kind_passes<Q4C_Q4_0>(a, p_begin, p_end, y);
    case Q4C_Q4_1: return q4c_kind_passes<Q4C_Q4_1>(a, p_begin, p_end, y);
    case Q4C_Q4_K: return q4c_kind_passes<Q4C_Q4_K>(a, p_begin, p_end, y);
    default: return q4c_kind_passes<Q4C_Q6_K>(a, p_begin, p_end, y);
  }
}
