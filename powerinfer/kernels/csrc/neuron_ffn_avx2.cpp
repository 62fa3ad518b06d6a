// The kernel for CPUs with AVX2 and FMA, compiled with -mavx2 -mfma -mf16c.
#define ISA_NS avx2
#include "neuron_ffn.h"
namespace powerinfer {
const Kernels kernels_avx2 = {avx2::acts, avx2::downs, avx2::gemv, avx2::widen, {avx2::gemv_q4x16, avx2::gemv_q4kx16, avx2::gemv_q6kx16, avx2::gemv_q8x16, avx2::gemv_q5kx16, avx2::gemv_q5x16}, avx2::attend, avx2::q4c_passes, avx2::quantize, avx2::records_rows, avx2::rows_bf16_dots, avx2::rows_on_amx, avx2::activate, avx2::round_bf16, avx2::add_bf16};
}
