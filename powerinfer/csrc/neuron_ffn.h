// The fused neuron-aware FFN for one decode step, written once over a small SIMD layer and
// compiled per instruction set (neuron_ffn_avx512bf16.cpp, neuron_ffn_avx512.cpp,
// neuron_ffn_avx2.cpp); ops.cpp picks one at run time and registers the torch operator.
//
// Dot products see the input as the rows' format reads it: in float for f32 and i8 rows,
// rounded to bf16 for bf16 rows (multiplied in bf16 pairs with AVX512_BF16, in float otherwise:
// the same products), quantized to 8 bits per block of 32 for the block formats.
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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace powerinfer {

enum Format : int { F32 = 0, BF16 = 1, I8 = 2, Q4_0 = 3, Q4_1 = 4, Q8_0 = 5 };
enum Act : int { RELU = 0, REGLU = 1, DREGLU = 2, SWIGLU = 3, GEGLU = 4, GELU = 5 };
inline bool gated_act(int act) { return act != RELU && act != GELU; }
// GELU, tanh-approximated (Gemma's GeGLU gate) and exact (Falcon's FFN), as torch computes them
inline float gelu_tanh(float g) {
  return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}
inline float gelu_erf(float u) { return 0.5f * u * (1.0f + std::erf(u * 0.7071067811865476f)); }

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
  const uint8_t* keep;   // per-row masks (see keep_stride) or nullptr (keep what fires)
  int64_t m;
  float threshold;       // > 0: zero a neuron whose firing score is not above it
  int act, fmt;
  // with the block formats (Q4_0, Q4_1, Q8_0): x quantized to 8 bits per block of 32, for
  // integer dot products (`quantize_input`): values (B, dim), scales and scale * sum (B, dim/32)
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xs = nullptr;
  // with bf16 rows: x rounded to bf16 (B, dim), for native bf16 dot products (a.x then holds
  // the same rounded values in float, for the other instruction sets)
  const uint16_t* xb = nullptr;
  // keep[r * keep_stride + i]: i is the position in sel (keep (B, m)), or with keep_by_neuron
  // the neuron's record (keep (B, k), masks over every record)
  int64_t keep_stride = 0;
  bool keep_by_neuron = false;
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
// only one: a plain matrix) to rows of `dim` in out (record-major; float32, or bf16 rounded to
// nearest even with `bf16`), for many-token steps that run as matrix products.
using WidenFn = void (*)(const uint8_t* w, int64_t neuron_bytes, int fmt, int64_t rows,
                         int64_t dim, int64_t begin, int64_t end, void* out, bool bf16);

// One tile of attention over the paged KV cache (attention.h): nq query vectors sharing one KV
// head, each with its position, against that head's keys and values in the blocks of `table`.
constexpr int64_t ATTN_MAX_TILE = 64;  // query vectors a tile
constexpr int64_t ATTN_MAX_BS = 64;    // positions a block
struct AttnTile {
  const float* q;         // (nq, D) the queries, scaled by the attention's scale
  const int64_t* qpos;    // (nq,) each query's position: it sees keys at [qpos - window + 1, qpos]
  int64_t nq, D, BS, window;  // window 0: every earlier position
  const int32_t* table;   // the sequence's blocks, by position / BS
  const uint8_t* k;       // the pool's keys of this head in block 0: (D, BS) transposed
  const uint8_t* v;       // its values in block 0: (BS, D)
  int64_t block_stride;   // bytes from one block's entry to the next's
  bool bf16;              // the pool's type: bf16, else float32
  float* out;             // (nq, D)
};
using AttendFn = void (*)(const AttnTile&);

// One instruction set's entry points (neuron_ffn_avx512.cpp, neuron_ffn_avx2.cpp).
struct Kernels {
  RangeFn range;
  GemvFn gemv;
  WidenFn widen;
  GemvFn gemv_q4x16;  // over groups of 16 rows of a q4x16 matrix (begin, end: groups)
  AttendFn attend;
};
extern const Kernels kernels_avx512bf16;
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

template <int FMT>
constexpr int64_t block_bytes() { return FMT == F32 ? 128 : FMT == BF16 ? 64 : FMT == I8 ? 32 : FMT == Q4_0 ? 18 : FMT == Q4_1 ? 20 : 34; }

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

// ---- dot products of one weight row with R input rows, fed 32-weight blocks ----
// Each keeps two sets of accumulators, one for even blocks and one for odd (template P), so two
// dependency chains run side by side in a row's loop.

// Float formats (f32, i8, and bf16 without native bf16 dot products): the block widened to float
// and multiplied by the input in float.
template <int FMT, int R>
struct FloatDots {
  V acc[R][2][NV];
  void zero() {
    for (int r = 0; r < R; r++)
      for (int p = 0; p < 2; p++)
        for (int v = 0; v < NV; v++) acc[r][p][v] = vzero();
  }
  template <int P>
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, int64_t r0) {
    V w[NV];
    block<FMT>(row, blk, w);
    const float* x = a.x + r0 * a.dim + 32 * blk;
    for (int r = 0; r < R; r++)
      for (int v = 0; v < NV; v++) acc[r][P][v] = vfma(w[v], vload(x + r * a.dim + v * W), acc[r][P][v]);
  }
  void sum(float* out) const {
    for (int r = 0; r < R; r++) {
      V s = vadd(acc[r][0][0], acc[r][1][0]);
      for (int v = 1; v < NV; v++) s = vadd(s, vadd(acc[r][0][v], acc[r][1][v]));
      out[r] = hsum(s);
    }
  }
};

