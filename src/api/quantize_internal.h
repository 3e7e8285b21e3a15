// quantize_fp8 in halves, for callers inside the library that validate once and then run
// (MlaBackend::forward_decode quantises the engine's query into a buffer of its own). The public
// quantize_fp8 is validate_quantize_input + validate_quantize_output + run_quantize_fp8_validated.
#pragma once

#include "api/check.h"
#include "speedmla/tensor.h"

namespace speedmla::detail {

// quantize_fp8's checks of x alone, naming it `name`: at most kMaxDims dims, defined, BF16, FP16
// or FP32, last dim contiguous.
void validate_quantize_input(const ArgChecker& check, const TensorView& x, const char* name = "x");

// quantize_fp8's checks of out against an x that validate_quantize_input accepted, and of
// scale_inv: x's shape, FP8, last dim contiguous, no element twice, x's device, disjoint from x.
void validate_quantize_output(const ArgChecker& check, const TensorView& x, const TensorView& out,
                              float scale_inv);

// quantize_fp8's work on arguments both checks accepted (or that hold by construction): the CPU
// reference or the kernel on `stream`. Checks no argument; `check` names the function in a launch
// error.
void run_quantize_fp8_validated(const ArgChecker& check, const TensorView& x, const TensorView& out,
                                float scale_inv, Stream stream);

}  // namespace speedmla::detail
