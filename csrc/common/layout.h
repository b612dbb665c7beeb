// Symmetric-heap layout of one EpBuffer, shared by the allocator (host) and the kernels
// (device), so the two can never disagree on an offset. See docs/architecture.md.
#pragma once

#include "common/platform.h"

namespace petit {

constexpr int kTokenGroupSize = 32;    // tokens per readiness flag
constexpr int kMaxTopK = 16;
constexpr int kMaxWorldSize = 32;      // token -> rank masks are uint32
constexpr int kMaxExperts = 512;
constexpr int kSizeMultiple = 8;       // H and I: multiples of one 16-byte vector of bf16
constexpr int kMegaMoeMaxEntries = 2048;  // fused layer: N*K, sorted in shared memory
constexpr int kMegaMoeSizeMultiple = 64;  // fused layer: H and I, whole 64-k TMA box rows
// Fused layer's optional trace (MegaMoeArgs::trace): per block, timer stamps of entry (after
// griddepcontrol.wait: the previous kernel has completed), routing
// done, exit, the count of tasks, the routing's steps (rows' ids read -- at EP after every
// rank's rows arrived --, expert counts and offsets known, the first weight loads issued),
// then (task, ready, done) of its first kMegaMoeTraceTasks, then (wait begun, weights in) of
// the first kMegaMoeTraceSteps weight ring steps of its warp 0 with e4m3 weights (W = 1).
constexpr int kMegaMoeTraceHeader = 7;
constexpr int kMegaMoeTraceTasks = 32;
constexpr int kMegaMoeTraceSteps = 64;
constexpr int kMegaMoeTraceSlots =
    kMegaMoeTraceHeader + 3 * kMegaMoeTraceTasks + 2 * kMegaMoeTraceSteps;
constexpr int kMegaMoeBlocksPerSm = 2;  // fused layer's grid: up to this many blocks per SM
constexpr int kRegionAlignment = 256;  // bytes; keeps every region 16-byte vector aligned
constexpr int kFp8ScaleBlock = 128;   // elements per fp8 scale (1x128 block quantization)
// The most tokens per rank of a buffer, so the most a region stride can be: the call tag
// carries the stride in full (layout.h call_tag), in 16 bits.
constexpr int kMaxTokensPerRank = 65536;
// A readiness flag (u64) = epoch << kFlagEpochShift | call tag << kFlagCountBits | count:
// the count of rows routed in the group (0..32), the tag of the call that raised it (call_tag:
// its kind, region stride in full, top-k and wire format or send chunks), and the low
// kFlagEpochBits bits of the epoch (the call's sequence number: every dispatch or fused call
// takes the next, a combine shares its dispatch's). A waiter that finds its epoch with another
// tag knows the peer made a different call (region stride, top-k, quant) and fails with that,
// instead of reading rows at the wrong offsets. Epochs compare modulo 2^kFlagEpochBits (2^33
// dispatches: 33 days at 3000 calls/s; only equality and the order of the freshest flags are
// ever read, flag_epoch_after).
constexpr int kFlagCountBits = 6;
constexpr int kFlagTagBits = 25;
constexpr int kFlagEpochShift = 31;
constexpr int kFlagEpochBits = 33;
static_assert(kFlagEpochShift == kFlagCountBits + kFlagTagBits &&
                  kFlagEpochBits == 64 - kFlagEpochShift,
              "flag = epoch | tag | count fills 64 bits");
// Bound of every spin-wait (seconds; EpBuffer's timeout_s, megamoe_forward's,
// VLLM_PETIT_MOE_TIMEOUT_S): kDefaultTimeoutS where the caller gives none; finite, > 0 and at
// most kMaxTimeoutS (timeout_s_valid; api.h timeout_check gives the message).
constexpr float kDefaultTimeoutS = 30.0f;
constexpr float kMaxTimeoutS = 3600.0f;
// NaN fails both comparisons; 0 would fail every wait at once, inf would never end one.
inline bool timeout_s_valid(double timeout_s) {
  return timeout_s > 0.0 && timeout_s <= kMaxTimeoutS;
}
// Bound of a dispatch/combine wait on a peer whose process is alive (its heartbeat moves):
// EpBuffer's max_wait_s, in [timeout_s, kMaxWaitS] seconds.
constexpr float kMaxWaitS = 86400.0f;
// A send item (token group, hidden chunk) keeps >= kMinChunkVectors 16-byte vectors (32 KB) of
// the group's rows: splitting less data only adds a fence and a flag to the latency. (More,
// smaller items to fill the grid's last round cost more than they gained: 2x H200, commit
// fb2cba5, dispatch at 4096 tokens/rank on 24 SMs 238 -> 414 us with 3 chunks instead of 1.)
constexpr int kMinChunkVectors = 2048;

// The most hidden chunks of one token group's rows for bf16 rows of `hidden` elements (a full
// group of kTokenGroupSize rows of hidden / 8 vectors, kMinChunkVectors each): the combine
// flags have one slot per chunk.
PETIT_HOST_DEVICE int max_group_chunks(int hidden) {
  const int chunks = int(int64_t(kTokenGroupSize) * (hidden / 8) / kMinChunkVectors);
  return chunks < 1 ? 1 : chunks;
}

PETIT_HOST_DEVICE uint64_t make_flag(uint64_t epoch, uint32_t tag, uint32_t count) {
  return (epoch << kFlagEpochShift) | (uint64_t(tag & ((1u << kFlagTagBits) - 1)) << kFlagCountBits) |
         count;
}
// The epoch as a flag carries it (its low kFlagEpochBits bits).
PETIT_HOST_DEVICE uint64_t flag_epoch_bits(uint64_t epoch) {
  return epoch & ((uint64_t(1) << kFlagEpochBits) - 1);
}
PETIT_HOST_DEVICE uint64_t flag_epoch(uint64_t flag) { return flag >> kFlagEpochShift; }
PETIT_HOST_DEVICE uint32_t flag_tag(uint64_t flag) {
  return uint32_t(flag >> kFlagCountBits) & ((1u << kFlagTagBits) - 1);
}
PETIT_HOST_DEVICE uint32_t flag_count(uint64_t flag) {
  return uint32_t(flag & ((1u << kFlagCountBits) - 1));
}
// The call kinds a tag names. Within one epoch a dispatch comes before its combine; a fused
// call raises dispatch flags then its reductions flag (combine kind).
enum CallKind : uint32_t { kCallDispatch = 0, kCallCombine = 1 };
// Tag of a call: bits [0, 4) the variant (a dispatch's wire format, DispatchQuant; a combine's
// send chunks per (group, peer) - 1, mod 16), [4, 8) top-k - 1, [8] the kind (CallKind),
// [9, 25) the region stride - 1: in full (1 <= R <= kMaxTokensPerRank = 2^16).
constexpr int kTagKindShift = 8;
constexpr int kTagStrideShift = 9;
static_assert(kTagStrideShift + 16 == kFlagTagBits && kMaxTokensPerRank <= (1 << 16),
              "the tag holds every region stride in full");
PETIT_HOST_DEVICE uint32_t call_tag(uint32_t kind, int region_stride, int top_k,
                                    uint32_t variant) {
  return (variant & 15u) | (uint32_t((top_k - 1) & 15) << 4) | ((kind & 1u) << kTagKindShift) |
         (uint32_t((region_stride - 1) & 0xFFFF) << kTagStrideShift);
}
PETIT_HOST_DEVICE uint32_t tag_kind(uint32_t tag) { return (tag >> kTagKindShift) & 1u; }
PETIT_HOST_DEVICE int tag_region_stride(uint32_t tag) {
  return int((tag >> kTagStrideShift) & 0xFFFF) + 1;
}
PETIT_HOST_DEVICE uint32_t dispatch_flag_tag(int region_stride, int top_k, int quant) {
  return call_tag(kCallDispatch, region_stride, top_k, uint32_t(quant));
}
// (A combine's chunk count follows from the stride and the setup's agreed sizes; it is in the
// tag only as a second check. The fused layer's reductions flag uses 16.)
PETIT_HOST_DEVICE uint32_t combine_flag_tag(int region_stride, int top_k, int num_chunks) {
  return call_tag(kCallCombine, region_stride, top_k, uint32_t(num_chunks - 1));
}
// Whether epoch `a` (flag bits) is later than `b`, modulo 2^kFlagEpochBits: true for a
// distance below half the range. Used only on the flags every call rewrites (a peer's group 0),
// never on a flag that may be older than the previous call.
PETIT_HOST_DEVICE bool flag_epoch_after(uint64_t a, uint64_t b) {
  const uint64_t mask = (uint64_t(1) << kFlagEpochBits) - 1;
  const uint64_t distance = (a - b) & mask;
  return distance != 0 && distance < (uint64_t(1) << (kFlagEpochBits - 1));
}

PETIT_HOST_DEVICE int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}
PETIT_HOST_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Byte offsets (identical on every rank) of the regions inside one rank's heap.
struct HeapLayout {
  int world_size;
  int max_tokens;   // T_max per rank
  int hidden;       // H (elements)
  int max_top_k;    // K_max
  int max_groups;   // ceil(T_max / 32)
  int max_chunks;   // max_group_chunks(H): combine flags per (rank, group)
  int64_t row_bytes;
  int64_t dispatch_rows;     // [W, T_max, H] bf16
  int64_t dispatch_ids;      // [W, T_max, K_max] int32
  int64_t dispatch_weights;  // [W, T_max, K_max] f32
  int64_t dispatch_scales;   // [W, T_max, ceil(H/128)] f32 (fp8 dispatch only)
  int64_t dispatch_flags;    // [W, G_max] u64
  int64_t combine_rows;      // [W, T_max, H] bf16
  int64_t combine_flags;     // [W, G_max, C_max] u64
  int64_t flags_begin;       // [flags_begin, flags_end) is zeroed at creation
  int64_t flags_end;
  int64_t total_bytes;
};

