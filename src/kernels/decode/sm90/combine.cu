#include <cuda_bf16.h>

#include "kernels/decode/sm90/combine.h"
#include "kernels/decode/sm90/plan.cuh"
#include "kernels/sm90/dependent_launch.cuh"

namespace speedmla::kernels::decode_sm90 {
namespace {

// One warp per (split request, query row, 128 output columns): lane l owns columns 4l .. 4l + 3
// of the warp's 128, so each load instruction of a warp reads 512 contiguous bytes. Warps meet
// at no CTA barrier: each computes its row's piece weights itself (a few exponentials), 32
// pieces at a time, one per lane, broadcast by shuffles. A request has at most num_parts
// pieces in the balanced policy (any number in the batch-invariant one); long contexts on small batches have many (B = 4: ~33), and few rows, so splitting a
// row's columns over four warps is what keeps enough loads in flight to reach the memory's
// bandwidth there.
//
// Grid: (row pairs, columns). In the balanced policy at most num_parts - 1 requests are split
// (every cut between two parts lies inside one request), so min(batch, num_parts - 1) CTA
// columns suffice: column y combines the split ones among requests y, y + columns, ... (the
// batch-invariant policy may split more; the columns then take more requests each, in the
// same fixed order). The host cannot know which (the
// plan is made on the GPU); one CTA per request and row pair instead made 8192 CTAs at B = 128,
// H = 64, q_len 2, about 8 us of launching CTAs that mostly find nothing to do.
constexpr int kColumnsPerWarp = 128;
constexpr int kWarpsPerRow = kLatentDim / kColumnsPerWarp;
constexpr int kCombineRows = 2;  // rows of one request per CTA
constexpr int kCombineThreads = 32 * kWarpsPerRow * kCombineRows;

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// Pieces whose partial loads are issued before their weights are known (combine_row):
// 8 in general; 16 where requests are cut into many pieces (a small batch on a long context,
// B = 4: ~33 pieces a row), so that a row costs three memory round trips after its plan instead
// of five. 16 take 128 registers a thread, two CTAs an SM: where rows have few pieces (large
// batches) the combine is bound by bandwidth over many rows and wants the occupancy of 8.
constexpr int kPiecesAhead = 8;
constexpr int kManyPiecesAhead = 16;

__device__ __forceinline__ void accumulate(float4& acc, float w, const float4& x) {
  // An empty piece weighs 0 and its partial may hold anything: it is skipped, not multiplied
  // (0 * NaN).
  if (w != 0.f) {
    acc.x = fmaf(w, x.x, acc.x);
    acc.y = fmaf(w, x.y, acc.y);
    acc.z = fmaf(w, x.z, acc.z);
    acc.w = fmaf(w, x.w, acc.w);
  }
}

// Combines one row's 128 columns (this warp's) of one split request. At small batch an SM
// holds few such warps and each waits on memory, so the first kAhead partials are
// loaded together with the pieces' LSE (one per lane, kept for the weights): one memory round
// trip before the first accumulation, where loading the partials after the weights took three.
template <int kAhead>
__device__ void combine_row(const DecodeParams& p, const RequestPlan& plan, int piece_units, int request,
                            int row, int column, int lane) {
  const int num_splits = request_num_splits(plan, piece_units);
  const float* lse = p.partial_lse + static_cast<int64_t>(plan.split_slot) * p.num_rows + row;
  const float4* src = reinterpret_cast<const float4*>(
      p.partial_out + (static_cast<int64_t>(plan.split_slot) * p.num_rows + row) * kLatentDim + column);
  const int64_t split_stride = static_cast<int64_t>(p.num_rows) * kLatentDim / 4;  // in float4

  static_assert(kAhead <= 32, "the pieces loaded ahead are the first round's");
  float4 ahead[kAhead];
#pragma unroll
  for (int k = 0; k < kAhead; ++k)
    if (k < num_splits) ahead[k] = src[k * split_stride];
  const float first_lse = lane < num_splits ? lse[static_cast<int64_t>(lane) * p.num_rows] : -INFINITY;

  // NaN-propagating maximum of the pieces' LSE: a NaN piece must poison the row.
  float max_lse = first_lse;
  for (int s = 32 + lane; s < num_splits; s += 32) max_lse = nan_max(max_lse, lse[static_cast<int64_t>(s) * p.num_rows]);
  for (int d = 16; d > 0; d /= 2) max_lse = nan_max(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));
  // All pieces empty (-inf): the row saw no key, out 0 and lse -inf.
  const bool empty = max_lse == -INFINITY;

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  for (int first = 0; first < num_splits; first += 32) {
    const int mine = first + lane;
    const float my_lse = first == 0 ? first_lse : mine < num_splits ? lse[static_cast<int64_t>(mine) * p.num_rows] : -INFINITY;
    const float my_weight = empty || mine >= num_splits ? 0.f : expf(my_lse - max_lse);
    sum += my_weight;
    const int count = min(32, num_splits - first);
    int k = 0;
    if (first == 0) {
#pragma unroll
      for (; k < kAhead; ++k) {
        const float w = __shfl_sync(0xffffffffu, my_weight, k);
        if (k < count) accumulate(acc, w, ahead[k]);
      }
    }
#pragma unroll 8
    for (; k < count; ++k) accumulate(acc, __shfl_sync(0xffffffffu, my_weight, k), src[(first + k) * split_stride]);
  }
  for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);

