// Push dispatch and combine over the linearized symmetric heap (one node, bf16 rows).
//
// Work is split into items (destination or source rank, token group of 32, hidden chunk)
// processed by a persistent grid; every item ends in one system-scope release of an
// epoch-tagged flag in the peer's heap (no remote atomics). Each kernel first does all its
// send items, then waits for its receive items: since all blocks are co-resident and sends
// never wait, every rank's sends complete and the waits terminate (or time out).
#include "api.h"
#include "common/check.h"
#include "common/expert_ids.h"
#include "common/fp8.h"
#include "comm/ep_sync.h"

namespace petit {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / PETIT_WARP_SIZE;
constexpr int kVecElems = 8;  // bf16 per 16-byte vector

// [begin, end) of hidden chunk `chunk` of `num_chunks`, in 16-byte vectors.
PETIT_DEVICE void chunk_range(int num_vectors, int chunk, int num_chunks, int* begin, int* end) {
  *begin = int(int64_t(num_vectors) * chunk / num_chunks);
  *end = int(int64_t(num_vectors) * (chunk + 1) / num_chunks);
}

// fp8 dispatch (fp8.h): a warp quantizes a bf16 row span at the source and writes e4m3
// bytes (8 per lane and 16-byte source vector) plus fp32 scales into the peer's heap.
constexpr int kVecPerScaleBlock = kFp8ScaleBlock / kVecElems;  // 16 vectors per 1x128 block
constexpr int kQuantUnroll = 4;

PETIT_DEVICE float bf16x8_to_float(const uint4& v, float (&f)[kVecElems]) {
  const petit_bf16_bits* h = reinterpret_cast<const petit_bf16_bits*>(&v);
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < kVecElems; ++e) {
    f[e] = petit_bf16_to_float(h[e]);
    amax = petit_fmax_nan(amax, fabsf(f[e]));  // NaN propagates (fp8.h)
  }
  return amax;
}

// q = sat(f * mul) or sat(f / div) (one of the two is used; see fp8.h), as 8 e4m3 bytes.
template <bool kDivide>
PETIT_DEVICE uint2 quantize_x8(const float (&f)[kVecElems], float scale_or_inverse) {
  uint2 packed;
  uint16_t* pairs = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
  for (int e = 0; e < kVecElems; e += 2) {
    float q0 = kDivide ? f[e] / scale_or_inverse : f[e] * scale_or_inverse;
    float q1 = kDivide ? f[e + 1] / scale_or_inverse : f[e + 1] * scale_or_inverse;
    q0 = petit_fp8_clamp(q0);  // NaN stays NaN (fp8.h)
    q1 = petit_fp8_clamp(q1);
    pairs[e / 2] = petit_float2_to_e4m3x2(q0, q1);
  }
  return packed;
}

// 1x128 blocks [blk_begin, blk_end) of one row: each group of 16 lanes owns one block per
// step (amax over its 16 vectors by shuffles), kQuantUnroll steps of loads in flight.
// kUe8m0: power-of-two scales (fp8.h).
template <bool kUe8m0>
PETIT_DEVICE void warp_quant_blocks(uint2* __restrict__ dst, float* __restrict__ scales,
                                    const uint4* __restrict__ src, int blk_begin, int blk_end,
                                    int lane) {
  constexpr int kBlocksPerStep = PETIT_WARP_SIZE / kVecPerScaleBlock;
  const int sub = lane / kVecPerScaleBlock, sub_lane = lane % kVecPerScaleBlock;
  for (int b0 = blk_begin; b0 < blk_end; b0 += kBlocksPerStep * kQuantUnroll) {  // warp-uniform
    uint4 v[kQuantUnroll];
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      const int b = b0 + u * kBlocksPerStep + sub;
      v[u] = b < blk_end ? src[int64_t(b) * kVecPerScaleBlock + sub_lane] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      const int b = b0 + u * kBlocksPerStep + sub;
      float f[kVecElems];
      float amax = bf16x8_to_float(v[u], f);
#pragma unroll
      for (int offset = kVecPerScaleBlock / 2; offset >= 1; offset /= 2)
        amax = petit_fmax_nan(amax, petit_shfl_xor(amax, offset));
      float scale = petit_fmax_nan(amax, kFp8BlockMinAmax) / kFp8E4m3Max;
      if (kUe8m0) scale = petit_pow2_ceil(scale);
      if (b < blk_end) {
        dst[int64_t(b) * kVecPerScaleBlock + sub_lane] = quantize_x8<true>(f, scale);
        if (sub_lane == 0) scales[b] = scale;
      }
    }
  }
}

// Per-token scale: the amax of the whole row (every chunk reads it; only chunk 0 stores the
// scale), then vectors [begin, end) quantized with the inverse scale.
PETIT_DEVICE void warp_quant_token(uint2* __restrict__ dst, float* __restrict__ scale_out,
                                   const uint4* __restrict__ src, int begin, int end,
                                   int num_vectors, int lane) {
  float amax = 0.f;
  for (int v = lane; v < num_vectors; v += PETIT_WARP_SIZE) {
    float f[kVecElems];
    amax = petit_fmax_nan(amax, bf16x8_to_float(src[v], f));
  }
#pragma unroll
  for (int offset = PETIT_WARP_SIZE / 2; offset >= 1; offset /= 2)
    amax = petit_fmax_nan(amax, petit_shfl_xor(amax, offset));
  const float scale = petit_fmax_nan(amax / kFp8E4m3Max, kFp8TokenMinScale);
  const float inverse = 1.0f / scale;
  if (scale_out != nullptr && lane == 0) *scale_out = scale;
  for (int v = begin + lane; v < end; v += PETIT_WARP_SIZE) {
    float f[kVecElems];
    bf16x8_to_float(src[v], f);
    dst[v] = quantize_x8<false>(f, inverse);
  }
}

