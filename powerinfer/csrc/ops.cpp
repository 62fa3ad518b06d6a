// The torch operator `powerinfer::neuron_ffn` over the per-ISA kernels of neuron_ffn.h, chosen
// once at load by what the CPU supports, parallel over neurons with ATen's thread pool: each
// thread accumulates its neurons' down rows into its own partial output, then the partials are
// summed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "neuron_ffn.h"

namespace powerinfer {
// Instruction sets, each a superset of the one before.
static const std::vector<std::string> ISAS = {"avx2", "avx512", "avx512bf16"};

static std::string pick_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return __builtin_cpu_supports("avx512bf16") ? "avx512bf16" : "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "none";
}

static const std::string BEST = pick_isa();
static std::string ISA = BEST;

static std::string isa() { return ISA; }

static int64_t rank(const std::string& isa) {
  return std::find(ISAS.begin(), ISAS.end(), isa) - ISAS.begin();
}

// Run with a lesser instruction set than the best this CPU has (tests cover every path on one
// machine); returns the one in use before.
static std::string use_isa(const std::string& want) {
  TORCH_CHECK(rank(want) < (int64_t)ISAS.size(), "isa must be one of avx2, avx512, avx512bf16, got ", want);
  TORCH_CHECK(rank(want) <= rank(BEST), "this CPU cannot run ", want, " (best: ", BEST, ")");
  std::string before = ISA;
  ISA = want;
  return before;
}

// The entry points of the instruction set in use.
static const Kernels& active() {
  TORCH_CHECK(ISA != "none", "the CPU kernel needs a CPU with AVX2 and FMA");
  return ISA == "avx512bf16" ? kernels_avx512bf16 : ISA == "avx512" ? kernels_avx512 : kernels_avx2;
}

static void check_format(int64_t fmt) {
  TORCH_CHECK(fmt >= F32 && fmt <= Q8_0, "unknown weight format ", fmt);
}

// x: (B, dim) contiguous float32 (or bfloat16 where `bf16_ok`), 1 to 64 rows (the kernels'
// MAXB), dim a multiple of 32
static void check_input(const at::Tensor& x, bool bf16_ok = false) {
  const bool type_ok = x.scalar_type() == at::kFloat || (bf16_ok && x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(x.dim() == 2 && type_ok && x.is_contiguous(),
              bf16_ok ? "x: (B, dim) contiguous float32 or bfloat16" : "x: (B, dim) contiguous float32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 64, "the kernel takes 1 to 64 rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) % 32 == 0, "dim must be a multiple of 32, got ", x.size(1));
}

// w: (n, bytes) contiguous uint8 rows or records
static void check_rows(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w: (n, bytes) contiguous uint8");
}

// The input rows as format `fmt`'s dot products read them, held for one call: float32 for the
// float formats; rounded to bf16 for bf16 rows (in float for most instruction sets, as bf16 for
// native bf16 products); quantized to 8 bits per block for the block formats.
struct Input {
  at::Tensor xf, xb, xq, xd, xs;
};

static void prepare_input(int64_t fmt, const at::Tensor& x, FFNArgs& a, Input& in) {
  const bool bf16_in = x.scalar_type() == at::kBFloat16;
  if (fmt == BF16) {
    in.xb = bf16_in ? x : x.to(at::kBFloat16);
    in.xf = in.xb.to(at::kFloat);
    a.xb = (const uint16_t*)in.xb.data_ptr<at::BFloat16>();
  } else {
    in.xf = bf16_in ? x.to(at::kFloat) : x;
  }
  a.x = in.xf.data_ptr<float>();
  if (!integer_dots((int)fmt)) return;
  const int64_t B = x.size(0), nb = x.size(1) / 32;
  in.xq = at::empty({B, x.size(1)}, in.xf.options().dtype(at::kChar));
  in.xd = at::empty({B, nb}, in.xf.options());
  in.xs = at::empty({B, nb}, in.xf.options());
  quantize_input(a.x, B, x.size(1), in.xq.data_ptr<int8_t>(), in.xd.data_ptr<float>(),
                 in.xs.data_ptr<float>());
  a.xq = in.xq.data_ptr<int8_t>();
  a.xd = in.xd.data_ptr<float>();
  a.xs = in.xs.data_ptr<float>();
}

