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
// In records, 4-bit gate and up rows are held split (Q4_0S, Q4_1S: the records' own codes for
// the formats; a plain matrix keeps the file's blocks): the row's dim/2 nibble bytes (block after
// block, as in the blocks), then its dim/32 f16 scales d, then (Q4_1) its dim/32 f16 minimums m,
// the same bytes as the blocks. One 64-byte load then serves four blocks and one conversion 16
// scales (a block at a time, a row's scales, offsets and 16-byte loads cost more than its bytes).
// The down row is the neuron's column of the down projection (a row of its transpose). With the
// 4-bit formats it is Q8_0 (`down_format`): a 4-bit file's blocks run along the other axis of
// the down matrix, and quantizing its columns to 4 bits again would add a second rounding.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <atomic>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

// A helper whose only effect is to ask for lines (prefetches). GCC finds such a function pure
// (a prefetch changes no state it models), and a call to it that the early inliner has not
// inlined is then dead code, deleted before the later inlining: the q4c product lost every scale
// and next-block prefetch that way (GCC 12, -O3). Forced inline, the prefetches stay.
#define PREFETCHES __attribute__((always_inline)) inline

namespace powerinfer {

enum Format : int { F32 = 0, BF16 = 1, I8 = 2, Q4_0 = 3, Q4_1 = 4, Q8_0 = 5, Q4_0S = 6, Q4_1S = 7 };
constexpr bool split4(int fmt) { return fmt == Q4_0S || fmt == Q4_1S; }
// the code of a record's gate/up rows in format fmt
constexpr int record_format(int fmt) { return fmt == Q4_0 ? Q4_0S : fmt == Q4_1 ? Q4_1S : fmt; }
enum Act : int { RELU = 0, REGLU = 1, DREGLU = 2, SWIGLU = 3, GEGLU = 4, GELU = 5 };
inline bool gated_act(int act) { return act != RELU && act != GELU; }
// GELU, tanh-approximated (Gemma's GeGLU gate) and exact (Falcon's FFN): torch's functions. The
// first as 0.5 g (1 + tanh(y)) = g / (1 + e^(-2y)): one exponential, without 1 + tanh(y)'s
// cancellation for a negative y (with a scalar tanh a value, Gemma 3's prompt step in the native
// loop took 1.5-1.8x the modules'; its FFN phase over 480 tokens 264.5 -> 105.1 ms with this and
// `activate`)
inline float gelu_tanh(float g) {
  const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return g / (1.0f + std::exp(-2.0f * y));
}
inline float gelu_erf(float u) { return 0.5f * u * (1.0f + std::erf(u * 0.7071067811865476f)); }

constexpr int down_format(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || split4(fmt) ? Q8_0 : fmt; }

// v rounded to bf16 and held as float: c10::BFloat16's rounding (to nearest even; a NaN to its
// one quiet NaN), here where the kernel's units have no torch (ops.cpp rounds with it too)
inline float round_to_bf16(float v) {
  uint32_t i;
  std::memcpy(&i, &v, 4);
  i = (i & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : (i + ((i >> 16) & 1) + 0x7FFF) & 0xFFFF0000u;
  std::memcpy(&v, &i, 4);
  return v;
}

// h = act(g, u) over pre-activations from the model's projection (rounded to bf16 first where
// the model computes in bf16), each step rounded as torch rounds a bf16 tensor op's result: the
// values a block slice's Python path computes (g unused by the ungated acts)
inline float act_value(int act, float g, float u, bool bf16) {
  auto r = [&](float v) { return bf16 ? round_to_bf16(v) : v; };
  g = r(g), u = r(u);
  switch (act) {
    case RELU: return u > 0 ? u : 0.0f;
    case REGLU: return r((g > 0 ? g : 0.0f) * u);
    case DREGLU: return r((g > 0 ? g : 0.0f) * (u > 0 ? u : 0.0f));
    case GELU: return r(gelu_erf(u));
    case GEGLU: return r(r(gelu_tanh(g)) * u);
    default: return r(r(g / (1.0f + std::exp(-g))) * u);
  }
}

inline int64_t row_bytes(int fmt, int64_t dim) {
  switch (fmt) {
    case F32: return dim * 4;
    case BF16: return dim * 2;
    case I8: return 4 + dim;
    case Q4_0: case Q4_0S: return dim / 32 * 18;
    case Q4_1: case Q4_1S: return dim / 32 * 20;
    default: return dim / 32 * 34;
  }
}

// bytes of one block (32 weights) of 16 rows in the q4x16 layout (see gemv_q4x16), and in
// q5x16's (q4x16's with the fifth bits: a file's Q5_0 and Q5_1 blocks, 6 bits a weight)
constexpr int64_t Q4X16_BLOCK = 320;
constexpr int64_t Q5X16_BLOCK = 384;
// bytes of one super-block (256 weights) of 16 rows in the K-quant layouts (see q4kx16_group,
// q5kx16_group, q6kx16_group): 4.625, 5.625 and 6.5625 bits a weight (the file's Q4_K and Q5_K
// blocks, their 6-bit scales and minimums a byte each; its Q6_K blocks as they are)
constexpr int64_t Q4KX16_SB = 2368;
constexpr int64_t Q5KX16_SB = 2880;
constexpr int64_t Q6KX16_SB = 3360;
// bytes of one block (32 weights) of 16 rows in the q8x16 layout (see q8x16_group): 8.5 bits a
// weight, as Q8_0
constexpr int64_t Q8X16_BLOCK = 544;
// the matrices whose rows are interleaved 16 at a time, by their `layout` code
enum Layout : int { Q4X16 = 0, Q4KX16 = 1, Q6KX16 = 2, Q8X16 = 3, Q5KX16 = 4, Q5X16 = 5 };
constexpr int N_LAYOUTS = 6;
// whether a layout's rows are blocks of 32 (else super-blocks of 256)
inline bool blocks_of_32(int layout) { return layout == Q4X16 || layout == Q8X16 || layout == Q5X16; }
// bytes of one group of 16 rows of `dim` columns in a layout
inline int64_t group_bytes(int layout, int64_t dim) {
  if (blocks_of_32(layout))
    return dim / 32 * (layout == Q4X16 ? Q4X16_BLOCK : layout == Q5X16 ? Q5X16_BLOCK : Q8X16_BLOCK);
  return dim / 256 * (layout == Q4KX16 ? Q4KX16_SB : layout == Q5KX16 ? Q5KX16_SB : Q6KX16_SB);
}

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
  // integer dot products (`quantize`): values (B, dim), scales and scale * sum (B, dim/32)
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xs = nullptr;
  // with bf16 rows: x rounded to bf16 (B, dim), for native bf16 dot products (a.x then holds
  // the same rounded values in float, for the other instruction sets)
  const uint16_t* xb = nullptr;
  // with the q6kx16 layout: the sums of x's 8-bit values per 16 (B, dim/16)
  const int32_t* x16 = nullptr;
  // with split 4-bit rows (records): xq permuted per group of 4 blocks (`permute_input`), rows
  // of xp_stride values
  const int8_t* xp = nullptr;
  int64_t xp_stride = 0;
  // keep[r * keep_stride + i]: i is the position in sel (keep (B, m)), or with keep_by_neuron
  // the neuron's record (keep (B, k), masks over every record)
  int64_t keep_stride = 0;
  bool keep_by_neuron = false;
};

constexpr bool integer_dots(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0 || split4(fmt); }

// Row stride of permute_input's output: dim rounded up to whole groups of 4 blocks.
inline int64_t permuted_stride(int64_t dim) { return (dim + 127) / 128 * 128; }

// xq (B, dim) -> xp (B, permuted_stride(dim)): per group of 4 blocks (128 values; the last may
// hold fewer, zero-padded), the 16 first values of each block, then the 16 last of each, as the
// low and high nibbles of the same 64 bytes of a split row meet them.
inline void permute_input(const int8_t* xq, int64_t B, int64_t dim, int8_t* xp) {
  const int64_t stride = permuted_stride(dim), nb = dim / 32;
  for (int64_t r = 0; r < B; r++) {
    int8_t* o = xp + r * stride;
    std::memset(o, 0, stride);
    for (int64_t b = 0; b < nb; b++) {
      const int8_t* x = xq + r * dim + 32 * b;
      int8_t* g = o + (b / 4) * 128 + (b % 4) * 16;
      std::memcpy(g, x, 16);
      std::memcpy(g + 64, x + 16, 16);
    }
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
    case Q4_0S: return f(std::integral_constant<int, Q4_0S>{});
    case Q4_1S: return f(std::integral_constant<int, Q4_1S>{});
    default: return f(std::integral_constant<int, Q8_0>{});
  }
}

// A decode step's two phases (ops.cpp's neuron_ffn), which threads split differently. The first,
// over neurons sel[begin:end]: each one's activations into h (B floats a neuron, at h + jj * B,
// zero in a row where it does not fire), and the positions jj of those that fire in some row
// into fired, in order (returns how many). The second, over the down rows' blocks [blo, bhi)
// (32 columns each): to out's columns there, every row, h times the down rows of the neurons
// fired[0:nf] added, in that order (the caller zeroes them first: a selection's fired neurons can
// come in segments, each added as it is known).
using ActsFn = int64_t (*)(const FFNArgs&, int64_t begin, int64_t end, float* h, int64_t* fired);
using DownsFn = void (*)(const FFNArgs&, const int64_t* fired, int64_t nf, const float* h, int64_t blo,
                         int64_t bhi, float* out);
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

// The input-sparse products' 4-bit matrices held by input channel (`q4c`; input_sparse.h has the
// layout and the kernel). n rows are held as q4c_rows(n): a multiple of 128 (a pass: one 64-byte
// line of each channel's codes), the extra rows zero.
inline int64_t q4c_rows(int64_t n) { return (n + 127) / 128 * 128; }
// The kinds of q4c matrix: a Q4_0 file's (a f16 scale a row and block), a Q4_1 file's (and a f16
// offset), a Q4_K file's (its 6-bit scale and minimum a row and block as bytes, its f16 d and dmin
// a row and super-block of 256 channels after the blocks), a Q6_K file's (6-bit codes, an 8-bit
// scale a row per 16 channels, its f16 d a row and super-block after the blocks)
enum Q4CKind { Q4C_Q4_0 = 0, Q4C_Q4_1 = 1, Q4C_Q4_K = 2, Q4C_Q6_K = 3 };
// bytes of one block (32 input channels) of a matrix of np held rows
inline int64_t q4c_region(int64_t np, int kind) {
  return kind == Q4C_Q6_K ? 2 * np + 24 * np : np * (kind == Q4C_Q4_1 ? 4 : 2) + 16 * np;
}
// bytes of a super-block's (256 channels) values after the blocks: Q4_K's d and dmin, Q6_K's d
inline int64_t q4c_tail_sb(int64_t np, int kind) {
  return kind == Q4C_Q4_K ? 4 * np : kind == Q4C_Q6_K ? 2 * np : 0;
}
// bytes of an (n, k) matrix (a Q4_K or Q6_K one: k a multiple of 256)
inline int64_t q4c_bytes(int64_t n, int64_t k, int kind) {
  const int64_t np = q4c_rows(n);
  return k / 32 * q4c_region(np, kind) + k / 256 * q4c_tail_sb(np, kind);
}

// Two kept channels of a block and their 8-bit inputs (x1 = 0 for an odd one out; a pair of
// inputs 0 where it makes a block's pairs, or a Q6_K half's, even)
struct Q4CPair {
  uint8_t j0, j1;
  int8_t x0, x1;
};

struct Q4CArgs {
  const uint8_t* w;
  int64_t n, k;
  int kind;              // Q4CKind
  const float* xd;       // (k / 32) the input blocks' scales
  const float* xs;       // (k / 32) xd * the sum of the block's kept 8-bit inputs
  const Q4CPair* pairs;  // block b's pairs: pairs[first[b] .. first[b + 1])
  const int32_t* first;  // (k / 32 + 1)
  const int32_t* x16;    // (k / 16) the sums of the kept 8-bit inputs per 16 channels (Q6_K:
                         // its pairs never span two, those of channels 0..15 first)
  bool by_runs;          // (VNNI, Q4 kinds) quad by quad (q4c_runs), else pass by pass
};
// adds rows [128 p0, 128 p1) of the product into y (q4c_rows(n) floats, zeroed)
using Q4CFn = void (*)(const Q4CArgs& a, int64_t p0, int64_t p1, float* y);

// x (B, dim) float32, or bf16 where the flag is set -> q (B, dim), d and s (B, dim / 32) (see
// `quantize` in the kernel body)
using QuantizeFn = void (*)(const void* x, bool bf16, int64_t B, int64_t dim, int8_t* q, float* d, float* s);

// Every record [begin, end) for many input rows, added into out (records_rows.h)
constexpr int64_t RR_BLOCK = 16;  // records whose lead rows are multiplied at a time
constexpr int64_t RR_DOWN = 64;   // records whose down rows are added in one pass over out

struct RowsArgs {
  const void* x;        // (T, dim): bf16 (uint16_t) where bf16_dots, else float32
  int64_t T, dim;
  bool bf16_dots;       // the dot products in bf16 pairs (AVX512_BF16; the lead rows widened to bf16)
  bool bf16_model;      // the activations rounded as a bf16 model holds them
  const uint8_t* w;     // (k, neuron_bytes) records
  int64_t neuron_bytes;
  const float* bias;    // (k,) up bias or null
  float threshold;      // > 0: zero an activation whose score is not above it
  int act, fmt;         // fmt: the records' format (Q4_0, not Q4_0S)
};

// The bytes of scratch one call of records_rows needs for `rows` rows (the vector path's, or the
// AMX path's: its packed tiles, a block's rows widened, and a tile of rows padded).
// bf16_model: a bf16 model's input (the integer dot products' quantized rows, RR_DOWN down rows
// as bf16 pairs; records_rows_t)
inline int64_t rows_scratch(int64_t dim, int64_t rows, bool bf16_model) {
  const int64_t down = (bf16_model ? RR_DOWN : RR_BLOCK) * dim * 4, xq = bf16_model ? rows * (dim + dim / 32 * 8) : 0;
  return std::max(RR_BLOCK * dim * 2 * 4 + down + rows * (RR_BLOCK * 2 + RR_DOWN) * 4 + xq, 512 * dim + 32768) + 512;
}
// Whether records_rows may use the CPU's AMX tiles where it has them (`rows_amx` in ops.cpp: a
// switch for measurements and tests; the AVX512_BF16 path otherwise)
inline std::atomic<bool> rows_amx_allowed{true};

// Where the weight walks ask for the lines they will read soon: into every level of the caches
// (prefetcht0, `PF_L1`) or into L2 (prefetcht1, `PF_L2`, with the dense GEMVs also asking a
// second time further ahead). A prefetch into L1 holds one of the core's L1 fill buffers until
// its line arrives (16 on Intel's recent cores, 10-12 before), which bounds one core's stream to
// about 16 lines a memory latency; into L2 it holds an L2 queue entry instead (48). On a 2-core
// Xeon with AMX the dense GEMVs read a 7B matrix from memory 1.12-1.43x faster into L2 (q4kx16
// 1.25-1.28x, q4x16 1.39-1.43x, q6kx16 1.12-1.13x; held to avx2 1.17-1.37x; BENCHMARKS.md, "The
// weight walks' prefetches into L2 on Intel's cores"), and the records kernel 1.04-1.06x at
// 20-100% active (a tie below; the q4c product keeps prefetcht0: 0.87-1.03x into L2); on a Zen 5
// EPYC the records kernel took 1.10-1.38x as long into L2 (AMD's cores keep more misses in
// flight from L1), so AMD keeps L1. The CPU's vendor picks it; POWERINFER_PREFETCH=l1|l2 (or
// `kernels.prefetch_level`) sets it.
enum PrefetchLevel : int { PF_L1 = 0, PF_L2 = 1 };
inline bool intel_cpu() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13];
  std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
  vendor[12] = 0;
  return !std::strcmp(vendor, "GenuineIntel");
}
inline int default_prefetch_level() {
  if (const char* v = std::getenv("POWERINFER_PREFETCH")) {
    if (!std::strcmp(v, "l1")) return PF_L1;
    if (!std::strcmp(v, "l2")) return PF_L2;
  }
  return intel_cpu() ? PF_L2 : PF_L1;
}
inline std::atomic<int> prefetch_level{default_prefetch_level()};

