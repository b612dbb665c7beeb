// Linearized symmetric heap: each rank's allocation is created with the virtual-memory API
// and a POSIX file-descriptor handle; all W allocations are mapped into ONE reserved range,
// so rank r's heap is at base + r * stride on every rank. The descriptors travel between
// processes in Python (SCM_RIGHTS over Unix sockets, vllm_petit_moe/rendezvous.py).
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "api.h"

namespace petit {

namespace {

void format_error(char* err, int err_len, const char* fmt, ...) {
  if (err == nullptr || err_len <= 0) return;
  va_list args;
  va_start(args, fmt);
  vsnprintf(err, size_t(err_len), fmt, args);
  va_end(args);
}

// Runs one VMM call; on failure writes "<what> failed: <message>" and returns.
#define PETIT_VMM_CHECK(call, ...)                                                   \
  do {                                                                               \
    petitVmmResult _res = (call);                                                    \
    if (_res != petitVmmResult(0)) {                                                 \
      char _what[256];                                                               \
      snprintf(_what, sizeof(_what), __VA_ARGS__);                                   \
      format_error(err, err_len, "%s failed: %s (code %d)", _what,                   \
                   petit_vmm_error_string(_res), int(_res));                         \
      return petitErrorNotSupported;                                                 \
    }                                                                                \
  } while (0)

petitMemAllocationProp make_prop(int device) {
  petitMemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = PETIT_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = PETIT_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.PETIT_MEM_PROP_HANDLE_TYPE = PETIT_MEM_HANDLE_TYPE_POSIX_FD;
  return prop;
}

// Closes the peers' descriptors (every entry but `rank`'s that is >= 0).
void close_peer_fds(const int* peer_fds, int world_size, int rank) {
  for (int r = 0; r < world_size; ++r)
    if (r != rank && peer_fds[r] >= 0) close(peer_fds[r]);
}

}  // namespace

petitError_t SymmetricHeap::create(int device, int64_t bytes, SymmetricHeap** out, char* err,
                                   int err_len) {
  *out = nullptr;
  if (bytes <= 0) {
    format_error(err, err_len, "heap size must be positive, got %lld", (long long)bytes);
    return petitErrorInvalidValue;
  }
  PETIT_VMM_CHECK(petit_vmm_load(), "loading the CUDA virtual-memory driver API");
  const petitMemAllocationProp prop = make_prop(device);
  size_t granularity = 0;
  PETIT_VMM_CHECK(petit_vmm_granularity(&granularity, &prop),
                  "query of the allocation granularity on device %d", device);
  SymmetricHeap* heap = new SymmetricHeap();
  heap->device_ = device;
  heap->bytes_ = bytes;
  heap->granularity_ = int64_t(granularity);
  heap->stride_ = align_up(bytes, int64_t(granularity));
  petitVmmResult res = petit_vmm_create(&heap->local_handle_, size_t(heap->stride_), &prop);
  if (res != petitVmmResult(0)) {
    delete heap;
    PETIT_VMM_CHECK(res, "allocation of a %lld-byte heap with a POSIX fd handle on device %d",
                    (long long)bytes, device);
  }
  heap->has_local_handle_ = true;
  *out = heap;
  return petitSuccess;
}

petitError_t SymmetricHeap::export_fd(int* fd, char* err, int err_len) {
  *fd = -1;
  PETIT_VMM_CHECK(petit_vmm_export_fd(fd, local_handle_), "export of the heap handle");
  return petitSuccess;
}

petitError_t SymmetricHeap::map_all(const int* peer_fds, int world_size, int rank, char* err,
                                    int err_len) {
  // Every peer descriptor is closed here, on every path: an open descriptor of a peer's
  // allocation keeps that allocation alive for the life of this process, also after a
  // failed setup has fallen back.
  if (mapped_ || peer_handles_ != nullptr) {
    close_peer_fds(peer_fds, world_size, rank);
    format_error(err, err_len, "heap is already mapped");
    return petitErrorInvalidValue;
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    close_peer_fds(peer_fds, world_size, rank);
    format_error(err, err_len, "rank %d outside a world of %d", rank, world_size);
    return petitErrorInvalidValue;
  }
  world_size_ = world_size;
  peer_handles_ = new petitMemHandle_t[world_size];
  imported_ = new bool[world_size]();
  // Import every peer's allocation (the imported handle keeps it alive, so each fd is closed
  // at once); after the first failure the rest are only closed.
  petitVmmResult import_res = petitVmmResult(0);
  int failed_rank = -1;
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) {
      peer_handles_[r] = local_handle_;
      continue;
    }
    if (failed_rank < 0) {
      import_res = peer_fds[r] >= 0 ? petit_vmm_import_fd(&peer_handles_[r], peer_fds[r])
                                    : petitVmmResult(1);  // no descriptor: invalid value
      if (import_res == petitVmmResult(0))
        imported_[r] = true;
      else
        failed_rank = r;
    }
    if (peer_fds[r] >= 0) close(peer_fds[r]);
  }
  PETIT_VMM_CHECK(import_res, "import of rank %d's heap handle", failed_rank);
  const size_t total = size_t(stride_) * size_t(world_size);
  PETIT_VMM_CHECK(petit_vmm_reserve(&base_, total, size_t(granularity_)),
                  "reservation of a %zu-byte virtual range for %d heaps", total, world_size);
  for (int r = 0; r < world_size; ++r) {
    PETIT_VMM_CHECK(petit_vmm_map(base_ + int64_t(r) * stride_, size_t(stride_), peer_handles_[r]),
                    "mapping rank %d's heap into the linear range", r);
    num_mapped_ = r + 1;
  }
  petitMemAccessDesc access;
  memset(&access, 0, sizeof(access));
  access.location.type = PETIT_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = PETIT_MEM_ACCESS_FLAGS_PROT_READWRITE;
  PETIT_VMM_CHECK(petit_vmm_set_access(base_, total, &access),
                  "granting device %d access to all %d heaps (the GPUs of this node cannot "
                  "access each other: no peer-to-peer path)", device_, world_size);
  mapped_ = true;
  return petitSuccess;
}

void SymmetricHeap::release() {
  // Teardown in reverse: unmap, free the range, release imported and local handles. Best
  // effort (also run by the destructor): a failed step does not stop the later ones.
  for (int r = 0; r < num_mapped_; ++r)
    (void)petit_vmm_unmap(base_ + int64_t(r) * stride_, size_t(stride_));
  num_mapped_ = 0;
  mapped_ = false;
  if (base_ != nullptr)
    (void)petit_vmm_address_free(base_, size_t(stride_) * size_t(world_size_));
  base_ = nullptr;
  if (peer_handles_ != nullptr) {
    for (int r = 0; r < world_size_; ++r)
      if (imported_[r]) (void)petit_vmm_release(peer_handles_[r]);
    delete[] peer_handles_;
    delete[] imported_;
    peer_handles_ = nullptr;
    imported_ = nullptr;
  }
  if (has_local_handle_) (void)petit_vmm_release(local_handle_);
  has_local_handle_ = false;
}

SymmetricHeap::~SymmetricHeap() { release(); }

}  // namespace petit
