// The attention of one query row, shared by the decode and prefill references.
#pragma once

#include <cstdint>

namespace speedmla::reference {

// Keys and values of one attention problem, as float rows in memory (exact copies of the
// FP8/BF16 inputs): key j is keys[j*key_stride + 0 .. d_qk), value j is
// values[j*value_stride + 0 .. d_v). Decode points values at the keys themselves (the first 512
// columns of each cache row).
struct KeyValueRows {
  const float* keys = nullptr;
  int64_t key_stride = 0;
  int64_t d_qk = 0;
  const float* values = nullptr;
  int64_t value_stride = 0;
  int64_t d_v = 0;
};

// Softmax attention of query q[0 .. d_qk) over keys 0 .. num_keys-1, in FP64:
//   s_j = softmax_scale * q·k_j,  out = output_scale * sum_j softmax(s)_j * v_j,
// returning lse = ln sum_j exp(s_j) (natural log). With no keys, out is 0 and lse -inf.
// `out` has d_v entries.
double attend_row(const double* q, const KeyValueRows& kv, int64_t num_keys, double softmax_scale,
                  double output_scale, double* out);

}  // namespace speedmla::reference
