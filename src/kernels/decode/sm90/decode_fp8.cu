// FP8 e4m3 query and cache, FP8 tensor-core math, BF16 output.
#include "kernels/decode/sm90/launch.h"
#include "kernels/decode/sm90/launch_kernel.cuh"

namespace speedmla::kernels::decode_sm90 {

cudaError_t prepare_decode_fp8() { return prepare_decode_kernel<Fp8Traits>(); }

cudaError_t launch_decode_fp8(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  return launch_decode_kernel<Fp8Traits>(kv_map, params, stream);
}

}  // namespace speedmla::kernels::decode_sm90