// Which walks of the records kernel also ask, into L2, for the rows they read two passes ahead
// (besides those of the next pass, at `prefetch_level`): the activations' walk over the gate and
// up rows (`FAR_ACTS`), the down rows' walk (`FAR_DOWNS`). Read once a call; a walk not asked to
// leaves its far rows null, which its loops already test. On a Zen 5 EPYC (2 threads, a 7B
// layer's Q4_0 records from memory) the step without them was 1.01-1.05x as fast as with both at
// 5-20% active in three runs of 5-9 turns, a tie at 1-2% and 50% (`benchmarks/prefetch.py
// --records`), and the down rows' walk alone 1.19x: a core there is bound by the misses it keeps
// in flight (the gate and up rows' walk stalls at its prefetches into L1), and requests two
// passes ahead only add to them. Intel's cores (into L2, `PF_L2`) keep both, as measured there
// when they were written. The CPU's vendor picks it; POWERINFER_FAR_PREFETCH=none|acts|downs|both
// (or `kernels.far_prefetch`) sets it.
enum FarAhead : int { FAR_ACTS = 1, FAR_DOWNS = 2 };
// the settings' names, by their bits (kernels.FAR_PREFETCH)
inline constexpr const char* FAR_NAMES[4] = {"none", "acts", "downs", "both"};
inline int far_setting(const char* name) {  // -1: not a setting
  for (int i = 0; i < 4; i++)
    if (!std::strcmp(name, FAR_NAMES[i])) return i;
  return -1;
}
inline int default_far_ahead() {
  if (const char* v = std::getenv("POWERINFER_FAR_PREFETCH"))
    if (const int i = far_setting(v); i >= 0) return i;
  return intel_cpu() ? FAR_ACTS | FAR_DOWNS : 0;
}
inline std::atomic<int> far_ahead{default_far_ahead()};

using RowsFn = void (*)(const RowsArgs& a, int64_t begin, int64_t end, float* out, uint8_t* scratch);
using RowsBf16Fn = bool (*)(bool bf16_input);
// h[i] = act_value(act, g[i], u[i], bf16) for i < n (g null for the ungated acts)
using ActivateFn = void (*)(int act, bool bf16, const float* g, const float* u, float* h, int64_t n);

// One instruction set's entry points (neuron_ffn_avx512.cpp, neuron_ffn_avx2.cpp).
struct Kernels {
  ActsFn acts;
  DownsFn downs;
  GemvFn gemv;
  WidenFn widen;
  GemvFn gemv_x16[N_LAYOUTS];  // over groups of 16 rows of a matrix in a Layout (begin, end: groups)
  AttendFn attend;
  Q4CFn q4c;  // over passes of 128 rows of a q4c matrix
  QuantizeFn quantize;  // the input rows of the integer dot products
  RowsFn rows;          // a prompt's rows over records (records_rows.h)
  RowsBf16Fn rows_bf16;  // whether those multiply a bf16 input in bf16 pairs
  bool (*rows_amx)();    // whether they run on AMX tiles here (records_rows.h)
  ActivateFn activate;   // a block slice's activations (ffn_step in ops.cpp)
  void (*round_bf16)(float* p, int64_t n);  // values rounded to bf16 in place (ops.cpp's rows)
  void (*add_bf16)(uint16_t* h, const float* y, int64_t n);  // a bf16 residual's add (join_parts)
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

// The input rows (B, dim) as the integer dot products read them (see `Input` above): per block
// of 32, d = max |x| / 127, q = round(x / d) in [-127, 127] half away from zero (the Q8_0
// rounding ggml applies to activations; d stays float32 here), and d * sum(q). x float32, or bf16
// (as uint16_t) where `bf16`, read as it is. |x / d| <= 127 rounds exactly (x - trunc(x) is
// exact at that size): for finite blocks the values the torch reference
// (`kernels.quantize_input`) gives. (A NaN is skipped by the max, as fmax skips it; a block with a
// NaN or an infinity, or whose max is below about 4e-37 so that 1 / d overflows, gets codes that
// differ between the instruction sets and from the reference: no finite answer comes of it.) A
// block at a time in vectors, compiled per instruction set: built for the baseline ISA in ops.cpp
// this was 3.3 of a one-neuron call's 8.5 us on a 4,096-wide input (measured).
inline void quantize(const void* x, bool bf16, int64_t B, int64_t dim, int8_t* q, float* d, float* s) {
  for (int64_t i = 0; i < B * dim / 32; i++) {
    V v[NV];
    for (int k = 0; k < NV; k++)
      v[k] = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x) + 32 * i + k * W)
                  : vload(static_cast<const float*>(x) + 32 * i + k * W);
    float amax;
#if defined(__AVX512F__)
    // max(a, m) is a > m ? a : m, lane by lane: a NaN in a keeps m
    __m512 m = _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps());
    m = _mm512_max_ps(_mm512_abs_ps(v[1]), m);
    amax = _mm512_reduce_max_ps(m);
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < NV; k++) m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    amax = _mm_cvtss_f32(h);
#endif
    const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const V vid = vset(id);
#if defined(__AVX512F__)
    __m512i sum = _mm512_setzero_si512();
    for (int k = 0; k < NV; k++) {
      const __m512 y = _mm512_mul_ps(v[k], vid);
      __m512i t = _mm512_cvttps_epi32(y);  // toward zero
      const __m512 r = _mm512_sub_ps(y, _mm512_cvtepi32_ps(t));
      const __m512i one = _mm512_set1_epi32(1);
      t = _mm512_mask_add_epi32(t, _mm512_cmp_ps_mask(r, _mm512_set1_ps(0.5f), _CMP_GE_OQ), t, one);
      t = _mm512_mask_sub_epi32(t, _mm512_cmp_ps_mask(r, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), t, one);
      _mm_storeu_si128((__m128i*)(q + 32 * i + k * W), _mm512_cvtepi32_epi8(t));
      sum = _mm512_add_epi32(sum, t);
    }
    const int total = _mm512_reduce_add_epi32(sum);
#else
    __m256i t[NV];
    __m256i sum = _mm256_setzero_si256();
    for (int k = 0; k < NV; k++) {
      const __m256 y = _mm256_mul_ps(v[k], vid);
      t[k] = _mm256_cvttps_epi32(y);  // toward zero
      const __m256 r = _mm256_sub_ps(y, _mm256_cvtepi32_ps(t[k]));
      // a true comparison is all ones, -1 as an integer
      t[k] = _mm256_sub_epi32(t[k], _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_set1_ps(0.5f), _CMP_GE_OQ)));
      t[k] = _mm256_add_epi32(t[k], _mm256_castps_si256(_mm256_cmp_ps(r, _mm256_set1_ps(-0.5f), _CMP_LE_OQ)));
      sum = _mm256_add_epi32(sum, t[k]);
    }
    // 32 values in [-127, 127] to bytes: the packs interleave the 128-bit lanes, the permute
    // puts the four-byte runs back in order
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(t[0], t[1]), _mm256_packs_epi32(t[2], t[3]));
    _mm256_storeu_si256((__m256i*)(q + 32 * i),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const int total = _mm_cvtsi128_si32(s4);
#endif
    d[i] = dd;
    s[i] = dd * (float)total;
  }
}

template <int FMT>
constexpr int64_t block_bytes() { return FMT == F32 ? 128 : FMT == BF16 ? 64 : FMT == I8 ? 32 : FMT == Q4_0 || FMT == Q4_0S ? 18 : FMT == Q4_1 || FMT == Q4_1S ? 20 : 34; }

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Block blk of a 4-bit row of nb blocks, as GGUF stores it or split: its 16 nibble bytes, its
// scale d and its offset m (w = d * q + m; Q4_0's m = -8 d)
struct Q4Block {
  const uint8_t* q;
  float d, m;
};
template <int FMT>
inline Q4Block q4_block(const uint8_t* row, int64_t blk, int64_t nb) {
  constexpr bool ZERO = FMT == Q4_0 || FMT == Q4_0S;
  if constexpr (split4(FMT)) {
    const float d = half(row + nb * 16 + 2 * blk);
    return {row + blk * 16, d, ZERO ? -8.0f * d : half(row + nb * 18 + 2 * blk)};
  } else {
    constexpr int HDR = ZERO ? 2 : 4;
    const uint8_t* b = row + blk * (HDR + 16);
    const float d = half(b);
    return {b + HDR, d, ZERO ? -8.0f * d : half(b + 2)};
  }
}

