// marlin-convert: GEMM on the Marlin tile format, written for this project (sm_80 .. sm_90): the kernel template.
//
//   C[m, n] = A[m, k] @ W[k, n],   W[k, n] = (q[k, n] - z[group(k), n]) * s[group(k), n],   fp32 accumulation
//
// Kinds (template parameters of one kernel, see `Kind`): activations, scales and output fp16 or bf16; weights of
// b = 4 or 8 bits (codes 0 .. 2^b - 1); z = the zero points of a `zp` tensor, or 2^(b-1) (8 / 128) when there is none
// (symmetric). Every dequantized weight value (q - z) is exact before the scale multiplies it.
//
// This header holds the kernel template, its launcher and the dispatch of one kind; the translation units
// marlin_gemm.cu (host checks, fp16 x 4-bit symmetric), marlin_gemm_fp16.cu (the other fp16 kinds),
// marlin_gemm_bf16_int4.cu and marlin_gemm_bf16_int8.cu each instantiate their kinds, so that the build compiles them
// in parallel. Self-contained: CUDA runtime + cuda_fp16 / cuda_bf16 only, so `nvcc -c kernel/<any>.cu` checks each
// without a GPU or torch. Layout facts are in shared/FORMAT.md (sections 2, 3 and 7); design notes in kernel/README.md.
//
// ------------------------------------------------------------------------------------------------ overview
// One thread block (256 threads = 8 warps) owns an output tile of 16*MB rows x TN = 64*WN columns and a contiguous
// range of k ("split"). Its warps form a WN x WK grid (WK = 8 / WN): warp (wn, wk) owns the 64 columns wn of the
// tile and, in every pipeline stage, STRIPS consecutive 16-row k-strips. Per stage the block therefore consumes
// STAGE_K = 16 * STRIPS * WK rows of k:
//
//        k --->        stage 0                         stage 1                  ...  (STAGES of them in flight)
//               +--------+--------+-----+--------+--------+--------+-----+
//   cols wn=0   | wk=0   | wk=1   | ... | wk=WK-1| wk=0   | wk=1   | ... |        each cell: STRIPS strips of 16 k-rows
//   cols wn=1   | wk=0   | wk=1   | ... | wk=WK-1| ...                            x 64 columns = STRIPS x 128 b bytes of B
//               +--------+--------+-----+--------+--------+--------+-----+
//
// The grid is (n / TN tiles) x (ceil(m / 16MB) row chunks) x (splits over k), linearised as
//   blockIdx.x = (ntile * splits + split) * m_chunks + mchunk
// so the blocks that read the same B columns run side by side and share it through L2; under stream-K (below)
// blockIdx.x = blk * m_chunks + mchunk, block blk taking an equal run of (tile, k-stage) units.
//
// Pipeline of one block, per stage (names used in the comments below):
//   [G2S]  global -> shared: cp.async.cg 16-byte copies of the A tile, the B tile and (grouped) the scale rows and
//          zero-point rows; STAGES - 1 stages are in flight while one is computed (cp.async.commit_group / wait_group).
//   [S2R]  shared -> registers: ldmatrix.x4 for the A fragments, one (4-bit) or two (8-bit) 16-byte ld.shared per
//          lane for B (its fragments of 4 tiles = 64 columns), one 16-byte ld.shared per lane for the 8 grouped
//          scales, one 4-byte (4-bit) or 8-byte (8-bit) ld.shared for the lane's 8 zero points.
//   [DEQ]  dequant: bit tricks + magic numbers (struct Dequant), giving q - z exactly, then (grouped) times the scale
//          (bf16 x 4-bit in the fp32 group-scale stages: 128 + q, the zero taken off the fp32 sums; kOffsetB).
//   [MMA]  mma.sync.m16n8k16 fp16 x fp16 or bf16 x bf16 -> fp32.
//   [RED]  reduction: the WK warps that share columns add their accumulators through shared memory; then the
//          blocks that share an output tile (its contributors) add through C, in block order, serialised by a lock.
//   [OUT]  write-out: pairs of output values to C; channelwise scales are applied here, in fp32.
//
// Split-K and the workspace: when n / TN * m_chunks blocks do not fill the GPU, k is cut into `splits` ranges.
// Block `split` waits until lock == split, adds its partial sums to what C holds (split 0 just stores), then sets
// lock = split + 1; the last split sets it back to 0, so the workspace is zero again when the kernel ends. One
// lock per (ntile, mchunk): n / TN * m_chunks <= (n / 64) * 16 ints is checked on the host, and the grid is kept
// within what the GPU can hold resident at once, so a block never waits for one that cannot start. Stream-K (the
// 2-stage kernels of >= 4 strips, where the tiles leave SMs idle in a last wave): every block takes the same number of
// (tile, k-stage) units across tile boundaries; a tile's contributors are consecutive blocks, and the lock protocol is
// the same with contributor index for split.
//
// [RED] in a cluster (the wgmma kernel, Hopper, split-K with one row chunk): the `splits` blocks of a tile form one
// thread-block cluster (rank = split), and their partial sums meet in distributed shared memory instead of C: each
// block pushes every output pair it does not own into the owner's shared memory (st.shared::cluster), one cluster
// barrier, and each block adds the `splits` partial sums of the pairs it owns, in split order, and writes them. No
// lock, no wait for the other contributors' writes to C, and the sums stay fp32 until the one write. Why: the serial
// chain through C cost each contributor of a 256-column tile several microseconds (H200, 4096 x 4096 m = 128 with 8
// splits: 77 us against 18 for the mma.sync kernels), which kept the wgmma kernel off the small layers.
//
// No L2 cache-hint variants (`.L2::cache_hint`, createpolicy) are used: published Marlin's small-batch path died
// with an illegal instruction on an H200 because of them.

#pragma once

#include "marlin_gemm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

namespace marlin_convert {
namespace detail {

constexpr int kThreads = 256;  // 8 warps per block
constexpr int kWarps = kThreads / 32;
constexpr int kMaxClusterRed = 8;  // blocks of a [RED] cluster at most: the portable cluster size limit
constexpr int kSmemPerSm = 228 * 1024;  // shared memory of one sm_90 multiprocessor (blocks per SM bound, 8-bit)

// ------------------------------------------------------------------------------------------------ PTX helpers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// [G2S] 16-byte asynchronous copy global -> shared, L2 only (.cg), or allocated in L1 as well (.ca) with kL1: for data
// that other blocks on the SM read at about the same time. The direct kernel's A chunks are such data (the blocks of
// one split read the same chunks in step; with L1 hits their copies do not all load the L2: kernel/NOTES.md, fifteenth
// session); A is read-only in the kernel and written only by kernels before it, whose writes are visible to this grid
// from its start or its griddepcontrol.wait. Skipped entirely when !pred (then `gmem` may point outside the tensor: it
// is never dereferenced).
template <bool kL1 = false>
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const int on = static_cast<int>(pred);
  if constexpr (kL1) {
    asm volatile("{\n  .reg .pred p;\n  setp.ne.b32 p, %0, 0;\n  @p cp.async.ca.shared.global [%1], [%2], 16;\n}\n"
                 ::"r"(on), "r"(smem_u32(smem)), "l"(gmem));
  } else {
    asm volatile("{\n  .reg .pred p;\n  setp.ne.b32 p, %0, 0;\n  @p cp.async.cg.shared.global [%1], [%2], 16;\n}\n"
                 ::"r"(on), "r"(smem_u32(smem)), "l"(gmem));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- [PDL] programmatic dependent launch (compute capability 9.0; the host adds the launch attribute where
// pdl_launch takes it). Such a launch may start while the kernel before it in the stream still runs, if that kernel
// lets it: every kernel here does (grid_launch_dependents, at its start), so the blocks of a successor launched with
// the attribute take the multiprocessors' free room, or each one that a block of ours leaves, and wait there. Until
// grid_dependency_wait returns, a kernel reads and writes no memory at all (A, C, the workspace and even B / s / zp
// may be what the kernel before it writes). Launched without the attribute, a kernel's wait returns at once (the
// kernel before it has finished); a successor launched without it waits for the whole grid as usual.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- [TRACE] development builds only (MARLIN_CONVERT_TRACE=1 in the environment: kernel.py adds
// -DMARLIN_CONVERT_TRACE; scripts/trace_kernel.py reads the stamps). Thread 0 of each block notes %globaltimer (ns, one
// clock for all SMs) at seven phases of its last segment in registers, and writes them once, at the block's end, into
// the buffer the host named with marlin_trace_set: row b (kTraceStamps 64-bit words) = phases 0 .. 6 in words 0 .. 6,
// the SM id in word 7; a phase the block never reached stays 0 (phase 2 where warp 0 has no chunk). (A first version
// wrote each stamp at once: the load of the buffer's address held warp 0 up before its first loads, ~0.3 us on the
// H100.) Phases: 0 entry, 1 the first loads issued (after the [PDL] wait), 2 warp 0's first chunk / stage computed, 3
// warp 0's main loop done, 4 the block's warps all done (the barrier before [RED]), 5 the reduction's cross-block wait
// done (cluster barrier or lock; the direct kernel's includes its own sum over the warps), 6 the segment's end. A
// stamp is issued after the instructions that compute `after` (in order: once their operands, the loaded weights,
// were there), not after their results. The seven 64-bit stamps cost registers: in a trace build six kernels spilled
// 4-16 bytes (none of fp16 x 4-bit's m <= 16 defaults), so those run a little slower traced than in release.
// Release builds have none of it (TraceClock is empty there).
constexpr int kTraceStamps = 16;
constexpr int kTracePhases = 7;
#if defined(MARLIN_CONVERT_TRACE)
extern unsigned long long* trace_host;  // the host's buffer (marlin_gemm.cu), or null
extern long trace_host_blocks;          // its rows
static __device__ unsigned long long* trace_device;  // this unit's copy of the two (each .cu is its own device module)
static __device__ long trace_device_blocks;
// Host: hands the buffer to this unit's kernels when it changed: a synchronous copy, so not while `stream` is being
// captured into a graph (scripts/trace_kernel.py's warm-up calls arm it before the capture); a failed copy leaves it
// unarmed, to be tried again at the next launch. (One GPU per process: the copy goes to the current device.)
static inline void trace_arm(cudaStream_t stream) {
  static unsigned long long* armed = nullptr;
  static long armed_blocks = 0;
  if (armed == trace_host && armed_blocks == trace_host_blocks) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) return;
  if (cudaMemcpyToSymbol(trace_device, &trace_host, sizeof trace_host) != cudaSuccess ||
      cudaMemcpyToSymbol(trace_device_blocks, &trace_host_blocks, sizeof trace_host_blocks) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  armed = trace_host;
  armed_blocks = trace_host_blocks;
}
#endif
struct TraceClock {
#if defined(MARLIN_CONVERT_TRACE)
  unsigned long long at[kTracePhases] = {};
#endif
  // notes `phase` (a constant at every call site, so `at` stays in registers) after the code that computes `after`
  __device__ __forceinline__ void stamp(int phase, float after) {
#if defined(MARLIN_CONVERT_TRACE) && defined(__CUDA_ARCH__)
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(at[phase]) : "f"(after) : "memory");
#else
    (void)phase;
    (void)after;
#endif
  }
  __device__ __forceinline__ void flush() const {
#if defined(MARLIN_CONVERT_TRACE) && defined(__CUDA_ARCH__)
    unsigned long long* const buf = trace_device;
    if (threadIdx.x == 0 && buf != nullptr && (long)blockIdx.x < trace_device_blocks) {
      unsigned long long* const row = buf + (size_t)blockIdx.x * kTraceStamps;
#pragma unroll
      for (int i = 0; i < kTracePhases; ++i) row[i] = at[i];
      unsigned int sm;
      asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
      row[7] = sm;
    }
#endif
  }
};

// Cluster helpers (sm_90; the direct kernel's and the wgmma kernel's [RED] in a cluster): the barrier of all blocks
// of the cluster (release / acquire: shared-memory writes before it are visible to the other blocks after it), in two
// halves where the arrival comes early (cluster_arrive at the kernel's start, cluster_wait before the first store into
// a peer: every block of the cluster has started, so its shared memory may be written), and a float2 store into block
// `rank`'s shared memory at the address `addr` has in this block.
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void st_cluster_f2(uint32_t addr, uint32_t rank, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(remote), "f"(v.x), "f"(v.y) : "memory");
#else
  __trap();
#endif
}

// [S2R] four 8x8 16-bit matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

// Three-input logic op; LUT is the truth table of f(a, b, c) evaluated on a = 0xF0, b = 0xCC, c = 0xAA.
template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
}
constexpr int kAndOr = (0xF0 & 0xCC) | 0xAA;  // lop3 table of (a & b) | c = 0xEA

__device__ __forceinline__ half2 as_h2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }
__device__ __forceinline__ uint32_t as_u32(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __nv_bfloat162 as_b2(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 h) { return *reinterpret_cast<uint32_t*>(&h); }

// ------------------------------------------------------------------------------------------------ Hopper (sm_90a)
// wgmma (warpgroup MMA, sm_90a only: compiled where __CUDA_ARCH_FEAT_SM90_ALL is defined, i.e. for
// -gencode=arch=compute_90a,code=sm_90a; elsewhere Wgmma::run traps and the fence / commit / wait helpers are empty, and
// the host never launches the kernels that use them, see wgmma_variant in marlin_gemm.cu). The four warps of a warpgroup issue one wgmma together; it runs asynchronously:
//   wgmma.fence        before a wgmma reads registers that ordinary instructions wrote (the dequantized A fragments,
//                      the zeroed accumulators)
//   wgmma.commit_group closes the wgmma issued since the last commit into one group
//   wgmma.wait_group N waits until at most N groups are pending (the accumulators are read, and the shared memory
//                      and fragments a wgmma reads may be reused, only after that)
// Shared memory written through the generic proxy (cp.async here) is made visible to wgmma's reads (the async proxy)
// by fence.proxy.async before the barrier that precedes them.
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Shared-memory matrix descriptor of wgmma's B operand (PTX ISA, "matrix descriptor"): K-major rows of 128 bytes
// (64 16-bit values of k) with the 128-byte swizzle, i.e. the 16-byte chunk c of row r stored at chunk c ^ (r % 8),
// in atoms of 8 rows = 1024 bytes that start 1024-byte aligned. Fields: bits 0-13 start address / 16, 16-29 the
// leading byte offset / 16 (unused for swizzled K-major: 1), 32-45 the stride byte offset / 16 (from one 8-row atom
// to the next: 1024 / 16 = 64), 62-63 the swizzle mode (1 = 128 bytes). The k16 slice kk (0..3) of a 64-wide row
// starts 32 kk bytes into it: the swizzle is applied to the address bits, so the start moves by 32 bytes.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr) {
  return (uint64_t)((smem_addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// Wgmma<MB>::run<J, ActT>(d, a, desc): D[64 x N] += W^T[64 x 16] B[16 x N], N = 16 MB batch rows, fp32 accumulators.
// Warp w of the warpgroup gives rows 16 w .. 16 w + 15 of W^T as the registers a (the mma.m16n8k16 A-fragment layout:
// {(row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..)}, g = lane / 4, t = lane % 4) and gets
// those rows of D back in the m16n8 C layout per n8-chunk i: (row g, cols 8i + 2t, +1), (row g+8, the same). In the
// kernel the rows are tile J (0, 1) of each warp's 64 columns and n8-chunk i is batch block i, so chunk i lands in
// d[i / 2][2 (i % 2) + J] (m-block i / 2, batch block i % 2 of it).
// desc: B = the activations' k16 x N slice, K-major (each batch row's 16 k contiguous), wgmma_desc_sw128.
template <int MB>
struct Wgmma;
// One specialisation per N: the accumulator operands of n8-chunk i are d[i / 2][2 (i % 2) + J][0..3] (MC_D4); the
// asm's operand numbers: 8 MB accumulators, then a[0..3], desc and the scale-d flag (1: D += A B).
#define MC_D4(i)                                                                                                   \
  "+f"(d[(i) / 2][2 * ((i) % 2) + J][0]), "+f"(d[(i) / 2][2 * ((i) % 2) + J][1]),                                   \
      "+f"(d[(i) / 2][2 * ((i) % 2) + J][2]), "+f"(d[(i) / 2][2 * ((i) % 2) + J][3])
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MC_WGMMA_ASM(SHAPE, TYPE, DREGS, REST, ...)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " REST ";\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "."     \
               TYPE " {" DREGS "}, " __VA_ARGS__)
#define MC_WGMMA_SPECIALISATION(MB_, SHAPE, DREGS, SCALE_D, AREGS, OPERANDS)                                        \
  template <>                                                                                                      \
  struct Wgmma<MB_> {                                                                                              \
    template <int J, class ActT>                                                                                   \
    static __device__ __forceinline__ void run(float (&d)[MB_][4][4], const uint32_t (&a)[4], uint64_t desc) {     \
      if constexpr (std::is_same<ActT, half>::value)                                                               \
        MC_WGMMA_ASM(SHAPE, "f16", DREGS, SCALE_D, AREGS ", p, 1, 1, 0;\n}\n" : OPERANDS                           \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1) : "memory");                  \
      else                                                                                                         \
        MC_WGMMA_ASM(SHAPE, "bf16", DREGS, SCALE_D, AREGS ", p, 1, 1, 0;\n}\n" : OPERANDS                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1) : "memory");                  \
    }                                                                                                              \
  };
#else
#define MC_WGMMA_SPECIALISATION(MB_, SHAPE, DREGS, SCALE_D, AREGS, OPERANDS)                                        \
  template <>                                                                                                      \
  struct Wgmma<MB_> {                                                                                              \
    template <int J, class ActT>                                                                                   \
    static __device__ __forceinline__ void run(float (&)[MB_][4][4], const uint32_t (&)[4], uint64_t) { __trap(); } \
  };
#endif
#define MC_COMMA ,
MC_WGMMA_SPECIALISATION(4, "m64n64k16",
                        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
                        "%37, 0", "{%32, %33, %34, %35}, %36",
                        MC_D4(0) MC_COMMA MC_D4(1) MC_COMMA MC_D4(2) MC_COMMA MC_D4(3) MC_COMMA MC_D4(4) MC_COMMA
                        MC_D4(5) MC_COMMA MC_D4(6) MC_COMMA MC_D4(7))
MC_WGMMA_SPECIALISATION(8, "m64n128k16",
                        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
                        "%69, 0", "{%64, %65, %66, %67}, %68",
                        MC_D4(0) MC_COMMA MC_D4(1) MC_COMMA MC_D4(2) MC_COMMA MC_D4(3) MC_COMMA MC_D4(4) MC_COMMA
                        MC_D4(5) MC_COMMA MC_D4(6) MC_COMMA MC_D4(7) MC_COMMA MC_D4(8) MC_COMMA MC_D4(9) MC_COMMA
                        MC_D4(10) MC_COMMA MC_D4(11) MC_COMMA MC_D4(12) MC_COMMA MC_D4(13) MC_COMMA MC_D4(14) MC_COMMA
                        MC_D4(15))
