// ---- a prompt's rows over neuron records (`records_rows`): every record, many rows ----
// Included in the kernel body (neuron_ffn.h), compiled per instruction set.
//
// A prompt step computes every neuron of a set for many rows: a matrix product, where the decode
// kernel (`acts`, `downs`) is a walk over the records that unpacks each record's weights again for
// every four rows and adds its down row a row at a time. Here the records go a block of RR_BLOCK
// at a time:
// - the gate and up dot products of every row with every record of the block: with a bf16
//   model's input and 4-bit records in integers, the block's rows regrouped as the dense q4x16
//   GEMV reads them and the input quantized to 8 bits (`rows_int8`); else the rows widened once
//   into a scratch in the dot products' type, tiles of RT rows by JT records, each tile's sums in
//   registers along the whole input (bf16 pairs in one instruction with AVX512_BF16 and a bf16
//   input, float32 FMAs otherwise) and reduced across their lanes by one fixed tree;
// - the activations of the block's records for every row, a vector of them at a time (the
//   decode kernel's rules: the score against the threshold; with a bf16 input the gate, the up
//   and the activation rounded to bf16 as the model's type holds them, as the dense FFN's are);
// - the down rows added into out, tiles of RT rows by CT vectors of columns, the records in
//   their order: widened to float32, each record's activation broadcast against its row, a block
//   at a time; with AVX512_BF16 and a bf16 input widened to bf16 and multiplied in pairs of
//   records (each pair's two products by one instruction), RR_DOWN records a pass over out
//   (`records_rows_t`).
// Each row's sums run the same operations in the same order whatever rows share the call, and
// wherever in it the row sits (a tile of fewer rows computes each of its rows as a full one
// does; a row is quantized alone): a row's answer is the same floats alone or batched.
#if defined(__AVX512BF16__)
constexpr bool RR_BF16_DOTS = true;
#else
constexpr bool RR_BF16_DOTS = false;
#endif

