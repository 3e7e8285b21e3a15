#include <cuda_bf16.h>

#include "kernels/decode/sm90/combine.h"
#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/slot_handover.cuh"
#include "kernels/sm90/dependent_launch.cuh"

namespace speedmla::kernels::decode_sm90 {
namespace {

// Work: the plan's compact list of split requests (PlanHeader::num_split_requests entries of
// DecodeParams::split_requests). Grid: (row groups, list entries), at most max_split_requests
// columns; a CTA whose entry lies past the list's end has nothing to do. It runs beside the
// main kernel's tail: each piece is merged once the main kernel has counted it written
// (slot_handover.cuh).
//
// A warp combines one query row's 512 columns (lane l owns columns 4l + 128c, c = 0..3: each
// load instruction of the warp reads 512 contiguous bytes) over some of the row's pieces: the
// row's pieces are dealt round-robin to kPieceGroups warps, each loading kPiecesPerRound of them
// (and their LSE) at once before using any, and merging them into its own running
// (max, sum, accumulator) online. A row costs one memory round trip per round. Batches at least
// as large as the part count cut a request into two pieces, rarely three (kPieceGroups 1: a
// warp per row, eight rows a CTA); small batches on long contexts into many (B = 4 on 132 SMs:
// ~34), dealt over up to eight warps of one CTA that then merge their results through shared
// memory.
// The warps of a CTA meet only there. (The kernel before this one scanned the batch's plans per
// CTA and took three to five round trips a row. H200, µs past the main kernel's end, before ->
// now: B = 128 s_k 8K H = 128 q_len 2 21.7 -> 11.7 (FlashMLA's combine 10.0), H·q_len 32-128
// 3.8-6.6 -> 1.2-1.6, B = 4 s_k 80K H = 16 q_len 4 9.2 -> 6.9; B = 16 there 8.9 -> 10.0.)
constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = 32 * kCombineWarps;
// Query rows a CTA merges when each row's pieces are dealt over kPieceGroups warps: the kernel's
// row index and the launch's grid both follow from it.
template <int kPieceGroups>
constexpr int kRowsPerCta = kCombineWarps / kPieceGroups;
constexpr int kColumnsPerLane = kLatentDim / 32;  // 16: four float4 a piece
constexpr int kChunksPerLane = kColumnsPerLane / 4;

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

// Running merge of one row's pieces by their LSE: out = sum_i e^(lse_i - max) o_i / sum_i
// e^(lse_i - max). A NaN LSE poisons the row (nan_max makes it the max, and every weight NaN);
// an empty piece (LSE -inf) weighs 0 and is skipped, never multiplied (its partial may hold
// anything, and 0 * NaN is NaN).
struct RowMerge {
  float max = -INFINITY;
  float sum = 0.f;
  float acc[kColumnsPerLane] = {};