// Weights [32 * blk, 32 * blk + 32) of a row of nb blocks, as NV vectors.
template <int FMT>
inline void block(const uint8_t* row, int64_t blk, int64_t nb, V* w) {
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
    const Q4Block k = q4_block<FMT>(row, blk, nb);
    const V d = vset(k.d), m = vset(k.m);
    __m128i q = _mm_loadu_si128((const __m128i*)k.q);
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
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, const int64_t* ri) {
    V w[NV];
    block<FMT>(row, blk, a.dim / 32, w);
    for (int r = 0; r < R; r++) {
      const float* x = a.x + ri[r] * a.dim + 32 * blk;
      for (int v = 0; v < NV; v++) acc[r][P][v] = vfma(w[v], vload(x + v * W), acc[r][P][v]);
    }
  }
  void sum(float* out, const int64_t* ri) const {
    for (int r = 0; r < R; r++) {
      V s = vadd(acc[r][0][0], acc[r][1][0]);
      for (int v = 1; v < NV; v++) s = vadd(s, vadd(acc[r][0][v], acc[r][1][v]));
      out[ri[r]] = hsum(s);
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
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, const int64_t* ri) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(row + 64 * blk));
    for (int r = 0; r < R; r++)
      acc[r][P] = _mm512_dpbf16_ps(acc[r][P], w,
                                   (__m512bh)_mm512_loadu_si512((const void*)(a.xb + ri[r] * a.dim + 32 * blk)));
  }
  void sum(float* out, const int64_t* ri) const {
    for (int r = 0; r < R; r++) out[ri[r]] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
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
  __m256 accv[R];  // split rows' offsets, 8 blocks a lane set (see chunk)
  void zero() {
    for (int r = 0; r < R; r++) {
      for (int p = 0; p < 2; p++) acc[r][p] = _mm256_setzero_ps(), accm[r][p] = 0.0f;
      accv[r] = _mm256_setzero_ps();
    }
  }
  template <int P>
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, const int64_t* ri) {
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
      const Q4Block k = q4_block<FMT>(row, blk, nb);
      d = k.d, m = k.m;
      const __m128i q = _mm_loadu_si128((const __m128i*)k.q), mask = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
    }
    for (int r = 0; r < R; r++) {
      const int64_t row_i = ri[r];
      __m256i xv = _mm256_loadu_si256((const __m256i*)(a.xq + row_i * a.dim + 32 * blk));
      if constexpr (FMT == Q8_0) xv = _mm256_sign_epi8(xv, wsign);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);  // 8 sums of 4
      acc[r][P] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * a.xd[row_i * nb + blk]), acc[r][P]);
      if constexpr (FMT != Q8_0) accm[r][P] = std::fma(m, a.xs[row_i * nb + blk], accm[r][P]);
    }
  }
  // blocks blk .. blk + n - 1, two chains alternating (the stage loop of split rows). A whole
  // chunk of split rows (16 blocks, their scales side by side after the nibbles) takes its blocks
  // two at a time: one 32-byte load of both blocks' nibbles, their low nibbles (each block's first
  // 16 weights) and high nibbles (its last 16) against the input permuted to match (a.xp, as the
  // VNNI kernel reads it), the two products' pairs added in 16 bits and summed into 8 lanes in one
  // `madd` (lanes 0-3 block k, 4-7 block k + 1), scaled per lane by the block's scale times the
  // input block's (16 computed as two vectors, each pair's lanes picked with one permute). The
  // offsets (Q4_0's -8 d, Q4_1's m) times the input blocks' sums are added as vectors. A block at
  // a time took twice the shuffles and products: the chunk's dot products bound a record on AVX2.
  template <bool FULL>
  inline void chunk(const uint8_t* row, int64_t blk, int n, const FFNArgs& a, const int64_t* ri) {
    if constexpr (FULL && split4(FMT)) {
      const int64_t nb = a.dim / 32;
      const uint8_t* sc = row + nb * 16 + 2 * blk;
      const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sc)),
                   d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 16)));
      __m256 m0, m1;
      if constexpr (FMT == Q4_1S) {
        const uint8_t* ms = row + nb * 18 + 2 * blk;
        m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)ms));
        m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ms + 16)));
      } else {
        m0 = _mm256_mul_ps(d0, _mm256_set1_ps(-8.0f));
        m1 = _mm256_mul_ps(d1, _mm256_set1_ps(-8.0f));
      }
      __m256 s0[R], s1[R];  // blocks 0-7's and 8-15's weight scale times row r's input scale
      const int8_t* xp[R];  // the chunk's input, permuted (blk is a multiple of 16: whole groups)
      __m256 c0[R], c1[R];  // (in registers over the chunk: every index below is a constant)
      for (int r = 0; r < R; r++) {
        const float* xd = a.xd + ri[r] * nb + blk;
        const float* xs = a.xs + ri[r] * nb + blk;
        s0[r] = _mm256_mul_ps(d0, _mm256_loadu_ps(xd));
        s1[r] = _mm256_mul_ps(d1, _mm256_loadu_ps(xd + 8));
        accv[r] = _mm256_fmadd_ps(m1, _mm256_loadu_ps(xs + 8), _mm256_fmadd_ps(m0, _mm256_loadu_ps(xs), accv[r]));
        xp[r] = a.xp + ri[r] * a.xp_stride + 32 * blk;
        c0[r] = acc[r][0], c1[r] = acc[r][1];
      }
      const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
      const uint8_t* qs = row + blk * 16;
      auto two = [&](int p, __m256* c) __attribute__((always_inline)) {  // blocks 2p and 2p + 1
        const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + p * 32));
        const __m256i lo = _mm256_and_si256(q, mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
        const int e = 2 * (p % 4);  // the pair's first block among its vector's 8 scales
        const __m256i pick = _mm256_set_epi32(e + 1, e + 1, e + 1, e + 1, e, e, e, e);
        const int at = 128 * (p / 2) + 32 * (p % 2);  // its first 16 values' place in a.xp's group
        for (int r = 0; r < R; r++) {
          const __m256i lp = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(xp[r] + at)));
          const __m256i hp = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xp[r] + at + 64)));
          const __m256i s = _mm256_madd_epi16(_mm256_add_epi16(lp, hp), ones);  // |sum| <= 4 * 3,810
          const __m256 scale = _mm256_permutevar8x32_ps(p < 4 ? s0[r] : s1[r], pick);
          c[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, c[r]);
        }
      };
#pragma GCC unroll 4
      for (int p = 0; p < 8; p += 2) {
        two(p, c0);
        two(p + 1, c1);
      }
      for (int r = 0; r < R; r++) acc[r][0] = c0[r], acc[r][1] = c1[r];
      return;
    }
    int k = 0;
    for (; k + 1 < n; k += 2) {
      add<0>(row, blk + k, a, ri);
      add<1>(row, blk + k + 1, a, ri);
    }
    if (k < n) add<0>(row, blk + k, a, ri);
  }
  void sum(float* out, const int64_t* ri) const {
    for (int r = 0; r < R; r++)
      out[ri[r]] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + (accm[r][0] + accm[r][1]) + hsum8(accv[r]);
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
  inline void add(const uint8_t* row, int64_t blk, const FFNArgs& a, const int64_t* ri) {
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
      const int64_t row_i = ri[r], at = row_i * nb + blk;
      const __m512i xv = _mm512_maskz_loadu_epi8(take, a.xq + row_i * a.dim + 32 * blk);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
      const float s1 = pair ? d1 * a.xd[at + 1] : 0.0f;
      const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0 * a.xd[at]), _mm512_set1_ps(s1));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[r]);
      accm[r] += m0 * a.xs[at] + (pair ? m1 * a.xs[at + 1] : 0.0f);
    }
  }
  void sum(float* out, const int64_t* ri) const {
    for (int r = 0; r < R; r++) out[ri[r]] = _mm512_reduce_add_ps(acc[r]) + accm[r];
  }
};

// Split 4-bit rows (Q4_0S, Q4_1S) with AVX512_VNNI, up to 16 blocks a call (`chunk`): per group
// of 4 blocks one 64-byte load of nibbles, their low and high halves against the input permuted
// to match (a.xp) in two vpdpbusd (lanes 4b..4b+3 summing block b's products), then scaled per
// lane by its block's d times the input's scale, from 16 scales converted at once; the offsets
// (Q4_1's m, Q4_0's -8 d) times the input blocks' sums, 16 at a time. About a sixth of the
// instructions of a block at a time (Q4Dots), which left a 4-bit neuron bound by its
// instructions, not its bytes.
template <int FMT, int R>
struct SplitDots {
  __m512 acc[R], accm[R];
  void zero() {
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), accm[r] = _mm512_setzero_ps();
  }
  // FULL: n is 16, known here, so that the groups unroll and their nibbles stay in registers (a
  // count known only at run time left them spilled to the stack and a branch per group)
  template <bool FULL>
  __attribute__((always_inline)) inline void chunk(const uint8_t* row, int64_t blk, int n_, const FFNArgs& a,
                                                   const int64_t* ri) {
    const int n = FULL ? 16 : n_;
    const int64_t nb = a.dim / 32;
    const __mmask16 bm = (__mmask16)((1u << n) - 1);
    const __m512 d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, row + nb * 16 + 2 * blk));
    const __m512 m16 = FMT == Q4_1S ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, row + nb * 18 + 2 * blk))
                                    : _mm512_mul_ps(d16, _mm512_set1_ps(-8.0f));
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const int groups = (n + 3) / 4;
    __m512i lo[4], hi[4];
    for (int g = 0; g < groups; g++) {
      const int left = n - 4 * g;  // blocks of this group
      const __m512i q = left >= 4 ? _mm512_loadu_si512((const void*)(row + (blk + 4 * g) * 16))
                                  : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (16 * left)) - 1),
                                                            row + (blk + 4 * g) * 16);
      lo[g] = _mm512_and_si512(q, mask);
      hi[g] = _mm512_and_si512(_mm512_srli_epi16(q, 4), mask);
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int r = 0; r < R; r++) {
      const int64_t row_i = ri[r], at = row_i * nb + blk;
      const __m512 s16 = _mm512_mul_ps(d16, _mm512_maskz_loadu_ps(bm, a.xd + at));
      accm[r] = _mm512_fmadd_ps(m16, _mm512_maskz_loadu_ps(bm, a.xs + at), accm[r]);
      const int8_t* xp = a.xp + row_i * a.xp_stride + 32 * blk;
      for (int g = 0; g < groups; g++) {
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[g], _mm512_loadu_si512((const void*)(xp + 128 * g)));
        p = _mm512_dpbusd_epi32(p, hi[g], _mm512_loadu_si512((const void*)(xp + 128 * g + 64)));
        const __m512i idx = _mm512_srli_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * g)), 2);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx, s16), acc[r]);
      }
    }
  }
  void sum(float* out, const int64_t* ri) const {
    for (int r = 0; r < R; r++) out[ri[r]] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], accm[r]));
  }
};
#endif

