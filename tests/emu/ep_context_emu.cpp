// csrc/comm/ep_context.cpp (with comm/heap.cpp) on a fake runtime, for tests without a GPU:
// the context's checks, its state machine (map_peers, the launches, close, the views' share of
// the memory, the heartbeat page) and its error paths. Its launches run the real dispatch and
// combine kernels on the CPU emulation (emu_runtime.h).
//
// The seam: ep_context.cpp reaches the runtime only through platform.h's petit* names, and
// heap.cpp the virtual-memory API only through the petit_driver() table. Here those names are
// redefined, as emu_runtime.h does for the kernels' launches, to a fake runtime on host
// memory that logs its calls and fails one on request (fake_rt), and the table gets a fake
// driver whose allocations are memfds mapped into the reserved range with mmap (fake_vmm), so
// two contexts in one process share heap memory through exported descriptors as two ranks'
// processes do.
//
// Built by tests/test_ep_context_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/ep_context_emu.cpp -o ep_context_emu.so
#include "emu_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/dispatch_combine.cu"
#include "experts/megamoe.cu"  // EpContext::megamoe's check and launcher

// ---- the fake runtime: host memory for device memory, every call logged.
namespace fake_rt {

std::mutex mutex;
std::string log;                    // "call;call;..." since the last reset
std::string failing;                // the call that fails when next made (once)
int live_device = 0, live_host = 0, live_registered = 0;
const volatile uint64_t* watched = nullptr;  // a registered heartbeat page's word, or nullptr
int watched_rank = 0;

// Logs `call`; true where it is the one to fail.
bool made(const std::string& call) {
  std::lock_guard<std::mutex> lock(mutex);
  log += call + ";";
  if (failing != call) return false;
  failing.clear();
  return true;
}

cudaError_t malloc_device(void** ptr, size_t bytes) {
  if (made("malloc")) return cudaErrorMemoryAllocation;
  *ptr = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  ++live_device;
  return cudaSuccess;
}
cudaError_t free_device(void* ptr) {
  made("free");
  std::free(ptr);
  --live_device;
  return cudaSuccess;
}
cudaError_t memset_device(void* ptr, int value, size_t bytes) {
  if (made("memset")) return cudaErrorInvalidValue;
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}
// Logs whether the watched heartbeat word carried the aborted mark when the device was waited
// for (close: the device first, with the beat still live); "(unmapped)" where a page still
// registered is no longer mapped.
cudaError_t synchronize() {
  unsigned char resident = 0;
  const char* beat =
      watched == nullptr ? ""
      : mincore(const_cast<uint64_t*>(watched), 1, &resident) != 0 ? "(unmapped)"
      : (watched[watched_rank] & petit::kHeartbeatAborted)          ? "(aborted)"
                                                                    : "(beating)";
  if (made(std::string("synchronize") + beat)) return cudaErrorLaunchFailure;
  return cudaSuccess;
}
cudaError_t host_alloc(void** ptr, size_t bytes) {
  if (made("host_alloc")) return cudaErrorMemoryAllocation;
  *ptr = std::malloc(bytes);
  ++live_host;
  return cudaSuccess;
}
cudaError_t free_host(void* ptr) {
  made("free_host");
  std::free(ptr);
  --live_host;
  return cudaSuccess;
}
cudaError_t host_device_pointer(void** device_ptr, void* host_ptr) {
  if (made("host_device_pointer")) return cudaErrorInvalidValue;
  *device_ptr = host_ptr;
  return cudaSuccess;
}
cudaError_t host_register(void* ptr, size_t) {
  if (made("host_register")) return cudaErrorHostMemoryAlreadyRegistered;
  ++live_registered;
  watched = static_cast<const volatile uint64_t*>(ptr);
  return cudaSuccess;
}
cudaError_t host_unregister(void*) {
  made("host_unregister");
  --live_registered;
  watched = nullptr;
  return cudaSuccess;
}
cudaError_t set_device(int device) {
  made("set_device " + std::to_string(device));
  return cudaSuccess;
}
const char* error_string(cudaError_t) { return "fake runtime error"; }

}  // namespace fake_rt

#undef petitMalloc
#define petitMalloc fake_rt::malloc_device
#undef petitFree
#define petitFree fake_rt::free_device
#undef petitMemset
#define petitMemset fake_rt::memset_device
#undef petitDeviceSynchronize
#define petitDeviceSynchronize fake_rt::synchronize
#undef petitHostAlloc
#define petitHostAlloc(ptr, size) fake_rt::host_alloc(ptr, size)
#undef petitFreeHost
#define petitFreeHost fake_rt::free_host
#undef petitHostGetDevicePointer
#define petitHostGetDevicePointer(dptr, hptr) fake_rt::host_device_pointer(dptr, hptr)
#undef petitHostRegisterMapped
#define petitHostRegisterMapped(ptr, size) fake_rt::host_register(ptr, size)
#undef petitHostUnregister
#define petitHostUnregister fake_rt::host_unregister
#undef petitSetDevice
#define petitSetDevice fake_rt::set_device
#undef petitGetErrorString
#define petitGetErrorString fake_rt::error_string

