// CPU emulation of the dispatch and combine kernels (csrc/comm/dispatch_combine.cu) across W ranks,
// for tests without GPUs: the kernel source and its host launchers run unchanged on the
// thread-per-GPU-thread runtime of emu_runtime.h.
//
// One process holds the ranks: the linearized symmetric heap is one host allocation of W
// heaps at a fixed stride (rank r's at heap + r * stride, the layout of layout.h), each rank
// has its own device state (epoch, counters, masks, diagnostics), and each rank's launches run
// on a host thread of its own with every block of a grid at once (emu::grid_at_once), as the
// persistent grids are co-resident on the GPU. The ranks' grids therefore run concurrently
// and wait for each other's flags through the heap exactly as they do over NVLink.
// What this checks: the data layout, routing, dedup, chunking, the flag/epoch protocol across
// back-to-back calls and its bounded waits. What it cannot: performance, or a missing fence
// (host atomics on x86 are stronger than the GPU's memory model).
//
// Built by tests/test_dispatch_combine_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/ep_emu.cpp -o ep_emu.so
#include "emu_runtime.h"

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "comm/dispatch_combine.cu"
#include "comm/heartbeat.h"  // the beat of EpContext, on the emulated ranks' words
#include "experts/megamoe.cu"  // the fused layer across the emulated ranks (MegaMoeEpArgs)

namespace {

constexpr int64_t kHeapAlignment = 4096;
constexpr uint8_t kHeapPoison = 0xA5;  // the heap's bytes before any kernel wrote them

struct RankState {
  petit::EpState state{};
  petit::EpDiagnostics diagnostics{};
  std::vector<uint32_t> token_rank_mask, group_done;
  std::vector<int32_t> recv_group_counts;
};

struct EpEmu {
  int world_size = 0, num_experts = 0, num_blocks = 0;
  uint64_t timeout_ticks = 0;
  const volatile uint64_t* heartbeats = nullptr;  // petit_emu_ep_set_heartbeats
  uint64_t max_wait_ticks = 0;
  petit::HeapLayout layout{};
  int64_t stride = 0;
  unsigned char* heap = nullptr;
  std::vector<std::unique_ptr<RankState>> ranks;
  petit::CombineConfig combine_config{};  // every rank's (petit_emu_ep_set_combine_config)

  ~EpEmu() { std::free(heap); }

  petit::EpContextArgs context(int rank) {
    RankState& r = *ranks[size_t(rank)];
    petit::EpContextArgs c{};
    c.heap_base = reinterpret_cast<char*>(heap);
    c.heap_stride = stride;
    c.layout = layout;
    c.rank = rank;
    c.world_size = world_size;
    c.num_experts = num_experts;
    c.num_local_experts = num_experts / world_size;
    c.state = &r.state;
    c.diagnostics = &r.diagnostics;
    c.timeout_ticks = timeout_ticks;
    c.heartbeats = heartbeats;
    c.max_wait_ticks = max_wait_ticks;
    c.token_rank_mask = r.token_rank_mask.data();
    c.group_done = r.group_done.data();
    c.recv_group_counts = r.recv_group_counts.data();
    c.num_blocks = num_blocks;
    return c;
  }
};

uint32_t all_ranks(const EpEmu& ep) {
  return ep.world_size >= 32 ? ~0u : (1u << ep.world_size) - 1u;
}

// fn(rank) on one host thread per rank whose bit is set in `ranks_mask`, all at once; each
// thread's launches run their blocks at once. Returns the first nonzero result (0: all ok).
template <class Fn>
int on_ranks(const EpEmu& ep, uint32_t ranks_mask, int* results, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ep.world_size; ++r) {
    results[r] = 0;
    if ((ranks_mask >> r) & 1u)
      threads.emplace_back([&, r] {
        emu::grid_at_once = true;
        results[r] = fn(r);
      });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ep.world_size; ++r)
    if (results[r] != 0) return results[r];
  return 0;
}

