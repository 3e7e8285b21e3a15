// Launch of the main decode kernel for one element type; included by the .cu that instantiates
// it (nvcc gives kernel template stubs internal linkage).
#pragma once

#include "kernels/decode/sm90/decode_kernel.cuh"
#include "kernels/sm90/dynamic_smem.h"

namespace speedmla::kernels::decode_sm90 {

// The kernel's shared-memory opt-in on the current device (set once per device, see
// sm90/dynamic_smem.h). run_decode calls it before launching anything of the operation.
template <typename Traits>
cudaError_t prepare_decode_kernel() {
  return sm90::ensure_dynamic_smem<decode_kernel<Traits>>(DecodeKernel<Traits>::kSmemBytes);
}

template <typename Traits>
cudaError_t launch_decode_kernel(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(params.num_row_tiles, params.num_parts);
  return sm90::launch_dependent(decode_kernel<Traits>, grid, dim3(kThreads), DecodeKernel<Traits>::kSmemBytes, stream,
                                kv_map, params);
}

}  // namespace speedmla::kernels::decode_sm90