// lane l of the result: the sum of v[l]'s lanes (one fixed tree for every l), for 16 vectors
// (AVX-512) or 8 (AVX2)
#if defined(__AVX512F__)
constexpr int RT = 4, JT = 4, CT = 4;  // dot tiles RT x JT (16 sums a tile); down tiles RT x CT vectors
inline V lane_sums(const V* v) {
  V a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vabs(V a) { return _mm512_abs_ps(a); }
inline V vkeep_above(V v, V score, V t) {  // v where score > t, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(score, t, _CMP_GT_OQ), v);
}
#else
constexpr int RT = 2, JT = 4, CT = 4;
inline V lane_sums(const V* v) {
  const V s0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const V s1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vabs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline V vkeep_above(V v, V score, V t) { return _mm256_and_ps(v, _mm256_cmp_ps(score, t, _CMP_GT_OQ)); }
#endif
static_assert(RT * JT == W, "a dot tile's sums fill one vector");

// e^x for x <= 88 (attention.h's vexp, here over the whole range a gate takes)
inline V vexp_any(V x) { return vexp(vmin(x, vset(88.0f))); }

// h = act(g, u) for a vector of records (u with its bias), zero where the score is not above the
// threshold (> 0); bf16: the values rounded as the model's type holds them (ops.cpp's
// `activation`). GELU (exact, erf) a lane at a time.
inline V act_vec(int act, V g, V u, float threshold, bool bf16) {
  auto r = [&](V v) { return bf16 ? vround_bf16(v) : v; };
  g = r(g), u = r(u);
  const V zero = vzero();
  V h, score;
  switch (act) {
    case RELU: h = score = vmax(u, zero); break;
    case REGLU: score = vmax(g, zero); h = r(vmul(score, u)); break;
    case DREGLU: h = score = r(vmul(vmax(g, zero), vmax(u, zero))); break;
    case GELU: {
      alignas(64) float t[W];
      vstore(t, u);
      for (int i = 0; i < W; i++) t[i] = gelu_erf(t[i]);
      h = r(vload(t));
      score = vabs(h);
      break;
    }
    case GEGLU: {  // 0.5 g (1 + tanh(y)), tanh(y) = 1 - 2 / (e^(2y) + 1)
      const V y = vmul(vset(0.7978845608028654f), vfma(vmul(vset(0.044715f), vmul(g, g)), g, g));
      const V th = vsub(vset(1.0f), vdiv(vset(2.0f), vadd(vexp_any(vadd(y, y)), vset(1.0f))));
      const V s = r(vmul(vmul(vset(0.5f), g), vadd(vset(1.0f), th)));
      score = vabs(s);
      h = r(vmul(s, u));
      break;
    }
    default: {  // SwiGLU: silu(g) u
      const V s = r(vdiv(g, vadd(vset(1.0f), vexp_any(vmul(g, vset(-1.0f))))));
      score = vabs(s);
      h = r(vmul(s, u));
    }
  }
  return threshold > 0 ? vkeep_above(h, score, vset(threshold)) : h;
}

// The gate/up dot products of rows [r0, r0 + R) with records [j0, j0 + JT) of the block's
// widened rows (wrows: record j's lead row at j * lead_stride, in the dots' type), into
// out[r * RR_BLOCK + j]. R <= RT: a tile of fewer rows computes each row as a full one does.
template <int R, bool BF>
inline void dot_tile(const RowsArgs& a, int64_t r0, const void* wrows, int64_t lead_stride, int64_t j0,
                     float* out) {
  V acc[RT * JT];
  for (int i = 0; i < RT * JT; i++) acc[i] = vzero();
  const int64_t dim = a.dim;
#if defined(__AVX512BF16__)
  if constexpr (BF) {
    const uint16_t* x = (const uint16_t*)a.x + r0 * dim;
    const uint16_t* w = (const uint16_t*)wrows + j0 * lead_stride;
    for (int64_t k = 0; k < dim; k += 32) {
      __m512bh xv[R];
      for (int r = 0; r < R; r++) xv[r] = (__m512bh)_mm512_loadu_si512((const void*)(x + r * dim + k));
      for (int j = 0; j < JT; j++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(w + j * lead_stride + k));
        for (int r = 0; r < R; r++) acc[r * JT + j] = _mm512_dpbf16_ps(acc[r * JT + j], wv, xv[r]);
      }
    }
  } else
#endif
  {
    static_assert(!BF || RR_BF16_DOTS, "bf16 dot products need AVX512_BF16");
    const float* x = (const float*)a.x + r0 * dim;
    const float* w = (const float*)wrows + j0 * lead_stride;
    for (int64_t k = 0; k < dim; k += W) {
      V xv[R];
      for (int r = 0; r < R; r++) xv[r] = vload(x + r * dim + k);
      for (int j = 0; j < JT; j++) {
        const V wv = vload(w + j * lead_stride + k);
        for (int r = 0; r < R; r++) acc[r * JT + j] = vfma(wv, xv[r], acc[r * JT + j]);
      }
    }
  }
  alignas(64) float s[W];
  vstore(s, lane_sums(acc));
  for (int r = 0; r < R; r++)
    for (int j = 0; j < JT; j++) out[(r0 + r) * RR_BLOCK + j0 + j] = s[r * JT + j];
}

template <int R, bool BF>
inline void dot_rows(const RowsArgs& a, int64_t r0, int64_t r1, const void* wrows, int64_t lead_stride,
                     float* out) {
  for (int64_t j0 = 0; j0 < RR_BLOCK; j0 += JT)
    for (int64_t r = r0; r < r1; r += R) dot_tile<R, BF>(a, r, wrows, lead_stride, j0, out);
}

// out[r, c] += sum over the records j < nj (in order) of h[r * RR_DOWN + j] * down[j, c] for rows
// [r0, r0 + R): tiles of CT vectors of columns (then of 32 columns, the last ones)
template <int R>
inline void down_tile(const RowsArgs& a, int64_t r0, const float* h, const float* down, int64_t nj, float* out) {
  const int64_t dim = a.dim;
  auto cols = [&](auto ct, int64_t c0) {
    constexpr int C = decltype(ct)::value;
    V acc[R][C];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++) acc[r][c] = vload(out + (r0 + r) * dim + c0 + c * W);
    for (int64_t j = 0; j < nj; j++) {
      V d[C];
      for (int c = 0; c < C; c++) d[c] = vload(down + j * dim + c0 + c * W);
      for (int r = 0; r < R; r++) {
        const V hv = vset(h[(r0 + r) * RR_DOWN + j]);
        for (int c = 0; c < C; c++) acc[r][c] = vfma(hv, d[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++) vstore(out + (r0 + r) * dim + c0 + c * W, acc[r][c]);
  };
  int64_t c0 = 0;
  for (; c0 + CT * W <= dim; c0 += CT * W) cols(std::integral_constant<int, CT>{}, c0);
  for (; c0 < dim; c0 += 32) cols(std::integral_constant<int, NV>{}, c0);
}

#if defined(__AVX512BF16__)
// Two records' down rows widened to bf16 (ra, rb; rb null: zeros) as pairs, out[2c] = ra[c] and
// out[2c + 1] = rb[c]: a vector of 32 bf16 holds 16 columns of both, as VDPBF16PS takes them
inline void pair_rows(const uint16_t* ra, const uint16_t* rb, int64_t dim, uint16_t* out) {
  const __m512i i0 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), i1 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t c = 0; c < dim; c += 32) {
    const __m512i x = _mm512_loadu_si512((const void*)(ra + c));
    const __m512i y = rb ? _mm512_loadu_si512((const void*)(rb + c)) : _mm512_setzero_si512();
    const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
    _mm512_storeu_si512((void*)(out + 2 * c), _mm512_permutex2var_epi64(lo, i0, hi));
    _mm512_storeu_si512((void*)(out + 2 * c + 32), _mm512_permutex2var_epi64(lo, i1, hi));
  }
}

// down_tile over bf16 pairs: out[r, c] += h[r, 2q] * down[2q, c] + h[r, 2q + 1] * down[2q + 1, c]
// for the pairs q < np in order, one VDPBF16PS a pair and 16 columns (the pair's two products in
// the instruction's own order and rounding; hp[r * RR_DOWN / 2 + q]: the row's two activations
// as bf16; dp: pair_rows' rows, pair q at q * 2 dim)
template <int R>
inline void down_tile_pairs(const RowsArgs& a, int64_t r0, const uint32_t* hp, const uint16_t* dp, int64_t np,
                            int64_t c_lo, int64_t c_hi, float* out) {
  const int64_t dim = a.dim;
  auto cols = [&](auto ct, int64_t c0) {
    constexpr int C = decltype(ct)::value;
    __m512 acc[R][C];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++) acc[r][c] = _mm512_loadu_ps(out + (r0 + r) * dim + c0 + 16 * c);
    for (int64_t q = 0; q < np; q++) {
      __m512bh d[C];
      for (int c = 0; c < C; c++) d[c] = (__m512bh)_mm512_loadu_si512((const void*)(dp + q * 2 * dim + 2 * (c0 + 16 * c)));
      for (int r = 0; r < R; r++) {
        const __m512bh hv = (__m512bh)_mm512_set1_epi32((int)hp[(r0 + r) * (RR_DOWN / 2) + q]);
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], d[c], hv);
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++) _mm512_storeu_ps(out + (r0 + r) * dim + c0 + 16 * c, acc[r][c]);
  };
  int64_t c0 = c_lo;
  for (; c0 + 64 <= c_hi; c0 += 64) cols(std::integral_constant<int, 4>{}, c0);
  for (; c0 < c_hi; c0 += 32) cols(std::integral_constant<int, 2>{}, c0);
}
#endif

