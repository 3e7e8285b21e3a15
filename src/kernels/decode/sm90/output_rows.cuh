// The end of a piece in the SM90 decode kernels: a row's normaliser and LSE (every kernel, the
// narrow one included), and, for kernels whose P·V warpgroups each own half of the output columns
// in the wgmma accumulator layout (decode_kernel.cuh), a thread's two rows, their normalisers
// and the output stores (final BF16, or FP32 partials for the combine kernel).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/params.h"
#include "kernels/decode/sm90/plan.cuh"
#include "kernels/sm90/primitives.cuh"

namespace speedmla::kernels::decode_sm90 {

// Rows of this thread in the tile: r0 and r0 + 8 (wgmma accumulator layout).
struct RowInfo {
  int local[2];     // row within the tile
  bool valid[2];    // row < num_rows
  int token[2];     // query token t of the row
  int head[2];
};

__device__ __forceinline__ RowInfo row_info(const DecodeParams& p, int row_tile, int warp, int lane) {
  RowInfo r;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    r.local[i] = 16 * warp + lane / 4 + 8 * i;
    const int row = row_tile * kTileRows + r.local[i];
    r.valid[i] = row < p.num_rows;
    r.token[i] = row / p.num_heads;
    r.head[i] = row % p.num_heads;
  }
  return r;
}

// The output normaliser and LSE (natural log) of one row at the end of a piece, from its sums
// (`sum`: of the probabilities as computed, for the LSE; `weight`: as the P·V multiplied them,
// the normaliser) and its max (base 2, biased by bias_log2). Invalid seq_len (num_blocks < 0),
// or a NaN score (the max skips it, the sum does not): NaN rows, as the reference's; rows that
// saw no key: output 0, LSE -inf.
__device__ __forceinline__ void row_normaliser(int num_blocks, float sum, float weight, float row_max, float bias_log2,
                                               float& inv, float& lse) {
  if (num_blocks < 0 || sum != sum) {
    inv = lse = NAN;
  } else if (sum > 0.f) {
    // A sum of probabilities scaled so that the row's maximum is near 2^bias: far inside
    // [2^-126, 2^126], where the fast reciprocal is within 2 ulp. It has no IEEE slow
    // path, which ptxas would otherwise outline into a call (and spill around it).
    inv = weight > 0.f ? __fdividef(1.f, weight) : 0.f;
    lse = (row_max - bias_log2 + __log2f(sum)) * 0.69314718055994530942f;
  } else {
    inv = 0.f;
    lse = -INFINITY;
  }
}

// row_normaliser of a thread's two accumulator rows, from its share of their sums (summed over
// the quad here).
__device__ __forceinline__ void piece_normalisers(int num_blocks, const float (&exact)[2], const float (&weights)[2],
                                                  const float (&row_max)[2], float bias_log2, float (&inv)[2],
                                                  float (&lse)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = exact[i], weight = weights[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    weight += __shfl_xor_sync(0xffffffffu, weight, 1);
    weight += __shfl_xor_sync(0xffffffffu, weight, 2);
    row_normaliser(num_blocks, sum, weight, row_max[i], bias_log2, inv[i], lse[i]);
  }
}

// The rows' LSE, to `lse` (a whole request) or the piece's partial-result slot; from the lanes
// that hold it (lane % 4 == 0) of one warpgroup.
__device__ __forceinline__ void store_lse(const DecodeParams& p, const PartPiece& piece, const RowInfo& rows,
                                          const float (&lse)[2]) {
  if (threadIdx.x % 4 != 0) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!rows.valid[i]) continue;
    if (piece.slot >= 0) {
      p.partial_lse[static_cast<int64_t>(piece.slot) * p.num_rows + rows.token[i] * p.num_heads + rows.head[i]] = lse[i];
    } else if (p.lse != nullptr) {
      p.lse[piece.request * p.lse_stride_batch + rows.token[i] * p.lse_stride_token + rows.head[i] * p.lse_stride_head] =
          lse[i];
    }
  }
}

