// quantize_fp8 on the GPU: launch parameters and launcher.
#pragma once

#include <cstdint>

#include "speedmla/tensor.h"

namespace speedmla::kernels {

inline constexpr int kQuantizeMaxOuterDims = kMaxDims - 1;

// out = fp8_e4m3(x × scale_inv) over a tensor seen as rows of row_length contiguous elements,
// indexed by up to kQuantizeMaxOuterDims outer dims.
struct QuantizeFp8Params {
  const void* x;    // BF16, FP16 or FP32
  DType x_dtype;
  void* out;        // FP8 e4m3 (written)
  // Outer dims, outermost first; entries past num_outer_dims are unused (strides 0). Dims that
  // are contiguous with the next in both x and out are merged into it on the host, so a
  // contiguous tensor is one row.
  int num_outer_dims;
  int64_t outer_shape[kQuantizeMaxOuterDims];
  int64_t x_outer_strides[kQuantizeMaxOuterDims];    // elements
  int64_t out_outer_strides[kQuantizeMaxOuterDims];  // elements
  int64_t row_length;  // elements per row (the last dims, merged), stride 1 in x and out
  int64_t num_rows;    // derived: product of outer_shape
  float scale_inv;
};

void run_quantize_fp8(const QuantizeFp8Params& params, Stream stream);

}  // namespace speedmla::kernels
