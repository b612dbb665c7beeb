// The thin torch layer: tensor checks, device/stream selection, and the pybind11 module.
// Kernels and the heap live in framework-free files (api.h); nothing here branches on the
// platform.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "api.h"
#include "comm/heartbeat.h"
#include "common/fp8.h"

namespace petit {
namespace {

// Checks format their message with snprintf: no std::ostream integer insertion is compiled
// into this module (a GCC-13 header / older libstdc++ pairing crashes there, seen on the
// H200 image), and one formatting path serves every message.
#define PETIT_CHECK(cond, ...)                                       \
  do {                                                               \
    if (!(cond)) {                                                   \
      char _petit_msg[512];                                          \
      snprintf(_petit_msg, sizeof(_petit_msg), __VA_ARGS__);         \
      TORCH_CHECK(false, "petit_moe: ", static_cast<const char*>(_petit_msg)); \
    }                                                                \
  } while (0)

#define PETIT_CHECK_OK(expr, what)                                                    \
  do {                                                                                \
    petitError_t _err = (expr);                                                       \
    PETIT_CHECK(_err == petitSuccess, "%s failed: %s", what, petitGetErrorString(_err)); \
  } while (0)

// ---- configs (common/config.h) from Python: {field: int} dicts (vllm_petit_moe/config.py);
// an unknown field or an invalid value is an error, a missing field keeps its default.
void set_config_field(const char* struct_name, const std::string& key, int value,
                      std::initializer_list<std::pair<const char*, int*>> fields) {
  for (const auto& field : fields) {
    if (key == field.first) {
      *field.second = value;
      return;
    }
  }
  PETIT_CHECK(false, "%s has no field %s", struct_name, key.c_str());
}

ExpertConfig expert_config_from(const py::dict& d) {
  ExpertConfig c;
  for (const auto& item : d)
    set_config_field("ExpertConfig", py::str(item.first), item.second.cast<int>(),
                     {{"narrow_max_rows", &c.narrow_max_rows},
                      {"m64_max_rows", &c.m64_max_rows},
                      {"mc_min_rows", &c.mc_min_rows},
                      {"mc_min_hidden", &c.mc_min_hidden},
                      {"simt_large_min_rows", &c.simt_large_min_rows}});
  PETIT_CHECK(config_valid(c),
              "ExpertConfig: bounds must be >= 0 with narrow_max_rows (%d) <= m64_max_rows (%d)",
              c.narrow_max_rows, c.m64_max_rows);
  return c;
}

CombineConfig combine_config_from(const py::dict& d) {
  CombineConfig c;
  for (const auto& item : d)
    set_config_field("CombineConfig", py::str(item.first), item.second.cast<int>(),
                     {{"reduce_pct", &c.reduce_pct},
                      {"reduce_vectors", &c.reduce_vectors},
                      {"reduce_items", &c.reduce_items},
                      {"tail_chunks", &c.tail_chunks}});
  PETIT_CHECK(config_valid(c),
              "CombineConfig: reduce_pct in [0, 90], reduce_vectors and reduce_items in "
              "[0, 2^20], tail_chunks in [0, 1024]");
  return c;
}

// The default configs as dicts: what config.py's dataclasses must mirror.
py::dict config_defaults() {
  const ExpertConfig e;
  const CombineConfig c;
  py::dict expert, combine, d;
  expert["narrow_max_rows"] = e.narrow_max_rows;
  expert["m64_max_rows"] = e.m64_max_rows;
  expert["mc_min_rows"] = e.mc_min_rows;
  expert["mc_min_hidden"] = e.mc_min_hidden;
  expert["simt_large_min_rows"] = e.simt_large_min_rows;
  combine["reduce_pct"] = c.reduce_pct;
  combine["reduce_vectors"] = c.reduce_vectors;
  combine["reduce_items"] = c.reduce_items;
  combine["tail_chunks"] = c.tail_chunks;
  d["ExpertConfig"] = expert;
  d["CombineConfig"] = combine;
  return d;
}

void check_cuda_tensor(const torch::Tensor& t, const char* name, int64_t dim) {
  PETIT_CHECK(t.is_cuda(), "%s must be a CUDA tensor", name);
  PETIT_CHECK(t.is_contiguous(), "%s must be contiguous", name);
  PETIT_CHECK(t.dim() == dim, "%s must have %lld dims, got %lld", name, (long long)dim,
              (long long)t.dim());
}

// The fused layer's tensors and sizes (api.h MegaMoeArgs), shared by the one-GPU and the EP
// bindings, which check them first and set the rest (expert map, grid, timeout, trace).
MegaMoeArgs megamoe_args(const torch::Tensor& x, const torch::Tensor& topk_ids,
                         const torch::Tensor& topk_weights, const torch::Tensor& w13,
                         const torch::Tensor& w2, torch::Tensor& act, torch::Tensor& partial,
                         torch::Tensor& sync, torch::Tensor& out) {
  MegaMoeArgs a{};
  a.x = reinterpret_cast<const petit_bf16_bits*>(x.data_ptr());
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.topk_weights = topk_weights.data_ptr<float>();
  a.w13 = reinterpret_cast<const petit_bf16_bits*>(w13.data_ptr());
  a.w2 = reinterpret_cast<const petit_bf16_bits*>(w2.data_ptr());
  a.act = reinterpret_cast<petit_bf16_bits*>(act.data_ptr());
  a.partial = partial.data_ptr<float>();
  a.sync = sync.data_ptr<int32_t>();
  a.out = reinterpret_cast<petit_bf16_bits*>(out.data_ptr());
  a.num_rows = int(x.size(0));
  a.top_k = int(topk_ids.size(1));
  a.hidden = int(x.size(1));
  a.intermediate = int(w13.size(1) / 2);
  a.num_local_experts = int(w13.size(0));
  return a;
}

// The fused layer's weight format: bf16 w13 / w2 without scales, or block fp8 (float8_e4m3fn
// with fp32 scales [L, 2I/128, H/128] / [L, H/128, I/128]); sets the scale pointers of `a`.
void set_weight_format(MegaMoeArgs& a, const torch::Tensor& w13, const torch::Tensor& w2,
                       const c10::optional<torch::Tensor>& w13_scale,
                       const c10::optional<torch::Tensor>& w2_scale) {
  const bool fp8 = w13_scale.has_value();
  const auto weight_type = fp8 ? torch::kFloat8_e4m3fn : torch::kBFloat16;
  PETIT_CHECK(w13.scalar_type() == weight_type && w2.scalar_type() == weight_type &&
                  w2_scale.has_value() == fp8,
              "w13 and w2 must be bfloat16, or float8_e4m3fn with both w13_scale and w2_scale");
  if (!fp8) return;
  const int64_t B = kFp8ScaleBlock, L = w13.size(0), I = w13.size(1) / 2, H = w13.size(2);
  for (const torch::Tensor* t : {&*w13_scale, &*w2_scale}) {
    check_cuda_tensor(*t, "w13_scale / w2_scale", 3);
    PETIT_CHECK(t->scalar_type() == torch::kFloat32 && t->get_device() == w13.get_device(),
                "w13_scale and w2_scale must be float32 on the weights' device");
  }
  PETIT_CHECK(H % B == 0 && I % B == 0 && w13_scale->size(0) == L &&
                  w13_scale->size(1) == 2 * I / B && w13_scale->size(2) == H / B &&
                  w2_scale->size(0) == L && w2_scale->size(1) == H / B &&
                  w2_scale->size(2) == I / B,
              "fp8 weights: H and I multiples of %lld, w13_scale [L, 2I/%lld, H/%lld], "
              "w2_scale [L, H/%lld, I/%lld]", (long long)B, (long long)B, (long long)B,
              (long long)B, (long long)B);
  a.w13_scale = w13_scale->data_ptr<float>();
  a.w2_scale = w2_scale->data_ptr<float>();
}

// Owns one rank's symmetric heap plus the local device state of an EpBuffer.
class EpContext {
 public:
  EpContext(int64_t device, int64_t rank, int64_t world_size, int64_t max_tokens,
            int64_t hidden, int64_t max_top_k, int64_t num_experts, int64_t num_blocks,
            double timeout_s, const py::dict& combine_config)
      : device_(int(device)), combine_config_(combine_config_from(combine_config)) {
    PETIT_CHECK(world_size >= 1 && world_size <= kMaxWorldSize, "world size %lld outside [1, %d]",
                (long long)world_size, kMaxWorldSize);
    PETIT_CHECK(rank >= 0 && rank < world_size, "rank %lld outside [0, %lld)", (long long)rank,
                (long long)world_size);
    PETIT_CHECK(hidden > 0 && hidden % 8 == 0, "hidden size %lld must be a positive multiple of 8",
                (long long)hidden);
    PETIT_CHECK(max_top_k >= 1 && max_top_k <= kMaxTopK, "max top-k %lld outside [1, %d]",
                (long long)max_top_k, kMaxTopK);
    PETIT_CHECK(num_experts >= world_size && num_experts <= kMaxExperts &&
                    num_experts % world_size == 0,
                "%lld experts must be a multiple of the world size %lld and at most %d",
                (long long)num_experts, (long long)world_size, kMaxExperts);
    PETIT_CHECK(max_tokens >= 1 && max_tokens <= kMaxTokensPerRank,
                "max tokens per rank %lld outside [1, %d] (the call tag holds the region stride "
                "in full)", (long long)max_tokens, kMaxTokensPerRank);
    PETIT_CHECK(timeout_s_valid(timeout_s),
                "timeout_s %g outside (0, %g] seconds (the bound of every spin-wait)", timeout_s,
                kMaxTimeoutS);
    c10::cuda::CUDAGuard guard(device_);
    args_.layout = make_heap_layout(int(world_size), int(max_tokens), int(hidden),
                                    int(max_top_k));
    args_.rank = int(rank);
    args_.world_size = int(world_size);
    args_.num_experts = int(num_experts);
    args_.num_local_experts = int(num_experts / world_size);
    int num_sms = 0;
    PETIT_CHECK_OK(petitDeviceGetAttribute(&num_sms, petitDevAttrMultiProcessorCount, device_),
                   "SM count query");
    PETIT_CHECK(num_blocks >= 1 && num_blocks <= num_sms,
                "num_sms %lld must be in [1, %d] (the persistent grid must be co-resident)",
                (long long)num_blocks, num_sms);
    args_.num_blocks = int(num_blocks);
    args_.timeout_ticks = uint64_t(timeout_s * petit_timer_ticks_per_second());

    char err[512] = {0};
    SymmetricHeap* heap = nullptr;
    petitError_t e = SymmetricHeap::create(device_, args_.layout.total_bytes, &heap, err,
                                           sizeof(err));
    PETIT_CHECK(e == petitSuccess, "%s", err);
    heap_ = std::shared_ptr<SymmetricHeap>(heap, release_heap);

    auto opts = torch::TensorOptions().device(torch::kCUDA, device_);
    const int64_t groups = args_.layout.max_groups;
    state_ = torch::zeros({int64_t(sizeof(EpState) / 8)}, opts.dtype(torch::kInt64));
    token_rank_mask_ = torch::zeros({max_tokens}, opts.dtype(torch::kInt32));
    group_done_ = torch::zeros({world_size * groups}, opts.dtype(torch::kInt32));
    recv_group_counts_ = torch::zeros({world_size, groups}, opts.dtype(torch::kInt32));
    PETIT_CHECK_OK(petitHostAlloc((void**)&diag_host_, sizeof(EpDiagnostics)),
                   "pinned diagnostics allocation");
    memset(diag_host_, 0, sizeof(EpDiagnostics));
    PETIT_CHECK_OK(petitHostGetDevicePointer((void**)&args_.diagnostics, diag_host_),
                   "diagnostics device pointer");
    args_.state = reinterpret_cast<EpState*>(state_.data_ptr());
    args_.token_rank_mask = reinterpret_cast<uint32_t*>(token_rank_mask_.data_ptr());
    args_.group_done = reinterpret_cast<uint32_t*>(group_done_.data_ptr());
    args_.recv_group_counts = recv_group_counts_.data_ptr<int32_t>();
  }