template <typename F>
inline void with_rows(int64_t n, F&& f) {  // f(R) for the tile of n <= RT rows
  static_assert(RT == 4 || RT == 2, "tiles of 2 or 4 rows");
  if constexpr (RT == 4) {
    if (n == 4) return f(std::integral_constant<int, 4>{});
    if (n == 3) return f(std::integral_constant<int, 3>{});
  }
  if (n == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// Row `row` of records [b0, b0 + n) (0 the gate, 1 the up row of a gated record, its last the
// down row, in format fmt) widened into out, record j's at out + j * stride; the records past the
// first nj zero (a block's missing ones)
template <typename O>
inline void widen_block(const RowsArgs& a, int64_t b0, int64_t nj, int64_t n, int row, int fmt, O* out,
                        int64_t stride) {
  const int64_t rb = row_bytes(record_format(a.fmt), a.dim);
  for (int64_t j = 0; j < n; j++) {
    O* o = out + j * stride;
    if (j >= nj) {
      std::memset(o, 0, a.dim * sizeof(O));
      continue;
    }
    with_format(fmt, [&](auto f) {
      widen_row<decltype(f)::value>(a.w + (b0 + j) * a.neuron_bytes + row * rb, a.dim, o);
    });
  }
}

// The activations of one row for the block's records [j, j + W) (b0 the block's first record, the
// first nj of them real, the rest zero): act(g, u + bias) with the threshold (g, u: the row's sums)
inline V block_acts(const RowsArgs& a, bool gated, const float* g, const float* u, int64_t b0, int64_t j,
                    int64_t nj) {
  V uu = vload(u + j);
  if (a.bias) {
    alignas(64) float bv[W];
    for (int i = 0; i < W; i++) bv[i] = j + i < nj ? a.bias[b0 + j + i] : 0.0f;
    uu = vadd(uu, vload(bv));
  }
  V hv = act_vec(a.act, gated ? vload(g + j) : vzero(), uu, a.threshold, a.bf16_model);
  if (nj - j < W) {
    alignas(64) float t[W];
    vstore(t, hv);
    for (int64_t i = std::max<int64_t>(nj - j, 0); i < W; i++) t[i] = 0.0f;
    hv = vload(t);
  }
  return hv;
}

// ---- a bf16 model's 4-bit records: the lead rows' dot products in integers ----
// With a bf16 model's input (its activations rounded to bf16 anyway) and 4-bit records, a
// block's RR_BLOCK gate rows, and its up rows, are regrouped into one group of the dense q4x16
// layout each (the same codes, scales and offsets; 320 bytes a block of 32 of the 16 rows), and
// the rows' dot products are the q4x16 GEMV's, four rows a walk of the group: the input quantized
// to 8 bits per block of 32, as the decode kernel and the dense projections quantize it, and
// multiplied in integers (VNNI's byte products, else 16-bit pair sums), one float multiply-add a
// block and row. Widened to bf16 (or float32) and multiplied as floats, the same products took
// about twice the instructions (a 7B-shape prompt's records, BENCHMARKS.md "A sparse model's
// prompt"). A float32 model keeps the float products.
static_assert(RR_BLOCK == 16, "a block's lead rows make one group of 16");
inline bool rows_int8(const RowsArgs& a) {
  return a.bf16_model && (a.fmt == Q4_0 || a.fmt == Q4_1) && a.dim % 32 == 0;
}

// Row `row` (0 the gate, 1 the up row of a gated record) of records [b0, b0 + nj) (split 4-bit
// rows: their nibble bytes, then d, then Q4_1's m) as one q4x16 group at gw: per block, the 16
// rows' d, their m (Q4_0's -8 d in f16, as the dense q4x16 layout holds it: exact for |d| up
// to 8188), then four vectors whose lane i holds bytes 4k..4k+3
// of row i's block; the block's missing records zero.
inline void pack_lead_x16(const RowsArgs& a, int64_t b0, int64_t nj, int row, uint8_t* gw) {
  const int lead_fmt = record_format(a.fmt);
  const int64_t nb = a.dim / 32, rb = row_bytes(lead_fmt, a.dim);
  for (int64_t i = 0; i < RR_BLOCK; i++) {
    const uint8_t* r = i < nj ? a.w + (b0 + i) * a.neuron_bytes + row * rb : nullptr;
    for (int64_t b = 0; b < nb; b++) {
      uint8_t* blk = gw + b * Q4X16_BLOCK;
      uint16_t d = 0, m = 0;
      uint8_t q[16] = {};
      if (r) {
        std::memcpy(&d, r + nb * 16 + 2 * b, 2);
        if (lead_fmt == Q4_1S)
          std::memcpy(&m, r + nb * 18 + 2 * b, 2);
        else
          m = _cvtss_sh(-8.0f * _cvtsh_ss(d), 0);
        std::memcpy(q, r + 16 * b, 16);
      }
      std::memcpy(blk + 2 * i, &d, 2);
      std::memcpy(blk + 32 + 2 * i, &m, 2);
      for (int k = 0; k < 4; k++) std::memcpy(blk + 64 + 64 * k + 4 * i, q + 4 * k, 4);
    }
  }
}

// Records [begin, end) for every row of a.x, their sums added into out (T, dim) float32. scratch:
// rows_scratch(dim, a.T, a.bf16_model) bytes. The records go RR_BLOCK at a time through their
// lead rows' dot products and activations (g, u: (T, RR_BLOCK); h: (T, RR_DOWN), the block's
// records at its place in the pass). Float32 down rows are then added block by block (down_tile,
// every column); with bf16 products (BF) the down rows of RR_DOWN records are widened as bf16
// pairs and added once for the pass, a band of DOWN_COLS columns at a time, so that the band's
// rows stay in L2 across the rows' tiles and out's tiles are loaded and stored once a pass.
constexpr int64_t DOWN_COLS = 512;
template <bool BF>
void records_rows_t(const RowsArgs& a, int64_t begin, int64_t end, float* out, uint8_t* scratch) {
  const int64_t dim = a.dim, T = a.T;
  const bool gated = gated_act(a.act), int8 = rows_int8(a);
  // the down rows in bf16 pairs: bf16 products and a bf16 model's activations (bf16 values, which
  // hp below cuts to 16 bits; rows_scratch sizes their region by the model's type)
  const bool pairs = BF && a.bf16_model;
  const int lead_fmt = record_format(a.fmt), dfmt = down_format(a.fmt);
  const int64_t ls = (int64_t)2 * dim;  // a record's lead rows: gate, then up (gated)
  // scratch: lead rows (RR_BLOCK, 2, dim) in the dots' type (or the block's two q4x16 groups),
  // down rows (RR_BLOCK, dim) float32 (pairs: (RR_DOWN, dim) bf16 pairs, then the block's rows
  // widened), g and u (T, RR_BLOCK) and h (T, RR_DOWN) float32, then (int8) the rows quantized;
  // each on a line
  auto line = [](uint8_t* p) { return (uint8_t*)(((uintptr_t)p + 63) & ~(uintptr_t)63); };
  uint8_t* lead = line(scratch);
  float* down = (float*)line(lead + RR_BLOCK * ls * (BF ? 2 : 4));
  float* g = (float*)line((uint8_t*)(down + (pairs ? RR_DOWN : RR_BLOCK) * dim));
  float* u = g + T * RR_BLOCK;
  float* h = u + T * RR_BLOCK;
  uint8_t *gate_x16 = lead, *up_x16 = lead + dim / 32 * Q4X16_BLOCK;
  FFNArgs fa{};  // (int8) the rows quantized once a call, as the q4x16 GEMV takes them
  if (int8) {
    int8_t* xq = (int8_t*)line((uint8_t*)(h + T * RR_DOWN));
    float* xd = (float*)line((uint8_t*)(xq + T * dim));
    float* xs = xd + T * (dim / 32);
    quantize(a.x, BF, T, dim, xq, xd, xs);
    fa.B = T, fa.dim = dim, fa.xq = xq, fa.xd = xd, fa.xs = xs;
  }
  // records [b0, b0 + nj) at place s of the pass: their down rows widened, their activations
  auto block = [&](int64_t b0, int64_t nj, int64_t s) {
#if defined(__AVX512BF16__)
    if (pairs) {
      uint16_t* wide = (uint16_t*)down + RR_DOWN * dim;
      widen_block(a, b0, nj, nj, gated ? 2 : 1, dfmt, wide, dim);
      for (int64_t j = 0; j < nj; j += 2)
        pair_rows(wide + j * dim, j + 1 < nj ? wide + (j + 1) * dim : nullptr, dim,
                  (uint16_t*)down + (s + j) * dim);
    } else
#endif
      widen_block(a, b0, nj, nj, gated ? 2 : 1, dfmt, down, dim);
    // the dot products: the gate rows (gated), then the up rows
    if (int8) {
      if (gated) pack_lead_x16(a, b0, nj, 0, gate_x16);
      pack_lead_x16(a, b0, nj, gated ? 1 : 0, up_x16);
      // (the dense GEMV over the one group: every row into g, u at r * RR_BLOCK + j)
      if (gated) gemv_q4x16(gate_x16, fa, RR_BLOCK, 0, 1, g);
      gemv_q4x16(up_x16, fa, RR_BLOCK, 0, 1, u);
    } else {
      // widened, the block's missing records zero: the lead rows (gate, up) side by side a record
      auto widen_lead = [&](auto* rows) {
        if (gated) widen_block(a, b0, nj, RR_BLOCK, 0, lead_fmt, rows, ls);
        widen_block(a, b0, nj, RR_BLOCK, gated ? 1 : 0, lead_fmt, rows + (gated ? dim : 0), ls);
      };
      if constexpr (BF)
        widen_lead((uint16_t*)lead);
      else
        widen_lead((float*)lead);
      const void* gate_rows = lead;
      const void* up_rows = gated ? (const void*)((const uint8_t*)lead + dim * (BF ? 2 : 4)) : lead;
      for (int64_t r0 = 0; r0 < T; r0 += RT)
        with_rows(std::min<int64_t>(RT, T - r0), [&](auto rr) {
          constexpr int R = decltype(rr)::value;
          if (gated) dot_rows<R, BF>(a, r0, r0 + R, gate_rows, ls, g);
          dot_rows<R, BF>(a, r0, r0 + R, up_rows, ls, u);
        });
    }
    // the activations, a vector of records at a time
    for (int64_t r = 0; r < T; r++)
      for (int64_t j = 0; j < RR_BLOCK; j += W)
        vstore(h + r * RR_DOWN + s + j, block_acts(a, gated, g + r * RR_BLOCK, u + r * RR_BLOCK, b0, j, nj));
  };
  for (int64_t d0 = begin; d0 < end; d0 += RR_DOWN) {
    const int64_t nd = std::min(RR_DOWN, end - d0);
    for (int64_t s = 0; s < nd; s += RR_BLOCK) {
      const int64_t nj = std::min(RR_BLOCK, nd - s);
      block(d0 + s, nj, s);
      if (!pairs)
        for (int64_t r0 = 0; r0 < T; r0 += RT)
          with_rows(std::min<int64_t>(RT, T - r0), [&](auto rr) {
            down_tile<decltype(rr)::value>(a, r0, h + s, down, nj, out);
          });
    }
#if defined(__AVX512BF16__)
    if (pairs) {
      // A bf16 input's down products in bf16 pairs, as the AMX path multiplies them: the
      // activations are bf16 values already (block_acts rounds them as the model holds them),
      // the down rows rounded to bf16; two products an instruction where a float multiply-add
      // makes one. hp (T, RR_DOWN / 2): a row's pairs of activations, where g and u were.
      uint32_t* hp = (uint32_t*)g;
      const int64_t np = (nd + 1) / 2;  // (an odd pass's last pair: a zero activation and row)
      for (int64_t r = 0; r < T; r++)
        for (int64_t q = 0; q < np; q++) {
          uint32_t lo, hi;
          std::memcpy(&lo, h + r * RR_DOWN + 2 * q, 4);
          std::memcpy(&hi, h + r * RR_DOWN + 2 * q + 1, 4);
          hp[r * (RR_DOWN / 2) + q] = (hi & 0xFFFF0000u) | (lo >> 16);
        }
      for (int64_t c0 = 0; c0 < dim; c0 += DOWN_COLS)
        for (int64_t r0 = 0; r0 < T; r0 += RT)
          with_rows(std::min<int64_t>(RT, T - r0), [&](auto rr) {
            down_tile_pairs<decltype(rr)::value>(a, r0, hp, (const uint16_t*)down, np, c0,
                                                 std::min(dim, c0 + DOWN_COLS), out);
          });
    }
#endif
  }
}


#if defined(__AVX512BF16__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define POWERINFER_RR_AMX 1
// ---- the same product on AMX tiles (Sapphire Rapids and later Xeons) ----
// One TDPBF16PS multiplies a tile of 16 rows by 32 bf16 inputs with a tile of 32 inputs by 16
// columns (bf16 pairs), 8,192 products, into 16 x 16 float32 sums: where the CPU has them, a
// block's gate and up dot products and its down rows' sums run on the tiles. The block's records
// are widened to bf16 and laid out as the tiles read them (a row of a B tile: one input pair for
// 16 records, or one pair of records for 16 columns); the rows go 16 at a time, a last tile of
// fewer padded with zeros. A row's sums are the tile unit's, the same whatever rows share its tile.
#define AMX_FN __attribute__((target("amx-tile,amx-bf16")))
constexpr int64_t AMX_BLOCK = 32;  // records a block: one tile of 32 inputs of the down product

// Whether this CPU has AMX's tiles and bf16 products and the kernel (Linux) lets this process use
// them (asked once: ARCH_REQ_XCOMP_PERM for XTILEDATA, without which the first tile instruction
// faults)
inline bool amx_ready() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// dst[i * 16 + j] = src[j * stride + i], i, j < 16 (32-bit values)
inline void transpose16(const uint32_t* src, int64_t stride, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void*)(src + i * stride));
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xDD);
  }
  for (int i = 0; i < 16; i++) _mm512_storeu_si512((void*)(dst + i * 16), r[i]);
}

