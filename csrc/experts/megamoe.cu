// MegaMoE: a whole MoE layer (routing -> gate/up + SiLU·mul -> down + routing weight ->
// top-k reduction; across an EP group also dispatch and combine) as ONE persistent launch, on
// bf16 or block-fp8 expert weights. Design and invariants: docs/architecture.md, "The fused
// layer (MegaMoE)". The kernel reads as a loop over task kinds; each role is a device function
// below (routing, claims, EP dispatch, the control warp, the weight loader, the mainloops, the
// epilogues, the reductions).
//
// Why: in decode the composed chain (row lists, gate/up, down, reduction: 3-4 launches) pays
// each launch's start and each hand-off on the critical path while the weights, the only large
// operand, wait. Here every block starts streaming weights right after a few microseconds of
// routing it computes itself, and the down GEMM of an expert starts as soon as that expert's
// activations exist, while other experts' gate/up tiles still stream.
//
// Structure (a block = 4 compute warps + a control warp, two blocks per SM, grid <= 2 x SMs):
//   1. Routing, redundantly in every block's shared memory (no inter-block sync): local expert
//      of every entry, per-expert counts, offsets and the experts with rows (one warp's scan),
//      then a stable counting sort of the entries (positions agree across blocks because the
//      sort is deterministic). Limited to kMegaMoeMaxEntries entries (N*K).
//   2. Tasks, claimed in order from one counter: every (active expert, 16-column gate/up
//      tile, row group), then every (active expert, 32-row down tile, row group), then one
//      reduction per 32-row tile of H. A weight task is 32 weight rows (gate + up rows of the
//      same 16 columns, or 32 rows of w2) times the whole k range, split over the compute warps
//      and summed in shared memory. The weights are the M operand of mma.sync m16n8k16
//      (gemm/sm80_mma.h), the group's rows the N operand, 8 per n-tile, 16 per pass over the
//      task's weights. Row groups (the skew adaptation): where the grid's weight tiles fit in
//      L2, a group is all of an expert's rows, and a task's later passes re-read its tile from
//      L2; where they do not, a pass would re-stream it from HBM, so a group is 16 rows: an
//      expert with more rows gets more tasks, consecutive claims that stream the same tile at
//      once (from HBM once) on several blocks (the launcher's choice: kSplit). With e4m3
//      weights (half the bytes a row) a weight task is two such tiles, one after the other in
//      each pass, so that its fixed costs are paid on as many bytes as a bf16 task's.
//   3. Weights stream by TMA into a per-warp ring of kStages steps that runs ahead across task
//      boundaries, so a task's weights are in flight before its inputs exist.
//   4. A gate/up task writes act[pos][cols] = bf16(silu(gate) * up) and raises its expert's
//      counter; a down task's inputs are that expert's activations (all its gate/up tasks), it
//      writes weight * (act . w2^T) as fp32 partials per routing entry and raises its row
//      tile's counter; a reduction waits for every row group's down tile, sums each token's
//      partials over its top-k slots in slot order (fp32, deterministic) and writes out[:, tile].
//      The control warp does the waits (bounded, acquire), the publishing (fence + counter,
//      while the compute warps run the next task) and the claims: the compute warps never
//      fence, which would stall them on their own loads in flight.
//   5. The last block to finish resets every counter to 0, so the next call (same stream)
//      starts from zeros: no memset launch, CUDA-graph capturable.
// Deadlock freedom does not depend on co-residency: a task waits only on tasks of an earlier
// kind, all claimed before it (claims are ordered) by blocks that never wait on a later kind;
// the control warp publishes its own finished task before it waits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <type_traits>

#include "api.h"
#include "comm/ep_sync.h"
#include "common/expert_ids.h"
#include "common/launch.h"
#include "gemm/epilogues.h"
#if PETIT_SM80_PATH
#include "gemm/sm80_mma.h"
#include "gemm/sm90_epilogue_staged.h"    // named barriers
#include "gemm/sm90_mainloop_wgmma_ws.h"  // mbarrier wrappers
#include "gemm/sm90_tma.h"
#endif

namespace petit {

namespace megamoe_detail {  // named: a test harness compiles this file with dispatch_combine.cu

constexpr int kWarps = 4;                       // compute warps
constexpr int kBlocksPerSm = kMegaMoeBlocksPerSm;  // two blocks overlap each other's barriers
                                                   // and epilogues
constexpr int kComputeThreads = kWarps * 32;
constexpr int kThreads = kComputeThreads + 32;  // + the control warp
constexpr int kComputeBarrier = 1;              // bar.sync id of the compute warps alone
constexpr int kTileCols = 16;    // gate/up task: 16 columns of I (16 gate + 16 up weight rows)
constexpr int kDownRows = 32;    // down task: 32 rows of H (two 16-row m-tiles)
constexpr int kSpan = 32;        // k elements of one mma_span32 (two mma.sync k16)
constexpr int kStepK = 64;       // k elements per ring step: one TMA box row (128 bytes)
constexpr int kStepK8 = 128;     // the same with e4m3 weights: one scale block of k
constexpr int kMaxNTiles = 2;    // n-tiles of 8 rows per pass: 16 expert rows
constexpr int kPassRows = 8 * kMaxNTiles;
constexpr int kPassRows8 = 8;    // e4m3 weights: one n-tile per pass (mainloop_fp8)
// e4m3 weights: a weight task may be kWide8 tiles (gate/up: 2 x 16 columns of I, down: 2 x 32
// rows of H), so that its fixed costs are paid on as many bytes as a bf16 task's; which kinds
// are wide is the kernel's kWide (bit kGateUp, bit kDown; the launcher's wide_mask)
constexpr int kWide8 = 2;
constexpr int kGroupShift = 4;   // kSplit: a row group is 1 << kGroupShift rows, one pass
static_assert(1 << kGroupShift == kPassRows, "a row group is one pass");
constexpr int kStages = 5;       // ring steps in flight per warp
constexpr int kInputsAhead = 4;  // input steps in flight per warp with one n-tile (W = 1)
constexpr int kBoxRows = 16;     // one TMA box: 16 weight rows x 64 k, 128-byte swizzle
constexpr int kBoxBytes = kBoxRows * kStepK * 2;
constexpr int kStepBytes = 2 * kBoxBytes;  // a step: both 16-row halves of the task
static_assert(kDownRows == 32, "megamoe_sync_ints (api.h) counts H / 32 row tiles");
static_assert(kMegaMoeSizeMultiple % kStepK == 0, "H and I are whole ring steps");
#if PETIT_SM80_PATH
static_assert(kStepK == gemm::kTmaBoxK, "a step is one box row");
static_assert(kStepK8 == kFp8ScaleBlock, "an e4m3 step is one box row and one scale block");
#endif

// Offsets of the block's shared memory (dynamic, 16-byte aligned pieces).
struct SmemLayout {
  // [warps][stages] steps of two 1024-byte aligned boxes (the base is aligned up by the slack)
  static constexpr int kRing = 0;
  static constexpr int kFull = kRing + kWarps * kStages * kStepBytes + 1024;  // u64 [warps][stages]
  static constexpr int kExpertOf = kFull + 8 * kWarps * kStages;              // int16 [E]
  static constexpr int kSorted = kExpertOf + 2 * kMegaMoeMaxEntries;           // int32 [E]
  static constexpr int kOffsets = kSorted + 4 * kMegaMoeMaxEntries;           // int32 [L+1]
  static constexpr int kCursor = kOffsets + 4 * (kMaxExperts + 16);           // int32 [L]
  static constexpr int kActive = kCursor + 4 * kMaxExperts;                   // int32 [L]
  static constexpr int kGroupBase = kActive + 4 * kMaxExperts;  // int32 [active + 1]
  static constexpr int kScalars = kGroupBase + 4 * (kMaxExperts + 4);         // int32 [12]
  static constexpr int kReduce = kScalars + 4 * 12;  // float [warps][2][n-tiles][4][32]
  static constexpr int kBytes = kReduce + 4 * kWarps * 2 * kMaxNTiles * 4 * 32;
};
static_assert(kBlocksPerSm * (SmemLayout::kBytes + 1024) <= 228 * 1024, "two blocks per SM");
// kClaim0..2: the claimed task of iterations i, i + 1, i + 2 (by i % 3); EP: the call's epoch
// (two words) and a send item's route mask; kNumGroups: the row groups of all active experts
enum Scalar { kNumActive = 0, kClaim0 = 1, kExitHere = 4, kEpochLo = 5, kEpochHi = 6,
              kRouteMask = 7, kNumGroups = 8 };

// Sync words (MegaMoeArgs::sync): all zero between calls. kSyncExperts: [L] gate/up tiles
// done per expert, then [H / 32] down tiles done per row tile, then (EP) one count of the
// reductions done and the blocks past their wait for the dispatch flags (the last of those
// H / 32 + grid arrivals raises "reductions done" at every rank).
enum SyncWord { kSyncClaim = 0, kSyncExit = 1, kSyncExperts = 2 };

#if PETIT_SM80_PATH

PETIT_DEVICE uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

PETIT_DEVICE float as_float(uint32_t bits) {
  union { uint32_t u; float f; } v;
  v.u = bits;
  return v.f;
}

// The control warp's bounded wait until *counter >= target (acquire).
// expert >= 0: a down task waits for that expert's gate/up tasks; -1 - t: a reduction waits
// for the down tasks of row tile t.
PETIT_DEVICE void wait_count(const int* counter, int target, uint64_t timeout_ticks, int expert) {
  const uint64_t start = petit_timer();
  int seen = petit_load_acquire_gpu(counter);
  while (seen < target) {
    if (petit_timer() - start > timeout_ticks) {
      if (expert >= 0) {
        printf("petit_moe: fused MoE layer (W=1) timed out in block %d waiting for the gate/up "
               "tasks of local expert %d: %d of %d arrived\n",
               int(blockIdx.x), expert, seen, target);
      } else {
        printf("petit_moe: fused MoE layer (W=1) timed out in block %d waiting for the down "
               "tiles of row tile %d: %d of %d row groups arrived\n",
               int(blockIdx.x), -1 - expert, seen, target);
      }
      petit_trap();
    }
    seen = petit_load_acquire_gpu(counter);
  }
}

// What one task is, from the block's routing tables. Claim order: every gate/up task, then
// every down task, then one reduction task per row tile; a task waits only on tasks of an
// earlier kind, all claimed before it by blocks that run them without waiting on it.
// EP adds a fourth kind: per row tile, the sum of this rank's tokens' rows that every rank's
// reductions sent back (after all W ranks' "reductions done" flags).
// Within a kind, active expert s owns the task range tiles * [group_base[s], group_base[s + 1])
// in (tile, row group) order, the row group fastest.
enum TaskKind { kGateUp = 0, kDown = 1, kReduce = 2, kFinal = 3 };
struct Task {
  bool valid;
  int kind;
  int expert, tile;  // a weight task's tiles: tile * subs .. + subs - 1 (Schedule::subs_of)
  int begin, count;  // the row group's first sorted position and rows
};

// The row groups of an expert with `rows` rows (kSplit; otherwise one per expert).
PETIT_HOST_DEVICE constexpr int row_groups(int rows) {
  return (rows + kPassRows - 1) >> kGroupShift;
}

// kSplit = false: one row group per expert (num_groups == num_active, group_base unused).
// gate_up_tiles, down_tiles: weight tasks per row group.
template <bool kEp, bool kSplit>
PETIT_DEVICE Task decode_task(int task, int num_active, int num_groups, int gate_up_tiles,
                              int down_tiles, int reduce_tiles, const int32_t* active,
                              const int32_t* group_base, const int32_t* offsets) {
  Task t{};
  const int num_gate_up = num_groups * gate_up_tiles, num_down = num_groups * down_tiles;
  // W = 1 with no entry: no task (the output is zeroed); EP: the reductions and final sums
  // run regardless (the peers wait for this rank's "reductions done")
  t.valid = (kEp || num_active > 0) &&
            task < num_gate_up + num_down + reduce_tiles * (kEp ? 2 : 1);
  if (!t.valid) return t;
  if (task >= num_gate_up + num_down) {
    const int tile = task - num_gate_up - num_down;
    t.kind = tile < reduce_tiles ? kReduce : kFinal;
    t.tile = tile % reduce_tiles;
    return t;
  }
  const bool gate_up = task < num_gate_up;
  const int local = gate_up ? task : task - num_gate_up;
  const int tiles = gate_up ? gate_up_tiles : down_tiles;
  t.kind = gate_up ? kGateUp : kDown;
  const int unit = local / tiles;
  if (!kSplit || num_groups == num_active) {  // one group per expert: slot = unit
    t.expert = active[unit];
    t.tile = local - unit * tiles;
    t.begin = offsets[t.expert];
    t.count = offsets[t.expert + 1] - t.begin;
    return t;
  }
  // the active slot s with group_base[s] <= local / tiles < group_base[s + 1]
  int lo = 0, hi = num_active - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (group_base[mid] <= unit) lo = mid; else hi = mid - 1;
  }
  const int rest = local - tiles * group_base[lo], groups = group_base[lo + 1] - group_base[lo];
  t.expert = active[lo];
  t.tile = rest / groups;
  t.begin = offsets[t.expert] + (rest - t.tile * groups) * kPassRows;
  t.count = min(kPassRows, offsets[t.expert + 1] - t.begin);
  return t;
}

// This warp's weight stream of one task: the two 16-row boxes of a step (half 0 / half 1:
// box coordinates row, group, expert of the task's weight map), its steps [s0, s0 + steps)
// of kStepK, and the passes over them; per pass, its tiles one after the other (tile i's
// boxes sub_rows * i rows further).
struct WarpStream {
  bool gate_up;
  int row0, row1, group0, group1, expert;
  int subs, sub_rows;
  int s0, steps, total;  // total = passes * subs * steps
};

template <bool kFp8>
PETIT_DEVICE WarpStream warp_stream(const Task& t, const MegaMoeArgs& a, int subs) {
  const int warp = petit_warp_id();
  WarpStream ws{};
  if (!t.valid || t.kind >= kReduce) return ws;  // no weights
  ws.gate_up = t.kind == kGateUp;
  ws.expert = t.expert;
  ws.subs = kFp8 ? subs : 1;
  if (ws.gate_up) {  // w13 as {H, I, 2, L}: gate (group 0) and up (group 1) rows of the tile
    ws.sub_rows = kTileCols;
    ws.row0 = ws.row1 = t.tile * ws.subs * kTileCols;
    ws.group0 = 0;
    ws.group1 = 1;
  } else {  // w2 as {I, H, 1, L}: the tile's 32 rows
    ws.sub_rows = kDownRows;
    ws.row0 = t.tile * ws.subs * kDownRows;
    ws.row1 = ws.row0 + kBoxRows;
    ws.group0 = ws.group1 = 0;
  }
  const int k_steps = (ws.gate_up ? a.hidden : a.intermediate) / (kFp8 ? kStepK8 : kStepK);
  ws.s0 = warp * k_steps / kWarps;
  ws.steps = (warp + 1) * k_steps / kWarps - ws.s0;
  // a pass: a row group's rows (e4m3: 8 of them)
  ws.total = ws.steps * ws.subs *
             (kFp8 ? (t.count + kPassRows8 - 1) / kPassRows8 : row_groups(t.count));
  return ws;
}

// Sum over the warps of output (half, weight row `row` in [0, 16), row n of the pass).
PETIT_DEVICE float reduced(const float* red, int half, int row, int n) {
  const int j = n / 8, col = n % 8;
  const int reg = (col % 2) + 2 * (row / 8), lane = (row % 8) * 4 + col / 2;
  const int idx = ((half * kMaxNTiles + j) * 4 + reg) * 32 + lane;
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w * (2 * kMaxNTiles * 4 * 32) + idx];
  return sum;
}