// 4-bit rows, GGUF blocks or split (records): with VNNI, pairs of blocks (Q4Dots) or 16 blocks
// a call (SplitDots); else a block at a time (IntDots)
#if defined(__AVX512VNNI__)
template <int FMT, int R>
using Q4DotsOf = std::conditional_t<split4(FMT), SplitDots<FMT, R>, Q4Dots<FMT, R>>;
#else
template <int FMT, int R>
using Q4DotsOf = IntDots<FMT, R>;
#endif
template <int FMT, int R, typename = void>
struct DotsOf {
  using type = FloatDots<FMT, R>;
};
template <int FMT, int R>
struct DotsOf<FMT, R, std::enable_if_t<FMT == Q4_0 || FMT == Q4_1 || split4(FMT)>> {
  using type = Q4DotsOf<FMT, R>;
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

constexpr int MAXB = 64;  // input rows a call (kernels.MAX_ROWS)
// down rows whose axpys share one pass over out (see downs_fmt)
constexpr int DOWNS = 4;

template <typename F>
inline void with_bool(bool b, F&& f) {
  if (b)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// out[r, block] += h[n][r] * block of down row n, for n < DN (in that order) and every row r of
// B with h[n][r] != 0: out's block loaded and stored once for the DN rows (a row at a time,
// each axpy loaded and stored all of out: more bytes through L1 than the rows themselves). Q8_0
// rows take downs_one_q8 and downs_rows_q8 instead. With one input row no activation is tested:
// a down row is added only if its neuron fired (acts_fmt).
template <int FMT, int DN>
inline void axpy_block(const uint8_t* const* rows, int64_t blk, const float (*h)[MAXB], int64_t B,
                       int64_t dim, float* out) {
  static_assert(FMT != Q8_0, "Q8_0 down rows take downs_one_q8 and downs_rows_q8");
  V w[DN][NV];
  for (int n = 0; n < DN; n++) block<FMT>(rows[n], blk, dim / 32, w[n]);
  with_bool(B == 1, [&](auto one) {
    for (int64_t r = 0; r < (decltype(one)::value ? 1 : B); r++) {
      float* o = out + r * dim + 32 * blk;
      V acc[NV];
      for (int v = 0; v < NV; v++) acc[v] = vload(o + v * W);
      for (int n = 0; n < DN; n++) {
        if constexpr (!decltype(one)::value)
          if (h[n][r] == 0.0f) continue;
        const V hv = vset(h[n][r]);
        for (int v = 0; v < NV; v++) acc[v] = vfma(hv, w[n][v], acc[v]);
      }
      for (int v = 0; v < NV; v++) vstore(o + v * W, acc[v]);
    }
  });
}

// A line of a row a pass will read, asked for at the process's `prefetch_level` (l2: PF_L2, read
// by the walk once a call or pass, not at each line: 1.01-1.03x a 7B layer's records step from
// memory at 5-10% active, 2 threads, a Zen 5 EPYC, `benchmarks/kernel_ab.py`): into every level
// of the caches (prefetcht0), or into L2 (prefetcht1). On a Zen 5 VM, into L2 the records kernel
// took 1.10-1.38x as long at 5-100% active, 2 threads (prefetchnta as fast as t0); on Zen 3 the
// three were not distinguishable; on a Xeon with AMX L2 was 1.04-1.06x faster.
PREFETCHES void prefetch_line(const uint8_t* p, bool l2) {
  if (l2)
    _mm_prefetch((const char*)p, _MM_HINT_T1);
  else
    _mm_prefetch((const char*)p, _MM_HINT_T0);
}
inline bool prefetch_to_l2() { return prefetch_level.load(std::memory_order_relaxed) == PF_L2; }
// A line of a row the pass after next will read, asked for into L2 (prefetcht1): it is asked for
// again at `prefetch_level` the pass before it is read (`acts_fmt`).
PREFETCHES void prefetch_l2(const uint8_t* p) { _mm_prefetch((const char*)p, _MM_HINT_T1); }

// Rows that a pass brings into the caches while it reads others (null: none): up to four rows,
// and with split 4-bit rows as many into L2 alone (`far`: for the pass after next).
constexpr int AHEAD = 4;
struct Ahead {
  const uint8_t* rows[AHEAD] = {};
  const uint8_t* far[AHEAD] = {};
};

// One pass over the blocks of N rows of different neurons, side by side: each row's dot
// products (a gate row, an up row, or the up row of a plain ReLU FFN) with input rows ri[0..R)
// into outs[i][ri[r]]; the rows of `pf` brought into the caches over the same pass.
// Reading streams side by side and prefetching the next rows keeps a core's memory requests in
// flight across the short rows of different neurons, where one stream at a time left the
// prefetchers starting over at every row (a third of the read rate measured).
template <int FMT, int R, int N>
void stage(const FFNArgs& a, const int64_t* ri, const uint8_t* const* rows, const Ahead& pf, float* const* outs) {
  Dots<FMT, R> d[N];
  for (int i = 0; i < N; i++) d[i].zero();
  constexpr int64_t bb = block_bytes<FMT>();
  const int64_t nb = a.dim / 32;
  int64_t blk = 0;
  const bool l2 = prefetch_to_l2();
  if constexpr (split4(FMT)) {
    // 16 blocks a turn: the dot products' chunks, and the lines of the rows to prefetch that the
    // turn's blocks span
    for (; blk < nb; blk += 16) {
      const int n = (int)std::min<int64_t>(16, nb - blk);
      const int64_t o0 = blk * bb / 64 * 64, o1 = (blk + n) * bb;
      for (const uint8_t* p : pf.far)
        if (p)
          for (int64_t o = o0; o < o1; o += 64) prefetch_l2(p + o);
      // each next row's lines asked for just before a row's chunk, not all of them before the
      // first: a burst of 18 requests found the core's misses in flight at their limit and
      // stalled it there (perf, a Zen 5 EPYC: 43% of this walk's samples from memory), where
      // spread over the chunks the products run between them (1.00-1.07x the step at 2-15%
      // active from memory, in one process)
      with_bool(n == 16, [&](auto full) {
        for (int i = 0; i < (N > AHEAD ? N : AHEAD); i++) {
          if (i < AHEAD && pf.rows[i])
            for (int64_t o = o0; o < o1; o += 64) prefetch_line(pf.rows[i] + o, l2);
          if (i < N) d[i].template chunk<decltype(full)::value>(rows[i], blk, n, a, ri);
        }
      });
    }
  } else {
    auto body = [&](auto parity, int64_t blk) {
      constexpr int P = decltype(parity)::value;
      if ((blk * bb) % 64 < bb)
        for (const uint8_t* p : pf.rows)
          if (p) prefetch_line(p + blk * bb, l2);
      for (int i = 0; i < N; i++) d[i].template add<P>(rows[i], blk, a, ri);
    };
    for (; blk + 1 < nb; blk += 2) {
      body(std::integral_constant<int, 0>{}, blk);
      body(std::integral_constant<int, 1>{}, blk + 1);
    }
    if (blk < nb) body(std::integral_constant<int, 0>{}, blk);
  }
  for (int i = 0; i < N; i++) d[i].sum(outs[i], ri);
}

// 0, 1, ..., MAXB - 1: the input rows of a call that reads all of them
struct AllRows {
  int64_t i[MAXB];
  constexpr AllRows() : i() {
    for (int r = 0; r < MAXB; r++) i[r] = r;
  }
};
inline constexpr AllRows ALL_ROWS{};

// stage() over the n (1 to 4) rows given for the input rows ri[0..count), R of them at a time
// (the first group prefetches): every row of the n side by side.
template <int FMT, int N>
void stage_rows(const FFNArgs& a, const int64_t* ri, int64_t count, const uint8_t* const* rows, const Ahead& pf,
                float* const* outs) {
  const Ahead none;
  for (int64_t c = 0; c < count;) {
    const int64_t left = count - c;
    const Ahead& p = c == 0 ? pf : none;
    if (left >= 4)
      stage<FMT, 4, N>(a, ri + c, rows, p, outs), c += 4;
    else if (left >= 2)
      stage<FMT, 2, N>(a, ri + c, rows, p, outs), c += 2;
    else
      stage<FMT, 1, N>(a, ri + c, rows, p, outs), c += 1;
  }
}

// stage() for the n (1 to 4) rows given: with no lists, over every input row, the n rows side by
// side; with lists, row i over its own input rows lists[i][0..counts[i]) alone (a batch's rows
// keep and fire different neurons, and a row that does not keep a neuron, or whose gate left it
// shut, needs neither its gate's nor its up row's dot product). The same floats either way: a
// row's dot product is the same operations whatever other rows share its pass.
template <int FMT>
void stages(int n, const FFNArgs& a, const uint8_t* const* rows, const Ahead& pf, float* const* outs,
            const int64_t* const* lists = nullptr, const int64_t* counts = nullptr) {
  if (!lists) {
    switch (n) {
      case 1: stage_rows<FMT, 1>(a, ALL_ROWS.i, a.B, rows, pf, outs); break;
      case 2: stage_rows<FMT, 2>(a, ALL_ROWS.i, a.B, rows, pf, outs); break;
      case 3: stage_rows<FMT, 3>(a, ALL_ROWS.i, a.B, rows, pf, outs); break;
      case 4: stage_rows<FMT, 4>(a, ALL_ROWS.i, a.B, rows, pf, outs); break;
    }
    return;
  }
  const Ahead none;
  bool asked = false;  // pf given to the first stage that runs
  for (int i = 0; i < n; i++)
    if (counts[i]) {
      stage_rows<FMT, 1>(a, lists[i], counts[i], rows + i, asked ? none : pf, outs + i);
      asked = true;
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
    if (!kept(a, r, jj)) {  // (in a batch its dot products were not computed for this row)
      h[r] = 0.0f;
      continue;
    }
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
    h[r] = hh;
    any |= hh != 0.0f;
  }
  return any;
}

// ActsFn: the first phase, a pipeline over the gate and up rows of neurons sel[begin:end].
// Gated: the pass of neuron p computes the gate of p+2 and the up row of p-1 (if its gate
// opened), and asks for each row it will read twice, one pass ahead (the gate of p+3, the up row
// of p if its gate opened) and two passes ahead into L2 (the gate of p+4, the up row of p+1):
// every row arrives ahead of its pass, and no up row behind a gate that stays shut is fetched (an
// up row left to the hardware arrived while it was read, a third of a 4-bit neuron's time
// measured; prefetched for every neuron, it doubled what a shut gate costs). Asked for once, a
// pass ahead, the rows came at about the rate one reader of a record at a time gets; asked for
// twice, 4-9% less time when a thread's step was one walk (a Zen 5 EPYC, 2 threads,
// BENCHMARKS.md "The records kernel on two threads over processes"), a tie or a loss there since
// the step came in two phases (`far_ahead`: AMD's cores now ask once); no software prefetch at
// all took 1.7x as long (a Xeon with AMX, 1% active). A plain FFN's pass computes the up row of
// p+1 and asks for those of p+2 and p+3.
// P neurons take the place of one (groups of P in the selection's order): with P = 2 a pass
// reads four rows side by side, which one input row uses (its step at 1-15% active 1.02-1.03x
// from memory, 2 threads of a Xeon with AMX, `benchmarks/kernel.py --reads` in turns, a tie held
// to AVX2; three or four neurons a pass, tried, were no faster). A batch's rows keep P = 1 (P = 2
// was within the spread for 4 rows). The neurons' dot products are the same floats whatever P.
template <int FMT, int P>
int64_t acts_fmt(const FFNArgs& a, int64_t begin, int64_t end, float* hout, int64_t* fired) {
  if (begin >= end) return 0;
  const int64_t rb = row_bytes(FMT, a.dim), B = a.B;
  // group t: neurons begin + P t .. begin + P t + P - 1 (those before end); a pass reads the
  // rows of P neurons where the comment above says one
  const int64_t ng = (end - begin + P - 1) / P;
  auto rec = [&](int64_t jj) { return jj >= begin && jj < end ? a.w + a.sel[jj] * a.neuron_bytes : nullptr; };
  auto first = [&](int64_t t) { return begin + P * t; };  // group t's first neuron
  float lead[4][P][MAXB], u[P][MAXB];
  auto dots = [&](int64_t jj) {  // the lead rows' dot products of jj (four groups kept)
    return lead[((jj - begin) / P) % 4][(jj - begin) % P];
  };
  // A batch (B > 1): each neuron's lead row over the input rows that keep it (`keeps`), its up
  // row over those whose gate opened (`opens`); the dot products of the other rows are not
  // computed, and those rows' activations are zero (a plain FFN's up row is its lead row)
  const bool lists = B > 1;
  int64_t keeps[4][P][MAXB], nkeep[4][P], opens[4][P][MAXB], nopen[4][P];
  auto slot = [&](int64_t jj) { return ((jj - begin) / P) % 4; };
  int64_t nf = 0;
  auto emit = [&](int64_t jj, const float* g, const float* uu) {
    if (activations(a, jj, g, uu, hout + jj * B)) fired[nf++] = jj;
  };
  // a pass: the rows of `rows` (n of them) into `outs`, asking for `pf`'s (over the input rows
  // of `rlist`, `rcount`, in a batch)
  const uint8_t* rows[2 * P];
  float* outs[2 * P];
  const int64_t* rlist[2 * P];
  int64_t rcount[2 * P];
  int n = 0;
  auto lead_rows = [&](int64_t t) {  // group t's lead rows, added to the pass
    for (int64_t jj = first(t); jj < first(t) + P; jj++)
      if (rec(jj)) {
        if (lists) {
          const int64_t s = slot(jj), k = (jj - begin) % P;
          int64_t c = 0;
          for (int64_t r = 0; r < B; r++)
            if (kept(a, r, jj)) keeps[s][k][c++] = r;
          nkeep[s][k] = c;
          rlist[n] = keeps[s][k], rcount[n] = c;
        }
        rows[n] = rec(jj), outs[n++] = dots(jj);
      }
  };
  const bool far_on = far_ahead.load(std::memory_order_relaxed) & FAR_ACTS;
  auto ask = [&](const uint8_t** to, int64_t t, const bool* open) {  // group t's lead rows or (open) up rows
    for (int k = 0; k < P; k++) {
      const uint8_t* r = rec(first(t) + k);
      to[k] = !r ? nullptr : !open ? r : open[k] ? r + rb : nullptr;
    }
  };
  auto ask_far = [&](const uint8_t** to, int64_t t, const bool* open) {  // (left null where not asked)
    if (far_on) ask(to, t, open);
  };
  auto pass = [&](const Ahead& pf) {
    if (n) stages<FMT>(n, a, rows, pf, outs, lists ? rlist : nullptr, lists ? rcount : nullptr);
    n = 0;
  };
  {  // the first pass: the lead rows of group 0
    Ahead pf;
    ask(pf.rows, 1, nullptr), ask_far(pf.far, 2, nullptr);
    lead_rows(0);
    pass(pf);
  }
  if (!gated_act(a.act)) {
    for (int64_t t = 0; t < ng; t++) {
      Ahead pf;
      ask(pf.rows, t + 2, nullptr), ask_far(pf.far, t + 3, nullptr);
      lead_rows(t + 1);
      pass(pf);
      for (int64_t jj = first(t); jj < std::min(first(t) + P, end); jj++) emit(jj, nullptr, dots(jj));
    }
    return nf;
  }
  auto opened = [&](int64_t t, bool* open) {  // whether group t's gates let each fire in some row (dots computed)
    for (int k = 0; k < P; k++) {
      const int64_t jj = first(t) + k;
      open[k] = false;
      if (!rec(jj)) continue;
      if (!lists) {
        for (int64_t i = 0; i < B && !open[k]; i++)
          open[k] = kept(a, i, jj) && gate_open(a.act, dots(jj)[i], a.threshold);
        continue;
      }
      const int64_t* kr = keeps[slot(jj)][k];
      int64_t* to = opens[slot(jj)][k];
      int64_t c = 0;
      for (int64_t i = 0; i < nkeep[slot(jj)][k]; i++)
        if (gate_open(a.act, dots(jj)[kr[i]], a.threshold)) to[c++] = kr[i];
      nopen[slot(jj)][k] = c;
      open[k] = c > 0;
    }
  };
  bool before[P] = {}, now[P], next[P];  // whether the gates of groups t - 1, t and t + 1 opened
  opened(0, now);
  {  // the second pass: the lead rows of group 1
    Ahead pf;
    ask(pf.rows, 2, nullptr), ask_far(pf.far, 3, nullptr), ask_far(pf.far + P, 0, now);
    lead_rows(1);
    pass(pf);
  }
  for (int64_t t = 0; t <= ng; t++) {
    opened(t + 1, next);  // (its dots computed in the pass before)
    Ahead pf;
    ask(pf.rows, t + 3, nullptr), ask(pf.rows + P, t, now);
    ask_far(pf.far, t + 4, nullptr), ask_far(pf.far + P, t + 1, next);
    lead_rows(t + 2);
    for (int k = 0; k < P; k++)
      if (before[k]) {
        if (lists) {
          const int64_t s = slot(first(t - 1) + k);
          rlist[n] = opens[s][k], rcount[n] = nopen[s][k];
          std::fill(u[k], u[k] + B, 0.0f);  // (the rows whose gate stayed shut)
        }
        rows[n] = rec(first(t - 1) + k) + rb, outs[n++] = u[k];
      }
    pass(pf);
    if (t > 0)
      for (int k = 0; k < P && first(t - 1) + k < end; k++) {
        const int64_t jj = first(t - 1) + k;
        if (before[k])
          emit(jj, dots(jj), u[k]);
        else
          std::fill(hout + jj * B, hout + (jj + 1) * B, 0.0f);
      }
    std::copy(now, now + P, before), std::copy(next, next + P, now);
  }
  return nf;
}

// The lines of the next group's rows (near, n of them; null: none) that start in block b of
// blocks of db bytes, and the first block's first line, asked for at the walk's level (l2); those
// of the group's after that (far) into L2: the down walks' requests a block ahead of their rows
template <int N>
PREFETCHES void ask_block_lines(const uint8_t* const* near, const uint8_t* const* far, int64_t b, int64_t blo,
                                int64_t db, bool l2) {
  const int64_t at = b * db;
  for (int64_t o = b == blo ? at / 64 * 64 : (at + 63) / 64 * 64; o < at + db; o += 64)
    for (int k = 0; k < N; k++) {
      if (near[k]) prefetch_line(near[k] + o, l2);
      if (far[k]) prefetch_l2(far[k] + o);
    }
}

// The Q8_0 down walks' requests, for a group of g rows with `left` rows from its first on,
// over the blocks [blo, bhi): for the next group's rows (near, those that exist, at the walk's
// level) and, `far_on`, the one's after (far, into L2): once per two blocks, by the first and
// last bytes of the pair's 68, with no test per line or row. Two addresses reach every line of
// the 68 where the pair starts at most 60 bytes into a line: for every pair of a row whose first
// pair starts a multiple of 4 bytes in (each next one starts 68 bytes on). Else (an odd blo: one
// thread's share of the blocks; a row whose bytes sit otherwise) the line after the first too.
struct PairLines {
  static constexpr int64_t db = 34;  // a Q8_0 block: f16 scale, 32 int8 weights
  const uint8_t* const* near;
  const uint8_t* const* far;
  int nn, nfar;  // how many of the next group's rows exist, and of the one's after (asked for)
  int64_t blo, bhi;
  bool two = true, l2;
  PairLines(const uint8_t* const* near_, const uint8_t* const* far_, int64_t left, int g,
            bool far_on, int64_t blo_, int64_t bhi_, bool l2_)
      : near(near_), far(far_), nn((int)std::clamp<int64_t>(left - g, 0, g)),
        nfar(far_on ? (int)std::clamp<int64_t>(left - 2 * g, 0, g) : 0), blo(blo_), bhi(bhi_),
        l2(l2_) {
    for (int k = 0; k < nn; k++) two &= ((uintptr_t)(near[k] + blo * db) & 3) == 0;
    for (int k = 0; k < nfar; k++) two &= ((uintptr_t)(far[k] + blo * db) & 3) == 0;
  }
  PREFETCHES void ask(int64_t b) const {
    if ((b - blo) & 1) return;  // (asked at b - 1)
    // blocks b and b + 1 (or b alone)
    const int64_t o = b * db, end = (b + 1 < bhi ? 2 * db : db) - 1;
    auto one = [&](const uint8_t* r, bool into_l2) __attribute__((always_inline)) {
      prefetch_line(r + o, into_l2), prefetch_line(r + o + end, into_l2);
      if (!two) prefetch_line(r + o + 64, into_l2);
    };
    for (int k = 0; k < nn; k++) one(near[k], l2);
    for (int k = 0; k < nfar; k++) one(far[k], true);
  }
};

// downs_fmt's one-row step (decode) over Q8_0 down rows, every build: per block of out, each of
// the group's rows' 32 weights widened and added as it is read (acc = fma(h d, w, acc), the
// group's rows in order, out's block loaded and stored once: the same floats as downs_rows_q8), and
// the lines of the next group's rows (and, `far`, of the one's after, into L2) asked for once per
// two blocks (PairLines). Where the general walk widened all of a group's weights first and asked
// for each line that starts in a block, row by row with a test for a missing one, a record took
// 0.79-1.03x the time with the records in the caches (one thread), from memory 0.96x at 2%
// active and 0.88x at 20% (a tie at 5-10% while memory read slowly), and the 8-layer 7B-shape
// token's FFN 0.95-0.96x while memory read fast, on a Zen 5 EPYC (BENCHMARKS.md, "The records
// kernel's one-row down walk"). With AVX2 the general walk was a call per block of four rows,
// each widened vector added as it was read, and the same test per line: with the walk here, a
// 7B layer's records step from memory 1.22x, 1.11x, 1.27x and 1.23x as fast at 1, 5, 10 and 20%
// active (2 threads of an EPYC Milan, `benchmarks/kernel_ab.py --product records`, the rounds'
// medians; BENCHMARKS.md, "The AVX2 records kernel's down rows by the AVX-512 walks").
template <typename Row>
void downs_one_q8(const int64_t* fired, int64_t nf, const float* hin, int64_t blo, int64_t bhi,
                  float* out, const Row& row, bool far_on, bool l2) {
  constexpr int64_t db = PairLines::db;
  constexpr int DG = 2 * DOWNS;  // (downs_fmt's group with AVX-512)
  for (int64_t i = 0; i < nf; i += DG) {
    const int dn = (int)std::min<int64_t>(DG, nf - i);
    const uint8_t *rows[DG], *near[DG], *far[DG];
    float h[DG];
    for (int k = 0; k < DG; k++) {
      rows[k] = row(i + k), near[k] = row(i + DG + k), far[k] = row(i + 2 * DG + k);
      h[k] = k < dn ? hin[fired[i + k]] : 0.0f;
    }
    const PairLines lines(near, far, nf - i, DG, far_on, blo, bhi, l2);
    with_bool(dn == DG, [&](auto full) {  // (a whole group's row loop unrolled)
      const int n = decltype(full)::value ? DG : dn;
      for (int64_t b = blo; b < bhi; b++) {
        lines.ask(b);
        float* o = out + 32 * b;
        V acc[NV];
        for (int v = 0; v < NV; v++) acc[v] = vload(o + v * W);
        for (int k = 0; k < n; k++) {
          const uint8_t* q = rows[k] + b * db;
          const V hv = vset(h[k] * half(q));
          for (int v = 0; v < NV; v++) acc[v] = vfma(hv, i8_to_f32((const int8_t*)q + 2 + v * W), acc[v]);
        }
        for (int v = 0; v < NV; v++) vstore(o + v * W, acc[v]);
      }
    });
  }
}

// downs_fmt's step over several input rows (a batch's decode) and Q8_0 down rows, every build:
// the fired neurons RG at a time; per row, the group's neurons whose activation in that row is
// not zero, found once for the group (where the general walk tested every neuron's activation in
// every row at every block: a branch the predictor missed, a sixth of a 32-row step's down-row
// samples), and per block of out the group's weights widened once into L1 and each row's block
// loaded and stored once for RG neurons (where the general walk's eight left out's loads and
// stores at a third of its samples); the next group's lines, and where `far_ahead` says so the
// group's after that into L2, asked for once per two blocks (PairLines: the step over 4, 8 and 16
// rows 1.06x, 1.05x and 1.02x by the rounds' median, where a test per line and row
// (ask_block_lines) was a tenth of this walk's samples at 4 rows; a Zen 5 EPYC). Each row's sums
// are those the general walk gave (acc = fma(h d, w, acc), the neurons in order, a zero
// activation skipped): the same floats. Every build: with AVX2, where the general walk (four rows
// a group, every activation tested at every block) ran before, the records step over 8 and 32
// rows 1.49x and 2.13x as fast (2 threads of an EPYC Milan, `kernel_ab.py --product records
// --batch B`, the rounds' medians; BENCHMARKS.md, "The AVX2 records kernel's down rows by the
// AVX-512 walks").
constexpr int RG = 32;
template <typename Row>
void downs_rows_q8(const int64_t* fired, int64_t nf, const float* hin, int64_t B, int64_t dim, int64_t blo,
                   int64_t bhi, float* out, const Row& row, bool far_on, bool l2) {
  constexpr int64_t db = PairLines::db;
  alignas(64) float wb[RG][32];
  uint8_t list[MAXB][RG];
  float hr[MAXB][RG];
  int cnt[MAXB];
  for (int64_t i = 0; i < nf; i += RG) {
    const int gn = (int)std::min<int64_t>(RG, nf - i);
    const uint8_t *rows[RG], *near[RG], *far[RG];  // the group's, the next group's, the one's after
    for (int k = 0; k < RG; k++) {
      rows[k] = k < gn ? row(i + k) : nullptr, near[k] = row(i + RG + k);
      far[k] = far_on ? row(i + 2 * RG + k) : nullptr;
    }
    for (int64_t r = 0; r < B; r++) {  // (each written, kept where not zero: no branch)
      int c = 0;
      for (int k = 0; k < gn; k++) {
        const float hv = hin[fired[i + k] * B + r];
        list[r][c] = (uint8_t)k, hr[r][c] = hv;
        c += hv != 0.0f;
      }
      cnt[r] = c;
    }
    const PairLines lines(near, far, nf - i, RG, far_on, blo, bhi, l2);
    for (int64_t b = blo; b < bhi; b++) {
      lines.ask(b);
      float s[RG];
      for (int k = 0; k < gn; k++) {
        const uint8_t* q = rows[k] + b * db;
        s[k] = half(q);
        for (int v = 0; v < NV; v++) vstore(wb[k] + v * W, i8_to_f32((const int8_t*)q + 2 + v * W));
      }
      for (int64_t r = 0; r < B; r++) {
        if (!cnt[r]) continue;
        float* o = out + r * dim + 32 * b;
        V acc[NV];
        for (int v = 0; v < NV; v++) acc[v] = vload(o + v * W);
        for (int c = 0; c < cnt[r]; c++) {
          const int k = list[r][c];
          const V hv = vset(hr[r][c] * s[k]);
          for (int v = 0; v < NV; v++) acc[v] = vfma(hv, vload(wb[k] + v * W), acc[v]);
        }
        for (int v = 0; v < NV; v++) vstore(o + v * W, acc[v]);
      }
    }
  }
}

// DownsFn: Q8_0 down rows (the 4-bit records') by the walks above; the others' (f32, bf16, i8)
// DG at a time (one load and store of out's block for the group, added in the group's order:
// the same sums as one at a time), each group's pass over the blocks asking for the next group's
// lines and, where `far_ahead` says so, into L2 the group's after that.
template <int FMT, int DFMT>
void downs_fmt(const FFNArgs& a, const int64_t* fired, int64_t nf, const float* hin, int64_t blo, int64_t bhi,
               float* out) {
  const int64_t B = a.B, dim = a.dim;
  const int64_t skip = (gated_act(a.act) ? 2 : 1) * row_bytes(FMT, dim);  // the lead rows before the down row
  constexpr int64_t db = block_bytes<DFMT>();
  // eight rows a group with AVX-512 (1.01-1.03x four when Q8_0 rows took this loop, a 7B layer at
  // 15% active from memory on a Xeon with AMX); four with AVX2, whose 16 registers would not hold
  // a batch's eight widened
  constexpr int DG = NV > 2 ? DOWNS : 2 * DOWNS;
  auto row = [&](int64_t i) -> const uint8_t* {
    return i < nf ? a.w + a.sel[fired[i]] * a.neuron_bytes + skip : nullptr;
  };
  const bool far_on = far_ahead.load(std::memory_order_relaxed) & FAR_DOWNS, l2 = prefetch_to_l2();
  if constexpr (DFMT == Q8_0) {
    if (B == 1) return downs_one_q8(fired, nf, hin, blo, bhi, out, row, far_on, l2);
    return downs_rows_q8(fired, nf, hin, B, dim, blo, bhi, out, row, far_on, l2);
  } else {
    for (int64_t i = 0; i < nf; i += DG) {
      const int dn = (int)std::min<int64_t>(DG, nf - i);
      const uint8_t *rows[DG], *near[DG], *far[DG];
      float h[DG][MAXB];
      for (int k = 0; k < DG; k++) {
        rows[k] = k < dn ? row(i + k) : nullptr;
        near[k] = row(i + DG + k), far[k] = far_on ? row(i + 2 * DG + k) : nullptr;
        if (k < dn) std::copy(hin + fired[i + k] * B, hin + fired[i + k] * B + B, h[k]);
      }
      for (int64_t b = blo; b < bhi; b++) {
        ask_block_lines<DG>(near, far, b, blo, db, l2);
        if (dn == DG)
          axpy_block<DFMT, DG>(rows, b, h, B, dim, out);
        else
          for (int k = 0; k < dn; k++) axpy_block<DFMT, 1>(rows + k, b, h + k, B, dim, out);
      }
    }
  }
}

// y[r, i] for rows [begin, end): each row's dot products in one pass, the row after next
// prefetched
template <int FMT>
inline void gemv_fmt(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end,
                     float* y) {
  const int64_t rb = row_bytes(FMT, a.dim);
  float d[MAXB];
  for (int64_t i = begin; i < end; i++) {
    const uint8_t* pf = i + 2 < end ? w + (i + 2) * rb : nullptr;
    const uint8_t* row = w + i * rb;
    float* out = d;
    stages<FMT>(1, a, &row, Ahead{{pf}}, &out);
    for (int64_t r = 0; r < a.B; r++) y[r * n + i] = d[r];
  }
}

#if defined(__AVX512BF16__)
// bf16 rows times one input row (decode): four rows at a time, each input block loaded once for
// the four; the sums are the same as gemv_fmt's, in the same order (blocks alternate between two
// accumulators). dim a multiple of 64. The next four rows were once prefetched into L2 over the
// pass (1.11-1.19x a row at a time, 12,288 x 4,096 matrices, 2 threads); on the same kind of VM
// later, with its memory reading faster, that prefetch cost 13-19% (benchmarks/gemv.py, the two
// builds alternated), and the hardware's own prefetchers keep four streams fed.
inline void gemv_bf16_x4(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end, float* y) {
  const int64_t rb = a.dim * 2, nb = a.dim / 32;
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    __m512 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint8_t* rows = w + i * rb;
    for (int64_t b = 0; b < nb; b += 2) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void*)(a.xb + 32 * b));
      const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void*)(a.xb + 32 * b + 32));
      for (int r = 0; r < 4; r++) {
        const uint8_t* p = rows + r * rb + 64 * b;
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_loadu_si512((const void*)p), x0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_loadu_si512((const void*)(p + 64)), x1);
      }
    }
    for (int r = 0; r < 4; r++) y[i + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
  if (i < end) gemv_fmt<BF16>(w, a, n, i, end, y);
}
#endif

