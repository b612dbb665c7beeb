// The one validity rule for a routing entry's expert id, shared by the row-list kernels
// (routing.cu) and the local reduction (reduce.cu), so both always agree on which entries a
// rank serves. Framework-free (platform.h only), CUDA and HIP.
#pragma once

#include "common/platform.h"

namespace petit {

// Local expert of routing entry `entry`, or -1 (the entry is not served here).
//   expert_map == nullptr: ids[entry] is a local id; anything outside [0, num_local) is -1.
//   expert_map != nullptr: ids[entry] is a global id g; the local id is expert_map[g] for g in
//     [0, num_global), -1 for other g; a map value outside [0, num_local) is -1 too (vLLM's EP
//     expert_map: global -> local id on this rank, -1 for other ranks' experts).
PETIT_HOST_DEVICE int local_expert_id(const int32_t* ids, const int32_t* expert_map,
                                      int num_global, int num_local, int64_t entry) {
  int e = ids[entry];
  if (expert_map != nullptr) e = (e >= 0 && e < num_global) ? expert_map[e] : -1;
  return (e >= 0 && e < num_local) ? e : -1;
}

// Owner rank of a routing slot's global expert id in dispatch (E = num_experts experts, L =
// num_local per rank, rank r owns [r*L, (r+1)*L)), or -1 when the slot is not routed: -1 and
// every id outside [0, E) (an out-of-range id is dropped like -1, and counted: see
// EpDiagnostics::dropped_ids). 64-bit throughout, so an int64 id >= 2^31 * L cannot alias a
// real expert through a narrowing, and the owner is always < kMaxWorldSize (a valid shift).
PETIT_HOST_DEVICE int expert_owner(int64_t id, int num_experts, int num_local) {
  return (id >= 0 && id < int64_t(num_experts)) ? int(id / num_local) : -1;
}

}  // namespace petit