#undef MC_COMMA
#undef MC_WGMMA_SPECIALISATION
#undef MC_WGMMA_ASM
#undef MC_D4

// ------------------------------------------------------------------------------------------------ activation type
// Everything the kernel does with a pair of 16-bit activation values, kept in a uint32_t (low half = first value).
template <typename ActT>
struct Act;

template <>
struct Act<half> {
  // [MMA] D = A(16x16, row) * B(16x8, col) + D, fp16 inputs, fp32 accumulators.
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // D = A * B (the accumulator input is zero: SASS takes RZ for it, so no register has to be zeroed first)
  static __device__ __forceinline__ void mma_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  }
  static __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    return as_u32(__hmul2(as_h2(a), as_h2(b)));
  }
  static __device__ __forceinline__ uint32_t low2(uint32_t a) { return as_u32(__low2half2(as_h2(a))); }
  static __device__ __forceinline__ uint32_t high2(uint32_t a) { return as_u32(__high2half2(as_h2(a))); }
  static __device__ __forceinline__ float2 to_float2(uint32_t a) { return __half22float2(as_h2(a)); }
  static __device__ __forceinline__ uint32_t pack(float x, float y) { return as_u32(__floats2half2_rn(x, y)); }
};

template <>
struct Act<__nv_bfloat16> {
  // [MMA] D = A(16x16, row) * B(16x8, col) + D, bf16 inputs, fp32 accumulators.
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // D = A * B (the accumulator input is zero: SASS takes RZ for it, so no register has to be zeroed first)
  static __device__ __forceinline__ void mma_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  }
  static __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    return as_u32(__hmul2(as_b2(a), as_b2(b)));
  }
  static __device__ __forceinline__ uint32_t low2(uint32_t a) { return as_u32(__low2bfloat162(as_b2(a))); }
  static __device__ __forceinline__ uint32_t high2(uint32_t a) { return as_u32(__high2bfloat162(as_b2(a))); }
  static __device__ __forceinline__ float2 to_float2(uint32_t a) { return __bfloat1622float2(as_b2(a)); }
  static __device__ __forceinline__ uint32_t pack(float x, float y) { return as_u32(__floats2bfloat162_rn(x, y)); }
};

// One kernel kind: activation type, weight bits, zero points (true) or symmetric (false).
template <typename ActT_, int BITS_, bool ZP_>
struct Kind {
  using ActT = ActT_;
  static constexpr int kBits = BITS_;
  static constexpr bool kZp = ZP_;
  static_assert(BITS_ == 4 || BITS_ == 8, "weights are 4 or 8 bits");
};

// ------------------------------------------------------------------------------------------------ [DEQ]
// Dequant<ActT, BITS>::run<ZP>(w, zero, frag): the lane's Marlin word(s) of one 16 x 16 tile -> its four mma
// B-fragment registers (pairs of ActT), each value exactly q - z (scales come later).
//
// Which values a lane holds (FORMAT.md sections 2 and 7; lane: c = lane / 4, r = 2 * (lane % 4); row = k, col = n):
// the 1024-entry table gives each lane, per tile, the 8 values (r, c) (r+1, c) (r+8, c) (r+9, c) and the same four
// at column c + 8. The mma.m16n8k16 B fragment of n8-block h (column c + 8h) is b0 = {(r, .), (r+1, .)} and
// b1 = {(r+8, .), (r+9, .)} (low half first). frag = {b0 of h = 0, b1 of h = 0, b0 of h = 1, b1 of h = 1}.
//   4-bit: the 8 values are interleaved [0, 2, 4, 6, 1, 3, 5, 7] into one word, so nibble 0 .. 7 holds
//          (r, c) (r+8, c) (r, c+8) (r+8, c+8) (r+1, c) (r+9, c) (r+1, c+8) (r+9, c+8): nibbles i and i + 4
//          (bits 4i .. 4i+3 and 16+4i ..) are frag[i].
//   8-bit: groups of 4 interleaved [0, 2, 1, 3] into two words, word h holding (r, c+8h) (r+8, ..) (r+1, ..) (r+9, ..)
//          in bytes 0 .. 3: bytes 0 and 2 are frag[2h], bytes 1 and 3 frag[2h + 1].
// Zero points (FORMAT.md section 7 "Asymmetric"): the lane's 8 columns c + 8 jj (jj = 0..7, n8-block jj of the 64)
// sit in the grouped scale order at positions 8c .. 8c+7, interleaved like the weights, packed along n:
//   4-bit: one word zw[0], nibble i = z of jj (0, 2, 4, 6, 1, 3, 5, 7)[i]: tile j (n8-blocks 2j, 2j+1) has its two
//          zero points in nibbles j and j + 4, i.e. bits 0-3 and 16-19 of zw[0] >> 4j.
//   8-bit: two words, zw[j / 2] byte i = z of jj 4 (j / 2) + (0, 2, 1, 3)[i]: tile j has them in bytes j % 2 and
//          j % 2 + 2.
// `Zero` holds one tile's zero points in the form run() subtracts (low half: n8-block 2j, high half: 2j + 1);
// with ZP false run() uses the symmetric constant z = 2^(b-1) instead and ignores `zero`.
template <typename ActT, int BITS>
struct Dequant;

template <>
struct Dequant<half, 4> {
  static constexpr int kWords = 1;  // B words per lane per tile (and zero-point words per lane)
  struct Zero {  // each value in both halves, for n8-block 2j (0) and 2j + 1 (1)
    uint32_t sub0, sub1;  // 1024 + z
    uint32_t add0, add1;  // -(64 + z)
  };
  // Magic numbers, fp16 = sign | 5-bit exponent (bias 15) | 10-bit mantissa:
  //   0x6400 = 2^10 = 1024.0: its mantissa ulp is 1, so 0x6400 | x (x < 1024) is exactly 1024 + x.
  //   b0: 0x6400 | q           = 1024 + q       ; minus (1024 + z)                          -> q - z
  //   b1: 0x6400 | (q << 4)    = 1024 + 16 q    ; times 0x2C00 (= 2^-4: exponent 11 = 15 - 4) -> 64 + q,
  //       plus -(64 + z)                                                                     -> q - z
  //   symmetric z = 8: 1024 + 8 = 0x6408, -(64 + 8) = -72 = 0xD480 (exponent 21 = 15 + 6 -> 64, mantissa 0x080 ->
  //   1.125, 64 * 1.125 = 72).
  //   zero points: 0x6400 | z = 1024 + z (the same trick), and -(64 + z) = 960 - (1024 + z) with 960 = 0x6380
  //   (exponent 24 = 15 + 9 -> 512, mantissa 0x380 -> 1.875).
  // All steps are exact in fp16 (|values| < 2048 and integral), so q - z is exact.
  static __device__ __forceinline__ Zero zero(const uint32_t (&zw)[1], int j) {
    const half2 sub = as_h2(lop3<kAndOr>(zw[0] >> (4 * j), 0x000f000fu, 0x64006400u));
    const half2 add = __hsub2(as_h2(0x63806380u), sub);
    return {as_u32(__low2half2(sub)), as_u32(__high2half2(sub)), as_u32(__low2half2(add)),
            as_u32(__high2half2(add))};
  }
  template <bool ZP>
  static __device__ __forceinline__ void run(const uint32_t* w, const Zero& zero, uint32_t (&frag)[4]) {
    uint32_t q = w[0];
    constexpr uint32_t kLo = 0x000f000fu;   // nibbles 0 and 4
    constexpr uint32_t kHi = 0x00f000f0u;   // nibbles 1 and 5
    constexpr uint32_t kExp = 0x64006400u;  // 1024.0 in both halves
    const uint32_t lo0 = lop3<kAndOr>(q, kLo, kExp);
    const uint32_t hi0 = lop3<kAndOr>(q, kHi, kExp);
    q >>= 8;
    const uint32_t lo1 = lop3<kAndOr>(q, kLo, kExp);
    const uint32_t hi1 = lop3<kAndOr>(q, kHi, kExp);
    const half2 mul = as_h2(0x2c002c00u);  // 1/16
    if constexpr (!ZP) {
      const half2 sub = as_h2(0x64086408u);  // 1032
      const half2 add = as_h2(0xd480d480u);  // -72
      frag[0] = as_u32(__hsub2(as_h2(lo0), sub));           // b0, n8-block 0
      frag[1] = as_u32(__hfma2(as_h2(hi0), mul, add));      // b1, n8-block 0
      frag[2] = as_u32(__hsub2(as_h2(lo1), sub));           // b0, n8-block 1
      frag[3] = as_u32(__hfma2(as_h2(hi1), mul, add));      // b1, n8-block 1
    } else {
      frag[0] = as_u32(__hsub2(as_h2(lo0), as_h2(zero.sub0)));
      frag[1] = as_u32(__hfma2(as_h2(hi0), mul, as_h2(zero.add0)));
      frag[2] = as_u32(__hsub2(as_h2(lo1), as_h2(zero.sub1)));
      frag[3] = as_u32(__hfma2(as_h2(hi1), mul, as_h2(zero.add1)));
    }
  }
};

template <>
struct Dequant<half, 8> {
  static constexpr int kWords = 2;
  struct Zero {
    uint32_t z0, z1;  // 1024 + z in both halves, for n8-blocks 2j and 2j + 1
  };
  // __byte_perm(x, y, sel): byte i of the result is byte (sel >> 4i) & 7 of the 8 bytes {y:x} (x = bytes 0..3).
  // With y = 0x64646464, selector 0x4240 gives bytes (x0, 0x64, x2, 0x64) = two fp16 0x64xx = 1024 + x0, 1024 + x2
  // (0x6400 = 1024.0, mantissa ulp 1, as in the 4-bit path; 1024 + 255 < 2048 still has ulp 1), and 0x4341 the
  // same for bytes 1 and 3. Minus (1024 + z) -> q - z exactly (|q - z| <= 255, integral).
  //   symmetric z = 128: 1024 + 128 = 1152 = 0x6480 (exponent 25 -> 1024, mantissa 0x080 -> 1.125).
  //   zero points: the same byte_perm on the zero-point word gives (1024 + z0, 1024 + z1) directly.
  static __device__ __forceinline__ Zero zero(const uint32_t (&zw)[2], int j) {
    const half2 sub = as_h2(__byte_perm(zw[j >> 1], 0x64646464u, (j & 1) ? 0x4341u : 0x4240u));
    return {as_u32(__low2half2(sub)), as_u32(__high2half2(sub))};
  }
  template <bool ZP>
  static __device__ __forceinline__ void run(const uint32_t* w, const Zero& zero, uint32_t (&frag)[4]) {
    const half2 z0 = as_h2(ZP ? zero.z0 : 0x64806480u);
    const half2 z1 = as_h2(ZP ? zero.z1 : 0x64806480u);
    frag[0] = as_u32(__hsub2(as_h2(__byte_perm(w[0], 0x64646464u, 0x4240u)), z0));  // rows r, r+1, n8-block 0
    frag[1] = as_u32(__hsub2(as_h2(__byte_perm(w[0], 0x64646464u, 0x4341u)), z0));  // rows r+8, r+9
    frag[2] = as_u32(__hsub2(as_h2(__byte_perm(w[1], 0x64646464u, 0x4240u)), z1));  // n8-block 1
    frag[3] = as_u32(__hsub2(as_h2(__byte_perm(w[1], 0x64646464u, 0x4341u)), z1));
  }
};

template <>
struct Dequant<__nv_bfloat16, 4> {
  static constexpr int kWords = 1;
  struct Zero {
    uint32_t z0, z1;  // 128 + z in both halves, for n8-blocks 2j and 2j + 1
  };
  // bf16 = sign | 8-bit exponent (bias 127) | 7-bit mantissa:
  //   0x4300 = 2^7 = 128.0 (exponent 134 = 127 + 7): its mantissa ulp is 1, so 0x4300 | x (x < 128) is exactly
  //   128 + x. Only 7 mantissa bits: a nibble must sit in bits 0-3 (q << 4 would reach the exponent), so each of
  //   the four fragments takes its own shift (w >> 4i, nibbles i and i + 4 in bits 0-3 and 16-19).
  //   Minus (128 + z) -> q - z exactly; symmetric z = 8: 136 = 0x4308 (mantissa 8 / 128 -> 1.0625).
  //   zero points: 0x4300 | z = 128 + z, the same trick on the zero-point word.
  static __device__ __forceinline__ Zero zero(const uint32_t (&zw)[1], int j) {
    const __nv_bfloat162 sub = as_b2(lop3<kAndOr>(zw[0] >> (4 * j), 0x000f000fu, 0x43004300u));
    return {as_u32(__low2bfloat162(sub)), as_u32(__high2bfloat162(sub))};
  }
  template <bool ZP>
  static __device__ __forceinline__ void run(const uint32_t* w, const Zero& zero, uint32_t (&frag)[4]) {
    const uint32_t q = w[0];
    const __nv_bfloat162 z0 = as_b2(ZP ? zero.z0 : 0x43084308u);
    const __nv_bfloat162 z1 = as_b2(ZP ? zero.z1 : 0x43084308u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = lop3<kAndOr>(q >> (4 * i), 0x000f000fu, 0x43004300u);
      frag[i] = as_u32(__hsub2(as_b2(v), i < 2 ? z0 : z1));
    }
  }
  // 128 + q (exact), the zero not subtracted: the kernels with fp32 partial sums subtract (128 + z) times the sum of
  // the activations instead (kOffsetB), 4 instructions fewer per tile.
  static __device__ __forceinline__ void run_offset(const uint32_t* w, uint32_t (&frag)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) frag[i] = lop3<kAndOr>(w[0] >> (4 * i), 0x000f000fu, 0x43004300u);
  }
};

template <>
struct Dequant<__nv_bfloat16, 8> {
  static constexpr int kWords = 2;
  struct Zero {
    float z0, z1;  // 2^23 + z of n8-blocks 2j and 2j + 1
  };
  // 128 + q does not fit bf16's 8 significant bits for q >= 128, so the values go through fp32:
  //   0x4B000000 = 2^23 (exponent 150 = 127 + 23): mantissa ulp 1, so 0x4B0000xx is exactly 2^23 + x. Selector
  //   0x744i of __byte_perm(w, 0x4B000000, .) builds (byte i of w, 0x00, 0x00, 0x4B) = that float for byte i.
  //   Minus (2^23 + z) -> q - z exactly in fp32; |q - z| <= 255 has at most 8 significant bits, so the conversion
  //   to bf16 (cvt.rn.bf16x2.f32) is exact too.
  //   symmetric z = 128: 2^23 + 128 = 8388736.0f (0x4B000080).
  //   zero points: the same byte_perm on the zero-point word gives 2^23 + z.
  static __device__ __forceinline__ Zero zero(const uint32_t (&zw)[2], int j) {
    const uint32_t word = zw[j >> 1];
    return {__uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (j & 1))),
            __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | ((j & 1) + 2)))};
  }
  template <bool ZP>
  static __device__ __forceinline__ void run(const uint32_t* w, const Zero& zero, uint32_t (&frag)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float z = ZP ? (h == 0 ? zero.z0 : zero.z1) : 8388736.0f;
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(__byte_perm(w[h], 0x4B000000u, 0x7440u | i)) - z;
      frag[2 * h] = as_u32(__floats2bfloat162_rn(v[0], v[2]));      // rows r, r+1 (bytes 0, 2)
      frag[2 * h + 1] = as_u32(__floats2bfloat162_rn(v[1], v[3]));  // rows r+8, r+9 (bytes 1, 3)
    }
  }
};

// Dequant<bf16, 4>::run_offset for the kernel's kOffsetB path (the other kinds have none: never called for them).
template <class DQ>
__device__ __forceinline__ void dequant_offset(const uint32_t* w, uint32_t (&frag)[4]) {
  if constexpr (std::is_same<DQ, Dequant<__nv_bfloat16, 4>>::value) DQ::run_offset(w, frag);
}

// [DEQ] the grouped scales onto one tile's four fragments (16-bit): word sw holds the scales of n8-blocks 2j (low half:
// f[0], f[1]) and 2j + 1 (high half: f[2], f[3]).
template <class Ops>
__device__ __forceinline__ void scale_tile(uint32_t (&f)[4], uint32_t sw) {
  const uint32_t s0 = Ops::low2(sw), s1 = Ops::high2(sw);
  f[0] = Ops::mul2(f[0], s0);
  f[1] = Ops::mul2(f[1], s0);
  f[2] = Ops::mul2(f[2], s1);
  f[3] = Ops::mul2(f[3], s1);
}

// ------------------------------------------------------------------------------------------------ the kernel

// How a warp's strips of one stage take their grouped scales and zero points (the kernel's strips()).
constexpr int kPerStrip = 0;     // each strip its own scale row and zero points
constexpr int kOneGroupF32 = 1;  // all in one group: unscaled B, fp32 partial sums scaled once (kF32Scale)
constexpr int kOneGroupB = 2;    // all in one group: scale row and zero points read once, scales on B in 16 bits

