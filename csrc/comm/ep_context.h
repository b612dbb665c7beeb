// One rank's EP context, framework-free: its share of the symmetric heap, the device-side state
// of its calls (EpState, token masks, group counters), the pinned diagnostics record, the
// heartbeat page and its thread, the launch/close mutex and the order of close and abort.
// The torch binding (bindings/ep_context.cpp) converts tensors into the raw calls below and
// wraps the returned pointers in tensor views; every error is a std::runtime_error whose
// message the binding shows as it is (after its "petit_moe: " prefix).
//
// Ownership: the heap and the device state are each one allocation behind a shared_ptr that
// the context holds until close() (the heap) or its destruction (the device state), and that
// every view of it holds too (OwnedPtr::owner), so a view kept past close() reads stale bytes,
// never unmapped or freed memory. The last owner waits for the device before it frees (a
// queued kernel may still read the memory), through EpContextParams::run_blocking.
//
// Tested without a GPU on a fake runtime (tests/emu/ep_context_emu.cpp,
// tests/test_ep_context_emu_cpu.py): its runtime calls go through platform.h's petit* names
// and the heap's through petit_driver(), which the test redefines.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "api.h"
#include "comm/heartbeat.h"

namespace petit {

struct EpContextParams {
  int64_t device = 0;
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t max_tokens = 1;     // tokens per rank, the largest region stride
  int64_t hidden = 0;
  int64_t max_top_k = 1;
  int64_t num_experts = 1;    // global; a multiple of world_size
  int64_t num_blocks = 1;     // persistent grid, at most the device's SM count
  double timeout_s = kDefaultTimeoutS;
  CombineConfig combine_config;
  // Runs `wait` (a device synchronize, possibly long: until a kernel's bounded waits end).
  // The binding passes one that releases the GIL around it where the calling thread holds it;
  // empty: runs it as it is.
  std::function<void(const std::function<void()>& wait)> run_blocking;
};

// A pointer into memory that a share keeps alive (a view's owner).
struct OwnedPtr {
  char* ptr = nullptr;
  std::shared_ptr<void> owner;
};

// This rank's receive regions after a dispatch (layout.h offsets in its own heap); the owner
// keeps the heap mapped.
struct DispatchRegions {
  char* rows = nullptr;     // [W*R, H] bf16, or e4m3 bytes (quant != kQuantNone)
  char* ids = nullptr;      // [W*R, K] int32
  char* weights = nullptr;  // [W*R, K] float32
  char* scales = nullptr;   // [W*R, H/128] or [W*R, 1] float32 (fp8 only)
  std::shared_ptr<void> owner;
};

// The name of an EpError as diagnostics report it ("timeout", "mismatch", "peer_aborted",
// "order"; "" for kEpErrorNone).
const char* ep_error_name(int error);

class EpContext {
 public:
  // Checks the sizes (world size, rank, hidden, top-k, experts, tokens, timeout, grid against
  // the device's SMs), allocates the heap, the device state and the diagnostics record.
  explicit EpContext(const EpContextParams& params);
  ~EpContext();  // close(), through run_blocking
  EpContext(const EpContext&) = delete;
  EpContext& operator=(const EpContext&) = delete;

  // The heartbeat page (docs/faults.md): POSIX shared memory `name` of one word per rank,
  // created (zeroed) by the first caller (`create`) and opened by the others, mapped here and
  // registered with the GPU; a thread of this process increments this rank's word every
  // `period_s`. Waits then go on past the bound while the peer's word moves, up to max_wait_s.
  void attach_heartbeat(const std::string& name, bool create, double period_s,
                        double max_wait_s);
  // This rank leaves the protocol (a collective call raised before its launch): its
  // heartbeat word is marked aborted, so peers waiting for it fail at their next look
  // (kEpErrorPeerAborted) instead of waiting max_wait_s for a live process.
  void abort() { heartbeat_.abort(); }
  static void unlink_heartbeat(const std::string& name);

  // A new descriptor of this rank's allocation (the caller sends and closes it).
  int export_fd();
  // fds[r] for r != rank: descriptors received from the peers. Takes them: every one is
  // closed on every path (SymmetricHeap::map_all, or here when it is not reached), so a
  // failed setup keeps no peer's allocation alive. Zeroes this rank's flags (epoch 0); the
  // caller runs a barrier before any peer writes them.
  void map_peers(const std::vector<int>& fds);

  // `num_bytes` at `offset` of rank `rank`'s heap, through the linear range.
  OwnedPtr heap_view(int64_t rank, int64_t offset, int64_t num_bytes);

  // The launches, on `stream` (of this context's device). Each takes the launch mutex (against
  // close(), which runs without the GIL), refuses an unmapped heap, sets the context fields of
  // its arguments and checks them against the context's limits (api.h *_check: one home per
  // limit) before it launches.
  DispatchRegions dispatch(DispatchArgs call, petitStream_t stream);
  void combine(CombineArgs call, petitStream_t stream);  // call.config: the context's
  void megamoe(MegaMoeEpArgs call, petitStream_t stream);  // num_sms, timeout: the context's
  // Benchmark ceiling: push `bytes_per_peer` of `src` into every peer's combine region.
  void peer_write(const void* src, int64_t bytes_per_peer, int num_blocks, petitStream_t stream);

  // Device state, valid for the context's life and as long as the owner lives.
  OwnedPtr epoch() const;              // uint64 [1] (EpState::epoch)
  OwnedPtr recv_group_counts() const;  // int32 [W, layout.max_groups]
  // Copies the diagnostics record (pinned host memory: no device sync); false once closed.
  bool diagnostics(EpDiagnostics* out) const;

  // Bound without the GIL by the binding: the device wait may last until a kernel's bounded
  // waits end. Order: no launch from here on; the device first, with the heartbeat still
  // beating (a kernel of ours still running must not look dead to its peers); then the mark
  // "left the protocol" and the end of the beat; then the memory (the heap once its views are
  // gone too). Idempotent.
  void close();

  int device() const { return device_; }
  const HeapLayout& layout() const { return args_.layout; }
  int rank() const { return args_.rank; }
  int world_size() const { return args_.world_size; }
  int num_blocks() const { return args_.num_blocks; }
  int64_t heap_stride() const;

 private:
  void check_mapped() const;  // under launch_mutex_
  void wait_for_device() const;

  int device_;
  CombineConfig combine_config_;
  std::function<void(const std::function<void()>&)> run_blocking_;
  EpContextArgs args_{};
  std::shared_ptr<SymmetricHeap> heap_;  // shared with the views
  std::shared_ptr<void> device_state_;   // EpState, masks, counters: one device allocation
  EpDiagnostics* diag_host_ = nullptr;
  mutable std::mutex diag_mutex_;  // diagnostics() against close()'s free
  std::mutex launch_mutex_;        // a launch (or view) against close()
  uint64_t* heartbeat_host_ = nullptr;  // the mapped heartbeat page (attach_heartbeat)
  size_t heartbeat_bytes_ = 0;
  HeartbeatThread heartbeat_;           // beats this rank's word (comm/heartbeat.h)
};

}  // namespace petit