// Send work of one item: its num_routed rows, each cut into `parts` spans of whole
// granules (1 vector, or a 1x128 scale block) when the block has fewer rows than warps, so
// that a decode step's few rows still keep every warp busy instead of one warp walking a
// whole row in dependent load/store steps. A span keeps >= kMinPartVectors vectors (two
// per lane) and at least one granule.
constexpr int kMinPartVectors = 2 * PETIT_WARP_SIZE;
PETIT_DEVICE int row_parts(int num_routed, int num_vectors, int granule) {
  if (num_routed <= 0 || num_routed >= kWarps) return 1;
  const int by_warps = kWarps / num_routed;
  const int by_size = min(num_vectors / kMinPartVectors, num_vectors / granule);
  return max(1, min(by_warps, by_size));
}
// [begin, end) of span `part` of `parts` within [begin, end), on granule boundaries
// (end - begin is a multiple of `granule`).
PETIT_DEVICE void part_range(int begin, int end, int granule, int part, int parts, int* part_begin,
                             int* part_end) {
  const int64_t granules = (end - begin) / granule;
  *part_begin = begin + int(granules * part / parts) * granule;
  *part_end = begin + int(granules * (part + 1) / parts) * granule;
}

// Called by thread 0 after the block's barrier and publish_fence over the block's writes of
// item (peer, group) (the barrier makes them thread 0's to publish): the last of
// `num_chunks` items of that (peer, group) publishes the flag. The counter is local and
// reset by its last user, so it is zero again for the next epoch. The other items' fences
// precede their increments, and this block's fence follows its increment, so their writes
// are ordered before the flag too.
PETIT_DEVICE void publish_item(uint32_t* done_counter, int num_chunks, uint64_t* remote_flag,
                               uint64_t flag_value) {
  if (num_chunks > 1) {
    if (petit_atomic_add_gpu(done_counter, 1) != uint32_t(num_chunks - 1)) return;
    *done_counter = 0;
    publish_fence();  // order the other blocks' (fenced) writes before the flag
  }
  publish_flag(remote_flag, flag_value);
}

