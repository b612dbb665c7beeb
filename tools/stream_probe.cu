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
//   mix      megamoe plus the kernel's one activation load per step: each lane reads 4 bytes
//            (8 with e4m3 weights) of a token's bf16 input row, the step's k range, from
//            global memory before it waits for the step's weights, as the fused layer's
//            compute warps do
// Whole-call regions ("... call") are one decode call's weights at 1 token in the order the
// fused layer streams them: every active expert's gate/up rows, then their down rows (k =
// the intermediate size), in bf16 or e4m3 (one-byte elements: a 128-byte step is 128 k).
// Launches: "plain" back to back on a stream; "graph" the same launches captured in one CUDA
// graph with the programmatic stream-serialization attribute (PDL), as vLLM replays the layer:
// a launch starts while the previous one drains and waits at griddepcontrol.wait after its
// barrier set-up, the fused layer's own order.
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

enum Pattern { kMegamoe, kRotated, kTall, kBulk, kLdg, kMix };
const char* kNames[] = {"megamoe", "rotated", "tall", "bulk", "ldg", "mix"};
constexpr int kWarps = 4, kStages = 5, kStepBytes = 4096, kTaskRows = 32;

// A 1-D bulk copy global -> shared (the expert kernels copy boxes only).
__device__ void bulk_1d(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// One streamed weight region: rows x k elements of elem_bytes (2: bf16, 1: e4m3), k contiguous,
// with its tensor maps of 16- and 32-row boxes of one 128-byte row.
struct Part {
  CUtensorMap map16, map32;
  const char* base;
  int rows, k, elem_bytes;
};
// A launch's work: its parts' 32-row tasks in order (part 0's, then part 1's), and x, a token's
// input row (read by the mix pattern).
struct Call {
  Part part[2];
  int parts;
  const uint32_t* x;
};

// warp `warp`'s share of a task's k steps (128 bytes each): [*first, *first + return)
__device__ int warp_steps(const Part& p, int warp, int* first) {
  const int steps = p.k * p.elem_bytes / 128;
  *first = warp * steps / kWarps;
  return (warp + 1) * steps / kWarps - *first;
}

// A warp's walk over its shares of the block's tasks (task = block + i x grid), in order:
// next() is the next step's index within the current task's share [first, first + steps).
struct StepWalk {
  int task, j = 0, first = 0, steps = 0;
  __device__ StepWalk(const Call& call, int tasks0, int tasks, int warp) : task(blockIdx.x) {
    if (task < tasks) steps = warp_steps(call.part[task < tasks0 ? 0 : 1], warp, &first);
  }
  __device__ int next(const Call& call, int tasks0, int warp) {
    while (j >= steps) {  // the next task with steps for this warp
      task += gridDim.x;
      j = 0;
      steps = warp_steps(call.part[task < tasks0 ? 0 : 1], warp, &first);
    }
    return j++;
  }
};

template <int P>
__global__ void __launch_bounds__(kWarps * 32, 2)
    stream(const __grid_constant__ Call call, uint64_t* stamps, uint32_t* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* ring = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kWarps * kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (P != kLdg) {
    if (lane == 0)
      for (int s = 0; s < kStages; ++s)
        sm90_mbarrier_init(smem_addr_u32(&full[warp * kStages + s]), 1);
    sm90_fence_mbarrier_init();
    __syncthreads();
  }
  petit_grid_dependency_sync();  // PDL (graph launches): the previous launch has finished
  const uint64_t t0 = sm90_globaltimer_ns();
  uint32_t acc = 0;
  if constexpr (P == kLdg) {
    const Part& p = call.part[0];
    const int64_t n = int64_t(p.rows) * p.k * p.elem_bytes / 16;
    const uint4* w = reinterpret_cast<const uint4*>(p.base);
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
      const uint4 v = __ldg(w + i);
      acc ^= v.x ^ v.w;
    }
  } else {
    unsigned char* my_ring = ring + warp * kStages * kStepBytes;
    const int tasks0 = call.part[0].rows / kTaskRows;
    const int tasks = tasks0 + (call.parts > 1 ? call.part[1].rows / kTaskRows : 0);
    // this warp's steps over the block's tasks (task = block + i x grid), in order
    int total = 0;
    for (int task = blockIdx.x; task < tasks; task += gridDim.x) {
      int first;
      total += warp_steps(call.part[task < tasks0 ? 0 : 1], warp, &first);
    }
    StepWalk loads(call, tasks0, tasks, warp);  // the issuing lane's position
    auto issue = [&](int n) {
      int s = loads.next(call, tasks0, warp);
      const int task = loads.task, part = task < tasks0 ? 0 : 1;
      const Part& p = call.part[part];
      const int row = (task - (part ? tasks0 : 0)) * kTaskRows;
      if constexpr (P == kRotated) s = (s + 5 * task) % loads.steps;
      const int kstep = loads.first + s;
      const int kcoord = kstep * (128 / p.elem_bytes);
      const int slot = n % kStages;
      const uint32_t dst = smem_addr_u32(my_ring + slot * kStepBytes);
      const uint32_t bar = smem_addr_u32(&full[warp * kStages + slot]);
      sm90_mbarrier_arrive_expect_tx(bar, kStepBytes);
      if constexpr (P == kBulk) {
        // the task's rows as one contiguous range, this warp's share of it in order
        const char* src = p.base + int64_t(row) * p.k * p.elem_bytes + int64_t(kstep) * kStepBytes;
        bulk_1d(dst, src, kStepBytes, bar);
      } else if constexpr (P == kTall) {
        sm90_tma_load_4d(dst, &p.map32, kcoord, row, 0, 0, bar);
      } else {
        sm90_tma_load_4d(dst, &p.map16, kcoord, row, 0, 0, bar);
        sm90_tma_load_4d(dst + kStepBytes / 2, &p.map16, kcoord, row + 16, 0, 0, bar);
      }
    };
    StepWalk inputs(call, tasks0, tasks, warp);  // the consuming lanes' position in x
    if (lane == 0)
      for (int n = 0; n < kStages && n < total; ++n) issue(n);
    for (int n = 0; n < total; ++n) {
      const int slot = n % kStages;
      uint32_t xv = 0;
      if constexpr (P == kMix) {
        // issued before the weights' wait: 128 k of bf16 inputs per e4m3 step, 64 per bf16
        const int step = inputs.next(call, tasks0, warp);
        const int at = (inputs.first + step) * 32 + lane;
        if (call.part[0].elem_bytes == 1) {
          const uint2 v = reinterpret_cast<const uint2*>(call.x)[at];
          xv = v.x ^ v.y;
        } else {
          xv = call.x[at];
        }
      }
      sm90_mbarrier_wait_parity(smem_addr_u32(&full[warp * kStages + slot]), (n / kStages) & 1);
      const uint4 v = *reinterpret_cast<const uint4*>(my_ring + slot * kStepBytes + lane * 16);
      acc ^= v.x ^ v.w ^ xv;
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

// rows x k elements of elem_bytes as the expert kernels' weight map (one group, one expert)
CUtensorMap make_map(const char* base, int rows, int k, int elem_bytes, int box_rows) {
  CUtensorMap map;
  if (sm90_encode_weight_map_of(&map, base, elem_bytes, k, rows, 1, 1, box_rows) !=
      petitSuccess) {
    fprintf(stderr, "the weight map of %d x %d (boxes of %d rows) failed\n", rows, k, box_rows);
    exit(1);
  }
  return map;
}

// A region: one or two parts (rows, k), elements of elem_bytes, laid out one after the other.
struct Region {
  const char* name;
  int rows0, k0, rows1, k1, elem_bytes;
  size_t bytes() const { return (size_t(rows0) * k0 + size_t(rows1) * k1) * elem_bytes; }
};

Call make_call(const Region& r, const char* base, const uint32_t* x) {
  Call c{};
  c.parts = r.rows1 > 0 ? 2 : 1;
  c.x = x;
  const char* at = base;
  for (int i = 0; i < c.parts; ++i) {
    const int rows = i ? r.rows1 : r.rows0, k = i ? r.k1 : r.k0;
    c.part[i] = Part{make_map(at, rows, k, r.elem_bytes, 16), make_map(at, rows, k, r.elem_bytes, 32),
                     at, rows, k, r.elem_bytes};
    at += size_t(rows) * k * r.elem_bytes;
  }
  return c;
}

template <int P>
void run(const Region& r, int grid, bool graph, int copies, char* buf, size_t stride,
         const uint32_t* x, cudaStream_t stream_) {
  const int smem = kWarps * kStages * kStepBytes + 1024;
  CHECK(cudaFuncSetAttribute(stream<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<Call> calls(copies);
  for (int c = 0; c < copies; ++c) calls[c] = make_call(r, buf + c * stride, x);
  uint64_t* stamps;
  uint32_t* sink;
  CHECK(cudaMalloc(&stamps, 16));
  CHECK(cudaMalloc(&sink, 4));
  const uint64_t init[2] = {~0ull, 0};
  cudaLaunchAttribute pdl;
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  auto launch = [&](int i) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(kWarps * 32);
    config.dynamicSmemBytes = smem;
    config.stream = stream_;
    config.attrs = &pdl;
    config.numAttrs = graph ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&config, stream<P>, calls[i % copies], stamps, sink));
  };
  const int iters = 48;  // a multiple of copies: every launch of a graph replay reads a new copy
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < iters; ++i) launch(i);
    CHECK(cudaStreamEndCapture(stream_, &g));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    CHECK(cudaGraphDestroy(g));
  }
  auto all = [&]() {
    if (graph) CHECK(cudaGraphLaunch(exec, stream_));
    else for (int i = 0; i < iters; ++i) launch(i);
  };
  all();  // warm-up
  CHECK(cudaStreamSynchronize(stream_));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a, stream_));
  all();
  CHECK(cudaEventRecord(b, stream_));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  // in-kernel span: one more launch, stamped
  double span_ns = 1e30;
  for (int i = 0; i < 5; ++i) {
    CHECK(cudaMemcpy(stamps, init, 16, cudaMemcpyHostToDevice));
    launch(i);
    CHECK(cudaStreamSynchronize(stream_));
    uint64_t got[2];
    CHECK(cudaMemcpy(got, stamps, 16, cudaMemcpyDeviceToHost));
    span_ns = std::min(span_ns, double(got[1] - got[0]));
  }
  CHECK(cudaGetLastError());
  if (exec) CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  const double us = ms * 1e3 / iters;
  printf("%-8s %-6s %-30s %5d %9.1f %8.0f %8.1f %8.0f\n", kNames[P], graph ? "graph" : "plain",
         r.name, grid, us, r.bytes() / us / 1e3, span_ns / 1e3, r.bytes() / span_ns);
  CHECK(cudaFree(stamps));
  CHECK(cudaFree(sink));
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // DeepSeek-V3's one expert's gate/up (4096 x 7168) and down (7168 x 2048); Qwen3-30B-A3B's
  // eight experts' gate/up (8 x 1536 rows x 2048); whole 1-token calls: Qwen3-30B-A3B (8
  // experts: 12288 x 2048 gate/up, 16384 x 768 down) and DeepSeek-V3's share (its one local
  // expert), in bf16 and e4m3
  const Region regions[] = {{"dsv3 gate/up 1 expert", 4096, 7168, 0, 0, 2},
                            {"dsv3 down 1 expert", 7168, 2048, 0, 0, 2},
                            {"qwen3 gate/up 8 experts", 12288, 2048, 0, 0, 2}};
  const Region calls[] = {{"qwen3 call 1 token bf16", 12288, 2048, 16384, 768, 2},
                          {"qwen3 call 1 token fp8", 12288, 2048, 16384, 768, 1},
                          {"dsv3 call 1 token bf16", 4096, 7168, 7168, 2048, 2},
                          {"dsv3 call 1 token fp8", 4096, 7168, 7168, 2048, 1}};
  size_t stride = 0;
  for (const Region& r : regions) stride = std::max(stride, r.bytes());
  for (const Region& r : calls) stride = std::max(stride, r.bytes());
  stride = (stride + 4095) & ~size_t(4095);
  const int copies = 12;  // 12 x 88 MB: each launch's copy is out of L2
  char* buf;
  CHECK(cudaMalloc(&buf, copies * stride));
  CHECK(cudaMemset(buf, 0x3c, copies * stride));
  uint32_t* x;  // a token's input row: 7168 bf16 at most
  CHECK(cudaMalloc(&x, 7168 * 2));
  CHECK(cudaMemset(x, 0x3c, 7168 * 2));
  cudaStream_t stream_;
  CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
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
  printf("%-8s %-6s %-30s %5s %9s %8s %8s %8s\n", "pattern", "launch", "region", "grid",
         "us/launch", "GB/s", "span us", "GB/s");
  for (const Region& r : regions) {
    const int tasks = r.rows0 / kTaskRows;
    for (int grid : {tasks < 2 * sms ? tasks : sms, 2 * sms}) {
      run<kMegamoe>(r, grid, false, copies, buf, stride, x, stream_);
      run<kRotated>(r, grid, false, copies, buf, stride, x, stream_);
      run<kTall>(r, grid, false, copies, buf, stride, x, stream_);
      run<kBulk>(r, grid, false, copies, buf, stride, x, stream_);
      run<kLdg>(r, grid, false, copies, buf, stride, x, stream_);
    }
  }
  // the fused layer's whole 1-token call: its grid (two blocks per SM), its weight pattern
  // with and without the per-step activation loads, launched plain and as a PDL graph
  for (const Region& r : calls)
    for (bool graph : {false, true}) {
      run<kMegamoe>(r, 2 * sms, graph, copies, buf, stride, x, stream_);
      run<kMix>(r, 2 * sms, graph, copies, buf, stride, x, stream_);
    }
  CHECK(cudaStreamDestroy(stream_));
  return 0;
}