  ~EpContext() {  // EpBuffer closes first; otherwise the same wait, without the GIL too
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      close();
    } else {
      close();
    }
  }

  // Unmaps and frees a heap once nothing holds it: the context (until close) and every view
  // of it (dispatch's outputs, heap_view), so a DispatchOutput tensor kept past close() reads
  // stale rows, never unmapped memory. Waits for the device first (a queued kernel may still
  // read a view), without the GIL where this thread holds it (a view's last owner can be
  // Python code).
  static void release_heap(SymmetricHeap* heap) {
    auto free_it = [heap] {
      if (heap->device() >= 0) {
        c10::cuda::CUDAGuard guard(heap->device());
        petitDeviceSynchronize();
      }
      delete heap;
    };
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      free_it();
    } else {
      free_it();
    }
  }

  // The heartbeat page (docs/faults.md): POSIX shared memory `name` of one word per rank,
  // created (zeroed) by the first caller (`create`) and opened by the others, mapped here and
  // registered with the GPU; a thread of this process increments this rank's word every
  // `period_s`. Waits then go on past the bound while the peer's word moves, up to max_wait_s.
  void attach_heartbeat(const std::string& name, bool create, double period_s,
                        double max_wait_s) {
    PETIT_CHECK(heartbeat_host_ == nullptr, "the heartbeat is attached already");
    PETIT_CHECK(period_s > 0.0 && period_s * 2.0 < double(args_.timeout_ticks) /
                                                       petit_timer_ticks_per_second(),
                "heartbeat period %g s must be below half the wait bound", period_s);
    PETIT_CHECK(max_wait_s * petit_timer_ticks_per_second() >= double(args_.timeout_ticks) &&
                    max_wait_s <= kMaxWaitS,
                "max_wait_s %g outside [timeout_s, %g]", max_wait_s, kMaxWaitS);
    const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
    PETIT_CHECK(fd >= 0, "heartbeat page %s: shm_open failed (errno %d)", name.c_str(), errno);
    const size_t bytes = size_t(sysconf(_SC_PAGESIZE));
    PETIT_CHECK(size_t(args_.world_size) * sizeof(uint64_t) <= bytes, "heartbeat page too small");
    const bool sized = !create || ftruncate(fd, off_t(bytes)) == 0;  // zero-filled
    void* host = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                       : MAP_FAILED;
    ::close(fd);
    PETIT_CHECK(host != MAP_FAILED, "heartbeat page %s: mapping failed (errno %d)", name.c_str(),
                errno);
    c10::cuda::CUDAGuard guard(device_);
    void* device = nullptr;
    petitError_t e = petitHostRegisterMapped(host, bytes);
    if (e == petitSuccess) e = petitHostGetDevicePointer(&device, host);
    if (e != petitSuccess) {
      petitGetLastError();
      munmap(host, bytes);
      PETIT_CHECK(false, "heartbeat page: registering it with the GPU failed (%d)", int(e));
    }
    heartbeat_host_ = static_cast<uint64_t*>(host);
    heartbeat_bytes_ = bytes;
    args_.heartbeats = static_cast<const volatile uint64_t*>(device);
    args_.max_wait_ticks = uint64_t(max_wait_s * petit_timer_ticks_per_second());
    heartbeat_.start(heartbeat_host_ + args_.rank, period_s);
  }

  // This rank leaves the protocol (a collective call raised before its launch): its
  // heartbeat word is marked aborted, so peers waiting for it fail at their next look
  // (kEpErrorPeerAborted) instead of waiting max_wait_s for a live process.
  void abort() { heartbeat_.abort(); }

  static void unlink_heartbeat(const std::string& name) { shm_unlink(name.c_str()); }

  int64_t export_fd() {
    int fd = -1;
    char err[512] = {0};
    PETIT_CHECK(heap_ != nullptr, "context is closed");
    PETIT_CHECK(heap_->export_fd(&fd, err, sizeof(err)) == petitSuccess, "%s", err);
    return fd;
  }