// Compile-time shape of one configuration. WG: the wgmma kernel (SWAP 3): no split of k inside the block (kWK = 1),
// and A stages of 128-byte-swizzled atoms that must start 1024-byte aligned (wgmma_desc_sw128): every stage a multiple
// of 1024 bytes, plus 1024 bytes of room to align the start of dynamic shared memory.
template <int MB, int WN, int STRIPS, int STAGES, bool GROUPED, int BITS = 4, bool ZP = false, bool WG = false>
struct Tile {
  static constexpr int kWK = WG ? 1 : kWarps / WN;       // warps side by side along k (wgmma: both warpgroups
                                                          // take every strip, each two of its four tiles)
  static constexpr int kRows = 16 * MB;                   // A rows per block (MB 16-row m-blocks)
  static constexpr int kTN = 64 * WN;                     // output columns per block (WN 64-column groups)
  static constexpr int kStageStrips = STRIPS * kWK;       // 16-row k-strips per stage
  static constexpr int kStageK = 16 * kStageStrips;       // k per stage
  static constexpr int kAChunks = kStageK / 8;            // 16-byte chunks (8 values) per A row per stage
  static constexpr int kABytes = kRows * kStageK * 2;     // A tile (16-bit values)
  static constexpr int kPieceInt4 = 32 * BITS / 4;        // a 16 x 64 piece of B: 512 (4-bit) / 1024 bytes in int4
  static constexpr int kBBytes = kStageStrips * WN * kPieceInt4 * 16;
  static constexpr int kSBytes = GROUPED ? kStageStrips * kTN * 2 : 0;  // at most one scale row per strip
  // zero-point rows (grouped only; channelwise zero points are read once into registers): 64 columns = 8 * BITS bytes
  static constexpr int kZBytes = GROUPED && ZP ? kStageStrips * WN * 8 * BITS : 0;
  // (wgmma: rounded up to whole 1024-byte units, so every stage's A atoms start 1024-byte aligned)
  static constexpr int kStageBytes = WG ? (kABytes + kBBytes + kSBytes + kZBytes + 1023) / 1024 * 1024
                                        : kABytes + kBBytes + kSBytes + kZBytes;
  static constexpr int kPipeBytes = STAGES * kStageBytes;
  // [RED] in-block reduction area, one m-block at a time: 8 warps x 8 n8-blocks x 4 floats x 32 lanes.
  static constexpr int kRedBytes = kWarps * 8 * 4 * 32 * 4;
  static constexpr int kAlignBytes = WG ? 1024 : 0;
  static constexpr int kSmemBytes = (kPipeBytes > kRedBytes ? kPipeBytes : kRedBytes) + kAlignBytes;
  // [RED] in a cluster (wgmma): behind the in-block area, the partial sums pushed to this block, one float2 per
  // thread for each of the (splits x ceil(kClusterPairs / splits)) entries, at most kClusterPairs + kMaxClusterRed - 1
  // (kClusterPairs = the output pairs each thread holds: MB m-blocks x WN * 512 / kThreads).
  static constexpr int kClusterPairs = MB * (WN * 512 / kThreads);
  static constexpr int kClusterSmemBytes = kAlignBytes + kRedBytes + (kClusterPairs + kMaxClusterRed - 1) * kThreads * 8;

  static_assert(kWarps % WN == 0, "WN must divide the 8 warps");
  static_assert(kAChunks >= 8, "the A swizzle XORs 3 bits of the chunk index: a stage needs >= 64 k");
  static_assert((kRows * kAChunks) % kThreads == 0, "A tile copies must split evenly over the threads");
  static_assert(kBBytes / 16 % kThreads == 0, "B tile copies: a whole number of 16-byte copies per thread");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert(!WG || (kABytes % 1024 == 0 && kStageK % 64 == 0 && WN == 4),
                "wgmma stages: 1024-byte multiples, whole 64-wide k atoms, 4 warps of 64 columns per warpgroup");
};

// Blocks per SM the register allocation must allow: 3 for the 16-row kernels (72 KB of shared memory at 2 strips
// x 4 stages), except the two-batch-block swapped kernels with 12 / 16 strip-stages (3 strips x 4 or 2 x 6 stages:
// 108 KB, 4 x 4: 144 KB), whose shared memory only fits 2 / 1 blocks anyway (32 accumulators spill at 85 registers).
// The swapped one-batch-block kernels likewise take the 1 / 2 limits (their fp32 group partial sums need registers).
// 8-bit kernels (twice the B bytes per strip) take at most the blocks their shared memory fits on a multiprocessor;
// grouped zero-point kernels and grouped unswapped 8-bit kernels at most 2 (at 3 blocks = 80 registers they spilled
// 8-48 bytes, the latter on sm_80). The 4-bit 32-row kernels (MB = 2) 2: they took 132 registers, one block per SM;
// at 128 they do not spill, and fp16 x 4-bit m = 32 went from 0.89x to 1.02x of torch (H200, group 128); except the
// grouped zero-point ones (4 bytes of spill on sm_80). The 64-row ones (128 accumulators) stay at 1, and so do the wgmma
// kernels (SWAP 3: 64 / 128 accumulators).
template <int MB, int WN, int STRIPS, int STAGES, bool GROUPED, int SWAP, int BITS, bool ZP>
__host__ __device__ constexpr int min_blocks() {
  constexpr int by_strips = SWAP == 3 || (MB == 2 && STRIPS == 8) ? 1  // (32 rows x 8 strips: one block per SM)
                         : MB == 2 && BITS == 4 && !(ZP && GROUPED) ? 2 : MB != 1 ? 1 : SWAP == 0 ? 3
                         : WN == 2 && STRIPS == 8 ? 2  // (128-column tiles, 8 x 2: 112 KB, two fit an SM)
                         : STRIPS * STAGES >= 16 ? 1 : STRIPS * STAGES >= 12 ? 2
                         : STRIPS == 4 ? 2 : 3;  // 4 strips x 2 stages: 4-bit spilled at 3
  constexpr int fit = kSmemPerSm / Tile<MB, WN, STRIPS, STAGES, GROUPED, BITS, ZP>::kSmemBytes;
  constexpr int by_smem = BITS == 4 ? by_strips : (fit < 1 ? 1 : fit < by_strips ? fit : by_strips);
  return GROUPED && (ZP || (BITS == 8 && SWAP == 0)) && by_smem > 2 ? 2 : by_smem;
}

// Template parameters:
//   K          Kind<ActT, BITS, ZP>: activation / scale / output type (half or __nv_bfloat16), weight bits (4, 8),
//              zero points (ZP true: from Z; false: symmetric, z = 2^(BITS-1))
//   MB         16-row m-blocks per thread block: 1, 2 or 4 (m rows 16, 32, 64 per block)
//   WN         64-column warp groups per block (n-tile width 64 * WN); the other 8 / WN warps split k
//   STRIPS     16-row k-strips each warp handles per stage
//   STAGES     pipeline depth (shared-memory stages)
//   GROUPED    true: grouped scales applied to B before the mma; false: channelwise, applied to C in fp32
//   SWAP       0: C = A W (A = mma A operand); 1: C^T = W^T A^T with one 8-row batch block (m <= 8 per chunk);
//              2: C^T = W^T A^T with two 8-row batch blocks (rows 0-7 and 8-15 of the 16-row chunk, m <= 16);
//              3: C^T = W^T A^T through wgmma (sm_90a; WN = 4): each warpgroup's four warps, one per 64 columns, give
//              their tile j of a strip as rows of one m64 x n(16 MB) x k16 wgmma (j = 0..3), the activations come
//              straight from shared memory (no ldmatrix), 2 MB batch blocks of 8 rows (the 16 MB rows of a chunk)
//   NO_F32_SCALE  benchmark only: grouped scales always on B in 16-bit (the previous kernel, see kF32Scale)
//   SEGMENTS   false: each block works on one tile (split-K, units_per_block divides tile_units); true: a block may
//              work on several (stream-K), with the next segment's first stages copied during the reduction
// Arguments:
//   A          ActT [m, k] row-major (as int4 = 8 values), act-order already gathered
//   B          int32 [k / 16, n * BITS / 2] Marlin tiles (as int4: row stride n * BITS / 8 int4)
//   S          ActT [scale_rows, n] permuted scales (as int4: row stride n / 8 int4)
//   Z          int32 [scale_rows, n * BITS / 32] zero points in the Marlin order (as int4: row stride n * BITS / 128
//              int4); only read when ZP
//   C          ActT [m, n] row-major output
//   locks      int32 workspace, zero on entry and on exit; one int per (ntile, mchunk) of a tile with > 1 contributor
//   m, n, k    problem size; group_size = k / scale_rows (only read when GROUPED)
//   group_shift log2(group_size) when it is a power of two (then k / g is a shift), else -1 (division)
//   tile_units, units_per_block   the work of block blockIdx.x / m_chunks (see "which rows, which tiles" below):
//              split-K over `splits` ranges of stages_per_split stages: splits * stages_per_split, stages_per_split;
//              stream-K: the k stages of one tile, the stages each block takes (across tile boundaries)
//   cluster_red   1: [RED] in a cluster (the wgmma kernel in split-K, m_chunks == 1, launched in clusters of
//              `splits` blocks with T::kClusterSmemBytes of shared memory; the locks are not touched); 0: the lock chain
template <class K, int MB, int WN, int STRIPS, int STAGES, bool GROUPED, int SWAP, bool NO_F32_SCALE = false,
          bool SEGMENTS = false>
