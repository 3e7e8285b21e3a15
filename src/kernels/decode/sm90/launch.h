// Host entry of the SM90 decode: plan, main kernel, combine — three launches on one stream,
// no allocation, no host synchronisation.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "kernels/decode/sm90/params.h"

namespace speedmla::kernels::decode_sm90 {

// The main kernel of one element type (one .cu per instantiation). prepare_* sets its
// shared-memory opt-in on the current device (once per device); launch_* launches it. Both
// return the CUDA error (cudaSuccess if none).
cudaError_t prepare_decode_fp8();
cudaError_t prepare_decode_bf16();
cudaError_t launch_decode_fp8(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);
cudaError_t launch_decode_bf16(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);

// Schedule + main + combine on the current device. The main kernel's opt-in is checked first:
// when it fails nothing is launched. Returns the CUDA error (cudaSuccess if none).
cudaError_t run_decode(const CUtensorMap& kv_map, const DecodeParams& params, bool fp8, cudaStream_t stream);

}  // namespace speedmla::kernels::decode_sm90
