// marlin-convert: the direct-load kernel for small batches (m <= 32, 4-bit kinds, Hopper), written for this project.
// Included by marlin_gemm_impl.cuh after the mma.sync kernel; it reuses that file's Kind, Act, Dequant and Launch.
//
//   C[m, n] = A[m, k] @ W[k, n],   W = (q - z) * s,   the same sums as marlin_gemm_kernel (fp32 accumulation)
//
// Why a second kernel: at small m the work is reading B once, and the pipelined kernel moves it global -> shared ->
// registers, with a barrier per stage and the split-K chain through C between blocks. Here every lane loads its B words
// straight into registers, and the blocks that share an output tile reduce through distributed shared memory (cluster
// mode: two blocks per tile where all fit at once, one block per tile where only the tiles do) or, where the tiles
// outnumber the blocks that fit at once, take even shares of the work and add through C (stream-K).
//
// ------------------------------------------------------------------------------------------------ overview
// Work: a block computes runs of one 64-column tile's chunks (32 x 16-byte words of B per 16-row strip, 512 bytes;
// kDirectChunkK = 128 k = 8 strips per chunk): segments.
//   cluster mode (units_per_block == 0): one segment per block. The `splits` blocks of a tile form one thread-block
//     cluster (cluster rank = split; splits = 1: one block per tile, no cluster), so their partial sums meet in shared
//     memory, not in C; no workspace or lock:
//       grid = (n / 64 tiles) x splits, blockIdx.x = tile * splits + split, cluster = (splits, 1, 1), splits <= 8
//       block split s: chunks [s * chunks / splits, (s + 1) * chunks / splits) of the k / 128 chunks
//   stream-K (units_per_block > 0, no clusters): the (tile, unit) space, a unit = kDirectUnitChunks = 8 chunks of a
//     tile (one per warp), cut into runs of units_per_block units, one per block, all blocks resident at once; a run
//     that crosses tiles is several segments, taken last first. A tile's contributors (at most 4) add their sums into
//     C in block order under the tile's lock in the workspace (as the pipelined kernel's stream-K).
//   warp w of a segment of nc chunks from c_begin: chunks [c_begin + w * nc / 8, c_begin + (w + 1) * nc / 8).
//
// Per segment:
//   [LDB]  each warp keeps one chunk of B in flight in registers: lane l, strip i -> the 16-byte word l of the tile's
//          512 bytes (ld.global.nc, no L1 allocation: read once), a ring in which strip i's registers are refilled with
//          the next chunk's strip i as soon as they are dequantized; the next chunk's zero-point word (group zero
//          points) one chunk ahead too, the chunk's scale word at its start; and the next chunk's rows < m of A (256
//          bytes each) into the warp's other shared-memory slot (cp.async, two slots per warp), rows kARowBytes = 272
//          bytes apart; allocated in L1 too (cp.async.ca, cp_async16<true>), since the blocks of one split on an SM
//          read the same A chunks at about the same time (at m = 8 the A copies are half of B's bytes, all from L2).
//          The next segment's first chunk (B and A) is loaded before this one is reduced.
//   [S2R]  the activations' fragment of a strip and batch block: two 4-byte ld.shared per lane (k 2t, 2t + 1 and
//          2t + 8, 2t + 9 of row 8 bb + g); the 16-byte pad per row puts the 32 lanes on 32 banks (row g at word
//          68 g: bank 4 g + t).
//   [DEQ]  Dequant<ActT, 4>: q - z exactly, as in the pipelined kernel.
//   [MMA]  swapped, C^T = W^T A^T: the tile's four fragments are the A operand {f0, f2, f1, f3} of mma.m16n8k16, the
//          activations' fragment (8 batch rows) the B operand; MB8 batch blocks of 8 rows (m <= 8: 1, m <= 16: 2,
//          m <= 32: 4).
//          With group scales the chunk lies inside one group (the host requires group_size % 128 == 0): its sums are
//          formed unscaled and added to the accumulators times the group's scales in fp32 (16 FFMA per batch block).
//   [RED]  the 8 warps' accumulators through shared memory (red); then
//          stream-K, or one block per tile: summed into the block's sums P[row][64] (fp32);
//          cluster mode with splits > 1: summed per output pair p (rows < m) and pushed into block
//            p % splits' shared memory (st.shared::cluster; the barrier that lets it write there was arrived at on
//            entry, so its wait costs nothing by then), one cluster barrier, and block s adds the pushed sums of its
//            pairs (one barrier: an earlier form read the peers' P after a barrier and needed a second one to keep P
//            alive until they had);
//          stream-K with several contributors: contributor i > 0 waits until the tile's lock is i, adds what C holds;
//            then sets the lock to i + 1 (the last one back to 0: the workspace is zero again at the end);
//          channelwise scales applied in fp32, C written.
//
// Only on compute capability 9.0 (clusters; the host's direct_variant decides), built into the sm_90a code. Elsewhere
// the kernel body traps and is never launched. Where it is the default: direct_pays (m <= 8; m = 9..32 in clusters of
// two only).