#if defined(__AVX512BF16__)
// bf16 rows with native bf16 dot products (AVX512_BF16): 32 products of a block in one
// instruction, over the input rounded to bf16 (a.xb).
template <int R>
struct BF16Dots {
  __m512 acc[R][2];
  void zero() {
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  }
  template <int P>
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, int64_t r0) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(row + 64 * blk));
    const uint16_t* x = a.xb + r0 * a.dim + 32 * blk;
    for (int r = 0; r < R; r++)
      acc[r][P] = _mm512_dpbf16_ps(acc[r][P], w, (__m512bh)_mm512_loadu_si512((const void*)(x + r * a.dim)));
  }
  void sum(float* out) const {
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
};
#endif

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The block formats (Q4_0, Q4_1, Q8_0) over the input quantized per block (a.xq, a.xd, a.xs):
// integer products of each block (pairs of 8-bit values summed into 16 and 32 bits), scaled in
// float, and the blocks' offsets (Q4_1's m, Q4_0's -8 d) times the input block's sum.
template <int FMT, int R>
struct IntDots {
  __m256 acc[R][2];
  float accm[R][2];
  void zero() {
    for (int r = 0; r < R; r++)
      for (int p = 0; p < 2; p++) acc[r][p] = _mm256_setzero_ps(), accm[r][p] = 0.0f;
  }
  template <int P>
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, int64_t r0) {
    const int64_t nb = a.dim / 32;
    const __m256i ones = _mm256_set1_epi16(1);
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
      const int64_t row_i = r0 + r;
      __m256i xv = _mm256_loadu_si256((const __m256i*)(a.xq + row_i * a.dim + 32 * blk));
      if constexpr (FMT == Q8_0) xv = _mm256_sign_epi8(xv, wsign);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);  // 8 sums of 4
      acc[r][P] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * a.xd[row_i * nb + blk]), acc[r][P]);
      if constexpr (FMT != Q8_0) accm[r][P] += m * a.xs[row_i * nb + blk];
    }
  }
  void sum(float* out) const {
    for (int r = 0; r < R; r++)
      out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + (accm[r][0] + accm[r][1]);
  }
};

