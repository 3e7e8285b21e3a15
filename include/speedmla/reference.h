// speedmla/reference.h — the CPU reference of every operation.
//
// Same signatures and semantics as the public entry points, on CPU tensors only: exact masks,
// FP64 accumulation, bit-exact FP8/BF16 conversions, threads across (request, head). It is the
// oracle of the GPU tests and the CPU path of the library (the public functions call it for CPU
// tensors after validation). These functions assume validated arguments: call the public
// functions unless you have validated yourself.
#pragma once

#include <optional>

#include "speedmla/tensor.h"

namespace speedmla::reference {

void mla_decode(const TensorView& q, const TensorView& kv_cache, const TensorView& block_table,
                const TensorView& seq_lens, const TensorView& out,
                const std::optional<TensorView>& lse, float softmax_scale, float output_scale);

void mla_prefill(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                 const TensorView& out, const std::optional<TensorView>& lse, bool causal,
                 float softmax_scale, float output_scale);

void merge_attn_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                       const TensorView& lse_b, const TensorView& out,
                       const std::optional<TensorView>& lse);

void kv_cache_write(const TensorView& kv_cache, const TensorView& slots, const TensorView& latent,
                    const TensorView& rope, float scale_inv);

void gather_cache(const TensorView& kv_cache, const TensorView& slots, const TensorView& out,
                  float scale);

void quantize_fp8(const TensorView& x, const TensorView& out, float scale_inv);

void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, float k_scale_inv,
                     float v_scale_inv);

}  // namespace speedmla::reference