template <typename IdT, int kQuant>
PETIT_GLOBAL void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchArgs a) {
  const EpContextArgs& c = a.ctx;
  const HeapLayout& l = c.layout;
  PETIT_SHARED(uint64_t, s_epoch);
  PETIT_SHARED(uint32_t, s_route_mask);
  if (threadIdx.x == 0) s_epoch = *((volatile uint64_t*)&c.state->epoch) + 1;
  __syncthreads();
  const uint64_t epoch = s_epoch;

  const int R = a.region_stride, K = a.top_k, W = c.world_size, L = c.num_local_experts;
  const int E = c.num_experts;
  const uint32_t tag = dispatch_flag_tag(R, K, kQuant);
  const int num_groups = ceil_div(R, kTokenGroupSize);
  const int num_vectors = l.hidden / kVecElems;
  const int num_chunks = a.num_chunks;
  const int lane = petit_lane_id(), warp = petit_warp_id();
  const IdT* ids = static_cast<const IdT*>(a.topk_ids);

  // ---- send: item = ((group * W) + peer_step) * num_chunks + chunk
  const int num_items = num_groups * W * num_chunks;
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int chunk = item % num_chunks;
    const int peer_step = (item / num_chunks) % W;
    const int group = item / (num_chunks * W);
    const int dst = (c.rank + 1 + peer_step) % W;  // peers first, self last
    char* dst_heap = rank_heap(c, dst);
    if (warp == 0) {
      // Lane t owns token group*32 + t: routing entries and the route bit for `dst`.
      const int token = group * kTokenGroupSize + lane;
      bool routed = false;
      if (lane < kTokenGroupSize && token < R) {
        const int64_t slot = (int64_t(c.rank) * R + token) * K;
        int32_t* dst_ids = reinterpret_cast<int32_t*>(dst_heap + l.dispatch_ids) + slot;
        float* dst_weights = reinterpret_cast<float*>(dst_heap + l.dispatch_weights) + slot;
        uint32_t rank_mask = 0;
        int dropped = 0;  // ids outside [-1, E): treated as -1 (expert_ids.h expert_owner)
        for (int k = 0; k < K; ++k) {
          int32_t local = -1;
          float weight = 0.f;
          if (token < a.num_tokens) {
            const int64_t id = int64_t(ids[int64_t(token) * K + k]);
            const int owner = expert_owner(id, E, L);
            dropped += (owner < 0 && id != -1);
            if (owner >= 0) {
              rank_mask |= 1u << owner;
              if (owner == dst) {
                local = int32_t(id - int64_t(dst) * L);
                weight = a.topk_weights[int64_t(token) * K + k];
              }
            }
          }
          routed |= (local >= 0);
          if (chunk == 0) {
            dst_ids[k] = local;
            dst_weights[k] = weight;
          }
        }
        if (chunk == 0 && dst == c.rank && token < a.num_tokens) {
          c.token_rank_mask[token] = rank_mask;
          // Counted once per slot (the item of this rank's own rows, chunk 0); an atomic on
          // pinned host memory only where such ids occur.
          if (dropped > 0) atomicAdd(&c.diagnostics->dropped_ids, dropped);
        }
      }
      const uint32_t mask = uint32_t(petit_ballot(routed));
      if (lane == 0) s_route_mask = mask;
    }
    __syncthreads();
    const uint32_t route_mask = s_route_mask;
    int begin, end;  // in 16-byte source vectors; whole 1x128 blocks in block mode
    constexpr bool kBlockQuant = is_block_quant(kQuant);
    if (kBlockQuant) {
      chunk_range(num_vectors / kVecPerScaleBlock, chunk, num_chunks, &begin, &end);
      begin *= kVecPerScaleBlock;
      end *= kVecPerScaleBlock;
    } else {
      chunk_range(num_vectors, chunk, num_chunks, &begin, &end);
    }
    const int num_routed = __popc(route_mask);
    constexpr int kGranule = kBlockQuant ? kVecPerScaleBlock : 1;
    const int parts = row_parts(num_routed, end - begin, kGranule);
    for (int unit = warp; unit < num_routed * parts; unit += kWarps) {
      const int part = unit % parts;
      const int token = group * kTokenGroupSize + nth_set_bit(route_mask, unit / parts);
      int part_begin, part_end;
      part_range(begin, end, kGranule, part, parts, &part_begin, &part_end);
      const uint4* src = reinterpret_cast<const uint4*>(a.x) + int64_t(token) * num_vectors;
      const int64_t row = int64_t(c.rank) * R + token;
      if (kQuant == kQuantNone) {
        uint4* dst_row = reinterpret_cast<uint4*>(dst_heap + l.dispatch_rows) + row * num_vectors;
        warp_copy(dst_row, src, part_begin, part_end, lane);
      } else {
        // e4m3 row = num_vectors 8-byte units (H bytes)
        uint2* dst_row = reinterpret_cast<uint2*>(dst_heap + l.dispatch_rows) + row * num_vectors;
        float* scales = reinterpret_cast<float*>(dst_heap + l.dispatch_scales);
        if (kBlockQuant)
          warp_quant_blocks<kQuant == kQuantFp8BlockUe8m0>(
              dst_row, scales + row * (num_vectors / kVecPerScaleBlock), src,
              part_begin / kVecPerScaleBlock, part_end / kVecPerScaleBlock, lane);
        else  // the span starting at vector 0 stores the row's scale
          warp_quant_token(dst_row, part_begin == 0 ? scales + row : nullptr, src, part_begin,
                           part_end, num_vectors, lane);
      }
    }
    __syncthreads();  // the block's row writes, then one system fence + flag by thread 0
    if (threadIdx.x == 0) {
      publish_fence();
      uint64_t* flag = reinterpret_cast<uint64_t*>(dst_heap + l.dispatch_flags) +
                       int64_t(c.rank) * l.max_groups + group;
      publish_item(c.group_done + int64_t(dst) * l.max_groups + group, num_chunks, flag,
                   make_flag(epoch, tag, __popc(route_mask)));
    }
  }

  // ---- receive: every (source, group) flag of this call must show the epoch.
  const uint64_t* my_flags =
      reinterpret_cast<const uint64_t*>(rank_heap(c, c.rank) + l.dispatch_flags);
  for (int f = blockIdx.x * blockDim.x + threadIdx.x; f < W * num_groups;
       f += gridDim.x * blockDim.x) {
    const int src = f / num_groups, group = f % num_groups;
    const uint64_t value =
        wait_flag(c, my_flags + int64_t(src) * l.max_groups + group, epoch, tag, src, 0, group);
    c.recv_group_counts[int64_t(src) * l.max_groups + group] = int32_t(flag_count(value));
  }

  // ---- advance the epoch once every block has read it (the last block to finish). Only
  // this GPU reads the epoch and the counts, so a device-scope fence orders them (the rows'
  // and flags' system-scope ordering is done above).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (petit_atomic_add_gpu(&c.state->blocks_done, 1) == gridDim.x - 1) {
      c.state->blocks_done = 0;
      *((volatile uint64_t*)&c.state->epoch) = epoch;
    }
  }
}

// Combine reduction of one item (own token group, hidden chunk) whose peer rows have landed:
// y[i] = sum over ranks d in mask(i), in rank order, of row i of d (the peer's push into my
// combine region, or my own expert_out for d == rank), accumulated in fp32. Work unit =
// (row, span of kReduceUnroll * warp-size vectors), one per warp at a time, so even a single
// token's row is spread over the block's warps; a row's rank mask is warp-uniform.
constexpr int kReduceUnroll = 6;  // 8 spills at the 128-register cap