#if defined(__AVX512VNNI__)
// Q4_0/Q4_1 with AVX512_VNNI (Zen 4, Ice Lake and later): two blocks at a time (the even block's
// call does its odd neighbour's too; P = 1 does nothing), their 64 nibbles widened to bytes in
// one 512-bit vector whose 16 lanes each sum 4 products of the 8-bit input in one instruction
// (vpdpbusd), then scaled per block in float: about half the instructions of IntDots per block,
// which is what bounds a 4-bit row (its bytes arrive faster than IntDots consumes them).
template <int FMT, int R>
struct Q4Dots {
  __m512 acc[R];
  float accm[R];
  void zero() {
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), accm[r] = 0.0f;
  }
  template <int P>
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, int64_t r0) {
    if constexpr (P == 1) return;
    constexpr int HDR = FMT == Q4_0 ? 2 : 4, BB = HDR + 16;
    const int64_t nb = a.dim / 32;
    const bool pair = blk + 1 < nb;
    const uint8_t *b0 = row + blk * BB, *b1 = b0 + BB;
    const __m128i q0 = _mm_loadu_si128((const __m128i*)(b0 + HDR));
    const __m128i q1 = pair ? _mm_loadu_si128((const __m128i*)(b1 + HDR)) : _mm_setzero_si128();
    const __m256i q = _mm256_set_m128i(q1, q0), mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(q, mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
    // [lo0 hi0 lo1 hi1]: block 0's weights 0-15 and 16-31, then block 1's, as the input lies
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                         _mm256_permute2x128_si256(lo, hi, 0x31), 1);
    const float d0 = half(b0), d1 = pair ? half(b1) : 0.0f;
    const float m0 = FMT == Q4_0 ? -8.0f * d0 : half(b0 + 2);
    const float m1 = !pair ? 0.0f : FMT == Q4_0 ? -8.0f * d1 : half(b1 + 2);
    const __mmask64 take = pair ? ~0ULL : 0xFFFFFFFFULL;
    for (int r = 0; r < R; r++) {
      const int64_t row_i = r0 + r, at = row_i * nb + blk;
      const __m512i xv = _mm512_maskz_loadu_epi8(take, a.xq + row_i * a.dim + 32 * blk);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
      const float s1 = pair ? d1 * a.xd[at + 1] : 0.0f;
      const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0 * a.xd[at]), _mm512_set1_ps(s1));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[r]);
      accm[r] += m0 * a.xs[at] + (pair ? m1 * a.xs[at + 1] : 0.0f);
    }
  }
  void sum(float* out) const {
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + accm[r];
  }
};
#endif

template <int FMT, int R>
struct DotsOf {
  using type = FloatDots<FMT, R>;
};
// 4-bit rows: VNNI's pairs of blocks where the build has it, else IntDots
#if defined(__AVX512VNNI__)
template <int FMT, int R>
using Q4DotsOf = Q4Dots<FMT, R>;
#else
template <int FMT, int R>
using Q4DotsOf = IntDots<FMT, R>;
#endif
template <int R>
struct DotsOf<Q4_0, R> {
  using type = Q4DotsOf<Q4_0, R>;
};
template <int R>
struct DotsOf<Q4_1, R> {
  using type = Q4DotsOf<Q4_1, R>;
};
template <int R>
struct DotsOf<Q8_0, R> {
  using type = IntDots<Q8_0, R>;
};
#if defined(__AVX512BF16__)
template <int R>
struct DotsOf<BF16, R> {
  using type = BF16Dots<R>;
};
#endif
template <int FMT, int R>
using Dots = typename DotsOf<FMT, R>::type;

// out[r, block] += h[r] * block of the row, for every row r of B with h[r] != 0
template <int FMT>
inline void axpy_block(const uint8_t* row, int64_t blk, const float* h, int64_t B, int64_t dim, float* out) {
  V w[NV];
  block<FMT>(row, blk, w);
  for (int64_t r = 0; r < B; r++) {
    if (h[r] == 0.0f) continue;
    const V hv = vset(h[r]);
    float* o = out + r * dim + 32 * blk;
    for (int v = 0; v < NV; v++) vstore(o + v * W, vfma(hv, w[v], vload(o + v * W)));
  }
}

