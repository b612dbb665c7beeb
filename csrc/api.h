// Framework-free launchers of every kernel family. Each launcher validates what it can
// without touching device data, launches on `stream` and returns an error code
// (petitSuccess or the launch error). No torch types cross this header.
#pragma once

#include "common/check.h"
#include "common/config.h"
#include "common/layout.h"

namespace petit {

// ------------------------------------------------------------------ wait bounds
// The bound of the kernels' spin-waits in seconds (megamoe_forward's timeout_s,
// EpContextParams::timeout_s): petitErrorInvalidValue, with the reason in `err` (nullptr: none),
// outside (0, kMaxTimeoutS] (timeout_s_valid, layout.h). The one message of the binding and
// EpContext. timeout_ticks: a valid bound in petit_timer ticks (MegaMoeArgs::timeout_ticks,
// EpContextArgs::timeout_ticks).
inline petitError_t timeout_check(double timeout_s, char* err, int err_len) {
  if (timeout_s_valid(timeout_s)) return petitSuccess;
  return refuse(err, err_len, "timeout_s %g outside (0, %g] seconds (the bound of every spin-wait)",
                timeout_s, double(kMaxTimeoutS));
}
inline uint64_t timeout_ticks(double timeout_s) {
  return uint64_t(timeout_s * petit_timer_ticks_per_second());
}

// ------------------------------------------------------------------ routing.cu
// Per-local-expert row lists from a routing block (a stable counting sort, device-side
// counts only, no host sync). See docs/architecture.md, "Per-local-expert row lists".
struct RowListArgs {
  const int32_t* topk_ids;   // [num_entries] expert ids (entry = row*K + k): local ids or -1,
                             // or global ids when expert_map is set (expert_ids.h)
  const int32_t* expert_map; // [num_global_experts] global -> local id or -1; nullptr: none
  int num_global_experts;    // E (with expert_map)
  int num_entries;           // N*K
  int num_local_experts;     // L <= kMaxExperts
  int32_t* workspace;        // [row_list_workspace_ints(num_entries, L)]
  int32_t* expert_counts;    // [L]
  int32_t* expert_offsets;   // [L+1]
  int32_t* sorted_entries;   // [num_entries]
  int32_t* expert_done;      // [L+1] set to 0 here (the fused GEMMs' counters), or nullptr
};
constexpr int kRowListChunk = 1024;  // entries per block
PETIT_HOST_DEVICE int64_t row_list_workspace_ints(int num_entries, int num_local_experts) {
  return int64_t(ceil_div(num_entries > 0 ? num_entries : 1, kRowListChunk)) * num_local_experts;
}
// petitErrorInvalidValue, with the reason in `err` (nullptr: none), where num_local_experts is
// outside [1, kMaxExperts], num_entries < 0 or an expert_map has no entries. Reads no pointer
// (the binding runs it before it allocates the lists); launch_expert_row_lists runs it too.
petitError_t row_lists_check(const RowListArgs& args, char* err, int err_len);
petitError_t launch_expert_row_lists(const RowListArgs& args, petitStream_t stream);

// ----------------------- tile_choice.cu, gemm_sm90.cu, gemm_simt.cu, reduce.cu
// Expert grouped GEMMs on the row lists above (see docs/architecture.md, "Expert GEMMs").
// With pos = a position in sorted_entries order, entry = sorted_entries[pos], e = the local
// expert of pos, row = entry / K:
//   gate/up:  act[pos] = bf16(silu(x[row] . w13[e, :I]^T) * (x[row] . w13[e, I:]^T))
//   down:     partial[entry] = bf16(weight[entry] * (act[pos] . w2[e]^T))
//   reduce:   out[row] = bf16(sum over k = 0..K-1 with a local id of partial[row*K + k]),
//             accumulated in fp32 in slot order (deterministic); rows with no local id get 0.
// Only the rows [0, offsets[L]) of act and the partial rows of valid entries are written and
// read, so neither workspace needs clearing. Limits: H, I multiples of 8, L <= kMaxExperts,
// K <= kMaxTopK, N*K < 2^31; every pointer 16-byte aligned.
//
// Tile families: one Hopper family (sm_90a, warp-specialized wgmma) in four regimes, and the
// portable SIMT fallback. kExpertTilesAuto picks one (tile_choice.cu, choose_expert_tiles, with
// the bounds of ExpertGemmArgs::config); naming another forces it (for tests and debugging).
// The Hopper regimes return petitErrorNotSupported where the build has no sm_90a image or the
// device is not compute capability 9.0 (HIP, older GPUs). wgmma_narrow and wgmma_m64 give the
// same bits, as do wgmma and wgmma_mc; the SIMT family sums in another order.
enum ExpertTiles : int {
  kExpertTilesAuto = 0,
  // Portable SIMT fallback: 16-row tiles (few rows per expert: weight-bandwidth bound) below
  // config.simt_large_min_rows routing entries per local expert, 128-row tiles from there.
  kExpertTilesSimt = 1,
  // 64 x 128 x 64 tiles, gate/up and down as one fused launch (expert_fused_gemms), for very
  // few rows per expert. Auto: below config.narrow_max_rows.
  kExpertTilesWgmmaNarrow = 2,
  // 64 x 256 x 64 tiles, gate/up and down as one fused launch. Auto: below
  // config.m64_max_rows, in a kernel that runs the narrow tiles instead where the m64 ones
  // would leave more than half of the SMs idle (decided on the device).
  kExpertTilesWgmmaM64 = 3,
  // 128 x 256 x 64 tiles, a launch per GEMM, the down GEMM with a staged epilogue. Auto: from
  // config.m64_max_rows.
  kExpertTilesWgmma = 4,
  // kExpertTilesWgmma's tiles in clusters of 2 CTAs that take two m-tiles of one (expert,
  // n-tile) and load each weight box once for both (TMA multicast), or two n-tiles of an
  // expert's odd last m-tile. Auto: from config.mc_min_rows at hidden sizes from
  // config.mc_min_hidden.
  kExpertTilesWgmmaMc = 5,
  kExpertTilesLast = kExpertTilesWgmmaMc,
};

struct ExpertGemmArgs {
  const petit_bf16_bits* x;        // [N, H] received rows (GEMM1 A, gathered by entry / K)
  const int32_t* topk_ids;         // [N*K] local expert ids or -1 (ids outside [0, L) skipped),
                                   // or global ids when expert_map is set (expert_ids.h)
  const int32_t* expert_map;       // [num_global_experts] global -> local id or -1; or nullptr
  int num_global_experts;          // E (with expert_map)
  const float* topk_weights;       // [N*K] routing weights
  const petit_bf16_bits* w13;      // [L, 2I, H] gate rows [0, I), up rows [I, 2I)
  const petit_bf16_bits* w2;       // [L, H, I]
  const int32_t* expert_offsets;   // [L+1] from launch_expert_row_lists
  const int32_t* sorted_entries;   // [N*K] from launch_expert_row_lists
  petit_bf16_bits* act;            // [N*K, I] workspace (expert_act_workspace_elems)
  petit_bf16_bits* partial;        // [N*K, H] bf16 workspace (expert_partial_workspace_elems)
  petit_bf16_bits* out;            // [N, H]
  int num_rows;                    // N
  int top_k;                       // K
  int hidden;                      // H
  int intermediate;                // I
  int num_local_experts;           // L
  int tiles;                       // ExpertTiles
  int num_sms;                     // persistent grid = num_sms x blocks per SM; 0: query device
  // Fused GEMMs (set where expert_fused_gemms; nullptr otherwise): per local expert, the
  // arrivals of its finished gate/up tiles, then the counter of claimed tiles; all zero at
  // launch (launch_expert_row_lists zeroes them through RowListArgs::expert_done).
  int32_t* gate_up_done;           // [L+1]
  ExpertConfig config;             // auto's regime bounds (common/config.h)
};
// The 64-row regimes (wgmma_narrow, wgmma_m64) run gate/up and down as one persistent launch:
// the gate/up tiles and then the down tiles of the call through one ring, each block claiming
// the next tile when its ring has room; a down tile's producer starts loading an expert's act
// rows once all of that expert's gate/up tiles have arrived (gate_up_done), so the down tiles
// fill the SMs the last gate/up tiles leave idle and the call has one kernel boundary less.
// Whether a call with these arguments (num_sms set) runs them, i.e. needs gate_up_done.
bool expert_fused_gemms(const ExpertGemmArgs& args);
PETIT_HOST_DEVICE int64_t expert_act_workspace_elems(int num_rows, int top_k, int intermediate) {
  return int64_t(num_rows) * top_k * intermediate;
}
PETIT_HOST_DEVICE int64_t expert_partial_workspace_elems(int num_rows, int top_k, int hidden) {
  return int64_t(num_rows) * top_k * hidden;
}
// petitErrorInvalidValue, with the reason in `err` (nullptr: none), where a call is outside the
// limits above (H, I, K, L, N*K), names no ExpertTiles, has num_sms < 0, an invalid config or
// an expert_map of no entries. Reads no pointer and makes no CUDA call (the binding runs it
// before it allocates the workspaces). The launchers below run it too, and with rows refuse
// besides a pointer that is null or not 16-byte aligned.
petitError_t experts_check(const ExpertGemmArgs& args, char* err, int err_len);
// Gate/up, down (one fused launch in the 64-row regimes) and the local reduction, in stream
// order. num_sms = 0: the current device's SM count, queried once per device and process.
petitError_t launch_experts(const ExpertGemmArgs& args, petitStream_t stream);
// The local reduction alone (the last step of launch_experts).
petitError_t launch_expert_reduce(const ExpertGemmArgs& args, petitStream_t stream);
// The tile family launch_experts runs for these arguments (args.tiles, or auto's choice by
// the sizes and args.config on the current device).
int resolve_expert_tiles(const ExpertGemmArgs& args);
// Whether this build has sm_90a images and the current device runs them (compute capability
// exactly 9.0): the Hopper GEMM family and the fused layer (megamoe.cu) need both.
bool sm90a_kernels_supported();
// Launch shape of this process's most recent gate/up (gate_up) or down GEMM launch, for
// diagnostics (the persistent grid a family got on this device; cluster = CTAs per
// thread-block cluster, 1 without). All zeros before the first launch; not per thread.
struct ExpertLaunchShape {
  int grid, threads, smem_bytes, cluster;
};
ExpertLaunchShape last_expert_gemm_launch(bool gate_up);

// ------------------------------------------------------------------ megamoe.cu
// MegaMoE at W=1: the whole MoE layer of experts_forward (same inputs, same result up to fp32
// rounding order) as one persistent launch, for calls of at most kMegaMoeMaxEntries routing
// entries (decode; kMegaMoeMaxEntries, kMegaMoeSizeMultiple in layout.h). See experts/megamoe.cu.
struct MegaMoeArgs {
  const petit_bf16_bits* x;        // [N, H]
  const int32_t* topk_ids;         // [N*K] local ids (or global ids with expert_map); invalid
                                   // ids are slots this call does not serve (expert_ids.h)
  const int32_t* expert_map;       // [num_global_experts] or nullptr
  int num_global_experts;
  const float* topk_weights;       // [N*K]
  const void* w13;                 // [L, 2I, H] bf16, or e4m3 with w13_scale
  const void* w2;                  // [L, H, I] bf16, or e4m3 with w2_scale
  // Block fp8 weights (the checkpoints' format, vLLM's layout in place): fp32 scales of each
  // 128 x 128 block, weight = e4m3 * scale; both nullptr: bf16 weights. H and I then
  // multiples of kFp8ScaleBlock (layout.h).
  const float* w13_scale;          // [L, 2I / 128, H / 128]
  const float* w2_scale;           // [L, H / 128, I / 128]
  petit_bf16_bits* act;            // [N*K, I] workspace
  float* partial;                  // [N*K, H] workspace: weighted fp32 down projections
  int32_t* sync;                   // [megamoe_sync_ints(L, H)] zero before the first call; every
                                   // call leaves it zero. One call at a time per sync buffer.
  petit_bf16_bits* out;            // [N, H]
  int num_rows;                    // N
  int top_k;                       // K
  int hidden;                      // H
  int intermediate;                // I
  int num_local_experts;           // L
  int num_sms;                     // grid = up to 2 blocks per SM; 0: query the device
  uint64_t timeout_ticks;          // bound of the in-kernel waits (petit_timer ticks), > 0
  int64_t* trace;                  // diagnostics, nullptr: none. [grid][kMegaMoeTraceSlots]
                                   // timer stamps (layout.h; tools/megamoe_trace.py reads them)
};
PETIT_HOST_DEVICE int megamoe_sync_ints(int num_local_experts, int hidden) {
  return 3 + num_local_experts + hidden / 32;
}
// petitErrorInvalidValue, with the reason in `err` (nullptr: none), where the arguments are
// outside the limits above: 0 <= N, 1 <= K <= kMaxTopK, 1 <= L <= kMaxExperts, H and I
// positive multiples of kMegaMoeSizeMultiple, N*K <= kMegaMoeMaxEntries, num_sms >= 0,
// timeout_ticks > 0, x / w13 / w2 / act / partial / out 16-byte aligned, a sync buffer, an
// expert_map of >= 1 entries; block fp8: both scales (4-byte aligned), H and I multiples of
// kFp8ScaleBlock. No CUDA call; launch_megamoe runs it too.
petitError_t megamoe_check(const MegaMoeArgs& args, char* err, int err_len);
// The most blocks a fused launch on `num_sms` SMs runs (0: the current device's SM count):
// kMegaMoeBlocksPerSm per SM; its trace has a row for each.
petitError_t megamoe_max_blocks(int num_sms, int64_t* blocks);
// petitErrorNotSupported where mma.sync is missing (HIP, GPUs before sm_80).
petitError_t launch_megamoe(const MegaMoeArgs& args, petitStream_t stream);
int megamoe_smem_bytes();

// -------------------------------------------------------- dispatch_combine.cu
// Device-side state of one EpBuffer (local memory, not in the heap).
struct EpState {
  uint64_t epoch;         // epoch of the last completed dispatch; advanced on the GPU
  uint32_t blocks_done;   // grid-completion counter of the running dispatch
  uint32_t reduce_next;   // combine: next reduce item to claim (reset by its last block)
  uint32_t combine_done;  // grid-completion counter of the running combine
  uint32_t pad;
};

// What EpDiagnostics::error records.
enum EpError : int32_t {
  kEpErrorNone = 0,
  kEpErrorTimeout = 1,   // a bounded wait expired: the peer's flag never showed the epoch
  kEpErrorMismatch = 2,  // the peer's flag shows the epoch with another call's tag: the two
                         // ranks called dispatch/combine with another region stride, top-k or
                         // quant (layout.h call_tag)
  kEpErrorPeerAborted = 3,  // the peer's heartbeat word is marked kHeartbeatAborted: it left
                            // the protocol (an error on that rank before its call, a failed
                            // wait of its own, or it closed its buffer)
  kEpErrorOrder = 4,     // the peer is past this call (its freshest flag here shows a later
                         // call: epoch, then dispatch before combine): it skipped this call or
                         // made its calls in another order
};

// Bit of a heartbeat word (EpContextArgs::heartbeats) that says its rank left the protocol:
// set by the host when a call raises before its launch or the buffer closes
// (comm/heartbeat.h), and by a kernel's first failed wait (ep_sync.h fail_wait). The beat goes
// on in the low bits; a waiter that sees the bit fails with kEpErrorPeerAborted.
constexpr uint64_t kHeartbeatAborted = uint64_t(1) << 63;

// Host-visible pinned memory, readable without a device sync (and after a trap, when the
// CUDA context is gone). The first failing wait writes the error fields, then traps.
struct EpDiagnostics {
  int32_t error;          // EpError; kEpErrorNone = no error
  int32_t rank;           // the waiting rank
  int32_t peer;           // the rank whose flag never arrived / disagreed
  int32_t phase;          // 0 = dispatch, 1 = combine
  int32_t group;          // token group (32 tokens) of the flag
  int32_t dropped_ids;    // routing slots with an id outside [-1, num_experts) that dispatch
                          // treated as -1 (summed over all dispatches of the buffer; not an
                          // error; EpBuffer.diagnostics() reports it)
  uint64_t expected_epoch;
  uint64_t observed_flag; // raw flag value seen last
  uint32_t expected_tag;  // this rank's call tag (kEpErrorMismatch: the flag holds another)
  uint32_t peer_alive;    // kEpErrorTimeout with heartbeats: 1 = the peer's process still beat
                          // (the wait reached max_wait_ticks), 0 = it stopped beating
};

struct EpContextArgs {
  char* heap_base;            // rank r's heap starts at heap_base + r * heap_stride
  int64_t heap_stride;
  HeapLayout layout;
  int rank;
  int world_size;
  int num_experts;
  int num_local_experts;
  EpState* state;
  EpDiagnostics* diagnostics;
  uint64_t timeout_ticks;
  // [W] host words every rank's process increments while it lives (mapped host memory; see
  // docs/faults.md): a wait whose bound expired goes on while its peer's word moves, up to
  // max_wait_ticks in all, and fails at once when it carries kHeartbeatAborted. nullptr: the
  // bound alone.
  const volatile uint64_t* heartbeats;
  uint64_t max_wait_ticks;
  uint32_t* token_rank_mask;  // [T_max]  ranks each own token was sent to (bit d)
  uint32_t* group_done;       // [W, G_max] completion counters of the dispatch's chunks
  int32_t* recv_group_counts; // [W, G_max] rows received per (source, group), last dispatch
  int num_blocks;             // persistent grid; must be co-resident (<= SM count)
};

// The fused layer on one rank of an EP group (W >= 1 ranks of an EpContext): this rank's
// tokens go to their experts' ranks through the heap's dispatch regions and flags, every
// rank's experts run on their W x R received rows, the rows return to their sources' combine
// regions, and each rank sums its tokens' rows, all in one launch per rank. layer: x [T, H]
// this rank's tokens, topk_ids [T, K] global ids (int32; -1 or any id outside [0, E) unused;
// no expert_map), topk_weights, w13 / w2 the ctx's local experts, act / partial sized for
// W x R x K entries (<= kMegaMoeMaxEntries), out [T, H], num_rows = T, num_sms = the SMs the
// rank may use (its grid, 2 blocks per SM, must be co-resident). The call takes the next
// epoch of ctx (dispatch / combine calls before and after it stay in step).
struct MegaMoeEpArgs {
  MegaMoeArgs layer;
  EpContextArgs ctx;
  int region_stride;  // R: T <= R <= layout.max_tokens, equal on all ranks
};
// petitErrorInvalidValue, with the reason in `err` (nullptr: none), where a call is outside
// megamoe_check's limits for its W x R received rows, or outside its context's: no expert_map,
// 0 <= T <= R <= layout.max_tokens, K <= layout.max_top_k, H = layout.hidden, L = the context's
// local experts, num_sms >= 1, a mapped heap. No CUDA call; launch_megamoe_ep runs it too.
petitError_t megamoe_ep_check(const MegaMoeEpArgs& args, char* err, int err_len);
petitError_t launch_megamoe_ep(const MegaMoeEpArgs& args, petitStream_t stream);

// Wire format of dispatched rows. fp8 modes quantize at the source inside dispatch (fp8.h):
// rows arrive as e4m3 bytes (row stride H bytes) plus fp32 scales (row stride H/128 floats for
// 1x128 blocks, 1 float per token).
enum DispatchQuant : int {
  kQuantNone = 0,       // bf16 rows
  kQuantFp8Block = 1,   // e4m3, one scale per 1x128 block (H % 128 == 0)
  kQuantFp8Token = 2,   // e4m3, one scale per token
  kQuantFp8BlockUe8m0 = 3,  // as kQuantFp8Block with power-of-two (UE8M0) scales
};

// The modes with one scale per 1x128 block (H % 128 == 0; H/128 scales per row).
PETIT_HOST_DEVICE constexpr bool is_block_quant(int quant) {
  return quant == kQuantFp8Block || quant == kQuantFp8BlockUe8m0;
}

struct DispatchArgs {
  EpContextArgs ctx;
  const petit_bf16_bits* x;   // [T, H]
  const void* topk_ids;       // [T, K] int32 or int64 global ids, -1 = unused
  bool ids_are_int64;
  const float* topk_weights;  // [T, K]
  int num_tokens;             // T <= region_stride
  int top_k;                  // K <= layout.max_top_k
  int region_stride;          // R <= layout.max_tokens, equal on all ranks
  int quant;                  // DispatchQuant, equal on all ranks
  int num_chunks;             // set by the launcher
};

struct CombineArgs {
  EpContextArgs ctx;
  const petit_bf16_bits* expert_out;  // [W*R, H] local weighted sums, in dispatch layout
  petit_bf16_bits* out;               // [T, H]
  int num_tokens;
  int top_k;
  int region_stride;
  int num_chunks;             // set by the launcher: hidden chunks (flags) per (group, peer)
  int num_whole_pairs;        // set by the launcher: (group, peer) pairs [0, this) go out as
                              // one send item each, the rest as num_chunks items each
  int num_send_blocks;        // set by the launcher: blocks [0, this) push rows back
  int num_reduce_chunks;      // set by the launcher: hidden chunks of one reduce item
  int static_reduce;          // set by the launcher: 1 = reduce-only block b owns item
                              // b - num_send_blocks (a block per item), no claim counter
  CombineConfig config;       // the split of the grid and the work (common/config.h)
  int64_t* trace;             // optional (nullptr: none): [grid, kCombineTraceSlots], see
                              // CombineTraceSlot; every launched block writes its row
};

// The per-block timeline of a traced combine (CombineArgs::trace): petit_timer ticks
// (petit_timer_ticks_per_second per second; nanoseconds on CUDA) at the block's start, when
// its first send item starts copying, after its last send item's flags, when the flags of its
// first reduce item have all been seen, after its last reduction, and at its end; then how
// many send and reduce items it did; then the ticks its thread 0 spent, summed over its
// reduce items, waiting for the peers' rows (from claiming an item to seeing its flags) and
// in the reduction itself. A phase the block had no part in holds 0.
enum CombineTraceSlot {
  kTraceStart = 0,
  kTraceFirstSend,
  kTraceSendsDone,
  kTraceFirstReduceReady,
  kTraceLastReduceDone,
  kTraceEnd,
  kTraceSendItems,
  kTraceReduceItems,
  kTraceReduceWait,
  kTraceReduceWork,
  kCombineTraceSlots
};

// petitErrorInvalidValue, with the reason in `err` (nullptr: none), where a call is outside
// its context's limits: 1 <= top_k <= layout.max_top_k, 0 <= num_tokens <= region_stride <=
// layout.max_tokens; a dispatch's quant a DispatchQuant (block modes: hidden a multiple of
// kFp8ScaleBlock), a combine's config valid. No CUDA call; the launchers run the same check.
petitError_t dispatch_check(const DispatchArgs& args, char* err, int err_len);
petitError_t combine_check(const CombineArgs& args, char* err, int err_len);
petitError_t launch_dispatch(const DispatchArgs& args, petitStream_t stream);
petitError_t launch_combine(const CombineArgs& args, petitStream_t stream);
// Host only: what launch_combine launches for `args` (its fields set by the launcher, plus the
// grid size); the same errors as launch_combine's, no CUDA call.
petitError_t plan_combine(CombineArgs* args, int* grid);
// Host only, without a context (diagnostics, tests): the plan of a combine of `num_tokens` own
// tokens with region stride `region_stride` among `world_size` ranks, rows of `hidden` bf16,
// `num_blocks` blocks and `config` (a heap of region_stride tokens per rank, top-k 1). Sets
// `*plan` and `*grid` as plan_combine does; petitErrorInvalidValue, with the reason in `err`
// (nullptr: none), outside 2 <= world_size <= kMaxWorldSize, hidden a positive multiple of 8,
// 0 <= num_tokens <= region_stride, region_stride >= 1, num_blocks >= 1, or where
// combine_check refuses.
petitError_t plan_combine_sizes(int world_size, int hidden, int num_tokens, int region_stride,
                                int num_blocks, const CombineConfig& config, CombineArgs* plan,
                                int* grid, char* err, int err_len);

// Ceiling for benchmarks: every rank pushes `bytes_per_peer` from `src` into each peer's
// heap at `heap_offset` with the same SM copy loop the dispatch uses (self excluded).
struct PeerWriteArgs {
  char* heap_base;
  int64_t heap_stride;
  int rank;
  int world_size;
  const void* src;
  int64_t heap_offset;
  int64_t bytes_per_peer;  // multiple of 16
  int num_blocks;
};
petitError_t launch_peer_write(const PeerWriteArgs& args, petitStream_t stream);

// ------------------------------------------------------------------- heap.cpp
// One rank's share of the linearized symmetric heap (virtual-memory API).
class SymmetricHeap {
 public:
  // Allocates `bytes` (rounded up to the allocation granularity) on `device` with a
  // POSIX-fd shareable handle.
  static petitError_t create(int device, int64_t bytes, SymmetricHeap** out, char* err,
                             int err_len);
  ~SymmetricHeap();
  // A new file descriptor for this rank's allocation (the caller sends and closes it).
  petitError_t export_fd(int* fd, char* err, int err_len);
  // Maps all ranks' allocations into one reserved range: peer_fds[r] for r != rank (ignored
  // for r == rank). Takes the descriptors: every peer fd is closed here, on every path
  // (imported or not, success or error). After this, base() is valid. On error the partial
  // state is undone by release().
  petitError_t map_all(const int* peer_fds, int world_size, int rank, char* err, int err_len);
  void release();
  char* base() const { return base_; }
  int64_t stride() const { return stride_; }
  int64_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  SymmetricHeap() = default;
  int device_ = -1;
  int64_t bytes_ = 0;      // requested size
  int64_t granularity_ = 0;
  int64_t stride_ = 0;     // rounded to the granularity
  petitMemHandle_t local_handle_{};
  bool has_local_handle_ = false;
  petitMemHandle_t* peer_handles_ = nullptr;  // [world]; [rank] is local_handle_
  bool* imported_ = nullptr;                   // [world]
  int world_size_ = 0;
  int num_mapped_ = 0;
  char* base_ = nullptr;
  bool mapped_ = false;
};

}  // namespace petit
