// Portability layer: the ONLY place that branches on CUDA vs HIP.
//
// Everything under csrc/ except the torch binding is framework-free and written
// against the names below. Compile with nvcc (CUDA) or hipcc -x hip (ROCm/HIP).
//
// Memory-ordering contract of the scoped atomics:
//   petit_store_release_sys(p, v)  : every write this thread made (and every write it
//                                    observed through a barrier) is visible system-wide
//                                    (all GPUs of the node) before v is.
//   petit_load_acquire_sys(p)      : writes ordered before the matching release are
//                                    visible to this thread (and, through a following
//                                    barrier, to its block) after the load returns.
//   petit_fence_sys()              : full (sequentially consistent) fence at system scope.
//   petit_fence_acq_rel_sys()      : acquire-release fence at system scope: enough for message
//                                    passing (the PTX model's release pattern is a fence.sc
//                                    or fence.acq_rel followed by a strong write), not for
//                                    store-buffering patterns; on sm_90 a MEMBAR.ALL.SYS
//                                    where petit_fence_sys is a MEMBAR.SC.SYS.
//   petit_store_relaxed_sys(p, v)  : a strong store at system scope with no ordering of its
//                                    own; right after petit_fence_sys or
//                                    petit_fence_acq_rel_sys by the same thread it publishes
//                                    like petit_store_release_sys (one fence, then several
//                                    flags).
#pragma once

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define PETIT_HIP 1
#include <hip/hip_runtime.h>
#else
#define PETIT_CUDA 1
#include <cuda_runtime.h>
#include <cuda.h>
#endif

// Arch-specific paths. PETIT_SM80_PATH: this translation unit is an nvcc (CUDA) compile, so
// the tensor-core kernels exist (their cp.async pieces need sm_80+, csrc/gemm/cp_async.h).
// PETIT_SM80_DEVICE: this is a device pass for __CUDA_ARCH__ >= 800, in which the cp.async
// wrappers emit their asm (elsewhere they are empty).
// PETIT_EMU_PTX: set (to 1) by the CPU emulation of tests/emu (emu_runtime.h), which compiles
// the tensor-core sources as host code and routes every PTX wrapper of csrc/gemm/ to an
// emulation (tests/emu/emu_ptx.h, which also emulates ldmatrix / mma.sync); 0 in every real
// build.
#ifndef PETIT_EMU_PTX
#define PETIT_EMU_PTX 0
#endif
#if (PETIT_CUDA && defined(__CUDACC__)) || PETIT_EMU_PTX
#define PETIT_SM80_PATH 1
#else
#define PETIT_SM80_PATH 0
#endif
#if PETIT_CUDA && defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
#define PETIT_SM80_DEVICE 1
#endif
#endif
#ifndef PETIT_SM80_DEVICE
#define PETIT_SM80_DEVICE 0
#endif
// PETIT_SM90A_DEVICE: a device pass for sm_90a (Hopper with its arch-specific features: wgmma),
// the only pass in which the wgmma kernels (csrc/gemm/sm90_*.h) have a body. PETIT_SM90A_BUILT
// (set by setup.py when TORCH_CUDA_ARCH_LIST names 9.0a): the host code may launch them on a
// compute-capability 9.0 device, which then runs the sm_90a image.
#if PETIT_CUDA && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PETIT_SM90A_DEVICE 1
#else
#define PETIT_SM90A_DEVICE 0
#endif
#ifndef PETIT_SM90A_BUILT
#define PETIT_SM90A_BUILT 0
#endif
// The tensor-core kernels have a body: in the device passes that can run them, and under the
// CPU emulation.
#define PETIT_SM80_BODY (PETIT_SM80_DEVICE || PETIT_EMU_PTX)
#define PETIT_SM90A_BODY (PETIT_SM90A_DEVICE || PETIT_EMU_PTX)

// A kernel's dynamic shared memory (the bytes given at launch), 128-byte aligned.
#define PETIT_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]

#define PETIT_HOST_DEVICE __host__ __device__ __forceinline__
#define PETIT_DEVICE __device__ __forceinline__
#define PETIT_GLOBAL __global__

