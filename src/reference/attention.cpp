#include "reference/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace speedmla::reference {

double attend_row(const double* q, const KeyValueRows& kv, int64_t num_keys, double softmax_scale,
                  double output_scale, double* out) {
  std::fill(out, out + kv.d_v, 0.0);
  if (num_keys <= 0) return -std::numeric_limits<double>::infinity();

  std::vector<double> scores(static_cast<size_t>(num_keys));
  double max_score = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* key = kv.keys + j * kv.key_stride;
    double dot = 0;
    for (int64_t d = 0; d < kv.d_qk; ++d) dot += q[d] * key[d];
    scores[j] = softmax_scale * dot;
    max_score = std::max(max_score, scores[j]);
  }

  // Weights relative to the largest score keep exp() in range; NaN scores propagate.
  double weight_sum = 0;
  for (int64_t j = 0; j < num_keys; ++j) {
    const double weight = std::exp(scores[j] - max_score);
    weight_sum += weight;
    const float* value = kv.values + j * kv.value_stride;
    for (int64_t d = 0; d < kv.d_v; ++d) out[d] += weight * value[d];
  }
  const double out_factor = output_scale / weight_sum;
  for (int64_t d = 0; d < kv.d_v; ++d) out[d] *= out_factor;
  return max_score + std::log(weight_sum);
}

}  // namespace speedmla::reference
