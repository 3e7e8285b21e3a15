#include "common/error_budget.h"

#include <cstdio>

namespace speedmla::test {

ErrorBounds decode_bounds(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? ErrorBounds{6e-2, 4e-2} : ErrorBounds{1e-2, 2e-3};
}

ErrorBounds prefill_bounds(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? ErrorBounds{6e-2, 4e-2} : ErrorBounds{5e-3, 2e-3};
}

ErrorBounds merge_bounds(DType out_dtype) {
  return out_dtype == DType::kBFloat16 ? ErrorBounds{8e-3, 1e-5} : ErrorBounds{1e-5, 1e-5};
}

void record_error(const char* op, DType dtype, double out_rel_l2, double out_max_abs, double lse_max_abs) {
  std::printf("[ budget ] %s %s out_rel_l2=%.4g out_max_abs=%.4g lse_max_abs=%.4g\n", op, dtype_name(dtype),
              out_rel_l2, out_max_abs, lse_max_abs);
}

}  // namespace speedmla::test
