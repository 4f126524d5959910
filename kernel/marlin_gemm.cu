// marlin-convert: GEMM on the Marlin tile format (sm_80 .. sm_90): host checks, the launcher marlin_gemm_launch, and
// the fp16 x 4-bit symmetric kind with its benchmark-only variants. The kernel itself, and what it computes, is in
// marlin_gemm_impl.cuh; the other kinds are instantiated in marlin_gemm_fp16.cu, marlin_gemm_bf16_int4.cu and
// marlin_gemm_bf16_int8.cu (compiled in parallel). Self-contained: `nvcc -c kernel/marlin_gemm.cu` checks it without a
// GPU or torch.

#include "marlin_gemm_impl.cuh"

#include <atomic>

namespace marlin_convert {
namespace detail {

// The instantiated configurations (see kernel/README.md for why these).
// fp16 x 4-bit symmetric (the converter's main kind; dispatch_fp16_int4 below):
//   m <= 8 on Hopper, where each 64-column tile takes a cluster of two blocks or, in one wave, one block, or in
//             stream-K where every block gets enough of the work (direct_pays), and m = 9..32 where each tile takes a
//             cluster of two blocks at one block per SM (two / four batch blocks of 8 rows): the direct-load kernel
//             (marlin_gemm_direct.cuh; try_direct), for every 4-bit kind; otherwise:
//   m <= 16 : grouped with n / 64 > SMs, or channelwise m <= 8 with n / 256 >= SMs: 4 strips at 2 stages, swapped;
//             otherwise MB=1, WN=1 (64-column tiles: the most blocks for small n), 4 stages, swapped (C^T = W^T A^T) with
//             4 / 3 strips per warp when the n / 64 tiles fit one wave at 1 / 2 blocks per SM; otherwise 2 strips
//             (stage k = 256, 72 KB of shared memory, <= 85 registers: 3 blocks = 24 warps per SM), swapped for
//             m <= 8 only (see dispatch below)
//   m = 17..128, every 4-bit kind, the layers of eight_strip_32_pick (marlin_gemm_impl.cuh; at m > 32 after the
//             wgmma kernel; at m = 97..128 only one wave of 128-column blocks with k <= 4096): the unswapped 32-row
//             kernel with 8 strips per warp and stage at one block per SM (grouped: fp32 partial sums scaled once per
//             group), 64-column tiles at 2 stages (208 KB) on one wave of them with k < 16384, else (and always at
//             m = 65..128) 128-column tiles at 2 stages (144 KB)
//   m > 32 on Hopper (sm_90a build), n % 256 == 0, k per block >= 2560 after the split that fills the GPU: the wgmma
//             kernel (SWAP 3; try_wgmma in marlin_gemm_impl.cuh), 64- / 128-row chunks, 256-column tiles
//   m > 64, and 33..64 with k >= 16384 or n >= 32768, n % 128 == 0: MB=4 (64-row chunks), WN=2 (128-column tiles,
//             A fragments shared by 2x the columns), 8 strips, 2 stages (208 KB), one block per SM
//   otherwise: MB=2 (32-row chunks), WN=1, 4 strips, 2 stages (104 KB), 2 blocks per SM; at m <= 32 with group
//             scales, one wave of tiles at one block per SM and k >= 16384 in stream-K at two blocks per SM
//             (fill_one_wave in launch_config)
//   m > 16 where the shared memory per block is below those (sm_86 / sm_89): MB=2, 1 strip
// each once with grouped and once with channelwise scales, plus the benchmark-only variants (m <= 16, and m > 16:
// launch_m32_cfg).
// The other kinds: dispatch_kind in marlin_gemm_impl.cuh.

// A benchmark / test switch read per call: its value when it starts with a digit, else `unset`.
int env_switch(const char* name, int unset) {
  const char* v = getenv(name);
  return (v != nullptr && v[0] >= '0' && v[0] <= '9') ? atoi(v) : unset;
}

// Benchmark-only switch for the stream-K schedule (MARLIN_CONVERT_STREAM_K, read per call: 0 = split-K, N = stream-K
// at <= N blocks per SM; unset = launch_config's choice; the direct kernel's stream-K plans take N > 0 as their blocks
// per SM cap, direct_plan). Used by scripts/bench_kernel.py --stream-k.
int stream_k_per_sm() { return env_switch("MARLIN_CONVERT_STREAM_K", -1); }

// Benchmark-only switch for the m <= 16 configuration (MARLIN_CONVERT_SMALL_CFG, read per call; unset = the
// default below). Used by scripts/bench_kernel.py --cfgs; see kernel/README.md for the measurements.
int small_cfg() { return env_switch("MARLIN_CONVERT_SMALL_CFG", -1); }

// Whether the current device is compute capability 9.0, the one that takes the sm_90a code (checked for the current
// device on every call, so an all-architectures build on a machine with a Hopper and an older GPU never launches a
// Hopper-only kernel on the latter, where it would trap).
bool device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  return cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
         minor == 0;
}

// A Hopper-only kernel's switch `name`: its value where that kernel can run here, else 0. It can run where the build
// has sm_90a code (kernel.py defines MARLIN_CONVERT_SM90A when it compiles for compute_90a) and the device is compute
// capability 9.0 (device_is_sm90). The switch is read per call (benchmark and tests; like the others, a value that does
// not start with a digit counts as unset): 0 = never, 1 or unset = the default, other values per kernel.
int hopper_switch(const char* name) {
#if defined(MARLIN_CONVERT_SM90A)
  const int want = env_switch(name, 1);
  if (want == 0) return 0;
  return device_is_sm90() ? want : 0;
#else
  (void)name;
  return 0;
#endif
}

// The wgmma kernels (SWAP 3), MARLIN_CONVERT_WGMMA: 1 = where wgmma_pays, 2..4 = a fixed configuration wherever it fits
// (try_wgmma).
int wgmma_variant() { return hopper_switch("MARLIN_CONVERT_WGMMA"); }

// [RED] in a cluster for the wgmma kernel (launch_config), MARLIN_CONVERT_WGMMA_CLUSTER: 0 = never, else where
// cluster_split allows.
int wgmma_cluster_variant() { return hopper_switch("MARLIN_CONVERT_WGMMA_CLUSTER"); }

// [PDL] on compute capability 9.0 (sm_90a build) unless MARLIN_CONVERT_PDL=0; read at every launch, as the switches
// above.
bool pdl_enabled() { return hopper_switch("MARLIN_CONVERT_PDL") != 0; }

// Launches asked for with the [PDL] attribute since the library was loaded (counted as the LaunchShape is built, right
// before its launch; a launch that fails counts too, and its call returns the error), for the tests: a chain of calls
// meant to overlap must have taken it.
std::atomic<long> pdl_launch_count{0};
void count_pdl_launch() { pdl_launch_count.fetch_add(1, std::memory_order_relaxed); }

// The last launch of this host thread (note_launch): its fields, stored as they are (formatted only when asked for,
// by marlin_last_launch, so a launch pays a few stores, not a string's formatting).
struct LastLaunch {
  const char* family = nullptr;
  int mb = 0, wn = 0, strips = 0, stages = 0, swap = 0, schedule = 0, cluster = 0;
  long grid = 0;
};
thread_local LastLaunch last_launch;
void note_launch(const char* family, int mb, int wn, int strips, int stages, int swap, int schedule, long grid,
                 int cluster) {
  last_launch = LastLaunch{family, mb, wn, strips, stages, swap, schedule, cluster, grid};
}

#if defined(MARLIN_CONVERT_TRACE)
// [TRACE] (development builds): the buffer the kernels stamp (marlin_trace_set), handed to each unit by trace_arm.
unsigned long long* trace_host = nullptr;
long trace_host_blocks = 0;
#endif

// The direct-load kernel (marlin_gemm_direct.cuh; thread-block clusters or stream-K), MARLIN_CONVERT_DIRECT: 1 = where
// direct_pays, 2 = wherever it fits in cluster mode, 3 = in stream-K (try_direct).
int direct_variant() { return hopper_switch("MARLIN_CONVERT_DIRECT"); }

using KindFp16Int4 = Kind<half, 4, false>;

// swap: m <= 8 the swapped path with one batch block, m = 9..16 with two, both with STRIPS / STAGES.
// !swap: the unswapped MB = 1 kernel, 2 strips, 4 stages (it spills at 4 strips under the 3-blocks-per-SM
// register limit); swap_small_only: swapped for m <= 8 only; previous: also grouped scales on B in fp16 (the
// previous default, benchmark only).
template <int STRIPS, int STAGES, bool GROUPED>
int launch_small(const Launch& L, bool swap, bool swap_small_only = false, bool previous = false) {
  using K = KindFp16Int4;
  if (swap && L.m <= 8 && previous) return launch_config<K, 1, 1, STRIPS, STAGES, GROUPED, 1, true>(L);
  if (swap && L.m <= 8) return launch_config<K, 1, 1, STRIPS, STAGES, GROUPED, 1>(L);
  if (swap && !swap_small_only) return launch_config<K, 1, 1, STRIPS, STAGES, GROUPED, 2>(L);
  return launch_config<K, 1, 1, 2, 4, GROUPED, 0>(L);
}

// Whether the wide-tile kernel below can take L: n divides by its 64 * WN columns and its shared memory fits.
template <int WN, int STRIPS, int STAGES, bool GROUPED>
bool wide_fits(const Launch& L, int optin) {
  return L.n % (64 * WN) == 0 && optin >= Tile<1, WN, STRIPS, STAGES, GROUPED>::kSmemBytes;
}

// Benchmark only (cfg 10..13): swapped kernels with WN 64-column groups per block (one / two batch blocks).
template <int WN, int STRIPS, int STAGES, bool GROUPED>
int launch_wide(const Launch& L) {
  using K = KindFp16Int4;
  if (L.m <= 8) return launch_config<K, 1, WN, STRIPS, STAGES, GROUPED, 1>(L);
  return launch_config<K, 1, WN, STRIPS, STAGES, GROUPED, 2>(L);
}

template <bool GROUPED>
int dispatch_fp16_int4(const Launch& L) {
  using K = KindFp16Int4;
  if (L.m <= 16) {
    // Default: 64-column tiles; the swapped kernel (m <= 8: one 8-row batch block, m = 9..16: two) with 4 strips at
    // 2 stages (72 KB, 2 blocks per SM) where n / 64 > SMs (below for which), 4 strips at 4 stages (stage k = 512,
    // 16 KB of B per stage, 144 KB of shared memory, one block per SM) when n / 64 <= SMs; otherwise 2 strips (72 KB:
    // 3 blocks per SM), swapped for m <= 8 only.
    const int optin = smem_optin();
    const bool big_smem = optin >= Tile<1, 1, 4, 4, GROUPED>::kSmemBytes;  // sm_86 / sm_89 have ~100 KB
    const bool one_wave = big_smem && L.n / 64 <= L.sms;
    const int cfg = small_cfg();  // benchmark-only switch, read once per call
    if (cfg < 0) {  // the direct-load kernel where it takes the layer (Hopper; marlin_gemm_direct.cuh)
      bool launched = false;
      const int rc = try_direct<K, GROUPED>(L, optin, launched);
      if (launched) return rc;
    }
    switch (cfg) {
      case 0: return launch_small<2, 4, GROUPED>(L, false);  // the previous default (no swap)
      case 1: return launch_small<2, 4, GROUPED>(L, true);
      case 2: return big_smem ? launch_small<4, 4, GROUPED>(L, true) : launch_small<2, 4, GROUPED>(L, true);
      case 3: return big_smem ? launch_small<3, 4, GROUPED>(L, true) : launch_small<2, 4, GROUPED>(L, true);
      case 4: return big_smem ? launch_small<2, 6, GROUPED>(L, true) : launch_small<2, 4, GROUPED>(L, true);
      case 6:
        if (one_wave) return launch_small<4, 4, GROUPED>(L, true);
        return big_smem ? launch_small<3, 4, GROUPED>(L, true) : launch_small<2, 4, GROUPED>(L, true);
      case 7:  // the previous default (HEAD bc9a8c1; its zero-point-free 16-bit scale path now reads the scale row
               // once per stage where a warp's strips share a group, kOneGroupB)
        return one_wave ? launch_small<4, 4, GROUPED>(L, true, true, true)
                        : launch_small<2, 4, GROUPED>(L, true, true, true);
      case 8: return one_wave ? launch_small<4, 4, GROUPED>(L, true) : launch_small<2, 4, GROUPED>(L, true, true);
      // Wide tiles (issue #11 hypothesis: 512-byte pieces of B per 16-row strip use DRAM poorly; 1 / 2 KB pieces
      // read more of each DRAM page per request): swapped, WN = 2 (128 columns, 1 KB per strip row) or 4 (256
      // columns, 2 KB); 16 KB of B per stage as cfg 2 (cfg 10, 11; 13 with 6 stages) or 8 KB as the 2-strip default
      // (12, 6 stages). n must divide by the tile width; otherwise the default below.
      case 10: if (wide_fits<2, 4, 4, GROUPED>(L, optin)) return launch_wide<2, 4, 4, GROUPED>(L); break;
      case 11: if (wide_fits<4, 4, 4, GROUPED>(L, optin)) return launch_wide<4, 4, 4, GROUPED>(L); break;
      case 12: if (wide_fits<2, 2, 6, GROUPED>(L, optin)) return launch_wide<2, 2, 6, GROUPED>(L); break;
      case 13: if (wide_fits<4, 4, 6, GROUPED>(L, optin)) return launch_wide<4, 4, 6, GROUPED>(L); break;
      case 14: return launch_small<4, 2, GROUPED>(L, true);  // 4 strips at 2 stages, whatever n
      case 15: return launch_small<8, 2, GROUPED>(L, true);  // 8 strips at 2 stages (one group of 128 per warp and stage)
      // 128-column tiles, 8 strips at 2 stages, whatever the layer (the default takes them on wide_eight_pays' layers
      // at m = 9..16); 24: the default without them (the rule before the twelfth session); 25: the twelfth session's
      // rule (not on the grouped one-wave layers)
      case 23: if (wide_fits<2, 8, 2, GROUPED>(L, optin)) return launch_wide<2, 8, 2, GROUPED>(L); break;
      // m = 9..16: the two-batch-block swapped kernel at 4 and 3 strips; at 2 strips (n / 64 > 2 SMs) it measured
      // 5-10 % slower than the unswapped kernel (cfg 1 vs cfg 7, kernel/README.md), so that one stays there.
      default: break;
    }
    // 4 strips at 2 stages (72 KB, 2 blocks per SM; as the 8-bit kinds at n / 64 > SMs): with grouped scales where
    // n / 64 > SMs, and for very wide channelwise layers at m <= 8 (n / 256 >= SMs, in place of the 256-column tiles
    // below). Measured on the H200 against the default (cfg 14, kernel/NOTES.md), m = 1 / 16, group 128:
    // 4096 x 12288 17.4 -> 14.9 / 21.6 -> 19.7 us, 8192 x 57344 93.3 -> 87.5 / 143.0 -> 121.6, 4096 x 22016 25.1 ->
    // 24.0 / 33.6 -> 32.0, 8192 x 10240 27.2 -> 25.4 / 35.9 -> 35.5; channelwise 8192 x 57344 m = 1 87.2 -> 75.6 (other
    // channelwise shapes and m = 9..16 mixed, so not there); n / 64 <= SMs slower (the one-wave kernels stay).
    // Channelwise with SMs < n / 64 <= 2 SMs likewise (this session, kernel/NOTES.md; it had the 2-strip kernel split in
    // two at n / 64 <= 1.5 SMs, m <= 8, else the 3-strip one): 4096 x 12288 m = 1 14.8 -> 12.9 us, m = 16 16.8 -> 15.6;
    // 8192 x 10240 m = 16 24.8 -> 22.5 (with the stream-K schedule launch_config picks there).
    // m = 9..16 on wide layers (n / 128 >= 2 SMs), and on one wave of 64-column tiles with long k (the layers split in
    // two below): 128-column tiles, 8 strips at 2 stages (stage k = 512, 112 KB: two blocks per SM, where two fit).
    // A warp's 8 strips are 128 k, so with group scales the fp32 partial sums are flushed once per group of 128
    // instead of every 64 k (ncu, m = 16, 8192 x 57344: the flush was ~10 % of the 4-strip kernel's instructions), and
    // each A tile serves 128 columns. H200 (cfg 23, twelfth session, kernel/NOTES.md), m = 12 / 16 time against the
    // previous default: 8192 x 57344 0.88 / 0.89 (group 128), 0.92 / 0.94 (channelwise); 28672 x 8192 0.93 / 0.91,
    // 0.96 / 0.93; slower on the layers with fewer tiles (4096 x 22016 channelwise 1.08, 8192 x 10240 1.10, one-wave
    // layers with k < 16384 1.15), which keep their kernels. With group scales also where SMs < n / 128 (one wave at
    // two blocks per SM, against the 64-column kernel's 1.3 waves): 4096 x 22016 m = 12 / 16 0.95 / 0.94 (H100,
    // thirteenth session, `--cfgs=-,25`).
    if (cfg != 24 && wide_eight_pays<K, GROUPED>(L, optin, true, cfg != 25)) return launch_wide<2, 8, 2, GROUPED>(L);
    if (((GROUPED && L.n / 64 > L.sms) || (!GROUPED && L.m <= 8 && L.n / 256 >= L.sms) ||
         (!GROUPED && L.n / 64 > L.sms && L.n / 64 <= 2 * L.sms)) &&
        optin >= Tile<1, 1, 4, 2, GROUPED>::kSmemBytes)
      return launch_small<4, 2, GROUPED>(L, true);
    // (The 256-column tiles, cfg 11, were the default for m <= 8 with n / 256 >= SMs: 8192 x 57344 m = 1 119 -> 100 us;
    // the 4-strip, 2-stage kernel above takes those layers now, and needs less shared memory, so they stay cfg 11.)
    // More resident blocks through a split over k, where the 4-strip / 3-strip kernels would leave one or two
    // blocks per SM with nothing to overlap (their warps stall on instruction latency, not on memory: ncu showed
    // 0.45 issued instructions per scheduler at one block per SM, kernel/NOTES.md). Measured on the H200 (`--cfgs`
    // with `--split-k`):
    //   SMs < n / 64 <= 1.5 SMs (both halves resident): the 2-strip kernel (3 blocks per SM) split in two,
    //     8192 x 10240 m = 1 32.0 -> 27.3 us, m = 16 42.3 -> 37.8 (since the fifth session the 4-strip, 2-stage kernel
    //     above takes those shapes, grouped and channelwise, with stream-K where launch_config picks it; removed);
    //   SMs / 2 < n / 64 <= SMs (the 4-strip kernel has no room to split): the 3-strip kernel (2 blocks per SM)
    //     split in two, for long k or m > 8: 28672 x 8192 m = 16 91.6 -> 73.9 us, m = 1 59.4 -> 57.6,
    //     8192 x 8192 m = 16 27.9 -> 26.0 (at m = 1 there 19.5 -> 20.7, hence not for short k at m <= 8); at m = 9..16
    //     the 4-strip, 2-stage kernel (2 blocks per SM too) split in two instead: a warp's 64 rows never straddle a
    //     group of 64 / 128 (the 3-strip kernel's 48 do, and those warps take the per-strip 16-bit scales),
    //     28672 x 8192 m = 16 63.9 -> 50.7 us (g128), 50.9 -> 48.0 (channelwise); 8192 x 8192 23.1 -> 20.0, 19.4 ->
    //     19.1 (kernel/NOTES.md); and at m <= 8 with long k too (a later session): 28672 x 8192 m = 1 52.6 -> 42.2 us
    //     (g128), 42.5 -> 40.2 (channelwise).
    const int tiles = L.n / 64;
    // One wave of tiles (SMs / 2 < n / 64 <= SMs) with k < 16384: 8 strips at 2 stages (stage k = 1024, so a warp's 8
    // strips are one group of 128 and the fp32 partial sums are scaled once per group; one barrier per 1024 k; 144 KB,
    // one block per SM), no split. H200 (cfg 15, sixth session, kernel/NOTES.md): 8192 x 8192 m = 1 / 8 / 16 16.5 /
    // 17.3 / 19.8 -> 15.1 / 16.3 / 17.3 us at group 128, 15.9 / 16.7 / 18.7 -> 15.3 / 16.6 / 17.3 channelwise; with
    // k >= 16384 (28672 x 8192) 2-11 % slower than the split 4-strip kernel below at m <= 8, so not there.
    if (one_wave && 2 * tiles > L.sms && L.k < 16384 && optin >= Tile<1, 1, 8, 2, GROUPED>::kSmemBytes)
      return launch_small<8, 2, GROUPED>(L, true);
    Launch split_two = L;
    split_two.split_k = L.split_k > 0 ? L.split_k : 2;  // launch_config still caps it to the resident blocks
    if (one_wave && 2 * tiles > L.sms && (L.m > 8 || L.k >= 16384) && optin >= Tile<1, 1, 4, 2, GROUPED>::kSmemBytes)
      return launch_small<4, 2, GROUPED>(split_two, true);
    if (one_wave) return launch_small<4, 4, GROUPED>(L, true);
    // (SMs < n / 64 <= 2 SMs took the 3-strip kernel, one wave at 2 blocks per SM, before the fifth session: the
    // 4-strip, 2-stage kernel above takes them now)
    return launch_small<2, 4, GROUPED>(L, true, true);
  }
  // m > 16: more strips per stage (fewer barriers, half the per-stage bookkeeping per mma), measured on the H200
  // against the previous kernels (2 strips at 4 stages: MB = 2 for m <= 64, MB = 4 with 128-column tiles above;
  // `--m 32,64,128 --cfgs`, kernel/NOTES.md), geomean over the 8 shapes, group 128 / channelwise:
  //   m > 64, and m = 33..64 with long k or wide n: 64-row chunks, 128-column tiles, 8 strips at 2 stages (208 KB,
  //     one block per SM): m = 128 0.56x -> 0.65x / 0.59x -> 0.64x; m = 64 8192 x 57344 275.8 -> 218.1 us,
  //     28672 x 8192 135.7 -> 99.7 (g128);
  //   otherwise 32-row chunks (MB = 2), 4 strips at 2 stages (104 KB, 2 blocks per SM, as the 2-strip, 4-stage one it
  //     replaces): m = 32 1.32x -> 1.47x / 1.45x -> 1.56x, m = 64 0.84x -> 0.94x / 0.94x -> 1.01x, faster on every
  //     shape at m = 32.
  // Wider tiles (256 columns: A read once per 256 columns) were slower at every m (0.47-0.65x at m = 128).
  const int optin = smem_optin();
  const int cfg = small_cfg();  // benchmark-only switch (launch_m32_cfg)
  if (cfg >= 30) {
    bool launched = false;
    const int rc = launch_m32_cfg<K, GROUPED>(L, cfg, launched);
    if (launched) return rc;
  }
  if (L.m <= 32 && cfg < 0) {  // m = 17..32: the direct-load kernel where it takes the layer (Hopper; try_direct)
    bool launched = false;
    const int rc = try_direct<K, GROUPED>(L, optin, launched);
    if (launched) return rc;
  }
  {
    bool launched = false;
    const int rc = try_wgmma<K, GROUPED>(L, launched);
    if (launched) return rc;
  }
  if (cfg < 0) {  // m = 17..128: the 8-strip 32-row kernels where they pay (try_eight_strip_32)
    bool launched = false;
    const int rc = try_eight_strip_32<K, GROUPED>(L, optin, launched);
    if (launched) return rc;
  }
  if (wants_64_row_chunks(L) && optin >= Tile<4, 2, 8, 2, GROUPED>::kSmemBytes)
    return launch_config<K, 4, 2, 8, 2, GROUPED>(L);
  // (the 208 KB of that kernel do not fit an A100's 163 KB: there m > 64 keeps the previous 64-row kernel, 2 strips x
  // 4 stages, 104 KB; not measured on an A100 either way)
  if (L.m > 64 && L.n % 128 == 0 && optin >= Tile<4, 2, 2, 4, GROUPED>::kSmemBytes)
    return launch_config<K, 4, 2, 2, 4, GROUPED>(L);
  if (optin >= Tile<2, 1, 4, 2, GROUPED>::kSmemBytes) return launch_config<K, 2, 1, 4, 2, GROUPED>(L);
  // less shared memory per block (sm_86 / sm_89: 99 KB): one strip per warp and stage, as the other kinds
  return launch_config<K, 2, 1, 1, 4, GROUPED>(L);
}

int launch_fp16_int4_sym(const Launch& L) {
  return L.scale_rows > 1 ? dispatch_fp16_int4<true>(L) : dispatch_fp16_int4<false>(L);
}

}  // namespace detail

