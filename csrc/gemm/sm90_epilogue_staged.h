// Staged epilogues of the warp-specialized expert GEMMs (sm90_mainloop_wgmma_ws.h; experts.cu
// picks them with PETIT_MOE_STAGED_EPILOGUE: 1, the default, for the down GEMMs of wgmma_ws /
// wgmma_ws_mc, 2 for their gate/up GEMMs as well, 0 for neither). Same output, bit for bit, as
// the plain epilogues of epilogues.h (SiluMulEpilogue, WeightedEntryEpilogue), but
//   - what the tile's rows need besides the accumulators (down: the routing weights of the
//     thread's rows and the destination entry of each tile row) is loaded before the tile's
//     main loop (prefetch), not after it;
//   - the consumers write the bf16 tile into a shared-memory staging buffer (rows padded by 16
//     bytes: the 8 rows a warp's store covers fall in distinct banks) instead of 4-byte global
//     stores scattered over 8 rows per warp instruction;
//   - consumer thread r < rows then copies tile row r to its destination row (down: its
//     entry's row of `partial`; gate/up: its sorted position's row of `act`) with one bulk copy
//     (cp.async.bulk.global.shared::cta, up to 512 bytes), which runs on while the consumers
//     go on with the next tile's MMAs; the next epilogue waits only until those copies have
//     read the staging buffer (cp.async.bulk.wait_group.read).
// The point is to shorten the part of each tile in which no MMA runs (Nsight Compute: the
// tensor pipe idles 38% of the down kernel's cycles with the plain epilogue).
//
// Consumer threads only (threadIdx.x < Cfg::kThreads): they synchronize among themselves with
// named barrier kStagedBarrierId, the producer warpgroup never reaches it. CUDA only; the asm
// is emitted only in sm_90a device passes; under the CPU emulation (PETIT_EMU_PTX) the bulk
// copies and the named barrier are tests/emu/emu_ptx.h's.
#pragma once

#include "../platform.h"
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

// Shared memory of a staging buffer for one Cfg tile (kBlockM rows of kBlockN bf16 columns).
template <class Cfg>
constexpr int kStagedEpilogueBytes = Cfg::kBlockM * (Cfg::kBlockN * 2 + 16);

// Output of a staged epilogue (the Out of StagedEpilogue): Rows, what a consumer thread needs
// of its tile's rows; prefetch(row_begin, num_rows), loaded before the main loop; value(acc,
// rows, i, j), the output of accumulator row i, column j (epilogue view); row(rows), the
// destination row of tile row threadIdx.x (rows.dest >= 0).

// GEMM1 (gated tile): act[row_begin + r][n] = bf16(silu(gate) * up), as SiluMulEpilogue.
template <class Cfg>
struct StagedSiluMulOutput {
  static_assert(Cfg::kNumBGroups == 2, "SiLU·mul needs the gate and the up accumulators");
  petit_bf16_bits* act;  // [positions, out_cols]
  int out_cols;          // I

  struct Rows {
    int dest;  // the sorted position of tile row threadIdx.x; -1: none
  };
  PETIT_DEVICE Rows prefetch(int row_begin, int num_rows) const {
    const int t = int(threadIdx.x);
    return Rows{t < num_rows ? row_begin + t : -1};
  }
  template <class Acc>
  PETIT_DEVICE float value(const Acc& acc, const Rows&, int i, int j) const {
    return silu(acc[i][j]) * acc[i][Cfg::kThreadN + j];
  }
  PETIT_DEVICE petit_bf16_bits* row(const Rows& rows) const {
    return act + int64_t(rows.dest) * out_cols;
  }
};

// GEMM2 (plain tile): partial[entry][n] = bf16(weight[entry] * acc), entry =
// sorted_entries[row_begin + r], as WeightedEntryEpilogue.
template <class Cfg>
struct StagedWeightedEntryOutput {
  static_assert(Cfg::kNumBGroups == 1, "plain tile");
  petit_bf16_bits* partial;       // [N*K, out_cols]
  const int32_t* sorted_entries;  // [N*K]
  const float* entry_weights;     // [N*K]
  int out_cols;                   // H

  struct Rows {
    int dest;                      // the entry of tile row threadIdx.x; -1: none
    float weight[Cfg::kThreadM];   // the routing weights of accumulator rows row_of(t, i)
  };
  PETIT_DEVICE Rows prefetch(int row_begin, int num_rows) const {
    Rows rows;
    const int t = int(threadIdx.x);
    rows.dest = t < num_rows ? sorted_entries[row_begin + t] : -1;
#pragma unroll
    for (int i = 0; i < Cfg::kThreadM; ++i) {
      const int r = Cfg::row_of(t, i);
      rows.weight[i] = r < num_rows ? entry_weights[sorted_entries[row_begin + r]] : 0.0f;
    }
    return rows;
  }
  template <class Acc>
  PETIT_DEVICE float value(const Acc& acc, const Rows& rows, int i, int j) const {
    return rows.weight[i] * acc[i][j];
  }
  PETIT_DEVICE petit_bf16_bits* row(const Rows& rows) const {
    return partial + int64_t(rows.dest) * out_cols;
  }
};

// The epilogue itself, over a staging buffer of kBytes in shared memory.
template <class Cfg, class Out>
struct StagedEpilogue {
  static_assert(Cfg::kThreads >= Cfg::kBlockM, "one consumer thread per tile row copies it");
  static_assert(Cfg::kVecN == 2, "bf16 pairs");
  static constexpr int kRowBytes = Cfg::kBlockN * 2 + 16;  // padded: conflict-free stores
  static constexpr int kBytes = kStagedEpilogueBytes<Cfg>;
  using Rows = typename Out::Rows;

  Out out;

  PETIT_DEVICE Rows prefetch(int row_begin, int num_rows) const {
    return out.prefetch(row_begin, num_rows);
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
        const uint32_t packed = uint32_t(petit_float_to_bf16(out.value(acc, rows, i, j))) |
                                (uint32_t(petit_float_to_bf16(out.value(acc, rows, i, j + 1)))
                                 << 16);
        *reinterpret_cast<uint32_t*>(row + Cfg::col_of(t, j) * 2) = packed;
      }
    }
    // This thread's generic-proxy writes before the bulk copies' (async proxy) reads, then all
    // consumers' writes before any copy.
    sm90_fence_proxy_async_smem();
    sm90_named_barrier_sync(kStagedBarrierId, Cfg::kThreads);
    if (t < num_rows) {
      const int cols =
          out.out_cols - col_begin < Cfg::kBlockN ? out.out_cols - col_begin : Cfg::kBlockN;
      sm90_bulk_store(out.row(rows) + col_begin, smem_addr_u32(staging + t * kRowBytes),
                      cols * 2);
      sm90_bulk_commit();
    }
  }

  // After the thread's last tile: its copies done before the block exits.
  PETIT_DEVICE static void finish() { sm90_bulk_wait_all(); }
};

template <class Cfg>
using StagedSiluMulEpilogue = StagedEpilogue<Cfg, StagedSiluMulOutput<Cfg>>;
template <class Cfg>
using StagedWeightedEntryEpilogue = StagedEpilogue<Cfg, StagedWeightedEntryOutput<Cfg>>;

}  // namespace gemm
}  // namespace petit
