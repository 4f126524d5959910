// marlin-convert: the dequantize-to-shared wgmma kernel ("DQS"), Hopper only (sm_90a), an experiment for issue #11
// (benchmark switch MARLIN_CONVERT_WGMMA = 8; never taken by default).
//
// Why: the 128-row wgmma kernel (SWAP 3) gives the dequantized weights to wgmma as its register operand, so every warp
// runs a dependent chain per k16 strip (shared load of B -> dequant -> scale -> wgmma -> wait) with two warps per
// scheduler, and its tensor pipe is about half busy (kernel/NOTES.md, twenty-fourth session's ncu). Here the weights
// of a k64 chunk are dequantized by all 256 threads into shared memory (fp16 / bf16, the 128-byte-swizzled K-major
// layout wgmma reads), and each warpgroup then issues four m64n256k16 wgmma with both operands from shared memory;
// the next chunk's dequantization runs while those run. The tensor work of a chunk (2 warpgroups x 4 x 64 x 256 x 16
// MACs = 2^21, ~1024 cycles at 2048 MACs per cycle per SM) then hides the dequantization (8 words per thread).
//
// Shape of a block: 128 batch rows (warpgroup wg takes rows 64 wg .. 64 wg + 63) x 256 columns, the whole of k (no
// split). Kinds: 4-bit, symmetric (no zero points), fp16 or bf16 activations, grouped (group size a multiple of 64)
// or channelwise; n % 256 == 0, k % 64 == 0 (launch_dqs checks, else the caller takes the other kernels).
//
// Shared memory (1024-byte aligned; offsets in bytes):
//   A slots   kSlots x 16 KB  chunk c's activations, 128 rows x 128 bytes, chunk ch of row r at (ch ^ (r % 8))
//   W bufs    2 x 32 KB       chunk c's dequantized weights, 256 rows (columns n) x 128 bytes (64 k), same swizzle
//   B slots   kSlots x 8 KB   chunk c's Marlin words: strip s (4) x piece p (4 x 64 columns) x lane (32) int4
//   S slots   kSlots x 512 B  chunk c's scale row (grouped), 256 values in the Marlin scale order
//
// Per chunk c (one iteration; copies run two chunks ahead):
//   wgmma_wait<1>     this warpgroup's chunk c - 2 done (c - 1 may still run)
//   cp.async wait     this thread's copies of chunk c landed
//   barrier           chunk c visible to all; both warpgroups are past chunk c - 2: W buf c % 2 and slot (c + 2) %
//                     kSlots free
//   [G2S]             copies of chunk c + 2
//   [DEQ]             Marlin words -> q - z -> times the scale -> stmatrix into W buf c % 2
//   fence + barrier   the stores and the copies visible to wgmma (async proxy)
//   [MMA]             4 x wgmma m64n256k16 (k16 slices of the chunk), one commit group
// [OUT] after the last chunk: wgmma_wait<0>, channelwise scales in fp32, pairs written to C.

#pragma once

