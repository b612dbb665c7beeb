// wgmma pieces of the Hopper (sm_90a) expert GEMMs, used by the warp-specialized main loop
// (sm90_mainloop_wgmma_ws.h): C[m, n] = sum_k A[m, k] * B[n, k] for one kBlockM x
// (kNumBGroups * kBlockN) output tile, bf16 operands, fp32 accumulators, with
//   - wgmma.mma_async m64n256k16, m64n128k16 or m64n64k16 (one or more consumer warpgroups,
//     each 64 rows by kWgmmaN B rows), both operands read by the tensor cores straight from
//     shared memory through 64-bit matrix descriptors,
//   - the 128-byte swizzled K-major layout (8-row x 128-byte atoms, 1024-byte aligned) of the
//     operand stages,
//   - the tile configuration (Sm90WgmmaTileConfig) and its epilogue view: acc[i][g * kThreadN +
//     j] is tile row Cfg::row_of(threadIdx.x, i), column Cfg::col_of(threadIdx.x, j) of B group
//     g, runs of kVecN = 2 columns, so epilogues.h applies unchanged; in gated tiles thread t
//     holds gate[n] and up[n] of the same n.
//
// CUDA only (included where PETIT_SM80_PATH is set); the asm is emitted only in sm_90a device
// passes (PETIT_SM90A_DEVICE), elsewhere the kernels built on it have no body and the
// launchers refuse the family (experts/gemm_sm90.cu, wgmma_path_supported). Under the CPU
// emulation (PETIT_EMU_PTX) the kernels have a body and the wgmma is tests/emu/emu_ptx.h's.
#pragma once

#include "../common/platform.h"
#include "cp_async.h"

