// The operand rows of the expert GEMMs, the same for both families (gemm_sm90.cu,
// gemm_simt.cu): where a tile's A row and weight row r live. nullptr: a row past the tile or the
// output width, which the loaders treat as zeros and the epilogues skip. One home, so the two
// families cannot read different rows.
#pragma once

#include "api.h"
#include "gemm/scheduler.h"

namespace petit {

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

}  // namespace petit
