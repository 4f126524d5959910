// marlin-convert: host launcher of the FP16 x INT4 Marlin-format GEMM (kernel/marlin_gemm.cu).
//
// Plain C++ / CUDA runtime only (no torch headers), so the kernel file compile-checks with `nvcc -c` alone.
#pragma once

#include <cuda_runtime.h>

namespace marlin_convert {

// Return codes of marlin_gemm_launch. On anything but MARLIN_OK, `err` holds a message naming the values.
enum MarlinStatus : int {
  MARLIN_OK = 0,
  MARLIN_BAD_SHAPE = 1,      // a shape limit is broken (k % 16, n % 64, group size, m < 1, ...)
  MARLIN_BAD_WORKSPACE = 2,  // workspace smaller than (n / 64) * 16 ints
  MARLIN_BAD_POINTER = 3,    // null or misaligned pointer (all of A, B, s, C must be 16-byte aligned)
  MARLIN_CUDA_ERROR = 4,     // the launch (or an attribute call before it) failed; message has CUDA's text
};

// Smallest workspace the kernel accepts for n output columns: (n / 64) * 16 int32 (FORMAT.md section 4,
// "vLLM legacy" rule: one lock region of 16 ints per 64-column slice). Must be zeroed before the first call;
// the kernel leaves it zeroed again after every call.
long marlin_required_workspace_ints(int n);

// C[m, n] = A[m, k] @ ((q - 8) * s)[k, n], fp32 accumulation, fp16 output.
//   A          fp16 [m, k], row-major, contiguous rows (row stride k), 16-byte aligned
//   B          int32 [k / 16, 2 * n], Marlin tiles (FORMAT.md section 2), rows dense, 16-byte aligned
//   s          fp16 [scale_rows, n], permuted scales (FORMAT.md section 3): scale_rows == 1 -> channelwise
//              table (runs of 32), scale_rows > 1 -> grouped table (runs of 64), group size k / scale_rows
//   C          fp16 [m, n], row-major, written completely (rows < m, cols < n); 16-byte aligned
//   workspace  int32, zeroed, >= marlin_required_workspace_ints(n) ints; left zeroed on return of the kernel
//   sms        number of multiprocessors to fill (cudaDeviceProp::multiProcessorCount)
//   split_k    0: choose the split over k automatically; > 0: use at most this many k-splits (tuning)
//   stream     CUDA stream of the launch
//   err        buffer for an error message of at most errlen bytes (may be null when errlen == 0)
// Act-order (a row permutation `perm` of W) is NOT handled here: the caller gathers A[:, perm] first.
int marlin_gemm_launch(const void* A, const void* B, const void* s, void* C, int* workspace, long workspace_ints,
                       int m, int n, int k, int scale_rows, int sms, int split_k, cudaStream_t stream, char* err,
                       int errlen);

}  // namespace marlin_convert