// x (B, dim) f32 or bf16; w (k, neuron_bytes) uint8 records; sel: the neurons to compute,
// (m,) int64 indices, or a (k,) bool mask over the records; keep: per-row masks, (B, m) bool
// for indices or (B, k) for a mask, or None; bias (k,) f32 or None -> (B, dim) in x's type:
// the sum over the selected neurons of h * down row (summed in float, rounded once).
static at::Tensor neuron_ffn(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sel,
                             const std::optional<at::Tensor>& keep,
                             const std::optional<at::Tensor>& bias, double threshold, int64_t act,
                             int64_t fmt) {
  const Kernels& k = active();
  check_input(x, true);
  check_rows(w);
  check_format(fmt);
  TORCH_CHECK(sel.dim() == 1 && sel.is_contiguous() &&
              (sel.scalar_type() == at::kLong || sel.scalar_type() == at::kBool),
              "sel: (m,) int64 or (k,) bool");
  TORCH_CHECK(act >= RELU && act <= SWIGLU, "unknown activation ", act);
  const int64_t B = x.size(0), dim = x.size(1), n = w.size(0);
  const int64_t nb = (act == RELU ? 1 : 2) * row_bytes(fmt, dim) + row_bytes(down_format(fmt), dim);
  TORCH_CHECK(w.size(1) == nb, "w: ", w.size(1), " bytes per neuron, expected ", nb);
  std::vector<int64_t> picked;  // a mask's neurons
  const bool by_mask = sel.scalar_type() == at::kBool;
  if (by_mask) {
    TORCH_CHECK(sel.numel() == n, "sel: a mask of ", sel.numel(), " for ", n, " neurons");
    const bool* mp = sel.data_ptr<bool>();
    for (int64_t j = 0; j < n; j++)
      if (mp[j]) picked.push_back(j);
  } else {  // bounds once here, so the kernel trusts sel
    const int64_t* sp = sel.data_ptr<int64_t>();
    for (int64_t i = 0; i < sel.numel(); i++)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < n, "sel holds an index outside the ", n, " neurons");
  }
  const int64_t m = by_mask ? (int64_t)picked.size() : sel.numel();
  FFNArgs a{nullptr, B, dim, w.data_ptr<uint8_t>(), w.size(1), nullptr,
            by_mask ? picked.data() : sel.data_ptr<int64_t>(), nullptr, m, (float)threshold, (int)act,
            (int)fmt};
  if (keep && keep->defined()) {
    const int64_t width = by_mask ? n : m;
    TORCH_CHECK(keep->scalar_type() == at::kBool && keep->is_contiguous() && keep->dim() == 2 &&
                keep->size(0) == B && keep->size(1) == width,
                "keep: (B, ", width, ") contiguous bool, one mask per row");
    a.keep = (const uint8_t*)keep->data_ptr<bool>();
    a.keep_stride = width;
    a.keep_by_neuron = by_mask;
  }
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "bias: (k,) float32");
    a.bias = bias->data_ptr<float>();
  }
  Input in;
  prepare_input(fmt, x, a, in);
  const int64_t nt = at::get_num_threads();
  at::Tensor part = at::zeros({nt, B, dim}, x.options().dtype(at::kFloat));
  float* pp = part.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    k.range(a, begin, end, pp + at::get_thread_num() * B * dim);
  });
  at::Tensor y = nt == 1 ? part[0] : part.sum(0);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// w (k, neuron_bytes) records of `rows` rows each (1: a plain matrix) -> (k, rows, dim) float32
static at::Tensor widen(const at::Tensor& w, int64_t fmt, int64_t rows, int64_t dim) {
  const Kernels& k = active();
  check_rows(w);
  check_format(fmt);
  TORCH_CHECK(rows >= 1 && rows <= 3 && dim % 32 == 0, "rows must be 1 to 3 and dim a multiple of 32");
  TORCH_CHECK(w.size(1) == (rows - 1) * row_bytes(fmt, dim) + row_bytes(rows == 1 ? fmt : down_format(fmt), dim),
              "w: ", w.size(1), " bytes per neuron do not fit the format");
  at::Tensor out = at::empty({w.size(0), rows, dim}, w.options().dtype(at::kFloat));
  const uint8_t* p = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.size(0), 16, [&](int64_t begin, int64_t end) {
    k.widen(p, w.size(1), (int)fmt, rows, dim, begin, end, o);
  });
  return out;
}

