#include <cuda_bf16.h>

#include "kernels/decode/sm90/combine.h"
#include "kernels/decode/sm90/plan.cuh"

namespace speedmla::kernels::decode_sm90 {
namespace {

constexpr int kCombineThreads = 128;
constexpr int kRowsPerCta = 16;
constexpr int kDimsPerLane = kLatentDim / 32;  // 16: four float4 per lane

// One warp per query row: lanes own 16 consecutive output columns each.
__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(DecodeParams p) {
  const int request = blockIdx.x;
  const RequestPlan plan = p.plans[request];
  if (plan.split_slot < 0) return;  // the main kernel wrote this request directly
  const int num_splits = request_num_splits(plan, p.plan_header->units_per_part);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  for (int row = blockIdx.y * kRowsPerCta + warp; row < min(p.num_rows, (blockIdx.y + 1) * kRowsPerCta);
       row += kCombineThreads / 32) {
    float max_lse = -INFINITY;  // NaN-propagating maximum: a NaN partial must poison the row
    for (int s = 0; s < num_splits; ++s) {
      const float lse = p.partial_lse[static_cast<int64_t>(plan.split_slot + s) * p.num_rows + row];
      max_lse = (lse > max_lse || lse != lse) ? lse : max_lse;
    }
    float acc[kDimsPerLane] = {};
    float weight_sum = 0.f;
    if (max_lse != -INFINITY) {
      for (int s = 0; s < num_splits; ++s) {
        const int64_t slot_row = static_cast<int64_t>(plan.split_slot + s) * p.num_rows + row;
        const float weight = expf(p.partial_lse[slot_row] - max_lse);
        weight_sum += weight;
        const float4* src = reinterpret_cast<const float4*>(p.partial_out + slot_row * kLatentDim) + lane * 4;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float4 x = src[v];
          acc[4 * v + 0] += weight * x.x;
          acc[4 * v + 1] += weight * x.y;
          acc[4 * v + 2] += weight * x.z;
          acc[4 * v + 3] += weight * x.w;
        }
      }
    }
    // An all-empty row (every part saw no key) is 0 with lse -inf; a NaN partial stays NaN.
    const float norm = weight_sum > 0.f ? p.output_scale / weight_sum : (max_lse != max_lse ? NAN : 0.f);
    const int token = row / p.num_heads, head = row % p.num_heads;
    uint16_t* dst = p.out + request * p.out_stride_batch + token * p.out_stride_token +
                    head * p.out_stride_head + lane * kDimsPerLane;
    uint4 packed[2];
    uint32_t* words = reinterpret_cast<uint32_t*>(packed);
#pragma unroll
    for (int i = 0; i < kDimsPerLane / 2; ++i) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[2 * i] * norm, acc[2 * i + 1] * norm);
      words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    reinterpret_cast<uint4*>(dst)[0] = packed[0];
    reinterpret_cast<uint4*>(dst)[1] = packed[1];
    if (p.lse != nullptr && lane == 0) {
      const float lse = weight_sum > 0.f ? max_lse + logf(weight_sum) : max_lse;
      p.lse[request * p.lse_stride_batch + token * p.lse_stride_token + head * p.lse_stride_head] = lse;
    }
  }
}

}  // namespace

void run_decode_combine(const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(params.batch, (params.num_rows + kRowsPerCta - 1) / kRowsPerCta);
  decode_combine_kernel<<<grid, kCombineThreads, 0, stream>>>(params);
}

}  // namespace speedmla::kernels::decode_sm90