namespace marlin_convert {
namespace detail {

struct DqsShape {
  static constexpr int kRows = 128;   // batch rows per block: two warpgroups of m64
  static constexpr int kTN = 256;     // columns per block: wgmma N = 256
  static constexpr int kChunkK = 64;  // k per chunk: one 128-byte swizzle row of 16-bit values
  static constexpr int kSlots = 4;    // copy slots: chunks c - 1 (its wgmma may run), c, c + 1, c + 2
  static constexpr int kABytes = kRows * kChunkK * 2;  // 16384
  static constexpr int kWBytes = kTN * kChunkK * 2;    // 32768
  static constexpr int kBBytes = kTN * kChunkK / 2;    // 8192 (4 bits a weight)
  static constexpr int kSBytes = kTN * 2;              // 512
  static constexpr int kAOff = 0;
  static constexpr int kWOff = kAOff + kSlots * kABytes;
  static constexpr int kBOff = kWOff + 2 * kWBytes;
  static constexpr int kSOff = kBOff + kSlots * kBBytes;
  static constexpr int kSmemBytes = kSOff + kSlots * kSBytes + 1024;  // + room to align the start to 1024 bytes
  static_assert(kABytes % 1024 == 0 && kWBytes % 1024 == 0, "swizzle atoms start 1024-byte aligned");
};

// 16-byte copy global -> shared, L2 only; skipped when !pred (then gmem is never dereferenced).
__device__ __forceinline__ void dqs_copy16(uint32_t smem, const void* gmem, bool pred) {
  asm volatile("{\n  .reg .pred p;\n  setp.ne.b32 p, %0, 0;\n  @p cp.async.cg.shared.global [%1], [%2], 16;\n}\n"
               ::"r"((int)pred), "r"(smem), "l"(gmem));
}

// stmatrix .x4: four 8 x 8 matrices of 16-bit values; lane l gives the address of row l % 8 of matrix l / 8, and
// register i holds matrix i's (row lane / 4, columns 2 (lane % 4), + 1), low half first: the inverse of ldmatrix.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
#else
  (void)addr, (void)r0, (void)r1, (void)r2, (void)r3;
  __trap();
#endif
}

// D[64 x 256] += A[64 x 16] B[16 x 256], both operands from shared memory (K-major, 128-byte swizzle: descriptors by
// wgmma_desc_sw128), fp32 accumulators d[128] in the wgmma D layout: d[4 i + e] = (row 16 w + lane / 4 + 8 (e / 2),
// column 8 i + 2 (lane % 4) + e % 2) for warp w of the warpgroup.
template <class ActT>
__device__ __forceinline__ void dqs_wgmma(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                          int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DQS_F4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define DQS_F32(i) DQS_F4(i), DQS_F4(i + 4), DQS_F4(i + 8), DQS_F4(i + 12), DQS_F4(i + 16), DQS_F4(i + 20), \
                   DQS_F4(i + 24), DQS_F4(i + 28)
#define DQS_REGS                                                                                         \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                               \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                     \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                     \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                     \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                     \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                     \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "         \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
  if constexpr (std::is_same<ActT, half>::value) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" DQS_REGS "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : DQS_F32(0), DQS_F32(32), DQS_F32(64), DQS_F32(96)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)
                 : "memory");
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" DQS_REGS "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : DQS_F32(0), DQS_F32(32), DQS_F32(64), DQS_F32(96)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)
                 : "memory");
  }
#undef DQS_REGS
#undef DQS_F32
#undef DQS_F4
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();
#endif
}

