// The thin torch layer: tensor checks, device/stream selection, and the pybind11 module.
// Kernels and the heap live in framework-free files (api.h); nothing here branches on the
// platform.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

#include "api.h"

namespace petit {
namespace {

#define PETIT_CHECK_OK(expr, what)                                                    \
  do {                                                                                \
    petitError_t _err = (expr);                                                       \
    TORCH_CHECK(_err == petitSuccess, "petit_moe: ", what, " failed: ",              \
                petitGetErrorString(_err));                                           \
  } while (0)

void check_cuda_tensor(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "petit_moe: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "petit_moe: ", name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, "petit_moe: ", name, " must have ", dim, " dims, got ",
              t.dim());
}

// Owns one rank's symmetric heap plus the local device state of an EpBuffer.
class EpContext {
 public:
  EpContext(int64_t device, int64_t rank, int64_t world_size, int64_t max_tokens,
            int64_t hidden, int64_t max_top_k, int64_t num_experts, int64_t num_blocks,
            double timeout_s)
      : device_(int(device)) {
    TORCH_CHECK(world_size >= 1 && world_size <= kMaxWorldSize, "petit_moe: world size ",
                world_size, " outside [1, ", kMaxWorldSize, "]");
    TORCH_CHECK(rank >= 0 && rank < world_size, "petit_moe: rank ", rank, " outside [0, ",
                world_size, ")");
    TORCH_CHECK(hidden > 0 && hidden % 8 == 0, "petit_moe: hidden size ", hidden,
                " must be a positive multiple of 8");
    TORCH_CHECK(max_top_k >= 1 && max_top_k <= kMaxTopK, "petit_moe: max top-k ", max_top_k,
                " outside [1, ", kMaxTopK, "]");
    TORCH_CHECK(num_experts >= world_size && num_experts <= kMaxExperts &&
                    num_experts % world_size == 0,
                "petit_moe: ", num_experts, " experts must be a multiple of the world size ",
                world_size, " and at most ", kMaxExperts);
    TORCH_CHECK(max_tokens >= 1, "petit_moe: max tokens per rank must be >= 1");
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
    TORCH_CHECK(num_blocks >= 1 && num_blocks <= num_sms, "petit_moe: num_sms ", num_blocks,
                " must be in [1, ", num_sms, "] (the persistent grid must be co-resident)");
    args_.num_blocks = int(num_blocks);
    args_.timeout_ticks = uint64_t(timeout_s * petit_timer_ticks_per_second());

    char err[512] = {0};
    SymmetricHeap* heap = nullptr;
    petitError_t e = SymmetricHeap::create(device_, args_.layout.total_bytes, &heap, err,
                                           sizeof(err));
    TORCH_CHECK(e == petitSuccess, "petit_moe: ", err);
    heap_.reset(heap);

    auto opts = torch::TensorOptions().device(torch::kCUDA, device_);
    const int64_t groups = args_.layout.max_groups;
    state_ = torch::zeros({int64_t(sizeof(EpState) / 8)}, opts.dtype(torch::kInt64));
    token_rank_mask_ = torch::zeros({max_tokens}, opts.dtype(torch::kInt32));
    group_done_ = torch::zeros({2 * world_size * groups}, opts.dtype(torch::kInt32));
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

  ~EpContext() { close(); }

  int64_t export_fd() {
    int fd = -1;
    char err[512] = {0};
    TORCH_CHECK(heap_, "petit_moe: context is closed");
    TORCH_CHECK(heap_->export_fd(&fd, err, sizeof(err)) == petitSuccess, "petit_moe: ", err);
    return fd;
  }

  // fds[r] for r != rank: descriptors received from the peers (closed here).
  void map_peers(const std::vector<int64_t>& fds) {
    TORCH_CHECK(heap_, "petit_moe: context is closed");
    TORCH_CHECK(int64_t(fds.size()) == args_.world_size, "petit_moe: expected ",
                args_.world_size, " descriptors, got ", fds.size());
    c10::cuda::CUDAGuard guard(device_);
    std::vector<int> int_fds(fds.begin(), fds.end());
    char err[512] = {0};
    petitError_t e = heap_->map_all(int_fds.data(), args_.world_size, args_.rank, err,
                                    sizeof(err));
    TORCH_CHECK(e == petitSuccess, "petit_moe: ", err);
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
    check_mapped();
    TORCH_CHECK(rank >= 0 && rank < args_.world_size, "petit_moe: rank out of range");
    TORCH_CHECK(offset >= 0 && num_bytes >= 0 && offset + num_bytes <= heap_->stride(),
                "petit_moe: heap view out of range");
    return view(args_.heap_base + rank * args_.heap_stride + offset, {num_bytes},
                torch::kUInt8);
  }

  std::vector<torch::Tensor> dispatch(const torch::Tensor& x, const torch::Tensor& topk_ids,
                                      const torch::Tensor& topk_weights, int64_t region_stride) {
    check_mapped();
    check_cuda_tensor(x, "x", 2);
    check_cuda_tensor(topk_ids, "topk_ids", 2);
    check_cuda_tensor(topk_weights, "topk_weights", 2);
    const int64_t T = x.size(0), K = topk_ids.size(1);
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "petit_moe: x must be bfloat16");
    TORCH_CHECK(x.size(1) == args_.layout.hidden, "petit_moe: x hidden size ", x.size(1),
                " != buffer hidden size ", args_.layout.hidden);
    TORCH_CHECK(topk_ids.scalar_type() == torch::kInt32 || topk_ids.scalar_type() == torch::kInt64,
                "petit_moe: topk_ids must be int32 or int64");
    TORCH_CHECK(topk_weights.scalar_type() == torch::kFloat32,
                "petit_moe: topk_weights must be float32");
    TORCH_CHECK(topk_ids.size(0) == T && topk_weights.size(0) == T && topk_weights.size(1) == K,
                "petit_moe: x, topk_ids and topk_weights disagree on the token count / top-k");
    TORCH_CHECK(K >= 1 && K <= args_.layout.max_top_k, "petit_moe: top-k ", K,
                " outside [1, ", args_.layout.max_top_k, "]");
    TORCH_CHECK(T <= region_stride && region_stride <= args_.layout.max_tokens,
                "petit_moe: need tokens (", T, ") <= region stride (", region_stride,
                ") <= max tokens per rank (", args_.layout.max_tokens, ")");
    TORCH_CHECK(x.get_device() == device_ && topk_ids.get_device() == device_ &&
                    topk_weights.get_device() == device_,
                "petit_moe: inputs must be on the buffer's device ", device_);
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
    PETIT_CHECK_OK(launch_dispatch(a, c10::cuda::getCurrentCUDAStream()), "dispatch launch");
    char* own = args_.heap_base + int64_t(args_.rank) * args_.heap_stride;
    const int64_t rows = int64_t(args_.world_size) * region_stride;
    return {view(own + args_.layout.dispatch_rows, {rows, args_.layout.hidden}, torch::kBFloat16),
            view(own + args_.layout.dispatch_ids, {rows, K}, torch::kInt32),
            view(own + args_.layout.dispatch_weights, {rows, K}, torch::kFloat32)};
  }

