"""FlashMLA's dense decode API on speedmla: a drop-in for ``flash_mla`` (deepseek-ai/FlashMLA at
9241ae3, ``flash_mla/flash_mla_interface.py``) as SGLang's and vLLM's Hopper MLA backends call it::

    import speedmla.compat.flash_mla as flash_mla

    sched_meta, num_splits = flash_mla.get_mla_metadata()       # (holder, None), as FlashMLA
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                                sched_meta, num_splits, causal=True)

Conventions kept: q [B, s_q, h_q, 576], the cache as [num_blocks, page_block_size, h_k, 576]
views, int32 block_table and cache_seqlens, out [B, s_q, h_q, 512] in q's dtype, softmax_lse
[B, h_q, s_q] FP32 in natural log with +inf for a query that sees no key (its output is 0),
softmax_scale defaulting to 576**-0.5, the causal mask aligned to the end of the sequence, and a
metadata holder that records the first call's configuration and refuses calls that disagree
with it. Added: speedmla's FP8 cache (``is_fp8_kvcache=True`` with a float8_e4m3fn cache of
plain 576-wide rows) and page sizes 1-128. docs/python.md lists what differs. PyTorch CPU
tensors and NumPy arrays run the CPU reference; errors raise speedmla.Error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

from .. import _tensors as tz
from .. import ops
from ._common import contiguous, decode, neg_inf_to_pos_inf, require, swap_last_two

__all__ = ["FlashMLASchedMeta", "flash_mla_with_kvcache", "get_mla_metadata"]

_FN = "flash_mla_with_kvcache"


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's tile-scheduler metadata holder, with its fields.

    FlashMLA fills tile_scheduler_metadata and num_splits on the first call of a decode step and
    the step's other layers reuse them. Here tile_scheduler_metadata holds speedmla's split-KV
    plan (speedmla.DecodePlan), made by the first call from its cache_seqlens and reused by the
    calls that pass the same cache_seqlens tensor and block-table width (another tensor gets a
    new plan): the layers after the first skip the planner kernel, as FlashMLA's skip its
    metadata kernel. As with FlashMLA, a holder serves one decode step: lengths changed in place
    after its first call are not seen. num_splits stays None. The holder also records the first
    call's configuration and refuses later calls that differ, as FlashMLA does.
    """

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int

        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]

        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Any = None
    num_splits: Any = None


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """An empty FlashMLASchedMeta and None, as FlashMLA returns them; the arguments (of
    FlashMLA's older interface) are accepted and not needed."""
    del args, kwargs
    return FlashMLASchedMeta(), None


