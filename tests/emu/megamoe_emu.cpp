// CPU emulation of the fused MoE layer (csrc/experts/megamoe.cu), for tests without a GPU: the
// kernel source runs unchanged on the thread-per-GPU-thread runtime of emu_runtime.h, with
// mma.sync from emu_ptx.h.
//
// Built by tests/test_megamoe_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/megamoe_emu.cpp -o megamoe_emu.so
#include "emu_runtime.h"

#include <string>

#include "experts/megamoe.cu"

// Runs launch_megamoe on host memory with a grid of `num_sms` blocks. at_once = 1: every
// block of the grid runs at the same time (as co-resident blocks do on the GPU); 0: the blocks
// run one after another (a grid larger than the GPU can hold). l2_bytes: the L2 size the
// emulated device reports (the launcher splits experts' rows into 16-row groups when the
// grid's weight tiles exceed it). w13_scale / w2_scale: block fp8 weights (w13, w2 then e4m3
// bytes), nullptr: bf16. Returns the petitError_t.
extern "C" int petit_emu_megamoe(const uint16_t* x, const int32_t* topk_ids,
                                 const int32_t* expert_map, int num_global_experts,
                                 const float* topk_weights, const uint16_t* w13,
                                 const uint16_t* w2, uint16_t* act, float* partial,
                                 int32_t* sync, uint16_t* out, int num_rows, int top_k,
                                 int hidden, int intermediate, int num_local_experts,
                                 int num_sms, int at_once, int64_t* trace, int l2_bytes,
                                 const float* w13_scale, const float* w2_scale) {
  emu::last_error = 0;
  emu::l2_bytes = l2_bytes;
  emu::cc_major = 9;
  emu::cc_minor = 0;
  emu::grid_at_once = at_once != 0;
  petit::MegaMoeArgs a{};
  a.x = x;
  a.topk_ids = topk_ids;
  a.expert_map = expert_map;
  a.num_global_experts = num_global_experts;
  a.topk_weights = topk_weights;
  a.w13 = w13;
  a.w2 = w2;
  a.w13_scale = w13_scale;
  a.w2_scale = w2_scale;
  a.act = act;
  a.partial = partial;
  a.sync = sync;
  a.out = out;
  a.num_rows = num_rows;
  a.top_k = top_k;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.num_local_experts = num_local_experts;
  a.num_sms = num_sms;
  a.timeout_ticks = uint64_t(20e9);
  a.trace = trace;
  const int rc = int(petit::launch_megamoe(a, nullptr));
  emu::grid_at_once = false;
  emu::l2_bytes = 0;
  return rc;
}

extern "C" int petit_emu_megamoe_sync_ints(int num_local_experts, int hidden) {
  return petit::megamoe_sync_ints(num_local_experts, hidden);
}

// megamoe_check on these sizes (16-byte aligned placeholder pointers, never read; bf16 weights,
// or block fp8 with fp8 = 1; no expert_map, or one of num_global_experts >= 0 entries), with
// `misaligned` naming one pointer to offset by 8 bytes ("x", "w13", "w2", "act", "partial",
// "out", "w13_scale"; "sync": none at all; nullptr: all aligned). Returns the petitError_t as
// an int (0: accepted), the reason in err.
extern "C" int petit_emu_megamoe_check(int num_rows, int top_k, int hidden, int intermediate,
                                       int num_local_experts, int num_sms,
                                       unsigned long long timeout_ticks, int num_global_experts,
                                       int fp8, const char* misaligned, char* err, int err_len) {
  alignas(16) static char placeholder[32];
  static const int32_t map_entry = 0;
  const std::string off = misaligned != nullptr ? misaligned : "";
  auto ptr = [&](const char* name) -> void* { return placeholder + (off == name ? 8 : 0); };
  petit::MegaMoeArgs a{};
  a.x = static_cast<const petit_bf16_bits*>(ptr("x"));
  a.w13 = ptr("w13");
  a.w2 = ptr("w2");
  a.act = static_cast<petit_bf16_bits*>(ptr("act"));
  a.partial = static_cast<float*>(ptr("partial"));
  a.out = static_cast<petit_bf16_bits*>(ptr("out"));
  a.sync = off == "sync" ? nullptr : static_cast<int32_t*>(ptr("sync"));
  if (fp8 != 0) {
    a.w13_scale = reinterpret_cast<const float*>(placeholder + (off == "w13_scale" ? 2 : 0));
    a.w2_scale = off == "w2_scale" ? nullptr : reinterpret_cast<const float*>(placeholder);
  }
  if (num_global_experts >= 0) {
    a.expert_map = &map_entry;
    a.num_global_experts = num_global_experts;
  }
  a.num_rows = num_rows;
  a.top_k = top_k;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.num_local_experts = num_local_experts;
  a.num_sms = num_sms;
  a.timeout_ticks = timeout_ticks;
  return int(petit::megamoe_check(a, err, err_len));
}

// timeout_check (api.h): 0 with *ticks = timeout_ticks(timeout_s), else the refusal's reason.
extern "C" int petit_emu_timeout_check(double timeout_s, unsigned long long* ticks, char* err,
                                       int err_len) {
  const petitError_t rc = petit::timeout_check(timeout_s, err, err_len);
  *ticks = rc == petitSuccess ? petit::timeout_ticks(timeout_s) : 0;
  return int(rc);
}

// megamoe_max_blocks on an emulated device of `sm_count` SMs: the blocks, or -1 on an error.
extern "C" long long petit_emu_megamoe_max_blocks(int num_sms, int sm_count) {
  const int device_sms = emu::sm_count;
  emu::sm_count = sm_count;
  int64_t blocks = 0;
  const petitError_t rc = petit::megamoe_max_blocks(num_sms, &blocks);
  emu::sm_count = device_sms;
  return rc == petitSuccess ? blocks : -1;
}
