"""The operations of the speedmla contract (§4), one function each.

Every function takes PyTorch tensors (CPU or CUDA) or NumPy arrays, without copying them. CUDA
work runs on PyTorch's current stream, allocates only through PyTorch, never waits for the
device, and can be captured in torch.cuda.graph. CPU tensors run the CPU reference. An ``out``
left as None is allocated on the inputs' framework and device and returned. Bad arguments raise
:class:`speedmla.Error` naming the argument and the expected value.

Notation: T tokens, H heads, B requests; FP8 is float8_e4m3fn (torch.float8_e4m3fn). NumPy has
no bfloat16/float8: pass and receive such data as uint16/uint8 bit arrays (see _tensors).
"""

from __future__ import annotations

import functools
import operator

from . import _tensors as tz
from ._native import Error, lib

LATENT_DIM = 512  # kv_lora_rank: the latent part of a cache row, and the decode output width
ROPE_DIM = 64  # qk_rope_head_dim
CACHE_ROW_DIM = LATENT_DIM + ROPE_DIM  # 576: one cache row, one decode query row
PREFILL_QK_DIM = 192  # qk_nope_head_dim (128) + qk_rope_head_dim (64)
PREFILL_V_DIM = 128  # v_head_dim


def mla_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale: float,
               output_scale: float = 1.0, out=None, lse=None, return_lse: bool = False,
               workspace=None, causal_seqs=None, cp_world: int = 1, cp_rank: int = 0):
    """MLA decode / speculative verify over a paged latent KV cache.

    Args:
        q: [B, q_len, H, 576] FP8 or BF16 (the cache's dtype), 1 <= H <= 128; last dim contiguous.
        kv_cache: [num_pages, page_size, 576] FP8 or BF16; page 0 is the null page.
        block_table: [B, max_pages] int32 page ids (padding may hold anything).
        seq_lens: [B] int32 KV lengths including the q_len new tokens (already in the cache).
        softmax_scale: multiplies q·k (fold every q/k dequantisation scale in).
        output_scale: multiplies the output (a V dequantisation scale).
        out: optional [B, q_len, H, 512] BF16.
        lse: optional [B, q_len, H] FP32 natural-log LSE (-inf for a row that sees no key;
            NaN, with a NaN output row, for a row with a NaN score).
        return_lse: allocate lse when it is None and return (out, lse).
        workspace: optional uint8 [>= mla_decode_workspace_size(B, H, q_len, SMs)] on the GPU;
            allocated through PyTorch when None. Unused on the CPU.
        causal_seqs, cp_world, cp_rank: decode context parallelism (off when causal_seqs is
            None; then cp_world must be 1 and cp_rank 0). This call is rank cp_rank of cp_world
            (1 <= cp_world <= 65536, 0 <= cp_rank < cp_world), holding global tokens cp_rank,
            cp_rank + cp_world, ... of each request in its cache (seq_lens are the LOCAL
            lengths); causal_seqs: [B] int32 on q's device, the GLOBAL KV lengths (including the
            q_len new tokens), read on the device only. Merge the ranks' (out, lse) with
            speedmla.cp.merge_partials / merge_cp_partials.

    Query token t of request b sees keys k < seq_lens[b] - (q_len - 1) + t; with context
    parallelism, local keys k < ceil((causal_seqs[b] - cp_rank - (q_len - 1) + t) / cp_world),
    clamped to [max(0, seq_lens[b] - (q_len - 1) + t), seq_lens[b]]: a causal_seqs consistent with
    seq_lens never leaves that range, and any value is memory-safe. A row that sees no
    key gets out 0 and lse -inf.

    Returns:
        out, or (out, lse) when return_lse.
    """
    try:
        dims, out, out_arg, lse = _decode_outputs(q, out, lse, return_lse, "mla_decode")
        if workspace is None and tz.is_cuda(q):
            # Allocated through PyTorch (stream-ordered, safe in graph capture); its size comes from a
            # cache, not from two more calls into the compiled module per decode.
            workspace, _ = tz.empty(q, (_decode_workspace_bytes(dims[0], dims[2], dims[1], q.device.index),),
                                    "uint8")
        lib().mla_decode(tz.arg(q), tz.arg(kv_cache), block_table, seq_lens, out_arg, tz.arg(lse),
                         workspace, float(softmax_scale), float(output_scale), causal_seqs,
                         operator.index(cp_world), operator.index(cp_rank))
        return (out, lse) if return_lse else out
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(mla_decode, locals(), failure)


def mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool, softmax_scale: float,
                output_scale: float = 1.0, out=None, lse=None, return_lse: bool = False,
                v_layout: str = "token_major"):
    """Ragged multi-head attention for MLA prefill (the un-absorbed form).

    Args:
        q: [total_q, H, 192] FP8 or BF16; last dim contiguous.
        k: [total_k, H_kv, 192], same dtype as q; H a multiple of H_kv.
        v: [total_k, H_kv, 128], same dtype as q; or, with v_layout "fp8_transposed" (FP8),
            [H_kv, 128, T] with T >= total_k a multiple of 16, as pack_prefill_kv writes it
            (speedmla/prefill.h, PrefillValueLayout::kFp8Transposed): the GPU kernel then reads
            the values without transposing them.
        cu_seqlens_q, cu_seqlens_k: [B+1] int32 cumulative lengths, starting at 0. Requests with
            no queries or no keys are legal.
        causal: bottom-right aligned: query i of a request with len_q queries and len_k keys
            sees key j iff j <= i + (len_k - len_q). Non-causal sees all keys.
        softmax_scale: multiplies q·k; output_scale multiplies the output.
        out: optional [total_q, H, 128] BF16 (rows past cu_seqlens_q[B] untouched).
        lse: optional [total_q, H] FP32 natural-log LSE (-inf, out 0, for a row that sees no
            key; NaN, with a NaN output row, for a row with a NaN score); return_lse allocates
            it and returns (out, lse).

    Returns:
        out, or (out, lse) when return_lse.
    """
    try:
        total_q, heads, _ = tz.dims(q, 3, "mla_prefill", "q")
        if out is None:
            out, out_arg = tz.empty(q, (total_q, heads, PREFILL_V_DIM), "bfloat16")
        else:
            out_arg = tz.arg(out)
        if lse is None and return_lse:
            lse, _ = tz.empty(q, (total_q, heads), "float32")
        lib().mla_prefill(tz.arg(q), tz.arg(k), tz.arg(v), _value_layout_transposed(v_layout), cu_seqlens_q,
                          cu_seqlens_k, out_arg,
                          tz.arg(lse), bool(causal), float(softmax_scale), float(output_scale))
        return (out, lse) if return_lse else out
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(mla_prefill, locals(), failure)


def merge_attn_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    """Merges two partial attention results over disjoint key sets by their LSE.

    m = max(lse_a, lse_b); w = exp(lse - m); out = (w_a out_a + w_b out_b) / (w_a + w_b);
    lse = m + ln(w_a + w_b). Both -inf gives out 0, lse -inf.

    Args:
        out_a, out_b: [T, H, D] BF16 or FP32 (may differ); last dim contiguous.
        lse_a, lse_b: [T, H] FP32.
        out: optional [T, H, D] BF16 or FP32; may be out_a (in place). Default: out_a's dtype.
        lse: optional [T, H] FP32; may be lse_a. Allocated when None.

    Returns:
        (out, lse)
    """
    try:
        if out is None:
            out, out_arg = tz.empty(out_a, tz.shape(out_a), tz.dtype_name(out_a))
        else:
            out_arg = tz.arg(out)
        if lse is None:
            lse, _ = tz.empty(out_a, tz.shape(lse_a), "float32")
        lib().merge_attn_states(tz.arg(out_a), lse_a, tz.arg(out_b), lse_b, out_arg, lse)
        return out, lse
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(merge_attn_states, locals(), failure)


