// FP8 e4m3 query and cache, requests of at most 16 query rows (H·q_len <= 16), TMA pages:
// decode_narrow_kernel.cuh.
#include "kernels/decode/sm90/decode_narrow_kernel.cuh"
#include "kernels/decode/sm90/launch.h"
#include "kernels/decode/sm90/launch_kernel.cuh"

namespace speedmla::kernels::decode_sm90 {

DecodeLaunchStatus prepare_decode_fp8_narrow(const DecodeLaunch& launch, CUtensorMap* kv_map) {
  using Kernel = NarrowDecodeKernel<kNarrowRows>;
  DecodeLaunchStatus status;
  status.tensor_map = encode_kv_tensor_map<Kernel::Traits>(launch, kv_map);
  if (status.tensor_map == 0) status.cuda = sm90::ensure_dynamic_smem<decode_narrow_kernel<kNarrowRows>>(Kernel::kSmemBytes);
  return status;
}

cudaError_t launch_decode_fp8_narrow(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(params.num_row_tiles, params.num_parts);
  return sm90::launch_dependent(decode_narrow_kernel<kNarrowRows>, grid, dim3(kThreads),
                                NarrowDecodeKernel<kNarrowRows>::kSmemBytes, stream, kv_map, params);
}

}  // namespace speedmla::kernels::decode_sm90
