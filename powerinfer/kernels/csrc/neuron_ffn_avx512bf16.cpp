// The kernel for CPUs with AVX-512 and its bf16 dot products (AVX512_BF16: Zen 4, Sapphire
// Rapids): bf16 rows multiply in bf16 pairs, compiled with -mavx512bf16 beside the AVX-512 flags.
#define ISA_NS avx512bf16
#include "neuron_ffn.h"
namespace powerinfer {
const Kernels kernels_avx512bf16 = {avx512bf16::acts, avx512bf16::downs, avx512bf16::gemv, avx512bf16::widen,
                                    {avx512bf16::gemv_q4x16, avx512bf16::gemv_q4kx16, avx512bf16::gemv_q6kx16, avx512bf16::gemv_q8x16, avx512bf16::gemv_q5kx16, avx512bf16::gemv_q5x16}, avx512bf16::attend, avx512bf16::q4c_passes, avx512bf16::quantize, avx512bf16::records_rows, avx512bf16::rows_bf16_dots, avx512bf16::rows_on_amx, avx512bf16::activate, avx512bf16::round_bf16, avx512bf16::add_bf16};
}
