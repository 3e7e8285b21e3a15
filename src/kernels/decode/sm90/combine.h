// Merges the partial results of requests that the split-KV plan cut into several parts, by
// their log-sum-exp, and writes the final BF16 output (× output_scale) and LSE.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/decode/sm90/params.h"

namespace speedmla::kernels::decode_sm90 {

void run_decode_combine(const DecodeParams& params, cudaStream_t stream);

}  // namespace speedmla::kernels::decode_sm90
