// The torch operator `powerinfer::neuron_ffn` over the per-ISA kernels of neuron_ffn.h, chosen
// once at load by what the CPU supports, parallel over neurons with ATen's thread pool: each
// thread accumulates its neurons' down rows into its own partial output, then the partials are
// summed.
#ifdef POWERINFER_LITE  // (the torch-free build: lite.h)
#include "lite.h"
#else
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#endif

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "neuron_ffn.h"

namespace powerinfer {
// Instruction sets, each a superset of the one before.
static const std::vector<std::string> ISAS = {"avx2", "avx512", "avx512bf16"};

static int64_t rank(const std::string& isa) {
  return std::find(ISAS.begin(), ISAS.end(), isa) - ISAS.begin();
}

static std::string cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") ? "avx512bf16" : "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "none";
}

// The CPU's class, or a lower one that POWERINFER_MAX_ISA names: this process, and the
// processes it starts (they inherit the variable), then run as on a CPU of that class, `auto`
// included. A name that is not a class, or one above the CPU's, is ignored here (the Python
// side says so when it loads the library).
static std::string pick_isa() {
  std::string best = cpu_isa();
  const char* cap = std::getenv("POWERINFER_MAX_ISA");
  if (best != "none" && cap && rank(cap) < rank(best)) return cap;
  return best;
}

static const std::string BEST = pick_isa();
static std::string ISA = BEST;

static std::string isa() { return ISA; }
static std::string best_isa() { return BEST; }

// Run with a lesser instruction set than the best this CPU has (tests cover every path on one
// machine); returns the one in use before.
static std::string use_isa(const std::string& want) {
  TORCH_CHECK(rank(want) < (int64_t)ISAS.size(), "isa must be one of avx2, avx512, avx512bf16, got ", want);
  TORCH_CHECK(rank(want) <= rank(BEST), "this CPU cannot run ", want, " (best: ", BEST, ")");
  std::string before = ISA;
  ISA = want;
  return before;
}

// How the VNNI bodies walk a Q4 q4c matrix (input_sparse.h): "runs" (quad by quad, the
// default) or "passes" (pass by pass, the other bodies' walk); `q4c_walk` sets it for this
// process (a benchmark's baseline) and returns the one before.
static bool Q4C_BY_RUNS = true;
static std::string q4c_walk(const std::string& walk) {
  TORCH_CHECK(walk == "runs" || walk == "passes", "walk must be runs or passes, got ", walk);
  const std::string before = Q4C_BY_RUNS ? "runs" : "passes";
  Q4C_BY_RUNS = walk == "runs";
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
// MAXB; any number where `many`), dim a multiple of 32
static void check_input(const at::Tensor& x, bool bf16_ok = false, bool many = false) {
  const bool type_ok = x.scalar_type() == at::kFloat || (bf16_ok && x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(x.dim() == 2 && type_ok && x.is_contiguous(),
              bf16_ok ? "x: (B, dim) contiguous float32 or bfloat16" : "x: (B, dim) contiguous float32");
  TORCH_CHECK(x.size(0) >= 1 && (many || x.size(0) <= 64), "the kernel takes 1 to 64 rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) % 32 == 0, "dim must be a multiple of 32, got ", x.size(1));
}

// w: (n, bytes) contiguous uint8 rows or records
static void check_rows(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w: (n, bytes) contiguous uint8");
}

// The input rows as format `fmt`'s dot products read them, held for one call: float32 for the
// float formats; rounded to bf16 for bf16 rows (in float for most instruction sets, as bf16 for
// native bf16 products); quantized to 8 bits per block for the block formats, from bf16 rows
// as they are (no float copy: the block formats read none) into buffers of the call's own
// (three or four tensors and a copy to float were 1.8 of a small records step's 9.6 us: a
// cold executor answers each layer with one such step).
struct Input {
  at::Tensor xf, xb;
  std::unique_ptr<int8_t[]> xq, xp;
  std::unique_ptr<float[]> xd, xs;
};

// records: the rows are neuron records (whose 4-bit rows are split: the input permuted for them)
static void prepare_input(int64_t fmt, const at::Tensor& x, FFNArgs& a, Input& in, bool records = false) {
  const bool bf16_in = x.scalar_type() == at::kBFloat16, integer = integer_dots((int)fmt);
  if (fmt == BF16) {
    in.xb = bf16_in ? x : x.to(at::kBFloat16);
    in.xf = in.xb.to(at::kFloat);
    a.xb = (const uint16_t*)in.xb.data_ptr<at::BFloat16>();
  } else if (!(integer && bf16_in)) {
    in.xf = bf16_in ? x.to(at::kFloat) : x;
  }
  a.x = in.xf.defined() ? in.xf.data_ptr<float>() : nullptr;  // (null: integer dots of bf16 rows)
  if (!integer) return;
  const int64_t B = x.size(0), dim = x.size(1), nb = dim / 32;
  in.xq.reset(new int8_t[B * dim]);
  in.xd.reset(new float[B * nb]);
  in.xs.reset(new float[B * nb]);
  active().quantize(a.x ? (const void*)a.x : x.data_ptr(), a.x == nullptr, B, dim, in.xq.get(), in.xd.get(),
                    in.xs.get());
  a.xq = in.xq.get();
  a.xd = in.xd.get();
  a.xs = in.xs.get();
  if (records && split4(record_format((int)fmt))) {
    a.xp_stride = permuted_stride(dim);
    in.xp.reset(new int8_t[B * a.xp_stride]);
    permute_input(a.xq, B, dim, in.xp.get());
    a.xp = in.xp.get();
  }
}

// f(j) for each flag j < n set in any of B bool masks (row r at rows + r * stride), in order:
// eight flags a load, a word of none skipped (a 7B layer's mask over 11,008 neurons read a byte
// at a time was 2.4-3.3 us of a call, measured: more than a 1% share's records take to read)
template <typename F>
static void each_set(const bool* rows, int64_t B, int64_t stride, int64_t n, F&& f) {
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t j1 = std::min(j0 + 8, n);
    if (j1 - j0 == 8) {  // (the last few flags are read one by one)
      uint64_t any = 0;
      for (int64_t r = 0; r < B; r++) {
        uint64_t word;
        std::memcpy(&word, rows + r * stride + j0, 8);
        any |= word;
      }
      if (!any) continue;
    }
    for (int64_t j = j0; j < j1; j++)
      for (int64_t r = 0; r < B; r++)
        if (rows[r * stride + j]) {
          f(j);
          break;
        }
  }
}

// w: records of a gated or plain FFN in format fmt for inputs of dim (gate and up rows, or the
// up row alone, then the down row), and a known activation
static void check_records(const at::Tensor& w, int64_t act, int64_t fmt, int64_t dim) {
  TORCH_CHECK(act >= RELU && act <= GELU, "unknown activation ", act);
  const int64_t nb = (gated_act(act) ? 2 : 1) * row_bytes(fmt, dim) + row_bytes(down_format(fmt), dim);
  TORCH_CHECK(w.size(1) == nb, "w: ", w.size(1), " bytes per neuron, expected ", nb);
}

// Floats left between one thread's sums and the next thread's (past the first's end, rounded
// to a line; records_rows' parts). When the decode step also summed per thread, with the two
// threads' sums side by side (a 7B layer's: 16 KiB each) it took up to 1.18x the time it took
// with them 2 KiB or more apart, 1.00-1.09x in other processes (a 2-core Zen 5 VM,
// benchmarks/kernel.py, switched per call in one process): each core's prefetchers likely take
// lines of the other's sums as it writes them.
constexpr int64_t PART_GAP = 1024;

// Parts `parts` of n floats each (part t at pp + t * stride) added into the first, in their
// order (a prompt's rows: in parallel)
static void add_parts(float* pp, int64_t stride, const std::vector<int64_t>& parts, int64_t n) {
  if (parts.size() < 2) return;
  float* dst = pp + parts[0] * stride;
  at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
    for (size_t t = 1; t < parts.size(); t++) {
      const float* src = pp + parts[t] * stride;
      for (int64_t i = i0; i < i1; i++) dst[i] += src[i];
    }
  });
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
  check_records(w, act, fmt, x.size(1));
  const int64_t B = x.size(0), dim = x.size(1), n = w.size(0);
  std::vector<int64_t> picked;  // a mask's neurons
  const bool by_mask = sel.scalar_type() == at::kBool;
  if (by_mask) {
    TORCH_CHECK(sel.numel() == n, "sel: a mask of ", sel.numel(), " for ", n, " neurons");
    picked.reserve(n / 8);
    each_set(sel.data_ptr<bool>(), 1, n, n, [&](int64_t j) { picked.push_back(j); });
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
  prepare_input(fmt, x, a, in, true);
  // Two phases, split between threads differently. First the neurons' activations, the
  // selection split by count into segments (a neuron's activations are the same floats whichever
  // thread computes them); then the down rows of those that fired, split by columns: each thread
  // adds every fired neuron's down row over its own columns, in the selection's order, segment
  // after segment, each as soon as its activations are done (a thread done with its segment
  // starts on its columns while the other still reads gate and up rows, where a barrier between
  // the phases kept it waiting: 4.9% of a 7B layer's 5%-active step's thread time on a Zen 5
  // EPYC). A row's answer is its own neurons summed in one order whatever the thread count or
  // the other rows of its batch (a neuron no row of it fires adds nothing), and no thread's sums
  // are added to another's. Before, each thread summed its own neurons into its own copy of out,
  // which one thread then added: on a 2-core Xeon that addition alone was 3.1-3.5 us of a step
  // (the other core's 16 KiB read across), and the split by the neurons' places left the threads
  // uneven (at 1% of a 7B layer's 11,008 neurons, typically 59 records on one thread and 51 on
  // the other). The answer does not depend on the thread count.
  at::Tensor y = at::empty({B, dim}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int64_t nt = m <= 8 ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const int64_t nb = dim / 32, parts = std::min(nt, nb);
  std::unique_ptr<float[]> h(new float[std::max<int64_t>(1, m * B)]);  // (acts writes every value)
  std::vector<int64_t> fired(std::max<int64_t>(1, m)), count(nt);
  std::unique_ptr<std::atomic<bool>[]> ready(new std::atomic<bool>[nt]);
  for (int64_t c = 0; c < nt; c++) ready[c].store(false, std::memory_order_relaxed);
  std::atomic<int64_t> next_acts{0}, next_downs{0};
  auto work = [&]() {
    for (int64_t c; (c = next_acts.fetch_add(1)) < nt;) {
      count[c] = k.acts(a, m * c / nt, m * (c + 1) / nt, h.get(), fired.data() + m * c / nt);
      ready[c].store(true, std::memory_order_release);
    }
    // (every segment is taken by now: each one not ready is being computed by a running thread)
    for (int64_t c; (c = next_downs.fetch_add(1)) < parts;) {
      const int64_t blo = nb * c / parts, bhi = nb * (c + 1) / parts;
      for (int64_t r = 0; r < B; r++) std::fill(yp + r * dim + 32 * blo, yp + r * dim + 32 * bhi, 0.0f);
      for (int64_t s = 0; s < nt; s++) {
        for (int spins = 0; !ready[s].load(std::memory_order_acquire); spins++)
          if (spins < 4096)
            _mm_pause();
          else
            sched_yield();
        k.downs(a, fired.data() + m * s / nt, count[s], h.get(), blo, bhi, yp);
      }
    }
  };
  if (nt == 1)
    work();
  else
    at::parallel_for(0, nt, 1, [&](int64_t, int64_t) { work(); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// x (T, dim) f32 or bf16; w (k, neuron_bytes) uint8 records; bias (k,) f32 or None -> (T, dim) in
// x's type: every record for every row, as a prompt step computes a neuron set (records_rows.h),
// summed in float and rounded once. The records split into parts at fixed places,
// [k t / P, k (t+1) / P) for P the thread count, each part's sums in its own rows, added in the
// parts' order (over many rows, a small part of the call); the rows run 256 at a time. A row's
// answer is then the same floats whatever rows share the call and wherever it sits among them.
static at::Tensor records_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                               double threshold, int64_t act, int64_t fmt) {
  const Kernels& k = active();
  check_input(x, true, true);
  check_rows(w);
  check_format(fmt);
  check_records(w, act, fmt, x.size(1));
  const int64_t T = x.size(0), dim = x.size(1), n = w.size(0);
  const bool bf16_in = x.scalar_type() == at::kBFloat16, pairs = k.rows_bf16(bf16_in);
  const at::Tensor xin = pairs ? x : x.to(at::kFloat);  // (x contiguous: check_input)
  RowsArgs a{xin.data_ptr(), T, dim, pairs, bf16_in, w.data_ptr<uint8_t>(), w.size(1), nullptr, (float)threshold,
             (int)act, (int)fmt};
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "bias: (k,) float32");
    a.bias = bias->data_ptr<float>();
  }
  // rows a pass over the records (each pass widens every record again: a 7B layer's half at 64
  // rows took 35.9 ms in passes of 40 rows, 21.2 in one of 64; at 256 rows 46.9 ms in one pass,
  // 83.0 in passes of 64, on AMX tiles; the vector path 1.13-1.17x faster in one pass too)
  const int64_t chunk = 256;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const int64_t stride = (T * dim + 15) / 16 * 16 + PART_GAP;
  at::Tensor part = at::empty({nt, stride}, x.options().dtype(at::kFloat));
  float* pp = part.data_ptr<float>();
  const int64_t esize = pairs ? 2 : 4;
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> scratch(rows_scratch(dim, std::min(chunk, T), bf16_in));
    for (int64_t t = t0; t < t1; t++) {
      float* o = pp + t * stride;
      std::fill(o, o + T * dim, 0.0f);
      for (int64_t r0 = 0; r0 < T; r0 += chunk) {
        RowsArgs c = a;
        c.x = (const uint8_t*)a.x + r0 * dim * esize;
        c.T = std::min(chunk, T - r0);
        k.rows(c, n * t / nt, n * (t + 1) / nt, o + r0 * dim, scratch.data());
      }
    }
  });
  std::vector<int64_t> parts(nt);
  std::iota(parts.begin(), parts.end(), 0);
  add_parts(pp, stride, parts, T * dim);
  at::Tensor y = part.as_strided({T, dim}, {dim, 1}, 0);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The process's prefetch level ("l1" or "l2", see `prefetch_level` in neuron_ffn.h; "" leaves
// it): returns the level before
static std::string prefetch_level_op(const std::string& level) {
  TORCH_CHECK(level.empty() || level == "l1" || level == "l2", "level must be l1 or l2, got ",
              level);
  const std::string before = prefetch_level.load() == PF_L2 ? "l2" : "l1";
  if (!level.empty()) prefetch_level.store(level == "l2" ? PF_L2 : PF_L1);
  return before;
}

// Which records walks ask for rows two passes ahead into L2 ("none", "acts", "downs", "both";
// "" leaves it; see `far_ahead` in neuron_ffn.h): returns the setting before
static std::string far_prefetch_op(const std::string& which) {
  const int mode = far_setting(which.c_str());
  TORCH_CHECK(which.empty() || mode >= 0, "far prefetch must be none, acts, downs or both, got ", which);
  const std::string before = FAR_NAMES[far_ahead.load() & 3];
  if (mode >= 0) far_ahead.store(mode);
  return before;
}

// records_rows on AMX tiles where the CPU has them: mode 0 forbids it, 1 allows it (the
// default), -1 leaves it; returns whether a bf16 input runs on them now (the active instruction
// set's kernels: AVX512_BF16 and AMX's tiles)
static bool rows_amx(int64_t mode) {
  if (mode >= 0) rows_amx_allowed.store(mode > 0);
  return active().rows_amx();
}

// w (k, neuron_bytes) records of `rows` rows each (1: a plain matrix) -> (k, rows, dim) float32
// records w (n, bytes) -> out (n, rows, dim), float32 or bf16 (see WidenFn)
static void widen_out(const at::Tensor& w, int64_t fmt, int64_t rows, int64_t dim, at::Tensor& out) {
  const Kernels& k = active();
  check_rows(w);
  check_format(fmt);
  TORCH_CHECK(rows >= 1 && rows <= 3 && dim % 32 == 0, "rows must be 1 to 3 and dim a multiple of 32");
  TORCH_CHECK(w.size(1) == (rows - 1) * row_bytes(fmt, dim) + row_bytes(rows == 1 ? fmt : down_format(fmt), dim),
              "w: ", w.size(1), " bytes per neuron do not fit the format");
  TORCH_CHECK(out.is_contiguous() && out.device().is_cpu() && out.numel() == w.size(0) * rows * dim &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out: a contiguous float32 or bf16 tensor of ", w.size(0) * rows * dim, " values");
  const uint8_t* p = w.data_ptr<uint8_t>();
  void* o = out.data_ptr();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, w.size(0), 16, [&](int64_t begin, int64_t end) {
    k.widen(p, w.size(1), (int)fmt, rows, dim, begin, end, o, bf16);
  });
}

static at::Tensor widen(const at::Tensor& w, int64_t fmt, int64_t rows, int64_t dim) {
  at::Tensor out = at::empty({w.size(0), rows, dim}, w.options().dtype(at::kFloat));
  widen_out(w, fmt, rows, dim, out);
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

// (below, after `project`, which it runs its GEMVs on)
static at::Tensor predicted_rows(const at::Tensor& p, const at::Tensor& fc1, const at::Tensor& fc2, int64_t fmt,
                                 double threshold);

// A decode step of neuron records under a predictor's per-row masks over the layer's neurons,
// as `sparse.decode_rows` runs it: x (B, dim); w the records of neurons idx (int64, in order;
// undefined or empty: the layer's every neuron, in order); mask (B, ffn_dim) bool; bias (k,) f32 or None ->
// (B, dim) in x's type: the neurons any row predicts, each row keeping its own (one row: the
// row's mask is the selection).
static at::Tensor masked_records(const at::Tensor& x, const at::Tensor& w, const at::Tensor& idx,
                                 const at::Tensor& mask, const std::optional<at::Tensor>& bias, double threshold,
                                 int64_t act, int64_t fmt) {
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == x.size(0),
              "masks: (B, ffn_dim) bool, one row per input row");
  const int64_t k = idx.defined() ? idx.numel() : 0;
  TORCH_CHECK(!k || (idx.scalar_type() == at::kLong && idx.dim() == 1), "idx: (k,) int64, ascending");
  TORCH_CHECK((k ? k : mask.size(1)) == w.size(0), "the masks' neurons are the records'");
  const bool whole = !k || k == mask.size(1);
  if (whole) {
    if (x.size(0) == 1) return neuron_ffn(x, w, mask[0].contiguous(), std::nullopt, bias, threshold, act, fmt);
    return neuron_ffn(x, w, mask.any(0), mask.contiguous(), bias, threshold, act, fmt);
  }
  // a shard of the layer's neurons (a cold executor's, idx ascending: `native.ffn_entry` holds
  // none other): the positions of the neurons any row's mask selects, found by a search in idx
  // for each (the masks read eight flags a load), and each row's own among them. The masks'
  // columns gathered at every index of the shard (index_select) cost 14 us a 7B layer's step
  // (7,700 of 11,008 neurons), more than a 1% share's records take to read.
  const at::Tensor masks = mask.contiguous(), ids = idx.contiguous();
  const bool* mp = masks.data_ptr<bool>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t B = mask.size(0), D = mask.size(1);
  std::vector<int64_t> pos, js;  // positions in the shard and the neurons they hold
  int64_t lo = 0;
  each_set(mp, B, D, D, [&](int64_t j) {
    lo = std::lower_bound(ip + lo, ip + k, j) - ip;
    if (lo < k && ip[lo] == j) {
      pos.push_back(lo);
      js.push_back(j);
    }
  });
  const int64_t m = (int64_t)pos.size();
  const at::Tensor sel = at::from_blob(pos.data(), {m}, at::TensorOptions().dtype(at::kLong));
  if (B == 1) return neuron_ffn(x, w, sel, std::nullopt, bias, threshold, act, fmt);
  at::Tensor keep = at::empty({B, m}, masks.options());
  bool* kp = keep.data_ptr<bool>();
  for (int64_t r = 0; r < B; r++)
    for (int64_t i = 0; i < m; i++) kp[r * m + i] = mp[r * D + js[i]];
  return neuron_ffn(x, w, sel, keep, bias, threshold, act, fmt);
}

// A decode step of a layer's neurons as the sparse engine's modules run it with a predictor
// (`sparse.HybridFFN` over `predictor.Predictors`), in one call where the modules take about
// fifteen: each row's predicted neurons (`predicted_rows`, pred_fmt and pred_threshold its
// format and rule), their union computed by `neuron_ffn` over the records w, the layer's every
// neuron in order (each row keeping its own where there are several) -> (B, dim) in x's type,
// the values the modules give.
static at::Tensor predicted_ffn(const at::Tensor& x, const at::Tensor& p, const at::Tensor& fc1,
                                const at::Tensor& fc2, int64_t pred_fmt, double pred_threshold,
                                const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                double threshold, int64_t act, int64_t fmt) {
  TORCH_CHECK(x.dim() == 2 && p.dim() == 2 && p.size(0) == x.size(0), "x, p: (B, dim) each");
  return masked_records(x.contiguous(), w, at::Tensor(), predicted_rows(p, fc1, fc2, pred_fmt, pred_threshold),
                        bias, threshold, act, fmt);
}

// The sum of 16 8-bit inputs (each + 128 as a byte, summed by `psadbw`, less 16 * 128)
static inline int32_t sum16(const int8_t* q) {
  const __m128i s = _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128((const __m128i*)q), _mm_set1_epi8(-128)),
                                 _mm_setzero_si128());
  return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
}