  // fds[r] for r != rank: descriptors received from the peers. Takes them: every one is
  // closed on every path (SymmetricHeap::map_all, or here when it is not reached), so a
  // failed setup keeps no peer's allocation alive.
  void map_peers(const std::vector<int64_t>& fds) {
    std::vector<int> int_fds(fds.begin(), fds.end());
    if (heap_ == nullptr || int64_t(fds.size()) != args_.world_size) {
      for (size_t r = 0; r < int_fds.size(); ++r)
        if (int64_t(r) != args_.rank && int_fds[r] >= 0) ::close(int_fds[r]);
      PETIT_CHECK(heap_ != nullptr, "context is closed");
      PETIT_CHECK(false, "expected %d descriptors, got %zu", args_.world_size, fds.size());
    }
    c10::cuda::CUDAGuard guard(device_);
    char err[512] = {0};
    petitError_t e = heap_->map_all(int_fds.data(), args_.world_size, args_.rank, err,
                                    sizeof(err));
    PETIT_CHECK(e == petitSuccess, "%s", err);
    args_.heap_base = heap_->base();
    args_.heap_stride = heap_->stride();
    // Flags start at epoch 0; the caller runs a barrier before any peer writes them.
    char* own = args_.heap_base + int64_t(args_.rank) * args_.heap_stride;
    PETIT_CHECK_OK(petitMemset(own + args_.layout.flags_begin, 0,
                               size_t(args_.layout.flags_end - args_.layout.flags_begin)),
                   "flag initialization");
    PETIT_CHECK_OK(petitDeviceSynchronize(), "flag initialization");
  }

  // uint8 view of `num_bytes` at `offset` of rank `rank`'s heap, through the linear range.
  torch::Tensor heap_view(int64_t rank, int64_t offset, int64_t num_bytes) {
    std::lock_guard<std::mutex> launching(launch_mutex_);  // against close() (no GIL)
    check_mapped();
    PETIT_CHECK(rank >= 0 && rank < args_.world_size, "rank %lld out of range", (long long)rank);
    PETIT_CHECK(offset >= 0 && num_bytes >= 0 && offset + num_bytes <= heap_->stride(),
                "heap view out of range");
    return view(args_.heap_base + rank * args_.heap_stride + offset, {num_bytes},
                torch::kUInt8);
  }

  // Returns (recv_x, recv_ids, recv_weights, recv_scales): recv_x [W*R, H] bf16 (quant 0) or
  // float8_e4m3fn (quant 1, 2, 3: api.h DispatchQuant); recv_scales [W*R, H/128] (1, 3) or
  // [W*R, 1] (2) float32, empty for bf16.
  std::vector<torch::Tensor> dispatch(const torch::Tensor& x, const torch::Tensor& topk_ids,
                                      const torch::Tensor& topk_weights, int64_t region_stride,
                                      int64_t quant) {
    std::lock_guard<std::mutex> launching(launch_mutex_);  // against close() (no GIL)
    check_mapped();
    check_cuda_tensor(x, "x", 2);
    check_cuda_tensor(topk_ids, "topk_ids", 2);
    check_cuda_tensor(topk_weights, "topk_weights", 2);
    const int64_t T = x.size(0), K = topk_ids.size(1);
    PETIT_CHECK(x.scalar_type() == torch::kBFloat16, "x must be bfloat16");
    PETIT_CHECK(x.size(1) == args_.layout.hidden, "x hidden size %lld != buffer hidden size %d",
                (long long)x.size(1), args_.layout.hidden);
    PETIT_CHECK(topk_ids.scalar_type() == torch::kInt32 || topk_ids.scalar_type() == torch::kInt64,
                "topk_ids must be int32 or int64");
    PETIT_CHECK(topk_weights.scalar_type() == torch::kFloat32, "topk_weights must be float32");
    PETIT_CHECK(topk_ids.size(0) == T && topk_weights.size(0) == T && topk_weights.size(1) == K,
                "x, topk_ids and topk_weights disagree on the token count / top-k");
    PETIT_CHECK(K >= 1 && K <= args_.layout.max_top_k, "top-k %lld outside [1, %d]", (long long)K,
                args_.layout.max_top_k);
    PETIT_CHECK(T <= region_stride && region_stride <= args_.layout.max_tokens,
                "need tokens (%lld) <= region stride (%lld) <= max tokens per rank (%d)",
                (long long)T, (long long)region_stride, args_.layout.max_tokens);
    const bool block_quant = is_block_quant(int(quant));
    PETIT_CHECK(quant >= kQuantNone && quant <= kQuantFp8BlockUe8m0,
                "quant %lld is not a DispatchQuant", (long long)quant);
    PETIT_CHECK(!block_quant || args_.layout.hidden % kFp8ScaleBlock == 0,
                "fp8 1x128 block dispatch needs a hidden size that is a multiple of %d, got %d",
                kFp8ScaleBlock, args_.layout.hidden);
    PETIT_CHECK(x.get_device() == device_ && topk_ids.get_device() == device_ &&
                    topk_weights.get_device() == device_,
                "inputs must be on the buffer's device %d", device_);
    c10::cuda::CUDAGuard guard(device_);
    DispatchArgs a{};
    a.ctx = args_;
    a.x = reinterpret_cast<const petit_bf16_bits*>(x.data_ptr());
    a.topk_ids = topk_ids.data_ptr();
    a.ids_are_int64 = topk_ids.scalar_type() == torch::kInt64;
    a.topk_weights = topk_weights.data_ptr<float>();
    a.num_tokens = int(T);
    a.top_k = int(K);
    a.region_stride = int(region_stride);
    a.quant = int(quant);
    PETIT_CHECK_OK(launch_dispatch(a, c10::cuda::getCurrentCUDAStream()), "dispatch launch");
    char* own = args_.heap_base + int64_t(args_.rank) * args_.heap_stride;
    const int64_t rows = int64_t(args_.world_size) * region_stride;
    const int64_t H = args_.layout.hidden;
    const bool fp8 = quant != kQuantNone;
    const int64_t num_scales = block_quant ? H / kFp8ScaleBlock : 1;
    return {view(own + args_.layout.dispatch_rows, {rows, H},
                 fp8 ? at::ScalarType::Float8_e4m3fn : torch::kBFloat16),
            view(own + args_.layout.dispatch_ids, {rows, K}, torch::kInt32),
            view(own + args_.layout.dispatch_weights, {rows, K}, torch::kFloat32),
            view(own + args_.layout.dispatch_scales, {fp8 ? rows : 0, num_scales},
                 torch::kFloat32)};
  }

  // trace: optional int64 [num_blocks, kCombineTraceSlots] on this device; each launched
  // block writes its row (CombineTraceSlot), the others are left as they are.
  void combine(const torch::Tensor& expert_out, torch::Tensor& out, int64_t top_k,
               int64_t region_stride, c10::optional<torch::Tensor> trace) {
    std::lock_guard<std::mutex> launching(launch_mutex_);  // against close() (no GIL)
    check_mapped();
    check_cuda_tensor(expert_out, "expert_out", 2);
    check_cuda_tensor(out, "out", 2);
    const int64_t rows = int64_t(args_.world_size) * region_stride;
    PETIT_CHECK(expert_out.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
                "expert_out and out must be bfloat16");
    PETIT_CHECK(expert_out.size(0) == rows && expert_out.size(1) == args_.layout.hidden,
                "expert_out must be [world*region_stride, hidden] = [%lld, %d], got [%lld, %lld]",
                (long long)rows, args_.layout.hidden, (long long)expert_out.size(0),
                (long long)expert_out.size(1));
    PETIT_CHECK(out.size(1) == args_.layout.hidden && out.size(0) <= region_stride,
                "out must be [tokens <= region_stride, hidden]");
    PETIT_CHECK(region_stride <= args_.layout.max_tokens, "region stride %lld > max tokens %d",
                (long long)region_stride, args_.layout.max_tokens);
    c10::cuda::CUDAGuard guard(device_);
    CombineArgs a{};
    a.ctx = args_;
    a.expert_out = reinterpret_cast<const petit_bf16_bits*>(expert_out.data_ptr());
    a.out = reinterpret_cast<petit_bf16_bits*>(out.data_ptr());
    a.num_tokens = int(out.size(0));
    a.top_k = int(top_k);
    a.region_stride = int(region_stride);
    a.config = combine_config_;
    if (trace.has_value()) {
      check_cuda_tensor(*trace, "trace", 2);
      PETIT_CHECK(trace->scalar_type() == torch::kInt64 &&
                      trace->size(0) == args_.num_blocks &&
                      trace->size(1) == kCombineTraceSlots &&
                      trace->get_device() == device_,
                  "trace must be int64 [num_blocks, %d] = [%d, %d] on this buffer's device",
                  int(kCombineTraceSlots), args_.num_blocks, int(kCombineTraceSlots));
      a.trace = trace->data_ptr<int64_t>();
    }
    PETIT_CHECK_OK(launch_combine(a, c10::cuda::getCurrentCUDAStream()), "combine launch");
  }

