// Epilogues of the expert GEMMs: what happens to a thread's fp32 accumulators (the
// register tile of SimtMainloop: acc[i][g * kThreadN + j] is tile row Cfg::row_of(ty, i),
// tile column Cfg::col_of(tx, j) of B group g) once a tile's reduction is done.
//
//   SiluMulEpilogue        GEMM1: act[pos][n] = bf16(silu(gate) * up), fp32 math, one rounding
//   WeightedEntryEpilogue  GEMM2: partial[entry][n] = bf16(weight[entry] * acc)
//
// Column runs of kVecN (<= 4) start at multiples of kVecN and every output width is a
// multiple of 8, so a run is entirely inside or entirely outside the output: one bounds
// check per run, vector stores.
#pragma once

#include "../common/platform.h"

namespace petit {
namespace gemm {

PETIT_DEVICE float silu(float x) { return x / (1.0f + expf(-x)); }

template <int kVec>
PETIT_DEVICE void store_bf16_vec(petit_bf16_bits* dst, const float* v) {
  if constexpr (kVec == 4) {
    uint2 packed;
    packed.x = uint32_t(petit_float_to_bf16(v[0])) | (uint32_t(petit_float_to_bf16(v[1])) << 16);
    packed.y = uint32_t(petit_float_to_bf16(v[2])) | (uint32_t(petit_float_to_bf16(v[3])) << 16);
    *reinterpret_cast<uint2*>(dst) = packed;
  } else if constexpr (kVec == 2) {
    *reinterpret_cast<uint32_t*>(dst) =
        uint32_t(petit_float_to_bf16(v[0])) | (uint32_t(petit_float_to_bf16(v[1])) << 16);
  } else {
    dst[0] = petit_float_to_bf16(v[0]);
  }
}

template <int kVec>
PETIT_DEVICE void store_f32_vec(float* dst, const float* v) {
  if constexpr (kVec == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (kVec == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
  } else {
    dst[0] = v[0];
  }
}

// GEMM1 (gated tile: group 0 = gate rows of w13, group 1 = up rows): the activation of the
// tile's rows, written at their sorted positions: act[(row_begin + r) * out_cols + n].
template <class Cfg>
struct SiluMulEpilogue {
  static_assert(Cfg::kNumBGroups == 2, "SiLU·mul needs the gate and the up accumulators");
  petit_bf16_bits* act;  // [positions, out_cols]
  int out_cols;          // I

  template <class Acc>
  PETIT_DEVICE void apply(const Acc& acc, int ty, int tx, int row_begin, int num_rows,
                          int col_begin) const {
#pragma unroll
    for (int i = 0; i < Cfg::kThreadM; ++i) {
      const int r = Cfg::row_of(ty, i);
      if (r >= num_rows) continue;
      petit_bf16_bits* out_row = act + int64_t(row_begin + r) * out_cols;
#pragma unroll
      for (int j = 0; j < Cfg::kThreadN; j += Cfg::kVecN) {
        const int n = col_begin + Cfg::col_of(tx, j);
        if (n >= out_cols) continue;
        float v[Cfg::kVecN];
#pragma unroll
        for (int u = 0; u < Cfg::kVecN; ++u)
          v[u] = silu(acc[i][j + u]) * acc[i][Cfg::kThreadN + j + u];
        store_bf16_vec<Cfg::kVecN>(out_row + n, v);
      }
    }
  }
};

// GEMM2 (plain tile): the routing weight applied, fp32 per routing entry, at the entry's own
// row of the workspace: partial[entry * out_cols + n], entry = sorted_entries[row_begin + r].
// The local weighted reduction over a token's entries happens afterwards, in a fixed order.
template <class Cfg>
struct WeightedEntryEpilogue {
  static_assert(Cfg::kNumBGroups == 1, "plain tile");
  petit_bf16_bits* partial;       // [N*K, out_cols]
  const int32_t* sorted_entries;  // [N*K]
  const float* entry_weights;     // [N*K]
  int out_cols;                   // H

  template <class Acc>
  PETIT_DEVICE void apply(const Acc& acc, int ty, int tx, int row_begin, int num_rows,
                          int col_begin) const {
#pragma unroll
    for (int i = 0; i < Cfg::kThreadM; ++i) {
      const int r = Cfg::row_of(ty, i);
      if (r >= num_rows) continue;
      const int entry = sorted_entries[row_begin + r];
      const float weight = entry_weights[entry];
      petit_bf16_bits* out_row = partial + int64_t(entry) * out_cols;
#pragma unroll
      for (int j = 0; j < Cfg::kThreadN; j += Cfg::kVecN) {
        const int n = col_begin + Cfg::col_of(tx, j);
        if (n >= out_cols) continue;
        float v[Cfg::kVecN];
#pragma unroll
        for (int u = 0; u < Cfg::kVecN; ++u) v[u] = weight * acc[i][j + u];
        store_bf16_vec<Cfg::kVecN>(out_row + n, v);
      }
    }
  }
};

}  // namespace gemm
}  // namespace petit