inline void prefetch_l2(const uint8_t* p) { _mm_prefetch((const char*)p, _MM_HINT_T1); }

// One pass over the blocks of up to three rows of different neurons, side by side: the lead
// row's dot products (G: the gate row, or the up row of a plain ReLU FFN), the up row's (U), and
// the down row's axpy into out (D, over all B rows with their activations h). Input rows r0..
// r0+R-1 for the dot products. pf_a, pf_b: rows to bring into L2 over the same pass (or null).
// Reading three streams at once and prefetching the next rows keeps a core's memory requests
// in flight across the short rows of different neurons, where one stream at a time left the
// prefetchers starting over at every row (a third of the read rate measured).
template <int FMT, int DFMT, int R, bool G, bool U, bool D>
void stage(const FFNArgs& a, int64_t r0, const uint8_t* lead, const uint8_t* upr, const uint8_t* down,
           const float* h, const uint8_t* pf_a, const uint8_t* pf_b, float* gout, float* uout, float* out) {
  Dots<FMT, R> g, u;
  if constexpr (G) g.zero();
  if constexpr (U) u.zero();
  constexpr int64_t bb = block_bytes<FMT>(), db = block_bytes<DFMT>();
  const int64_t nb = a.dim / 32;
  auto body = [&](auto parity, int64_t blk) {
    constexpr int P = decltype(parity)::value;
    if (pf_a && (blk * bb) % 64 < bb) prefetch_l2(pf_a + blk * bb);
    if (pf_b && (blk * db) % 64 < db) prefetch_l2(pf_b + blk * db);
    if constexpr (G) g.template add<P>(lead, blk, a, r0);
    if constexpr (U) u.template add<P>(upr, blk, a, r0);
    if constexpr (D) axpy_block<DFMT>(down, blk, h, a.B, a.dim, out);
  };
  int64_t blk = 0;
  for (; blk + 1 < nb; blk += 2) {
    body(std::integral_constant<int, 0>{}, blk);
    body(std::integral_constant<int, 1>{}, blk + 1);
  }
  if (blk < nb) body(std::integral_constant<int, 0>{}, blk);
  if constexpr (G) g.sum(gout + r0);
  if constexpr (U) u.sum(uout + r0);
}