PETIT_DEVICE void reduce_item(const CombineArgs& a, const uint4* combine_rows,
                              const uint4* own_rows, int group, int chunk, int num_vectors) {
  const EpContextArgs& c = a.ctx;
  const int W = c.world_size, R = a.region_stride;
  const int lane = petit_lane_id(), warp = petit_warp_id();
  int begin, end;
  chunk_range(num_vectors, chunk, a.num_reduce_chunks, &begin, &end);
  const int first_token = group * kTokenGroupSize;
  const int group_tokens = min(kTokenGroupSize, a.num_tokens - first_token);
  constexpr int kSpan = kReduceUnroll * PETIT_WARP_SIZE;
  const int spans = ceil_div(end - begin, kSpan);
  for (int unit = warp; unit < group_tokens * spans; unit += kWarps) {
    const int token = first_token + unit / spans;
    const int span_begin = begin + (unit % spans) * kSpan;
    const int span_end = min(end, span_begin + kSpan);
    const uint32_t mask = c.token_rank_mask[token];
    const int64_t row_offset = int64_t(token) * num_vectors;
    const int v0 = span_begin + lane;
    float acc[kReduceUnroll][kVecElems];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u)
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) acc[u][e] = 0.f;
    for (int d = 0; d < W; ++d) {  // rank order, fp32 accumulation
      if (!((mask >> d) & 1u)) continue;
      uint4 packed[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        const int v = v0 + u * PETIT_WARP_SIZE;
        if (v < span_end)
          packed[u] = d == c.rank ? own_rows[row_offset + v]
                                  : petit_load_cg(combine_rows + int64_t(d) * R * num_vectors +
                                                  row_offset + v);
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        if (v0 + u * PETIT_WARP_SIZE >= span_end) continue;
        const petit_bf16_bits* h = reinterpret_cast<const petit_bf16_bits*>(&packed[u]);
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) acc[u][e] += petit_bf16_to_float(h[e]);
      }
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      const int v = v0 + u * PETIT_WARP_SIZE;
      if (v >= span_end) continue;
      uint4 result;
      petit_bf16_bits* r = reinterpret_cast<petit_bf16_bits*>(&result);
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) r[e] = petit_float_to_bf16(acc[u][e]);
      reinterpret_cast<uint4*>(a.out)[row_offset + v] = result;
    }
  }
}

// The combine's optional timeline (CombineArgs::trace), written by thread 0 of each block into
// its row. Nothing is kept in registers (the trace pointer is read from the kernel parameters
// at each call), so the untraced kernel keeps its register allocation.
PETIT_DEVICE int64_t* combine_trace_row(const CombineArgs& a) {
  return a.trace != nullptr && threadIdx.x == 0
             ? a.trace + int64_t(blockIdx.x) * kCombineTraceSlots
             : nullptr;
}
PETIT_DEVICE void combine_trace_start(const CombineArgs& a) {
  if (int64_t* row = combine_trace_row(a)) {
    row[kTraceStart] = int64_t(petit_timer());
    for (int slot = kTraceFirstSend; slot < kCombineTraceSlots; ++slot) row[slot] = 0;
  }
}
PETIT_DEVICE void combine_trace_stamp(const CombineArgs& a, int slot) {
  if (int64_t* row = combine_trace_row(a)) row[slot] = int64_t(petit_timer());
}
// The timer for a later combine_trace_add (0 when not traced).
PETIT_DEVICE int64_t combine_trace_now(const CombineArgs& a) {
  return combine_trace_row(a) != nullptr ? int64_t(petit_timer()) : 0;
}
// Adds the ticks since `since` (a combine_trace_now) to `slot`.
PETIT_DEVICE void combine_trace_add(const CombineArgs& a, int slot, int64_t since) {
  if (int64_t* row = combine_trace_row(a)) row[slot] += int64_t(petit_timer()) - since;
}
// An item starts: the first one of its kind stamps `first_slot`; counted in `count_slot`.
PETIT_DEVICE void combine_trace_item(const CombineArgs& a, int first_slot, int count_slot) {
  if (int64_t* row = combine_trace_row(a)) {
    if (row[count_slot]++ == 0) row[first_slot] = int64_t(petit_timer());
  }
}

