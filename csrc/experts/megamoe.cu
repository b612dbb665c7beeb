// MegaMoE at W=1: a whole MoE layer (routing -> gate/up + SiLU·mul -> down + routing weight ->
// top-k reduction) as ONE persistent launch. Design and invariants: docs/architecture.md,
// "The fused layer (MegaMoE)".
//
// Why: in decode the composed chain (row lists, gate/up, down, reduction: 3-4 launches) pays
// each launch's start and each hand-off on the critical path while the weights, the only large
// operand, wait. Here every block starts streaming weights right after a few microseconds of
// routing it computes itself, and the down GEMM of an expert starts as soon as that expert's
// activations exist, while other experts' gate/up tiles still stream.
//
// Structure (one block = 8 warps, one block per SM: the weight-streaming passes want more
// registers than two blocks would leave; grid <= SMs):
//   1. Routing, redundantly in every block's shared memory (no inter-block sync): local expert
//      of every entry, per-expert counts and offsets, the list of experts with rows, and a
//      stable counting sort of the entries (positions agree across blocks because the sort
//      is deterministic). Limited to kMegaMoeMaxEntries entries (N*K).
//   2. Tasks, claimed in order from one counter: first every (active expert, 16-column
//      gate/up tile), then every (active expert, 32-row down tile), experts in the same order.
//      A task is 32 weight rows (gate + up rows of the same 16 columns, or 32 rows of w2) times
//      the whole k range, split over the 8 warps and summed in shared memory. The weights are
//      the M operand of mma.sync m16n8k16 (loaded straight into registers, gemm/sm80_mma.h)
//      and the expert's rows the N operand, 8 per n-tile, up to 16 per pass.
//   3. A gate/up task writes act[pos][cols] (bf16(silu(gate) * up)) and raises its expert's
//      counter; a down task issues its first weight loads, waits (bounded) until its expert's
//      counter shows every gate/up tile, then writes weight * (act . w2^T) as fp32 partials
//      per routing entry and raises its row tile's counter. The task that completes a row tile
//      (one arrival per active expert) sums the tile's partials of every token over its top-k
//      slots in slot order (fp32, deterministic) and writes out[:, tile] in bf16.
//   4. The last block to finish resets every counter to 0, so the next call (same stream)
//      starts from zeros: no memset launch, CUDA-graph capturable.
// Deadlock freedom does not depend on co-residency: a down task waits only on gate/up tasks,
// which were all claimed before it (claims are ordered) by blocks that run them without waiting.
#include <algorithm>
#include <cstdio>

#include "api.h"
#include "common/block_scan.h"
#include "common/expert_ids.h"
#include "gemm/epilogues.h"
#if PETIT_SM80_PATH
#include "gemm/sm80_mma.h"
#endif

