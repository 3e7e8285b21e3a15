#include "kernels/prefill/sm90/launch.h"

#include <cstdint>

#include "kernels/prefill/sm90/config.h"

namespace speedmla::kernels::prefill_sm90 {

PrefillLaunchStatus run_prefill(const PrefillViews& views, cudaStream_t stream) {
  PrefillParams p{};
  p.batch = static_cast<int>(views.cu_seqlens_q.size(0) - 1);
  p.num_heads = static_cast<int>(views.q.size(1));
  p.head_group = static_cast<int>(views.q.size(1) / views.k.size(1));
  p.total_q = static_cast<int>(views.q.size(0));
  p.total_k = static_cast<int>(views.k.size(0));
  p.num_slots = p.total_q / kPairRows + p.batch;
  p.total_items = static_cast<int64_t>(p.num_slots) * p.num_heads;
  p.cu_seqlens_q = views.cu_seqlens_q.ptr<int32_t>();
  p.cu_seqlens_k = views.cu_seqlens_k.ptr<int32_t>();
  p.out = views.out.ptr<uint16_t>();
  p.out_stride_token = views.out.strides[0];
  p.out_stride_head = views.out.strides[1];
  p.out_aligned16 = reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && p.out_stride_token % 8 == 0 &&
                    p.out_stride_head % 8 == 0;
  if (views.lse != nullptr) {
    p.lse = views.lse->ptr<float>();
    p.lse_stride_token = views.lse->strides[0];
    p.lse_stride_head = views.lse->strides[1];
  }
  p.causal = views.causal;
  p.score_scale_log2 = views.softmax_scale * 1.4426950408889634f;
  p.output_scale = views.output_scale;
  if (p.batch == 0 || p.total_q == 0) return {};
  if (views.q.dtype != DType::kFloat8E4M3) return launch_prefill_bf16(views, p, stream);
  return views.values_transposed ? launch_prefill_fp8_transposed_values(views, p, stream)
                                 : launch_prefill_fp8(views, p, stream);
}

}  // namespace speedmla::kernels::prefill_sm90
