// Tensor-core main loop of the grouped GEMM for CUDA sm_80 and newer (Ampere, Hopper sm_90a
// included): C[m, n] = sum_k A[m, k] * B[n, k] for one (kBlockM x kBlockN) output tile, bf16
// operands, fp32 accumulators, with
//   - mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (inline PTX),
//   - ldmatrix.x4 for the A and B fragments,
//   - cp.async.cg (16 bytes, zero-fill for rows / chunks that do not exist) into a kStages-deep
//     shared-memory ring (commit_group / wait_group),
//   - an XOR swizzle of the 16-byte chunks of every smem row (conflict-free ldmatrix and
//     cp.async stores, no padding).
// Same operand contract as the portable path (tile_loader.h): both operands K-contiguous, one
// global pointer per tile row (A rows gathered through the row list, B rows are weight rows),
// a null row pointer means the row does not exist (zeros), k_dim a multiple of 8, every row
// pointer 16-byte aligned. Gated tiles (kNumBGroups = 2) hold kBlockN gate rows followed by
// kBlockN up rows, and every warp owns the same columns of both groups, so the SiLU·mul
// epilogue finds gate[n] and up[n] in the same thread.
//
// The accumulators are exposed in the layout of the SIMT main loop (acc[i][g * kThreadN + j]
// is tile row Cfg::row_of(ty, i), tile column Cfg::col_of(tx, j) of B group g, runs of
// kVecN = 2 contiguous columns), so the epilogues of epilogues.h apply unchanged with
// ty = tx = threadIdx.x.
//
// CUDA only: this header is included where platform.h's PETIT_SM80_PATH is set (an nvcc
// compile), and its device code is only meaningful in device passes with PETIT_SM80_DEVICE
// (__CUDA_ARCH__ >= 800); the launchers refuse the family elsewhere.
#pragma once

#include "../common/platform.h"
#include "cp_async.h"

namespace petit {
namespace gemm {

// ------------------------------------------------------------------ PTX wrappers

// Four 8x8 b16 matrices; lanes 8j..8j+7 give the row addresses of matrix j, and register j of
// lane t receives row t/4, elements 2(t%4), 2(t%4)+1 of matrix j (lower element in the low half).
PETIT_DEVICE void sm80_ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if PETIT_SM80_DEVICE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::ldmatrix_x4(r, addr);
#else
  r[0] = r[1] = r[2] = r[3] = 0u;
#endif
}

// D = A * B + D, A 16x16 (row), B 16x8 (col), fp32 accumulators. Fragments (g = lane / 4,
// q = lane % 4): a = {A[g][2q..], A[g+8][2q..], A[g][2q+8..], A[g+8][2q+8..]},
// b = {B[k=2q..][n=g], B[k=2q+8..][n=g]}, d = {D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1]}.
PETIT_DEVICE void sm80_mma_bf16_16816(float& d0, float& d1, float& d2, float& d3,
                                      const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if PETIT_SM80_DEVICE
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif PETIT_EMU_PTX
  emu_ptx::mma_bf16_16816(d0, d1, d2, d3, a, b0, b1);
#endif
}

// ------------------------------------------------------------------ tile configuration

// 128 x kBlockN output tile (per B group), k-stage 32, 8 warps as 2 (M) x 4 (N): each warp owns
// 64 rows x kWarpN columns of every B group (4 x kMmaN m16n8 tiles per group).
template <int kBlockN_, int kNumBGroups_, int kStages_, int kMinBlocksPerSm_>
struct Sm80MmaTileConfig {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kBlockN_;          // output columns per tile (per group)
  static constexpr int kBlockK = 32;                // reduction columns per pipeline stage
  static constexpr int kNumBGroups = kNumBGroups_;  // 1: plain; 2: gate rows then up rows
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kWarpsM = 2;
  static constexpr int kWarpsN = 4;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kBRows = kNumBGroups * kBlockN;
  static constexpr int kWarpM = kBlockM / kWarpsM;  // 64
  static constexpr int kWarpN = kBlockN / kWarpsN;  // per group
  static constexpr int kMmaM = kWarpM / 16;         // m16 tiles per warp
  static constexpr int kMmaN = kWarpN / 8;          // n8 tiles per warp and group
  // Epilogue view (see epilogues.h): kThreadM rows x kThreadN columns per group and thread.
  static constexpr int kThreadM = 2 * kMmaM;
  static constexpr int kThreadN = 2 * kMmaN;
  static constexpr int kVecN = 2;

  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tile: m16 x (pairs of n8)");
  static_assert(kNumBGroups == 1 || kNumBGroups == 2, "plain or gated");
  static_assert(kStages >= 2, "at least double buffering");

