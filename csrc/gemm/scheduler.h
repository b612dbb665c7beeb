// Tile scheduler of the grouped GEMMs over (local expert, m-tile, n-tile), driven by the
// device-side row lists (expert_offsets of routing.cu): no host sync, so a launch sized on
// the host stays valid for any routing and can be captured in a CUDA graph.
//
// Used by a persistent grid: every block builds the per-expert m-tile prefix sum once, in
// shared memory (a block-wide scan over <= kMaxExperts counts), then strides over the linear
// tile index t = blockIdx.x, blockIdx.x + gridDim.x, ... < num_tiles(). A block whose
// blockIdx.x is past num_tiles() does nothing, so the grid may be sized for the worst case.
//
// Tile order: n-tile fastest, then the m-tiles of expert 0, of expert 1, ... Blocks running
// at the same time thus share the A rows of one m-tile (reused from L2) and walk through one
// expert's weights before the next.
//
// Clusters (cluster_m > 1, the thread-block clusters of the multicast main loop): a unit of
// the linear index is then (expert, group of cluster_m consecutive m-tiles, n-tile), and the
// CTA of cluster rank r takes m-tile cluster_m * group + r of it, so the CTAs of a cluster
// always work on the same expert and n-tile, i.e. on the same weight rows. A group's last
// m-tiles may not exist (an expert with fewer m-tiles than a multiple of cluster_m): their
// CTAs get num_rows = 0 and still take part in the group's weight loads.
#pragma once

#include "../block_scan.h"
#include "../layout.h"

namespace petit {
namespace gemm {

struct TileCoord {
  int expert;     // local expert
  int n_tile;     // output column tile
  int row_begin;  // position (in sorted_entries order) of the tile's first row
  int num_rows;   // rows of the tile that exist, 1..kBlockM
};

template <int kThreads>
struct ExpertTileScheduler {
  static constexpr int kItemsPerThread = (kMaxExperts + kThreads - 1) / kThreads;

  struct SharedStorage {
    int32_t tile_prefix[kMaxExperts + 1];  // m-tile groups of experts [0, e)
    int32_t thread_sums[kThreads];
  };

  const int32_t* expert_offsets;  // [L+1] global
  const int32_t* tile_prefix;     // [L+1] shared
  int num_experts;
  int num_n_tiles;
  int block_m;
  int cluster_m;  // m-tiles per unit (1, or the cluster size of a multicast main loop)

  // Block-wide: every thread of the block must call it (it contains barriers).
  PETIT_DEVICE void init(const int32_t* offsets, int num_local_experts, int tile_rows,
                         int n_tiles, SharedStorage& smem, int cluster_size = 1) {
    expert_offsets = offsets;
    tile_prefix = smem.tile_prefix;
    num_experts = num_local_experts;
    num_n_tiles = n_tiles;
    block_m = tile_rows;
    cluster_m = cluster_size;
    // Each thread owns kItemsPerThread consecutive experts.
    int32_t tiles[kItemsPerThread];
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) {
      const int e = threadIdx.x * kItemsPerThread + i;
      tiles[i] = 0;
      if (e < num_local_experts)
        tiles[i] = ((offsets[e + 1] - offsets[e] + tile_rows - 1) / tile_rows + cluster_size - 1) /
                   cluster_size;
    }
    int32_t total;
    int32_t running =
        block_exclusive_scan<kThreads, kItemsPerThread>(tiles, smem.thread_sums, &total);
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) {
      const int e = threadIdx.x * kItemsPerThread + i;
      if (e < num_local_experts) smem.tile_prefix[e] = running;
      running += tiles[i];
    }
    if (threadIdx.x == 0) smem.tile_prefix[num_local_experts] = total;
    __syncthreads();
  }

  PETIT_DEVICE int num_tiles() const { return tile_prefix[num_experts] * num_n_tiles; }

  // The persistent tile loop of an expert GEMM kernel (block-wide, like init): the tiles
  // blockIdx.x, blockIdx.x + gridDim.x, ... of the (expert, m-tile, n-tile) grid of tile_rows x
  // block_n tiles over out_cols output columns, body(tile, first output column of the tile).
  template <class Body>
  PETIT_DEVICE static void for_each_tile(const int32_t* offsets, int num_local_experts,
                                         int tile_rows, int block_n, int out_cols,
                                         SharedStorage& smem, Body&& body) {
    ExpertTileScheduler scheduler;
    scheduler.init(offsets, num_local_experts, tile_rows, (out_cols + block_n - 1) / block_n,
                   smem, 1);
    const int num_tiles = scheduler.num_tiles();
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {  // uniform per block
      const TileCoord tile = scheduler.tile(t);
      body(tile, tile.n_tile * block_n);
    }
  }

  // Coordinates of linear tile t < num_tiles() (with clusters: of the m-tile that cluster rank
  // `rank` takes in unit t; num_rows may then be 0).
  PETIT_DEVICE TileCoord tile(int t, int rank = 0) const {
    TileCoord c;
    c.n_tile = t % num_n_tiles;
    const int m_unit = t / num_n_tiles;
    // The expert e with tile_prefix[e] <= m_unit < tile_prefix[e+1]: the largest e < L with
    // tile_prefix[e] <= m_unit (experts without tiles share their successor's prefix).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_prefix[mid] <= m_unit) lo = mid; else hi = mid - 1;
    }
    c.expert = lo;
    const int m_tile = (m_unit - tile_prefix[lo]) * cluster_m + rank;
    const int row_begin = expert_offsets[lo] + m_tile * block_m;
    const int rows_left = expert_offsets[lo + 1] - row_begin;
    c.row_begin = row_begin;
    c.num_rows = rows_left < block_m ? (rows_left > 0 ? rows_left : 0) : block_m;
    return c;
  }
};

}  // namespace gemm
}  // namespace petit
