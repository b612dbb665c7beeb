// The torch layer: tensors in (their device, dtype, contiguity and the shapes that relate them
// are checked here, with messages about tensors), raw pointers and sizes out to the
// framework-free C API (api.h, comm/ep_context.h), device and stream selection, and the
// pybind11 module. The C API owns every limit and its check (the *_check functions,
// timeout_check, plan_combine_sizes, EpContext): the binding raises their messages as they are.
// Nothing here branches on the platform.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "comm/ep_context.h"
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

// A C API call that gives the reason of a refusal (api.h: its last two parameters are
// `char* err, int err_len`): a refusal is raised with that message, after `prefix`.
#define PETIT_CHECK_CALL(prefix, call, ...)                                              \
  do {                                                                                  \
    char _petit_err[512] = {0};                                                         \
    PETIT_CHECK(call(__VA_ARGS__, _petit_err, int(sizeof(_petit_err))) == petitSuccess, \
                "%s%s", prefix, _petit_err);                                            \
  } while (0)

int checked_int(int64_t value, const char* name) {
  PETIT_CHECK(value >= INT32_MIN && value <= INT32_MAX, "%s %lld does not fit 32 bits", name,
              (long long)value);
  return int(value);
}

// ---- configs (common/config.h) from Python: {field: int} dicts (vllm_petit_moe/config.py),
// read through the header's field tables; an unknown field is an error, a missing one keeps
// its default. Values are checked where the config is used (experts_check, combine_check,
// EpContext).
template <class Config, size_t kNumFields>
Config config_from(const py::dict& d, const char* struct_name,
                   const std::pair<const char*, int Config::*> (&fields)[kNumFields]) {
  Config c;
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    const auto* field = std::find_if(std::begin(fields), std::end(fields),
                                     [&](const auto& f) { return key == f.first; });
    PETIT_CHECK(field != std::end(fields), "%s has no field %s", struct_name, key.c_str());
    c.*(field->second) = item.second.cast<int>();
  }
  return c;
}

ExpertConfig expert_config_from(const py::dict& d) {
  return config_from<ExpertConfig>(d, "ExpertConfig", kExpertConfigFields);
}

CombineConfig combine_config_from(const py::dict& d) {
  return config_from<CombineConfig>(d, "CombineConfig", kCombineConfigFields);
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

// ---- tensor checks
std::string dtype_name(torch::ScalarType dtype) {
  return std::string(c10::getDtypeNames(dtype).first);
}

// "[2, *, 16]" (-1: any size).
std::string sizes_text(c10::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    char size[24] = "*";
    if (sizes[i] >= 0) snprintf(size, sizeof(size), "%lld", (long long)sizes[i]);
    text += (i > 0 ? ", " : "") + std::string(size);
  }
  return text + "]";
}

// A contiguous CUDA tensor of `dtype` on cuda:`device` whose sizes are `sizes` (-1: any), which
// `shape` names in the message ("[N, K]").
void check_tensor(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int device,
                  const char* shape, c10::IntArrayRef sizes) {
  PETIT_CHECK(t.is_cuda(), "%s must be a CUDA tensor", name);
  PETIT_CHECK(t.is_contiguous(), "%s must be contiguous", name);
  bool sized = t.dim() == int64_t(sizes.size());
  for (size_t i = 0; sized && i < sizes.size(); ++i) sized = sizes[i] < 0 || t.size(i) == sizes[i];
  PETIT_CHECK(sized, "%s must be %s = %s, got %s", name, shape, sizes_text(sizes).c_str(),
              sizes_text(t.sizes()).c_str());
  PETIT_CHECK(t.scalar_type() == dtype, "%s must be %s, got %s", name, dtype_name(dtype).c_str(),
              dtype_name(t.scalar_type()).c_str());
  PETIT_CHECK(t.get_device() == device, "%s must be on cuda:%d, got cuda:%d", name, device,
              int(t.get_device()));
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
}  // namespace petit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using petit::BoundEpContext;
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
  py::class_<BoundEpContext>(m, "EpContext")
      .def(py::init(&petit::ep_create), py::arg("device"), py::arg("rank"),
           py::arg("world_size"), py::arg("max_tokens"), py::arg("hidden"), py::arg("max_top_k"),
           py::arg("num_experts"), py::arg("num_blocks"), py::arg("timeout_s"),
           py::arg("combine_config") = py::dict())
      .def("export_fd",
           [](BoundEpContext& c) {
             return int64_t(petit::translated([&] { return c.export_fd(); }));
           })
      .def(
          "attach_heartbeat",
          [](BoundEpContext& c, const std::string& name, bool create, double period_s,
             double max_wait_s) {
            petit::translated([&] { c.attach_heartbeat(name, create, period_s, max_wait_s); });
          },
          py::arg("name"), py::arg("create"), py::arg("period_s"), py::arg("max_wait_s"))
      .def_static("unlink_heartbeat", &EpContext::unlink_heartbeat, py::arg("name"))
      .def(
          "map_peers",
          [](BoundEpContext& c, const std::vector<int64_t>& fds) {
            const std::vector<int> int_fds(fds.begin(), fds.end());
            petit::translated([&] { c.map_peers(int_fds); });
          },
          py::arg("fds"))
      .def("heap_view", &petit::ep_heap_view, py::arg("rank"), py::arg("offset"),
           py::arg("num_bytes"))
      .def("dispatch", &petit::ep_dispatch, py::arg("x"), py::arg("topk_ids"),
           py::arg("topk_weights"), py::arg("region_stride"), py::arg("quant") = 0)
      .def("combine", &petit::ep_combine, py::arg("expert_out"), py::arg("out"),
           py::arg("top_k"), py::arg("region_stride"), py::arg("trace") = py::none())
      .def("megamoe", &petit::ep_megamoe, py::arg("x"), py::arg("topk_ids"),
           py::arg("topk_weights"), py::arg("w13"), py::arg("w2"), py::arg("out"),
           py::arg("act"), py::arg("partial"), py::arg("sync"), py::arg("region_stride"),
           py::arg("trace") = py::none(), py::arg("w13_scale") = py::none(),
           py::arg("w2_scale") = py::none())
      .def("peer_write", &petit::ep_peer_write, py::arg("src"), py::arg("bytes_per_peer"),
           py::arg("num_blocks"))
      .def("recv_group_counts",
           [](const BoundEpContext& c) {
             return petit::context_view(c, c.recv_group_counts(),
                                        {c.world_size(), c.layout().max_groups}, torch::kInt32);
           })
      .def("epoch",
           [](const BoundEpContext& c) {
             return petit::context_view(c, c.epoch(), {1}, torch::kInt64);
           })
      .def("diagnostics", &petit::ep_diagnostics)
      .def_property_readonly("heap_bytes",
                             [](const BoundEpContext& c) { return c.layout().total_bytes; })
      .def_property_readonly("heap_stride", &EpContext::heap_stride)
      .def_property_readonly("num_blocks",
                             [](const BoundEpContext& c) { return int64_t(c.num_blocks()); })
      .def("abort", &EpContext::abort)
      .def("close", &EpContext::close, py::call_guard<py::gil_scoped_release>());
}