// A block's lead rows (32 records, bf16, row-major with stride dim) as B tiles: for each 32
// inputs s and half h of the records, 16 rows (input pairs) of 16 records' pairs (1 KiB)
inline void pack_lead(const uint16_t* rows, int64_t dim, uint8_t* out) {
  const uint32_t* r32 = (const uint32_t*)rows;
  for (int64_t s = 0; s < dim / 32; s++)
    for (int h = 0; h < 2; h++)
      transpose16(r32 + h * 16 * (dim / 2) + 16 * s, dim / 2, (uint32_t*)(out + (2 * s + h) * 1024));
}

// A block's down rows (32 records, bf16, stride dim) as B tiles: for each 16 columns c, 16 rows
// (record pairs) of the 16 columns' pairs
inline void pack_down(const uint16_t* rows, int64_t dim, uint8_t* out) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512((const void*)order);
  for (int64_t c = 0; c < dim / 16; c++)
    for (int q = 0; q < 16; q++) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)(rows + 2 * q * dim + 16 * c));
      const __m256i b = _mm256_loadu_si256((const __m256i*)(rows + (2 * q + 1) * dim + 16 * c));
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512((void*)(out + (c * 16 + q) * 64), _mm512_permutexvar_epi16(idx, ab));
    }
}

// One tile of 16 rows (x: bf16, stride dim) against a packed block: the gate and up sums (16 x 32
// each, stride 32) of its records
AMX_FN inline void amx_dots(const uint16_t* x, int64_t dim, const uint8_t* gate, const uint8_t* up, bool gated,
                            float* g, float* u) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < dim / 32; s++) {
    _tile_loadd(4, x + 32 * s, dim * 2);
    if (gated) {
      _tile_loadd(5, gate + 2 * s * 1024, 64);
      _tile_loadd(6, gate + (2 * s + 1) * 1024, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
    }
    _tile_loadd(5, up + 2 * s * 1024, 64);
    _tile_loadd(6, up + (2 * s + 1) * 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, g, 128);
  _tile_stored(1, g + 16, 128);
  _tile_stored(2, u, 128);
  _tile_stored(3, u + 16, 128);
}

// out (16 rows, stride dim, float32) += h (16 rows x 32 records, bf16) times the block's packed
// down rows, 64 columns a pass (four sums tiles)
AMX_FN inline void amx_down(const uint16_t* h, const uint8_t* down, int64_t dim, float* out) {
  _tile_loadd(4, h, 64);
  int64_t c = 0;
  for (; c + 4 <= dim / 16; c += 4) {
    _tile_loadd(0, out + 16 * c, dim * 4);
    _tile_loadd(1, out + 16 * (c + 1), dim * 4);
    _tile_loadd(2, out + 16 * (c + 2), dim * 4);
    _tile_loadd(3, out + 16 * (c + 3), dim * 4);
    _tile_loadd(5, down + c * 1024, 64);
    _tile_loadd(6, down + (c + 1) * 1024, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, down + (c + 2) * 1024, 64);
    _tile_loadd(6, down + (c + 3) * 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
    _tile_stored(0, out + 16 * c, dim * 4);
    _tile_stored(1, out + 16 * (c + 1), dim * 4);
    _tile_stored(2, out + 16 * (c + 2), dim * 4);
    _tile_stored(3, out + 16 * (c + 3), dim * 4);
  }
  for (; c < dim / 16; c++) {
    _tile_loadd(0, out + 16 * c, dim * 4);
    _tile_loadd(5, down + c * 1024, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_stored(0, out + 16 * c, dim * 4);
  }
}

AMX_FN inline void amx_config() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  // (GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the config: without this the
  // stores of the tiles' shapes were dropped as dead, and the first tile instruction faulted)
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
AMX_FN inline void amx_release() { _tile_release(); }

// records_rows_t on the tiles (a.x bf16, a.bf16_dots): blocks of AMX_BLOCK records
inline void records_rows_amx(const RowsArgs& a, int64_t begin, int64_t end, float* out, uint8_t* scratch) {
  const int64_t dim = a.dim, T = a.T;
  const bool gated = gated_act(a.act);
  const int lead_fmt = record_format(a.fmt), dfmt = down_format(a.fmt);
  auto line = [](uint8_t* p) { return (uint8_t*)(((uintptr_t)p + 63) & ~(uintptr_t)63); };
  // scratch: packed gate and up (dim * 64 bytes each), packed down (dim * 64), the block's rows
  // widened (AMX_BLOCK x dim bf16, reused for each of the three), g and u (16 x 32 float32), h
  // (16 x 32 bf16), a padded tile of input rows (16 x dim bf16) and of sums (16 x dim float32)
  uint8_t* gate_p = line(scratch);
  uint8_t* up_p = gate_p + dim * 64;
  uint8_t* down_p = up_p + dim * 64;
  uint16_t* wide = (uint16_t*)(down_p + dim * 64);
  float* g = (float*)line((uint8_t*)(wide + AMX_BLOCK * dim));
  float* u = g + 16 * AMX_BLOCK;
  uint16_t* hb = (uint16_t*)(u + 16 * AMX_BLOCK);
  uint16_t* xpad = (uint16_t*)line((uint8_t*)(hb + 16 * AMX_BLOCK));
  float* opad = (float*)line((uint8_t*)(xpad + 16 * dim));
  const uint16_t* x = (const uint16_t*)a.x;
  amx_config();
  for (int64_t b0 = begin; b0 < end; b0 += AMX_BLOCK) {
    const int64_t nj = std::min(AMX_BLOCK, end - b0);
    if (gated) {
      widen_block(a, b0, nj, AMX_BLOCK, 0, lead_fmt, wide, dim);
      pack_lead(wide, dim, gate_p);
    }
    widen_block(a, b0, nj, AMX_BLOCK, gated ? 1 : 0, lead_fmt, wide, dim);
    pack_lead(wide, dim, up_p);
    widen_block(a, b0, nj, AMX_BLOCK, gated ? 2 : 1, dfmt, wide, dim);
    pack_down(wide, dim, down_p);
    for (int64_t r0 = 0; r0 < T; r0 += 16) {
      const int64_t nr = std::min<int64_t>(16, T - r0);
      const uint16_t* xt = x + r0 * dim;
      float* ot = out + r0 * dim;
      if (nr < 16) {  // a last tile of fewer rows: padded copies
        std::memcpy(xpad, xt, nr * dim * 2);
        std::memset(xpad + nr * dim, 0, (16 - nr) * dim * 2);
        std::memcpy(opad, ot, nr * dim * 4);
        xt = xpad, ot = opad;
      }
      amx_dots(xt, dim, gate_p, up_p, gated, g, u);
      for (int64_t r = 0; r < 16; r++)
        for (int64_t j = 0; j < AMX_BLOCK; j += W)
          store_bf16(hb + r * AMX_BLOCK + j, block_acts(a, gated, g + r * AMX_BLOCK, u + r * AMX_BLOCK, b0, j, nj));
      amx_down(hb, down_p, dim, ot);
      if (nr < 16) std::memcpy(out + r0 * dim, opad, nr * dim * 4);
    }
  }
  amx_release();
}
#endif

// Whether records_rows multiplies bf16 pairs (AVX512_BF16 and a bf16 input), else float32
// (a bf16 input widened by the caller)
inline bool rows_bf16_dots(bool bf16_input) { return RR_BF16_DOTS && bf16_input; }

// Whether records_rows runs a bf16 input on the AMX tiles here (allowed, and the CPU has them)
inline bool rows_on_amx() {
#if defined(POWERINFER_RR_AMX)
  return rows_amx_allowed.load() && amx_ready();
#else
  return false;
#endif
}

inline void records_rows(const RowsArgs& a, int64_t begin, int64_t end, float* out, uint8_t* scratch) {
#if defined(POWERINFER_RR_AMX)
  if (a.bf16_dots && a.dim % 32 == 0 && rows_amx_allowed.load(std::memory_order_relaxed) && amx_ready())
    return records_rows_amx(a, begin, end, out, scratch);
#endif
  if constexpr (RR_BF16_DOTS)
    if (a.bf16_dots) return records_rows_t<RR_BF16_DOTS>(a, begin, end, out, scratch);
  records_rows_t<false>(a, begin, end, out, scratch);
}