// Launch bounds with an occupancy target (CUDA: minimum resident blocks per SM, which caps
// the registers per thread). HIP-Clang turns the second argument into a waves-per-EU minimum
// that caps VGPRs hard enough to push the SIMT GEMM tiles into scratch on gfx90a, so on AMD
// only the block size is given; AMD occupancy tuning belongs to the arch-specific paths.
#if PETIT_HIP
#define PETIT_LAUNCH_BOUNDS(max_threads, min_blocks) __launch_bounds__(max_threads)
#else
#define PETIT_LAUNCH_BOUNDS(max_threads, min_blocks) __launch_bounds__(max_threads, min_blocks)
#endif

// ---------------------------------------------------------------- runtime API
#if PETIT_HIP
typedef hipError_t petitError_t;
typedef hipStream_t petitStream_t;
#define petitSuccess hipSuccess
#define petitErrorInvalidValue hipErrorInvalidValue
#define petitErrorNotSupported hipErrorNotSupported
#define petitErrorCooperativeLaunchTooLarge hipErrorCooperativeLaunchTooLarge
#define petitGetErrorString hipGetErrorString
#define petitGetLastError hipGetLastError
#define petitGetDevice hipGetDevice
#define petitSetDevice hipSetDevice
#define petitDeviceGetAttribute hipDeviceGetAttribute
#define petitDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define petitDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define petitDevAttrComputeCapabilityMinor hipDeviceAttributeComputeCapabilityMinor
#define petitDevAttrL2CacheSize hipDeviceAttributeL2CacheSize
#define petitDeviceCanAccessPeer hipDeviceCanAccessPeer
#define petitDeviceGetPCIBusId hipDeviceGetPCIBusId
#define petitDeviceGetByPCIBusId hipDeviceGetByPCIBusId
#define petitMemsetAsync hipMemsetAsync
#define petitMemcpy hipMemcpy
#define petitMemcpyDefault hipMemcpyDefault
#define petitDeviceSynchronize hipDeviceSynchronize
#define petitFuncSetAttribute hipFuncSetAttribute
#define petitFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define petitFuncAttributePreferredSharedMemoryCarveout \
  hipFuncAttributePreferredSharedMemoryCarveout
#define petitFuncGetAttributes hipFuncGetAttributes
#define petitOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
typedef hipFuncAttributes petitFuncAttributes;
#define petitHostAlloc(ptr, size) hipHostMalloc(ptr, size, hipHostMallocMapped)
#define petitHostGetDevicePointer(dptr, hptr) hipHostGetDevicePointer(dptr, hptr, 0)
#define petitFreeHost hipHostFree
#define petitHostRegisterMapped(ptr, size) \
  hipHostRegister(ptr, size, hipHostRegisterMapped | hipHostRegisterPortable)
#define petitHostUnregister hipHostUnregister
#define petitMemset hipMemset
#define petitMalloc hipMalloc
#define petitFree hipFree
#define petitLaunchKernel(kernel, grid, block, smem, stream, ...) \
  hipLaunchKernelGGL(kernel, grid, block, smem, stream, __VA_ARGS__)
#else
typedef cudaError_t petitError_t;
typedef cudaStream_t petitStream_t;
#define petitSuccess cudaSuccess
#define petitErrorInvalidValue cudaErrorInvalidValue
#define petitErrorNotSupported cudaErrorNotSupported
#define petitErrorCooperativeLaunchTooLarge cudaErrorCooperativeLaunchTooLarge
#define petitGetErrorString cudaGetErrorString
#define petitGetLastError cudaGetLastError
#define petitGetDevice cudaGetDevice
#define petitSetDevice cudaSetDevice
#define petitDeviceGetAttribute cudaDeviceGetAttribute
#define petitDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define petitDevAttrComputeCapabilityMajor cudaDevAttrComputeCapabilityMajor
#define petitDevAttrComputeCapabilityMinor cudaDevAttrComputeCapabilityMinor
#define petitDevAttrL2CacheSize cudaDevAttrL2CacheSize
#define petitDeviceCanAccessPeer cudaDeviceCanAccessPeer
#define petitDeviceGetPCIBusId cudaDeviceGetPCIBusId
#define petitDeviceGetByPCIBusId cudaDeviceGetByPCIBusId
#define petitMemsetAsync cudaMemsetAsync
#define petitMemcpy cudaMemcpy
#define petitMemcpyDefault cudaMemcpyDefault
#define petitDeviceSynchronize cudaDeviceSynchronize
#define petitFuncSetAttribute cudaFuncSetAttribute
#define petitFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define petitFuncAttributePreferredSharedMemoryCarveout \
  cudaFuncAttributePreferredSharedMemoryCarveout