  void combine(const torch::Tensor& expert_out, torch::Tensor& out, int64_t top_k,
               int64_t region_stride) {
    check_mapped();
    check_cuda_tensor(expert_out, "expert_out", 2);
    check_cuda_tensor(out, "out", 2);
    const int64_t rows = int64_t(args_.world_size) * region_stride;
    TORCH_CHECK(expert_out.scalar_type() == torch::kBFloat16 &&
                    out.scalar_type() == torch::kBFloat16,
                "petit_moe: expert_out and out must be bfloat16");
    TORCH_CHECK(expert_out.size(0) == rows && expert_out.size(1) == args_.layout.hidden,
                "petit_moe: expert_out must be [world*region_stride, hidden] = [", rows, ", ",
                args_.layout.hidden, "], got [", expert_out.size(0), ", ", expert_out.size(1),
                "]");
    TORCH_CHECK(out.size(1) == args_.layout.hidden && out.size(0) <= region_stride,
                "petit_moe: out must be [tokens <= region_stride, hidden]");
    TORCH_CHECK(region_stride <= args_.layout.max_tokens, "petit_moe: region stride too large");
    c10::cuda::CUDAGuard guard(device_);
    CombineArgs a{};
    a.ctx = args_;
    a.expert_out = reinterpret_cast<const petit_bf16_bits*>(expert_out.data_ptr());
    a.out = reinterpret_cast<petit_bf16_bits*>(out.data_ptr());
    a.num_tokens = int(out.size(0));
    a.top_k = int(top_k);
    a.region_stride = int(region_stride);
    PETIT_CHECK_OK(launch_combine(a, c10::cuda::getCurrentCUDAStream()), "combine launch");
  }