  // The fused layer on this rank (api.h MegaMoeEpArgs): out [T, H] <- the MoE of x over the
  // group's experts, dispatch and combine inside one launch. Shapes as megamoe_forward's, with
  // global int32 ids; act / partial / sync: the workspaces of W * R * K entries.
  void megamoe(const torch::Tensor& x, const torch::Tensor& topk_ids,
               const torch::Tensor& topk_weights, const torch::Tensor& w13,
               const torch::Tensor& w2, torch::Tensor& out, torch::Tensor& act,
               torch::Tensor& partial, torch::Tensor& sync, int64_t region_stride,
               c10::optional<torch::Tensor> trace, c10::optional<torch::Tensor> w13_scale,
               c10::optional<torch::Tensor> w2_scale) {
    std::lock_guard<std::mutex> launching(launch_mutex_);  // against close() (no GIL)
    check_mapped();
    for (const auto& [t, name] : {std::pair<const torch::Tensor*, const char*>{&x, "x"},
                                  {&topk_ids, "topk_ids"}, {&topk_weights, "topk_weights"},
                                  {&w13, "w13"}, {&w2, "w2"}, {&out, "out"}, {&act, "act"},
                                  {&partial, "partial"}, {&sync, "sync"}}) {
      PETIT_CHECK(t->is_cuda() && t->is_contiguous() && t->get_device() == device_,
                  "%s must be a contiguous tensor on the buffer's device %d", name, device_);
    }
    const int64_t T = x.size(0), K = topk_ids.size(1), L = w13.size(0), I = w13.size(1) / 2;
    const int64_t H = args_.layout.hidden, entries = args_.world_size * region_stride * K;
    PETIT_CHECK(x.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
                    act.scalar_type() == torch::kBFloat16 &&
                    topk_ids.scalar_type() == torch::kInt32 &&
                    topk_weights.scalar_type() == torch::kFloat32 &&
                    partial.scalar_type() == torch::kFloat32 && sync.scalar_type() == torch::kInt32,
                "dtypes: bf16 x, out, act; int32 topk_ids, sync; f32 weights, partial");
    PETIT_CHECK(x.dim() == 2 && x.size(1) == H && topk_ids.size(0) == T &&
                    topk_weights.size(0) == T && topk_weights.size(1) == K &&
                    w13.dim() == 3 && w13.size(2) == H && w2.dim() == 3 && w2.size(0) == L &&
                    w2.size(1) == H && w2.size(2) == I && out.numel() == T * H &&
                    act.numel() >= entries * I && partial.numel() >= entries * H &&
                    sync.numel() >= megamoe_sync_ints(int(L), int(H)),
                "shapes: x [T, H=%lld], topk [T, K], w13 [L, 2I, H], w2 [L, H, I], out [T, H], "
                "act >= W*R*K*I, partial >= W*R*K*H, sync >= megamoe_sync_ints(L, H)",
                (long long)H);
    c10::cuda::CUDAGuard guard(device_);
    MegaMoeEpArgs e{};
    e.ctx = args_;
    e.region_stride = int(region_stride);
    e.layer = megamoe_args(x, topk_ids, topk_weights, w13, w2, act, partial, sync, out);
    MegaMoeArgs& a = e.layer;
    set_weight_format(a, w13, w2, w13_scale, w2_scale);
    a.num_sms = args_.num_blocks;
    a.timeout_ticks = args_.timeout_ticks;
    if (trace.has_value()) {  // one row of stamps per block of the grid (2 per SM)
      check_cuda_tensor(*trace, "trace", 2);
      PETIT_CHECK(trace->scalar_type() == torch::kInt64 &&
                      trace->size(0) == int64_t(kMegaMoeBlocksPerSm) * args_.num_blocks &&
                      trace->size(1) == kMegaMoeTraceSlots && trace->get_device() == device_,
                  "trace must be int64 [%d x num_sms, %d] = [%d, %d] on this buffer's device",
                  kMegaMoeBlocksPerSm, kMegaMoeTraceSlots,
                  kMegaMoeBlocksPerSm * args_.num_blocks, kMegaMoeTraceSlots);
      a.trace = trace->data_ptr<int64_t>();
    }
    PETIT_CHECK(megamoe_ep_check(e) == petitSuccess,
                "fused EP layer: arguments outside its limits (T <= region stride <= max tokens, "
                "W*R*K <= %d entries, H and I multiples of %d, L = the buffer's local experts)",
                kMegaMoeMaxEntries, kMegaMoeSizeMultiple);
    const petitError_t launched = launch_megamoe_ep(e, c10::cuda::getCurrentCUDAStream());
    PETIT_CHECK(launched != petitErrorCooperativeLaunchTooLarge,
                "fused EP layer: its grid of %d x num_sms = %d blocks cannot all be resident on "
                "this GPU at once (occupancy x SMs, or num_sms above the SM count), and its "
                "ranks spin on each other: build the EpBuffer with fewer num_sms",
                kMegaMoeBlocksPerSm, kMegaMoeBlocksPerSm * args_.num_blocks);
    PETIT_CHECK_OK(launched, "fused EP launch");
  }

  // Benchmark ceiling: push `bytes_per_peer` of `src` into every peer's combine region.
  void peer_write(const torch::Tensor& src, int64_t bytes_per_peer, int64_t num_blocks) {
    std::lock_guard<std::mutex> launching(launch_mutex_);  // against close() (no GIL)
    check_mapped();
    PETIT_CHECK(src.is_cuda() && src.is_contiguous() && src.nbytes() >= size_t(bytes_per_peer),
                "peer_write source too small");
    const int64_t region = args_.layout.flags_begin - args_.layout.combine_rows;
    PETIT_CHECK(bytes_per_peer <= region && bytes_per_peer % 16 == 0,
                "bytes_per_peer must be a multiple of 16 and <= %lld", (long long)region);
    c10::cuda::CUDAGuard guard(device_);
    PeerWriteArgs a{};
    a.heap_base = args_.heap_base;
    a.heap_stride = args_.heap_stride;
    a.rank = args_.rank;
    a.world_size = args_.world_size;
    a.src = src.data_ptr();
    a.heap_offset = args_.layout.combine_rows;
    a.bytes_per_peer = bytes_per_peer;
    a.num_blocks = int(num_blocks);
    PETIT_CHECK_OK(launch_peer_write(a, c10::cuda::getCurrentCUDAStream()), "peer write launch");
  }

  torch::Tensor recv_group_counts() const { return recv_group_counts_; }
  torch::Tensor epoch() const { return state_.narrow(0, 0, 1); }

  py::dict diagnostics() const {
    py::dict d;
    std::lock_guard<std::mutex> lock(diag_mutex_);  // close() may free the record meanwhile
    if (diag_host_ == nullptr) return d;
    volatile EpDiagnostics* diag = diag_host_;
    const int error = int(diag->error);
    d["error"] = error == kEpErrorTimeout        ? "timeout"
                 : error == kEpErrorMismatch     ? "mismatch"
                 : error == kEpErrorPeerAborted  ? "peer_aborted"
                 : error == kEpErrorOrder        ? "order"
                                                 : "";
    d["timed_out"] = int(error == kEpErrorTimeout);
    d["rank"] = int(diag->rank);
    d["peer"] = int(diag->peer);
    d["phase"] = diag->phase == 0 ? "dispatch" : "combine";
    d["group"] = int(diag->group);
    d["expected_epoch"] = uint64_t(diag->expected_epoch);
    d["observed_epoch"] = flag_epoch(diag->observed_flag);
    d["expected_tag"] = uint32_t(diag->expected_tag);
    d["peer_alive"] = int(diag->peer_alive);
    d["observed_tag"] = flag_tag(diag->observed_flag);
    d["dropped_ids"] = int(diag->dropped_ids);
    return d;
  }