__global__ void __launch_bounds__(kThreads, min_blocks<MB, WN, STRIPS, STAGES, GROUPED, NO_F32_SCALE ? 0 : SWAP,
                                                       K::kBits, K::kZp>())
    marlin_gemm_kernel(const int4* __restrict__ A, const int4* __restrict__ B, const int4* __restrict__ S,
                       const int4* __restrict__ Z, typename K::ActT* __restrict__ C, int* __restrict__ locks, int m,
                       int n, int k, int group_size, int group_shift, int tile_units, int units_per_block,
                       int cluster_red) {
  static_assert(SWAP >= 0 && SWAP <= 3 && (SWAP == 0 || SWAP == 3 || MB == 1),
                "the swapped mma.sync (W^T x A^T) path serves m <= 16 only");
  static_assert(SWAP != 3 || (WN == 4 && !NO_F32_SCALE), "wgmma: a warpgroup is 4 warps of 64 columns");
  constexpr int BITS = K::kBits;
  constexpr bool ZP = K::kZp;
  constexpr bool WG = SWAP == 3;
  using T = Tile<MB, WN, STRIPS, STAGES, GROUPED, BITS, ZP, WG>;
  using Ops = Act<typename K::ActT>;
  using DQ = Dequant<typename K::ActT, BITS>;
  constexpr int kWords = DQ::kWords;  // B words per lane per tile = zero-point words per lane
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // (wgmma) the pipeline from the first 1024-byte boundary on: Tile's kAlignBytes left room for it
  unsigned char* const smem = WG ? smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) : smem_raw;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wn = warp % WN;  // this warp's 64 columns inside the tile
  const int wk = WG ? 0 : warp / WN;  // this warp's k-slot inside a stage
  const int jh = WG ? warp / WN : 0;  // (wgmma) this warpgroup's half of the tiles: 2 jh, 2 jh + 1

  // ---- which rows, which tiles and k ranges. Block `blk` owns the units [units_lo, units_hi) of the flattened
  // (n-tile, k-stage) space, unit = ntile * tile_units + stage (stages >= total_stages of a tile are padding, skipped).
  // Split-K: tile_units = splits * stages_per_split and units_per_block = stages_per_split, so block
  // ntile * splits + split owns stages [split * stages_per_split, ...) of tile ntile. Stream-K: tile_units =
  // total_stages and units_per_block = (all units) / grid, so every block gets the same number of stages and a block
  // may end one tile and start the next (two or more segments). Each tile's contributors add their partial sums into
  // C in block order, through the tile's lock ([RED] below).
  const int m_chunks = (m + T::kRows - 1) / T::kRows;
  const int mchunk = blockIdx.x % m_chunks;
  const int blk = blockIdx.x / m_chunks;
  const int row0 = mchunk * T::kRows;
  const int k_strips = k / 16;
  const int total_stages = (k_strips + T::kStageStrips - 1) / T::kStageStrips;
  const int units_lo = blk * units_per_block;
  const int units_hi = min(units_lo + units_per_block, (n / T::kTN) * tile_units);

  // group of a k index: a shift for the power-of-two group sizes (all GPTQ uses), a division otherwise
  auto group_of = [&](int kk) { return group_shift >= 0 ? (kk >> group_shift) : (kk / group_size); };
  const int b_row_int4 = n * BITS / 8;    // B row: n * BITS / 2 words
  const int s_row_int4 = n / 8;           // scale row: n 16-bit values
  const int z_row_int4 = n * BITS / 128;  // zero-point row: n * BITS / 32 words

  // ---- [G2S] per-thread constants of the copies. A stage's B tile is kStageStrips strips of kBPiece int4 (the WN
  // 64-column pieces side by side, as they lie in B); thread tid's copy j is int4 tid + j * kThreads of it: strip
  // b_strip + j * kBStripsPerPass, int4 tid % kBPiece of that strip. Its global offset (int4, from B) is
  // b_thread + ntile * kBPiece + st * b_stage + j * b_pass: 32-bit offsets (the host checks that B has fewer than 2^32
  // int4), so a stage's copies cost an add and an address each, not the 64-bit index arithmetic of every copy from
  // scratch (ncu, H200, 8192 x 10240 m = 1 g128: about 45 of the ~390 instructions per warp and stage went to that).
  constexpr int kBPiece = WN * T::kPieceInt4;
  static_assert(kThreads % kBPiece == 0, "one pass of the threads covers whole strips of the B tile");
  constexpr int kBStripsPerPass = kThreads / kBPiece;
  const int b_strip = tid / kBPiece;
  const uint32_t b_thread = (uint32_t)b_strip * (uint32_t)b_row_int4 + (uint32_t)(tid % kBPiece);
  const uint32_t b_pass = (uint32_t)kBStripsPerPass * (uint32_t)b_row_int4;
  const uint32_t b_stage = (uint32_t)T::kStageStrips * (uint32_t)b_row_int4;
  // The A copies likewise where one pass of the threads covers whole rows of the A tile (kAChunks divides kThreads;
  // the 3-strip kernels' 48 chunks per row do not): copy j is row a_row + j * kARowsPerPass, chunk a_ch, at int4
  // a_first + k0 / 8 + j * a_pass of A (32-bit: the host checks (m + 128) * k / 8 < 2^32).
  constexpr bool kAPasses = kThreads % T::kAChunks == 0;
  constexpr int kARowsPerPass = kAPasses ? kThreads / T::kAChunks : 1;
  const int a_row = tid / T::kAChunks;
  const int a_ch = tid % T::kAChunks;
  const uint32_t a_first = (uint32_t)(row0 + a_row) * (uint32_t)(k / 8) + (uint32_t)a_ch;
  const uint32_t a_pass = (uint32_t)kARowsPerPass * (uint32_t)(k / 8);
  // The grouped scale rows (kSPer int4 each) and zero-point rows (kZInt4) of a stage, at most kStageStrips of each.
  constexpr int kSPer = WN * 8;
  constexpr int kZInt4 = WN * BITS / 2;  // int4 of one zero-point row of the tile (64 columns: 8 * BITS bytes)
  constexpr int kSRowsPerPass = kThreads / kSPer, kZRowsPerPass = kThreads / kZInt4;
  constexpr int kSPasses = (T::kStageStrips + kSRowsPerPass - 1) / kSRowsPerPass;
  constexpr int kZPasses = (T::kStageStrips + kZRowsPerPass - 1) / kZRowsPerPass;
  const int s_r = tid / kSPer, z_r = tid / kZInt4;
  const uint32_t s_thread = (uint32_t)s_r * (uint32_t)s_row_int4 + (uint32_t)(tid % kSPer);  // + ntile * kSPer
  const uint32_t z_thread = (uint32_t)z_r * (uint32_t)z_row_int4 + (uint32_t)(tid % kZInt4);  // + ntile * kZInt4

  // ---- [G2S] issue the copies of pipeline stage `st` (absolute k stage) of n-tile `ntile` into shared slot `slot`
  auto load_stage = [&](int slot, int ntile, int st) {
    unsigned char* base = smem + slot * T::kStageBytes;
    uint16_t* sA = reinterpret_cast<uint16_t*>(base);
    int4* sB = reinterpret_cast<int4*>(base + T::kABytes);
    int4* sS = reinterpret_cast<int4*>(base + T::kABytes + T::kBBytes);
    int4* sZ = reinterpret_cast<int4*>(base + T::kABytes + T::kBBytes + T::kSBytes);
    const int k0 = st * T::kStageK;
    const int strip0 = st * T::kStageStrips;
    // A: kRows x kAChunks 16-byte chunks. Rows >= m and columns >= k are not copied: a garbage A row only
    // reaches the same (never written) C row, and strips past k are skipped in the compute.
    // The 16-byte chunk ch of row r is stored at chunk (ch ^ (r & 7)): ldmatrix then reads 8 rows of one
    // logical chunk from 8 different 16-byte bank groups (row stride kStageK * 2 bytes is a multiple of 128).
    // wgmma (WG): in 64-wide k atoms, atom ch / 8 holding the kRows rows of 128 bytes each, chunk ch % 8 of row r at
    // (ch % 8) ^ (r & 7): the 128-byte swizzle of wgmma_desc_sw128.
    auto a_at = [&](int r, int ch) {
      return WG ? (ch >> 3) * (T::kRows * 64) + r * 64 + (((ch & 7) ^ (r & 7)) * 8)
                : r * T::kStageK + ((ch ^ (r & 7)) * 8);
    };
    auto copy_a = [&](int i) {
      const int r = i / T::kAChunks;
      const int ch = i % T::kAChunks;
      const int grow = row0 + r;
      const int gcol = k0 + ch * 8;
      const bool ok = grow < m && gcol < k;
      cp_async16(sA + a_at(r, ch), A + ((size_t)grow * k + gcol) / 8, ok);
    };
    if constexpr (kAPasses) {
      const uint32_t at = a_first + (uint32_t)(k0 / 8);
      const bool col_ok = k0 + a_ch * 8 < k;
      const int rows = m - row0;  // rows of A from this chunk on
#pragma unroll
      for (int j = 0; j < T::kRows * T::kAChunks / kThreads; ++j) {
        const int r = a_row + j * kARowsPerPass;
        if (SWAP == 1 && r >= rows) break;  // m <= 8: only the rows < m are visited (as below)
        cp_async16(sA + a_at(r, a_ch), A + (at + (uint32_t)j * a_pass), col_ok && r < rows);
      }
    } else if constexpr (SWAP == 1) {
      // m <= 8 (one batch block): only the rows < m are visited. At m = 1 that is 1 / 16 of the tile, and the
      // predicated-off copies of the others cost as many instructions as real ones (H200, m = 1: 8192 x 8192
      // 22.4 -> 19.5 us, kernel/NOTES.md). a_chunks is computed here: kept live across the main loop it made one
      // kernel spill. The other kernels keep the plain predicated loop (with the early exit, m = 16 ran up to 12 %
      // slower).
      const int a_chunks = min(m - row0, T::kRows) * T::kAChunks;
#pragma unroll
      for (int i = tid; i < T::kRows * T::kAChunks; i += kThreads) {
        if (i >= a_chunks) break;
        copy_a(i);
      }
    } else {
#pragma unroll
      for (int i = tid; i < T::kRows * T::kAChunks; i += kThreads) copy_a(i);
    }
    // B: kStageStrips strips x WN pieces of kPieceInt4 int4, copied as they lie (lane l's int4 is l for 4-bit, 2l and
    // 2l + 1 for 8-bit): consecutive threads copy consecutive 16 bytes into consecutive shared memory. (An earlier
    // 8-bit version stored int4 2l, 2l + 1 at l and 32 + l for conflict-free reads; ncu showed that this scatter
    // split every cp.async into one-sector L2 requests, each sector requested twice: L2 86.7 % busy, 60 % hits,
    // kernel/NOTES.md. The reads in strips() avoid the bank conflicts instead.)
    {
      const uint32_t at = b_thread + (uint32_t)(ntile * kBPiece) + (uint32_t)st * b_stage;
      const int strips_left = k_strips - strip0 - b_strip;  // copy j's strip is inside k: j * kBStripsPerPass < this
#pragma unroll
      for (int j = 0; j < T::kBBytes / 16 / kThreads; ++j)
        cp_async16(sB + tid + j * kThreads, B + (at + (uint32_t)j * b_pass), j * kBStripsPerPass < strips_left);
    }
    // Scales and zero points (grouped): the distinct rows k0 / g .. (last k of the stage) / g, kTN values each.
    if constexpr (GROUPED) {
      const int kend = min(k0 + T::kStageK, k);
      const int r0 = group_of(k0);
      const int nrows = group_of(kend - 1) - r0 + 1;  // <= kStageStrips since group_size >= 16
      // as the B copies: thread tid copies int4 tid + p * kThreads of the stage's rows (row s_r + p * kSRowsPerPass),
      // at a per-thread 32-bit offset plus r0 rows (the scales and zero points are far smaller than B)
      const uint32_t s_at = s_thread + (uint32_t)(ntile * kSPer) + (uint32_t)r0 * (uint32_t)s_row_int4;
#pragma unroll
      for (int p = 0; p < kSPasses; ++p)
        if (s_r + p * kSRowsPerPass < nrows)
          cp_async16(sS + tid + p * kThreads, S + (s_at + (uint32_t)(p * kSRowsPerPass * s_row_int4)), true);
      if constexpr (ZP) {
        const uint32_t z_at = z_thread + (uint32_t)(ntile * kZInt4) + (uint32_t)r0 * (uint32_t)z_row_int4;
#pragma unroll
        for (int p = 0; p < kZPasses; ++p)
          if (z_r + p * kZRowsPerPass < nrows)
            cp_async16(sZ + tid + p * kThreads, Z + (z_at + (uint32_t)(p * kZRowsPerPass * z_row_int4)), true);
      }
    }
  };

  // The unswapped 32-row kernel with 8 strips per warp and stage (128 k: one group of 128; one block per SM): see
  // kF32Scale.
  constexpr bool kEightStrip32 = SWAP == 0 && MB == 2 && STRIPS == 8 && BITS == 4;
  // kF32Scale (grouped, swapped; two batch blocks only in the <= 2-blocks-per-SM kernels, whose limit leaves room for
  // the 32 partial sums, and with zero points only in the 1-block-per-SM ones: at 2 blocks per SM those spilled 4-36
  // bytes; at 1, m = 16, group 128 on the H200: fp16 x 4-bit zp 4096 x 4096 12.6 -> 11.3 us, 11008 x 4096 23.9 -> 20.9,
  // fp16 x 8-bit zp 28672 x 8192 102.5 -> 87.0, 8192 x 8192 32.5 -> 27.6): when all of a warp's strips of the stage lie
  // in one group, they are multiplied unscaled into fp32 partial sums, and the group's scales are applied to those
  // once, in fp32 (16 / 32 FFMA per stage instead of 4 hmul2 per tile per strip, one scale load instead of one per
  // strip); otherwise (a group boundary inside the warp's strips) the scales go onto B in 16 bits as in the other
  // kernels.
  constexpr bool kF32Scale =
      GROUPED && !NO_F32_SCALE &&
      (SWAP == 1 || (SWAP == 2 && min_blocks<MB, WN, STRIPS, STAGES, GROUPED, SWAP, BITS, ZP>() <= (ZP ? 1 : 2) &&
                     !(BITS == 8 && STAGES == 2)) ||  // (the 8-bit 2-stage one spilled 4 bytes with it)
       (SWAP == 0 && kEightStrip32));
  // The other grouped kernels (scales on B in 16 bits): when all of a warp's strips of the stage lie in one group,
  // the scale row and the zero points are read, and the zeros derived, once per stage instead of once per strip
  // (kOneGroupB below). No extra accumulators, so it fits where kF32Scale spilled.
  // The wgmma kernel has this path only (every stage in one group: launch_wgmma takes it only where the group size is
  // a multiple of the stage's k): with the per-strip path beside it in one stage loop, ptxas serialised the 8-strip
  // grouped wgmma (warning C7511, at any register count), and with the per-strip path alone the extra scale and zero
  // reads made it slower (kernel/NOTES.md, seventh session).
  constexpr bool kHoistOneGroup = GROUPED && !kF32Scale && STRIPS > 1;
  constexpr bool kOnlyOneGroup = GROUPED && WG;
  static_assert(!kOnlyOneGroup || kHoistOneGroup, "the wgmma kernel's one path is the hoisted one-group path");
  // bf16 x 4-bit in kF32Scale's one-group stages (fp32, unscaled partial sums of at most 16 * STRIPS k per warp):
  // W = (q - z) s is computed as s ((128 + q) - (128 + z)) with (128 + z) times the activations' sum over those k
  // subtracted from the partial sums at the stage's flush, so B needs no subtraction (Dequant::run_offset): 4 of 11
  // dequant instructions per tile, for one more mma per strip and batch block. 128 + q and the activations are exact
  // in bf16, their products in fp32. The cancellation grows with the activations' mean over the summed k (about
  // 7 bits for mean 0.5 over 64 k, leaving ~17 of fp32's 24, far more than bf16's 8); so it is done per stage, not
  // over a whole channelwise k range (a review modelled 1e-2 errors there for truncating fp32 mma accumulation).
  constexpr bool kOffsetB =
      std::is_same<typename K::ActT, __nv_bfloat16>::value && BITS == 4 && SWAP != 0 && kF32Scale;
  constexpr uint32_t kOnes = 0x3f803f80u;  // bf16 1.0 (exponent 127, mantissa 0) in both halves
  // this lane's zero-point words of scale row `srow` of the stage in slot `slot` (grouped); the per-tile Zero is
  // derived from them where it is used (a few integer ops, fewer registers than holding four of them)
  auto zero_row = [&](int slot, int srow, uint32_t (&zw)[kWords]) {
    const uint32_t* sZ = reinterpret_cast<const uint32_t*>(smem + slot * T::kStageBytes + T::kABytes + T::kBBytes +
                                                           T::kSBytes);
    const int at = ((srow * WN + wn) * 8 + (lane >> 2)) * kWords;
    if constexpr (kWords == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(sZ + at);
      zw[0] = v.x;
      zw[1] = v.y;
    } else {
      zw[0] = sZ[at];
    }
  };
  // (kOffsetB) 128 + z as floats for this lane's columns in n8-blocks 2j and 2j + 1, from its zero-point word zw of
  // the stage's scale row (nibbles j and j + 4, Dequant<bf16, 4>): 0x43000000 = 128.0f has exponent 134 = 127 + 7, so
  // its mantissa ulp is 2^(7 - 23) = 2^-16 and 0x43000000 | (z << 16) is exactly 128 + z; a shift and a lop3 each.
  // 136 (z = 8) without zero points.
  auto offset_zero = [&](const uint32_t (&zw)[kWords], int j) {
    if constexpr (kOffsetB && ZP) {
      return make_float2(__uint_as_float(lop3<kAndOr>(zw[0] << (16 - 4 * j), 0x000f0000u, 0x43000000u)),
                         __uint_as_float(lop3<kAndOr>(zw[0] >> (4 * j), 0x000f0000u, 0x43000000u)));
    } else {
      return make_float2(136.0f, 136.0f);
    }
  };

  // ---- the block's segments (one per tile it touches), last first: a block's last segment is the head (stage 0 on) of
  // its tile, whose contributor 0 never waits for the lock, so it is done early; the first segment, a tile's tail,
  // waits for the blocks before it, which by then have finished theirs (each takes its last segment first too).
  struct Segment {
    int ntile, stage_begin, n_stages;
  };
  int seg_end = units_hi;  // the units before this are still to do
  auto next_segment = [&](Segment& sg) {
    while (seg_end > units_lo) {
      const int ntile = (seg_end - 1) / tile_units;
      const int tile_lo = ntile * tile_units;
      const int stage_begin = max(units_lo, tile_lo) - tile_lo;
      const int stage_end = min(seg_end - tile_lo, total_stages);
      seg_end = tile_lo + stage_begin;
      if (stage_begin < stage_end) {  // (else padding units only: split-K never makes such a block)
        sg = Segment{ntile, stage_begin, stage_end - stage_begin};
        return true;
      }
    }
    return false;
  };
  // Pipeline slots: stage j of a segment (j = 0 .. n_stages - 1) lives in slot (j + 1) % STAGES, so the first STAGES -
  // 1 stages of a segment never use slot 0. Where the [RED] area (from the start of shared memory) fits in slot 0
  // (kOverlapNext), the next segment's first stages are copied while this one's partial sums are reduced, so a block
  // with several segments waits for memory once, not once per segment.
  // (The one-segment kernels keep slot j % STAGES.)
  constexpr bool kOverlapNext = SEGMENTS && T::kRedBytes <= T::kStageBytes;
  auto slot_of = [](int j) { return (j + (SEGMENTS ? 1 : 0)) % STAGES; };
  auto prologue = [&](const Segment& sg) {  // the copies of the segment's first STAGES - 1 stages
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < sg.n_stages) load_stage(slot_of(s), sg.ntile, sg.stage_begin + s);
      cp_async_commit();  // always commit (possibly empty) so the group count stays aligned
    }
  };
  TraceClock trace;
  trace.stamp(0, 0.0f);
  Segment seg{0, 0, 0};
  bool have_seg = next_segment(seg);
  // ---- [PDL] let the next kernel start, then wait for the one before: nothing above read or wrote memory
  grid_launch_dependents();
  grid_dependency_wait();
  if (have_seg) prologue(seg);
  trace.stamp(1, 0.0f);
  while (have_seg) {
    const int ntile = seg.ntile;
    const int stage_begin = seg.stage_begin;
    const int n_stages = seg.n_stages;
    // this tile's contributors are blocks tile_lo / units_per_block .. (its last real unit) / units_per_block
    const int tile_lo = ntile * tile_units;
    const int split = blk - tile_lo / units_per_block;
    const int splits = (tile_lo + total_stages - 1) / units_per_block - tile_lo / units_per_block + 1;
    const int col0 = ntile * T::kTN;

    // Channelwise zero points (one row, constant over k): this lane's words, read once.
    uint32_t zconst[kWords] = {};
    if constexpr (ZP && !GROUPED) {
      const uint32_t* z32 = reinterpret_cast<const uint32_t*>(Z);
#pragma unroll
      for (int i = 0; i < kWords; ++i) zconst[i] = __ldg(z32 + ((col0 / 64 + wn) * 8 + (lane >> 2)) * kWords + i);
    }

    // accumulators: per m-block, 8 n8-blocks (unswapped), batch block x tile (swapped: 4 h + j; wgmma: 2 h + jj,
    // the warpgroup's two tiles)
    constexpr int kAccN = WG ? 4 : 8;
    float acc[MB][kAccN][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
      for (int nb = 0; nb < kAccN; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mb][nb][i] = 0.0f;
    float rs_unused[2][4];  // strips()' activation sums, written only in kOneGroupF32 mode (kOffsetB)

    // ---- [S2R] + [DEQ] + [MMA] on shared slot `slot` holding absolute stage `st`
    // strips(mode, d): this warp's strips of the stage into accumulators d. mode::value (kPerStrip, kOneGroupF32 or
    // kOneGroupB, the constants above the Tile struct):
    //   kPerStrip     grouped: each strip reads its own scale row (and zero points); channelwise: no scales here
    //   kOneGroupF32  all of them lie in one group (the caller checked): leave B unscaled (the caller scales the fp32
    //                 partial sums d) and read the zero points once
    //   kOneGroupB    all of them lie in one group: the scales go onto B in 16 bits as in kPerStrip, but the scale row
    //                 and the zero points are read, and the zeros derived, once for all the strips
    // With kOffsetB (bf16 x 4-bit) in kOneGroupF32 mode, B is 128 + q and rs[h] gets the sums of batch block h's
    // activations over the strips (an mma with an all-ones W^T); the caller subtracts (128 + z) * rs.
    auto strips = [&](auto mode_tag, float (&d)[MB][kAccN][4], float (&rs)[2][4], int slot, int st) {
      constexpr int kMode = decltype(mode_tag)::value;
      constexpr bool kOneGroup = kMode != kPerStrip;
      constexpr bool kScaleB = GROUPED && kMode != kOneGroupF32;
      [[maybe_unused]] constexpr bool kOffset = kOffsetB && kMode == kOneGroupF32;
      const unsigned char* base = smem + slot * T::kStageBytes;
      const uint16_t* sA = reinterpret_cast<const uint16_t*>(base);
      const int4* sB = reinterpret_cast<const int4*>(base + T::kABytes);
      const int4* sS = reinterpret_cast<const int4*>(base + T::kABytes + T::kBBytes);
      const int strip0 = st * T::kStageStrips;
      uint32_t zw[kWords];  // this lane's zero-point words (ZP)
#pragma unroll
      for (int i = 0; i < kWords; ++i) zw[i] = zconst[i];
      // the one scale row of this warp's strips (the one-group modes)
      const int srow_once = kOneGroup ? group_of((strip0 + wk * STRIPS) * 16) - group_of(st * T::kStageK) : 0;
      if constexpr (ZP && GROUPED && kOneGroup) zero_row(slot, srow_once, zw);
      int4 sc_once = make_int4(0, 0, 0, 0);
      if constexpr (GROUPED && kMode == kOneGroupB) sc_once = sS[srow_once * WN * 8 + wn * 8 + (lane >> 2)];
      // Zero points that hold for every strip here (channelwise, or the warp's strips in one group): the four tiles'
      // Zero values once, not once per strip.
      constexpr bool kZeroOnce = ZP && (!GROUPED || kOneGroup);
      typename DQ::Zero zero_once[4] = {};
      if constexpr (kZeroOnce) {
#pragma unroll
        for (int j = 0; j < 4; ++j) zero_once[j] = DQ::zero(zw, j);
      }
      // The strips, twice in the 4-bit mma.sync kernels: without a guard per strip where all of this warp's strips lie
      // inside k (every stage but possibly the last), so that ptxas computes their shared-memory addresses once (with
      // a branch around every strip it recomputed them for each: ~20 of a strip's ~90 instructions in the swapped
      // kernels, kernel/NOTES.md); with the guard otherwise.
      auto strip_loop = [&](auto guard_tag) {
      constexpr bool kGuard = decltype(guard_tag)::value;
#pragma unroll
      for (int ls = 0; ls < STRIPS; ++ls) {
        const int strip = wk * STRIPS + ls;  // strip inside the stage
        // (the one-group path's first strip is always there: compute_stage checked it; there the mma starts the
        // partial sums from zero instead of adding to zeroed registers)
        const bool first = kMode == kOneGroupF32 && ls == 0;  // a constant once the loop is unrolled
        if (!kGuard || first || strip0 + strip < k_strips) {  // warp-uniform
          if constexpr (WG) {
            // wgmma: this warp's tiles 2 jh, 2 jh + 1 of its 64 columns (words 2 jh, 2 jh + 1 of the lane's 16 bytes;
            // 8-bit: its second 16 bytes hold tiles 2, 3), unswapped into the W^T fragment order, then one wgmma per
            // tile over all kRows batch rows
            const int4* piece = sB + (strip * WN + wn) * T::kPieceInt4;
            uint32_t bw[2 * kWords];
            if constexpr (kWords == 1) {
              const uint2 v = reinterpret_cast<const uint2*>(piece + lane)[jh];
              bw[0] = v.x;
              bw[1] = v.y;
            } else {
              const int4 v = piece[2 * lane + jh];
              bw[0] = (uint32_t)v.x;
              bw[1] = (uint32_t)v.y;
              bw[2] = (uint32_t)v.z;
              bw[3] = (uint32_t)v.w;
            }
            int4 sc = sc_once;
            if constexpr (kScaleB && !kOneGroup) {
              const int srow = group_of((strip0 + strip) * 16) - group_of(st * T::kStageK);
              sc = sS[srow * WN * 8 + wn * 8 + (lane >> 2)];
              if constexpr (ZP) zero_row(slot, srow, zw);
            }
            const uint32_t s_tile[2] = {(uint32_t)(jh ? sc.z : sc.x), (uint32_t)(jh ? sc.w : sc.y)};
            uint32_t wg_a[2][4];
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              uint32_t f[4];
              typename DQ::Zero zero{};
              if constexpr (kZeroOnce) zero = jh ? zero_once[2 + jj] : zero_once[jj];
              else if constexpr (ZP) zero = DQ::zero(zw, 2 * jh + jj);
              DQ::template run<ZP>(&bw[jj * kWords], zero, f);
              if constexpr (kScaleB) {
                scale_tile<Ops>(f, s_tile[jj]);
              }
              wg_a[jj][0] = f[0];  // the W^T fragment order of the swapped mma.sync path
              wg_a[jj][1] = f[2];
              wg_a[jj][2] = f[1];
              wg_a[jj][3] = f[3];
            }
            // B of the wgmma: this strip's k16 slice of the kRows activation rows, slice strip % 4 of k atom strip / 4
            // (a_at in load_stage)
            const uint64_t desc = wgmma_desc_sw128(smem_u32(sA) + (strip >> 2) * (T::kRows * 128) + (strip & 3) * 32);
            wgmma_fence();
            Wgmma<MB>::template run<0, typename K::ActT>(d, wg_a[0], desc);
            Wgmma<MB>::template run<1, typename K::ActT>(d, wg_a[1], desc);
            wgmma_commit();
            // at most the previous strip's group in flight: its fragments' registers are reused two strips on (with
            // a whole stage's in flight ptxas serialised the wgmma for want of registers)
            wgmma_wait<1>();
          } else {
            // B: this lane's 4 (4-bit) or 8 (8-bit) words = its fragments of the 4 tiles (64 columns) of this strip.
            uint32_t bw[4 * kWords];
            const int4* piece = sB + (strip * WN + wn) * T::kPieceInt4;
            int4 bq[kWords];
            if constexpr (kWords == 1) {
              bq[0] = piece[lane];
            } else {
              // 8-bit: the lane's 32 bytes are int4 2l, 2l + 1. A 16-byte shared load is served 8 lanes at a time;
              // lanes 4..7 of every 8 read their second int4 first, so the 8 addresses of each phase (16-byte units
              // 0 2 4 6 9 11 13 15, then 1 3 5 7 8 10 12 14, modulo 8) fall in 8 distinct groups of 4 banks: no
              // conflict.
              const int swap = (lane >> 2) & 1;
              const int4 read0 = piece[2 * lane + swap];
              const int4 read1 = piece[2 * lane + (swap ^ 1)];
              bq[0] = swap ? read1 : read0;
              bq[1] = swap ? read0 : read1;
            }
#pragma unroll
            for (int h = 0; h < kWords; ++h) {
              bw[4 * h] = (uint32_t)bq[h].x;
              bw[4 * h + 1] = (uint32_t)bq[h].y;
              bw[4 * h + 2] = (uint32_t)bq[h].z;
              bw[4 * h + 3] = (uint32_t)bq[h].w;
            }
            // Grouped scales: lane c = lane / 4 needs columns c + 8 jj (jj = 0..7, n8-block jj), which the grouped
            // table stores at positions 8 c .. 8 c + 7 of the 64-column run: one 16-byte load; the zero points of the
            // same row likewise (zero_row). (srow is computed in here: computed above for every kernel, the compiler
            // scheduled it so that two sm_80 kernels spilled.)
            int4 sc = sc_once;
            if constexpr (kScaleB && !kOneGroup) {
              const int srow = group_of((strip0 + strip) * 16) - group_of(st * T::kStageK);  // scale row in the stage
              sc = sS[srow * WN * 8 + wn * 8 + (lane >> 2)];
              if constexpr (ZP) zero_row(slot, srow, zw);
            }
            // A fragments. Unswapped (the mma A operand): matrix q = lane / 8 is rows 8 (q % 2) .., chunk q / 2, so
            // a = {(rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)}. Swapped (the mma B
            // operand, one pair per batch block): matrix q is rows 8 (q / 2) .., chunk q % 2, so each batch block's
            // pair is two consecutive registers, {a0, a1} and {a2, a3} (with the other order the compiler copied the
            // pair into fresh registers for every mma: 8 moves per strip, kernel/NOTES.md).
            uint32_t a[MB][4];
#pragma unroll
            for (int mb = 0; mb < MB; ++mb) {
              const int q = lane >> 3;
              const int r = mb * 16 + (lane & 7) + (SWAP != 0 ? (q >> 1) : (q & 1)) * 8;
              const int ch = 2 * strip + (SWAP != 0 ? (q & 1) : (q >> 1));
              ldmatrix_x4(a[mb], sA + r * T::kStageK + ((ch ^ (r & 7)) * 8));
            }
            if constexpr (kOffset) {  // rs[h] += ones (16 x 16) x A^T: every row the sum over k of each batch row
              const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
#pragma unroll
              for (int h = 0; h < SWAP; ++h) {
                if (first) Ops::mma_first(rs[h], ones, a[0][2 * h], a[0][2 * h + 1]);
                else Ops::mma(rs[h], ones, a[0][2 * h], a[0][2 * h + 1]);
              }
            }
            [[maybe_unused]] const uint32_t sw[4] = {(uint32_t)sc.x, (uint32_t)sc.y, (uint32_t)sc.z, (uint32_t)sc.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // tile j = n8-blocks 2j, 2j + 1
              uint32_t f[4];
              typename DQ::Zero zero{};
              if constexpr (kZeroOnce) zero = zero_once[j];
              else if constexpr (ZP) zero = DQ::zero(zw, j);
              if constexpr (kOffset) dequant_offset<DQ>(&bw[j * kWords], f);
              else DQ::template run<ZP>(&bw[j * kWords], zero, f);
              if constexpr (kScaleB) scale_tile<Ops>(f, sw[j]);
              if constexpr (SWAP != 0) {
                // C^T = W^T A^T: the tile's 4 fragments are exactly the mma A fragment of W^T (rows = 16 columns n,
                // cols = 16 k): {(n g, k 2t..), (n g+8, k 2t..), (n g, k 2t+8..), (n g+8, k 2t+8..)} = f0 f2 f1 f3.
                // The B fragment (k x 8 batch rows) is ldmatrix matrices 0 and 1 (A rows 0-7, k 0-7 / 8-15, above);
                // with SWAP == 2 the second batch block (A rows 8-15) is matrices 2 and 3, accumulated in d[0][4 + j].
                const uint32_t wa[4] = {f[0], f[2], f[1], f[3]};
                if (first) {
                  Ops::mma_first(d[0][j], wa, a[0][0], a[0][1]);
                  if constexpr (SWAP == 2) Ops::mma_first(d[0][4 + j], wa, a[0][2], a[0][3]);
                } else {
                  Ops::mma(d[0][j], wa, a[0][0], a[0][1]);
                  if constexpr (SWAP == 2) Ops::mma(d[0][4 + j], wa, a[0][2], a[0][3]);
                }
              } else {
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) {
                  if (first) {
                    Ops::mma_first(d[mb][2 * j], a[mb], f[0], f[1]);
                    Ops::mma_first(d[mb][2 * j + 1], a[mb], f[2], f[3]);
                  } else {
                    Ops::mma(d[mb][2 * j], a[mb], f[0], f[1]);
                    Ops::mma(d[mb][2 * j + 1], a[mb], f[2], f[3]);
                  }
                }
              }
            }
          }
        }
      }
      };
      // (not the wgmma, 8-bit and unswapped zero-point kernels: their registers do not take two copies, ptxas spilled)
      if constexpr (!WG && BITS == 4 && !(SWAP == 0 && ZP)) {
        if (strip0 + wk * STRIPS + STRIPS <= k_strips) {
          strip_loop(std::false_type{});
          return;
        }
      }
      strip_loop(std::true_type{});
    };
    const bool strips_share_group = GROUPED && group_size % (16 * STRIPS) == 0;
    auto compute_stage = [&](int slot, int st) {
      if constexpr (kF32Scale || kHoistOneGroup) {
        const int first = st * T::kStageStrips + wk * STRIPS;  // this warp's first strip (absolute)
        if (first >= k_strips) return;                         // warp-uniform: nothing of ours in this stage
        // (a warp's strips start at a multiple of 16 * STRIPS rows: with group_size a multiple of that, they always
        // share one group, and the per-stage comparison is skipped)
        if (kOnlyOneGroup || strips_share_group ||
            group_of(first * 16) == group_of((min(first + STRIPS, k_strips) - 1) * 16)) {
          if constexpr (kF32Scale) {
            float part[MB][kAccN][4];  // set by the first strip's mma (mma_first), not zeroed
            float rs[2][4];        // (kOffsetB) likewise
            strips(std::integral_constant<int, kOneGroupF32>{}, part, rs, slot, st);
            // acc[0][4 h + j][e] is column 16 j + g + 8 (e >> 1): n8-block 2 j (e = 0, 1: low scale of word j) or
            // 2 j + 1 (e = 2, 3: high scale), as in the 16-bit path above.
            const int4* sS = reinterpret_cast<const int4*>(smem + slot * T::kStageBytes + T::kABytes + T::kBBytes);
            const int srow = group_of(first * 16) - group_of(st * T::kStageK);
            if constexpr (SWAP == 0) {
              // Unswapped: acc[mb][nb][e] is column 8 nb + 2t + (e & 1) of the warp's 64 (t = lane % 4). The grouped
              // table holds column c + 8 nb at position 8 c + nb of the run, so int4 2t of the run is the scales of
              // columns 2t + 8 nb and int4 2t + 1 those of 2t + 1 + 8 nb (half nb of each).
              const int4* run = sS + srow * WN * 8 + wn * 8 + 2 * (lane & 3);
              const int4 even = run[0], odd = run[1];
              const uint32_t se[4] = {(uint32_t)even.x, (uint32_t)even.y, (uint32_t)even.z, (uint32_t)even.w};
              const uint32_t so[4] = {(uint32_t)odd.x, (uint32_t)odd.y, (uint32_t)odd.z, (uint32_t)odd.w};
#pragma unroll
              for (int w = 0; w < 4; ++w) {
                const float2 s0 = Ops::to_float2(se[w]), s1 = Ops::to_float2(so[w]);  // n8-blocks 2w, 2w + 1
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) {
                  float(&a0)[4] = acc[mb][2 * w];
                  float(&a1)[4] = acc[mb][2 * w + 1];
                  const float(&p0)[4] = part[mb][2 * w];
                  const float(&p1)[4] = part[mb][2 * w + 1];
                  a0[0] = fmaf(p0[0], s0.x, a0[0]);
                  a0[1] = fmaf(p0[1], s1.x, a0[1]);
                  a0[2] = fmaf(p0[2], s0.x, a0[2]);
                  a0[3] = fmaf(p0[3], s1.x, a0[3]);
                  a1[0] = fmaf(p1[0], s0.y, a1[0]);
                  a1[1] = fmaf(p1[1], s1.y, a1[1]);
                  a1[2] = fmaf(p1[2], s0.y, a1[2]);
                  a1[3] = fmaf(p1[3], s1.y, a1[3]);
                }
              }
              return;
            }
            const int4 sc = sS[srow * WN * 8 + wn * 8 + (lane >> 2)];
            const uint32_t sw[4] = {(uint32_t)sc.x, (uint32_t)sc.y, (uint32_t)sc.z, (uint32_t)sc.w};
            uint32_t zw[kWords] = {};  // (kOffsetB with zero points) this lane's zero-point words of the stage's row
            if constexpr (kOffsetB && ZP) zero_row(slot, srow, zw);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 s01 = Ops::to_float2(sw[j]);
              if constexpr (kOffsetB) {
                // part - (128 + z) rs: rs[h][e & 1] is batch row 2t + (e & 1) of block h (every row of the ones-mma
                // is the same sum), z of n8-block 2j (e = 0, 1) or 2j + 1 (e = 2, 3)
                const float2 z01 = offset_zero(zw, j);
#pragma unroll
                for (int h = 0; h < SWAP; ++h) {
                  float(&a4)[4] = acc[0][4 * h + j];
                  const float(&p4)[4] = part[0][4 * h + j];
                  a4[0] = fmaf(fmaf(-z01.x, rs[h][0], p4[0]), s01.x, a4[0]);
                  a4[1] = fmaf(fmaf(-z01.x, rs[h][1], p4[1]), s01.x, a4[1]);
                  a4[2] = fmaf(fmaf(-z01.y, rs[h][0], p4[2]), s01.y, a4[2]);
                  a4[3] = fmaf(fmaf(-z01.y, rs[h][1], p4[3]), s01.y, a4[3]);
                }
              } else {
#pragma unroll
                for (int h = 0; h < SWAP; ++h) {
                  acc[0][4 * h + j][0] = fmaf(part[0][4 * h + j][0], s01.x, acc[0][4 * h + j][0]);
                  acc[0][4 * h + j][1] = fmaf(part[0][4 * h + j][1], s01.x, acc[0][4 * h + j][1]);
                  acc[0][4 * h + j][2] = fmaf(part[0][4 * h + j][2], s01.y, acc[0][4 * h + j][2]);
                  acc[0][4 * h + j][3] = fmaf(part[0][4 * h + j][3], s01.y, acc[0][4 * h + j][3]);
                }
              }
            }
          } else {
            strips(std::integral_constant<int, kOneGroupB>{}, acc, rs_unused, slot, st);
          }
          return;
        }
      }
      if constexpr (!kOnlyOneGroup) strips(std::integral_constant<int, kPerStrip>{}, acc, rs_unused, slot, st);
    };

    // ---- main loop: STAGES - 1 stages in flight (the prologue issued the first), one barrier per stage
    for (int it = 0; it < n_stages; ++it) {
      cp_async_wait<STAGES - 2>();  // stage `it` has landed (for this thread)
      if constexpr (WG) fence_proxy_async();  // ... and is visible to wgmma's reads
      __syncthreads();              // ... for all threads; and everyone is done computing stage it - 1
      const int next = it + STAGES - 1;
      if (next < n_stages) load_stage(slot_of(next), ntile, stage_begin + next);  // refills the slot of stage it - 1
      cp_async_commit();
      compute_stage(slot_of(it), stage_begin + it);
      if constexpr (WG) wgmma_wait<0>();  // the stage's wgmma are done with its shared memory (refilled next)
      if (it == 0) trace.stamp(2, acc[0][0][0]);
    }
    trace.stamp(3, acc[0][0][0]);
    if constexpr (WG) {
      // the accumulators are read from here on: pin every one behind the last wait (an empty asm that "writes" it), so
      // that no compiler moves a read or copy of them above it (as CUTLASS's warpgroup_fence_operand does)
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int nb = 0; nb < kAccN; ++nb)
#pragma unroll
          for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(acc[mb][nb][i])::"memory");
    }
    Segment following{0, 0, 0};
    have_seg = SEGMENTS && next_segment(following);
    if (kOverlapNext && have_seg) {
      __syncthreads();      // everyone is done computing; no copy of this segment is pending (all were waited for)
      prologue(following);  // into slots 1 .. STAGES - 1, past the [RED] area
    } else {
      cp_async_wait<0>();
      __syncthreads();  // the pipeline's shared memory is now free for the reduction
    }
    trace.stamp(4, 0.0f);

    // ---- [RED] across blocks: wait for our turn on this tile's lock; or, in a cluster, for every block of it to be done
    // with its pipeline, whose shared memory the peers write from here on (entries of the pairs this block owns)
    const bool in_cluster = WG && !SEGMENTS && cluster_red != 0 && splits > 1;
    int* lock = locks + ntile * m_chunks + mchunk;
    if (in_cluster) {
      cluster_barrier();
    } else if (splits > 1) {
      if (tid == 0) {
        int v;
        do {
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(lock) : "memory");
        } while (v != split);
      }
      __syncthreads();
    }
    trace.stamp(5, 0.0f);

    // ---- [RED] inside the block, then [OUT]; one m-block at a time (32 KB of shared memory)
    float2* red = reinterpret_cast<float2*>(smem);
    const uint32_t* S2 = reinterpret_cast<const uint32_t*>(S);  // scale pairs
    uint32_t* C2 = reinterpret_cast<uint32_t*>(C);              // output pairs
    // [RED] in a cluster: thread tid's pair q of m-block mb is its pair idx = mb * kPairs + q (of T::kClusterPairs),
    // owned by rank idx % splits, where it is entry e = idx / splits; the owner keeps the partial sum of contributor
    // c at float2 (c * entries + e) * kThreads + tid of its slot area (behind the in-block area `red`)
    const int entries = (T::kClusterPairs + splits - 1) / splits;
    const uint32_t slots = smem_u32(smem) + (uint32_t)T::kRedBytes;
    constexpr int kPairs = WN * 512 / kThreads;  // output pairs per thread and m-block ([OUT] below)
    static_assert(WN * 512 % kThreads == 0, "whole pairs per thread");
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      // red[(((wk * WN + wn) * 8 + nb) * 2 + hi) * 32 + lane] = (acc[mb][nb][2 hi], acc[mb][nb][2 hi + 1])
      if constexpr (SWAP != 0) {
        // acc[mb][4 h + j][e] = C[row 16 mb + 8 h + 2t + (e & 1)][col 16 j + g + 8 (e >> 1)] (g = lane / 4, t = lane %
        // 4, cols inside this warp's 64, h = batch block; mb = 0 but for wgmma); stored where the non-swapped layout
        // keeps that element (row 8 h + r is half `hi = h` of lane 4 r + ...). With SWAP == 1 rows 8..15 are never
        // stored (m <= 8 there).
        float* redf = reinterpret_cast<float*>(smem);
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int h = 0; h < (WG ? 2 : SWAP); ++h)
#pragma unroll
          for (int jj = 0; jj < (WG ? 2 : 4); ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int j = WG ? 2 * jh + jj : jj;  // (wgmma: acc[mb][2 h + jj] is tile 2 jh + jj)
              const int row = 2 * t + (e & 1);
              const int col = 16 * j + g + 8 * (e >> 1);
              const int ln = row * 4 + ((col & 7) >> 1);
              redf[2 * ((((wk * WN + wn) * 8 + (col >> 3)) * 2 + h) * 32 + ln) + (col & 1)] =
                  acc[mb][(WG ? 2 : 4) * h + jj][e];
            }
      } else {
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi)
            red[(((wk * WN + wn) * 8 + nb) * 2 + hi) * 32 + lane] =
                make_float2(acc[mb][nb][2 * hi], acc[mb][nb][2 * hi + 1]);
      }
      __syncthreads();
      // Pair p = ((wn * 8 + nb) * 2 + hi) * 32 + ln: accumulator registers 2 hi, 2 hi + 1 of lane ln, which hold
      // C[row, col], C[row, col + 1] with row = ln / 4 + 8 hi, col = 8 nb + 2 (ln % 4) (mma C fragment layout).
      // Thread tid takes pairs tid + q * kThreads. All of its reads of C (the earlier contributors' sums) are issued
      // before any of its writes: read-add-write per pair made every read wait for the write before it (the compiler
      // cannot reorder a read of C past a write to C), one L2 round trip per pair and m-block in each contributor of
      // the serial chain (H200, the 256-column wgmma kernel at m = 128: 8 x 8 round trips, 4096 x 4096 took 142 us).
      float2 v[kPairs];
      size_t at[kPairs];  // pair index into C2
      bool ok[kPairs];
