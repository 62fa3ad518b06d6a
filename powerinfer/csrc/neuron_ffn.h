// The fused neuron-aware FFN for one decode step, written once over a small SIMD layer and
// compiled per instruction set (neuron_ffn_avx512.cpp, neuron_ffn_avx2.cpp); ops.cpp picks one
// at run time and registers the torch operator.
//
// Weights are neuron-major: neuron j's record is [gate row][up row][down row] (no gate row for
// plain ReLU), each row `dim` weights in one format:
//   f32, bf16      dim values;
//   i8             one f32 scale, then dim int8 values (w = scale * q);
//   q4_0           dim/32 GGUF blocks {f16 d; 16 bytes}: w = d * (q - 8);
//   q4_1           dim/32 GGUF blocks {f16 d; f16 m; 16 bytes}: w = d * q + m;
//   q8_0           dim/32 GGUF blocks {f16 d; 32 int8}: w = d * q;
// a block's low nibbles are its weights 0..15, the high nibbles 16..31 (GGUF's order).
// The down row is the neuron's column of the down projection (a row of its transpose). With the
// 4-bit formats it is Q8_0 (`down_format`): a 4-bit file's blocks run along the other axis of
// the down matrix, and quantizing its columns to 4 bits again would add a second rounding.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace powerinfer {

enum Format : int { F32 = 0, BF16 = 1, I8 = 2, Q4_0 = 3, Q4_1 = 4, Q8_0 = 5 };
enum Act : int { RELU = 0, REGLU = 1, DREGLU = 2, SWIGLU = 3 };

constexpr int down_format(int fmt) { return fmt == Q4_0 || fmt == Q4_1 ? Q8_0 : fmt; }

inline int64_t row_bytes(int fmt, int64_t dim) {
  switch (fmt) {
    case F32: return dim * 4;
    case BF16: return dim * 2;
    case I8: return 4 + dim;
    case Q4_0: return dim / 32 * 18;
    case Q4_1: return dim / 32 * 20;
    default: return dim / 32 * 34;
  }
}

// bytes of one block (32 weights) of 16 rows in the q4x16 layout (see gemv_q4x16)
constexpr int64_t Q4X16_BLOCK = 320;

struct FFNArgs {
  const float* x;        // (B, dim) the normed input rows
  int64_t B, dim;
  const uint8_t* w;      // (k, neuron_bytes) records
  int64_t neuron_bytes;
  const float* bias;     // (k,) up bias or nullptr
  const int64_t* sel;    // (m,) neurons to compute, indices into the k records
  const uint8_t* keep;   // (B, m) per-row masks or nullptr (keep what fires)
  int64_t m;
  float threshold;       // > 0: zero a neuron whose firing score is not above it
  int act, fmt;
  // with the block formats (Q4_0, Q4_1, Q8_0): x quantized to 8 bits per block of 32, for
  // integer dot products (`quantize_input`): values (B, dim), scales and scale * sum (B, dim/32)
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xs = nullptr;
};

constexpr bool integer_dots(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0; }

// x (B, dim) -> per block of 32: d = max |x| / 127, q = round(x / d) in [-127, 127], and d * sum(q)
// (the Q8_0 rounding ggml applies to activations; d stays float32 here).
// T: float, or a type that converts to it (c10::BFloat16: the input read as it is, no copy)
template <typename T>
inline void quantize_input(const T* x, int64_t B, int64_t dim, int8_t* q, float* d, float* s) {
  for (int64_t i = 0; i < B * dim / 32; i++) {
    const T* xb = x + 32 * i;
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = std::fmax(amax, std::fabs((float)xb[j]));
    const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
      const int v = (int)std::roundf((float)xb[j] * id);
      q[32 * i + j] = (int8_t)v;
      sum += v;
    }
    d[i] = dd;
    s[i] = dd * (float)sum;
  }
}

