// The error budget of the GPU tests: the bound each test asserts per operation and dtype, in one
// place, and the line every measurement prints so that scripts/gpu-check.sh can tabulate the
// worst measured error against its bound (docs/error-budget.md explains how the bounds follow
// from the numerics and what they leave room for).
#pragma once

#include "speedmla/tensor.h"

namespace speedmla::test {

struct ErrorBounds {
  double out_rel_l2;   // relative L2 error of one request's (or one call's) output
  double lse_max_abs;  // largest absolute error of one LSE element (natural log)
};

// mla_decode, per request. BF16: probabilities and outputs are BF16-rounded (measured: a few
// 1e-3). FP8: probabilities are rounded to e4m3 (3 mantissa bits) before P·V (measured ~2e-2).
// A layout or masking bug gives output errors of order 1 (BF16 shares the masking code and
// checks it to 1e-2). LSE: FP8 wgmma keeps about 14 significant bits while it accumulates the
// 576-term scores, so the LSE error grows with the scores: ~1e-3 at the usual softmax scale, up
// to 1.5-2e-2 measured on sharp softmaxes (scores of tens, H200, 2026-11-30). A wrong bias,
// maximum or scale moves the LSE by whole units.
ErrorBounds decode_bounds(DType dtype);

// mla_prefill, per request. BF16: scores in FP32 from exact BF16 inputs; P and the output are
// rounded to BF16 (a few 1e-3 at most); LSE only sees FP32 rounding and exp2 (~1e-5). FP8: P is
// rounded to e4m3 before P·V: emulated in NumPy, 0.9e-2 per request at 8 rows to 2.5e-2 at a
// thousand non-causal rows. The LSE comes from the FP32 sums of P; the FP8 score accumulation
// (~14 bits, as decode's) moves it by up to 2.2e-2 on sharp softmaxes (H200, 2026-12-01). A wrong
// head or row costs a rel. L2 of ~1.4, an off-by-one causal mask
// 0.3-0.5, a dropped key tile 0.25 or more.
ErrorBounds prefill_bounds(DType dtype);

// merge_attn_states, per call: FP32 arithmetic on both sides, so the output is within one
// rounding of its dtype (BF16: one ulp per element, which the merge test checks element by
// element; FP32: 1e-5 relative) and the LSE within 1e-5 absolute.
ErrorBounds merge_bounds(DType out_dtype);

// Prints "[ budget ] <op> <dtype> out_rel_l2=<x> out_max_abs=<y> lse_max_abs=<z>" for one
// measurement (a request's worst or a call's), the line gpu-check.sh collects into its table.
// A negative value means "not measured".
void record_error(const char* op, DType dtype, double out_rel_l2, double out_max_abs, double lse_max_abs);

}  // namespace speedmla::test