// y (B, ceil(n/16) * 16) f32 = rows x (B, dim) f32 or bf16 times a matrix w of n rows in a
// Layout (q4x16, q4kx16, q6kx16), over x rounded to 8 bits per block of 32; in this thread's
// scratch (valid until its next call)
static const float* x16_rows(const Kernels& k, int64_t layout, const void* x, bool bf16, int64_t B, int64_t dim,
                             const uint8_t* w, int64_t n) {
  const int64_t nb = dim / 32, groups = (n + 15) / 16;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs, yf;
  thread_local std::vector<int32_t> x16;
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
    k.quantize(static_cast<const char*>(x) + r0 * dim * (bf16 ? 2 : 4), bf16, r1 - r0, dim, q, d, s);
  });
  FFNArgs a{nullptr, B, dim, nullptr, 0, nullptr, nullptr, nullptr, 0, 0.0f, 0, Q4_1};
  a.xq = xq.data();
  a.xd = xd.data();
  a.xs = xs.data();
  if (layout == Q6KX16 || layout == Q8X16) {  // their q - 32 and q - 128 need x's sums per 16
    x16.resize(B * dim / 16);
    for (int64_t i = 0; i < B * dim / 16; i++) x16[i] = sum16(xq0 + 16 * i);
    a.x16 = x16.data();
  }
  float* yp = yf.data();
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    k.gemv_x16[layout](w, a, groups * 16, begin, end, yp);
  });
  return yp;
}

// x (..., dim) f32 or bf16, at most 64 rows; w (ceil(n/16), group bytes) uint8, a matrix of n
// rows interleaved 16 at a time in a Layout (neuron_ffn.h: q4x16, the file's Q4_0/Q4_1 blocks;
// q4kx16 and q6kx16, its Q4_K and Q6_K ones) -> (..., n) in x's type = x W^T, over x rounded to
// 8 bits per block of 32. A decode step calls this four times a layer with one row, where
// dispatching ops costs more than the arithmetic: a bf16 x is read as it is, the answer written
// in bf16 here, and the scratch is this thread's own, so the call is one op.
static at::Tensor linear_x16(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t layout) {
  const Kernels& k = active();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(layout >= 0 && layout < N_LAYOUTS, "layout: 0 q4x16, 1 q4kx16, 2 q6kx16, 3 q8x16, 4 q5kx16, 5 q5x16, got ", layout);
  TORCH_CHECK(x.dim() >= 1 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              "x: (..., dim) contiguous float32 or bfloat16");
  const int64_t dim = x.size(-1), B = dim ? x.numel() / dim : 0;
  TORCH_CHECK(B >= 1 && B <= 64, "the kernel takes 1 to 64 rows, got ", B);
  const int64_t unit = blocks_of_32(layout) ? 32 : 256;
  TORCH_CHECK(dim % unit == 0, "dim must be a multiple of ", unit, " in this layout, got ", dim);
  check_rows(w);
  const int64_t groups = (n + 15) / 16;
  TORCH_CHECK(n >= 1 && w.size(0) == groups, "w: ", w.size(0), " groups of 16 rows, expected ",
              groups, " for ", n, " rows");
  TORCH_CHECK(w.size(1) == group_bytes(layout, dim), "w: ", w.size(1), " bytes per group, expected ",
              group_bytes(layout, dim), " for dim ", dim);
  const float* yp = x16_rows(k, layout, x.data_ptr(), bf16, B, dim, w.data_ptr<uint8_t>(), n);
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

// Whether input sparsity drops an input entry v under threshold t: its magnitude not over t (at
// or under it, or a NaN): the q4c product's rule, and `zeroed_under`'s for a projection's runs
// without a copy
static bool dropped(float v, float t) { return !(std::fabs(v) > t); }

// A block's kept channels (a nonzero 8-bit input; channel j at bit j) from its 32 inputs
static inline uint32_t kept_channels(const int8_t* q) {
  const __m128i z = _mm_setzero_si128();
  const uint32_t lo = _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i*)q), z));
  const uint32_t hi = _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i*)(q + 16)), z));
  return ~(lo | hi << 16);
}

// pairs[n..] = the kept channels of mask m (bits of a block's channels, q its inputs) two by two
// in channel order, the last of an odd count with itself and an input 0, and their count made
// even with a pair of inputs 0 (the products take two pairs at a time: input_sparse.h) -> the new
// count
static inline int32_t add_pairs(const int8_t* q, uint32_t m, Q4CPair* pairs, int32_t n) {
  const int32_t n0 = n;
  while (m) {
    const int j0 = __builtin_ctz(m);
    m &= m - 1;
    if (!m) {
      pairs[n++] = Q4CPair{(uint8_t)j0, (uint8_t)j0, q[j0], 0};
      break;
    }
    const int j1 = __builtin_ctz(m);
    m &= m - 1;
    pairs[n++] = Q4CPair{(uint8_t)j0, (uint8_t)j1, q[j0], q[j1]};
  }
  if ((n - n0) % 2) {
    const uint8_t j = pairs[n - 1].j0;
    pairs[n++] = Q4CPair{j, j, 0, 0};
  }
  return n;
}

// The rows of x (B, k) f32 or bf16 (each alone: its own channels), with every input channel at
// or below `t` in magnitude set to 0 (TEAL's input sparsity), times a matrix w of n rows held by
// input channel (q4c, input_sparse.h; `kind`: a Q4CKind) -> (B, n) f32 in this
// thread's scratch (valid until its next call), over the kept values rounded to 8 bits per block
// of 32: the floats the q4x16 product (q4kx16's for Q4_K, to the order of its sums) gives for
// the same sparse input. Only the kept channels' runs are read. Adds the channels kept to *kept.
static const float* q4c_product(const Kernels& kk, const void* x, bool bf16, int64_t B, int64_t k,
                                const uint8_t* w, int64_t n, int kind, float t, int64_t* kept) {
  const int64_t nb = k / 32, np = q4c_rows(n), passes = np / 128;
  thread_local std::vector<float> xf, xd, xs, out;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<Q4CPair> pairs;
  thread_local std::vector<int32_t> first, x16;
  xf.resize(k);
  x16.resize(k / 16);
  xq.resize(k);
  xd.resize(nb);
  xs.resize(nb);
  first.resize(nb + 1);
  pairs.resize(nb * 16);
  out.resize((B - 1) * n + np);  // (the last row's padding rows too)
  const c10::BFloat16* xb = bf16 ? static_cast<const c10::BFloat16*>(x) : nullptr;
  const float* xp = bf16 ? nullptr : static_cast<const float*>(x);
  for (int64_t r = 0; r < B; r++) {
    if (bf16) {
      for (int64_t j = 0; j < k; j++) {
        const float v = (float)xb[r * k + j];
        xf[j] = dropped(v, t) ? 0.0f : v;
      }
    } else {
      for (int64_t j = 0; j < k; j++) xf[j] = dropped(xp[r * k + j], t) ? 0.0f : xp[r * k + j];
    }
    active().quantize(xf.data(), false, 1, k, xq.data(), xd.data(), xs.data());
    // a Q6_K matrix's blocks sum their two halves of 16 channels apart: no pair spans them,
    // and their 8-bit inputs' sums are the q6kx16 product's (see input_sparse.h)
    const bool halves = kind == Q4C_Q6_K;
    int32_t npairs = 0;
    for (int64_t b = 0; b < nb; b++) {
      const int8_t* q = xq.data() + 32 * b;
      const uint32_t m = kept_channels(q);
      first[b] = npairs;
      *kept += __builtin_popcount(m);
      if (halves) {
        x16[2 * b] = sum16(q), x16[2 * b + 1] = sum16(q + 16);
        npairs = add_pairs(q, m & 0xFFFFu, pairs.data(), npairs);
        npairs = add_pairs(q, m & 0xFFFF0000u, pairs.data(), npairs);
      } else {
        npairs = add_pairs(q, m, pairs.data(), npairs);
      }
    }
    first[nb] = npairs;
    const Q4CArgs a{w, n, k, kind, xd.data(), xs.data(), pairs.data(), first.data(), x16.data(), Q4C_BY_RUNS};
    // rows r * n .. (row r's sums; each row's padding rows are overwritten by the next row's)
    float* yp = out.data() + r * n;
    std::fill(yp, yp + np, 0.0f);
    at::parallel_for(0, passes, std::max<int64_t>(1, passes / std::max(1, at::get_num_threads())),
                     [&](int64_t p0, int64_t p1) { kk.q4c(a, p0, p1, yp); });
  }
  return out.data();
}

