// csrc/comm/heap.cpp on a fake CUDA driver, for tests without a GPU: what SymmetricHeap does
// with the peers' descriptors (every one closed on every path) and its teardown.
//
// Built by tests/test_heap_fds_emu_cpu.py:
//   g++ -std=c++17 -O1 -shared -fPIC -pthread -I csrc -I $CUDA_HOME/include \
//       tests/emu/heap_emu.cpp -o heap_emu.so
#include "comm/heap.cpp"

// Referenced by petit_vmm_load (never called: the fake driver is marked loaded).
cudaError_t cudaGetDriverEntryPointByVersion(const char*, void**, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult*) {
  return cudaErrorNotSupported;
}

namespace {

int g_fail_fd = -1;        // the import of this descriptor fails
int g_live_handles = 0;    // created + imported - released
int g_fail_reserve = 0;    // the address reservation fails
char g_range[1 << 16];

CUresult fake_create(CUmemGenericAllocationHandle* h, size_t, const CUmemAllocationProp*,
                     unsigned long long) {
  *h = 1000;
  ++g_live_handles;
  return CUDA_SUCCESS;
}
CUresult fake_release(CUmemGenericAllocationHandle) {
  --g_live_handles;
  return CUDA_SUCCESS;
}
CUresult fake_import(CUmemGenericAllocationHandle* h, void* fd, CUmemAllocationHandleType) {
  if (int(uintptr_t(fd)) == g_fail_fd) return CUDA_ERROR_INVALID_VALUE;
  *h = CUmemGenericAllocationHandle(uintptr_t(fd));
  ++g_live_handles;
  return CUDA_SUCCESS;
}
CUresult fake_reserve(CUdeviceptr* p, size_t, size_t, CUdeviceptr, unsigned long long) {
  if (g_fail_reserve) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = CUdeviceptr(g_range);
  return CUDA_SUCCESS;
}
CUresult fake_ok_free(CUdeviceptr, size_t) { return CUDA_SUCCESS; }
CUresult fake_map(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) {
  return CUDA_SUCCESS;
}
CUresult fake_set_access(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) {
  return CUDA_SUCCESS;
}
CUresult fake_granularity(size_t* g, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) {
  *g = 4096;
  return CUDA_SUCCESS;
}
CUresult fake_error_string(CUresult, const char** s) {
  *s = "fake driver error";
  return CUDA_SUCCESS;
}

}  // namespace

// Creates a 4 KiB heap on the fake driver and maps `fds` (fds[r] for r != rank) into it. The
// import of descriptor `fail_fd` fails; `fail_reserve`: the range reservation fails. Returns
// the first failing petitError_t (0: none), its message in `err`; *live_handles: handles alive
// after the heap is destroyed (0: all released).
extern "C" int petit_emu_heap_map(const int* fds, int world_size, int rank, int fail_fd,
                                  int fail_reserve, char* err, int err_len,
                                  int* live_handles) {
  PetitDriverApi& api = petit_driver();
  api.mem_create = fake_create;
  api.mem_release = fake_release;
  api.mem_import = fake_import;
  api.address_reserve = fake_reserve;
  api.address_free = fake_ok_free;
  api.map = fake_map;
  api.unmap = fake_ok_free;
  api.set_access = fake_set_access;
  api.granularity = fake_granularity;
  api.error_string = fake_error_string;
  api.loaded = true;
  g_fail_fd = fail_fd;
  g_fail_reserve = fail_reserve;
  g_live_handles = 0;
  petit::SymmetricHeap* heap = nullptr;
  int result = int(petit::SymmetricHeap::create(0, 4096, &heap, err, err_len));
  if (result == 0) {
    result = int(heap->map_all(fds, world_size, rank, err, err_len));
    delete heap;
  }
  *live_handles = g_live_handles;
  return result;
}
