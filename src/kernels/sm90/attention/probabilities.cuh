// Probabilities P (a 64 x N score accumulator after the softmax, see accumulator.cuh) turned
// into the A-operand register fragments of the P·V wgmma, for both element types.
//
// BF16 (K = 16 per wgmma): the fragment of K-step s is columns 16 s .. 16 s + 15 in exactly the
// accumulator's order, so a thread converts its own registers pairwise.
// FP8 (K = 32): a thread's four bytes of a K-group would be columns 4 (lane % 4) .. + 3, but it
// holds columns {2q, 2q+1, 8+2q, 9+2q} (q = lane % 4) of each 16. Rather than moving P between
// threads, the V^T operand stores its token positions in that order (fp8_transpose.cuh): V^T
// position 4k + 2a + b of each 16-token group is token 8a + 2k + b.
#pragma once

#include <cstdint>

#include "kernels/sm90/primitives.cuh"

namespace speedmla::kernels::sm90::attention {

// Fragment registers for N columns of P: BF16 N / 4, FP8 N / 8.
template <bool kFp8, int kScoreRegs>
inline constexpr int kProbabilityRegs = kFp8 ? kScoreRegs / 4 : kScoreRegs / 2;

// Columns of P in one K step of the P·V wgmma: BF16 16 (8 score registers), FP8 32 (16).
template <bool kFp8>
inline constexpr int kScoreRegsPerValueStep = kFp8 ? 16 : 8;

// The fragments of K steps kFirstStep .. kFirstStep + kSteps - 1 only: a P·V issued in parts
// can start on its first steps while later columns are still being computed.
template <bool kFp8, int kFirstStep, int kSteps, int kScoreRegs>
__device__ __forceinline__ void pack_probability_steps(const float (&p)[kScoreRegs],
                                                       uint32_t (&probs)[kProbabilityRegs<kFp8, kScoreRegs>]) {
  static_assert(kFirstStep >= 0 && kSteps > 0 && (kFirstStep + kSteps) * kScoreRegsPerValueStep<kFp8> <= kScoreRegs);
#pragma unroll
  for (int step = kFirstStep; step < kFirstStep + kSteps; ++step) {
    const float* f = &p[kScoreRegsPerValueStep<kFp8> * step];
    if constexpr (kFp8) {
      probs[4 * step + 0] = pack_fp8x4(f[0], f[1], f[4], f[5]);
      probs[4 * step + 1] = pack_fp8x4(f[2], f[3], f[6], f[7]);
      probs[4 * step + 2] = pack_fp8x4(f[8], f[9], f[12], f[13]);
      probs[4 * step + 3] = pack_fp8x4(f[10], f[11], f[14], f[15]);
    } else {
      probs[4 * step + 0] = pack_bf16x2(f[0], f[1]);
      probs[4 * step + 1] = pack_bf16x2(f[2], f[3]);
      probs[4 * step + 2] = pack_bf16x2(f[4], f[5]);
      probs[4 * step + 3] = pack_bf16x2(f[6], f[7]);
    }
  }
}

template <bool kFp8, int kScoreRegs>
__device__ __forceinline__ void pack_probabilities(const float (&p)[kScoreRegs],
                                                   uint32_t (&probs)[kProbabilityRegs<kFp8, kScoreRegs>]) {
  pack_probability_steps<kFp8, 0, kScoreRegs / kScoreRegsPerValueStep<kFp8>>(p, probs);
}

// FP8: this thread's share of its two rows' sums of the e4m3-rounded P that the P·V multiplies.
// Registers 4s and 4s + 2 hold row 0's bytes, 4s + 1 and 4s + 3 row 1's (pack_probabilities).
// Dividing the output by these sums (not the exact ones) makes every output row a weighted mean
// of V with exactly its own weights. Pairs are summed in FP16: sums of at most 16 values below
// 2^9 lose next to nothing with 11-bit significands against e4m3's 4.
template <int kProbRegs>
__device__ __forceinline__ void fp8_probability_row_sums(const uint32_t (&probs)[kProbRegs], float (&sums)[2]) {
  static_assert(kProbRegs % 4 == 0 && kProbRegs <= 16, "each FP16 half sums at most 16 values");
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    auto step_sum = [&](int s) {
      return add_f16x2(fp8x4_pair_sums(probs[4 * s + i]), fp8x4_pair_sums(probs[4 * s + i + 2]));
    };
    uint32_t pair = step_sum(0);
#pragma unroll
    for (int s = 1; s < kProbRegs / 4; ++s) pair = add_f16x2(pair, step_sum(s));
    sums[i] = f16x2_total(pair);
  }
}

}  // namespace speedmla::kernels::sm90::attention