int dispatch_one(EpEmu& ep, int rank, const void* x, const void* ids, int ids_int64,
                 const float* weights, int num_tokens, int top_k, int region_stride, int quant) {
  emu::last_error = 0;
  petit::DispatchArgs a{};
  a.ctx = ep.context(rank);
  a.x = static_cast<const petit_bf16_bits*>(x);
  a.topk_ids = ids;
  a.ids_are_int64 = ids_int64 != 0;
  a.topk_weights = weights;
  a.num_tokens = num_tokens;
  a.top_k = top_k;
  a.region_stride = region_stride;
  a.quant = quant;
  return int(petit::launch_dispatch(a, nullptr));
}

int combine_one(EpEmu& ep, int rank, const void* expert_out, void* out, int num_tokens,
                int top_k, int region_stride) {
  emu::last_error = 0;
  petit::CombineArgs a{};
  a.ctx = ep.context(rank);
  a.expert_out = static_cast<const petit_bf16_bits*>(expert_out);
  a.out = static_cast<petit_bf16_bits*>(out);
  a.num_tokens = num_tokens;
  a.top_k = top_k;
  a.region_stride = region_stride;
  a.config = ep.combine_config;
  return int(petit::launch_combine(a, nullptr));
}

}  // namespace

// The fused layer (csrc/experts/megamoe.cu, MegaMoeEpArgs) on every rank of `ranks_mask` at
// once: rank r's tokens xs[r] [T_r, H] bf16, ids[r] [T_r, K] int32 global ids, weights[r],
// its experts' w13s[r] [L, 2I, H] / w2s[r] [L, H, I], workspaces acts[r] (>= W*R*K*I bf16),
// partials[r] (>= W*R*K*H f32), syncs[r] (zeroed, megamoe_sync_ints(L, H) ints) and outs[r]
// [T_r, H]; each rank's grid is 2 x num_blocks blocks, all at once; traces (nullptr: none)
// traces[r] int64 [2 x num_blocks, kMegaMoeTraceSlots]; w13_scales / w2_scales (nullptr:
// bf16 weights): block-fp8 weights, w13s[r] / w2s[r] then e4m3 bytes with fp32 scales
// [L, 2I/128, H/128] / [L, H/128, I/128]. results[r]: rank r's launch error. Returns the first
// nonzero one.
extern "C" int petit_emu_ep_megamoe(void* handle, uint32_t ranks_mask, const void* const* xs,
                                    const int32_t* const* ids, const float* const* weights,
                                    const int* num_tokens, int top_k, int region_stride,
                                    const void* const* w13s, const void* const* w2s,
                                    int intermediate, void* const* acts, float* const* partials,
                                    int32_t* const* syncs, void* const* outs, int* results,
                                    int64_t* const* traces, const float* const* w13_scales,
                                    const float* const* w2_scales) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  return on_ranks(ep, ranks_mask, results, [&](int r) {
    emu::last_error = 0;
    emu::cc_major = 9;
    emu::cc_minor = 0;
    petit::MegaMoeEpArgs e{};
    e.ctx = ep.context(r);
    e.region_stride = region_stride;
    petit::MegaMoeArgs& a = e.layer;
    a.x = static_cast<const petit_bf16_bits*>(xs[r]);
    a.topk_ids = ids[r];
    a.topk_weights = weights[r];
    a.w13 = static_cast<const petit_bf16_bits*>(w13s[r]);
    a.w2 = static_cast<const petit_bf16_bits*>(w2s[r]);
    a.w13_scale = w13_scales != nullptr ? w13_scales[r] : nullptr;
    a.w2_scale = w2_scales != nullptr ? w2_scales[r] : nullptr;
    a.act = static_cast<petit_bf16_bits*>(acts[r]);
    a.partial = partials[r];
    a.sync = syncs[r];
    a.out = static_cast<petit_bf16_bits*>(outs[r]);
    a.num_rows = num_tokens[r];
    a.top_k = top_k;
    a.hidden = ep.layout.hidden;
    a.intermediate = intermediate;
    a.num_local_experts = ep.num_experts / ep.world_size;
    a.num_sms = ep.num_blocks;
    a.timeout_ticks = ep.timeout_ticks;
    a.trace = traces != nullptr ? traces[r] : nullptr;
    return int(petit::launch_megamoe_ep(e, nullptr));
  });
}

