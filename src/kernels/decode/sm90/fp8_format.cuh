// What both FP8 decode kernels (decode_kernel.cuh's Fp8Traits, decode_narrow_kernel.cuh's
// NarrowFp8Traits) share: how the e4m3 cache lands in shared memory and how P is scaled before
// its conversion to e4m3.
#pragma once

#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/tensor_map.h"

namespace speedmla::kernels::decode_sm90 {

struct Fp8Format {
  static constexpr bool kFp8 = true;
  static constexpr int kElemBytes = 1;
  static constexpr sm90::SmemLayout kSwizzle = sm90::SmemLayout::kSwizzle64B;
  // How TMA writes the cache's chunks into a K stage: the same swizzle, FP8 as raw bytes.
  static constexpr sm90::TmaSwizzle kTmaSwizzle = sm90::TmaSwizzle::k64B;
  static constexpr sm90::TmaElement kTmaElement = sm90::TmaElement::kUInt8;
  // P in [0, 2^7] instead of [0, 1] before the FP8 conversion: small probabilities stay normal
  // numbers (e4m3 subnormals start at 2^-6). It cancels in out = (P·V) / sum(P).
  static constexpr float kProbabilityLog2Bias = 7.f;
  // A block raises the running max only when it exceeds it by more than this (base 2), which
  // saves most rescales of the output; P then stays below 2^(7 + 1.5) < 448, the largest e4m3
  // number.
  static constexpr float kMaxSlackLog2 = 1.5f;
};

}  // namespace speedmla::kernels::decode_sm90
