// The tests' stand-in for a model's kv_b_proj, as MlaBackend::attend_cached_prefix calls it:
// latent [n, 576] -> per-head keys k [n, H, 192] = (latent · Wk[h]) ‖ rope, values
// v [n, H, 128] = latent · Wv[h]. Only a few latent dims are used, to stay cheap on the CPU;
// every key and value still depends on its own token's latent row.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "speedmla/prefill.h"
#include "speedmla/tensor.h"

namespace speedmla::test {

class PrefixExpansion {
 public:
  PrefixExpansion(int64_t heads, std::mt19937_64& rng);

  // CPU views: latent [n, 576] (any float dtype), k [n, H, 192] and v [n, H, 128] (any float
  // dtype; each value rounded once to it); any strides.
  void operator()(const TensorView& latent, const TensorView& k, const TensorView& v) const;
  // The same for views on the device (k and v contiguous), through host copies. Synchronous:
  // it waits for the work queued before it and finishes its copies before returning.
  // kFp8Transposed: v is FP8 [H, 128, P] in that layout (prefill.h), NaN past the n tokens.
  void on_device(const TensorView& latent, const TensorView& k, const TensorView& v,
                 PrefillValueLayout v_layout = PrefillValueLayout::kTokenMajor) const;

 private:
  static constexpr int64_t kUsedLatent = 8;
  int64_t heads_;
  std::vector<double> wk_, wv_;  // [heads, kUsedLatent, 128]
};

}  // namespace speedmla::test