#pragma unroll
      for (int q = 0; q < kPairs; ++q) {
        const int p = tid + q * kThreads;
        const int ln = p & 31;
        const int hi = (p >> 5) & 1;
        const int nb = (p >> 6) & 7;
        const int pwn = p >> 9;
        v[q] = make_float2(0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < T::kWK; ++w) {
          const float2 x = red[(w * WN + pwn) * 512 + (p & 511)];
          v[q].x += x.x;
          v[q].y += x.y;
        }
        const int row = row0 + mb * 16 + (ln >> 2) + 8 * hi;
        const int col = col0 + pwn * 64 + nb * 8 + 2 * (ln & 3);
        if constexpr (!GROUPED) {
          // Channelwise table (runs of 32): position 8 t + jpos holds column 2 t + {0,1,8,9,16,17,24,25}[jpos].
          // Column 8 nb + 2 t + e of the 64-column run lies in run nb / 4 at jpos = 2 (nb % 4) + e, i.e. at
          // position 32 (nb / 4) + 8 t + 2 (nb % 4) + e: the pair (e = 0, 1) is one 32-bit word.
          const int pos = col0 + pwn * 64 + 32 * (nb >> 2) + 8 * (ln & 3) + 2 * (nb & 3);
          const float2 sc = Ops::to_float2(S2[pos >> 1]);
          v[q].x *= sc.x;
          v[q].y *= sc.y;
        }
        ok[q] = row < m;
        at[q] = ((size_t)row * n + col) >> 1;
      }
      if (in_cluster) {  // push every pair to its owner (this block included), which adds and writes it below
#pragma unroll
        for (int q = 0; q < kPairs; ++q) {
          const int idx = mb * kPairs + q;
          st_cluster_f2(slots + (uint32_t)(((split * entries + idx / splits) * kThreads + tid) * 8),
                        (uint32_t)(idx % splits), v[q]);
        }
        __syncthreads();  // `red` is rewritten by the next m-block
        continue;
      }
      if (splits > 1 && split > 0) {  // add the partial sums of contributors 0 .. split - 1 (read from L2)
        unsigned int old[kPairs];
#pragma unroll
        for (int q = 0; q < kPairs; ++q)
          old[q] = ok[q] ? __ldcg(reinterpret_cast<const unsigned int*>(C2 + at[q])) : 0u;
#pragma unroll
        for (int q = 0; q < kPairs; ++q) {
          const float2 o = Ops::to_float2(old[q]);
          v[q].x += o.x;
          v[q].y += o.y;
        }
      }