// Calls f(std::integral_constant<int, FMT>{}) for format `fmt`: the one switch from a run-time
// format to the kernels' compile-time one.
template <typename F>
inline void with_format(int fmt, F&& f) {
  switch (fmt) {
    case F32: return f(std::integral_constant<int, F32>{});
    case BF16: return f(std::integral_constant<int, BF16>{});
    case I8: return f(std::integral_constant<int, I8>{});
    case Q4_0: return f(std::integral_constant<int, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int, Q4_1>{});
    default: return f(std::integral_constant<int, Q8_0>{});
  }
}

// Computes neurons sel[begin:end] for every row and adds their down rows, scaled by the rows'
// activations, into out (B, dim).
using RangeFn = void (*)(const FFNArgs&, int64_t begin, int64_t end, float* out);
// y[r, i] = row i . x[r] for rows [begin, end) of a (n, row_bytes) matrix in format a.fmt: a
// dense matrix-vector product over a.B input rows (decode), reading each weight row once (a.x,
// a.B, a.dim, a.fmt and, for the block formats, a.xq/xd/xs are read).
using GemvFn = void (*)(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end,
                        float* y);
// Widens records [begin, end) (`rows` rows each, the last in down_format(fmt) unless it is the
// only one: a plain matrix) to float32 rows of `dim` in out (record-major), for many-token
// steps that run as matrix products.
using WidenFn = void (*)(const uint8_t* w, int64_t neuron_bytes, int fmt, int64_t rows,
                         int64_t dim, int64_t begin, int64_t end, float* out);

// One instruction set's entry points (neuron_ffn_avx512.cpp, neuron_ffn_avx2.cpp).
struct Kernels {
  RangeFn range;
  GemvFn gemv;
  WidenFn widen;
  GemvFn gemv_q4x16;  // over groups of 16 rows of a q4x16 matrix (begin, end: groups)
};
extern const Kernels kernels_avx512;
extern const Kernels kernels_avx2;

}  // namespace powerinfer