// EP: the flag in rank `dst`'s heap that says "rank `src` has sent back every row of dst's
// tokens it reduced in this call" (the combine flag slot [src][group 0][chunk 0]; the fused
// call's own tag, so a peer's standalone combine in the same epoch is a mismatch).
PETIT_DEVICE uint64_t* reductions_flag(const EpContextArgs& c, int dst, int src) {
  return reinterpret_cast<uint64_t*>(rank_heap(c, dst) + c.layout.combine_flags) +
         int64_t(src) * c.layout.max_groups * c.layout.max_chunks;
}
PETIT_HOST_DEVICE uint32_t reductions_tag(int region_stride, int top_k) {
  return combine_flag_tag(region_stride, top_k, 16);
}
// "This rank's reductions are in every rank's heap": one fence (after the caller's count),
// then every rank's flag.
PETIT_DEVICE void publish_reductions(const EpContextArgs& c, uint64_t epoch, int R, int K) {
  publish_fence();
  for (int d = 0; d < c.world_size; ++d)
    publish_flag(reductions_flag(c, d, c.rank), make_flag(epoch, reductions_tag(R, K), 1));
}

PETIT_DEVICE float bf16_lo(uint32_t bits) { return as_float(bits << 16); }
PETIT_DEVICE float bf16_hi(uint32_t bits) { return as_float(bits & 0xFFFF0000u); }

// ------------------------------------------------------------------ the block's state

// The block's shared memory (SmemLayout), carved once at entry.
struct Smem {
  unsigned char* ring;  // [warps][stages] weight steps, 1024-byte aligned
  uint64_t* full;       // [warps][stages] the steps' mbarriers
  int16_t* expert_of;   // [entries] local expert of each routing entry, -1: not served
  int32_t* sorted;      // [entries] the entries by expert, entry order within an expert
  int32_t* offsets;     // [L + 1] each expert's first sorted position
  int32_t* cursor;      // [L] counts, then the sort's cursors
  int32_t* active;      // [L] the experts with rows, ascending
  int32_t* group_base;  // [active + 1] kSplit: each active expert's first row group
  int32_t* scalars;     // [12] Scalar
  float* red;           // [warps][2][n-tiles][4][32] the warps' sums of a pass
};

PETIT_DEVICE Smem carve_smem(unsigned char* smem) {
  Smem s;
  s.ring = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem + SmemLayout::kRing) + 1023) & ~uintptr_t(1023));
  s.full = reinterpret_cast<uint64_t*>(smem + SmemLayout::kFull);
  s.expert_of = reinterpret_cast<int16_t*>(smem + SmemLayout::kExpertOf);
  s.sorted = reinterpret_cast<int32_t*>(smem + SmemLayout::kSorted);
  s.offsets = reinterpret_cast<int32_t*>(smem + SmemLayout::kOffsets);
  s.cursor = reinterpret_cast<int32_t*>(smem + SmemLayout::kCursor);
  s.active = reinterpret_cast<int32_t*>(smem + SmemLayout::kActive);
  s.group_base = s.active + kMaxExperts;  // one base register for both
  static_assert(SmemLayout::kGroupBase == SmemLayout::kActive + 4 * kMaxExperts, "adjacent");
  s.scalars = reinterpret_cast<int32_t*>(smem + SmemLayout::kScalars);
  s.red = reinterpret_cast<float*>(smem + SmemLayout::kReduce);
  return s;
}

// What the experts see: the rows, their routing and their weights (the caller's at W = 1; at
// EP this rank's dispatch regions: W x R rows at region stride R, local expert ids or -1),
// the layer's sizes and the call's counters in the sync buffer.
struct Layer {
  const petit_bf16_bits* rows_x;
  const int32_t* row_ids;
  const float* row_weights;
  int num_rows, top_k, hidden, intermediate, num_local_experts, num_entries;
  int* gate_up_done;     // [L] gate/up tasks done, by local expert
  int* tile_done;        // [H / kDownRows] down row groups done, by row tile
  int* reductions_done;  // EP: reductions done and blocks past the dispatch wait
};

template <bool kEp>
PETIT_DEVICE Layer layer_of(const MegaMoeEpArgs& e) {
  const MegaMoeArgs& a = e.layer;
  const EpContextArgs& c = e.ctx;
  Layer l;
  char* const my_heap = kEp ? rank_heap(c, c.rank) : nullptr;
  l.rows_x = kEp ? reinterpret_cast<const petit_bf16_bits*>(my_heap + c.layout.dispatch_rows)
                 : a.x;
  l.row_ids = kEp ? reinterpret_cast<const int32_t*>(my_heap + c.layout.dispatch_ids)
                  : a.topk_ids;
  l.row_weights = kEp ? reinterpret_cast<const float*>(my_heap + c.layout.dispatch_weights)
                      : a.topk_weights;
  l.num_rows = kEp ? c.world_size * e.region_stride : a.num_rows;
  l.top_k = a.top_k;
  l.hidden = a.hidden;
  l.intermediate = a.intermediate;
  l.num_local_experts = a.num_local_experts;
  l.num_entries = l.num_rows * l.top_k;
  l.gate_up_done = a.sync + kSyncExperts;
  l.tile_done = l.gate_up_done + l.num_local_experts;
  l.reductions_done = l.tile_done + l.hidden / kDownRows;
  return l;
}

