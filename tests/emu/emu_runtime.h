// Thread-per-GPU-thread runtime for running kernel sources on the CPU (tests without a GPU).
//
// The kernel source is compiled unchanged by the host compiler: every GPU thread of a block
// is a std::thread, __syncthreads() is a barrier across them, __shared__ variables are
// function-local statics (blocks run one after another, so one instance per kernel suffices),
// and petitLaunchKernel runs the grid block by block. The warp primitives of platform.h
// (lane / warp ids, ballot, match_any, lane masks; 32-lane warps) exchange values through a
// per-warp barrier, so every lane of a warp must reach them together, as on the GPU; atomicAdd
// on int is a host atomic. Index math, bounds, barrier placement and warp-level logic execute
// as written; what this cannot show is performance or anything about the GPU memory model.
//
// The sm_90a tensor-core sources compile too (PETIT_EMU_PTX): their PTX wrappers run the
// emulation of emu_ptx.h, petitLaunchKernelCluster runs thread-block clusters (the blocks of a
// cluster at the same time, each with its own shared memory), petitLaunchKernel gives each block its dynamic shared memory
// (1024-byte aligned, poisoned with 0xFF bytes), and the device reports compute capability
// emu::cc_major.emu::cc_minor (default 2.0: no tensor-core family is taken; 9.0 with the
// sm_90a build flag set below makes the wgmma families run).
//
// Several grids may run at once, one per host thread that launches (the emulated ranks of
// tests/emu/ep_emu.cpp): the launch shape and error are per launching thread, and a thread
// that sets emu::grid_at_once runs every block of its grids at the same time (a persistent
// grid whose blocks wait for each other's or other grids' writes, as co-resident blocks do on
// the GPU). Such kernels declare their block-shared variables with PETIT_SHARED (platform.h),
// which here gives every block its own instance.
//
// Include this, then the kernel source (e.g. "experts/routing.cu"); compile with
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include <file>.cpp
// (the CUDA headers only provide uint4/float4/dim3 and friends; nothing links against CUDA).
#pragma once

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#define PETIT_EMU_PTX 1
#define PETIT_SM90A_BUILT 1

#define __shared__ static            // before cuda_runtime.h, which keeps a prior definition
// before platform.h: a block's own instance (emu::block_static), for blocks that run at once
#define PETIT_SHARED(type, name) type& name = emu::block_static<type>(__COUNTER__)
#define __launch_bounds__(...)
#define __grid_constant__            // likewise (a kernel parameter held in constant memory)
#include <cuda_runtime.h>

namespace emu_ptx {
inline void check_drained();        // emu_ptx.h: no asynchronous copy or MMA left unwaited
// ... and no TMA copy or transaction byte left pending in these blocks' shared memories
inline void check_block_drained(unsigned char* const* smem, int count, size_t bytes);
}

namespace emu {

thread_local uint3 thread_idx;
thread_local uint3 block_idx;
thread_local dim3 block_dim, grid_dim;  // of the launch: on its launching and its blocks' threads
thread_local bool grid_at_once = false;  // this thread's launches: all blocks at the same time

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

thread_local Barrier* block_barrier = nullptr;  // this thread's block's

// The named barriers of one block (bar.sync id, count with id 1..15): a barrier completes when
// `count` threads have arrived; every arrival of one use must name the same count.
class NamedBarriers {
 public:
  bool wait(int id, int count) {  // false: an id or count the PTX does not allow
    if (id < 1 || id >= kIds || count <= 0 || count % 32 != 0) return false;
    std::unique_lock<std::mutex> lock(mutex_);
    State& s = state_[id];
    if (s.arrived == 0) s.count = count;
    if (s.count != count) return false;
    const long generation = s.generation;
    if (++s.arrived == count) {
      s.arrived = 0;
      ++s.generation;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation != s.generation; });
    }
    return true;
  }

 private:
  static constexpr int kIds = 16;
  struct State {
    int count = 0, arrived = 0;
    long generation = 0;
  };
  std::mutex mutex_;
  std::condition_variable cv_;
  State state_[kIds];
};
thread_local NamedBarriers* named_barriers = nullptr;  // this thread's block's
thread_local int last_error = 0;  // of this thread's launches