PETIT_HOST_DEVICE HeapLayout make_heap_layout(int world_size, int max_tokens, int hidden,
                                              int max_top_k) {
  HeapLayout l;
  l.world_size = world_size;
  l.max_tokens = max_tokens;
  l.hidden = hidden;
  l.max_top_k = max_top_k;
  l.max_groups = ceil_div(max_tokens, kTokenGroupSize);
  l.max_chunks = max_group_chunks(hidden);
  l.row_bytes = int64_t(hidden) * 2;
  const int64_t rows = int64_t(world_size) * max_tokens;
  int64_t cursor = 0;
  // The layout is the construction order: advance a cursor region by region.
  auto take = [&cursor](int64_t bytes) {
    int64_t offset = cursor;
    cursor = align_up(cursor + bytes, kRegionAlignment);
    return offset;
  };
  l.dispatch_rows = take(rows * l.row_bytes);
  l.dispatch_ids = take(rows * max_top_k * 4);
  l.dispatch_weights = take(rows * max_top_k * 4);
  l.dispatch_scales = take(rows * ceil_div(hidden, kFp8ScaleBlock) * 4);
  l.combine_rows = take(rows * l.row_bytes);
  l.flags_begin = cursor;
  l.dispatch_flags = take(int64_t(world_size) * l.max_groups * 8);
  l.combine_flags = take(int64_t(world_size) * l.max_groups * l.max_chunks * 8);
  l.flags_end = cursor;
  l.total_bytes = cursor;
  return l;
}

}  // namespace petit