#pragma once

namespace marlin_convert {
namespace detail {

constexpr int kDirectStrips = 8;                   // 16-row k-strips per chunk
constexpr int kDirectChunkK = 16 * kDirectStrips;  // 128 k per chunk: one group of 128
constexpr int kDirectMaxSplits = 8;                // the portable cluster size limit
constexpr int kDirectUnitChunks = kWarps;          // stream-K: a unit of work is one chunk per warp

// [LDB] 16-byte load of data read exactly once: not allocated in L1 (ld.global.nc.L1::no_allocate).
__device__ __forceinline__ uint4 ldg_stream16(const int4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

constexpr int kARowBytes = kDirectChunkK * 2 + 16;  // one A row of a chunk (128 16-bit values) + 16 bytes of pad

// Shared memory of one block: each warp's two A slots (m rows of kARowBytes each); behind them the warps' accumulators
// for the reduction (8 warps x 64 columns x 8 MB8 rows, fp32), apart from the slots so that the next segment's first A
// rows can be copied while a segment is reduced; last the block's sums P (8 MB8 rows x 64 columns, fp32), or in a
// cluster the sums its peers push for the output pairs it writes (splits x ceil(m x 32 / splits) float2: at most
// kDirectMaxSplits - 1 more than P's).
template <int MB8>
struct DirectSmem {
  static constexpr int kRows = 8 * MB8;
  static constexpr int kRedBytes = kWarps * 64 * kRows * 4;
  static constexpr int kSumBytes = (kRows * 32 + kDirectMaxSplits) * 8;
  static __host__ __device__ int slot_bytes(int m) { return m * kARowBytes; }
  static __host__ __device__ int red_offset(int m) { return kWarps * 2 * slot_bytes(m); }
  static __host__ __device__ int sum_offset(int m) { return red_offset(m) + kRedBytes; }
  static int bytes(int m) { return sum_offset(m) + kSumBytes; }
};

// The lane's scale word of a group: the scales of its 8 columns, word j = tile j (low half column 16 j + g, high half
// 16 j + 8 + g), through L1 (the 4 lanes of a quarter read the same 16 bytes).
__device__ __forceinline__ uint4 ldg_u4(const int4* p) {
  const int4 v = __ldg(p);
  return make_uint4((uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w);
}

// A run of one tile's chunks that a block computes: chunks [c_begin, c_end) of tile `tile`; the tile's partial sums
// from `contributors` blocks (contributor = this block's place among them) meet in a cluster (cluster mode) or in C
// under the tile's lock (stream-K).
struct DirectSegment {
  int tile, c_begin, c_end, contributor, contributors;
};

// Template parameters: K a 4-bit Kind; MB8 batch blocks of 8 rows (m <= 8 * MB8); GROUPED: group scales (group size a
// multiple of 128) or one channelwise scale row.
// Arguments as marlin_gemm_kernel's (A gathered for act-order; Z as 32-bit words, [scale_rows, n / 8]; locks: the
// workspace, zero on entry and on exit), plus
//   chunks_per_group  group_size / 128 (GROUPED)
//   splits            cluster mode: blocks per tile = the cluster size (1 .. 8); stream-K: 1
//   units_per_block   0: cluster mode; > 0: stream-K, each block takes that many units of kDirectUnitChunks chunks
template <class K, int MB8, bool GROUPED>
__global__ void __launch_bounds__(kThreads, MB8 == 1 ? 2 : 1)
    marlin_direct_kernel(const int4* __restrict__ A, const int4* __restrict__ B, const int4* __restrict__ S,
                         const uint32_t* __restrict__ Z, typename K::ActT* __restrict__ C, int* __restrict__ locks,
                         int m, int n, int k, int chunks_per_group, int splits, int units_per_block) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(K::kBits == 4, "the direct kernel takes 4-bit weights");
  using ActT = typename K::ActT;
  using Ops = Act<ActT>;
  using DQ = Dequant<ActT, 4>;
  using SM = DirectSmem<MB8>;
  constexpr bool ZP = K::kZp;
  constexpr int kRows = SM::kRows;
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // mma groupID: W^T row (column 16 j + g, + 8), activation row of the batch block
  const int t = lane & 3;   // mma thread-in-group: k pairs 2t, 2t + 8; output batch rows 2t, 2t + 1
  const int chunks = k / kDirectChunkK;
  const bool stream_k = units_per_block > 0;

  // ---- the block's segments. Cluster mode: one, chunks [split * chunks / splits, ...) of tile blockIdx.x / splits.
  // Stream-K: the units [u_lo, min(u_lo + units_per_block, all units)) of the flattened (tile, unit) space, unit =
  // tile * tile_units + u covering chunks [8 u, 8 u + 8) of the tile, one segment per tile touched, last first: a
  // block's last segment is the head (chunk 0 on) of its tile, contributor 0, which never waits for the lock, so it is
  // done early; its first segment, a tile's tail, waits for the blocks before it, which by then have finished theirs
  // (each takes its last segment first too).
  const int tile_units = (chunks + kDirectUnitChunks - 1) / kDirectUnitChunks;
  const int u_lo = stream_k ? blockIdx.x * units_per_block : 0;
  int seg_end = stream_k ? min(u_lo + units_per_block, (n / 64) * tile_units) : 1;  // the units still to do
  auto next_segment = [&](DirectSegment& sg) {
    if (!stream_k) {
      if (seg_end == 0) return false;
      seg_end = 0;
      const int split = blockIdx.x % splits;  // the block's rank in its cluster (clusters: splits consecutive blocks)
      sg = DirectSegment{(int)(blockIdx.x / splits), (int)((long)split * chunks / splits),
                         (int)((long)(split + 1) * chunks / splits), split, splits};
      return true;
    }
    if (seg_end <= u_lo) return false;
    const int tile = (seg_end - 1) / tile_units;
    const int t_lo = tile * tile_units;
    const int u_begin = max(u_lo, t_lo) - t_lo;
    const int first_block = t_lo / units_per_block;
    sg = DirectSegment{tile, u_begin * kDirectUnitChunks, min((seg_end - t_lo) * kDirectUnitChunks, chunks),
                       (int)blockIdx.x - first_block, (t_lo + tile_units - 1) / units_per_block - first_block + 1};
    seg_end = t_lo + u_begin;
    return true;
  };
  // this warp's chunks of a segment
  auto warp_lo = [&](const DirectSegment& sg) { return sg.c_begin + warp * (sg.c_end - sg.c_begin) / kWarps; };
  auto warp_hi = [&](const DirectSegment& sg) { return sg.c_begin + (warp + 1) * (sg.c_end - sg.c_begin) / kWarps; };

  // ---- [LDB] (32-bit offsets in int4: the host checks A and B below 2^32 of them)
  const uint32_t b_row = (uint32_t)n / 2;  // int4 per B row (one strip: n / 64 tiles x 32)
  const int s_row = n / 8;  // int4 per scale row; also 32-bit words per zero-point row
  const uint32_t a_row = (uint32_t)k / 8;  // int4 per A row
  const int slot_bytes = SM::slot_bytes(m);
  unsigned char* const a_slots = smem + warp * 2 * slot_bytes;
  // the lane's word of strip 0 of chunk c, from its word of the tile's first strip (b_tile); strip i is i B rows
  // further on (b_row int4 each)
  auto b_chunk = [&](const int4* b_tile, int c) { return b_tile + (uint32_t)(c * kDirectStrips) * b_row; };
  // chunk c's rows < m of A into slot `slot` (cp.async); one group per call, empty when c >= hi, so that waiting
  // for all but the newest group always means "the current chunk's A is here"
  auto copy_a = [&](int c, int hi, int slot) {
    if (c < hi) {
      __syncwarp();  // every lane is done reading this slot (the chunk before)
      unsigned char* const dst = a_slots + slot * slot_bytes;
      for (int p = lane; p < m * 16; p += 32) {  // row p / 16, 16-byte piece p % 16 of the chunk's 256 bytes
        const int row = p >> 4, q = p & 15;
        cp_async16<true>(dst + row * kARowBytes + q * 16, A + row * a_row + (uint32_t)c * 16 + q, true);
      }
    }
    cp_async_commit();
  };
  // the group of chunk c (group 128: the chunk itself, no division)
  auto group_of_chunk = [&](int c) { return chunks_per_group == 1 ? c : c / chunks_per_group; };

  // The B words in flight: bq[i] holds strip i of the current chunk until it is dequantized, then strip i of the next
  // one (a ring one chunk = 8 x 512 bytes per warp deep, in half the registers of two whole chunks). The refill is
  // issued after the strip's dequant, so that it lands in the same registers (no copies at the chunk's end). A
  // segment's first chunk is loaded before the previous segment is reduced (start below).
  uint4 bq[kDirectStrips];
  uint32_t z_next = 0u;  // (grouped zero points) the next chunk's word, one chunk ahead: strip 0 needs it at once
  auto start = [&](const DirectSegment& sg) {
    const int lo = warp_lo(sg), hi = warp_hi(sg);
    if (lo < hi) {
      const int4* bp = b_chunk(B + sg.tile * 32 + lane, lo);
#pragma unroll
      for (int i = 0; i < kDirectStrips; ++i, bp += b_row) bq[i] = ldg_stream16(bp);
      if constexpr (ZP && GROUPED) z_next = __ldg(Z + group_of_chunk(lo) * s_row + sg.tile * 8 + g);
    }
    copy_a(lo, hi, 0);
  };

  // a_lane: this lane's activation word (row g, k 2t, 2t + 1) of slot 0; row 8 bb + g, strip i, k + 8 are immediate
  // offsets from it (8 bb x kARowBytes, 32 i, 16)
  const uint32_t a_lane = smem_u32(a_slots) + (uint32_t)(g * kARowBytes + 4 * t);
  bool row_ok[MB8];
#pragma unroll
  for (int bb = 0; bb < MB8; ++bb) row_ok[bb] = 8 * bb + g < m;
  float* const red = reinterpret_cast<float*>(smem + SM::red_offset(m));
  const int sum_offset = SM::sum_offset(m);
  float* const sums = reinterpret_cast<float*>(smem + sum_offset);
  const uint32_t sums_addr = smem_u32(smem) + (uint32_t)sum_offset;
  const uint32_t* S2 = reinterpret_cast<const uint32_t*>(S);
  uint32_t* C2 = reinterpret_cast<uint32_t*>(C);

  TraceClock trace;
  trace.stamp(0, 0.0f);
  DirectSegment seg{0, 0, 0, 0, 1};
  bool have_seg = next_segment(seg);
  // cluster mode with splits > 1: one segment per block, whose sums go to the peers that write them ([RED] below); this
  // block's arrival at the barrier that makes it safe to write into a peer's shared memory comes now, the wait there
  const bool cluster = !stream_k && splits > 1;
  if (cluster) cluster_arrive();
  // [PDL] let the next kernel start, then wait for the one before: nothing above read or wrote memory
  grid_launch_dependents();
  grid_dependency_wait();
  if (have_seg) start(seg);
  trace.stamp(1, 0.0f);
  while (have_seg) {
    const int tile = seg.tile;
    const int w_lo = warp_lo(seg), w_hi = warp_hi(seg);
    const int4* const b_tile = B + tile * 32 + lane;  // the lane's word of the tile's first strip
    const int4* const s_lane = S + tile * 8 + g;  // the lane's scale word of a group row
    [[maybe_unused]] const uint32_t* const z_lane = ZP ? Z + tile * 8 + g : nullptr;

    // channelwise zero points: one row, the lane's word read once
    [[maybe_unused]] uint32_t z_cw = 0u;
    if constexpr (ZP && !GROUPED) z_cw = __ldg(z_lane);

    // acc[bb][j][e]: column 16 j + g + 8 (e >> 1) of the tile, batch row 8 bb + 2t + (e & 1)
    float acc[MB8][4][4];
#pragma unroll
    for (int bb = 0; bb < MB8; ++bb)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[bb][j][e] = 0.0f;

    // ---- main loop: chunk c computed strip by strip, each strip's B registers refilled with the next chunk's
    for (int c = w_lo; c < w_hi; ++c) {
      const int slot = (c - w_lo) & 1;
      const bool next = c + 1 < w_hi;
      copy_a(c + 1, w_hi, slot ^ 1);
      // (grouped) this chunk's scale word, read now and used at the chunk's end (the strips cover its latency)
      uint4 s_cur = make_uint4(0u, 0u, 0u, 0u);
      if constexpr (GROUPED) s_cur = ldg_u4(s_lane + group_of_chunk(c) * s_row);
      const uint32_t z_cur = z_next;
      if constexpr (ZP && GROUPED) {
        if (next) z_next = __ldg(z_lane + group_of_chunk(c + 1) * s_row);
      }
      cp_async_wait<1>();  // this chunk's A (the newest group is the next chunk's)
      __syncwarp();
      const uint32_t a_slot = a_lane + (uint32_t)(slot * slot_bytes);
      // the four tiles' Zero values, from this chunk's zero-point word (channelwise: the one row's): once per chunk,
      // except for bf16, which derives them per strip (2 ALU instructions each; holding all four took the registers
      // past the launch bound's 128)
      [[maybe_unused]] const uint32_t z_word = GROUPED ? z_cur : z_cw;
      constexpr bool kZeroPerStrip = ZP && std::is_same<ActT, __nv_bfloat16>::value;
      typename DQ::Zero zero[4] = {};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (ZP && !kZeroPerStrip) {
          const uint32_t zw[1] = {z_word};
          zero[j] = DQ::zero(zw, j);
        }
      }
      const int4* bp = b_chunk(b_tile, next ? c + 1 : c);  // (after the last chunk the refill is predicated off)
      float part[MB8][4][4];  // (grouped) the chunk's unscaled sums
#pragma unroll
      for (int i = 0; i < kDirectStrips; ++i, bp += b_row) {
        uint32_t bf[MB8][2];
#pragma unroll
        for (int bb = 0; bb < MB8; ++bb) {
          bf[bb][0] = bf[bb][1] = 0u;
          if (row_ok[bb]) {  // k 16 i + 2t, +1 and 16 i + 2t + 8, +9 of the chunk, row 8 bb + g
            const uint32_t at = a_slot + (uint32_t)(8 * bb * kARowBytes + 32 * i);
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(bf[bb][0]) : "r"(at));
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(bf[bb][1]) : "r"(at + 16));
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t w[1] = {j == 0 ? bq[i].x : j == 1 ? bq[i].y : j == 2 ? bq[i].z : bq[i].w};
          uint32_t f[4];
          if constexpr (kZeroPerStrip) {
            const uint32_t zw[1] = {z_word};
            DQ::template run<ZP>(w, DQ::zero(zw, j), f);
          } else {
            DQ::template run<ZP>(w, zero[j], f);
          }
          const uint32_t wa[4] = {f[0], f[2], f[1], f[3]};  // W^T rows g, g + 8 x k 2t.., 2t + 8.. (see the kernel)
#pragma unroll
          for (int bb = 0; bb < MB8; ++bb) {
            if constexpr (GROUPED) {
              if (i == 0) Ops::mma_first(part[bb][j], wa, bf[bb][0], bf[bb][1]);
              else Ops::mma(part[bb][j], wa, bf[bb][0], bf[bb][1]);
            } else {
              Ops::mma(acc[bb][j], wa, bf[bb][0], bf[bb][1]);
            }
          }
        }
        if (next) bq[i] = ldg_stream16(bp);  // (after the strip's last dequant: bq[i] is free)
      }
      if constexpr (GROUPED) {
        const uint32_t sw[4] = {s_cur.x, s_cur.y, s_cur.z, s_cur.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 sc = Ops::to_float2(sw[j]);  // x: column 16 j + g, y: 16 j + 8 + g
#pragma unroll
          for (int bb = 0; bb < MB8; ++bb) {
            acc[bb][j][0] = fmaf(sc.x, part[bb][j][0], acc[bb][j][0]);
            acc[bb][j][1] = fmaf(sc.x, part[bb][j][1], acc[bb][j][1]);
            acc[bb][j][2] = fmaf(sc.y, part[bb][j][2], acc[bb][j][2]);
            acc[bb][j][3] = fmaf(sc.y, part[bb][j][3], acc[bb][j][3]);
          }
        }
      }
      if (c == w_lo) trace.stamp(2, acc[0][0][0]);
    }
    trace.stamp(3, acc[0][0][0]);

    // ---- the next segment's first B words and A rows, in flight while this one is reduced
    DirectSegment following{0, 0, 0, 0, 1};
    const bool have_next = next_segment(following);
    if (have_next) start(following);

    // ---- [RED] the warps' accumulators: red[(warp * 64 + col) * kRows + row]
#pragma unroll
    for (int bb = 0; bb < MB8; ++bb)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = 16 * j + 8 * h + g;
          *reinterpret_cast<float2*>(&red[(warp * 64 + col) * kRows + 8 * bb + 2 * t]) =
              make_float2(acc[bb][j][2 * h], acc[bb][j][2 * h + 1]);
        }
    __syncthreads();
    trace.stamp(4, 0.0f);
    // a cluster's output pairs p = row * 32 + col / 2 (rows < m) are written by block p % splits: pairs per block
    const int per_rank = cluster ? (m * 32 + splits - 1) / splits : 0;
    if (cluster) {
      // push: the block's sums of pair p into block p % splits' shared memory at [this rank][p / splits] (thread o:
      // row o % kRows, pair o / kRows, so that the reads of red fall on distinct banks but for two-way conflicts); one
      // cluster barrier then makes every pair's sums visible to the block that adds and writes them
      cluster_wait();
      for (int o = tid; o < kRows * 32; o += kThreads) {
        const int row = o % kRows, col = 2 * (o / kRows);
        if (row >= m) continue;
        float2 v = make_float2(0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          v.x += red[(w * 64 + col) * kRows + row];
          v.y += red[(w * 64 + col + 1) * kRows + row];
        }
        const int p = row * 32 + col / 2;
        st_cluster_f2(sums_addr + (uint32_t)((seg.contributor * per_rank + p / splits) * 8), (uint32_t)(p % splits), v);
      }
      cluster_barrier();
    } else {
      // the block's sums P[row * 64 + col], rows < kRows
      for (int o = tid; o < kRows * 64; o += kThreads) {
        const int row = o >> 6, col = o & 63;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += red[(w * 64 + col) * kRows + row];
        sums[o] = v;
      }
      __syncthreads();
    }

