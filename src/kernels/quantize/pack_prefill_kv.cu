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

// One work item is kChunk consecutive output elements of one (token, head): the chunks of the
// k_out row (k_nope, then k_rope) followed by those of the v_out row.
template <typename OutT, int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads)
    pack_prefill_kv_kernel(const PackPrefillKvParams p) {
  constexpr int kNopeChunks = kNopeDim / kChunk;
  constexpr int kKChunks = kPrefillQkDim / kChunk;
  constexpr int kChunksPerRow = kKChunks + kPrefillVDim / kChunk;
  const int64_t items = p.num_tokens * p.num_heads * kChunksPerRow;
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    const int64_t row = i / kChunksPerRow;
    const int chunk = static_cast<int>(i % kChunksPerRow);
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
  const int64_t rows = p.num_tokens * p.num_heads;
  constexpr int kRowLength = kPrefillQkDim + kPrefillVDim;
  if (aligned16(p.k_nope, p.k_nope_dtype, {p.k_nope_stride_token, p.k_nope_stride_head}) &&
      aligned16(p.k_rope, p.k_rope_dtype, {p.k_rope_stride_token}) &&
      aligned16(p.v, p.v_dtype, {p.v_stride_token, p.v_stride_head}) &&
      aligned16(p.k_out, p.out_dtype, {p.k_out_stride_token, p.k_out_stride_head}) &&
      aligned16(p.v_out, p.out_dtype, {p.v_out_stride_token, p.v_out_stride_head}))
    launch_elementwise(pack_prefill_kv_kernel<OutT, kVectorChunk>,
                       rows * (kRowLength / kVectorChunk), p, stream);
  else
    launch_elementwise(pack_prefill_kv_kernel<OutT, 1>, rows * kRowLength, p, stream);
}

}  // namespace

void run_pack_prefill_kv(const PackPrefillKvParams& params, Stream stream) {
  if (params.out_dtype == DType::kFloat8E4M3)
    launch<fp8_e4m3>(params, stream);
  else
    launch<bf16>(params, stream);
}

}  // namespace speedmla::kernels