// stage() for every input row, R of them at a time (the down rows' axpy once, with the first
// group, which also prefetches); G, U, D chosen at run time.
template <int FMT, int DFMT>
void stages(bool G, bool U, bool D, const FFNArgs& a, const uint8_t* lead, const uint8_t* upr,
            const uint8_t* down, const float* h, const uint8_t* pf_a, const uint8_t* pf_b, float* gout,
            float* uout, float* out) {
  for (int64_t r0 = 0; r0 < a.B;) {
    const int64_t left = a.B - r0;
    const int R = left >= 4 ? 4 : left >= 2 ? 2 : 1;
    const bool d = D && r0 == 0;
    const uint8_t *pa = r0 == 0 ? pf_a : nullptr, *pb = r0 == 0 ? pf_b : nullptr;
    const int which = (int)G * 4 + (int)U * 2 + (int)d;
    auto go = [&](auto r) {
      constexpr int RR = decltype(r)::value;
      switch (which) {
        case 1: return stage<FMT, DFMT, RR, false, false, true>(a, r0, lead, upr, down, h, pa, pb, gout, uout, out);
        case 2: return stage<FMT, DFMT, RR, false, true, false>(a, r0, lead, upr, down, h, pa, pb, gout, uout, out);
        case 3: return stage<FMT, DFMT, RR, false, true, true>(a, r0, lead, upr, down, h, pa, pb, gout, uout, out);
        case 4: return stage<FMT, DFMT, RR, true, false, false>(a, r0, lead, upr, down, h, pa, pb, gout, uout, out);
        case 5: return stage<FMT, DFMT, RR, true, false, true>(a, r0, lead, upr, down, h, pa, pb, gout, uout, out);
        case 6: return stage<FMT, DFMT, RR, true, true, false>(a, r0, lead, upr, down, h, pa, pb, gout, uout, out);
        case 7: return stage<FMT, DFMT, RR, true, true, true>(a, r0, lead, upr, down, h, pa, pb, gout, uout, out);
        default: return;
      }
    };
    if (R == 4)
      go(std::integral_constant<int, 4>{});
    else if (R == 2)
      go(std::integral_constant<int, 2>{});
    else
      go(std::integral_constant<int, 1>{});
    r0 += R;
  }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

inline bool kept(const FFNArgs& a, int64_t r, int64_t jj) {
  return !a.keep || a.keep[r * a.keep_stride + (a.keep_by_neuron ? a.sel[jj] : jj)];
}

// Whether a gated neuron can fire in row r given its gate's dot product alone: if not, its up
// and down rows are not read. ReGLU relu(g) * u and dReLU relu(g) * relu(u) are zero for g <= 0
// (ReGLU's score relu(g) must also pass the threshold); SwiGLU's score |silu(g)| must pass it.
inline bool gate_open(int act, float g, float threshold) {
  switch (act) {
    case REGLU: return g > (threshold > 0 ? threshold : 0.0f);
    case DREGLU: return g > 0;
    case GEGLU: return threshold > 0 ? std::fabs(gelu_tanh(g)) > threshold : true;
    default: return threshold > 0 ? std::fabs(silu(g)) > threshold : true;
  }
}

// h[r]: neuron j's activation in row r from its gate (g, gated) and up (u) dot products, zero
// where its score does not pass the threshold or row r does not keep it; true if any is nonzero
inline bool activations(const FFNArgs& a, int64_t jj, const float* g, const float* u, float* h) {
  const int64_t j = a.sel[jj];
  bool any = false;
  for (int64_t r = 0; r < a.B; r++) {
    const float uu = u[r] + (a.bias ? a.bias[j] : 0.0f);
    float score, hh;
    switch (a.act) {
      case RELU: hh = score = uu > 0 ? uu : 0.0f; break;
      case DREGLU: hh = score = (g[r] > 0 ? g[r] : 0.0f) * (uu > 0 ? uu : 0.0f); break;
      case REGLU: score = g[r] > 0 ? g[r] : 0.0f; hh = score * uu; break;
      case GELU: hh = gelu_erf(uu); score = std::fabs(hh); break;
      case GEGLU: { const float s = gelu_tanh(g[r]); score = std::fabs(s); hh = s * uu; break; }
      default: { const float s = silu(g[r]); score = std::fabs(s); hh = s * uu; }
    }
    if (a.threshold > 0 && !(score > a.threshold)) hh = 0.0f;
    if (!kept(a, r, jj)) hh = 0.0f;
    h[r] = hh;
    any |= hh != 0.0f;
  }
  return any;
}

// Neurons sel[begin:end] as a pipeline over the records: while the gate rows of neuron jj+1 are
// read, so are the up rows of neuron jj (only if its gate can let it fire) and the down rows of
// neuron jj-1 (only if it fired), and the lead rows of jj+2 and the down rows of jj are
// prefetched. A plain ReLU FFN pipelines its up rows (the lead) with the down rows.
template <int FMT, int DFMT = down_format(FMT)>
void range_fmt(const FFNArgs& a, int64_t begin, int64_t end, float* out) {
  constexpr int MAXB = 64;
  if (begin >= end) return;
  const bool gated = gated_act(a.act);
  const int64_t rb = row_bytes(FMT, a.dim), B = a.B;
  auto rec = [&](int64_t jj) { return jj < end ? a.w + a.sel[jj] * a.neuron_bytes : nullptr; };
  float lead[2][MAXB], u[MAXB], h[MAXB];
  float *cur = lead[0], *next = lead[1];
  stages<FMT, DFMT>(true, false, false, a, rec(begin), nullptr, nullptr, h, rec(begin + 1), nullptr, cur,
                    nullptr, out);
  const uint8_t* pending = nullptr;  // the down row of the last neuron, which fired with h
  for (int64_t jj = begin; jj < end; jj++) {
    const uint8_t *r = rec(jj), *nx = rec(jj + 1), *pf = rec(jj + 2);
    if (gated) {
      bool open = false;
      for (int64_t i = 0; i < B && !open; i++) open = kept(a, i, jj) && gate_open(a.act, cur[i], a.threshold);
      stages<FMT, DFMT>(nx != nullptr, open, pending != nullptr, a, nx, r + rb, pending, h, pf,
                        open ? r + 2 * rb : nullptr, next, u, out);
      pending = open && activations(a, jj, cur, u, h) ? r + 2 * rb : nullptr;
    } else {
      const uint8_t* down = activations(a, jj, nullptr, cur, h) ? r + rb : nullptr;
      stages<FMT, DFMT>(nx != nullptr, false, down != nullptr, a, nx, nullptr, down, h, pf, nullptr, next,
                        nullptr, out);
    }
    std::swap(cur, next);
  }
  if (pending) stages<FMT, DFMT>(false, false, true, a, nullptr, nullptr, pending, h, nullptr, nullptr, nullptr,
                                 nullptr, out);
}

// y[r, i] for rows [begin, end): each row's dot products in one pass, the row after next
// prefetched
template <int FMT>
inline void gemv_fmt(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end,
                     float* y) {
  constexpr int MAXB = 64;
  const int64_t rb = row_bytes(FMT, a.dim);
  float d[MAXB];
  for (int64_t i = begin; i < end; i++) {
    const uint8_t* pf = i + 2 < end ? w + (i + 2) * rb : nullptr;
    stages<FMT, FMT>(true, false, false, a, w + i * rb, nullptr, nullptr, nullptr, pf, nullptr, d, nullptr,
                     nullptr);
    for (int64_t r = 0; r < a.B; r++) y[r * n + i] = d[r];
  }
}

inline void gemv(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end, float* y) {
  with_format(a.fmt, [&](auto f) { gemv_fmt<decltype(f)::value>(w, a, n, begin, end, y); });
}

// v rounded to bf16 (to nearest even; the weights are finite) and stored at p
inline void store_bf16(uint16_t* p, V v) {
#if defined(__AVX512F__)
  __m512i i = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  i = _mm512_srli_epi32(_mm512_add_epi32(i, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(i));
#else
  __m256i i = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  i = _mm256_srli_epi32(_mm256_add_epi32(i, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(i, i), 0x08);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
#endif
}

template <int FMT, typename O>
inline void widen_row(const uint8_t* row, int64_t dim, O* out) {
  V w[NV];
  for (int64_t blk = 0; blk < dim / 32; blk++) {
    block<FMT>(row, blk, w);
    for (int v = 0; v < NV; v++) {
      if constexpr (std::is_same_v<O, float>)
        vstore(out + 32 * blk + v * W, w[v]);
      else
        store_bf16(out + 32 * blk + v * W, w[v]);
    }
  }
}

inline void widen(const uint8_t* w, int64_t neuron_bytes, int fmt, int64_t rows, int64_t dim,
                  int64_t begin, int64_t end, void* out, bool bf16) {
  const int64_t rb = row_bytes(fmt, dim);
  for (int64_t j = begin; j < end; j++) {
    const uint8_t* rec = w + j * neuron_bytes;
    for (int64_t r = 0; r < rows; r++)
      with_format(r + 1 < rows || rows == 1 ? fmt : down_format(fmt), [&](auto f) {
        constexpr int F = decltype(f)::value;
        const int64_t at = (j * rows + r) * dim;
        if (bf16)
          widen_row<F>(rec + r * rb, dim, (uint16_t*)out + at);
        else
          widen_row<F>(rec + r * rb, dim, (float*)out + at);
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

#include "attention.h"

}  // namespace ISA_NS
}  // namespace powerinfer
#endif