  // Benchmark ceiling: push `bytes_per_peer` of `src` into every peer's combine region.
  void peer_write(const torch::Tensor& src, int64_t bytes_per_peer, int64_t num_blocks) {
    check_mapped();
    TORCH_CHECK(src.is_cuda() && src.is_contiguous() && src.nbytes() >= size_t(bytes_per_peer),
                "petit_moe: peer_write source too small");
    const int64_t region = args_.layout.flags_begin - args_.layout.combine_rows;
    TORCH_CHECK(bytes_per_peer <= region && bytes_per_peer % 16 == 0,
                "petit_moe: bytes_per_peer must be a multiple of 16 and <= ", region);
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
    if (diag_host_ == nullptr) return d;
    volatile EpDiagnostics* diag = diag_host_;
    d["timed_out"] = int(diag->timed_out);
    d["rank"] = int(diag->rank);
    d["peer"] = int(diag->peer);
    d["phase"] = diag->phase == 0 ? "dispatch" : "combine";
    d["group"] = int(diag->group);
    d["expected_epoch"] = uint64_t(diag->expected_epoch);
    d["observed_epoch"] = flag_epoch(diag->observed_flag);
    return d;
  }

  int64_t heap_bytes() const { return args_.layout.total_bytes; }
  int64_t heap_stride() const { return heap_ ? heap_->stride() : 0; }
  int64_t num_blocks() const { return args_.num_blocks; }

  void close() {
    if (heap_) {
      c10::cuda::CUDAGuard guard(device_);
      petitDeviceSynchronize();  // no kernel may still touch the range
      heap_.reset();
    }
    if (diag_host_ != nullptr) petitFreeHost(diag_host_);
    diag_host_ = nullptr;
    args_.heap_base = nullptr;
  }

 private:
  void check_mapped() const {
    TORCH_CHECK(heap_ && args_.heap_base != nullptr,
                "petit_moe: the symmetric heap is not mapped (closed, or map_peers not run)");
  }
  torch::Tensor view(char* ptr, std::vector<int64_t> sizes, torch::ScalarType dtype) const {
    return torch::from_blob(ptr, sizes, [](void*) {},
                            torch::TensorOptions().dtype(dtype).device(torch::kCUDA, device_));
  }