  // ty = tx = threadIdx.x. Accumulator row i = 2 * mi + h is m16 tile mi, half h (rows +8);
  // accumulator column j = 2 * ni + c is n8 tile ni, element c.
  PETIT_HOST_DEVICE static int row_of(int ty, int i) {
    const int warp_m = (ty / 32) / kWarpsN, lane = ty % 32;
    return warp_m * kWarpM + (i / 2) * 16 + (i % 2) * 8 + lane / 4;
  }
  PETIT_HOST_DEVICE static int col_of(int tx, int j) {
    const int warp_n = (tx / 32) % kWarpsN, lane = tx % 32;
    return warp_n * kWarpN + (j / 2) * 8 + (lane % 4) * 2 + j % 2;
  }
  // smem B row r: B group and tile column of the weight row it holds (all gate rows, then all
  // up rows).
  PETIT_HOST_DEVICE static int b_group_of(int r) { return r / kBlockN; }
  PETIT_HOST_DEVICE static int b_col_of(int r) { return r % kBlockN; }
};

// ------------------------------------------------------------------ main loop

template <class Cfg_>
struct Sm80MmaMainloop {
  using Cfg = Cfg_;
  static constexpr int kThreads = Cfg::kThreads;  // block size
  // The kernels have a body only in the device passes that can run this main loop.
  static constexpr bool kCompiled = PETIT_SM80_BODY;
  using LoaderA = CpAsyncLoader<Cfg::kBlockM, Cfg::kThreads, Sm80Swizzle>;
  using LoaderB = CpAsyncLoader<Cfg::kBRows, Cfg::kThreads, Sm80Swizzle>;
  static constexpr int kAccCols = Cfg::kNumBGroups * Cfg::kThreadN;
  static constexpr int kStageBytes = LoaderA::kStageBytes + LoaderB::kStageBytes;
  // Dynamic shared memory of the kernel (kStages stages of A then B), 128-byte aligned base.
  static constexpr int kSmemBytes = Cfg::kStages * kStageBytes;

  // acc[i][g * kThreadN + j]: row Cfg::row_of(threadIdx.x, i), column Cfg::col_of(threadIdx.x,
  // j) of group g.
  float acc[Cfg::kThreadM][kAccCols];

  // The whole reduction over k_dim (> 0, a multiple of 8). Starts and ends with every thread
  // past a barrier, no copy in flight and `smem` free, so consecutive tiles of a persistent
  // loop may call it back to back.
  PETIT_DEVICE void run(const LoaderA& a_loader, const LoaderB& b_loader, int k_dim,
                        unsigned char* smem) {
#pragma unroll
    for (int i = 0; i < Cfg::kThreadM; ++i)
#pragma unroll
      for (int j = 0; j < kAccCols; ++j) acc[i][j] = 0.0f;

    const uint32_t smem_base = smem_addr_u32(smem);
    const int num_k_tiles = (k_dim + Cfg::kBlockK - 1) / Cfg::kBlockK;

    // Prologue: stages 0 .. kStages-2 (one commit group each, empty past the last k-tile, so
    // the group count stays uniform and wait_group<kStages-2> below always means "k-tile kt
    // has landed").
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s)
      issue_stage(a_loader, b_loader, smem_base + s * kStageBytes, s, Cfg::kBlockK, num_k_tiles,
                  k_dim);