namespace petit {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileCols = 16;    // gate/up task: 16 columns of I (16 gate + 16 up weight rows)
constexpr int kDownRows = 32;    // down task: 32 rows of H (two 16-row m-tiles)
constexpr int kSpan = 32;        // k elements per step (two mma.sync k16)
constexpr int kMaxNTiles = 2;    // n-tiles of 8 rows per pass: 16 expert rows
constexpr int kPassRows = 8 * kMaxNTiles;

// Offsets of the block's shared memory (dynamic, 16-byte aligned pieces).
struct SmemLayout {
  static constexpr int kExpertOf = 0;                                          // int16 [E]
  static constexpr int kSorted = kExpertOf + 2 * kMegaMoeMaxEntries;           // int32 [E]
  static constexpr int kOffsets = kSorted + 4 * kMegaMoeMaxEntries;           // int32 [L+1]
  static constexpr int kCursor = kOffsets + 4 * (kMaxExperts + 16);           // int32 [L]
  static constexpr int kActive = kCursor + 4 * kMaxExperts;                   // int32 [L]
  static constexpr int kScan = kActive + 4 * kMaxExperts;                     // int32 [threads]
  static constexpr int kScalars = kScan + 4 * kThreads;                       // int32 [8]
  static constexpr int kReduce = kScalars + 4 * 8;  // float [warps][2][n-tiles][4][32]
  static constexpr int kBytes = kReduce + 4 * kWarps * 2 * kMaxNTiles * 4 * 32;
};
static_assert(SmemLayout::kBytes <= 100 * 1024, "fits next to the L1 share");
enum Scalar { kNumActive = 0, kClaim0 = 1, kClaim1 = 2, kReduceHere = 3 };

// Sync words (MegaMoeArgs::sync): all zero between calls.
enum SyncWord { kSyncClaim = 0, kSyncExit = 1, kSyncExperts = 2 };

#if PETIT_SM80_PATH

PETIT_DEVICE uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

PETIT_DEVICE float as_float(uint32_t bits) {
  union { uint32_t u; float f; } v;
  v.u = bits;
  return v.f;
}

// Source of one B column (an expert row) of the current pass: x rows (gate/up, read-only) or
// act rows (down, written by other blocks in this launch: loaded through L2).
template <bool kFromAct>
PETIT_DEVICE uint4 load_b(const petit_bf16_bits* row, int k) {
  if (row == nullptr) return zero4();
  if constexpr (kFromAct) {
    return petit_load_cg(reinterpret_cast<const uint4*>(row + k));
  } else {
#if PETIT_SM80_DEVICE
    return __ldg(reinterpret_cast<const uint4*>(row + k));
#else
    return *reinterpret_cast<const uint4*>(row + k);
#endif
  }
}

// A block's bounded wait until *counter >= target (thread 0 spins, everyone meets after).
PETIT_DEVICE void block_wait_count(const int* counter, int target, uint64_t timeout_ticks,
                                   int expert) {
  if (threadIdx.x == 0) {
    const uint64_t start = petit_timer();
    int seen = petit_load_acquire_gpu(counter);
    while (seen < target) {
      if (petit_timer() - start > timeout_ticks) {
        printf("petit_moe: fused MoE layer (W=1) timed out in block %d waiting for the gate/up "
               "tiles of local expert %d: %d of %d arrived\n",
               int(blockIdx.x), expert, seen, target);
        petit_trap();
      }
      seen = petit_load_acquire_gpu(counter);
    }
  }
  __syncthreads();
}

// One pass of a task: the two 16-row halves of its weights (rows lo0 .. lo0 + 15 and
// hi0 .. hi0 + 15, `row_stride` elements apart) against up to 8 * kNT expert rows (b_rows:
// this lane's B column, nullptr = none); this warp covers k steps [s0, s1) and leaves its fp32
// sums in red[warp]. With wait_counter (a down task's first pass) the block waits there, after
// the first weight loads went out, until the expert's activations exist.
template <int kNT, bool kFromAct>
PETIT_DEVICE void task_pass(const petit_bf16_bits* lo0, const petit_bf16_bits* hi0,
                            int64_t row_stride, const petit_bf16_bits* const (&b_rows)[kNT],
                            int s0, int s1, float* red, const int* wait_counter, int wait_target,
                            uint64_t timeout_ticks, int wait_expert) {
  const int lane = petit_lane_id(), g = lane / 4, q = lane % 4;
  // This lane's 16 bytes of weight rows g and g + 8 of each half, at k = 8q of the span.
  const petit_bf16_bits* const w0 = lo0 + g * row_stride + 8 * q;
  const petit_bf16_bits* const w1 = lo0 + (g + 8) * row_stride + 8 * q;
  const petit_bf16_bits* const w2 = hi0 + g * row_stride + 8 * q;
  const petit_bf16_bits* const w3 = hi0 + (g + 8) * row_stride + 8 * q;
  float acc[2][kNT][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[h][j][r] = 0.0f;

  // Weights one step ahead of the multiply (two steps of this warp in flight); the first
  // step's loads go out before a down task's wait for its expert's activations.
  uint4 c0, c1, c2, c3;
  if (s0 < s1) {
    const int k = s0 * kSpan;
    c0 = gemm::load_stream(w0 + k);
    c1 = gemm::load_stream(w1 + k);
    c2 = gemm::load_stream(w2 + k);
    c3 = gemm::load_stream(w3 + k);
  }
  if (wait_counter != nullptr) block_wait_count(wait_counter, wait_target, timeout_ticks,
                                                wait_expert);
#pragma unroll 1
  for (int s = s0; s < s1; ++s) {
    const int k = s * kSpan;
    uint4 b[kNT];
#pragma unroll
    for (int j = 0; j < kNT; ++j) b[j] = load_b<kFromAct>(b_rows[j], k + 8 * q);
    uint4 n0, n1, n2, n3;
    if (s + 1 < s1) {
      n0 = gemm::load_stream(w0 + k + kSpan);
      n1 = gemm::load_stream(w1 + k + kSpan);
      n2 = gemm::load_stream(w2 + k + kSpan);
      n3 = gemm::load_stream(w3 + k + kSpan);
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      gemm::mma_span32(acc[0][j], c0, c1, b[j]);
      gemm::mma_span32(acc[1][j], c2, c3, b[j]);
    }
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
  }
  // red[warp][half][n-tile][reg][lane]
  float* mine = red + petit_warp_id() * (2 * kMaxNTiles * 4 * 32);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) mine[((h * kMaxNTiles + j) * 4 + r) * 32 + lane] = acc[h][j][r];
}

// Sum over the warps of output (half, weight row `row` in [0, 16), expert row n in [0, 32)).
PETIT_DEVICE float reduced(const float* red, int half, int row, int n) {
  const int j = n / 8, col = n % 8;
  const int reg = (col % 2) + 2 * (row / 8), lane = (row % 8) * 4 + col / 2;
  const int idx = ((half * kMaxNTiles + j) * 4 + reg) * 32 + lane;
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w * (2 * kMaxNTiles * 4 * 32) + idx];
  return sum;
}