// The kind of q4c matrix of (n, k) that w holds (a Q4CKind), by its size; fails for none.
static int q4c_kind(const at::Tensor& w, int64_t n, int64_t k) {
  TORCH_CHECK(n >= 1 && w.dim() == 1 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "w: contiguous uint8 bytes expected for a q4c matrix, got ", w.sizes());
  for (int kind : {Q4C_Q4_0, Q4C_Q4_1, Q4C_Q4_K, Q4C_Q6_K})
    if ((kind < Q4C_Q4_K || k % 256 == 0) && w.numel() == q4c_bytes(n, k, kind)) return kind;
  TORCH_CHECK(false, "w: ", q4c_bytes(n, k, Q4C_Q4_0), ", ", q4c_bytes(n, k, Q4C_Q4_1),
              (k % 256 == 0 ? ", " + std::to_string(q4c_bytes(n, k, Q4C_Q4_K)) + " or " +
                                  std::to_string(q4c_bytes(n, k, Q4C_Q6_K)) : std::string()),
              " bytes expected for a q4c matrix of (", n, ", ", k, "), got ", w.numel());
  return -1;
}

// x (..., k) f32 or bf16, at most 64 rows, times a q4c matrix of n rows with its input channels
// at or below `threshold` zeroed (q4c_product) -> (..., n) in x's type. stats, where given
// (int64, 2), gains the channels kept and the channels seen.
static at::Tensor linear_q4c(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t kind, double threshold,
                             const std::optional<at::Tensor>& stats) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() >= 1 && (bf16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              "x: (..., k) contiguous float32 or bfloat16");
  const int64_t k = x.size(-1), B = k ? x.numel() / k : 0;
  TORCH_CHECK(B >= 1 && B <= 64, "the kernel takes 1 to 64 rows, got ", B);
  TORCH_CHECK(k % 32 == 0, "k must be a multiple of 32, got ", k);
  const int held = q4c_kind(w, n, k);
  static const char* const names[] = {"Q4_0", "Q4_1", "Q4_K", "Q6_K"};
  TORCH_CHECK(held == kind, "w: a q4c matrix of ", names[held], " blocks, not kind ", kind);
  if (stats) TORCH_CHECK(stats->scalar_type() == at::kLong && stats->numel() == 2 && stats->is_contiguous(),
                         "stats: 2 int64");
  int64_t kept = 0;
  const float* yp = q4c_product(active(), x.data_ptr(), bf16, B, k, w.data_ptr<uint8_t>(), n, held, (float)threshold, &kept);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  if (bf16) {
    c10::BFloat16* dst = y.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < B * n; i++) dst[i] = c10::BFloat16(yp[i]);
  } else {
    std::memcpy(y.data_ptr<float>(), yp, B * n * sizeof(float));
  }
  if (stats) {
    stats->data_ptr<int64_t>()[0] += kept;
    stats->data_ptr<int64_t>()[1] += B * k;
  }
  return y;
}

// RMSNorm over the last axis of x, f32 or bf16 with a weight of the same type, as torch's CPU
// rms_norm computes it (in float, rounded once at the end). One call in place of torch's
// several: a decode step normalizes two rows of a few hundred values per layer, and dispatching
// the ops cost more than their arithmetic (2.2 against 10.1 us for one row of 576 in bf16)
// (also x and y float32 holding values of w's type, bf16 (`round`: each result rounded to it) or
// float: the values the model's type would hold, with no copies to that type and back)
template <typename T, typename W = T, typename Y = T>
static void rms_rows(const T* x, const W* w, Y* y, int64_t dim, double eps, int64_t begin, int64_t end,
                     bool round = false) {
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
    for (j = 0; j < dim; j++) {
      const float v = (float)xi[j] * r * (float)w[j];
      yi[j] = round ? (Y)round_to_bf16(v) : (Y)v;
    }
  }
}

// rms_rows over `rows` rows of x (float32, values of w's type), in place, with w (dim,) bf16 or
// float32: rms_norm of x held in w's type, without the copies.
static void rms_in_place(float* x, const at::Tensor& w, int64_t rows, double eps) {
  const int64_t dim = w.numel();
  if (w.scalar_type() == at::kBFloat16)
    rms_rows<float, at::BFloat16, float>(x, w.data_ptr<at::BFloat16>(), x, dim, eps, 0, rows, true);
  else
    rms_rows<float, float, float>(x, w.data_ptr<float>(), x, dim, eps, 0, rows);
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

// qkv (N, (H + 2 Hkv) D), f32 or bf16: each head of q through RMSNorm with qw, each head of k
// with kw (both (D,) of qkv's type), v as it is (Qwen3's and Gemma 3's q/k norms): one call in
// place of a decode step's split, two norms, reshapes and concatenation.
static at::Tensor qk_norm(const at::Tensor& qkv, const at::Tensor& qw, const at::Tensor& kw, int64_t n_heads,
                          int64_t n_kv, double eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, "qkv: float32 or bfloat16");
  TORCH_CHECK(qw.scalar_type() == qkv.scalar_type() && kw.scalar_type() == qkv.scalar_type() && qw.dim() == 1 &&
                  qw.is_contiguous() && kw.is_contiguous() && kw.numel() == qw.numel(),
              "qw, kw: (head_dim,) of qkv's type");
  const int64_t D = qw.size(0), W = (n_heads + 2 * n_kv) * D;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == W, "qkv: (N, ", W, ")");
  at::Tensor x = qkv.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t N = x.size(0);
  auto run = [&](auto* xp, auto* qp, auto* kp, auto* yp) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; n++) {
        const int64_t o = n * W, ok = o + n_heads * D, ov = ok + n_kv * D;
        rms_rows(xp + o, qp, yp + o, D, eps, 0, n_heads);
        rms_rows(xp + ok, kp, yp + ok, D, eps, 0, n_kv);
        std::memcpy(yp + ov, xp + ov, n_kv * D * sizeof(*xp));
      }
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(x.data_ptr<float>(), qw.data_ptr<float>(), kw.data_ptr<float>(), y.data_ptr<float>());
  else
    run(x.data_ptr<at::BFloat16>(), qw.data_ptr<at::BFloat16>(), kw.data_ptr<at::BFloat16>(),
        y.data_ptr<at::BFloat16>());
  return y;
}

// ---- attention over the paged KV cache (the tile kernel: attention.h) ----

// The native layer loop's time by phase (`loop_profile`, for benchmarks; off unless asked for,
// then two clock reads a phase): nanoseconds per phase of `hot_layers` (a hot executor, the
// in-process engine) or `cold_serve` (a cold executor), the `attention_step`s they run and
// their `attend_rows`, added up over every call in this process; hot_layers' calls counted.
namespace prof {
enum Phase {
  NORM, SEND, QKV, PLACE, ATTEND, WO, WAIT_ATTN, ADD_ATTN, FFN, WAIT_FFN, ADD_FFN, PREDICT,  // hot_layers
  WAIT_MSG, ANSWER_ATTN, ANSWER_FFN, ANSWER_HEAD,  // cold_serve (an attention answer holds QKV .. WO)
  WARM,  // cold_serve: the records of the predictor's newest masks warmed (within WAIT_MSG)
  WARMED,  // (a count, not nanoseconds: the records warmed)
  CALLS, N
};
static std::atomic<bool> on{false};
static std::array<std::atomic<int64_t>, N> ns;  // (static: zeroed)
using clock = std::chrono::steady_clock;

struct Laps {
  const bool active = on.load(std::memory_order_relaxed);
  clock::time_point t = active ? clock::now() : clock::time_point();
  int64_t since() {  // ns since the last lap, and a new lap starts
    const auto n = clock::now();
    const int64_t d = std::chrono::duration_cast<std::chrono::nanoseconds>(n - t).count();
    t = n;
    return d;
  }
  void lap(Phase p) {
    if (active) ns[p] += since();
  }
  void skip() {  // (time another Laps counted)
    if (active) t = clock::now();
  }
  // a join of the executors' answers: `waited` ns (their reader states' growth) of it waiting
  void join(Phase wait, Phase add, int64_t waited) {
    if (!active) return;
    const int64_t d = since();
    ns[wait] += waited;
    ns[add] += d - waited;
  }
};

static int64_t waited(at::TensorList states) {  // the readers' nanoseconds waited, all channels
  int64_t w = 0;
  for (const at::Tensor& st : states) w += st.data_ptr<int64_t>()[1];
  return w;
}
}  // namespace prof

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

// One token's q, k, v (H + 2 Hkv heads of D floats, in place): the rotary embedding of q and k
// (cos null: none; q then rounded to T, as the model's type holds it), and the new k and v
// written into the pool: kb is head 0's key entry (column `off` of a (D, BS) block), vb its
// value row; heads hs elements apart.
template <typename T>
static void place_token(float* x, const float* cos, const float* sin, T* kb, T* vb, int64_t H, int64_t Hkv,
                        int64_t D, int64_t BS, int64_t hs) {
  if (cos)
    for (int64_t h = 0; h < H + Hkv; h++) rope_row<T>(x + h * D, cos, sin, D);
  else
    for (int64_t d = 0; d < H * D; d++) x[d] = (float)(T)x[d];
  for (int64_t h = 0; h < Hkv; h++)
    for (int64_t d = 0; d < D; d++) {
      kb[h * hs + d * BS] = (T)x[(H + h) * D + d];
      vb[h * hs + d] = (T)x[(H + Hkv + h) * D + d];
    }
}

// A step's attention after the q/k/v projection, in one call, for any mix of sequences and
// tokens (prompt chunks and decode rows): the rotary embedding of q and k, the new keys and
// values written into their blocks, then softmax(q K^T * scale) V over each token's positions,
// read from the blocks in place (no gathered copy of a sequence's cache).
// qkv (N, (H + 2 Hkv) D): the step's tokens, sequence by sequence (sequence s owns tokens
// starts[s] .. starts[s+1] - 1); cos, sin (N, D) float32 at each token's position, or empty;
// k_pool (NB, Hkv, D, BS) keys transposed per block, v_pool (NB, Hkv, BS, D), of qkv's type;
// tables (S, M) int32: sequence s's position p is in block tables[s][p / BS]; pos (N,) each
// token's position: it sees positions [pos - window + 1, pos] (window 0: [0, pos]), every one
// of them in the cache or in this step -> (N, H D) of qkv's type.
// The step's checks (shapes, types, positions inside their tables, blocks inside the pool).
static void check_attention(const at::Tensor& qkv, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& pos,
                            int64_t n_heads, at::ScalarType qkv_type) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "pools: keys (NB, Hkv, D, BS) and values (NB, Hkv, BS, D), contiguous");
  const int64_t NB = k_pool.size(0), Hkv = k_pool.size(1), D = k_pool.size(2), BS = k_pool.size(3);
  TORCH_CHECK(v_pool.size(0) == NB && v_pool.size(1) == Hkv && v_pool.size(2) == BS && v_pool.size(3) == D,
              "the value pool's shape does not match the keys'");
  const auto dt = k_pool.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && v_pool.scalar_type() == dt && qkv_type == dt,
              "qkv and the pools: one type, float32 or bfloat16");
  const int64_t H = n_heads, N = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * Hkv) * D, "qkv: (N, (H + 2 Hkv) D)");
  TORCH_CHECK(H % Hkv == 0 && D % 16 == 0 && BS % 16 == 0 && BS <= ATTN_MAX_BS,
              "head sizes and block sizes: D and BS multiples of 16, BS at most 64");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.is_contiguous(),
              "tables: (S, M) int32");
  const int64_t S = tables.size(0), M = tables.size(1);
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.numel() == S + 1 && starts.is_contiguous() &&
              pos.scalar_type() == at::kLong && pos.numel() == N && pos.is_contiguous(),
              "starts: (S + 1,) int64, pos: (N,) int64");
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t *st = starts.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[S] == N, "starts must run from 0 to N");
  for (int64_t s = 0; s < S; s++) {
    TORCH_CHECK(st[s] <= st[s + 1], "starts must not decrease");
    int64_t last = -1;
    for (int64_t t = st[s]; t < st[s + 1]; t++) {
      TORCH_CHECK(pp[t] >= 0 && pp[t] / BS < M, "position ", pp[t], " outside its block table");
      last = std::max(last, pp[t] / BS);
    }
    for (int64_t b = 0; b <= last; b++)
      TORCH_CHECK(tp[s * M + b] >= 0 && tp[s * M + b] < NB, "block ", tp[s * M + b], " outside the pool");
  }
}

// The attention of `check_attention`'s step over x (N, (H + 2 Hkv) D) float32, the projections'
// values as the pools' type holds them, in place (RoPE'd there): the new keys and values go into
// the pools, -> (N, H D) float32. cos, sin: null (no RoPE), or the rows of token t at
// cos + at(t) * D, where at(t) is t (rows per token) or pos[t] (`by_pos`: a table by position).
static at::Tensor attend_rows(at::Tensor& x, const float* cos, const float* sin, bool by_pos,
                              const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                              const at::Tensor& starts, const at::Tensor& pos, int64_t n_heads, int64_t window,
                              double scale) {
  const Kernels& kern = active();
  const int64_t Hkv = k_pool.size(1), D = k_pool.size(2), BS = k_pool.size(3);
  const auto dt = k_pool.scalar_type();
  const int64_t H = n_heads, N = x.size(0), S = tables.size(0), M = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t *st = starts.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  const int64_t row = (H + 2 * Hkv) * D, hs = D * BS, es = dt == at::kFloat ? 4 : 2;
  char* kbase = static_cast<char*>(k_pool.data_ptr());
  char* vbase = static_cast<char*>(v_pool.data_ptr());
  prof::Laps laps;
  // 1. every token's new key and value in place, before anyone reads them
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; s++)
      for (int64_t t = st[s]; t < st[s + 1]; t++) {
        const int64_t blk = tp[s * M + pp[t] / BS], off = pp[t] % BS, at_row = (by_pos ? pp[t] : t) * D;
        const float* c = cos ? cos + at_row : nullptr;
        const float* sn = cos ? sin + at_row : nullptr;
        const int64_t kat = blk * Hkv * hs + off, vat = (blk * Hkv * BS + off) * D;
        if (dt == at::kFloat)
          place_token(xp + t * row, c, sn, (float*)kbase + kat, (float*)vbase + vat, H, Hkv, D, BS, hs);
        else
          place_token(xp + t * row, c, sn, (at::BFloat16*)kbase + kat, (at::BFloat16*)vbase + vat, H, Hkv, D, BS, hs);
      }
  });
  laps.lap(prof::PLACE);
  // 2. tiles: a sequence's tokens in runs of `per` for one KV head and its G query heads
  const int64_t G = H / Hkv, per = std::max<int64_t>(1, std::min<int64_t>(16, ATTN_MAX_TILE / G));
  std::vector<std::array<int64_t, 4>> tasks;  // (sequence, KV head, first token, end)
  for (int64_t s = 0; s < S; s++)
    for (int64_t t = st[s]; t < st[s + 1]; t += per)
      for (int64_t h = 0; h < Hkv; h++) tasks.push_back({s, h, t, std::min(t + per, st[s + 1])});
  // dealt first, last, second, second to last, ...: a prompt's later tiles see more keys (its
  // last about twice its average), and parallel_for gives each thread a run of tasks, so in
  // their order the thread with the last half of a prompt had about three quarters of its work;
  // each task's floats are its own either way
  std::vector<std::array<int64_t, 4>> dealt;
  dealt.reserve(tasks.size());
  for (size_t i = 0, j = tasks.size(); i < j; i++) {
    dealt.push_back(tasks[i]);
    if (i != --j) dealt.push_back(tasks[j]);
  }
  tasks.swap(dealt);
  at::Tensor out = at::empty({N, H * D}, x.options());
  float* op = out.data_ptr<float>();
  const float sc_f = (float)scale;
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(ATTN_MAX_TILE * D), o(ATTN_MAX_TILE * D);
    std::vector<int64_t> qpos(ATTN_MAX_TILE);
    for (int64_t i = begin; i < end; i++) {
      const auto [s, h, t0, t1] = tasks[i];
      const int64_t nq = (t1 - t0) * G;
      for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < G; g++) {
          const float* src = xp + t * row + (h * G + g) * D;
          float* dst = q.data() + ((t - t0) * G + g) * D;
          for (int64_t d = 0; d < D; d++) dst[d] = src[d] * sc_f;
          qpos[(t - t0) * G + g] = pp[t];
        }
      const AttnTile a{q.data(), qpos.data(), nq, D, BS, window, tp + s * M,
                       reinterpret_cast<const uint8_t*>(kbase) + h * hs * es,
                       reinterpret_cast<const uint8_t*>(vbase) + h * hs * es, Hkv * hs * es,
                       dt == at::kBFloat16, o.data()};
      kern.attend(a);
      for (int64_t t = t0; t < t1; t++)
        std::memcpy(op + t * H * D + h * G * D, o.data() + (t - t0) * G * D, G * D * sizeof(float));
    }
  });
  laps.lap(prof::ATTEND);
  return out;
}