// One claim of the next task in the call's order (claims are ordered: see decode_task).
PETIT_DEVICE int claim_task(int* sync) { return atomicAdd(&sync[kSyncClaim], 1); }

// ------------------------------------------------------------------ EP dispatch (role)

// Pushes this rank's tokens to their experts' ranks (dispatch's layout, flags and tag), then
// waits until every rank's have arrived here; returns the call's epoch. The grid is
// co-resident (the launcher's rule), so every block's sends complete before any block can wait
// for them.
PETIT_DEVICE uint64_t ep_dispatch(const MegaMoeEpArgs& e, const Layer& lay, const Smem& s) {
  const MegaMoeArgs& a = e.layer;
  const EpContextArgs& c = e.ctx;
  const HeapLayout& l = c.layout;
  const int tid = threadIdx.x, lane = petit_lane_id(), warp = petit_warp_id();
  const int R = e.region_stride, K = a.top_k, H = a.hidden;
  if (tid == 0) {
    const uint64_t next = *reinterpret_cast<const volatile uint64_t*>(&c.state->epoch) + 1;
    s.scalars[kEpochLo] = int32_t(uint32_t(next));
    s.scalars[kEpochHi] = int32_t(uint32_t(next >> 32));
  }
  __syncthreads();
  const uint64_t epoch =
      (uint64_t(uint32_t(s.scalars[kEpochHi])) << 32) | uint32_t(s.scalars[kEpochLo]);
  const int W = c.world_size, E = c.num_experts, Lc = c.num_local_experts;
  const uint32_t tag = dispatch_flag_tag(R, K, kQuantNone);
  const int groups = ceil_div(R, kTokenGroupSize), num_vectors = H / 8;
  for (int item = blockIdx.x; item < groups * W; item += gridDim.x) {
    const int group = item / W, dst = (c.rank + 1 + item % W) % W;  // peers first
    char* dst_heap = rank_heap(c, dst);
    if (warp == 0) {  // lane t: token group * 32 + t, its slots for dst and its rank mask
      const int token = group * kTokenGroupSize + lane;
      bool routed = false;
      if (token < R) {
        const int64_t slot = (int64_t(c.rank) * R + token) * K;
        int32_t* dst_ids = reinterpret_cast<int32_t*>(dst_heap + l.dispatch_ids) + slot;
        float* dst_weights = reinterpret_cast<float*>(dst_heap + l.dispatch_weights) + slot;
        uint32_t rank_mask = 0;
        int dropped = 0;
        for (int k = 0; k < K; ++k) {
          int32_t local = -1;
          float weight = 0.f;
          if (token < a.num_rows) {
            const int64_t id = int64_t(a.topk_ids[int64_t(token) * K + k]);
            const int owner = expert_owner(id, E, Lc);
            dropped += (owner < 0 && id != -1);
            if (owner >= 0) {
              rank_mask |= 1u << owner;
              if (owner == dst) {
                local = int32_t(id - int64_t(dst) * Lc);
                weight = a.topk_weights[int64_t(token) * K + k];
              }
            }
          }
          routed |= (local >= 0);
          dst_ids[k] = local;
          dst_weights[k] = weight;
        }
        if (dst == c.rank && token < a.num_rows) {
          c.token_rank_mask[token] = rank_mask;
          if (dropped > 0) atomicAdd(&c.diagnostics->dropped_ids, dropped);
        }
      }
      const uint32_t mask = uint32_t(petit_ballot(routed));
      if (lane == 0) s.scalars[kRouteMask] = int32_t(mask);
    }
    __syncthreads();
    const uint32_t mask = uint32_t(s.scalars[kRouteMask]);
    const int routed_rows = petit_popc(mask);
    for (int u = warp; u < routed_rows; u += kWarps + 1) {  // the control warp copies too
      const int token = group * kTokenGroupSize + nth_set_bit(mask, u);
      warp_copy(reinterpret_cast<uint4*>(dst_heap + l.dispatch_rows) +
                    (int64_t(c.rank) * R + token) * num_vectors,
                reinterpret_cast<const uint4*>(a.x) + int64_t(token) * num_vectors, 0,
                num_vectors, lane);
    }
    __syncthreads();  // the block's stores, then one system fence and the flag
    if (tid == 0) {
      publish_fence();
      publish_flag(reinterpret_cast<uint64_t*>(dst_heap + l.dispatch_flags) +
                       int64_t(c.rank) * l.max_groups + group,
                   make_flag(epoch, tag, uint32_t(routed_rows)));
    }
  }
  if (warp == kWarps) {  // the control warp: every (source, group) of this call, bounded
    const uint64_t* flags =
        reinterpret_cast<const uint64_t*>(rank_heap(c, c.rank) + l.dispatch_flags);
    for (int f = lane; f < W * groups; f += 32) {
      const int src = f / groups, group = f % groups;
      wait_flag(c, flags + int64_t(src) * l.max_groups + group, epoch, tag, src, 0, group);
    }
  }
  __syncthreads();
  // Counted with the reductions: "reductions done" goes out only once every block has read
  // its dispatch flags, since a peer that sees it may end the call and overwrite them here
  // with its next call's (a block still waiting would wait forever, its peers alive).
  if (tid == 0 && atomicAdd(lay.reductions_done, 1) == H / kDownRows + int(gridDim.x) - 1)
    publish_reductions(c, epoch, R, K);
  return epoch;
}

// ------------------------------------------------------------------ routing (role)
// Redundantly in every block's shared memory, so no block waits for another: counts, offsets
// and the active experts first (the weight stream can start from them), then the stable sort
// of the entries (positions agree across blocks because the sort is deterministic).

// Every entry's local expert (-1: not served here); the counts cleared.
template <bool kEp>
PETIT_DEVICE void route_experts(const MegaMoeArgs& a, const Layer& l, const Smem& s) {
  const int tid = threadIdx.x;
  for (int i = tid; i < l.num_entries; i += kThreads) {
    s.expert_of[i] =
        int16_t(kEp ? local_expert_id(l.row_ids, nullptr, l.num_local_experts,
                                      l.num_local_experts, i)
                    : local_expert_id(l.row_ids, a.expert_map, a.num_global_experts,
                                      l.num_local_experts, i));
  }
  for (int e = tid; e < l.num_local_experts; e += kThreads) s.cursor[e] = 0;
}

// Each expert's entries, counted in cursor (after route_experts' barrier).
PETIT_DEVICE void route_count(const Layer& l, const Smem& s) {
  for (int i = threadIdx.x; i < l.num_entries; i += kThreads) {
    const int e = s.expert_of[i];
    if (e >= 0) atomicAdd(&s.cursor[e], 1);
  }
}

// Warp 0: the offsets (cursor becomes each expert's first position), the active experts, their
// row groups (kSplit) and the totals in scalars. Lane l owns experts
// [l * per_lane, (l + 1) * per_lane); one warp-wide inclusive scan.
template <bool kSplit>
PETIT_DEVICE void route_scan(int L, const Smem& s) {
  static_assert(kMaxExperts % 32 == 0, "the routing scan: kMaxExperts / 32 experts per lane");
  const int lane = petit_lane_id();
  const int per_lane = (L + 31) / 32;
  int count = 0, actives = 0, groups = 0;
  for (int i = 0; i < per_lane; ++i) {
    const int e = lane * per_lane + i;
    const int c = e < L ? s.cursor[e] : 0;
    count += c;
    actives += c > 0 ? 1 : 0;
    if constexpr (kSplit) groups += row_groups(c);
  }
  int count_incl = count, active_incl = actives, group_incl = groups;  // inclusive scans
  for (int d = 1; d < 32; d <<= 1) {
    const int src = lane >= d ? lane - d : lane;
    const int c = petit_shfl(count_incl, src), n = petit_shfl(active_incl, src);
    const int gr = kSplit ? petit_shfl(group_incl, src) : 0;
    if (lane >= d) {
      count_incl += c;
      active_incl += n;
      group_incl += gr;
    }
  }
  int offset = count_incl - count, slot = active_incl - actives, group = group_incl - groups;
  for (int i = 0; i < per_lane; ++i) {
    const int e = lane * per_lane + i;
    if (e < L) {
      const int c = s.cursor[e];
      s.offsets[e] = offset;
      s.cursor[e] = offset;
      if (c > 0) {
        if constexpr (kSplit) s.group_base[slot] = group;
        s.active[slot++] = e;
      }
      offset += c;
      if constexpr (kSplit) group += row_groups(c);
    }
  }
  if (lane == 31) {
    s.offsets[L] = count_incl;
    s.scalars[kNumActive] = active_incl;
    if constexpr (kSplit) {
      s.group_base[active_incl] = group_incl;
      s.scalars[kNumGroups] = group_incl;
    }
  }
}

// Warp 0: the stable scatter of the entries into sorted (entry order within each expert).
PETIT_DEVICE void route_sort(int num_entries, const Smem& s) {
  const int lane = petit_lane_id();
  for (int base = 0; base < num_entries; base += 32) {
    const int i = base + lane;
    const int e = i < num_entries ? s.expert_of[i] : -1;
    const petit_lanemask_t same = petit_match_any(e);
    const petit_lanemask_t below = same & petit_lanemask_lt();
    if (e >= 0) s.sorted[s.cursor[e] + petit_popc(below)] = i;
    petit_syncwarp();
    if (e >= 0 && below == 0) s.cursor[e] += petit_popc(same);
    petit_syncwarp();
  }
}

// ------------------------------------------------------------------ the schedule

// The block's view of the call's tasks once routed: the active experts and their row groups,
// held in registers, but read from shared memory at each use by the W = 1 kernel with row
// groups (its registers spill otherwise; the EP kernel's spill more the other way round).
// kWide: the wide kinds (bit kGateUp, bit kDown), whose tasks are kWide8 tiles.
template <bool kEp, bool kSplit, int kWide>
struct Schedule {
  static constexpr bool kHeld = kEp || !kSplit;
  static constexpr int kGateUpSubs = kWide >> kGateUp & 1 ? kWide8 : 1;
  static constexpr int kDownSubs = kWide >> kDown & 1 ? kWide8 : 1;
  const Smem& s;
  int held_active, held_groups;
  int gate_up_tiles, down_tiles;  // weight tasks per row group (of subs_of tiles each)

