// The attention of one query row, shared by the decode and prefill references.
#pragma once

#include <cstdint>
#include <optional>

#include "reference/element.h"
#include "speedmla/tensor.h"

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

// Where one call's rows live: queries q[..., d_qk], outputs out[..., d_v] and optional lse[...],
// all addressed by the same leading indices.
struct AttentionTensors {
  const TensorView& q;
  const TensorView& out;
  const std::optional<TensorView>& lse;
};

// Attention of one query row over keys 0 .. num_keys-1, in FP64, given element offsets:
//   s_j = softmax_scale * q·k_j,  out = output_scale * sum_j softmax(s)_j * v_j,
//   lse = ln sum_j exp(s_j) (natural log).
// With no keys, out is 0 and lse -inf. out is rounded once to its dtype, lse to FP32.
void attend_row(const AttentionTensors& io, int64_t q_offset, int64_t out_offset,
                int64_t lse_offset, const KeyValueRows& kv, int64_t num_keys,
                double softmax_scale, double output_scale);

// The same for the row at `index` (leading indices, e.g. b, t, h) of every tensor in `io`.
template <typename... Index>
void attend_row_at(const AttentionTensors& io, const KeyValueRows& kv, int64_t num_keys,
                   double softmax_scale, double output_scale, Index... index) {
  attend_row(io, offset_of(io.q, index...), offset_of(io.out, index...),
             io.lse ? offset_of(*io.lse, index...) : 0, kv, num_keys, softmax_scale,
             output_scale);
}

}  // namespace speedmla::reference
