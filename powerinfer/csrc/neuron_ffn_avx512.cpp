// The kernel for CPUs with AVX-512 (F, BW, VL), compiled with -mavx512f -mavx512bw -mavx512vl.
#define ISA_NS avx512
#include "neuron_ffn.h"
namespace powerinfer {
RangeFn range_avx512 = avx512::range;
WidenFn widen_avx512 = avx512::widen;
GemvFn gemv_avx512 = avx512::gemv;
}