#define petitFuncGetAttributes cudaFuncGetAttributes
#define petitOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
typedef cudaFuncAttributes petitFuncAttributes;
#define petitHostAlloc(ptr, size) cudaHostAlloc(ptr, size, cudaHostAllocMapped)
#define petitHostGetDevicePointer(dptr, hptr) cudaHostGetDevicePointer(dptr, hptr, 0)
#define petitFreeHost cudaFreeHost
#define petitHostRegisterMapped(ptr, size) \
  cudaHostRegister(ptr, size, cudaHostRegisterMapped | cudaHostRegisterPortable)
#define petitHostUnregister cudaHostUnregister
#define petitMemset cudaMemset
#define petitMalloc cudaMalloc
#define petitFree cudaFree
#define petitLaunchKernel(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

// ------------------------------------------------- virtual-memory (heap) API
// petit_vmm_* : one signature on both platforms, 0 = success (petit_vmm_load also resolves the
// CUDA driver's cuTensorMapEncodeTiled for gemm/sm90_tma.h). HIP has these calls in its
// runtime; on CUDA they are driver entry points resolved at run time through
// cudaGetDriverEntryPointByVersion, so the extension imports without libcuda (CPU-only CI).
#if PETIT_HIP
typedef hipMemGenericAllocationHandle_t petitMemHandle_t;
typedef hipMemAllocationProp petitMemAllocationProp;
typedef hipMemAccessDesc petitMemAccessDesc;
typedef hipError_t petitVmmResult;
#define PETIT_MEM_PROP_HANDLE_TYPE requestedHandleType
#define PETIT_MEM_ALLOCATION_TYPE_PINNED hipMemAllocationTypePinned
#define PETIT_MEM_LOCATION_TYPE_DEVICE hipMemLocationTypeDevice
#define PETIT_MEM_HANDLE_TYPE_POSIX_FD hipMemHandleTypePosixFileDescriptor
#define PETIT_MEM_ACCESS_FLAGS_PROT_READWRITE hipMemAccessFlagsProtReadWrite
#define PETIT_MEM_ALLOC_GRANULARITY_RECOMMENDED hipMemAllocationGranularityRecommended

inline petitVmmResult petit_vmm_load() { return hipSuccess; }
inline const char* petit_vmm_error_string(petitVmmResult r) { return hipGetErrorString(r); }
inline petitVmmResult petit_vmm_granularity(size_t* g, const petitMemAllocationProp* prop) {
  return hipMemGetAllocationGranularity(g, prop, PETIT_MEM_ALLOC_GRANULARITY_RECOMMENDED);
}
inline petitVmmResult petit_vmm_create(petitMemHandle_t* h, size_t size,
                                       const petitMemAllocationProp* prop) {
  return hipMemCreate(h, size, prop, 0);
}
inline petitVmmResult petit_vmm_release(petitMemHandle_t h) { return hipMemRelease(h); }
inline petitVmmResult petit_vmm_export_fd(int* fd, petitMemHandle_t h) {
  return hipMemExportToShareableHandle(fd, h, PETIT_MEM_HANDLE_TYPE_POSIX_FD, 0);
}
inline petitVmmResult petit_vmm_import_fd(petitMemHandle_t* h, int fd) {
  return hipMemImportFromShareableHandle(h, (void*)(uintptr_t)fd, PETIT_MEM_HANDLE_TYPE_POSIX_FD);
}
inline petitVmmResult petit_vmm_reserve(char** ptr, size_t size, size_t alignment) {
  return hipMemAddressReserve((void**)ptr, size, alignment, nullptr, 0);
}
inline petitVmmResult petit_vmm_address_free(char* ptr, size_t size) {
  return hipMemAddressFree(ptr, size);
}
inline petitVmmResult petit_vmm_map(char* ptr, size_t size, petitMemHandle_t h) {
  return hipMemMap(ptr, size, 0, h, 0);
}
inline petitVmmResult petit_vmm_unmap(char* ptr, size_t size) { return hipMemUnmap(ptr, size); }
inline petitVmmResult petit_vmm_set_access(char* ptr, size_t size, const petitMemAccessDesc* d) {
  return hipMemSetAccess(ptr, size, d, 1);
}
#else
typedef CUmemGenericAllocationHandle petitMemHandle_t;
typedef CUmemAllocationProp petitMemAllocationProp;
typedef CUmemAccessDesc petitMemAccessDesc;
typedef CUresult petitVmmResult;
#define PETIT_MEM_PROP_HANDLE_TYPE requestedHandleTypes
#define PETIT_MEM_ALLOCATION_TYPE_PINNED CU_MEM_ALLOCATION_TYPE_PINNED
#define PETIT_MEM_LOCATION_TYPE_DEVICE CU_MEM_LOCATION_TYPE_DEVICE
#define PETIT_MEM_HANDLE_TYPE_POSIX_FD CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
#define PETIT_MEM_ACCESS_FLAGS_PROT_READWRITE CU_MEM_ACCESS_FLAGS_PROT_READWRITE
#define PETIT_MEM_ALLOC_GRANULARITY_RECOMMENDED CU_MEM_ALLOC_GRANULARITY_RECOMMENDED