  PETIT_DEVICE int num_active() const { return kHeld ? held_active : s.scalars[kNumActive]; }
  PETIT_DEVICE int num_groups() const {
    return !kSplit ? num_active() : kHeld ? held_groups : s.scalars[kNumGroups];
  }
  PETIT_DEVICE Task task(int id) const {
    return decode_task<kEp, kSplit>(id, num_active(), num_groups(), gate_up_tiles, down_tiles,
                                    reduce_tiles(), s.active, s.group_base, s.offsets);
  }
  // H / kDownRows: the reductions' row tiles
  PETIT_DEVICE int reduce_tiles() const { return down_tiles * kDownSubs; }
  // a weight task's tiles
  PETIT_DEVICE int subs_of(const Task& t) const {
    return kGateUpSubs == kDownSubs || t.kind == kGateUp ? kGateUpSubs : kDownSubs;
  }
  // A down task waits for its expert's gate/up tasks, a reduction for its row tile's down
  // tasks (every row group's).
  PETIT_DEVICE const int* counter_of(const Task& t, const Layer& l) const {
    return t.kind == kDown ? &l.gate_up_done[t.expert] : &l.tile_done[t.tile];
  }
  PETIT_DEVICE int target_of(const Task& t) const {
    const int groups = kSplit ? row_groups(s.offsets[t.expert + 1] - s.offsets[t.expert]) : 1;
    return t.kind == kDown ? gate_up_tiles * groups : num_groups();
  }
};

template <bool kEp, bool kSplit, int kWide>
PETIT_DEVICE Schedule<kEp, kSplit, kWide> schedule_of(const Layer& l, const Smem& s) {
  using S = Schedule<kEp, kSplit, kWide>;
  return S{s, s.scalars[kNumActive], kSplit ? s.scalars[kNumGroups] : 0,
           l.intermediate / (kTileCols * S::kGateUpSubs), l.hidden / (kDownRows * S::kDownSubs)};
}

// ------------------------------------------------------------------ the control warp (role)
// Lane 0 of the control warp: waits (bounded, acquire) until the current task's inputs are
// complete, publishes each finished task (fence + counter) while the compute warps run the
// next one, and claims two tasks ahead. The compute warps never fence (a fence would wait for
// their weight loads in flight) and wait at R only when an input is really missing.
template <bool kEp, bool kSplit, int kWide>
struct Control {
  using Sched = Schedule<kEp, kSplit, kWide>;
  Task unpublished;  // the finished task not yet published
  bool inputs_seen;  // the current task's inputs were seen complete (acquired) already

  PETIT_DEVICE void publish(Task& t, const MegaMoeEpArgs& e, const Layer& l, uint64_t epoch,
                            const Sched& sc) {
    if (!t.valid) return;
    if (kEp && t.kind == kReduce) {
      // the rows went to peers' heaps: a system-scope release, then the count; the last
      // reduction of this rank tells every rank its rows are in (dispatch's publish_item)
      petit_fence_acq_rel_sys();
      if (atomicAdd(l.reductions_done, 1) == sc.reduce_tiles() + int(gridDim.x) - 1)
        publish_reductions(e.ctx, epoch, e.region_stride, l.top_k);
    } else {
      __threadfence();  // release: the compute warps' stores, ordered before it by S
      if (t.kind == kGateUp) atomicAdd(&l.gate_up_done[t.expert], 1);
      if (t.kind == kDown) {
        constexpr int subs = Sched::kDownSubs;
#pragma unroll
        for (int i = 0; i < subs; ++i) atomicAdd(&l.tile_done[t.tile * subs + i], 1);
      }
    }
    t.valid = false;
  }

  // Before R(iter): what the current task reads from other blocks is complete.
  PETIT_DEVICE void await_inputs(const Task& cur, const Sched& sc,
                                 const MegaMoeEpArgs& e, const Layer& l, uint64_t epoch) {
    const EpContextArgs& c = e.ctx;
    const bool waits = cur.valid && cur.kind != kGateUp && !inputs_seen;
    if (waits || !cur.valid) publish(unpublished, e, l, epoch, sc);  // ours may be awaited
    if (kEp && waits && cur.kind == kFinal) {  // every rank's rows of our tokens
      for (int d = 0; d < c.world_size; ++d) {
        wait_flag(c, reductions_flag(c, c.rank, d), epoch,
                  reductions_tag(e.region_stride, l.top_k), d, 1, 0);
      }
    } else if (waits) {
      wait_count(sc.counter_of(cur, l), sc.target_of(cur), e.layer.timeout_ticks,
                 cur.kind == kDown ? cur.expert : -1 - cur.tile);
    }
  }

  // During the compute warps' task: publish the previous task, claim the task of iteration
  // iter + 2 (read after S(iter)), look at the next task's inputs.
  PETIT_DEVICE void step(int iter, const Task& next, const Sched& sc,
                         const MegaMoeEpArgs& e, const Layer& l, uint64_t epoch, int* scalars) {
    publish(unpublished, e, l, epoch, sc);
    scalars[kClaim0 + (iter + 2) % 3] = claim_task(e.layer.sync);
    inputs_seen = next.valid && next.kind != kGateUp && next.kind != kFinal &&
                  petit_load_acquire_gpu(sc.counter_of(next, l)) >= sc.target_of(next);
  }
};

// ------------------------------------------------------------------ weight stream (loader)
// The warp's weight stream runs ahead of its multiplies across task boundaries: a producer
// cursor walks the current task's steps, then the next task's (whose id is known one
// iteration ahead); lane 0 issues each step as two TMA boxes into the warp's ring slot,
// completing the slot's mbarrier. The warp consumes slots in order; a slot is refilled only
// after every lane of the warp has read it (the refill follows the multiplies that used it).

// The warp's ring: kStages steps and their mbarriers, and the tensor maps it loads from.
struct WarpRing {
  const unsigned char* steps;  // [kStages][kStepBytes]
  uint32_t steps_addr, full_addr;
  const CUtensorMap* w13_map;
  const CUtensorMap* w2_map;
};

struct Producer {
  WarpStream cur, next;  // the cursor's task and the one after it
  bool has_next;
  int iter;              // the block iteration whose task cur is
  int step;              // of cur: 0 .. cur.total
  int kstep;             // step % cur.steps
  int sub;               // (step / cur.steps) % cur.subs: the tile of the pass
  int pushed;            // steps issued so far (slot = pushed % kStages)
};

template <bool kFp8, int kWide>
PETIT_DEVICE void produce(Producer& p, int consumed, const WarpRing& r) {
  while (p.pushed - consumed < kStages) {
    if (p.step >= p.cur.total) {
      if (!p.has_next) return;
      p.cur = p.next;
      p.has_next = false;
      p.step = 0;
      p.kstep = 0;
      p.sub = 0;
      ++p.iter;
      continue;
    }
    if (petit_lane_id() == 0) {
      const int slot = p.pushed % kStages;
      const uint32_t dst = r.steps_addr + slot * kStepBytes, bar = r.full_addr + slot * 8;
      const CUtensorMap* map = p.cur.gate_up ? r.w13_map : r.w2_map;
      const int k = (p.cur.s0 + p.kstep) * (kFp8 ? kStepK8 : kStepK);
      const int rows = kWide != 0 ? p.sub * p.cur.sub_rows : 0;
      gemm::sm90_mbarrier_arrive_expect_tx(bar, kStepBytes);
      gemm::sm90_tma_load_4d(dst, map, k, p.cur.row0 + rows, p.cur.group0, p.cur.expert, bar);
      gemm::sm90_tma_load_4d(dst + kBoxBytes, map, k, p.cur.row1 + rows, p.cur.group1,
                             p.cur.expert, bar);
    }
    ++p.step;
    ++p.pushed;
    if (++p.kstep == p.cur.steps) {  // the next tile, or the next pass, starts over the k steps
      p.kstep = 0;
      if (kWide != 0 && ++p.sub == p.cur.subs) p.sub = 0;
    }
  }
}

// Lane (g, q)'s 16 bytes of box row r (g or g + 8) for span h of a step: k = 32h + 8q of the
// box's 64, i.e. 16-byte chunk 4h + q, at its 128-byte swizzled position.
PETIT_DEVICE uint4 box_chunk(const unsigned char* box, int r, int chunk) {
  return *reinterpret_cast<const uint4*>(box + r * 128 + ((chunk ^ (r & 7)) * 16));
}

// ------------------------------------------------------------------ gate/up and down (roles)

// One pass's multiplies: this warp's k steps over NT n-tiles of the pass's rows, the weights
// (M) from the warp's ring, the rows' inputs (N) from global memory at b_rows[j] (nullptr: a
// missing row), into acc[half][n-tile]. B is loaded D steps ahead into a register ring, so a
// step waits for its weights (ring kStages ahead) rather than for an input load issued one
// step earlier: D = 4 with one n-tile (2 in the EP instance, whose other state leaves fewer
// registers), 1 with two.
template <bool kEp, int NT>
PETIT_DEVICE void mainloop(const WarpStream& ws, const petit_bf16_bits* const (&b_rows)[kMaxNTiles],
                           float (&acc)[2][kMaxNTiles][4], Producer& prod, int& consumed,
                           const WarpRing& ring) {
  constexpr int D = NT == 1 ? (kEp ? 2 : kInputsAhead) : 1;
  const int lane = petit_lane_id(), g = lane / 4, q = lane % 4;
  const int end = ws.s0 + ws.steps;
  uint4 ahead[D][2][NT];  // step s's inputs in ahead[(s - s0) % D]
  auto load_b = [&](uint4 (&dst)[2][NT], int s) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        dst[h][j] = b_rows[j] != nullptr && s < end
                        ? petit_load_cg(reinterpret_cast<const uint4*>(
                              b_rows[j] + s * kStepK + h * kSpan + 8 * q))
                        : zero4();
      }
  };
#pragma unroll
  for (int d = 0; d < D; ++d) load_b(ahead[d], ws.s0 + d);
  for (int base = ws.s0; base < end; base += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int s = base + d;
      if (s < end) {
        // this step's inputs; one step ahead (D = 1) the next load goes out before the
        // weights' wait, from a copy, as several steps ahead it can follow the multiplies
        uint4 (&b)[2][NT] = ahead[d];
        uint4 held[2][NT];
        if constexpr (D == 1) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < NT; ++j) held[h][j] = b[h][j];
          load_b(ahead[d], s + D);
        }
        const uint4 (&in)[2][NT] = D == 1 ? held : b;
        const int slot = consumed % kStages;
        gemm::sm90_mbarrier_wait_parity(ring.full_addr + slot * 8, (consumed / kStages) & 1);
        const unsigned char* step = ring.steps + slot * kStepBytes;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // span h: chunk 4h + q of rows g, g + 8 of each box
          const uint4 lo0 = box_chunk(step, g, 4 * h + q);
          const uint4 hi0 = box_chunk(step, g + 8, 4 * h + q);
          const uint4 lo1 = box_chunk(step + kBoxBytes, g, 4 * h + q);
          const uint4 hi1 = box_chunk(step + kBoxBytes, g + 8, 4 * h + q);
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            gemm::mma_span32(acc[0][j], lo0, hi0, in[h][j]);
            gemm::mma_span32(acc[1][j], lo1, hi1, in[h][j]);
          }
        }
        if constexpr (D > 1) load_b(ahead[d], s + D);  // after the multiplies read it
        ++consumed;
        petit_syncwarp();  // every lane has read the slot before lane 0 refills it
        produce<false, 0>(prod, consumed, ring);
      }
    }
  }
}

