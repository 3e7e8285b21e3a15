#include "kernels/quantize/quantize_fp8.h"

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"

namespace speedmla::kernels {
namespace {

// Elements per work item on the vector path: one 16-byte FP8 store.
constexpr int kVectorChunk = 16;

// One work item is kChunk consecutive elements of one row.
template <int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads) quantize_fp8_kernel(const QuantizeFp8Params p) {
  const int64_t chunks_per_row = p.row_length / kChunk;
  const int64_t items = p.num_rows * chunks_per_row;
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    int64_t row = i / chunks_per_row;
    const int64_t column = (i - row * chunks_per_row) * kChunk;
    int64_t x_offset = column, out_offset = column;
#pragma unroll
    for (int d = kQuantizeMaxOuterDims - 1; d >= 0; --d) {
      if (d >= p.num_outer_dims) continue;
      const int64_t index = row % p.outer_shape[d];
      row /= p.outer_shape[d];
      x_offset += index * p.x_outer_strides[d];
      out_offset += index * p.out_outer_strides[d];
    }
    float values[kChunk];
    load_floats(p.x, p.x_dtype, x_offset, values);
#pragma unroll
    for (float& v : values) v *= p.scale_inv;
    store_floats(static_cast<fp8_e4m3*>(p.out) + out_offset, values);
  }
}

}  // namespace

void run_quantize_fp8(const QuantizeFp8Params& params, Stream stream) {
  if (params.row_length % kVectorChunk == 0 &&
      aligned16(params.x, params.x_dtype, params.x_outer_strides) &&
      aligned16(params.out, DType::kFloat8E4M3, params.out_outer_strides))
    launch_elementwise(quantize_fp8_kernel<kVectorChunk>,
                       params.num_rows * (params.row_length / kVectorChunk), params, stream);
  else
    launch_elementwise(quantize_fp8_kernel<1>, params.num_rows * params.row_length, params, stream);
}

}  // namespace speedmla::kernels
