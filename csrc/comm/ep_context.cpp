// One rank's EP context (ep_context.h): the heap, the device state, the heartbeat page and the
// order of close and abort, without torch or Python.
#include "comm/ep_context.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace petit {

namespace {

// Every refusal and failure: a std::runtime_error with a formatted message (snprintf: one
// formatting path, no std::ostream integer insertion, as in the binding).
[[noreturn]] void fail(const char* fmt, ...) {
  char msg[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof(msg), fmt, args);
  va_end(args);
  throw std::runtime_error(msg);
}

#define PETIT_REQUIRE(cond, ...) \
  do {                           \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

void require_ok(petitError_t err, const char* what) {
  if (err != petitSuccess) fail("%s failed: %s", what, petitGetErrorString(err));
}

// Makes `device` current for the scope (the runtime calls below act on the current device).
class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    if (petitGetDevice(&previous_) != petitSuccess) previous_ = -1;
    if (previous_ != device_) (void)petitSetDevice(device_);
  }
  ~DeviceScope() {
    if (previous_ >= 0 && previous_ != device_) (void)petitSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

using RunBlocking = std::function<void(const std::function<void()>&)>;

void run(const RunBlocking& run_blocking, const std::function<void()>& wait) {
  if (run_blocking)
    run_blocking(wait);
  else
    wait();
}

// The device state of one context in one allocation, each part 256-byte aligned.
struct DeviceStateLayout {
  int64_t token_rank_mask, group_done, recv_group_counts, total_bytes;
};

int64_t align_up(int64_t bytes) {
  return (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

DeviceStateLayout device_state_layout(int world_size, int max_tokens, int max_groups) {
  DeviceStateLayout l{};
  l.token_rank_mask = align_up(int64_t(sizeof(EpState)));
  l.group_done = l.token_rank_mask + align_up(int64_t(max_tokens) * sizeof(uint32_t));
  const int64_t counters = int64_t(world_size) * max_groups;
  l.recv_group_counts = l.group_done + align_up(counters * int64_t(sizeof(uint32_t)));
  l.total_bytes = l.recv_group_counts + align_up(counters * int64_t(sizeof(int32_t)));
  return l;
}

}  // namespace

const char* ep_error_name(int error) {
  return error == kEpErrorTimeout       ? "timeout"
         : error == kEpErrorMismatch    ? "mismatch"
         : error == kEpErrorPeerAborted ? "peer_aborted"
         : error == kEpErrorOrder       ? "order"
                                        : "";
}

EpContext::EpContext(const EpContextParams& p)
    : device_(int(p.device)), combine_config_(p.combine_config), run_blocking_(p.run_blocking) {
  PETIT_REQUIRE(config_valid(combine_config_), "%s", kCombineConfigLimits);
  PETIT_REQUIRE(p.world_size >= 1 && p.world_size <= kMaxWorldSize,
                "world size %lld outside [1, %d]", (long long)p.world_size, kMaxWorldSize);
  PETIT_REQUIRE(p.rank >= 0 && p.rank < p.world_size, "rank %lld outside [0, %lld)",
                (long long)p.rank, (long long)p.world_size);
  PETIT_REQUIRE(p.hidden > 0 && p.hidden % 8 == 0,
                "hidden size %lld must be a positive multiple of 8", (long long)p.hidden);
  PETIT_REQUIRE(p.max_top_k >= 1 && p.max_top_k <= kMaxTopK, "max top-k %lld outside [1, %d]",
                (long long)p.max_top_k, kMaxTopK);
  PETIT_REQUIRE(p.num_experts >= p.world_size && p.num_experts <= kMaxExperts &&
                    p.num_experts % p.world_size == 0,
                "%lld experts must be a multiple of the world size %lld and at most %d",
                (long long)p.num_experts, (long long)p.world_size, kMaxExperts);
  PETIT_REQUIRE(p.max_tokens >= 1 && p.max_tokens <= kMaxTokensPerRank,
                "max tokens per rank %lld outside [1, %d] (the call tag holds the region stride "
                "in full)", (long long)p.max_tokens, kMaxTokensPerRank);
  char err[512] = {0};
  PETIT_REQUIRE(timeout_check(p.timeout_s, err, sizeof(err)) == petitSuccess, "%s", err);
  DeviceScope scope(device_);
  args_.layout = make_heap_layout(int(p.world_size), int(p.max_tokens), int(p.hidden),
                                  int(p.max_top_k));
  args_.rank = int(p.rank);
  args_.world_size = int(p.world_size);
  args_.num_experts = int(p.num_experts);
  args_.num_local_experts = int(p.num_experts / p.world_size);
  int num_sms = 0;
  require_ok(petitDeviceGetAttribute(&num_sms, petitDevAttrMultiProcessorCount, device_),
             "SM count query");
  PETIT_REQUIRE(p.num_blocks >= 1 && p.num_blocks <= num_sms,
                "num_sms %lld must be in [1, %d] (the persistent grid must be co-resident)",
                (long long)p.num_blocks, num_sms);
  args_.num_blocks = int(p.num_blocks);
  args_.timeout_ticks = timeout_ticks(p.timeout_s);

  // The heap: unmapped and freed once nothing holds it, the context (until close) and every
  // view of it, after the device is done with it (a queued kernel may still read a view).
  SymmetricHeap* heap = nullptr;
  const petitError_t created =
      SymmetricHeap::create(device_, args_.layout.total_bytes, &heap, err, sizeof(err));
  PETIT_REQUIRE(created == petitSuccess, "%s", err);
  const RunBlocking run_blocking = run_blocking_;
  heap_ = std::shared_ptr<SymmetricHeap>(heap, [run_blocking](SymmetricHeap* h) {
    run(run_blocking, [h] {
      if (h->device() >= 0) {
        DeviceScope scope(h->device());
        (void)petitDeviceSynchronize();
      }
      delete h;
    });
  });

  // The device state, zeroed (the first call's epoch is 1); freed as the heap is.
  const DeviceStateLayout s = device_state_layout(args_.world_size, args_.layout.max_tokens,
                                                  args_.layout.max_groups);
  char* state = nullptr;
  require_ok(petitMalloc(reinterpret_cast<void**>(&state), size_t(s.total_bytes)),
             "device state allocation");
  const int device = device_;
  device_state_ = std::shared_ptr<void>(state, [run_blocking, device](void* ptr) {
    run(run_blocking, [ptr, device] {
      DeviceScope scope(device);
      (void)petitDeviceSynchronize();
      (void)petitFree(ptr);
    });
  });
  require_ok(petitMemset(state, 0, size_t(s.total_bytes)), "device state initialization");
  require_ok(petitDeviceSynchronize(), "device state initialization");
  args_.state = reinterpret_cast<EpState*>(state);
  args_.token_rank_mask = reinterpret_cast<uint32_t*>(state + s.token_rank_mask);
  args_.group_done = reinterpret_cast<uint32_t*>(state + s.group_done);
  args_.recv_group_counts = reinterpret_cast<int32_t*>(state + s.recv_group_counts);

  require_ok(petitHostAlloc(reinterpret_cast<void**>(&diag_host_), sizeof(EpDiagnostics)),
             "pinned diagnostics allocation");
  memset(diag_host_, 0, sizeof(EpDiagnostics));
  const petitError_t mapped =
      petitHostGetDevicePointer(reinterpret_cast<void**>(&args_.diagnostics), diag_host_);
  if (mapped != petitSuccess) {  // no destructor runs after a constructor throws
    (void)petitFreeHost(diag_host_);
    diag_host_ = nullptr;
  }
  require_ok(mapped, "diagnostics device pointer");
}

EpContext::~EpContext() {  // the owner closes first; otherwise the same wait, without the GIL
  run(run_blocking_, [this] {
    close();
    device_state_.reset();
  });
}

void EpContext::attach_heartbeat(const std::string& name, bool create, double period_s,
                                  double max_wait_s) {
  PETIT_REQUIRE(heartbeat_host_ == nullptr, "the heartbeat is attached already");
  const double ticks_per_s = petit_timer_ticks_per_second();
  PETIT_REQUIRE(period_s > 0.0 && period_s * 2.0 < double(args_.timeout_ticks) / ticks_per_s,
                "heartbeat period %g s must be below half the wait bound", period_s);
  PETIT_REQUIRE(max_wait_s * ticks_per_s >= double(args_.timeout_ticks) && max_wait_s <= kMaxWaitS,
                "max_wait_s %g outside [timeout_s, %g]", max_wait_s, kMaxWaitS);
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  PETIT_REQUIRE(fd >= 0, "heartbeat page %s: shm_open failed (errno %d)", name.c_str(), errno);
  const size_t bytes = size_t(sysconf(_SC_PAGESIZE));
  if (size_t(args_.world_size) * sizeof(uint64_t) > bytes) {
    ::close(fd);
    fail("heartbeat page too small");
  }
  const bool sized = !create || ftruncate(fd, off_t(bytes)) == 0;  // zero-filled
  void* host = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                     : MAP_FAILED;
  ::close(fd);
  PETIT_REQUIRE(host != MAP_FAILED, "heartbeat page %s: mapping failed (errno %d)", name.c_str(),
                errno);
  DeviceScope scope(device_);
  void* device = nullptr;
  petitError_t e = petitHostRegisterMapped(host, bytes);
  const bool registered = e == petitSuccess;
  if (registered) e = petitHostGetDevicePointer(&device, host);
  if (e != petitSuccess) {
    (void)petitGetLastError();
    if (registered) (void)petitHostUnregister(host);
    munmap(host, bytes);
    fail("heartbeat page: registering it with the GPU failed (%d)", int(e));
  }
  heartbeat_host_ = static_cast<uint64_t*>(host);
  heartbeat_bytes_ = bytes;
  args_.heartbeats = static_cast<const volatile uint64_t*>(device);
  args_.max_wait_ticks = uint64_t(max_wait_s * ticks_per_s);
  heartbeat_.start(heartbeat_host_ + args_.rank, period_s);
}

void EpContext::unlink_heartbeat(const std::string& name) { shm_unlink(name.c_str()); }

int EpContext::export_fd() {
  PETIT_REQUIRE(heap_ != nullptr, "context is closed");
  int fd = -1;
  char err[512] = {0};
  PETIT_REQUIRE(heap_->export_fd(&fd, err, sizeof(err)) == petitSuccess, "%s", err);
  return fd;
}

void EpContext::map_peers(const std::vector<int>& fds) {
  if (heap_ == nullptr || int64_t(fds.size()) != args_.world_size) {
    for (size_t r = 0; r < fds.size(); ++r)
      if (int64_t(r) != args_.rank && fds[r] >= 0) ::close(fds[r]);
    PETIT_REQUIRE(heap_ != nullptr, "context is closed");
    fail("expected %d descriptors, got %zu", args_.world_size, fds.size());
  }
  DeviceScope scope(device_);
  char err[512] = {0};
  const petitError_t e = heap_->map_all(fds.data(), args_.world_size, args_.rank, err,
                                        sizeof(err));
  PETIT_REQUIRE(e == petitSuccess, "%s", err);
  args_.heap_base = heap_->base();
  args_.heap_stride = heap_->stride();
  // Flags start at epoch 0; the caller runs a barrier before any peer writes them.
  char* own = args_.heap_base + int64_t(args_.rank) * args_.heap_stride;
  require_ok(petitMemset(own + args_.layout.flags_begin, 0,
                         size_t(args_.layout.flags_end - args_.layout.flags_begin)),
             "flag initialization");
  require_ok(petitDeviceSynchronize(), "flag initialization");
}

OwnedPtr EpContext::heap_view(int64_t rank, int64_t offset, int64_t num_bytes) {
  std::lock_guard<std::mutex> launching(launch_mutex_);
  check_mapped();
  PETIT_REQUIRE(rank >= 0 && rank < args_.world_size, "rank %lld out of range", (long long)rank);
  PETIT_REQUIRE(offset >= 0 && num_bytes >= 0 && offset + num_bytes <= heap_->stride(),
                "heap view out of range");
  return {args_.heap_base + rank * args_.heap_stride + offset, heap_};
}

DispatchRegions EpContext::dispatch(DispatchArgs a, petitStream_t stream) {
  std::lock_guard<std::mutex> launching(launch_mutex_);
  check_mapped();
  a.ctx = args_;
  char err[512] = {0};
  PETIT_REQUIRE(dispatch_check(a, err, sizeof(err)) == petitSuccess, "%s", err);
  {
    DeviceScope scope(device_);
    require_ok(launch_dispatch(a, stream), "dispatch launch");
  }
  char* own = args_.heap_base + int64_t(args_.rank) * args_.heap_stride;
  DispatchRegions r;
  r.rows = own + args_.layout.dispatch_rows;
  r.ids = own + args_.layout.dispatch_ids;
  r.weights = own + args_.layout.dispatch_weights;
  r.scales = own + args_.layout.dispatch_scales;
  r.owner = heap_;
  return r;
}

void EpContext::combine(CombineArgs a, petitStream_t stream) {
  std::lock_guard<std::mutex> launching(launch_mutex_);
  check_mapped();
  a.ctx = args_;
  a.config = combine_config_;
  char err[512] = {0};
  PETIT_REQUIRE(combine_check(a, err, sizeof(err)) == petitSuccess, "%s", err);
  DeviceScope scope(device_);
  require_ok(launch_combine(a, stream), "combine launch");
}

void EpContext::megamoe(MegaMoeEpArgs e, petitStream_t stream) {
  std::lock_guard<std::mutex> launching(launch_mutex_);
  check_mapped();
  e.ctx = args_;
  e.layer.num_sms = args_.num_blocks;
  e.layer.timeout_ticks = args_.timeout_ticks;
  char err[512] = {0};
  PETIT_REQUIRE(megamoe_ep_check(e, err, sizeof(err)) == petitSuccess, "fused EP layer: %s", err);
  DeviceScope scope(device_);
  const petitError_t launched = launch_megamoe_ep(e, stream);
  PETIT_REQUIRE(launched != petitErrorCooperativeLaunchTooLarge,
                "fused EP layer: its grid of %d x num_sms = %d blocks cannot all be resident on "
                "this GPU at once (occupancy x SMs, or num_sms above the SM count), and its "
                "ranks spin on each other: build the EpBuffer with fewer num_sms",
                kMegaMoeBlocksPerSm, kMegaMoeBlocksPerSm * args_.num_blocks);
  require_ok(launched, "fused EP launch");
}

void EpContext::peer_write(const void* src, int64_t bytes_per_peer, int num_blocks,
                           petitStream_t stream) {
  std::lock_guard<std::mutex> launching(launch_mutex_);
  check_mapped();
  const int64_t region = args_.layout.flags_begin - args_.layout.combine_rows;
  PETIT_REQUIRE(bytes_per_peer <= region && bytes_per_peer % 16 == 0,
                "bytes_per_peer must be a multiple of 16 and <= %lld", (long long)region);
  PeerWriteArgs a{};
  a.heap_base = args_.heap_base;
  a.heap_stride = args_.heap_stride;
  a.rank = args_.rank;
  a.world_size = args_.world_size;
  a.src = src;
  a.heap_offset = args_.layout.combine_rows;
  a.bytes_per_peer = bytes_per_peer;
  a.num_blocks = num_blocks;
  DeviceScope scope(device_);
  require_ok(launch_peer_write(a, stream), "peer write launch");
}

OwnedPtr EpContext::epoch() const {
  return {reinterpret_cast<char*>(&args_.state->epoch), device_state_};
}

OwnedPtr EpContext::recv_group_counts() const {
  return {reinterpret_cast<char*>(args_.recv_group_counts), device_state_};
}

bool EpContext::diagnostics(EpDiagnostics* out) const {
  std::lock_guard<std::mutex> lock(diag_mutex_);  // close() may free the record meanwhile
  if (diag_host_ == nullptr) return false;
  const volatile EpDiagnostics* d = diag_host_;  // written by the device at any time
  out->error = d->error;
  out->rank = d->rank;
  out->peer = d->peer;
  out->phase = d->phase;
  out->group = d->group;
  out->dropped_ids = d->dropped_ids;
  out->expected_epoch = d->expected_epoch;
  out->observed_flag = d->observed_flag;
  out->expected_tag = d->expected_tag;
  out->peer_alive = d->peer_alive;
  return true;
}

int64_t EpContext::heap_stride() const { return heap_ ? heap_->stride() : 0; }

void EpContext::close() {
  {  // no launch from here on (check_mapped); one already in progress is enqueued first
    std::lock_guard<std::mutex> lock(launch_mutex_);
    args_.heap_base = nullptr;
  }
  if (heap_ || diag_host_ != nullptr || heartbeat_host_ != nullptr) {
    DeviceScope scope(device_);
    (void)petitDeviceSynchronize();  // no kernel of ours may still touch the range or the words
  }
  heartbeat_.abort();
  heartbeat_.stop();
  heap_.reset();
  {
    std::lock_guard<std::mutex> lock(diag_mutex_);
    if (diag_host_ != nullptr) (void)petitFreeHost(diag_host_);
    diag_host_ = nullptr;
  }
  if (heartbeat_host_ != nullptr) {  // after the synchronize above: no kernel reads it
    (void)petitHostUnregister(heartbeat_host_);
    munmap(heartbeat_host_, heartbeat_bytes_);
    heartbeat_host_ = nullptr;
  }
  args_.heartbeats = nullptr;
}

void EpContext::check_mapped() const {
  PETIT_REQUIRE(heap_ && args_.heap_base != nullptr,
                "the symmetric heap is not mapped (closed, or map_peers not run)");
}

}  // namespace petit
