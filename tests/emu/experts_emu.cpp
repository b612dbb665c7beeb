// CPU emulation of the expert kernels (csrc/experts.cu), for tests without a GPU.
//
// The kernel source is compiled unchanged by the host compiler: every GPU thread of a block
// is a std::thread, __syncthreads() is a barrier across them, __shared__ variables are
// function-local statics (blocks run one after another, so one instance per kernel suffices),
// and petitLaunchKernel runs the grid block by block. Index math, bounds, the persistent tile
// loop, the scheduler's scan and the placement of every barrier execute as written; what this
// cannot show is performance or anything about the GPU memory model (the kernels rely on
// nothing beyond __syncthreads).
//
// Built by tests/test_experts_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/experts_emu.cpp -o experts_emu.so
// (the CUDA headers only provide uint4/float4/dim3 and friends; nothing links against CUDA).
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#define __shared__ static            // before cuda_runtime.h, which keeps a prior definition
#define __launch_bounds__(...)
#include <cuda_runtime.h>

namespace emu {

thread_local uint3 thread_idx;
thread_local uint3 block_idx;
dim3 block_dim, grid_dim;

class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const long generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation != generation_; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int count_;
  int arrived_ = 0;
  long generation_ = 0;
};

Barrier* block_barrier = nullptr;
int last_error = 0;

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, const Args&... args) {
  if (grid.x == 0 || block.x == 0 || grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    last_error = 1;
    return;
  }
  block_dim = block;
  grid_dim = grid;
  for (unsigned b = 0; b < grid.x; ++b) {
    Barrier barrier(int(block.x));
    block_barrier = &barrier;
    std::vector<std::thread> threads;
    threads.reserve(block.x);
    for (unsigned t = 0; t < block.x; ++t) {
      threads.emplace_back([&, t, b] {
        thread_idx = make_uint3(t, 0, 0);
        block_idx = make_uint3(b, 0, 0);
        kernel(args...);
      });
    }
    for (auto& th : threads) th.join();
    block_barrier = nullptr;
  }
}

}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
inline void __syncthreads() { emu::block_barrier->wait(); }

#include "platform.h"

#undef petitLaunchKernel
#define petitLaunchKernel(kernel, grid, block, smem, stream, ...) \
  emu::launch(kernel, dim3(grid), dim3(block), __VA_ARGS__)
#undef petitGetLastError
#define petitGetLastError() (emu::last_error ? petitErrorInvalidValue : petitSuccess)
#undef petitGetDevice
#define petitGetDevice(device) (*(device) = 0, petitSuccess)
#undef petitDeviceGetAttribute
#define petitDeviceGetAttribute(value, attr, device) (*(value) = 2, petitSuccess)

#include "experts.cu"

// Runs launch_experts on host memory. Returns the petitError_t as an int (0 = success), and
// the tile family that ran in *tiles_used.
extern "C" int petit_emu_experts(const uint16_t* x, const int32_t* topk_ids,
                                 const float* topk_weights, const uint16_t* w13,
                                 const uint16_t* w2, const int32_t* expert_offsets,
                                 const int32_t* sorted_entries, uint16_t* act, float* partial,
                                 uint16_t* out, int num_rows, int top_k, int hidden,
                                 int intermediate, int num_local_experts, int tiles, int num_sms,
                                 const int32_t* expert_map, int num_global_experts,
                                 int* tiles_used) {
  emu::last_error = 0;
  petit::ExpertGemmArgs a{};
  a.x = x;
  a.topk_ids = topk_ids;
  a.expert_map = expert_map;  // nullptr: topk_ids are local ids
  a.num_global_experts = num_global_experts;
  a.topk_weights = topk_weights;
  a.w13 = w13;
  a.w2 = w2;
  a.expert_offsets = expert_offsets;
  a.sorted_entries = sorted_entries;
  a.act = act;
  a.partial = partial;
  a.out = out;
  a.num_rows = num_rows;
  a.top_k = top_k;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.num_local_experts = num_local_experts;
  a.tiles = tiles;
  a.num_sms = num_sms;
  *tiles_used = petit::resolve_expert_tiles(a);
  return int(petit::launch_experts(a, nullptr));
}
