// FP8 e4m3 query and cache, FP8 tensor-core math, BF16 output.
// Pages below min_tma_page_tokens: the producer copies the cache rows with cp.async.
#include "kernels/decode/sm90/launch.h"
#include "kernels/decode/sm90/launch_kernel.cuh"

namespace speedmla::kernels::decode_sm90 {

DecodeLaunchStatus prepare_decode_fp8_copied_rows(const DecodeLaunch& launch, CUtensorMap* kv_map) {
  return prepare_decode_kernel<Fp8Traits, KvLoad::kCopiedRows>(launch, kv_map);
}

cudaError_t launch_decode_fp8_copied_rows(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  return launch_decode_kernel<Fp8Traits, KvLoad::kCopiedRows>(kv_map, params, stream);
}

}  // namespace speedmla::kernels::decode_sm90