// Final output rows leave through shared memory, so that every global store writes 16
// contiguous bytes: in the accumulator layout a thread holds 4 bytes of each 16 columns, and
// storing them directly writes every 32-byte sector in two halves, from two instructions.
// Each warp stages 16 rows x 128 columns at a time (swizzled by 16-byte chunk) in
// kOutputStageWarpBytes of shared memory of its own, which the caller provides.
inline constexpr int kOutputStageColumns = 128;
inline constexpr int kOutputStageRowBytes = kOutputStageColumns * 2;
inline constexpr int kOutputStageWarpBytes = 16 * kOutputStageRowBytes;

// Writes this thread's half (`half` 0: columns 0-255, 1: 256-511) of its rows of the piece's
// output, acc x inv: final BF16 (x output_scale) through the warp's stage at `warp_stage` (a
// shared-window address), or an FP32 partial for the combine kernel (direct 8-byte stores).
// Called by every thread of the warpgroup.
__device__ __forceinline__ void store_output_half(const DecodeParams& p, uint32_t warp_stage, const PartPiece& piece,
                                                  const RowInfo& rows, int row_tile, const float (&acc)[128],
                                                  const float (&inv)[2], int half) {
  if (piece.slot >= 0) {
    const int col0 = half * kHalfValueDim + 2 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
      const int row = rows.token[i] * p.num_heads + rows.head[i];
      float* dst = p.partial_out + (static_cast<int64_t>(piece.slot) * p.num_rows + row) * kLatentDim + col0;
#pragma unroll
      for (int n = 0; n < 32; ++n)
        *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(acc[4 * n + 2 * i] * inv[i], acc[4 * n + 2 * i + 1] * inv[i]);
    }
    return;
  }
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const float scale[2] = {inv[0] * p.output_scale, inv[1] * p.output_scale};
  // Where the warp's row lane % 16 goes in `out` (kNoRow: past num_rows); the stores below ask
  // lanes 0-15 for their rows' offsets. Offsets may be negative (any of out's strides may be),
  // so the sentinel is one no row can have: |offset| stays below 2^62 for any tensor that fits.
  constexpr int64_t kNoRow = INT64_MIN;
  int64_t my_row_offset = kNoRow;
  if (const int row = row_tile * kTileRows + 16 * warp + lane % 16; row < p.num_rows)
    my_row_offset = piece.request * p.out_stride_batch + (row / p.num_heads) * p.out_stride_token +
                    (row % p.num_heads) * p.out_stride_head;
  // stmatrix: lanes 8j .. 8j + 7 name the rows of matrix j of each x4, which holds rows
  // 8 (j & 1) .. + 7 (accumulator row i = j & 1) of column group 2k + (j >> 1).
  const int matrix = lane / 8, matrix_row = lane % 8;
  const uint32_t stmatrix_row = warp_stage + (8 * (matrix & 1) + matrix_row) * kOutputStageRowBytes;
#pragma unroll
  for (int round = 0; round < kHalfValueDim / kOutputStageColumns; ++round) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int n = round * 16 + 2 * k;  // accumulator column group (8 columns)
      const uint4 v = make_uint4(sm90::pack_bf16x2(acc[4 * n] * scale[0], acc[4 * n + 1] * scale[0]),
                                 sm90::pack_bf16x2(acc[4 * n + 2] * scale[1], acc[4 * n + 3] * scale[1]),
                                 sm90::pack_bf16x2(acc[4 * n + 4] * scale[0], acc[4 * n + 5] * scale[0]),
                                 sm90::pack_bf16x2(acc[4 * n + 6] * scale[1], acc[4 * n + 7] * scale[1]));
      const int chunk = 2 * k + (matrix >> 1);
      sm90::stmatrix_x4(stmatrix_row + ((chunk ^ matrix_row) << 4), v);
    }
    __syncwarp();
    // Lanes 0-15 write one row's 256 bytes, lanes 16-31 the next row's.
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int row = 2 * m + lane / 16, chunk = lane % 16;
      const uint4 v = sm90::ld_shared_v4(warp_stage + row * kOutputStageRowBytes + ((chunk ^ (row % 8)) << 4));
      const int64_t row_offset = __shfl_sync(0xffffffffu, my_row_offset, row);
      if (row_offset != kNoRow)
        *reinterpret_cast<uint4*>(p.out + row_offset + half * kHalfValueDim + round * kOutputStageColumns + 8 * chunk) = v;
    }
    __syncwarp();  // read before the next round overwrites the stage
  }
}

}  // namespace speedmla::kernels::decode_sm90
