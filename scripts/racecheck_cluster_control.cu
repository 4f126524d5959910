// A control for compute-sanitizer's racecheck (scripts/racecheck_triage.py builds and runs it; sm_90 only):
// does the tool order a cp.async write before a distributed-shared-memory store into the same bytes when the two are
// ordered by the textbook chain
//     cp.async.wait_group 0 -> __syncthreads -> barrier.cluster.arrive.release / barrier.cluster.wait.acquire
//     -> (a peer block) st.shared::cluster
// (the wgmma kernel's [RED] in a cluster: each block's pipeline, filled by cp.async, takes its peers' pushed partial
// sums after that chain; kernel/marlin_gemm_impl.cuh). The kernel fills its buffer one of two ways, then every block
// writes its next peer's buffer:
//     racecheck_cluster_control cp_async   the buffer filled by cp.async in 3 groups (wait_group 2, then 0)
//     racecheck_cluster_control plain      the same bytes by plain loads and stores
// With CUDA 13.0's compute-sanitizer on an H200 (kernel/NOTES.md, twenty-seventh session) racecheck reports
// "Race reported between Write access ... and Write access" in every run of the cp_async form and in no run of the
// plain one: this program, 20-24 reports in each of 5 runs; its first form (three launches per run, 128 and 1024
// blocks), 12 runs of each form, 23-68 reports in every cp_async run. A report of this pair is the tool's.
// Each run also checks what every block read back (exactly its peer's pushes; a wrong sum prints 'wrong sums' and
// exits 1, which the triage takes for a control that did not run): added after those runs, not yet run on a GPU.
// Build: nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -o control racecheck_cluster_control.cu
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kThreads = 256;
constexpr int kCluster = 4;                  // blocks per cluster (any size from 2 shows it)
constexpr int kBufferBytes = 96 * 1024;      // shared memory per block (> 48 KB: one or two blocks per SM)
constexpr int kChunks = kBufferBytes / 16;   // 16-byte copies per block
constexpr int kGroups = 3;                   // cp.async groups, as a pipeline's prologue commits them
constexpr int kGroupChunks = kChunks / kGroups;
static_assert(kChunks % kGroups == 0, "whole groups");
constexpr int kPushes = kBufferBytes / (kThreads * 8);  // float2 stores per thread into the peer: the whole buffer
static_assert(kBufferBytes % (kThreads * 8) == 0, "the pushes cover the buffer exactly");
constexpr int kBlocks = 128;  // 32 clusters: one wave on an H100 / H200
static_assert(kBlocks % kCluster == 0, "whole clusters");

// What thread `tid` of every block reads back: float i of the buffer (i = tid, tid + kThreads, ...) is component i % 2
// of the pair i / 2 = j * kThreads + t that the peer's thread t pushed as (j, t), all of it, nothing of the first fill.
// (Whole numbers below 2^24: exact in fp32 whatever the order.)
float expected_sum(int tid) {
  float sum = 0.0f;
  for (int i = tid; i < kBufferBytes / 4; i += kThreads) {
    const int pair = i / 2;
    sum += static_cast<float>(i % 2 == 0 ? pair / kThreads : pair % kThreads);
  }
  return sum;
}

__device__ __forceinline__ unsigned shared_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__global__ void __cluster_dims__(kCluster, 1, 1) fill_then_push(const int4* src, float* out, int by_cp_async) {
  extern __shared__ int4 buffer[];
  const int tid = threadIdx.x;
  const int4* mine = src + static_cast<size_t>(blockIdx.x) * kChunks;
  // ---- fill this block's buffer
  if (by_cp_async) {
    for (int g = 0; g < kGroups; ++g) {
      for (int i = g * kGroupChunks + tid; i < (g + 1) * kGroupChunks; i += kThreads)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_u32(buffer + i)), "l"(mine + i));
      asm volatile("cp.async.commit_group;\n" ::);
    }
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");  // as a pipeline's first stage
    __syncthreads();
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // every copy of this thread has landed
  } else {
    for (int i = tid; i < kChunks; i += kThreads) buffer[i] = mine[i];
  }
  // ---- every thread of the block is done writing; then every block of the cluster (release / acquire)
  __syncthreads();
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  // ---- write the next peer's whole buffer (the writes the tool pairs with the copies above)
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  const unsigned peer = (rank + 1) % kCluster;
  for (int j = 0; j < kPushes; ++j) {
    unsigned remote;
    const unsigned local = shared_u32(buffer) + static_cast<unsigned>((j * kThreads + tid) * 8);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(peer));
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(remote), "f"(static_cast<float>(j)),
                 "f"(static_cast<float>(tid))
                 : "memory");
  }
  // ---- every push is in place; read what the peer wrote
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  const float* values = reinterpret_cast<const float*>(buffer);
  float sum = 0.0f;
  for (int i = tid; i < kBufferBytes / 4; i += kThreads) sum += values[i];
  out[blockIdx.x * kThreads + tid] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || (std::strcmp(argv[1], "cp_async") != 0 && std::strcmp(argv[1], "plain") != 0)) {
    std::fprintf(stderr, "usage: %s cp_async|plain\n", argv[0]);
    return 2;
  }
  const int by_cp_async = std::strcmp(argv[1], "cp_async") == 0;
  int4* src = nullptr;
  float* out = nullptr;
  std::vector<float> sums(static_cast<size_t>(kBlocks) * kThreads);
  cudaError_t err = cudaMalloc(&src, static_cast<size_t>(kBlocks) * kBufferBytes);
  if (err == cudaSuccess) err = cudaMemset(src, 1, static_cast<size_t>(kBlocks) * kBufferBytes);
  if (err == cudaSuccess) err = cudaMalloc(&out, sums.size() * sizeof(float));
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(fill_then_push, cudaFuncAttributeMaxDynamicSharedMemorySize, kBufferBytes);
  if (err == cudaSuccess) {
    fill_then_push<<<kBlocks, kThreads, kBufferBytes>>>(src, out, by_cp_async);
    err = cudaDeviceSynchronize();
  }
  if (err == cudaSuccess) err = cudaMemcpy(sums.data(), out, sums.size() * sizeof(float), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("racecheck_cluster_control %s: %s\n", argv[1], cudaGetErrorString(err));
    return 1;
  }
  // every block must have read exactly its peer's pushes (the ordering the barriers give, checked on the values)
  for (size_t o = 0; o < sums.size(); ++o) {
    const float expected = expected_sum(static_cast<int>(o % kThreads));
    if (sums[o] != expected) {
      std::printf("racecheck_cluster_control %s: wrong sums: block %zu thread %zu read %g, expected %g\n", argv[1],
                  o / kThreads, o % kThreads, sums[o], expected);
      return 1;
    }
  }
  std::printf("racecheck_cluster_control %s: no error (every block read its peer's pushes; out[0] = %g)\n", argv[1],
              sums[0]);
  return 0;
}
