// Staged epilogue of the warp-specialized down GEMM (sm90_mainloop_wgmma_ws.h) of the wgmma
// and wgmma_mc regimes (experts/gemm_sm90.cu): the same
// output as WeightedEntryEpilogue (epilogues.h: partial[entry][n] = bf16(weight[entry] * acc),
// bit for bit), but
//   - the routing weights of the thread's rows and the destination entry of each tile row are
//     loaded before the tile's main loop (prefetch), not after it;
//   - the consumers write the weighted bf16 tile into a shared-memory staging buffer (rows
//     padded by 16 bytes: the 8 rows a warp's store covers fall in distinct banks) instead of
//     4-byte global stores scattered over 8 rows per warp instruction;
//   - consumer thread r < rows then copies tile row r to its entry's row of `partial` with one
//     bulk copy (cp.async.bulk.global.shared::cta, up to 512 bytes), which runs on while the
//     consumers go on with the next tile's MMAs; the next epilogue waits only until those
//     copies have read the staging buffer (cp.async.bulk.wait_group.read).
// The point is to shorten the part of each tile in which no MMA runs (Nsight Compute: the
// tensor pipe idles 38% of the down kernel's cycles with the plain epilogue).
//
// Consumer threads only (threadIdx.x < Cfg::kThreads): they synchronize among themselves with
// named barrier kStagedBarrierId, the producer warpgroup never reaches it. CUDA only; the asm
// is emitted only in sm_90a device passes; under the CPU emulation (PETIT_EMU_PTX) the bulk
// copies and the named barrier are tests/emu/emu_ptx.h's.
#pragma once

#include "../common/platform.h"
#include "cp_async.h"
#include "epilogues.h"
#include "sm90_mainloop_wgmma.h"

namespace petit {
namespace gemm {

// bar.sync `id`, `threads` (a multiple of 32): the first `threads` threads to arrive at named
// barrier `id` of the block wait for each other.
PETIT_DEVICE void sm90_named_barrier_sync(int id, int threads) {
#if PETIT_SM90A_DEVICE
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::named_barrier_sync(id, threads);
#endif
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from shared memory at `src` to
// global memory at `dst`, asynchronously, in this thread's current bulk async-group.
PETIT_DEVICE void sm90_bulk_store(void* dst, uint32_t src, int bytes) {
#if PETIT_SM90A_DEVICE
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::bulk_store(dst, src, bytes);
#endif
}

PETIT_DEVICE void sm90_bulk_commit() {
#if PETIT_SM90A_DEVICE
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#elif PETIT_EMU_PTX
  emu_ptx::bulk_commit();
#endif
}

// Until at most kPending of this thread's bulk async-groups have not yet read their source.
template <int kPending>
PETIT_DEVICE void sm90_bulk_wait_read() {
#if PETIT_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::bulk_wait(kPending);
#endif
}

// Until all of this thread's bulk async-groups have completed (their writes done).
PETIT_DEVICE void sm90_bulk_wait_all() {
#if PETIT_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#elif PETIT_EMU_PTX
  emu_ptx::bulk_wait(0);
#endif
}

constexpr int kStagedBarrierId = 1;  // 0 is __syncthreads'

// GEMM2 (plain wgmma tile of Cfg) with a staging buffer of kBytes in shared memory.
template <class Cfg>
struct StagedWeightedEntryEpilogue {
  static_assert(Cfg::kNumBGroups == 1, "plain tile");
  static_assert(Cfg::kThreads >= Cfg::kBlockM, "one consumer thread per tile row copies it");
  static_assert(Cfg::kVecN == 2, "bf16 pairs");
  static constexpr bool kStaged = true;
  static constexpr int kRowBytes = Cfg::kBlockN * 2 + 16;  // padded: conflict-free stores
  static constexpr int kBytes = Cfg::kBlockM * kRowBytes;

  petit_bf16_bits* partial;       // [N*K, out_cols]
  const int32_t* sorted_entries;  // [N*K]
  const float* entry_weights;     // [N*K]
  int out_cols;                   // H

  // What a consumer thread needs of its tile's rows, loaded before the main loop: the entry of
  // tile row threadIdx.x (the row it copies out; -1: none), the routing weights of its
  // accumulator rows (Cfg::row_of(threadIdx.x, i)).
  struct Rows {
    int entry;
    float weight[Cfg::kThreadM];
  };

  PETIT_DEVICE Rows prefetch(int row_begin, int num_rows) const {
    Rows rows;
    const int t = int(threadIdx.x);
    rows.entry = t < num_rows ? sorted_entries[row_begin + t] : -1;
#pragma unroll
    for (int i = 0; i < Cfg::kThreadM; ++i) {
      const int r = Cfg::row_of(t, i);
      rows.weight[i] = r < num_rows ? entry_weights[sorted_entries[row_begin + r]] : 0.0f;
    }
    return rows;
  }

  // acc: the tile's accumulators (epilogue view); staging: its buffer in shared memory
  // (16-byte aligned). Every consumer thread calls it once per tile.
  template <class Acc>
  PETIT_DEVICE void apply(const Acc& acc, const Rows& rows, int num_rows, int col_begin,
                          unsigned char* staging) const {
    const int t = int(threadIdx.x);
    // The previous tile's copies (issued by this thread) have read the buffer; then everyone's.
    sm90_bulk_wait_read<0>();
    sm90_named_barrier_sync(kStagedBarrierId, Cfg::kThreads);
#pragma unroll
    for (int i = 0; i < Cfg::kThreadM; ++i) {
      unsigned char* row = staging + Cfg::row_of(t, i) * kRowBytes;
#pragma unroll
      for (int j = 0; j < Cfg::kThreadN; j += 2) {
        const uint32_t packed =
            uint32_t(petit_float_to_bf16(rows.weight[i] * acc[i][j])) |
            (uint32_t(petit_float_to_bf16(rows.weight[i] * acc[i][j + 1])) << 16);
        *reinterpret_cast<uint32_t*>(row + Cfg::col_of(t, j) * 2) = packed;
      }
    }
    // This thread's generic-proxy writes before the bulk copies' (async proxy) reads, then all
    // consumers' writes before any copy.
    sm90_fence_proxy_async_smem();
    sm90_named_barrier_sync(kStagedBarrierId, Cfg::kThreads);
    if (t < num_rows) {
      const int cols = out_cols - col_begin < Cfg::kBlockN ? out_cols - col_begin : Cfg::kBlockN;
      sm90_bulk_store(partial + int64_t(rows.entry) * out_cols + col_begin,
                      smem_addr_u32(staging + t * kRowBytes), cols * 2);
      sm90_bulk_commit();
    }
  }

  // After the thread's last tile: its copies done before the block exits.
  PETIT_DEVICE static void finish() { sm90_bulk_wait_all(); }
};

}  // namespace gemm
}  // namespace petit