// [DEQ] one 64-column piece of one k16 strip: the lane's int4 v of Marlin words (tile j = word j) and, grouped, its
// int4 sc of scales (word j = the scales of tile j's columns c, c + 8, c = lane / 4) -> q - z, times the scale -> the W
// buffer, by stmatrix. dst: the W buffer + the piece's first column * 128 + this lane's row address inside a tile
// (dqs_st_lane).
template <class DQ, class Ops, bool GROUPED>
__device__ __forceinline__ void dqs_dequant_piece(int4 v, int4 sc, uint32_t dst) {
  const uint32_t words[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
  const uint32_t scales[4] = {(uint32_t)sc.x, (uint32_t)sc.y, (uint32_t)sc.z, (uint32_t)sc.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t f[4];
    DQ::template run<false>(&words[j], typename DQ::Zero{}, f);
    if constexpr (GROUPED) scale_tile<Ops>(f, scales[j]);
    stmatrix_x4(dst + (uint32_t)(j * 16 * 128), f[0], f[1], f[2], f[3]);
  }
}

// The stmatrix row address of this lane inside a 16 x 16 tile of a W buffer, for k16 strip `strip` (0..3) of the
// chunk: matrix q = lane / 8 (q % 2: k half, q / 2: column half), its row lane % 8: column n = (lane % 8) + 8 (lane /
// 16) of the tile, 16-byte chunk (2 strip + q % 2) ^ (n % 8) of that column's 128-byte row (n % 8 = lane % 8: tiles
// start at multiples of 16 columns).
__device__ __forceinline__ uint32_t dqs_st_lane(int lane, int strip) {
  return (uint32_t)(((lane & 7) + ((lane >> 4) << 3)) * 128) +
         (uint32_t)(((2 * strip + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
}

// [OUT] a warpgroup's accumulators (rows row_a, row_a + 8 of warp w: row_a = its first row + 16 w + lane / 4) to C:
// channelwise scales in fp32 first (FORMAT.md section 3: in each run of 32 scale values, columns 8 a + 2 t, + 1 sit at
// 8 t + 2 a, + 1).
template <class Ops, bool GROUPED, class ActT>
__device__ __forceinline__ void dqs_write(const float (&acc)[128], const int4* S, ActT* C, int m, int n, int ntile,
                                          int row_a, int lane) {
  const int t = lane & 3;
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(S);
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int col = ntile * DqsShape::kTN + 8 * i + 2 * t;
    float v0 = acc[4 * i], v1 = acc[4 * i + 1], v2 = acc[4 * i + 2], v3 = acc[4 * i + 3];
    if constexpr (!GROUPED) {
      const uint32_t sw =
          *reinterpret_cast<const uint32_t*>(s16 + ntile * DqsShape::kTN + 32 * (i >> 2) + 8 * t + 2 * (i & 3));
      const float2 sf = Ops::to_float2(sw);
      v0 *= sf.x;
      v1 *= sf.y;
      v2 *= sf.x;
      v3 *= sf.y;
    }
    if (row_a < m) *reinterpret_cast<uint32_t*>(C + (size_t)row_a * n + col) = Ops::pack(v0, v1);
    if (row_a + 8 < m) *reinterpret_cast<uint32_t*>(C + (size_t)(row_a + 8) * n + col) = Ops::pack(v2, v3);
  }
}

// Named barriers in their non-aligned form (the threads of one barrier meet at different instructions: producers and
// consumers), `count` threads in all; id 0 is __syncthreads'.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

template <class K, bool GROUPED>
__global__ void __launch_bounds__(kThreads, 1)
    dqs_kernel(const int4* __restrict__ A, const int4* __restrict__ B, const int4* __restrict__ S,
               typename K::ActT* __restrict__ C, int m, int n, int k, int group_size) {
  static_assert(K::kBits == 4 && !K::kZp, "DQS: 4-bit symmetric kinds only");
  using ActT = typename K::ActT;
  using Ops = Act<ActT>;
  using DQ = Dequant<ActT, 4>;
  using D = DqsShape;
  extern __shared__ __align__(16) unsigned char dqs_smem_raw[];
  const uint32_t base = smem_u32(dqs_smem_raw) + ((1024u - (smem_u32(dqs_smem_raw) & 1023u)) & 1023u);
  unsigned char* const base_ptr = dqs_smem_raw + (base - smem_u32(dqs_smem_raw));

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wg = warp >> 2;  // warpgroup: batch rows 64 wg ..
  const int ntile = blockIdx.x;
  const int row0 = blockIdx.y * D::kRows;
  const int chunks = k / D::kChunkK;
  const size_t b_row_int4 = (size_t)n / 2;  // one k16 strip of B: 2 n int32 = n / 2 int4
  const size_t s_row_int4 = (size_t)n / 8;  // one scale row: n 16-bit values

  grid_dependency_wait();  // (launched without PDL: returns at once)

  // ---- [G2S] chunk c into slot c % kSlots
  auto load_chunk = [&](int c) {
    const int slot = c % D::kSlots;
    const uint32_t sa = base + D::kAOff + slot * D::kABytes;
    const int kc = c * D::kChunkK;
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // A: 128 rows x 8 chunks of 16 bytes = 4 per thread
      const int i = tid + u * kThreads;
      const int r = i >> 3, ch = i & 7;
      const int grow = row0 + r;
      const bool ok = grow < m;  // rows >= m: left as they are; they reach only C rows that are never written
      dqs_copy16(sa + r * 128 + ((ch ^ (r & 7)) << 4), A + ((size_t)(ok ? grow : 0) * k + kc) / 8 + ch, ok);
    }
    const uint32_t sb = base + D::kBOff + slot * D::kBBytes;
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // B: 4 strips x 128 int4 (the tile's 256 columns) = 2 per thread
      const int i = tid + u * kThreads;
      const int s = i >> 7, w = i & 127;
      dqs_copy16(sb + i * 16, B + (size_t)(c * 4 + s) * b_row_int4 + (size_t)ntile * 128 + w, true);
    }
    if constexpr (GROUPED) {
      if (tid < 32) {
        const uint32_t ss = base + D::kSOff + slot * D::kSBytes;
        const int grp = kc / group_size;
        dqs_copy16(ss + tid * 16, S + (size_t)grp * s_row_int4 + (size_t)ntile * 32 + tid, true);
      }
    }
  };

  float acc[128];  // (the first chunk's wgmma start from zero: scale-d = 0)

  // The dequantization's share of this thread: strip ds of the chunk, pieces 2 (warp % 2) and + 1 (64 columns each)
  const int ds = warp >> 1;
  const int dp0 = 2 * (warp & 1);
  const uint32_t st_lane = dqs_st_lane(lane, ds);

  load_chunk(0);
  cp_async_commit();
  if (chunks > 1) load_chunk(1);
  cp_async_commit();

  for (int c = 0; c < chunks; ++c) {
    wgmma_wait<1>();
    cp_async_wait<1>();
    __syncthreads();
    if (c + 2 < chunks) load_chunk(c + 2);
    cp_async_commit();

    const int slot = c % D::kSlots;
    const uint32_t wbuf = base + D::kWOff + (c & 1) * D::kWBytes;
    {
      const int4* sb = reinterpret_cast<const int4*>(base_ptr + D::kBOff + slot * D::kBBytes);
      const int4* ss = reinterpret_cast<const int4*>(base_ptr + D::kSOff + slot * D::kSBytes);
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        const int p = dp0 + pp;
        dqs_dequant_piece<DQ, Ops, GROUPED>(sb[ds * 128 + p * 32 + lane],
                                            GROUPED ? ss[p * 8 + (lane >> 2)] : make_int4(0, 0, 0, 0),
                                            wbuf + (uint32_t)(p * 64 * 128) + st_lane);
      }
    }
    fence_proxy_async();
    __syncthreads();

    const uint32_t sa = base + D::kAOff + slot * D::kABytes + wg * (64 * 128);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)
      dqs_wgmma<ActT>(acc, wgmma_desc_sw128(sa + s * 32), wgmma_desc_sw128(wbuf + s * 32), c > 0 || s > 0);
    wgmma_commit();
  }
  wgmma_wait<0>();
  grid_launch_dependents();

  // ---- [OUT]
  dqs_write<Ops, GROUPED>(acc, S, C, m, n, ntile, row0 + wg * 64 + (warp & 3) * 16 + (lane >> 2), lane);
}

