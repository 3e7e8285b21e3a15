#include "reference/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace speedmla::reference {

void attend_row(const AttentionTensors& io, int64_t q_offset, int64_t out_offset,
                int64_t lse_offset, const KeyValueRows& kv, int64_t num_keys,
                double softmax_scale, double output_scale) {
  std::vector<double> q(static_cast<size_t>(kv.d_qk)), out(static_cast<size_t>(kv.d_v), 0.0);
  std::vector<double> scores(static_cast<size_t>(std::max<int64_t>(num_keys, 0)));
  load_row(io.q, q_offset, kv.d_qk, q.data());

  double max_score = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* key = kv.keys + j * kv.key_stride;
    double dot = 0;
    for (int64_t d = 0; d < kv.d_qk; ++d) dot += q[d] * key[d];
    scores[j] = softmax_scale * dot;
    max_score = std::max(max_score, scores[j]);
  }

  // Weights relative to the largest score keep exp() in range; NaN scores propagate.
  double lse = -std::numeric_limits<double>::infinity();
  if (num_keys > 0) {
    double weight_sum = 0;
    for (int64_t j = 0; j < num_keys; ++j) {
      const double weight = std::exp(scores[j] - max_score);
      weight_sum += weight;
      const float* value = kv.values + j * kv.value_stride;
      for (int64_t d = 0; d < kv.d_v; ++d) out[d] += weight * value[d];
    }
    const double out_factor = output_scale / weight_sum;
    for (double& x : out) x *= out_factor;
    lse = max_score + std::log(weight_sum);
  }
  store_row(io.out, out_offset, kv.d_v, out.data());
  if (io.lse) store(*io.lse, lse_offset, lse);
}

}  // namespace speedmla::reference