struct PetitDriverApi {
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*mem_export)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                         unsigned long long);
  CUresult (*mem_import)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags);
  CUresult (*error_string)(CUresult, const char**);
  // Not a heap call: the expert GEMMs' TMA weight maps (gemm/sm90_tma.h).
  CUresult (*tensor_map_encode_tiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                      const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                      const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion,
                                      CUtensorMapFloatOOBfill);
  bool loaded;
};

inline PetitDriverApi& petit_driver() {
  static PetitDriverApi api = {};
  return api;
}

inline petitVmmResult petit_vmm_load() {
  PetitDriverApi& api = petit_driver();
  if (api.loaded) return CUDA_SUCCESS;
  struct Entry { const char* name; void** slot; };
  const Entry entries[] = {
      {"cuMemCreate", (void**)&api.mem_create},
      {"cuMemRelease", (void**)&api.mem_release},
      {"cuMemExportToShareableHandle", (void**)&api.mem_export},
      {"cuMemImportFromShareableHandle", (void**)&api.mem_import},
      {"cuMemAddressReserve", (void**)&api.address_reserve},
      {"cuMemAddressFree", (void**)&api.address_free},
      {"cuMemMap", (void**)&api.map},
      {"cuMemUnmap", (void**)&api.unmap},
      {"cuMemSetAccess", (void**)&api.set_access},
      {"cuMemGetAllocationGranularity", (void**)&api.granularity},
      {"cuGetErrorString", (void**)&api.error_string},
      {"cuTensorMapEncodeTiled", (void**)&api.tensor_map_encode_tiled},
  };
  for (const Entry& e : entries) {
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion(e.name, e.slot, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess || *e.slot == nullptr)
      return CUDA_ERROR_NOT_FOUND;
  }
  api.loaded = true;
  return CUDA_SUCCESS;
}
inline const char* petit_vmm_error_string(petitVmmResult r) {
  const char* msg = "CUDA driver API not available";
  if (petit_driver().error_string) petit_driver().error_string(r, &msg);
  return msg;
}
inline petitVmmResult petit_vmm_granularity(size_t* g, const petitMemAllocationProp* prop) {
  return petit_driver().granularity(g, prop, PETIT_MEM_ALLOC_GRANULARITY_RECOMMENDED);
}
inline petitVmmResult petit_vmm_create(petitMemHandle_t* h, size_t size,
                                       const petitMemAllocationProp* prop) {
  return petit_driver().mem_create(h, size, prop, 0);
}
inline petitVmmResult petit_vmm_release(petitMemHandle_t h) { return petit_driver().mem_release(h); }
inline petitVmmResult petit_vmm_export_fd(int* fd, petitMemHandle_t h) {
  return petit_driver().mem_export(fd, h, PETIT_MEM_HANDLE_TYPE_POSIX_FD, 0);
}
inline petitVmmResult petit_vmm_import_fd(petitMemHandle_t* h, int fd) {
  return petit_driver().mem_import(h, (void*)(uintptr_t)fd, PETIT_MEM_HANDLE_TYPE_POSIX_FD);
}
inline petitVmmResult petit_vmm_reserve(char** ptr, size_t size, size_t alignment) {
  CUdeviceptr p = 0;
  CUresult r = petit_driver().address_reserve(&p, size, alignment, 0, 0);
  *ptr = reinterpret_cast<char*>(p);
  return r;
}
inline petitVmmResult petit_vmm_address_free(char* ptr, size_t size) {
  return petit_driver().address_free(reinterpret_cast<CUdeviceptr>(ptr), size);
}
inline petitVmmResult petit_vmm_map(char* ptr, size_t size, petitMemHandle_t h) {
  return petit_driver().map(reinterpret_cast<CUdeviceptr>(ptr), size, 0, h, 0);
}
inline petitVmmResult petit_vmm_unmap(char* ptr, size_t size) {
  return petit_driver().unmap(reinterpret_cast<CUdeviceptr>(ptr), size);
}
inline petitVmmResult petit_vmm_set_access(char* ptr, size_t size, const petitMemAccessDesc* d) {
  return petit_driver().set_access(reinterpret_cast<CUdeviceptr>(ptr), size, d, 1);
}
#endif

