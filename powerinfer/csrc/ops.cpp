// The torch operator `powerinfer::neuron_ffn` over the per-ISA kernels of neuron_ffn.h, chosen
// once at load by what the CPU supports, parallel over neurons with ATen's thread pool: each
// thread accumulates its neurons' down rows into its own partial output, then the partials are
// summed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "neuron_ffn.h"

namespace powerinfer {
static const char* pick_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "none";
}

static const std::string BEST = pick_isa();
static std::string ISA = BEST;

static std::string isa() { return ISA; }

// Run with a lesser instruction set than the best this CPU has (tests cover both paths on one
// machine); returns the one in use before.
static std::string use_isa(const std::string& want) {
  TORCH_CHECK(want == "avx2" || want == "avx512", "isa must be avx2 or avx512, got ", want);
  TORCH_CHECK(BEST == "avx512" || want == BEST, "this CPU cannot run ", want, " (best: ", BEST, ")");
  std::string before = ISA;
  ISA = want;
  return before;
}

// The entry points of the instruction set in use.
static const Kernels& active() {
  TORCH_CHECK(ISA != "none", "the CPU kernel needs a CPU with AVX2 and FMA");
  return ISA == "avx512" ? kernels_avx512 : kernels_avx2;
}

static void check_format(int64_t fmt) {
  TORCH_CHECK(fmt >= F32 && fmt <= Q8_0, "unknown weight format ", fmt);
}

// x: (B, dim) contiguous float32, 1 to 64 rows (the kernels' MAXB), dim a multiple of 32
static void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: (B, dim) contiguous float32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 64, "the kernel takes 1 to 64 rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) % 32 == 0, "dim must be a multiple of 32, got ", x.size(1));
}

// w: (n, bytes) contiguous uint8 rows or records
static void check_rows(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w: (n, bytes) contiguous uint8");
}

static void quantize_for(int64_t fmt, const at::Tensor& x, FFNArgs& a, at::Tensor& xq,
                         at::Tensor& xd, at::Tensor& xs) {
  if (!integer_dots((int)fmt)) return;
  const int64_t B = x.size(0), nb = x.size(1) / 32;
  xq = at::empty({B, x.size(1)}, x.options().dtype(at::kChar));
  xd = at::empty({B, nb}, x.options());
  xs = at::empty({B, nb}, x.options());
  quantize_input(x.data_ptr<float>(), B, x.size(1), xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                 xs.data_ptr<float>());
  a.xq = xq.data_ptr<int8_t>();
  a.xd = xd.data_ptr<float>();
  a.xs = xs.data_ptr<float>();
}

// x (B, dim) f32; w (k, neuron_bytes) uint8 records; sel (m,) int64; keep (B, m) bool or None;
// bias (k,) f32 or None -> (B, dim) f32: sum over the selected neurons of h * down row.
static at::Tensor neuron_ffn(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sel,
                             const std::optional<at::Tensor>& keep,
                             const std::optional<at::Tensor>& bias, double threshold, int64_t act,
                             int64_t fmt) {
  const Kernels& k = active();
  check_input(x);
  check_rows(w);
  check_format(fmt);
  TORCH_CHECK(sel.dim() == 1 && sel.scalar_type() == at::kLong && sel.is_contiguous(), "sel: (m,) int64");
  TORCH_CHECK(act >= RELU && act <= SWIGLU, "unknown activation ", act);
  const int64_t B = x.size(0), dim = x.size(1), m = sel.size(0);
  const int64_t nb = (act == RELU ? 1 : 2) * row_bytes(fmt, dim) + row_bytes(down_format(fmt), dim);
  TORCH_CHECK(w.size(1) == nb, "w: ", w.size(1), " bytes per neuron, expected ", nb);
  FFNArgs a{x.data_ptr<float>(), B, dim, w.data_ptr<uint8_t>(), w.size(1), nullptr,
            sel.data_ptr<int64_t>(), nullptr, m, (float)threshold, (int)act, (int)fmt};
  if (keep && keep->defined()) {
    TORCH_CHECK(keep->scalar_type() == at::kBool && keep->is_contiguous() && keep->size(0) == B &&
                keep->size(1) == m, "keep: (B, m) contiguous bool");
    a.keep = (const uint8_t*)keep->data_ptr<bool>();
  }
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == w.size(0), "bias: (k,) float32");
    a.bias = bias->data_ptr<float>();
  }
  // bounds once here, so the kernel trusts sel
  if (m) {
    auto mm = at::aminmax(sel);
    TORCH_CHECK(std::get<0>(mm).item<int64_t>() >= 0 && std::get<1>(mm).item<int64_t>() < w.size(0),
                "sel holds an index outside the ", w.size(0), " neurons");
  }
  at::Tensor xq, xd, xs;  // the input per block, for the block formats' integer products
  quantize_for(fmt, x, a, xq, xd, xs);
  const int64_t nt = at::get_num_threads();
  at::Tensor part = at::zeros({nt, B, dim}, x.options());
  float* pp = part.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    k.range(a, begin, end, pp + at::get_thread_num() * B * dim);
  });
  return nt == 1 ? part[0] : part.sum(0);
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

// x (B, dim) f32; w (n, row_bytes) rows in one format -> (B, n) f32 = x W^T
static at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  const Kernels& k = active();
  check_input(x);
  check_rows(w);
  check_format(fmt);
  const int64_t B = x.size(0), dim = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == row_bytes(fmt, dim), "w: ", w.size(1), " bytes per row, expected ", row_bytes(fmt, dim));
  at::Tensor y = at::empty({B, n}, x.options());
  FFNArgs a{x.data_ptr<float>(), B, dim, nullptr, 0, nullptr, nullptr, nullptr, 0, 0.0f, 0, (int)fmt};
  at::Tensor xq, xd, xs;
  quantize_for(fmt, x, a, xq, xd, xs);
  const uint8_t* p = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) { k.gemv(p, a, n, begin, end, yp); });
  return y;
}

}  // namespace powerinfer

TORCH_LIBRARY(powerinfer, m) {
  m.def("neuron_ffn(Tensor x, Tensor w, Tensor sel, Tensor? keep, Tensor? bias, float threshold, int act, int fmt) -> Tensor");
  m.def("widen(Tensor w, int fmt, int rows, int dim) -> Tensor");
  m.def("linear(Tensor x, Tensor w, int fmt) -> Tensor");
  m.def("isa", &powerinfer::isa);
  m.def("use_isa", &powerinfer::use_isa);
}

TORCH_LIBRARY_IMPL(powerinfer, CPU, m) {
  m.impl("neuron_ffn", powerinfer::neuron_ffn);
  m.impl("widen", powerinfer::widen);
  m.impl("linear", powerinfer::linear);
}