// The PETIT_SHARED variables of one block: a 0xFF-poisoned slot per declaration (keyed by its
// __COUNTER__), made by the first of the block's threads to reach it.
class BlockStatics {
 public:
  void* slot(int key, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& p = slots_[key];
    if (!p) {
      p.reset(new (std::align_val_t(16)) unsigned char[(bytes + 15) / 16 * 16]);
      std::memset(p.get(), 0xFF, bytes);
    }
    return p.get();
  }

 private:
  struct Free {
    void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t(16)); }
  };
  std::mutex mutex_;
  std::map<int, std::unique_ptr<unsigned char[], Free>> slots_;
};
thread_local BlockStatics* block_statics = nullptr;  // this thread's block's
template <class T>
T& block_static(int key) {
  return *static_cast<T*>(block_statics->slot(key, sizeof(T)));
}
thread_local unsigned char* dynamic_smem = nullptr;  // this thread's block's
int cc_major = 2, cc_minor = 0, sm_count = 2;
// Blocks of any kernel one SM holds at once, as petitOccupancyMaxActiveBlocksPerMultiprocessor
// reports it (the fused EP layer's launcher refuses a grid above this x sm_count).
int blocks_per_sm = 2;
int l2_bytes = 0;  // the L2 size reported (MegaMoE's row groups: with 0, every grid's tiles exceed it)
// Thread-block clusters (launch_cluster): this thread's rank in its cluster, the dynamic shared
// memory of every block of the cluster (by rank) and a barrier of all the cluster's threads.
thread_local int cluster_rank = 0;
thread_local int cluster_size = 1;
thread_local unsigned char* const* cluster_smem = nullptr;
thread_local Barrier* cluster_barrier = nullptr;

constexpr int kWarpSize = 32;
struct Warp {
  Barrier barrier{kWarpSize};
  uint32_t words[kWarpSize][8];  // each lane's published values (warp_gather)
};
thread_local Warp* warp = nullptr;  // this thread's warp (blocks of whole warps only)

// The kWords 32-bit values of every lane of this thread's warp, all[w][lane]: every lane
// publishes its values, then reads all of them; the second wait keeps the slots until everyone
// has read. All lanes of the warp must call it, as on the GPU. False (nothing exchanged) in a
// block that is not whole warps, which cannot use warp primitives.
template <int kWords>
bool warp_gather(const uint32_t (&mine)[kWords], uint32_t (&all)[kWords][kWarpSize]) {
  static_assert(kWords <= 8, "Warp::words holds 8 words per lane");
  if (warp == nullptr) return false;
  const int t = int(thread_idx.x) % kWarpSize;
  for (int w = 0; w < kWords; ++w) warp->words[t][w] = mine[w];
  warp->barrier.wait();
  for (int lane = 0; lane < kWarpSize; ++lane)
    for (int w = 0; w < kWords; ++w) all[w][lane] = warp->words[lane][w];
  warp->barrier.wait();
  return true;
}