// ------------------------------------------------------------ warp primitives
#if PETIT_HIP
#define PETIT_WARP_SIZE 64
typedef uint64_t petit_lanemask_t;
#else
#define PETIT_WARP_SIZE 32
typedef uint32_t petit_lanemask_t;
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)  // device helpers: only in nvcc / hipcc -x hip

PETIT_DEVICE int petit_lane_id() { return threadIdx.x % PETIT_WARP_SIZE; }
PETIT_DEVICE int petit_warp_id() { return threadIdx.x / PETIT_WARP_SIZE; }

PETIT_DEVICE petit_lanemask_t petit_ballot(bool pred) {
#if PETIT_HIP
  return __ballot(pred);
#else
  return __ballot_sync(0xffffffffu, pred);
#endif
}

PETIT_DEVICE int petit_popc(petit_lanemask_t m) {
#if PETIT_HIP
  return __popcll(m);
#else
  return __popc(m);
#endif
}

// Lanes below this one.
PETIT_DEVICE petit_lanemask_t petit_lanemask_lt() {
  return (petit_lanemask_t(1) << petit_lane_id()) - 1;
}

// Mask of the lanes (of the full warp) whose `value` equals this lane's.
PETIT_DEVICE petit_lanemask_t petit_match_any(int value) {
#if PETIT_HIP
  petit_lanemask_t result = 0, remaining = ~petit_lanemask_t(0);
  while (remaining) {  // one distinct value per iteration
    int leader = __ffsll((unsigned long long)remaining) - 1;
    int leader_value = __shfl(value, leader);
    petit_lanemask_t same = __ballot(value == leader_value);
    if (value == leader_value) result = same;
    remaining &= ~same;
  }
  return result;
#else
  return __match_any_sync(0xffffffffu, value);
#endif
}

template <typename T>
PETIT_DEVICE T petit_shfl(T value, int src_lane) {
#if PETIT_HIP
  return __shfl(value, src_lane);
#else
  return __shfl_sync(0xffffffffu, value, src_lane);
#endif
}

