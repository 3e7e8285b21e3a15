#include "kernels/merge/merge_attn_states.h"

#include <cmath>

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"

namespace speedmla::kernels {
namespace {

// Elements per work item on the vector path: 8 BF16 (one 16-byte access) or 8 FP32 (two).
constexpr int kVectorChunk = 8;

// How one row is merged: out = fill + coef_a·out_a + coef_b·out_b, where a part of weight 0
// (lse -inf, or negligible next to the other) is left out, not even read, so that whatever its
// output holds cannot reach the result.
struct RowMerge {
  float coef_a, coef_b;  // w_a / (w_a + w_b), w_b / (w_a + w_b)
  float fill;            // 0, or NaN when an lse is NaN
  float lse;             // m + ln(w_a + w_b)
};

__device__ __forceinline__ RowMerge merge_row(float lse_a, float lse_b) {
  if (isnan(lse_a) || isnan(lse_b)) return {0.f, 0.f, NAN, NAN};
  if (lse_a == -INFINITY && lse_b == -INFINITY) return {0.f, 0.f, 0.f, -INFINITY};  // no key
  const float m = fmaxf(lse_a, lse_b);
  // exp(lse - m) is exactly 1 for the larger part, also when both are +inf (inf - inf = NaN).
  const float w_a = lse_a == m ? 1.f : expf(lse_a - m);
  const float w_b = lse_b == m ? 1.f : expf(lse_b - m);
  const float sum = w_a + w_b;
  return {w_a / sum, w_b / sum, 0.f, m + logf(sum)};
}

// Lanes of a warp that merge one row of `chunks_per_row` chunks: the smallest power of two
// covering them, at most 32, so that short rows (head_dim 128) still keep every lane busy.
__host__ __device__ constexpr int merge_lanes_per_row(int64_t chunks_per_row) {
  int lanes = 1;
  while (lanes < 32 && lanes < chunks_per_row) lanes *= 2;
  return lanes;
}

// A group of lanes_per_row lanes of a warp merges one row (t, h), kChunk elements per lane and
// step.
template <typename OutT, int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads)
    merge_attn_states_kernel(const MergeAttnStatesParams p) {
  const int64_t chunks_per_row = p.head_dim / kChunk;
  const int lanes_per_row = merge_lanes_per_row(chunks_per_row);
  const int rows_per_warp = 32 / lanes_per_row;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int lane_in_row = lane % lanes_per_row;
  const int64_t num_rows = p.num_tokens * p.num_heads;
  const int64_t rows_per_step = global_thread_count() / 32 * rows_per_warp;
  for (int64_t first = global_thread_index() / 32 * rows_per_warp; first < num_rows;
       first += rows_per_step) {
    const int64_t row = first + lane / lanes_per_row;
    const bool active = row < num_rows;
    const int64_t t = row / p.num_heads, h = row % p.num_heads;
    RowMerge merge{};
    if (active) {
      merge = merge_row(p.lse_a[t * p.lse_a_stride_token + h * p.lse_a_stride_head],
                        p.lse_b[t * p.lse_b_stride_token + h * p.lse_b_stride_head]);
      const int64_t a_row = t * p.out_a_stride_token + h * p.out_a_stride_head;
      const int64_t b_row = t * p.out_b_stride_token + h * p.out_b_stride_head;
      OutT* out_row = static_cast<OutT*>(p.out) + t * p.out_stride_token + h * p.out_stride_head;
      for (int64_t c = lane_in_row; c < chunks_per_row; c += lanes_per_row) {
        float values[kChunk], part[kChunk];
#pragma unroll
        for (float& v : values) v = merge.fill;
        if (merge.coef_a > 0.f) {
          load_floats(p.out_a, p.out_a_dtype, a_row + c * kChunk, part);
#pragma unroll
          for (int i = 0; i < kChunk; ++i) values[i] += merge.coef_a * part[i];
        }
        if (merge.coef_b > 0.f) {
          load_floats(p.out_b, p.out_b_dtype, b_row + c * kChunk, part);
#pragma unroll
          for (int i = 0; i < kChunk; ++i) values[i] += merge.coef_b * part[i];
        }
        store_floats(out_row + c * kChunk, values);
      }
    }
    // lse may be lse_a: every lane of the row has read it before it is overwritten.
    __syncwarp();
    if (active && lane_in_row == 0 && p.lse != nullptr)
      p.lse[t * p.lse_stride_token + h * p.lse_stride_head] = merge.lse;
  }
}

// Work items are the threads of the warps that cover every row.
template <typename OutT, int kChunk>
void launch_with_chunk(const MergeAttnStatesParams& p, Stream stream) {
  const int rows_per_warp = 32 / merge_lanes_per_row(p.head_dim / kChunk);
  const int64_t warps = (p.num_tokens * p.num_heads + rows_per_warp - 1) / rows_per_warp;
  launch_elementwise(merge_attn_states_kernel<OutT, kChunk>, warps * 32, p, stream);
}

template <typename OutT>
void launch(const MergeAttnStatesParams& p, Stream stream) {
  if (p.head_dim % kVectorChunk == 0 &&
      aligned16(p.out_a, p.out_a_dtype, {p.out_a_stride_token, p.out_a_stride_head}) &&
      aligned16(p.out_b, p.out_b_dtype, {p.out_b_stride_token, p.out_b_stride_head}) &&
      aligned16(p.out, p.out_dtype, {p.out_stride_token, p.out_stride_head}))
    launch_with_chunk<OutT, kVectorChunk>(p, stream);
  else
    launch_with_chunk<OutT, 1>(p, stream);
}

}  // namespace

void run_merge_attn_states(const MergeAttnStatesParams& params, Stream stream) {
  if (params.out_dtype == DType::kBFloat16)
    launch<bf16>(params, stream);
  else
    launch<float>(params, stream);
}

}  // namespace speedmla::kernels