// The grid in clusters of `cluster` blocks (grid.x a multiple of it): the blocks of a cluster run
// at the same time, each with its own threads, barrier, warps and dynamic shared memory; the
// clusters run one after another. Static __shared__ variables are function statics, i.e. one
// instance for all blocks: kernels launched in clusters of more than one block keep their
// shared state in dynamic shared memory.
template <class Kernel, class... Args>
void launch_cluster(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, int cluster,
                    const Args&... args) {
  if (grid.x == 0 || block.x == 0 || grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1 ||
      cluster < 1 || grid.x % unsigned(cluster) != 0) {
    last_error = 1;
    return;
  }
  block_dim = block;
  grid_dim = grid;
  if (grid_at_once) cluster = int(grid.x);  // every block at once (clusters unused then)
  const size_t smem_alloc = (smem_bytes + 1023) / 1024 * 1024;
  std::vector<unsigned char*> smem(size_t(cluster), nullptr);
  for (auto& buffer : smem)
    buffer = smem_alloc ? static_cast<unsigned char*>(std::aligned_alloc(1024, smem_alloc))
                        : nullptr;
  for (unsigned first = 0; first < grid.x; first += unsigned(cluster)) {
    for (auto* buffer : smem)
      if (buffer) std::memset(buffer, 0xFF, smem_alloc);
    Barrier cluster_sync(int(block.x) * cluster);
    std::vector<std::unique_ptr<Barrier>> barriers;
    std::vector<std::unique_ptr<NamedBarriers>> named(static_cast<size_t>(cluster));
    std::vector<std::vector<Warp>> warps(static_cast<size_t>(cluster));
    std::vector<BlockStatics> statics(static_cast<size_t>(cluster));
    for (int q = 0; q < cluster; ++q) {
      named[size_t(q)] = std::make_unique<NamedBarriers>();
      barriers.push_back(std::make_unique<Barrier>(int(block.x)));
      warps[size_t(q)] = std::vector<Warp>(block.x % kWarpSize == 0 ? block.x / kWarpSize : 0);
    }
    std::vector<std::thread> threads;
    threads.reserve(size_t(block.x) * size_t(cluster));
    for (int q = 0; q < cluster; ++q)
      for (unsigned t = 0; t < block.x; ++t) {
        threads.emplace_back([&, t, q] {
          thread_idx = make_uint3(t, 0, 0);
          block_idx = make_uint3(first + unsigned(q), 0, 0);
          block_dim = block;
          grid_dim = grid;
          block_statics = &statics[size_t(q)];
          warp = warps[size_t(q)].empty() ? nullptr : &warps[size_t(q)][t / kWarpSize];
          block_barrier = barriers[size_t(q)].get();
          named_barriers = named[size_t(q)].get();
          dynamic_smem = smem[size_t(q)];
          cluster_rank = q;
          cluster_size = cluster;
          cluster_smem = smem.data();
          cluster_barrier = &cluster_sync;
          kernel(args...);
          emu_ptx::check_drained();
        });
      }
    for (auto& th : threads) th.join();
    emu_ptx::check_block_drained(smem.data(), cluster, smem_alloc);
  }
  for (auto* buffer : smem) std::free(buffer);
}

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, const Args&... args) {
  launch_cluster(kernel, grid, block, smem_bytes, 1, args...);
}

void cluster_barrier_wait() { cluster_barrier->wait(); }

inline int device_attribute(int attr) {
  if (attr == int(cudaDevAttrComputeCapabilityMajor)) return cc_major;
  if (attr == int(cudaDevAttrComputeCapabilityMinor)) return cc_minor;
  if (attr == int(cudaDevAttrL2CacheSize)) return l2_bytes;
  return sm_count;
}

}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
inline void __syncthreads() { emu::block_barrier->wait(); }

#include "common/platform.h"
#include "emu_ptx.h"

