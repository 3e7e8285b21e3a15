// speedmla/merge.h — merging two partial attention results by their log-sum-exp.
#pragma once

#include <optional>

#include "speedmla/tensor.h"

namespace speedmla {

// (out_a, lse_a) ⊕ (out_b, lse_b) -> (out, lse), the attention over the union of two disjoint
// key sets, each given by its normalised output and its natural-log LSE:
//   m = max(lse_a, lse_b), w_a = exp(lse_a - m), w_b = exp(lse_b - m)
//   out = (w_a*out_a + w_b*out_b) / (w_a + w_b),   lse = m + ln(w_a + w_b)
// Both lse -inf -> out 0, lse -inf.
//
//   out_a, out_b  [T, H, D]  BF16 or FP32 (may differ); last dim contiguous.
//   lse_a, lse_b  [T, H]     FP32.
//   out           [T, H, D]  BF16 or FP32 (written). May be out_a (in place); must not
//                            otherwise overlap the inputs.
//   lse           optional [T, H] FP32 (written). May be lse_a.
// All on one device. GPU: vectorised, 16-byte accesses where alignment allows; graph-safe.
void merge_attn_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                       const TensorView& lse_b, const TensorView& out,
                       const std::optional<TensorView>& lse, Stream stream = nullptr);

}  // namespace speedmla