  int64_t heap_bytes() const { return args_.layout.total_bytes; }
  int64_t heap_stride() const { return heap_ ? heap_->stride() : 0; }
  int64_t num_blocks() const { return args_.num_blocks; }

  // Bound without the GIL (py::call_guard in the module): the device wait may last until a
  // kernel's bounded waits end, and no Python thread (the fault watch included) may be frozen
  // meanwhile. Touches no Python object. Order: the device first, with the heartbeat still
  // beating (a kernel of ours still running must not look dead to its peers), then the mark
  // "left the protocol" and the end of the beat, then the memory (the heap once its views are
  // gone too: release_heap).
  void close() {
    {  // no launch from here on (check_mapped); one already in progress is enqueued first
      std::lock_guard<std::mutex> lock(launch_mutex_);
      args_.heap_base = nullptr;
    }
    if (heap_ || diag_host_ != nullptr || heartbeat_host_ != nullptr) {
      c10::cuda::CUDAGuard guard(device_);
      petitDeviceSynchronize();  // no kernel of ours may still touch the range or the words
    }
    heartbeat_.abort();
    heartbeat_.stop();
    heap_.reset();
    {
      std::lock_guard<std::mutex> lock(diag_mutex_);
      if (diag_host_ != nullptr) petitFreeHost(diag_host_);
      diag_host_ = nullptr;
    }
    if (heartbeat_host_ != nullptr) {  // after the synchronize above: no kernel reads it
      petitHostUnregister(heartbeat_host_);
      munmap(heartbeat_host_, heartbeat_bytes_);
      heartbeat_host_ = nullptr;
    }
    args_.heartbeats = nullptr;
  }

 private:
  void check_mapped() const {
    PETIT_CHECK(heap_ && args_.heap_base != nullptr,
                "the symmetric heap is not mapped (closed, or map_peers not run)");
  }
  torch::Tensor view(char* ptr, std::vector<int64_t> sizes, torch::ScalarType dtype) const {
    // The heap is VMM memory whose pages may live on a peer GPU: name the device the
    // mapping is accessed from instead of letting torch query the pointer's home device.
    // The view owns a share of the heap (release_heap): valid after close() too.
    const torch::Device device(torch::kCUDA, device_);
    std::shared_ptr<SymmetricHeap> owner = heap_;
    return at::for_blob(ptr, sizes)
        .options(torch::TensorOptions().dtype(dtype).device(device))
        .target_device(device)
        .deleter([owner](void*) mutable { owner.reset(); })
        .make_tensor();
  }

  int device_;
  CombineConfig combine_config_;
  EpContextArgs args_{};
  std::shared_ptr<SymmetricHeap> heap_;  // shared with the views (release_heap)
  torch::Tensor state_, token_rank_mask_, group_done_, recv_group_counts_;
  EpDiagnostics* diag_host_ = nullptr;
  mutable std::mutex diag_mutex_;       // diagnostics() against close()'s free
  std::mutex launch_mutex_;             // a launch (or view) against close(), which runs
                                        // without the GIL
  uint64_t* heartbeat_host_ = nullptr;  // the mapped heartbeat page (attach_heartbeat)
  size_t heartbeat_bytes_ = 0;
  HeartbeatThread heartbeat_;           // beats this rank's word (comm/heartbeat.h)
};

// SM count of a device, queried once per device (no device sync; safe under graph capture).
int num_sms_of(int device) {
  static std::mutex mutex;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= int(cache.size())) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    PETIT_CHECK_OK(petitDeviceGetAttribute(&cache[device], petitDevAttrMultiProcessorCount, device),
                   "SM count query");
  }
  return cache[device];
}

// vLLM's EP expert_map (global -> local expert id, -1 for other ranks' experts), optional:
// with it the routing ids are global ids and the kernels map them (expert_ids.h). Returns the
// map's pointer (nullptr without one) and sets *num_global to its length.
const int32_t* expert_map_arg(const c10::optional<torch::Tensor>& expert_map,
                              const torch::Device& device, int* num_global) {
  *num_global = 0;
  if (!expert_map.has_value()) return nullptr;
  const torch::Tensor& m = *expert_map;
  check_cuda_tensor(m, "expert_map", 1);
  PETIT_CHECK(m.scalar_type() == torch::kInt32 && m.device() == device && m.numel() >= 1 &&
                  m.numel() < (int64_t(1) << 31),
              "expert_map must be a non-empty int32 [E] tensor on the routing ids' device");
  *num_global = int(m.numel());
  return m.data_ptr<int32_t>();
}

std::vector<torch::Tensor> expert_row_lists(const torch::Tensor& topk_ids,
                                            int64_t num_local_experts,
                                            c10::optional<torch::Tensor> expert_map) {
  check_cuda_tensor(topk_ids, "topk_ids", 2);
  PETIT_CHECK(topk_ids.scalar_type() == torch::kInt32, "topk_ids must be int32");
  PETIT_CHECK(num_local_experts >= 1 && num_local_experts <= kMaxExperts,
              "num_local_experts %lld outside [1, %d]", (long long)num_local_experts, kMaxExperts);
  PETIT_CHECK(topk_ids.numel() < (int64_t(1) << 31), "too many routing entries");
  c10::cuda::CUDAGuard guard(topk_ids.device());
  auto opts = topk_ids.options();
  const int num_entries = int(topk_ids.numel());
  auto counts = torch::empty({num_local_experts}, opts);
  auto offsets = torch::empty({num_local_experts + 1}, opts);
  auto sorted = torch::empty({num_entries}, opts);
  auto workspace = torch::empty({row_list_workspace_ints(num_entries, int(num_local_experts))}, opts);
  RowListArgs a{};
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.expert_map = expert_map_arg(expert_map, topk_ids.device(), &a.num_global_experts);
  a.num_entries = num_entries;
  a.num_local_experts = int(num_local_experts);
  a.workspace = workspace.data_ptr<int32_t>();
  a.expert_counts = counts.data_ptr<int32_t>();
  a.expert_offsets = offsets.data_ptr<int32_t>();
  a.sorted_entries = sorted.data_ptr<int32_t>();
  PETIT_CHECK_OK(launch_expert_row_lists(a, c10::cuda::getCurrentCUDAStream()),
                 "row-list launch");
  return {counts, offsets, sorted};
}

void check_aligned16(const torch::Tensor& t, const char* name) {
  PETIT_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "%s must be 16-byte aligned (vector loads/stores)", name);
}