inline void gemv(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end, float* y) {
#if defined(__AVX512BF16__)
  if (a.fmt == BF16 && a.B == 1 && a.dim % 64 == 0) return gemv_bf16_x4(w, a, n, begin, end, y);
#endif
  with_format(a.fmt, [&](auto f) { gemv_fmt<decltype(f)::value>(w, a, n, begin, end, y); });
}

// v's bits with the rounding to bf16 (to nearest even; finite values) added: the bf16 value in
// each lane's high half
#if defined(__AVX512F__)
inline __m512i bf16_bits(V v) {
  const __m512i i = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(i, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}
#else
inline __m256i bf16_bits(V v) {
  const __m256i i = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(i, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}
#endif

// v rounded to bf16 (to nearest even; the weights are finite) and stored at p: AVX512_BF16's one
// instruction where the build has it (the same values but that it flushes a denormal to zero;
// the six integer operations took most of a prompt's product over records at 16 rows, widening
// them), else the rounding in integers
inline void store_bf16_int(uint16_t* p, V v) {  // (the rounding in integers, every build)
#if defined(__AVX512F__)
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
#else
  const __m256i i = _mm256_srli_epi32(bf16_bits(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(i, i), 0x08);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
#endif
}
inline void store_bf16(uint16_t* p, V v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
  store_bf16_int(p, v);
#endif
}

// v rounded to bf16 and held as float32 (the low halves zero)
inline V vround_bf16(V v) {
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32((int)0xFFFF0000u)));
#else
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits(v), _mm256_set1_epi32((int)0xFFFF0000u)));
#endif
}