// ------------------------------------------------------------------------------------------------ warp-specialized
// The same work split by roles (MARLIN_CONVERT_WGMMA = 9): 384 threads, warpgroups 0 and 1 the consumers (each copies
// its 64 rows of A, waits for the chunk's W buffer, issues its four wgmma), warpgroup 2 the producer (copies B and the
// scales, dequantizes into one of kWBufs W buffers). Why: in the one-role kernel above the copies, the dequantization
// and the barriers of a chunk took ~1450 cycles by themselves (H200, its wgmma left out: kernel/NOTES.md), more than
// the chunk's tensor work (~1024), and every warp waited on both; here the consumers hand a W buffer back (EMPTY) as
// soon as its wgmma are done and the producer runs up to kWBufs chunks ahead. 384 threads at one block per SM leave
// 65536 / 384 = 170 registers a thread (168 allocated): the consumers' 128 accumulators fit without setmaxnreg.
//
// Named barriers (count 384 = 128 producer + 256 consumer threads, or 128 within a warpgroup):
//   FULL b  (kFull + b)   producer arrives after W buffer b holds chunk c (c % kWBufs == b); consumers sync
//   EMPTY b (kEmpty + b)  consumers arrive once chunk c's wgmma are done (c + kWBufs < chunks); the producer syncs
//                         before dequantizing chunk c + kWBufs into buffer b
//   kProducer             the producer warpgroup's own: chunk c's B and scales landed for all of its threads
//   kConsumer + wg        consumer warpgroup wg's own: its A rows of chunk c landed
template <int PRODUCERS>
struct DqsWsShape {
  static constexpr int kProducers = PRODUCERS;  // producer warpgroups: 1 (384 threads) or 2 (512)
  static constexpr int kThreads = 128 * (2 + PRODUCERS);
  // registers a thread: 65536 / kThreads at launch (384: 168 for all, no split; 512: 128, then setmaxnreg gives the
  // consumers kConsumerRegs and the producers kProducerRegs, 256 x 168 + 256 x 88 = 65536)
  static constexpr int kConsumerRegs = 168, kProducerRegs = PRODUCERS == 1 ? 168 : 88;
  static_assert(256 * kConsumerRegs + 128 * PRODUCERS * kProducerRegs <= 65536,
                "setmaxnreg: no more than the block has");
  static constexpr int kWBufs = 3;
  static constexpr int kAOff = 0;
  static constexpr int kWOff = kAOff + DqsShape::kSlots * DqsShape::kABytes;
  static constexpr int kBOff = kWOff + kWBufs * DqsShape::kWBytes;
  static constexpr int kSOff = kBOff + DqsShape::kSlots * DqsShape::kBBytes;
  static constexpr int kSmemBytes = kSOff + DqsShape::kSlots * DqsShape::kSBytes + 1024;  // 199680
  static constexpr int kFull = 1, kEmpty = kFull + kWBufs, kProducer = kEmpty + kWBufs, kConsumer = kProducer + 1;
  static_assert(kConsumer + 2 <= 16, "16 named barriers");
};

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