    // ---- [RED] across blocks (stream-K): wait for this tile's lock to reach our turn
    int* const lock = locks + tile;
    const bool chained = stream_k && seg.contributors > 1;
    if (chained && seg.contributor > 0) {
      if (tid == 0) {
        int v;
        do {
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(lock) : "memory");
        } while (v != seg.contributor);
      }
      __syncthreads();
    }
    trace.stamp(5, 0.0f);

    // ---- [OUT] output pairs p = row * 32 + col / 2 (rows < m); in a cluster those with p % splits == rank, the
    // cluster's sums added
    const int rank = cluster ? seg.contributor : 0, step = cluster ? splits : 1;
    for (int p = rank + tid * step; p < m * 32; p += kThreads * step) {
      const int row = p >> 5, col = 2 * (p & 31);
      float2 v;
      if (cluster) {
        v = make_float2(0.0f, 0.0f);
        const float2* const pushed = reinterpret_cast<const float2*>(sums) + p / splits;
        for (int rk = 0; rk < splits; ++rk) {
          const float2 x = pushed[rk * per_rank];
          v.x += x.x;
          v.y += x.y;
        }
      } else {
        v = *reinterpret_cast<const float2*>(&sums[row * 64 + col]);
      }
      if constexpr (!GROUPED) {
        // channelwise table (runs of 32): the pair col, col + 1 is the word at 32 (col / 32) + 8 ((col % 8) / 2) +
        // 2 ((col % 32) / 8) of the tile's 64 (as in marlin_gemm_kernel's [OUT])
        const int pos = tile * 64 + 32 * (col >> 5) + 8 * ((col & 7) >> 1) + 2 * ((col >> 3) & 3);
        const float2 sc = Ops::to_float2(S2[pos >> 1]);
        v.x *= sc.x;
        v.y *= sc.y;
      }
      const size_t at = ((size_t)row * n + tile * 64 + col) >> 1;
      if (chained && seg.contributor > 0) {  // the earlier contributors' sums, from L2
        const float2 o = Ops::to_float2(__ldcg(reinterpret_cast<const unsigned int*>(C2 + at)));
        v.x += o.x;
        v.y += o.y;
      }
      C2[at] = Ops::pack(v.x, v.y);
    }
    if (!cluster) {  // (a cluster's peers wrote into this block's shared memory before the barrier above, never after)
      if (chained) __threadfence();  // our C writes are visible device-wide before the lock moves
      __syncthreads();               // (and red / sums are rewritten by the next segment)
      if (chained && tid == 0) atomicExch(lock, seg.contributor == seg.contributors - 1 ? 0 : seg.contributor + 1);
    }
    trace.stamp(6, 0.0f);
    seg = following;
    have_seg = have_next;
  }
  trace.flush();
  cp_async_wait<0>();
