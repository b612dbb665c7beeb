// The torch binding of EpContext (comm/ep_context.h): tensors in, raw pointers and sizes to the
// context, tensor views of the heap and the device state out; the context's std::runtime_error
// becomes this module's error.
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/common.h"
#include "comm/ep_context.h"

namespace petit {
namespace binding {
namespace {

// ---- EpContext (comm/ep_context.h): the torch side of its calls. Tensors in, raw pointers
// and sizes to the context, tensor views of the heap and the device state out; the context's
// std::runtime_error becomes this module's error.
template <class F>
auto translated(F&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "petit_moe: ", e.what());
    throw;  // not reached
  }
}

// Runs a blocking wait without the GIL where this thread holds it (a view's last owner can be
// Python code; the context's destructor runs under the GIL).
void without_gil(const std::function<void()>& wait) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    wait();
  } else {
    wait();
  }
}

// A view of context memory on the context's device. The heap is VMM memory whose pages may
// live on a peer GPU: name the device the mapping is accessed from instead of letting torch
// query the pointer's home device. The view holds a share of the memory: valid after close().
torch::Tensor context_view(const EpContext& ctx, const OwnedPtr& p, std::vector<int64_t> sizes,
                   torch::ScalarType dtype) {
  const torch::Device device(torch::kCUDA, ctx.device());
  std::shared_ptr<void> owner = p.owner;
  return at::for_blob(p.ptr, sizes)
      .options(torch::TensorOptions().dtype(dtype).device(device))
      .target_device(device)
      .deleter([owner](void*) mutable { owner.reset(); })
      .make_tensor();
}

// The class the module binds: a type of this file alone (pybind11's types are hidden; a bound
// type of default visibility draws -Wattributes).
class BoundEpContext final : public EpContext {
 public:
  using EpContext::EpContext;
};

std::unique_ptr<BoundEpContext> ep_create(int64_t device, int64_t rank, int64_t world_size,
                                     int64_t max_tokens, int64_t hidden, int64_t max_top_k,
                                     int64_t num_experts, int64_t num_blocks, double timeout_s,
                                     const py::dict& combine_config) {
  EpContextParams p;
  p.combine_config = combine_config_from(combine_config);
  p.device = device;
  p.rank = rank;
  p.world_size = world_size;
  p.max_tokens = max_tokens;
  p.hidden = hidden;
  p.max_top_k = max_top_k;
  p.num_experts = num_experts;
  p.num_blocks = num_blocks;
  p.timeout_s = timeout_s;
  p.run_blocking = without_gil;
  return translated([&] { return std::make_unique<BoundEpContext>(p); });
}

torch::Tensor ep_heap_view(BoundEpContext& ctx, int64_t rank, int64_t offset, int64_t num_bytes) {
  const OwnedPtr p = translated([&] { return ctx.heap_view(rank, offset, num_bytes); });
  return context_view(ctx, p, {num_bytes}, torch::kUInt8);
}

// Returns (recv_x, recv_ids, recv_weights, recv_scales): recv_x [W*R, H] bf16 (quant 0) or
// float8_e4m3fn (quant 1, 2, 3: api.h DispatchQuant); recv_scales [W*R, H/128] (1, 3) or
// [W*R, 1] (2) float32, empty for bf16. Limits (top-k, region stride, quant): dispatch_check.
std::vector<torch::Tensor> ep_dispatch(BoundEpContext& ctx, const torch::Tensor& x,
                                       const torch::Tensor& topk_ids,
                                       const torch::Tensor& topk_weights, int64_t region_stride,
                                       int64_t quant) {
  const int device = ctx.device(), H = ctx.layout().hidden;
  check_tensor(x, "x", torch::kBFloat16, device, "[T, H]", {-1, H});
  const int64_t T = x.size(0);
  PETIT_CHECK(topk_ids.scalar_type() == torch::kInt32 || topk_ids.scalar_type() == torch::kInt64,
              "topk_ids must be int32 or int64");
  check_tensor(topk_ids, "topk_ids", topk_ids.scalar_type(), device, "[T, K]", {T, -1});
  const int64_t K = topk_ids.size(1);
  check_tensor(topk_weights, "topk_weights", torch::kFloat32, device, "[T, K]", {T, K});
  DispatchArgs a{};
  a.x = reinterpret_cast<const petit_bf16_bits*>(x.data_ptr());
  a.topk_ids = topk_ids.data_ptr();
  a.ids_are_int64 = topk_ids.scalar_type() == torch::kInt64;
  a.topk_weights = topk_weights.data_ptr<float>();
  a.num_tokens = checked_int(T, "token count");
  a.top_k = checked_int(K, "top-k");
  a.region_stride = checked_int(region_stride, "region stride");
  a.quant = checked_int(quant, "quant");
  const DispatchRegions r = translated(
      [&] { return ctx.dispatch(a, c10::cuda::getCurrentCUDAStream(device)); });
  const int64_t rows = int64_t(ctx.world_size()) * region_stride;
  const bool fp8 = quant != kQuantNone;
  const int64_t num_scales = is_block_quant(int(quant)) ? H / kFp8ScaleBlock : 1;
  return {context_view(ctx, {r.rows, r.owner}, {rows, H},
               fp8 ? at::ScalarType::Float8_e4m3fn : torch::kBFloat16),
          context_view(ctx, {r.ids, r.owner}, {rows, K}, torch::kInt32),
          context_view(ctx, {r.weights, r.owner}, {rows, K}, torch::kFloat32),
          context_view(ctx, {r.scales, r.owner}, {fp8 ? rows : 0, num_scales}, torch::kFloat32)};
}