long marlin_required_workspace_ints(int n) { return (long)(n / 64) * 16; }

long marlin_pdl_launches() { return detail::pdl_launch_count.load(std::memory_order_relaxed); }

#if defined(MARLIN_CONVERT_TRACE)
void marlin_trace_set(void* buffer, long blocks) {
  detail::trace_host = static_cast<unsigned long long*>(buffer);
  detail::trace_host_blocks = buffer == nullptr ? 0 : blocks;
}
#endif

int marlin_last_launch(char* buf, int len) {
  const detail::LastLaunch& l = detail::last_launch;
  if (l.family == nullptr) return snprintf(buf, len, "%s", "");
  if (l.family[0] == 'd')
    return snprintf(buf, len, "direct MB8=%d cluster=%d units_per_block=%d grid=%ld", l.mb, l.wn, l.schedule, l.grid);
  return snprintf(buf, len, "%s MB=%d WN=%d STRIPS=%d STAGES=%d SWAP=%d stream_k=%d cluster=%d grid=%ld", l.family,
                  l.mb, l.wn, l.strips, l.stages, l.swap, l.schedule, l.cluster, l.grid);
}

int marlin_gemm_launch(const void* A, const void* B, const void* s, const void* zp, void* C, int* workspace,
                       long workspace_ints, int m, int n, int k, int scale_rows, int bits, int act, int sms,
                       int split_k, cudaStream_t stream, char* err, int errlen) {
  using namespace detail;
  if (err != nullptr && errlen > 0) err[0] = '\0';
  // ---- kind
  if (bits != 4 && bits != 8) {
    set_error(err, errlen, "bits = %d: the kernel takes 4- or 8-bit weights", bits);
    return MARLIN_BAD_KIND;
  }
  if (act != MARLIN_ACT_FP16 && act != MARLIN_ACT_BF16) {
    set_error(err, errlen, "act = %d: the activation type must be fp16 (%d) or bf16 (%d)", act, MARLIN_ACT_FP16,
              MARLIN_ACT_BF16);
    return MARLIN_BAD_KIND;
  }
  // ---- shape limits, each with the values that break it
  if (m < 1) {
    set_error(err, errlen, "m = %d: A must have at least one row", m);
    return MARLIN_BAD_SHAPE;
  }
  if (k < 16 || k % 16 != 0) {
    set_error(err, errlen, "k = %d is not a positive multiple of 16 (the k-size of one Marlin tile)", k);
    return MARLIN_BAD_SHAPE;
  }
  if (n < 64 || n % 64 != 0) {
    set_error(err, errlen, "n = %d is not divisible by 64 (thread tile width)", n);
    return MARLIN_BAD_SHAPE;
  }
  if (scale_rows < 1 || k % scale_rows != 0) {
    set_error(err, errlen, "k = %d is not divisible by the %d scale rows: the group size must divide k", k,
              scale_rows);
    return MARLIN_BAD_SHAPE;
  }
  const int group_size = k / scale_rows;
  if (scale_rows > 1 && group_size % 16 != 0) {
    set_error(err, errlen,
              "group size %d (k = %d / %d scale rows) is not a multiple of 16 (the k-size of one Marlin tile)",
              group_size, k, scale_rows);
    return MARLIN_BAD_SHAPE;
  }
  if (sms < 1) {
    set_error(err, errlen, "sms = %d: the number of multiprocessors must be >= 1", sms);
    return MARLIN_BAD_SHAPE;
  }
  // the kernel addresses A and B with 32-bit offsets in 16-byte units (see [G2S] in marlin_gemm_impl.cuh); A rows are
  // counted up to the last 128-row chunk (the wgmma kernels' chunks)
  const long long a_int4 = ((long long)m + 128) * (k / 8);
  const long long b_int4 = (long long)(k / 16) * n * bits / 8;
  if (a_int4 >= (1LL << 32) || b_int4 >= (1LL << 32)) {
    set_error(err, errlen, "m = %d, n = %d, k = %d: A or B has 2^32 or more 16-byte units (%lld, %lld), more than "
              "the kernel's 32-bit offsets address", m, n, k, a_int4, b_int4);
    return MARLIN_BAD_SHAPE;
  }
  // ---- workspace
  const long need = marlin_required_workspace_ints(n);
  if (workspace == nullptr || workspace_ints < need) {
    set_error(err, errlen,
              "workspace has %ld ints, but n = %d needs at least %ld ((n / 64) * 16 int32, zeroed)",
              workspace == nullptr ? 0L : workspace_ints, n, need);
    return MARLIN_BAD_WORKSPACE;
  }
  // ---- pointers (cp.async copies 16 bytes; A rows are k * 2 bytes, a multiple of 32; zero-point rows n * b / 8
  // bytes, a multiple of 32); zp may be null (symmetric)
  const void* ptrs[5] = {A, B, s, C, zp};
  const char* names[5] = {"A", "B", "s", "C", "zp"};
  for (int i = 0; i < 5; ++i) {
    if ((ptrs[i] == nullptr && i < 4) || (reinterpret_cast<uintptr_t>(ptrs[i]) & 15u) != 0) {
      set_error(err, errlen, "%s pointer %p is null or not 16-byte aligned", names[i], ptrs[i]);
      return MARLIN_BAD_POINTER;
    }
  }
  const detail::Launch L{A, B, s, zp, C, workspace, workspace_ints, m, n, k, scale_rows, sms, split_k, stream, err,
                         errlen};
  if (act == MARLIN_ACT_FP16) return bits == 4 && zp == nullptr ? launch_fp16_int4_sym(L) : launch_fp16_other(L, bits);
  return bits == 4 ? launch_bf16_int4(L) : launch_bf16_int8(L);
}

}  // namespace marlin_convert