// Combine: blocks [0, num_send_blocks) push this rank's reduced rows back to their (remote)
// sources, group by group, each (group, hidden chunk) with its own flag; the other blocks,
// and each sender once its sends are done, claim reduce items (own group, chunk) in group
// order from a local counter, wait for the send chunks the item overlaps and reduce them
// (small calls, with a reduce-only block per item: each of those blocks reduces its own item
// and the senders stop after sending). So the reduction runs while the transfer does, on
// SMs the transfer does not need, and no wait can precede one of this rank's sends (a block
// only waits after its sends). A token's own-rank row is read straight from expert_out
// (never copied).
PETIT_GLOBAL void __launch_bounds__(kThreads, 1) combine_kernel(CombineArgs a) {
  const EpContextArgs& c = a.ctx;
  const HeapLayout& l = c.layout;
  PETIT_SHARED(uint32_t, s_route_mask);
  PETIT_SHARED(int, s_claim);
  // The epoch of the dispatch this combine answers (advanced by that dispatch).
  const uint64_t epoch = *((volatile uint64_t*)&c.state->epoch);
  combine_trace_start(a);

  const int R = a.region_stride, K = a.top_k, W = c.world_size;
  const int num_groups = ceil_div(R, kTokenGroupSize);
  const int num_vectors = l.hidden / kVecElems;
  const int num_chunks = a.num_chunks;
  const uint32_t tag = combine_flag_tag(R, K, num_chunks);
  const int lane = petit_lane_id(), warp = petit_warp_id();
  const char* my_heap = rank_heap(c, c.rank);
  const int32_t* recv_ids = reinterpret_cast<const int32_t*>(my_heap + l.dispatch_ids);

  // ---- send: reduced rows of remote source `src`'s tokens go back to src's combine region.
  // Pairs (group, peer_step), pair = group * (W-1) + peer_step, go out in order, so groups
  // complete in order: pairs [0, num_whole_pairs) as one item each (all num_chunks chunks,
  // one fence, a flag per chunk), the rest as num_chunks items of one chunk each.
  // Warp 0 reads the routing of the block's next item (the local ids the source sent with
  // token group*32 + lane: is the token routed here) into registers while the block copies the
  // current one, so an item starts without waiting for those loads.
  const int num_pairs = num_groups * (W - 1);
  const int num_whole = a.num_whole_pairs;
  const int num_items = num_whole + (num_pairs - num_whole) * num_chunks;
  const int send_stride = a.num_send_blocks;
  auto item_pair = [&](int item) {
    return item < num_whole ? item : num_whole + (item - num_whole) / num_chunks;
  };
  int32_t next_ids[kMaxTopK];  // warp 0: the routing ids of the next item's token `lane`
  auto load_ids = [&](int item) {
    const int pair = item_pair(item);
    const int src = (c.rank + 1 + pair % (W - 1)) % W;
    const int token = (pair / (W - 1)) * kTokenGroupSize + lane;
    const bool valid = lane < kTokenGroupSize && token < R;
    const int32_t* row_ids = recv_ids + (int64_t(src) * R + (valid ? token : 0)) * K;
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) next_ids[k] = valid && k < K ? row_ids[k] : -1;
  };
  if (warp == 0 && blockIdx.x < send_stride && int(blockIdx.x) < num_items)
    load_ids(blockIdx.x);
  for (int item = blockIdx.x; blockIdx.x < send_stride && item < num_items; item += send_stride) {
    const bool whole = item < num_whole;
    const int pair = item_pair(item);
    const int chunk = whole ? 0 : (item - num_whole) % num_chunks;
    const int peer_step = pair % (W - 1);
    const int group = pair / (W - 1);
    const int src = (c.rank + 1 + peer_step) % W;
    char* src_heap = rank_heap(c, src);
    if (warp == 0) {
      bool routed = false;
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) routed |= (next_ids[k] >= 0);
      const uint32_t mask = uint32_t(petit_ballot(routed));
      if (lane == 0) s_route_mask = mask;
      if (item + send_stride < num_items) load_ids(item + send_stride);
    }
    __syncthreads();
    combine_trace_item(a, kTraceFirstSend, kTraceSendItems);
    const uint32_t route_mask = s_route_mask;
    int begin = 0, end = num_vectors;
    if (!whole) chunk_range(num_vectors, chunk, num_chunks, &begin, &end);
    const int num_routed = __popc(route_mask);
    const int parts = row_parts(num_routed, end - begin, 1);
    for (int unit = warp; unit < num_routed * parts; unit += kWarps) {
      const int token = group * kTokenGroupSize + nth_set_bit(route_mask, unit / parts);
      int part_begin, part_end;
      part_range(begin, end, 1, unit % parts, parts, &part_begin, &part_end);
      const uint4* row = reinterpret_cast<const uint4*>(a.expert_out) +
                         (int64_t(src) * R + token) * num_vectors;
      uint4* dst_row = reinterpret_cast<uint4*>(src_heap + l.combine_rows) +
                       (int64_t(c.rank) * R + token) * num_vectors;
      warp_copy(dst_row, row, part_begin, part_end, lane);
    }
    __syncthreads();  // the block's row writes, then one system fence by thread 0
    if (threadIdx.x == 0) {
      // Every chunk its own flag (the reductions wait for the chunks they read): no
      // completion counter and no second fence between the last chunk and the flag. A whole
      // pair raises all its chunks' flags after the one fence.
      publish_fence();
      uint64_t* flags = reinterpret_cast<uint64_t*>(src_heap + l.combine_flags) +
                        (int64_t(c.rank) * l.max_groups + group) * l.max_chunks;
      const uint64_t value = make_flag(epoch, tag, __popc(route_mask));
      if (whole) {
        for (int f = 0; f < num_chunks; ++f) petit_store_relaxed_sys(flags + f, value);
      } else {
        publish_flag(flags + chunk, value);
      }
      combine_trace_stamp(a, kTraceSendsDone);
    }
  }

  // ---- reduce
  const uint64_t* my_flags = reinterpret_cast<const uint64_t*>(my_heap + l.combine_flags);
  const uint4* combine_rows = reinterpret_cast<const uint4*>(my_heap + l.combine_rows);
  const uint4* own_rows =
      reinterpret_cast<const uint4*>(a.expert_out) + int64_t(c.rank) * R * num_vectors;
  const int num_reduce_chunks = a.num_reduce_chunks;
  const int num_reduce = ceil_div(a.num_tokens, kTokenGroupSize) * num_reduce_chunks;
  // Waits until the peers' send chunks of `item`'s group that overlap its hidden range have
  // landed (a reduce chunk lies in one or two send chunks), then reduces it.
  auto wait_and_reduce = [&](int item) {
    const int group = item / num_reduce_chunks, reduce_chunk = item % num_reduce_chunks;
    int begin, end;
    chunk_range(num_vectors, reduce_chunk, num_reduce_chunks, &begin, &end);
    const int64_t claimed_at = combine_trace_now(a);
    {  // the own rows are there already: into L2 while the peers' land
      const int first_token = group * kTokenGroupSize;
      const int rows = min(kTokenGroupSize, a.num_tokens - first_token);
      constexpr int kLineVectors = 128 / 16;
      const int lines = ceil_div(end - begin, kLineVectors);
      for (int t = threadIdx.x; t < rows * lines; t += blockDim.x)
        petit_prefetch_l2(own_rows + int64_t(first_token + t / lines) * num_vectors + begin +
                          (t % lines) * kLineVectors);
    }
    for (int t = threadIdx.x; t < W * num_chunks; t += blockDim.x) {
      const int peer = t / num_chunks, chunk = t % num_chunks;
      int send_begin, send_end;
      chunk_range(num_vectors, chunk, num_chunks, &send_begin, &send_end);
      if (peer != c.rank && send_begin < end && begin < send_end)
        wait_flag(c, my_flags + (int64_t(peer) * l.max_groups + group) * l.max_chunks + chunk,
                  epoch, tag, peer, 1, group);
    }
    __syncthreads();  // the rows are visible (and, claiming, every thread has read s_claim)
    combine_trace_add(a, kTraceReduceWait, claimed_at);
    combine_trace_item(a, kTraceFirstReduceReady, kTraceReduceItems);
    const int64_t ready_at = combine_trace_now(a);
    reduce_item(a, combine_rows, own_rows, group, reduce_chunk, num_vectors);
    combine_trace_add(a, kTraceReduceWork, ready_at);
    combine_trace_stamp(a, kTraceLastReduceDone);
  };
  // A reduce-only block for every item (small calls): each block its own item, no claim
  // counter to read first and none to reset last, so the kernel ends when the last
  // reduction does (the senders only send).
  if (a.static_reduce) {
    const int item = int(blockIdx.x) - a.num_send_blocks;
    if (item >= 0 && item < num_reduce) wait_and_reduce(item);
  } else {
    // Otherwise every block claims items in group order until none is left.
    while (true) {
      if (threadIdx.x == 0) s_claim = int(petit_atomic_add_gpu(&c.state->reduce_next, 1));
      __syncthreads();
      const int item = s_claim;
      if (item >= num_reduce) break;  // block-uniform
      wait_and_reduce(item);
    }
    // ---- the last block to finish resets the claim counter for the next combine (every
    // block's final, failed claim precedes its increment here).
    if (threadIdx.x == 0) {
      __threadfence();
      if (petit_atomic_add_gpu(&c.state->combine_done, 1) == gridDim.x - 1) {
        c.state->reduce_next = 0;
        c.state->combine_done = 0;
      }
    }
  }
  // A rank without tokens reduces nothing and so would wait for no peer: its next dispatch
  // could then overwrite its flag in a peer whose dispatch of this epoch has not read it yet
  // (that peer then waits for an epoch the flag no longer shows: a hang of live ranks). So
  // block 0 waits for one flag of each peer's combine (group 0, chunk 0: every peer sends
  // every group of the region stride to every source, whatever its tokens), raised only after
  // that peer's dispatch of this epoch completed. With tokens, the reductions wait for these.
  if (num_reduce == 0 && blockIdx.x == 0) {
    for (int peer = threadIdx.x; peer < W; peer += blockDim.x)
      if (peer != c.rank)
        wait_flag(c, my_flags + int64_t(peer) * l.max_groups * l.max_chunks, epoch, tag, peer,
                  1, 0);
  }
  combine_trace_stamp(a, kTraceEnd);
}

