// merge_attn_states on the GPU: launch parameters and launcher.
#pragma once

#include <cstdint>

#include "speedmla/tensor.h"

namespace speedmla::kernels {

// (out_a, lse_a) ⊕ (out_b, lse_b) -> (out, lse) for every row (t, h) of head_dim elements.
// out may be out_a and lse may be lse_a (in place): every row is read before it is written.
struct MergeAttnStatesParams {
  const void* out_a;  // [num_tokens, num_heads, head_dim], last dim contiguous
  DType out_a_dtype;  // BF16 or FP32
  int64_t out_a_stride_token, out_a_stride_head;
  const float* lse_a;  // [num_tokens, num_heads]
  int64_t lse_a_stride_token, lse_a_stride_head;
  const void* out_b;  // like out_a
  DType out_b_dtype;
  int64_t out_b_stride_token, out_b_stride_head;
  const float* lse_b;
  int64_t lse_b_stride_token, lse_b_stride_head;
  void* out;          // [num_tokens, num_heads, head_dim] of out_dtype (written)
  DType out_dtype;    // BF16 or FP32
  int64_t out_stride_token, out_stride_head;
  float* lse;         // [num_tokens, num_heads] (written), or nullptr
  int64_t lse_stride_token, lse_stride_head;
  int64_t num_tokens, num_heads, head_dim;
};

void run_merge_attn_states(const MergeAttnStatesParams& params, Stream stream);

}  // namespace speedmla::kernels