#pragma unroll
      for (int q = 0; q < kPairs; ++q)
        if (ok[q]) C2[at[q]] = Ops::pack(v[q].x, v[q].y);
      __syncthreads();  // `red` is rewritten by the next m-block
    }

    // ---- [RED] in a cluster: the pairs this block owns, each the sum of the `splits` contributors' in split order
    if (in_cluster) {
      cluster_barrier();  // every push is in place (and no peer writes into this block's shared memory after this)
      const float2* pushed = reinterpret_cast<const float2*>(smem + T::kRedBytes);
      for (int e = 0; e < entries; ++e) {
        const int idx = e * splits + split;
        if (idx >= T::kClusterPairs) break;
        const int mb = idx / kPairs, p = tid + (idx % kPairs) * kThreads;
        const int ln = p & 31, hi = (p >> 5) & 1, nb = (p >> 6) & 7, pwn = p >> 9;
        const int row = row0 + mb * 16 + (ln >> 2) + 8 * hi;
        if (row >= m) continue;
        float2 sum = pushed[e * kThreads + tid];
        for (int c = 1; c < splits; ++c) {
          const float2 x = pushed[(c * entries + e) * kThreads + tid];
          sum.x += x.x;
          sum.y += x.y;
        }
        const int col = col0 + pwn * 64 + nb * 8 + 2 * (ln & 3);
        C2[((size_t)row * n + col) >> 1] = Ops::pack(sum.x, sum.y);
      }
    }

    // ---- [RED] across blocks: hand the tile to the next split (the last one re-zeroes the lock)
    if (splits > 1 && !in_cluster) {
      __threadfence();  // our C writes are visible device-wide before the lock moves
      __syncthreads();
      if (tid == 0) atomicExch(lock, split == splits - 1 ? 0 : split + 1);
    }
    trace.stamp(6, 0.0f);
    if (!kOverlapNext && have_seg) prologue(following);
    seg = following;
  }  // segments
  trace.flush();
}

// ------------------------------------------------------------------------------------------------ host side

inline void set_error(char* err, int errlen, const char* fmt, ...) __attribute__((format(printf, 3, 4)));

inline void set_error(char* err, int errlen, const char* fmt, ...) {
  if (err == nullptr || errlen <= 0) return;
  va_list args;
  va_start(args, fmt);
  vsnprintf(err, static_cast<size_t>(errlen), fmt, args);
  va_end(args);
}

struct Launch {
  const void* A;
  const void* B;
  const void* s;
  const void* zp;
  void* C;
  int* workspace;
  long workspace_ints;
  int m, n, k, scale_rows, sms, split_k;
  cudaStream_t stream;
  char* err;
  int errlen;
};

// m > 16: whether the 64-row, 128-column, 8 strips x 2 stages kernel takes the batch (m > 64, and m = 33..64 with long
// k or wide n; measured on fp16 x 4-bit, dispatch_fp16_int4) rather than the 32-row one; its shared memory is checked
// by the caller.
inline bool wants_64_row_chunks(const Launch& L) {
  return (L.m > 64 || (L.m > 32 && (L.k >= 16384 || L.n >= 32768))) && L.n % 128 == 0;
}

// Stream-K schedule (launch_config), benchmark switch MARLIN_CONVERT_STREAM_K (marlin_gemm.cu): -1 when unset (the
// schedule launch_config picks), 0 = split-K, N = stream-K with at most N blocks per SM.
int stream_k_per_sm();

// [RED] in a cluster for the wgmma kernel (marlin_gemm.cu, MARLIN_CONVERT_WGMMA_CLUSTER; 0 where the device or the
// build has no sm_90a code): 0 = never (the lock chain), else wherever cluster_split allows.
int wgmma_cluster_variant();

// [PDL] Whether launches carry cudaLaunchAttributeProgrammaticStreamSerialization (marlin_gemm.cu): compute
// capability 9.0 in an sm_90a build, unless MARLIN_CONVERT_PDL=0 (benchmark and tests: the kernels' results are the
// same either way, only when they may start differs).
bool pdl_enabled();
// [PDL] Counts one launch that carries the attribute (marlin_gemm.cu; marlin_pdl_launches reads the count).
void count_pdl_launch();
// Notes the configuration of a kernel this host thread launched (marlin_gemm.cu; marlin_last_launch reads it back, so
// tests can check which kernel a dispatch rule chose): `family` "pipelined" (MB, WN, STRIPS, STAGES, SWAP as the
// template parameters, `schedule` 1 for stream-K, `cluster` the blocks of a [RED] cluster, 1 for none) or "direct"
// (MB = batch blocks of 8 rows, WN = blocks per tile's cluster, `schedule` = units per block, 0 in cluster mode; the
// rest 0).
void note_launch(const char* family, int mb, int wn, int strips, int stages, int swap, int schedule, long grid,
                 int cluster = 1);

// Largest dynamic shared memory a block may opt in to on the current device (0 when the query fails).
inline int smem_optin() {
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 0;
  return optin;
}

// [PDL] A launch's dynamic shared memory and whether it takes PDL (where pdl_enabled()). Launched early, a kernel's
// blocks take the room beside the running grid's, and where that room holds two of them on some SMs the kernel waits
// for its slowest block: H200, back-to-back calls (kernel/NOTES.md), grids of up to 132 blocks of kernels that may run
// two per SM (m = 32 / 64 on 4096 x 4096, 11008 x 4096, 8192 x 8192, 28672 x 8192 split over k; the direct kernel's
// clusters on 4096 x 4096 and 11008 x 4096) took 1.06-1.55x the time with PDL. So PDL is taken where the kernel runs
// one block per SM, where its grid has more blocks than SMs (both gained: 0.89-0.99 of the time), and where the grid
// has at most one block per SM anyway: there the launch asks for kOneBlockSmem of shared memory, which keeps a second
// block of it off any SM (two of them and the runtime's 1 KB each exceed an sm_90 SM's 228 KB). Elsewhere (that much
// does not fit the opt-in limit) no PDL.
constexpr int kOneBlockSmem = kSmemPerSm / 2;
struct PdlLaunch {
  int smem;
  bool pdl;
};
inline PdlLaunch pdl_launch(long grid, int smem, int per_sm, int sms, int optin) {
  if (!pdl_enabled()) return PdlLaunch{smem, false};
  if (per_sm == 1 || grid > sms) return PdlLaunch{smem, true};
  if (smem < kOneBlockSmem && kOneBlockSmem <= optin) return PdlLaunch{kOneBlockSmem, true};
  return PdlLaunch{smem, false};
}
// The attribute cudaFuncAttributeMaxDynamicSharedMemorySize of a kernel using `smem` bytes: room for kOneBlockSmem
// too where the device allows it (a constant per kernel and device, so that calls from several host threads never
// lower it under another's launch).
inline int smem_attribute(int smem, int optin) { return kOneBlockSmem <= optin && smem < kOneBlockSmem ? kOneBlockSmem : smem; }

// The launch of every kernel here: grid x kThreads threads, smem bytes of dynamic shared memory, a cluster of
// cluster_x blocks (1: none), the [PDL] attribute where pdl.
struct LaunchShape {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2];
  LaunchShape(long grid, int smem, cudaStream_t stream, int cluster_x, bool pdl) {
    cfg.gridDim = dim3((unsigned)grid, 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = (size_t)smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 0;
    if (cluster_x > 1) {
      attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
      attr[cfg.numAttrs].val.clusterDim.x = (unsigned)cluster_x;
      attr[cfg.numAttrs].val.clusterDim.y = 1;
      attr[cfg.numAttrs].val.clusterDim.z = 1;
      ++cfg.numAttrs;
    }
    if (pdl) {
      attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
      ++cfg.numAttrs;
      count_pdl_launch();
    }
  }
  LaunchShape(const LaunchShape&) = delete;  // (cfg.attrs points into this object)
  LaunchShape& operator=(const LaunchShape&) = delete;
};

// [RED] in a cluster: the blocks per tile (its split over k) for the wgmma kernel `kernel` on n_tiles tiles of
// total_stages stages, with `smem` bytes of shared memory per block; 1 = no cluster. The largest s <= kMaxClusterRed
// with s <= SMs / n_tiles (one block per SM: the grid in one wave), each split >= 2 stages and none empty, and all
// n_tiles clusters of s resident at once (cudaOccupancyMaxActiveClusters: a cluster's blocks must share one GPC, so
// a GPC of 16 or 18 SMs holds two clusters of 8 and the GPU fewer than SMs / 8). The query costs microseconds, so
// its answers are kept in `fits` (the caller's, one per kernel instantiation and its one `smem`), per device (< 16)
// and s, as clusters + 1 (0 = not asked yet); a query that fails counts as "does not fit" for this call and is not
// kept.
using ClusterFits = std::atomic<int>[16][kMaxClusterRed + 1];
template <class Kernel>
int cluster_split(Kernel kernel, ClusterFits& fits, long n_tiles, int total_stages, int sms, int smem) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  for (int s = (int)min((long)kMaxClusterRed, sms / max(n_tiles, 1L)); s >= 2; --s) {
    if (total_stages / s < 2) continue;
    const int per_split = (total_stages + s - 1) / s;
    if ((total_stages + per_split - 1) / per_split != s) continue;  // (an empty split)
    int clusters = dev < 16 ? fits[dev][s].load(std::memory_order_relaxed) - 1 : -1;
    if (clusters < 0) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      cfg.gridDim = dim3((unsigned)(n_tiles * s), 1, 1);
      cfg.blockDim = dim3(kThreads, 1, 1);
      cfg.dynamicSmemBytes = (size_t)smem;
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = (unsigned)s;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        clusters = 0;
      } else if (dev < 16) {
        fits[dev][s].store(clusters + 1, std::memory_order_relaxed);
      }
    }
    if (clusters >= n_tiles) return s;
  }
  return 1;
}

// [RED] in a cluster, where launch_config takes it over the lock chain (H200, fp16 x 4-bit, twenty-third session,
// kernel/NOTES.md): wherever its split keeps as many blocks as the lock chain's, or where the lock chain's blocks would
// keep less than kClusterLongK of k each. 4096 x 12288 (both split in two) at m = 64 / 128 took 0.85-0.89 of the time;
// 8192 x 10240 (a cluster of 2 blocks, 80 in all, against 3-way lock chains of 2730 k, 120 blocks) 0.96-0.99; but
// 28672 x 8192 (clusters of 3, 96 blocks: 32 clusters of 4 did not fit the H200's GPCs; against 4-way chains of 7168 k,
// 128 blocks) 1.00-1.05x, the SMs left idle costing more than the chain there.
constexpr int kClusterLongK = 4096;
// The 128-row wgmma kernel (m = 65..128) on layers wgmma_pays leaves, in a cluster only, where each block keeps at
// least kClusterMinK of k (same measurements, against the mma.sync kernels' default): 11008 x 4096 (clusters of 6,
// 1835 k) 0.86 / 0.90 of the time (group 128 / channelwise), 8192 x 8192 (3, 2730 k) 0.93 / 0.99; not 4096 x 4096
// (6, 683 k): 1.12 / 1.25. At m = 33..64 the same layers were mixed (0.94-1.03), so the 64-row kernel keeps wgmma_pays.
constexpr int kClusterMinK = 1536;

// Pick the split over k, then launch one instantiation. cluster_only (the wgmma kernel where wgmma_pays says no):
// launch only with [RED] in a cluster that leaves each block >= kClusterMinK of k; else set *cluster_only = false
// and return MARLIN_OK without launching.
template <class K, int MB, int WN, int STRIPS, int STAGES, bool GROUPED, int SWAP = 0, bool NO_F32_SCALE = false>
int launch_config(const Launch& L, bool* cluster_only = nullptr) {
  using T = Tile<MB, WN, STRIPS, STAGES, GROUPED, K::kBits, K::kZp, SWAP == 3>;
  using ActT = typename K::ActT;
  auto kernel = marlin_gemm_kernel<K, MB, WN, STRIPS, STAGES, GROUPED, SWAP, NO_F32_SCALE>;
  const int smem = T::kSmemBytes;
  const int optin = smem_optin();
  // [RED] in a cluster (the wgmma kernel): its launches take kClusterSmem, so the attribute allows that too where the
  // device does; one value per kernel and device, set by every call alike (see smem_attribute)
  constexpr int kClusterSmem = SWAP == 3 && T::kClusterSmemBytes > T::kSmemBytes ? T::kClusterSmemBytes : T::kSmemBytes;
  const bool cluster_fits = SWAP == 3 && kClusterSmem <= optin;
  const int smem_attr = cluster_fits && kClusterSmem > smem_attribute(smem, optin) ? kClusterSmem
                                                                                  : smem_attribute(smem, optin);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_attr);
  if (e != cudaSuccess) {
    set_error(L.err, L.errlen, "cudaFuncSetAttribute(%d bytes of shared memory) failed: %s", smem_attr,
              cudaGetErrorString(e));
    return MARLIN_CUDA_ERROR;
  }
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (e != cudaSuccess || per_sm < 1) {
    set_error(L.err, L.errlen, "kernel configuration (MB=%d, WN=%d, %d bytes of shared memory) cannot run here: %s",
              MB, WN, smem, e != cudaSuccess ? cudaGetErrorString(e) : "0 blocks fit on a multiprocessor");
    return MARLIN_CUDA_ERROR;
  }
  const int n_tiles = L.n / T::kTN;
  const int m_chunks = (L.m + T::kRows - 1) / T::kRows;
  const long base_blocks = (long)n_tiles * m_chunks;
  const int total_stages = (L.k / 16 + T::kStageStrips - 1) / T::kStageStrips;
  const long resident = (long)L.sms * per_sm;

  const int max_splits = std::is_same<ActT, half>::value ? 16 : 8;
  // Split-K (and one block per tile): split k when the tiles alone leave multiprocessors idle: enough splits to give
  // every SM a block, each split at least 2 stages long (fewer, longer chains of the lock), at most 16 (the chain is
  // serial), and only while the whole grid stays resident (a waiting block must never keep a block it waits for from
  // starting) and one lock per (ntile, mchunk) fits in the workspace. bf16: at most 8, because every split rounds the
  // running sum in C to bf16 (8 mantissa bits): 16 roundings made the error twice torch's.
  int splits = 1;
  if (L.split_k > 0) {
    splits = L.split_k;
  } else if (base_blocks < L.sms) {
    splits = (int)(L.sms / base_blocks);
    splits = min(splits, max_splits);
    splits = min(splits, max(1, total_stages / 2));
  }
  splits = max(1, min(splits, total_stages));
  while (splits > 1 && (base_blocks * splits > resident || base_blocks > L.workspace_ints)) --splits;
  const int stages_per_split = (total_stages + splits - 1) / splits;
  splits = (total_stages + stages_per_split - 1) / stages_per_split;  // no empty split
  int tile_units = splits * stages_per_split, units_per_block = stages_per_split;
  long grid = base_blocks * splits;

  // [RED] in a cluster (the wgmma kernel, one row chunk, where split-K would split): the split cluster_split picks
  int cluster = 1;
  int launch_smem = smem;
  if constexpr (SWAP == 3) {
    if (L.split_k <= 0 && stream_k_per_sm() <= 0 && m_chunks == 1 && base_blocks < L.sms && cluster_fits &&
        wgmma_cluster_variant() != 0) {
      static ClusterFits cluster_fits_cache;  // (this instantiation's: one kernel, one kClusterSmem)
      const int fits = cluster_split(kernel, cluster_fits_cache, n_tiles, total_stages, L.sms, kClusterSmem);
      if (fits > 1 && (cluster_only != nullptr || fits >= splits || L.k / splits < kClusterLongK)) cluster = fits;
      if (cluster > 1) {
        splits = cluster;
        units_per_block = (total_stages + splits - 1) / splits;
        tile_units = splits * units_per_block;
        grid = base_blocks * splits;
        launch_smem = kClusterSmem;
      }
    }
    if (cluster_only != nullptr && (cluster == 1 || L.k / cluster < kClusterMinK)) {
      *cluster_only = false;
      return MARLIN_OK;
    }
  }

  // Stream-K: every block takes the same number of (tile, stage) units, across tile boundaries, and the grid is what
  // the GPU holds resident, so no SM idles while others finish a last, partial wave. A tile of S stages then has at
  // most ceil((S - 1) / units_per_block) + 1 contributors, each adding into C in ActT: kept <= max_splits as above.
  // Taken where it gains more than it costs, in units of one block's work: the gain is the part of the busiest SM's
  // time that the split-K grid leaves the average SM idle, 1 - (grid / sms) / ceil(grid / sms); the cost is about one
  // stage per segment (a pipeline start and a reduction through C), (units_per_block / S + 1) / units_per_block. Fitted
  // on the H200 (kernel/NOTES.md): 8192 x 10240 (160 tiles on 132 SMs) is faster at every m, 4096 x 22016 at m <= 16
  // (344 tiles, 8 stages each) slower. MARLIN_CONVERT_STREAM_K (benchmark only) forces it off (0) or on (N: at most N
  // blocks per SM).
  // Only the 2-stage kernels of >= 4 strips (a stage long enough to hide a segment's start) and the 64-row wgmma kernels
  // (m = 33..64; 206-255 registers, no spill) have the stream-K variant; not bf16 x 4-bit symmetric's grouped
  // 128-column 8-strip kernel, whose stream-K form spilled 4-12 bytes at two blocks per SM (its split-K form does not),
  // nor the 128-row wgmma kernels, whose stream-K forms spilled 530-640 bytes and were slower where the rule below
  // would take them (H200, nineteenth session: fp16 x 4-bit m = 128 4096 x 22016 61.1 -> 69.8 us, 8192 x 57344 248.5
  // -> 251.3).
  constexpr bool kStreamKAble = (STAGES == 2 || (SWAP == 3 && MB == 4)) && STRIPS >= 4 && !NO_F32_SCALE &&
                                !(std::is_same<ActT, __nv_bfloat16>::value && !K::kZp && GROUPED && WN == 2 &&
                                  STRIPS == 8 && SWAP == 2);
  auto sk_kernel = marlin_gemm_kernel<K, MB, WN, STRIPS, STAGES, GROUPED, SWAP, NO_F32_SCALE, kStreamKAble>;
  bool stream_k = false;
  const int sk_env = stream_k_per_sm();
  if (kStreamKAble && L.split_k <= 0 && sk_env != 0 && base_blocks <= L.workspace_ints) {
    // units per block for a grid of `blocks_per_sm` blocks per SM (0 when that leaves an m-chunk without a block)
    const long units = (long)n_tiles * total_stages;
    auto units_per_block_at = [&](int blocks_per_sm) {
      const long per_chunk = (long)L.sms * blocks_per_sm / m_chunks;  // blocks per m-chunk
      if (per_chunk < 1) return 0L;
      const long upb = (units + per_chunk - 1) / per_chunk;
      return max(max(upb, (long)((total_stages - 1 + max_splits - 2) / (max_splits - 1))), 1L);
    };
    // decided with the split-K kernel's occupancy; the stream-K kernel's own (its registers may differ) is queried
    // only when it is taken, so the calls that stay split-K pay no extra host work
    long upb = units_per_block_at(sk_env > 0 ? min(per_sm, sk_env) : per_sm);
    const double per_sm_now = (double)grid / L.sms;
    const double gain = 1.0 - per_sm_now / std::ceil(per_sm_now);
    const double cost = upb > 0 ? ((double)upb / total_stages + 1.0) / (double)upb : 1.0;
    // m = 17..32 with group scales (the 32-row kernel, two blocks per SM) where the tiles are one wave at one block per
    // SM (SMs / 2 < n / 64 <= SMs: no split above) and k >= 16384: stream-K at two blocks per SM, each with half of a
    // tile's k, although the formula above sees no idle SM. The scales on B make this kernel wait on latency, which a
    // second block per SM hides; channelwise it gained nothing. H200 (seventeenth session, kernel/NOTES.md), fp16 x
    // 4-bit group 128 m = 32: 28672 x 8192 86.6 -> 71.7 us (split in two 74.4); 8192 x 8192 (k = 8192) 0.96 of the
    // time with stream-K, 1.04 split in two, so not there; 4096 x 4096 and 11008 x 4096 (split already) 1.2-1.5x
    // slower.
    const bool fill_one_wave = GROUPED && MB == 2 && SWAP == 0 && STRIPS == 4 && m_chunks == 1 && per_sm >= 2 &&
                               2 * base_blocks > L.sms && base_blocks <= L.sms && L.k >= 16384;
    // The wgmma kernel (three stages, one block per SM) only where split-K leaves k whole (splits == 1: more than half as
    // many tiles as SMs, so that SMs / tiles rounds down to one split, or more tiles than SMs): H200 (nineteenth
    // session, kernel/NOTES.md), fp16 x 4-bit m = 64, stream-K against split-K, three calls: 4096 x 22016 (86 tiles)
    // 0.88-0.95 of the time, 8192 x 57344 (224 tiles, 1.7 waves) 0.85-0.99, the other 4-bit kinds alike; but where
    // split-K splits, 1.04-1.13x (4096 x 12288 in two, 8192 x 10240 in three, 28672 x 8192 in four).
    const bool wgmma_whole_k = SWAP != 3 || splits == 1;
    if (cluster == 1 && upb > 0 && (sk_env > 0 || (gain > cost && wgmma_whole_k) || fill_one_wave)) {
      int sk_per_sm = 0;
      if (cudaFuncSetAttribute(sk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_attribute(smem, optin)) !=
              cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&sk_per_sm, sk_kernel, kThreads, smem) != cudaSuccess) {
        set_error(L.err, L.errlen, "stream-K kernel (MB=%d, WN=%d, %d bytes of shared memory) cannot be set up: %s",
                  MB, WN, smem, cudaGetErrorString(cudaGetLastError()));
        return MARLIN_CUDA_ERROR;
      }
      if (sk_per_sm < per_sm) upb = units_per_block_at(min(sk_per_sm, sk_env > 0 ? sk_env : sk_per_sm));
      if (upb > 0) {
        stream_k = true;
        tile_units = total_stages;
        units_per_block = (int)upb;
        grid = (units + upb - 1) / upb * m_chunks;
      }
    }
  }

  if (grid > 0x7fffffffL) {
    set_error(L.err, L.errlen, "m = %d, n = %d need %ld thread blocks, more than a launch can have", L.m, L.n, grid);
    return MARLIN_BAD_SHAPE;
  }
  const int group_size = L.k / L.scale_rows;
  int group_shift = -1;
  if ((group_size & (group_size - 1)) == 0) {
    group_shift = 0;
    while ((1 << group_shift) < group_size) ++group_shift;
  }
  const PdlLaunch pl = pdl_launch(grid, launch_smem, per_sm, L.sms, optin);
  const LaunchShape shape(grid, pl.smem, L.stream, cluster, pl.pdl);
