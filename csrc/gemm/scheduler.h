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
// Clusters (kClusterM = c > 1, the thread-block clusters of the multicast main loop): a unit
// of the linear index is the work of one cluster, and every CTA of the cluster walks the same
// units. An expert with mt m-tiles and N n-tiles has
//   - (mt / c) * N paired units (expert, group of c consecutive m-tiles, n-tile): the CTA of
//     cluster rank r takes m-tile c * group + r, so all of them need the same weight rows,
//     which they load once for all (multicast = true);
//   - then, when mt % c != 0, ceil(N / c) split units for each of the mt % c m-tiles left: the
//     CTA of rank r takes n-tile c * j + r of that m-tile, loading its own weight rows
//     (multicast = false). A rank past the last n-tile gets num_rows = 0 (it still walks the
//     unit's k-tiles, which its cluster's barriers count on, and stores nothing).
// So a cluster never spends a CTA on a missing m-tile: an expert costs as many CTA tiles as
// without clusters (plus at most c - 1 per left-over m-tile when N % c != 0).
#pragma once

#include "../common/block_scan.h"
#include "../common/layout.h"

namespace petit {
namespace gemm {

struct TileCoord {
  int expert;     // local expert
  int n_tile;     // output column tile
  int row_begin;  // position (in sorted_entries order) of the tile's first row
  int num_rows;   // rows of the tile that exist, 1..kBlockM (0 only with clusters)
  bool multicast; // clusters: the CTAs of the cluster share this tile's weight rows
};

// kClusterM: the CTAs per cluster (1 without clusters).
template <int kThreads, int kClusterM = 1>
struct ExpertTileScheduler {
  static constexpr int kItemsPerThread = (kMaxExperts + kThreads - 1) / kThreads;

  struct SharedStorage {
    int32_t tile_prefix[kMaxExperts + 1];  // units of experts [0, e) (kClusterM 1: m-tiles)
    int32_t thread_sums[kThreads];
  };

  const int32_t* expert_offsets;  // [L+1] global
  const int32_t* tile_prefix;     // [L+1] shared
  int num_experts;
  int num_n_tiles;
  int block_m;

  // Block-wide: every thread of the block must call it (it contains barriers).
  PETIT_DEVICE void init(const int32_t* offsets, int num_local_experts, int tile_rows,
                         int n_tiles, SharedStorage& smem) {
    expert_offsets = offsets;
    tile_prefix = smem.tile_prefix;
    num_experts = num_local_experts;
    num_n_tiles = n_tiles;
    block_m = tile_rows;
    // Each thread owns kItemsPerThread consecutive experts.
    int32_t tiles[kItemsPerThread];
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) {
      const int e = threadIdx.x * kItemsPerThread + i;
      tiles[i] = 0;
      if (e < num_local_experts)
        tiles[i] = num_units((offsets[e + 1] - offsets[e] + tile_rows - 1) / tile_rows, n_tiles);
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

  // Units of an expert with m_tiles m-tiles (see the top of the file); without clusters in
  // units of N tiles (its m-tiles).
  PETIT_HOST_DEVICE static int num_units(int m_tiles, int n_tiles) {
    if constexpr (kClusterM == 1) return m_tiles;
    return m_tiles / kClusterM * n_tiles +
           m_tiles % kClusterM * ((n_tiles + kClusterM - 1) / kClusterM);
  }

  PETIT_DEVICE int num_tiles() const {
    return kClusterM == 1 ? tile_prefix[num_experts] * num_n_tiles : tile_prefix[num_experts];
  }

  // The persistent tile loop of an expert GEMM kernel (block-wide, like init): the tiles
  // blockIdx.x, blockIdx.x + gridDim.x, ... of the (expert, m-tile, n-tile) grid of tile_rows x
  // block_n tiles over out_cols output columns, body(tile, first output column of the tile).
  template <class Body>
  PETIT_DEVICE static void for_each_tile(const int32_t* offsets, int num_local_experts,
                                         int tile_rows, int block_n, int out_cols,
                                         SharedStorage& smem, Body&& body) {
    ExpertTileScheduler scheduler;
    scheduler.init(offsets, num_local_experts, tile_rows, (out_cols + block_n - 1) / block_n,
                   smem);
    const int num_tiles = scheduler.num_tiles();
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {  // uniform per block
      const TileCoord tile = scheduler.tile(t);
      body(tile, tile.n_tile * block_n);
    }
  }

  // Coordinates of linear tile t < num_tiles() (with clusters: of the tile that cluster rank
  // `rank` takes in unit t; num_rows may then be 0).
  PETIT_DEVICE TileCoord tile(int t, int rank = 0) const {
    // Without clusters: n-tile t % N of m-tile t / N of all experts' m-tiles in order.
    const int key = kClusterM == 1 ? t / num_n_tiles : t;
    // The expert e with tile_prefix[e] <= key < tile_prefix[e+1]: the largest e < L with
    // tile_prefix[e] <= key (experts without tiles share their successor's prefix).
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_prefix[mid] <= key) lo = mid; else hi = mid - 1;
    }
    TileCoord c;
    c.expert = lo;
    const int u = key - tile_prefix[lo];
    const int expert_begin = expert_offsets[lo];
    int m_tile;
    if constexpr (kClusterM == 1) {
      m_tile = u;
      c.n_tile = t % num_n_tiles;
      c.multicast = false;
    } else {
      const int expert_rows = expert_offsets[lo + 1] - expert_begin;
      const int paired = (expert_rows + block_m - 1) / block_m / kClusterM * num_n_tiles;
      if (u < paired) {
        m_tile = u / num_n_tiles * kClusterM + rank;
        c.n_tile = u % num_n_tiles;
        c.multicast = true;
      } else {
        const int split_units = (num_n_tiles + kClusterM - 1) / kClusterM, j = u - paired;
        m_tile = paired / num_n_tiles * kClusterM + j / split_units;
        c.n_tile = j % split_units * kClusterM + rank;
        c.multicast = false;
      }
    }
    const int rows_left = expert_offsets[lo + 1] - expert_begin - m_tile * block_m;
    c.row_begin = expert_begin + m_tile * block_m;
    c.num_rows = rows_left < block_m ? rows_left : block_m;
    if (kClusterM > 1 && c.n_tile >= num_n_tiles) {  // a split unit's rank past the last n-tile
      c.n_tile = num_n_tiles - 1;
      c.num_rows = 0;
    }
    return c;
  }
};

}  // namespace gemm
}  // namespace petit
