// Programmatic dependent launch (PDL) between the kernels of one operation: the next kernel
// of the stream is launched while the previous one still runs, runs its prologue (barrier
// set-up, ...) and waits in grid_dependency_wait() until the previous grid has completed and
// its writes are visible. This hides a kernel launch gap (a few microseconds) per dependency;
// captured in a CUDA graph it becomes a programmatic edge.
#pragma once

#include <cuda_runtime.h>

namespace speedmla::kernels::sm90 {

// Blocks until the grid this one depends on has completed and its memory is visible. Nothing
// written by earlier work of the stream may be read before it, and nothing they may still
// read may be written.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next (dependent) grid be launched before this one ends; it still waits in
// grid_dependency_wait() for this grid's completion.
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;"); }

// Counters in global memory through which two grids of one operation that run at once (a
// dependent launched early) hand over work, at GPU scope: the writer adds with release
// semantics after its stores, the reader loads with acquire semantics before its loads.
__device__ __forceinline__ void add_release(int* counter, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}
__device__ __forceinline__ int load_acquire(const int* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}
__device__ __forceinline__ int fetch_add_acq_rel(int* counter, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(value) : "memory");
  return old;
}

// Launches `kernel(args...)` as a programmatic dependent of the previous kernel on `stream`.
// The kernel must call grid_dependency_wait() before touching memory that earlier work uses.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                             cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace speedmla::kernels::sm90