// out [T, H] <- the rows of expert_out [W*R, H] that belong to this rank's tokens. trace:
// optional int64 [num_blocks, kCombineTraceSlots] on this device; each launched block writes
// its row (CombineTraceSlot), the others are left as they are. Limits (top-k, T <= R):
// combine_check.
void ep_combine(BoundEpContext& ctx, const torch::Tensor& expert_out, torch::Tensor& out,
                int64_t top_k, int64_t region_stride, c10::optional<torch::Tensor> trace) {
  const int device = ctx.device(), H = ctx.layout().hidden;
  check_tensor(expert_out, "expert_out", torch::kBFloat16, device, "[W*R, H]",
               {int64_t(ctx.world_size()) * region_stride, H});
  check_tensor(out, "out", torch::kBFloat16, device, "[T, H]", {-1, H});
  CombineArgs a{};
  a.expert_out = reinterpret_cast<const petit_bf16_bits*>(expert_out.data_ptr());
  a.out = reinterpret_cast<petit_bf16_bits*>(out.data_ptr());
  a.num_tokens = checked_int(out.size(0), "token count");
  a.top_k = checked_int(top_k, "top-k");
  a.region_stride = checked_int(region_stride, "region stride");
  if (trace.has_value()) {
    check_tensor(*trace, "trace", torch::kInt64, device, "[num_blocks, kCombineTraceSlots]",
                 {ctx.num_blocks(), kCombineTraceSlots});
    a.trace = trace->data_ptr<int64_t>();
  }
  translated([&] { ctx.combine(a, c10::cuda::getCurrentCUDAStream(device)); });
}

// The fused layer on this rank (api.h MegaMoeEpArgs): out [T, H] <- the MoE of x over the
// group's experts, dispatch and combine inside one launch. Shapes as megamoe_forward's, with
// global int32 ids; act / partial / sync: the workspaces of W * R * K entries. Limits:
// megamoe_ep_check.
void ep_megamoe(BoundEpContext& ctx, const torch::Tensor& x, const torch::Tensor& topk_ids,
                const torch::Tensor& topk_weights, const torch::Tensor& w13,
                const torch::Tensor& w2, torch::Tensor& out, torch::Tensor& act,
                torch::Tensor& partial, torch::Tensor& sync, int64_t region_stride,
                c10::optional<torch::Tensor> trace, c10::optional<torch::Tensor> w13_scale,
                c10::optional<torch::Tensor> w2_scale) {
  const int device = ctx.device();
  MegaMoeEpArgs e{};
  e.region_stride = checked_int(region_stride, "region stride");
  e.layer = megamoe_args(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, out, act,
                         partial, sync, ctx.layout().hidden,
                         int64_t(ctx.world_size()) * region_stride, device);
  e.layer.trace = megamoe_trace_arg(trace, ctx.num_blocks(), device);  // the context's grid
  translated([&] { ctx.megamoe(e, c10::cuda::getCurrentCUDAStream(device)); });
}