// x (B, dim) f32 or bf16; w (n, row_bytes) rows in one format -> (B, n) f32 = x W^T (x as the
// format's dot products read it, see prepare_input)
static at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  const Kernels& k = active();
  check_input(x, true);
  check_rows(w);
  check_format(fmt);
  const int64_t B = x.size(0), dim = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == row_bytes(fmt, dim), "w: ", w.size(1), " bytes per row, expected ", row_bytes(fmt, dim));
  at::Tensor y = at::empty({B, n}, x.options().dtype(at::kFloat));
  FFNArgs a{nullptr, B, dim, nullptr, 0, nullptr, nullptr, nullptr, 0, 0.0f, 0, (int)fmt};
  Input in;
  prepare_input(fmt, x, a, in);
  const uint8_t* p = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) { k.gemv(p, a, n, begin, end, yp); });
  return y;
}

// x (..., dim) f32 or bf16, at most 64 rows; w (ceil(n/16), dim/32 * 320) uint8, an int4
// matrix in the q4x16 layout (neuron_ffn.h) -> (..., n) in x's type = x W^T, over x rounded to
// 8 bits per block of 32. A decode step calls this four times a layer with one row, where
// dispatching ops costs more than the arithmetic: a bf16 x is read as it is, the answer written
// in bf16 here, and the scratch is this thread's own, so the call is one op.
static at::Tensor linear_q4x16(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  const Kernels& k = active();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() >= 1 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              "x: (..., dim) contiguous float32 or bfloat16");
  const int64_t dim = x.size(-1), B = dim ? x.numel() / dim : 0, nb = dim / 32;
  TORCH_CHECK(B >= 1 && B <= 64, "the kernel takes 1 to 64 rows, got ", B);
  TORCH_CHECK(dim % 32 == 0, "dim must be a multiple of 32, got ", dim);
  check_rows(w);
  const int64_t groups = (n + 15) / 16;
  TORCH_CHECK(n >= 1 && w.size(0) == groups, "w: ", w.size(0), " groups of 16 rows, expected ",
              groups, " for ", n, " rows");
  TORCH_CHECK(w.size(1) == nb * Q4X16_BLOCK, "w: ", w.size(1), " bytes per group, expected ",
              nb * Q4X16_BLOCK, " for dim ", dim);
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs, yf;
  xq.resize(B * dim);
  xd.resize(B * nb);
  xs.resize(B * nb);
  yf.resize(B * groups * 16);  // the kernel writes whole groups
  // rows in parallel when there are many (a prompt): alone it was a third of a long row's call
  // (the scratch is this thread's: workers get its pointers, not their own thread_locals)
  int8_t* const xq0 = xq.data();
  float *const xd0 = xd.data(), *const xs0 = xs.data();
  at::parallel_for(0, B, B * dim >= 16384 ? 1 : B, [&](int64_t r0, int64_t r1) {
    int8_t* q = xq0 + r0 * dim;
    float *d = xd0 + r0 * nb, *s = xs0 + r0 * nb;
    if (bf16)
      quantize_input(x.data_ptr<c10::BFloat16>() + r0 * dim, r1 - r0, dim, q, d, s);
    else
      quantize_input(x.data_ptr<float>() + r0 * dim, r1 - r0, dim, q, d, s);
  });
  FFNArgs a{nullptr, B, dim, nullptr, 0, nullptr, nullptr, nullptr, 0, 0.0f, 0, Q4_1};
  a.xq = xq.data();
  a.xd = xd.data();
  a.xs = xs.data();
  const uint8_t* p = w.data_ptr<uint8_t>();
  float* yp = yf.data();
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    k.gemv_q4x16(p, a, groups * 16, begin, end, yp);
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  for (int64_t r = 0; r < B; r++) {
    const float* src = yp + r * groups * 16;
    if (bf16) {
      c10::BFloat16* dst = y.data_ptr<c10::BFloat16>() + r * n;
      for (int64_t i = 0; i < n; i++) dst[i] = c10::BFloat16(src[i]);  // round to nearest even
    } else {
      std::memcpy(y.data_ptr<float>() + r * n, src, n * sizeof(float));
    }
  }
  return y;
}

// RMSNorm over the last axis of x, f32 or bf16 with a weight of the same type, as torch's CPU
// rms_norm computes it (in float, rounded once at the end). One call in place of torch's
// several: a decode step normalizes two rows of a few hundred values per layer, and dispatching
// the ops cost more than their arithmetic (2.2 against 10.1 us for one row of 576 in bf16).
template <typename T>
static void rms_rows(const T* x, const T* w, T* y, int64_t dim, double eps, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i++) {
    const T* xi = x + i * dim;
    T* yi = y + i * dim;
    float s[8] = {};
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8)
      for (int k = 0; k < 8; k++) {
        const float v = (float)xi[j + k];
        s[k] += v * v;
      }
    for (; j < dim; j++) s[0] += (float)xi[j] * (float)xi[j];
    const float ss = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    const float r = 1.0f / std::sqrt(ss / (float)dim + (float)eps);
    for (j = 0; j < dim; j++) yi[j] = (T)((float)xi[j] * r * (float)w[j]);
  }
}

