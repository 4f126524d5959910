// marlin-convert: the bf16 x 8-bit kinds, symmetric and with zero points
// (the kernel is in marlin_gemm_impl.cuh; a translation unit of its own so that the build compiles the kinds in
// parallel). Self-contained: `nvcc -c kernel/marlin_gemm_bf16_int8.cu` checks it without a GPU or torch.

#include "marlin_gemm_impl.cuh"

namespace marlin_convert {
namespace detail {

int launch_bf16_int8(const Launch& L) {
  return L.zp != nullptr ? dispatch<Kind<__nv_bfloat16, 8, true>>(L) : dispatch<Kind<__nv_bfloat16, 8, false>>(L);
}

}  // namespace detail
}  // namespace marlin_convert
