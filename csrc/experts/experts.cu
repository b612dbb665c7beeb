// Expert grouped GEMMs at the destination rank: gate/up GEMM with SiLU·mul fused into its
// epilogue, down GEMM with the routing weight fused into its epilogue, and the deterministic
// local weighted reduction. Two families:
//   - Hopper (sm_90a): warp-specialized wgmma kernels (a producer warpgroup loads the gathered
//     rows by cp.async and the weights by TMA, consumer warpgroups multiply) in four regimes:
//     narrow and m64 (64-row tiles, both GEMMs of a call in one persistent launch, the choice
//     between the two made on the device), full (128 x 256 tiles) and multicast (full tiles
//     in clusters of 2 CTAs sharing weight boxes);
//   - the portable SIMT fallback (CUDA without an sm_90a image, HIP), 16- or 128-row tiles.
// choose_expert_tiles is the one place a call's family and regime are chosen. The pieces
// (tile loaders, main loops, epilogues, scheduler) live in csrc/gemm/. Launch contract and
// formulas: api.h, "experts.cu"; design: docs/architecture.md.
//
// Why a separate reduction instead of accumulating in the down GEMM's epilogue: a token's
// (up to K) local entries belong to different experts, i.e. to tiles that run in no fixed
// order, so an in-epilogue fp32 accumulation (atomics) would round differently from run to
// run. Writing each entry's weighted row, rounded to bf16 (as vLLM's own experts do before
// their sum), to its own workspace row (indexed by the entry, so no inverse permutation is
// needed) and summing them in fp32 in slot order k = 0..K-1 afterwards gives bit-identical
// results on every run, at the cost of the workspace (N*K*H*2 bytes, see
// expert_partial_workspace_elems) and one extra pass over it.
#include <type_traits>

#include "api.h"
#include "common/expert_ids.h"
#include "gemm/epilogues.h"
#include "gemm/mainloop_simt.h"
#include "gemm/scheduler.h"
#include "common/launch.h"
#if PETIT_SM80_PATH
#include "gemm/sm90_epilogue_staged.h"
#include "gemm/sm90_mainloop_wgmma_ws.h"
#endif