#include "comm/ep_context.cpp"
#include "comm/heap.cpp"

// Referenced by petit_vmm_load (never called: the fake driver is marked loaded).
cudaError_t cudaGetDriverEntryPointByVersion(const char*, void**, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult*) {
  return cudaErrorNotSupported;
}

// ---- the fake virtual-memory driver: an allocation is a memfd (its handle the descriptor),
// the reserved range an inaccessible anonymous mapping, a mapping the memfd mapped over it.
namespace fake_vmm {

int live_handles = 0, live_maps = 0, live_ranges = 0;

CUresult create(CUmemGenericAllocationHandle* h, size_t bytes, const CUmemAllocationProp*,
                unsigned long long) {
  if (fake_rt::made("mem_create")) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("petit-fake-heap", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, off_t(bytes)) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *h = CUmemGenericAllocationHandle(fd);
  ++live_handles;
  return CUDA_SUCCESS;
}
CUresult release(CUmemGenericAllocationHandle h) {
  fake_rt::made("mem_release");
  close(int(h));
  --live_handles;
  return CUDA_SUCCESS;
}
CUresult export_fd(void* fd, CUmemGenericAllocationHandle h, CUmemAllocationHandleType,
                   unsigned long long) {
  if (fake_rt::made("mem_export")) return CUDA_ERROR_INVALID_VALUE;
  *static_cast<int*>(fd) = dup(int(h));
  return CUDA_SUCCESS;
}
CUresult import_fd(CUmemGenericAllocationHandle* h, void* fd, CUmemAllocationHandleType) {
  if (fake_rt::made("mem_import")) return CUDA_ERROR_INVALID_VALUE;
  const int handle = dup(int(uintptr_t(fd)));  // the caller closes its descriptor
  if (handle < 0) return CUDA_ERROR_INVALID_VALUE;
  *h = CUmemGenericAllocationHandle(handle);
  ++live_handles;
  return CUDA_SUCCESS;
}
CUresult reserve(CUdeviceptr* p, size_t bytes, size_t, CUdeviceptr, unsigned long long) {
  if (fake_rt::made("address_reserve")) return CUDA_ERROR_OUT_OF_MEMORY;
  void* range = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
  if (range == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = CUdeviceptr(range);
  ++live_ranges;
  return CUDA_SUCCESS;
}
CUresult address_free(CUdeviceptr p, size_t bytes) {
  fake_rt::made("address_free");
  munmap(reinterpret_cast<void*>(p), bytes);
  --live_ranges;
  return CUDA_SUCCESS;
}
CUresult map(CUdeviceptr p, size_t bytes, size_t offset, CUmemGenericAllocationHandle h,
             unsigned long long) {
  if (fake_rt::made("map")) return CUDA_ERROR_INVALID_VALUE;
  if (mmap(reinterpret_cast<void*>(p), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
           int(h), off_t(offset)) == MAP_FAILED)
    return CUDA_ERROR_INVALID_VALUE;
  ++live_maps;
  return CUDA_SUCCESS;
}
CUresult unmap(CUdeviceptr p, size_t bytes) {
  fake_rt::made("unmap");
  mmap(reinterpret_cast<void*>(p), bytes, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  --live_maps;
  return CUDA_SUCCESS;
}
CUresult set_access(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) {
  return fake_rt::made("set_access") ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult granularity(size_t* g, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) {
  *g = size_t(sysconf(_SC_PAGESIZE));
  return CUDA_SUCCESS;
}
CUresult error_string(CUresult, const char** s) {
  *s = "fake driver error";
  return CUDA_SUCCESS;
}

}  // namespace fake_vmm

namespace {

// Copies a caught message into err; returns -1.
int refused(const std::exception& e, char* err, int err_len) {
  snprintf(err, size_t(err_len), "%s", e.what());
  return -1;
}

// A view of context memory kept by the test (the binding's tensor view holds the same share).
struct View {
  petit::OwnedPtr ptr;
};

}  // namespace

// Resets the fake runtime and driver: no failing call, an empty log, the emulated device's SM
// count and occupancy; installs the fake driver.
extern "C" void petit_emu_rt_reset(int sm_count) {
  PetitDriverApi& api = petit_driver();
  api.mem_create = fake_vmm::create;
  api.mem_release = fake_vmm::release;
  api.mem_export = fake_vmm::export_fd;
  api.mem_import = fake_vmm::import_fd;
  api.address_reserve = fake_vmm::reserve;
  api.address_free = fake_vmm::address_free;
  api.map = fake_vmm::map;
  api.unmap = fake_vmm::unmap;
  api.set_access = fake_vmm::set_access;
  api.granularity = fake_vmm::granularity;
  api.error_string = fake_vmm::error_string;
  api.loaded = true;
  std::lock_guard<std::mutex> lock(fake_rt::mutex);
  fake_rt::log.clear();
  fake_rt::failing.clear();
  emu::sm_count = sm_count;
}

// The next call of this name fails (once): malloc, memset, synchronize..., host_alloc,
// host_device_pointer, host_register, mem_create, mem_export, mem_import, address_reserve,
// map, set_access.
extern "C" void petit_emu_rt_fail(const char* call) {
  std::lock_guard<std::mutex> lock(fake_rt::mutex);
  fake_rt::failing = call;
}

// The calls made since the last reset or take, then an empty log; "call;call;...".
extern "C" void petit_emu_rt_take_log(char* out, int out_len) {
  std::lock_guard<std::mutex> lock(fake_rt::mutex);
  snprintf(out, size_t(out_len), "%s", fake_rt::log.c_str());
  fake_rt::log.clear();
}

// What is alive: device allocations, host allocations, registered pages, VMM handles, mapped
// heaps, reserved ranges.
extern "C" void petit_emu_rt_live(int* counts) {
  counts[0] = fake_rt::live_device;
  counts[1] = fake_rt::live_host;
  counts[2] = fake_rt::live_registered;
  counts[3] = fake_vmm::live_handles;
  counts[4] = fake_vmm::live_maps;
  counts[5] = fake_vmm::live_ranges;
}

// An EpContext of these sizes on device 0 (default CombineConfig but reduce_pct), its waits
// through a run_blocking that logs "blocking{" and "}blocking" around them; nullptr with the
// constructor's message in err.
extern "C" void* petit_emu_ctx_create(int rank, int world_size, int max_tokens, int hidden,
                                      int max_top_k, int num_experts, int num_blocks,
                                      double timeout_s, int reduce_pct, char* err,
                                      int err_len) {
  petit::EpContextParams p;
  p.rank = rank;
  p.world_size = world_size;
  p.max_tokens = max_tokens;
  p.hidden = hidden;
  p.max_top_k = max_top_k;
  p.num_experts = num_experts;
  p.num_blocks = num_blocks;
  p.timeout_s = timeout_s;
  p.combine_config.reduce_pct = reduce_pct;
  p.run_blocking = [](const std::function<void()>& wait) {
    fake_rt::made("blocking{");
    wait();
    fake_rt::made("}blocking");
  };
  try {
    return new petit::EpContext(p);
  } catch (const std::runtime_error& e) {
    refused(e, err, err_len);
    return nullptr;
  }
}

extern "C" void petit_emu_ctx_destroy(void* ctx) { delete static_cast<petit::EpContext*>(ctx); }

extern "C" void petit_emu_ctx_close(void* ctx) { static_cast<petit::EpContext*>(ctx)->close(); }

extern "C" int petit_emu_ctx_export_fd(void* ctx, char* err, int err_len) {
  try {
    return static_cast<petit::EpContext*>(ctx)->export_fd();
  } catch (const std::runtime_error& e) {
    return refused(e, err, err_len);
  }
}

extern "C" int petit_emu_ctx_map_peers(void* ctx, const int* fds, int num_fds, char* err,
                                       int err_len) {
  try {
    static_cast<petit::EpContext*>(ctx)->map_peers(std::vector<int>(fds, fds + num_fds));
    return 0;
  } catch (const std::runtime_error& e) {
    return refused(e, err, err_len);
  }
}

extern "C" int petit_emu_ctx_attach_heartbeat(void* ctx, const char* name, int create,
                                              double period_s, double max_wait_s, char* err,
                                              int err_len) {
  auto* c = static_cast<petit::EpContext*>(ctx);
  try {
    c->attach_heartbeat(name, create != 0, period_s, max_wait_s);
    fake_rt::watched_rank = c->rank();
    return 0;
  } catch (const std::runtime_error& e) {
    return refused(e, err, err_len);
  }
}

extern "C" void petit_emu_ctx_unlink_heartbeat(const char* name) {
  petit::EpContext::unlink_heartbeat(name);
}

extern "C" void petit_emu_ctx_abort(void* ctx) { static_cast<petit::EpContext*>(ctx)->abort(); }

// A view of `num_bytes` at `offset` of rank `rank`'s heap (*view: release it with
// petit_emu_view_release; *address: where it starts).
extern "C" int petit_emu_ctx_heap_view(void* ctx, int rank, long long offset,
                                       long long num_bytes, void** view, void** address,
                                       char* err, int err_len) {
  try {
    auto* v = new View{static_cast<petit::EpContext*>(ctx)->heap_view(rank, offset, num_bytes)};
    *view = v;
    *address = v->ptr.ptr;
    return 0;
  } catch (const std::runtime_error& e) {
    return refused(e, err, err_len);
  }
}

// The context's epoch (EpState::epoch) as a view (*view, *address), as the binding's epoch().
extern "C" void petit_emu_ctx_epoch_view(void* ctx, void** view, void** address) {
  auto* v = new View{static_cast<petit::EpContext*>(ctx)->epoch()};
  *view = v;
  *address = v->ptr.ptr;
}

extern "C" void petit_emu_view_release(void* view) { delete static_cast<View*>(view); }

// The heap offset of a layout field (0 rows, 1 ids, 2 weights, 3 scales, 4 combine rows).
extern "C" long long petit_emu_ctx_offset(void* ctx, int field) {
  const petit::HeapLayout& l = static_cast<petit::EpContext*>(ctx)->layout();
  const int64_t offsets[] = {l.dispatch_rows, l.dispatch_ids, l.dispatch_weights,
                             l.dispatch_scales, l.combine_rows};
  return offsets[field];
}

// dispatch on this thread (its grid's blocks at once, as co-resident on the GPU): 0, or -1
// with the message in err. *rows: this rank's receive rows (DispatchRegions::rows).
extern "C" int petit_emu_ctx_dispatch(void* ctx, const void* x, const void* ids,
                                      const float* weights, int num_tokens, int top_k,
                                      int region_stride, int quant, void** rows, char* err,
                                      int err_len) {
  emu::grid_at_once = true;
  emu::last_error = 0;
  petit::DispatchArgs a{};
  a.x = static_cast<const petit_bf16_bits*>(x);
  a.topk_ids = ids;
  a.ids_are_int64 = true;
  a.topk_weights = weights;
  a.num_tokens = num_tokens;
  a.top_k = top_k;
  a.region_stride = region_stride;
  a.quant = quant;
  try {
    *rows = static_cast<petit::EpContext*>(ctx)->dispatch(a, nullptr).rows;
    return 0;
  } catch (const std::runtime_error& e) {
    return refused(e, err, err_len);
  }
}

extern "C" int petit_emu_ctx_combine(void* ctx, const void* expert_out, void* out,
                                     int num_tokens, int top_k, int region_stride, char* err,
                                     int err_len) {
  emu::grid_at_once = true;
  emu::last_error = 0;
  petit::CombineArgs a{};
  a.expert_out = static_cast<const petit_bf16_bits*>(expert_out);
  a.out = static_cast<petit_bf16_bits*>(out);
  a.num_tokens = num_tokens;
  a.top_k = top_k;
  a.region_stride = region_stride;
  try {
    static_cast<petit::EpContext*>(ctx)->combine(a, nullptr);
    return 0;
  } catch (const std::runtime_error& e) {
    return refused(e, err, err_len);
  }
}

// The fused EP layer's call up to its launch: sizes only (the buffers are 16-byte aligned
// placeholders, never read, since every case here is refused before the kernel runs).
extern "C" int petit_emu_ctx_megamoe_refused(void* ctx, int num_tokens, int top_k,
                                             int region_stride, int intermediate,
                                             int num_local_experts, char* err, int err_len) {
  alignas(16) static char placeholder[16];
  auto* c = static_cast<petit::EpContext*>(ctx);
  petit::MegaMoeEpArgs call{};
  petit::MegaMoeArgs& a = call.layer;
  a.x = reinterpret_cast<const petit_bf16_bits*>(placeholder);
  a.w13 = a.w2 = placeholder;
  a.topk_ids = reinterpret_cast<const int32_t*>(placeholder);
  a.topk_weights = reinterpret_cast<const float*>(placeholder);
  a.act = reinterpret_cast<petit_bf16_bits*>(placeholder);
  a.out = reinterpret_cast<petit_bf16_bits*>(placeholder);
  a.partial = reinterpret_cast<float*>(placeholder);
  a.sync = reinterpret_cast<int32_t*>(placeholder);
  a.num_rows = num_tokens;
  a.top_k = top_k;
  a.hidden = c->layout().hidden;
  a.intermediate = intermediate;
  a.num_local_experts = num_local_experts;
  call.region_stride = region_stride;
  try {
    c->megamoe(call, nullptr);
    snprintf(err, size_t(err_len), "launched");
    return 0;
  } catch (const std::runtime_error& e) {
    return refused(e, err, err_len);
  }
}

// EpContext::diagnostics: 1 with the record's error and rank, 0 once closed.
extern "C" int petit_emu_ctx_diagnostics(void* ctx, int* error, int* rank) {
  petit::EpDiagnostics d{};
  if (!static_cast<petit::EpContext*>(ctx)->diagnostics(&d)) return 0;
  *error = d.error;
  *rank = d.rank;
  return 1;
}
