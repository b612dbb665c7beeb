// CPU emulation of the fused MoE layer (csrc/experts/megamoe.cu), for tests without a GPU: the
// kernel source runs unchanged on the thread-per-GPU-thread runtime of emu_runtime.h, with
// mma.sync from emu_ptx.h.
//
// Built by tests/test_megamoe_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/megamoe_emu.cpp -o megamoe_emu.so
#include "emu_runtime.h"

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
