// The one validity rule for a routing entry's expert id, shared by the row-list kernels
// (routing.cu) and the local reduction (experts.cu), so both always agree on which entries a
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

}  // namespace petit