namespace petit {

namespace {

using gemm::SimtTileConfig;

// <kBlockM, kBlockN, kBlockK, kThreadM, kThreadN, kNumBGroups, kMinBlocksPerSm>, 256 threads.
// Small: few rows per expert (decode), the cost is streaming the weights, so tiles are short
// in M and wide in N with a deep (32) k-stage, and more blocks per SM keep more weight bytes
// in flight. Large: 128-row tiles with 8x(4 or 8) register tiles per thread (prefill).
// ExpertConfig::simt_large_min_rows picks between them.
using GateUpSmall = SimtTileConfig<16, 64, 32, 2, 2, 2, 4>;    // B tile: 64 gate + 64 up rows
using GateUpLarge = SimtTileConfig<128, 64, 16, 8, 4, 2, 2>;   // B tile: 64 gate + 64 up rows
using DownSmall = SimtTileConfig<16, 128, 32, 2, 4, 1, 4>;
using DownLarge = SimtTileConfig<128, 128, 16, 8, 8, 1, 2>;

// The local reduction (expert_reduce_kernel<kBatch>): 256-thread blocks, one thread per 8
// columns of a row. A call whose chunks fit one wave of the batched kernel (kReduceBatch slots'
// loads in flight per thread: 40 registers under ptxas of nvcc 13.0 for sm_90a, so 6 blocks per
// SM) runs it, since there a thread's memory round trips are the time; larger calls are bound
// by HBM and run the kernel of one load at a time (31 registers: 8 blocks per SM) over a grid of
// as many blocks as fit at once (measured: docs/experiments/local-reduction.md).
constexpr int kReduceThreads = 256;
constexpr int kReduceBatch = 4;
constexpr int kReduceBlocksPerSmBatched = 6;
constexpr int kReduceBlocksPerSm = 8;

// ------------------------------------------------------------------ operand rows
// The rows every tile family reads (nullptr: a row past the tile or the output width, which the
// loaders treat as zeros and the epilogues skip).

// GEMM1 A: tile row r, gathered through the row list (entry -> received row entry / K).
PETIT_DEVICE const petit_bf16_bits* gate_up_a_row(const ExpertGemmArgs& a,
                                                  const gemm::TileCoord& tile, int r) {
  if (r >= tile.num_rows) return nullptr;
  return a.x + int64_t(a.sorted_entries[tile.row_begin + r] / a.top_k) * a.hidden;
}

// GEMM1 B: w13 of the tile's expert; row n of the gate (group 0) or up (group 1) half.
PETIT_DEVICE const petit_bf16_bits* w13_of(const ExpertGemmArgs& a, const gemm::TileCoord& tile) {
  return a.w13 + int64_t(tile.expert) * 2 * a.intermediate * a.hidden;
}
PETIT_DEVICE const petit_bf16_bits* w13_row(const ExpertGemmArgs& a, const petit_bf16_bits* w13_e,
                                            int group, int n) {
  if (n >= a.intermediate) return nullptr;
  return w13_e + int64_t(group * a.intermediate + n) * a.hidden;
}

// GEMM2 A: tile row r of the activation, already in sorted order (no gather).
PETIT_DEVICE const petit_bf16_bits* down_a_row(const ExpertGemmArgs& a,
                                               const gemm::TileCoord& tile, int r) {
  if (r >= tile.num_rows) return nullptr;
  return a.act + int64_t(tile.row_begin + r) * a.intermediate;
}

// GEMM2 B: w2 of the tile's expert; row n (output column n).
PETIT_DEVICE const petit_bf16_bits* w2_of(const ExpertGemmArgs& a, const gemm::TileCoord& tile) {
  return a.w2 + int64_t(tile.expert) * a.hidden * a.intermediate;
}
PETIT_DEVICE const petit_bf16_bits* w2_row(const ExpertGemmArgs& a, const petit_bf16_bits* w2_e,
                                           int n) {
  return n < a.hidden ? w2_e + int64_t(n) * a.intermediate : nullptr;
}

// The local weighted reduction of `row` at columns [col, col + 8): its local slots' bf16
// partials summed in fp32 in slot order, rounded to bf16 once.
//   kBatch == 1: slot by slot, its id, then its partial vector (HBM-bound calls: fastest there);
//   kBatch > 1: the slots' validity first (id loads that do not wait for each other), then the
//     valid slots' partial vectors kBatch at a time, so a thread waits for a few memory round
//     trips rather than for two per slot (a decode call's reduction is that latency).
template <int kBatch>
PETIT_DEVICE uint4 local_slot_sum8(const ExpertGemmArgs& a, int row, int col) {
  float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if constexpr (kBatch == 1) {
    for (int k = 0; k < a.top_k; ++k) {
      const int entry = row * a.top_k + k;
      // the validity rule of the row lists (expert_ids.h)
      if (local_expert_id(a.topk_ids, a.expert_map, a.num_global_experts, a.num_local_experts,
                          entry) < 0)
        continue;
      const uint4 bits =
          *reinterpret_cast<const uint4*>(a.partial + int64_t(entry) * a.hidden + col);
      const petit_bf16_bits* h = reinterpret_cast<const petit_bf16_bits*>(&bits);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[e] += petit_bf16_to_float(h[e]);
    }
  } else {
    const int64_t first_entry = int64_t(row) * a.top_k;
    uint32_t valid = 0;  // bit k: slot k is served here
#pragma unroll 4
    for (int k = 0; k < a.top_k; ++k)
      if (local_expert_id(a.topk_ids, a.expert_map, a.num_global_experts, a.num_local_experts,
                          first_entry + k) >= 0)
        valid |= 1u << k;
    while (valid != 0) {
      uint4 bits[kBatch] = {};
      int loaded = 0;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (valid != 0) {
          const int k = __ffs(int(valid)) - 1;  // the lowest slot left: slot order
          valid &= valid - 1;
          bits[j] =
              *reinterpret_cast<const uint4*>(a.partial + (first_entry + k) * a.hidden + col);
          loaded = j + 1;
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j < loaded) {
          const petit_bf16_bits* h = reinterpret_cast<const petit_bf16_bits*>(&bits[j]);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum[e] += petit_bf16_to_float(h[e]);
        }
      }
    }
  }
  uint4 packed;
  packed.x = uint32_t(petit_float_to_bf16(sum[0])) | (uint32_t(petit_float_to_bf16(sum[1])) << 16);
  packed.y = uint32_t(petit_float_to_bf16(sum[2])) | (uint32_t(petit_float_to_bf16(sum[3])) << 16);
  packed.z = uint32_t(petit_float_to_bf16(sum[4])) | (uint32_t(petit_float_to_bf16(sum[5])) << 16);
  packed.w = uint32_t(petit_float_to_bf16(sum[6])) | (uint32_t(petit_float_to_bf16(sum[7])) << 16);
  return packed;
}

// ------------------------------------------------------------------ gate/up (GEMM1)

template <class Cfg>
PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    expert_gate_up_kernel(ExpertGemmArgs a) {
  petit_grid_dependency_sync();  // launched programmatically (launch_kernel)
  using Mainloop = gemm::SimtMainloop<Cfg>;
  using Scheduler = gemm::ExpertTileScheduler<Cfg::kThreads>;
  __shared__ typename Mainloop::SharedStorage mainloop_smem;
  __shared__ typename Scheduler::SharedStorage scheduler_smem;

  const gemm::SiluMulEpilogue<Cfg> epilogue{a.act, a.intermediate};
  Scheduler::for_each_tile(a.expert_offsets, a.num_local_experts, Cfg::kBlockM, Cfg::kBlockN,
                           a.intermediate, scheduler_smem,
                           [&](const gemm::TileCoord& tile, int n_begin) {
    // A: the tile's rows gathered through the row list (entry -> received row entry / K).
    typename Mainloop::LoaderA a_loader;
    a_loader.init([&](int r) { return gate_up_a_row(a, tile, r); });
    // B: gate rows [n_begin, n_begin + kBlockN) of w13[e], then the same up rows (+ I).
    const petit_bf16_bits* w13_e = w13_of(a, tile);
    typename Mainloop::LoaderB b_loader;
    b_loader.init([&](int r) {
      return w13_row(a, w13_e, r / Cfg::kBlockN, n_begin + r % Cfg::kBlockN);
    });
    Mainloop mainloop;
    mainloop.run(a_loader, b_loader, a.hidden, mainloop_smem);
    epilogue.apply(mainloop.acc, mainloop.ty, mainloop.tx, tile.row_begin, tile.num_rows,
                   n_begin);
  });
}

// ------------------------------------------------------------------ down (GEMM2)

template <class Cfg>
PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    expert_down_kernel(ExpertGemmArgs a) {
  petit_grid_dependency_sync();  // launched programmatically (launch_kernel)
  using Mainloop = gemm::SimtMainloop<Cfg>;
  using Scheduler = gemm::ExpertTileScheduler<Cfg::kThreads>;
  __shared__ typename Mainloop::SharedStorage mainloop_smem;
  __shared__ typename Scheduler::SharedStorage scheduler_smem;

  const gemm::WeightedEntryEpilogue<Cfg> epilogue{a.partial, a.sorted_entries, a.topk_weights,
                                                  a.hidden};
  Scheduler::for_each_tile(a.expert_offsets, a.num_local_experts, Cfg::kBlockM, Cfg::kBlockN,
                           a.hidden, scheduler_smem,
                           [&](const gemm::TileCoord& tile, int n_begin) {
    // A: the activation rows, already in sorted order (no gather).
    typename Mainloop::LoaderA a_loader;
    a_loader.init([&](int r) { return down_a_row(a, tile, r); });
    const petit_bf16_bits* w2_e = w2_of(a, tile);
    typename Mainloop::LoaderB b_loader;
    b_loader.init([&](int r) { return w2_row(a, w2_e, n_begin + r); });
    Mainloop mainloop;
    mainloop.run(a_loader, b_loader, a.intermediate, mainloop_smem);
    epilogue.apply(mainloop.acc, mainloop.ty, mainloop.tx, tile.row_begin, tile.num_rows,
                   n_begin);
  });
}

// ------------------------------------------------------------------ Hopper: warp-specialized wgmma
// The four regimes' main loops (gemm/sm90_mainloop_wgmma_ws.h): a producer warpgroup loads
// (the gathered A rows by cp.async, the weight rows as TMA boxes), the ring is handed over
// through mbarriers, and the loads run on into the next tile during the epilogue. CUDA only; a
// kernel has a body only in the sm_90a device passes (Mainloop::kCompiled), and the launchers
// check that the current device runs that image (wgmma_path_supported below).
#if PETIT_SM80_PATH

// The ws main loops keep the tile scheduler's storage in their shared memory (kUserBytes).
// (kSchedulerBytes: that storage, rounded to 16 bytes.)
template <class Cfg>
constexpr int kSchedulerBytes =
    (int(sizeof(typename gemm::ExpertTileScheduler<Cfg::kThreads + 128>::SharedStorage)) + 15) /
    16 * 16;
// (+ kWsExtraBytes after it: the fused GEMMs' stage tags and claimed units, see
// fused_ws_gemms.)
constexpr int kWsExtraBytes = 64;
template <class Cfg, int kClusterM = 1>
using WsMainloop = gemm::Sm90WgmmaWsMainloop<Cfg, kClusterM, kSchedulerBytes<Cfg> + kWsExtraBytes>;
// <kBlockM, kBlockN, kNumBGroups, kStages, kWgN> (Sm90WgmmaTileConfig), one block per SM:
// wgmma: 128 x 256 x 64 tiles (B tile: 128 gate + 128 up rows for gate/up, 256 w2 rows for
//   down), 2 consumer warpgroups of 64 x 256 (one above the other), 4-stage ring; the down
//   GEMM with the staged epilogue (gemm/sm90_epilogue_staged.h) and a 3-stage ring (144 KiB)
//   to make room for its 66 KiB staging buffer after the scheduler's storage.
using GateUpWgmma = WsMainloop<gemm::Sm90WgmmaTileConfig<128, 128, 2, 4, 1>>;
template <class Cfg, int kClusterM = 1>
using WsStagedMainloop = gemm::Sm90WgmmaWsMainloop<
    Cfg, kClusterM, kSchedulerBytes<Cfg> + gemm::StagedWeightedEntryEpilogue<Cfg>::kBytes>;
using DownWgmma = WsStagedMainloop<gemm::Sm90WgmmaTileConfig<128, 256, 1, 3, 1>>;
// wgmma_mc: the wgmma tiles in clusters of 2 CTAs: two m-tiles of one (expert, n-tile) with
//   each weight box loaded once for both (TMA multicast: half the L2 reads of the weights,
//   and the two readers of each weight slice advance together), or, for an expert's odd last
//   m-tile, two of its n-tiles with their own weights (see gemm/scheduler.h,
//   gemm/sm90_mainloop_wgmma_ws.h).
constexpr int kWsClusterM = 2;
using GateUpWgmmaMc = WsMainloop<gemm::Sm90WgmmaTileConfig<128, 128, 2, 4, 1>, kWsClusterM>;
using DownWgmmaMc = WsStagedMainloop<gemm::Sm90WgmmaTileConfig<128, 256, 1, 3, 1>, kWsClusterM>;
// wgmma_m64: 64 x 256 x 64 tiles, 2 consumer warpgroups of 64 x 128 side by side (half the
//   tensor-core work per weight byte of wgmma, for few rows per expert), 5-stage ring.
using GateUpWgmmaM64 = WsMainloop<gemm::Sm90WgmmaTileConfig<64, 128, 2, 5, 2>>;
using DownWgmmaM64 = WsMainloop<gemm::Sm90WgmmaTileConfig<64, 256, 1, 5, 2>>;
// wgmma_narrow: 64 x 128 x 64 tiles (gate/up 64 gate + 64 up rows, down 128 w2 rows; 2
//   consumer warpgroups of 64 x 64 side by side) with an 8-stage ring (8 x 24 KiB keeps as
//   many weight bytes in flight per SM as wgmma_m64's 5 x 48 KiB): 4x the tiles per expert of
//   wgmma_m64, for decode steps whose few experts would otherwise fill the SMs unevenly
//   (e.g. 9 experts x 16 gate/up tiles = 144 on 132 SMs: 2 rounds of 3.7 MB slices).
using GateUpWgmmaNarrow = WsMainloop<gemm::Sm90WgmmaTileConfig<64, 64, 2, 8, 2>>;
using DownWgmmaNarrow = WsMainloop<gemm::Sm90WgmmaTileConfig<64, 128, 1, 8, 2>>;

// Device-scope fence (the fused GEMMs' counters; the CPU emulation: a host fence).
PETIT_DEVICE void device_fence() {
#if PETIT_EMU_PTX
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#else
  __threadfence();
#endif
}

// The wgmma and wgmma_mc kernels, one per GEMM (Mainloop = Sm90WgmmaWsMainloop): the weight
// rows come through `b_map`, the tensor map of w13 (dims {H, I, 2, L}) or w2 ({I, H, 1, L})
// that launch_ws_gemm encodes. The scheduler and the ring are set up by the whole block; then
// the producer warpgroup walks the block's tiles issuing copies and the consumer warpgroups
// walk the same tiles multiplying and storing. With clusters (Mainloop::kClusterM > 1) the
// CTAs of a cluster walk the same units, each its own tile of them: the m-tiles of one
// (expert, n-tile) sharing their weight rows, or the n-tiles of an expert's left-over m-tile
// (scheduler.h).
// kStaged: Epilogue is gemm::StagedWeightedEntryEpilogue, its staging buffer after the
// scheduler's storage in the main loop's user shared memory.
// a_init(loader, tile): sets up the producer's A loader (Mainloop::LoaderA) for a tile.
template <class Mainloop, bool kStaged = false, class Epilogue, class AInit>
PETIT_DEVICE void expert_ws_gemm(const ExpertGemmArgs& a, const CUtensorMap* b_map,
                                 const Epilogue& epilogue, int k_dim, int out_cols, AInit a_init) {
  using Cfg = typename Mainloop::Cfg;
  using Scheduler = gemm::ExpertTileScheduler<Mainloop::kThreads, Mainloop::kClusterM>;
  static_assert(Mainloop::kUserBytes >= int(sizeof(typename Scheduler::SharedStorage)),
                "the scheduler's storage is the main loop's user shared memory");
  constexpr int kClusterM = Mainloop::kClusterM;
  PETIT_DYNAMIC_SMEM(tc_dynamic_smem);  // Mainloop::kSmemBytes
  auto& scheduler_smem = *reinterpret_cast<typename Scheduler::SharedStorage*>(
      Mainloop::user_smem(tc_dynamic_smem));
  Scheduler scheduler;
  scheduler.init(a.expert_offsets, a.num_local_experts, Cfg::kBlockM,
                 (out_cols + Cfg::kBlockN - 1) / Cfg::kBlockN, scheduler_smem);
  Mainloop mainloop;
  mainloop.init(tc_dynamic_smem);
  const int num_tiles = scheduler.num_tiles();
  const int rank = kClusterM > 1 ? gemm::sm90_cluster_rank() : 0;
  // 1-D clusters: cluster c is blocks [c * kClusterM, (c + 1) * kClusterM)
  const int first = int(blockIdx.x) / kClusterM, step = int(gridDim.x) / kClusterM;
  if (Mainloop::is_producer()) {
    gemm::sm90_setmaxnreg_dec<Mainloop::kProducerRegs>();
    if (Mainloop::is_tma_issuer()) gemm::sm90_prefetch_tensor_map(b_map);
    for (int u = first; u < num_tiles; u += step) {
      const gemm::TileCoord tile = scheduler.tile(u, rank);
      typename Mainloop::LoaderA a_loader;
      a_init(a_loader, tile);
      typename Mainloop::LoaderB b_loader;
      b_loader.init(b_map, tile.expert, tile.n_tile * Cfg::kBlockN);
      mainloop.produce(a_loader, b_loader, k_dim, rank, tile.multicast);
    }
    gemm::cp_async_wait_all();  // no copy outlives its thread
  } else {
    gemm::sm90_setmaxnreg_inc<Mainloop::kConsumerRegs>();
    for (int u = first; u < num_tiles; u += step) {
      const gemm::TileCoord tile = scheduler.tile(u, rank);
      if constexpr (kStaged) {
        static_assert(Mainloop::kUserBytes >= kSchedulerBytes<Cfg> + Epilogue::kBytes,
                      "the staging buffer is the main loop's user shared memory");
        const typename Epilogue::Rows rows = epilogue.prefetch(tile.row_begin, tile.num_rows);
        mainloop.consume(k_dim);
        epilogue.apply(mainloop.acc, rows, tile.num_rows, tile.n_tile * Cfg::kBlockN,
                       Mainloop::user_smem(tc_dynamic_smem) + kSchedulerBytes<Cfg>);
      } else {
        mainloop.consume(k_dim);
        epilogue.apply(mainloop.acc, int(threadIdx.x), int(threadIdx.x), tile.row_begin,
                       tile.num_rows, tile.n_tile * Cfg::kBlockN);
      }
    }
    if constexpr (kStaged) Epilogue::finish();
  }
  mainloop.finish();
}

template <class Mainloop>
PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(Mainloop::kThreads, 1)
    expert_gate_up_ws_kernel(ExpertGemmArgs a, const __grid_constant__ CUtensorMap w13_map) {
  petit_grid_dependency_sync();  // launched programmatically (launch_kernel)
  if constexpr (Mainloop::kCompiled) {
    using Cfg = typename Mainloop::Cfg;
    expert_ws_gemm<Mainloop>(
        a, &w13_map, gemm::SiluMulEpilogue<Cfg>{a.act, a.intermediate}, a.hidden, a.intermediate,
        [&](typename Mainloop::LoaderA& loader, const gemm::TileCoord& tile) {
          loader.init([&](int r) { return gate_up_a_row(a, tile, r); }, a.x);
        });
  }
}

// The down GEMM with the staged epilogue (gemm/sm90_epilogue_staged.h; Mainloop a
// WsStagedMainloop).
template <class Mainloop>
PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(Mainloop::kThreads, 1)
    expert_down_ws_kernel(ExpertGemmArgs a, const __grid_constant__ CUtensorMap w2_map) {
  petit_grid_dependency_sync();  // launched programmatically (launch_kernel)
  if constexpr (Mainloop::kCompiled) {
    using Cfg = typename Mainloop::Cfg;
    expert_ws_gemm<Mainloop, true>(
        a, &w2_map,
        gemm::StagedWeightedEntryEpilogue<Cfg>{a.partial, a.sorted_entries, a.topk_weights,
                                               a.hidden},
        a.intermediate, a.hidden,
        [&](typename Mainloop::LoaderA& loader, const gemm::TileCoord& tile) {
          loader.init([&](int r) { return down_a_row(a, tile, r); }, a.act);
        });
  }
}

// ---- fused GEMMs of the 64-row regimes (expert_fused_gemms, api.h): both GEMMs of a call in
// one persistent launch.
// The units of the launch are the gate/up tiles [0, U1) and then the down tiles [U1, U1 + U2),
// both in the scheduler's order (expert-major). Each block's producer claims the next unit
// from a counter (a.gate_up_done[L]) when it is ready to load it and tags the unit's first
// ring stage with it (produce's stage_tags); the consumers read the tag of the next stage to
// learn which tile they multiply, and a final stage tagged -1 ends them. One ring for both
// GEMMs: the down main loop continues the gate/up one (continue_from). Each consumer warp of
// a gate/up tile, once its act stores are done, fences and counts one arrival for the tile's
// expert in gate_up_done[expert]; a down tile's producer threads wait (acquire) until their
// expert has all its arrivals (m-tiles x gate/up n-tiles x consumer warps) before copying act
// rows. Units are claimed in order, so every gate/up unit a down unit waits for was claimed
// before it by a running block, which has loaded all its stages already and whose consumers
// finish it without waiting on anything: no deadlock, whatever the grid or the residency
// (blocks that start late just claim later units), and the units spread over the blocks by
// how fast each one drains its ring, not by a fixed stride.
constexpr int kFusedClaimBarrierId = 3;  // producer named barrier (consumers' ids: 1, 2)

PETIT_DEVICE int32_t fused_load_acquire(const int32_t* p) {
#if PETIT_EMU_PTX
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#elif PETIT_SM90A_DEVICE
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return *p;
#endif
}

// Consumer warp, after its epilogue stores of a gate/up tile of `expert`.
PETIT_DEVICE void fused_gate_up_arrive(int32_t* done, int expert) {
  petit_syncwarp();
  if (petit_lane_id() == 0) {
    device_fence();  // the warp's act stores before the arrival
    atomicAdd(done + expert, 1);
  }
}

// Producer thread, before the act rows of a down tile of `expert` (bounded like the ring's
// waits: traps after kMbarrierTimeoutNs). The CPU emulation runs blocks one after another and
// threads concurrently, so there it only ever waits for this block's own consumers.
PETIT_DEVICE void fused_wait_gate_up(const int32_t* done, int expert, int32_t arrivals) {
  gemm::sm90_wait_bounded([&] { return fused_load_acquire(done + expert) == arrivals; },
                          "fused expert GEMMs: a down tile's gate/up arrivals never came");
}

// The fused kernels' m-tile prefix of the call's experts (tiles of kBlockM rows), built by
// every thread of the block into `smem` (the tile scheduler's init, with a barrier).
template <int kThreads>
using FusedScheduler = gemm::ExpertTileScheduler<kThreads>;
template <int kThreads>
PETIT_DEVICE FusedScheduler<kThreads> fused_m_tiles(
    const ExpertGemmArgs& a, int block_m, typename FusedScheduler<kThreads>::SharedStorage& smem) {
  FusedScheduler<kThreads> tiles;
  tiles.init(a.expert_offsets, a.num_local_experts, block_m, 1, smem);
  return tiles;
}

// The fused kernel's body for one tile family (the maps: the kernel's __grid_constant__
// parameters, whose addresses TMA takes; m_tiles: fused_m_tiles of the family's kBlockM).
template <class GateUp, class Down>
PETIT_DEVICE void fused_ws_gemms(const ExpertGemmArgs& a, const CUtensorMap* w13_map,
                                 const CUtensorMap* w2_map,
                                 const FusedScheduler<GateUp::kThreads>& m_tiles) {
  if constexpr (GateUp::kCompiled) {
    using CfgG = typename GateUp::Cfg;
    using CfgD = typename Down::Cfg;
    static_assert(CfgG::kBlockM == CfgD::kBlockM && GateUp::kThreads == Down::kThreads &&
                      GateUp::kClusterM == 1 && Down::kClusterM == 1 &&
                      GateUp::kProducerRegs == Down::kProducerRegs &&
                      GateUp::kConsumerRegs == Down::kConsumerRegs &&
                      GateUp::kSmemBytes == Down::kSmemBytes,
                  "one block shape for both GEMMs");
    static_assert(GateUp::kUserBytes >= kSchedulerBytes<CfgG> + (CfgG::kStages + 2) * 4,
                  "the scheduler's storage, the stage tags and the claims are the main loop's "
                  "user shared memory");
    PETIT_DYNAMIC_SMEM(tc_dynamic_smem);  // GateUp::kSmemBytes
    unsigned char* user = GateUp::user_smem(tc_dynamic_smem);
    volatile int* stage_tags = reinterpret_cast<volatile int*>(user + kSchedulerBytes<CfgG>);
    volatile int* claims = stage_tags + CfgG::kStages;  // [2]: the producer's broadcast
    // one m-tile prefix (same kBlockM) for both, with each GEMM's n-tiles
    FusedScheduler<GateUp::kThreads> gate_up_tiles = m_tiles;
    gate_up_tiles.num_n_tiles = (a.intermediate + CfgG::kBlockN - 1) / CfgG::kBlockN;
    FusedScheduler<GateUp::kThreads> down_tiles = m_tiles;
    down_tiles.num_n_tiles = (a.hidden + CfgD::kBlockN - 1) / CfgD::kBlockN;
    const int num_gate_up = gate_up_tiles.num_tiles();
    const int num_units = num_gate_up + down_tiles.num_tiles();
    int32_t* const next_unit = a.gate_up_done + a.num_local_experts;
    GateUp gate_up;
    gate_up.init(tc_dynamic_smem);
    // arrivals that complete an expert's gate/up tiles
    auto arrivals = [&](int expert) {
      return (gate_up_tiles.tile_prefix[expert + 1] - gate_up_tiles.tile_prefix[expert]) *
             gate_up_tiles.num_n_tiles * GateUp::kConsumerWarps;
    };
    if (GateUp::is_producer()) {
      gemm::sm90_setmaxnreg_dec<GateUp::kProducerRegs>();
      const bool leader = GateUp::is_tma_issuer();  // producer thread 0
      if (leader) {
        gemm::sm90_prefetch_tensor_map(w13_map);
        gemm::sm90_prefetch_tensor_map(w2_map);
      }
      // the next unit: claimed by the leader, read by every producer thread (double-buffered:
      // a slot is rewritten two claims later, after the barrier that follows every read of it)
      int claim = 0;
      auto claim_next = [&]() {
        if (leader) claims[claim & 1] = atomicAdd(next_unit, 1);
        gemm::sm90_named_barrier_sync(kFusedClaimBarrierId, GateUp::kProducerThreads);
        return claims[claim++ & 1];
      };
      int u = claim_next();
      for (; u < num_gate_up; u = claim_next()) {
        const gemm::TileCoord tile = gate_up_tiles.tile(u);
        typename GateUp::LoaderA a_loader;
        a_loader.init([&](int r) { return gate_up_a_row(a, tile, r); }, a.x);
        typename GateUp::LoaderB b_loader;
        b_loader.init(w13_map, tile.expert, tile.n_tile * CfgG::kBlockN);
        gate_up.produce(a_loader, b_loader, a.hidden, 0, false, stage_tags, u);
      }
      Down down;
      down.continue_from(gate_up);
      for (; u < num_units; u = claim_next()) {
        const gemm::TileCoord tile = down_tiles.tile(u - num_gate_up);
        typename Down::LoaderB b_loader;
        b_loader.init(w2_map, tile.expert, tile.n_tile * CfgD::kBlockN);
        fused_wait_gate_up(a.gate_up_done, tile.expert, arrivals(tile.expert));
        typename Down::LoaderA a_loader;
        a_loader.init([&](int r) { return down_a_row(a, tile, r); }, a.act);
        down.produce(a_loader, b_loader, a.intermediate, 0, false, stage_tags, u);
      }
      down.produce_end(stage_tags, -1);
      gemm::cp_async_wait_all();  // no copy outlives its thread
    } else {
      gemm::sm90_setmaxnreg_inc<GateUp::kConsumerRegs>();
      int u = gate_up.peek_tag(stage_tags);
      {
        const gemm::SiluMulEpilogue<CfgG> epilogue{a.act, a.intermediate};
        for (; u >= 0 && u < num_gate_up; u = gate_up.peek_tag(stage_tags)) {
          const gemm::TileCoord tile = gate_up_tiles.tile(u);
          gate_up.consume(a.hidden);
          epilogue.apply(gate_up.acc, int(threadIdx.x), int(threadIdx.x), tile.row_begin,
                         tile.num_rows, tile.n_tile * CfgG::kBlockN);
          fused_gate_up_arrive(a.gate_up_done, tile.expert);
        }
      }
      Down down;
      down.continue_from(gate_up);
      const gemm::WeightedEntryEpilogue<CfgD> epilogue{a.partial, a.sorted_entries,
                                                       a.topk_weights, a.hidden};
      for (; u >= 0; u = down.peek_tag(stage_tags)) {
        const gemm::TileCoord tile = down_tiles.tile(u - num_gate_up);
        down.consume(a.intermediate);
        epilogue.apply(down.acc, int(threadIdx.x), int(threadIdx.x), tile.row_begin,
                       tile.num_rows, tile.n_tile * CfgD::kBlockN);
      }
    }
  }
}

template <class GateUp, class Down>
PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(GateUp::kThreads, 1)
    expert_fused_ws_kernel(ExpertGemmArgs a, const __grid_constant__ CUtensorMap w13_map,
                           const __grid_constant__ CUtensorMap w2_map) {
  petit_grid_dependency_sync();  // launched programmatically (launch_kernel)
  if constexpr (GateUp::kCompiled) {
    PETIT_DYNAMIC_SMEM(tc_dynamic_smem);  // the scheduler's storage: the user shared memory
    auto& smem = *reinterpret_cast<typename FusedScheduler<GateUp::kThreads>::SharedStorage*>(
        GateUp::user_smem(tc_dynamic_smem));
    fused_ws_gemms<GateUp, Down>(a, &w13_map, &w2_map,
                                 fused_m_tiles<GateUp::kThreads>(a, GateUp::Cfg::kBlockM, smem));
  }
}

// auto's wgmma_m64 regime (choose_expert_tiles: from ExpertConfig::narrow_max_rows to
// m64_max_rows routing entries per local expert): the m64 tiles (MG, MD), or the narrow ones (NG, ND:
// same 64 rows, half the columns, twice the tiles) when even those fill at most one wave of
// the SMs (2 x the m64 gate/up tiles of this call <= num_sms), so that the m64 tiles would
// leave more than half of the SMs without one. The host cannot tell such calls apart: they
// differ in how the entries spread over the experts (a dummy-weight server's decode sends
// every token to the same few experts), which only the device knows (expert_offsets). Every
// block counts the m-tiles itself, so every block takes the same branch. Both families give
// the same bits.
template <class NG, class ND, class MG, class MD>
PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(MG::kThreads, 1)
    expert_fused_ws_auto_kernel(ExpertGemmArgs a, const __grid_constant__ CUtensorMap narrow_w13,
                                const __grid_constant__ CUtensorMap narrow_w2,
                                const __grid_constant__ CUtensorMap m64_w13,
                                const __grid_constant__ CUtensorMap m64_w2, int num_sms) {
  petit_grid_dependency_sync();  // launched programmatically (launch_kernel)
  if constexpr (MG::kCompiled) {
    static_assert(NG::kThreads == MG::kThreads && NG::Cfg::kBlockM == MG::Cfg::kBlockM,
                  "one block shape and m-tile for both families");
    // One m-tile prefix serves both families (same kBlockM), built once, before the choice,
    // in static shared memory (the families' user shared memory lies at different offsets);
    // its total is the call's m-tiles.
    __shared__ typename FusedScheduler<MG::kThreads>::SharedStorage scheduler_smem;
    const FusedScheduler<MG::kThreads> m_tiles =
        fused_m_tiles<MG::kThreads>(a, MG::Cfg::kBlockM, scheduler_smem);
    const int64_t m64_tiles = int64_t(m_tiles.tile_prefix[a.num_local_experts]) *
                              ((a.intermediate + MG::Cfg::kBlockN - 1) / MG::Cfg::kBlockN);
    const bool narrow = 2 * m64_tiles <= num_sms;
    if (narrow)
      fused_ws_gemms<NG, ND>(a, &narrow_w13, &narrow_w2, m_tiles);
    else
      fused_ws_gemms<MG, MD>(a, &m64_w13, &m64_w2, m_tiles);
  }
}

#endif  // PETIT_SM80_PATH

// ------------------------------------------------------------------ local reduction

// One thread per (row, 8 columns): sum the row's local entries (bf16) in fp32 in slot order,
// round once (kBatch: local_slot_sum8's loads in flight; the same sums for every kBatch).
template <int kBatch>
PETIT_GLOBAL void __launch_bounds__(kReduceThreads) expert_reduce_kernel(ExpertGemmArgs a) {
  petit_grid_dependency_sync();  // launched programmatically (launch_kernel)
  const int chunks_per_row = a.hidden / 8;
  const int64_t num_chunks = int64_t(a.num_rows) * chunks_per_row;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < num_chunks;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int row = int(idx / chunks_per_row);
    const int col = int(idx % chunks_per_row) * 8;
    *reinterpret_cast<uint4*>(a.out + int64_t(row) * a.hidden + col) =
        local_slot_sum8<kBatch>(a, row, col);
  }
}

