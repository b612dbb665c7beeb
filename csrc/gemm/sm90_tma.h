// TMA (tensor memory accelerator, sm_90) loads of expert weight tiles for the warp-specialized
// main loop (sm90_mainloop_wgmma_ws.h). One thread issues a whole stage's weight rows as a few
// box copies; the hardware computes the addresses, zero-fills what lies outside the tensor
// and writes shared memory in the 128-byte swizzled layout the wgmma descriptors read
// (Sw128Swizzle), signalling the stage's mbarrier with the bytes it wrote (complete_tx). The
// weights are fixed-stride tensors, so they suit TMA; the gathered A rows of the gate/up GEMM
// do not (Hopper's TMA has no row gather), they stay with cp.async.
//
// A weight tensor is viewed as 4-D, innermost first: k (the reduction, contiguous), row
// (output column), group (gate / up half of w13; 1 for w2), expert:
//   w13 [L, 2I, H] = dims {H, I, 2, L};  w2 [L, H, I] = dims {I, H, 1, L}.
// A box is 64 k (128 bytes, one swizzle row) x kGroupCols rows of one group of one expert, so
// rows past I (or H) and k past the tensor read as zeros, as the cp.async loaders' missing
// rows / chunks do.
//
// CUDA only (included where PETIT_SM80_PATH is set); the asm is emitted only in sm_90a device
// passes. The tensor map is encoded on the host through the driver's cuTensorMapEncodeTiled
// (resolved at run time like the heap's driver calls, platform.h); under the CPU emulation
// (PETIT_EMU_PTX) encoding and copies are tests/emu/emu_ptx.h's.
#pragma once

#include "../common/platform.h"
#include "sm90_mainloop_wgmma.h"