// Local experts with the local weighted reduction (docs/architecture.md, "Expert kernels"):
// row lists + gate/up GEMM + down GEMM + reduction, all on the current stream, no host sync.
torch::Tensor experts_forward(const torch::Tensor& recv_x, const torch::Tensor& topk_ids,
                              const torch::Tensor& topk_weights, const torch::Tensor& w13,
                              const torch::Tensor& w2, c10::optional<torch::Tensor> out,
                              c10::optional<torch::Tensor> act_workspace,
                              c10::optional<torch::Tensor> partial_workspace, int64_t tiles,
                              c10::optional<torch::Tensor> expert_map, const py::dict& config) {
  check_cuda_tensor(recv_x, "recv_x", 2);
  check_cuda_tensor(topk_ids, "recv_topk_ids", 2);
  check_cuda_tensor(topk_weights, "recv_topk_weights", 2);
  check_cuda_tensor(w13, "w13", 3);
  check_cuda_tensor(w2, "w2", 3);
  PETIT_CHECK(recv_x.scalar_type() == torch::kBFloat16, "recv_x must be bfloat16");
  PETIT_CHECK(w13.scalar_type() == torch::kBFloat16 && w2.scalar_type() == torch::kBFloat16,
              "w13 and w2 must be bfloat16 (quantized expert weights are not supported)");
  PETIT_CHECK(topk_ids.scalar_type() == torch::kInt32, "recv_topk_ids must be int32");
  PETIT_CHECK(topk_weights.scalar_type() == torch::kFloat32, "recv_topk_weights must be float32");
  const int64_t N = recv_x.size(0), H = recv_x.size(1), K = topk_ids.size(1);
  const int64_t L = w13.size(0), I = w13.size(1) / 2;
  PETIT_CHECK(H > 0 && H % 8 == 0, "hidden size %lld must be a positive multiple of 8",
              (long long)H);
  PETIT_CHECK(topk_ids.size(0) == N && topk_weights.size(0) == N && topk_weights.size(1) == K,
              "recv_topk_ids [%lld, %lld] and recv_topk_weights [%lld, %lld] must be [N=%lld, K]",
              (long long)topk_ids.size(0), (long long)K, (long long)topk_weights.size(0),
              (long long)topk_weights.size(1), (long long)N);
  PETIT_CHECK(K >= 1 && K <= kMaxTopK, "top-k %lld outside [1, %d]", (long long)K, kMaxTopK);
  PETIT_CHECK(L >= 1 && L <= kMaxExperts, "%lld local experts outside [1, %d]", (long long)L,
              kMaxExperts);
  PETIT_CHECK(w13.size(1) % 2 == 0 && I > 0 && I % 8 == 0 && w13.size(2) == H,
              "w13 must be [L, 2I, H=%lld] with I a positive multiple of 8, got [%lld, %lld, %lld]",
              (long long)H, (long long)w13.size(0), (long long)w13.size(1),
              (long long)w13.size(2));
  PETIT_CHECK(w2.size(0) == L && w2.size(1) == H && w2.size(2) == I,
              "w2 must be [L=%lld, H=%lld, I=%lld], got [%lld, %lld, %lld]", (long long)L,
              (long long)H, (long long)I, (long long)w2.size(0), (long long)w2.size(1),
              (long long)w2.size(2));
  PETIT_CHECK(N * K < (int64_t(1) << 31), "N*K = %lld routing entries exceed 2^31 - 1",
              (long long)(N * K));
  PETIT_CHECK(tiles >= kExpertTilesAuto && tiles <= kExpertTilesLast,
              "tiles %lld must be 0 (auto), 1 (simt), 2 (wgmma_narrow), 3 (wgmma_m64), "
              "4 (wgmma) or 5 (wgmma_mc)",
              (long long)tiles);
  const ExpertConfig expert_config = expert_config_from(config);
  const auto device = recv_x.device();
  PETIT_CHECK(topk_ids.device() == device && topk_weights.device() == device &&
                  w13.device() == device && w2.device() == device,
              "recv_x, routing and weights must be on one device");
  check_aligned16(recv_x, "recv_x");
  check_aligned16(w13, "w13");
  check_aligned16(w2, "w2");
  c10::cuda::CUDAGuard guard(device);
  auto opts = recv_x.options();

  torch::Tensor result;
  if (out.has_value()) {
    result = *out;
    check_cuda_tensor(result, "out", 2);
    PETIT_CHECK(result.scalar_type() == torch::kBFloat16 && result.size(0) == N &&
                    result.size(1) == H && result.device() == device,
                "out must be a bfloat16 [N=%lld, H=%lld] tensor on recv_x's device",
                (long long)N, (long long)H);
  } else {
    result = torch::empty({N, H}, opts);
  }
  if (N == 0) return result;
  check_aligned16(result, "out");

  const int64_t act_elems = expert_act_workspace_elems(int(N), int(K), int(I));
  const int64_t partial_elems = expert_partial_workspace_elems(int(N), int(K), int(H));
  torch::Tensor act, partial;
  if (act_workspace.has_value()) {
    act = *act_workspace;
    PETIT_CHECK(act.is_cuda() && act.is_contiguous() && act.device() == device &&
                    act.scalar_type() == torch::kBFloat16 && act.numel() >= act_elems,
                "act_workspace must be a contiguous bfloat16 tensor of >= N*K*I = %lld elements "
                "on recv_x's device",
                (long long)act_elems);
  } else {
    act = torch::empty({act_elems}, opts);
  }
  if (partial_workspace.has_value()) {
    partial = *partial_workspace;
    PETIT_CHECK(partial.is_cuda() && partial.is_contiguous() && partial.device() == device &&
                    partial.scalar_type() == torch::kBFloat16 && partial.numel() >= partial_elems,
                "partial_workspace must be a contiguous bfloat16 tensor of >= N*K*H = %lld "
                "elements on recv_x's device",
                (long long)partial_elems);
  } else {
    partial = torch::empty({partial_elems}, opts);
  }
  check_aligned16(act, "act_workspace");
  check_aligned16(partial, "partial_workspace");

  auto int_opts = opts.dtype(torch::kInt32);
  const int num_entries = int(N * K);
  auto offsets = torch::empty({L + 1}, int_opts);
  auto counts = torch::empty({L}, int_opts);
  auto sorted = torch::empty({num_entries}, int_opts);
  auto row_list_ws = torch::empty({row_list_workspace_ints(num_entries, int(L))}, int_opts);
  const petitStream_t stream = c10::cuda::getCurrentCUDAStream();

  int num_global = 0;
  const int32_t* map = expert_map_arg(expert_map, device, &num_global);
  RowListArgs rl{};
  rl.topk_ids = topk_ids.data_ptr<int32_t>();
  rl.expert_map = map;
  rl.num_global_experts = num_global;
  rl.num_entries = num_entries;
  rl.num_local_experts = int(L);
  rl.workspace = row_list_ws.data_ptr<int32_t>();
  rl.expert_counts = counts.data_ptr<int32_t>();
  rl.expert_offsets = offsets.data_ptr<int32_t>();
  rl.sorted_entries = sorted.data_ptr<int32_t>();

  ExpertGemmArgs a{};
  a.x = reinterpret_cast<const petit_bf16_bits*>(recv_x.data_ptr());
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.expert_map = map;
  a.num_global_experts = num_global;
  a.topk_weights = topk_weights.data_ptr<float>();
  a.w13 = reinterpret_cast<const petit_bf16_bits*>(w13.data_ptr());
  a.w2 = reinterpret_cast<const petit_bf16_bits*>(w2.data_ptr());
  a.expert_offsets = offsets.data_ptr<int32_t>();
  a.sorted_entries = sorted.data_ptr<int32_t>();
  a.act = reinterpret_cast<petit_bf16_bits*>(act.data_ptr());
  a.partial = reinterpret_cast<petit_bf16_bits*>(partial.data_ptr());
  a.out = reinterpret_cast<petit_bf16_bits*>(result.data_ptr());
  a.num_rows = int(N);
  a.top_k = int(K);
  a.hidden = int(H);
  a.intermediate = int(I);
  a.num_local_experts = int(L);
  a.tiles = int(tiles);
  a.num_sms = num_sms_of(device.index());
  a.config = expert_config;
  // fused GEMMs (expert_fused_gemms): per-expert arrival counters and the tile claim counter,
  // zeroed by the row lists
  torch::Tensor gate_up_done;
  if (expert_fused_gemms(a)) {
    gate_up_done = torch::empty({L + 1}, int_opts);
    a.gate_up_done = rl.expert_done = gate_up_done.data_ptr<int32_t>();
  }
  PETIT_CHECK_OK(launch_expert_row_lists(rl, stream), "row-list launch");
  PETIT_CHECK_OK(launch_experts(a, stream), "expert GEMM launch");
  return result;
}

// The tile family experts_forward runs for these sizes (tiles = 0: the automatic choice).
int64_t resolve_expert_tiles_for(int64_t num_rows, int64_t top_k, int64_t num_local_experts,
                                 int64_t hidden, int64_t tiles, const py::dict& config) {
  ExpertGemmArgs a{};
  a.config = expert_config_from(config);
  a.num_rows = int(num_rows);
  a.top_k = int(top_k);
  a.num_local_experts = int(num_local_experts);
  a.hidden = int(hidden);
  a.tiles = int(tiles);
  return resolve_expert_tiles(a);
}