// ---- the kernel body, instantiated per ISA inside namespace ISA_NS ----
#ifdef ISA_NS
namespace powerinfer {
namespace ISA_NS {

#if defined(__AVX512F__)
constexpr int W = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline V bf16_to_f32(const uint16_t* p) {
  __m512i i = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(i, 16));
}
inline V i8_to_f32(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// 16 nibbles (low halves of 16 bytes) as floats
inline V u8_to_f32(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
#else
constexpr int W = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V bf16_to_f32(const uint16_t* p) {
  __m256i i = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(i, 16));
}
inline V i8_to_f32(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif
constexpr int NV = 32 / W;  // vectors per 32-weight block
// Rows are short streams (a few KiB each, one per neuron, in no fixed order), too short for the
// hardware prefetchers to ramp up: each block loop prefetches PF bytes ahead in its row, and each
// neuron the first PF bytes of the next one's rows.
constexpr int64_t PF = 2048;

template <int FMT>
constexpr int64_t block_bytes() { return FMT == F32 ? 128 : FMT == BF16 ? 64 : FMT == I8 ? 32 : FMT == Q4_0 ? 18 : FMT == Q4_1 ? 20 : 34; }

inline void prefetch_lines(const uint8_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Weights [32 * blk, 32 * blk + 32) of a row, as NV vectors.
template <int FMT>
inline void block(const uint8_t* row, int64_t blk, V* w) {
  if constexpr (FMT == F32) {
    const float* p = (const float*)row + 32 * blk;
    for (int v = 0; v < NV; v++) w[v] = vload(p + v * W);
  } else if constexpr (FMT == BF16) {
    const uint16_t* p = (const uint16_t*)row + 32 * blk;
    for (int v = 0; v < NV; v++) w[v] = bf16_to_f32(p + v * W);
  } else if constexpr (FMT == I8) {
    float s;
    std::memcpy(&s, row, 4);
    const V sv = vset(s);
    const int8_t* p = (const int8_t*)(row + 4) + 32 * blk;
    for (int v = 0; v < NV; v++) w[v] = vmul(sv, i8_to_f32(p + v * W));
  } else if constexpr (FMT == Q8_0) {
    const uint8_t* b = row + blk * 34;
    const V d = vset(half(b));
    const int8_t* p = (const int8_t*)(b + 2);
    for (int v = 0; v < NV; v++) w[v] = vmul(d, i8_to_f32(p + v * W));
  } else {
    constexpr int HDR = FMT == Q4_0 ? 2 : 4;
    const uint8_t* b = row + blk * (HDR + 16);
    const V d = vset(half(b));
    const V m = FMT == Q4_0 ? vset(-8.0f * half(b)) : vset(half(b + 2));
    __m128i q = _mm_loadu_si128((const __m128i*)(b + HDR));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
#if defined(__AVX512F__)
    w[0] = vfma(u8_to_f32(lo), d, m);
    w[1] = vfma(u8_to_f32(hi), d, m);
#else
    auto f = [](__m128i x) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)); };
    w[0] = vfma(f(lo), d, m);
    w[1] = vfma(f(_mm_srli_si128(lo, 8)), d, m);
    w[2] = vfma(f(hi), d, m);
    w[3] = vfma(f(_mm_srli_si128(hi, 8)), d, m);
#endif
  }
}

// dots[r] = row . x[r] for R rows of x (stride dim)
template <int FMT, int R>
inline void dot_rows(const uint8_t* row, const float* x, int64_t dim, float* dots) {
  V acc[R][NV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = vzero();
  V w[NV];
  for (int64_t blk = 0; blk < dim / 32; blk++) {
    _mm_prefetch((const char*)row + blk * block_bytes<FMT>() + PF, _MM_HINT_T0);
    block<FMT>(row, blk, w);
    for (int r = 0; r < R; r++)
      for (int v = 0; v < NV; v++) acc[r][v] = vfma(w[v], vload(x + r * dim + 32 * blk + v * W), acc[r][v]);
  }
  for (int r = 0; r < R; r++) {
    V s = acc[r][0];
    for (int v = 1; v < NV; v++) s = vadd(s, acc[r][v]);
    dots[r] = hsum(s);
  }
}

template <int FMT>
inline void dots(const uint8_t* row, const float* x, int64_t B, int64_t dim, float* out) {
  int64_t r = 0;
  for (; r + 4 <= B; r += 4) dot_rows<FMT, 4>(row, x + r * dim, dim, out + r);
  switch (B - r) {
    case 3: dot_rows<FMT, 3>(row, x + r * dim, dim, out + r); break;
    case 2: dot_rows<FMT, 2>(row, x + r * dim, dim, out + r); break;
    case 1: dot_rows<FMT, 1>(row, x + r * dim, dim, out + r); break;
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// dots[r] = row . x[r] for R rows, the row in a block format and x quantized per block: integer
// products of each block (pairs of 8-bit values summed into 16 and 32 bits), scaled in float
template <int FMT, int R>
inline void idot_rows(const uint8_t* row, const int8_t* xq, const float* xd, const float* xs,
                      int64_t dim, float* dots) {
  const int64_t nb = dim / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float accm[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), accm[r] = 0.0f;
  for (int64_t blk = 0; blk < nb; blk++) {
    _mm_prefetch((const char*)row + blk * block_bytes<FMT>() + PF, _MM_HINT_T0);
    __m256i w, wsign;
    float d, m = 0.0f;
    if constexpr (FMT == Q8_0) {
      const uint8_t* b = row + blk * 34;
      d = half(b);
      wsign = _mm256_loadu_si256((const __m256i*)(b + 2));
      w = _mm256_sign_epi8(wsign, wsign);  // |w|: the unsigned side of the products
    } else {
      constexpr int HDR = FMT == Q4_0 ? 2 : 4;
      const uint8_t* b = row + blk * (HDR + 16);
      d = half(b);
      m = FMT == Q4_0 ? -8.0f * d : half(b + 2);
      const __m128i q = _mm_loadu_si128((const __m128i*)(b + HDR)), mask = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
    }
    for (int r = 0; r < R; r++) {
      __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + r * dim + 32 * blk));
      if constexpr (FMT == Q8_0) xv = _mm256_sign_epi8(xv, wsign);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);  // 8 sums of 4
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[r * nb + blk]), acc[r]);
      if constexpr (FMT != Q8_0) accm[r] += m * xs[r * nb + blk];  // the blocks' offsets
    }
  }
  for (int r = 0; r < R; r++) dots[r] = hsum8(acc[r]) + accm[r];
}

