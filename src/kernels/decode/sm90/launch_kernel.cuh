// Launch of the main decode kernel for one element type; included by the .cu that instantiates
// it (nvcc gives kernel template stubs internal linkage).
#pragma once

#include "kernels/decode/sm90/decode_kernel.cuh"

namespace speedmla::kernels::decode_sm90 {

template <typename Traits>
void launch_decode_kernel(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  constexpr int smem_bytes = DecodeKernel<Traits>::kSmemBytes;
  // Setting the attribute is a host-side call with no device synchronisation; doing it once
  // per process keeps it off the hot path.
  static const cudaError_t attribute_status =
      cudaFuncSetAttribute(decode_kernel<Traits>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (attribute_status != cudaSuccess) return;  // reported by the caller's cudaGetLastError()
  const dim3 grid(params.num_row_tiles, params.num_parts);
  sm90::launch_dependent(decode_kernel<Traits>, grid, dim3(kThreads), smem_bytes, stream, kv_map, params);
}

}  // namespace speedmla::kernels::decode_sm90