// act_value over n values, all but GELU's erf in vectors: the same operations in the same
// order, each rounding to bf16 the integer one c10::BFloat16 makes (finite values), the
// exponential the scalar std::exp's (its vector forms give other last bits), so that a value's
// result does not depend on where a thread's part starts. A prompt's step of a block slice spent
// a fifth of its time on them one value at a time (SmolLM2 in bf16, 480 tokens: the prompt in
// the native loop 1.26x the modules' time, whose ops run in vectors).
inline void activate(int act, bool bf16, const float* g, const float* u, float* h, int64_t n) {
  int64_t i = 0;
  if (act != GELU) {
    auto r = [&](V v) { return bf16 ? vround_bf16(v) : v; };
#if defined(__AVX512F__)
    auto pos = [](V v) { return _mm512_max_ps(v, _mm512_setzero_ps()); };  // v > 0 ? v : 0
    auto div = [](V a, V b) { return _mm512_div_ps(a, b); };
#else
    auto pos = [](V v) { return _mm256_max_ps(v, _mm256_setzero_ps()); };
    auto div = [](V a, V b) { return _mm256_div_ps(a, b); };
#endif
    for (; i + W <= n; i += W) {
      const V uu = r(vload(u + i));
      V out;
      if (act == RELU) {
        out = pos(uu);
      } else {
        const V gg = r(vload(g + i));
        if (act == REGLU) {
          out = r(vmul(pos(gg), uu));
        } else if (act == DREGLU) {
          out = r(vmul(pos(gg), pos(uu)));
        } else {  // SwiGLU: g / (1 + e^-g); GeGLU: g / (1 + e^(-2y)) (gelu_tanh)
          alignas(64) float e[W];
          if (act == GEGLU) {
            const V y = vmul(vset(0.7978845608028654f), vadd(gg, vmul(vmul(vmul(vset(0.044715f), gg), gg), gg)));
            vstore(e, vmul(vset(-2.0f), y));
            for (int j = 0; j < W; j++) e[j] = std::exp(e[j]);
          } else {
            vstore(e, gg);
            for (int j = 0; j < W; j++) e[j] = std::exp(-e[j]);
          }
          out = r(vmul(r(div(gg, vadd(vset(1.0f), vload(e)))), uu));
        }
      }
      vstore(h + i, out);
    }
  }
  for (; i < n; i++) h[i] = act_value(act, g ? g[i] : 0.0f, u[i], bf16);
}

// v's NaN lanes as c10's one quiet NaN (0x7FC00000), which the roundings to bf16 above keep;
// the other lanes as they are
inline V quiet_nans(V v) {
#if defined(__AVX512F__)
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
#else
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
#endif
}

// p[i] = round_to_bf16(p[i]) for i < n, in vectors: the values a bf16 tensor holds, kept as
// float32 (ops.cpp's projections' rows and the head's; one value at a time there, in a build
// for no particular instruction set)
inline void round_bf16(float* p, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(p + i, vround_bf16(quiet_nans(vload(p + i))));
  for (; i < n; i++) p[i] = round_to_bf16(p[i]);
}

// h[i] = bf16(float(h[i]) + round_to_bf16(y[i])) for i < n, h bf16 (its bits): a residual's add
// in bf16 with c10::BFloat16's roundings, in vectors (join_parts in ops.cpp: a prompt's two adds
// a layer over its rows, one value at a time there, took 4.2 ms each of SmolLM2's 480-token
// prompt in bf16 against 1.0-1.3 ms in float32)
inline void add_bf16(uint16_t* h, const float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W)
    store_bf16_int(h + i, quiet_nans(vadd(bf16_to_f32(h + i), vround_bf16(quiet_nans(vload(y + i))))));
  for (; i < n; i++) {
    uint32_t b = (uint32_t)h[i] << 16;
    float v;
    std::memcpy(&v, &b, 4);
    v = round_to_bf16(v + round_to_bf16(y[i]));
    std::memcpy(&b, &v, 4);
    h[i] = (uint16_t)(b >> 16);
  }
}

