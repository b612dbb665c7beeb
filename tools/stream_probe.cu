// How fast can a grid stream one weight region whose bytes every block reads at once, the way
// the fused MoE layer (csrc/experts/megamoe.cu) streams its few active experts in a 1-token
// decode call? No multiplies: the warps only wait for their ring slots and read one chunk.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -DPETIT_SM90A_BUILT=1 -Icsrc -o /tmp/stream_probe \
//     tools/stream_probe.cu
//   /tmp/stream_probe            # prints a table: pattern, region, blocks, GB/s, in-kernel GB/s
//
// Patterns (a task = 32 weight rows x the whole k range, tasks dealt to the blocks in order):
//   megamoe  4 warps, each a quarter of k in order, a step = two 16-row x 64-k TMA boxes
//            (4 KiB), a ring of 5 steps per warp: the fused layer's weight stream
//   rotated  the same, each warp starting its quarter at a step that depends on the task
//   tall     the same steps as one 32-row x 64-k box
//   bulk     the task's rows as one contiguous range (the same bytes), each warp a quarter of
//            it in 4 KiB 1-D bulk copies
//   ldg      every thread of the grid 16-byte loads, grid-stride over the region
// Each launch reads the next of enough copies of the region that none is in L2. GB/s = region
// bytes / (time of 50 launches / 50); "in-kernel" = region bytes / (last block out - first
// block in, %globaltimer), without the launch gaps. The mbarrier waits, TMA boxes and tensor
// maps are the expert kernels' own (csrc/gemm): bounded waits, the same weight-map encoding.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gemm/sm90_mainloop_wgmma_ws.h"

using namespace petit::gemm;

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

enum Pattern { kMegamoe, kRotated, kTall, kBulk, kLdg };
const char* kNames[] = {"megamoe", "rotated", "tall", "bulk", "ldg"};
constexpr int kWarps = 4, kStages = 5, kStepBytes = 4096, kTaskRows = 32, kStepK = 64;