template <int FMT>
inline void idots(const uint8_t* row, const FFNArgs& a, float* out) {
  const int64_t nb = a.dim / 32, dim = a.dim;
  int64_t r = 0;
  for (; r + 4 <= a.B; r += 4) idot_rows<FMT, 4>(row, a.xq + r * dim, a.xd + r * nb, a.xs + r * nb, dim, out + r);
  const int8_t* q = a.xq + r * dim;
  const float *d = a.xd + r * nb, *s = a.xs + r * nb;
  switch (a.B - r) {
    case 3: idot_rows<FMT, 3>(row, q, d, s, dim, out + r); break;
    case 2: idot_rows<FMT, 2>(row, q, d, s, dim, out + r); break;
    case 1: idot_rows<FMT, 1>(row, q, d, s, dim, out + r); break;
  }
}

// dots of one weight row with every input row, as its format computes them
template <int FMT>
inline void row_dots(const uint8_t* row, const FFNArgs& a, float* out) {
  if constexpr (integer_dots(FMT))
    idots<FMT>(row, a, out);
  else
    dots<FMT>(row, a.x, a.B, a.dim, out);
}

// out[r] += h[r] * row for every row r with h[r] != 0
template <int FMT>
inline void axpy(const uint8_t* row, const float* h, int64_t B, int64_t dim, float* out) {
  V w[NV];
  for (int64_t blk = 0; blk < dim / 32; blk++) {
    _mm_prefetch((const char*)row + blk * block_bytes<FMT>() + PF, _MM_HINT_T0);
    block<FMT>(row, blk, w);
    for (int64_t r = 0; r < B; r++) {
      if (h[r] == 0.0f) continue;
      const V hv = vset(h[r]);
      float* o = out + r * dim + 32 * blk;
      for (int v = 0; v < NV; v++) vstore(o + v * W, vfma(hv, w[v], vload(o + v * W)));
    }
  }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

template <int FMT, int DFMT = down_format(FMT)>
void range_fmt(const FFNArgs& a, int64_t begin, int64_t end, float* out) {
  constexpr int MAXB = 64;
  const bool gated = a.act != RELU;
  const int64_t rb = row_bytes(FMT, a.dim);
  float g[MAXB], u[MAXB], h[MAXB];
  for (int64_t jj = begin; jj < end; jj++) {
    const int64_t j = a.sel[jj];
    const uint8_t* rec = a.w + j * a.neuron_bytes;
    const uint8_t* up = gated ? rec + rb : rec;
    const uint8_t* down = up + rb;
    if (jj + 1 < end) {
      const uint8_t* next = a.w + a.sel[jj + 1] * a.neuron_bytes;
      prefetch_lines(next, PF);
      if (gated) prefetch_lines(next + rb, PF);
    }
    if (gated) row_dots<FMT>(rec, a, g);  // in record order: one forward stream
    row_dots<FMT>(up, a, u);
    bool any = false;
    for (int64_t r = 0; r < a.B; r++) {
      float uu = u[r] + (a.bias ? a.bias[j] : 0.0f), score, hh;
      switch (a.act) {
        case RELU: hh = score = uu > 0 ? uu : 0.0f; break;
        case DREGLU: hh = score = (g[r] > 0 ? g[r] : 0.0f) * (uu > 0 ? uu : 0.0f); break;
        case REGLU: score = g[r] > 0 ? g[r] : 0.0f; hh = score * uu; break;
        default: { float s = silu(g[r]); score = std::fabs(s); hh = s * uu; }
      }
      if (a.threshold > 0 && !(score > a.threshold)) hh = 0.0f;
      if (a.keep && !a.keep[r * a.m + jj]) hh = 0.0f;
      h[r] = hh;
      any |= hh != 0.0f;
    }
    if (any) axpy<DFMT>(down, h, a.B, a.dim, out);
  }
}

template <int FMT>
inline void gemv_fmt(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end,
                     float* y) {
  constexpr int MAXB = 64;
  const int64_t rb = row_bytes(FMT, a.dim);
  float d[MAXB];
  for (int64_t i = begin; i < end; i++) {
    _mm_prefetch((const char*)(w + (i + 1) * rb), _MM_HINT_T0);
    row_dots<FMT>(w + i * rb, a, d);
    for (int64_t r = 0; r < a.B; r++) y[r * n + i] = d[r];
  }
}

inline void gemv(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end, float* y) {
  with_format(a.fmt, [&](auto f) { gemv_fmt<decltype(f)::value>(w, a, n, begin, end, y); });
}

template <int FMT>
inline void widen_row(const uint8_t* row, int64_t dim, float* out) {
  V w[NV];
  for (int64_t blk = 0; blk < dim / 32; blk++) {
    block<FMT>(row, blk, w);
    for (int v = 0; v < NV; v++) vstore(out + 32 * blk + v * W, w[v]);
  }
}

inline void widen(const uint8_t* w, int64_t neuron_bytes, int fmt, int64_t rows, int64_t dim,
                  int64_t begin, int64_t end, float* out) {
  const int64_t rb = row_bytes(fmt, dim);
  for (int64_t j = begin; j < end; j++) {
    const uint8_t* rec = w + j * neuron_bytes;
    for (int64_t r = 0; r < rows; r++)
      with_format(r + 1 < rows || rows == 1 ? fmt : down_format(fmt), [&](auto f) {
        widen_row<decltype(f)::value>(rec + r * rb, dim, out + (j * rows + r) * dim);
      });
  }
}

// ---- 4-bit rows interleaved by 16 (`q4x16`): the dense matrix-vector product of int4 weights ----
// A (n, dim) matrix of Q4_0/Q4_1 rows regrouped 16 rows at a time (n a multiple of 16): group g
// is nb = dim/32 blocks of Q4X16_BLOCK bytes, block b holding the 16 rows' weights 32b..32b+31:
//   [0, 32)    d: 16 f16 scales, row 0 first
//   [32, 64)   m: 16 f16 offsets (w = d * q + m; a Q4_0 block has m = -8 d)
//   [64, 320)  four 64-byte vectors k = 0..3; bytes 4i..4i+3 of vector k are bytes 4k..4k+3 of
//              row i's 16 (low nibbles: weights 4k..4k+3, high nibbles: 16+4k..16+4k+3)
// Lane i of one vector is then row i: each 4 bytes of the input block, broadcast, meet the same
// 4 weights of all 16 rows (pairwise u8 x s8 products summed to 16 and 32 bits), so a block of
// 16 rows costs a few dozen instructions and its 16 sums arrive as one vector, with the scales
// of the 16 rows converted in one instruction. A row-at-a-time Q4 dot product spends about as
// much on one row's block (its scalar scales and horizontal sum). ggml repacks its 4-bit
// weights the same way on CPUs with wide vectors.
#ifndef Q4X16_PF
#define Q4X16_PF 16
#endif

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The integer vectors of this instruction set, with lanes of 32 bits: one lane a row, so a pass
// covers 16 rows with AVX-512 and 8 (half a group) with AVX2.
#if defined(__AVX512F__)
struct QV {
  using I = __m512i;
  using F = __m512;
  static constexpr int LANES = 16;
  static I load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  static I bytes(int8_t v) { return _mm512_set1_epi8(v); }
  static I words(int16_t v) { return _mm512_set1_epi16(v); }
  static I dwords(int32_t v) { return _mm512_set1_epi32(v); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I shr4(I a) { return _mm512_srli_epi16(a, 4); }
  static I dot(I u8, I s8) { return _mm512_maddubs_epi16(u8, s8); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static F sum32(I a, I ones) { return _mm512_cvtepi32_ps(_mm512_madd_epi16(a, ones)); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#else
struct QV {
  using I = __m256i;
  using F = __m256;
  static constexpr int LANES = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I bytes(int8_t v) { return _mm256_set1_epi8(v); }
  static I words(int16_t v) { return _mm256_set1_epi16(v); }
  static I dwords(int32_t v) { return _mm256_set1_epi32(v); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I shr4(I a) { return _mm256_srli_epi16(a, 4); }
  static I dot(I u8, I s8) { return _mm256_maddubs_epi16(u8, s8); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static F sum32(I a, I ones) { return _mm256_cvtepi32_ps(_mm256_madd_epi16(a, ones)); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif

// One group's rows for input rows r0..r0+R-1: QV::LANES rows a pass (AVX2 makes two passes, the
// second over the group's bytes in L1).
template <int R>
inline void q4x16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                        float* y) {
  using I = QV::I;
  using F = QV::F;
  constexpr int L = QV::LANES;
  const int64_t nb = a.dim / 32, dim = a.dim;
  const I mask = QV::bytes(0x0F), ones = QV::words(1);
  for (int part = 0; part < 16 / L; part++) {
    F acc[R];
    for (int r = 0; r < R; r++) acc[r] = QV::fzero();
    for (int64_t blk = 0; blk < nb; blk++) {
      const uint8_t* b = gw + blk * Q4X16_BLOCK;
      if (part == 0)
        for (int o = 0; o < Q4X16_BLOCK; o += 64) _mm_prefetch((const char*)b + Q4X16_PF * Q4X16_BLOCK + o, _MM_HINT_T0);
      const F d = QV::halves(b + 2 * L * part), m = QV::halves(b + 32 + 2 * L * part);
      I lo[4], hi[4];
      for (int k = 0; k < 4; k++) {
        const I v = QV::load(b + 64 + 64 * k + 4 * L * part);
        lo[k] = QV::band(v, mask);
        hi[k] = QV::band(QV::shr4(v), mask);
      }
      for (int r = 0; r < R; r++) {
        const int64_t row = r0 + r;
        const int8_t* xb = a.xq + row * dim + 32 * blk;
        // 8 pairwise sums of 4 products each, at most 8 * 2 * 15 * 127 in 16 bits: no saturation
        I s = QV::dot(lo[0], QV::dwords(load4(xb)));
        s = QV::add16(s, QV::dot(hi[0], QV::dwords(load4(xb + 16))));
        for (int k = 1; k < 4; k++) {
          s = QV::add16(s, QV::dot(lo[k], QV::dwords(load4(xb + 4 * k))));
          s = QV::add16(s, QV::dot(hi[k], QV::dwords(load4(xb + 16 + 4 * k))));
        }
        acc[r] = QV::fma(QV::sum32(s, ones), QV::fmul(d, QV::fset(a.xd[row * nb + blk])), acc[r]);
        acc[r] = QV::fma(m, QV::fset(a.xs[row * nb + blk]), acc[r]);
      }
    }
    for (int r = 0; r < R; r++) QV::store(y + (r0 + r) * n + 16 * g + L * part, acc[r]);
  }
}

// y[r, 16g..16g+15] = rows of group g . x[r] for groups [begin, end) of a q4x16 matrix of n rows
inline void gemv_q4x16(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end,
                       float* y) {
  const int64_t gbytes = a.dim / 32 * Q4X16_BLOCK;
  for (int64_t g = begin; g < end; g++) {
    const uint8_t* gw = w + g * gbytes;
    int64_t r = 0;
    for (; r + 4 <= a.B; r += 4) q4x16_group<4>(gw, a, r, n, g, y);
    switch (a.B - r) {
      case 3: q4x16_group<3>(gw, a, r, n, g, y); break;
      case 2: q4x16_group<2>(gw, a, r, n, g, y); break;
      case 1: q4x16_group<1>(gw, a, r, n, g, y); break;
    }
  }
}

inline void range(const FFNArgs& a, int64_t begin, int64_t end, float* out) {
  with_format(a.fmt, [&](auto f) { range_fmt<decltype(f)::value>(a, begin, end, out); });
}

}  // namespace ISA_NS
}  // namespace powerinfer
#endif
