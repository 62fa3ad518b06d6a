// The library's C entry points, for a process that loads it with ctypes rather than through
// torch (`actors/cold_native.py`, `actors/pred_native.py`): a cold executor or predictor whose
// every message the native loop answers never imports torch, and loads the library's torch-free
// build (POWERINFER_LITE, lite.h), which maps no libtorch either. The ops are the same functions
// the torch operators run; only their arguments come as a flat array of tagged values (PiArg)
// instead of torch's boxed ones. Included at the end of ops.cpp (the same translation unit: the
// ops stay static), in both builds.

namespace powerinfer {

// One argument: an int or bool, a float, a tensor (its data, dtype, shape and strides in
// elements), no tensor (an optional one left out), or a list of tensors, ints or floats.
enum PiKind : int64_t { PI_INT = 0, PI_FLOAT, PI_TENSOR, PI_NONE, PI_TENSORS, PI_INTS, PI_FLOATS };

struct PiArg {
  int64_t kind;
  int64_t i;    // the int or bool; a list's length; a tensor's dtype (PI_DTYPES' index)
  double f;     // the float
  void* data;   // a tensor's first element; a list's items (PiArg, int64_t or double)
  int64_t ndim;
  int64_t shape[4];
  int64_t strides[4];
};

static const at::ScalarType PI_DTYPES[] = {at::kByte, at::kChar, at::kShort, at::kInt,  at::kLong,
                                           at::kHalf, at::kBFloat16, at::kFloat, at::kBool};

// Reads the arguments in order, each checked against the kind its parameter takes; the tensor
// lists it builds live as long as it does (the call's).
class PiArgs {
 public:
  PiArgs(const PiArg* args, int64_t n) : args_(args), n_(n) {}

  int64_t integer() { return take(PI_INT, "an int").i; }
  bool boolean() { return take(PI_INT, "a bool").i != 0; }
  double real() {
    const PiArg& a = take(-1, "a float");
    TORCH_CHECK(a.kind == PI_FLOAT || a.kind == PI_INT, where(), ": a float expected");
    return a.kind == PI_FLOAT ? a.f : (double)a.i;
  }
  at::Tensor tensor() { return of(take(PI_TENSOR, "a tensor")); }
  std::optional<at::Tensor> optional() {
    const PiArg& a = take(-1, "a tensor or none");
    TORCH_CHECK(a.kind == PI_TENSOR || a.kind == PI_NONE, where(), ": a tensor or none expected");
    if (a.kind == PI_NONE) return std::nullopt;
    return of(a);
  }
  at::TensorList tensors() {
    const PiArg& a = list(PI_TENSORS, "a list of tensors");
    lists_.emplace_back();
    auto& out = lists_.back();
    const auto* items = static_cast<const PiArg*>(a.data);
    for (int64_t j = 0; j < a.i; j++) {
      TORCH_CHECK(items[j].kind == PI_TENSOR, where(), ": item ", j, " is not a tensor");
      out.push_back(of(items[j]));
    }
    return out;
  }
  at::IntArrayRef ints() {
    const PiArg& a = list(PI_INTS, "a list of ints");
    return at::IntArrayRef(static_cast<const int64_t*>(a.data), (size_t)a.i);
  }
  at::ArrayRef<double> reals() {
    const PiArg& a = list(PI_FLOATS, "a list of floats");
    return at::ArrayRef<double>(static_cast<const double*>(a.data), (size_t)a.i);
  }
  void done() const { TORCH_CHECK(at_ == n_, n_, " arguments given, ", at_, " taken"); }