// The dispatch kernels' float -> e4m3 conversion (fp8.h), run on the host: lets CPU tests
// check it bit for bit against torch's float8_e4m3fn.
torch::Tensor float_to_e4m3(const torch::Tensor& values) {
  PETIT_CHECK(values.device().is_cpu() && values.scalar_type() == torch::kFloat32,
              "float_to_e4m3 takes a CPU float32 tensor");
  torch::Tensor in = values.contiguous();
  torch::Tensor out = torch::empty(in.sizes(), in.options().dtype(torch::kUInt8));
  const float* src = in.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < in.numel(); ++i) dst[i] = petit_float_to_e4m3(src[i]);
  return out;
}

// What a combine of `num_tokens` own tokens (rows per source region `region_stride`) launches
// on `num_blocks` SMs: host-side planning only (plan_combine), for diagnostics and CPU tests.
py::dict combine_plan(int64_t world_size, int64_t hidden, int64_t num_tokens,
                      int64_t region_stride, int64_t num_blocks, const py::dict& combine_config) {
  PETIT_CHECK(world_size >= 2 && world_size <= kMaxWorldSize, "world size %lld outside [2, %d]",
              (long long)world_size, kMaxWorldSize);
  PETIT_CHECK(hidden > 0 && hidden % 8 == 0, "hidden size %lld must be a positive multiple of 8",
              (long long)hidden);
  PETIT_CHECK(region_stride >= 1 && num_tokens >= 0 && num_tokens <= region_stride,
              "need 0 <= num_tokens (%lld) <= region_stride (%lld), region_stride >= 1",
              (long long)num_tokens, (long long)region_stride);
  PETIT_CHECK(num_blocks >= 1, "num_blocks %lld must be >= 1", (long long)num_blocks);
  CombineArgs a{};
  a.ctx.layout = make_heap_layout(int(world_size), int(region_stride), int(hidden), 1);
  a.ctx.world_size = int(world_size);
  a.ctx.num_blocks = int(num_blocks);
  a.num_tokens = int(num_tokens);
  a.top_k = 1;
  a.region_stride = int(region_stride);
  a.config = combine_config_from(combine_config);
  int grid = 0;
  PETIT_CHECK_OK(plan_combine(&a, &grid), "combine plan");
  py::dict d;
  d["send_chunks"] = a.num_chunks;
  d["whole_pairs"] = a.num_whole_pairs;
  d["send_blocks"] = a.num_send_blocks;
  d["reduce_chunks"] = a.num_reduce_chunks;
  d["static_reduce"] = bool(a.static_reduce);
  d["grid"] = grid;
  return d;
}

py::dict heap_layout(int64_t world_size, int64_t max_tokens, int64_t hidden, int64_t max_top_k) {
  HeapLayout l = make_heap_layout(int(world_size), int(max_tokens), int(hidden), int(max_top_k));
  py::dict d;
  d["max_groups"] = l.max_groups;
  d["max_chunks"] = l.max_chunks;
  d["dispatch_rows"] = l.dispatch_rows;
  d["dispatch_ids"] = l.dispatch_ids;
  d["dispatch_weights"] = l.dispatch_weights;
  d["dispatch_scales"] = l.dispatch_scales;
  d["combine_rows"] = l.combine_rows;
  d["dispatch_flags"] = l.dispatch_flags;
  d["combine_flags"] = l.combine_flags;
  d["flags_begin"] = l.flags_begin;
  d["flags_end"] = l.flags_end;
  d["total_bytes"] = l.total_bytes;
  return d;
}

