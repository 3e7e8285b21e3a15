// speedmla-bench --prefill: times mla_prefill over the prefill cases of issue 12 (see
// prefill_bench.cpp).
#pragma once

#include <vector>

#include "speedmla/prefill.h"
#include "speedmla/tensor.h"

namespace speedmla::bench {

struct PrefillCase {
  DType dtype;
  int heads, batch, len;  // `batch` requests of `len` queries and `len` keys each
  bool causal;
  PrefillValueLayout v_layout = PrefillValueLayout::kTokenMajor;  // "fp8t": FP8, kFp8Transposed
};

// H=128 causal 16x1K, 4x4K, 1x8K, 1x16K, 1x32K; H=16 causal 4x4K, 1x16K; for each dtype (FP8:
// token-major values, then fp8t, for each shape).
std::vector<PrefillCase> prefill_grid(const std::vector<DType>& dtypes);
// "fp8|fp8t|bf16,H,B,LEN,CAUSAL(0|1)" (fp8t: FP8 with v in the kFp8Transposed layout); false when
// the text does not parse.
bool parse_prefill_case(const char* text, PrefillCase& c);
// Times every case, prints one line each; returns 0, or 1 when a case failed (e.g. refused).
int run_prefill_cases(const std::vector<PrefillCase>& cases, int iters, int rest_ms);

}  // namespace speedmla::bench