// Runs task_pass with the smallest n-tile count that covers `rows` expert rows.
template <bool kFromAct>
PETIT_DEVICE void task_pass_rows(int rows, const petit_bf16_bits* lo0, const petit_bf16_bits* hi0,
                                 int64_t row_stride, const petit_bf16_bits* const (&b_rows)[kMaxNTiles],
                                 int s0, int s1, float* red, const int* wait_counter,
                                 int wait_target, uint64_t timeout_ticks, int wait_expert) {
  if (rows <= 8) {
    const petit_bf16_bits* const b1[1] = {b_rows[0]};
    task_pass<1, kFromAct>(lo0, hi0, row_stride, b1, s0, s1, red, wait_counter, wait_target,
                           timeout_ticks, wait_expert);
  } else {
    task_pass<2, kFromAct>(lo0, hi0, row_stride, b_rows, s0, s1, red, wait_counter,
                           wait_target, timeout_ticks, wait_expert);
  }
}

#endif  // PETIT_SM80_PATH

PETIT_GLOBAL void PETIT_LAUNCH_BOUNDS(kThreads, 1) megamoe_w1_kernel(const MegaMoeArgs a) {
#if PETIT_SM80_BODY
  PETIT_DYNAMIC_SMEM(smem);
  int16_t* expert_of = reinterpret_cast<int16_t*>(smem + SmemLayout::kExpertOf);
  int32_t* sorted = reinterpret_cast<int32_t*>(smem + SmemLayout::kSorted);
  int32_t* offsets = reinterpret_cast<int32_t*>(smem + SmemLayout::kOffsets);
  int32_t* cursor = reinterpret_cast<int32_t*>(smem + SmemLayout::kCursor);
  int32_t* active = reinterpret_cast<int32_t*>(smem + SmemLayout::kActive);
  int32_t* scan = reinterpret_cast<int32_t*>(smem + SmemLayout::kScan);
  int32_t* scalars = reinterpret_cast<int32_t*>(smem + SmemLayout::kScalars);
  float* red = reinterpret_cast<float*>(smem + SmemLayout::kReduce);

  const int tid = threadIdx.x, lane = petit_lane_id();
  const int N = a.num_rows, K = a.top_k, H = a.hidden, I = a.intermediate;
  const int L = a.num_local_experts, num_entries = N * K;
  int* sync = a.sync;
  int* gate_up_done = sync + kSyncExperts;   // [L] by local expert
  int* tile_done = gate_up_done + L;         // [H / kDownRows] by down row tile

  if (tid == 0) scalars[kClaim0] = atomicAdd(&sync[kSyncClaim], 1);  // first claim, early

  // ---- 1. routing in shared memory
  for (int i = tid; i < num_entries; i += kThreads) {
    expert_of[i] = int16_t(local_expert_id(a.topk_ids, a.expert_map, a.num_global_experts, L, i));
  }
  for (int e = tid; e < L; e += kThreads) cursor[e] = 0;
  __syncthreads();
  for (int i = tid; i < num_entries; i += kThreads) {
    const int e = expert_of[i];
    if (e >= 0) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();
  {
    constexpr int kItems = kMaxExperts / kThreads;
    int32_t counts[kItems], flags[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = tid * kItems + i;
      counts[i] = e < L ? cursor[e] : 0;
      flags[i] = counts[i] > 0 ? 1 : 0;
    }
    int32_t total = 0, num_active = 0;
    int32_t offset = block_exclusive_scan<kThreads, kItems>(counts, scan, &total);
    __syncthreads();
    int32_t slot = block_exclusive_scan<kThreads, kItems>(flags, scan, &num_active);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = tid * kItems + i;
      if (e < L) {
        offsets[e] = offset;
        cursor[e] = offset;
        if (flags[i]) active[slot++] = e;
      }
      offset += counts[i];
    }
    if (tid == 0) {
      offsets[L] = total;
      scalars[kNumActive] = num_active;
    }
  }
  __syncthreads();
  if (petit_warp_id() == 0) {  // stable scatter: entry order within each expert
    for (int base = 0; base < num_entries; base += 32) {
      const int i = base + lane;
      const int e = i < num_entries ? expert_of[i] : -1;
      const petit_lanemask_t same = petit_match_any(e);
      const petit_lanemask_t below = same & petit_lanemask_lt();
      if (e >= 0) sorted[cursor[e] + petit_popc(below)] = i;
      petit_syncwarp();
      if (e >= 0 && below == 0) cursor[e] += petit_popc(same);
      petit_syncwarp();
    }
  }
  __syncthreads();

  const int num_active = scalars[kNumActive];
  const int gate_up_tiles = I / kTileCols, down_tiles = H / kDownRows;
  const int num_gate_up_tasks = num_active * gate_up_tiles;
  const int num_tasks = num_gate_up_tasks + num_active * down_tiles;
  if (num_active == 0) {  // no entry served: the layer's output is 0
    const int64_t vectors = int64_t(N) * H / 8;
    for (int64_t v = int64_t(blockIdx.x) * kThreads + tid; v < vectors;
         v += int64_t(gridDim.x) * kThreads) {
      reinterpret_cast<uint4*>(a.out)[v] = zero4();
    }
  }

  // ---- 2. tasks
  const int warp = petit_warp_id();
  for (int iter = 0;; ++iter) {
    const int task = scalars[kClaim0 + (iter & 1)];
    if (task >= num_tasks) break;
    if (tid == 0) scalars[kClaim0 + ((iter + 1) & 1)] = atomicAdd(&sync[kSyncClaim], 1);
    const bool gate_up = task < num_gate_up_tasks;
    const int local = gate_up ? task : task - num_gate_up_tasks;
    const int tiles = gate_up ? gate_up_tiles : down_tiles;
    const int e = active[local / tiles], tile = local % tiles;
    const int begin = offsets[e], count = offsets[e + 1] - begin;
    const int k_total = gate_up ? H : I;
    const int steps = k_total / kSpan;
    const int s0 = warp * steps / kWarps, s1 = (warp + 1) * steps / kWarps;
    const int g = lane / 4;
    for (int pass = 0; pass < count; pass += kPassRows) {
      const int rows = min(kPassRows, count - pass);
      const petit_bf16_bits* b_rows[kMaxNTiles];
#pragma unroll
      for (int j = 0; j < kMaxNTiles; ++j) {
        const int r = pass + j * 8 + g;
        b_rows[j] = nullptr;
        if (r < count) {
          b_rows[j] = gate_up ? a.x + int64_t(sorted[begin + r] / K) * H
                              : a.act + int64_t(begin + r) * I;
        }
      }
      if (gate_up) {
        const petit_bf16_bits* gate0 = a.w13 + (int64_t(e) * 2 * I + tile * kTileCols) * H;
        task_pass_rows<false>(rows, gate0, gate0 + int64_t(I) * H, H, b_rows, s0, s1, red,
                              nullptr, 0, a.timeout_ticks, e);
      } else {
        const petit_bf16_bits* w0 = a.w2 + (int64_t(e) * H + tile * kDownRows) * I;
        task_pass_rows<true>(rows, w0, w0 + int64_t(16) * I, I, b_rows, s0, s1, red,
                             pass == 0 ? &gate_up_done[e] : nullptr, gate_up_tiles,
                             a.timeout_ticks, e);
      }
      __syncthreads();
      // Epilogue: thread -> (expert row n, 2 or 4 consecutive weight rows).
      const int n = tid / 8, part = tid % 8;
      if (n < rows) {
        const int pos = begin + pass + n;
        if (gate_up) {
          const int c = 2 * part;  // columns c, c + 1 of the tile
          const float a0 = gemm::silu(reduced(red, 0, c, n)) * reduced(red, 1, c, n);
          const float a1 = gemm::silu(reduced(red, 0, c + 1, n)) * reduced(red, 1, c + 1, n);
          const uint32_t packed = uint32_t(petit_float_to_bf16(a0)) |
                                  (uint32_t(petit_float_to_bf16(a1)) << 16);
          *reinterpret_cast<uint32_t*>(a.act + int64_t(pos) * I + tile * kTileCols + c) = packed;
        } else {
          const int entry = sorted[pos];
          const float weight = a.topk_weights[entry];
          const int r0 = 4 * part;  // rows r0 .. r0 + 3 of the tile (half r0 / 16)
          float4 v;
          v.x = weight * reduced(red, r0 / 16, r0 % 16, n);
          v.y = weight * reduced(red, r0 / 16, r0 % 16 + 1, n);
          v.z = weight * reduced(red, r0 / 16, r0 % 16 + 2, n);
          v.w = weight * reduced(red, r0 / 16, r0 % 16 + 3, n);
          *reinterpret_cast<float4*>(a.partial + int64_t(entry) * H + tile * kDownRows + r0) = v;
        }
      }
      __syncthreads();  // red is reused by the next pass
    }
    // Publish: every thread's stores, then one arrival (release by fence + atomic).
    __threadfence();
    __syncthreads();
    if (gate_up) {
      if (tid == 0) atomicAdd(&gate_up_done[e], 1);
    } else {
      if (tid == 0) scalars[kReduceHere] = atomicAdd(&tile_done[tile], 1) == num_active - 1;
      __syncthreads();
      if (scalars[kReduceHere]) {  // every expert's partials of this row tile have arrived
        __threadfence();
        const int r0 = 4 * (tid % 8);
        for (int n = tid / 8; n < N; n += kThreads / 8) {
          float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int k = 0; k < K; ++k) {
            const int entry = n * K + k;
            if (expert_of[entry] < 0) continue;
            const uint4 raw = petit_load_cg(reinterpret_cast<const uint4*>(
                a.partial + int64_t(entry) * H + tile * kDownRows + r0));
            s[0] += as_float(raw.x);
            s[1] += as_float(raw.y);
            s[2] += as_float(raw.z);
            s[3] += as_float(raw.w);
          }
          uint2 packed;
          packed.x = uint32_t(petit_float_to_bf16(s[0])) | (uint32_t(petit_float_to_bf16(s[1])) << 16);
          packed.y = uint32_t(petit_float_to_bf16(s[2])) | (uint32_t(petit_float_to_bf16(s[3])) << 16);
          *reinterpret_cast<uint2*>(a.out + int64_t(n) * H + tile * kDownRows + r0) = packed;
        }
      }
    }
    __syncthreads();
  }

  // ---- 3. the last block out resets the counters for the next call
  __threadfence();
  __syncthreads();
  if (tid == 0) scalars[kReduceHere] = atomicAdd(&sync[kSyncExit], 1) == int(gridDim.x) - 1;
  __syncthreads();
  if (scalars[kReduceHere]) {
    __threadfence();
    for (int i = tid; i < megamoe_sync_ints(L, H); i += kThreads) sync[i] = 0;
    __threadfence();
  }