// MegaMoE at W=1 (experts/megamoe.cu): the MoE layer in one launch. Shapes and limits are
// validated in Python (vllm_petit_moe/ops.py megamoe_forward); checked again here where a
// wrong value would make the kernel read or write out of bounds.
void megamoe_forward(const torch::Tensor& x, const torch::Tensor& topk_ids,
                     const torch::Tensor& topk_weights, const torch::Tensor& w13,
                     const torch::Tensor& w2, torch::Tensor& out, torch::Tensor& act_workspace,
                     torch::Tensor& partial_workspace, torch::Tensor& sync,
                     c10::optional<torch::Tensor> expert_map, int64_t num_sms,
                     double timeout_s, c10::optional<torch::Tensor> trace,
                     c10::optional<torch::Tensor> w13_scale,
                     c10::optional<torch::Tensor> w2_scale) {
  check_cuda_tensor(x, "x", 2);
  check_cuda_tensor(topk_ids, "topk_ids", 2);
  check_cuda_tensor(topk_weights, "topk_weights", 2);
  check_cuda_tensor(w13, "w13", 3);
  check_cuda_tensor(w2, "w2", 3);
  check_cuda_tensor(out, "out", 2);
  const int64_t N = x.size(0), H = x.size(1), K = topk_ids.size(1);
  const int64_t L = w13.size(0), I = w13.size(1) / 2;
  PETIT_CHECK(x.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "x and out must be bfloat16");
  PETIT_CHECK(topk_ids.scalar_type() == torch::kInt32 &&
                  topk_weights.scalar_type() == torch::kFloat32,
              "topk_ids must be int32 and topk_weights float32");
  PETIT_CHECK(topk_ids.size(0) == N && topk_weights.size(0) == N && topk_weights.size(1) == K &&
                  w13.size(2) == H && w2.size(0) == L && w2.size(1) == H && w2.size(2) == I &&
                  out.size(0) == N && out.size(1) == H,
              "inconsistent shapes: x [N, H], topk [N, K], w13 [L, 2I, H], w2 [L, H, I], "
              "out [N, H]");
  PETIT_CHECK(act_workspace.is_cuda() && act_workspace.is_contiguous() &&
                  act_workspace.scalar_type() == torch::kBFloat16 &&
                  act_workspace.numel() >= N * K * I,
              "act_workspace must be a contiguous bfloat16 CUDA tensor of >= N*K*I elements");
  PETIT_CHECK(partial_workspace.is_cuda() && partial_workspace.is_contiguous() &&
                  partial_workspace.scalar_type() == torch::kFloat32 &&
                  partial_workspace.numel() >= N * K * H,
              "partial_workspace must be a contiguous float32 CUDA tensor of >= N*K*H elements");
  PETIT_CHECK(sync.is_cuda() && sync.is_contiguous() && sync.scalar_type() == torch::kInt32 &&
                  sync.numel() >= megamoe_sync_ints(int(L), int(H)),
              "sync must be a contiguous int32 CUDA tensor of >= %d elements",
              megamoe_sync_ints(int(L), int(H)));
  PETIT_CHECK(timeout_s_valid(timeout_s), "timeout_s %g outside (0, %g] seconds",
              timeout_s, kMaxTimeoutS);
  c10::cuda::CUDAGuard guard(x.device());
  MegaMoeArgs a = megamoe_args(x, topk_ids, topk_weights, w13, w2, act_workspace,
                               partial_workspace, sync, out);
  a.expert_map = expert_map_arg(expert_map, topk_ids.device(), &a.num_global_experts);
  set_weight_format(a, w13, w2, w13_scale, w2_scale);
  if (trace.has_value()) {
    int sms = int(num_sms);
    if (sms == 0) {
      PETIT_CHECK_OK(petitDeviceGetAttribute(&sms, petitDevAttrMultiProcessorCount,
                                             x.get_device()),
                     "SM count query");
    }
    const torch::Tensor& t = *trace;
    PETIT_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == torch::kInt64 &&
                    t.numel() >= int64_t(kMegaMoeBlocksPerSm) * sms * kMegaMoeTraceSlots,
                "trace must be a contiguous int64 CUDA tensor of >= %d x SMs x %d elements",
                kMegaMoeBlocksPerSm, kMegaMoeTraceSlots);
    a.trace = t.data_ptr<int64_t>();
  }
  a.num_sms = int(num_sms);
  a.timeout_ticks = uint64_t(timeout_s * petit_timer_ticks_per_second());
  const petitError_t err = megamoe_check(a);
  PETIT_CHECK(err == petitSuccess,
              "fused MoE layer: arguments outside its limits (N*K <= %d, H and I multiples of "
              "%d, K <= %d, L <= %d, 16-byte aligned tensors)",
              kMegaMoeMaxEntries, kMegaMoeSizeMultiple, kMaxTopK, kMaxExperts);
  PETIT_CHECK_OK(launch_megamoe(a, c10::cuda::getCurrentCUDAStream()), "fused MoE launch");
}

}  // namespace
}  // namespace petit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using petit::EpContext;
  m.doc() = "vllm-petit-moe compiled kernels (symmetric heap, dispatch/combine, routing, experts)";
  m.attr("kTokenGroupSize") = petit::kTokenGroupSize;
  m.attr("kMinChunkVectors") = petit::kMinChunkVectors;
  m.attr("kMaxTopK") = petit::kMaxTopK;
  m.attr("kMaxWorldSize") = petit::kMaxWorldSize;
  m.attr("kMaxExperts") = petit::kMaxExperts;
  m.attr("kCombineTraceSlots") = int(petit::kCombineTraceSlots);
  m.attr("kTimerTicksPerSecond") = petit_timer_ticks_per_second();
  m.def("heap_layout", &petit::heap_layout, "Byte offsets of the heap regions (layout.h)",
        py::arg("world_size"), py::arg("max_tokens"), py::arg("hidden"), py::arg("max_top_k"));
  m.def("combine_plan", &petit::combine_plan,
        "What a combine launches (host-side plan, no GPU needed): {send_chunks, whole_pairs, "
        "send_blocks, reduce_chunks, static_reduce, grid}",
        py::arg("world_size"), py::arg("hidden"), py::arg("num_tokens"),
        py::arg("region_stride"), py::arg("num_blocks"), py::arg("combine_config") = py::dict());
  m.def("config_defaults", &petit::config_defaults,
        "{'ExpertConfig': {...}, 'CombineConfig': {...}}: the defaults of csrc/common/config.h");
  m.def("float_to_e4m3", &petit::float_to_e4m3,
        "Host run of dispatch's float32 -> fp8 e4m3fn conversion (csrc/common/fp8.h): uint8 codes",
        py::arg("values"));
  m.attr("kMegaMoeMaxEntries") = petit::kMegaMoeMaxEntries;
  m.attr("kMegaMoeSizeMultiple") = petit::kMegaMoeSizeMultiple;
  m.def("megamoe_sync_ints", &petit::megamoe_sync_ints,
        "Elements of the fused layer's int32 sync buffer", py::arg("num_local_experts"),
        py::arg("hidden"));
  m.def("sm90a_kernels_supported", &petit::sm90a_kernels_supported,
        "Whether this build has sm_90a images and the current device runs them (the Hopper "
        "GEMM family, the fused layer)");
  m.def("megamoe_forward", &petit::megamoe_forward,
        "Fused MoE layer (W=1) in one launch: x [N,H] bf16, topk_ids [N,K] int32, topk_weights "
        "[N,K] f32, w13 [L,2I,H], w2 [L,H,I] -> out [N,H] (written in full)",
        py::arg("x"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("w13"),
        py::arg("w2"), py::arg("out"), py::arg("act_workspace"), py::arg("partial_workspace"),
        py::arg("sync"), py::arg("expert_map") = py::none(), py::arg("num_sms") = 0,
        py::arg("timeout_s") = double(petit::kDefaultTimeoutS), py::arg("trace") = py::none(),
        py::arg("w13_scale") = py::none(), py::arg("w2_scale") = py::none());
  m.def("expert_row_lists", &petit::expert_row_lists,
        "Routing block [N,K] int32 (local ids, or global ids with expert_map [E] int32) -> "
        "(counts [L], offsets [L+1], sorted_entries [N*K])",
        py::arg("topk_ids"), py::arg("num_local_experts"), py::arg("expert_map") = py::none());
  m.def("experts_forward", &petit::experts_forward,
        "Local experts with the local weighted reduction: recv_x [N,H] bf16, recv_topk_ids "
        "[N,K] int32 local ids or -1 (global ids with expert_map [E] int32), recv_topk_weights "
        "[N,K] f32, w13 [L,2I,H] bf16, w2 [L,H,I] bf16 -> out [N,H] bf16",
        py::arg("recv_x"), py::arg("recv_topk_ids"), py::arg("recv_topk_weights"),
        py::arg("w13"), py::arg("w2"), py::arg("out") = py::none(),
        py::arg("act_workspace") = py::none(), py::arg("partial_workspace") = py::none(),
        py::arg("tiles") = 0, py::arg("expert_map") = py::none(), py::arg("config") = py::dict());
  m.def("resolve_expert_tiles", &petit::resolve_expert_tiles_for,
        "Tile family (1 simt, 2 wgmma_narrow, 3 wgmma_m64, 4 wgmma, 5 wgmma_mc) experts_forward "
        "runs for these sizes (and ExpertConfig dict) on the current device",
        py::arg("num_rows"), py::arg("top_k"), py::arg("num_local_experts"), py::arg("hidden"),
        py::arg("tiles") = 0, py::arg("config") = py::dict());
  m.def(
      "last_expert_gemm_launch",
      [](bool gate_up) {
        const petit::ExpertLaunchShape s = petit::last_expert_gemm_launch(gate_up);
        return py::make_tuple(s.grid, s.threads, s.smem_bytes, s.cluster);
      },
      "(grid, threads, dynamic smem bytes, CTAs per cluster) of this process's latest gate/up "
      "or down GEMM launch; zeros before the first",
      py::arg("gate_up"));
  py::class_<EpContext>(m, "EpContext")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    double, const py::dict&>(),
           py::arg("device"), py::arg("rank"), py::arg("world_size"), py::arg("max_tokens"),
           py::arg("hidden"), py::arg("max_top_k"), py::arg("num_experts"),
           py::arg("num_blocks"), py::arg("timeout_s"), py::arg("combine_config") = py::dict())
      .def("export_fd", &EpContext::export_fd)
      .def("attach_heartbeat", &EpContext::attach_heartbeat, py::arg("name"), py::arg("create"),
           py::arg("period_s"), py::arg("max_wait_s"))
      .def_static("unlink_heartbeat", &EpContext::unlink_heartbeat, py::arg("name"))
      .def("map_peers", &EpContext::map_peers, py::arg("fds"))
      .def("heap_view", &EpContext::heap_view, py::arg("rank"), py::arg("offset"),
           py::arg("num_bytes"))
      .def("dispatch", &EpContext::dispatch, py::arg("x"), py::arg("topk_ids"),
           py::arg("topk_weights"), py::arg("region_stride"), py::arg("quant") = 0)
      .def("combine", &EpContext::combine, py::arg("expert_out"), py::arg("out"),
           py::arg("top_k"), py::arg("region_stride"), py::arg("trace") = py::none())
      .def("megamoe", &EpContext::megamoe, py::arg("x"), py::arg("topk_ids"),
           py::arg("topk_weights"), py::arg("w13"), py::arg("w2"), py::arg("out"),
           py::arg("act"), py::arg("partial"), py::arg("sync"), py::arg("region_stride"),
           py::arg("trace") = py::none(), py::arg("w13_scale") = py::none(),
           py::arg("w2_scale") = py::none())
      .def("peer_write", &EpContext::peer_write, py::arg("src"), py::arg("bytes_per_peer"),
           py::arg("num_blocks"))
      .def("recv_group_counts", &EpContext::recv_group_counts)
      .def("epoch", &EpContext::epoch)
      .def("diagnostics", &EpContext::diagnostics)
      .def_property_readonly("heap_bytes", &EpContext::heap_bytes)
      .def_property_readonly("heap_stride", &EpContext::heap_stride)
      .def_property_readonly("num_blocks", &EpContext::num_blocks)
      .def("abort", &EpContext::abort)
      .def("close", &EpContext::close, py::call_guard<py::gil_scoped_release>());
}
