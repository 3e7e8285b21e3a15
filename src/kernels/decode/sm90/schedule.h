// The split-KV planner: one small kernel that reads seq_lens on the device and writes the plan
// (workspace.h) the main and combine kernels follow. No host synchronisation.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/decode/sm90/params.h"

namespace speedmla::kernels::decode_sm90 {

void run_decode_schedule(const DecodeParams& params, cudaStream_t stream);

}  // namespace speedmla::kernels::decode_sm90
