#include "kernels/quantize/pack_prefill_kv.h"

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "speedmla/decode.h"
#include "speedmla/prefill.h"

namespace speedmla::kernels {
namespace {

constexpr int kNopeDim = kPrefillQkDim - kRopeDim;  // 128: k_out[..., 0:128] from k_nope

// Elements per work item on the vector path: 16 FP8 (one 16-byte store) or 16 BF16 (two).
constexpr int kVectorChunk = 16;

// Output chunks of kChunk elements of one (token, head): those of the k_out row (k_nope, then
// k_rope), then those of the v_out row unless v_out is transposed (pack_transposed_values).
template <int kChunk>
__host__ __device__ constexpr int chunks_per_row(bool v_out_transposed) {
  return (kPrefillQkDim + (v_out_transposed ? 0 : kPrefillVDim)) / kChunk;
}

// One work item is one chunk.
template <typename OutT, int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads)
    pack_prefill_kv_kernel(const PackPrefillKvParams p) {
  constexpr int kNopeChunks = kNopeDim / kChunk;
  constexpr int kKChunks = kPrefillQkDim / kChunk;
  const int row_chunks = chunks_per_row<kChunk>(p.v_out_transposed);
  const int64_t items = p.num_tokens * p.num_heads * row_chunks;
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    const int64_t row = i / row_chunks;
    const int chunk = static_cast<int>(i % row_chunks);
    const int64_t t = row / p.num_heads, h = row % p.num_heads;
    float values[kChunk];
    float scale;
    OutT* dst;
    if (chunk < kKChunks) {
      const int column = chunk * kChunk;
      if (chunk < kNopeChunks)
        load_floats(p.k_nope, p.k_nope_dtype,
                    t * p.k_nope_stride_token + h * p.k_nope_stride_head + column, values);
      else
        load_floats(p.k_rope, p.k_rope_dtype, t * p.k_rope_stride_token + column - kNopeDim,
                    values);
      scale = p.k_scale_inv;
      dst = static_cast<OutT*>(p.k_out) + t * p.k_out_stride_token + h * p.k_out_stride_head + column;
    } else {
      const int column = (chunk - kKChunks) * kChunk;
      load_floats(p.v, p.v_dtype, t * p.v_stride_token + h * p.v_stride_head + column, values);
      scale = p.v_scale_inv;
      dst = static_cast<OutT*>(p.v_out) + t * p.v_out_stride_token + h * p.v_out_stride_head + column;
    }
#pragma unroll
    for (float& v : values) v *= scale;
    store_floats(dst, values);
  }
}

// Transposed FP8 values (PrefillValueLayout::kFp8Transposed): one work item is the 16 positions
// of one (head, 16-token group, dim), one 16-byte store; dims fastest, so a warp reads 32
// consecutive values of each token row. Position 4k + 2a + b holds token 8a + 2k + b of the
// group; tokens past num_tokens give zeros.
__global__ void __launch_bounds__(kElementwiseThreads) pack_transposed_values_kernel(const PackPrefillKvParams p) {
  const int64_t groups = (p.num_tokens + 15) / 16;
  const int64_t items = p.num_heads * groups * kPrefillVDim;
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    const int d = static_cast<int>(i % kPrefillVDim);
    const int64_t group = (i / kPrefillVDim) % groups, h = i / kPrefillVDim / groups;
    float values[16];
#pragma unroll
    for (int position = 0; position < 16; ++position) {
      const int k = position / 4, a = (position / 2) % 2, b = position % 2;
      const int64_t t = 16 * group + 8 * a + 2 * k + b;
      float value[1] = {0.f};
      if (t < p.num_tokens) load_floats(p.v, p.v_dtype, t * p.v_stride_token + h * p.v_stride_head + d, value);
      values[position] = value[0] * p.v_scale_inv;
    }
    store_floats(static_cast<fp8_e4m3*>(p.v_out) + h * p.v_out_stride_head + d * p.v_out_stride_dim + 16 * group,
                 values);
  }
}

template <typename OutT>
void launch(const PackPrefillKvParams& p, Stream stream) {
  const int64_t rows = p.num_tokens * p.num_heads;
  const bool vectors =
      aligned16(p.k_nope, p.k_nope_dtype, {p.k_nope_stride_token, p.k_nope_stride_head}) &&
      aligned16(p.k_rope, p.k_rope_dtype, {p.k_rope_stride_token}) &&
      aligned16(p.k_out, p.out_dtype, {p.k_out_stride_token, p.k_out_stride_head}) &&
      (p.v_out_transposed || (aligned16(p.v, p.v_dtype, {p.v_stride_token, p.v_stride_head}) &&
                              aligned16(p.v_out, p.out_dtype, {p.v_out_stride_token, p.v_out_stride_head})));
  if (vectors)
    launch_elementwise(pack_prefill_kv_kernel<OutT, kVectorChunk>,
                       rows * chunks_per_row<kVectorChunk>(p.v_out_transposed), p, stream);
  else
    launch_elementwise(pack_prefill_kv_kernel<OutT, 1>, rows * chunks_per_row<1>(p.v_out_transposed), p, stream);
  if (p.v_out_transposed)
    launch_elementwise(pack_transposed_values_kernel, p.num_heads * ((p.num_tokens + 15) / 16) * kPrefillVDim, p,
                       stream);
}

}  // namespace

void run_pack_prefill_kv(const PackPrefillKvParams& params, Stream stream) {
  if (params.out_dtype == DType::kFloat8E4M3)
    launch<fp8_e4m3>(params, stream);
  else
    launch<bf16>(params, stream);
}

}  // namespace speedmla::kernels