static at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.is_contiguous(), "w: (dim,) of x's type");
  const int64_t dim = w.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == dim, "x: (..., ", dim, ")");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = xc.numel() / dim;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kFloat)
      rms_rows(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), dim, eps, begin, end);
    else
      rms_rows(xc.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), dim, eps,
               begin, end);
  });
  return y;
}

// ---- attention for one query per row, over the KV cache in place ----

__attribute__((target("avx2,fma"))) static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) static inline __m256 load8(const at::BFloat16* p) {
  const __m256i i = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(i, 16));
}

// out (G, D) = softmax(q k^T * scale) v for the G query heads q (G, D) sharing one KV head,
// whose keys and values are k, v (L, D) rows `stride` apart; positions where valid[l] is 0 are
// left out. Scores and sums in float.
template <typename T>
__attribute__((target("avx2,fma"))) static void attend(const float* q, int64_t G, const T* k, const T* v,
                                                        int64_t stride, const bool* valid, int64_t L,
                                                        int64_t D, float scale, float* scores, float* out) {
  for (int64_t g = 0; g < G; g++) {
    const float* qg = q + g * D;
    float* sg = scores + g * L;
    float mx = -INFINITY;
    for (int64_t l = 0; l < L; l++) {
      if (!valid[l]) {
        sg[l] = -INFINITY;
        continue;
      }
      const T* kl = k + l * stride;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(load8(kl + d), _mm256_loadu_ps(qg + d), acc);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      sg[l] = _mm_cvtss_f32(h) * scale;
      mx = std::max(mx, sg[l]);
    }
    float sum = 0.0f;
    for (int64_t l = 0; l < L; l++) {
      sg[l] = valid[l] ? std::exp(sg[l] - mx) : 0.0f;
      sum += sg[l];
    }
    float* og = out + g * D;
    for (int64_t d = 0; d < D; d++) og[d] = 0.0f;
    for (int64_t l = 0; l < L; l++) {
      if (sg[l] == 0.0f) continue;
      const __m256 p = _mm256_set1_ps(sg[l] / sum);
      const T* vl = v + l * stride;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(og + d, _mm256_fmadd_ps(p, load8(vl + d), _mm256_loadu_ps(og + d)));
    }
  }
}

// x (D,) in place: the half-rotation rotary embedding (HF's rotate_half) at one position, in
// float, rounded to T as torch's apply_rope leaves it.
template <typename T>
static void rope_row(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; d++) {
    const float a = x[d], b = x[d + h];
    x[d] = (float)(T)(a * cos[d] - b * sin[d]);
    x[d + h] = (float)(T)(b * cos[d + h] + a * sin[d + h]);
  }
}

// One row's q, k, v (H + 2 Hkv heads of D floats, in place): the rotary embedding of q and k
// (cos null: none; else q as the model's type holds it after all), and the new k and v written
// to the cache at k, v (head 0's entry; heads S * D apart).
template <typename T>
static void place_row(float* x, const float* cos, const float* sin, T* k, T* v, int64_t H, int64_t Hkv,
                      int64_t S, int64_t D) {
  if (cos)
    for (int64_t h = 0; h < H + Hkv; h++) rope_row<T>(x + h * D, cos, sin, D);
  else
    for (int64_t d = 0; d < H * D; d++) x[d] = (float)(T)x[d];
  for (int64_t h = 0; h < Hkv; h++)
    for (int64_t d = 0; d < D; d++) {
      k[h * S * D + d] = (T)x[(H + h) * D + d];
      v[h * S * D + d] = (T)x[(H + Hkv + h) * D + d];
    }
}