static at::Tensor paged_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                                  const at::Tensor& starts, const at::Tensor& pos, int64_t n_heads, int64_t window,
                                  double scale) {
  const at::Tensor tc = tables.contiguous(), sc = starts.contiguous(), pc = pos.contiguous();
  check_attention(qkv, k_pool, v_pool, tc, sc, pc, n_heads, qkv.scalar_type());
  const int64_t N = qkv.size(0), D = k_pool.size(2);
  const bool roped = cos.numel() > 0;
  if (roped)
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                cos.size(0) == N && cos.size(1) == D && sin.sizes() == cos.sizes(), "cos, sin: (N, D) float32");
  at::Tensor x = qkv.to(at::kFloat, false, true).contiguous();  // (N, (H + 2 Hkv) D), our own copy
  at::Tensor cc, snc;
  if (roped) cc = cos.contiguous(), snc = sin.contiguous();
  at::Tensor out = attend_rows(x, roped ? cc.data_ptr<float>() : nullptr, roped ? snc.data_ptr<float>() : nullptr,
                               false, k_pool, v_pool, tc, sc, pc, n_heads, window, scale);
  const auto dt = k_pool.scalar_type();
  return dt == at::kFloat ? out : out.to(dt);
}

// ---- the data plane's channels (actors/channel.py), for steps compiled by torch.compile ----
// A channel is a shared mapping: [0:8) seq (messages published; the futex word is its low
// half), [8:16) the writer's pid, [16:24) closed, [24:128) 13 int64 words, [128:) payload.
// These two ops do what Channel.put + publish and Channel.wait do, so that a compiled step calls
// them from its generated C++ (a Python call in the middle of a layer would break the graph).
// `base` is the mapping's address in this process.
constexpr int64_t CH_HEADER = 128;

struct ChannelHeader {
  std::atomic<int64_t> seq;
  int64_t pid;
  std::atomic<int64_t> closed;
  int64_t words[13];
};

static bool process_alive(int64_t pid) {
  if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return false;
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* end = std::strrchr(buf, ')');  // the state follows the command's closing paren
  return !(end && end[1] == ' ' && end[2] == 'Z');  // a zombie has exited
}

// The message's words after its payload is in place: bump seq, wake the sleepers.
static void publish(int64_t base, const int64_t* words, int n) {
  auto* h = reinterpret_cast<ChannelHeader*>(base);
  std::memcpy(h->words, words, n * sizeof(int64_t));
  h->seq.store(h->seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// parts[0] (rows, T, dim) or (rows, dim), and the other parts after it, each at the next
// 64-byte boundary -> the channel's payload, and a message with the words (op, layer, rows, T,
// *extra), extra padded with zeros to two words, as Channel.put + publish.
static void send_message(at::TensorList parts, int64_t base, int64_t capacity, int64_t op, int64_t layer,
                         const std::vector<int64_t>& extra) {
  TORCH_CHECK(!parts.empty() && (parts[0].dim() == 2 || parts[0].dim() == 3), "parts[0]: (rows, T, dim) or (rows, dim)");
  int64_t offset = 0;
  for (const at::Tensor& t : parts) {
    at::Tensor c = t.contiguous();
    TORCH_CHECK(offset + (int64_t)c.nbytes() <= capacity, "a message of ", offset + c.nbytes(),
                " bytes on a channel of ", capacity);
    std::memcpy(reinterpret_cast<char*>(base) + CH_HEADER + offset, c.data_ptr(), c.nbytes());
    offset = (offset + c.nbytes() + 63) / 64 * 64;
  }
  const at::Tensor& x = parts[0];
  TORCH_CHECK(extra.size() <= 9, "at most 9 extra words");
  int64_t words[13] = {op, layer, x.size(0), x.dim() == 3 ? x.size(1) : 1};  // the rest 0
  for (size_t i = 0; i < extra.size(); i++) words[4 + i] = extra[i];
  // at least the two words every reader reads after these: none left from an earlier message
  publish(base, words, 4 + std::max<int>(2, (int)extra.size()));
}

// A channel's mapping named by a small slot number (ch_slot) rather than by its address: a
// compiled step holds the number as a constant of its graph, the same in every process and
// run, so Inductor's caches find the step compiled before (an address differs every time).
// ch_send and ch_recv take either; an address is never below CH_SLOTS.
constexpr int64_t CH_SLOTS = 64;
static std::atomic<int64_t> g_slots[CH_SLOTS];

static void ch_slot(int64_t slot, int64_t base) {
  TORCH_CHECK(slot > 0 && slot < CH_SLOTS, "ch_slot: slot ", slot, " out of 1..", CH_SLOTS - 1);
  TORCH_CHECK(base >= CH_SLOTS, "ch_slot: not a mapping's address: ", base);
  g_slots[slot].store(base);
}

static int64_t channel_base(int64_t base) {
  if (base >= CH_SLOTS) return base;
  const int64_t b = base > 0 ? g_slots[base].load() : 0;
  TORCH_CHECK(b, "channel slot ", base, " names no mapping (ch_slot)");
  return b;
}

// send_message, returning a copy of parts[0]: a compiled step reads what follows the send from
// it, which keeps the send first.
#ifndef POWERINFER_LITE
static at::Tensor ch_send(at::TensorList parts, int64_t base, int64_t capacity, int64_t op, int64_t layer,
                          c10::SymIntArrayRef extra) {
  base = channel_base(base);
  std::vector<int64_t> words;
  for (const auto& e : extra) words.push_back(e.expect_int());
  send_message(parts, base, capacity, op, layer, words);
  return parts[0].contiguous().clone();
}
#endif

// Waits for the next message on the channel at `base`, as Channel.wait: spinning (yielding the
// core) for spin_us, then asleep in the futex, checking the closed flag and the writer's
// liveness. st: the reader's [messages consumed, nanoseconds waited].
static void wait_message(int64_t base, int64_t* st, double spin_us) {
  auto* h = reinterpret_cast<ChannelHeader*>(base);
  const int64_t target = st[0] + 1;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  if (h->seq.load(std::memory_order_acquire) < target) {
    const auto spin_end = t0 + std::chrono::nanoseconds((int64_t)(spin_us * 1e3));
    while (h->seq.load(std::memory_order_acquire) < target && clock::now() < spin_end) sched_yield();
    bool slept = false;
    while (h->seq.load(std::memory_order_acquire) < target) {
      TORCH_CHECK(!h->closed.load(), "channel closed");
      const int64_t pid = h->pid;
      TORCH_CHECK(!(slept && pid && !process_alive(pid)), "peer died: the process writing a channel (pid ", pid,
                  ") died");
      const timespec ts{0, 50000000};  // re-check liveness every 50 ms
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->seq), FUTEX_WAIT, (uint32_t)((target - 1) & 0xFFFFFFFF),
              &ts, nullptr, 0);
      slept = true;
    }
  }
  TORCH_CHECK(h->seq.load() == target, "channel out of lockstep: message ", h->seq.load(), " where ", target,
              " was due");
  st[0] = target;
  st[1] += std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count();
}

// The next message on the channel at `base` (see wait_message; state: the reader's int64
// [messages consumed, nanoseconds waited]): a float32 copy of its payload, of shape
// like.shape[:-1] + (width,).
static at::Tensor ch_recv(const at::Tensor& like, at::Tensor& state, int64_t base, int64_t width, double spin_us) {
  TORCH_CHECK(state.scalar_type() == at::kLong && state.numel() == 2 && state.is_contiguous(), "state: int64 (2,)");
  base = channel_base(base);
  wait_message(base, state.data_ptr<int64_t>(), spin_us);
  std::vector<int64_t> shape(like.sizes().begin(), like.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, like.options().dtype(at::kFloat));
  std::memcpy(out.data_ptr(), reinterpret_cast<char*>(base) + CH_HEADER, out.nbytes());
  return out;
}

// y (rows, n) f32 = x (rows, dim) times a matrix held as 16-row groups (fmt -1 - its Layout:
// -1 q4x16, -2 q4kx16, -3 q6kx16, -4 q8x16, -5 q5kx16, -6 q5x16; n rows) or as rows in a kernel format (fmt >= 0).
// A one-row step (decode) with `sparse` given (a q4c copy of the same matrix, a non-empty tensor)
// reads only the input channels over `threshold` (q4c_product), adding them and the channels
// seen to stats[0] and stats[1] where given.
static at::Tensor project(const Kernels& k, const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t n,
                          const at::Tensor* sparse = nullptr, double threshold = 0.0, int64_t* stats = nullptr) {
  if (sparse && sparse->numel() && x.size(0) == 1) {
    const int64_t dim = x.size(1);
    TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "x: contiguous float32 or bfloat16");
    int64_t kept = 0;
    const float* y = q4c_product(k, x.data_ptr(), x.scalar_type() == at::kBFloat16, 1, dim, sparse->data_ptr<uint8_t>(),
                                 n, q4c_kind(*sparse, n, dim), (float)threshold, &kept);
    if (stats) stats[0] += kept, stats[1] += dim;
    at::Tensor out = at::empty({1, n}, x.options().dtype(at::kFloat));
    std::memcpy(out.data_ptr<float>(), y, n * 4);
    return out;
  }
  if (fmt >= 0) return linear(x, w, fmt);
  TORCH_CHECK(-1 - fmt < N_LAYOUTS, "no matrix layout ", -1 - fmt);
  const int64_t rows = x.size(0), dim = x.size(1), npad = (n + 15) / 16 * 16;
  const float* y = x16_rows(k, -1 - fmt, x.data_ptr(), x.scalar_type() == at::kBFloat16, rows, dim, w.data_ptr<uint8_t>(), n);
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  for (int64_t r = 0; r < rows; r++) std::memcpy(out.data_ptr<float>() + r * n, y + r * npad, n * 4);
  return out;
}

// x (B, dim) f32 or bf16 times one of a predictor's matrices -> (B, n) f32 (`project`): w rows
// in a format (fmt >= 0), or groups of 16 rows in a Layout (fmt = -1 - layout; n = 16 a group:
// q8x16, 8-bit codes, about half the bytes of bf16 rows and read at twice their rate, where a
// Q8_0 row of a rank-128 predictor's second matrix, 4 blocks, costs more in its row's sums than
// in its bytes). A public op's tensors: the groups' shapes checked here (`linear` checks rows).
static at::Tensor pred_linear(const at::Tensor& x, const at::Tensor& w, int64_t fmt) {
  if (fmt < 0) {
    TORCH_CHECK(-1 - fmt < N_LAYOUTS, "no matrix layout ", -1 - fmt);
    check_input(x, true);
    check_rows(w);
    TORCH_CHECK(w.size(1) == group_bytes(-1 - fmt, x.size(1)), "w: ", w.size(1), " bytes per group, expected ",
                group_bytes(-1 - fmt, x.size(1)), " for dim ", x.size(1));
  }
  return project(active(), x, w, fmt, fmt < 0 ? w.size(0) * 16 : w.size(0));
}

// A predictor's logits relu(p fc1^T) fc2^T on the kernel's GEMV (p: its input rows (B, dim);
// fc1, fc2 in fmt, see pred_linear) -> (B, ffn_dim) f32: `predictor.Predictors.logits` for
// decode rows, and what the native loops pick neurons from
static at::Tensor pred_logits(const at::Tensor& p, const at::Tensor& fc1, const at::Tensor& fc2, int64_t fmt) {
  return pred_linear(pred_linear(p.contiguous(), fc1, fmt).relu_(), fc2, fmt);
}

// The rows' predicted neurons as `predictor.Predictors.active` computes them: a neuron picked
// where its logit (pred_logits) is at least `threshold` -> (B, ffn_dim) bool
static at::Tensor predicted_rows(const at::Tensor& p, const at::Tensor& fc1, const at::Tensor& fc2, int64_t fmt,
                                 double threshold) {
  return pred_logits(p, fc1, fc2, fmt).ge(threshold);
}

// What a cold executor holds of each layer for `cold_serve`, or the hot executor (the in-process
// engine) for `hot_layers` (one entry per layer in each list; an empty tensor or a kind of 0
// where the caller answers that layer's messages itself, or holds no neurons of it).
struct ColdLayers {
  at::TensorList ffn_w1, ffn_w2;  // block slice: gate+up rows, down columns (16-row groups); records: w1
  at::IntArrayRef ffn_kind;       // 0 none, 1 block slice (ffn_n: its gate+up rows), 2 neuron records,
                                  // 3 neuron records with their predictor (w2: its fc1; see Predicted)
  at::IntArrayRef ffn_n;          // (records: their format)
  at::IntArrayRef ffn_down_fmt;   // block slice: its down's, < 0 16-row groups (see project) or a kernel
                                  // format; kind 3: the predictor's format
  at::IntArrayRef ffn_w1_fmt;     // block slice: its gate+up's, < 0 16-row groups (see project)
  at::TensorList ffn_idx;         // records: the layer's neurons they hold, in order (int64), which a
                                  // predictor's masks over the layer's neurons select from
  at::ArrayRef<double> ffn_threshold;  // records: a neuron's firing threshold (0: none)
  at::TensorList qkv, wo, k_cache, v_cache;  // its heads: projections, paged pools (see paged_attention)
  at::IntArrayRef qkv_fmt, qkv_n, wo_fmt;    // < 0: 16-row groups (see project), else a kernel format
  // a second run of q/k/v rows in another format, after the first (a Q4_K_M file's v in Q6_K
  // beside q and k in Q4_K); an empty tensor where there is none
  at::TensorList qkv2;
  at::IntArrayRef qkv2_fmt, qkv2_n;
  // input sparsity (the native loops' decode steps, set_sparse): four a layer (q/k/v, the output
  // projection, a block slice's gate+up, q/k/v's second run), a q4c copy of the projection (see
  // project; an empty tensor: dense; q/k/v's first run and its second apart: attention_step) and
  // its input's threshold; empty lists where none
  at::TensorList sparse = {};
  at::ArrayRef<double> sparse_threshold = {};
  int64_t* sparse_stats = nullptr;  // the channels kept and seen, where counted

