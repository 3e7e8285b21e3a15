// The wgmma accumulator of a warpgroup's 64 x N tile as a thread sees it: register 4n + 2i + e
// holds row 16 w + lane / 4 + 8 i (w = warp of the warpgroup, i = 0 or 1, "the thread's row i")
// and column 8 n + 2 (lane % 4) + e. The four lanes of a quad share their two rows.
// Attention kernels (decode and prefill) reduce, scale and convert these tiles the same way.
#pragma once

#include <cstdint>

#include "kernels/sm90/primitives.cuh"

namespace speedmla::kernels::sm90::attention {

// Row i's registers of a thread combined pairwise (depth log2(N / 4), not N / 4 - 1 dependent
// steps): the softmax sits on the path from one block's scores to the next GEMM.
namespace detail {
// v[0] = op over v[0 .. 2 kWidth): one level per instantiation, so every index is a constant
// (a run-time loop over the levels left the array in local memory).
template <int kWidth, int kSize, typename Op>
__device__ __forceinline__ void fold_halves(float (&v)[kSize], Op op) {
#pragma unroll
  for (int k = 0; k < kWidth; ++k) v[k] = op(v[k], v[k + kWidth]);
  if constexpr (kWidth > 1) fold_halves<kWidth / 2>(v, op);
}
}  // namespace detail

template <int kRegs, typename Op>
__device__ __forceinline__ float row_tree_reduce(const float (&acc)[kRegs], int i, Op op) {
  constexpr int kBlocks = kRegs / 4;
  static_assert(kRegs % 4 == 0 && (kBlocks & (kBlocks - 1)) == 0, "N must be a power-of-two multiple of 8");
  float v[kBlocks];
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) v[n] = op(acc[4 * n + 2 * i], acc[4 * n + 2 * i + 1]);
  if constexpr (kBlocks > 1) detail::fold_halves<kBlocks / 2>(v, op);
  return v[0];
}

// A row value combined over the quad that shares the row.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int kRegs>
__device__ __forceinline__ void zero(float (&acc)[kRegs]) {
#pragma unroll
  for (int r = 0; r < kRegs; ++r) acc[r] = 0.f;
}

// Multiplies row 0's registers by scale0 and row 1's by scale1. kSkipOnes: skipped when the
// whole warp would multiply by one (common once the running maxima settle) — a branch that
// differs between the warps of a warpgroup, so only where no wgmma wait can land inside it.
template <bool kSkipOnes, int kRegs>
__device__ __forceinline__ void scale_rows(float (&acc)[kRegs], float scale0, float scale1) {
  if (kSkipOnes && __all_sync(0xffffffffu, scale0 == 1.f && scale1 == 1.f)) return;
#pragma unroll
  for (int n = 0; n < kRegs / 4; ++n) {
    acc[4 * n + 0] *= scale0;
    acc[4 * n + 1] *= scale0;
    acc[4 * n + 2] *= scale1;
    acc[4 * n + 3] *= scale1;
  }
}

}  // namespace speedmla::kernels::sm90::attention
