// speedmla/prefill.h — ragged multi-head attention for MLA prefill (the "un-absorbed" form).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "speedmla/tensor.h"

namespace speedmla {

inline constexpr int kPrefillQkDim = 192;  // qk_nope_head_dim (128) + qk_rope_head_dim (64)
inline constexpr int kPrefillVDim = 128;   // v_head_dim

// How mla_prefill's v is laid out.
//   kTokenMajor     v [total_k, H_kv, 128], last dim contiguous (the plain layout).
//   kFp8Transposed  v [H_kv, 128, T] FP8 e4m3 with T >= total_k a multiple of 16, last dim
//                   contiguous: value (token t, head h, dim d) at [h, d, 16 (t / 16) + pos(t % 16)],
//                   pos(8a + 2k + b) = 4k + 2a + b (a, b in {0, 1}, k in 0..3) — the token order
//                   of the FP8 P·V's register fragments, so that the GPU kernel reads V^T as it
//                   arrives instead of transposing every block (~10 % of FP8 prefill at 1x32K).
//                   The groups count from the tensor's token 0, so the layout does not depend on
//                   cu_seqlens_k. pack_prefill_kv writes it (quantize.h); positions of tokens
//                   >= total_k are ignored.
enum class PrefillValueLayout { kTokenMajor, kFp8Transposed };

// The kFp8Transposed layout's arithmetic (host and device code alike):
// its token groups,
inline constexpr int kFp8TransposedGroupTokens = 16;
// the positions a tensor of `tokens` tokens needs (whole groups),
constexpr int64_t fp8_transposed_value_positions(int64_t tokens) {
  return (tokens + kFp8TransposedGroupTokens - 1) / kFp8TransposedGroupTokens * kFp8TransposedGroupTokens;
}
// the position of token t,
constexpr int64_t fp8_transposed_value_position(int64_t t) {
  return 16 * (t / 16) + 4 * ((t % 8) / 2) + 2 * ((t % 16) / 8) + t % 2;
}
// and the token (within its group) at position p (0..15) of a group: the inverse.
constexpr int fp8_transposed_value_token(int p) { return 8 * ((p / 2) % 2) + 2 * (p / 4) + p % 2; }

// The shape of the values of `tokens` tokens and `heads` heads in `layout` (Python:
// speedmla.value_shape): [tokens, heads, 128], or with kFp8Transposed [heads, 128,
// fp8_transposed_value_positions(tokens)].
inline std::vector<int64_t> prefill_value_shape(int64_t tokens, int64_t heads, PrefillValueLayout layout) {
  if (layout == PrefillValueLayout::kFp8Transposed) return {heads, kPrefillVDim, fp8_transposed_value_positions(tokens)};
  return {tokens, heads, kPrefillVDim};
}

// Ragged (variable-length, packed) attention over B requests.
//
//   q             [total_q, H, 192]     FP8 e4m3 or BF16; last dim contiguous.
//   k             [total_k, H_kv, 192]  same dtype as q; H must be a multiple of H_kv.
//   v             [total_k, H_kv, 128]  same dtype as q.
//   cu_seqlens_q  [B+1] int32: request b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b+1]);
//                 non-decreasing, cu_seqlens_q[0] = 0, cu_seqlens_q[B] <= total_q.
//   cu_seqlens_k  [B+1] int32: likewise for k and v rows. Requests with 0 queries or 0 keys
//                 are legal.
//   out           [total_q, H, 128] BF16 (written; rows past cu_seqlens_q[B] untouched).
//   lse           optional [total_q, H] FP32 (written): natural log; -inf (out 0) for a row with
//                 no key; NaN (out NaN) for a row with a NaN score (NaN in its query or in a key
//                 it sees), never a row with no key.
//   causal        bottom-right aligned: query i of a request with len_q queries and len_k keys
//                 sees key j iff j <= i + (len_k - len_q). Non-causal sees all len_k keys.
//   softmax_scale multiplies q·k; output_scale multiplies the output. Both must be finite.
//
// All tensors (cu_seqlens too) live on one device. out and lse must not overlap the inputs or
// each other. Other strides than the last dim's are free.
//
// CPU tensors run the reference (cu_seqlens values are checked there). CUDA tensors run the SM90
// kernel (compute capability 9.0 only) on `stream`: one persistent launch, no allocation and no
// host synchronisation, so the call can be captured in a CUDA graph and replayed with new
// lengths. There cu_seqlens are read on the device only: values the CPU path would refuse
// (decreasing, past the tensors) are clamped to the tensors, so they can give wrong rows but
// never an out-of-bounds access. The GPU path also requires softmax_scale > 0; q, k and v data
// 16-byte aligned with every stride but the last a non-negative multiple of 16 bytes (token
// strides of views into wider buffers are fine); out 4-byte aligned; cu_seqlens contiguous;
// q and k with fewer than 2^31 rows.
// Throws Error for any shape, dtype, stride, device or cu_seqlens value it can check, naming the
// argument.
void mla_prefill(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                 const TensorView& out, const std::optional<TensorView>& lse, bool causal,
                 float softmax_scale, float output_scale = 1.0f, Stream stream = nullptr);

// The same with v in `v_layout` (above). kFp8Transposed: q, k and v FP8; v [H_kv, 128, T] with
// T >= total_k a multiple of 16 and the last dim contiguous (GPU: strides multiples of 16 bytes,
// data 16-byte aligned). Every other argument and error as above.
void mla_prefill(const TensorView& q, const TensorView& k, const TensorView& v, PrefillValueLayout v_layout,
                 const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                 const TensorView& out, const std::optional<TensorView>& lse, bool causal,
                 float softmax_scale, float output_scale = 1.0f, Stream stream = nullptr);

}  // namespace speedmla