template <class K, bool GROUPED, int PRODUCERS>
__global__ void __launch_bounds__(DqsWsShape<PRODUCERS>::kThreads, 1)
    dqs_ws_kernel(const int4* __restrict__ A, const int4* __restrict__ B, const int4* __restrict__ S,
                  typename K::ActT* __restrict__ C, int m, int n, int k, int group_size) {
  static_assert(K::kBits == 4 && !K::kZp, "DQS: 4-bit symmetric kinds only");
  using ActT = typename K::ActT;
  using Ops = Act<ActT>;
  using DQ = Dequant<ActT, 4>;
  using D = DqsShape;
  using W = DqsWsShape<PRODUCERS>;
  constexpr int kAll = W::kThreads;
  extern __shared__ __align__(16) unsigned char dqs_smem_raw[];
  const uint32_t base = smem_u32(dqs_smem_raw) + ((1024u - (smem_u32(dqs_smem_raw) & 1023u)) & 1023u);
  unsigned char* const base_ptr = dqs_smem_raw + (base - smem_u32(dqs_smem_raw));

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int ntile = blockIdx.x;
  const int row0 = blockIdx.y * D::kRows;
  const int chunks = k / D::kChunkK;

  grid_dependency_wait();  // (launched without PDL: returns at once)

  if (warp >= 8) {
    // ---- producer: [G2S] B and scales two chunks ahead, [DEQ] chunk c into W buffer c % kWBufs
    if constexpr (PRODUCERS > 1) setmaxnreg_dec<W::kProducerRegs>();
    constexpr int kPThreads = 128 * PRODUCERS;
    constexpr int kPieces = 4 / PRODUCERS;  // 64-column pieces per warp and chunk
    const int pt = tid - 256;
    const int pw = warp - 8;
    const int strip = pw / PRODUCERS;  // this warp's k16 strip of every chunk, and its pieces from piece0 on
    const int piece0 = (pw % PRODUCERS) * kPieces;
    const size_t b_row_int4 = (size_t)n / 2;
    const size_t s_row_int4 = (size_t)n / 8;
    auto load_bs = [&](int c) {
      const int slot = c % D::kSlots;
      const uint32_t sb = base + W::kBOff + slot * D::kBBytes;
#pragma unroll
      for (int u = 0; u < 512 / kPThreads; ++u) {  // 4 strips x 128 int4
        const int i = pt + u * kPThreads;
        dqs_copy16(sb + i * 16, B + (size_t)(c * 4 + (i >> 7)) * b_row_int4 + (size_t)ntile * 128 + (i & 127), true);
      }
      if (GROUPED && pt < 32) {
        const uint32_t ss = base + W::kSOff + slot * D::kSBytes;
        dqs_copy16(ss + pt * 16, S + (size_t)(c * D::kChunkK / group_size) * s_row_int4 + (size_t)ntile * 32 + pt,
                   true);
      }
    };
    load_bs(0);
    cp_async_commit();
    if (chunks > 1) load_bs(1);
    cp_async_commit();
    const uint32_t st_lane = dqs_st_lane(lane, strip);
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<1>();
      named_sync(W::kProducer, kPThreads);  // chunk c's B and scales landed; every producer thread is past chunk c - 1
      if (c + 2 < chunks) load_bs(c + 2);
      cp_async_commit();
      const int b = c % W::kWBufs;
      if (c >= W::kWBufs) named_sync(W::kEmpty + b, kAll);  // the consumers are done with chunk c - kWBufs
      const int slot = c % D::kSlots;
      const int4* sb = reinterpret_cast<const int4*>(base_ptr + W::kBOff + slot * D::kBBytes);
      const int4* ss = reinterpret_cast<const int4*>(base_ptr + W::kSOff + slot * D::kSBytes);
      const uint32_t wbuf = base + W::kWOff + b * D::kWBytes;
#pragma unroll
      for (int pp = 0; pp < kPieces; ++pp) {
        const int p = piece0 + pp;
        dqs_dequant_piece<DQ, Ops, GROUPED>(sb[strip * 128 + p * 32 + lane],
                                            GROUPED ? ss[p * 8 + (lane >> 2)] : make_int4(0, 0, 0, 0),
                                            wbuf + (uint32_t)(p * 64 * 128) + st_lane);
      }
      fence_proxy_async();  // the stores visible to wgmma (async proxy) ...
      named_arrive(W::kFull + b, kAll);  // ... before the consumers may read them
    }
    return;
  }

  // ---- consumers: warpgroup wg takes batch rows 64 wg .. 64 wg + 63
  if constexpr (PRODUCERS > 1) setmaxnreg_inc<W::kConsumerRegs>();
  const int wg = warp >> 2;
  const int ct = tid & 127;
  auto load_a = [&](int c) {  // this warpgroup's 64 rows x 8 chunks of 16 bytes = 4 per thread
    const uint32_t sa = base + W::kAOff + (c % D::kSlots) * D::kABytes;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = ct + u * 128;
      const int r = wg * 64 + (i >> 3), ch = i & 7;
      const int grow = row0 + r;
      const bool ok = grow < m;  // rows >= m: left as they are; they reach only C rows that are never written
      dqs_copy16(sa + r * 128 + ((ch ^ (r & 7)) << 4),
                 A + ((size_t)(ok ? grow : 0) * k + (size_t)c * D::kChunkK) / 8 + ch, ok);
    }
  };
  load_a(0);
  cp_async_commit();
  if (chunks > 1) load_a(1);
  cp_async_commit();
  float acc[128];  // (the first chunk's wgmma start from zero: scale-d = 0)
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait<1>();
    fence_proxy_async();                 // this thread's A copies of chunk c visible to wgmma
    named_sync(W::kConsumer + wg, 128);  // ... and every thread's of this warpgroup; all past chunk c - 1's wgmma wait
    if (c + 2 < chunks) load_a(c + 2);   // (into chunk c - 2's slot: its wgmma are done, wgmma_wait<1> below)
    cp_async_commit();
    const int b = c % W::kWBufs;
    named_sync(W::kFull + b, kAll);
    const uint32_t sa = base + W::kAOff + (c % D::kSlots) * D::kABytes + wg * (64 * 128);
    const uint32_t wbuf = base + W::kWOff + b * D::kWBytes;
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)
      dqs_wgmma<ActT>(acc, wgmma_desc_sw128(sa + s * 32), wgmma_desc_sw128(wbuf + s * 32), c > 0 || s > 0);
    wgmma_commit();
    wgmma_wait<1>();  // chunk c - 1's wgmma done: its W buffer goes back to the producer
    if (c >= 1 && c - 1 + W::kWBufs < chunks) named_arrive(W::kEmpty + (c - 1) % W::kWBufs, kAll);
  }
  wgmma_wait<0>();
  grid_launch_dependents();
  dqs_write<Ops, GROUPED>(acc, S, C, m, n, ntile, row0 + wg * 64 + (warp & 3) * 16 + (lane >> 2), lane);
}

