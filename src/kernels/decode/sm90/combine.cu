#include <cuda_bf16.h>

#include "kernels/decode/sm90/combine.h"
#include "kernels/decode/sm90/plan.cuh"
#include "kernels/sm90/dependent_launch.cuh"

namespace speedmla::kernels::decode_sm90 {
namespace {

// One CTA per (request, query row): thread t owns output columns 4t..4t+3. A request is cut
// into at most num_parts pieces, and long contexts on small batches hit that bound (B = 4:
// ~33 pieces a request), so the loop over pieces keeps several independent loads in flight.
constexpr int kCombineThreads = kLatentDim / 4;  // 128

__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(DecodeParams p) {
  sm90::grid_dependency_wait();  // a dependent of the main kernel: its partials are complete
  const int row = blockIdx.x, request = blockIdx.y;
  const RequestPlan plan = p.plans[request];
  if (plan.split_slot < 0) return;  // the main kernel wrote this request directly
  const int num_splits = request_num_splits(plan, p.plan_header->units_per_part);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  __shared__ float weight[kMaxParts];  // a request has at most num_parts <= kMaxParts pieces
  __shared__ float warp_value[kCombineThreads / 32];

  // NaN-propagating maximum of the pieces' LSE: a NaN piece must poison the row.
  auto nan_max = [](float a, float b) { return (b > a || b != b) ? b : a; };
  const float* lse = p.partial_lse + static_cast<int64_t>(plan.split_slot) * p.num_rows + row;
  float max_lse = -INFINITY;
  for (int s = t; s < num_splits; s += kCombineThreads) max_lse = nan_max(max_lse, lse[static_cast<int64_t>(s) * p.num_rows]);
  for (int d = 16; d > 0; d /= 2) max_lse = nan_max(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));
  if (lane == 0) warp_value[warp] = max_lse;
  __syncthreads();
  max_lse = nan_max(nan_max(warp_value[0], warp_value[1]), nan_max(warp_value[2], warp_value[3]));
  __syncthreads();

  // All pieces empty (-inf): the row saw no key, out 0 and lse -inf.
  const bool empty = max_lse == -INFINITY;
  float sum = 0.f;
  for (int s = t; s < num_splits; s += kCombineThreads) {
    const float w = empty ? 0.f : expf(lse[static_cast<int64_t>(s) * p.num_rows] - max_lse);
    weight[s] = w;
    sum += w;
  }
  for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  if (lane == 0) warp_value[warp] = sum;
  __syncthreads();
  sum = warp_value[0] + warp_value[1] + warp_value[2] + warp_value[3];

  const float4* src = reinterpret_cast<const float4*>(
      p.partial_out + (static_cast<int64_t>(plan.split_slot) * p.num_rows + row) * kLatentDim) + t;
  const int64_t split_stride = static_cast<int64_t>(p.num_rows) * kLatentDim / 4;  // in float4
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int s = 0; s < num_splits; ++s) {
    const float w = weight[s];
    if (w == 0.f) continue;  // an empty piece (its output is 0, maybe never written as NaN-free)
    const float4 x = src[s * split_stride];
    acc.x += w * x.x;
    acc.y += w * x.y;
    acc.z += w * x.z;
    acc.w += w * x.w;
  }
  const float norm = sum > 0.f ? p.output_scale / sum : (max_lse != max_lse ? NAN : 0.f);
  const int token = row / p.num_heads, head = row % p.num_heads;
  uint16_t* dst = p.out + request * p.out_stride_batch + token * p.out_stride_token + head * p.out_stride_head + 4 * t;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * norm, acc.y * norm);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * norm, acc.w * norm);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = packed;
  if (p.lse != nullptr && t == 0)
    p.lse[request * p.lse_stride_batch + token * p.lse_stride_token + head * p.lse_stride_head] =
        sum > 0.f ? max_lse + logf(sum) : max_lse;
}

}  // namespace

void run_decode_combine(const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(params.num_rows, params.batch);
  sm90::launch_dependent(decode_combine_kernel, grid, dim3(kCombineThreads), 0, stream, params);
}

}  // namespace speedmla::kernels::decode_sm90