// The ranks' heartbeat words (host memory the caller owns and increments: word r = rank r's
// process) and the bound of a wait on a peer whose word moves, in seconds of the emulated
// timer; words = nullptr: the bound alone (the default).
extern "C" void petit_emu_ep_set_heartbeats(void* handle, const uint64_t* words,
                                            double max_wait_s) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  ep.heartbeats = words;
  ep.max_wait_ticks = uint64_t(max_wait_s * petit_timer_ticks_per_second());
}

// The beat of one rank's heartbeat word (comm/heartbeat.h, as EpContext runs it): a host
// thread increments `word` every period_s seconds of host time until
// petit_emu_heartbeat_stop; petit_emu_heartbeat_abort marks the word aborted.
extern "C" void* petit_emu_heartbeat_start(uint64_t* word, double period_s) {
  auto* beat = new petit::HeartbeatThread();
  beat->start(word, period_s);
  return beat;
}
extern "C" void petit_emu_heartbeat_abort(void* beat) {
  static_cast<petit::HeartbeatThread*>(beat)->abort();
}
extern "C" void petit_emu_heartbeat_stop(void* beat) {
  delete static_cast<petit::HeartbeatThread*>(beat);
}

// The emulated device: its SM count and the blocks of a kernel one SM holds at once (what
// petitDeviceGetAttribute and petitOccupancyMaxActiveBlocksPerMultiprocessor report; defaults
// 2 and 2).
extern "C" void petit_emu_set_device(int sm_count, int blocks_per_sm) {
  emu::sm_count = sm_count;
  emu::blocks_per_sm = blocks_per_sm;
}

// The CombineConfig of every rank's next combines (default-constructed until set).
extern "C" void petit_emu_ep_set_combine_config(void* handle, int reduce_pct, int reduce_vectors,
                                                int reduce_items, int tail_chunks) {
  static_cast<EpEmu*>(handle)->combine_config =
      petit::CombineConfig{reduce_pct, reduce_vectors, reduce_items, tail_chunks};
}

// The plan of one rank's combine (plan_combine, no launch): out[6] = send chunks, whole
// pairs, send blocks, reduce chunks, static reduction, grid. Returns the petitError_t.
extern "C" int petit_emu_ep_combine_plan(void* handle, int rank, int num_tokens, int top_k,
                                         int region_stride, int* out) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  petit::CombineArgs a{};
  a.ctx = ep.context(rank);
  a.num_tokens = num_tokens;
  a.top_k = top_k;
  a.region_stride = region_stride;
  a.config = ep.combine_config;
  int grid = 0;
  const int rc = int(petit::plan_combine(&a, &grid));
  const int plan[6] = {a.num_chunks, a.num_whole_pairs, a.num_send_blocks, a.num_reduce_chunks,
                       a.static_reduce, grid};
  for (int i = 0; i < 6; ++i) out[i] = plan[i];
  return rc;
}

// plan_combine_sizes (api.h: a combine's plan without a context) with the CombineConfig of
// these fields: out[6] as petit_emu_ep_combine_plan's. Returns the petitError_t, the reason of
// a refusal in err.
extern "C" int petit_emu_combine_plan_sizes(int world_size, int hidden, int num_tokens,
                                            int region_stride, int num_blocks, int reduce_pct,
                                            int reduce_vectors, int reduce_items,
                                            int tail_chunks, int* out, char* err, int err_len) {
  petit::CombineArgs a{};
  int grid = 0;
  const int rc = int(petit::plan_combine_sizes(
      world_size, hidden, num_tokens, region_stride, num_blocks,
      petit::CombineConfig{reduce_pct, reduce_vectors, reduce_items, tail_chunks}, &a, &grid,
      err, err_len));
  const int plan[6] = {a.num_chunks, a.num_whole_pairs, a.num_send_blocks, a.num_reduce_chunks,
                       a.static_reduce, grid};
  for (int i = 0; i < 6; ++i) out[i] = plan[i];
  return rc;
}

