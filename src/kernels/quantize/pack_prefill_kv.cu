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

// Work items: the chunks of kChunk elements of each (token, head) row, k_out's (k_nope, then
// k_rope) then v_out's; with v_out transposed (PrefillValueLayout::kFp8Transposed), in place of
// v_out's chunks, one item per (head, 16-token group, value dim), after all the rows' items
// (transposed_value_group). One launch either way.
template <int kChunk>
__host__ __device__ constexpr int chunks_per_row(bool v_out_transposed) {
  return (kPrefillQkDim + (v_out_transposed ? 0 : kPrefillVDim)) / kChunk;
}
__host__ __device__ inline int64_t transposed_value_items(const PackPrefillKvParams& p) {
  if (!p.v_out_transposed) return 0;
  return p.num_heads * (fp8_transposed_value_positions(p.num_tokens) / kFp8TransposedGroupTokens) * kPrefillVDim;
}
template <int kChunk>
int64_t pack_items(const PackPrefillKvParams& p) {
  return p.num_tokens * p.num_heads * chunks_per_row<kChunk>(p.v_out_transposed) + transposed_value_items(p);
}

// The 16 positions of one (head, token group, value dim) of transposed values, one 16-byte
// store; dims fastest, so a warp reads 32 consecutive values of each token row. Tokens past
// num_tokens give zeros.
__device__ void pack_transposed_value_group(const PackPrefillKvParams& p, int64_t item) {
  const int64_t groups = fp8_transposed_value_positions(p.num_tokens) / kFp8TransposedGroupTokens;
  const int d = static_cast<int>(item % kPrefillVDim);
  const int64_t group = (item / kPrefillVDim) % groups, h = item / kPrefillVDim / groups;
  float values[kFp8TransposedGroupTokens];
#pragma unroll
  for (int position = 0; position < kFp8TransposedGroupTokens; ++position) {
    const int64_t t = kFp8TransposedGroupTokens * group + fp8_transposed_value_token(position);
    float value[1] = {0.f};
    if (t < p.num_tokens) load_floats(p.v, p.v_dtype, t * p.v_stride_token + h * p.v_stride_head + d, value);
    values[position] = value[0] * p.v_scale_inv;
  }
  store_floats(static_cast<fp8_e4m3*>(p.v_out) + h * p.v_out_stride_head + d * p.v_out_stride_dim +
                   kFp8TransposedGroupTokens * group,
               values);
}

template <typename OutT, int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads)
    pack_prefill_kv_kernel(const PackPrefillKvParams p) {
  constexpr int kNopeChunks = kNopeDim / kChunk;
  constexpr int kKChunks = kPrefillQkDim / kChunk;
  const int row_chunks = chunks_per_row<kChunk>(p.v_out_transposed);
  const int64_t row_items = p.num_tokens * p.num_heads * row_chunks;
  const int64_t items = row_items + transposed_value_items(p);
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    if (i >= row_items) {
      pack_transposed_value_group(p, i - row_items);
      continue;
    }
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

template <typename OutT>
void launch(const PackPrefillKvParams& p, Stream stream) {
  const bool vectors =
      aligned16(p.k_nope, p.k_nope_dtype, {p.k_nope_stride_token, p.k_nope_stride_head}) &&
      aligned16(p.k_rope, p.k_rope_dtype, {p.k_rope_stride_token}) &&
      aligned16(p.k_out, p.out_dtype, {p.k_out_stride_token, p.k_out_stride_head}) &&
      (p.v_out_transposed || (aligned16(p.v, p.v_dtype, {p.v_stride_token, p.v_stride_head}) &&
                              aligned16(p.v_out, p.out_dtype, {p.v_out_stride_token, p.v_out_stride_head})));
  if (vectors)
    launch_elementwise(pack_prefill_kv_kernel<OutT, kVectorChunk>, pack_items<kVectorChunk>(p), p, stream);
  else
    launch_elementwise(pack_prefill_kv_kernel<OutT, 1>, pack_items<1>(p), p, stream);
}

}  // namespace

void run_pack_prefill_kv(const PackPrefillKvParams& params, Stream stream) {
  if (params.out_dtype == DType::kFloat8E4M3)
    launch<fp8_e4m3>(params, stream);
  else
    launch<bf16>(params, stream);
}

}  // namespace speedmla::kernels
