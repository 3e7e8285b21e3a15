"""The seed's kernel API on Hopper: a drop-in for ``tokenspeed_kernel.ops.attention.tokenspeed_mla``.

An engine backend written for TokenSpeed's Blackwell kernels (``../shared/seed/tokenspeed_mla.py``)
runs on speedmla by importing this module instead::

    from speedmla.compat.tokenspeed_mla import (get_num_sm, tokenspeed_mla_decode,
                                                tokenspeed_mla_prefill, warmup_compile_prefill)

Every function keeps TokenSpeed's argument names, order, defaults and return conventions; the
differences that remain are listed in docs/python.md ("Drop-in APIs"). Units: the decode LSE is
base 2 (log2 of the sum of exp of the scaled scores), as TokenSpeed's decode returns it; the
prefill LSE is the natural log, as TokenSpeed's prefill returns it. Like the rest of speedmla,
PyTorch CPU tensors and NumPy arrays run the CPU reference; errors raise speedmla.Error naming
the argument and what was expected.

Decode context parallelism (``cp_world``, ``cp_rank``, ``causal_seqs``) is TokenSpeed's: each
rank's call returns its partial output and LSE; merge them with speedmla.cp (natural-log LSE:
divide this module's base-2 LSE by log2(e) first).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from .. import _tensors as tz
from .. import ops
from .._native import Error, lib
from ._common import LOG2_E, as_int32, decode, dtype_name, require

__all__ = [
    "get_num_sm",
    "has_binary_prefill",
    "mla_kv_pack_quantize_fp8",
    "tokenspeed_mla_decode",
    "tokenspeed_mla_prefill",
    "warmup_compile_prefill",
]

# The dimensions speedmla's kernels are built for (DeepSeek-V3 / Kimi-K2 MLA).
_KV_LORA_RANK = ops.LATENT_DIM
_QK_ROPE_HEAD_DIM = ops.ROPE_DIM


def get_num_sm(device) -> int:
    """Number of streaming multiprocessors of a CUDA device.

    Args:
        device: a CUDA ``torch.device`` (index None: the current device), or a device index.

    Raises speedmla.Error for a non-CUDA device.
    """
    if isinstance(device, int):
        return ops.device_sm_count(device)
    require(getattr(device, "type", None) == "cuda", "get_num_sm",
            f"device must be a CUDA device (torch.device or index), got {device!r}")
    index = device.index
    if index is None:
        index = sys.modules["torch"].cuda.current_device()
    return ops.device_sm_count(index)


def has_binary_prefill() -> bool:
    """True when the ahead-of-time compiled prefill is available, i.e. when speedmla's compiled
    module loads (speedmla never compiles kernels at run time; its GPU prefill runs on compute
    capability 9.0)."""
    try:
        lib()
    except Error:
        return False
    return True


def warmup_compile_prefill(q_dtype="float8_e4m3fn", d_qk: int = 192, d_v: int = 128,
                           enable_pdl: bool = False) -> None:
    """TokenSpeed JIT-compiles its prefill kernels here; speedmla's are compiled ahead of time.

    What remains useful at start-up is kept: the configuration is checked (so a misconfigured
    server fails before serving) and the compiled module is loaded. Idempotent.

    Args:
        q_dtype: torch.float8_e4m3fn (default) or torch.bfloat16, or its name.
        d_qk, d_v: must be 192 and 128 (speedmla's prefill head dims).
        enable_pdl: accepted (see tokenspeed_mla_prefill).
    """
    name = dtype_name(q_dtype)
    require(name in ("float8_e4m3fn", "bfloat16"), "warmup_compile_prefill",
            f"q_dtype must be float8_e4m3fn or bfloat16, got {name}")
    require(d_qk == ops.PREFILL_QK_DIM, "warmup_compile_prefill",
            f"d_qk must be {ops.PREFILL_QK_DIM} (128 nope + 64 rope), got {d_qk}")
    require(d_v == ops.PREFILL_V_DIM, "warmup_compile_prefill", f"d_v must be {ops.PREFILL_V_DIM}, got {d_v}")
    del enable_pdl
    lib()


def tokenspeed_mla_decode(query, kv_cache, workspace_buffer, kv_lora_rank: int, qk_rope_head_dim: int,
                          block_tables, seq_lens, max_seq_len: int, softmax_scale: float,
                          output_scale: float = 1.0, out=None, is_var_seq: bool = True,
                          causal_mask: bool = True, enable_pdl: bool = False, return_lse: bool = False,
                          causal_seqs=None, cp_world: int = 1, cp_rank: int = 0):
    """MLA decode / speculative verify over a paged latent cache (speedmla.mla_decode).

    Args:
        query: [B, q_len, H, 576] FP8 e4m3 or BF16 (the cache's dtype), 1 <= H <= 128.
        kv_cache: [num_pages, page_size, 576] or [num_pages, 1, page_size, 576], FP8 or BF16;
            page sizes 1-128 (powers of two) on the GPU, any on the CPU.
        workspace_buffer: int8 (or uint8) contiguous bytes on query's device, as the seed sizes
            it (num_SMs·H·q_len·513·4). speedmla's decode needs its own layout
            (speedmla.mla_decode_workspace_size(B, H, q_len, SMs), up to about twice that bound):
            the buffer is used when it is large and 256-byte aligned enough, else a workspace is
            allocated for the call through PyTorch's caching allocator (stream-ordered and safe
            inside torch.cuda.graph capture). Unused on the CPU; None is accepted.
        kv_lora_rank, qk_rope_head_dim: must be 512 and 64.
        block_tables: [B, max_pages] int32 page ids (padding may hold anything).
        seq_lens: [B] int32 (other integer types are converted) KV lengths including the q_len
            new tokens, read on the device only.
        max_seq_len: > 0. TokenSpeed sizes its split-KV grid from it; speedmla plans from
            seq_lens on the device, so it is only checked.
        softmax_scale: multiplies q·k (fold the q/k dequantisation scales in).
        output_scale: multiplies the output.
        out: optional [B, q_len, H, 512] BF16.
        is_var_seq: accepted: TokenSpeed picks a persistent kernel for equal lengths; speedmla's
            planner handles both cases, with the same result.
        causal_mask: True: query token t sees keys k < seq_lens[b] - (q_len - 1) + t. False:
            every query token sees all seq_lens[b] keys.
        enable_pdl: accepted; speedmla chains its own launches with programmatic dependent
            launch in every call.
        return_lse: also return the LSE, [B, q_len, H] FP32, in base 2 (-inf for a row that sees
            no key).
        causal_seqs, cp_world, cp_rank: decode context parallelism. This call is rank cp_rank
            of cp_world; its cache holds global tokens cp_rank, cp_rank + cp_world, ... of each
            request, and seq_lens are those LOCAL lengths. causal_seqs: [B] int32 (other integer
            types are converted) on query's device, the GLOBAL KV lengths including the q_len
            new tokens; required when cp_world > 1 and causal_mask. With causal_mask, query token
            t sees local keys k < ceil((causal_seqs[b] - cp_rank - (q_len - 1) + t) / cp_world)
            (clamped to [max(0, seq_lens[b] - (q_len - 1) + t), seq_lens[b]], which a
            consistent causal_seqs never leaves); without it, all seq_lens[b] local keys (causal_seqs is
            not read). Each rank returns its partial (out, lse); the ranks' results merge by
            their LSE (speedmla.cp.merge_partials / merge_cp_partials, natural log: lse / log2(e)).

    Returns:
        out [B, q_len, H, 512] BF16, or (out, lse) when return_lse.
    """
    fn = "tokenspeed_mla_decode"
    require(kv_lora_rank == _KV_LORA_RANK, fn, f"kv_lora_rank must be {_KV_LORA_RANK}, got {kv_lora_rank}")
    require(qk_rope_head_dim == _QK_ROPE_HEAD_DIM, fn,
            f"qk_rope_head_dim must be {_QK_ROPE_HEAD_DIM}, got {qk_rope_head_dim}")
    require(isinstance(cp_world, int) and cp_world >= 1, fn, f"cp_world must be an int >= 1, got {cp_world!r}")
    require(isinstance(cp_rank, int) and 0 <= cp_rank < cp_world, fn,
            f"cp_rank must be in [0, cp_world={cp_world}), got {cp_rank!r}")
    require(causal_seqs is not None or cp_world == 1 or not causal_mask, fn,
            f"causal_seqs (the requests' global KV lengths, [B] int32) is required when cp_world > 1 "
            f"and causal_mask, got cp_world={cp_world} and causal_seqs=None")
    require(max_seq_len > 0, fn, f"max_seq_len must be > 0, got {max_seq_len}")
    require(len(tz.shape(query)) == 4, fn, f"query must be [B, q_len, H, 576], got shape {tz.shape(query)}")
    cache_dims = tz.shape(kv_cache)
    if len(cache_dims) == 4:
        require(cache_dims[1] == 1, fn,
                f"a 4-D kv_cache must be [num_pages, 1, page_size, 576], got shape {cache_dims}")
        kv_cache = kv_cache.squeeze(1)
    if workspace_buffer is not None:
        require(dtype_name(workspace_buffer.dtype) in ("int8", "uint8"), fn,
                f"workspace_buffer must be int8 (or uint8) bytes, got {dtype_name(workspace_buffer.dtype)}")
    batch, q_len, heads, _ = tz.shape(query)
    if out is None:
        out, _ = tz.empty(query, (batch, q_len, heads, ops.LATENT_DIM), "bfloat16")
    lse = tz.empty(query, (batch, q_len, heads), "float32")[0] if return_lse else None
    del is_var_seq, enable_pdl

    def workspace(nbytes: int):
        if _usable_workspace(workspace_buffer, nbytes):
            return workspace_buffer.view(sys.modules["torch"].uint8)
        return tz.empty(query, (nbytes,), "uint8")[0]

    cp = {}
    if causal_mask and causal_seqs is not None:
        cp = dict(causal_seqs=as_int32(causal_seqs), cp_world=cp_world, cp_rank=cp_rank)
    decode(query, kv_cache, block_tables, as_int32(seq_lens), out=out, lse=lse, causal=bool(causal_mask),
           softmax_scale=softmax_scale, output_scale=output_scale, workspace=workspace, **cp)
    if not return_lse:
        return out
    lse *= LOG2_E  # speedmla's natural-log LSE in TokenSpeed's base 2, in place
    return out, lse


def _usable_workspace(buffer: Any, nbytes: int) -> bool:
    """Whether the caller's workspace_buffer can hold speedmla's decode workspace."""
    return (buffer is not None and tz.is_torch(buffer) and buffer.is_cuda and buffer.dim() == 1 and buffer.is_contiguous()
            and buffer.numel() >= nbytes and buffer.data_ptr() % 256 == 0)


def tokenspeed_mla_prefill(query, key, value, seq_lens, cum_seq_lens, max_seq_len: int, batch_size: int,
                           softmax_scale: float, is_causal: bool = True, return_lse: bool = False,
                           cum_seq_lens_q=None, max_seq_len_q: Optional[int] = None,
                           enable_pdl: bool = False, out=None):
    """Ragged MLA prefill (the un-absorbed form; speedmla.mla_prefill).

    Args:
        query: [total_q, H, 192] FP8 e4m3 or BF16.
        key: [total_kv, H_kv, 192], value: [total_kv, H_kv, 128], query's dtype; H a multiple
            of H_kv.
        seq_lens: the requests' KV lengths; as in TokenSpeed, not read (cum_seq_lens defines
            the lengths).
        cum_seq_lens: [batch_size + 1] cumulative KV lengths from 0 (int32; other integer types
            are converted).
        max_seq_len, max_seq_len_q: TokenSpeed's grid bounds; speedmla reads the lengths on the
            device, so they are only checked (>= 0).
        batch_size: the number of requests, len(cum_seq_lens) - 1.
        softmax_scale: multiplies q·k.
        is_causal: bottom-right aligned: query i of a request with len_q queries and len_k keys
            sees key j iff j <= i + (len_k - len_q). False: all keys.
        return_lse: also return the LSE, [total_q, H] FP32, natural log (-inf for a row without
            keys, whose output is 0).
        cum_seq_lens_q: [batch_size + 1] cumulative query lengths; default cum_seq_lens.
        enable_pdl: accepted; PyTorch's stream order provides the dependency.
        out: optional [total_q, H, 128] BF16.

    Returns:
        out [total_q, H, 128] BF16, or (out, lse) when return_lse.
    """
    fn = "tokenspeed_mla_prefill"
    if cum_seq_lens_q is None:
        cum_seq_lens_q = cum_seq_lens
    if max_seq_len_q is None:
        max_seq_len_q = max_seq_len
    for name, bound in (("max_seq_len", max_seq_len), ("max_seq_len_q", max_seq_len_q)):
        require(bound >= 0, fn, f"{name} must be >= 0, got {bound}")
    for name, cu in (("cum_seq_lens", cum_seq_lens), ("cum_seq_lens_q", cum_seq_lens_q)):
        require(tz.shape(cu) == (batch_size + 1,), fn,
                f"{name} must have shape [batch_size + 1] = [{batch_size + 1}], got {list(tz.shape(cu))}")
    del seq_lens, enable_pdl
    return ops.mla_prefill(query, key, value, as_int32(cum_seq_lens_q), as_int32(cum_seq_lens),
                           causal=bool(is_causal), softmax_scale=softmax_scale, out=out,
                           return_lse=return_lse)


def mla_kv_pack_quantize_fp8(k_nope, k_pe, v, k_scale_inv: float = 1.0, v_scale_inv: float = 1.0,
                             k_out=None, v_out=None, fp8_dtype="float8_e4m3fn", enable_pdl: bool = False):
    """Packs prefill keys and quantises keys and values to FP8:

        k_out = fp8(cat(k_nope, broadcast_heads(k_pe)) × k_scale_inv),  v_out = fp8(v × v_scale_inv)

    Args:
        k_nope: [s, H, 128] BF16, FP16 or FP32, last dim contiguous.
        k_pe: [s, 64] or [s, 1, 64], shared by all heads.
        v: [s, H, 128].
        k_scale_inv, v_scale_inv: multiply before the conversion.
        k_out: optional [s, H, 192]; v_out: optional [s, H, 128], of fp8_dtype.
        fp8_dtype: torch.float8_e4m3fn (default; speedmla's kernel: round to nearest even,
            saturating to ±448) or torch.float8_e5m2 (PyTorch tensors only: PyTorch's own
            conversion, as TokenSpeed's portable fallback does; nearest even, values past
            ±57344 become ±inf).
        enable_pdl: accepted; PyTorch's stream order provides the dependency.

    Returns:
        (k_out, v_out)
    """
    fn = "mla_kv_pack_quantize_fp8"
    del enable_pdl
    name = dtype_name(fp8_dtype)
    if name == "float8_e4m3fn":
        return ops.pack_prefill_kv(k_nope, k_pe, v, dtype=name, k_scale_inv=k_scale_inv,
                                   v_scale_inv=v_scale_inv, k_out=k_out, v_out=v_out)
    require(name == "float8_e5m2", fn, f"fp8_dtype must be float8_e4m3fn or float8_e5m2, got {name}")
    require(tz.is_torch(k_nope), fn, "fp8_dtype float8_e5m2 needs PyTorch tensors")
    torch = sys.modules["torch"]
    tokens, heads, _ = k_nope.shape
    require(len(k_pe.shape) in (2, 3) and k_pe.shape[0] == tokens and k_pe.shape[-1] == ops.ROPE_DIM
            and (len(k_pe.shape) == 2 or k_pe.shape[1] == 1), fn,
            f"k_pe must be [{tokens}, {ops.ROPE_DIM}] or [{tokens}, 1, {ops.ROPE_DIM}], got {list(k_pe.shape)}")
    rope = k_pe.reshape(tokens, 1, ops.ROPE_DIM).expand(tokens, heads, ops.ROPE_DIM)
    k = (torch.cat((k_nope, rope), dim=-1).float() * k_scale_inv).to(torch.float8_e5m2)
    packed_v = (v.float() * v_scale_inv).to(torch.float8_e5m2)
    if k_out is None:
        k_out = k
    else:
        k_out.copy_(k)
    if v_out is None:
        v_out = packed_v
    else:
        v_out.copy_(packed_v)
    return k_out, v_out