// The mainloop with e4m3 weights (128 x 128 blocks of one fp32 scale): a step is 128 k, one
// scale block; a pass is at most 8 rows (one n-tile: kPassRows8). A lane's 16-byte chunk
// 4h + q of a box row is 16 weights along k; they are widened to bf16 exactly in registers
// (e4m3_x4_to_bf16: k pairs (0, 2), (1, 3) of each word) and the bf16 inputs of the same k
// permuted alike (bf16_pairs_even_odd), so the bf16 mma.sync runs as in the bf16 mainloop. A
// step's products are summed apart and added to acc times the step's block scale, per half
// (a half's 16 rows lie in one 128-row block), in fp32. The next step's inputs and scales are
// loaded after the multiplies (one step ahead: more spill at two).
template <int kWide, bool kSteps>
PETIT_DEVICE void mainloop_fp8(const WarpStream& ws, const petit_bf16_bits* b_row,
                               const float* const (&scale_rows)[2], float (&acc)[2][4],
                               Producer& prod, int& consumed, const WarpRing& ring,
                               int64_t* step_stamps) {
  const int lane = petit_lane_id(), g = lane / 4, q = lane % 4;
  const int end = ws.s0 + ws.steps;
  uint4 b[2][2];   // [span h][c]: bf16 of k 128s + 64h + 16q + 8c ..
  float scale[2];  // [half]
  auto load = [&](int s) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        b[h][c] = b_row != nullptr && s < end
                      ? petit_load_cg(reinterpret_cast<const uint4*>(
                            b_row + s * kStepK8 + h * 64 + 16 * q + 8 * c))
                      : zero4();
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) scale[h] = s < end ? scale_rows[h][s] : 0.0f;
  };
  load(ws.s0);
  for (int s = ws.s0; s < end; ++s) {
    const int slot = consumed % kStages;
    const bool stamp = kSteps && step_stamps != nullptr && consumed < kMegaMoeTraceSteps;
    const uint32_t begun = stamp ? uint32_t(petit_timer()) : 0u;  // one register over the wait
    gemm::sm90_mbarrier_wait_parity(ring.full_addr + slot * 8, (consumed / kStages) & 1);
    if (stamp) {
      const int64_t in = int64_t(petit_timer());
      step_stamps[2 * consumed] = in - int64_t(uint32_t(in) - begun);  // waits < 4 s
      step_stamps[2 * consumed + 1] = in;
    }
    const unsigned char* step = ring.steps + slot * kStepBytes;
    float part[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // chunk 4h + q of rows g, g + 8 of each box
      const uint4 w[4] = {box_chunk(step, g, 4 * h + q), box_chunk(step, g + 8, 4 * h + q),
                          box_chunk(step + kBoxBytes, g, 4 * h + q),
                          box_chunk(step + kBoxBytes, g + 8, 4 * h + q)};
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // k 8c .. 8c + 7 of the chunk: words 2c, 2c + 1
        uint4 a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t lo = c == 0 ? w[i].x : w[i].z, hi = c == 0 ? w[i].y : w[i].w;
          a[i] = make_uint4(gemm::e4m3_x4_to_bf16(lo << 8), gemm::e4m3_x4_to_bf16(lo),
                            gemm::e4m3_x4_to_bf16(hi << 8), gemm::e4m3_x4_to_bf16(hi));
        }
        const uint4 bk = gemm::bf16_pairs_even_odd(b[h][c]);
        gemm::mma_span32(part[0], a[0], a[1], bk);
        gemm::mma_span32(part[1], a[2], a[3], bk);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[h][r] = fmaf(part[h][r], scale[h], acc[h][r]);
    load(s + 1);  // after the multiplies read the registers
    ++consumed;
    petit_syncwarp();  // every lane has read the slot before lane 0 refills it
    produce<true, kWide>(prod, consumed, ring);
  }
}

// The epilogues' items of a pass: (row n, tile i, part) in that order, n < rows. With several
// tiles (e4m3: 8-row passes) tile i's sums are the warps' n-tile i (red's row 8i + n).

// Gate/up epilogue of a pass: act[pos][cols] = bf16(silu(gate) * up) for the pass's `rows`
// rows, from the warps' sums (item: row n, columns c, c + 1 of tile i).
PETIT_DEVICE void gate_up_epilogue(const Task& t, int pass, int rows, int pass_rows, int subs,
                                   const Layer& l, petit_bf16_bits* act, const float* red) {
  for (int item = threadIdx.x; item < pass_rows * subs * 16; item += kComputeThreads) {
    const int n = item / (subs * 16), i = (item / 16) % subs, part = item % 16;
    if (n >= rows) break;
    const int pos = t.begin + pass + n, m = n + 8 * i;
    if (part < 8) {
      const int c = 2 * part;  // columns c, c + 1 of the tile
      const float a0 = gemm::silu(reduced(red, 0, c, m)) * reduced(red, 1, c, m);
      const float a1 = gemm::silu(reduced(red, 0, c + 1, m)) * reduced(red, 1, c + 1, m);
      const uint32_t packed = uint32_t(petit_float_to_bf16(a0)) |
                              (uint32_t(petit_float_to_bf16(a1)) << 16);
      *reinterpret_cast<uint32_t*>(act + int64_t(pos) * l.intermediate +
                                   (t.tile * subs + i) * kTileCols + c) = packed;
    }
  }
}

// Down epilogue of a pass: partial[entry][rows] = weight * (act . w2^T) as fp32, per routing
// entry (item: row n, rows r0, r0 + 1 of tile i).
PETIT_DEVICE void down_epilogue(const Task& t, int pass, int rows, int pass_rows, int subs,
                                const Layer& l, const Smem& s, float* partial) {
  for (int item = threadIdx.x; item < pass_rows * subs * 16; item += kComputeThreads) {
    const int n = item / (subs * 16), i = (item / 16) % subs, part = item % 16;
    if (n >= rows) break;
    const int entry = s.sorted[t.begin + pass + n], m = n + 8 * i;
    const float weight = l.row_weights[entry];
    const int r0 = 2 * part;  // rows r0, r0 + 1 of the tile (half r0 / 16)
    float2 v;
    v.x = weight * reduced(s.red, r0 / 16, r0 % 16, m);
    v.y = weight * reduced(s.red, r0 / 16, r0 % 16 + 1, m);
    *reinterpret_cast<float2*>(partial + int64_t(entry) * l.hidden +
                               (t.tile * subs + i) * kDownRows + r0) = v;
  }
}

