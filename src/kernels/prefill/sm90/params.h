// The whole contract between the prefill launcher and its kernel: every pointer, stride and
// size the kernel sees besides the three TMA descriptors (q, k, v). Built on the host by the
// launcher (launch.cpp) from views the API layer validated, passed by value.
#pragma once

#include <cstdint>

namespace speedmla::kernels::prefill_sm90 {

struct PrefillParams {
  // ---- problem sizes
  int batch;           // B
  int num_heads;       // H
  int head_group;      // H / H_kv: query heads per key/value head
  int total_q;         // q rows (rows past cu_seqlens_q[B] are never written)
  int total_k;         // k / v rows
  // Work-item slots per head: request b owns slots [cu_q[b] / kPairRows + b, cu_q[b+1] / kPairRows + b + 1),
  // which holds its ceil(len_q / kPairRows) pairs of tiles (the rest are idle), so a CTA finds the
  // request of a slot by a search over cu_seqlens_q alone, with no plan written by another
  // kernel. total_q / kPairRows + B slots cover every request.
  int num_slots;
  int64_t total_items;  // num_slots * H: the persistent CTAs' work items

  // ---- inputs read directly (q, k and v go through their TMA descriptors)
  const int32_t* cu_seqlens_q;  // [B + 1], on the device
  const int32_t* cu_seqlens_k;  // [B + 1]

  // ---- outputs
  uint16_t* out;                // [total_q, H, 128] BF16 bits; element strides below, last dim 1
  int64_t out_stride_token, out_stride_head;
  bool out_aligned16;           // out and its strides allow 16-byte stores (else 4-byte ones)
  float* lse;                   // [total_q, H] natural log, or nullptr
  int64_t lse_stride_token, lse_stride_head;

  // ---- scalars
  bool causal;                  // bottom-right aligned
  float score_scale_log2;       // softmax_scale * log2(e) > 0: scores in base-2 units
  float output_scale;
};

}  // namespace speedmla::kernels::prefill_sm90
