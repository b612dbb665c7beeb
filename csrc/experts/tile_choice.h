// A call's tile family and regime (ExpertChoice, made in one place: tile_choice.cu,
// choose_expert_tiles) and the launchers of each family that run it (gemm_sm90.cu,
// gemm_simt.cu). Internal to csrc/experts/: the public launchers are declared in api.h.
#pragma once

#include "api.h"

namespace petit {

// The family and regime of a call (choose_expert_tiles).
struct ExpertChoice {
  int tiles;           // ExpertTiles, never auto: what resolve_expert_tiles reports
  bool simt_large;     // kExpertTilesSimt: the 128-row tiles (else the 16-row ones)
  bool device_choice;  // kExpertTilesWgmmaM64: the fused kernel that runs the narrow or the
                       // m64 tiles by the device's count of m-tiles (auto only)
};

// ---- gemm_simt.cu
// GEMM1 (gate_up) or GEMM2 of the SIMT family, with its 128-row tiles (large) or its 16-row ones.
petitError_t launch_simt_gemm(bool large, bool gate_up, const ExpertGemmArgs& a, int num_sms,
                              petitStream_t stream);

// ---- gemm_sm90.cu; petitErrorNotSupported where the current device cannot run them.
// Whether this build has the sm_90a image and the current device runs it.
petitError_t wgmma_path_supported();
// Both GEMMs of a 64-row regime (wgmma_narrow, wgmma_m64) as one launch (a.gate_up_done set).
petitError_t launch_fused_regime(const ExpertChoice& choice, const ExpertGemmArgs& a, int num_sms,
                                 petitStream_t stream);
// GEMM1 (gate_up) or GEMM2 of the wgmma or wgmma_mc regime.
petitError_t launch_ws_regime(int tiles, bool gate_up, const ExpertGemmArgs& a, int num_sms,
                              petitStream_t stream);

}  // namespace petit