namespace petit {
namespace gemm {

constexpr int kTmaBoxK = 64;  // bf16 per box row: 128 bytes, the 128-byte swizzle's row

// Host: the tensor map of a [experts][groups][rows][k] weight tensor of bf16 (element_bytes 2)
// or one-byte elements (1: e4m3), k contiguous, every dimension dense; boxes of one 128-byte
// row (kTmaBoxK bf16, 128 bytes) x box_rows x 1 x 1, 128-byte swizzle, out-of-bounds elements
// read as zeros. petitErrorInvalidValue for shapes TMA cannot describe (rows of k not a
// multiple of 16 bytes, a base not 16-byte aligned, box_rows outside 1..256),
// petitErrorNotSupported when the driver lacks the call.
inline petitError_t sm90_encode_weight_map_of(CUtensorMap* map, const void* base,
                                              int element_bytes, int k, int rows, int groups,
                                              int experts, int box_rows) {
  if ((element_bytes != 1 && element_bytes != 2) || k <= 0 || k % (16 / element_bytes) != 0 ||
      rows <= 0 || groups <= 0 || experts <= 0 || box_rows <= 0 || box_rows > 256 ||
      reinterpret_cast<uintptr_t>(base) % 16 != 0)
    return petitErrorInvalidValue;
  const cuuint64_t dims[4] = {cuuint64_t(k), cuuint64_t(rows), cuuint64_t(groups),
                              cuuint64_t(experts)};
  const cuuint64_t row_bytes = cuuint64_t(k) * element_bytes;
  const cuuint64_t strides[3] = {row_bytes, row_bytes * rows, row_bytes * rows * groups};
  const cuuint32_t box[4] = {cuuint32_t(128 / element_bytes), cuuint32_t(box_rows), 1, 1};
#if PETIT_EMU_PTX
  emu_ptx::tensor_map_encode(map, base, dims, strides, box, element_bytes);
  return petitSuccess;
#else
  if (petit_vmm_load() != CUDA_SUCCESS || petit_driver().tensor_map_encode_tiled == nullptr)
    return petitErrorNotSupported;
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = petit_driver().tensor_map_encode_tiled(
      map, element_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8,
      4, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? petitSuccess : petitErrorInvalidValue;
#endif
}
inline petitError_t sm90_encode_weight_map(CUtensorMap* map, const petit_bf16_bits* base, int k,
                                           int rows, int groups, int experts, int box_rows) {
  return sm90_encode_weight_map_of(map, base, 2, k, rows, groups, experts, box_rows);
}

// Box (c0 = k, c1 = row, c2 = group, c3 = expert) of `map` into shared memory at `dst`
// (1024-byte aligned for the swizzle), completing `bytes` of the mbarrier `bar`'s transaction
// count. `map` is the generic address of a kernel parameter (__grid_constant__).
PETIT_DEVICE void sm90_tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                   int c3, uint32_t bar) {
#if PETIT_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::tma_load_4d(dst, map, c0, c1, c2, c3, bar);
#endif
}

// The same box into shared memory at `dst` of every CTA of the cluster in `cta_mask`, each
// completing the bytes on its own mbarrier at offset `bar` (multicast, sm_90 clusters).
PETIT_DEVICE void sm90_tma_load_4d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                             int c2, int c3, uint32_t bar, uint16_t cta_mask) {
#if PETIT_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar),
      "h"(cta_mask)
      : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::tma_load_4d_multicast(dst, map, c0, c1, c2, c3, bar, cta_mask);
#endif
}

// Fetches the tensor map into the TMA unit's cache ahead of its first use.
PETIT_DEVICE void sm90_prefetch_tensor_map(const CUtensorMap* map) {
#if PETIT_SM90A_DEVICE
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// The B (weight) rows of one output tile of tile config Cfg, as TMA boxes: stage row r holds
// row n_begin + Cfg::b_col_of(r) of group Cfg::b_group_of(r) of the expert, and the config
// keeps runs of kRunRows = Cfg::kGroupCols stage rows in one group with consecutive columns
// (host-checked by tests/emu/gemm_layout_check.cu), so a stage is kRuns runs of kRunRows rows.
// With kClusterM > 1 each run is cut into kClusterM boxes of kBoxRows rows. In a tile whose
// weight rows the CTAs of the cluster share (scheduler.h, TileCoord::multicast) the CTA of
// cluster rank q loads boxes q, q + kClusterM, ... once, multicast into every CTA of the
// cluster; in any other tile each CTA loads all the boxes, into its own shared memory only.
// Without clusters a box is a run.
template <class Cfg, int kClusterM = 1>
struct Sm90WeightTmaLoader {
  static constexpr int kRunRows = Cfg::kGroupCols;
  static constexpr int kRuns = Cfg::kBRows / kRunRows;
  static constexpr int kBoxRows = kRunRows / kClusterM;
  static constexpr int kBoxes = kRuns * kClusterM;  // per stage, all CTAs of a cluster together
  static constexpr int kStageBytes = Cfg::kBRows * kTmaBoxK * int(sizeof(petit_bf16_bits));
  static_assert(Cfg::kBlockK == kTmaBoxK, "one box row per stage row");
  static_assert(kRunRows % 8 == 0 && kRunRows <= 256 && Cfg::kBRows % kRunRows == 0,
                "runs of whole 8-row swizzle atoms, at most 256 rows");
  static_assert(kClusterM >= 1 && kRunRows % (8 * kClusterM) == 0,
                "each CTA's box of a run is whole 8-row swizzle atoms");

  // Stage row of box b's first row.
  PETIT_HOST_DEVICE static constexpr int box_row(int b) {
    return (b / kClusterM) * kRunRows + (b % kClusterM) * kBoxRows;
  }

  const CUtensorMap* map;
  int expert;
  int n_begin;

  PETIT_DEVICE void init(const CUtensorMap* tensor_map, int tile_expert, int tile_n_begin) {
    map = tensor_map;
    expert = tile_expert;
    n_begin = tile_n_begin;
  }

  // The boxes of the k-tile starting at column k0 into the stage at `dst`, completing on
  // `bar`: with `multicast`, this CTA's share (cluster rank `rank`) into the stage (and onto
  // the barrier) of every CTA of the cluster; otherwise all of them, into this CTA's.
  PETIT_DEVICE void issue(uint32_t dst, int k0, uint32_t bar, int rank = 0,
                          bool multicast = false) const {
#pragma unroll
    for (int b = 0; b < kBoxes; ++b) {
      const int r0 = box_row(b);
      if (kClusterM > 1 && multicast) {
        if (b % kClusterM == rank)
          sm90_tma_load_4d_multicast(dst + uint32_t(r0) * 128u, map, k0,
                                     n_begin + Cfg::b_col_of(r0), Cfg::b_group_of(r0), expert,
                                     bar, uint16_t((1u << kClusterM) - 1));
      } else {
        sm90_tma_load_4d(dst + uint32_t(r0) * 128u, map, k0, n_begin + Cfg::b_col_of(r0),
                         Cfg::b_group_of(r0), expert, bar);
      }
    }
  }
};

}  // namespace gemm
}  // namespace petit
