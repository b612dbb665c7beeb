// The one place a call's tile family and regime are chosen (choose_expert_tiles: the Hopper
// regimes by the routing entries per local expert where the device runs the sm_90a image, the
// SIMT fallback elsewhere; bounds in ExpertConfig, common/config.h), and launch_experts, which
// runs the choice: gate/up and down (gemm_sm90.cu or gemm_simt.cu; one fused launch in the
// 64-row regimes), then the local reduction (reduce.cu). Launch contract and formulas: api.h;
// design: docs/architecture.md, "Expert GEMMs".
#include "api.h"
#include "common/check.h"
#include "experts/persistent_launch.h"
#include "experts/tile_choice.h"

namespace petit {

namespace {

// The shape of the latest GEMM launches (last_expert_gemm_launch).
ExpertLaunchShape g_gemm_launch_shape[2] = {};  // down, gate/up

// The regimes whose two GEMMs run as one fused launch (and only so).
bool fused_regime(int tiles) {
  return tiles == kExpertTilesWgmmaNarrow || tiles == kExpertTilesWgmmaM64;
}

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
    err = launch_simt_gemm(choice.simt_large, gate_up, a, num_sms, stream);
  else
    err = launch_ws_regime(choice.tiles, gate_up, a, num_sms, stream);
  if (err == petitSuccess) g_gemm_launch_shape[gate_up ? 1 : 0] = g_launch_shape;
  return err;
}

}  // namespace

petitError_t experts_check(const ExpertGemmArgs& a, char* err, int err_len) {
  if (a.hidden <= 0 || a.hidden % 8 != 0)
    return refuse(err, err_len, "hidden size %d must be a positive multiple of 8", a.hidden);
  if (a.intermediate <= 0 || a.intermediate % 8 != 0)
    return refuse(err, err_len, "intermediate size %d must be a positive multiple of 8",
                  a.intermediate);
  if (a.top_k < 1 || a.top_k > kMaxTopK)
    return refuse(err, err_len, "top-k %d outside [1, %d]", a.top_k, kMaxTopK);
  if (a.num_local_experts < 1 || a.num_local_experts > kMaxExperts)
    return refuse(err, err_len, "%d local experts outside [1, %d]", a.num_local_experts,
                  kMaxExperts);
  const int64_t num_entries = int64_t(a.num_rows) * a.top_k;
  if (a.num_rows < 0 || num_entries >= (int64_t(1) << 31))
    return refuse(err, err_len, "N*K = %lld routing entries outside [0, 2^31 - 1]",
                  (long long)num_entries);
  if (a.tiles < kExpertTilesAuto || a.tiles > kExpertTilesLast)
    return refuse(err, err_len,
                  "tiles %d must be 0 (auto), 1 (simt), 2 (wgmma_narrow), 3 (wgmma_m64), "
                  "4 (wgmma) or 5 (wgmma_mc)", a.tiles);
  if (a.num_sms < 0)
    return refuse(err, err_len, "num_sms %d must be >= 0 (0: the device's SM count)", a.num_sms);
  if (!config_valid(a.config))
    return refuse(err, err_len, "%s, got narrow_max_rows %d, m64_max_rows %d",
                  kExpertConfigLimits, a.config.narrow_max_rows, a.config.m64_max_rows);
  if (a.expert_map != nullptr && a.num_global_experts < 1)
    return refuse(err, err_len, "an expert_map needs >= 1 entries, got %d",
                  a.num_global_experts);
  return petitSuccess;
}

int resolve_expert_tiles(const ExpertGemmArgs& a) { return choose_expert_tiles(a).tiles; }

ExpertLaunchShape last_expert_gemm_launch(bool gate_up) {
  return g_gemm_launch_shape[gate_up ? 1 : 0];
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