  // Folds in pieces with LSE lse[k] and partial columns x[k] (this lane's).
  template <int kCount>
  __device__ __forceinline__ void add(const float (&lse)[kCount], const float4 (&x)[kCount][kChunksPerLane]) {
    float round_max = max;
#pragma unroll
    for (int k = 0; k < kCount; ++k) round_max = nan_max(round_max, lse[k]);
    if (round_max == -INFINITY) return;  // every piece so far empty
    // max is -inf (nothing yet: acc and sum are 0) or finite; round_max finite or NaN.
    const float rescale = max == -INFINITY ? 0.f : expf(max - round_max);
    sum *= rescale;
#pragma unroll
    for (int i = 0; i < kColumnsPerLane; ++i) acc[i] *= rescale;
    max = round_max;
#pragma unroll
    for (int k = 0; k < kCount; ++k) {
      const float w = expf(lse[k] - round_max);
      if (w == 0.f) continue;
      sum += w;
#pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c) {
        acc[4 * c + 0] = fmaf(w, x[k][c].x, acc[4 * c + 0]);
        acc[4 * c + 1] = fmaf(w, x[k][c].y, acc[4 * c + 1]);
        acc[4 * c + 2] = fmaf(w, x[k][c].z, acc[4 * c + 2]);
        acc[4 * c + 3] = fmaf(w, x[k][c].w, acc[4 * c + 3]);
      }
    }
  }
};

// Merges the row's pieces group, group + kPieceGroups, ... (of num_splits) into `merge`, each
// round's once the main kernel has written them (slot_handover.cuh).
template <int kPieceGroups, int kPiecesPerRound>
__device__ __forceinline__ void merge_pieces(const DecodeParams& p, const SplitRequest& split, int row, int group,
                                             int lane, RowMerge& merge) {
  const float* lse = p.partial_lse + static_cast<int64_t>(split.slot) * p.num_rows + row;
  const float4* partial = reinterpret_cast<const float4*>(
      p.partial_out + (static_cast<int64_t>(split.slot) * p.num_rows + row) * kLatentDim) + lane;
  const int64_t piece_stride = static_cast<int64_t>(p.num_rows) * kLatentDim / 4;  // in float4
  for (int first = group; first < split.num_splits; first += kPieceGroups * kPiecesPerRound) {
    const int round_pieces = (split.num_splits - first + kPieceGroups - 1) / kPieceGroups;
    wait_slots_written(p, split.slot + first, kPieceGroups, min(round_pieces, kPiecesPerRound));
    float piece_lse[kPiecesPerRound];
    float4 x[kPiecesPerRound][kChunksPerLane];
#pragma unroll
    for (int k = 0; k < kPiecesPerRound; ++k) {
      const int piece = first + k * kPieceGroups;
      piece_lse[k] = piece < split.num_splits ? lse[static_cast<int64_t>(piece) * p.num_rows] : -INFINITY;
#pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c)
        if (piece < split.num_splits) x[k][c] = __ldcs(partial + piece * piece_stride + 32 * c);
    }
    merge.add(piece_lse, x);
  }
}

// Writes columns [column, column + kCount) of one row: BF16 out * output_scale / sum.
template <int kCount>
__device__ __forceinline__ void store_columns(const DecodeParams& p, int request, int row, int column,
                                              const float (&values)[kCount], float norm) {
  static_assert(kCount % 2 == 0 && kCount <= 4, "bfloat162 pairs, at most 8 bytes a store");
  const int token = row / p.num_heads, head = row % p.num_heads;
  uint16_t* dst =
      p.out + request * p.out_stride_batch + token * p.out_stride_token + head * p.out_stride_head + column;
  uint32_t packed[kCount / 2];
#pragma unroll
  for (int i = 0; i < kCount / 2; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(values[2 * i] * norm, values[2 * i + 1] * norm);
    packed[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  if constexpr (kCount == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  else *reinterpret_cast<uint32_t*>(dst) = packed[0];
}

__device__ __forceinline__ void store_lse(const DecodeParams& p, int request, int row, float max, float sum) {
  if (p.lse == nullptr) return;
  const int token = row / p.num_heads, head = row % p.num_heads;
  p.lse[request * p.lse_stride_batch + token * p.lse_stride_token + head * p.lse_stride_head] =
      sum > 0.f ? max + logf(sum) : max;
}

// All pieces empty (-inf, sum 0): out 0 and lse -inf; a NaN max: NaN.
__device__ __forceinline__ float output_norm(const DecodeParams& p, float max, float sum) {
  return sum > 0.f ? p.output_scale / sum : (max != max ? NAN : 0.f);
}

template <int kPieceGroups, int kPiecesPerRound>
__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(DecodeParams p) {
  static_assert(kCombineWarps % kPieceGroups == 0, "whole rows a CTA");
  // The groups' results, for the cross-warp merge (kPieceGroups > 1 only); 16-byte aligned for
  // the float4 stores of acc.
  struct alignas(16) GroupResult {
    float acc[kLatentDim];
    float max, sum;
  };
  __shared__ GroupResult results[kPieceGroups > 1 ? kCombineWarps : 1];

  // No grid_dependency_wait here: pieces are merged as the main kernel completes them
  // (slot_handover.cuh says why that is safe).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = warp % kPieceGroups;
  const int row = blockIdx.x * kRowsPerCta<kPieceGroups> + warp / kPieceGroups;
  const bool has_row = row < p.num_rows;
  const int num_split_requests = p.plan_header->num_split_requests;
  for (int index = blockIdx.y; index < num_split_requests; index += gridDim.y) {
    const SplitRequest split = p.split_requests[index];
    RowMerge merge;
    if (has_row) merge_pieces<kPieceGroups, kPiecesPerRound>(p, split, row, group, lane, merge);
    if constexpr (kPieceGroups == 1) {
      if (has_row) {
        const float norm = output_norm(p, merge.max, merge.sum);
#pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c) {
          const float values[4] = {merge.acc[4 * c], merge.acc[4 * c + 1], merge.acc[4 * c + 2], merge.acc[4 * c + 3]};
          store_columns(p, split.request, row, 128 * c + 4 * lane, values, norm);
        }
        if (lane == 0) store_lse(p, split.request, row, merge.max, merge.sum);
      }
    } else {
      GroupResult& mine = results[warp];
#pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c)
        *reinterpret_cast<float4*>(&mine.acc[128 * c + 4 * lane]) =
            make_float4(merge.acc[4 * c], merge.acc[4 * c + 1], merge.acc[4 * c + 2], merge.acc[4 * c + 3]);
      if (lane == 0) {
        mine.max = merge.max;
        mine.sum = merge.sum;
      }
      __syncthreads();
      if (has_row) {
        // The row's groups merged: each of its kPieceGroups * 32 threads takes kColumns columns.
        const GroupResult* row_results = &results[warp - group];
        float max = -INFINITY;
#pragma unroll
        for (int g = 0; g < kPieceGroups; ++g) max = nan_max(max, row_results[g].max);
        float weight[kPieceGroups];
        float sum = 0.f;
#pragma unroll
        for (int g = 0; g < kPieceGroups; ++g) {
          // A group that saw only empty pieces (max -inf) holds zeros and weighs 0.
          weight[g] = row_results[g].max == -INFINITY ? 0.f : expf(row_results[g].max - max);
          sum += weight[g] * row_results[g].sum;
        }
        constexpr int kColumns = kLatentDim / (32 * kPieceGroups);
        const int column = (group * 32 + lane) * kColumns;
        float values[kColumns] = {};
#pragma unroll
        for (int g = 0; g < kPieceGroups; ++g)
#pragma unroll
          for (int i = 0; i < kColumns; ++i) values[i] = fmaf(weight[g], row_results[g].acc[column + i], values[i]);
        const float norm = output_norm(p, max, sum);
#pragma unroll
        for (int i = 0; i < kColumns; i += 4 < kColumns ? 4 : kColumns) {
          constexpr int kStore = 4 < kColumns ? 4 : kColumns;
          float part[kStore];
#pragma unroll
          for (int j = 0; j < kStore; ++j) part[j] = values[i + j];
          store_columns(p, split.request, row, column + i, part, norm);
        }
        if (group == 0 && lane == 0) store_lse(p, split.request, row, max, sum);
      }
    }
    finish_split_request(p, split, index);  // its barrier: `results` is rewritten for the next entry
  }
  // Work after this operation that waits for it waits for this grid: it completes after the
  // main kernel (slot_handover.cuh).
  sm90::grid_dependency_wait();
}

template <int kPieceGroups, int kPiecesPerRound>
void launch_combine(const DecodeParams& params, cudaStream_t stream) {
  constexpr int kRows = kRowsPerCta<kPieceGroups>;
  constexpr int kMaxGridY = 65535;
  const int columns = params.max_split_requests < kMaxGridY ? params.max_split_requests : kMaxGridY;
  const dim3 grid((params.num_rows + kRows - 1) / kRows, columns > 1 ? columns : 1);
  sm90::launch_dependent(decode_combine_kernel<kPieceGroups, kPiecesPerRound>, grid, dim3(kCombineThreads), 0,
                         stream, params);
}

}  // namespace

void run_decode_combine(const DecodeParams& params, cudaStream_t stream) {
  // Pieces a split request is expected to have (the plan is made on the GPU; any number is
  // combined correctly, this only picks the shape): in the balanced policy about
  // num_parts / batch + 1 when the batch is smaller than the part count, else two; in the
  // batch-invariant one up to the workspace's pieces per request (num_slots / batch).
  int expected_pieces = params.batch > 0 && params.batch < params.num_parts ? params.num_parts / params.batch + 1 : 2;
  if (params.split_units > 0 && params.batch > 0 && params.num_slots / params.batch > expected_pieces)
    expected_pieces = params.num_slots / params.batch;
  // Enough groups that a row's pieces take one round; a CTA holds fewer rows the more groups.
  if (expected_pieces > 20) launch_combine<8, 5>(params, stream);
  else if (expected_pieces > 8) launch_combine<4, 5>(params, stream);
  else if (expected_pieces > 2) launch_combine<2, 4>(params, stream);
  else launch_combine<1, 2>(params, stream);
}

}  // namespace speedmla::kernels::decode_sm90