// A gate/up or down task on the compute warps: per pass of up to 16 rows, the mainloop, the
// warps' sums through shared memory, then the kind's epilogue.
template <bool kEp, bool kFp8, int kWide, bool kSteps>
PETIT_DEVICE void weight_task(const Task& t, int subs, const MegaMoeArgs& a, const Layer& l,
                              const Smem& s, Producer& prod, int& consumed, const WarpRing& ring,
                              int64_t* step_stamps) {
  constexpr int kRows = kFp8 ? kPassRows8 : kPassRows;  // rows per pass
  const int lane = petit_lane_id(), warp = petit_warp_id(), g = lane / 4;
  const bool gate_up = t.kind == kGateUp;
  const WarpStream ws = warp_stream<kFp8>(t, a, subs);
  // e4m3: the two halves' scale rows, [L, 2I / 128, H / 128] (gate, then up rows) or
  // [L, H / 128, I / 128]; a task's 32 columns (64 rows) lie in one 128-row block
  static_assert(kStepK8 % (kWide8 * kTileCols) == 0 && kStepK8 % (kWide8 * kDownRows) == 0,
                "an e4m3 task's rows lie in one scale block");
  static_assert(kWide8 <= kMaxNTiles, "a tile's sums are one n-tile of red");
  const float* scale_rows[2] = {nullptr, nullptr};
  if constexpr (kFp8) {
    const int blocks_h = l.hidden / kStepK8, blocks_i = l.intermediate / kStepK8;
    if (gate_up) {
      const float* base = a.w13_scale + int64_t(t.expert) * 2 * blocks_i * blocks_h;
      scale_rows[0] = base + (t.tile * ws.subs * kTileCols / kStepK8) * blocks_h;
      scale_rows[1] = base + (blocks_i + t.tile * ws.subs * kTileCols / kStepK8) * blocks_h;
    } else {
      scale_rows[0] = a.w2_scale + (int64_t(t.expert) * blocks_h +
                                    t.tile * ws.subs * kDownRows / kStepK8) * blocks_i;
      scale_rows[1] = scale_rows[0];
    }
  }
  for (int pass = 0; pass < t.count; pass += kRows) {
    const int rows = min(kRows, t.count - pass);
    const petit_bf16_bits* b_rows[kMaxNTiles];
#pragma unroll
    for (int j = 0; j < kMaxNTiles; ++j) {
      const int r = pass + j * 8 + g;
      b_rows[j] = nullptr;
      if (r < t.count && (!kFp8 || j == 0)) {
        b_rows[j] = gate_up ? l.rows_x + int64_t(s.sorted[t.begin + r] / l.top_k) * l.hidden
                            : a.act + int64_t(t.begin + r) * l.intermediate;
      }
    }
    // red[warp][half][n-tile][reg][lane]: the warp's sums of the pass (e4m3: tile i's 8 rows
    // as n-tile i)
    float* mine = s.red + warp * (2 * kMaxNTiles * 4 * 32);
    if constexpr (kFp8) {
      for (int i = 0; i < ws.subs; ++i) {
        float acc8[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        mainloop_fp8<kWide, kSteps>(ws, b_rows[0], scale_rows, acc8, prod, consumed, ring,
                                    step_stamps);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < 4; ++r) mine[((h * kMaxNTiles + i) * 4 + r) * 32 + lane] = acc8[h][r];
      }
    } else {
      float acc[2][kMaxNTiles][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < kMaxNTiles; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[h][j][r] = 0.0f;
      if (rows > 8) {
        mainloop<kEp, 2>(ws, b_rows, acc, prod, consumed, ring);
      } else {
        mainloop<kEp, 1>(ws, b_rows, acc, prod, consumed, ring);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < kMaxNTiles; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) mine[((h * kMaxNTiles + j) * 4 + r) * 32 + lane] = acc[h][j][r];
    }
    gemm::sm90_named_barrier_sync(kComputeBarrier, kComputeThreads);
    if (gate_up) {
      gate_up_epilogue(t, pass, rows, kRows, kFp8 ? ws.subs : 1, l, a.act, s.red);
    } else {
      down_epilogue(t, pass, rows, kRows, kFp8 ? ws.subs : 1, l, s, a.partial);
    }
    gemm::sm90_named_barrier_sync(kComputeBarrier, kComputeThreads);  // red is reused next pass
  }
}

// ------------------------------------------------------------------ reduction and EP combine

// A reduction task: every expert's partials of row tile `tile` are in; each token's slots are
// summed in slot order (fp32, deterministic). W = 1: into out[:, tile]; EP: row n = token
// n % R of rank n / R goes into that rank's combine region, slot of this rank (rows no local
// expert served are never read there).
template <bool kEp>
PETIT_DEVICE void reduce_task(int tile, const MegaMoeEpArgs& e, const Layer& l,
                              const Smem& s) {
  const MegaMoeArgs& a = e.layer;
  const int tid = threadIdx.x, r0 = 4 * (tid % 8), K = l.top_k, H = l.hidden;
  for (int n = tid / 8; n < l.num_rows; n += kComputeThreads / 8) {
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    bool served = false;
    for (int k = 0; k < K; ++k) {
      const int entry = n * K + k;
      if (s.expert_of[entry] < 0) continue;
      served = true;
      const uint4 raw = petit_load_cg(reinterpret_cast<const uint4*>(
          a.partial + int64_t(entry) * H + tile * kDownRows + r0));
      v[0] += as_float(raw.x);
      v[1] += as_float(raw.y);
      v[2] += as_float(raw.z);
      v[3] += as_float(raw.w);
    }
    uint2 packed;
    packed.x = uint32_t(petit_float_to_bf16(v[0])) | (uint32_t(petit_float_to_bf16(v[1])) << 16);
    packed.y = uint32_t(petit_float_to_bf16(v[2])) | (uint32_t(petit_float_to_bf16(v[3])) << 16);
    if constexpr (kEp) {
      if (served) {
        const int R = e.region_stride;
        petit_bf16_bits* dst = reinterpret_cast<petit_bf16_bits*>(rank_heap(e.ctx, n / R) +
                                                                  e.ctx.layout.combine_rows);
        *reinterpret_cast<uint2*>(dst + (int64_t(e.ctx.rank) * R + n % R) * H +
                                  tile * kDownRows + r0) = packed;
      }
    } else {
      *reinterpret_cast<uint2*>(a.out + int64_t(n) * H + tile * kDownRows + r0) = packed;
    }
  }
}

// EP final task (the combine's reduction): every rank's rows of this rank's tokens are in;
// out[i, tile] = the sum over the ranks d that served token i, in rank order, in fp32.
PETIT_DEVICE void final_task(int tile, const MegaMoeEpArgs& e) {
  const MegaMoeArgs& a = e.layer;
  const EpContextArgs& c = e.ctx;
  const int tid = threadIdx.x, H = a.hidden, R = e.region_stride;
  const petit_bf16_bits* rows =
      reinterpret_cast<const petit_bf16_bits*>(rank_heap(c, c.rank) + c.layout.combine_rows);
  const int c0 = 8 * (tid % 4), tile_col = tile * kDownRows + c0;
  for (int i = tid / 4; i < a.num_rows; i += kComputeThreads / 4) {
    const uint32_t mask = c.token_rank_mask[i];
    float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int d = 0; d < c.world_size; ++d) {
      if (((mask >> d) & 1u) == 0) continue;
      const uint4 raw = petit_load_cg(reinterpret_cast<const uint4*>(
          rows + (int64_t(d) * R + i) * H + tile_col));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] += bf16_lo(w[j]);
        v[2 * j + 1] += bf16_hi(w[j]);
      }
    }
    uint4 packed;
    uint32_t* p = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      p[j] = uint32_t(petit_float_to_bf16(v[2 * j])) |
             (uint32_t(petit_float_to_bf16(v[2 * j + 1])) << 16);
    }
    *reinterpret_cast<uint4*>(a.out + int64_t(i) * H + tile_col) = packed;
  }
}

// The trace's task record (thread 0): kind, expert, row group, tile; and its ready stamp.
PETIT_DEVICE void trace_task(int64_t* trace, int iter, const Task& t, const int32_t* offsets) {
  const int group = t.kind >= kReduce ? 0 : (t.begin - offsets[t.expert]) / kPassRows;
  trace[kMegaMoeTraceHeader + 3 * iter] = (int64_t(t.kind) << 48) | (int64_t(t.expert) << 32) |
                                          (int64_t(group) << 16) | t.tile;
  trace[kMegaMoeTraceHeader + 1 + 3 * iter] = int64_t(petit_timer());
}

// The last block out resets the counters for the next call (same stream: no memset launch,
// CUDA-graph capturable); at EP it also spends the call's epoch.
template <bool kEp>
PETIT_DEVICE void exit_block(const MegaMoeEpArgs& e, const Smem& s, uint64_t epoch) {
  const MegaMoeArgs& a = e.layer;
  const int tid = threadIdx.x;
  __threadfence();
  __syncthreads();
  if (tid == 0) s.scalars[kExitHere] = atomicAdd(&a.sync[kSyncExit], 1) == int(gridDim.x) - 1;
  __syncthreads();
  if (s.scalars[kExitHere]) {
    __threadfence();
    for (int i = tid; i < megamoe_sync_ints(a.num_local_experts, a.hidden); i += kThreads)
      a.sync[i] = 0;
    // EP: the call's epoch is spent (the next dispatch, combine or fused call uses the next)
    if (kEp && tid == 0) *reinterpret_cast<volatile uint64_t*>(&e.ctx.state->epoch) = epoch;
    __threadfence();
  }
}