#else
  __trap();
#endif
}

// Hopper: MARLIN_CONVERT_DIRECT's value where the direct kernel can run (marlin_gemm.cu), else 0.
int direct_variant();

// How the direct kernel takes a layer: cluster mode (units_per_block == 0: `splits` blocks per tile, a cluster) or
// stream-K (units_per_block > 0 units of kDirectUnitChunks chunks per block, `grid` blocks, all resident at once).
struct DirectPlan {
  int splits = 0;           // 0: the direct kernel cannot take the layer
  int units_per_block = 0;  // > 0: stream-K
  long grid = 0;
  long resident = 0;        // the blocks resident at once that the plan assumed (SMs x blocks per SM)
  int chunks = 0;           // k / kDirectChunkK
};

// Whether the direct kernel can take L (4-bit, m <= 8 MB8, k a multiple of 128, group size a multiple of 128 or one
// scale row), and how. Cluster mode: two blocks per tile where both halves of every tile are resident at once
// (2 * n / 64 <= SMs x blocks per SM) and k has two chunks, else one; forced_splits > 0 (tuning) fixes the split
// (1 .. 8) where it fits. H200, fp16 x 4-bit group 128, m = 1, the kernel's first form (kernel/NOTES.md): 4096 x 4096
// 7.8 us at 2 against 8.8 / 11.0 / 15.3 at 3 / 4 / 8: a cluster's blocks start and end together, so every wave pays
// the whole chain of load, reduction and cluster barrier. stream_k: the (tile, unit) space cut evenly over the resident
// blocks (each tile's contributors add through C under its lock; the grid never exceeds what is resident, so a block
// never waits for one that cannot start). per_sm_cap > 0 (MARLIN_CONVERT_STREAM_K, benchmark only) caps stream-K's
// grid at that many blocks per SM; one (H200, fourteenth session, kernel/NOTES.md) took 14-29 % more time on
// 4096 x 22016 and 8192 x 57344 at group 128, 0-5 % on 8192 x 10240.
template <int MB8>
DirectPlan direct_plan(const Launch& L, int optin, int forced_splits, bool stream_k, int per_sm_cap = 0) {
  DirectPlan plan;
  if (L.m > 8 * MB8 || L.k % kDirectChunkK != 0) return plan;
  if (L.scale_rows > 1 && (L.k / L.scale_rows) % kDirectChunkK != 0) return plan;
  const int smem = DirectSmem<MB8>::bytes(L.m);
  if (DirectSmem<MB8>::bytes(8 * MB8) > optin) return plan;  // (launch_direct's attribute)
  const int chunks = L.k / kDirectChunkK;
  const int tiles = L.n / 64;
  const int by_regs = MB8 == 1 ? 2 : 1;  // __launch_bounds__
  const int by_smem = kSmemPerSm / (smem + 1024);  // (1 KB per block reserved by the runtime)
  int per_sm = by_smem < by_regs ? by_smem : by_regs;
  if (stream_k && per_sm_cap > 0 && per_sm_cap < per_sm) per_sm = per_sm_cap;
  const long resident = (long)L.sms * per_sm;
  plan.resident = resident;
  plan.chunks = chunks;
  if (stream_k) {
    // at most 4 contributors per tile (units_per_block >= ceil(tile_units / 3)): each adds its sums to C's 16-bit
    // values, so a longer chain rounds more often (bf16: a chain of 16 measured 2x torch's error in
    // tests/test_kernel_gpu.py)
    const int tile_units = (chunks + kDirectUnitChunks - 1) / kDirectUnitChunks;
    const long units = (long)tiles * tile_units;
    if (resident < 1 || units > 0x7fffffffL) return plan;
    const long even = (units + resident - 1) / resident, cap = (tile_units + 2) / 3;
    plan.units_per_block = (int)(even > cap ? even : cap);
    plan.grid = (units + plan.units_per_block - 1) / plan.units_per_block;
    plan.splits = 1;
    return plan;
  }
  int splits = forced_splits > 0 ? forced_splits : (2L * tiles <= resident ? 2 : 1);
  if (forced_splits <= 0 && splits > chunks) splits = chunks;  // (k = 128: one chunk, one block per tile)
  if (splits > kDirectMaxSplits || splits > chunks || splits > resident || (long)tiles * splits > 0x7fffffffL)
    return plan;
  plan.splits = splits;
  plan.grid = (long)tiles * splits;
  return plan;
}

