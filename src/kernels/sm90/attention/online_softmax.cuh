// Online softmax over blocks of scores, in base 2, for a thread's two accumulator rows
// (accumulator.cuh). Scores arrive raw (q·k); `scale_log2` = softmax_scale · log2(e) > 0 turns
// them into base-2 exponents. Keys a row may not see are -inf before the step (mask policies
// live with the kernels: decode's per-row limits, prefill's causal diagonal and sequence end).
//
// Lazy maxima: a row's running max moves only when a block exceeds it by more than kSlackLog2,
// so most rescales of the output accumulator disappear; sums and outputs are relative to
// whichever max is in use, so the result is the same. Probabilities are 2^(s - max + kBiasLog2):
// FP8 raises them by 2^7 so that small ones stay normal e4m3 numbers (subnormals start at 2^-6),
// and the slack keeps them below 2^(7 + 1.5) < 448, e4m3's largest. The bias cancels in out =
// (P·V) / sum(P) and is taken out of the LSE.
#pragma once

#include <cmath>

#include "kernels/sm90/attention/accumulator.cuh"
#include "kernels/sm90/primitives.cuh"

namespace speedmla::kernels::sm90::attention {

// The lazy max's steps, for kernels that take them apart (decode) as for OnlineSoftmax::step.
// Maxima are in base-2 units. A row's max moves when a block's exceeds it by more than the slack;
// -inf + slack is -inf, so a row's first finite max always moves it.
__device__ __forceinline__ bool max_moves(float block_max, float row_max, float slack_log2) {
  return block_max > row_max + slack_log2;
}
__device__ __forceinline__ float lazy_max(float block_max, float row_max, float slack_log2) {
  return max_moves(block_max, row_max, slack_log2) ? block_max : row_max;
}
// What earlier output (and any other running sum) relative to `old_max` is multiplied by to be
// relative to `new_max`: exp2(-inf - finite) = 0 rescales a row that had seen nothing; a row that
// still has seen nothing keeps max -inf and factor 1.
__device__ __forceinline__ float rescale_factor(float old_max, float new_max) {
  return new_max == -INFINITY ? 1.f : fast_exp2(old_max - new_max);
}
// Probabilities are 2^(s·scale_log2 - base); a row that has seen nothing keeps exponents of -inf.
__device__ __forceinline__ float exponent_base(float new_max, float bias_log2) {
  return new_max == -INFINITY ? 0.f : new_max - bias_log2;
}

struct SoftmaxConfig {
  float slack_log2;  // lazy-max slack (base 2)
  float bias_log2;   // probabilities scaled by 2^bias
};

template <SoftmaxConfig kConfig>
struct OnlineSoftmax {
  float row_max[2];   // running max of each row, base-2 units; -inf until a row sees a key
  float row_sum[2];   // this thread's share of the row sums of the probabilities as computed

  __device__ __forceinline__ void reset() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Scores of one block -> probabilities, in place. `factor` receives what earlier output (and
  // any other running sum relative to the maxima) must be multiplied by: 1 when a row's max did
  // not move. The block's probabilities are added to row_sum.
  template <int kRegs>
  __device__ __forceinline__ void step(float (&scores)[kRegs], float scale_log2, float (&factor)[2]) {
    float base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float block_max =
          quad_max(row_tree_reduce(scores, i, [](float a, float b) { return fmaxf(a, b); })) * scale_log2;
      const float new_max = lazy_max(block_max, row_max[i], kConfig.slack_log2);
      factor[i] = rescale_factor(row_max[i], new_max);
      base[i] = exponent_base(new_max, kConfig.bias_log2);
      row_max[i] = new_max;
    }
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const float x = fmaf(scores[r], scale_log2, -base[(r / 2) % 2]);
      scores[r] = fast_exp2(x);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
      row_sum[i] = fmaf(row_sum[i], factor[i], row_tree_reduce(scores, i, [](float a, float b) { return a + b; }));
  }

  // Whether row i has an output, from its quad-wide sum: it saw a key (its max is finite; its
  // sum is then at least 2^(bias - slack)), or a NaN score made its sum NaN. fmaxf drops NaN,
  // so a row whose scores are all NaN (a NaN query) keeps max -inf; it must come out NaN, not as
  // a row that saw no key (out 0, LSE -inf: a merge drops it).
  __device__ __forceinline__ bool has_output(int i, float quad_row_sum) const {
    return row_max[i] != -INFINITY || quad_row_sum != quad_row_sum;
  }

  // The LSE (natural log) of row i from the quad-wide sum; -inf for a row that saw no key, NaN
  // for a NaN sum.
  __device__ __forceinline__ float lse(int i, float quad_row_sum) const {
    return has_output(i, quad_row_sum)
               ? (row_max[i] - kConfig.bias_log2 + __log2f(quad_row_sum)) * 0.69314718055994530942f
               : -INFINITY;
  }
};

}  // namespace speedmla::kernels::sm90::attention
