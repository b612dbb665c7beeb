// The Hopper (sm_90a) family of the expert GEMMs and its launchers: warp-specialized wgmma
// kernels in four regimes, narrow and m64 (64-row tiles, both GEMMs of a call in one
// persistent launch, the choice between the two made on the device), full (128 x 256 tiles)
// and multicast (full tiles in clusters of 2 CTAs sharing weight boxes). A file of its own
// because it is arch-specific: a build without the sm80 path (HIP) compiles only the stubs at
// the end. The portable family is gemm_simt.cu, the choice between them tile_choice.cu; the
// pieces (main loop, TMA, epilogues, scheduler) live in csrc/gemm/; design:
// docs/architecture.md, "Expert GEMMs".
#include "api.h"
#include "experts/tile_choice.h"
#if PETIT_SM80_PATH
#include "experts/operand_rows.h"
#include "experts/persistent_launch.h"
#include "gemm/epilogues.h"
#include "gemm/scheduler.h"
#include "gemm/sm90_epilogue_staged.h"
#include "gemm/sm90_mainloop_wgmma_ws.h"
#endif

namespace petit {

#if PETIT_SM80_PATH

namespace {

// The four regimes' main loops (gemm/sm90_mainloop_wgmma_ws.h): a producer warpgroup loads
// (the gathered A rows by cp.async, the weight rows as TMA boxes), the ring is handed over
// through mbarriers, and the loads run on into the next tile during the epilogue. CUDA only; a
// kernel has a body only in the sm_90a device passes (Mainloop::kCompiled), and the launchers
// check that the current device runs that image (wgmma_path_supported below).

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

// ------------------------------------------------------------------ launchers

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

}  // namespace

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

bool sm90a_kernels_supported() { return wgmma_path_supported() == petitSuccess; }

}  // namespace petit