// Where the direct kernel is the default (m <= 8, the automatic plans): in cluster mode where each tile takes a cluster
// of two (2 x n / 64 <= resident blocks), or one block where every tile's block is resident at once (n / 64 <= resident
// blocks) and each of its warps has a chunk; otherwise in stream-K where each block gets enough units to amortise a
// segment's start, reduction and lock (grouped >= 4, channelwise >= 12). H200, direct / pipelined time at m = 1..8
// (kernel/NOTES.md, ninth session, fp16 x 4-bit; the other 4-bit kinds alike): cluster mode 4096 x 4096, 11008 x 4096
// and 28672 x 8192 0.81-0.92, 8192 x 8192 0.92-1.01 grouped (the eighth session's kernel had kept grouped layers
// there on the pipelined kernels); stream-K grouped 8192 x 57344 (28 units per block) 0.86-0.90, 8192 x 10240 (5)
// 0.90-0.98, 4096 x 22016 (6) 0.92-0.97, but 4096 x 12288 (3) 1.11-1.16; channelwise 8192 x 57344 0.91-0.93, the
// others 0.98-1.08. One block per tile (fifteenth session, since A goes through L1: the blocks of a wave read the same
// A chunks in step): H100, time against the rule before at m = 1..8, 4096 x 12288 0.95-0.98 (against the pipelined
// kernels), 8192 x 10240 0.91-0.95 (against stream-K); 4096 x 22016 (344 tiles, 1.3 waves) 1.05-1.20, so not there.
// Two batch blocks (MB8 = 2, m = 9..16, one block per SM): in clusters of two only (2 x n / 64 <= SMs). H100 (sixteenth
// session, kernel/NOTES.md), time against the pipelined kernels at m = 12 / 16: 4096 x 4096 0.86-0.89, 11008 x 4096
// 0.94-0.96; one block per tile, one wave (8192 x 8192, 28672 x 8192) 0.95-1.06, and 1.2-1.5 on the stream-K layers.
// Four batch blocks (MB8 = 4, m = 17..32, 208 KB of shared memory at m = 32, one block per SM): likewise. H200
// (eighteenth session, kernel/NOTES.md), fp16 x 4-bit time against the pipelined kernels at m = 17 / 24 / 32, group 128:
// 4096 x 4096 0.88 / 0.89 / 0.96, 11008 x 4096 0.86 / 0.88 / 0.93 (channelwise 0.91-1.00; bf16 and zero points at
// m = 24 / 32 0.83-0.96); forced elsewhere (one block per tile, or stream-K) 1.0-2.4x, but for 28672 x 8192 with group
// scales (0.96-1.00 against its stream-K kernel; since then the 8-strip kernel takes it).
inline bool direct_pays(const DirectPlan& plan, bool grouped, int mb8 = 1) {
  if (mb8 >= 2) return plan.units_per_block == 0 && plan.splits == 2;
  if (plan.units_per_block == 0)
    return plan.splits == 2 || (plan.splits == 1 && plan.grid <= plan.resident && plan.chunks >= kWarps);
  return plan.units_per_block >= (grouped ? 4 : 12);
}

