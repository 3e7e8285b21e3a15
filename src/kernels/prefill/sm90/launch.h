// Host entry of the SM90 prefill: one persistent kernel per call, no allocation, no host
// synchronisation. The launcher owns every kernel detail: the launch struct, the TMA
// descriptors (their swizzle is the kernel traits'), the grid and the shared-memory opt-in.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "kernels/prefill/sm90/params.h"
#include "speedmla/tensor.h"

namespace speedmla::kernels::prefill_sm90 {

// Views the API layer validated (speedmla/prefill.h): CUDA tensors on the current device, all
// FP8 or all BF16, 16-byte aligned with 16-byte multiples for every stride but the last. v is
// [total_k, H_kv, 128], or with values_transposed (FP8) the layout of
// PrefillValueLayout::kFp8Transposed: [H_kv, 128, T16].
struct PrefillViews {
  TensorView q, k, v, cu_seqlens_q, cu_seqlens_k, out;
  bool values_transposed;
  const TensorView* lse;  // nullptr: no LSE
  bool causal;
  float softmax_scale, output_scale;
  int num_sms;
};

struct PrefillLaunchStatus {
  int tensor_map_error = 0;             // cuTensorMapEncodeTiled's error (0: none)
  const char* tensor_map_name = nullptr;  // which descriptor failed
  cudaError_t cuda_error = cudaSuccess;   // the opt-in's or the launch's
};

PrefillLaunchStatus run_prefill(const PrefillViews& views, cudaStream_t stream);

// One instantiation per element type and value layout (prefill_bf16.cu, prefill_fp8.cu,
// prefill_fp8_transposed_values.cu): encodes the q, k and v descriptors with that kernel's
// swizzle and box, then launches it.
PrefillLaunchStatus launch_prefill_bf16(const PrefillViews& views, const PrefillParams& params, cudaStream_t stream);
PrefillLaunchStatus launch_prefill_fp8(const PrefillViews& views, const PrefillParams& params, cudaStream_t stream);
PrefillLaunchStatus launch_prefill_fp8_transposed_values(const PrefillViews& views, const PrefillParams& params,
                                                         cudaStream_t stream);

}  // namespace speedmla::kernels::prefill_sm90
