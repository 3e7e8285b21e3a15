// Query rows held in registers as wgmma A fragments, loaded from the staged K-major tile.
#pragma once

#include <cstdint>

#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/swizzle.cuh"

namespace speedmla::kernels::sm90::attention {

// The A fragments of the warp's 16 rows first_row .. first_row + 15 over kChunks chunks of
// kStepsPerChunk wgmma K steps, from the swizzled tile whose chunk c starts at tile + c ·
// chunk_bytes (rows one swizzle span long): four registers a step, a[4 (c · kStepsPerChunk +
// step)] on. A step is 32 bytes of each row (16 BF16 or 32 FP8 features): one ldmatrix.x4 of
// matrices (rows 0-7, bytes 0-15), (rows 8-15, 0-15), (0-7, 16-31), (8-15, 16-31), which is the
// wgmma's A register layout.
template <SmemLayout kLayout, int kChunks, int kStepsPerChunk>
__device__ __forceinline__ void load_a_fragments(uint32_t tile, int chunk_bytes, int first_row, int lane, uint32_t* a) {
  const int row = first_row + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int step = 0; step < kStepsPerChunk; ++step) {
      const uint32_t address = tile + c * chunk_bytes + swizzled_piece_offset<kLayout>(row, 2 * step + lane / 16);
      const uint4 v = ldmatrix_x4<false>(address);
      uint32_t* fragment = &a[4 * (c * kStepsPerChunk + step)];
      fragment[0] = v.x, fragment[1] = v.y, fragment[2] = v.z, fragment[3] = v.w;
    }
}

}  // namespace speedmla::kernels::sm90::attention
