// Block-wide exclusive prefix sum, shared by the expert tile scheduler (gemm/scheduler.h: m-tile
// prefix over experts) and the row lists (routing.cu: entry offsets over experts).
#pragma once

#include "common/platform.h"

namespace petit {

// Thread t of the block's kThreads threads holds items[0, kItems) (e.g. kItems consecutive
// experts); every thread must call it (it contains barriers). Returns the sum of the items of
// the threads below t; *total gets the sum of all items. An inclusive Hillis-Steele scan of
// the per-thread sums in `thread_sums` ([kThreads] shared memory), which stays in use until the
// caller's next __syncthreads.
template <int kThreads, int kItems>
PETIT_DEVICE int32_t block_exclusive_scan(const int32_t (&items)[kItems], int32_t* thread_sums,
                                          int32_t* total) {
  int32_t thread_sum = 0;
#pragma unroll
  for (int i = 0; i < kItems; ++i) thread_sum += items[i];
  thread_sums[threadIdx.x] = thread_sum;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset <<= 1) {
    const int32_t add = int(threadIdx.x) >= offset ? thread_sums[threadIdx.x - offset] : 0;
    __syncthreads();
    thread_sums[threadIdx.x] += add;
    __syncthreads();
  }
  *total = thread_sums[kThreads - 1];
  return thread_sums[threadIdx.x] - thread_sum;
}

}  // namespace petit
