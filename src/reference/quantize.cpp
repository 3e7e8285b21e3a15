// Reference FP8 quantisation and prefill K/V pack (speedmla/quantize.h).
#include "reference/element.h"
#include "reference/parallel.h"
#include "speedmla/decode.h"
#include "speedmla/prefill.h"
#include "speedmla/reference.h"

namespace speedmla::reference {

void quantize_fp8(const TensorView& x, const TensorView& out, float scale_inv) {
  // One task per element: its multi-index gives the offsets in both views.
  parallel_for(x.numel(), 8, [&](int64_t element) {
    int64_t x_offset = 0, out_offset = 0;
    for (int d = x.ndim - 1; d >= 0; --d) {
      const int64_t index = element % x.shape[d];
      element /= x.shape[d];
      x_offset += index * x.strides[d];
      out_offset += index * out.strides[d];
    }
    convert(x, x_offset, out, out_offset, scale_inv);
  });
}

void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, float k_scale_inv,
                     float v_scale_inv) {
  pack_prefill_kv(k_nope, k_rope, v, k_out, v_out, PrefillValueLayout::kTokenMajor, k_scale_inv, v_scale_inv);
}

void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, PrefillValueLayout v_layout,
                     float k_scale_inv, float v_scale_inv) {
  constexpr int64_t kNopeDim = kPrefillQkDim - kRopeDim;  // 128 nope dims, then 64 rope dims
  const int64_t num_tokens = k_nope.size(0), num_heads = k_nope.size(1);
  const bool transposed = v_layout == PrefillValueLayout::kFp8Transposed;
  parallel_for(num_tokens * num_heads, kPrefillQkDim + kPrefillVDim, [&](int64_t row) {
    const int64_t t = row / num_heads, h = row % num_heads;
    const int64_t k_row = offset_of(k_out, t, h);
    convert_row(k_nope, offset_of(k_nope, t, h), k_out, k_row, kNopeDim, k_scale_inv);
    // k_rope is [T, 64] or [T, 1, 64]: either way row t starts at t * stride(0).
    convert_row(k_rope, offset_of(k_rope, t), k_out, k_row + kNopeDim * k_out.stride(2),
                kRopeDim, k_scale_inv);
    if (!transposed) {
      convert_row(v, offset_of(v, t, h), v_out, offset_of(v_out, t, h), kPrefillVDim, v_scale_inv);
      return;
    }
    const int64_t position = fp8_transposed_value_position(t);
    for (int64_t d = 0; d < kPrefillVDim; ++d)
      convert(v, offset_of(v, t, h) + d * v.stride(2), v_out, offset_of(v_out, h, d) + position * v_out.stride(2),
              v_scale_inv);
  });
  if (!transposed) return;
  // The last group's positions of tokens past T: zeros (FP8 0 is the zero byte).
  auto* bytes = static_cast<uint8_t*>(v_out.data);
  for (int64_t t = num_tokens; t < fp8_transposed_value_positions(num_tokens); ++t) {
    const int64_t position = fp8_transposed_value_position(t);
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t d = 0; d < kPrefillVDim; ++d) bytes[offset_of(v_out, h, d) + position * v_out.stride(2)] = 0;
  }
}

}  // namespace speedmla::reference
