// The pybind11 module: its constants and each binding file's part (bindings/common.h).
#include "bindings/common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vllm-petit-moe compiled kernels (symmetric heap, dispatch/combine, routing, experts)";
  m.attr("kTokenGroupSize") = petit::kTokenGroupSize;
  m.attr("kMinChunkVectors") = petit::kMinChunkVectors;
  m.attr("kMaxTopK") = petit::kMaxTopK;
  m.attr("kMaxWorldSize") = petit::kMaxWorldSize;
  m.attr("kMaxExperts") = petit::kMaxExperts;
  m.attr("kCombineTraceSlots") = int(petit::kCombineTraceSlots);
  m.attr("kTimerTicksPerSecond") = petit_timer_ticks_per_second();
  petit::binding::bind_kernels(m);
  petit::binding::bind_ep_context(m);
}
