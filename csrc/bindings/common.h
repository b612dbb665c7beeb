// The torch binding's shared part: the check macros (messages formatted with snprintf), the
// conversions of Python config dicts, and the tensor checks every binding file uses. The
// binding files: kernels.cpp (the expert kernels, the fused layer, host-only helpers),
// ep_context.cpp (EpContext), module.cpp (the pybind11 module). The C API (api.h,
// comm/ep_context.h) owns every limit and its check; the binding raises their messages as they
// are. Nothing here branches on the platform.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <utility>

#include "api.h"

namespace petit {
namespace binding {

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

inline int checked_int(int64_t value, const char* name) {
  PETIT_CHECK(value >= INT32_MIN && value <= INT32_MAX, "%s %lld does not fit 32 bits", name,
              (long long)value);
  return int(value);
}

// ---- configs (common/config.h) from Python: {field: int} dicts (vllm_petit_moe/config.py),
// read through the header's field tables; an unknown field is an error, a missing one keeps
// its default. Values are checked where the config is used (experts_check, combine_check,
// EpContext).
template <class Config, size_t kNumFields>
inline Config config_from(const py::dict& d, const char* struct_name,
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

inline CombineConfig combine_config_from(const py::dict& d) {
  return config_from<CombineConfig>(d, "CombineConfig", kCombineConfigFields);
}

// ---- tensor checks
inline std::string dtype_name(torch::ScalarType dtype) {
  return std::string(c10::getDtypeNames(dtype).first);
}

// "[2, *, 16]" (-1: any size).
inline std::string sizes_text(c10::IntArrayRef sizes) {
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
inline void check_tensor(const torch::Tensor& t, const char* name, torch::ScalarType dtype,
                         int device, const char* shape, c10::IntArrayRef sizes) {
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

// The fused layer's tensors as api.h MegaMoeArgs, checked (kernels.cpp; the one-GPU and the EP
// bindings share it), and its optional trace buffer.
MegaMoeArgs megamoe_args(const torch::Tensor& x, const torch::Tensor& topk_ids,
                         const torch::Tensor& topk_weights, const torch::Tensor& w13,
                         const torch::Tensor& w2, const c10::optional<torch::Tensor>& w13_scale,
                         const c10::optional<torch::Tensor>& w2_scale, torch::Tensor& out,
                         torch::Tensor& act, torch::Tensor& partial, torch::Tensor& sync,
                         int64_t hidden, int64_t expert_rows, int device);
int64_t* megamoe_trace_arg(const c10::optional<torch::Tensor>& trace, int num_sms, int device);

// Each binding file's part of the module (module.cpp calls them).
void bind_kernels(py::module_& m);
void bind_ep_context(py::module_& m);

}  // namespace binding
}  // namespace petit
