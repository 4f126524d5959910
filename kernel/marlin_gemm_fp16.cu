// marlin-convert: the fp16 kinds other than 4-bit symmetric: 4-bit with zero points, 8-bit with and
// without
// (the kernel is in marlin_gemm_impl.cuh; a translation unit of its own so that the build compiles the kinds in
// parallel). Self-contained: `nvcc -c kernel/marlin_gemm_fp16.cu` checks it without a GPU or torch.

#include "marlin_gemm_impl.cuh"

namespace marlin_convert {
namespace detail {

int launch_fp16_other(const Launch& L, int bits) {
  if (bits == 4) return dispatch<Kind<half, 4, true>>(L);
  return L.zp != nullptr ? dispatch<Kind<half, 8, true>>(L) : dispatch<Kind<half, 8, false>>(L);
}

}  // namespace detail
}  // namespace marlin_convert
