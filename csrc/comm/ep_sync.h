// Device pieces shared by the kernels that talk to peers over the linearized symmetric heap
// (comm/dispatch_combine.cu, experts/megamoe.cu's EP layer): the peer's heap, the row copy,
// the bounded flag wait with its diagnostic record and heartbeat (docs/faults.md), and the
// release of a flag.
#pragma once

#include <stdio.h>

#include "../api.h"

namespace petit {

PETIT_DEVICE char* rank_heap(const EpContextArgs& c, int rank) {
  return c.heap_base + int64_t(rank) * c.heap_stride;
}

// One warp copies vectors [begin, end) of a row; kCopyUnroll independent 16-byte loads in
// flight per lane before the first store, also in a partial last step (predicated).
constexpr int kCopyUnroll = 8;
PETIT_DEVICE void warp_copy(uint4* __restrict__ dst, const uint4* __restrict__ src, int begin,
                            int end, int lane) {
  for (int v0 = begin + lane; v0 < end; v0 += kCopyUnroll * PETIT_WARP_SIZE) {
    uint4 buf[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (v0 + u * PETIT_WARP_SIZE < end) buf[u] = src[v0 + u * PETIT_WARP_SIZE];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (v0 + u * PETIT_WARP_SIZE < end) dst[v0 + u * PETIT_WARP_SIZE] = buf[u];
  }
}

// Index of the n-th set bit of a 32-bit mask.
PETIT_DEVICE int nth_set_bit(uint32_t mask, int n) {
  for (int i = 0; i < n; ++i) mask &= mask - 1;
  return __ffs(mask) - 1;
}

// The first failing wait of this rank records the error (pinned host memory, readable after
// the trap), marks this rank's heartbeat aborted (its peers then fail at their next look
// instead of waiting for a live process: the host's beat keeps the bit, heartbeat.h), prints
// it and traps; any other failing thread just traps.
PETIT_DEVICE void fail_wait(const EpContextArgs& c, int error, uint64_t value, uint64_t epoch,
                            uint32_t tag, int peer, int phase, int group, bool peer_alive = false) {
  if (atomicCAS(&c.diagnostics->error, 0, error) == 0) {
    c.diagnostics->peer_alive = peer_alive ? 1u : 0u;
    c.diagnostics->rank = c.rank;
    c.diagnostics->peer = peer;
    c.diagnostics->phase = phase;
    c.diagnostics->group = group;
    c.diagnostics->expected_epoch = epoch;
    c.diagnostics->observed_flag = value;
    c.diagnostics->expected_tag = tag;
    if (c.heartbeats != nullptr) {
      volatile uint64_t* own = const_cast<volatile uint64_t*>(c.heartbeats) + c.rank;
      *own = *own | kHeartbeatAborted;
    }
    petit_fence_sys();
    const char* what = phase == 0 ? "dispatch" : "combine";
    const uint32_t seen_tag = flag_tag(value);
    if (error == kEpErrorTimeout)
      printf("petit_moe: %s timed out on rank %d waiting for rank %d, token group %d: "
             "expected epoch %llu, flag holds epoch %llu (count %u)%s\n",
             what, c.rank, peer, group, (unsigned long long)epoch,
             (unsigned long long)flag_epoch(value), flag_count(value),
             c.heartbeats == nullptr ? ""
             : peer_alive ? "; its process is alive but the wait reached max_wait_s"
                          : "; its process stopped (no heartbeat)");
    else if (error == kEpErrorPeerAborted)
      printf("petit_moe: %s on rank %d waiting for rank %d, token group %d, epoch %llu: rank %d "
             "left the protocol (its heartbeat is marked aborted: an error on that rank, or it "
             "closed its buffer)\n",
             what, c.rank, peer, group, (unsigned long long)epoch, peer);
    else if (error == kEpErrorOrder)
      printf("petit_moe: %s call order mismatch on rank %d: rank %d is past this call (its "
             "%s of epoch %llu, stride %d, is here; this rank waits in its %s of epoch %llu, "
             "token group %d): a call skipped or made in another order\n",
             what, c.rank, peer, tag_kind(seen_tag) == kCallDispatch ? "dispatch" : "combine",
             (unsigned long long)flag_epoch(value), tag_region_stride(seen_tag), what,
             (unsigned long long)epoch, group);
    else
      printf("petit_moe: %s call mismatch on rank %d: rank %d's call of epoch %llu differs "
             "(token group %d: call tag 0x%07x, this rank's 0x%07x: region stride %d vs %d; "
             "kind, region stride, top-k and quant must be equal on all ranks)\n",
             what, c.rank, peer, (unsigned long long)epoch, group, seen_tag, tag,
             tag_region_stride(seen_tag), tag_region_stride(tag));
  }
  petit_trap();
}

// Whether rank `peer` is past the call this rank waits in (epoch `epoch`, `phase` 0 dispatch
// / 1 combine): its freshest flags here, group 0 of each region (every dispatch and fused call
// raises its dispatch flag [peer][0], every combine and fused call its combine flag
// [peer][0][0]), show a later call, in (epoch, kind) order. A peer cannot be past a call
// without having raised all of that call's flags for us first (its sends precede its waits and
// its next call), so this is a skipped call or another call order, never a slow peer.
// *value: the flag that shows it.
PETIT_DEVICE bool peer_past_call(const EpContextArgs& c, int peer, uint64_t epoch, int phase,
                                 uint64_t* value) {
  const char* my_heap = rank_heap(c, c.rank);
  const uint64_t want = flag_epoch_bits(epoch);
  const uint64_t dispatch = petit_load_acquire_sys(
      reinterpret_cast<const uint64_t*>(my_heap + c.layout.dispatch_flags) +
      int64_t(peer) * c.layout.max_groups);
  const uint64_t combine = petit_load_acquire_sys(
      reinterpret_cast<const uint64_t*>(my_heap + c.layout.combine_flags) +
      int64_t(peer) * c.layout.max_groups * c.layout.max_chunks);
  if (flag_epoch_after(flag_epoch(dispatch), want)) {
    *value = dispatch;
    return true;
  }
  if (flag_epoch_after(flag_epoch(combine), want) ||
      (phase == 0 && flag_epoch(combine) == want)) {  // its combine of this epoch: past ours
    *value = combine;
    return true;
  }
  return false;
}

// Bounded spin until the flag shows `epoch` (its low kFlagEpochBits bits); the flag must then
// carry `tag`, the tag of this rank's own call (else the peer made another call: mismatch).
// When the bound (timeout_ticks) expires the peer's position is read (peer_past_call: a peer
// past this call is a call-order mismatch, reported at once) and, when the context has
// heartbeats, the peer's word (only then: one read of host memory): aborted, the peer left the
// protocol (reported at once); otherwise the wait goes on for half a bound and fails when the
// word did not move over such a half (the peer's process is gone or frozen: reported within
// 1.5 bounds) or when max_wait_ticks have passed since the wait began (alive but stuck).
// On failure or mismatch: fail_wait.
PETIT_DEVICE uint64_t wait_flag(const EpContextArgs& c, const uint64_t* flag, uint64_t epoch,
                                uint32_t tag, int peer, int phase, int group) {
  const uint64_t want = flag_epoch_bits(epoch);
  uint64_t value = petit_load_acquire_sys(flag);
  if (flag_epoch(value) != want) {
    const uint64_t begin = petit_timer();
    uint64_t start = begin, beat = 0;
    bool sampled = false;  // beat holds the peer's word as of the last expiry
    while (true) {
      value = petit_load_acquire_sys(flag);
      if (flag_epoch(value) == want) break;
      const uint64_t now = petit_timer();
      if (now - start > c.timeout_ticks) {
        uint64_t ahead = 0;
        if (peer_past_call(c, peer, epoch, phase, &ahead)) {
          // The peer raised our flag before its later one; a grace of 1/64 bound lets a
          // store still in flight land (no order between the two is guaranteed across blocks).
          const uint64_t seen_at = petit_timer();
          do {
            value = petit_load_acquire_sys(flag);
          } while (flag_epoch(value) != want && petit_timer() - seen_at <= c.timeout_ticks / 64);
          if (flag_epoch(value) == want) break;
          fail_wait(c, kEpErrorOrder, ahead, epoch, tag, peer, phase, group);
        }
        if (c.heartbeats == nullptr)
          fail_wait(c, kEpErrorTimeout, value, epoch, tag, peer, phase, group);
        const uint64_t seen = c.heartbeats[peer];
        if (seen & kHeartbeatAborted)
          fail_wait(c, kEpErrorPeerAborted, value, epoch, tag, peer, phase, group);
        const bool moved = !sampled || seen != beat;
        if (!moved || now - begin > c.max_wait_ticks)
          fail_wait(c, kEpErrorTimeout, value, epoch, tag, peer, phase, group, moved);
        beat = seen;
        sampled = true;
        start = now - c.timeout_ticks / 2;  // the next look: half a bound from now
      }
    }
  }
  if (flag_tag(value) != tag) fail_wait(c, kEpErrorMismatch, value, epoch, tag, peer, phase, group);
  return value;
}

// Thread 0's fence between its block's writes (observed through the block barrier) and the
// flags that publish them, which follow as strong relaxed stores (publish_flag): an
// acquire-release fence at system scope, all that message passing needs (one MEMBAR.SYS per
// flag on sm_90, where a sequentially consistent fence is two).
PETIT_DEVICE void publish_fence() { petit_fence_acq_rel_sys(); }

PETIT_DEVICE void publish_flag(uint64_t* flag, uint64_t value) {
  petit_store_relaxed_sys(flag, value);
}

}  // namespace petit
