// kv_cache_write in halves, for callers inside the library that have checked kv_cache already
// (MlaBackend::forward_decode, through validate_decode). The public kv_cache_write checks
// kv_cache (the shared layout, FP8 or BF16, 16-byte aligned), then the rest, then runs.
#pragma once

#include "api/check.h"
#include "speedmla/tensor.h"

namespace speedmla::detail {

// kv_cache_write's checks of everything but kv_cache itself: slots, latent and rope (and that
// they do not overlap kv_cache), scale_inv.
void validate_kv_cache_write_inputs(const ArgChecker& check, const TensorView& kv_cache, const TensorView& slots,
                                    const TensorView& latent, const TensorView& rope, float scale_inv);

// kv_cache_write's work on arguments its checks accepted: the CPU reference or the kernel on
// `stream`. Checks no argument; `check` names the function in a launch error.
void run_kv_cache_write_validated(const ArgChecker& check, const TensorView& kv_cache, const TensorView& slots,
                                  const TensorView& latent, const TensorView& rope, float scale_inv,
                                  Stream stream);

}  // namespace speedmla::detail
