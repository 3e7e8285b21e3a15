// FP8 e4m3 q and k, values already transposed (PrefillValueLayout::kFp8Transposed), FP8
// tensor-core math for Q·K^T and P·V, BF16 output.
#include "kernels/prefill/sm90/launch_kernel.cuh"

namespace speedmla::kernels::prefill_sm90 {

PrefillLaunchStatus launch_prefill_fp8_transposed_values(const PrefillViews& views, const PrefillParams& params,
                                                         cudaStream_t stream) {
  return launch_prefill_kernel<PrefillFp8TransposedValuesTraits>(views, params, stream);
}

}  // namespace speedmla::kernels::prefill_sm90
