// speedmla/quantize.h — FP8 quantisation of queries and the prefill K/V pack.
#pragma once

#include "speedmla/prefill.h"
#include "speedmla/tensor.h"

namespace speedmla {

// out = fp8_e4m3(x × scale_inv), round to nearest even, saturating to ±448.
//   x    any shape (ndim <= 6), BF16, FP16 or FP32, last dim contiguous.
//   out  same shape, FP8 e4m3, last dim contiguous.
void quantize_fp8(const TensorView& x, const TensorView& out, float scale_inv = 1.0f,
                  Stream stream = nullptr);

// The prefill K/V pack: k = k_nope ‖ broadcast_heads(k_rope), v copied, both converted.
//   k_nope  [T, H, 128]  BF16, FP16 or FP32     k_rope [T, 64] or [T, 1, 64], same choice
//   v       [T, H, 128]
//   k_out   [T, H, 192]  FP8 e4m3 or BF16 (written): k_out[t,h,0:128] = k_nope[t,h] × k_scale_inv,
//                        k_out[t,h,128:192] = k_rope[t] × k_scale_inv
//   v_out   [T, H, 128]  same dtype as k_out (written): v × v_scale_inv
// Last dims contiguous. Conversion to FP8 rounds to nearest even and saturates to ±448.
void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, float k_scale_inv = 1.0f,
                     float v_scale_inv = 1.0f, Stream stream = nullptr);

// The same with v_out in `v_layout` (prefill.h), for mla_prefill's overload that takes it.
// kFp8Transposed: k_out and v_out FP8 e4m3; v_out [H, 128, P] with P >= T a multiple of 16, last
// dim contiguous (GPU: 16-byte aligned, strides multiples of 16 bytes); every position of the
// T tokens' 16-token groups is written, those of tokens >= T as 0 (positions from T rounded
// up to 16 on stay untouched). kTokenMajor: as above.
void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, PrefillValueLayout v_layout,
                     float k_scale_inv = 1.0f, float v_scale_inv = 1.0f, Stream stream = nullptr);

}  // namespace speedmla
