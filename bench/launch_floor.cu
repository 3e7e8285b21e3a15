// The floor under speedmla-host-cost's full-call figures: the host time of the launches alone.
// A decode call is three launches (planner, main kernel, combine) made with cudaLaunchKernelEx
// and the programmatic-dependent-launch attribute; the same three launches of an empty kernel
// cost what no validation or parameter work can remove.
#include "launch_floor.h"

#include "kernels/sm90/dependent_launch.cuh"

namespace {
__global__ void empty_kernel(int) {}
}  // namespace

cudaError_t launch_three_plain_empty_kernels(cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) {
    empty_kernel<<<1, 32, 0, stream>>>(i);
    if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

cudaError_t launch_three_empty_kernels(cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) {
    const cudaError_t status =
        speedmla::kernels::sm90::launch_dependent(empty_kernel, dim3(1), dim3(32), 0, stream, i);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}