  // the projection's sparse copy (slot 0 q/k/v, 1 output, 2 gate+up, 3 q/k/v's second run) or null
  const at::Tensor* sparse_of(int64_t layer, int slot) const {
    if (sparse.empty()) return nullptr;
    const at::Tensor& t = sparse[4 * layer + slot];
    return t.numel() ? &t : nullptr;
  }
  double threshold_of(int64_t layer, int slot) const { return sparse.empty() ? 0.0 : sparse_threshold[4 * layer + slot]; }
};

// The native loops' per-layer lists as one ColdLayers, each checked to hold an entry per layer.
static ColdLayers per_layer(at::TensorList ffn_w1, at::TensorList ffn_w2, at::IntArrayRef ffn_kind,
                            at::IntArrayRef ffn_n, at::IntArrayRef ffn_down_fmt, at::IntArrayRef ffn_w1_fmt,
                            at::TensorList ffn_idx, at::ArrayRef<double> ffn_threshold, at::TensorList qkv,
                            at::IntArrayRef qkv_fmt, at::IntArrayRef qkv_n, at::TensorList qkv2, at::IntArrayRef qkv2_fmt, at::IntArrayRef qkv2_n, at::TensorList wo,
                            at::IntArrayRef wo_fmt, at::TensorList k_cache, at::TensorList v_cache) {
  const size_t n = ffn_kind.size();
  TORCH_CHECK(ffn_w1.size() == n && ffn_w2.size() == n && ffn_n.size() == n && ffn_down_fmt.size() == n &&
              ffn_w1_fmt.size() == n && ffn_idx.size() == n && ffn_threshold.size() == n && qkv.size() == n &&
              qkv_fmt.size() == n && qkv_n.size() == n &&
              qkv2.size() == n && qkv2_fmt.size() == n && qkv2_n.size() == n && wo.size() == n &&
              wo_fmt.size() == n && k_cache.size() == n && v_cache.size() == n,
              "one entry per layer in every list");
  for (size_t l = 0; l < n; l++)
    TORCH_CHECK(!ffn_idx[l].numel() || (ffn_idx[l].scalar_type() == at::kLong && ffn_idx[l].dim() == 1 &&
                                        ffn_idx[l].numel() == ffn_w1[l].size(0)),
                "layer ", l, ": ffn_idx holds one int64 neuron index per record");
  return ColdLayers{ffn_w1, ffn_w2, ffn_kind, ffn_n, ffn_down_fmt, ffn_w1_fmt, ffn_idx, ffn_threshold, qkv, wo,
                    k_cache, v_cache, qkv_fmt, qkv_n, wo_fmt, qkv2, qkv2_fmt, qkv2_n};
}

// A layer's predictor beside its neuron records (ffn kind 3, `hot_layers` in process only): its
// second matrix (its first is the layer's ffn_w2), and the predictor's rule and input, as
// `predicted_ffn` takes them.
struct Predicted {
  at::TensorList fc2;
  double pred_threshold;  // a logit at least this picks a neuron
  bool layer_input;       // the predictor reads the layer's input, else the FFN's residual
};

// A layer's decode step of its block slice or neuron records: (rows, dim) -> (rows, dim) f32;
// for predicted records (kind 3) p is the predictor's input rows; for records (kind 2) `mask`
// the rows' masks over the layer's neurons (see masked_records), or null: every neuron, and
// `prompt` (records, no masks): the rows are a prompt's, every record without a threshold
static at::Tensor ffn_step(const Kernels& k, const ColdLayers& L, int64_t layer, const at::Tensor& x, int64_t act,
                           const Predicted* pred = nullptr, const at::Tensor* p = nullptr,
                           const at::Tensor* mask = nullptr, bool prompt = false) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t rows = x.size(0), dim = x.size(1);
  const double threshold = L.ffn_threshold[layer];
  if (L.ffn_kind[layer] == 3) {  // records (w1) and the predictor (w2 its fc1) in one call
    TORCH_CHECK(pred && p, "predicted neurons need their predictor");
    return predicted_ffn(x, *p, L.ffn_w2[layer], pred->fc2[layer], L.ffn_down_fmt[layer], pred->pred_threshold,
                         L.ffn_w1[layer], std::nullopt, threshold, act, L.ffn_n[layer])
        .to(at::kFloat);
  }
  if (L.ffn_kind[layer] == 2) {  // the records through the neuron kernel: the masks' neurons, or all
    const at::Tensor& w = L.ffn_w1[layer];
    // a prompt's rows: every record, no threshold (the Python set's prompt path,
    // `NeuronSet._prompt_rows`, which runs the same product)
    if (prompt && !mask) return records_rows(x, w, std::nullopt, 0.0, act, L.ffn_n[layer]).to(at::kFloat);
    if (rows > 64) {  // a decode step: 64 rows a call (a row's answer is its own neurons' sums
      // whatever rows share the call: the Python set's, which splits its rows the same way)
      const at::Tensor xs = x.contiguous(), ms = mask ? mask->contiguous() : at::Tensor();
      at::Tensor out = at::empty({rows, dim}, at::TensorOptions().dtype(at::kFloat));
      for (int64_t r = 0; r < rows; r += 64) {
        const int64_t n = std::min<int64_t>(64, rows - r);
        const at::Tensor xr = at::from_blob(static_cast<char*>(xs.data_ptr()) + r * dim * xs.element_size(),
                                            {n, dim}, xs.options());
        const at::Tensor mr = mask ? at::from_blob(ms.data_ptr<bool>() + r * ms.size(1), {n, ms.size(1)},
                                                   ms.options())
                                   : at::Tensor();
        const at::Tensor part = ffn_step(k, L, layer, xr, act, nullptr, nullptr, mask ? &mr : nullptr).contiguous();
        std::memcpy(out.data_ptr<float>() + r * dim, part.data_ptr<float>(), n * dim * 4);
      }
      return out;
    }
    if (mask)
      return masked_records(x, w, L.ffn_idx[layer], *mask, std::nullopt, threshold, act, L.ffn_n[layer]).to(at::kFloat);
    at::Tensor all = at::ones({w.size(0)}, x.options().dtype(at::kBool));
    return neuron_ffn(x, w, all, std::nullopt, std::nullopt, threshold, act, L.ffn_n[layer]).to(at::kFloat);
  }
  TORCH_CHECK(!mask, "layer ", layer, ": masks for neurons held as a block slice");
  const bool gated = gated_act(act);
  const int64_t n = L.ffn_n[layer], kk = gated ? n / 2 : n;
  at::Tensor y1 = project(k, x, L.ffn_w1[layer], L.ffn_w1_fmt[layer], n,  // (rows, n): gate rows then up rows
                          L.sparse_of(layer, 2), L.threshold_of(layer, 2), L.sparse_stats);
  at::Tensor h = at::empty({rows, kk}, x.options().dtype(at::kFloat));
  const float* yp = y1.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  // over the threads (each value's exponential, or erf for GELU, is a scalar call); a part's
  // runs within a row in the kernel's vectors (`activate`)
  at::parallel_for(0, rows * kk, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t r = i / kk, j = i % kk, m = std::min(end - i, kk - j);
      const float* row = yp + r * n;
      k.activate((int)act, bf16, gated ? row + j : nullptr, row + (gated ? kk : 0) + j, hp + i, m);
      i += m;
    }
  });
  return project(k, h, L.ffn_w2[layer], L.ffn_down_fmt[layer], dim);
}

// mode 1: reset and start; 0: read; 2: stop. Returns the totals as they were before the call
// (int64, prof::Phase's order: nanoseconds per phase, then CALLS, the hot_layers calls counted).
static at::Tensor loop_profile(int64_t mode) {
  at::Tensor out = at::empty({prof::N}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int i = 0; i < prof::N; i++) o[i] = prof::ns[i].load();
  if (mode == 1)
    for (auto& v : prof::ns) v.store(0);
  if (mode == 1 || mode == 2) prof::on.store(mode == 1);
  return out;
}

// A layer's q/k norms (Qwen3, Gemma 3): each head's q and k through RMSNorm with these weights
// (D,) of the model's type, as `qk_norm` computes them.
struct QKNorms {
  const at::Tensor& q;
  const at::Tensor& k;
  double eps;
};

// x (1, dim) f32 or bf16 with every entry input sparsity drops (`dropped`) set to 0 (a copy):
// the input a q4c copy reads (`q4c_product`), for the runs of a projection that have no copy
static at::Tensor zeroed_under(const at::Tensor& x, double threshold) {
  at::Tensor out = x.contiguous().clone();
  const int64_t n = out.numel();
  const float t = (float)threshold;
  if (out.scalar_type() == at::kBFloat16) {
    c10::BFloat16* p = static_cast<c10::BFloat16*>(out.data_ptr());
    for (int64_t i = 0; i < n; i++)
      if (dropped((float)p[i], t)) p[i] = c10::BFloat16(0.0f);
  } else {
    float* p = out.data_ptr<float>();
    for (int64_t i = 0; i < n; i++)
      if (dropped(p[i], t)) p[i] = 0.0f;
  }
  return out;
}

// A layer's decode step of its heads: x (rows, dim) in the model's type; pos (rows,), starts,
// tables: where the rows sit in the paged cache (see paged_attention) -> (rows, dim) f32, their
// share of the output projection (as Attention(partial=True)). qk: the layer's q/k norms, or null.
static at::Tensor attention_step(const Kernels& k, const ColdLayers& L, int64_t layer, const at::Tensor& x,
                                 const at::Tensor& pos, const at::Tensor& starts, const at::Tensor& tables,
                                 int64_t n_heads, const std::optional<at::Tensor>& cos,
                                 const std::optional<at::Tensor>& sin, int64_t window, double scale,
                                 const QKNorms* qk = nullptr) {
  prof::Laps laps;
  const at::Tensor tables_c = tables.contiguous(), starts_c = starts.contiguous(), pos_c = pos.contiguous();
  // (the values paged_attention would see and return, with no copies between: the projection
  // rounded to the model's type in place, the RoPE tables read at each position, the output
  // rounded as the model's type holds it)
  const at::Tensor* sparse = L.sparse_of(layer, 0);
  const double threshold = L.threshold_of(layer, 0);
  at::Tensor qkv = project(k, x, L.qkv[layer], L.qkv_fmt[layer], L.qkv_n[layer], sparse, threshold,
                           L.sparse_stats);
  if (L.qkv2[layer].numel()) {
    // a second run (a Q4_K_M file's Q6_K v) beside a sparse first one: from its own copy, or
    // without one the dense product over the input zeroed as the first run's copy reads it (the
    // channels at or under its threshold), so q/k/v are the dense products over one zeroed input,
    // as the modules compute them (its channels not counted again)
    const at::Tensor* sparse2 = sparse ? L.sparse_of(layer, 3) : nullptr;
    const bool zeroed = sparse && !sparse2 && x.size(0) == 1;
    const at::Tensor xs = zeroed ? zeroed_under(x, threshold) : x;
    qkv = at::cat({qkv, project(k, xs, L.qkv2[layer], L.qkv2_fmt[layer], L.qkv2_n[layer], sparse2, threshold)}, 1);
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto round_rows = [&](at::Tensor& t) {
    if (bf16) active().round_bf16(t.data_ptr<float>(), t.numel());
  };
  qkv = qkv.contiguous();
  round_rows(qkv);
  if (qk) {  // in the model's type, as the module norms the projection's rounded output (qk_norm)
    const int64_t D = qk->q.numel(), Hkv = L.k_cache[layer].size(1), W = qkv.size(1);
    float* p = qkv.data_ptr<float>();
    for (int64_t n = 0; n < qkv.size(0); n++) {
      rms_in_place(p + n * W, qk->q, n_heads, qk->eps);
      rms_in_place(p + n * W + n_heads * D, qk->k, Hkv, qk->eps);
    }
  }
  laps.lap(prof::QKV);
  check_attention(qkv, L.k_cache[layer], L.v_cache[layer], tables_c, starts_c, pos_c, n_heads, x.scalar_type());
  const bool roped = cos && cos->defined() && cos->numel();
  if (roped) {
    TORCH_CHECK(sin && cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->dim() == 2 &&
                    cos->is_contiguous() && sin->is_contiguous() && sin->sizes() == cos->sizes() &&
                    cos->size(1) == L.k_cache[layer].size(2),
                "cos, sin: (positions, D) float32 tables");
    const int64_t* pp = pos_c.data_ptr<int64_t>();
    for (int64_t t = 0; t < pos_c.numel(); t++)
      TORCH_CHECK(pp[t] < cos->size(0), "position ", pp[t], " past the RoPE tables");
  }
  laps.lap(prof::ATTEND);
  at::Tensor y = attend_rows(qkv, roped ? cos->data_ptr<float>() : nullptr, roped ? sin->data_ptr<float>() : nullptr,
                             true, L.k_cache[layer], L.v_cache[layer], tables_c, starts_c, pos_c, n_heads, window, scale);
  laps.skip();  // (its own laps)
  round_rows(y);
  laps.lap(prof::ATTEND);
  at::Tensor out = project(k, y, L.wo[layer], L.wo_fmt[layer], x.size(1), L.sparse_of(layer, 1), L.threshold_of(layer, 1),
                           L.sparse_stats);
  laps.lap(prof::WO);
  return out;
}

// Whether a layer's neurons (its heads) answer a prompt's rows, any number of them, natively:
// a block slice (a whole dense FFN) whose gate+up and down are 16-row groups, heads whose
// projections are: the GEMVs the Python modules run for those rows too (a projection in a row
// format, `KernelLinear`, widens a many-row step's rows instead, and neuron records go through
// the prompt path of the Python set), so the answers are theirs.
static bool prompt_rows_ffn(const ColdLayers& L, int64_t layer) {
  return L.ffn_kind[layer] == 1 && L.ffn_w1_fmt[layer] < 0 && L.ffn_down_fmt[layer] < 0;
}

static bool prompt_rows_attention(const ColdLayers& L, int64_t layer) {
  return L.qkv[layer].numel() && L.qkv_fmt[layer] < 0 && (!L.qkv2[layer].numel() || L.qkv2_fmt[layer] < 0) &&
         L.wo_fmt[layer] < 0;
}

// The records of a layer that a predictor's masks select (rows (rows, ffn_dim) bool, any row's),
// warmed into this core's caches with software prefetches, a line at a time, until `x` holds
// message `target` (checked every 8 records): a cold executor's idle time while the hot side
// attends, spent on the reads of the step it will answer next. Its FFN then reads them from the
// caches (the last level's, where they outgrow the core's own), not from memory. Only a hint: a
// record it misses is read as before. Returns the records it warmed.
static int64_t warm_records(const ColdLayers& L, int64_t layer, const bool* rows_mask, int64_t rows, int64_t ffn_dim,
                            const ChannelHeader* xh, int64_t target) {
  const at::Tensor& w = L.ffn_w1[layer];
  const at::Tensor& idx = L.ffn_idx[layer];
  const char* base = static_cast<const char*>(w.data_ptr());
  const int64_t n = w.size(0), stride = w.stride(0) * w.element_size(), bytes = w.size(1) * w.element_size();
  const int64_t* ip = idx.numel() ? idx.data_ptr<int64_t>() : nullptr;
  int64_t warmed = 0;
  for (int64_t j = 0; j < n; j++) {
    if ((j & 7) == 0 && xh->seq.load(std::memory_order_relaxed) >= target) break;  // the step is here
    const int64_t neuron = ip ? ip[j] : j;
    if (neuron < 0 || neuron >= ffn_dim) continue;
    bool on = false;
    for (int64_t r = 0; r < rows && !on; r++) on = rows_mask[r * ffn_dim + neuron];
    if (!on) continue;
    const char* rec = base + j * stride;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(rec + o, 0, 1);
    warmed++;
  }
  return warmed;
}

// Input sparsity for a native loop's decode steps (see ColdLayers): none (empty lists), or four
// q4c copies (or empty tensors) and thresholds per layer, and the counter of the channels kept
// and seen (2 int64) where given. A one-row step's projection with a copy reads only the input
// channels over its threshold (project).
static void set_sparse(ColdLayers& L, size_t n_layers, at::TensorList sparse, at::ArrayRef<double> sparse_threshold,
                       const std::optional<at::Tensor>& sparse_stats) {
  TORCH_CHECK(sparse.empty() || (sparse.size() == 4 * n_layers && sparse_threshold.size() == 4 * n_layers),
              "sparse: none, or four q4c copies (or empty tensors) and thresholds per layer");
  if (sparse.empty()) return;
  L.sparse = sparse;
  L.sparse_threshold = sparse_threshold;
  if (sparse_stats) {
    TORCH_CHECK(sparse_stats->scalar_type() == at::kLong && sparse_stats->numel() == 2 && sparse_stats->is_contiguous(),
                "sparse_stats: 2 int64");
    L.sparse_stats = sparse_stats->data_ptr<int64_t>();
  }
}

// cold_serve's wait for the message after `st`'s with the predictor's mask channel beside it
// (`ahead`: its mapping; the masks of a layer come out before the hot side attends, lookahead):
// for up to spin_us, each new set of masks for a layer of neuron records is warmed
// (warm_records) while `x` holds nothing new; then the plain wait. The warming counts as waiting
// (the executor is not answering); loop_profile reports it apart (WARM, WARMED). The masks'
// payload stays in place until this executor answers their layer (the hot side sends the next
// layer's predictor input only after it has every answer), so reading it here races nothing.
static void wait_warming(const ColdLayers& L, int64_t x_base, int64_t* st, double spin_us, int64_t ahead,
                         int64_t& ahead_seen, int64_t ffn_dim) {
  auto* xh = reinterpret_cast<ChannelHeader*>(x_base);
  const auto* mh = reinterpret_cast<const ChannelHeader*>(ahead);
  const int64_t target = st[0] + 1;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now(), end = t0 + std::chrono::nanoseconds((int64_t)(spin_us * 1e3));
  int64_t warm_ns = 0, warmed = 0;
  while (xh->seq.load(std::memory_order_acquire) < target && clock::now() < end) {
    const int64_t seq = mh->seq.load(std::memory_order_acquire);
    if (seq == ahead_seen) {
      sched_yield();
      continue;
    }
    ahead_seen = seq;
    const int64_t layer = mh->words[0], rows = mh->words[1];
    if (layer < 0 || layer >= (int64_t)L.ffn_kind.size() || L.ffn_kind[layer] != 2 || rows < 1 || rows > 64)
      continue;
    const auto w0 = clock::now();
    warmed += warm_records(L, layer, reinterpret_cast<const bool*>(reinterpret_cast<const char*>(ahead) + CH_HEADER),
                           rows, ffn_dim, xh, target);
    warm_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - w0).count();
  }
  const int64_t before = st[1];
  const auto since = [&] { return std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count(); };
  wait_message(x_base, st, std::max(0.0, spin_us - 1e-3 * since()));  // the spin's rest, then asleep
  st[1] = before + since();  // (the warming above waited too)
  if (prof::on.load(std::memory_order_relaxed)) {
    prof::ns[prof::WARM] += warm_ns;
    prof::ns[prof::WARMED] += warmed;
  }
}