  int device_;
  EpContextArgs args_{};
  std::unique_ptr<SymmetricHeap> heap_;
  torch::Tensor state_, token_rank_mask_, group_done_, recv_group_counts_;
  EpDiagnostics* diag_host_ = nullptr;
};

std::vector<torch::Tensor> expert_row_lists(const torch::Tensor& topk_ids,
                                            int64_t num_local_experts) {
  check_cuda_tensor(topk_ids, "topk_ids", 2);
  TORCH_CHECK(topk_ids.scalar_type() == torch::kInt32, "petit_moe: topk_ids must be int32");
  TORCH_CHECK(num_local_experts >= 1 && num_local_experts <= kMaxExperts,
              "petit_moe: num_local_experts ", num_local_experts, " outside [1, ", kMaxExperts,
              "]");
  TORCH_CHECK(topk_ids.numel() < (int64_t(1) << 31), "petit_moe: too many routing entries");
  c10::cuda::CUDAGuard guard(topk_ids.device());
  auto opts = topk_ids.options();
  const int num_entries = int(topk_ids.numel());
  auto counts = torch::empty({num_local_experts}, opts);
  auto offsets = torch::empty({num_local_experts + 1}, opts);
  auto sorted = torch::empty({num_entries}, opts);
  auto workspace = torch::empty({row_list_workspace_ints(num_entries, int(num_local_experts))}, opts);
  RowListArgs a{};
  a.topk_ids = topk_ids.data_ptr<int32_t>();
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

py::dict heap_layout(int64_t world_size, int64_t max_tokens, int64_t hidden, int64_t max_top_k) {
  HeapLayout l = make_heap_layout(int(world_size), int(max_tokens), int(hidden), int(max_top_k));
  py::dict d;
  d["max_groups"] = l.max_groups;
  d["dispatch_rows"] = l.dispatch_rows;
  d["dispatch_ids"] = l.dispatch_ids;
  d["dispatch_weights"] = l.dispatch_weights;
  d["combine_rows"] = l.combine_rows;
  d["dispatch_flags"] = l.dispatch_flags;
  d["combine_flags"] = l.combine_flags;
  d["flags_begin"] = l.flags_begin;
  d["flags_end"] = l.flags_end;
  d["total_bytes"] = l.total_bytes;
  return d;
}

}  // namespace
}  // namespace petit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using petit::EpContext;
  m.doc() = "vllm-petit-moe compiled kernels (symmetric heap, dispatch/combine, routing)";
  m.attr("kTokenGroupSize") = petit::kTokenGroupSize;
  m.attr("kMaxTopK") = petit::kMaxTopK;
  m.attr("kMaxWorldSize") = petit::kMaxWorldSize;
  m.attr("kMaxExperts") = petit::kMaxExperts;
  m.def("heap_layout", &petit::heap_layout, "Byte offsets of the heap regions (layout.h)",
        py::arg("world_size"), py::arg("max_tokens"), py::arg("hidden"), py::arg("max_top_k"));
  m.def("expert_row_lists", &petit::expert_row_lists,
        "Routing block [N,K] int32 -> (counts [L], offsets [L+1], sorted_entries [N*K])",
        py::arg("topk_ids"), py::arg("num_local_experts"));
  py::class_<EpContext>(m, "EpContext")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    double>(),
           py::arg("device"), py::arg("rank"), py::arg("world_size"), py::arg("max_tokens"),
           py::arg("hidden"), py::arg("max_top_k"), py::arg("num_experts"),
           py::arg("num_blocks"), py::arg("timeout_s"))
      .def("export_fd", &EpContext::export_fd)
      .def("map_peers", &EpContext::map_peers, py::arg("fds"))
      .def("heap_view", &EpContext::heap_view, py::arg("rank"), py::arg("offset"),
           py::arg("num_bytes"))
      .def("dispatch", &EpContext::dispatch, py::arg("x"), py::arg("topk_ids"),
           py::arg("topk_weights"), py::arg("region_stride"))
      .def("combine", &EpContext::combine, py::arg("expert_out"), py::arg("out"),
           py::arg("top_k"), py::arg("region_stride"))
      .def("peer_write", &EpContext::peer_write, py::arg("src"), py::arg("bytes_per_peer"),
           py::arg("num_blocks"))
      .def("recv_group_counts", &EpContext::recv_group_counts)
      .def("epoch", &EpContext::epoch)
      .def("diagnostics", &EpContext::diagnostics)
      .def_property_readonly("heap_bytes", &EpContext::heap_bytes)
      .def_property_readonly("heap_stride", &EpContext::heap_stride)
      .def_property_readonly("num_blocks", &EpContext::num_blocks)
      .def("close", &EpContext::close);
}
