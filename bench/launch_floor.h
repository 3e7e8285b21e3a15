// Three dependent launches of an empty kernel (launch_floor.cu): the host cost of a decode
// call's launches with nothing else around them.
#pragma once

#include <cuda_runtime_api.h>

cudaError_t launch_three_empty_kernels(cudaStream_t stream);

// The same three launches with <<<>>> and no attribute: what the programmatic-dependent-launch
// attribute (cudaLaunchKernelEx) costs on the host, if anything.
cudaError_t launch_three_plain_empty_kernels(cudaStream_t stream);
