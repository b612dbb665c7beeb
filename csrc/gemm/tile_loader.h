// Global -> shared tile loader of the portable (SIMT) grouped GEMM: one bf16 tile of
// kRows rows x kBlockK columns, every row K-contiguous in global memory and addressed by its
// own pointer (so A rows can be gathered through a row list with no permute copy, and B rows
// are rows of an expert's weight matrix). The tile lands in shared memory as fp32, k-major
// (smem[k][row]), the layout the SIMT main loop reads with vector loads.
//
// Contract (checked by the launchers, relied on here):
//   - the reduction length k_dim is a multiple of 8 and every row pointer is 16-byte
//     aligned, so one 16-byte chunk (8 bf16) is either entirely inside [0, k_dim) or
//     entirely outside: there are no partial chunks;
//   - a row the tile does not have (past the expert's last entry, past N) has a null
//     pointer; its smem row is filled with zeros, as are chunks at k >= k_dim, so partial
//     tiles need no masking in the main loop (zeros add nothing to any dot product).
//
// Framework-free: written against platform.h only, compiles with nvcc and hipcc.
#pragma once

#include "../common/platform.h"

namespace petit {
namespace gemm {

constexpr int kChunkElems = 8;  // bf16 elements per 16-byte global load

template <int kRows_, int kBlockK_, int kThreads_>
struct TileLoader {
  static constexpr int kRows = kRows_;
  static constexpr int kBlockK = kBlockK_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kChunksPerRow = kBlockK / kChunkElems;
  static constexpr int kChunks = kRows * kChunksPerRow;
  static constexpr int kChunksPerThread = (kChunks + kThreads - 1) / kThreads;
  static constexpr bool kAllChunksUsed = kChunks % kThreads == 0;
  // Consecutive threads take consecutive chunks of one row (chunk index fastest), so a warp's
  // global loads cover whole 32-byte sectors. The price is a kChunksPerRow-way bank conflict
  // on the smem stores (the chunks of one row land in the same banks); an XOR swizzle would
  // remove it but costs the main loop address registers it does not have to spare (the large
  // tiles sit at 126-127 of 128), and the stores are a small share of the smem traffic.
  static_assert(kBlockK % kChunkElems == 0, "kBlockK must be a multiple of 8");
  static_assert(kRows % 4 == 0, "tile rows must be a multiple of 4 (vector smem reads)");

  PETIT_HOST_DEVICE static constexpr int smem_floats() { return kBlockK * kRows; }

  const petit_bf16_bits* chunk_ptr[kChunksPerThread];  // row start + chunk offset; null: zeros
  uint4 regs[kChunksPerThread];

  // row_fn(row) -> const petit_bf16_bits*: start of tile row `row` (0 <= row < kRows) in
  // global memory, or nullptr when the tile has no such row. Called once per tile.
  template <class RowFn>
  PETIT_DEVICE void init(RowFn row_fn) {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = threadIdx.x + i * kThreads;
      chunk_ptr[i] = nullptr;
      if (kAllChunksUsed || chunk < kChunks) {
        const petit_bf16_bits* row = row_fn(chunk / kChunksPerRow);
        if (row != nullptr) chunk_ptr[i] = row + (chunk % kChunksPerRow) * kChunkElems;
      }
    }
  }

  // Global -> registers for the k-tile starting at column k0 (issue early, use later).
  PETIT_DEVICE void load(int k0, int k_dim) {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = threadIdx.x + i * kThreads;
      const int k = k0 + (chunk % kChunksPerRow) * kChunkElems;
      regs[i] = make_uint4(0u, 0u, 0u, 0u);
      if (chunk_ptr[i] != nullptr && k < k_dim)
        regs[i] = *reinterpret_cast<const uint4*>(chunk_ptr[i] + k0);
    }
  }

  // Registers -> smem[k][row] as fp32 (smem holds smem_floats() floats).
  PETIT_DEVICE void store(float* smem) const {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = threadIdx.x + i * kThreads;
      if (!kAllChunksUsed && chunk >= kChunks) continue;
      const int kc = chunk % kChunksPerRow;
      float* dst = smem + kc * kChunkElems * kRows + chunk / kChunksPerRow;
      const uint32_t words[4] = {regs[i].x, regs[i].y, regs[i].z, regs[i].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {  // little endian: element 2w in the low half
        dst[(2 * w) * kRows] = petit_bf16_to_float(petit_bf16_bits(words[w] & 0xffffu));
        dst[(2 * w + 1) * kRows] = petit_bf16_to_float(petit_bf16_bits(words[w] >> 16));
      }
    }
  }
};

}  // namespace gemm
}  // namespace petit