#else
  (void)a;
#endif
}

}  // namespace

petitError_t megamoe_check(const MegaMoeArgs& a) {
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(a.w13) |
        reinterpret_cast<uintptr_t>(a.w2) | reinterpret_cast<uintptr_t>(a.act) |
        reinterpret_cast<uintptr_t>(a.partial) | reinterpret_cast<uintptr_t>(a.out)) & 15) == 0;
  if (a.num_rows < 0 || a.top_k < 1 || a.top_k > kMaxTopK || a.hidden <= 0 ||
      a.hidden % kMegaMoeSizeMultiple || a.intermediate <= 0 ||
      a.intermediate % kMegaMoeSizeMultiple || a.num_local_experts < 1 ||
      a.num_local_experts > kMaxExperts || int64_t(a.num_rows) * a.top_k > kMegaMoeMaxEntries ||
      a.num_sms < 0 || a.timeout_ticks == 0 || !aligned || a.sync == nullptr ||
      (a.expert_map != nullptr && a.num_global_experts < 1)) {
    return petitErrorInvalidValue;
  }
  return petitSuccess;
}

int megamoe_smem_bytes() { return SmemLayout::kBytes; }

petitError_t launch_megamoe(const MegaMoeArgs& args, petitStream_t stream) {
  petitError_t err = megamoe_check(args);
  if (err != petitSuccess) return err;
#if !PETIT_SM80_PATH
  return petitErrorNotSupported;  // HIP: no mma.sync (the composed path serves)
#else
  if (args.num_rows == 0) return petitSuccess;
  int device = 0, num_sms = args.num_sms, cc_major = 0;
  if ((err = petitGetDevice(&device)) != petitSuccess) return err;
  if ((err = petitDeviceGetAttribute(&cc_major, petitDevAttrComputeCapabilityMajor, device)) !=
      petitSuccess) {
    return err;
  }
  if (cc_major < 8) return petitErrorNotSupported;
  if (num_sms == 0 &&
      (err = petitDeviceGetAttribute(&num_sms, petitDevAttrMultiProcessorCount, device)) !=
          petitSuccess) {
    return err;
  }
  // One block per SM, fewer when the largest possible active-expert set has fewer tasks.
  const int64_t max_active = std::min<int64_t>(int64_t(args.num_rows) * args.top_k,
                                               args.num_local_experts);
  const int64_t max_tasks = max_active * (args.intermediate / kTileCols + args.hidden / kDownRows);
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(num_sms, max_tasks)));
  const int smem = SmemLayout::kBytes;
  err = petitFuncSetAttribute(megamoe_w1_kernel, petitFuncAttributeMaxDynamicSharedMemorySize,
                              smem);
  if (err != petitSuccess) return err;
  petitLaunchKernel(megamoe_w1_kernel, dim3(grid), dim3(kThreads), smem, stream, args);
  return petitGetLastError();
#endif
}

}  // namespace petit
