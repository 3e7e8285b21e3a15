// speedmla/reference.h — the CPU reference of every operation.
//
// Same signatures and semantics as the public entry points, on CPU tensors only: exact masks,
// FP64 accumulation, bit-exact FP8/BF16 conversions, threads across (request, head). It is the
// oracle of the GPU tests and the CPU path of the library (the public functions call it for CPU
// tensors after validation). These functions assume validated arguments: call the public
// functions unless you have validated yourself.
//
// Numerics, common to all: inputs are widened exactly; every tensor may have any strides (in
// elements, the last dim included); attention is computed in FP64 and each output element is
// rounded once (to nearest even) to its dtype, lse to FP32. The conversion operations
// (kv_cache_write, gather_cache, quantize_fp8, pack_prefill_kv) compute float(x) * scale in
// float, as the GPU kernels do, then round once to the destination type (FP8 saturating).
#pragma once

#include <optional>

#include "speedmla/decode.h"
#include "speedmla/prefill.h"
#include "speedmla/tensor.h"

namespace speedmla::reference {

// As speedmla::mla_decode (decode.h), with any page size >= 1, context parallelism included
// (causal_seqs read on the host). Only the first seq_lens[b] slots of each request are read; a
// seq_len outside [0, max_pages*page_size] gives NaN out and lse for that request; a page id
// outside [0, num_pages) reads as zero rows.
void mla_decode(const TensorView& q, const TensorView& kv_cache, const TensorView& block_table,
                const TensorView& seq_lens, const TensorView& out,
                const std::optional<TensorView>& lse, float softmax_scale, float output_scale,
                const std::optional<DecodeContextParallel>& context_parallel = std::nullopt);

// As speedmla::mla_prefill (prefill.h); cu_seqlens are read on the host.
void mla_prefill(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                 const TensorView& out, const std::optional<TensorView>& lse, bool causal,
                 float softmax_scale, float output_scale);

// As speedmla::merge_attn_states (merge.h). Each (token, head) reads all its inputs before
// writing, so out may be out_a and lse may be lse_a. Edge cases: a part of weight 0 (lse -inf)
// is left out, so whatever its out holds (NaN included) does not affect the result; both -inf
// give out 0 and lse -inf; a NaN lse gives NaN out and lse; a +inf lse dominates (two +inf
// weigh equally).
void merge_attn_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                       const TensorView& lse_b, const TensorView& out,
                       const std::optional<TensorView>& lse);

// As speedmla::kv_cache_write (cache.h). Rows are written in order: when two rows name the
// same slot, the later one wins.
void kv_cache_write(const TensorView& kv_cache, const TensorView& slots, const TensorView& latent,
                    const TensorView& rope, float scale_inv);

// As speedmla::gather_cache (cache.h).
void gather_cache(const TensorView& kv_cache, const TensorView& slots, const TensorView& out,
                  float scale);

// As speedmla::quantize_fp8 (quantize.h); x may also be 0-dimensional.
void quantize_fp8(const TensorView& x, const TensorView& out, float scale_inv);

// As speedmla::pack_prefill_kv (quantize.h).
void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, float k_scale_inv,
                     float v_scale_inv);
void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, PrefillValueLayout v_layout,
                     float k_scale_inv, float v_scale_inv);

}  // namespace speedmla::reference
