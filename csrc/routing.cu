// Destination-side routing block -> per-local-expert row lists: a stable counting sort in
// three launches (chunk histograms, one scan block, chunk scatter), device-side counts only.
#include "api.h"
#include "expert_ids.h"

namespace petit {

namespace {

constexpr int kRowListThreads = 256;
constexpr int kRowListWarps = kRowListThreads / PETIT_WARP_SIZE;
constexpr int kRowListRounds = kRowListChunk / kRowListThreads;

PETIT_DEVICE int valid_expert(const RowListArgs& a, int entry) {
  if (entry >= a.num_entries) return -1;
  return local_expert_id(a.topk_ids, a.expert_map, a.num_global_experts, a.num_local_experts,
                         entry);
}

// Histogram of one chunk of entries -> workspace[chunk][expert].
PETIT_GLOBAL void __launch_bounds__(kRowListThreads) row_list_histogram_kernel(RowListArgs a) {
  __shared__ int32_t hist[kMaxExperts];
  for (int e = threadIdx.x; e < a.num_local_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int chunk_begin = blockIdx.x * kRowListChunk;
  for (int j = threadIdx.x; j < kRowListChunk; j += blockDim.x) {
    int e = valid_expert(a, chunk_begin + j);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  int32_t* out = a.workspace + int64_t(blockIdx.x) * a.num_local_experts;
  for (int e = threadIdx.x; e < a.num_local_experts; e += blockDim.x) out[e] = hist[e];
}

// One block: per expert, exclusive scan over chunks (in place), then over experts.
PETIT_GLOBAL void __launch_bounds__(kMaxExperts) row_list_scan_kernel(RowListArgs a,
                                                                      int num_chunks) {
  __shared__ int32_t totals[kMaxExperts];
  const int e = threadIdx.x;
  int32_t running = 0;
  if (e < a.num_local_experts) {
    for (int c = 0; c < num_chunks; ++c) {
      int32_t* slot = a.workspace + int64_t(c) * a.num_local_experts + e;
      int32_t v = *slot;
      *slot = running;
      running += v;
    }
    a.expert_counts[e] = running;
  }
  totals[e] = (e < a.num_local_experts) ? running : 0;
  __syncthreads();
  // Hillis-Steele inclusive scan over <= 512 experts.
  for (int offset = 1; offset < kMaxExperts; offset <<= 1) {
    int32_t add = (e >= offset) ? totals[e - offset] : 0;
    __syncthreads();
    totals[e] += add;
    __syncthreads();
  }
  if (e < a.num_local_experts) a.expert_offsets[e + 1] = totals[e];
  if (e == 0) a.expert_offsets[0] = 0;
}

// Scatter one chunk in entry order. Within a round of kRowListThreads entries, an entry's
// rank among equal experts = (equal lanes below it in its warp) + (equal entries of the
// warps before it) + (equal entries of earlier rounds and chunks).
PETIT_GLOBAL void __launch_bounds__(kRowListThreads) row_list_scatter_kernel(RowListArgs a) {
  __shared__ int32_t running[kMaxExperts];
  __shared__ int32_t warp_hist[kRowListWarps][kMaxExperts];
  const int warp = petit_warp_id();
  const int32_t* chunk_base = a.workspace + int64_t(blockIdx.x) * a.num_local_experts;
  for (int e = threadIdx.x; e < a.num_local_experts; e += blockDim.x) {
    running[e] = a.expert_offsets[e] + chunk_base[e];
    for (int w = 0; w < kRowListWarps; ++w) warp_hist[w][e] = 0;
  }
  __syncthreads();
  const int chunk_begin = blockIdx.x * kRowListChunk;
  const int total = a.expert_offsets[a.num_local_experts];
  for (int round = 0; round < kRowListRounds; ++round) {
    const int entry = chunk_begin + round * kRowListThreads + threadIdx.x;
    const int e = valid_expert(a, entry);
    const petit_lanemask_t same = petit_match_any(e);
    const int rank_in_warp = petit_popc(same & petit_lanemask_lt());
    const bool leader = (rank_in_warp == 0);
    if (e >= 0 && leader) warp_hist[warp][e] = petit_popc(same);
    __syncthreads();
    if (e >= 0) {
      int position = running[e] + rank_in_warp;
      for (int w = 0; w < warp; ++w) position += warp_hist[w][e];
      a.sorted_entries[position] = entry;
    }
    __syncthreads();
    if (e >= 0 && leader) {
      atomicAdd(&running[e], warp_hist[warp][e]);
      warp_hist[warp][e] = 0;
    }
    __syncthreads();
  }
  // Positions past the total are not written by any scatter: mark them -1.
  for (int j = threadIdx.x; j < kRowListChunk; j += blockDim.x) {
    int position = chunk_begin + j;
    if (position >= total && position < a.num_entries) a.sorted_entries[position] = -1;
  }
}

}  // namespace

petitError_t launch_expert_row_lists(const RowListArgs& a, petitStream_t stream) {
  if (a.num_local_experts < 1 || a.num_local_experts > kMaxExperts || a.num_entries < 0 ||
      (a.expert_map != nullptr && a.num_global_experts < 1))
    return petitErrorInvalidValue;
  const int num_chunks = ceil_div(a.num_entries > 0 ? a.num_entries : 1, kRowListChunk);
  petitLaunchKernel(row_list_histogram_kernel, dim3(num_chunks), dim3(kRowListThreads), 0,
                    stream, a);
  petitLaunchKernel(row_list_scan_kernel, dim3(1), dim3(kMaxExperts), 0, stream, a,
                    num_chunks);
  petitLaunchKernel(row_list_scatter_kernel, dim3(num_chunks), dim3(kRowListThreads), 0,
                    stream, a);
  return petitGetLastError();
}

}  // namespace petit