template <int FMT, typename O>
inline void widen_row(const uint8_t* row, int64_t dim, O* out) {
  V w[NV];
  for (int64_t blk = 0; blk < dim / 32; blk++) {
    block<FMT>(row, blk, dim / 32, w);
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
    for (int64_t r = 0; r < rows; r++)  // a record's rows, or one row of a plain matrix
      with_format(rows == 1 ? fmt : r + 1 < rows ? record_format(fmt) : down_format(fmt), [&](auto f) {
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
  static I izero() { return _mm512_setzero_si512(); }
  static I bytes(int8_t v) { return _mm512_set1_epi8(v); }
  static I words(int16_t v) { return _mm512_set1_epi16(v); }
  static I dwords(int32_t v) { return _mm512_set1_epi32(v); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static I bxor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I abs8(I a) { return _mm512_abs_epi8(a); }
  // x negated where s < 0 (psignb's product signs; AVX-512 has no such instruction)
  static I sign8(I x, I s) { return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(s), _mm512_setzero_si512(), x); }
  static I shr4(I a) { return _mm512_srli_epi16(a, 4); }
  template <int S> static I shl16(I a) { return _mm512_slli_epi16(a, S); }
  template <int S> static I shr16(I a) { return _mm512_srli_epi16(a, S); }
  static I dot(I u8, I s8) { return _mm512_maddubs_epi16(u8, s8); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I widen16(I a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  // acc + the sums of 4 products u8 x s8 per lane (VNNI's one instruction where the build has it)
  static I dot4(I acc, I u8, I s8) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u8, s8);
#else
    return add32(acc, widen16(dot(u8, s8)));
#endif
  }
  static I u8x(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I s8x(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static F i2f(I a) { return _mm512_cvtepi32_ps(a); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#else
struct QV {
  using I = __m256i;
  using F = __m256;
  static constexpr int LANES = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I izero() { return _mm256_setzero_si256(); }
  static I bytes(int8_t v) { return _mm256_set1_epi8(v); }
  static I words(int16_t v) { return _mm256_set1_epi16(v); }
  static I dwords(int32_t v) { return _mm256_set1_epi32(v); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static I bxor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I abs8(I a) { return _mm256_abs_epi8(a); }
  static I sign8(I x, I s) { return _mm256_sign_epi8(x, s); }  // x negated where s < 0 (0 where 0)
  static I shr4(I a) { return _mm256_srli_epi16(a, 4); }
  template <int S> static I shl16(I a) { return _mm256_slli_epi16(a, S); }
  template <int S> static I shr16(I a) { return _mm256_srli_epi16(a, S); }
  static I dot(I u8, I s8) { return _mm256_maddubs_epi16(u8, s8); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen16(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I dot4(I acc, I u8, I s8) { return add32(acc, widen16(dot(u8, s8))); }
  static I u8x(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I s8x(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static F i2f(I a) { return _mm256_cvtepi32_ps(a); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif

// A 32-weight block of 16 rows (four 64-byte vectors of nibble runs, as q4x16 stores them) split
// into its low and high nibbles for pass `part` of the group.
inline void nibbles(const uint8_t* b, int part, QV::I* lo, QV::I* hi) {
  const QV::I mask = QV::bytes(0x0F);
  for (int k = 0; k < 4; k++) {
    const QV::I v = QV::load(b + 64 * k + 4 * QV::LANES * part);
    lo[k] = QV::band(v, mask);
    hi[k] = QV::band(QV::shr4(v), mask);
  }
}

// Per lane (row), the sum over one block of 32 of its 4-bit weights times x's 8-bit values xb:
// VNNI's 8 instructions where the build has it, else 8 pairwise sums of 4 products in 16 bits
// (at most 8 * 2 * 15 * 127: no saturation) widened once.
inline QV::I block_sums4(const QV::I* lo, const QV::I* hi, const int8_t* xb) {
#if defined(__AVX512VNNI__)
  QV::I s = QV::izero();
  for (int k = 0; k < 4; k++) {
    s = QV::dot4(s, lo[k], QV::dwords(load4(xb + 4 * k)));
    s = QV::dot4(s, hi[k], QV::dwords(load4(xb + 16 + 4 * k)));
  }
  return s;
#else
  QV::I s = QV::dot(lo[0], QV::dwords(load4(xb)));
  s = QV::add16(s, QV::dot(hi[0], QV::dwords(load4(xb + 16))));
  for (int k = 1; k < 4; k++) {
    s = QV::add16(s, QV::dot(lo[k], QV::dwords(load4(xb + 4 * k))));
    s = QV::add16(s, QV::dot(hi[k], QV::dwords(load4(xb + 16 + 4 * k))));
  }
  return QV::widen16(s);
#endif
}

// The dense GEMVs' lines `bytes` from p, asked for at the process's `prefetch_level`; into L2
// each also a second time PF_AGAIN bytes further ahead (one request of the two may find the L2
// queue full: asked for once, 8 KiB further or not, the q4kx16 GEMV read 3-7% slower, 5-14%
// held to avx2, on the Xeon with AMX)
constexpr int64_t PF_AGAIN = 8192;
PREFETCHES void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  if (prefetch_to_l2()) {
    for (int64_t o = 0; o < bytes; o += 64) {
      _mm_prefetch((const char*)p + o, _MM_HINT_T1);
      _mm_prefetch((const char*)p + PF_AGAIN + o, _MM_HINT_T1);
    }
  } else {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
  }
}

// One walk over a group's bytes for input rows r0..r0+R-1: QV::LANES rows a part (AVX-512 makes
// one part of the group's 16 rows, AVX2 two), each part's R rows of sums in registers;
// body(part, u, acc) adds unit u of the group (a block, or a K-quant super-block) of the part's
// rows into acc, and both parts of a unit run before the next unit is read. (AVX2 used to make
// a whole pass per part, the second over bytes the first had read: the memory idled for that
// pass. One walk read a Q4_K matrix twice the L3 at 21-23 GB/s against 15-17 on two cores, and
// the 7B-shape token held to avx2 went from 70.0 to 58.9 ms, 78% to 87% of its byte floor.)
template <int R, typename Body>
inline void group_walk(int64_t r0, int64_t n, int64_t g, int64_t units, float* y, Body&& body) {
  constexpr int P = 16 / QV::LANES;
  QV::F acc[P][R];
  for (int p = 0; p < P; p++)
    for (int r = 0; r < R; r++) acc[p][r] = QV::fzero();
  for (int64_t u = 0; u < units; u++)
    for (int p = 0; p < P; p++) body(p, u, acc[p]);
  for (int p = 0; p < P; p++)
    for (int r = 0; r < R; r++) QV::store(y + (r0 + r) * n + 16 * g + QV::LANES * p, acc[p][r]);
}

// Per lane (row), block_sums4's sums over 5-bit weights (q5x16, q5kx16): without VNNI two
// halves of four pairwise sums in 16 bits (at most 4 * 2 * 31 * 127), each widened: eight
// would overflow.
inline QV::I block_sums5(const QV::I* lo, const QV::I* hi, const int8_t* xb) {
#if defined(__AVX512VNNI__)
  return block_sums4(lo, hi, xb);
#else
  QV::I s[2];
  for (int h = 0; h < 2; h++) {
    const int k = 2 * h;
    QV::I t = QV::dot(lo[k], QV::dwords(load4(xb + 4 * k)));
    t = QV::add16(t, QV::dot(hi[k], QV::dwords(load4(xb + 16 + 4 * k))));
    t = QV::add16(t, QV::dot(lo[k + 1], QV::dwords(load4(xb + 4 * k + 4))));
    s[h] = QV::widen16(QV::add16(t, QV::dot(hi[k + 1], QV::dwords(load4(xb + 20 + 4 * k)))));
  }
  return QV::add32(s[0], s[1]);
#endif
}

// The fifth bits of a block's codes (one vector: byte p holds, from bit 0, those of the weights
// at byte p of low vector 0, high vector 0, low vector 1, ..., high vector 3) onto bit 4 of
// `lo` and `hi` (16-bit shifts: the mask drops what crosses a byte)
inline void fifth_bits(const uint8_t* h5, int part, QV::I* lo, QV::I* hi) {
  const QV::I m10 = QV::bytes(0x10), h = QV::load(h5 + 4 * QV::LANES * part);
  lo[0] = QV::bor(lo[0], QV::band(QV::shl16<4>(h), m10));
  hi[0] = QV::bor(hi[0], QV::band(QV::shl16<3>(h), m10));
  lo[1] = QV::bor(lo[1], QV::band(QV::shl16<2>(h), m10));
  hi[1] = QV::bor(hi[1], QV::band(QV::shl16<1>(h), m10));
  lo[2] = QV::bor(lo[2], QV::band(h, m10));
  hi[2] = QV::bor(hi[2], QV::band(QV::shr16<1>(h), m10));
  lo[3] = QV::bor(lo[3], QV::band(QV::shr16<2>(h), m10));
  hi[3] = QV::bor(hi[3], QV::band(QV::shr16<3>(h), m10));
}

// q4x16 and (FIVE) q5x16: per block of 32, w = d * q + m (q4x16: Q4_0's m = -8 d, Q4_1's own;
// q5x16: q in 0..31, Q5_0's m = -16 d, Q5_1's own), the 64 bytes of fifth bits after the
// nibble runs (384 bytes a block: 6 bits a weight against the file's 5.5 and 6, where the
// converted copy's Q8_0 takes 8.5)
template <int R, bool FIVE>
inline void x16_45_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                         float* y) {
  using F = QV::F;
  constexpr int L = QV::LANES;
  constexpr int64_t BLOCK = FIVE ? Q5X16_BLOCK : Q4X16_BLOCK;
  const int64_t nb = a.dim / 32, dim = a.dim;
  group_walk<R>(r0, n, g, nb, y, [&](int part, int64_t blk, F* acc) {
    const uint8_t* b = gw + blk * BLOCK;
    if (part == 0) prefetch_ahead(b + Q4X16_PF * BLOCK, BLOCK);
    const F d = QV::halves(b + 2 * L * part), m = QV::halves(b + 32 + 2 * L * part);
    QV::I lo[4], hi[4];
    nibbles(b + 64, part, lo, hi);
    if constexpr (FIVE) fifth_bits(b + 320, part, lo, hi);
    for (int r = 0; r < R; r++) {
      const int64_t row = r0 + r;
      const int8_t* xb = a.xq + row * dim + 32 * blk;
      const QV::I s = FIVE ? block_sums5(lo, hi, xb) : block_sums4(lo, hi, xb);
      acc[r] = QV::fma(QV::i2f(s), QV::fmul(d, QV::fset(a.xd[row * nb + blk])), acc[r]);
      acc[r] = QV::fma(m, QV::fset(a.xs[row * nb + blk]), acc[r]);
    }
  });
}

template <int R>
inline void q4x16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                        float* y) {
  x16_45_group<R, false>(gw, a, r0, n, g, y);
}

template <int R>
inline void q5x16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                        float* y) {
  x16_45_group<R, true>(gw, a, r0, n, g, y);
}

// ---- Q4_K and Q6_K rows interleaved by 16 (`q4kx16`, `q6kx16`): the K-quant files' GEMVs ----
// A Q4_K_M file's matrices kept in their own bits (4.625 and 6.5625 a weight against the file's
// 4.5 and 6.5625; as Q4_1 and Q8_0 blocks they were 5 and 8.5), regrouped like q4x16 so that one vector covers 16 rows. Group g
// is dim/256 super-blocks, each of 16 rows and 256 weights:
//   q4kx16 (Q4_K: w = d * sc_j * q - dmin * m_j, q in 0..15, sub-block j of 32 weights):
//     [0, 32) d, [32, 64) dmin: 16 f16 each, row 0 first
//     [64, 2368) 8 sub-blocks of 288 bytes: the 16 rows' 6-bit scales (a byte each, row 0
//       first), their minimums, then q4x16's four vectors of nibble runs (one stream: the
//       scales apart from the codes read at 0.75x the rate from memory)
//   q5kx16 (Q5_K: q4kx16's with q in 0..31): q4kx16's with each sub-block 352 bytes, its
//     nibble runs followed by the 64 bytes of their fifth bits (`fifth_bits`)
//   q6kx16 (Q6_K: w = d * sc_i * (q - 32), q in 0..63, sub-block i of 16 weights):
//     [0, 32) d: 16 f16
//     [32, 288) sc: sub-block i's 16 rows' int8 scales at 32 + 16 i
//     [288, 3360) 8 blocks of 32 weights, 384 bytes each: the low 4 bits of q as q4x16's four
//       vectors of nibble runs (the block's sub-blocks 2j and 2j+1 are its low and high
//       nibbles), then two vectors of the top 2 bits: byte p of the first holds, from bit 0,
//       those of the weights at byte p of low vector 0, high vector 0, low vector 1 and high
//       vector 1; the second the same for vectors 2 and 3.
// The dot products run in integers over x's 8-bit blocks of 32 (a Q6_K pair of sub-blocks meets
// one of them; q - 32 through x's sums per 16), one float multiply-add per block.
#ifndef KX16_PF
#define KX16_PF 5120
#endif

// q4kx16 and (FIVE) q5kx16: w = d * sc_j * q - dmin * m_j, one float multiply-add each a block
template <int R, bool FIVE>
inline void k45x16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                         float* y) {
  using F = QV::F;
  using I = QV::I;
  constexpr int L = QV::LANES;
  constexpr int64_t SB = FIVE ? Q5KX16_SB : Q4KX16_SB, SUB = FIVE ? 352 : 288;
  constexpr int64_t ASK = (SB + 7) / 8;  // a sub-block's share of the lines asked for ahead
  const int64_t nb = a.dim / 32, dim = a.dim;
  group_walk<R>(r0, n, g, a.dim / 256, y, [&](int part, int64_t s, F* acc) {
    const uint8_t* sb = gw + s * SB;
    const F d = QV::halves(sb + 2 * L * part), dmin = QV::halves(sb + 32 + 2 * L * part);
    for (int j = 0; j < 8; j++) {
      const uint8_t* b = sb + 64 + SUB * j;
      if (part == 0) prefetch_ahead(sb + KX16_PF + ASK * j, ASK);
      const F ds = QV::fmul(d, QV::i2f(QV::u8x(b + L * part)));
      const F ms = QV::fmul(dmin, QV::i2f(QV::u8x(b + 16 + L * part)));
      I lo[4], hi[4];
      nibbles(b + 32, part, lo, hi);
      if constexpr (FIVE) fifth_bits(b + 288, part, lo, hi);
      const int64_t blk = 8 * s + j;
      for (int r = 0; r < R; r++) {
        const int64_t row = r0 + r;
        const int8_t* xb = a.xq + row * dim + 32 * blk;
        const I t = FIVE ? block_sums5(lo, hi, xb) : block_sums4(lo, hi, xb);
        acc[r] = QV::fma(QV::i2f(t), QV::fmul(ds, QV::fset(a.xd[row * nb + blk])), acc[r]);
        acc[r] = QV::fnma(ms, QV::fset(a.xs[row * nb + blk]), acc[r]);
      }
    }
  });
}

template <int R>
inline void q4kx16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                         float* y) {
  k45x16_group<R, false>(gw, a, r0, n, g, y);
}

template <int R>
inline void q5kx16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                         float* y) {
  k45x16_group<R, true>(gw, a, r0, n, g, y);
}

template <int R>
inline void q6kx16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                         float* y) {
  using I = QV::I;
  using F = QV::F;
  constexpr int L = QV::LANES;
  const int64_t nb = a.dim / 32, dim = a.dim;
  const I m30 = QV::bytes(0x30);
  group_walk<R>(r0, n, g, a.dim / 256, y, [&](int part, int64_t s, F* acc) {
    const uint8_t* sb = gw + s * Q6KX16_SB;
    const F d = QV::halves(sb + 2 * L * part);
    for (int j = 0; j < 8; j++) {
      const uint8_t* b = sb + 288 + 384 * j;
      if (part == 0) prefetch_ahead(b + KX16_PF, 384 + (j == 7 ? 288 : 0));
      I lo[4], hi[4];
      nibbles(b, part, lo, hi);
      const I h0 = QV::load(b + 256 + 4 * L * part), h1 = QV::load(b + 320 + 4 * L * part);
      // each byte's 2-bit fields onto bits 4-5 (16-bit shifts: the mask drops what crosses)
      lo[0] = QV::bor(lo[0], QV::band(QV::shl16<4>(h0), m30));
      hi[0] = QV::bor(hi[0], QV::band(QV::shl16<2>(h0), m30));
      lo[1] = QV::bor(lo[1], QV::band(h0, m30));
      hi[1] = QV::bor(hi[1], QV::band(QV::shr16<2>(h0), m30));
      lo[2] = QV::bor(lo[2], QV::band(QV::shl16<4>(h1), m30));
      hi[2] = QV::bor(hi[2], QV::band(QV::shl16<2>(h1), m30));
      lo[3] = QV::bor(lo[3], QV::band(h1, m30));
      hi[3] = QV::bor(hi[3], QV::band(QV::shr16<2>(h1), m30));
      const I sca = QV::s8x(sb + 32 + 32 * j + L * part), scb = QV::s8x(sb + 48 + 32 * j + L * part);
      const int64_t blk = 8 * s + j;
      for (int r = 0; r < R; r++) {
        const int64_t row = r0 + r;
        const int8_t* xb = a.xq + row * dim + 32 * blk;
        I ia = QV::izero(), ib = QV::izero();
        for (int k = 0; k < 4; k++) {  // 4 products of at most 63 * 127 a lane: 32 bits
          ia = QV::dot4(ia, lo[k], QV::dwords(load4(xb + 4 * k)));
          ib = QV::dot4(ib, hi[k], QV::dwords(load4(xb + 16 + 4 * k)));
        }
        const int32_t* xs = a.x16 + row * 2 * nb + 2 * blk;  // (q - 32) . x = q . x - 32 sum(x)
        ia = QV::sub32(ia, QV::dwords(32 * xs[0]));
        ib = QV::sub32(ib, QV::dwords(32 * xs[1]));
        const I t = QV::add32(QV::mul32(ia, sca), QV::mul32(ib, scb));  // |t| < 2^24
        acc[r] = QV::fma(QV::i2f(t), QV::fmul(d, QV::fset(a.xd[row * nb + blk])), acc[r]);
      }
    }
  });
}

// ---- Q8_0 rows interleaved by 16 (`q8x16`): an 8-bit matrix of short rows (a small model's
// output head: 49,152 rows of 576 read at a fifth of the memory's rate a row at a time, where
// each row's 18 blocks cost their own sums and stores). Per block of 32 weights of 16 rows:
//   [0, 32) d: 16 f16, row 0 first
//   [32, 544) eight 64-byte vectors of codes: row i's weights 4k..4k+3 at 4i in vector k, each
//     q + 128 (0..255: the unsigned side of the byte products)
// With VNNI (q + 128) . x - 128 sum(x) in integers over x's 8-bit block (x's sums per 16),
// without it |q| . (x signed as q) in 16-bit pair sums; one float multiply-add per block: the
// Q8_0 row GEMV's sums, in another order.
#ifndef Q8X16_PF
#define Q8X16_PF 8
#endif

template <int R>
inline void q8x16_group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,
                        float* y) {
  using I = QV::I;
  using F = QV::F;
  constexpr int L = QV::LANES;
  const int64_t nb = a.dim / 32, dim = a.dim;
  group_walk<R>(r0, n, g, nb, y, [&](int part, int64_t blk, F* acc) {
    const uint8_t* b = gw + blk * Q8X16_BLOCK;
    if (part == 0) prefetch_ahead(b + Q8X16_PF * Q8X16_BLOCK, Q8X16_BLOCK);
    const F d = QV::halves(b + 2 * L * part);
    I w[8];
    for (int k = 0; k < 8; k++) w[k] = QV::load(b + 32 + 64 * k + 4 * L * part);
#if !defined(__AVX512VNNI__)  // the codes as signed bytes, |q| and its signs: q . x = |q| . (x sign q)
    I sg[8];  // (16-bit pair sums of at most 2 * 127 * 127: no saturation)
    for (int k = 0; k < 8; k++) {
      sg[k] = QV::bxor(w[k], QV::bytes((int8_t)0x80));  // q + 128 -> q
      w[k] = QV::abs8(sg[k]);
    }
#endif
    for (int r = 0; r < R; r++) {
      const int64_t row = r0 + r;
      const int8_t* xb = a.xq + row * dim + 32 * blk;
      I s = QV::izero();
#if defined(__AVX512VNNI__)
      for (int k = 0; k < 8; k++) s = QV::dot4(s, w[k], QV::dwords(load4(xb + 4 * k)));
      const int32_t* xs = a.x16 + row * 2 * nb + 2 * blk;
      s = QV::sub32(s, QV::dwords(128 * (xs[0] + xs[1])));
#else
      for (int k = 0; k < 8; k++) s = QV::dot4(s, w[k], QV::sign8(QV::dwords(load4(xb + 4 * k)), sg[k]));
#endif
      acc[r] = QV::fma(QV::i2f(s), QV::fmul(d, QV::fset(a.xd[row * nb + blk])), acc[r]);
    }
  });
}

// y[r, 16g..16g+15] = rows of group g . x[r] for groups [begin, end) of a matrix of n rows in the
// layout whose group kernel is K::group (input rows 4 at a time, the group's bytes read once a pass)
template <typename K>
inline void gemv_groups(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin, int64_t end,
                        float* y) {
  const int64_t gbytes = group_bytes(K::layout, a.dim);
  for (int64_t g = begin; g < end; g++) {
    const uint8_t* gw = w + g * gbytes;
    int64_t r = 0;
    if constexpr (QV::LANES == 16)  // (AVX-512: eight rows' sums and a block's codes fit its registers)
      for (; r + 8 <= a.B; r += 8) K::template group<8>(gw, a, r, n, g, y);
    for (; r + 4 <= a.B; r += 4) K::template group<4>(gw, a, r, n, g, y);
    switch (a.B - r) {
      case 3: K::template group<3>(gw, a, r, n, g, y); break;
      case 2: K::template group<2>(gw, a, r, n, g, y); break;
      case 1: K::template group<1>(gw, a, r, n, g, y); break;
    }
  }
}

#define POWERINFER_X16(NAME, LAYOUT)                                                              \
  struct NAME##_k {                                                                               \
    static constexpr int layout = LAYOUT;                                                         \
    template <int R>                                                                              \
    static void group(const uint8_t* gw, const FFNArgs& a, int64_t r0, int64_t n, int64_t g,     \
                      float* y) {                                                                 \
      NAME##_group<R>(gw, a, r0, n, g, y);                                                        \
    }                                                                                             \
  };                                                                                              \
  inline void gemv_##NAME(const uint8_t* w, const FFNArgs& a, int64_t n, int64_t begin,          \
                          int64_t end, float* y) {                                                \
    gemv_groups<NAME##_k>(w, a, n, begin, end, y);                                                \
  }
POWERINFER_X16(q4x16, Q4X16)
POWERINFER_X16(q4kx16, Q4KX16)
POWERINFER_X16(q6kx16, Q6KX16)
POWERINFER_X16(q5kx16, Q5KX16)
POWERINFER_X16(q5x16, Q5X16)
POWERINFER_X16(q8x16, Q8X16)
#undef POWERINFER_X16

inline int64_t acts(const FFNArgs& a, int64_t begin, int64_t end, float* h, int64_t* fired) {
  int64_t n = 0;
  with_format(record_format(a.fmt), [&](auto f) {
    constexpr int F = decltype(f)::value;
    // one input row: two neurons a pass (four rows side by side); else one
    n = a.B == 1 ? acts_fmt<F, 2>(a, begin, end, h, fired) : acts_fmt<F, 1>(a, begin, end, h, fired);
  });
  return n;
}
inline void downs(const FFNArgs& a, const int64_t* fired, int64_t nf, const float* h, int64_t blo, int64_t bhi,
                  float* out) {
  with_format(record_format(a.fmt), [&](auto f) {
    constexpr int F = decltype(f)::value;
    downs_fmt<F, down_format(F)>(a, fired, nf, h, blo, bhi, out);
  });
}

#include "attention.h"
#include "input_sparse.h"
#include "records_rows.h"

}  // namespace ISA_NS
}  // namespace powerinfer
#endif