// A 1-D bulk copy global -> shared (the expert kernels copy boxes only).
__device__ void bulk_1d(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// One launch streams rows x k bf16 at `w` (the map of the same bytes for the TMA patterns).
template <int P>
__global__ void __launch_bounds__(kWarps * 32, 2)
    stream(const __grid_constant__ CUtensorMap map16, const __grid_constant__ CUtensorMap map32,
           const uint4* w, int rows, int k, uint64_t* stamps, uint32_t* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* ring = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kWarps * kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t t0 = sm90_globaltimer_ns();
  uint32_t acc = 0;
  if constexpr (P == kLdg) {
    const int64_t n = int64_t(rows) * k / 8;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
      const uint4 v = __ldg(w + i);
      acc ^= v.x ^ v.w;
    }
  } else {
    if (lane == 0)
      for (int s = 0; s < kStages; ++s)
        sm90_mbarrier_init(smem_addr_u32(&full[warp * kStages + s]), 1);
    sm90_fence_mbarrier_init();
    __syncthreads();
    unsigned char* my_ring = ring + warp * kStages * kStepBytes;
    const int steps = k / kStepK / kWarps;  // this warp's quarter of a task's k range
    const int tasks = rows / kTaskRows;
    // the warp's flat step sequence over its tasks: (task i, step j)
    const int my_tasks = (tasks - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
    const int total = my_tasks * steps;
    auto issue = [&](int n) {
      const int task = int(blockIdx.x) + (n / steps) * int(gridDim.x);
      int j = n % steps;
      if constexpr (P == kRotated) j = (j + 5 * task) % steps;
      const int kstep = warp * steps + j;
      const int slot = n % kStages;
      const uint32_t dst = smem_addr_u32(my_ring + slot * kStepBytes);
      const uint32_t bar = smem_addr_u32(&full[warp * kStages + slot]);
      sm90_mbarrier_arrive_expect_tx(bar, kStepBytes);
      if constexpr (P == kBulk) {
        const char* base = reinterpret_cast<const char*>(w) +
                           int64_t(task) * kTaskRows * k * 2 +
                           (int64_t(warp) * steps + j) * kStepBytes;
        bulk_1d(dst, base, kStepBytes, bar);
      } else if constexpr (P == kTall) {
        sm90_tma_load_4d(dst, &map32, kstep * kStepK, task * kTaskRows, 0, 0, bar);
      } else {
        sm90_tma_load_4d(dst, &map16, kstep * kStepK, task * kTaskRows, 0, 0, bar);
        sm90_tma_load_4d(dst + kStepBytes / 2, &map16, kstep * kStepK, task * kTaskRows + 16, 0,
                         0, bar);
      }
    };
    if (lane == 0)
      for (int n = 0; n < kStages && n < total; ++n) issue(n);
    for (int n = 0; n < total; ++n) {
      const int slot = n % kStages;
      sm90_mbarrier_wait_parity(smem_addr_u32(&full[warp * kStages + slot]), (n / kStages) & 1);
      const uint4 v = *reinterpret_cast<const uint4*>(my_ring + slot * kStepBytes + lane * 16);
      acc ^= v.x ^ v.w;
      __syncwarp();
      if (lane == 0 && n + kStages < total) issue(n + kStages);
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMin(reinterpret_cast<unsigned long long*>(&stamps[0]), t0);
    atomicMax(reinterpret_cast<unsigned long long*>(&stamps[1]), sm90_globaltimer_ns());
  }
}

// rows x k bf16 as the expert kernels' weight map (one group, one expert), boxes of box_rows
CUtensorMap make_map(char* base, int rows, int k, int box_rows) {
  CUtensorMap map;
  if (sm90_encode_weight_map(&map, reinterpret_cast<const petit_bf16_bits*>(base), k, rows, 1, 1,
                             box_rows) != petitSuccess) {
    fprintf(stderr, "the weight map of %d x %d (boxes of %d rows) failed\n", rows, k, box_rows);
    exit(1);
  }
  return map;
}

template <int P>
void run(const char* region, int rows, int k, int grid, int copies, char* buf, size_t bytes) {
  const int smem = kWarps * kStages * kStepBytes + 1024;
  CHECK(cudaFuncSetAttribute(stream<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<CUtensorMap> m16(copies), m32(copies);
  for (int c = 0; c < copies; ++c) {
    m16[c] = make_map(buf + c * bytes, rows, k, 16);
    m32[c] = make_map(buf + c * bytes, rows, k, 32);
  }
  uint64_t* stamps;
  uint32_t* sink;
  CHECK(cudaMalloc(&stamps, 16));
  CHECK(cudaMalloc(&sink, 4));
  const uint64_t init[2] = {~0ull, 0};
  auto launch = [&](int i) {
    const int c = i % copies;
    stream<P><<<grid, kWarps * 32, smem>>>(m16[c], m32[c],
                                          reinterpret_cast<const uint4*>(buf + c * bytes), rows,
                                          k, stamps, sink);
  };
  for (int i = 0; i < copies; ++i) launch(i);  // warm-up
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  const int iters = 50;
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) launch(i);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  // in-kernel span: one more launch, stamped
  double span_ns = 1e30;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaMemcpy(stamps, init, 16, cudaMemcpyHostToDevice));
    launch(r);
    uint64_t got[2];
    CHECK(cudaMemcpy(got, stamps, 16, cudaMemcpyDeviceToHost));
    span_ns = std::min(span_ns, double(got[1] - got[0]));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  const double us = ms * 1e3 / iters;
  printf("%-8s %-24s %5d %9.1f %8.0f %8.1f %8.0f\n", kNames[P], region, grid, us,
         bytes / us / 1e3, span_ns / 1e3, bytes / span_ns);
  CHECK(cudaFree(stamps));
  CHECK(cudaFree(sink));
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Region { const char* name; int rows, k; };
  // DeepSeek-V3's one expert's gate/up (4096 x 7168) and down (7168 x 2048); Qwen3-30B-A3B's
  // eight experts' gate/up (8 x 1536 rows x 2048)
  const Region regions[] = {{"dsv3 gate/up 1 expert", 4096, 7168},
                            {"dsv3 down 1 expert", 7168, 2048},
                            {"qwen3 gate/up 8 experts", 12288, 2048}};
  size_t max_bytes = 0;
  for (const Region& r : regions) max_bytes = std::max(max_bytes, size_t(r.rows) * r.k * 2);
  const int copies = 12;  // 12 x 59 MB: each launch's copy is out of L2
  char* buf;
  CHECK(cudaMalloc(&buf, copies * max_bytes));
  CHECK(cudaMemset(buf, 0x3c, copies * max_bytes));
  // the same-run copy rate (read + write bytes / time), as examples/bench_moe_layer.py
  {
    const size_t n = size_t(1) << 30;
    char *src, *dst;
    CHECK(cudaMalloc(&src, n));
    CHECK(cudaMalloc(&dst, n));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 5; ++i) CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    printf("copy rate (read + write): %.0f GB/s\n", 2.0 * 5 * n / (ms * 1e6));
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
  }
  printf("%-8s %-24s %5s %9s %8s %8s %8s\n", "pattern", "region", "grid", "us/launch",
         "GB/s", "span us", "GB/s");
  for (const Region& r : regions) {
    const size_t bytes = size_t(r.rows) * r.k * 2;
    for (int grid : {r.rows / kTaskRows < 2 * sms ? r.rows / kTaskRows : sms, 2 * sms}) {
      run<kMegamoe>(r.name, r.rows, r.k, grid, copies, buf, bytes);
      run<kRotated>(r.name, r.rows, r.k, grid, copies, buf, bytes);
      run<kTall>(r.name, r.rows, r.k, grid, copies, buf, bytes);
      run<kBulk>(r.name, r.rows, r.k, grid, copies, buf, bytes);
      run<kLdg>(r.name, r.rows, r.k, grid, copies, buf, bytes);
    }
  }
  return 0;
}
