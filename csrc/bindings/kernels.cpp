// The torch binding of the expert kernels (experts/: routing, the GEMM launchers, the fused
// layer) and of the host-only helpers (diagnostics and CPU tests): tensors in, checked (their
// device, dtype, contiguity and the shapes that relate them), raw pointers and sizes out to the
// C API (api.h), on the current device's current stream.
#include <cstdint>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "common/fp8.h"

namespace petit {
namespace binding {
namespace {

ExpertConfig expert_config_from(const py::dict& d) {
  return config_from<ExpertConfig>(d, "ExpertConfig", kExpertConfigFields);
}

// A workspace: a contiguous `dtype` CUDA tensor of any shape with >= min_elems elements on
// cuda:`device`.
void check_workspace(const torch::Tensor& t, const char* name, torch::ScalarType dtype,
                     int64_t min_elems, int device) {
  PETIT_CHECK(t.is_cuda() && t.is_contiguous() && t.get_device() == device &&
                  t.scalar_type() == dtype && t.numel() >= min_elems,
              "%s must be a contiguous %s tensor of >= %lld elements on cuda:%d", name,
              dtype_name(dtype).c_str(), (long long)min_elems, device);
}

void check_aligned16(const torch::Tensor& t, const char* name) {
  PETIT_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "%s must be 16-byte aligned (vector loads/stores)", name);
}

// vLLM's EP expert_map (global -> local expert id, -1 for other ranks' experts), optional:
// with it the routing ids are global ids and the kernels map them (expert_ids.h). Returns the
// map's pointer (nullptr without one) and sets *num_global to its length. Refused here when
// empty: its data pointer may then be null, which the C API reads as no map.
const int32_t* expert_map_arg(const c10::optional<torch::Tensor>& expert_map, int device,
                              int* num_global) {
  *num_global = 0;
  if (!expert_map.has_value()) return nullptr;
  check_tensor(*expert_map, "expert_map", torch::kInt32, device, "[E]", {-1});
  PETIT_CHECK(expert_map->numel() >= 1, "expert_map must have >= 1 entries");
  *num_global = checked_int(expert_map->numel(), "expert_map size");
  return expert_map->data_ptr<int32_t>();
}

// The default configs as dicts: what config.py's dataclasses must mirror.
py::dict config_defaults() {
  py::dict expert, combine, d;
  for (const auto& [name, member] : kExpertConfigFields) expert[name] = ExpertConfig().*member;
  for (const auto& [name, member] : kCombineConfigFields) combine[name] = CombineConfig().*member;
  d["ExpertConfig"] = expert;
  d["CombineConfig"] = combine;
  return d;
}

// ---- the expert kernels (experts/: routing.cu, tile_choice.cu and the GEMM launchers)
// The per-local-expert row lists of a routing block (api.h RowListArgs, checked by
// row_lists_check before anything is allocated) in new int32 tensors.
struct RowLists {
  torch::Tensor counts, offsets, sorted, workspace;
  RowListArgs args{};
};

RowLists row_lists(const torch::Tensor& topk_ids, int num_local_experts,
                   const int32_t* expert_map, int num_global_experts) {
  RowLists r;
  r.args.expert_map = expert_map;
  r.args.num_global_experts = num_global_experts;
  r.args.num_entries = checked_int(topk_ids.numel(), "routing entry count");
  r.args.num_local_experts = num_local_experts;
  PETIT_CHECK_CALL("", row_lists_check, r.args);
  const auto opts = topk_ids.options().dtype(torch::kInt32);
  r.counts = torch::empty({num_local_experts}, opts);
  r.offsets = torch::empty({num_local_experts + 1}, opts);
  r.sorted = torch::empty({r.args.num_entries}, opts);
  r.workspace =
      torch::empty({row_list_workspace_ints(r.args.num_entries, num_local_experts)}, opts);
  r.args.topk_ids = topk_ids.data_ptr<int32_t>();
  r.args.workspace = r.workspace.data_ptr<int32_t>();
  r.args.expert_counts = r.counts.data_ptr<int32_t>();
  r.args.expert_offsets = r.offsets.data_ptr<int32_t>();
  r.args.sorted_entries = r.sorted.data_ptr<int32_t>();
  return r;
}

std::vector<torch::Tensor> expert_row_lists(const torch::Tensor& topk_ids,
                                            int64_t num_local_experts,
                                            c10::optional<torch::Tensor> expert_map) {
  const int device = topk_ids.get_device();
  check_tensor(topk_ids, "topk_ids", torch::kInt32, device, "[N, K]", {-1, -1});
  c10::cuda::CUDAGuard guard(topk_ids.device());
  int num_global = 0;
  const int32_t* map = expert_map_arg(expert_map, device, &num_global);
  const RowLists r = row_lists(topk_ids, checked_int(num_local_experts, "num_local_experts"),
                               map, num_global);
  PETIT_CHECK_OK(launch_expert_row_lists(r.args, c10::cuda::getCurrentCUDAStream()),
                 "row-list launch");
  return {r.counts, r.offsets, r.sorted};
}

// A caller's workspace (checked) or a new one of `elems` elements like `like`.
torch::Tensor workspace_or_new(const c10::optional<torch::Tensor>& given, const char* name,
                               int64_t elems, const torch::Tensor& like) {
  if (!given.has_value()) return torch::empty({elems}, like.options());
  check_workspace(*given, name, like.scalar_type(), elems, like.get_device());
  return *given;
}

// Local experts with the local weighted reduction (docs/architecture.md, "Expert kernels"):
// row lists + gate/up GEMM + down GEMM + reduction, all on the current stream, no host sync.
// Limits: experts_check, before anything is allocated.
torch::Tensor experts_forward(const torch::Tensor& recv_x, const torch::Tensor& topk_ids,
                              const torch::Tensor& topk_weights, const torch::Tensor& w13,
                              const torch::Tensor& w2, c10::optional<torch::Tensor> out,
                              c10::optional<torch::Tensor> act_workspace,
                              c10::optional<torch::Tensor> partial_workspace, int64_t tiles,
                              c10::optional<torch::Tensor> expert_map, const py::dict& config) {
  PETIT_CHECK(w13.scalar_type() == torch::kBFloat16 && w2.scalar_type() == torch::kBFloat16,
              "w13 and w2 must be bfloat16 (quantized expert weights are not supported)");
  const int device = recv_x.get_device();
  check_tensor(recv_x, "recv_x", torch::kBFloat16, device, "[N, H]", {-1, -1});
  const int64_t N = recv_x.size(0), H = recv_x.size(1);
  check_tensor(topk_ids, "recv_topk_ids", torch::kInt32, device, "[N, K]", {N, -1});
  const int64_t K = topk_ids.size(1);
  check_tensor(topk_weights, "recv_topk_weights", torch::kFloat32, device, "[N, K]", {N, K});
  check_tensor(w2, "w2", torch::kBFloat16, device, "[L, H, I]", {-1, H, -1});
  const int64_t L = w2.size(0), I = w2.size(2);
  check_tensor(w13, "w13", torch::kBFloat16, device, "[L, 2I, H]", {L, 2 * I, H});
  ExpertGemmArgs a{};
  a.num_rows = checked_int(N, "row count");
  a.top_k = checked_int(K, "top-k");
  a.hidden = checked_int(H, "hidden size");
  a.intermediate = checked_int(I, "intermediate size");
  a.num_local_experts = checked_int(L, "local expert count");
  a.tiles = checked_int(tiles, "tiles");
  a.config = expert_config_from(config);
  a.expert_map = expert_map_arg(expert_map, device, &a.num_global_experts);
  PETIT_CHECK_CALL("", experts_check, a);  // num_sms 0: the launchers' SM count of the device

  c10::cuda::CUDAGuard guard(recv_x.device());
  torch::Tensor result = out.has_value() ? *out : torch::empty({N, H}, recv_x.options());
  check_tensor(result, "out", torch::kBFloat16, device, "[N, H]", {N, H});
  if (N == 0) return result;
  const torch::Tensor act = workspace_or_new(
      act_workspace, "act_workspace (N*K*I)",
      expert_act_workspace_elems(a.num_rows, a.top_k, a.intermediate), recv_x);
  const torch::Tensor partial = workspace_or_new(
      partial_workspace, "partial_workspace (N*K*H)",
      expert_partial_workspace_elems(a.num_rows, a.top_k, a.hidden), recv_x);
  for (const auto& [t, name] : {std::pair<const torch::Tensor*, const char*>{&recv_x, "recv_x"},
                                {&w13, "w13"}, {&w2, "w2"}, {&result, "out"},
                                {&act, "act_workspace"}, {&partial, "partial_workspace"}})
    check_aligned16(*t, name);

  RowLists rl = row_lists(topk_ids, a.num_local_experts, a.expert_map, a.num_global_experts);
  a.x = reinterpret_cast<const petit_bf16_bits*>(recv_x.data_ptr());
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.topk_weights = topk_weights.data_ptr<float>();
  a.w13 = reinterpret_cast<const petit_bf16_bits*>(w13.data_ptr());
  a.w2 = reinterpret_cast<const petit_bf16_bits*>(w2.data_ptr());
  a.expert_offsets = rl.args.expert_offsets;
  a.sorted_entries = rl.args.sorted_entries;
  a.act = reinterpret_cast<petit_bf16_bits*>(act.data_ptr());
  a.partial = reinterpret_cast<petit_bf16_bits*>(partial.data_ptr());
  a.out = reinterpret_cast<petit_bf16_bits*>(result.data_ptr());
  // fused GEMMs (expert_fused_gemms): per-expert arrival counters and the tile claim counter,
  // zeroed by the row lists
  torch::Tensor gate_up_done;
  if (expert_fused_gemms(a)) {
    gate_up_done = torch::empty({L + 1}, rl.offsets.options());
    a.gate_up_done = rl.args.expert_done = gate_up_done.data_ptr<int32_t>();
  }
  const petitStream_t stream = c10::cuda::getCurrentCUDAStream();
  PETIT_CHECK_OK(launch_expert_row_lists(rl.args, stream), "row-list launch");
  PETIT_CHECK_OK(launch_experts(a, stream), "expert GEMM launch");
  return result;
}

// The tile family experts_forward runs for these sizes (tiles = 0: the automatic choice).
int64_t resolve_expert_tiles_for(int64_t num_rows, int64_t top_k, int64_t num_local_experts,
                                 int64_t hidden, int64_t tiles, const py::dict& config) {
  ExpertGemmArgs a{};
  a.config = expert_config_from(config);
  PETIT_CHECK(config_valid(a.config), "%s", kExpertConfigLimits);
  a.num_rows = int(num_rows);
  a.top_k = int(top_k);
  a.num_local_experts = int(num_local_experts);
  a.hidden = int(hidden);
  a.tiles = int(tiles);
  return resolve_expert_tiles(a);
}

}  // namespace

// ---- the fused layer (experts/megamoe.cu), on one GPU and on a rank of an EpContext
// The fused layer's tensors (api.h MegaMoeArgs), checked and converted for the one-GPU and the
// EP bindings: x [T, H] bf16, topk_ids [T, K] int32, topk_weights [T, K] f32, out [T, H] bf16;
// w13 [L, 2I, H] and w2 [L, H, I] bf16, or float8_e4m3fn with fp32 w13_scale [L, 2I/128, H/128]
// and w2_scale [L, H/128, I/128] (block fp8); workspaces for the experts' `expert_rows` x K
// entries: act >= entries * I bf16, partial >= entries * H f32, sync >= megamoe_sync_ints(L, H)
// int32; all on cuda:`device`. hidden, expert_rows -1: x's H and T. The callers set the rest
// (expert map, grid, timeout, trace) and run the C API's check.
MegaMoeArgs megamoe_args(const torch::Tensor& x, const torch::Tensor& topk_ids,
                         const torch::Tensor& topk_weights, const torch::Tensor& w13,
                         const torch::Tensor& w2, const c10::optional<torch::Tensor>& w13_scale,
                         const c10::optional<torch::Tensor>& w2_scale, torch::Tensor& out,
                         torch::Tensor& act, torch::Tensor& partial, torch::Tensor& sync,
                         int64_t hidden, int64_t expert_rows, int device) {
  check_tensor(x, "x", torch::kBFloat16, device, "[T, H]", {-1, hidden});
  const int64_t T = x.size(0), H = x.size(1), rows = expert_rows < 0 ? T : expert_rows;
  check_tensor(topk_ids, "topk_ids", torch::kInt32, device, "[T, K]", {T, -1});
  const int64_t K = topk_ids.size(1), B = kFp8ScaleBlock;
  check_tensor(topk_weights, "topk_weights", torch::kFloat32, device, "[T, K]", {T, K});
  const bool fp8 = w13_scale.has_value();
  const auto weight_type = fp8 ? torch::kFloat8_e4m3fn : torch::kBFloat16;
  PETIT_CHECK(w13.scalar_type() == weight_type && w2.scalar_type() == weight_type &&
                  w2_scale.has_value() == fp8,
              "w13 and w2 must be bfloat16, or float8_e4m3fn with both w13_scale and w2_scale");
  check_tensor(w2, "w2", weight_type, device, "[L, H, I]", {-1, H, -1});
  const int64_t L = w2.size(0), I = w2.size(2);
  check_tensor(w13, "w13", weight_type, device, "[L, 2I, H]", {L, 2 * I, H});
  check_tensor(out, "out", torch::kBFloat16, device, "[T, H]", {T, H});
  check_workspace(act, "act_workspace (entries x I)", torch::kBFloat16, rows * K * I, device);
  check_workspace(partial, "partial_workspace (entries x H)", torch::kFloat32, rows * K * H,
                  device);
  check_workspace(sync, "sync (megamoe_sync_ints)", torch::kInt32,
                  megamoe_sync_ints(int(L), int(H)), device);
  MegaMoeArgs a{};
  if (fp8) {  // H and I multiples of 128: megamoe_check
    check_tensor(*w13_scale, "w13_scale", torch::kFloat32, device, "[L, 2I/128, H/128]",
                 {L, 2 * I / B, H / B});
    check_tensor(*w2_scale, "w2_scale", torch::kFloat32, device, "[L, H/128, I/128]",
                 {L, H / B, I / B});
    a.w13_scale = w13_scale->data_ptr<float>();
    a.w2_scale = w2_scale->data_ptr<float>();
  }
  a.x = reinterpret_cast<const petit_bf16_bits*>(x.data_ptr());
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.topk_weights = topk_weights.data_ptr<float>();
  a.w13 = w13.data_ptr();
  a.w2 = w2.data_ptr();
  a.act = reinterpret_cast<petit_bf16_bits*>(act.data_ptr());
  a.partial = partial.data_ptr<float>();
  a.sync = sync.data_ptr<int32_t>();
  a.out = reinterpret_cast<petit_bf16_bits*>(out.data_ptr());
  a.num_rows = checked_int(T, "token count");
  a.top_k = checked_int(K, "top-k");
  a.hidden = checked_int(H, "hidden size");
  a.intermediate = checked_int(I, "intermediate size");
  a.num_local_experts = checked_int(L, "local expert count");
  return a;
}

// trace: optional int64 stamps of every block a fused launch on `num_sms` SMs may run
// (megamoe_max_blocks; kMegaMoeTraceSlots each, layout.h).
int64_t* megamoe_trace_arg(const c10::optional<torch::Tensor>& trace, int num_sms, int device) {
  if (!trace.has_value()) return nullptr;
  int64_t blocks = 0;
  PETIT_CHECK_OK(megamoe_max_blocks(num_sms, &blocks), "SM count query");
  check_workspace(*trace, "trace", torch::kInt64, blocks * kMegaMoeTraceSlots, device);
  return trace->data_ptr<int64_t>();
}

namespace {

// MegaMoE at W=1 (experts/megamoe.cu): the MoE layer in one launch. ops.megamoe_forward checks
// its arguments first and names Python's limits; here the tensors, then megamoe_check.
void megamoe_forward(const torch::Tensor& x, const torch::Tensor& topk_ids,
                     const torch::Tensor& topk_weights, const torch::Tensor& w13,
                     const torch::Tensor& w2, torch::Tensor& out, torch::Tensor& act_workspace,
                     torch::Tensor& partial_workspace, torch::Tensor& sync,
                     c10::optional<torch::Tensor> expert_map, int64_t num_sms,
                     double timeout_s, c10::optional<torch::Tensor> trace,
                     c10::optional<torch::Tensor> w13_scale,
                     c10::optional<torch::Tensor> w2_scale) {
  const int device = x.get_device();
  MegaMoeArgs a = megamoe_args(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, out,
                               act_workspace, partial_workspace, sync, -1, -1, device);
  PETIT_CHECK_CALL("", timeout_check, timeout_s);
  a.timeout_ticks = timeout_ticks(timeout_s);
  a.num_sms = checked_int(num_sms, "num_sms");
  a.expert_map = expert_map_arg(expert_map, device, &a.num_global_experts);
  PETIT_CHECK_CALL("fused MoE layer: ", megamoe_check, a);
  c10::cuda::CUDAGuard guard(x.device());
  a.trace = megamoe_trace_arg(trace, a.num_sms, device);
  PETIT_CHECK_OK(launch_megamoe(a, c10::cuda::getCurrentCUDAStream()), "fused MoE launch");
}

// ---- host-only helpers (no GPU needed): diagnostics and CPU tests
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
// on `num_blocks` SMs: host-side planning only (plan_combine_sizes), for diagnostics and CPU
// tests.
py::dict combine_plan(int64_t world_size, int64_t hidden, int64_t num_tokens,
                      int64_t region_stride, int64_t num_blocks, const py::dict& combine_config) {
  CombineArgs a{};
  int grid = 0;
  PETIT_CHECK_CALL("", plan_combine_sizes, checked_int(world_size, "world size"),
                   checked_int(hidden, "hidden size"), checked_int(num_tokens, "num_tokens"),
                   checked_int(region_stride, "region_stride"),
                   checked_int(num_blocks, "num_blocks"), combine_config_from(combine_config),
                   &a, &grid);
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

}  // namespace

void bind_kernels(py::module_& m) {
  m.def("heap_layout", &heap_layout, "Byte offsets of the heap regions (layout.h)",
        py::arg("world_size"), py::arg("max_tokens"), py::arg("hidden"), py::arg("max_top_k"));
  m.def("combine_plan", &combine_plan,
        "What a combine launches (host-side plan, no GPU needed): {send_chunks, whole_pairs, "
        "send_blocks, reduce_chunks, static_reduce, grid}",
        py::arg("world_size"), py::arg("hidden"), py::arg("num_tokens"),
        py::arg("region_stride"), py::arg("num_blocks"), py::arg("combine_config") = py::dict());
  m.def("config_defaults", &config_defaults,
        "{'ExpertConfig': {...}, 'CombineConfig': {...}}: the defaults of csrc/common/config.h");
  m.def("float_to_e4m3", &float_to_e4m3,
        "Host run of dispatch's float32 -> fp8 e4m3fn conversion (csrc/common/fp8.h): uint8 codes",
        py::arg("values"));
  m.attr("kMegaMoeMaxEntries") = kMegaMoeMaxEntries;
  m.attr("kMegaMoeSizeMultiple") = kMegaMoeSizeMultiple;
  m.def("megamoe_sync_ints", &megamoe_sync_ints,
        "Elements of the fused layer's int32 sync buffer", py::arg("num_local_experts"),
        py::arg("hidden"));
  m.def("sm90a_kernels_supported", &sm90a_kernels_supported,
        "Whether this build has sm_90a images and the current device runs them (the Hopper "
        "GEMM family, the fused layer)");
  m.def("megamoe_forward", &megamoe_forward,
        "Fused MoE layer (W=1) in one launch: x [N,H] bf16, topk_ids [N,K] int32, topk_weights "
        "[N,K] f32, w13 [L,2I,H], w2 [L,H,I] -> out [N,H] (written in full)",
        py::arg("x"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("w13"),
        py::arg("w2"), py::arg("out"), py::arg("act_workspace"), py::arg("partial_workspace"),
        py::arg("sync"), py::arg("expert_map") = py::none(), py::arg("num_sms") = 0,
        py::arg("timeout_s") = double(kDefaultTimeoutS), py::arg("trace") = py::none(),
        py::arg("w13_scale") = py::none(), py::arg("w2_scale") = py::none());
  m.def("expert_row_lists", &expert_row_lists,
        "Routing block [N,K] int32 (local ids, or global ids with expert_map [E] int32) -> "
        "(counts [L], offsets [L+1], sorted_entries [N*K])",
        py::arg("topk_ids"), py::arg("num_local_experts"), py::arg("expert_map") = py::none());
  m.def("experts_forward", &experts_forward,
        "Local experts with the local weighted reduction: recv_x [N,H] bf16, recv_topk_ids "
        "[N,K] int32 local ids or -1 (global ids with expert_map [E] int32), recv_topk_weights "
        "[N,K] f32, w13 [L,2I,H] bf16, w2 [L,H,I] bf16 -> out [N,H] bf16",
        py::arg("recv_x"), py::arg("recv_topk_ids"), py::arg("recv_topk_weights"),
        py::arg("w13"), py::arg("w2"), py::arg("out") = py::none(),
        py::arg("act_workspace") = py::none(), py::arg("partial_workspace") = py::none(),
        py::arg("tiles") = 0, py::arg("expert_map") = py::none(), py::arg("config") = py::dict());
  m.def("resolve_expert_tiles", &resolve_expert_tiles_for,
        "Tile family (1 simt, 2 wgmma_narrow, 3 wgmma_m64, 4 wgmma, 5 wgmma_mc) experts_forward "
        "runs for these sizes (and ExpertConfig dict) on the current device",
        py::arg("num_rows"), py::arg("top_k"), py::arg("num_local_experts"), py::arg("hidden"),
        py::arg("tiles") = 0, py::arg("config") = py::dict());
  m.def(
      "last_expert_gemm_launch",
      [](bool gate_up) {
        const ExpertLaunchShape s = last_expert_gemm_launch(gate_up);
        return py::make_tuple(s.grid, s.threads, s.smem_bytes, s.cluster);
      },
      "(grid, threads, dynamic smem bytes, CTAs per cluster) of this process's latest gate/up "
      "or down GEMM launch; zeros before the first",
      py::arg("gate_up"));
}

}  // namespace binding
}  // namespace petit
