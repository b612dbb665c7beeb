// CPU emulation of the row-list kernels (csrc/experts/routing.cu), for tests without a GPU: the
// kernel source runs unchanged on the thread-per-GPU-thread runtime of emu_runtime.h (warp
// primitives included).
//
// Built by tests/test_routing_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/routing_emu.cpp -o routing_emu.so
#include "emu_runtime.h"

#include "experts/routing.cu"

// Runs launch_expert_row_lists on host memory (workspace: row_list_workspace_ints ints;
// expert_done: L+1 ints the kernels set to 0, or nullptr).
// Returns the petitError_t as an int (0 = success).
extern "C" int petit_emu_row_lists(const int32_t* topk_ids, const int32_t* expert_map,
                                   int num_global_experts, int num_entries,
                                   int num_local_experts, int32_t* workspace,
                                   int32_t* expert_counts, int32_t* expert_offsets,
                                   int32_t* sorted_entries, int32_t* expert_done) {
  emu::last_error = 0;
  petit::RowListArgs a{};
  a.topk_ids = topk_ids;
  a.expert_map = expert_map;  // nullptr: topk_ids are local ids
  a.num_global_experts = num_global_experts;
  a.num_entries = num_entries;
  a.num_local_experts = num_local_experts;
  a.workspace = workspace;
  a.expert_counts = expert_counts;
  a.expert_offsets = expert_offsets;
  a.sorted_entries = sorted_entries;
  a.expert_done = expert_done;  // nullptr: none
  return int(petit::launch_expert_row_lists(a, nullptr));
}

extern "C" long long petit_emu_row_list_workspace_ints(int num_entries, int num_local_experts) {
  return petit::row_list_workspace_ints(num_entries, num_local_experts);
}

extern "C" int petit_emu_row_list_chunk() { return petit::kRowListChunk; }

// row_lists_check on these sizes (an expert_map of num_global_experts entries where that is
// >= 0, never read). Returns the petitError_t as an int (0: accepted), the reason in err.
extern "C" int petit_emu_row_lists_check(int num_entries, int num_local_experts,
                                         int num_global_experts, char* err, int err_len) {
  static const int32_t map_entry = 0;
  petit::RowListArgs a{};
  a.num_entries = num_entries;
  a.num_local_experts = num_local_experts;
  if (num_global_experts >= 0) {
    a.expert_map = &map_entry;
    a.num_global_experts = num_global_experts;
  }
  return int(petit::row_lists_check(a, err, err_len));
}
