// The portable SIMT family of the expert GEMMs (fp32 FMAs; CUDA without an sm_90a image, HIP):
// gate/up with SiLU·mul in its epilogue and down with the routing weight in its epilogue, each
// a persistent kernel over the tile scheduler, in 16-row tiles (few rows per expert) or 128-row
// tiles, and their launchers. One source for CUDA and HIP; the Hopper family is gemm_sm90.cu,
// the choice between them tile_choice.cu. The pieces (tile loaders, main loop, epilogues,
// scheduler) live in csrc/gemm/; design: docs/architecture.md, "Expert GEMMs".
#include "api.h"
#include "experts/operand_rows.h"
#include "experts/persistent_launch.h"
#include "experts/tile_choice.h"
#include "gemm/epilogues.h"
#include "gemm/mainloop_simt.h"
#include "gemm/scheduler.h"

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

// ------------------------------------------------------------------ launchers

template <class GateUp, class Down>
petitError_t launch_simt_tiles(bool gate_up, const ExpertGemmArgs& a, int num_sms,
                               petitStream_t stream) {
  return gate_up ? launch_persistent(expert_gate_up_kernel<GateUp>, a, a.intermediate,
                                     GateUp::kBlockM, GateUp::kBlockN, GateUp::kMinBlocksPerSm,
                                     GateUp::kThreads, 0, num_sms, 1, stream)
                 : launch_persistent(expert_down_kernel<Down>, a, a.hidden, Down::kBlockM,
                                     Down::kBlockN, Down::kMinBlocksPerSm, Down::kThreads, 0,
                                     num_sms, 1, stream);
}

}  // namespace

petitError_t launch_simt_gemm(bool large, bool gate_up, const ExpertGemmArgs& a, int num_sms,
                              petitStream_t stream) {
  return large ? launch_simt_tiles<GateUpLarge, DownLarge>(gate_up, a, num_sms, stream)
               : launch_simt_tiles<GateUpSmall, DownSmall>(gate_up, a, num_sms, stream);
}

}  // namespace petit