template <typename T>
PETIT_DEVICE T petit_shfl_xor(T value, int lane_mask) {
#if PETIT_HIP
  return __shfl_xor(value, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
#endif
}

PETIT_DEVICE void petit_syncwarp() {
#if PETIT_HIP
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// ------------------------------------------------------------ scoped atomics
PETIT_DEVICE uint64_t petit_load_acquire_sys(const uint64_t* ptr) {
#if PETIT_HIP
  return __hip_atomic_load(ptr, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
#endif
}

PETIT_DEVICE void petit_store_release_sys(uint64_t* ptr, uint64_t value) {
#if PETIT_HIP
  __hip_atomic_store(ptr, value, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
#endif
}

PETIT_DEVICE void petit_store_relaxed_sys(uint64_t* ptr, uint64_t value) {
#if PETIT_HIP
  __hip_atomic_store(ptr, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
#endif
}

PETIT_DEVICE void petit_fence_sys() {
#if PETIT_HIP
  __atomic_thread_fence(__ATOMIC_SEQ_CST);  // system scope is the default for HIP fences
#else
  __threadfence_system();
#endif
}

PETIT_DEVICE void petit_fence_acq_rel_sys() {
#if PETIT_HIP
  __atomic_thread_fence(__ATOMIC_ACQ_REL);
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

// Device-scope acquire load of a counter that other blocks of this GPU raise with
// __threadfence() + atomicAdd (the fused layer's per-expert and per-tile arrival counts).
PETIT_DEVICE int petit_load_acquire_gpu(const int* ptr) {
#if PETIT_HIP
  return __hip_atomic_load(ptr, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
#else
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
#endif
}

// Device-scope relaxed atomic add (local memory only: no remote atomics on the hot path).
PETIT_DEVICE uint32_t petit_atomic_add_gpu(uint32_t* ptr, uint32_t value) {
  return atomicAdd(ptr, value);
}

// Hint: start moving the 128-byte line holding ptr into L2 (no value, no fault on any
// address the caller may load). No-op on HIP, which has no such hint.
PETIT_DEVICE void petit_prefetch_l2(const void* ptr) {
#if PETIT_HIP
  (void)ptr;
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
#endif
}

// 16-byte load that bypasses the (non-coherent) L1, for data a peer writes while
// this kernel runs.
PETIT_DEVICE uint4 petit_load_cg(const uint4* ptr) {
#if PETIT_HIP
  uint4 v;
  v.x = __builtin_nontemporal_load(&ptr->x);
  v.y = __builtin_nontemporal_load(&ptr->y);
  v.z = __builtin_nontemporal_load(&ptr->z);
  v.w = __builtin_nontemporal_load(&ptr->w);
  return v;
#else
  return __ldcg(ptr);
#endif
}

// ----------------------------------------------------------------- timing
// A free-running timer for bounded spin-waits. Ticks per second come from the
// host (petit_timer_ticks_per_second), so a bound is given in seconds.
PETIT_DEVICE uint64_t petit_timer() {
#if PETIT_HIP
  return __builtin_amdgcn_s_memrealtime();  // constant 100 MHz on gfx9
#else
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
#endif
}

// Programmatic dependent launch (CUDA, sm_90+): a kernel launched with the programmatic
// stream-serialization attribute may start while the previous kernel of its stream is still
// running. Called first thing in such a kernel: waits until that kernel has completed and its
// memory operations are visible, then lets the next kernel of the stream be scheduled (which
// waits likewise). A no-op without the attribute, before sm_90 and on HIP.
PETIT_DEVICE void petit_grid_dependency_sync() {
#if PETIT_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

PETIT_DEVICE void petit_trap() {
#if PETIT_HIP
  abort();
#else
  __trap();
#endif
}

#endif  // __CUDACC__ || __HIPCC__

inline double petit_timer_ticks_per_second() {
#if PETIT_HIP
  return 100.0e6;
#else
  return 1.0e9;
#endif
}

// A block-shared variable declared in a kernel body: `PETIT_SHARED(uint32_t, s_mask);` is
// `__shared__ uint32_t s_mask;` in every real build. The CPU emulation (tests/emu) defines it
// to give each block its own instance, as it runs the blocks of a persistent grid at once
// (plain static __shared__ variables are one instance per kernel there).
#ifndef PETIT_SHARED
#define PETIT_SHARED(type, name) __shared__ type name
#endif

// bf16 storage type: kernels only move bf16 bits or convert through fp32, so a
// 16-bit carrier plus two conversions is all they need on either platform.
typedef uint16_t petit_bf16_bits;

PETIT_HOST_DEVICE float petit_bf16_to_float(petit_bf16_bits bits) {
  union { uint32_t u; float f; } v;
  v.u = uint32_t(bits) << 16;
  return v.f;
}

// Round to nearest even, NaN preserved (matches torch's float -> bfloat16).
PETIT_HOST_DEVICE petit_bf16_bits petit_float_to_bf16(float value) {
  union { uint32_t u; float f; } v;
  v.f = value;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return petit_bf16_bits((v.u >> 16) | 0x40u);
  uint32_t rounding_bias = 0x7fffu + ((v.u >> 16) & 1u);
  return petit_bf16_bits((v.u + rounding_bias) >> 16);
}
