// Portable SIMT main loop of the grouped GEMM: C[m, n] = sum_k A[m, k] * B[n, k] for one
// (kBlockM x kBlockN) output tile, bf16 operands, fp32 accumulation with scalar FMAs (no
// tensor-core intrinsics: the same code compiles for CUDA and HIP). Both operands are
// K-contiguous ("TN"): A rows are token rows (gathered or not), B rows are rows of an
// expert's weight matrix [N, K] as vLLM stores it.
//
// Gated tiles (kNumBGroups = 2) compute the gate and the up projection of the same output
// columns in one pass: the B tile holds kBlockN gate rows followed by kBlockN up rows, and
// every thread accumulates its columns of both, so a SiLU·mul epilogue finds gate[n] and
// up[n] in the same thread.
//
// Register tiling: thread (ty, tx) owns kThreadM rows x (kNumBGroups * kThreadN) columns.
// Its rows are kVecM-wide runs spaced kVecM * kThreadsM apart (and likewise its columns),
// so the threads of a warp read consecutive (up to 16-byte) vectors of a smem k-row.
//
// Pipeline: shared memory is double-buffered and the next k-tile is fetched into registers
// while the current one is multiplied: one __syncthreads per k-tile.
#pragma once

#include "tile_loader.h"

namespace petit {
namespace gemm {

template <int kBlockM_, int kBlockN_, int kBlockK_, int kThreadM_, int kThreadN_,
          int kNumBGroups_, int kMinBlocksPerSm_>
struct SimtTileConfig {
  static constexpr int kBlockM = kBlockM_;          // A rows (routing entries) per tile
  static constexpr int kBlockN = kBlockN_;          // output columns per tile
  static constexpr int kBlockK = kBlockK_;          // reduction columns per pipeline stage
  static constexpr int kThreadM = kThreadM_;        // accumulator rows per thread
  static constexpr int kThreadN = kThreadN_;        // accumulator columns per thread and group
  static constexpr int kNumBGroups = kNumBGroups_;  // 1: plain; 2: gate rows then up rows
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kThreadsM = kBlockM / kThreadM;
  static constexpr int kThreadsN = kBlockN / kThreadN;
  static constexpr int kThreads = kThreadsM * kThreadsN;
  static constexpr int kBRows = kNumBGroups * kBlockN;  // rows of the B tile
  static constexpr int kVecM = kThreadM < 4 ? kThreadM : 4;
  static constexpr int kVecN = kThreadN < 4 ? kThreadN : 4;

  static_assert(kBlockM % kThreadM == 0 && kBlockN % kThreadN == 0, "thread tiling");
  static_assert(kThreadM % kVecM == 0 && kThreadN % kVecN == 0, "vector runs");
  static_assert(kVecM == 1 || kVecM == 2 || kVecM == 4, "kVecM in {1, 2, 4}");
  static_assert(kVecN == 1 || kVecN == 2 || kVecN == 4, "kVecN in {1, 2, 4}");
  static_assert(kThreads % PETIT_WARP_SIZE == 0, "whole warps");
  static_assert(kNumBGroups == 1 || kNumBGroups == 2, "plain or gated");

  // Tile row of accumulator row i of thread row ty (and tile column of accumulator column j
  // of thread column tx, within one B group).
  PETIT_HOST_DEVICE static int row_of(int ty, int i) {
    return (i / kVecM) * (kVecM * kThreadsM) + ty * kVecM + i % kVecM;
  }
  PETIT_HOST_DEVICE static int col_of(int tx, int j) {
    return (j / kVecN) * (kVecN * kThreadsN) + tx * kVecN + j % kVecN;
  }
};

template <int kVec>
PETIT_DEVICE void load_smem_vec(const float* src, float* dst) {
  if constexpr (kVec == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
  } else if constexpr (kVec == 2) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    dst[0] = v.x; dst[1] = v.y;
  } else {
    dst[0] = src[0];
  }
}

template <class Cfg>
struct SimtMainloop {
  using LoaderA = TileLoader<Cfg::kBlockM, Cfg::kBlockK, Cfg::kThreads>;
  using LoaderB = TileLoader<Cfg::kBRows, Cfg::kBlockK, Cfg::kThreads>;
  static constexpr int kAccCols = Cfg::kNumBGroups * Cfg::kThreadN;

  // Two pipeline stages of both operands, fp32, k-major (see TileLoader::store).
  struct alignas(16) SharedStorage {
    float a[2][LoaderA::smem_floats()];
    float b[2][LoaderB::smem_floats()];
  };

  // acc[i][g * kThreadN + j]: row Cfg::row_of(ty, i), column Cfg::col_of(tx, j) of group g.
  float acc[Cfg::kThreadM][kAccCols];
  int ty, tx;

  PETIT_DEVICE SimtMainloop() : ty(threadIdx.x / Cfg::kThreadsN), tx(threadIdx.x % Cfg::kThreadsN) {}

  // The whole reduction over k_dim (> 0, a multiple of 8) for the tile whose rows `a_loader`
  // and `b_loader` were initialized with. Starts and ends with every thread past a barrier
  // and `smem` free, so consecutive tiles of a persistent loop may call it back to back.
  PETIT_DEVICE void run(LoaderA& a_loader, LoaderB& b_loader, int k_dim, SharedStorage& smem) {
#pragma unroll
    for (int i = 0; i < Cfg::kThreadM; ++i)
#pragma unroll
      for (int j = 0; j < kAccCols; ++j) acc[i][j] = 0.0f;

    const int num_k_tiles = (k_dim + Cfg::kBlockK - 1) / Cfg::kBlockK;
    a_loader.load(0, k_dim);
    b_loader.load(0, k_dim);
    a_loader.store(smem.a[0]);
    b_loader.store(smem.b[0]);
    __syncthreads();
    for (int kt = 0; kt < num_k_tiles; ++kt) {
      const int stage = kt & 1;
      const bool has_next = kt + 1 < num_k_tiles;
      if (has_next) {  // in flight while this stage is multiplied
        a_loader.load((kt + 1) * Cfg::kBlockK, k_dim);
        b_loader.load((kt + 1) * Cfg::kBlockK, k_dim);
      }
      multiply_stage(smem.a[stage], smem.b[stage]);
      // The other stage was last read in iteration kt-1, whose closing barrier every thread
      // has passed: it is free to overwrite.
      if (has_next) {
        a_loader.store(smem.a[stage ^ 1]);
        b_loader.store(smem.b[stage ^ 1]);
      }
      __syncthreads();
    }
  }

  PETIT_DEVICE void multiply_stage(const float* a_smem, const float* b_smem) {
#pragma unroll
    for (int k = 0; k < Cfg::kBlockK; ++k) {
      float a[Cfg::kThreadM];
      float b[kAccCols];
#pragma unroll
      for (int i = 0; i < Cfg::kThreadM; i += Cfg::kVecM)
        load_smem_vec<Cfg::kVecM>(a_smem + k * Cfg::kBlockM + Cfg::row_of(ty, i), &a[i]);
#pragma unroll
      for (int g = 0; g < Cfg::kNumBGroups; ++g)
#pragma unroll
        for (int j = 0; j < Cfg::kThreadN; j += Cfg::kVecN)
          load_smem_vec<Cfg::kVecN>(b_smem + k * Cfg::kBRows + g * Cfg::kBlockN + Cfg::col_of(tx, j),
                                    &b[g * Cfg::kThreadN + j]);
#pragma unroll
      for (int i = 0; i < Cfg::kThreadM; ++i)
#pragma unroll
        for (int j = 0; j < kAccCols; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
};

}  // namespace gemm
}  // namespace petit
