// The kernel for CPUs with AVX2 and FMA, compiled with -mavx2 -mfma -mf16c.
#define ISA_NS avx2
#include "neuron_ffn.h"
namespace powerinfer {
RangeFn range_avx2 = avx2::range;
WidenFn widen_avx2 = avx2::widen;
GemvFn gemv_avx2 = avx2::gemv;
}
