// Strided element access for the CPU reference: every operation reads and writes tensors only
// through these, so general strides, every dtype and the rounding rules live in one place.
// Offsets are in elements from t.data; rows step by t.stride(-1).
#pragma once

#include <cstdint>

#include "speedmla/tensor.h"

namespace speedmla::reference {

// Offset of the element at the given index of the leading dims (missing trailing indices
// count as 0).
template <typename... Index>
int64_t offset_of(const TensorView& t, Index... index) {
  int64_t offset = 0;
  int d = 0;
  ((offset += static_cast<int64_t>(index) * t.strides[d++]), ...);
  return offset;
}

// The element at `offset` of an int32 or int64 tensor.
int64_t load_index(const TensorView& t, int64_t offset);

// The element at `offset` of a floating tensor (FP8, BF16, FP16, FP32), exactly.
double load(const TensorView& t, int64_t offset);
// Writes `value` to the element at `offset`, rounded once (to nearest even) to t.dtype: FP32,
// BF16, FP16, or FP8 e4m3 (saturating to ±448). NaN stays NaN.
void store(const TensorView& t, int64_t offset, double value);
// dst[dst_offset] = convert(float(src[src_offset]) * scale): the conversion ops' rule. The
// product is taken in float, as the GPU kernels do, then rounded once to dst's dtype.
void convert(const TensorView& src, int64_t src_offset, const TensorView& dst,
             int64_t dst_offset, float scale);

// The same along `count` elements of the last dim. Every FP8/BF16/FP16/FP32 value is exact in
// float, so load_row may fill float (Dst = float) or double rows.
template <typename Dst>
void load_row(const TensorView& t, int64_t offset, int64_t count, Dst* dst);
void store_row(const TensorView& t, int64_t offset, int64_t count, const double* src);
void convert_row(const TensorView& src, int64_t src_offset, const TensorView& dst,
                 int64_t dst_offset, int64_t count, float scale);

}  // namespace speedmla::reference
