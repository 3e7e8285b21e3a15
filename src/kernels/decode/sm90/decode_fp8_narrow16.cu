// FP8 e4m3 query and cache, requests of at most 16 query rows (H·q_len <= 16), TMA pages:
// decode_narrow_kernel.cuh.
#include "kernels/decode/sm90/launch_narrow_kernel.cuh"

namespace speedmla::kernels::decode_sm90 {

DecodeLaunchStatus prepare_decode_fp8_narrow16(const DecodeLaunch& launch, CUtensorMap* kv_map) {
  return prepare_decode_narrow_kernel<16>(launch, kv_map);
}

cudaError_t launch_decode_fp8_narrow16(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  return launch_decode_narrow_kernel<16>(kv_map, params, stream);
}

}  // namespace speedmla::kernels::decode_sm90