#if defined(MARLIN_CONVERT_TRACE)
  trace_arm(L.stream);
#endif
  e = cudaLaunchKernelEx(&shape.cfg, stream_k ? sk_kernel : kernel, static_cast<const int4*>(L.A),
                         static_cast<const int4*>(L.B), static_cast<const int4*>(L.s), static_cast<const int4*>(L.zp),
                         static_cast<ActT*>(L.C), L.workspace, L.m, L.n, L.k, group_size, group_shift, tile_units,
                         units_per_block, cluster > 1 ? 1 : 0);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // (leave no error behind for the caller's next launch check)
    set_error(L.err, L.errlen,
              "kernel launch (MB=%d, WN=%d, grid %ld, clusters of %d, %d bytes of shared memory) failed: %s", MB, WN,
              grid, cluster, pl.smem, cudaGetErrorString(e));
    return MARLIN_CUDA_ERROR;
  }
  note_launch("pipelined", MB, WN, STRIPS, STAGES, SWAP, stream_k ? 1 : 0, grid, cluster);
  return MARLIN_OK;
}


// m <= 8: swapped, one batch block; m = 9..16: swapped with two (SWAP_MID) or the unswapped kernel.
template <class K, int STRIPS, bool GROUPED, bool SWAP_MID, int STAGES = 4>
int launch_small_kind(const Launch& L) {
  if (L.m <= 8) return launch_config<K, 1, 1, STRIPS, STAGES, GROUPED, 1>(L);
  if constexpr (SWAP_MID) return launch_config<K, 1, 1, STRIPS, STAGES, GROUPED, 2>(L);
  else return launch_config<K, 1, 1, STRIPS, STAGES, GROUPED, 0>(L);
}

// m > 32 on Hopper: the wgmma kernel, 256-column tiles (a warpgroup = 4 warps x 64 columns; the two warpgroups take
// two tiles of every warp's 64 columns each), 64-row chunks (N = 64) for m <= 64, else 128-row ones (N = 128). Sets
// launched = false when it does not apply (n not a multiple of 256, a group size that is not a multiple of the
// stage's 16 * STRIPS k, or too little shared memory): the caller then takes the mma.sync kernels. The 64-row kernel
// runs in stream-K where launch_config's rule takes it (the tiles leave SMs idle, or make a partial last wave, and
// split-K would not split k: 4096 x 22016 and 8192 x 57344 at m = 33..64).
// Whether the wgmma kernel is taken by default: when each block keeps a long run of k after the split that fills the
// GPU (>= 2560, or >= 2048 where that split is at most 2). Its blocks run one per SM and pay for each split in the
// serial reduction through C; measured on the H200 at m = 64 / 128 (kernel/NOTES.md): faster on 4096 x 22016,
// 8192 x 10240, 8192 x 57344 and 28672 x 8192 (k per block 4096, 2730, 8192, 7168), slower on 4096 x 4096,
// 11008 x 4096 and 8192 x 8192 (512 - 2048 after 4 to 8 splits); 4096 x 12288 (2048 after 2) faster since the seventh
// session's one-path grouped kernel: m = 128 47.7 -> 44.6 us (g128), bf16-int4-zp m = 64 39.2 -> 32.7 (fp16 x 4-bit
// at m = 64 and channelwise within 2 %).
inline bool wgmma_pays(const Launch& L) {
  if (L.n % 256 != 0) return false;
  const int tiles = L.n / 256;
  const int splits = tiles >= L.sms ? 1 : L.sms / tiles;
  return L.k / splits >= (splits <= 2 ? 2048 : 2560);
}

template <class K, int STRIPS, int STAGES, bool GROUPED>
int launch_wgmma(const Launch& L, bool& launched, bool cluster_only = false) {
  launched = false;
  if (L.n % 256 != 0) return MARLIN_OK;
  // grouped: every stage (16 * STRIPS k, stages start at multiples of it) inside one group (kOnlyOneGroup)
  if (GROUPED && (L.k / L.scale_rows) % (16 * STRIPS) != 0) return MARLIN_OK;
  const int optin = smem_optin();
  if (L.m <= 64) {
    if (optin < Tile<4, 4, STRIPS, STAGES, GROUPED, K::kBits, K::kZp, true>::kSmemBytes) return MARLIN_OK;
    launched = true;
    return launch_config<K, 4, 4, STRIPS, STAGES, GROUPED, 3>(L);
  }
  if (optin < Tile<8, 4, STRIPS, STAGES, GROUPED, K::kBits, K::kZp, true>::kSmemBytes) return MARLIN_OK;
  if (cluster_only) {  // (launch_config clears the flag where it does not launch)
    const int rc = launch_config<K, 8, 4, STRIPS, STAGES, GROUPED, 3>(L, &cluster_only);
    launched = cluster_only;
    return rc;
  }
  launched = true;
  return launch_config<K, 8, 4, STRIPS, STAGES, GROUPED, 3>(L);
}

// Hopper: MARLIN_CONVERT_WGMMA's value where the wgmma kernels can run (marlin_gemm.cu), else 0.
int wgmma_variant();

// m > 32, 4-bit kinds: the wgmma kernel where wgmma_variant allows it (1: the default, where wgmma_pays, and at m =
// 65..128 in a cluster where launch_config's kClusterMinK allows; 2..4 a fixed configuration wherever it fits).
// launched = false: the caller takes the mma.sync kernels.
template <class K, bool GROUPED>
int try_wgmma(const Launch& L, bool& launched) {
  launched = false;
#if defined(MARLIN_CONVERT_SM90A)  // (no wgmma instantiations in builds without sm_90a code)
  if constexpr (K::kBits == 4) {
    if (L.m <= 32) return MARLIN_OK;  // (before wgmma_variant's environment and device queries)
    const int wg = wgmma_variant();
    if (wg == 0) return MARLIN_OK;
    bool cluster_only = false;
    if (wg == 1 && !wgmma_pays(L)) {
      if (L.m <= 64 || L.m > 128 || wgmma_cluster_variant() == 0) return MARLIN_OK;
      cluster_only = true;
    }
    if (wg == 2) return launch_wgmma<K, 8, 3, GROUPED>(L, launched);
    if (wg == 3) return launch_wgmma<K, 4, 6, GROUPED>(L, launched);
    if (wg == 4) return launch_wgmma<K, 4, 4, GROUPED>(L, launched);
    // default: 8 strips x 3 stages (the fastest of the three on most shapes, kernel/NOTES.md); with group scales it
    // needs groups of a multiple of 128 (a stage's 128 k in one group), else 4 x 6 for groups of a multiple of 64,
    // else the mma.sync kernels. Grouped 128-row chunks took 4 x 6 until the wgmma kernel had one path per stage: 8 x 3
    // was then serialised by ptxas; without that, H200 group 128 m = 128 (seventh session): 8192 x 57344 253 -> 226
    // us, 28672 x 8192 144 -> 133, 4096 x 22016 67 -> 59, 8192 x 10240 70 -> 66.
    if (!GROUPED || (L.k / L.scale_rows) % 128 == 0) return launch_wgmma<K, 8, 3, GROUPED>(L, launched, cluster_only);
    return launch_wgmma<K, 4, 6, GROUPED>(L, launched, cluster_only);
  }
#endif
  return MARLIN_OK;
}

}  // namespace detail
}  // namespace marlin_convert

#include "marlin_gemm_direct.cuh"  // the direct-load kernel for m <= 32 on Hopper (try_direct)