    // Per-lane parts of the ldmatrix addresses (stage- and tile-independent).
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
    const int swz = (lane >> 1) & 3;  // (row >> 1) & 3 of this lane's row (bases are x16)
    // A, matrix j = lane / 8: rows +0/+8 (j & 1), k chunk +0/+1 (j >> 1).
    const uint32_t a_row_off = uint32_t((warp_m * Cfg::kWarpM + (lane & 15)) * 64);
    const int a_chunk = lane >> 4;
    // B, matrix j = lane / 8: k chunk +0/+1 (j & 1), n rows +0/+8 (j >> 1).
    const uint32_t b_row_off =
        uint32_t((warp_n * Cfg::kWarpN + (lane & 7) + ((lane >> 4) << 3)) * 64);
    const int b_chunk = (lane >> 3) & 1;

    int read_stage = 0;
    int write_stage = Cfg::kStages - 1;
    for (int kt = 0; kt < num_k_tiles; ++kt) {
      cp_async_wait<Cfg::kStages - 2>();
      // Makes k-tile kt visible to every thread and tells that every thread is done with the
      // stage read in iteration kt-1, which the prefetch below overwrites.
      __syncthreads();
      issue_stage(a_loader, b_loader, smem_base + write_stage * kStageBytes, kt + Cfg::kStages - 1,
                  Cfg::kBlockK, num_k_tiles, k_dim);
      write_stage = write_stage + 1 == Cfg::kStages ? 0 : write_stage + 1;

      const uint32_t a_stage = smem_base + read_stage * kStageBytes;
      const uint32_t b_stage = a_stage + LoaderA::kStageBytes;
#pragma unroll
      for (int ks = 0; ks < Cfg::kBlockK / 16; ++ks) {
        uint32_t a_frag[Cfg::kMmaM][4];
        uint32_t b_frag[Cfg::kNumBGroups][Cfg::kMmaN / 2][4];  // [.][p]: n8 tiles 2p, 2p+1
        const uint32_t a_col = uint32_t(((2 * ks + a_chunk) ^ swz) * 16);
        const uint32_t b_col = uint32_t(((2 * ks + b_chunk) ^ swz) * 16);
#pragma unroll
        for (int mi = 0; mi < Cfg::kMmaM; ++mi)
          sm80_ldmatrix_x4(a_frag[mi], a_stage + a_row_off + mi * 16 * 64 + a_col);
#pragma unroll
        for (int g = 0; g < Cfg::kNumBGroups; ++g)
#pragma unroll
          for (int p = 0; p < Cfg::kMmaN / 2; ++p)
            sm80_ldmatrix_x4(b_frag[g][p],
                             b_stage + b_row_off + (g * Cfg::kBlockN + p * 16) * 64 + b_col);
#pragma unroll
        for (int mi = 0; mi < Cfg::kMmaM; ++mi)
#pragma unroll
          for (int g = 0; g < Cfg::kNumBGroups; ++g)
#pragma unroll
            for (int ni = 0; ni < Cfg::kMmaN; ++ni) {
              const uint32_t* b = &b_frag[g][ni / 2][(ni % 2) * 2];
              const int j = g * Cfg::kThreadN + 2 * ni;
              sm80_mma_bf16_16816(acc[2 * mi][j], acc[2 * mi][j + 1], acc[2 * mi + 1][j],
                                  acc[2 * mi + 1][j + 1], a_frag[mi], b[0], b[1]);
            }
      }
      read_stage = read_stage + 1 == Cfg::kStages ? 0 : read_stage + 1;
    }
    // Only empty groups can still be pending; drain them and let every thread finish reading
    // before the next tile's prologue overwrites the stages.
    cp_async_wait<0>();
    __syncthreads();
  }
};

}  // namespace gemm
}  // namespace petit