def _plan(sched_meta: FlashMLASchedMeta, cache_seqlens, block_table, h_q: int, s_q: int, dtype: str,
          page_block_size: int) -> ops.DecodePlan:
    """The holder's plan for these lengths, made at the first call that passes them."""
    plan = sched_meta.tile_scheduler_metadata
    if (not isinstance(plan, ops.DecodePlan) or plan.seq_lens is not cache_seqlens
            or plan.block_table_width != tz.shape(block_table)[1]):
        plan = ops.mla_decode_plan(cache_seqlens, block_table, num_heads=h_q, q_len=s_q, dtype=dtype,
                                   page_size=page_block_size)
        sched_meta.tile_scheduler_metadata = plan
    return plan


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices=None, attn_sink=None, extra_k_cache=None,
                           extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
    """Dense MLA decode over a paged cache (speedmla.mla_decode).

    Args:
        q: [B, s_q, h_q, 576] BF16 (or float8_e4m3fn with an FP8 cache); last dim contiguous.
        k_cache: [num_blocks, page_block_size, h_k, 576], BF16; with is_fp8_kvcache=True
            float8_e4m3fn (one per-tensor scale, folded into softmax_scale by the caller).
            h_q must be a multiple of h_k. page_block_size 1-128 (powers of two) on the GPU.
        block_table: [B, max_num_blocks_per_seq] int32; entries past a request's length are
            never read.
        cache_seqlens: [B] int32 KV lengths (including the s_q new tokens).
        head_dim_v: must be 512.
        tile_scheduler_metadata: the FlashMLASchedMeta from get_mla_metadata.
        num_splits: must be None.
        softmax_scale: multiplies q·k; default 576 ** -0.5.
        causal: for s_q > 1, query token t sees keys k < cache_seqlens[b] - (s_q - 1) + t;
            otherwise all cache_seqlens[b] keys.
        is_fp8_kvcache: True for speedmla's FP8 cache; a BF16 q is then quantised to e4m3
            (round to nearest even, saturating to ±448) for the FP8 kernel.
        indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
        extra_topk_length: FlashMLA's sparse attention; not supported (must be None).

    Returns:
        (out [B, s_q, h_q, 512] BF16, softmax_lse [B, h_q, s_q] FP32, natural log, +inf for a
        query that sees no key).
    """
    sched_meta = tile_scheduler_metadata
    require(isinstance(sched_meta, FlashMLASchedMeta), _FN,
            "tile_scheduler_metadata must be the FlashMLASchedMeta of get_mla_metadata(), got "
            f"{type(sched_meta).__name__}")
    require(num_splits is None, _FN, "num_splits must be None (the second value of get_mla_metadata())")
    for name, value in (("indices", indices), ("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
                        ("extra_indices_in_kvcache", extra_indices_in_kvcache), ("topk_length", topk_length),
                        ("extra_topk_length", extra_topk_length)):
        require(value is None, _FN, f"{name} must be None: speedmla implements dense attention only, "
                "not FlashMLA's sparse attention")
    require(block_table is not None and cache_seqlens is not None, _FN,
            "block_table and cache_seqlens are required for dense attention")
    require(head_dim_v == ops.LATENT_DIM, _FN, f"head_dim_v must be {ops.LATENT_DIM}, got {head_dim_v}")
    require(len(tz.shape(q)) == 4, _FN, f"q must be [B, s_q, h_q, 576], got shape {list(tz.shape(q))}")
    require(len(tz.shape(k_cache)) == 4, _FN,
            f"k_cache must be [num_blocks, page_block_size, h_k, 576], got shape {list(tz.shape(k_cache))}")
    batch, s_q, h_q, _ = tz.shape(q)
    page_block_size, h_k = tz.shape(k_cache)[1:3]
    require(h_k >= 1 and h_q % h_k == 0, _FN,
            f"q.shape[2] (h_q = {h_q}) must be a multiple of k_cache.shape[2] (h_k = {h_k})")
    config = FlashMLASchedMeta.Config(batch, s_q, h_q, page_block_size, h_k, bool(causal),
                                      bool(is_fp8_kvcache), None, None, None)
    if not sched_meta.have_initialized:
        sched_meta.have_initialized, sched_meta.config = True, config
    else:
        for field in dataclasses.fields(config):
            given, recorded = getattr(config, field.name), getattr(sched_meta.config, field.name)
            require(given == recorded, _FN,
                    f"this call's {field.name} ({given}) differs from the one tile_scheduler_metadata "
                    f"was first used with ({recorded}); use one get_mla_metadata() per configuration")

    cache_dtype = tz.dtype_name(k_cache)
    expected = "float8_e4m3fn" if is_fp8_kvcache else "bfloat16"
    require(cache_dtype == expected, _FN,
            f"k_cache must be {expected} with is_fp8_kvcache={bool(is_fp8_kvcache)}, got {cache_dtype}")
    require(tz.shape(k_cache)[3] == ops.CACHE_ROW_DIM, _FN,
            f"k_cache.shape[3] must be {ops.CACHE_ROW_DIM} (512 latent + 64 rope; FlashMLA's 656-byte "
            f"sparse FP8 layout is not supported), got {tz.shape(k_cache)[3]}")
    if is_fp8_kvcache and tz.dtype_name(q) == "bfloat16":
        q = ops.quantize_fp8(q)
    if softmax_scale is None:
        softmax_scale = ops.CACHE_ROW_DIM ** -0.5

    out, _ = tz.empty(q, (batch, s_q, h_q, ops.LATENT_DIM), "bfloat16")
    lse, _ = tz.empty(q, (batch, h_q, s_q), "float32")
    lse_by_token = swap_last_two(lse)  # [B, s_q, h_q], the layout mla_decode writes
    if h_k == 1 and (causal or s_q == 1):
        # One mla_decode call over the whole batch: on the holder's plan (the mask is
        # mla_decode's own for s_q > 1, and s_q = 1 sees every key either way).
        ops.mla_decode_with_plan(_plan(sched_meta, cache_seqlens, block_table, h_q, s_q, expected, page_block_size),
                                 q, k_cache[:, :, 0, :], block_table, cache_seqlens, softmax_scale=softmax_scale,
                                 out=out, lse=lse_by_token)
        neg_inf_to_pos_inf(lse)
        return out, lse
    group = h_q // h_k
    for head_k in range(h_k):
        heads = slice(head_k * group, (head_k + 1) * group)
        # mla_decode reads cache rows of 576 contiguous elements: one KV head is a view of a
        # single-head cache, any other head's rows are copied out (MLA models have h_k = 1).
        cache = k_cache[:, :, head_k, :] if h_k == 1 else contiguous(k_cache[:, :, head_k, :])
        decode(q[:, :, heads], cache, block_table, cache_seqlens, out=out[:, :, heads],
               lse=lse_by_token[:, :, heads], causal=bool(causal), softmax_scale=softmax_scale,
               output_scale=1.0, workspace=lambda nbytes: tz.empty(q, (nbytes,), "uint8")[0])
    neg_inf_to_pos_inf(lse)
    return out, lse