namespace petit {
namespace gemm {

// ------------------------------------------------------------------ PTX wrappers

// Shared-memory matrix descriptor of a K-major, 128-byte swizzled operand tile whose atoms
// (8 rows x 128 bytes) follow each other every 1024 bytes: start address >> 4 (bits 0-13),
// leading byte offset (bits 16-29, unused by this layout: 1), stride byte offset 1024 >> 4
// (bits 32-45), layout type 1 = 128-byte swizzle (bits 62-63). The start may move by 32 bytes
// per k16 step inside an atom: the swizzle is applied to the final address bits.
PETIT_DEVICE uint64_t sm90_desc_sw128(uint32_t smem_addr) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Orders this thread's earlier generic-proxy writes of shared memory (cp.async included,
// once waited for) before later async-proxy reads of it (wgmma operands).
PETIT_DEVICE void sm90_fence_proxy_async_smem() {
#if PETIT_SM90A_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

PETIT_DEVICE void sm90_wgmma_fence() {
#if PETIT_SM90A_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

PETIT_DEVICE void sm90_wgmma_commit() {
#if PETIT_SM90A_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif PETIT_EMU_PTX
  emu_ptx::wgmma_commit();
#endif
}

// Wait until at most kPending of this warpgroup's wgmma groups are still in flight.
template <int kPending>
PETIT_DEVICE void sm90_wgmma_wait() {
#if PETIT_SM90A_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::wgmma_wait(kPending);
#endif
}

// Keeps the compiler from moving accesses of an accumulator register across the asynchronous
// wgmma region (the register is "modified" here).
PETIT_DEVICE void sm90_fence_operand(float& r) {
#if !PETIT_EMU_PTX
  asm volatile("" : "+f"(r)::"memory");
#endif
}

// d[64 x N] (+)= A[64 x 16] * B[N x 16]^T, both from shared memory (K-major), fp32
// accumulators: d = 0 * d + A*B when scale_d is 0. Accumulator layout (warp w of the
// warpgroup, lane l): d[4c + 2h + e] is row 16w + l/4 + 8h, column 8c + 2(l%4) + e.
PETIT_DEVICE void sm90_wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
#if PETIT_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7,"
      " %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23,"
      " %24, %25, %26, %27, %28, %29, %30, %31,"
      " %32, %33, %34, %35, %36, %37, %38, %39,"
      " %40, %41, %42, %43, %44, %45, %46, %47,"
      " %48, %49, %50, %51, %52, %53, %54, %55,"
      " %56, %57, %58, %59, %60, %61, %62, %63,"
      " %64, %65, %66, %67, %68, %69, %70, %71,"
      " %72, %73, %74, %75, %76, %77, %78, %79,"
      " %80, %81, %82, %83, %84, %85, %86, %87,"
      " %88, %89, %90, %91, %92, %93, %94, %95,"
      " %96, %97, %98, %99, %100, %101, %102, %103,"
      " %104, %105, %106, %107, %108, %109, %110, %111,"
      " %112, %113, %114, %115, %116, %117, %118, %119,"
      " %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

PETIT_DEVICE void sm90_wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                             int scale_d) {
#if PETIT_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7,"
      " %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23,"
      " %24, %25, %26, %27, %28, %29, %30, %31,"
      " %32, %33, %34, %35, %36, %37, %38, %39,"
      " %40, %41, %42, %43, %44, %45, %46, %47,"
      " %48, %49, %50, %51, %52, %53, %54, %55,"
      " %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

PETIT_DEVICE void sm90_wgmma_m64n64k16_bf16(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                            int scale_d) {
#if PETIT_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7,"
      " %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23,"
      " %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

template <int kN>
PETIT_DEVICE void sm90_wgmma_bf16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                  int scale_d) {
  static_assert(kN == 64 || kN == 128 || kN == 256,
                "wrapped wgmma shapes: m64n64k16, m64n128k16, m64n256k16");
#if PETIT_EMU_PTX
  emu_ptx::wgmma<kN>(d, desc_a, desc_b, scale_d);
#else
  if constexpr (kN == 256) {
    sm90_wgmma_m64n256k16_bf16(d, desc_a, desc_b, scale_d);
  } else if constexpr (kN == 128) {
    sm90_wgmma_m64n128k16_bf16(d, desc_a, desc_b, scale_d);
  } else {
    sm90_wgmma_m64n64k16_bf16(d, desc_a, desc_b, scale_d);
  }
#endif
}

// ------------------------------------------------------------------ tile configuration

// kBlockM x kBlockN output tile per B group, k-stage 64 (one 128-byte swizzle row), consumer
// warpgroups laid out kBlockM / 64 (M) x kWgN (N): warpgroup (wm, wn) owns tile rows
// [64 wm, 64 wm + 64) and the B rows [wn * kWgmmaN, (wn + 1) * kWgmmaN) of the smem tile, one
// m64 x kWgmmaN wgmma per k16 step. kWgN = 2 halves the tensor-core work per weight byte
// (small M, where the cost is streaming the weights). In a gated tile (kNumBGroups = 2) the B
// rows of every warpgroup are its kGroupCols gate rows followed by the same columns' up rows,
// so each thread holds gate[n] and up[n] of the same n (b_group_of / b_col_of: smem B row ->
// group and tile column). kMinBlocksPerSm > 1: that many blocks share an SM (shared memory
// and registers sized for it), so one block's pipeline fill and epilogue overlap another's
// copies.
template <int kBlockM_, int kBlockN_, int kNumBGroups_, int kStages_, int kWgN_,
          int kMinBlocksPerSm_ = 1>
struct Sm90WgmmaTileConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;          // output columns per tile (per group)
  static constexpr int kBlockK = 64;                // reduction columns per pipeline stage
  static constexpr int kNumBGroups = kNumBGroups_;  // 1: plain; 2: gate rows then up rows
  static constexpr int kStages = kStages_;
  static constexpr int kWgN = kWgN_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kWarpGroups = (kBlockM / 64) * kWgN;
  static constexpr int kThreads = kWarpGroups * 128;
  static constexpr int kBRows = kNumBGroups * kBlockN;
  static constexpr int kWgmmaN = kBRows / kWgN;          // B rows (wgmma N) per warpgroup
  static constexpr int kGroupCols = kBlockN / kWgN;      // output columns per group and warpgroup
  // Epilogue view (see epilogues.h): 2 rows x kThreadN columns per group and thread.
  static constexpr int kThreadM = 2;
  static constexpr int kThreadN = kGroupCols / 4;
  static constexpr int kVecN = 2;

  static_assert(kBlockM % 64 == 0 && kBlockM >= 64, "m64 warpgroup tiles");
  static_assert(kWgmmaN == 64 || kWgmmaN == 128 || kWgmmaN == 256,
                "wrapped wgmma shapes: n64, n128, n256");
  static_assert(kGroupCols % 8 == 0, "whole n8 chunks per group");
  static_assert(kNumBGroups == 1 || kNumBGroups == 2, "plain or gated");
  static_assert(kStages >= 3, "kStages - 2 k-tiles of copies in flight");

  // ty = tx = threadIdx.x: warpgroup w = ty / 128 = wm * kWgN + wn, warp (ty / 32) % 4 of it,
  // lane ty % 32.
  PETIT_HOST_DEVICE static int row_of(int ty, int i) {
    return (ty / 128 / kWgN) * 64 + ((ty / 32) % 4) * 16 + (ty % 32) / 4 + 8 * i;
  }
  PETIT_HOST_DEVICE static int col_of(int tx, int j) {
    return ((tx / 128) % kWgN) * kGroupCols + (j / 2) * 8 + (tx % 4) * 2 + j % 2;
  }
  // smem B row r: B group and tile column of the weight row it holds (kWgN = 1: all gate rows,
  // then all up rows).
  PETIT_HOST_DEVICE static int b_group_of(int r) {
    if constexpr (kWgN == 1) return r / kGroupCols;
    return (r % kWgmmaN) / kGroupCols;
  }
  PETIT_HOST_DEVICE static int b_col_of(int r) {
    if constexpr (kWgN == 1) return r % kGroupCols;
    return (r / kWgmmaN) * kGroupCols + r % kGroupCols;
  }
};

// ------------------------------------------------------------------ main loop

// The wgmma accumulators d of a warpgroup in the epilogue view acc (see the config): group g,
// n8 chunk c of the group (in this warpgroup's B rows), half h, element e.
template <class Cfg>
PETIT_DEVICE void sm90_epilogue_view(
    const float (&d)[Cfg::kWgmmaN / 2],
    float (&acc)[Cfg::kThreadM][Cfg::kNumBGroups * Cfg::kThreadN]) {
  constexpr int kChunksPerGroup = Cfg::kGroupCols / 8;
#pragma unroll
  for (int g = 0; g < Cfg::kNumBGroups; ++g)
#pragma unroll
    for (int c = 0; c < kChunksPerGroup; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          acc[h][g * Cfg::kThreadN + 2 * c + e] = d[(g * kChunksPerGroup + c) * 4 + 2 * h + e];
}

// One k-tile of a warpgroup's MMAs: the kBlockK / 16 wgmma k16
// steps on the stage's operand tiles at smem addresses a_stage / b_stage (this warpgroup's rows)
// as one commit group, then wait until at most kPending groups are in flight: 1, the previous
// k-tile's group has retired (its stage may be reused); 0, this one too. first_k_tile: d starts
// from zero.
template <class Cfg, int kPending = 1>
PETIT_DEVICE void sm90_wgmma_k_tile(float (&d)[Cfg::kWgmmaN / 2], uint32_t a_stage,
                                    uint32_t b_stage, bool first_k_tile) {
#pragma unroll
  for (int i = 0; i < Cfg::kWgmmaN / 2; ++i) sm90_fence_operand(d[i]);
  sm90_wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Cfg::kBlockK / 16; ++ks)
    sm90_wgmma_bf16<Cfg::kWgmmaN>(d, sm90_desc_sw128(a_stage + ks * 32),
                                  sm90_desc_sw128(b_stage + ks * 32), !first_k_tile || ks > 0);
  sm90_wgmma_commit();
  sm90_wgmma_wait<kPending>();
#pragma unroll
  for (int i = 0; i < Cfg::kWgmmaN / 2; ++i) sm90_fence_operand(d[i]);
}

}  // namespace gemm
}  // namespace petit
