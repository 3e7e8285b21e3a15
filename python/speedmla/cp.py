"""Decode context parallelism: merging the ranks' partial results.

With ``speedmla.mla_decode(..., causal_seqs=..., cp_world=W, cp_rank=r)`` each of W ranks
attends over its own share of every request's keys (global tokens r, r + W, ...) and returns a
partial output with its LSE. The ranks' partials merge by their LSE into the single-rank result:

    m = max_i lse_i,  w_i = exp(lse_i - m),  out = sum_i w_i out_i / sum_i w_i,  lse = m + ln sum_i w_i

All LSE here are **natural-log** (speedmla.mla_decode's; the seed-API shim returns base 2:
divide by log2(e) first). A row that no rank saw a key for (every lse_i = -inf) merges to out 0
and lse -inf; a part of weight 0 is left out, whatever its output holds. NaN propagates.

``merge_partials`` works on tensors in one process (PyTorch or NumPy); ``merge_cp_partials``
all-gathers the ranks' partials with ``torch.distributed`` and merges them. Importing this module
does not import PyTorch.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence, Tuple

from . import _tensors as tz
from ._native import Error

__all__ = ["merge_cp_partials", "merge_partials"]


def _bf16_bits_to_float32(bits: Any) -> Any:
    import numpy as np  # noqa: PLC0415

    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def merge_partials(outs: Sequence[Any], lses: Sequence[Any]) -> Tuple[Any, Any]:
    """Merges N partial attention results over disjoint key sets by their LSE.

    Args:
        outs: N partial outputs, each [..., D] (e.g. [B, q_len, H, 512]), all of one shape.
            PyTorch tensors of any float dtype, or NumPy arrays (float, or BF16 as uint16 bits).
        lses: N LSE, each [...] (the outputs' shape without D), FP32 natural log; -inf for a row
            of a part that saw no key.

    Returns:
        (out, lse): PyTorch: out in outs[0]'s dtype, lse FP32, on outs[0]'s device. NumPy: out and
        lse FP32 (NumPy has no bfloat16). Computed in FP32.

    Raises speedmla.Error for no parts, different counts or mismatched shapes.
    """
    fn = "merge_partials"
    if len(outs) == 0 or len(outs) != len(lses):
        raise Error(f"{fn}: outs and lses must hold the same number (>= 1) of parts, got {len(outs)} and {len(lses)}")
    out_shape = tuple(tz.shape(outs[0]))
    for i, (o, l) in enumerate(zip(outs, lses)):
        if tuple(tz.shape(o)) != out_shape or tuple(tz.shape(l)) != out_shape[:-1]:
            raise Error(f"{fn}: part {i} must have out shape {list(out_shape)} and lse shape {list(out_shape[:-1])}, "
                        f"got {list(tz.shape(o))} and {list(tz.shape(l))}")
    if tz.is_torch(outs[0]):
        torch = sys.modules["torch"]
        lse = torch.stack([l.float() for l in lses])  # [N, ...]
        out = torch.stack([o.float() for o in outs])  # [N, ..., D]
        where, exp, log, isneginf = torch.where, torch.exp, torch.log, torch.isneginf
        top = lse.amax(0)
    else:
        import numpy as np  # noqa: PLC0415

        lse = np.stack([np.asarray(l, dtype=np.float32) for l in lses])
        out = np.stack([_bf16_bits_to_float32(o) if tz.dtype_name(o) == "bfloat16" else np.asarray(o, np.float32)
                        for o in outs])
        where, exp, log, isneginf = np.where, np.exp, np.log, np.isneginf
        top = lse.max(0)
    # exp(-inf - (-inf)) is NaN: a row every part left empty is weighed against 0 instead.
    weight = exp(lse - where(isneginf(top), 0.0, top))  # [N, ...], 0 for an empty part
    total = weight.sum(0)
    # A part of weight 0 is left out, not multiplied (0 * NaN).
    acc = where(weight[..., None] > 0, weight[..., None] * out, 0.0).sum(0)
    # No key in any part: out 0, lse -inf (top). A NaN total (a NaN lse) stays NaN in both.
    empty = total == 0
    safe_total = where(empty, 1.0, total)
    merged = where(empty[..., None], 0.0, acc / safe_total[..., None])
    merged_lse = where(empty, top, top + log(safe_total))
    if tz.is_torch(outs[0]):
        return merged.to(outs[0].dtype), merged_lse
    return merged.astype(np.float32), merged_lse.astype(np.float32)


def merge_cp_partials(out: Any, lse: Any, group: Any = None) -> Tuple[Any, Any]:
    """All-gathers every rank's partial (out, lse) of a context-parallel decode over a
    ``torch.distributed`` process group and merges them (merge_partials).

    Call it on every rank of ``group`` (collective; the default group when None), each with its
    own ``speedmla.mla_decode(..., causal_seqs=..., cp_world=W, cp_rank=r, return_lse=True)``
    result. ``W`` is the group's size.

    Args:
        out: this rank's [..., D] partial output (PyTorch tensor, e.g. [B, q_len, H, 512] BF16).
        lse: this rank's [...] FP32 natural-log LSE (-inf for rows that saw no key).
        group: a torch.distributed process group, or None for the default one.

    Returns:
        (out, lse) merged over the group's ranks, the same on every rank: out in out's dtype,
        lse FP32 natural log.
    """
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if not tz.is_torch(out) or not tz.is_torch(lse):
        raise Error("merge_cp_partials: out and lse must be PyTorch tensors")
    world = dist.get_world_size(group)
    # Gathered as raw bytes: every backend moves uint8 (gloo has no bfloat16 collectives), and
    # the bits arrive unchanged.
    out_bytes = out.contiguous().view(torch.uint8)
    outs = [torch.empty_like(out_bytes) for _ in range(world)]
    lses = [torch.empty_like(lse.contiguous()) for _ in range(world)]
    dist.all_gather(outs, out_bytes, group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    return merge_partials([o.view(out.dtype) for o in outs], lses)
