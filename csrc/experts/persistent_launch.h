// Host side shared by the expert kernels' launchers (gemm_sm90.cu, gemm_simt.cu, reduce.cu,
// tile_choice.cu): the argument checks of ExpertGemmArgs (experts_check and the pointers), the
// SM count, the persistent grid (and its cluster form) and the one launch function, which
// launches programmatically and records the shape it launched (last_expert_gemm_launch).
// Internal to csrc/experts/: the public launchers are declared in api.h.
#pragma once

#include <atomic>

#include "api.h"
#include "common/launch.h"

namespace petit {

inline bool aligned16(const void* p) {
  return p != nullptr && (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// experts_check (the limits, with their message) and, with rows, the pointers the kernels use.
inline petitError_t check_args(const ExpertGemmArgs& a) {
  const petitError_t err = experts_check(a, nullptr, 0);
  if (err != petitSuccess) return err;
  if (a.num_rows > 0 &&
      !(aligned16(a.x) && aligned16(a.w13) && aligned16(a.w2) && aligned16(a.act) &&
        aligned16(a.partial) && aligned16(a.out) && a.topk_ids != nullptr &&
        a.topk_weights != nullptr && a.expert_offsets != nullptr && a.sorted_entries != nullptr))
    return petitErrorInvalidValue;
  return petitSuccess;
}

// a.num_sms, or where it is 0 the current device's SM count: queried once per device and
// process (the launchers run once per layer and step; no device sync, safe during capture).
inline petitError_t device_sm_count(const ExpertGemmArgs& a, int* num_sms) {
  *num_sms = a.num_sms;
  if (*num_sms > 0) return petitSuccess;
  int device = 0;
  petitError_t err = petitGetDevice(&device);
  if (err != petitSuccess) return err;
  constexpr int kCachedDevices = 64;  // devices beyond are queried every call
  static std::atomic<int> cached[kCachedDevices] = {};
  const bool cacheable = device >= 0 && device < kCachedDevices;
  if (cacheable && (*num_sms = cached[device].load(std::memory_order_relaxed)) > 0)
    return petitSuccess;
  err = petitDeviceGetAttribute(num_sms, petitDevAttrMultiProcessorCount, device);
  if (err == petitSuccess && cacheable) cached[device].store(*num_sms, std::memory_order_relaxed);
  return err;
}

// Persistent grid of block_m x block_n tiles over out_cols output columns: enough blocks to fill
// the GPU, never more than the most tiles any routing can produce (sum over experts of
// ceil(rows_e / block_m) <= N*K / block_m + L). Returns 0 when that bound does not fit the
// kernels' int tile index (absurd sizes: N*K in the 10^7s with H in the thousands).
constexpr int64_t kMaxTiles = int64_t(1) << 30;

inline int persistent_grid(const ExpertGemmArgs& a, int out_cols, int block_m,
                           int block_n, int blocks_per_sm, int num_sms) {
  const int64_t num_entries = int64_t(a.num_rows) * a.top_k;
  const int64_t max_m_tiles = (num_entries + block_m - 1) / block_m + a.num_local_experts;
  const int64_t max_tiles = max_m_tiles * ceil_div(out_cols, block_n);
  if (max_tiles >= kMaxTiles) return 0;
  const int64_t resident = int64_t(num_sms) * blocks_per_sm;
  return int(max_tiles < resident ? max_tiles : resident);
}

// Launches of the expert kernels: programmatic (common/launch.h) where the device allows, every
// expert kernel starting with petit_grid_dependency_sync. The row lists, gate/up, down and
// reduce kernels of one call thus follow each other with shorter gaps (most visible at decode
// sizes, where a call is a few tens of microseconds).

// The shape of the latest launch_kernel call, whichever file made it (tile_choice.cu keeps
// the GEMMs' for last_expert_gemm_launch).
inline ExpertLaunchShape g_launch_shape = {};

template <class Kernel, class... Args>
petitError_t launch_kernel(Kernel kernel, int grid, int threads, int smem_bytes, int cluster,
                           petitStream_t stream, const Args&... args) {
  g_launch_shape = ExpertLaunchShape{grid, threads, smem_bytes, cluster};
  return launch_with_attributes(kernel, grid, threads, smem_bytes, cluster,
                                programmatic_launch_enabled(), stream, args...);
}

// A persistent grid of clusters: a multiple of `cluster` CTAs, at most as many clusters as can
// be resident at once (CUDA's occupancy query; a cluster needs `cluster` SMs of one GPC), so
// that no cluster waits for another one's whole tile loop.
template <class Kernel>
petitError_t cluster_grid(Kernel kernel, int threads, int smem_bytes, int cluster, int* grid) {
  *grid = *grid / cluster * cluster;
  if (*grid < cluster) *grid = cluster;
#if PETIT_CUDA && !PETIT_EMU_PTX
  const LaunchConfig launch(*grid, threads, smem_bytes, cluster, false, nullptr);
  int max_clusters = 0;
  const petitError_t err = cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &launch.config);
  if (err != petitSuccess) return err;
  if (max_clusters <= 0) return petitErrorNotSupported;
  if (*grid > max_clusters * cluster) *grid = max_clusters * cluster;
#else
  (void)kernel, (void)threads, (void)smem_bytes;
#endif
  return petitSuccess;
}

// One launch of an expert GEMM kernel on its persistent grid.
// `extra`: kernel parameters after the ExpertGemmArgs (the warp-specialized kernels' tensor map).
template <class Kernel, class... Extra>
petitError_t launch_persistent(Kernel kernel, const ExpertGemmArgs& a, int out_cols, int block_m,
                               int block_n, int blocks_per_sm, int threads, int smem_bytes,
                               int num_sms, int cluster, petitStream_t stream,
                               const Extra&... extra) {
  int grid = persistent_grid(a, out_cols, block_m, block_n, blocks_per_sm, num_sms);
  if (grid == 0) return petitErrorInvalidValue;
  if (cluster > 1) {
    const petitError_t err = cluster_grid(kernel, threads, smem_bytes, cluster, &grid);
    if (err != petitSuccess) return err;
  }
  return launch_kernel(kernel, grid, threads, smem_bytes, cluster, stream, a, extra...);
}

}  // namespace petit