// megamoe_ep_check of a fused call on rank `rank` of the context with these sizes (16-byte
// aligned placeholders, never read; bf16 weights): hidden, num_local_experts and num_sms the
// context's where < 0; with_map: an expert_map of one entry. Returns the petitError_t, the
// reason of a refusal in err.
extern "C" int petit_emu_ep_megamoe_check(void* handle, int rank, int num_tokens, int top_k,
                                          int region_stride, int hidden, int intermediate,
                                          int num_local_experts, int num_sms, int with_map,
                                          char* err, int err_len) {
  alignas(16) static char placeholder[16];
  static const int32_t map_entry = 0;
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  petit::MegaMoeEpArgs e{};
  e.ctx = ep.context(rank);
  e.region_stride = region_stride;
  petit::MegaMoeArgs& a = e.layer;
  a.x = reinterpret_cast<const petit_bf16_bits*>(placeholder);
  a.w13 = a.w2 = placeholder;
  a.act = reinterpret_cast<petit_bf16_bits*>(placeholder);
  a.partial = reinterpret_cast<float*>(placeholder);
  a.sync = reinterpret_cast<int32_t*>(placeholder);
  a.out = reinterpret_cast<petit_bf16_bits*>(placeholder);
  if (with_map != 0) {
    a.expert_map = &map_entry;
    a.num_global_experts = 1;
  }
  a.num_rows = num_tokens;
  a.top_k = top_k;
  a.hidden = hidden < 0 ? ep.layout.hidden : hidden;
  a.intermediate = intermediate;
  a.num_local_experts = num_local_experts < 0 ? ep.num_experts / ep.world_size
                                              : num_local_experts;
  a.num_sms = num_sms < 0 ? ep.num_blocks : num_sms;
  a.timeout_ticks = ep.timeout_ticks;
  return int(petit::megamoe_ep_check(e, err, err_len));
}

// A context of `world_size` ranks (num_experts / world_size local experts each); the flags are
// zeroed, every other heap byte is kHeapPoison. timeout_s: the kernels' wait bound in seconds
// of the emulated timer (emu_ptx::kTimerSlowdown times slower than the host clock).
extern "C" void* petit_emu_ep_create(int world_size, int max_tokens, int hidden, int max_top_k,
                                     int num_experts, int num_blocks, double timeout_s) {
  if (world_size < 1 || world_size > petit::kMaxWorldSize || max_tokens < 1 ||
      max_tokens > petit::kMaxTokensPerRank || hidden < 8 ||
      hidden % 8 != 0 || max_top_k < 1 || max_top_k > petit::kMaxTopK || num_experts < 1 ||
      num_experts % world_size != 0 || num_blocks < 1 ||
      petit::timeout_check(timeout_s, nullptr, 0) != petitSuccess)  // as EpContext
    return nullptr;
  auto ep = std::make_unique<EpEmu>();
  ep->world_size = world_size;
  ep->num_experts = num_experts;
  ep->num_blocks = num_blocks;
  ep->timeout_ticks = petit::timeout_ticks(timeout_s);
  ep->layout = petit::make_heap_layout(world_size, max_tokens, hidden, max_top_k);
  ep->stride = petit::align_up(ep->layout.total_bytes, kHeapAlignment);
  ep->heap = static_cast<unsigned char*>(
      std::aligned_alloc(size_t(kHeapAlignment), size_t(ep->stride * world_size)));
  if (ep->heap == nullptr) return nullptr;
  std::memset(ep->heap, kHeapPoison, size_t(ep->stride * world_size));
  const int max_groups = ep->layout.max_groups;
  for (int r = 0; r < world_size; ++r) {
    std::memset(ep->heap + r * ep->stride + ep->layout.flags_begin, 0,
                size_t(ep->layout.flags_end - ep->layout.flags_begin));
    auto state = std::make_unique<RankState>();
    state->token_rank_mask.assign(size_t(max_tokens), 0xFFFFFFFFu);  // written by dispatch
    state->group_done.assign(size_t(world_size) * max_groups, 0u);   // zero, as allocated
    state->recv_group_counts.assign(size_t(world_size) * max_groups, -1);
    ep->ranks.push_back(std::move(state));
  }
  return ep.release();
}