PETIT_GLOBAL void __launch_bounds__(kThreads, 1) peer_write_kernel(PeerWriteArgs a) {
  const int num_vectors = int(a.bytes_per_peer / 16);
  const int lane = petit_lane_id(), warp = petit_warp_id();
  const int global_warp = blockIdx.x * kWarps + warp, num_warps = gridDim.x * kWarps;
  // Split the vectors of every peer into warp-sized spans of 4 KB, interleaved over peers.
  constexpr int kSpan = 256;
  const int spans_per_peer = ceil_div(num_vectors, kSpan);
  for (int s = global_warp; s < spans_per_peer * (a.world_size - 1); s += num_warps) {
    const int peer = (a.rank + 1 + s % (a.world_size - 1)) % a.world_size;
    const int span = s / (a.world_size - 1);
    uint4* dst = reinterpret_cast<uint4*>(a.heap_base + int64_t(peer) * a.heap_stride +
                                          a.heap_offset);
    warp_copy(dst, static_cast<const uint4*>(a.src), span * kSpan,
              min(num_vectors, (span + 1) * kSpan), lane);
  }
}

// Most hidden chunks of a send item that keep >= kMinChunkVectors vectors (layout.h) of a
// token group's rows (0 when even one chunk holds fewer).
int max_size_chunks(int region_stride, int num_vectors) {
  const int group_rows = region_stride < kTokenGroupSize ? region_stride : kTokenGroupSize;
  return int(int64_t(group_rows) * num_vectors / kMinChunkVectors);
}

// Hidden chunks per (peer, group) item, so that small calls still spread over the grid; each
// keeps >= kMinChunkVectors vectors, so there are at most max_group_chunks(H).
int choose_num_chunks(int region_stride, int num_peers, int num_vectors, int num_blocks) {
  const int num_groups = ceil_div(region_stride, kTokenGroupSize);
  const int items = num_groups * (num_peers > 0 ? num_peers : 1);
  const int max_chunks = max_size_chunks(region_stride, num_vectors);
  const int chunks = ceil_div(num_blocks, items);
  return chunks < 1 ? 1 : (chunks > max_chunks ? (max_chunks > 1 ? max_chunks : 1) : chunks);
}

// Blocks of the combine grid that may push rows (the rest only reduce, from the start):
// all but config.reduce_pct percent of the grid.
int combine_send_blocks(const CombineConfig& config, int num_blocks) {
  const int senders = num_blocks - num_blocks * config.reduce_pct / 100;
  return senders < 1 ? 1 : senders;
}