namespace marlin_convert {
namespace detail {

// Every kind but fp16 x 4-bit symmetric (that one is dispatch_fp16_int4 in marlin_gemm.cu, with its benchmark
// variants). The 4-bit kinds take the direct-load kernel first where it is the default (try_direct: Hopper, m <= 8,
// a cluster of two blocks per tile, one block per tile in one wave, or stream-K where direct_pays; m = 9..16 in
// clusters of two only). The m <= 16 schedule keeps at least as many bytes of B in flight per SM as fp16 x 4-bit does
// (for 8-bit that did not make it faster: kernel/NOTES.md):
//   m <= 16, n / 64 <= SMs (one wave at one block per SM): 4 strips per warp, swapped (4-bit 144 KB, 8-bit 208 KB);
//   4-bit with zero points and grouped scales, larger n: 4 strips at 2 stages, 2 blocks per SM (74 KB);
//   4-bit, n / 64 <= 2 SMs, or any n with zero points (channelwise): 3 strips, 2 blocks per SM (108 KB; the
//          zero-point kernels spill at the 3-blocks-per-SM register limit of the 2-strip kernel);
//   4-bit symmetric, larger n: 2 strips, 3 blocks per SM (72 KB), swapped for m <= 8 only;
//   8-bit, larger n: 4 strips at 2 stages, 2 blocks per SM (104-108 KB; 2 strips at 4 stages where that does not
//          fit);
//   m = 17..32, 4-bit: the direct-load kernel in clusters of two (four batch blocks; Hopper, 2 x n / 64 <= SMs); m =
//          17..128, 4-bit, else (and where the wgmma kernel does not take it): the 8-strip 32-row kernels where
//          eight_strip_32_pick takes the layer;
//   m > 16: 4-bit, 64-row chunks at 8 strips x 2 stages (m > 64, or 33..64 with k >= 16384 or n >= 32768), else
//          32-row chunks at 4 strips x 2 stages (104 KB); 8-bit grouped the latter (136 KB);
//   8-bit channelwise m > 16, and every kind where the shared memory is too small for the above (sm_86 / sm_89:
//   ~100 KB): MB = 2, 1 strip (52 / 68 KB).
// Benchmark-only configuration switch (MARLIN_CONVERT_SMALL_CFG; marlin_gemm.cu): -1 when unset.
int small_cfg();

// Whether the m = 9..16 default takes the 128-column, 8-strip, 2-stage swapped kernel (every 4-bit kind; fp16 x 4-bit
// symmetric in dispatch_fp16_int4): n / 128 >= 2 SMs; or SMs / 2 < n / 64 <= SMs with k >= 16384 (`long_k_one_wave`:
// fp16 x 4-bit symmetric only; the other kinds have their one-wave 8-strip kernel there, which bf16 x 4-bit kept 3-6 %
// ahead of it at group 128); or, with group scales (`grouped_one_wave`), SMs < n / 128, where its tiles are one wave
// at two blocks per SM against the 64-column kernel's 1.3 waves. Two of its blocks must fit a multiprocessor's shared
// memory: not with grouped zero points (2 x 116 KB), nor on an A100's 163 KB. Benchmark switch
// (MARLIN_CONVERT_SMALL_CFG): 24 = never, 25 = without grouped_one_wave.
template <class K, bool GROUPED>
bool wide_eight_pays(const Launch& L, int optin, bool long_k_one_wave, bool grouped_one_wave) {
  if (L.m <= 8 || L.n % 128 != 0 || optin < 2 * Tile<1, 2, 8, 2, GROUPED, K::kBits, K::kZp>::kSmemBytes) return false;
  const int tiles64 = L.n / 64;
  return L.n / 128 >= 2 * L.sms || (long_k_one_wave && 2 * tiles64 > L.sms && tiles64 <= L.sms && L.k >= 16384) ||
         (GROUPED && grouped_one_wave && L.n / 128 > L.sms);
}

// Benchmark only (MARLIN_CONVERT_SMALL_CFG at m > 16, `bench_kernel.py --cfgs`), 4-bit: the unswapped 32-row kernel
// with 8 strips per warp and stage, one block per SM, whatever the layer: 30 = 128-column tiles at 2 stages (144 KB;
// grouped: fp32 partial sums scaled once per group, kF32Scale), 33 = 64-column tiles at 2 stages (208 KB); the
// default's on the layers of eight_strip_32_pick. launched = false: no such configuration fits. H200, fp16 x 4-bit
// m = 32, geomean over the 8 shapes (kernel/NOTES.md), group 128 / channelwise: 30 1.46 / 1.55x, 33 1.50 / 1.63x, the
// default before 1.49 / 1.65x (each wins on some layers only); two more measured and removed: 128-column tiles with
// the scales on B in 16 bits 1.33 / 1.48x, at 3 stages (216 KB) 1.37 / 1.47x.
template <class K, bool GROUPED>
int launch_m32_cfg(const Launch& L, int cfg, bool& launched) {
  launched = false;
  if constexpr (K::kBits == 4) {
    const int optin = smem_optin();
    launched = true;
    if (cfg == 30 && optin >= Tile<2, 2, 8, 2, GROUPED, 4, K::kZp>::kSmemBytes && L.n % 128 == 0)
      return launch_config<K, 2, 2, 8, 2, GROUPED>(L);
    if (cfg == 33 && optin >= Tile<2, 1, 8, 2, GROUPED, 4, K::kZp>::kSmemBytes)
      return launch_config<K, 2, 1, 8, 2, GROUPED>(L);
    launched = false;
  }
  return MARLIN_OK;
}

// m = 17..128, 4-bit kinds, the layers the direct and wgmma kernels leave: the unswapped 32-row kernel with 8 strips per
// warp and stage at one block per SM (a warp's stage is 128 k, one group of 128: the grouped fp32 partial sums are
// scaled once per group, 64 FFMA per 8 strips, where the 4-strip kernel puts the scales on B, 4 hmul2 per tile and
// strip). With c = ceil(m / 32) row chunks:
//   one wave of 64-column blocks (SMs / 2 < c x n / 64 <= SMs) with k < 16384: 64-column tiles at 2 stages (208 KB,
//     no split), as the m <= 16 one-wave rule;
//   else m <= 32, n / 64 > SMs / 2 and the 128-column tiles not 1..2 waves (SMs < n / 128 < 2 SMs: 4096 x 22016 lost
//     5-10 % channelwise), or m = 33..64 with one wave of 128-column blocks (SMs / 2 < c x n / 128 <= SMs) and
//     k < 16384: 128-column tiles at 2 stages (144 KB; split or stream-K as launch_config picks).
// H200, fp16 x 4-bit (`--cfgs=-,30,33`, kernel/NOTES.md), group 128 / channelwise, against the default before: m = 32
// (the 4-strip, 2-stage 32-row kernel at two blocks per SM; stream-K on 28672 x 8192) 8192 x 57344 153.4 -> 134.7 /
// 127.2 -> 120.0 us, 28672 x 8192 77.1 -> 64.5 / 65.0 -> 59.1, 8192 x 10240 31.2 -> 29.1 / 27.7 -> 26.8, 4096 x 12288
// 20.8 -> 19.5 / 19.6 -> 18.5, 8192 x 8192 (64-column) 23.7 -> 21.7 / 20.8 -> 19.2, bf16 and zero points alike; m = 64
// (the same 4-strip kernel) 4096 x 4096 (64-column) 13.0 -> 12.0 / 11.5 -> 10.8, 11008 x 4096 (64-column) 29.8 -> 27.5 /
// 25.3 -> 23.4, 8192 x 8192 (128-column) 38.1 -> 34.5 / 33.3 -> 31.2; the wgmma and 64-row kernels stay ahead on the
// other m = 64 layers.
//   m = 65..96 (three row chunks), every layer the wgmma kernel leaves: 128-column tiles (split or stream-K as
//     launch_config picks). The 64-row kernel it replaces runs two 64-row chunks there, the second a quarter empty
//     (rows 97..128 of its tiles are padding), so three 32-row chunks do a quarter less tensor work for 1.5x the
//     dequantization. H200 (twentieth session, `--m 96,128 --cfgs=-,30,33`, kernel/NOTES.md), fp16 x 4-bit m = 96,
//     group 128 / channelwise: 4096 x 4096 21.6 -> 19.3 / 20.6 -> 17.0 us, 11008 x 4096 43.3 -> 38.2 / 39.0 -> 33.5,
//     8192 x 8192 58.6 -> 52.0 / 47.6 -> 45.7 (stream-K over 129 blocks). At m = 128 (no empty rows) it won only on
//     4096 x 4096 and lost on the others (11008 x 4096 42.6 -> 45.1, 8192 x 8192 53.0 -> 67.0), so m > 96 keeps the
//     64-row kernel, except on the short-k layers of the next clause. The rule against the one before, same call (`--m 72,80,96 --cfgs=-,99`, bench_h200_m96_rule.txt):
//     4096 x 4096 0.82-0.89 of the time, 11008 x 4096 0.86-0.90, 8192 x 8192 0.96-1.04 (fp16; the other 4-bit kinds
//     0.99-1.06 there, 0.85-0.97 on the first two); geomean over the 8 shapes m = 80 / 96 0.85 -> 0.88x / 0.84 ->
//     0.87x (group 128), 0.89 -> 0.93x / 0.88 -> 0.93x (channelwise).
//   m = 97..128 (four row chunks) with one wave of 128-column blocks (SMs / 2 < 4 x n / 128 <= SMs: n = 2176..4224
//     on 132 SMs) and k <= kFourChunkMaxK: 128-column tiles, no split. The 64-row kernel splits k in two there (its 2 x
//     n / 128 blocks are half a wave), and short k leaves each of its blocks little work besides the reduction, so
//     four 32-row chunks in one wave pay despite dequantizing each weight twice as often. H200 (twenty-first session,
//     `--m 100,128 --cfgs=-,99`, kernel/NOTES.md), fp16 x 4-bit, time against the 64-row kernel, group 128 /
//     channelwise: 2048 x 4096 0.71-0.73 / 0.69, 2560 x 2560 0.70-0.72 / 0.67, 3072 x 3072 0.78-0.79, 3584 x 3584
//     0.75 / 0.74-0.76, 4096 x 2560 0.73-0.74, 4096 x 4096 0.87-0.89 / 0.83-0.84; with longer k the gain shrinks and
//     turns: 5120 x 4096 0.89-0.93, 6144 x 4096 0.92-0.97, 8192 x 4096 0.98-1.02, 11008 x 4096 1.02-1.07. The other 4-bit
//     kinds at m = 128: 4096 x 4096 0.85-0.96, 3584 x 3584 0.74-0.84, but 8192 x 4096 0.98-1.11 (the zero-point kinds
//     1.05-1.11), so the bound is k <= 4096 for every kind. Measured on the H200 only; the rule applies wherever the
//     144 KB kernel fits (an A100's 108 SMs: n = 1792..3456), not measured there.
constexpr int kFourChunkMaxK = 4096;
// Returns 0 (not these layers), 1 (64-column tiles) or 2 (128-column tiles).
template <class K, bool GROUPED>
int eight_strip_32_pick(const Launch& L, int optin) {
  if (K::kBits != 4 || L.m <= 16 || L.m > 128) return 0;
  const long chunks = (L.m + 31) / 32;
  const long blocks64 = chunks * (L.n / 64), blocks128 = chunks * (L.n / 128);
  const bool fits64 = optin >= Tile<2, 1, 8, 2, GROUPED, 4, K::kZp>::kSmemBytes;
  const bool fits128 = L.n % 128 == 0 && optin >= Tile<2, 2, 8, 2, GROUPED, 4, K::kZp>::kSmemBytes;
  if (chunks == 4)
    return fits128 && 2 * blocks128 > L.sms && blocks128 <= L.sms && L.k <= kFourChunkMaxK ? 2 : 0;
  if (chunks == 3) return fits128 ? 2 : 0;
  if (2 * blocks64 > L.sms && blocks64 <= L.sms && L.k < 16384) return fits64 ? 1 : 0;
  if (chunks == 1)
    return fits128 && 2 * blocks64 > L.sms && !(blocks128 > L.sms && blocks128 < 2L * L.sms) ? 2 : 0;
  return fits128 && 2 * blocks128 > L.sms && blocks128 <= L.sms && L.k < 16384 ? 2 : 0;
}

// launch_m32_cfg's kernels where eight_strip_32_pick takes the layer; launched = false otherwise.
template <class K, bool GROUPED>
int try_eight_strip_32(const Launch& L, int optin, bool& launched) {
  launched = false;
  if constexpr (K::kBits == 4) {
    const int pick = eight_strip_32_pick<K, GROUPED>(L, optin);
    if (pick == 0) return MARLIN_OK;
    launched = true;
    return pick == 1 ? launch_config<K, 2, 1, 8, 2, GROUPED>(L) : launch_config<K, 2, 2, 8, 2, GROUPED>(L);
  }
  return MARLIN_OK;
}

template <class K, bool GROUPED>
int dispatch_kind(const Launch& L) {
  constexpr bool kZp = K::kZp;
  constexpr int kBits = K::kBits;
  const int optin = smem_optin();
  if (L.m <= 16) {
    const int tiles = L.n / 64;
    const bool one_wave = optin >= Tile<1, 1, 4, 4, GROUPED, kBits, kZp>::kSmemBytes && tiles <= L.sms;
    const int cfg = small_cfg();  // benchmark-only switch (MARLIN_CONVERT_SMALL_CFG), read once per call
    if (cfg < 0) {  // the direct-load kernel where it takes the layer (Hopper; marlin_gemm_direct.cuh)
      bool launched = false;
      const int rc = try_direct<K, GROUPED>(L, optin, launched);
      if (launched) return rc;
    }
    if constexpr (kBits == 4) {
      // m = 9..16 on the layers of wide_eight_pays (not its one-wave long-k clause): 128-column tiles, 8 strips at 2
      // stages, two batch blocks, as fp16 x 4-bit symmetric (dispatch_fp16_int4). H100 (thirteenth session,
      // kernel/NOTES.md), m = 12 / 16 time against the kernels before: 8192 x 57344 bf16-int4 0.92 / 0.93 (group 128),
      // 0.95 / 0.94 (channelwise), channelwise zero points 0.87-0.93; 4096 x 22016 bf16-int4 group 128 0.99.
      if (cfg != 24 && wide_eight_pays<K, GROUPED>(L, optin, false, cfg != 25))
        return launch_config<K, 1, 2, 8, 2, GROUPED, 2>(L);
    }
    if constexpr (kBits == 4 && !kZp) {
      // bf16 x 4-bit symmetric (fp16 has dispatch_fp16_int4): the 4-strip, 2-stage kernel where fp16 x 4-bit takes it,
      // grouped with n / 64 > SMs, channelwise at m <= 8 with n / 256 >= SMs (there 8192 x 57344 m = 1 took
      // 112.5 us against 90.6 for fp16 x 4-bit, 4096 x 12288 17.8 against 14.7 before; kernel/NOTES.md) and
      // channelwise with SMs < n / 64 <= 2 SMs (m = 16: 8192 x 10240 33.8 us against fp16's 22.9, 4096 x 12288 19.2
      // against 16.0 with the 3-strip kernel).
      if constexpr (GROUPED) {
        if (tiles > L.sms && optin >= Tile<1, 1, 4, 2, true, 4, false>::kSmemBytes)
          return launch_small_kind<K, 4, true, true, 2>(L);
      } else {
        if (L.m <= 8 && L.n / 256 >= L.sms && optin >= Tile<1, 1, 4, 2, false, 4, false>::kSmemBytes)
          return launch_config<K, 1, 1, 4, 2, false, 1>(L);
        if (tiles > L.sms && tiles <= 2 * L.sms && optin >= Tile<1, 1, 4, 2, false, 4, false>::kSmemBytes)
          return launch_small_kind<K, 4, false, true, 2>(L);
      }
    }
    if constexpr (kBits == 4) {
      // One wave of tiles (n / 64 <= SMs) with k < 16384, and with group scales at any k: 8 strips at 2 stages (a
      // warp's stage is one group of 128, so the fp32 partial sums are scaled, and bf16's offset sums subtracted, once
      // per group; 148 KB, one block per SM; split over k by launch_config where the tiles leave SMs idle). fp16 x
      // 4-bit symmetric takes it at SMs / 2 < n / 64 <= SMs and k < 16384 only (dispatch_fp16_int4). H200 (seventh
      // session, kernel/NOTES.md), m = 1..16 geomean at group 128: 8192 x 8192 bf16-int4 1.84 -> 2.10x, bf16-int4-zp
      // 1.79 -> 2.07x, fp16-int4-zp 2.08 -> 2.43x (channelwise +4-8 %); 28672 x 8192 (k = 28672, against the 4-strip
      // kernel split in two below) 2.31 -> 2.35x, 2.26 -> 2.32x, 2.36 -> 2.42x, but channelwise 5-7 % slower there;
      // 11008 x 4096 and 4096 x 4096 (n / 64 <= SMs / 2, against the 4-strip, 4-stage kernel) 1.53 -> 1.61x,
      // 1.49 -> 1.58x, 1.62 -> 1.71x (channelwise -1..+3 %). MARLIN_CONVERT_SMALL_CFG (benchmark only) = 16 skips it,
      // 17 takes it at k >= 16384 channelwise too.
      if (one_wave && (L.k < 16384 || GROUPED || cfg == 17) && cfg != 16 &&
          optin >= Tile<1, 1, 8, 2, GROUPED, 4, kZp>::kSmemBytes)
        return launch_small_kind<K, 8, GROUPED, true, 2>(L);
      // The split over more resident blocks that fp16 x 4-bit symmetric measured (dispatch_fp16_int4, NOTES.md):
      // SMs / 2 < n / 64 <= SMs, m = 9..16 or long k: 4 strips x 2 stages split in two.
      Launch split_two = L;
      split_two.split_k = L.split_k > 0 ? L.split_k : 2;  // launch_config still caps it to the resident blocks
      // there, m = 9..16 or long k (since the 8-strip kernel above: channelwise with k >= 16384): the 4-strip, 2-stage
      // kernel split in two, as fp16 x 4-bit (its 64-row warps never straddle a group of 64 / 128; the 3-strip
      // kernel's 48 do)
      if (one_wave && 2 * tiles > L.sms && (L.m > 8 || L.k >= 16384) &&
          optin >= Tile<1, 1, 4, 2, GROUPED, 4, kZp>::kSmemBytes)
        return launch_small_kind<K, 4, GROUPED, true, 2>(split_two);
    }
    if constexpr (kBits == 8) {
      // Benchmark only (MARLIN_CONVERT_SMALL_CFG, `bench_kernel.py --cfgs`): 20 = the 2-strip kernel, 21 = the
      // MB = 2 one-strip kernel, 22 = the 4-strip kernel, whatever n; the split as launch_config picks it (or
      // --split-k).
      switch (cfg) {
        case 20:
          if (optin >= Tile<1, 1, 2, 4, GROUPED, 8, kZp>::kSmemBytes) return launch_small_kind<K, 2, GROUPED, true>(L);
          break;
        case 21: return launch_config<K, 2, 1, 1, 4, GROUPED>(L);
        case 22:
          if (optin >= Tile<1, 1, 4, 4, GROUPED, 8, kZp>::kSmemBytes) return launch_small_kind<K, 4, GROUPED, true>(L);
          break;
        default: break;
      }
    }
    if (one_wave) return launch_small_kind<K, 4, GROUPED, true>(L);
    if constexpr (kBits == 8) {
      // 8-bit, n / 64 > SMs: 4 strips at 2 stages (104-108 KB, 2 blocks per SM), as the 4-bit zero-point kinds below.
      // Against the 2-strip, 4-stage kernel (same shared memory, same blocks per SM) on the H200 (kernel/NOTES.md):
      // fp16 x 8-bit g128 m = 1 8192 x 10240 38.4 -> 29.7 us, 4096 x 12288 21.8 -> 18.0, 4096 x 22016 34.6 -> 29.9,
      // 8192 x 57344 132.5 -> 124.8 (m = 16: 46.8 -> 41.4, 161.5 -> 141.6): half the stages' bookkeeping per byte.
      if (optin >= Tile<1, 1, 4, 2, GROUPED, 8, kZp>::kSmemBytes) return launch_small_kind<K, 4, GROUPED, true, 2>(L);
    }
    if constexpr (kBits == 4 && kZp && GROUPED) {
      // 4-bit zero points, grouped, n / 64 > SMs: 4 strips at 2 stages (74 KB, 2 blocks per SM). Against the 3-strip
      // kernel below (whose warps' 48 rows straddle a group of 128 in 2 of 8 warps per stage, and those warps take
      // the 16-bit scale path), measured on the H200 (kernel/NOTES.md): 8192 x 57344 m = 1 121.9 -> 99.2 us,
      // 8192 x 10240 35.1 -> 28.5, 4096 x 12288 19.5 -> 16.2 (m = 16: 6-9 % faster), bf16 alike; 2 strips at 4
      // stages were 10-40 % slower.
      if (optin >= Tile<1, 1, 4, 2, GROUPED, 4, true>::kSmemBytes) return launch_small_kind<K, 4, GROUPED, true, 2>(L);
    }
    if constexpr (kBits == 4 && kZp && !GROUPED) {
      // channelwise zero points, n / 64 > SMs: the same 4-strip, 2-stage kernel
      if (tiles > L.sms && optin >= Tile<1, 1, 4, 2, false, 4, true>::kSmemBytes)
        return launch_small_kind<K, 4, false, true, 2>(L);
    }
    if constexpr (kBits == 4) {
      if (optin >= Tile<1, 1, 3, 4, GROUPED, 4, kZp>::kSmemBytes && (kZp || L.n / 64 <= 2 * L.sms))
        return launch_small_kind<K, 3, GROUPED, true>(L);
      if constexpr (!kZp) {
        if (optin >= Tile<1, 1, 2, 4, GROUPED, 4, kZp>::kSmemBytes) return launch_small_kind<K, 2, GROUPED, false>(L);
      }
    } else {
      if (optin >= Tile<1, 1, 2, 4, GROUPED, 8, kZp>::kSmemBytes) return launch_small_kind<K, 2, GROUPED, true>(L);
    }
  }
  if (L.m > 16) {
    const int cfg = small_cfg();  // benchmark-only switch (launch_m32_cfg)
    if (cfg >= 30) {
      bool launched = false;
      const int rc = launch_m32_cfg<K, GROUPED>(L, cfg, launched);
      if (launched) return rc;
    }
    if (L.m <= 32 && cfg < 0) {  // m = 17..32: the direct-load kernel where it takes the layer (Hopper, 4-bit; try_direct)
      bool launched = false;
      const int rc = try_direct<K, GROUPED>(L, optin, launched);
      if (launched) return rc;
    }
    {  // Hopper, 4-bit, m > 32: the wgmma kernel (try_wgmma)
      bool launched = false;
      const int rc = try_wgmma<K, GROUPED>(L, launched);
      if (launched) return rc;
    }
    if (cfg < 0) {  // m = 17..128, 4-bit: the 8-strip 32-row kernels where they pay
      bool launched = false;
      const int rc = try_eight_strip_32<K, GROUPED>(L, optin, launched);
      if (launched) return rc;
    }
    // The m > 16 kernels of fp16 x 4-bit symmetric (dispatch_fp16_int4): 4-bit, 64-row chunks at 8 strips x 2 stages
    // for m > 64 and for m = 33..64 with long k or wide n, else 32-row chunks at 4 strips x 2 stages; 8-bit grouped the
    // latter. Against the 1-strip, 4-stage kernel below, on the H200 (`--m 32,64,128 --cfgs`, kernel/NOTES.md), group
    // 128 geomean m = 32 / 64 / 128: bf16-int4 1.13 / 0.71 / 0.46x -> 1.43 / 0.92 / 0.63x, fp16-int4-zp 1.02 / 0.59 /
    // 0.34x -> 1.29 / 0.77 / 0.63x, fp16-int8 0.93 / 0.54 / 0.31x -> 1.21 / 0.74 / 0.44x; 8-bit channelwise lost
    // there (1.28 -> 1.22x at m = 32: the 136 KB kernel runs one block per SM) and keeps the 1-strip kernel.
    if constexpr (kBits == 4) {
      if (wants_64_row_chunks(L) && optin >= Tile<4, 2, 8, 2, GROUPED, 4, kZp>::kSmemBytes)
        return launch_config<K, 4, 2, 8, 2, GROUPED>(L);
    }
    if constexpr (kBits == 4 || GROUPED) {
      if (optin >= Tile<2, 1, 4, 2, GROUPED, kBits, kZp>::kSmemBytes) return launch_config<K, 2, 1, 4, 2, GROUPED>(L);
    }
  }
  return launch_config<K, 2, 1, 1, 4, GROUPED>(L);
}

// One kind, grouped (more than one scale row) or channelwise.
template <class K>
int dispatch(const Launch& L) {
  return L.scale_rows > 1 ? dispatch_kind<K, true>(L) : dispatch_kind<K, false>(L);
}

// The kinds of each translation unit (bits 4 or 8; zero points when L.zp is not null).
int launch_fp16_int4_sym(const Launch& L);          // marlin_gemm.cu
int launch_fp16_other(const Launch& L, int bits);   // marlin_gemm_fp16.cu: 4-bit with zero points, 8-bit
int launch_bf16_int4(const Launch& L);              // marlin_gemm_bf16_int4.cu
int launch_bf16_int8(const Launch& L);              // marlin_gemm_bf16_int8.cu

}  // namespace detail
}  // namespace marlin_convert
