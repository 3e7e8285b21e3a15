// FP8 e4m3 q, k and v, FP8 tensor-core math for Q·K^T and P·V, BF16 output.
#include "kernels/prefill/sm90/launch_kernel.cuh"

namespace speedmla::kernels::prefill_sm90 {

PrefillLaunchStatus launch_prefill_fp8(const PrefillViews& views, const PrefillParams& params, cudaStream_t stream) {
  return launch_prefill_kernel<PrefillFp8Traits>(views, params, stream);
}

}  // namespace speedmla::kernels::prefill_sm90