// ------------------------------------------------------------------ the kernel
// (CUDA only: TMA tensor maps; an sm_90a body, empty in other device passes.)
// kEp = false: one GPU, e.layer only. kEp = true: a rank of an EP group (e.ctx, its heap):
// ep_dispatch first, the experts run on the W x R received rows, each reduction task sends
// its rows back to their source ranks' combine regions, the last one raises "reductions done"
// at every rank, and final tasks sum each own token's W rows.
// kSplit: an expert's rows in row groups of 16 (the launcher's choice), else one group.
// kFp8: e4m3 weights with 128 x 128 block scales (MegaMoeArgs::w13_scale), else bf16.
// kWide (e4m3 at W = 1): the kinds whose tasks are kWide8 tiles (bit kGateUp, bit kDown).
// kSteps (W = 1, e4m3, launched with a trace only): the trace's ring-step records too.
template <bool kEp, bool kSplit, bool kFp8, int kWide, bool kSteps = false>
PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(kThreads, kBlocksPerSm)
    megamoe_kernel(const MegaMoeEpArgs e, const __grid_constant__ CUtensorMap w13_map,
                   const __grid_constant__ CUtensorMap w2_map) {
  static_assert(kWide == 0 || (kFp8 && !kEp), "wide tasks: e4m3 weights at W = 1");
#if PETIT_SM90A_BODY
  const MegaMoeArgs& a = e.layer;
  PETIT_DYNAMIC_SMEM(smem_bytes);
  const Smem s = carve_smem(smem_bytes);
  const Layer l = layer_of<kEp>(e);
  const int tid = threadIdx.x, lane = petit_lane_id(), warp = petit_warp_id();
  const bool control = warp == kWarps;  // fences, counters, claims and waits: never streams
  // Before the previous kernel of the stream has completed (programmatic launch, W = 1):
  // only what touches no global memory.
  if (tid == 0) {
    for (int i = 0; i < kWarps * kStages; ++i) {
      gemm::sm90_mbarrier_init(gemm::smem_addr_u32(s.full + i), 1);
    }
    gemm::sm90_fence_mbarrier_init();
    gemm::sm90_prefetch_tensor_map(&w13_map);
    gemm::sm90_prefetch_tensor_map(&w2_map);
  }  // visible after the routing's first barrier
  // The EP kernel neither waits (it is launched plainly) nor lets the next kernel start early
  // (launch_dependents): that kernel's blocks could take SMs a peer's grid needs (launch_kernel).
  if constexpr (!kEp) petit_grid_dependency_sync();
  // the optional trace (layout.h): thread 0 stamps its block's phases and tasks
  int64_t* const trace = a.trace != nullptr && tid == 0
                             ? a.trace + int64_t(blockIdx.x) * kMegaMoeTraceSlots
                             : nullptr;
  if (trace != nullptr) {
    trace[0] = int64_t(petit_timer());
    trace[3] = 0;  // tasks run
  }
  // The first claim, early (stored once the routing's loads are issued, so the atomic's round
  // trip overlaps them); the second after the routing, so that every block holds one task of
  // the first wave before any holds two (two claims at once gave the first 2 x grid tasks to
  // the first blocks in pairs: at 1 token, 384 gate/up tasks on 192 of 264 blocks).
  int first_claim = 0;
  if (control && lane == 0) first_claim = claim_task(a.sync);

  uint64_t epoch = 0;
  if constexpr (kEp) epoch = ep_dispatch(e, l, s);

  route_experts<kEp>(a, l, s);
  if (control && lane == 0) s.scalars[kClaim0] = first_claim;
  __syncthreads();
  if (trace != nullptr) trace[4] = int64_t(petit_timer());  // every row's ids read
  route_count(l, s);
  __syncthreads();
  if (warp == 0) route_scan<kSplit>(l.num_local_experts, s);
  // The second claim: issued here; at W = 1 its value is stored only after the first weight
  // loads (the barrier below does not wait for the atomic's round trip, and the first loads
  // need only the first claim). The EP kernel, whose routing waits for the peers' rows anyway,
  // stores it first (deferred, its registers spill).
  int second_claim = 0;
  if (control && lane == 0) {
    second_claim = claim_task(a.sync);
    if (kEp) s.scalars[kClaim0 + 1] = second_claim;
  }
  __syncthreads();
  if (trace != nullptr) trace[5] = int64_t(petit_timer());  // counts, offsets, active experts

  const Schedule<kEp, kSplit, kWide> sc = schedule_of<kEp, kSplit, kWide>(l, s);
  // The first task's weight stream goes out before the sort (the second task's, whose claim
  // is stored meanwhile, after it).
  const unsigned char* ring_warp = s.ring + warp * (kStages * kStepBytes);
  const WarpRing ring{ring_warp, gemm::smem_addr_u32(ring_warp),
                      gemm::smem_addr_u32(s.full + warp * kStages), &w13_map, &w2_map};
  Producer prod{};
  Task cur_task = sc.task(s.scalars[kClaim0]), next_task{};
  prod.cur = warp_stream<kFp8>(cur_task, a, sc.subs_of(cur_task));
  if constexpr (kEp) {
    next_task = sc.task(s.scalars[kClaim0 + 1]);
    prod.next = warp_stream<kFp8>(next_task, a, sc.subs_of(next_task));
    prod.has_next = next_task.valid;
  }
  int consumed = 0;
  if (!control && cur_task.valid) produce<kFp8, kWide>(prod, consumed, ring);
  if (trace != nullptr) trace[6] = int64_t(petit_timer());  // this warp's first loads issued
  if (!kEp && control && lane == 0) s.scalars[kClaim0 + 1] = second_claim;

  if (warp == 0) route_sort(l.num_entries, s);
  __syncthreads();
  if (trace != nullptr) trace[1] = int64_t(petit_timer());
  if constexpr (!kEp) {
    next_task = sc.task(s.scalars[kClaim0 + 1]);
    prod.next = warp_stream<kFp8>(next_task, a, sc.subs_of(next_task));
    prod.has_next = next_task.valid;
  }

  if (!kEp && sc.num_active() == 0) {  // no entry served: the layer's output is 0
    const int64_t vectors = int64_t(l.num_rows) * l.hidden / 8;
    for (int64_t v = int64_t(blockIdx.x) * kThreads + tid; v < vectors;
         v += int64_t(gridDim.x) * kThreads) {
      reinterpret_cast<uint4*>(a.out)[v] = zero4();
    }
  }

  // ---- the tasks. Per iteration: R (ready: the control warp has acquired what the task
  // reads from other blocks), the task's role, S (every store of the task issued).
  Control<kEp, kSplit, kWide> ctl{};
  static_assert(!kSteps || (kFp8 && !kEp), "ring steps are traced at W = 1 with e4m3 only");
  // The optional trace's ring-step records (layout.h): thread 0's (a lane of compute warp 0)
  // first kMegaMoeTraceSteps e4m3 steps at W = 1, each as the moment its wait began and the
  // moment its weights were in, at step_stamps[2 * consumed] (the warp's ring steps so far).
  // Only the instance with kSteps (launched with a trace, W = 1, e4m3 weights) records them;
  // every other instance's code has no trace of them. nullptr on every other thread.
  int64_t* const step_stamps =
      kSteps && trace != nullptr ? trace + kMegaMoeTraceHeader + 3 * kMegaMoeTraceTasks : nullptr;
  for (int iter = 0;; ++iter) {
    if (control && lane == 0) ctl.await_inputs(cur_task, sc, e, l, epoch);
    __syncthreads();  // R(iter)
    if (!cur_task.valid) break;
    if (trace != nullptr && iter < kMegaMoeTraceTasks) trace_task(trace, iter, cur_task, s.offsets);
    if (control) {
      if (lane == 0) ctl.step(iter, next_task, sc, e, l, epoch, s.scalars);
    } else if (cur_task.kind == kReduce) {
      reduce_task<kEp>(cur_task.tile, e, l, s);
    } else if (kEp && cur_task.kind == kFinal) {
      final_task(cur_task.tile, e);
    } else {
      weight_task<kEp, kFp8, kWide, kSteps>(cur_task, sc.subs_of(cur_task), a, l, s, prod,
                                            consumed, ring, step_stamps);
    }
    __syncthreads();  // S(iter): the task's stores are issued; the claim of iter + 2 is in
    if (trace != nullptr && iter < kMegaMoeTraceTasks) {
      trace[kMegaMoeTraceHeader + 2 + 3 * iter] = int64_t(petit_timer());
    }
    if (trace != nullptr) trace[3] = iter + 1;
    if (control && lane == 0) ctl.unpublished = cur_task;
    // Advance. Every step of the finished task was consumed, so pushed: the cursor is past it
    // (in the new current task), or exactly at its end if it never needed to move on.
    cur_task = next_task;
    next_task = sc.task(s.scalars[kClaim0 + (iter + 2) % 3]);
    if (!control) {
      if (prod.iter == iter) {
        prod.cur = prod.next;
        prod.step = 0;
        prod.kstep = 0;
        prod.sub = 0;
        prod.iter = iter + 1;
      }
      prod.next = warp_stream<kFp8>(next_task, a, sc.subs_of(next_task));
      prod.has_next = next_task.valid;
      if (cur_task.valid) produce<kFp8, kWide>(prod, consumed, ring);
    }
  }
  // No weight load is in flight here: the producer only loads the current and the next task,
  // and the loop ends at the first invalid one, whose successors are invalid too.

  if (trace != nullptr) trace[2] = int64_t(petit_timer());
  exit_block<kEp>(e, s, epoch);
#else
  (void)e, (void)w13_map, (void)w2_map;
#endif
}

#endif  // PETIT_SM80_PATH

}  // namespace megamoe_detail

petitError_t megamoe_check(const MegaMoeArgs& a, char* err, int err_len) {
  if (a.num_rows < 0) return refuse(err, err_len, "token count %d must be >= 0", a.num_rows);
  if (a.top_k < 1 || a.top_k > kMaxTopK)
    return refuse(err, err_len, "top-k %d outside [1, %d]", a.top_k, kMaxTopK);
  if (a.hidden <= 0 || a.hidden % kMegaMoeSizeMultiple)
    return refuse(err, err_len, "hidden size %d must be a positive multiple of %d", a.hidden,
                  kMegaMoeSizeMultiple);
  if (a.intermediate <= 0 || a.intermediate % kMegaMoeSizeMultiple)
    return refuse(err, err_len, "intermediate size %d must be a positive multiple of %d",
                  a.intermediate, kMegaMoeSizeMultiple);
  if (a.num_local_experts < 1 || a.num_local_experts > kMaxExperts)
    return refuse(err, err_len, "%d local experts outside [1, %d]", a.num_local_experts,
                  kMaxExperts);
  const int64_t entries = int64_t(a.num_rows) * a.top_k;
  if (entries > kMegaMoeMaxEntries)
    return refuse(err, err_len, "N*K = %lld routing entries above the fused layer's %d",
                  (long long)entries, kMegaMoeMaxEntries);
  if (a.num_sms < 0)
    return refuse(err, err_len, "num_sms %d must be >= 0 (0: the device's SM count)", a.num_sms);
  if (a.timeout_ticks == 0) return refuse(err, err_len, "timeout_ticks must be > 0");
  const std::pair<const void*, const char*> aligned[] = {
      {a.x, "x"}, {a.w13, "w13"}, {a.w2, "w2"}, {a.act, "act"}, {a.partial, "partial"},
      {a.out, "out"}};
  for (const auto& [ptr, name] : aligned) {
    if ((reinterpret_cast<uintptr_t>(ptr) & 15) != 0)
      return refuse(err, err_len, "%s must be 16-byte aligned", name);
  }
  if (a.sync == nullptr) return refuse(err, err_len, "no sync buffer (megamoe_sync_ints)");
  if (a.expert_map != nullptr && a.num_global_experts < 1)
    return refuse(err, err_len, "an expert_map needs >= 1 entries, got %d",
                  a.num_global_experts);
  // block fp8 weights: both scale tensors, H and I whole scale blocks (and ring steps)
  if ((a.w13_scale == nullptr) != (a.w2_scale == nullptr))
    return refuse(err, err_len, "block fp8 weights need both w13_scale and w2_scale");
  if (a.w13_scale != nullptr &&
      (a.hidden % kFp8ScaleBlock || a.intermediate % kFp8ScaleBlock))
    return refuse(err, err_len,
                  "block fp8 weights need hidden (%d) and intermediate (%d) sizes that are "
                  "multiples of %d", a.hidden, a.intermediate, kFp8ScaleBlock);
  if (((reinterpret_cast<uintptr_t>(a.w13_scale) | reinterpret_cast<uintptr_t>(a.w2_scale)) &
       3) != 0)
    return refuse(err, err_len, "w13_scale and w2_scale must be 4-byte aligned");
  return petitSuccess;
}

petitError_t megamoe_ep_check(const MegaMoeEpArgs& e, char* err, int err_len) {
  const EpContextArgs& c = e.ctx;
  const MegaMoeArgs& a = e.layer;
  if (c.heap_base == nullptr || c.token_rank_mask == nullptr || c.world_size < 1)
    return refuse(err, err_len, "context not set up (heap, device state, world size %d)",
                  c.world_size);
  if (a.expert_map != nullptr)
    return refuse(err, err_len, "global ids take no expert_map (the context maps them)");
  if (a.num_rows < 0 || e.region_stride < a.num_rows || e.region_stride < 1 ||
      e.region_stride > c.layout.max_tokens)
    return refuse(err, err_len,
                  "need tokens (%d) <= region stride (%d) <= max tokens per rank (%d), region "
                  "stride >= 1", a.num_rows, e.region_stride, c.layout.max_tokens);
  if (a.top_k > c.layout.max_top_k)
    return refuse(err, err_len, "top-k %d outside [1, %d]", a.top_k, c.layout.max_top_k);
  if (a.hidden != c.layout.hidden)
    return refuse(err, err_len, "hidden size %d != the context's %d", a.hidden,
                  c.layout.hidden);
  if (a.num_local_experts != c.num_local_experts)
    return refuse(err, err_len, "%d local experts != the context's %d", a.num_local_experts,
                  c.num_local_experts);
  if (a.num_sms < 1)
    return refuse(err, err_len, "num_sms %d must be >= 1 (the context's grid)", a.num_sms);
  const int64_t received = int64_t(c.world_size) * e.region_stride * a.top_k;
  if (received > kMegaMoeMaxEntries)
    return refuse(err, err_len,
                  "W*R*K = %d*%d*%d = %lld received routing entries above the fused layer's %d",
                  c.world_size, e.region_stride, a.top_k, (long long)received,
                  kMegaMoeMaxEntries);
  MegaMoeArgs rows = a;  // the experts' view: W x R received rows, local ids
  rows.num_rows = c.world_size * e.region_stride;
  return megamoe_check(rows, err, err_len);
}