// ---- warp primitives and atomics (platform.h defines them for nvcc / hipcc only)
inline int petit_lane_id() { return int(threadIdx.x) % emu::kWarpSize; }
inline int petit_warp_id() { return int(threadIdx.x) / emu::kWarpSize; }
inline petit_lanemask_t petit_lanemask_lt() {
  return (petit_lanemask_t(1) << petit_lane_id()) - 1;
}
inline int petit_popc(petit_lanemask_t m) { return __builtin_popcount(m); }
namespace emu {
// Mask of the lanes whose value satisfies pred(their value).
template <class Pred>
petit_lanemask_t warp_mask(int value, Pred pred) {
  const uint32_t mine[1] = {uint32_t(value)};
  uint32_t all[1][kWarpSize];
  if (!warp_gather(mine, all)) {
    last_error = 1;
    return 0;
  }
  petit_lanemask_t mask = 0;
  for (int lane = 0; lane < kWarpSize; ++lane)
    if (pred(int(all[0][lane]))) mask |= petit_lanemask_t(1) << lane;
  return mask;
}
}  // namespace emu
inline petit_lanemask_t petit_ballot(bool pred) {
  return emu::warp_mask(int(pred), [](int v) { return v != 0; });
}
inline petit_lanemask_t petit_match_any(int value) {
  return emu::warp_mask(value, [value](int v) { return v == value; });
}
// Lane `src_lane`'s value (32-bit types; every lane of the warp calls it, as on the GPU).
template <typename T>
T petit_shfl(T value, int src_lane) {
  static_assert(sizeof(T) == 4, "32-bit values");
  uint32_t mine[1], all[1][emu::kWarpSize];
  std::memcpy(mine, &value, 4);
  if (!emu::warp_gather(mine, all)) emu::last_error = 1;
  T result;
  std::memcpy(&result, &all[0][src_lane & (emu::kWarpSize - 1)], 4);
  return result;
}
template <typename T>
T petit_shfl_xor(T value, int lane_mask) {
  return petit_shfl(value, petit_lane_id() ^ lane_mask);
}
inline void petit_syncwarp() { emu::warp_mask(0, [](int) { return false; }); }  // lanes meet
inline void petit_grid_dependency_sync() {}  // blocks and launches run one after another
inline int atomicAdd(int* address, int value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

// ---- the scoped memory operations, timer and trap of platform.h (used by the dispatch and
// combine kernels). Host atomics: x86 is TSO, so this checks the flag protocol's logic (what
// is published when, and what is waited for) but cannot show a missing fence.
inline uint64_t petit_load_acquire_sys(const uint64_t* ptr) {
  return __atomic_load_n(ptr, __ATOMIC_ACQUIRE);
}
inline void petit_store_release_sys(uint64_t* ptr, uint64_t value) {
  __atomic_store_n(ptr, value, __ATOMIC_RELEASE);
}
inline void petit_store_relaxed_sys(uint64_t* ptr, uint64_t value) {
  __atomic_store_n(ptr, value, __ATOMIC_RELAXED);
}
inline void petit_fence_sys() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void petit_fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline uint32_t petit_atomic_add_gpu(uint32_t* ptr, uint32_t value) {
  return __atomic_fetch_add(ptr, value, __ATOMIC_SEQ_CST);
}
inline int atomicCAS(int* address, int compare, int value) {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST,
                              __ATOMIC_SEQ_CST);
  return compare;  // the old value
}
inline uint4 petit_load_cg(const uint4* ptr) { return *ptr; }
inline int petit_load_acquire_gpu(const int* ptr) { return __atomic_load_n(ptr, __ATOMIC_ACQUIRE); }
inline void petit_prefetch_l2(const void*) {}
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
// The emulated %globaltimer (kTimerSlowdown times slower than the host clock). Spin-waits
// read it once per poll, so each read also yields the core for a moment: thousands of
// emulated threads poll on a few cores while the threads they wait for need to run.
inline uint64_t petit_timer() {
  std::this_thread::sleep_for(std::chrono::microseconds(20));
  return emu_ptx::globaltimer_ns();
}
// A kernel prints its diagnostic (printf, buffered here) before trapping, and only one of the
// threads whose wait expired prints: every trapping thread flushes and gives the printer a
// moment before the process aborts.
[[noreturn]] inline void petit_trap() {
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::fflush(stdout);
  emu_ptx::trap("trap (a bounded wait expired)");
}

#undef petitLaunchKernel
#define petitLaunchKernel(kernel, grid, block, smem, stream, ...) \
  emu::launch(kernel, dim3(grid), dim3(block), size_t(smem), __VA_ARGS__)
#define petitLaunchKernelCluster(kernel, grid, block, smem, stream, cluster, ...) \
  emu::launch_cluster(kernel, dim3(grid), dim3(block), size_t(smem), cluster, __VA_ARGS__)
#undef PETIT_DYNAMIC_SMEM
#define PETIT_DYNAMIC_SMEM(name) unsigned char* name = emu::dynamic_smem
#undef petitFuncSetAttribute
#define petitFuncSetAttribute(kernel, attr, value) petitSuccess
#undef petitFuncGetAttributes
#define petitFuncGetAttributes(attr, kernel) \
  ((attr)->ptxVersion = emu::cc_major * 10 + emu::cc_minor, petitSuccess)  // mma from 8.0
#undef petitGetLastError
#define petitGetLastError() (emu::last_error ? petitErrorInvalidValue : petitSuccess)
#undef petitOccupancyMaxActiveBlocksPerMultiprocessor
#define petitOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, smem) \
  (*(blocks) = emu::blocks_per_sm, petitSuccess)
#undef petitGetDevice
#define petitGetDevice(device) (*(device) = 0, petitSuccess)
// (no CUDA runtime is linked: without this, an emulation library that names the real one
// loads only into a process that happens to have libcudart, e.g. beside a CUDA build of torch)
#undef petitGetErrorString
#define petitGetErrorString(err) ((err) == petitSuccess ? "no error" : "emulated runtime error")
#undef petitDeviceGetAttribute
#define petitDeviceGetAttribute(value, attr, device) \
  (*(value) = emu::device_attribute(int(attr)), petitSuccess)

