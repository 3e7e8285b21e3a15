// pack_prefill_kv on the GPU: launch parameters and launcher.
#pragma once

#include <cstdint>

#include "speedmla/tensor.h"

namespace speedmla::kernels {

// For every token t and head h:
//   k_out[t, h] = convert(k_nope[t, h] ‖ k_rope[t], × k_scale_inv)   (128 + 64 = 192 elements)
//   v_out[t, h] = convert(v[t, h], × v_scale_inv)                    (128 elements)
// Inputs BF16, FP16 or FP32 (each its own); outputs FP8 e4m3 or BF16. Last dims contiguous.
struct PackPrefillKvParams {
  const void* k_nope;  // [num_tokens, num_heads, 128]
  DType k_nope_dtype;
  int64_t k_nope_stride_token, k_nope_stride_head;
  const void* k_rope;  // [num_tokens, 64], shared by every head
  DType k_rope_dtype;
  int64_t k_rope_stride_token;
  const void* v;       // [num_tokens, num_heads, 128]
  DType v_dtype;
  int64_t v_stride_token, v_stride_head;
  void* k_out;         // [num_tokens, num_heads, 192] of out_dtype (written)
  int64_t k_out_stride_token, k_out_stride_head;
  void* v_out;         // [num_tokens, num_heads, 128] of out_dtype (written), or transposed below
  int64_t v_out_stride_token, v_out_stride_head;
  // PrefillValueLayout::kFp8Transposed (FP8): v_out [num_heads, 128, P], P >= num_tokens rounded
  // up to 16; v_out_stride_head and v_out_stride_dim its strides, 16-byte multiples.
  bool v_out_transposed;
  int64_t v_out_stride_dim;
  DType out_dtype;     // FP8 e4m3 or BF16
  int64_t num_tokens, num_heads;
  float k_scale_inv, v_scale_inv;
};

void run_pack_prefill_kv(const PackPrefillKvParams& params, Stream stream);

}  // namespace speedmla::kernels
