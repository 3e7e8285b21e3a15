// Reference ragged prefill attention (speedmla/prefill.h).
#include <algorithm>
#include <vector>

#include "reference/attention.h"
#include "reference/element.h"
#include "reference/parallel.h"
#include "speedmla/prefill.h"
#include "speedmla/reference.h"

namespace speedmla::reference {

void mla_prefill(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                 const TensorView& out, const std::optional<TensorView>& lse, bool causal,
                 float softmax_scale, float output_scale) {
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  const int64_t num_heads = q.size(1), num_kv_heads = k.size(1);
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head (GQA)
  const AttentionTensors io{q, out, lse};
  std::vector<float> keys, values;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_begin = load_index(cu_seqlens_q, offset_of(cu_seqlens_q, b));
    const int64_t len_q = load_index(cu_seqlens_q, offset_of(cu_seqlens_q, b + 1)) - q_begin;
    const int64_t k_begin = load_index(cu_seqlens_k, offset_of(cu_seqlens_k, b));
    const int64_t len_k = load_index(cu_seqlens_k, offset_of(cu_seqlens_k, b + 1)) - k_begin;

    // The request's keys and values as float rows [len_k, H_kv, 192] and [len_k, H_kv, 128].
    keys.resize(static_cast<size_t>(len_k * num_kv_heads * kPrefillQkDim));
    values.resize(static_cast<size_t>(len_k * num_kv_heads * kPrefillVDim));
    parallel_for(len_k * num_kv_heads, kPrefillQkDim + kPrefillVDim, [&](int64_t row) {
      const int64_t j = k_begin + row / num_kv_heads, g = row % num_kv_heads;
      load_row(k, offset_of(k, j, g), kPrefillQkDim, keys.data() + row * kPrefillQkDim);
      load_row(v, offset_of(v, j, g), kPrefillVDim, values.data() + row * kPrefillVDim);
    });

    // One task per (query, head). Causal masking is bottom-right aligned: query i sees keys
    // j <= i + (len_k - len_q).
    parallel_for(len_q * num_heads, len_k * (kPrefillQkDim + kPrefillVDim), [&](int64_t row) {
      const int64_t i = row / num_heads, h = row % num_heads, g = h / group;
      const int64_t visible =
          causal ? std::clamp<int64_t>(i + (len_k - len_q) + 1, 0, len_k) : len_k;
      const KeyValueRows kv{keys.data() + g * kPrefillQkDim, num_kv_heads * kPrefillQkDim,
                            kPrefillQkDim, values.data() + g * kPrefillVDim,
                            num_kv_heads * kPrefillVDim, kPrefillVDim};
      attend_row_at(io, kv, visible, softmax_scale, output_scale, q_begin + i, h);
    });
  }
}

}  // namespace speedmla::reference
