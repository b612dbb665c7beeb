// Destination-side routing block -> per-local-expert row lists: a stable counting sort with
// device-side counts only. Up to kRowListChunk entries (decode sizes) one block does it all in
// one launch; beyond, three launches (chunk histograms, one scan block, chunk scatter).
#include "api.h"
#include "common/block_scan.h"
#include "common/expert_ids.h"

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
  __shared__ int32_t thread_sums[kMaxExperts];
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
    if (a.expert_done != nullptr) a.expert_done[e] = 0;
  }
  if (e == 0 && a.expert_done != nullptr) a.expert_done[a.num_local_experts] = 0;
  const int32_t count[1] = {e < a.num_local_experts ? running : 0};
  int32_t total;
  const int32_t before = block_exclusive_scan<kMaxExperts, 1>(count, thread_sums, &total);
  if (e < a.num_local_experts) a.expert_offsets[e + 1] = before + count[0];
  if (e == 0) a.expert_offsets[0] = 0;
}

// Scatter one chunk in entry order (block-wide). Within a round of kRowListThreads entries, an
// entry's rank among equal experts = (equal lanes below it in its warp) + (equal entries of
// the warps before it) + (equal entries of earlier rounds and chunks). running[e]: position of
// the chunk's first entry of expert e (advanced here); warp_hist: zeros (left zeroed); total:
// offsets[L]. Positions of the chunk past the total get -1 (no scatter writes them).
PETIT_DEVICE void scatter_chunk(const RowListArgs& a, int chunk_begin, int total,
                                int32_t* running, int32_t (*warp_hist)[kMaxExperts]) {
  const int warp = petit_warp_id();
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
  for (int j = threadIdx.x; j < kRowListChunk; j += blockDim.x) {
    int position = chunk_begin + j;
    if (position >= total && position < a.num_entries) a.sorted_entries[position] = -1;
  }
}

PETIT_GLOBAL void __launch_bounds__(kRowListThreads) row_list_scatter_kernel(RowListArgs a) {
  __shared__ int32_t running[kMaxExperts];
  __shared__ int32_t warp_hist[kRowListWarps][kMaxExperts];
  const int32_t* chunk_base = a.workspace + int64_t(blockIdx.x) * a.num_local_experts;
  for (int e = threadIdx.x; e < a.num_local_experts; e += blockDim.x) {
    running[e] = a.expert_offsets[e] + chunk_base[e];
    for (int w = 0; w < kRowListWarps; ++w) warp_hist[w][e] = 0;
  }
  __syncthreads();
  scatter_chunk(a, blockIdx.x * kRowListChunk, a.expert_offsets[a.num_local_experts], running,
                warp_hist);
}

// All of it for <= kRowListChunk entries, in one block: histogram in shared memory, counts
// and offsets (an exclusive scan over the experts, kExpertsPerThread consecutive experts per
// thread), then the scatter of the one chunk. Same results as the three launches.
constexpr int kExpertsPerThread = kMaxExperts / kRowListThreads;
static_assert(kExpertsPerThread * kRowListThreads == kMaxExperts, "whole experts per thread");

PETIT_GLOBAL void __launch_bounds__(kRowListThreads) row_list_one_block_kernel(RowListArgs a) {
  __shared__ int32_t running[kMaxExperts];  // counts, then first positions
  __shared__ int32_t warp_hist[kRowListWarps][kMaxExperts];
  __shared__ int32_t thread_sums[kRowListThreads];
  for (int e = threadIdx.x; e < kMaxExperts; e += blockDim.x) {
    running[e] = 0;
    for (int w = 0; w < kRowListWarps; ++w) warp_hist[w][e] = 0;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < a.num_entries; j += blockDim.x) {
    const int e = valid_expert(a, j);
    if (e >= 0) atomicAdd(&running[e], 1);
  }
  __syncthreads();
  // Exclusive scan of the counts over the experts (experts past L count 0).
  const int first = threadIdx.x * kExpertsPerThread;
  int32_t counts[kExpertsPerThread];
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) counts[i] = running[first + i];
  int32_t total;
  int32_t position =
      block_exclusive_scan<kRowListThreads, kExpertsPerThread>(counts, thread_sums, &total);
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = first + i;
    if (e < a.num_local_experts) {
      a.expert_counts[e] = counts[i];
      a.expert_offsets[e] = position;
      if (a.expert_done != nullptr) a.expert_done[e] = 0;
      running[e] = position;  // only this thread reads / writes experts [first, first + n)
    }
    position += counts[i];
  }
  if (threadIdx.x == 0) {
    a.expert_offsets[a.num_local_experts] = total;
    if (a.expert_done != nullptr) a.expert_done[a.num_local_experts] = 0;
  }
  __syncthreads();
  scatter_chunk(a, 0, total, running, warp_hist);
}

}  // namespace

petitError_t row_lists_check(const RowListArgs& a, char* err, int err_len) {
  if (a.num_local_experts < 1 || a.num_local_experts > kMaxExperts)
    return refuse(err, err_len, "num_local_experts %d outside [1, %d]", a.num_local_experts,
                  kMaxExperts);
  if (a.num_entries < 0)
    return refuse(err, err_len, "%d routing entries must be >= 0", a.num_entries);
  if (a.expert_map != nullptr && a.num_global_experts < 1)
    return refuse(err, err_len, "an expert_map needs >= 1 entries, got %d",
                  a.num_global_experts);
  return petitSuccess;
}

petitError_t launch_expert_row_lists(const RowListArgs& a, petitStream_t stream) {
  const petitError_t err = row_lists_check(a, nullptr, 0);
  if (err != petitSuccess) return err;
  const int num_chunks = ceil_div(a.num_entries > 0 ? a.num_entries : 1, kRowListChunk);
  if (num_chunks == 1) {  // decode sizes: one launch instead of three
    petitLaunchKernel(row_list_one_block_kernel, dim3(1), dim3(kRowListThreads), 0, stream, a);
    return petitGetLastError();
  }
  petitLaunchKernel(row_list_histogram_kernel, dim3(num_chunks), dim3(kRowListThreads), 0,
                    stream, a);
  petitLaunchKernel(row_list_scan_kernel, dim3(1), dim3(kMaxExperts), 0, stream, a,
                    num_chunks);
  petitLaunchKernel(row_list_scatter_kernel, dim3(num_chunks), dim3(kRowListThreads), 0,
                    stream, a);
  return petitGetLastError();
}

}  // namespace petit
