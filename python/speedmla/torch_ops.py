"""speedmla's operations as PyTorch custom operators: ``torch.ops.speedmla.*``.

Importing this module (it needs PyTorch >= 2.4; ``import speedmla`` alone never imports PyTorch)
registers each operation of the contract (§4) with ``torch.library.custom_op``, with a fake
implementation that gives the output shapes and dtypes without running anything. Code that calls
them compiles with ``torch.compile(fullgraph=True)`` without a graph break, and the compiled code
can be captured in a CUDA graph: the operations run on the current stream and allocate only
through PyTorch, as the functions of :mod:`speedmla.ops` they call.

The operators are functional (new outputs, no ``out=``), except ``kv_cache_write``, which writes
the cache in place (declared as a mutation, so the compiler orders it before the reads). Shapes,
dtypes, units and errors are those of the :mod:`speedmla.ops` function of the same name;
``mla_decode`` and ``mla_prefill`` always return the LSE (natural log) with the output. Tensors
only (no NumPy arrays), on the CPU (reference) or a CUDA device.

    import speedmla.torch_ops  # registers torch.ops.speedmla.*

    @torch.compile(fullgraph=True)
    def decode_step(q, latent, rope, kv_cache, slots, block_table, seq_lens):
        torch.ops.speedmla.kv_cache_write(kv_cache, slots, latent, rope, 1.0)
        out, lse = torch.ops.speedmla.mla_decode(q, kv_cache, block_table, seq_lens, 0.07, 1.0)
        return out
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import ops

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"speedmla.torch_ops needs PyTorch >= 2.4 (torch.library.custom_op); "
                      f"this is PyTorch {torch.__version__}")

Tensor = torch.Tensor


@torch.library.custom_op("speedmla::mla_decode", mutates_args=())
def mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
               softmax_scale: float, output_scale: float = 1.0, causal_seqs: Optional[Tensor] = None,
               cp_world: int = 1, cp_rank: int = 0) -> Tuple[Tensor, Tensor]:
    """MLA decode / verify (speedmla.ops.mla_decode): (out [B, q_len, H, 512] BF16,
    lse [B, q_len, H] FP32, natural log) for q [B, q_len, H, 576] over the paged cache;
    causal_seqs, cp_world, cp_rank: one rank's partial of a context-parallel decode."""
    return ops.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                          output_scale=output_scale, return_lse=True, causal_seqs=causal_seqs,
                          cp_world=cp_world, cp_rank=cp_rank)


@mla_decode.register_fake
def _(q, kv_cache, block_table, seq_lens, softmax_scale, output_scale=1.0, causal_seqs=None, cp_world=1,
      cp_rank=0):
    batch, q_len, heads, _ = q.shape
    return (q.new_empty((batch, q_len, heads, ops.LATENT_DIM), dtype=torch.bfloat16),
            q.new_empty((batch, q_len, heads), dtype=torch.float32))


@torch.library.custom_op("speedmla::mla_prefill", mutates_args=())
def mla_prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                causal: bool, softmax_scale: float,
                output_scale: float = 1.0, v_layout: str = "token_major") -> Tuple[Tensor, Tensor]:
    """Ragged MLA prefill (speedmla.ops.mla_prefill): (out [total_q, H, 128] BF16,
    lse [total_q, H] FP32, natural log)."""
    return ops.mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                           softmax_scale=softmax_scale, output_scale=output_scale, return_lse=True,
                           v_layout=v_layout)


@mla_prefill.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, output_scale=1.0, v_layout="token_major"):
    total_q, heads, _ = q.shape
    return (q.new_empty((total_q, heads, ops.PREFILL_V_DIM), dtype=torch.bfloat16),
            q.new_empty((total_q, heads), dtype=torch.float32))


@torch.library.custom_op("speedmla::merge_attn_states", mutates_args=())
def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
                      lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Merges two partial results by LSE (speedmla.ops.merge_attn_states): (out with out_a's
    shape and dtype, lse [T, H] FP32)."""
    return ops.merge_attn_states(out_a, lse_a, out_b, lse_b)


@merge_attn_states.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return torch.empty_like(out_a), torch.empty_like(lse_a, dtype=torch.float32)


@torch.library.custom_op("speedmla::kv_cache_write", mutates_args=("kv_cache",))
def kv_cache_write(kv_cache: Tensor, slots: Tensor, latent: Tensor, rope: Tensor,
                   scale_inv: float = 1.0) -> None:
    """Writes new tokens' rows into kv_cache in place (speedmla.ops.kv_cache_write)."""
    ops.kv_cache_write(kv_cache, slots, latent, rope, scale_inv=scale_inv)


@kv_cache_write.register_fake
def _(kv_cache, slots, latent, rope, scale_inv=1.0):
    return None


@torch.library.custom_op("speedmla::gather_cache", mutates_args=())
def gather_cache(kv_cache: Tensor, slots: Tensor, scale: float = 1.0) -> Tensor:
    """Cache rows dequantised to BF16 (speedmla.ops.gather_cache): [n, 576] for slots [n]."""
    return ops.gather_cache(kv_cache, slots, scale=scale)


@gather_cache.register_fake
def _(kv_cache, slots, scale=1.0):
    return kv_cache.new_empty((slots.shape[0], ops.CACHE_ROW_DIM), dtype=torch.bfloat16)


@torch.library.custom_op("speedmla::quantize_fp8", mutates_args=())
def quantize_fp8(x: Tensor, scale_inv: float = 1.0) -> Tensor:
    """fp8_e4m3(x × scale_inv), x's shape (speedmla.ops.quantize_fp8)."""
    return ops.quantize_fp8(x, scale_inv=scale_inv)


@quantize_fp8.register_fake
def _(x, scale_inv=1.0):
    return torch.empty_like(x, dtype=torch.float8_e4m3fn)


@torch.library.custom_op("speedmla::pack_prefill_kv", mutates_args=())
def pack_prefill_kv(k_nope: Tensor, k_rope: Tensor, v: Tensor,
                    dtype: torch.dtype = torch.float8_e4m3fn, k_scale_inv: float = 1.0,
                    v_scale_inv: float = 1.0, v_layout: str = "token_major") -> Tuple[Tensor, Tensor]:
    """Prefill keys k_nope ‖ k_rope [T, H, 192] and values [T, H, 128] in `dtype`
    (float8_e4m3fn or bfloat16; speedmla.ops.pack_prefill_kv); v_layout "fp8_transposed":
    values [H, 128, T rounded up to 16] for mla_prefill's v_layout of that name."""
    return ops.pack_prefill_kv(k_nope, k_rope, v, dtype=str(dtype).removeprefix("torch."),
                               k_scale_inv=k_scale_inv, v_scale_inv=v_scale_inv, v_layout=v_layout)


@pack_prefill_kv.register_fake
def _(k_nope, k_rope, v, dtype=torch.float8_e4m3fn, k_scale_inv=1.0, v_scale_inv=1.0, v_layout="token_major"):
    tokens, heads, _ = k_nope.shape
    return (k_nope.new_empty((tokens, heads, ops.PREFILL_QK_DIM), dtype=dtype),
            k_nope.new_empty(ops.value_shape(tokens, heads, v_layout), dtype=dtype))


__all__ = ["gather_cache", "kv_cache_write", "merge_attn_states", "mla_decode", "mla_prefill",
           "pack_prefill_kv", "quantize_fp8"]
