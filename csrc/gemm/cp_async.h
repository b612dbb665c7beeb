// cp.async (sm_80+) pieces of the tensor-core main loops (sm90_mainloop_wgmma_ws.h's producer
// gathers its A rows with them): the copy / commit / wait wrappers and the row-gathering tile
// loader.
//
// Loader contract (the same as the portable TileLoader of tile_loader.h): both operands are
// K-contiguous, one global pointer per tile row (A rows gathered through the row list, B rows
// are weight rows), a null row pointer means the row does not exist (its smem row is zeros),
// k_dim is a multiple of 8 and every row pointer 16-byte aligned, so a 16-byte chunk is
// either wholly inside [0, k_dim) or wholly outside (zeros). Where a stage's row of
// kChunksPerRow chunks lands in shared memory is the main loop's choice (Swizzle policy).
//
// CUDA only (included where platform.h's PETIT_SM80_PATH is set); the asm is emitted only in
// device passes for sm_80 and newer (PETIT_SM80_DEVICE), elsewhere the wrappers are empty;
// under the CPU emulation (PETIT_EMU_PTX) the copies are tests/emu/emu_ptx.h's.
#pragma once

#include "../common/platform.h"

namespace petit {
namespace gemm {

PETIT_DEVICE uint32_t smem_addr_u32(const void* ptr) {
#if PETIT_EMU_PTX
  return emu_ptx::smem_addr(ptr);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
#endif
}

// 16 bytes global -> shared, L1 bypassed; src_bytes = 0 writes 16 zero bytes and reads nothing
// (src must still be a valid address: callers pass a real row).
PETIT_DEVICE void sm80_cp_async_16(uint32_t dst, const void* src, int src_bytes) {
#if PETIT_SM80_DEVICE
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::cp_async_16(dst, src, src_bytes);
#endif
}

PETIT_DEVICE void cp_async_commit() {
#if PETIT_SM80_DEVICE
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif PETIT_EMU_PTX
  emu_ptx::cp_async_commit();
#endif
}

// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
PETIT_DEVICE void cp_async_wait() {
#if PETIT_SM80_DEVICE
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::cp_async_wait(kPending);
#endif
}

// Wait until every cp.async this thread issued has completed (committed to a group or not).
PETIT_DEVICE void cp_async_wait_all() {
#if PETIT_SM80_DEVICE
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#elif PETIT_EMU_PTX
  emu_ptx::cp_async_wait_all();
#endif
}

// ------------------------------------------------------------------ smem layouts of a stage

// wgmma path: rows of 64 bf16 (128 bytes = 8 chunks), chunk c of row r at chunk position
// c ^ (r & 7): the hardware's 128-byte swizzle (8-row x 128-byte atoms, 1024-byte aligned),
// which the wgmma shared-memory descriptors of sm90_mainloop_wgmma.h name as layout type 1.
struct Sw128Swizzle {
  static constexpr int kChunksPerRow = 8;
  PETIT_HOST_DEVICE static constexpr int offset(int row, int chunk) {
    return row * 128 + ((chunk ^ (row & 7)) * 16);
  }
};

// ------------------------------------------------------------------ row-gathering loader

// kRows rows x Swizzle::kChunksPerRow 16-byte chunks per stage; thread t copies chunks
// t, t + kThreads, ... of the stage, t = threadIdx.x - kThreadOffset (a warp-specialized main
// loop's producer threads follow its consumers').
template <int kRows_, int kThreads_, class Swizzle, int kThreadOffset = 0>
struct CpAsyncLoader {
  static constexpr int kRows = kRows_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kChunksPerRow = Swizzle::kChunksPerRow;
  static constexpr int kChunks = kRows * kChunksPerRow;
  static constexpr int kChunksPerThread = kChunks / kThreads;
  static constexpr int kStageBytes = kRows * kChunksPerRow * 16;
  static_assert(kChunks % kThreads == 0, "every thread copies the same number of chunks");
  static_assert(kChunksPerThread <= 32, "valid_mask has 32 bits");

  const petit_bf16_bits* chunk_ptr[kChunksPerThread];  // row start + chunk offset, or fallback
  uint32_t valid_mask;                                 // bit i: chunk i's row exists

  // row_fn(row) -> const petit_bf16_bits*: start of tile row `row` in global memory, or nullptr
  // when the tile has no such row; `fallback`: any valid 16-byte aligned global address (the
  // source operand of the zero-filling copies of missing rows). Called once per tile.
  template <class RowFn>
  PETIT_DEVICE void init(RowFn row_fn, const petit_bf16_bits* fallback) {
    valid_mask = 0;
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = int(threadIdx.x) - kThreadOffset + i * kThreads;
      const petit_bf16_bits* row = row_fn(chunk / kChunksPerRow);
      chunk_ptr[i] = fallback;
      if (row != nullptr) {
        chunk_ptr[i] = row + (chunk % kChunksPerRow) * 8;
        valid_mask |= 1u << i;
      }
    }
  }

  // Issue the copies of the k-tile starting at column k0 into the stage at smem address `dst`.
  PETIT_DEVICE void issue(uint32_t dst, int k0, int k_dim) const {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int chunk = int(threadIdx.x) - kThreadOffset + i * kThreads;
      const int row = chunk / kChunksPerRow, c = chunk % kChunksPerRow;
      const bool in = ((valid_mask >> i) & 1u) && k0 + c * 8 < k_dim;
      sm80_cp_async_16(dst + Swizzle::offset(row, c), in ? chunk_ptr[i] + k0 : chunk_ptr[i],
                       in ? 16 : 0);
    }
  }
};

}  // namespace gemm
}  // namespace petit