extern "C" void petit_emu_ep_destroy(void* ep) { delete static_cast<EpEmu*>(ep); }

// Byte offsets of the heap layout (identical on every rank) and the heap stride:
// 0 dispatch_rows, 1 dispatch_ids, 2 dispatch_weights, 3 dispatch_scales, 4 combine_rows,
// 5 dispatch_flags, 6 combine_flags, 7 stride, 8 max_chunks.
extern "C" long long petit_emu_ep_offset(void* handle, int which) {
  const EpEmu& ep = *static_cast<EpEmu*>(handle);
  const petit::HeapLayout& l = ep.layout;
  const int64_t values[] = {l.dispatch_rows, l.dispatch_ids,  l.dispatch_weights,
                            l.dispatch_scales, l.combine_rows, l.dispatch_flags,
                            l.combine_flags, ep.stride,       l.max_chunks};
  return which >= 0 && which < int(sizeof(values) / sizeof(values[0])) ? values[which] : -1;
}

// Rank `rank`'s heap (heap + rank * stride).
extern "C" void* petit_emu_ep_heap(void* handle, int rank) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  return ep.heap + rank * ep.stride;
}

// Rank `rank`'s [W, max_groups] rows-per-(source, group) counts of its last dispatch.
extern "C" const int32_t* petit_emu_ep_recv_group_counts(void* handle, int rank) {
  return static_cast<EpEmu*>(handle)->ranks[size_t(rank)]->recv_group_counts.data();
}

// Rank `rank`'s diagnostic record (api.h EpDiagnostics): out[9] = error, rank, peer, phase,
// group, dropped_ids, expected_epoch, observed flag, expected_tag.
extern "C" void petit_emu_ep_diagnostics(void* handle, int rank, long long* out) {
  const petit::EpDiagnostics& d = static_cast<EpEmu*>(handle)->ranks[size_t(rank)]->diagnostics;
  const long long values[9] = {d.error, d.rank, d.peer, d.phase, d.group, d.dropped_ids,
                               (long long)d.expected_epoch, (long long)d.observed_flag,
                               (long long)d.expected_tag};
  for (int i = 0; i < 9; ++i) out[i] = values[i];
}

extern "C" unsigned long long petit_emu_ep_epoch(void* handle, int rank) {
  return static_cast<EpEmu*>(handle)->ranks[size_t(rank)]->state.epoch;
}

// Dispatch on the ranks of ranks_mask at once; per-rank arguments are arrays indexed by rank.
// results[r]: rank r's petitError_t. Returns the first nonzero one (0: all succeeded).
extern "C" int petit_emu_ep_dispatch(void* handle, uint32_t ranks_mask, const void* const* xs,
                                     const void* const* ids, int ids_int64,
                                     const float* const* weights, const int* num_tokens,
                                     int top_k, int region_stride, int quant, int* results) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  return on_ranks(ep, ranks_mask, results, [&](int r) {
    return dispatch_one(ep, r, xs[r], ids[r], ids_int64, weights[r], num_tokens[r], top_k,
                        region_stride, quant);
  });
}

// As petit_emu_ep_dispatch with each rank's own top-k, region stride and quant (a rank that
// disagrees with its peers: the flags' call tags must catch it).
extern "C" int petit_emu_ep_dispatch_each(void* handle, uint32_t ranks_mask,
                                          const void* const* xs, const void* const* ids,
                                          int ids_int64, const float* const* weights,
                                          const int* num_tokens, const int* top_k,
                                          const int* region_stride, const int* quant,
                                          int* results) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  return on_ranks(ep, ranks_mask, results, [&](int r) {
    return dispatch_one(ep, r, xs[r], ids[r], ids_int64, weights[r], num_tokens[r], top_k[r],
                        region_stride[r], quant[r]);
  });
}