// ------------------------------------------------------------------ host side

bool aligned16(const void* p) { return p != nullptr && (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

petitError_t check_args(const ExpertGemmArgs& a) {
  if (a.num_rows < 0 || a.top_k < 1 || a.top_k > kMaxTopK || a.hidden <= 0 ||
      a.hidden % 8 != 0 || a.intermediate <= 0 || a.intermediate % 8 != 0 ||
      a.num_local_experts < 1 || a.num_local_experts > kMaxExperts ||
      a.tiles < kExpertTilesAuto || a.tiles > kExpertTilesLast || a.num_sms < 0 ||
      !config_valid(a.config) ||
      (a.expert_map != nullptr && a.num_global_experts < 1))
    return petitErrorInvalidValue;
  if (int64_t(a.num_rows) * a.top_k >= (int64_t(1) << 31)) return petitErrorInvalidValue;
  if (a.num_rows > 0 &&
      !(aligned16(a.x) && aligned16(a.w13) && aligned16(a.w2) && aligned16(a.act) &&
        aligned16(a.partial) && aligned16(a.out) && a.topk_ids != nullptr &&
        a.topk_weights != nullptr && a.expert_offsets != nullptr && a.sorted_entries != nullptr))
    return petitErrorInvalidValue;
  return petitSuccess;
}

petitError_t device_sm_count(const ExpertGemmArgs& a, int* num_sms) {
  *num_sms = a.num_sms;
  if (*num_sms > 0) return petitSuccess;
  int device = 0;
  petitError_t err = petitGetDevice(&device);
  if (err != petitSuccess) return err;
  return petitDeviceGetAttribute(num_sms, petitDevAttrMultiProcessorCount, device);
}

// Persistent grid of block_m x block_n tiles over out_cols output columns: enough blocks to fill
// the GPU, never more than the most tiles any routing can produce (sum over experts of
// ceil(rows_e / block_m) <= N*K / block_m + L). Returns 0 when that bound does not fit the
// kernels' int tile index (absurd sizes: N*K in the 10^7s with H in the thousands).
constexpr int64_t kMaxTiles = int64_t(1) << 30;

int persistent_grid(const ExpertGemmArgs& a, int out_cols, int block_m, int block_n,
                    int blocks_per_sm, int num_sms) {
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

// The shape of the latest launch_kernel call and of the latest GEMM launches
// (last_expert_gemm_launch).
ExpertLaunchShape g_launch_shape = {};
ExpertLaunchShape g_gemm_launch_shape[2] = {};  // down, gate/up

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

// ---- SIMT launchers (kExpertTilesSimt: its small or its large tiles)
template <class GateUp, class Down>
petitError_t launch_simt_gemm(bool gate_up, const ExpertGemmArgs& a, int num_sms,
                              petitStream_t stream) {
  return gate_up ? launch_persistent(expert_gate_up_kernel<GateUp>, a, a.intermediate,
                                     GateUp::kBlockM, GateUp::kBlockN, GateUp::kMinBlocksPerSm,
                                     GateUp::kThreads, 0, num_sms, 1, stream)
                 : launch_persistent(expert_down_kernel<Down>, a, a.hidden, Down::kBlockM,
                                     Down::kBlockN, Down::kMinBlocksPerSm, Down::kThreads, 0,
                                     num_sms, 1, stream);
}

// The family and regime of a call (choose_expert_tiles).
struct ExpertChoice {
  int tiles;           // ExpertTiles, never auto: what resolve_expert_tiles reports
  bool simt_large;     // kExpertTilesSimt: the 128-row tiles (else the 16-row ones)
  bool device_choice;  // kExpertTilesWgmmaM64: the fused kernel that runs the narrow or the
                       // m64 tiles by the device's count of m-tiles (auto only)
};

// The regimes whose two GEMMs run as one fused launch (and only so).
bool fused_regime(int tiles) {
  return tiles == kExpertTilesWgmmaNarrow || tiles == kExpertTilesWgmmaM64;
}

// ---- Hopper launchers; petitErrorNotSupported where the current device cannot run them.
#if PETIT_SM80_PATH

// sm_90a images exist only on devices of compute capability exactly 9.0, and the kernel
// attributes do not tell an sm_90a image from an sm_90 one: the build says whether it made
// one (PETIT_SM90A_BUILT), the device whether it runs it.
petitError_t wgmma_path_supported() {
  if (!PETIT_SM90A_BUILT) return petitErrorNotSupported;
  int device = 0, major = 0, minor = 0;
  petitError_t err = petitGetDevice(&device);
  if (err == petitSuccess)
    err = petitDeviceGetAttribute(&major, petitDevAttrComputeCapabilityMajor, device);
  if (err == petitSuccess)
    err = petitDeviceGetAttribute(&minor, petitDevAttrComputeCapabilityMinor, device);
  if (err != petitSuccess) return err;
  return major == 9 && minor == 0 ? petitSuccess : petitErrorNotSupported;
}

// One launch of a warp-specialized kernel (one block per SM) on its persistent grid.
template <class Mainloop, class Kernel, class... Extra>
petitError_t launch_ws_kernel(Kernel kernel, const ExpertGemmArgs& a, int out_cols, int num_sms,
                              petitStream_t stream, const Extra&... extra) {
  using Cfg = typename Mainloop::Cfg;
  constexpr int kSmemBytes = Mainloop::kSmemBytes;
  // Above the 48 KiB default: opt in.
  const petitError_t err =
      petitFuncSetAttribute(kernel, petitFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != petitSuccess) return err;
  return launch_persistent(kernel, a, out_cols, Cfg::kBlockM, Cfg::kBlockN, Cfg::kMinBlocksPerSm,
                           Mainloop::kThreads, kSmemBytes, num_sms, Mainloop::kClusterM, stream,
                           extra...);
}

// The weight tensors' maps, dims {H, I, 2, L} for w13 and {I, H, 1, L} for w2, in boxes of the
// main loop's B rows. Encoded per launch (host only, ~microseconds; a CUDA graph keeps the
// parameter it captured, valid while the weights stay where they are).
template <class Mainloop>
petitError_t encode_w13_map(CUtensorMap* map, const ExpertGemmArgs& a) {
  return gemm::sm90_encode_weight_map(map, a.w13, a.hidden, a.intermediate, 2,
                                      a.num_local_experts, Mainloop::LoaderB::kBoxRows);
}
template <class Mainloop>
petitError_t encode_w2_map(CUtensorMap* map, const ExpertGemmArgs& a) {
  return gemm::sm90_encode_weight_map(map, a.w2, a.intermediate, a.hidden, 1,
                                      a.num_local_experts, Mainloop::LoaderB::kBoxRows);
}

// GEMM1 (gate_up) or GEMM2 of the wgmma or wgmma_mc regime, one launch each.
template <class GateUp, class Down>
petitError_t launch_ws_gemm(bool gate_up, const ExpertGemmArgs& a, int num_sms,
                            petitStream_t stream) {
  CUtensorMap map;
  petitError_t err;
  if (gate_up) {
    if ((err = encode_w13_map<GateUp>(&map, a)) != petitSuccess) return err;
    return launch_ws_kernel<GateUp>(expert_gate_up_ws_kernel<GateUp>, a, a.intermediate, num_sms,
                                    stream, map);
  }
  if ((err = encode_w2_map<Down>(&map, a)) != petitSuccess) return err;
  return launch_ws_kernel<Down>(expert_down_ws_kernel<Down>, a, a.hidden, num_sms, stream, map);
}

// The persistent grid of one family's fused GEMMs: that of the GEMM with more tiles (0: too
// many tiles, as persistent_grid).
template <class GateUp, class Down>
int fused_grid(const ExpertGemmArgs& a, int num_sms) {
  using CfgG = typename GateUp::Cfg;
  using CfgD = typename Down::Cfg;
  const int gate_up_grid =
      persistent_grid(a, a.intermediate, CfgG::kBlockM, CfgG::kBlockN, 1, num_sms);
  const int down_grid = persistent_grid(a, a.hidden, CfgD::kBlockM, CfgD::kBlockN, 1, num_sms);
  if (gate_up_grid == 0 || down_grid == 0) return 0;
  return gate_up_grid > down_grid ? gate_up_grid : down_grid;
}

// Both GEMMs in one launch (expert_fused_ws_kernel).
template <class GateUp, class Down>
petitError_t launch_fused_ws(const ExpertGemmArgs& a, int num_sms, petitStream_t stream) {
  CUtensorMap w13_map, w2_map;
  petitError_t err;
  if ((err = encode_w13_map<GateUp>(&w13_map, a)) != petitSuccess ||
      (err = encode_w2_map<Down>(&w2_map, a)) != petitSuccess)
    return err;
  const auto kernel = expert_fused_ws_kernel<GateUp, Down>;
  if ((err = petitFuncSetAttribute(kernel, petitFuncAttributeMaxDynamicSharedMemorySize,
                                   GateUp::kSmemBytes)) != petitSuccess)
    return err;
  const int grid = fused_grid<GateUp, Down>(a, num_sms);
  if (grid == 0) return petitErrorInvalidValue;
  return launch_kernel(kernel, grid, GateUp::kThreads, GateUp::kSmemBytes, 1, stream, a, w13_map,
                       w2_map);
}

// auto's wgmma_m64 regime (expert_fused_ws_auto_kernel): both families' maps, the larger
// shared memory and grid of the two.
petitError_t launch_fused_ws_auto(const ExpertGemmArgs& a, int num_sms, petitStream_t stream) {
  using NG = GateUpWgmmaNarrow;
  using ND = DownWgmmaNarrow;
  using MG = GateUpWgmmaM64;
  using MD = DownWgmmaM64;
  CUtensorMap narrow_w13, narrow_w2, m64_w13, m64_w2;
  petitError_t err;
  if ((err = encode_w13_map<NG>(&narrow_w13, a)) != petitSuccess ||
      (err = encode_w2_map<ND>(&narrow_w2, a)) != petitSuccess ||
      (err = encode_w13_map<MG>(&m64_w13, a)) != petitSuccess ||
      (err = encode_w2_map<MD>(&m64_w2, a)) != petitSuccess)
    return err;
  const auto kernel = expert_fused_ws_auto_kernel<NG, ND, MG, MD>;
  const int smem = NG::kSmemBytes > MG::kSmemBytes ? NG::kSmemBytes : MG::kSmemBytes;
  if ((err = petitFuncSetAttribute(kernel, petitFuncAttributeMaxDynamicSharedMemorySize,
                                   smem)) != petitSuccess)
    return err;
  const int narrow_grid = fused_grid<NG, ND>(a, num_sms);
  const int m64_grid = fused_grid<MG, MD>(a, num_sms);
  if (narrow_grid == 0 || m64_grid == 0) return petitErrorInvalidValue;
  const int grid = narrow_grid > m64_grid ? narrow_grid : m64_grid;
  return launch_kernel(kernel, grid, MG::kThreads, smem, 1, stream, a, narrow_w13, narrow_w2,
                       m64_w13, m64_w2, num_sms);
}

// Both GEMMs of a 64-row regime as one launch (a.gate_up_done set).
petitError_t launch_fused_regime(const ExpertChoice& choice, const ExpertGemmArgs& a, int num_sms,
                                 petitStream_t stream) {
  if (choice.device_choice) return launch_fused_ws_auto(a, num_sms, stream);
  switch (choice.tiles) {
    case kExpertTilesWgmmaM64:
      return launch_fused_ws<GateUpWgmmaM64, DownWgmmaM64>(a, num_sms, stream);
    case kExpertTilesWgmmaNarrow:
      return launch_fused_ws<GateUpWgmmaNarrow, DownWgmmaNarrow>(a, num_sms, stream);
    default: return petitErrorInvalidValue;
  }
}

// GEMM1 or GEMM2 of the wgmma or wgmma_mc regime.
petitError_t launch_ws_regime(int tiles, bool gate_up, const ExpertGemmArgs& a, int num_sms,
                              petitStream_t stream) {
  switch (tiles) {
    case kExpertTilesWgmma:
      return launch_ws_gemm<GateUpWgmma, DownWgmma>(gate_up, a, num_sms, stream);
    case kExpertTilesWgmmaMc:
      return launch_ws_gemm<GateUpWgmmaMc, DownWgmmaMc>(gate_up, a, num_sms, stream);
    default: return petitErrorInvalidValue;
  }
}

#else  // no Hopper path in this build (HIP)

petitError_t wgmma_path_supported() { return petitErrorNotSupported; }
petitError_t launch_fused_regime(const ExpertChoice&, const ExpertGemmArgs&, int, petitStream_t) {
  return petitErrorNotSupported;
}
petitError_t launch_ws_regime(int, bool, const ExpertGemmArgs&, int, petitStream_t) {
  return petitErrorNotSupported;
}

#endif  // PETIT_SM80_PATH

// The one place a call's tiles are chosen. Where the device runs the sm_90a image, auto takes
// the Hopper regimes by the rows-per-expert estimate N*K / L (bounds: a.config, see
// common/config.h): narrow, m64 (with the narrow-or-m64 choice on the device), wgmma, and
// wgmma_mc at large hidden sizes; elsewhere the SIMT fallback. The SIMT family takes its large
// tiles from config.simt_large_min_rows, also when asked for by name.
ExpertChoice choose_expert_tiles(const ExpertGemmArgs& a) {
  const ExpertConfig& c = a.config;
  const int64_t num_entries = int64_t(a.num_rows) * a.top_k;
  auto below = [&](int rows_per_expert) {
    return num_entries < int64_t(rows_per_expert) * a.num_local_experts;
  };
  ExpertChoice choice{a.tiles, !below(c.simt_large_min_rows), false};
  if (a.tiles != kExpertTilesAuto) return choice;
  if (wgmma_path_supported() != petitSuccess) {
    choice.tiles = kExpertTilesSimt;
  } else if (below(c.narrow_max_rows)) {
    choice.tiles = kExpertTilesWgmmaNarrow;
  } else if (below(c.m64_max_rows)) {
    choice.tiles = kExpertTilesWgmmaM64;
    choice.device_choice = true;
  } else if (a.hidden >= c.mc_min_hidden && !below(c.mc_min_rows)) {
    choice.tiles = kExpertTilesWgmmaMc;
  } else {
    choice.tiles = kExpertTilesWgmma;
  }
  return choice;
}

// GEMM1 (gate_up) or GEMM2 of a regime with a launch per GEMM.
petitError_t launch_expert_gemm(const ExpertChoice& choice, bool gate_up, const ExpertGemmArgs& a,
                                int num_sms, petitStream_t stream) {
  petitError_t err;
  if (choice.tiles == kExpertTilesSimt)
    err = choice.simt_large
              ? launch_simt_gemm<GateUpLarge, DownLarge>(gate_up, a, num_sms, stream)
              : launch_simt_gemm<GateUpSmall, DownSmall>(gate_up, a, num_sms, stream);
  else
    err = launch_ws_regime(choice.tiles, gate_up, a, num_sms, stream);
  if (err == petitSuccess) g_gemm_launch_shape[gate_up ? 1 : 0] = g_launch_shape;
  return err;
}

}  // namespace

int resolve_expert_tiles(const ExpertGemmArgs& a) { return choose_expert_tiles(a).tiles; }

bool sm90a_kernels_supported() { return wgmma_path_supported() == petitSuccess; }

ExpertLaunchShape last_expert_gemm_launch(bool gate_up) {
  return g_gemm_launch_shape[gate_up ? 1 : 0];
}

petitError_t launch_expert_reduce(const ExpertGemmArgs& a, petitStream_t stream) {
  petitError_t err = check_args(a);
  if (err != petitSuccess || a.num_rows == 0) return err;
  int num_sms = 0;
  if ((err = device_sm_count(a, &num_sms)) != petitSuccess) return err;
  const int64_t num_chunks = int64_t(a.num_rows) * (a.hidden / 8);
  const int64_t needed = (num_chunks + kReduceThreads - 1) / kReduceThreads;
  if (needed <= int64_t(num_sms) * kReduceBlocksPerSmBatched)  // one wave: latency-bound
    return launch_kernel(expert_reduce_kernel<kReduceBatch>, int(needed), kReduceThreads, 0, 1,
                         stream, a);
  const int64_t resident = int64_t(num_sms) * kReduceBlocksPerSm;
  const int grid = int(needed < resident ? needed : resident);
  return launch_kernel(expert_reduce_kernel<1>, grid, kReduceThreads, 0, 1, stream, a);
}

bool expert_fused_gemms(const ExpertGemmArgs& a) {
  return a.num_rows > 0 && check_args(a) == petitSuccess &&
         fused_regime(choose_expert_tiles(a).tiles) && wgmma_path_supported() == petitSuccess;
}

petitError_t launch_experts(const ExpertGemmArgs& a, petitStream_t stream) {
  petitError_t err = check_args(a);
  if (err != petitSuccess) return err;
  // an unavailable Hopper path is an error even with no rows
  const ExpertChoice choice = choose_expert_tiles(a);
  if (choice.tiles != kExpertTilesSimt && (err = wgmma_path_supported()) != petitSuccess)
    return err;
  if (a.num_rows == 0) return petitSuccess;
  const bool fused = fused_regime(choice.tiles);
  if (fused && a.gate_up_done == nullptr) return petitErrorInvalidValue;  // expert_fused_gemms
  int num_sms = 0;
  if ((err = device_sm_count(a, &num_sms)) != petitSuccess) return err;
  if (fused) {
    err = launch_fused_regime(choice, a, num_sms, stream);
    if (err == petitSuccess) g_gemm_launch_shape[0] = g_gemm_launch_shape[1] = g_launch_shape;
  } else {
    err = launch_expert_gemm(choice, true, a, num_sms, stream);
    if (err == petitSuccess) err = launch_expert_gemm(choice, false, a, num_sms, stream);
  }
  if (err == petitSuccess) err = launch_expert_reduce(a, stream);
  return err;
}

}  // namespace petit
