// The kernel for CPUs with AVX-512 (F, BW, VL), compiled with -mavx512f -mavx512bw -mavx512vl.
#define ISA_NS avx512
#include "neuron_ffn.h"
namespace powerinfer {
const Kernels kernels_avx512 = {avx512::acts, avx512::downs, avx512::gemv, avx512::widen, {avx512::gemv_q4x16, avx512::gemv_q4kx16, avx512::gemv_q6kx16, avx512::gemv_q8x16, avx512::gemv_q5kx16, avx512::gemv_q5x16}, avx512::attend, avx512::q4c_passes, avx512::quantize, avx512::records_rows, avx512::rows_bf16_dots, avx512::rows_on_amx, avx512::activate, avx512::round_bf16, avx512::add_bf16};
}