template <class K, int MB8, bool GROUPED>
int launch_direct(const Launch& L, const DirectPlan& plan) {
  using ActT = typename K::ActT;
  auto kernel = marlin_direct_kernel<K, MB8, GROUPED>;
  const int smem = DirectSmem<MB8>::bytes(L.m);
  // the attribute is set to the largest m's size, or kOneBlockSmem ([PDL]) where larger and allowed (a constant per
  // instantiation and device, so that calls from several host threads never lower it under another's launch); each
  // launch asks for its own m's
  const int optin = smem_optin();
  const int smem_max = smem_attribute(DirectSmem<MB8>::bytes(8 * MB8), optin);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max);
  if (e != cudaSuccess) {
    set_error(L.err, L.errlen, "direct kernel: cudaFuncSetAttribute(%d bytes of shared memory) failed: %s", smem_max,
              cudaGetErrorString(e));
    return MARLIN_CUDA_ERROR;
  }
  // (stream-K: no clusters; cluster mode with one block per tile: a cluster of one, none)
  const int cluster = plan.units_per_block > 0 ? 1 : plan.splits;
  PdlLaunch pl = pdl_launch(plan.grid, smem, MB8 == 1 ? 2 : 1, L.sms, optin);
  if (pl.pdl && pl.smem != smem && cluster > 1) {
    // [PDL] padded to one block per SM: only where all the clusters still fit at once (clusters of two SMs of one
    // GPC: an odd GPC leaves an SM out)
    const LaunchShape probe(plan.grid, pl.smem, L.stream, cluster, false);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &probe.cfg) != cudaSuccess ||
        (long)clusters * cluster < plan.grid) {
      (void)cudaGetLastError();  // (a failed query leaves no error behind for the launch below)
      pl = PdlLaunch{smem, false};
    }
  }
  const LaunchShape shape(plan.grid, pl.smem, L.stream, cluster, pl.pdl);
  const int chunks_per_group = L.scale_rows > 1 ? (L.k / L.scale_rows) / kDirectChunkK : 1;