// y (contiguous float32) rounded to bf16 and back in place: y.to(kBFloat16).to(kFloat)'s values
// (nearest even) without its two copies (a head's rows: 3 MB a step at 32 rows)
static void round_bf16_(at::Tensor& y) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous(), "round_bf16_: a contiguous float32 tensor");
  active().round_bf16(y.data_ptr<float>(), y.numel());
}

// A cold executor's loop over the messages it answers without Python: decode steps of the
// layers it holds as block slices (no masks: a dense split) or neuron records (with a
// predictor's masks or without), of its attention heads, and of its rows of the output head.
// Waits for the next message on `x` (state: its reader state), answers it on `part` and waits
// again; returns the words of the first message it leaves to the caller, consumed (its payload
// is on `x`). x's payload holds the rows (rows, dim) in the model's type (bf16 or f32), followed
// at the next 64-byte boundary by, for a decode step with masks (word 4 set), the rows' masks
// (rows, ffn_dim) bool, for an attention step positions (int64), sequence starts (int64) and
// block tables (int32), each at the next 64-byte boundary (its words 4 and 5: sequences and the
// tables' width); answers are f32.
// ops: the plane's op codes (decode, head, attention, prefill; actors/plane.py). A prompt's
// rows (a prefill message) are answered here where the layer's entries allow it
// (prompt_rows_ffn, prompt_rows_attention), else left to the caller. sparse, sparse_threshold,
// sparse_stats: input sparsity in its one-row steps (set_sparse; empty: none).
static std::vector<int64_t> cold_serve(at::Tensor& state, int64_t x_base, int64_t part_base, int64_t part_capacity,
                                       int64_t dim, bool bf16, double spin_us, at::IntArrayRef ops, int64_t act,
                                       at::TensorList ffn_w1, at::TensorList ffn_w2, at::IntArrayRef ffn_kind,
                                       at::IntArrayRef ffn_n, at::IntArrayRef ffn_down_fmt, at::IntArrayRef ffn_w1_fmt,
                                       at::TensorList ffn_idx, at::ArrayRef<double> ffn_threshold, int64_t ffn_dim,
                                       at::TensorList qkv, at::IntArrayRef qkv_fmt, at::IntArrayRef qkv_n,
                                       at::TensorList qkv2, at::IntArrayRef qkv2_fmt, at::IntArrayRef qkv2_n,
                                       at::TensorList wo, at::IntArrayRef wo_fmt,
                                       at::TensorList k_cache, at::TensorList v_cache, int64_t n_heads,
                                       const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                                       int64_t window, double scale, const std::optional<at::Tensor>& head,
                                       int64_t head_fmt, int64_t head_n, int64_t ahead, at::TensorList sparse,
                                       at::ArrayRef<double> sparse_threshold,
                                       const std::optional<at::Tensor>& sparse_stats, at::TensorList qk_norms,
                                       at::TensorList layer_cos, at::TensorList layer_sin,
                                       at::IntArrayRef layer_window, double eps) {
  const Kernels& k = active();
  TORCH_CHECK(state.scalar_type() == at::kLong && state.numel() == 2 && state.is_contiguous(), "state: int64 (2,)");
  ColdLayers L = per_layer(ffn_w1, ffn_w2, ffn_kind, ffn_n, ffn_down_fmt, ffn_w1_fmt, ffn_idx, ffn_threshold,
                           qkv, qkv_fmt, qkv_n, qkv2, qkv2_fmt, qkv2_n, wo, wo_fmt, k_cache, v_cache);
  const size_t n_layers = ffn_kind.size();
  set_sparse(L, n_layers, sparse, sparse_threshold, sparse_stats);
  TORCH_CHECK(ops.size() == 4 && dim % 32 == 0, "ops: (decode, head, attention, prefill); dim a multiple of 32");
  // the layers' own variants (Gemma 3, Qwen3), as hot_layers takes them: each list empty (none)
  // or per layer, q/k norms two a layer (an empty tensor where a layer has none)
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2 * n_layers, "qk_norms: none, or q's and k's per layer");
  TORCH_CHECK(layer_cos.size() == layer_sin.size() && (layer_cos.empty() || layer_cos.size() == n_layers) &&
                  (layer_window.empty() || layer_window.size() == n_layers),
              "layer_cos, layer_sin, layer_window: none, or one a layer");
  for (int64_t kind : ffn_kind) TORCH_CHECK(kind >= 0 && kind <= 2, "a cold executor's neurons are of kind 0-2");
  auto* xh = reinterpret_cast<ChannelHeader*>(x_base);
  char* xp = reinterpret_cast<char*>(x_base) + CH_HEADER;
  char* pp = reinterpret_cast<char*>(part_base) + CH_HEADER;
  const auto rows_type = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat);
  int64_t* st = state.data_ptr<int64_t>();
  const bool warming = ahead && ffn_dim > 0 &&
                       std::any_of(ffn_kind.begin(), ffn_kind.end(), [](int64_t kind) { return kind == 2; });
  // the masks already seen: those before this call belong to steps answered
  int64_t ahead_seen = warming ? reinterpret_cast<const ChannelHeader*>(ahead)->seq.load() : 0;
  while (true) {
    const int64_t waited = st[1];
    if (warming)
      wait_warming(L, x_base, st, spin_us, ahead, ahead_seen, ffn_dim);
    else
      wait_message(x_base, st, spin_us);
    prof::Laps laps;
    if (laps.active) prof::ns[prof::WAIT_MSG] += st[1] - waited;
    const int64_t op = xh->words[0], layer = xh->words[1], B = xh->words[2], T = xh->words[3], w4 = xh->words[4],
                  w5 = xh->words[5];
    const bool in_layers = layer >= 0 && layer < (int64_t)n_layers;
    const bool decode_rows = T == 1 && B <= 64;  // else a prompt's rows: whole-row layouts only (below)
    const int64_t rows = B * T;
    auto up = [](int64_t n) { return (n + 63) / 64 * 64; };  // the payload's parts' boundaries
    at::Tensor y;
    const at::Tensor x_rows = at::from_blob(xp, {rows, dim}, rows_type);
    if (w4 && in_layers && T == 1 && op == ops[0] && ffn_kind[layer] == 2 && ffn_dim > 0) {
      // the predictor's masks after the rows (PlaneSpec.mask_offset); a decode step over
      // records, 64 rows a call (ffn_step)
      const at::Tensor m = at::from_blob(xp + up(rows * dim * (bf16 ? 2 : 4)), {rows, ffn_dim},
                                         at::TensorOptions().dtype(at::kBool));
      y = ffn_step(k, L, layer, x_rows, act, nullptr, nullptr, &m);
    } else if (!w4 && in_layers && T == 1 && (op == ops[0] || op == ops[3]) && ffn_kind[layer] == 2) {
      // every record (a one-token prompt as a decode row, as the Python set computes it)
      y = ffn_step(k, L, layer, x_rows, act);
    } else if (!w4 && in_layers && ((decode_rows && op == ops[0] && ffn_kind[layer]) ||
                                    ((op == ops[3] || op == ops[0]) && prompt_rows_ffn(L, layer)))) {
      // (a decode step of more rows than a GEMV's batch runs as a prompt's rows do)
      y = ffn_step(k, L, layer, x_rows, act);
    } else if (!w4 && in_layers && T > 1 && (op == ops[3] || op == ops[0]) && ffn_kind[layer] == 2) {
      y = ffn_step(k, L, layer, x_rows, act, nullptr, nullptr, nullptr, true);  // a prompt's rows
    } else if (op == ops[2] && in_layers && qkv[layer].numel() && (decode_rows || prompt_rows_attention(L, layer))) {
      // (PlaneSpec.attn_layout)
      const int64_t at_pos = up(rows * dim * (bf16 ? 2 : 4)), at_starts = at_pos + up(rows * 8), at_tables = at_starts + up((w4 + 1) * 8);
      const auto ints = at::TensorOptions().dtype(at::kLong);
      at::Tensor pos = at::from_blob(xp + at_pos, {rows}, ints), starts = at::from_blob(xp + at_starts, {w4 + 1}, ints);
      at::Tensor tables = at::from_blob(xp + at_tables, {w4, w5}, at::TensorOptions().dtype(at::kInt));
      const bool own_rope = !layer_cos.empty(), has_qk = !qk_norms.empty() && qk_norms[2 * layer].numel();
      const QKNorms qk{has_qk ? qk_norms[2 * layer] : pos, has_qk ? qk_norms[2 * layer + 1] : pos, eps};
      y = attention_step(k, L, layer, x_rows, pos, starts, tables, n_heads,
                         own_rope ? std::optional<at::Tensor>(layer_cos[layer]) : cos,
                         own_rope ? std::optional<at::Tensor>(layer_sin[layer]) : sin,
                         layer_window.empty() ? window : layer_window[layer], scale, has_qk ? &qk : nullptr);
    } else if ((decode_rows || head_fmt < 0) && op == ops[1] && head && head->defined()) {
      y = project(k, at::from_blob(xp, {B, dim}, rows_type), *head, head_fmt, head_n);
      if (bf16) round_bf16_(y);  // the head answers in the model's type
    } else {
      return {op, layer, B, T, w4, w5};
    }
    TORCH_CHECK((int64_t)y.nbytes() <= part_capacity, "an answer over the channel's capacity");
    std::memcpy(pp, y.contiguous().data_ptr<float>(), y.nbytes());
    const int64_t words[2] = {op == ops[1] ? -1 : layer, rows};  // (as Partial: the answer's rows)
    publish(part_base, words, 2);
    laps.lap(op == ops[2] ? prof::ANSWER_ATTN : op == ops[1] ? prof::ANSWER_HEAD : prof::ANSWER_FFN);
  }
}

// h (n values, bf16 or float32) += y (n floats) rounded to h's type, in place: h + y.to(h.dtype)
// as torch computes it, c10's roundings in the kernel's vectors (`Kernels::add_bf16`)
static void add_into(at::Tensor& h, const float* yp, int64_t n) {
  if (h.scalar_type() == at::kBFloat16) {
    active().add_bf16(reinterpret_cast<uint16_t*>(h.data_ptr<at::BFloat16>()), yp, n);
  } else {
    float* hp = h.data_ptr<float>();
    for (int64_t i = 0; i < n; i++) hp[i] += yp[i];
  }
}

