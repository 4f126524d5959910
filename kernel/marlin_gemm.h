// marlin-convert: host launcher of the Marlin-format GEMM (kernel/marlin_gemm.cu): fp16 or bf16 activations x
// 4- or 8-bit weights, symmetric or with zero points.
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
  MARLIN_BAD_POINTER = 3,    // null or misaligned pointer (A, B, s, C and zp when given must be 16-byte aligned)
  MARLIN_CUDA_ERROR = 4,     // the launch (or an attribute call before it) failed; message has CUDA's text
  MARLIN_BAD_KIND = 5,       // bits not 4 / 8, or an activation type other than fp16 / bf16
};

// Activation (and scale, and output) element type.
enum MarlinActType : int {
  MARLIN_ACT_FP16 = 0,
  MARLIN_ACT_BF16 = 1,
};

// Smallest workspace the kernel accepts for n output columns: (n / 64) * 16 int32 (FORMAT.md section 4,
// "vLLM legacy" rule: one lock region of 16 ints per 64-column slice). Must be zeroed before the first call;
// the kernel leaves it zeroed again after every call.
long marlin_required_workspace_ints(int n);

// Launches that carried the programmatic-dependent-launch attribute since the library was loaded (compute capability
// 9.0 only, where pdl_launch in marlin_gemm_impl.cuh takes it; tests check that a chain of calls took it).
long marlin_pdl_launches();

// The configuration of the last kernel this host thread launched, as text into buf (snprintf's return value; "" before
// any launch): the family ("pipelined" or "direct") and its parameters (note_launch in marlin_gemm_impl.cuh). Tests
// use it to check which kernel a dispatch rule chose.
int marlin_last_launch(char* buf, int len);

#if defined(MARLIN_CONVERT_TRACE)
// Development builds only (-DMARLIN_CONVERT_TRACE): the device buffer of `blocks` rows of 16 64-bit words that the
// next launches stamp (the [TRACE] section of marlin_gemm_impl.cuh says what each word is); null stops it. Takes
// effect at the next launch outside graph capture.
void marlin_trace_set(void* buffer, long blocks);
#endif

// C[m, n] = A[m, k] @ ((q - z) * s)[k, n], fp32 accumulation, output in the activation type.
// b = bits (4 or 8), p = 32 / b values per int32 word, z = 2^(b-1) (8 / 128) when zp is null.
//   A          act [m, k], row-major, contiguous rows (row stride k), 16-byte aligned
//   B          int32 [k / 16, n * b / 2], Marlin tiles (FORMAT.md sections 2 and 7), rows dense, 16-byte aligned
//   s          act [scale_rows, n], permuted scales (FORMAT.md section 3): scale_rows == 1 -> channelwise
//              table (runs of 32), scale_rows > 1 -> grouped table (runs of 64), group size k / scale_rows
//   zp         null (symmetric) or int32 [scale_rows, n / p], true zero points in the Marlin order (FORMAT.md
//              section 7 "Asymmetric": grouped scale table, interleaved in groups of p, packed along n), 16-byte
//              aligned; same rows (groups) as s
//   C          act [m, n], row-major, written completely (rows < m, cols < n); 16-byte aligned
//   workspace  int32, zeroed, >= marlin_required_workspace_ints(n) ints; left zeroed on return of the kernel
//   bits       4 or 8
//   act        MARLIN_ACT_FP16 or MARLIN_ACT_BF16 (type of A, s and C)
//   sms        number of multiprocessors to fill (cudaDeviceProp::multiProcessorCount)
//   split_k    0: choose the split over k automatically; > 0: use at most this many k-splits (tuning)
//   stream     CUDA stream of the launch
//   err        buffer for an error message of at most errlen bytes (may be null when errlen == 0)
// Act-order (a row permutation `perm` of W) is NOT handled here: the caller gathers A[:, perm] first.
int marlin_gemm_launch(const void* A, const void* B, const void* s, const void* zp, void* C, int* workspace,
                       long workspace_ints, int m, int n, int k, int scale_rows, int bits, int act, int sms,
                       int split_k, cudaStream_t stream, char* err, int errlen);

}  // namespace marlin_convert