// As petit_emu_ep_combine with each rank's own top-k and region stride.
extern "C" int petit_emu_ep_combine_each(void* handle, const void* const* expert_outs,
                                         void* const* outs, const int* num_tokens,
                                         const int* top_k, const int* region_stride,
                                         int* results) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  return on_ranks(ep, all_ranks(ep), results, [&](int r) {
    return combine_one(ep, r, expert_outs[r], outs[r], num_tokens[r], top_k[r],
                       region_stride[r]);
  });
}

// Combine on the ranks of ranks_mask at once: expert_outs[r] [W*R, H] bf16, outs[r]
// [num_tokens[r], H].
extern "C" int petit_emu_ep_combine(void* handle, uint32_t ranks_mask,
                                    const void* const* expert_outs, void* const* outs,
                                    const int* num_tokens, int top_k, int region_stride,
                                    int* results) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  return on_ranks(ep, ranks_mask, results, [&](int r) {
    return combine_one(ep, r, expert_outs[r], outs[r], num_tokens[r], top_k, region_stride);
  });
}

// num_rounds back-to-back layers with no barrier between ranks: every rank, on its own thread,
// runs for each round dispatch, then the identity experts (expert_out = its received rows, in
// a buffer of its own), then combine, and goes straight on to the next round, as ranks do in
// a serving loop. Inputs [round][rank] padded to region_stride rows: xs [.., R, H] bf16, ids
// [.., R, K] int32, weights [.., R, K] f32, num_tokens [round][rank]; outs [.., R, H] bf16.
extern "C" int petit_emu_ep_rounds(void* handle, int num_rounds, const uint16_t* xs,
                                   const int32_t* ids, const float* weights,
                                   const int* num_tokens, int top_k, int region_stride,
                                   uint16_t* outs, int* results) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  const int W = ep.world_size, H = ep.layout.hidden;
  const int64_t R = region_stride, row_elems = R * H, route_elems = R * top_k;
  return on_ranks(ep, all_ranks(ep), results, [&](int r) {
    std::vector<uint16_t> expert_out(size_t(W * row_elems));
    const uint16_t* recv = reinterpret_cast<const uint16_t*>(ep.heap + r * ep.stride +
                                                             ep.layout.dispatch_rows);
    for (int round = 0; round < num_rounds; ++round) {
      const int64_t at = int64_t(round) * W + r;
      int rc = dispatch_one(ep, r, xs + at * row_elems, ids + at * route_elems, 0,
                            weights + at * route_elems, num_tokens[at], top_k, region_stride,
                            petit::kQuantNone);
      if (rc != 0) return rc;
      std::memcpy(expert_out.data(), recv, expert_out.size() * sizeof(uint16_t));
      rc = combine_one(ep, r, expert_out.data(), outs + at * row_elems, num_tokens[at], top_k,
                       region_stride);
      if (rc != 0) return rc;
    }
    return 0;
  });
}

// The benchmark's ceiling kernel on every rank at once: rank r pushes bytes_per_peer bytes of
// srcs[r] into the combine region of every other rank (what EpBuffer.peer_write launches).
extern "C" int petit_emu_ep_peer_write(void* handle, const void* const* srcs,
                                       long long bytes_per_peer, int num_blocks, int* results) {
  EpEmu& ep = *static_cast<EpEmu*>(handle);
  return on_ranks(ep, all_ranks(ep), results, [&](int r) {
    emu::last_error = 0;
    petit::PeerWriteArgs a{};
    a.heap_base = reinterpret_cast<char*>(ep.heap);
    a.heap_stride = ep.stride;
    a.rank = r;
    a.world_size = ep.world_size;
    a.src = srcs[r];
    a.heap_offset = ep.layout.combine_rows;
    a.bytes_per_peer = bytes_per_peer;
    a.num_blocks = num_blocks;
    return int(petit::launch_peer_write(a, nullptr));
  });
}
