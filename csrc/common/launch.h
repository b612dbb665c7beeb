// Kernel launches with programmatic dependent launch (PDL) where the device has it.
//
// On CUDA devices of compute capability 9.0 and newer a kernel launched with programmatic
// stream serialization has its blocks scheduled onto SMs as the previous kernel's blocks exit,
// instead of after that whole grid has drained and the next launch has been processed. Such a
// kernel must call petit_grid_dependency_sync (platform.h) before it touches global memory
// that the previous kernel may write or read: it waits for that kernel's completion and
// memory. The expert kernels and the fused layer are launched this way.
#pragma once

#include "common/platform.h"

namespace petit {

inline bool programmatic_launch_enabled() {
#if PETIT_CUDA && !PETIT_EMU_PTX
  int device = 0, major = 0;
  if (petitGetDevice(&device) != petitSuccess ||
      petitDeviceGetAttribute(&major, petitDevAttrComputeCapabilityMajor, device) != petitSuccess)
    return false;
  return major >= 9;
#else
  return false;
#endif
}

#if PETIT_CUDA && !PETIT_EMU_PTX
// cluster > 1: thread-block clusters of that many CTAs along x (the grid a multiple of it).
// programmatic: with the programmatic stream-serialization attribute.
struct LaunchConfig {
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config;
  LaunchConfig(int grid, int threads, int smem_bytes, int cluster, bool programmatic,
               petitStream_t stream) {
    config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = size_t(smem_bytes);
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = 0;
    if (programmatic) {
      cudaLaunchAttribute& a = attributes[config.numAttrs++];
      a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a.val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster > 1) {
      cudaLaunchAttribute& a = attributes[config.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = unsigned(cluster);
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = 1;
    }
  }
};
#endif

// One launch of `kernel` on `grid` blocks: with the attributes above where there are any
// (CUDA), clusters run by the CPU emulation's cluster launch, otherwise a plain launch.
template <class Kernel, class... Args>
petitError_t launch_with_attributes(Kernel kernel, int grid, int threads, int smem_bytes,
                                    int cluster, bool programmatic, petitStream_t stream,
                                    const Args&... args) {
#if PETIT_CUDA && !PETIT_EMU_PTX
  LaunchConfig launch(grid, threads, smem_bytes, cluster, programmatic, stream);
  if (launch.config.numAttrs > 0) {
    const petitError_t err = cudaLaunchKernelEx(&launch.config, kernel, args...);
    return err != petitSuccess ? err : petitGetLastError();
  }
#elif PETIT_EMU_PTX
  (void)programmatic;
  if (cluster > 1) {
    petitLaunchKernelCluster(kernel, dim3(grid), dim3(threads), smem_bytes, stream, cluster,
                             args...);
    return petitGetLastError();
  }
#else
  (void)cluster, (void)programmatic;
#endif
  petitLaunchKernel(kernel, dim3(grid), dim3(threads), smem_bytes, stream, args...);
  return petitGetLastError();
}

}  // namespace petit