#ifndef POWERINFER_LITE
// add_into as an op: h (bf16 or float32, contiguous) += y (float32, as many values) rounded to
// h's type, in place (the native loop's add into the residual, checked against torch's)
static void residual_add_(at::Tensor& h, const at::Tensor& y) {
  TORCH_CHECK(h.is_contiguous() && (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat),
              "residual_add_: h a contiguous bfloat16 or float32 tensor");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.numel() == h.numel(),
              "residual_add_: y a contiguous float32 tensor of h's size");
  add_into(h, y.data_ptr<float>(), h.numel());
}
#endif

// y (rows, dim) f32 plus each cold executor's answer on its `part` channel, in their order (as
// ch_recv reads them: states, the readers' [messages consumed, nanoseconds waited]), rounded to
// the model's type and added into the residual h (rows, dim) in place: the hot executor's
// `y = own + part_0 + ...; h = h + y.to(h.dtype)`, the same operations in the same order.
// post: the branch's own norm before it joins the residual (Gemma 3's post-norms: RMSNorm of y
// in the model's type, weight (dim,) of that type), or null.
static void join_parts(at::Tensor& h, at::Tensor& y, at::IntArrayRef part_bases, at::TensorList part_states,
                       double spin_us, const at::Tensor* post = nullptr, double eps = 0.0) {
  float* yp = y.data_ptr<float>();
  const int64_t n = y.numel();
  for (size_t k = 0; k < part_bases.size(); k++) {
    wait_message(part_bases[k], part_states[k].data_ptr<int64_t>(), spin_us);
    const float* p = reinterpret_cast<const float*>(reinterpret_cast<char*>(part_bases[k]) + CH_HEADER);
    for (int64_t i = 0; i < n; i++) yp[i] += p[i];
  }
  if (post) {  // rms_norm(y.to(h.dtype)): values of the model's type, which the rounding below keeps
    if (h.scalar_type() == at::kBFloat16) active().round_bf16(yp, n);
    rms_in_place(yp, *post, n / post->numel(), eps);
  }
  add_into(h, yp, n);
}

// The hot executor's layers of a decode step (one token a sequence; attention split by KV
// heads, or all here: a group with a predictor that keeps them whole, or a model with one KV
// head), each as its Python modules run it: the normed rows go out to the cold executors on
// `x` (attention: with positions, sequence starts and block tables), this process computes its
// own heads and neurons (the lists as cold_serve takes them; an FFN kind 0: no neurons of its
// own), then adds the executors' answers and the result into
// the residual. With no part channels (the in-process engine) nothing is sent: the lists are the
// whole model's. h (B, dim) the embedded tokens in the model's type (f32 or bf16) -> the
// residual after the last layer. norms: each layer's attention norm then FFN norm (RMSNorm, the
// model's type); ops: the plane's op codes (decode, attention, prefill). `prompt`: the rows are
// a prompt step's tokens (chunks and decode rows, `starts` telling the sequences apart), sent to
// the cold executors as the Python modules send a prompt's; every layer's own entries in
// whole-row layouts (prompt_rows_ffn, prompt_rows_attention).
// `predict` (a group with a predictor actor, decode steps only; empty: none): the channels
// [pred_in's address, its capacity, mask's address], whether the predictor reads the layer's
// input (sent before attention: lookahead) or the residual entering the FFN (sent after it), the
// layer's neurons, and whether attention is split (else this process holds every head);
// mask_state the reader state of `mask`. Each layer's predictor input goes out float32 (a
// PredictorInput), its masks (B, ffn_dim) come back (Masks), go out after the FFN's rows to the
// cold executors, and select this process's records (kind 2).
// In process, a layer's neurons may be records with their predictor (ffn kind 3: the sparse
// engine's decode step, `predicted_ffn`; pred_fc2: per layer, empty where there are none), at
// most 64 rows.
static at::Tensor hot_layers(const at::Tensor& h_in, const at::Tensor& pos, const at::Tensor& starts,
                             const at::Tensor& tables, int64_t x_base, int64_t x_capacity, at::IntArrayRef part_bases,
                             at::TensorList part_states, double spin_us, at::IntArrayRef ops, at::IntArrayRef predict,
                             const std::optional<at::Tensor>& mask_state, int64_t act,
                             at::TensorList norms, double eps, at::TensorList ffn_w1, at::TensorList ffn_w2,
                             at::IntArrayRef ffn_kind, at::IntArrayRef ffn_n, at::IntArrayRef ffn_down_fmt,
                             at::IntArrayRef ffn_w1_fmt, at::TensorList ffn_idx, at::ArrayRef<double> ffn_threshold,
                             at::TensorList qkv, at::IntArrayRef qkv_fmt,
                             at::IntArrayRef qkv_n, at::TensorList qkv2, at::IntArrayRef qkv2_fmt,
                             at::IntArrayRef qkv2_n, at::TensorList wo, at::IntArrayRef wo_fmt,
                             at::TensorList k_cache, at::TensorList v_cache, int64_t n_heads,
                             const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                             int64_t window, double scale, at::TensorList pred_fc2, double pred_threshold,
                             bool pred_layer_input, at::TensorList qk_norms, at::TensorList post_norms,
                             at::TensorList layer_cos, at::TensorList layer_sin, at::IntArrayRef layer_window,
                             bool prompt, at::TensorList sparse, at::ArrayRef<double> sparse_threshold,
                             const std::optional<at::Tensor>& sparse_stats) {
  const Kernels& k = active();
  ColdLayers L = per_layer(ffn_w1, ffn_w2, ffn_kind, ffn_n, ffn_down_fmt, ffn_w1_fmt, ffn_idx, ffn_threshold,
                           qkv, qkv_fmt, qkv_n, qkv2, qkv2_fmt, qkv2_n, wo, wo_fmt, k_cache, v_cache);
  const size_t n_layers = ffn_kind.size();
  // input sparsity: decode steps only (a prompt's rows stay dense)
  if (!prompt) set_sparse(L, n_layers, sparse, sparse_threshold, sparse_stats);
  TORCH_CHECK(norms.size() == 2 * n_layers, "two norms per layer");
  TORCH_CHECK(ops.size() == 3, "ops: (decode, attention, prefill)");
  if (prompt)
    for (size_t l = 0; l < n_layers; l++)
      TORCH_CHECK((!ffn_kind[l] || ffn_kind[l] == 2 || prompt_rows_ffn(L, l)) &&
                      (!qkv[l].numel() || prompt_rows_attention(L, l)),
                  "layer ", l, ": a prompt's rows need 16-row group layouts or neuron records");
  TORCH_CHECK(part_bases.size() == part_states.size(), "a state for each part channel");
  // the layers' own variants (Gemma 3, Qwen3), each list empty (none) or per layer: q/k norms and
  // post-norms two a layer (an empty tensor: none in that layer), RoPE tables and windows
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2 * n_layers, "qk_norms: none, or q's and k's per layer");
  TORCH_CHECK(post_norms.empty() || post_norms.size() == 2 * n_layers,
              "post_norms: none, or the attention's and the FFN's per layer");
  TORCH_CHECK(layer_cos.size() == layer_sin.size() && (layer_cos.empty() || layer_cos.size() == n_layers) &&
                  (layer_window.empty() || layer_window.size() == n_layers),
              "layer_cos, layer_sin, layer_window: none, or one a layer");
  bool predicted = false;  // a layer of neurons with their predictor (kind 3): in process only
  for (size_t l = 0; l < n_layers; l++) {
    TORCH_CHECK(ffn_kind[l] >= 0 && ffn_kind[l] <= 3, "layer ", l, ": no FFN kind ", ffn_kind[l]);
    predicted = predicted || ffn_kind[l] == 3;
  }
  TORCH_CHECK(!predicted || (part_bases.empty() && pred_fc2.size() == n_layers && h_in.size(0) <= 64),
              "predicted neurons: in process, with a second predictor matrix per layer, at most 64 rows");
  const Predicted pred{pred_fc2, pred_threshold, pred_layer_input};
  // a predictor actor's masks (see above): decode steps (64 rows a records call); a prompt's
  // step in such a group computes every neuron, as its Python modules do (no masks asked for)
  const bool masked = !predict.empty(), masked_step = masked && !prompt;
  TORCH_CHECK(!masked || (predict.size() == 6 && mask_state && mask_state->scalar_type() == at::kLong &&
                          mask_state->numel() == 2 && mask_state->is_contiguous() && !predicted),
              "predict: [pred_in, its capacity, mask, lookahead, ffn_dim, attention split] with the mask's "
              "reader state");
  for (size_t l = 0; masked && l < n_layers; l++)
    TORCH_CHECK(ffn_kind[l] != 1, "layer ", l, ": masks for neurons held as a block slice");
  for (const at::Tensor& st : part_states)
    TORCH_CHECK(st.scalar_type() == at::kLong && st.numel() == 2 && st.is_contiguous(), "states: int64 (2,)");
  TORCH_CHECK(h_in.dim() == 2 && (h_in.scalar_type() == at::kFloat || h_in.scalar_type() == at::kBFloat16),
              "h: (B, dim) float32 or bfloat16");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.numel() == h_in.size(0), "pos: (B,) int64, one token a row");
  TORCH_CHECK(starts.scalar_type() == at::kLong && tables.scalar_type() == at::kInt && tables.dim() == 2,
              "starts: int64; tables: (S, M) int32");
  const bool exchange = !part_bases.empty();  // none: the whole model in this process
  // attention split by KV heads over the executors, or kept here: a group with a predictor
  // says which in `predict`, one without by its attention op (ops[1] < 0: every head here, as
  // a model with one KV head keeps them)
  const bool split_attention = exchange && (masked ? predict[5] != 0 : ops[1] >= 0);
  const at::IntArrayRef attn_bases = split_attention ? part_bases : at::IntArrayRef();  // whose answers to add
  const at::TensorList attn_states = split_attention ? part_states : at::TensorList();
  at::Tensor h = h_in.contiguous().clone();
  const std::vector<int64_t> attn_words = {tables.size(0), tables.size(1)}, none, with_masks = {1};
  // a prompt's rows go out as the Python modules send them, (1, rows, dim), its FFN's as a prefill
  const int64_t rows = h.size(0), dim = h.size(1);
  auto sent = [&](const at::Tensor& x) { return prompt ? x.view({1, rows, dim}) : x; };
  // the predictor's input, float32, and its answer: the masks (rows, ffn_dim) on `mask`
  auto to_predictor = [&](int64_t layer) {
    send_message({h.to(at::kFloat)}, predict[0], predict[1], ops[0], layer, none);
  };
  auto masks_of = [&](int64_t layer) {
    wait_message(predict[2], mask_state->data_ptr<int64_t>(), spin_us);
    const auto* mh = reinterpret_cast<const ChannelHeader*>(predict[2]);
    TORCH_CHECK(mh->words[0] == layer && mh->words[1] == rows, "the predictor answered layer ", mh->words[0],
                " for ", mh->words[1], " rows where layer ", layer, " with ", rows, " was due");
    return at::from_blob(reinterpret_cast<char*>(predict[2]) + CH_HEADER, {rows, predict[4]},
                         at::TensorOptions().dtype(at::kBool));
  };
  prof::Laps laps;
  if (laps.active) prof::ns[prof::CALLS] += 1;
  for (size_t l = 0; l < n_layers; l++) {
    const int64_t layer = (int64_t)l;
    if (masked_step && predict[3]) to_predictor(layer);  // lookahead: the layer's input, before attention
    laps.lap(prof::PREDICT);
    // the predictor's input: the layer's, as it was before the attention's sum, or (h itself,
    // which that sum updates in place) the residual entering the FFN
    const at::Tensor layer_in = ffn_kind[l] == 3 && pred_layer_input ? h.clone() : h;
    at::Tensor x = rms_norm(h, norms[2 * l], eps);
    laps.lap(prof::NORM);
    if (split_attention) send_message({sent(x), pos, starts, tables}, x_base, x_capacity, ops[1], layer, attn_words);
    laps.lap(prof::SEND);
    const bool own_rope = !layer_cos.empty();
    const std::optional<at::Tensor> lcos = own_rope ? std::optional<at::Tensor>(layer_cos[l]) : cos;
    const std::optional<at::Tensor> lsin = own_rope ? std::optional<at::Tensor>(layer_sin[l]) : sin;
    const bool has_qk = !qk_norms.empty() && qk_norms[2 * l].numel();
    const QKNorms qk{has_qk ? qk_norms[2 * l] : h, has_qk ? qk_norms[2 * l + 1] : h, eps};
    at::Tensor y = attention_step(k, L, layer, x, pos, starts, tables, n_heads, lcos, lsin,
                                  layer_window.empty() ? window : layer_window[l], scale, has_qk ? &qk : nullptr);
    laps.skip();  // (its own laps)
    int64_t w0 = laps.active ? prof::waited(attn_states) : 0;
    auto post = [&](int i) -> const at::Tensor* {
      return !post_norms.empty() && post_norms[2 * l + i].numel() ? &post_norms[2 * l + i] : nullptr;
    };
    join_parts(h, y, attn_bases, attn_states, spin_us, post(0), eps);
    laps.join(prof::WAIT_ATTN, prof::ADD_ATTN, laps.active ? prof::waited(attn_states) - w0 : 0);
    x = rms_norm(h, norms[2 * l + 1], eps);
    laps.lap(prof::NORM);
    if (masked_step) {
      if (!predict[3]) to_predictor(layer);  // the residual entering the FFN
      const at::Tensor mask = masks_of(layer);  // (valid until the next PredictorInput)
      laps.lap(prof::PREDICT);
      send_message({x, mask}, x_base, x_capacity, ops[0], layer, with_masks);
      laps.lap(prof::SEND);
      y = ffn_kind[l] ? ffn_step(k, L, layer, x, act, nullptr, nullptr, &mask).contiguous()
                      : at::zeros(x.sizes(), x.options().dtype(at::kFloat));
    } else {
      if (exchange) send_message({sent(x)}, x_base, x_capacity, prompt ? ops[2] : ops[0], layer, none);
      laps.lap(prof::SEND);
      y = ffn_kind[l] ? ffn_step(k, L, layer, x, act, &pred, &layer_in, nullptr, prompt).contiguous()
                      : at::zeros(x.sizes(), x.options().dtype(at::kFloat));
    }
    laps.lap(prof::FFN);
    w0 = laps.active ? prof::waited(part_states) : 0;
    join_parts(h, y, part_bases, part_states, spin_us, post(1), eps);
    laps.join(prof::WAIT_FFN, prof::ADD_FFN, laps.active ? prof::waited(part_states) - w0 : 0);
  }
  return h;
}