def kv_cache_write(kv_cache, slots, latent, rope, *, scale_inv: float = 1.0) -> None:
    """Writes new tokens' rows into the cache, in place.

    kv_cache[slot] = convert(latent ‖ rope × scale_inv) to the cache dtype (FP8: round to nearest
    even, saturate to ±448).

    Args:
        kv_cache: [num_pages, page_size, 576] FP8 or BF16 (written).
        slots: [T] int64 slot = page * page_size + offset; negative or out-of-range slots skip.
        latent: [T, 512] and rope: [T, 64], BF16, FP16 or FP32; last dims contiguous.
        scale_inv: multiplies every value before the conversion.
    """
    try:
        lib().kv_cache_write(tz.arg(kv_cache), slots, tz.arg(latent), tz.arg(rope), float(scale_inv))
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(kv_cache_write, locals(), failure)


def gather_cache(kv_cache, slots, *, scale: float = 1.0, out=None):
    """Gathers cache rows dequantised to BF16: out[i] = bf16(kv_cache[slots[i]] × scale).

    Args:
        kv_cache: [num_pages, page_size, 576] FP8 or BF16.
        slots: [n] int64; a negative slot gives zeros, one past the cache NaN.
        scale: the cache's dequantisation scale.
        out: optional [n, 576] BF16.

    Returns:
        out
    """
    try:
        if out is None:
            rows = tz.dims(slots, 1, "gather_cache", "slots")[0]
            out, out_arg = tz.empty(kv_cache, (rows, CACHE_ROW_DIM), "bfloat16")
        else:
            out_arg = tz.arg(out)
        lib().gather_cache(tz.arg(kv_cache), slots, out_arg, float(scale))
        return out
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(gather_cache, locals(), failure)


def quantize_fp8(x, *, scale_inv: float = 1.0, out=None):
    """out = fp8_e4m3(x × scale_inv), round to nearest even, saturating to ±448.

    Args:
        x: any shape (up to 6 dims), BF16, FP16 or FP32; last dim contiguous.
        out: optional, same shape, FP8.

    Returns:
        out
    """
    try:
        if out is None:
            out, out_arg = tz.empty(x, tz.shape(x), "float8_e4m3fn")
        else:
            out_arg = tz.arg(out)
        lib().quantize_fp8(tz.arg(x), out_arg, float(scale_inv))
        return out
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(quantize_fp8, locals(), failure)


def pack_prefill_kv(k_nope, k_rope, v, *, dtype: str = "float8_e4m3fn", k_scale_inv: float = 1.0,
                    v_scale_inv: float = 1.0, k_out=None, v_out=None, v_layout: str = "token_major"):
    """Packs prefill keys and values: k = k_nope ‖ broadcast_heads(k_rope), v copied, converted.

    Args:
        k_nope: [T, H, 128] BF16, FP16 or FP32.
        k_rope: [T, 64] or [T, 1, 64], same dtype choice.
        v: [T, H, 128].
        dtype: "float8_e4m3fn" (default) or "bfloat16": the dtype of k_out and v_out.
        k_scale_inv, v_scale_inv: multiply k and v before the conversion.
        k_out: optional [T, H, 192]; v_out: optional [T, H, 128], both of `dtype`.
        v_layout: "token_major" (default) or "fp8_transposed" (FP8 only): v_out is then
            [H, 128, T rounded up to 16] (or a given [H, 128, P], P >= T a multiple of 16) in the
            layout mla_prefill's v_layout="fp8_transposed" reads.

    Returns:
        (k_out, v_out)
    """
    try:
        tokens, heads, _ = tz.dims(k_nope, 3, "pack_prefill_kv", "k_nope")
        if k_out is None:
            k_out, k_arg = tz.empty(k_nope, (tokens, heads, PREFILL_QK_DIM), dtype)
        else:
            k_arg = tz.arg(k_out)
        transposed = _value_layout_transposed(v_layout)
        if v_out is None:
            v_out, v_arg = tz.empty(k_nope, value_shape(tokens, heads, v_layout), dtype)
        else:
            v_arg = tz.arg(v_out)
        lib().pack_prefill_kv(tz.arg(k_nope), tz.arg(k_rope), tz.arg(v), k_arg, v_arg, transposed,
                              float(k_scale_inv), float(v_scale_inv))
        return k_out, v_out
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(pack_prefill_kv, locals(), failure)