// MARLIN_CONVERT_WGMMA = 8 (9: dqs_ws_kernel with one producer warpgroup): the DQS kernel where it applies (4-bit
// symmetric, n % 256 == 0, k % 64 == 0, grouped with a group size that is a multiple of 64); launched = false
// elsewhere. One block per (256-column tile, 128-row chunk), whole k, no PDL.
template <class K, bool GROUPED>
int launch_dqs(const Launch& L, bool& launched, int producers) {
  launched = false;
  if constexpr (K::kBits != 4 || K::kZp) {
    return MARLIN_OK;
  } else {
    if (L.n % DqsShape::kTN != 0 || L.k % DqsShape::kChunkK != 0) return MARLIN_OK;
    const int group_size = L.k / L.scale_rows;
    if (GROUPED && group_size % DqsShape::kChunkK != 0) return MARLIN_OK;
    const int smem = producers > 0 ? DqsWsShape<1>::kSmemBytes : DqsShape::kSmemBytes;
    if (smem_optin() < smem) return MARLIN_OK;
    // (producers == 2, 512 threads with setmaxnreg 168 / 88, does not build: ptxas C7602 "Insufficient registers (128)"
    // for the consumers' wgmma, the launch's 65536 / 512 taken as their limit; not launched)
    if (producers > 1) return MARLIN_OK;
    auto kernel = producers == 1 ? dqs_ws_kernel<K, GROUPED, 1> : dqs_kernel<K, GROUPED>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) {
      set_error(L.err, L.errlen, "cudaFuncSetAttribute(%d bytes of shared memory) failed: %s", smem,
                cudaGetErrorString(e));
      return MARLIN_CUDA_ERROR;
    }
    launched = true;
    const int m_chunks = (L.m + DqsShape::kRows - 1) / DqsShape::kRows;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(L.n / DqsShape::kTN), (unsigned)m_chunks, 1);
    cfg.blockDim = dim3(producers > 0 ? 128 * (2 + producers) : kThreads, 1, 1);
    cfg.dynamicSmemBytes = (size_t)smem;
    cfg.stream = L.stream;
    e = cudaLaunchKernelEx(&cfg, kernel, static_cast<const int4*>(L.A), static_cast<const int4*>(L.B),
                           static_cast<const int4*>(L.s), static_cast<typename K::ActT*>(L.C), L.m, L.n, L.k,
                           group_size);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      set_error(L.err, L.errlen, "DQS kernel launch (grid %d x %d) failed: %s", L.n / DqsShape::kTN, m_chunks,
                cudaGetErrorString(e));
      return MARLIN_CUDA_ERROR;
    }
    note_launch(producers == 1 ? "wgmma-dqs-ws" : "wgmma-dqs", DqsShape::kRows / 16, 4, 4, DqsShape::kSlots, 4, 0,
                (long)(L.n / DqsShape::kTN) * m_chunks);
    return MARLIN_OK;
  }
}

}  // namespace detail
}  // namespace marlin_convert
