// The local weighted reduction, the last step of launch_experts: out[row] = bf16(sum of the
// row's local down-GEMM partials in fp32 in slot order), and its launcher (one wave of a
// batched kernel for latency-bound calls, a grid of single-load kernels for HBM-bound ones).
//
// Why a separate reduction instead of accumulating in the down GEMM's epilogue: a token's
// (up to K) local entries belong to different experts, i.e. to tiles that run in no fixed
// order, so an in-epilogue fp32 accumulation (atomics) would round differently from run to
// run. Writing each entry's weighted row, rounded to bf16 (as vLLM's own experts do before
// their sum), to its own workspace row (indexed by the entry, so no inverse permutation is
// needed) and summing them in fp32 in slot order k = 0..K-1 afterwards gives bit-identical
// results on every run, at the cost of the workspace (N*K*H*2 bytes, see
// expert_partial_workspace_elems) and one extra pass over it.
#include "api.h"
#include "common/expert_ids.h"
#include "experts/persistent_launch.h"

namespace petit {

namespace {

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

}  // namespace

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

}  // namespace petit