def value_shape(tokens: int, heads: int, v_layout: str = "token_major") -> tuple:
    """The shape of prefill values for `tokens` tokens of `heads` heads in `v_layout`:
    (tokens, heads, 128), or for "fp8_transposed" (heads, 128, tokens rounded up to 16)."""
    if _value_layout_transposed(v_layout):
        return (heads, PREFILL_V_DIM, (tokens + 15) // 16 * 16)
    return (tokens, heads, PREFILL_V_DIM)


def _value_layout_transposed(v_layout: str) -> bool:
    """True for "fp8_transposed", False for "token_major"; ValueError naming the choices else."""
    if v_layout not in ("token_major", "fp8_transposed"):
        raise ValueError(f'v_layout must be "token_major" or "fp8_transposed", got {v_layout!r}')
    return v_layout == "fp8_transposed"


def _decode_outputs(q, out, lse, return_lse: bool, function: str):
    """q's dims, then out and its module form, and lse: those given, or allocated like q
    (out [B, q_len, H, 512] BF16; lse [B, q_len, H] FP32 only when return_lse asks for it)."""
    dims = tz.dims(q, 4, function, "q")
    if out is None:
        out, out_arg = tz.empty(q, (*dims[:3], LATENT_DIM), "bfloat16")
    else:
        out_arg = tz.arg(out)
    if lse is None and return_lse:
        lse, _ = tz.empty(q, dims[:3], "float32")
    return dims, out, out_arg, lse


@functools.lru_cache(maxsize=1024)
def _decode_workspace_bytes(batch: int, num_heads: int, q_len: int, device: int, max_kv_tokens: int = 0,
                            invariant_split_tokens: int = 0) -> int:
    """mla_decode_workspace_size on `device`'s SMs, remembered: it depends on its arguments only."""
    return mla_decode_workspace_size(batch, num_heads, q_len, device_sm_count(device), max_kv_tokens=max_kv_tokens,
                                     invariant_split_tokens=invariant_split_tokens)


def mla_decode_workspace_size(batch: int, num_heads: int, q_len: int, num_sms: int, *, max_kv_tokens: int = 0,
                              invariant_split_tokens: int = 0) -> int:
    """Bytes of GPU workspace mla_decode needs: an upper bound independent of sequence lengths.

    With invariant_split_tokens > 0 (a multiple of 64), the workspace of a batch-invariant plan
    (mla_decode_plan), which also holds its partial results: max_kv_tokens (block_table.shape[1]
    * page_size, >= 1) is then required. Either size also serves mla_decode.
    """
    return int(lib().mla_decode_workspace_size(int(batch), int(num_heads), int(q_len), int(num_sms),
                                               int(max_kv_tokens), int(invariant_split_tokens)))


class DecodePlan:
    """A split-KV plan for the layers of one decode step (mla_decode_plan); pass it to
    mla_decode_with_plan. It keeps the workspace it was written into (and the seq_lens it was
    made from) alive; its shapes are checked at every use. block_table_width: the
    block_table.shape[1] it was made for."""

    __slots__ = ("_handle", "workspace", "seq_lens", "block_table_width")

    def __init__(self, handle, workspace, seq_lens, block_table_width):
        self._handle, self.workspace, self.seq_lens = handle, workspace, seq_lens
        self.block_table_width = block_table_width


def mla_decode_plan(seq_lens, block_table, *, num_heads: int, q_len: int, dtype: str, page_size: int,
                    workspace=None, invariant_split_tokens: int = 0) -> DecodePlan:
    """Makes the split-KV plan of a decode batch once, for every layer of the step to reuse.

    On the GPU, mla_decode launches a planner, the attention kernel and a combine; a plan made
    here once per step lets each layer's mla_decode_with_plan skip the planner (its launch and
    its GPU time), as FlashMLA's metadata does. Launches only the planner, on the current stream:
    no host synchronisation, capturable in a CUDA graph.

    Args:
        seq_lens: [B] int32 on the device of the calls to come; read on the device.
        block_table: [B, max_pages] int32; only its shape is used.
        num_heads, q_len: H (1-128) and the query tokens per request (1-1024) of the calls.
        dtype: "bfloat16" or "float8_e4m3fn", the dtype of q and kv_cache of the calls.
        page_size: tokens per cache page of the calls (GPU: a power of two, 1-128).
        workspace: optional uint8 GPU buffer of at least mla_decode_workspace_size(B, H, q_len,
            SMs, max_kv_tokens=max_pages * page_size, invariant_split_tokens=...) bytes,
            256-byte aligned; allocated through PyTorch when None. Unused on the CPU.
        invariant_split_tokens: 0 for mla_decode's balanced split; a positive multiple of 64
            for the batch-invariant policy: a request's output is then the same bits whatever
            else is in the batch (fixed pieces of that many tokens).

    The plan stays valid while seq_lens keeps its values and the workspace is used by nothing
    else (not by mla_decode, nor by another plan): make a new one every decode step. Calls on
    another stream need their own plan and workspace.
    """
    try:
        if workspace is None and tz.is_cuda(seq_lens):
            batch, max_pages = tz.dims(block_table, 2, "mla_decode_plan", "block_table")
            nbytes = _decode_workspace_bytes(batch, num_heads, q_len, seq_lens.device.index, max_pages * page_size,
                                             invariant_split_tokens)
            workspace, _ = tz.empty(seq_lens, (nbytes,), "uint8")
        handle = lib().mla_decode_plan(seq_lens, block_table, operator.index(num_heads), operator.index(q_len),
                                       str(dtype).removeprefix("torch."), operator.index(page_size), workspace,
                                       operator.index(invariant_split_tokens))
        return DecodePlan(handle, workspace, seq_lens, tz.dims(block_table, 2, "mla_decode_plan", "block_table")[1])
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(mla_decode_plan, locals(), failure)


def mla_decode_with_plan(plan: DecodePlan, q, kv_cache, block_table, seq_lens, *, softmax_scale: float,
                         output_scale: float = 1.0, out=None, lse=None, return_lse: bool = False):
    """mla_decode on a plan from mla_decode_plan: the same arguments (no workspace: the plan's)
    and the same result (with the balanced plan, the same bits), without the planner's launch.

    Raises speedmla.Error when the plan was made for another batch, head count, q_len, dtype,
    block-table width, page size, device or seq_lens tensor.
    """
    try:
        if not isinstance(plan, DecodePlan):
            raise Error(f"mla_decode_with_plan: plan must be the DecodePlan of mla_decode_plan, got "
                        f"{type(plan).__name__}")
        _, out, out_arg, lse = _decode_outputs(q, out, lse, return_lse, "mla_decode_with_plan")
        lib().mla_decode_with_plan(plan._handle, tz.arg(q), tz.arg(kv_cache), block_table, seq_lens, out_arg,
                                   tz.arg(lse), float(softmax_scale), float(output_scale))
        return (out, lse) if return_lse else out
    except (TypeError, AttributeError, ValueError) as failure:
        tz.raise_argument_error(mla_decode_with_plan, locals(), failure)


def device_sm_count(device: int) -> int:
    """Number of multiprocessors of CUDA device `device`."""
    return int(lib().device_sm_count(int(device)))


def decode_page_size_supported(page_size: int) -> bool:
    """Whether the decode kernels take this page size (a power of two from 1 to 128)."""
    return bool(lib().decode_page_size_supported(int(page_size)))

