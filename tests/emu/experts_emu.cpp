// CPU emulation of the expert kernels (csrc/experts/: the tile choice, both GEMM families and
// the local reduction), for tests without a GPU: the kernel sources run unchanged on the
// thread-per-GPU-thread runtime of emu_runtime.h, all in this one translation unit.
//
// Built by tests/test_experts_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/experts_emu.cpp -o experts_emu.so
#include "emu_runtime.h"

#include <cmath>
#include <vector>

#include "experts/gemm_simt.cu"
#include "experts/gemm_sm90.cu"
#include "experts/reduce.cu"
#include "experts/tile_choice.cu"

// emu_ptx::trap(what) on this thread: for the test of what a trap reports (it aborts).
extern "C" void petit_emu_trap(const char* what) { emu_ptx::trap(what); }
// Whether the last petit_emu_experts call ran both GEMMs as one launch (expert_fused_gemms).
static bool g_fused_gemms = false;
extern "C" int petit_emu_fused_gemms() { return g_fused_gemms ? 1 : 0; }
// The fused GEMMs' tile claim counter (ExpertGemmArgs::gate_up_done[L]) after the last
// petit_emu_experts call that fused them: every block claims units until one is past the
// last, so it ends at the call's gate/up + down tiles plus the grid (which tiles ran: the
// narrow or the m64 ones).
static int32_t g_fused_claims = 0;
extern "C" int petit_emu_fused_claims() { return g_fused_claims; }

// The ExpertConfig of the next calls (petit_emu_experts, petit_emu_resolve_tiles): a
// default-constructed one until set.
static petit::ExpertConfig g_config;
extern "C" void petit_emu_set_expert_config(int narrow_max_rows, int m64_max_rows,
                                            int mc_min_rows, int mc_min_hidden,
                                            int simt_large_min_rows) {
  g_config = petit::ExpertConfig{narrow_max_rows, m64_max_rows, mc_min_rows, mc_min_hidden,
                                 simt_large_min_rows};
}
extern "C" void petit_emu_default_expert_config(int* fields) {
  const petit::ExpertConfig c;
  fields[0] = c.narrow_max_rows;
  fields[1] = c.m64_max_rows;
  fields[2] = c.mc_min_rows;
  fields[3] = c.mc_min_hidden;
  fields[4] = c.simt_large_min_rows;
}

// Runs launch_experts on host memory. Returns the petitError_t as an int (0 = success), and
// the tile family that ran in *tiles_used.
extern "C" int petit_emu_experts(const uint16_t* x, const int32_t* topk_ids,
                                 const float* topk_weights, const uint16_t* w13,
                                 const uint16_t* w2, const int32_t* expert_offsets,
                                 const int32_t* sorted_entries, uint16_t* act, uint16_t* partial,
                                 uint16_t* out, int num_rows, int top_k, int hidden,
                                 int intermediate, int num_local_experts, int tiles, int num_sms,
                                 const int32_t* expert_map, int num_global_experts,
                                 int* tiles_used) {
  emu::last_error = 0;
  petit::ExpertGemmArgs a{};
  a.x = x;
  a.topk_ids = topk_ids;
  a.expert_map = expert_map;  // nullptr: topk_ids are local ids
  a.num_global_experts = num_global_experts;
  a.topk_weights = topk_weights;
  a.w13 = w13;
  a.w2 = w2;
  a.expert_offsets = expert_offsets;
  a.sorted_entries = sorted_entries;
  a.act = act;
  a.partial = partial;
  a.out = out;
  a.num_rows = num_rows;
  a.top_k = top_k;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.num_local_experts = num_local_experts;
  a.tiles = tiles;
  a.num_sms = num_sms;
  a.config = g_config;
  *tiles_used = petit::resolve_expert_tiles(a);
  // fused GEMMs (expert_fused_gemms), as the binding allocates them: one arrival counter per
  // local expert and the tile claim counter, zeroed there by the row-list kernels and here.
  // (Blocks run one after another in this emulation, so the first block claims every tile.)
  std::vector<int32_t> done(petit::expert_fused_gemms(a) ? size_t(num_local_experts) + 1 : 0, 0);
  if (!done.empty()) a.gate_up_done = done.data();
  g_fused_gemms = !done.empty();
  const int err = int(petit::launch_experts(a, nullptr));
  if (g_fused_gemms) g_fused_claims = done[size_t(num_local_experts)];
  return err;
}

// The compute capability the emulated device reports: 9.0 lets the Hopper regimes (run on the
// PTX emulation of emu_ptx.h) be taken, the default 2.0 leaves only the SIMT fallback.
extern "C" void petit_emu_set_compute_capability(int major, int minor) {
  emu::cc_major = major;
  emu::cc_minor = minor;
}

// The tile family launch_experts runs for these sizes on the emulated device (tiles = 0: auto).
extern "C" int petit_emu_resolve_tiles(int num_rows, int top_k, int num_local_experts,
                                       int hidden, int tiles) {
  petit::ExpertGemmArgs a{};
  a.num_rows = num_rows;
  a.top_k = top_k;
  a.num_local_experts = num_local_experts;
  a.hidden = hidden;
  a.tiles = tiles;
  a.config = g_config;
  return petit::resolve_expert_tiles(a);
}

// last_expert_gemm_launch: shape[4] = grid, threads, dynamic smem bytes, CTAs per cluster.
extern "C" void petit_emu_last_gemm_launch(int gate_up, int* shape) {
  const petit::ExpertLaunchShape s = petit::last_expert_gemm_launch(gate_up != 0);
  shape[0] = s.grid;
  shape[1] = s.threads;
  shape[2] = s.smem_bytes;
  shape[3] = s.cluster;
}

// experts_check on these sizes, with the ExpertConfig of petit_emu_set_expert_config and, where
// num_global_experts >= 0, an expert_map of that many entries (never read). Returns the
// petitError_t as an int (0: accepted), the reason in err.
extern "C" int petit_emu_experts_check(int num_rows, int top_k, int hidden, int intermediate,
                                       int num_local_experts, int tiles, int num_sms,
                                       int num_global_experts, char* err, int err_len) {
  static const int32_t map_entry = 0;
  petit::ExpertGemmArgs a{};
  a.num_rows = num_rows;
  a.top_k = top_k;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.num_local_experts = num_local_experts;
  a.tiles = tiles;
  a.num_sms = num_sms;
  a.config = g_config;
  if (num_global_experts >= 0) {
    a.expert_map = &map_entry;
    a.num_global_experts = num_global_experts;
  }
  return int(petit::experts_check(a, err, err_len));
}
