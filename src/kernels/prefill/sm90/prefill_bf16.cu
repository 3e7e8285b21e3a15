// BF16 q, k and v, BF16 tensor-core math, BF16 output.
#include "kernels/prefill/sm90/launch_kernel.cuh"

namespace speedmla::kernels::prefill_sm90 {

PrefillLaunchStatus launch_prefill_bf16(const PrefillViews& views, const PrefillParams& params, cudaStream_t stream) {
  return launch_prefill_kernel<PrefillBf16Traits>(views, params, stream);
}

}  // namespace speedmla::kernels::prefill_sm90