// Hidden chunks of one reduce item (own token group), at least the send chunks: a group's
// reduction is cut into chunks of <= config.reduce_vectors vectors per row (0: the send
// chunks), so that the last groups to land are reduced by many blocks instead of one (at 4096
// tokens/rank a whole-group item moves ~1.4 MB); but every item costs a claim, flag reads and
// barriers, so the chunks stop at about config.reduce_items items per block of the grid (0: no
// such bound). The chunking does not change any output bit (every element is summed in the
// same fixed order).
int combine_reduce_chunks(const CombineConfig& config, int num_chunks, int num_vectors,
                          int num_groups, int num_blocks) {
  const int reduce_vectors = config.reduce_vectors;
  const int items_per_block = config.reduce_items;
  if (reduce_vectors <= 0) return num_chunks;
  int chunks = ceil_div(num_vectors, reduce_vectors);
  if (items_per_block > 0 && num_groups > 0) {
    const int64_t bound = (int64_t(items_per_block) * num_blocks + num_groups - 1) / num_groups;
    if (bound < chunks) chunks = int(bound);
  }
  return chunks > num_chunks ? chunks : num_chunks;
}

// Tail split of large combines (config.tail_chunks; 0 or 1 = off): when every (group, peer)
// pair is one send item and the pairs take at most kTailSplitMaxRounds rounds of >=
// kTailSplitMinSenders senders, the last round's pairs go out in that many hidden chunks each
// (within the flag slots and the chunk size bound). The last round's rows then land in
// sub-rounds instead of all at the end, and only the last sub-round's reduction runs after
// the transfer. Few senders keep every pair whole: each extra item costs its sender a
// route-mask read, two barriers and a fence (docs/experiments/combine-reduction.md). Returns
// the chunks, or 0 for none.
constexpr int kTailSplitMaxRounds = 3;
constexpr int kTailSplitMinSenders = 48;
int combine_tail_chunks(const CombineConfig& config, int send_chunks, int64_t rounds,
                        int senders, int region_stride, int num_vectors, int max_chunks) {
  const int tail_chunks = config.tail_chunks;
  if (send_chunks != 1 || rounds < 1 || rounds > kTailSplitMaxRounds ||
      senders < kTailSplitMinSenders)
    return 0;
  int chunks = tail_chunks < max_chunks ? tail_chunks : max_chunks;
  const int size_bound = max_size_chunks(region_stride, num_vectors);
  if (chunks > size_bound) chunks = size_bound;
  return chunks >= 2 ? chunks : 0;
}

// What a dispatch and a combine both need of the context and the call: a co-resident grid,
// 1 <= top-k <= layout.max_top_k and tokens <= region stride <= layout.max_tokens.
petitError_t check_call(const EpContextArgs& c, int region_stride, int num_tokens, int top_k,
                        char* err, int err_len) {
  if (c.num_blocks < 1 || c.world_size < 1 || c.world_size > kMaxWorldSize ||
      c.layout.hidden % kVecElems != 0)
    return refuse(err, err_len, "context: %d blocks, world size %d, hidden size %d", c.num_blocks,
                  c.world_size, c.layout.hidden);
  if (top_k < 1 || top_k > c.layout.max_top_k)
    return refuse(err, err_len, "top-k %d outside [1, %d]", top_k, c.layout.max_top_k);
  if (num_tokens < 0 || region_stride < num_tokens || region_stride > c.layout.max_tokens)
    return refuse(err, err_len,
                  "need tokens (%d) <= region stride (%d) <= max tokens per rank (%d)",
                  num_tokens, region_stride, c.layout.max_tokens);
  return petitSuccess;
}

}  // namespace

petitError_t dispatch_check(const DispatchArgs& a, char* err, int err_len) {
  const petitError_t e = check_call(a.ctx, a.region_stride, a.num_tokens, a.top_k, err, err_len);
  if (e != petitSuccess) return e;
  if (a.quant < kQuantNone || a.quant > kQuantFp8BlockUe8m0)
    return refuse(err, err_len, "quant %d is not a DispatchQuant", a.quant);
  if (is_block_quant(a.quant) && a.ctx.layout.hidden % kFp8ScaleBlock != 0)
    return refuse(err, err_len,
                  "fp8 1x128 block dispatch needs a hidden size that is a multiple of %d, got %d",
                  kFp8ScaleBlock, a.ctx.layout.hidden);
  return petitSuccess;
}

petitError_t combine_check(const CombineArgs& a, char* err, int err_len) {
  const petitError_t e = check_call(a.ctx, a.region_stride, a.num_tokens, a.top_k, err, err_len);
  if (e != petitSuccess) return e;
  if (!config_valid(a.config))
    return refuse(err, err_len, "%s", kCombineConfigLimits);
  return petitSuccess;
}

petitError_t launch_dispatch(const DispatchArgs& args, petitStream_t stream) {
  const petitError_t err = dispatch_check(args, nullptr, 0);
  if (err != petitSuccess) return err;
  DispatchArgs a = args;
  a.num_chunks = choose_num_chunks(a.region_stride, a.ctx.world_size,
                                   a.ctx.layout.hidden / kVecElems, a.ctx.num_blocks);
  // No more blocks than send items (small calls launch, fence and count less).
  const int64_t send_items = int64_t(ceil_div(a.region_stride, kTokenGroupSize)) *
                             a.ctx.world_size * a.num_chunks;
  const int grid = int(send_items < a.ctx.num_blocks ? (send_items > 0 ? send_items : 1)
                                                     : a.ctx.num_blocks);
  using Kernel = void (*)(DispatchArgs);
  static const Kernel kernels[4][2] = {
      {dispatch_kernel<int32_t, kQuantNone>, dispatch_kernel<int64_t, kQuantNone>},
      {dispatch_kernel<int32_t, kQuantFp8Block>, dispatch_kernel<int64_t, kQuantFp8Block>},
      {dispatch_kernel<int32_t, kQuantFp8Token>, dispatch_kernel<int64_t, kQuantFp8Token>},
      {dispatch_kernel<int32_t, kQuantFp8BlockUe8m0>,
       dispatch_kernel<int64_t, kQuantFp8BlockUe8m0>}};
  const Kernel kernel = kernels[a.quant][a.ids_are_int64 ? 1 : 0];
  petitLaunchKernel(kernel, dim3(grid), dim3(kThreads), 0, stream, a);
  return petitGetLastError();
}

