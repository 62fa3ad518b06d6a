// The parts of ATen the library's ops use, for a build without torch (POWERINFER_LITE): host
// tensors with a shape, strides and one of nine element types, the few functions that make and
// convert them, and parallel_for over OpenMP as ATen's own (the same chunks for the same thread
// count, so the same per-thread partial sums and the same floats). The torch-free cold executor
// loads this build (`actors/cold_native.py`): a process that maps no libtorch saves its static
// initialisers, about 0.05 GiB. bf16 rounds to nearest even, as c10::BFloat16.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace pilite {

class Error : public std::exception {
 public:
  explicit Error(std::string m) : m_(std::move(m)) {}
  const char* what() const noexcept override { return m_.c_str(); }
  const char* what_without_backtrace() const noexcept { return m_.c_str(); }

 private:
  std::string m_;
};

inline void str_into(std::ostringstream&) {}
template <class T, class... R>
inline void str_into(std::ostringstream& o, const T& v, const R&... r) {
  o << v;
  str_into(o, r...);
}
template <class... A>
inline std::string check_message(const char* cond, const A&... a) {
  std::ostringstream o;
  if (sizeof...(a) == 0) o << "Expected " << cond << " to be true, but got false.";
  str_into(o, a...);
  return o.str();
}

#define TORCH_CHECK(cond, ...)                                                          \
  do {                                                                                  \
    if (!(cond)) throw ::pilite::Error(::pilite::check_message(#cond, ##__VA_ARGS__)); \
  } while (0)

enum class ScalarType : int8_t { Byte, Char, Short, Int, Long, Half, Float, BFloat16, Bool };
constexpr ScalarType kByte = ScalarType::Byte, kChar = ScalarType::Char, kShort = ScalarType::Short,
                     kInt = ScalarType::Int, kLong = ScalarType::Long, kHalf = ScalarType::Half,
                     kFloat = ScalarType::Float, kBFloat16 = ScalarType::BFloat16, kBool = ScalarType::Bool;

inline int64_t element_size(ScalarType t) {
  switch (t) {
    case kByte: case kChar: case kBool: return 1;
    case kShort: case kHalf: case kBFloat16: return 2;
    case kInt: case kFloat: return 4;
    case kLong: return 8;
  }
  return 1;
}

inline std::ostream& operator<<(std::ostream& o, ScalarType t) {
  static const char* names[] = {"Byte", "Char", "Short", "Int", "Long", "Half", "Float", "BFloat16", "Bool"};
  return o << names[(int)t];
}

struct BFloat16 {
  uint16_t x = 0;
  BFloat16() = default;
  BFloat16(float v) : x(round(v)) {}  // NOLINT: implicit, as c10's
  operator float() const {            // NOLINT
    uint32_t u = (uint32_t)x << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t round(float v) {  // to nearest even (c10::detail::round_to_nearest_even)
    if (std::isnan(v)) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return (uint16_t)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
  }
};

template <class T> constexpr ScalarType type_of();
template <> constexpr ScalarType type_of<uint8_t>() { return kByte; }
template <> constexpr ScalarType type_of<int8_t>() { return kChar; }
template <> constexpr ScalarType type_of<int16_t>() { return kShort; }
template <> constexpr ScalarType type_of<int32_t>() { return kInt; }
template <> constexpr ScalarType type_of<int64_t>() { return kLong; }
template <> constexpr ScalarType type_of<float>() { return kFloat; }
template <> constexpr ScalarType type_of<BFloat16>() { return kBFloat16; }
template <> constexpr ScalarType type_of<bool>() { return kBool; }

template <class T>
class ArrayRef {
 public:
  ArrayRef() = default;
  ArrayRef(const T* d, size_t n) : d_(d), n_(n) {}
  ArrayRef(const std::vector<T>& v) : d_(v.data()), n_(v.size()) {}        // NOLINT
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"  // (a list's array lives as ATen's does: a call's)
  ArrayRef(std::initializer_list<T> l) : d_(l.begin()), n_(l.size()) {}   // NOLINT
#pragma GCC diagnostic pop
  ArrayRef(const T& one) : d_(&one), n_(1) {}                             // NOLINT
  const T* begin() const { return d_; }
  const T* end() const { return d_ + n_; }
  const T* data() const { return d_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  const T& operator[](size_t i) const { return d_[i]; }
  const T& front() const { return d_[0]; }
  const T& back() const { return d_[n_ - 1]; }
  std::vector<T> vec() const { return std::vector<T>(d_, d_ + n_); }
  bool operator==(const ArrayRef& o) const { return n_ == o.n_ && std::equal(begin(), end(), o.begin()); }
  bool operator!=(const ArrayRef& o) const { return !(*this == o); }

 private:
  const T* d_ = nullptr;
  size_t n_ = 0;
};
using IntArrayRef = ArrayRef<int64_t>;
using SymIntArrayRef = ArrayRef<int64_t>;

struct Device {
  bool is_cpu() const { return true; }
};

struct TensorOptions {
  ScalarType dtype_ = kFloat;
  TensorOptions dtype(ScalarType t) const { return TensorOptions{t}; }
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<void> owner, void* data, ScalarType t, std::vector<int64_t> sizes,
         std::vector<int64_t> strides)
      : owner_(std::move(owner)), data_(data), dtype_(t), sizes_(std::move(sizes)), strides_(std::move(strides)),
        defined_(true) {}

  bool defined() const { return defined_; }
  int64_t dim() const { return (int64_t)sizes_.size(); }
  int64_t size(int64_t d) const { return sizes_[wrap(d)]; }
  int64_t stride(int64_t d) const { return strides_[wrap(d)]; }
  IntArrayRef sizes() const { return sizes_; }
  IntArrayRef strides() const { return strides_; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : sizes_) n *= s;
    return n;
  }
  ScalarType scalar_type() const { return dtype_; }
  int64_t element_size() const { return pilite::element_size(dtype_); }
  size_t nbytes() const { return (size_t)(numel() * element_size()); }
  TensorOptions options() const { return TensorOptions{dtype_}; }
  Device device() const { return Device{}; }
  bool is_contiguous() const {
    int64_t want = 1;
    for (int64_t d = dim() - 1; d >= 0; d--) {
      if (sizes_[d] != 1 && strides_[d] != want) return false;
      want *= sizes_[d];
    }
    return true;
  }
  void* data_ptr() const { return data_; }
  template <class T>
  T* data_ptr() const {
    TORCH_CHECK(type_of<T>() == dtype_, "expected scalar type ", type_of<T>(), " but found ", dtype_);
    return static_cast<T*>(data_);
  }
  Tensor contiguous() const { return is_contiguous() ? *this : copy_as(dtype_); }
  Tensor clone() const { return copy_as(dtype_); }
  Tensor to(ScalarType t, bool /*non_blocking*/ = false, bool copy = false) const {
    return t == dtype_ && !copy ? *this : copy_as(t);
  }
  Tensor view(IntArrayRef shape) const {
    TORCH_CHECK(is_contiguous(), "view of a contiguous tensor only");
    Tensor out = *this;
    out.sizes_ = shape.vec();
    out.strides_ = contiguous_strides(out.sizes_);
    TORCH_CHECK(out.numel() == numel(), "view: the shape's size differs");
    return out;
  }

  Tensor as_strided(IntArrayRef shape, IntArrayRef strides, int64_t offset) const {
    Tensor out = *this;
    out.sizes_ = shape.vec();
    out.strides_ = strides.vec();
    out.data_ = static_cast<char*>(data_) + offset * element_size();
    return out;
  }
  Tensor operator[](int64_t i) const {  // (select along the first dimension)
    Tensor out = *this;
    out.data_ = static_cast<char*>(data_) + i * strides_[0] * element_size();
    out.sizes_.erase(out.sizes_.begin());
    out.strides_.erase(out.strides_.begin());
    return out;
  }
  Tensor any(int64_t dim) const;   // (bool, 2-D, along dim 0)
  Tensor& relu_();                 // (float)
  Tensor ge(double threshold) const;  // (float, compared in float)

  static std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
    std::vector<int64_t> s(sizes.size());
    int64_t at = 1;
    for (int64_t d = (int64_t)sizes.size() - 1; d >= 0; d--) {
      s[d] = at;
      at *= std::max<int64_t>(sizes[d], 1);
    }
    return s;
  }

 private:
  size_t wrap(int64_t d) const { return (size_t)(d < 0 ? d + dim() : d); }
  double get(const char* p) const;  // (below: an element as a double)
  Tensor copy_as(ScalarType t) const;

  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  ScalarType dtype_ = kFloat;
  std::vector<int64_t> sizes_, strides_;
  bool defined_ = false;
};
using TensorList = ArrayRef<Tensor>;

// The blocks of 64 KiB and more that freed tensors held, kept for the next tensors of their
// size (or up to a quarter smaller; of a size, the one freed last, still in the caches)
// instead of going back to malloc. A layer loop's step makes and frees the same tensors at
// every layer, megabytes each over a prompt's rows, and glibc could serve such a block with a
// fresh mapping or give a heap's freed top back to the system, so that each layer wrote into
// new pages: 150,000-200,000 page faults a 2,000-token SmolLM2 prompt in a group's hot
// executor (BENCHMARKS.md, "A prompt's pages kept in the executors"). Kept here, a step's
// blocks are faulted in once. At most `cap` bytes are kept (a block that would pass it is
// freed); `release` frees them all, which an executor does once it is idle
// (`actors.clib.IDLE_RELEASE_S`). Thread-safe: the loop's threads and the release share one
// lock, taken only for the large blocks.
class BlockCache {
 public:
  static constexpr size_t MIN_BYTES = 64 << 10;

  static BlockCache& instance() {
    static BlockCache* c = new BlockCache();  // (never destroyed: tensors may outlive statics)
    return *c;
  }

  // A block of at least `bytes` (64-aligned) and its capacity; nullptr where none is kept.
  void* take(size_t bytes, size_t* capacity) {
    std::lock_guard<std::mutex> g(m_);
    auto it = free_.lower_bound(bytes);
    if (it == free_.end() || it->first > bytes + bytes / 4) {
      misses_++;
      return nullptr;
    }
    it = std::prev(free_.upper_bound(it->first));  // (the one of that size freed last)
    void* p = it->second;
    *capacity = it->first;
    kept_ -= it->first;
    free_.erase(it);
    hits_++;
    return p;
  }

  void give(void* p, size_t capacity) {
    {
      std::lock_guard<std::mutex> g(m_);
      if (kept_ + capacity <= cap_) {
        free_.emplace(capacity, p);
        kept_ += capacity;
        return;
      }
    }
    std::free(p);
  }

  // Frees every kept block; returns their bytes.
  size_t release() {
    std::multimap<size_t, void*> out;
    size_t bytes;
    {
      std::lock_guard<std::mutex> g(m_);
      out.swap(free_);
      bytes = kept_;
      kept_ = 0;
    }
    for (auto& b : out) std::free(b.second);
    return bytes;
  }

  // bytes kept now, the cap, blocks taken from the cache, blocks it had none for
  void stats(int64_t* out) {
    std::lock_guard<std::mutex> g(m_);
    out[0] = (int64_t)kept_;
    out[1] = (int64_t)cap_;
    out[2] = hits_;
    out[3] = misses_;
  }

  void set_cap(size_t bytes) {
    bool over;
    {
      std::lock_guard<std::mutex> g(m_);
      cap_ = bytes;
      over = kept_ > cap_;
    }
    if (over) release();
  }

 private:
  std::mutex m_;
  std::multimap<size_t, void*> free_;  // capacity -> block
  size_t kept_ = 0, cap_ = (size_t)512 << 20;
  int64_t hits_ = 0, misses_ = 0;
};

inline Tensor empty(IntArrayRef shape, TensorOptions o = {}) {
  std::vector<int64_t> sizes = shape.vec();
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  const size_t bytes = ((size_t)std::max<int64_t>(n, 1) * element_size(o.dtype_) + 63) / 64 * 64;
  if (bytes < BlockCache::MIN_BYTES) {
    void* p = std::aligned_alloc(64, bytes);
    TORCH_CHECK(p, "out of memory: ", bytes, " bytes");
    std::shared_ptr<void> owner(p, [](void* q) { std::free(q); });
    return Tensor(owner, p, o.dtype_, sizes, Tensor::contiguous_strides(sizes));
  }
  size_t capacity = bytes;
  void* p = BlockCache::instance().take(bytes, &capacity);
  if (!p) p = std::aligned_alloc(64, bytes);
  TORCH_CHECK(p, "out of memory: ", bytes, " bytes");
  std::shared_ptr<void> owner(p, [capacity](void* q) { BlockCache::instance().give(q, capacity); });
  return Tensor(owner, p, o.dtype_, sizes, Tensor::contiguous_strides(sizes));
}

inline Tensor zeros(IntArrayRef shape, TensorOptions o = {}) {
  Tensor t = empty(shape, o);
  std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

inline Tensor empty_like(const Tensor& t) { return empty(t.sizes(), t.options()); }

inline Tensor from_blob(void* data, IntArrayRef shape, IntArrayRef strides, TensorOptions o = {}) {
  return Tensor(nullptr, data, o.dtype_, shape.vec(), strides.vec());
}

inline Tensor from_blob(void* data, IntArrayRef shape, TensorOptions o = {}) {
  std::vector<int64_t> sizes = shape.vec();
  return Tensor(nullptr, data, o.dtype_, sizes, Tensor::contiguous_strides(sizes));
}

// element i (C order) of t at p's type, through a double (every value of these types is exact)
inline double Tensor::get(const char* p) const {
  switch (dtype_) {
    case kByte: return *(const uint8_t*)p;
    case kChar: return *(const int8_t*)p;
    case kShort: return *(const int16_t*)p;
    case kInt: return *(const int32_t*)p;
    case kLong: return (double)*(const int64_t*)p;
    case kFloat: return *(const float*)p;
    case kBFloat16: return (float)*(const BFloat16*)p;
    case kBool: return *(const bool*)p ? 1.0 : 0.0;
    case kHalf: break;
  }
  TORCH_CHECK(false, "no conversion from ", dtype_);
  return 0;
}

inline Tensor Tensor::copy_as(ScalarType t) const {
  Tensor out = empty(sizes_, TensorOptions{t});
  const int64_t n = numel(), es = element_size(), nd = dim();
  // a contiguous tensor as it is, or between float32 and bf16 (a head's rows, 0.8 M values a
  // step: the element-wise walk below took 3 ms of it), in one flat loop
  if (is_contiguous() && (t == dtype_ || (t == kBFloat16 && dtype_ == kFloat) || (t == kFloat && dtype_ == kBFloat16))) {
    if (t == dtype_) {
      std::memcpy(out.data_ptr(), data_, n * es);
    } else if (t == kBFloat16) {
      const float* src = static_cast<const float*>(data_);
      uint16_t* dst = static_cast<uint16_t*>(out.data_ptr());
      for (int64_t i = 0; i < n; i++) dst[i] = BFloat16::round(src[i]);
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(data_);
      uint32_t* dst = static_cast<uint32_t*>(out.data_ptr());
      for (int64_t i = 0; i < n; i++) dst[i] = (uint32_t)src[i] << 16;
    }
    return out;
  }
  std::vector<int64_t> idx(nd, 0);
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t ds = out.element_size();
  for (int64_t i = 0; i < n; i++) {
    int64_t off = 0;
    for (int64_t d = 0; d < nd; d++) off += idx[d] * strides_[d];
    const char* src = static_cast<const char*>(data_) + off * es;
    char* o = dst + i * ds;
    if (t == dtype_) {
      std::memcpy(o, src, es);
    } else if (t == kFloat && dtype_ == kBFloat16) {
      *(float*)o = (float)*(const BFloat16*)src;
    } else {
      const double v = get(src);
      switch (t) {
        case kByte: *(uint8_t*)o = (uint8_t)v; break;
        case kChar: *(int8_t*)o = (int8_t)v; break;
        case kShort: *(int16_t*)o = (int16_t)v; break;
        case kInt: *(int32_t*)o = (int32_t)v; break;
        case kLong: *(int64_t*)o = (int64_t)v; break;
        case kFloat: *(float*)o = (float)v; break;
        case kBFloat16: *(BFloat16*)o = BFloat16((float)v); break;
        case kBool: *(bool*)o = v != 0; break;
        case kHalf: TORCH_CHECK(false, "no conversion to Half");
      }
    }
    for (int64_t d = nd - 1; d >= 0; d--) {
      if (++idx[d] < sizes_[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

inline Tensor Tensor::any(int64_t dim) const {
  TORCH_CHECK(dtype_ == kBool && this->dim() == 2 && dim == 0, "any: along dim 0 of a 2-D bool tensor");
  Tensor out = zeros({sizes_[1]}, TensorOptions{kBool});
  bool* o = out.data_ptr<bool>();
  const bool* p = static_cast<const bool*>(data_);
  for (int64_t r = 0; r < sizes_[0]; r++)
    for (int64_t c = 0; c < sizes_[1]; c++) o[c] = o[c] || p[r * strides_[0] + c * strides_[1]];
  return out;
}

inline Tensor& Tensor::relu_() {
  TORCH_CHECK(dtype_ == kFloat && is_contiguous(), "relu_: a contiguous float tensor");
  float* p = static_cast<float*>(data_);
  for (int64_t i = 0, n = numel(); i < n; i++)
    if (p[i] < 0.0f) p[i] = 0.0f;  // (NaN stays NaN, as clamp_min)
  return *this;
}

inline Tensor Tensor::ge(double threshold) const {
  TORCH_CHECK(dtype_ == kFloat, "ge: a float tensor");
  const Tensor c = contiguous();
  Tensor out = empty(sizes_, TensorOptions{kBool});
  const float* p = static_cast<const float*>(c.data_ptr());
  bool* o = out.data_ptr<bool>();
  const float t = (float)threshold;
  for (int64_t i = 0, n = numel(); i < n; i++) o[i] = p[i] >= t;
  return out;
}

inline std::ostream& operator<<(std::ostream& o, IntArrayRef a) {
  o << "[";
  for (size_t i = 0; i < a.size(); i++) o << (i ? ", " : "") << a[i];
  return o << "]";
}

inline Tensor ones(IntArrayRef shape, TensorOptions o = {}) {
  Tensor t = zeros(shape, TensorOptions{kFloat});
  float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); i++) p[i] = 1.0f;
  return t.to(o.dtype_);
}

// along dim, every tensor of the same type and the same sizes but dim's
inline Tensor cat(TensorList ts, int64_t dim) {
  TORCH_CHECK(!ts.empty(), "cat of no tensors");
  const Tensor& a = ts[0];
  if (dim < 0) dim += a.dim();
  std::vector<int64_t> sizes = a.sizes().vec();
  sizes[dim] = 0;
  for (const Tensor& t : ts) {
    TORCH_CHECK(t.scalar_type() == a.scalar_type() && t.dim() == a.dim(), "cat: tensors of one type and rank");
    sizes[dim] += t.size(dim);
  }
  Tensor out = empty(sizes, a.options());
  int64_t outer = 1, inner = out.element_size();
  for (int64_t d = 0; d < dim; d++) outer *= sizes[d];
  for (int64_t d = dim + 1; d < (int64_t)sizes.size(); d++) inner *= sizes[d];
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t row = sizes[dim] * inner;
  int64_t at = 0;
  for (const Tensor& t0 : ts) {
    const Tensor t = t0.contiguous();
    const int64_t piece = t.size(dim) * inner;
    for (int64_t o = 0; o < outer; o++)
      std::memcpy(dst + o * row + at, static_cast<const char*>(t.data_ptr()) + o * piece, piece);
    at += piece;
  }
  return out;
}

// ---- threads, as ATen's OpenMP backend (ATen/Parallel-inl.h, ATen/ParallelOpenMP.h) ----

inline thread_local int64_t thread_num = 0;
inline thread_local bool in_parallel = false;

inline int get_num_threads() { return omp_get_max_threads(); }
inline void set_num_threads(int n) { omp_set_num_threads(std::max(n, 1)); }
inline int get_thread_num() { return (int)thread_num; }
inline bool in_parallel_region() { return in_parallel || omp_in_parallel(); }

struct ThreadGuard {  // (ATen's ThreadIdGuard and ParallelGuard together)
  int64_t tid0;
  bool par0;
  explicit ThreadGuard(int64_t tid) : tid0(thread_num), par0(in_parallel) {
    thread_num = tid;
    in_parallel = true;
  }
  ~ThreadGuard() {
    thread_num = tid0;
    in_parallel = par0;
  }
};

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain_size, const F& f) {
  if (begin >= end) return;
  const int64_t numiter = end - begin;
  if (!(numiter > grain_size && numiter > 1 && !in_parallel_region() && get_num_threads() > 1)) {
    ThreadGuard guard(0);
    f(begin, end);
    return;
  }
  std::exception_ptr eptr;
  bool failed = false;
#pragma omp parallel
  {
    int64_t num_threads = omp_get_num_threads();
    if (grain_size > 0) num_threads = std::min(num_threads, (numiter + grain_size - 1) / grain_size);
    const int64_t tid = omp_get_thread_num();
    const int64_t chunk = (numiter + num_threads - 1) / num_threads;
    const int64_t b = begin + tid * chunk;
    if (b < end) {
      try {
        ThreadGuard guard(tid);
        f(b, std::min(end, chunk + b));
      } catch (...) {
#pragma omp critical(pilite_error)
        if (!failed) {
          failed = true;
          eptr = std::current_exception();
        }
      }
    }
  }
  if (eptr) std::rethrow_exception(eptr);
}

}  // namespace pilite

namespace at = pilite;
namespace c10 = pilite;
