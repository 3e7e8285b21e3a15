// FP8 values -> the K-major V^T operand of the P·V wgmma (FP8 wgmma reads both operands
// K-major only, and V arrives token-major).
//
// Source: TMA-loaded rows of 64 values (one 64-byte swizzle row, SWIZZLE_64B: piece p of row t
// at p ^ ((t >> 1) & 3)), the dims in chunks of kChunkBytes (64 dims each).
// Destination: V^T without swizzle, in core matrices of 8 dims x 16 token positions (128 bytes),
// kCoreStride bytes apart along the tokens and kGroupStride bytes apart along the dims (a group
// stride that is not a multiple of 128 bytes puts the 8 rows of each stored matrix in distinct
// banks). Token positions follow the P fragment's register order (probabilities.cuh): position
// 4k + 2a + b of a 16-token group holds token 8a + 2k + b. That is what a 16-bit transposing
// matrix load gives: ldmatrix.trans of the group's tokens 0-7 and 8-15 (16 dims each) hands lane
// l the dim pair (2 (l/4), 2 (l/4) + 1) of tokens (2k, 2k+1) and (8+2k, 9+2k), k = l % 4; one
// byte permute per dim makes the 4 bytes of V^T row 2 (l/4) (or +1) at positions 4k..4k+3,
// which is the fragment stmatrix stores as row l/4.
#pragma once

#include <cstdint>

#include "kernels/sm90/primitives.cuh"

namespace speedmla::kernels::sm90::attention {

// One warp transposes token group `group` (tokens 16 group .. + 15) for kSteps x 32 dims,
// starting at chunk `first_chunk` of `src` and dim group (8 dims) `first_dim_group` of `vt`
// (offsets rather than moved bases: ptxas keeps the decode consumer's transposes spill-free this
// way, not with pre-offset bases). kMasked: tokens at
// or past `valid` become zeros (whatever the source holds there, NaN included). kBatch steps'
// loads are issued before their stores: a load may not pass an earlier store (to the compiler
// they might alias), so one load per store would put a shared-memory latency on every step.
template <int kChunkBytes, int kCoreStride, int kGroupStride, int kSteps, int kBatch, bool kMasked>
__device__ __forceinline__ void transpose_fp8_values(uint32_t src, int first_chunk, uint32_t vt, int first_dim_group,
                                                     int group, int valid, int lane) {
  static_assert(kSteps % kBatch == 0);
  const int matrix = lane / 8, row = lane % 8;
  // Load: matrix m is tokens 16 group + 8 (m % 2) + 0..7, 16-byte piece m / 2 of the step's 32
  // dims. Odd steps use pieces 2 and 3 of the chunk (an XOR with 2), even steps 0 and 1.
  const int token = 16 * group + 8 * (matrix % 2) + row;
  const uint32_t token_row = src + first_chunk * kChunkBytes + token * 64;
  const int piece = (matrix / 2) ^ ((token >> 1) & 3);
  const uint32_t load_base[2] = {token_row + (piece << 4), token_row + ((piece ^ 2) << 4)};
  // Store: matrix i holds V^T rows (dims) 16 (i / 2) + 2r + i % 2 of the step, r = row.
  const int dim = 16 * (matrix / 2) + 2 * row + matrix % 2;
  const uint32_t store_base = vt + (first_dim_group + dim / 8) * kGroupStride + group * kCoreStride + (dim % 8) * 16;
  // Tokens of this lane's output bytes: 2k, 2k+1, 8+2k, 9+2k of the group.
  uint32_t keep = 0xffffffffu;
  if constexpr (kMasked) {
    const int first = 16 * group + 2 * (lane % 4);
    keep = (first < valid ? 0xffu : 0u) | (first + 1 < valid ? 0xff00u : 0u) | (first + 8 < valid ? 0xff0000u : 0u) |
           (first + 9 < valid ? 0xff000000u : 0u);
  }
#pragma unroll
  for (int batch = 0; batch < kSteps; batch += kBatch) {
    uint4 in[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int step = batch + i;
      in[i] = ldmatrix_x4<true>(load_base[step % 2] + (step / 2) * kChunkBytes);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      uint4 out;
      out.x = byte_perm(in[i].x, in[i].y, 0x6420u) & keep;
      out.y = byte_perm(in[i].x, in[i].y, 0x7531u) & keep;
      out.z = byte_perm(in[i].z, in[i].w, 0x6420u) & keep;
      out.w = byte_perm(in[i].z, in[i].w, 0x7531u) & keep;
      stmatrix_x4(store_base + (batch + i) * 4 * kGroupStride, out);
    }
  }
}

}  // namespace speedmla::kernels::sm90::attention