// A hot executor's whole step without torch (`actors/hot_native.py`): the tokens' embeddings,
// `hot_layers`, the final norm of the rows whose logits are wanted (`last`, flat indices of the
// N tokens) and the output head, the logits written into `out` (K, vocab) float32 (the `out`
// channel's payload), as the torch executor's `NativeDecode` and `RemoteHead` compute them.
// embed: the embedding's rows, in a kernel format (embed_fmt >= 0: the file's blocks, widened
// to float32 then rounded to the model's type, as `KernelEmbedding`) or in the model's type
// (embed_fmt < 0), then scaled by embed_scale where it is not 0. head: this process's rows of the head (head_n of them, in `project`'s
// formats); head_widths: the other executors' shares of the vocabulary after them, in order
// (empty: the head is all here), each computed from the rows sent on `x` as a `head_op`
// message. `layers`: hot_layers over the embedded rows, with the step's positions, sequences
// and block tables.
// Rows idx[0..n) of a matrix of `row_bytes`-byte rows at src, one after another into dst.
static void gather_rows(const void* src, int64_t row_bytes, const int64_t* idx, int64_t n, void* dst) {
  for (int64_t i = 0; i < n; i++)
    std::memcpy(static_cast<char*>(dst) + i * row_bytes, static_cast<const char*>(src) + idx[i] * row_bytes,
                (size_t)row_bytes);
}

static void hot_step(const at::Tensor& tokens, const at::Tensor& last, at::Tensor& out,
                     const at::Tensor& embed, int64_t embed_fmt, double embed_scale, bool bf16,
                     const at::Tensor& final_norm,
                     double eps, const at::Tensor& head, int64_t head_fmt, int64_t head_n, int64_t head_op,
                     at::IntArrayRef head_widths, int64_t x_base, int64_t x_capacity, at::IntArrayRef part_bases,
                     at::TensorList part_states, double spin_us,
                     const std::function<at::Tensor(const at::Tensor&)>& layers) {
  const Kernels& k = active();
  const int64_t N = tokens.numel(), K = last.numel(), dim = final_norm.numel(), vocab = embed.size(0);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && last.scalar_type() == at::kLong &&
                  last.is_contiguous(), "tokens, last: contiguous int64");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == K,
              "out: (K, vocab) float32");
  const auto type = bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(final_norm.scalar_type() == type, "final_norm: of the model's type");
  const int64_t* tk = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; i++) TORCH_CHECK(tk[i] >= 0 && tk[i] < vocab, "token ", tk[i], " not below ", vocab);
  TORCH_CHECK(embed.is_contiguous() && (embed_fmt >= 0 || (embed.scalar_type() == type && embed.size(1) == dim)),
              "embed: contiguous rows in a kernel format, or (vocab, dim) of the model's type");
  const int64_t embed_bytes = embed.size(1) * embed.element_size();
  at::Tensor h;
  if (embed_fmt >= 0) {
    at::Tensor rows = at::empty({N, embed_bytes}, at::TensorOptions().dtype(at::kByte));
    gather_rows(embed.data_ptr(), embed_bytes, tk, N, rows.data_ptr());
    at::Tensor wide = at::empty({N, 1, dim}, at::TensorOptions().dtype(at::kFloat));
    widen_out(rows, embed_fmt, 1, dim, wide);
    h = wide.view({N, dim}).to(type);
  } else {
    h = at::empty({N, dim}, at::TensorOptions().dtype(type));
    gather_rows(embed.data_ptr(), embed_bytes, tk, N, h.data_ptr());
  }
  if (embed_scale != 0.0) {  // (Gemma's) in the activations' type, the scale rounded to it first
    if (bf16) {
      auto* hp = h.data_ptr<at::BFloat16>();
      const float s = round_to_bf16((float)embed_scale);
      for (int64_t i = 0; i < N * dim; i++) hp[i] = at::BFloat16((float)hp[i] * s);
    } else {
      float* hp = h.data_ptr<float>();
      const float s = (float)embed_scale;
      for (int64_t i = 0; i < N * dim; i++) hp[i] *= s;
    }
  }
  at::Tensor y = layers(h);  // (N, dim) of the model's type
  if (K == 0) return;
  at::Tensor picked = at::empty({K, dim}, at::TensorOptions().dtype(type));
  const int64_t* lp = last.data_ptr<int64_t>();
  for (int64_t i = 0; i < K; i++) TORCH_CHECK(lp[i] >= 0 && lp[i] < N, "last: row ", lp[i], " not below ", N);
  gather_rows(y.contiguous().data_ptr(), dim * picked.element_size(), lp, K, picked.data_ptr());
  const at::Tensor x = rms_norm(picked, final_norm, eps);
  int64_t width = head_n;
  for (int64_t w : head_widths) width += w;
  TORCH_CHECK(out.size(1) == width, "out: ", out.size(1), " columns where the head has ", width);
  TORCH_CHECK(head_widths.empty() || head_widths.size() == part_bases.size(), "a head width for each executor");
  if (!head_widths.empty()) send_message({x}, x_base, x_capacity, head_op, -1, {});
  // (K, head_n) float32; this share in the model's type, as the torch head module returns it
  // (the other executors' shares come as they sent them, float32)
  const at::Tensor own = project(k, x, head, head_fmt, head_n);
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < K; r++) {
    const float* src = own.data_ptr<float>() + r * head_n;
    float* dst = o + r * width;
    for (int64_t j = 0; j < head_n; j++) dst[j] = bf16 ? round_to_bf16(src[j]) : src[j];
  }
  int64_t lo = head_n;
  for (size_t j = 0; j < head_widths.size(); j++) {
    wait_message(part_bases[j], part_states[j].data_ptr<int64_t>(), spin_us);
    const float* p = reinterpret_cast<const float*>(reinterpret_cast<char*>(part_bases[j]) + CH_HEADER);
    for (int64_t r = 0; r < K; r++) std::memcpy(o + r * width + lo, p + r * head_widths[j], head_widths[j] * 4);
    lo += head_widths[j];
  }
}

// The predictor actor's loop: each decode message on `pred_in` (its input rows (B, dim) float32,
// a PredictorInput: op, layer, B) answered on `mask` with the rows' predicted neurons, as
// `predictor.Predictors.active` computes them on the kernel's GEMV (relu(p fc1^T) fc2^T >=
// threshold, fc1/fc2 rows in `fmt`), (B, ffn_dim) bool, and a Masks message (layer, B). state:
// its reader state of `pred_in`; counts: int64 [messages answered, nanoseconds spent on them],
// added to as it goes (read by another thread for stats); returns the words of the first
// message it leaves to the caller (any other op: STOP), consumed. Steps of any number of rows.
static std::vector<int64_t> pred_serve(at::Tensor& state, at::Tensor& counts, int64_t in_base, int64_t mask_base,
                                       int64_t mask_capacity, int64_t dim, double spin_us, int64_t decode_op,
                                       at::TensorList fc1, at::TensorList fc2, int64_t fmt, double threshold) {
  TORCH_CHECK(state.scalar_type() == at::kLong && state.numel() == 2 && state.is_contiguous(), "state: int64 (2,)");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.numel() == 2 && counts.is_contiguous(), "counts: int64 (2,)");
  TORCH_CHECK(fc1.size() == fc2.size() && !fc1.empty(), "fc1, fc2: one matrix each per layer");
  auto* xh = reinterpret_cast<ChannelHeader*>(in_base);
  char* xp = reinterpret_cast<char*>(in_base) + CH_HEADER;
  int64_t *st = state.data_ptr<int64_t>(), *ct = counts.data_ptr<int64_t>();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  using clock = std::chrono::steady_clock;
  while (true) {
    wait_message(in_base, st, spin_us);
    const auto t0 = clock::now();
    const int64_t op = xh->words[0], layer = xh->words[1], B = xh->words[2];
    if (op != decode_op || layer < 0 || layer >= (int64_t)fc1.size() || B < 1) return {op, layer, B};
    // 64 rows a call (the GEMV's most), as `Predictors.logits` runs them: a row's masks do not
    // depend on its batch
    int64_t put = 0;  // (bytes of masks written)
    for (int64_t r = 0; r < B; r += 64) {
      const int64_t n = std::min<int64_t>(64, B - r);
      const at::Tensor rows =
          predicted_rows(at::from_blob(xp + r * dim * 4, {n, dim}, f32), fc1[layer], fc2[layer], fmt, threshold);
      TORCH_CHECK(put + (int64_t)rows.nbytes() <= mask_capacity, "masks over the channel's capacity");
      std::memcpy(reinterpret_cast<char*>(mask_base) + CH_HEADER + put, rows.data_ptr<bool>(), rows.nbytes());
      put += rows.nbytes();
    }
    const int64_t words[2] = {layer, B};  // (as Masks)
    publish(mask_base, words, 2);
    ct[0] += 1;
    ct[1] += std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count();
  }
}

}  // namespace powerinfer

#ifndef POWERINFER_LITE
TORCH_LIBRARY(powerinfer, m) {
  m.def("neuron_ffn(Tensor x, Tensor w, Tensor sel, Tensor? keep, Tensor? bias, float threshold, int act, int fmt) -> Tensor");
  m.def("records_rows(Tensor x, Tensor w, Tensor? bias, float threshold, int act, int fmt) -> Tensor");
  m.def("rows_amx", &powerinfer::rows_amx);
  m.def("prefetch_level", &powerinfer::prefetch_level_op);
  m.def("far_prefetch", &powerinfer::far_prefetch_op);
  m.def("widen(Tensor w, int fmt, int rows, int dim) -> Tensor");
  m.def("widen_out(Tensor w, int fmt, int rows, int dim, Tensor(a!) out) -> ()");
  m.def("linear(Tensor x, Tensor w, int fmt) -> Tensor");
  m.def("predicted_ffn(Tensor x, Tensor p, Tensor fc1, Tensor fc2, int pred_fmt, float pred_threshold, Tensor w, "
        "Tensor? bias, float threshold, int act, int fmt) -> Tensor");
  m.def("masked_records(Tensor x, Tensor w, Tensor idx, Tensor mask, Tensor? bias, float threshold, int act, "
        "int fmt) -> Tensor");
  m.def("linear_x16(Tensor x, Tensor w, int n, int layout) -> Tensor");
  m.def("pred_logits(Tensor p, Tensor fc1, Tensor fc2, int fmt) -> Tensor");
  m.def("linear_q4c(Tensor x, Tensor w, int n, int kind, float threshold, Tensor(a!)? stats) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("residual_add_(Tensor(a!) h, Tensor y) -> ()");
  m.def("qk_norm(Tensor qkv, Tensor qw, Tensor kw, int n_heads, int n_kv, float eps) -> Tensor");
  m.def("paged_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor tables, "
        "Tensor starts, Tensor pos, int n_heads, int window, float scale) -> Tensor");
  m.def("ch_send(Tensor[] parts, int base, int capacity, int op, int layer, SymInt[] extra) -> Tensor");
  m.def("ch_recv(Tensor like, Tensor(a!) state, int base, int width, float spin_us) -> Tensor");
  m.def("ch_slot(int slot, int base) -> ()", &powerinfer::ch_slot);  // no tensor: every backend
  m.def("cold_serve(Tensor(a!) state, int x_base, int part_base, int part_capacity, int dim, bool bf16, "
        "float spin_us, int[] ops, int act, Tensor[] ffn_w1, Tensor[] ffn_w2, int[] ffn_kind, int[] ffn_n, int[] ffn_down_fmt, int[] ffn_w1_fmt, "
        "Tensor[] ffn_idx, float[] ffn_threshold, int ffn_dim, "
        "Tensor[] qkv, int[] qkv_fmt, int[] qkv_n, Tensor[] qkv2, int[] qkv2_fmt, int[] qkv2_n, Tensor[] wo, int[] wo_fmt, Tensor[] k_cache, Tensor[] v_cache, "
        "int n_heads, Tensor? cos, Tensor? sin, int window, float scale, Tensor? head, int head_fmt, int head_n, "
        "int ahead, Tensor[] sparse, float[] sparse_threshold, Tensor(a!)? sparse_stats, Tensor[] qk_norms, "
        "Tensor[] layer_cos, Tensor[] layer_sin, int[] layer_window, float eps) -> int[]");
  m.def("hot_layers(Tensor h, Tensor pos, Tensor starts, Tensor tables, int x_base, int x_capacity, "
        "int[] part_bases, Tensor[] part_states, float spin_us, int[] ops, int[] predict, Tensor? mask_state, "
        "int act, Tensor[] norms, float eps, "
        "Tensor[] ffn_w1, Tensor[] ffn_w2, int[] ffn_kind, int[] ffn_n, int[] ffn_down_fmt, int[] ffn_w1_fmt, "
        "Tensor[] ffn_idx, float[] ffn_threshold, "
        "Tensor[] qkv, int[] qkv_fmt, int[] qkv_n, Tensor[] qkv2, int[] qkv2_fmt, int[] qkv2_n, Tensor[] wo, "
        "int[] wo_fmt, Tensor[] k_cache, Tensor[] v_cache, int n_heads, Tensor? cos, Tensor? sin, int window, "
        "float scale, Tensor[] pred_fc2, float pred_threshold, bool pred_layer_input, "
        "Tensor[] qk_norms, Tensor[] post_norms, Tensor[] layer_cos, Tensor[] layer_sin, int[] layer_window, "
        "bool prompt, Tensor[] sparse, float[] sparse_threshold, Tensor(a!)? sparse_stats) -> Tensor");
  m.def("pred_serve(Tensor(a!) state, Tensor(b!) counts, int in_base, int mask_base, int mask_capacity, int dim, "
        "float spin_us, int decode_op, Tensor[] fc1, Tensor[] fc2, int fmt, float threshold) -> int[]");
  m.def("loop_profile", &powerinfer::loop_profile);
  m.def("isa", &powerinfer::isa);
  m.def("use_isa", &powerinfer::use_isa);
  m.def("q4c_walk", &powerinfer::q4c_walk);
  m.def("best_isa", &powerinfer::best_isa);
}

TORCH_LIBRARY_IMPL(powerinfer, CPU, m) {
  m.impl("neuron_ffn", powerinfer::neuron_ffn);
  m.impl("records_rows", powerinfer::records_rows);
  m.impl("widen", powerinfer::widen);
  m.impl("widen_out", powerinfer::widen_out);
  m.impl("linear", powerinfer::linear);
  m.impl("predicted_ffn", powerinfer::predicted_ffn);
  m.impl("masked_records", powerinfer::masked_records);
  m.impl("linear_x16", powerinfer::linear_x16);
  m.impl("pred_logits", powerinfer::pred_logits);
  m.impl("linear_q4c", powerinfer::linear_q4c);
  m.impl("rms_norm", powerinfer::rms_norm);
  m.impl("residual_add_", powerinfer::residual_add_);
  m.impl("qk_norm", powerinfer::qk_norm);
  m.impl("paged_attention", powerinfer::paged_attention);
  m.impl("ch_send", powerinfer::ch_send);
  m.impl("ch_recv", powerinfer::ch_recv);
  m.impl("cold_serve", powerinfer::cold_serve);
  m.impl("hot_layers", powerinfer::hot_layers);
  m.impl("pred_serve", powerinfer::pred_serve);
}
#endif  // POWERINFER_LITE

#include "capi.h"