petitError_t plan_combine(CombineArgs* args, int* grid) {
  const petitError_t err = combine_check(*args, nullptr, 0);
  if (err != petitSuccess) return err;
  CombineArgs& a = *args;
  const int max_senders = combine_send_blocks(a.config, a.ctx.num_blocks);
  a.num_chunks = choose_num_chunks(a.region_stride, a.ctx.world_size - 1,
                                   a.ctx.layout.hidden / kVecElems, max_senders);
  // Senders: no more than send items; reduce-only blocks: the rest of the grid, but no more
  // than reduce items (small calls launch, fence and count less).
  const int num_vectors = a.ctx.layout.hidden / kVecElems;
  const int64_t num_pairs =
      int64_t(ceil_div(a.region_stride, kTokenGroupSize)) * (a.ctx.world_size - 1);
  const int64_t send_items = num_pairs * a.num_chunks;
  // Equal rounds: e.g. 128 items on at most 99 senders would leave a second round of 29
  // blocks, too few to keep the links busy; 64 senders do two full rounds and the other
  // blocks reduce.
  const int64_t rounds = (send_items + max_senders - 1) / max_senders;
  a.num_send_blocks = int(rounds > 0 ? (send_items + rounds - 1) / rounds : 0);
  // The tail split: the last round's pairs (as many as senders) in chunks, the others whole.
  a.num_whole_pairs = 0;
  const int tail_chunks = combine_tail_chunks(a.config, a.num_chunks, rounds, a.num_send_blocks,
                                              a.region_stride, num_vectors,
                                              a.ctx.layout.max_chunks);
  if (tail_chunks > 0) {
    a.num_whole_pairs = int(num_pairs - a.num_send_blocks);
    a.num_chunks = tail_chunks;
  }
  if (a.num_chunks > a.ctx.layout.max_chunks) return petitErrorInvalidValue;  // flag slots
  const int reduce_groups = ceil_div(a.num_tokens, kTokenGroupSize);
  a.num_reduce_chunks =
      combine_reduce_chunks(a.config, a.num_chunks, num_vectors, reduce_groups,
                            a.ctx.num_blocks);
  const int64_t reduce_items = int64_t(reduce_groups) * a.num_reduce_chunks;
  const int64_t reducers_left = a.ctx.num_blocks - a.num_send_blocks;
  const int64_t reducers = reduce_items < reducers_left ? reduce_items : reducers_left;
  // Small calls give each reduce item its own reduce-only block (see combine_kernel).
  a.static_reduce = reduce_items <= reducers_left ? 1 : 0;
  *grid = int(a.num_send_blocks + reducers > 0 ? a.num_send_blocks + reducers : 1);
  return petitSuccess;
}

petitError_t plan_combine_sizes(int world_size, int hidden, int num_tokens, int region_stride,
                                int num_blocks, const CombineConfig& config, CombineArgs* plan,
                                int* grid, char* err, int err_len) {
  if (world_size < 2 || world_size > kMaxWorldSize)
    return refuse(err, err_len, "world size %d outside [2, %d]", world_size, kMaxWorldSize);
  if (hidden <= 0 || hidden % kVecElems != 0)
    return refuse(err, err_len, "hidden size %d must be a positive multiple of %d", hidden,
                  kVecElems);
  if (region_stride < 1 || num_tokens < 0 || num_tokens > region_stride)
    return refuse(err, err_len,
                  "need 0 <= num_tokens (%d) <= region_stride (%d), region_stride >= 1",
                  num_tokens, region_stride);
  if (num_blocks < 1) return refuse(err, err_len, "num_blocks %d must be >= 1", num_blocks);
  CombineArgs& a = *plan;
  a = CombineArgs{};
  a.ctx.layout = make_heap_layout(world_size, region_stride, hidden, 1);
  a.ctx.world_size = world_size;
  a.ctx.num_blocks = num_blocks;
  a.num_tokens = num_tokens;
  a.top_k = 1;
  a.region_stride = region_stride;
  a.config = config;
  const petitError_t refused = combine_check(a, err, err_len);
  if (refused != petitSuccess) return refused;
  const petitError_t planned = plan_combine(&a, grid);
  if (planned != petitSuccess)
    return refuse(err, err_len, "combine plan failed: %s", petitGetErrorString(planned));
  return petitSuccess;
}

petitError_t launch_combine(const CombineArgs& args, petitStream_t stream) {
  CombineArgs a = args;
  int grid = 0;
  const petitError_t err = plan_combine(&a, &grid);
  if (err != petitSuccess) return err;
  petitLaunchKernel(combine_kernel, dim3(grid), dim3(kThreads), 0, stream, a);
  return petitGetLastError();
}

petitError_t launch_peer_write(const PeerWriteArgs& a, petitStream_t stream) {
  if (a.world_size < 2 || a.bytes_per_peer % 16 != 0 || a.num_blocks < 1)
    return petitErrorInvalidValue;
  petitLaunchKernel(peer_write_kernel, dim3(a.num_blocks), dim3(kThreads), 0, stream, a);
  return petitGetLastError();
}

}  // namespace petit
