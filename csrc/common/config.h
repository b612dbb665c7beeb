// Tuning parameters of the kernels: typed configs with their defaults, the one place they are
// defined. The launchers take them as arguments (ExpertGemmArgs::config, CombineArgs::config);
// nothing in csrc reads the environment. Python mirrors both structs field by field in
// vllm_petit_moe/config.py (tests/test_config_cpu.py parses this header and checks the
// mirror's names and defaults) and passes them through the binding as {field: value} dicts
// (EpBuffer(..., combine_config=...), experts_forward(..., config=...)), which the binding
// reads through the field tables below (k*ConfigFields: every field, by name).
#pragma once

#include <utility>

namespace petit {

// The automatic choice of the expert GEMMs' regime (experts/tile_choice.cu,
// choose_expert_tiles) by the host-known estimate of routing entries per local expert, N*K / L.
// The estimate overstates the mean rows of an expert by the EP world size (the other ranks'
// entries are in N*K too), hence bounds above the tile heights. Bounds are exclusive below, inclusive from.
struct ExpertConfig {
  // Below this many entries per local expert: wgmma_narrow, 64 x 128 tiles (4x the tiles of
  // wgmma_m64 per expert, so a decode step's few experts spread over more SMs).
  int narrow_max_rows = 2;
  // Below this: wgmma_m64, 64 x 256 tiles (half the tensor-core work per weight byte of
  // wgmma); its fused kernel runs the narrow tiles instead where the m64 ones would leave
  // more than half of the SMs without a tile (decided on the device, where the spread of the
  // entries over the experts is known).
  int m64_max_rows = 96;
  // From this, at hidden sizes from mc_min_hidden: wgmma_mc, wgmma's 128 x 256 tiles in
  // clusters of 2 CTAs sharing each weight box (TMA multicast); long weight rows are the
  // case it pays for.
  int mc_min_rows = 256;
  int mc_min_hidden = 4096;
  // The portable SIMT fallback (no sm_90a image): 128-row tiles from this, 16-row below.
  int simt_large_min_rows = 256;
};

inline bool config_valid(const ExpertConfig& c) {
  return c.narrow_max_rows >= 0 && c.m64_max_rows >= c.narrow_max_rows && c.mc_min_rows >= 0 &&
         c.mc_min_hidden >= 0 && c.simt_large_min_rows >= 0;
}
// What config_valid(ExpertConfig) demands, as an error message says it.
constexpr const char* kExpertConfigLimits =
    "ExpertConfig: bounds must be >= 0 with narrow_max_rows <= m64_max_rows";
// The fields by name, in declaration order: the binding's {field: value} dicts and defaults.
constexpr std::pair<const char*, int ExpertConfig::*> kExpertConfigFields[] = {
    {"narrow_max_rows", &ExpertConfig::narrow_max_rows},
    {"m64_max_rows", &ExpertConfig::m64_max_rows},
    {"mc_min_rows", &ExpertConfig::mc_min_rows},
    {"mc_min_hidden", &ExpertConfig::mc_min_hidden},
    {"simt_large_min_rows", &ExpertConfig::simt_large_min_rows}};
static_assert(sizeof(kExpertConfigFields) / sizeof(kExpertConfigFields[0]) * sizeof(int) ==
                  sizeof(ExpertConfig),
              "kExpertConfigFields lists every field of ExpertConfig");

// The combine's split of its persistent grid into senders and reducers, and of its work into
// items (dispatch_combine.cu, plan_combine). No choice here changes an output bit: every
// element is summed in the same fixed order.
struct CombineConfig {
  // Share of the grid, in percent (0..90), that only reduces from the start: at large sizes
  // about 3/4 of the SMs already saturate the peer links, the reduction needs the rest.
  int reduce_pct = 25;
  // 16-byte vectors per row of one reduce item (0: the send chunks), so the last token groups
  // to land are reduced by many blocks instead of one ...
  int reduce_vectors = 128;
  // ... but at most about this many reduce items per block of the grid (0: no bound): every
  // item costs a claim, flag reads and barriers, which dominate on small grids.
  int reduce_items = 8;
  // Hidden chunks (0 or 1: off) of each pair of a large combine's last send round, so its rows
  // land in sub-rounds and only the last one's reduction runs after the transfer.
  int tail_chunks = 4;
};

inline bool config_valid(const CombineConfig& c) {
  return c.reduce_pct >= 0 && c.reduce_pct <= 90 && c.reduce_vectors >= 0 &&
         c.reduce_vectors <= (1 << 20) && c.reduce_items >= 0 && c.reduce_items <= (1 << 20) &&
         c.tail_chunks >= 0 && c.tail_chunks <= (1 << 10);
}
// What config_valid(CombineConfig) demands, as an error message says it.
constexpr const char* kCombineConfigLimits =
    "CombineConfig: reduce_pct in [0, 90], reduce_vectors and reduce_items in [0, 2^20], "
    "tail_chunks in [0, 1024]";
constexpr std::pair<const char*, int CombineConfig::*> kCombineConfigFields[] = {
    {"reduce_pct", &CombineConfig::reduce_pct},
    {"reduce_vectors", &CombineConfig::reduce_vectors},
    {"reduce_items", &CombineConfig::reduce_items},
    {"tail_chunks", &CombineConfig::tail_chunks}};
static_assert(sizeof(kCombineConfigFields) / sizeof(kCombineConfigFields[0]) * sizeof(int) ==
                  sizeof(CombineConfig),
              "kCombineConfigFields lists every field of CombineConfig");

}  // namespace petit