#if defined(MARLIN_CONVERT_TRACE)
  trace_arm(L.stream);
#endif
  e = cudaLaunchKernelEx(&shape.cfg, kernel, static_cast<const int4*>(L.A), static_cast<const int4*>(L.B),
                         static_cast<const int4*>(L.s), static_cast<const uint32_t*>(L.zp), static_cast<ActT*>(L.C),
                         L.workspace, L.m, L.n, L.k, chunks_per_group, plan.splits, plan.units_per_block);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // (leave no error behind for the caller's next launch check)
    set_error(L.err, L.errlen,
              "direct kernel launch (grid %ld, cluster %d, %d units per block, %d bytes of shared memory) failed: %s",
              plan.grid, plan.splits, plan.units_per_block, pl.smem, cudaGetErrorString(e));
    return MARLIN_CUDA_ERROR;
  }
  note_launch("direct", MB8, cluster, 0, 0, 0, plan.units_per_block, plan.grid);
  return MARLIN_OK;
}

// m <= 32, 4-bit kinds: the direct kernel where direct_variant allows it (1: the default, where direct_pays; 2: m <= 32
// wherever it fits in cluster mode, with split_k > 0 as the cluster size; 3: stream-K wherever it fits; tests and
// benchmark). optin: smem_optin() of the caller. launched = false: the caller takes the pipelined kernels.
template <class K, bool GROUPED>
int try_direct(const Launch& L, int optin, bool& launched) {
  launched = false;
#if defined(MARLIN_CONVERT_SM90A)  // (clusters: compute capability 9.0, built into the sm_90a code only)
  if constexpr (K::kBits == 4) {
    if (L.m > 32) return MARLIN_OK;
    const int variant = direct_variant();
    if (variant == 0 || (variant == 1 && L.split_k > 0)) return MARLIN_OK;
    const int forced = variant == 2 && L.split_k > 0 ? L.split_k : 0;
    const bool stream_k = variant == 3;
    // benchmark only (MARLIN_CONVERT_STREAM_K): stream-K's blocks per SM, read where a stream-K plan is launched
    const int forced_cap = stream_k ? stream_k_per_sm() : 0;
    if (L.m <= 8) {
      DirectPlan plan = direct_plan<1>(L, optin, forced, stream_k, forced_cap);
      // the default: a cluster of two per tile or one block per tile in one wave, else stream-K (direct_pays, decided
      // on the plan without the benchmark cap, so that MARLIN_CONVERT_STREAM_K changes how the direct kernel runs, not
      // whether)
      if (variant == 1 && !direct_pays(plan, GROUPED)) {
        plan = direct_plan<1>(L, optin, 0, true);
        if (plan.splits != 0 && direct_pays(plan, GROUPED)) {
          const int cap = stream_k_per_sm();
          if (cap > 0) plan = direct_plan<1>(L, optin, 0, true, cap);
        }
      }
      if (plan.splits == 0 || (variant == 1 && !direct_pays(plan, GROUPED))) return MARLIN_OK;
      launched = true;
      return launch_direct<K, 1, GROUPED>(L, plan);
    }
    // m = 9..16, two batch blocks (about 190-255 registers: one block of 8 warps per SM): by default in clusters of two only
    if (L.m <= 16) {
      const DirectPlan plan = direct_plan<2>(L, optin, forced, stream_k, forced_cap);
      if (plan.splits == 0 || (variant == 1 && !direct_pays(plan, GROUPED, 2))) return MARLIN_OK;
      launched = true;
      return launch_direct<K, 2, GROUPED>(L, plan);
    }
    // m = 17..32, four batch blocks (one block per SM, 208 KB of shared memory at m = 32): likewise
    const DirectPlan plan = direct_plan<4>(L, optin, forced, stream_k, forced_cap);
    if (plan.splits == 0 || (variant == 1 && !direct_pays(plan, GROUPED, 4))) return MARLIN_OK;
    launched = true;
    return launch_direct<K, 4, GROUPED>(L, plan);
  }
#endif
  return MARLIN_OK;
}

}  // namespace detail
}  // namespace marlin_convert
