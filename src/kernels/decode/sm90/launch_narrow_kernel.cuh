// Launch of the FP8 narrow decode kernel (decode_narrow_kernel.cuh) for kRows query rows;
// included by the .cu that instantiates it (nvcc gives kernel template stubs internal linkage).
#pragma once

#include "kernels/decode/sm90/decode_narrow_kernel.cuh"
#include "kernels/decode/sm90/launch.h"
#include "kernels/decode/sm90/launch_kernel.cuh"

namespace speedmla::kernels::decode_sm90 {

template <int kRows>
DecodeLaunchStatus prepare_decode_narrow_kernel(const DecodeLaunch& launch, CUtensorMap* kv_map) {
  using Kernel = NarrowDecodeKernel<kRows>;
  DecodeLaunchStatus status;
  status.tensor_map = encode_kv_tensor_map<typename Kernel::Traits>(launch, kv_map);
  if (status.tensor_map == 0) status.cuda = sm90::ensure_dynamic_smem<decode_narrow_kernel<kRows>>(Kernel::kSmemBytes);
  return status;
}

template <int kRows>
cudaError_t launch_decode_narrow_kernel(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(params.num_row_tiles, params.num_parts);
  return sm90::launch_dependent(decode_narrow_kernel<kRows>, grid, dim3(kThreads),
                                NarrowDecodeKernel<kRows>::kSmemBytes, stream, kv_map, params);
}

}  // namespace speedmla::kernels::decode_sm90