 private:
  const PiArg& take(int64_t kind, const char* what) {
    TORCH_CHECK(at_ < n_, "argument ", at_, ": ", what, " expected, the arguments ended");
    const PiArg& a = args_[at_++];
    TORCH_CHECK(kind < 0 || a.kind == kind, where(), ": ", what, " expected (kind ", a.kind, ")");
    return a;
  }
  const PiArg& list(int64_t kind, const char* what) {  // (an empty list is any list)
    const PiArg& a = take(-1, what);
    TORCH_CHECK(a.kind == kind || (a.i == 0 && (a.kind == PI_TENSORS || a.kind == PI_INTS || a.kind == PI_FLOATS)),
                where(), ": ", what, " expected (kind ", a.kind, ")");
    TORCH_CHECK(a.i == 0 || a.data, where(), ": a list without items");
    return a;
  }
  std::string where() const { return "argument " + std::to_string(at_ - 1); }
  at::Tensor of(const PiArg& a) {
    TORCH_CHECK(a.i >= 0 && a.i < (int64_t)(sizeof PI_DTYPES / sizeof PI_DTYPES[0]), where(), ": dtype code ", a.i);
    TORCH_CHECK(a.ndim >= 0 && a.ndim <= 4, where(), ": up to 4 dimensions");
    const auto opts = at::TensorOptions().dtype(PI_DTYPES[a.i]);
    std::vector<int64_t> shape(a.shape, a.shape + a.ndim), strides(a.strides, a.strides + a.ndim);
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    if (numel == 0) return at::empty(shape, opts);
    TORCH_CHECK(a.data, where(), ": a tensor without data");
    return at::from_blob(a.data, shape, strides, opts);
  }

  const PiArg* args_;
  int64_t n_, at_ = 0;
  std::deque<std::vector<at::Tensor>> lists_;  // (a deque: the lists handed out stay where they are)
};

// The per-layer lists of the FFN's entries (`native.ffn_entry`'s columns) and of attention's
// (`native.attention_entry`'s, then the heads, RoPE tables, window and scale), in the order
// cold_serve and hot_layers both take them.
struct PiFfn {
  at::TensorList w1, w2;
  at::IntArrayRef kind, n, down_fmt, w1_fmt;
  at::TensorList idx;
  at::ArrayRef<double> threshold;
  static PiFfn read(PiArgs& a) {
    PiFfn f;
    f.w1 = a.tensors(), f.w2 = a.tensors();
    f.kind = a.ints(), f.n = a.ints(), f.down_fmt = a.ints(), f.w1_fmt = a.ints();
    f.idx = a.tensors();
    f.threshold = a.reals();
    return f;
  }
};

struct PiAttn {
  at::TensorList qkv;
  at::IntArrayRef qkv_fmt, qkv_n;
  at::TensorList qkv2;
  at::IntArrayRef qkv2_fmt, qkv2_n;
  at::TensorList wo;
  at::IntArrayRef wo_fmt;
  at::TensorList k_cache, v_cache;
  int64_t n_heads = 0;
  std::optional<at::Tensor> cos, sin;
  int64_t window = 0;
  double scale = 1.0;
  static PiAttn read(PiArgs& a) {
    PiAttn t;
    t.qkv = a.tensors();
    t.qkv_fmt = a.ints(), t.qkv_n = a.ints();
    t.qkv2 = a.tensors();
    t.qkv2_fmt = a.ints(), t.qkv2_n = a.ints();
    t.wo = a.tensors();
    t.wo_fmt = a.ints();
    t.k_cache = a.tensors(), t.v_cache = a.tensors();
    t.n_heads = a.integer();
    t.cos = a.optional(), t.sin = a.optional();
    t.window = a.integer();
    t.scale = a.real();
    return t;
  }
};

static void pi_error(const std::exception& e, char* err, int64_t len) {
  const auto* c10e = dynamic_cast<const c10::Error*>(&e);
  const char* text = c10e ? c10e->what_without_backtrace() : e.what();
  if (err && len > 0) {
    std::strncpy(err, text, (size_t)len - 1);
    err[len - 1] = 0;
  }
}

static void pi_text(const std::string& s, char* out, int64_t len) {
  if (out && len > 0) {
    std::strncpy(out, s.c_str(), (size_t)len - 1);
    out[len - 1] = 0;
  }
}

}  // namespace powerinfer