  const float norm = sum > 0.f ? p.output_scale / sum : (max_lse != max_lse ? NAN : 0.f);
  const int token = row / p.num_heads, head = row % p.num_heads;
  uint16_t* dst =
      p.out + request * p.out_stride_batch + token * p.out_stride_token + head * p.out_stride_head + column;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * norm, acc.y * norm);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * norm, acc.w * norm);
  uint2 packed;
  packed.x = *reinterpret_cast<const uint32_t*>(&lo);
  packed.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(dst) = packed;
  if (p.lse != nullptr && column == 0)
    p.lse[request * p.lse_stride_batch + token * p.lse_stride_token + head * p.lse_stride_head] =
        sum > 0.f ? max_lse + logf(sum) : max_lse;
}

template <int kAhead>
__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(DecodeParams p) {
  sm90::grid_dependency_wait();  // a dependent of the main kernel: its partials are complete
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x * kCombineRows + warp / kWarpsPerRow;
  const int column = (warp % kWarpsPerRow) * kColumnsPerWarp + 4 * lane;
  if (row >= p.num_rows) return;
  const int piece_units = p.plan_header->piece_units;  // in flight with the plans below
  // This column's requests, 32 at a time: lane i reads the plan of the i-th (one round trip
  // for all), and the split ones are combined in order. The others were written directly by
  // the main kernel.
  const int columns = gridDim.y;
  for (int first = blockIdx.y; first < p.batch; first += 32 * columns) {
    const int mine = first + lane * columns;
    const bool split = mine < p.batch && p.plans[mine].split_slot >= 0;
    for (uint32_t pending = __ballot_sync(0xffffffffu, split); pending != 0; pending &= pending - 1) {
      const int request = first + (__ffs(pending) - 1) * columns;
      combine_row<kAhead>(p, p.plans[request], piece_units, request, row, column, lane);
    }
  }
}

}  // namespace

void run_decode_combine(const DecodeParams& params, cudaStream_t stream) {
  const int columns = params.batch < params.num_parts - 1 ? params.batch : params.num_parts - 1;
  const dim3 grid((params.num_rows + kCombineRows - 1) / kCombineRows, columns > 1 ? columns : 1);
  // In the balanced policy a split request has about num_parts / batch pieces (the plan is made
  // on the GPU; the batch-invariant one may cut more, which only makes either choice correct).
  const bool many_pieces = params.num_parts >= 8 * params.batch;
  sm90::launch_dependent(many_pieces ? decode_combine_kernel<kManyPiecesAhead> : decode_combine_kernel<kPiecesAhead>,
                         grid, dim3(kCombineThreads), 0, stream, params);
}

}  // namespace speedmla::kernels::decode_sm90