petitError_t megamoe_max_blocks(int num_sms, int64_t* blocks) {
  if (num_sms < 0) return petitErrorInvalidValue;
  if (num_sms == 0) {
    int device = 0;
    petitError_t err;
    if ((err = petitGetDevice(&device)) != petitSuccess ||
        (err = petitDeviceGetAttribute(&num_sms, petitDevAttrMultiProcessorCount, device)) !=
            petitSuccess) {
      return err;
    }
  }
  *blocks = int64_t(kMegaMoeBlocksPerSm) * num_sms;
  return petitSuccess;
}

int megamoe_smem_bytes() { return megamoe_detail::SmemLayout::kBytes; }

namespace {

#if PETIT_SM80_PATH && PETIT_SM90A_BUILT
// e4m3 weights at W = 1: the kernel's kWide, from the tasks the call can expect under uniform
// routing, with E[active local experts] = L (1 - (1 - K / E)^N) (E: the experts the ids
// index). Measured on one H100 (docs/experiments/megamoe-fp8.md, "Wide tasks"):
// - gate/up wide where the 16-column tasks outnumber the grid (more than one wave): the wide
//   ones then take a wave fewer at least, each well under twice as long (Qwen3-30B-A3B at 1
//   token: 384 tasks on 264 blocks); with fewer (DeepSeek-V3's 32-expert share at 1-2 tokens:
//   1-2 experts, 128-256 tasks) they only make the one wave longer;
// - down wide too where its 32-row tasks are short (I < 1024: under 2 k steps per warp) and
//   many (>= 8 waves): the down tasks of the experts whose gate/up ends last are the call's
//   tail, which wide tasks made longer at 1-2 tokens and with DeepSeek-V3's 4-step tasks.
int wide_mask(const MegaMoeArgs& a, int grid) {
  namespace md = megamoe_detail;
  if (a.w13_scale == nullptr || a.num_rows == 0) return 0;
  const double local = a.num_local_experts;
  const double indexed = a.expert_map != nullptr ? std::max(a.num_global_experts, 1) : local;
  const double active =
      local * (1.0 - std::pow(1.0 - std::min(1.0, a.top_k / indexed), double(a.num_rows)));
  if (active * (a.intermediate / md::kTileCols) <= grid) return 0;
  const bool down = a.intermediate < 8 * md::kStepK8 &&
                    active * (a.hidden / md::kDownRows) >= 8.0 * grid;
  return (1 << md::kGateUp) | (down ? 1 << md::kDown : 0);
}
#endif

// Encodes the weight maps and launches megamoe_kernel<kEp, split, fp8, wide> with `grid`
// blocks.
template <bool kEp>
petitError_t launch_kernel(const MegaMoeEpArgs& e, int grid, petitStream_t stream) {
#if !PETIT_SM80_PATH || !PETIT_SM90A_BUILT
  (void)e, (void)grid, (void)stream;
  return petitErrorNotSupported;  // no sm_90a image (HIP, other targets): the composed path
#else
  namespace md = megamoe_detail;
  const MegaMoeArgs& a = e.layer;
  int device = 0, cc_major = 0, cc_minor = 0;
  petitError_t err;
  if ((err = petitGetDevice(&device)) != petitSuccess ||
      (err = petitDeviceGetAttribute(&cc_major, petitDevAttrComputeCapabilityMajor, device)) !=
          petitSuccess ||
      (err = petitDeviceGetAttribute(&cc_minor, petitDevAttrComputeCapabilityMinor, device)) !=
          petitSuccess) {
    return err;
  }
  if (cc_major != 9 || cc_minor != 0) return petitErrorNotSupported;  // TMA + sm_90a image
  CUtensorMap w13_map, w2_map;
  const bool fp8 = a.w13_scale != nullptr;
  const int element_bytes = fp8 ? 1 : 2;
  if ((err = gemm::sm90_encode_weight_map_of(&w13_map, a.w13, element_bytes, a.hidden,
                                             a.intermediate, 2,
                                          a.num_local_experts, md::kBoxRows)) != petitSuccess ||
      (err = gemm::sm90_encode_weight_map_of(&w2_map, a.w2, element_bytes, a.intermediate,
                                             a.hidden, 1,
                                          a.num_local_experts, md::kBoxRows)) != petitSuccess) {
    return err;
  }
  // Row groups: split an expert's rows into 16-row tasks where a pass over a block's weight
  // tile (32 rows x the whole k) would re-read it from HBM, i.e. where the tiles that the
  // grid's blocks stream meanwhile exceed L2 (DeepSeek-V3's share: 264 x 458 KB on one H200),
  // and where an expert can have more than 16 rows; otherwise (Qwen3-30B-A3B: 264 x 128 KB)
  // one task per expert and tile, its passes served from L2, where splitting only adds tasks
  // (e4m3: the tile of a wide task, kWide8 times the rows, where the call's tasks are wide)
  // (measured: docs/experiments/megamoe-w1.md). Two kernels, so that the unsplit one pays
  // nothing for it.
  int l2_bytes = 0;
  if ((err = petitDeviceGetAttribute(&l2_bytes, petitDevAttrL2CacheSize, device)) !=
      petitSuccess) {
    return err;
  }
  const int64_t rows = kEp ? int64_t(e.ctx.world_size) * e.region_stride : a.num_rows;
  const int wide = kEp ? 0 : wide_mask(a, grid);
  const int64_t tile_bytes = int64_t(element_bytes) * md::kDownRows * (wide ? md::kWide8 : 1) *
                             std::max(a.hidden, a.intermediate);
  const bool split = rows * a.top_k > md::kPassRows && int64_t(grid) * tile_bytes > l2_bytes;
  const int smem = md::SmemLayout::kBytes;
  // W = 1 programmatic (common/launch.h): the blocks take the SMs as the previous kernel's
  // exit and set up their barriers before its completion, and let the next kernel do the
  // same. Not the EP kernel: where ranks share a GPU, blocks of a kernel started early (its
  // own, or the next one's) could hold the SMs a peer's grid needs to be resident (every
  // rank's grid must be, for the sends before the waits).
  auto launch = [&](auto kernel) {
    petitError_t rc =
        petitFuncSetAttribute(kernel, petitFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (rc != petitSuccess) return rc;
    if (kEp) {  // the EP grid's blocks spin on each other and on the peers': all resident
      int per_sm = 0, sms = 0;
      if ((rc = petitOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, md::kThreads,
                                                               size_t(smem))) != petitSuccess ||
          (rc = petitDeviceGetAttribute(&sms, petitDevAttrMultiProcessorCount, device)) !=
              petitSuccess) {
        return rc;
      }
      if (int64_t(grid) > int64_t(per_sm) * sms) return petitErrorCooperativeLaunchTooLarge;
    }
    return launch_with_attributes(kernel, grid, md::kThreads, smem, 1, !kEp, stream, e, w13_map,
                                  w2_map);
  };
  // megamoe_kernel<kEp, split, fp8, wide, steps>: the instance by the tags' values
  auto instance = [&](auto fp8_tag, auto wide_tag, auto steps_tag) {
    constexpr bool kF = decltype(fp8_tag)::value, kS = decltype(steps_tag)::value;
    constexpr int kW = decltype(wide_tag)::value;
    return split ? launch(md::megamoe_kernel<kEp, true, kF, kW, kS>)
                 : launch(md::megamoe_kernel<kEp, false, kF, kW, kS>);
  };
  using Narrow = std::integral_constant<int, 0>;
  if constexpr (!kEp) {
    if (fp8) {  // the wide kinds; with a trace, the instances that trace ring steps too
      auto by_wide = [&](auto steps_tag) {
        using GateUpWide = std::integral_constant<int, 1 << md::kGateUp>;
        using AllWide = std::integral_constant<int, GateUpWide::value | 1 << md::kDown>;
        if (wide == AllWide::value) return instance(std::true_type{}, AllWide{}, steps_tag);
        if (wide == GateUpWide::value) return instance(std::true_type{}, GateUpWide{}, steps_tag);
        return instance(std::true_type{}, Narrow{}, steps_tag);
      };
      return e.layer.trace != nullptr ? by_wide(std::true_type{}) : by_wide(std::false_type{});
    }
  }
  return fp8 ? instance(std::true_type{}, Narrow{}, std::false_type{})
             : instance(std::false_type{}, Narrow{}, std::false_type{});
#endif
}

}  // namespace

petitError_t launch_megamoe(const MegaMoeArgs& args, petitStream_t stream) {
  petitError_t err = megamoe_check(args, nullptr, 0);
  if (err != petitSuccess) return err;
#if !PETIT_SM80_PATH || !PETIT_SM90A_BUILT
  return petitErrorNotSupported;  // no sm_90a image (HIP, other targets): the composed path
#else
  if (args.num_rows == 0) return petitSuccess;
  int64_t max_blocks = 0;
  if ((err = megamoe_max_blocks(args.num_sms, &max_blocks)) != petitSuccess) return err;
  // kBlocksPerSm blocks per SM, fewer when the most row groups the entries can form have fewer
  // tasks (an active expert's groups: its rows / 16, rounded up).
  const int64_t entries = int64_t(args.num_rows) * args.top_k;
  const int64_t max_groups = std::min<int64_t>(
      entries, std::min<int64_t>(entries, args.num_local_experts) +
                   entries / megamoe_detail::kPassRows);
  const int64_t max_tasks =
      max_groups * (args.intermediate / megamoe_detail::kTileCols +
                    args.hidden / megamoe_detail::kDownRows) +
      args.hidden / megamoe_detail::kDownRows;
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(max_blocks, max_tasks)));
  MegaMoeEpArgs e{};
  e.layer = args;
  return launch_kernel<false>(e, grid, stream);
#endif
}

petitError_t launch_megamoe_ep(const MegaMoeEpArgs& args, petitStream_t stream) {
  petitError_t err = megamoe_ep_check(args, nullptr, 0);
  if (err != petitSuccess) return err;
  // Every block takes part in the send phase before any waits for the other ranks: the grid
  // must be co-resident, two blocks on each of the rank's num_sms SMs. Refused here when it
  // cannot be (num_sms above the device's SMs; launch_kernel: occupancy x SMs below the
  // grid), instead of a trap after the wait bound. What no launch can check (docs/faults.md):
  // that no other kernel holds those SMs meanwhile (another stream, another process).
  int device = 0, device_sms = 0;
  if ((err = petitGetDevice(&device)) != petitSuccess ||
      (err = petitDeviceGetAttribute(&device_sms, petitDevAttrMultiProcessorCount, device)) !=
          petitSuccess) {
    return err;
  }
  if (args.layer.num_sms > device_sms) return petitErrorCooperativeLaunchTooLarge;
  return launch_kernel<true>(args, kMegaMoeBlocksPerSm * args.layer.num_sms, stream);
}

}  // namespace petit