// The one-token step's attention after the q/k/v projection, in one call: rotary embedding of
// q and k, the new k and v written into the cache, and softmax(q K^T / sqrt(D)) V read from the
// cache in place (no gathered copy of the cache's rows, no widened copies of K and V).
// qkv (B, (H + 2 Hkv) D) the projection's output; cos, sin (B, D) float32 at each row's
// position, or empty (no rotary embedding); k_cache, v_cache (N, Hkv, S, D) of qkv's type;
// rows (B,) cache rows; pos (B,) the new entries' positions; valid (B, L) the positions each
// row attends to -> (B, H D) of qkv's type.
static at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& rows, const at::Tensor& pos, const at::Tensor& valid,
                                   int64_t n_heads) {
  TORCH_CHECK(BEST != "none", "attention needs a CPU with AVX2 and FMA");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "caches: (N, Hkv, S, D), contiguous");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && v_cache.scalar_type() == dt &&
              qkv.scalar_type() == dt, "qkv and the caches: one type, float32 or bfloat16");
  const int64_t N = k_cache.size(0), Hkv = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  const int64_t H = n_heads, B = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * Hkv) * D, "qkv: (B, (H + 2 Hkv) D)");
  TORCH_CHECK(D % 8 == 0 && H % Hkv == 0, "head sizes do not fit");
  const bool roped = cos.numel() > 0;
  if (roped)
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                cos.size(0) == B && cos.size(1) == D && sin.sizes() == cos.sizes(), "cos, sin: (B, D) float32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.numel() == B && pos.scalar_type() == at::kLong &&
              pos.numel() == B, "rows, pos: (B,) int64");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.dim() == 2 && valid.size(0) == B && valid.size(1) <= S,
              "valid: (B, L) bool, L at most the cache's length");
  const int64_t L = valid.size(1), G = H / Hkv;
  at::Tensor rc = rows.contiguous(), pc = pos.contiguous(), vc = valid.contiguous();
  const int64_t *rp = rc.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < N && pp[b] >= 0 && pp[b] < S, "a row or position outside the cache");
  at::Tensor x = qkv.to(at::kFloat).contiguous();  // (B, (H + 2 Hkv) D)
  at::Tensor cc, sc;
  if (roped) cc = cos.contiguous(), sc = sin.contiguous();
  float* xp = x.data_ptr<float>();
  for (int64_t b = 0; b < B; b++) {
    float* xb = xp + b * (H + 2 * Hkv) * D;
    const float* c = roped ? cc.data_ptr<float>() + b * D : nullptr;
    const float* s = roped ? sc.data_ptr<float>() + b * D : nullptr;
    const int64_t off = (rp[b] * Hkv * S + pp[b]) * D;  // head 0's entry at the new position
    if (dt == at::kFloat)
      place_row(xb, c, s, k_cache.data_ptr<float>() + off, v_cache.data_ptr<float>() + off, H, Hkv, S, D);
    else
      place_row(xb, c, s, k_cache.data_ptr<at::BFloat16>() + off, v_cache.data_ptr<at::BFloat16>() + off, H, Hkv,
                S, D);
  }
  at::Tensor out = at::empty({B, H * D}, x.options());
  const float scale = 1.0f / std::sqrt((float)D);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L);
    for (int64_t i = begin; i < end; i++) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t off = ((rp[b] * Hkv + h) * S) * D;
      const float* qb = xp + b * (H + 2 * Hkv) * D + h * G * D;
      float* ob = out.data_ptr<float>() + (b * H + h * G) * D;
      const bool* ok = vc.data_ptr<bool>() + b * L;
      if (dt == at::kFloat)
        attend(qb, G, k_cache.data_ptr<float>() + off, v_cache.data_ptr<float>() + off, D, ok, L, D, scale,
               scores.data(), ob);
      else
        attend(qb, G, k_cache.data_ptr<at::BFloat16>() + off, v_cache.data_ptr<at::BFloat16>() + off, D, ok,
               L, D, scale, scores.data(), ob);
    }
  });
  return dt == at::kFloat ? out : out.to(dt);
}

}  // namespace powerinfer

TORCH_LIBRARY(powerinfer, m) {
  m.def("neuron_ffn(Tensor x, Tensor w, Tensor sel, Tensor? keep, Tensor? bias, float threshold, int act, int fmt) -> Tensor");
  m.def("widen(Tensor w, int fmt, int rows, int dim) -> Tensor");
  m.def("linear(Tensor x, Tensor w, int fmt) -> Tensor");
  m.def("linear_q4x16(Tensor x, Tensor w, int n) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, Tensor pos, Tensor valid, int n_heads) -> Tensor");
  m.def("isa", &powerinfer::isa);
  m.def("use_isa", &powerinfer::use_isa);
}

TORCH_LIBRARY_IMPL(powerinfer, CPU, m) {
  m.impl("neuron_ffn", powerinfer::neuron_ffn);
  m.impl("widen", powerinfer::widen);
  m.impl("linear", powerinfer::linear);
  m.impl("linear_q4x16", powerinfer::linear_q4x16);
  m.impl("rms_norm", powerinfer::rms_norm);
  m.impl("decode_attention", powerinfer::decode_attention);
}
