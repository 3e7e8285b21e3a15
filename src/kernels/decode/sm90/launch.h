// Host entry of the SM90 decode: plan, main kernel, combine — three launches on one stream,
// no allocation, no host synchronisation.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "kernels/decode/sm90/params.h"

namespace speedmla::kernels::decode_sm90 {

// The main kernel of one element type (one .cu per instantiation).
void launch_decode_fp8(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);
void launch_decode_bf16(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);

// Schedule + main + combine. Returns the CUDA error of the launches (cudaSuccess if none).
cudaError_t run_decode(const CUtensorMap& kv_map, const DecodeParams& params, bool fp8, cudaStream_t stream);

}  // namespace speedmla::kernels::decode_sm90
