// The query tile of a decode CTA in shared memory: kRows query rows (flattened (token, head)
// pairs of one request) in kNumChunks column chunks of kChunkDims features, each chunk row one
// swizzle row, chunk c at c · kRows · chunk-row bytes: the K-major layout the score wgmma reads.
#pragma once

#include <cstdint>

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/params.h"
#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/swizzle.cuh"

namespace speedmla::kernels::decode_sm90 {

// Stages rows first_row .. first_row + kRows - 1 of `request` (rows past num_rows: zeros) at
// `q_smem`, thread `thread` of `threads` copying every threads-th 16-byte piece. The copies are
// asynchronous and all in flight at once, so the tile costs about one global-memory latency;
// they have landed and are visible to wgmma when this returns.
template <int kRows, int kElemBytes, sm90::SmemLayout kSwizzle>
__device__ __forceinline__ void stage_query_tile(const DecodeParams& p, uint32_t q_smem, int request, int first_row,
                                                 int thread, int threads) {
  constexpr int kChunkRowBytes = kChunkDims * kElemBytes;
  constexpr int kPiecesPerChunkRow = kChunkRowBytes / 16;
  constexpr int kPiecesPerRow = kRowDim * kElemBytes / 16;
  const uint8_t* q = static_cast<const uint8_t*>(p.q);
  for (int i = thread; i < kRows * kPiecesPerRow; i += threads) {
    const int r = i / kPiecesPerRow, piece = i % kPiecesPerRow;
    const int row = first_row + r;
    const uint8_t* src = q;
    if (row < p.num_rows) {
      const int token = row / p.num_heads, head = row % p.num_heads;
      const int64_t element = request * p.q_stride_batch + token * p.q_stride_token + head * p.q_stride_head;
      src = q + element * kElemBytes + piece * 16;
    }
    const int chunk = piece / kPiecesPerChunkRow, in_row = piece % kPiecesPerChunkRow;
    sm90::cp_async_16(q_smem + chunk * kRows * kChunkRowBytes + sm90::swizzled_piece_offset<kSwizzle>(r, in_row), src,
                      row < p.num_rows ? 16u : 0u);
  }
  sm90::cp_async_wait_all();
  sm90::fence_proxy_async_smem();
}

}  // namespace speedmla::kernels::decode_sm90
