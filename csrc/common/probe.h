// Start-up probe of the warp-specialized expert kernels (a build with PETIT_MOE_PROBE=1 only;
// tools/expert_startup_probe.py reads it). Each marked point writes the %globaltimer (ns) into
// a per-block slot of one device array: "first" marks keep the first time a block reaches the
// point (the array is zero after every read), "last" marks the latest, "count" marks add one.
// A build without the macro compiles every mark to nothing, so the kernels the product runs are
// unchanged; expert_probe_read (api.h) then says so.
#pragma once

#include "common/platform.h"

namespace petit {

constexpr int kProbeBlocks = 1024;  // blocks past this one are not recorded
constexpr int kProbeSlots = 16;

// The marked points, in the order a block passes them (tools/expert_startup_probe.py names
// them the same way; keep both in step).
enum ProbeSlot : int {
  kProbeEntry = 0,         // thread 0, first instruction (before griddepcontrol.wait)
  kProbeWaited,            // thread 0, after griddepcontrol.wait
  kProbeScheduled,         // thread 0, the m-tile prefix built (after its block barrier)
  kProbeFirstClaim,        // TMA issuer: its first tile known (fused: claimed)
  kProbeFirstIssue,        // TMA issuer: its first weight boxes issued
  kProbeFirstFull,         // consumer thread 0: its first stage full (the first bytes landed)
  kProbeFirstConsumed,     // consumer thread 0: its first tile's MMAs done
  kProbeFirstStored,       // consumer thread 0: its first tile's epilogue done
  kProbeDownClaim,         // fused, TMA issuer: its first down tile claimed
  kProbeDownReady,         // fused, TMA issuer: that tile's gate/up arrivals all seen
  kProbeDownFull,          // fused, consumer thread 0: its first down stage full
  kProbeDownConsumed,      // fused, consumer thread 0: its first down tile's MMAs done
  kProbeLastStored,        // consumer thread 0: its last epilogue done (last mark)
  kProbeExit,              // consumer thread 0, leaving the kernel (last mark)
  kProbeTiles,             // consumer thread 0: tiles it multiplied (count)
  kProbeKTiles,            // consumer thread 0: k-tiles it multiplied (count)
};

#if defined(PETIT_MOE_PROBE) && PETIT_CUDA && !PETIT_EMU_PTX && defined(__CUDACC__)
#define PETIT_PROBE_BUILT 1
__device__ unsigned long long g_petit_probe[kProbeBlocks * kProbeSlots];

PETIT_DEVICE unsigned long long* probe_slot(int slot) {
  return blockIdx.x < kProbeBlocks ? g_petit_probe + blockIdx.x * kProbeSlots + slot : nullptr;
}
// `who`: whether the calling thread records (one thread per point and block).
PETIT_DEVICE void probe_first(int slot, bool who) {
  unsigned long long* p = probe_slot(slot);
  if (who && p != nullptr && *p == 0) *p = petit_timer();
}
PETIT_DEVICE void probe_last(int slot, bool who) {
  unsigned long long* p = probe_slot(slot);
  if (who && p != nullptr) *p = petit_timer();
}
PETIT_DEVICE void probe_count(int slot, bool who, int n = 1) {
  unsigned long long* p = probe_slot(slot);
  if (who && p != nullptr) *p += (unsigned long long)n;
}
#else
#define PETIT_PROBE_BUILT 0
PETIT_HOST_DEVICE void probe_first(int, bool) {}
PETIT_HOST_DEVICE void probe_last(int, bool) {}
PETIT_HOST_DEVICE void probe_count(int, bool, int = 1) {}
#endif

}  // namespace petit