extern "C" {

// cold_serve with its arguments as the torch operator takes them, in order; the words of the
// message it leaves to the caller into words (6). Returns 0, or 1 with the error's text in err.
int64_t pi_cold_serve(const powerinfer::PiArg* args, int64_t n, int64_t* words, char* err, int64_t err_len) {
  using namespace powerinfer;
  try {
    PiArgs a(args, n);
    at::Tensor state = a.tensor();
    const int64_t x_base = a.integer(), part_base = a.integer(), part_capacity = a.integer(), dim = a.integer();
    const bool bf16 = a.boolean();
    const double spin_us = a.real();
    const at::IntArrayRef ops = a.ints();
    const int64_t act = a.integer();
    const PiFfn f = PiFfn::read(a);
    const int64_t ffn_dim = a.integer();
    const PiAttn t = PiAttn::read(a);
    const std::optional<at::Tensor> head = a.optional();
    const int64_t head_fmt = a.integer(), head_n = a.integer(), ahead = a.integer();
    const at::TensorList sparse = a.tensors();
    const at::ArrayRef<double> sparse_threshold = a.reals();
    const std::optional<at::Tensor> sparse_stats = a.optional();
    const at::TensorList qk_norms = a.tensors(), layer_cos = a.tensors(), layer_sin = a.tensors();
    const at::IntArrayRef layer_window = a.ints();
    const double eps = a.real();
    a.done();
    const std::vector<int64_t> out =
        cold_serve(state, x_base, part_base, part_capacity, dim, bf16, spin_us, ops, act, f.w1, f.w2, f.kind, f.n,
                   f.down_fmt, f.w1_fmt, f.idx, f.threshold, ffn_dim, t.qkv, t.qkv_fmt, t.qkv_n, t.qkv2, t.qkv2_fmt,
                   t.qkv2_n, t.wo, t.wo_fmt, t.k_cache, t.v_cache, t.n_heads, t.cos, t.sin, t.window, t.scale, head, head_fmt,
                   head_n, ahead, sparse, sparse_threshold, sparse_stats, qk_norms, layer_cos, layer_sin,
                   layer_window, eps);
    std::copy(out.begin(), out.end(), words);
    return 0;
  } catch (const std::exception& e) {
    pi_error(e, err, err_len);
    return 1;
  }
}

// pred_serve likewise (the predictor actor's loop, `actors/pred_native.py`): the words of the
// message it leaves to the caller into words (3). Returns 0, or 1 with the error's text in err.
int64_t pi_pred_serve(const powerinfer::PiArg* args, int64_t n, int64_t* words, char* err, int64_t err_len) {
  using namespace powerinfer;
  try {
    PiArgs a(args, n);
    at::Tensor state = a.tensor(), counts = a.tensor();
    const int64_t in_base = a.integer(), mask_base = a.integer(), mask_capacity = a.integer(), dim = a.integer();
    const double spin_us = a.real();
    const int64_t decode_op = a.integer();
    const at::TensorList fc1 = a.tensors(), fc2 = a.tensors();
    const int64_t fmt = a.integer();
    const double threshold = a.real();
    a.done();
    const std::vector<int64_t> out =
        pred_serve(state, counts, in_base, mask_base, mask_capacity, dim, spin_us, decode_op, fc1, fc2, fmt, threshold);
    std::copy(out.begin(), out.end(), words);
    return 0;
  } catch (const std::exception& e) {
    pi_error(e, err, err_len);
    return 1;
  }
}

// hot_step (the hot executor's whole step, `actors/hot_native.py`): the step's tensors, the
// embedding and head's, then hot_layers' arguments from x_base to layer_window and its
// input-sparsity ones, in order. Returns 0, or 1 with the error's text in err.
int64_t pi_hot_step(const powerinfer::PiArg* args, int64_t n, char* err, int64_t err_len) {
  using namespace powerinfer;
  try {
    PiArgs a(args, n);
    const at::Tensor tokens = a.tensor(), pos = a.tensor(), starts = a.tensor(), tables = a.tensor(),
                     last = a.tensor();
    const bool prompt = a.boolean();
    at::Tensor out = a.tensor();
    const at::Tensor embed = a.tensor();
    const int64_t embed_fmt = a.integer();
    const double embed_scale = a.real();
    const bool bf16 = a.boolean();
    const at::Tensor final_norm = a.tensor();
    const double final_eps = a.real();
    const at::Tensor head = a.tensor();
    const int64_t head_fmt = a.integer(), head_n = a.integer(), head_op = a.integer();
    const at::IntArrayRef head_widths = a.ints();
    const int64_t x_base = a.integer(), x_capacity = a.integer();
    const at::IntArrayRef part_bases = a.ints();
    const at::TensorList part_states = a.tensors();
    const double spin_us = a.real();
    const at::IntArrayRef ops = a.ints(), predict = a.ints();
    const std::optional<at::Tensor> mask_state = a.optional();
    const int64_t act = a.integer();
    const at::TensorList norms = a.tensors();
    const double eps = a.real();
    const PiFfn f = PiFfn::read(a);
    const PiAttn t = PiAttn::read(a);
    const at::TensorList pred_fc2 = a.tensors();
    const double pred_threshold = a.real();
    const bool pred_layer_input = a.boolean();
    const at::TensorList qk_norms = a.tensors(), post_norms = a.tensors(), layer_cos = a.tensors(),
                         layer_sin = a.tensors();
    const at::IntArrayRef layer_window = a.ints();
    const at::TensorList sparse = a.tensors();
    const at::ArrayRef<double> sparse_threshold = a.reals();
    const std::optional<at::Tensor> sparse_stats = a.optional();
    a.done();
    hot_step(tokens, last, out, embed, embed_fmt, embed_scale, bf16, final_norm, final_eps, head,
             head_fmt, head_n, head_op, head_widths, x_base, x_capacity, part_bases, part_states, spin_us,
             [&](const at::Tensor& h) {
               return hot_layers(h, pos, starts, tables, x_base, x_capacity, part_bases, part_states, spin_us, ops,
                                 predict, mask_state, act, norms, eps, f.w1, f.w2, f.kind, f.n, f.down_fmt, f.w1_fmt,
                                 f.idx, f.threshold, t.qkv, t.qkv_fmt, t.qkv_n, t.qkv2, t.qkv2_fmt, t.qkv2_n, t.wo,
                                 t.wo_fmt, t.k_cache, t.v_cache, t.n_heads, t.cos, t.sin, t.window, t.scale, pred_fc2,
                                 pred_threshold,
                                 pred_layer_input, qk_norms, post_norms, layer_cos, layer_sin, layer_window, prompt,
                                 sparse, sparse_threshold, sparse_stats);
             });
    return 0;
  } catch (const std::exception& e) {
    pi_error(e, err, err_len);
    return 1;
  }
}

// The instruction-set class in use, the best this CPU has ("none": the kernel cannot run here).
void pi_isa(char* out, int64_t len) { powerinfer::pi_text(powerinfer::isa(), out, len); }
void pi_best_isa(char* out, int64_t len) { powerinfer::pi_text(powerinfer::best_isa(), out, len); }

// Run at class `want` from now on (use_isa); 0, or 1 with the error's text in err.
int64_t pi_use_isa(const char* want, char* err, int64_t err_len) {
  try {
    powerinfer::use_isa(want);
    return 0;
  } catch (const std::exception& e) {
    powerinfer::pi_error(e, err, err_len);
    return 1;
  }
}

// The calling thread's parallel loops run on n threads (at::set_num_threads: OpenMP's, per thread).
void pi_set_threads(int64_t n) { at::set_num_threads((int)n); }

// The kept blocks of the torch-free build (`pilite::BlockCache`): mode 0 reads its figures into
// out (4: bytes kept, the cap, blocks taken from it, blocks it had none for), 1 frees the kept
// blocks, 2 sets the cap to out[0] bytes; returns the bytes kept before the call. The torch
// build keeps none (its tensors are torch's): 0, and out zeros.
int64_t pi_blocks(int64_t mode, int64_t* out) {
#ifdef POWERINFER_LITE
  auto& c = pilite::BlockCache::instance();
  int64_t now[4];
  c.stats(now);
  if (mode == 0) std::copy(now, now + 4, out);
  if (mode == 1) c.release();
  if (mode == 2) c.set_cap((size_t)std::max<int64_t>(out[0], 0));
  return now[0];
#else
  if (mode == 0) std::fill(out, out + 4, 0);
  return 0;
#endif
}

// loop_profile's totals into out (up to len); returns how many there are.
int64_t pi_loop_profile(int64_t mode, int64_t* out, int64_t len) {
  const at::Tensor t = powerinfer::loop_profile(mode);
  const int64_t n = t.numel();
  std::copy(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + std::min(n, len), out);
  return n;
}

}  // extern "C"