// Benchmark ceiling: push `bytes_per_peer` of `src` into every peer's combine region.
void ep_peer_write(BoundEpContext& ctx, const torch::Tensor& src, int64_t bytes_per_peer,
                   int64_t num_blocks) {
  PETIT_CHECK(src.is_cuda() && src.is_contiguous() && bytes_per_peer >= 0 &&
                  src.nbytes() >= size_t(bytes_per_peer),
              "peer_write source too small");
  translated([&] {
    ctx.peer_write(src.data_ptr(), bytes_per_peer, checked_int(num_blocks, "num_blocks"),
                   c10::cuda::getCurrentCUDAStream(ctx.device()));
  });
}

py::dict ep_diagnostics(const BoundEpContext& ctx) {
  py::dict d;
  EpDiagnostics diag{};
  if (!ctx.diagnostics(&diag)) return d;
  d["error"] = ep_error_name(diag.error);
  d["timed_out"] = int(diag.error == kEpErrorTimeout);
  d["rank"] = int(diag.rank);
  d["peer"] = int(diag.peer);
  d["phase"] = diag.phase == 0 ? "dispatch" : "combine";
  d["group"] = int(diag.group);
  d["expected_epoch"] = uint64_t(diag.expected_epoch);
  d["observed_epoch"] = flag_epoch(diag.observed_flag);
  d["expected_tag"] = uint32_t(diag.expected_tag);
  d["peer_alive"] = int(diag.peer_alive);
  d["observed_tag"] = flag_tag(diag.observed_flag);
  d["dropped_ids"] = int(diag.dropped_ids);
  return d;
}

}  // namespace

void bind_ep_context(py::module_& m) {
  py::class_<BoundEpContext>(m, "EpContext")
      .def(py::init(&ep_create), py::arg("device"), py::arg("rank"),
           py::arg("world_size"), py::arg("max_tokens"), py::arg("hidden"), py::arg("max_top_k"),
           py::arg("num_experts"), py::arg("num_blocks"), py::arg("timeout_s"),
           py::arg("combine_config") = py::dict())
      .def("export_fd",
           [](BoundEpContext& c) {
             return int64_t(translated([&] { return c.export_fd(); }));
           })
      .def(
          "attach_heartbeat",
          [](BoundEpContext& c, const std::string& name, bool create, double period_s,
             double max_wait_s) {
            translated([&] { c.attach_heartbeat(name, create, period_s, max_wait_s); });
          },
          py::arg("name"), py::arg("create"), py::arg("period_s"), py::arg("max_wait_s"))
      .def_static("unlink_heartbeat", &EpContext::unlink_heartbeat, py::arg("name"))
      .def(
          "map_peers",
          [](BoundEpContext& c, const std::vector<int64_t>& fds) {
            const std::vector<int> int_fds(fds.begin(), fds.end());
            translated([&] { c.map_peers(int_fds); });
          },
          py::arg("fds"))
      .def("heap_view", &ep_heap_view, py::arg("rank"), py::arg("offset"),
           py::arg("num_bytes"))
      .def("dispatch", &ep_dispatch, py::arg("x"), py::arg("topk_ids"),
           py::arg("topk_weights"), py::arg("region_stride"), py::arg("quant") = 0)
      .def("combine", &ep_combine, py::arg("expert_out"), py::arg("out"),
           py::arg("top_k"), py::arg("region_stride"), py::arg("trace") = py::none())
      .def("megamoe", &ep_megamoe, py::arg("x"), py::arg("topk_ids"),
           py::arg("topk_weights"), py::arg("w13"), py::arg("w2"), py::arg("out"),
           py::arg("act"), py::arg("partial"), py::arg("sync"), py::arg("region_stride"),
           py::arg("trace") = py::none(), py::arg("w13_scale") = py::none(),
           py::arg("w2_scale") = py::none())
      .def("peer_write", &ep_peer_write, py::arg("src"), py::arg("bytes_per_peer"),
           py::arg("num_blocks"))
      .def("recv_group_counts",
           [](const BoundEpContext& c) {
             return context_view(c, c.recv_group_counts(),
                                        {c.world_size(), c.layout().max_groups}, torch::kInt32);
           })
      .def("epoch",
           [](const BoundEpContext& c) {
             return context_view(c, c.epoch(), {1}, torch::kInt64);
           })
      .def("diagnostics", &ep_diagnostics)
      .def_property_readonly("heap_bytes",
                             [](const BoundEpContext& c) { return c.layout().total_bytes; })
      .def_property_readonly("heap_stride", &EpContext::heap_stride)
      .def_property_readonly("num_blocks",
                             [](const BoundEpContext& c) { return int64_t(c.num_blocks()); })
      .def("abort", &EpContext::abort)
      .def("close", &EpContext::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace binding
}  // namespace petit
