"""What the drop-in modules share: decode with or without the causal window, and a few
framework-neutral helpers (PyTorch tensors or NumPy arrays, as everywhere in speedmla)."""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional, Sequence

from .. import _tensors as tz
from .. import ops
from .._native import Error

LOG2_E = 1.0 / math.log(2.0)  # natural-log LSE × LOG2_E = base-2 LSE
MAX_DECODE_HEADS = 128  # mla_decode's limit on q.shape[2]


def dtype_name(dtype: Any) -> str:
    """A dtype given as a torch.dtype or by its name ("float8_e4m3fn"), as speedmla names it."""
    return str(dtype).removeprefix("torch.")


def as_int32(x: Any) -> Any:
    """`x` as int32 (a new tensor only when it has another integer type), as both APIs accept."""
    if tz.dtype_name(x) == "int32":
        return x
    if tz.is_torch(x):
        return x.to(sys.modules["torch"].int32)
    import numpy as np  # noqa: PLC0415

    return np.asarray(x).astype(np.int32)


def contiguous(x: Any) -> Any:
    if tz.is_torch(x):
        return x.contiguous()
    import numpy as np  # noqa: PLC0415

    return np.ascontiguousarray(x)


def swap_last_two(x: Any) -> Any:
    """A view with the last two dimensions swapped (no copy)."""
    return x.swapaxes(-1, -2)  # the same method on torch.Tensor and numpy.ndarray


def neg_inf_to_pos_inf(x: Any) -> None:
    """In place, without a host synchronisation (so also inside CUDA-graph capture)."""
    if tz.is_torch(x):
        torch = sys.modules["torch"]
        x.masked_fill_(torch.isneginf(x), math.inf)
    else:
        import numpy as np  # noqa: PLC0415

        x[np.isneginf(x)] = np.inf


def _view(x: Any, dims: Sequence[int]) -> Optional[Any]:
    """A view of `x` with another shape, or None where its strides allow none."""
    try:
        return tz.reshape(x, dims)
    except (RuntimeError, AttributeError, ValueError):  # torch .view, NumPy in-place reshape
        return None


def _copy_into(dst: Any, src: Any) -> None:
    if tz.is_torch(dst):
        dst.copy_(src)
    else:
        import numpy as np  # noqa: PLC0415

        np.copyto(dst, src)


def decode(q, kv_cache, block_table, seq_lens, *, out, lse, causal: bool, softmax_scale: float,
           output_scale: float, workspace: Callable[[int], Any], causal_seqs=None, cp_world: int = 1,
           cp_rank: int = 0) -> None:
    """speedmla.mla_decode into `out` (and `lse`, natural log, when given) with the mask the
    drop-in APIs select.

    causal=True: query token t of request b sees keys k < seq_lens[b] - (q_len - 1) + t, which is
    mla_decode's own window (and TokenSpeed's and FlashMLA's causal mask); with causal_seqs,
    mla_decode's context-parallel bound for rank cp_rank of cp_world instead. causal=False: every
    query token sees all seq_lens[b] keys (of this rank: causal_seqs is not read). MLA has one latent KV head and heads are independent,
    so the q_len tokens of a request are then exactly q_len*H heads of a one-token query: q is
    viewed as [B, 1, q_len*H, 576] and decoded in calls of at most 128 heads.

    workspace(nbytes) returns a GPU workspace of at least nbytes bytes (called once, only for
    CUDA tensors; every call here runs on the same stream, one after the other).
    """
    batch, q_len, heads, _ = tz.shape(q)
    device = q.device.index if tz.is_cuda(q) else None

    def workspace_for(shapes):
        if device is None:
            return None
        return workspace(max(ops._decode_workspace_bytes(batch, h, n, device) for h, n in shapes))

    if causal:
        ops.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                       output_scale=output_scale, out=out, lse=lse,
                       workspace=workspace_for([(heads, q_len)]), causal_seqs=causal_seqs,
                       cp_world=cp_world, cp_rank=cp_rank)
        return
    if q_len == 1:
        ops.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                       output_scale=output_scale, out=out, lse=lse,
                       workspace=workspace_for([(heads, q_len)]))
        return
    rows = q_len * heads
    chunk = min(rows, MAX_DECODE_HEADS)
    # q is only read: reshape copies it only where its strides allow no view.
    flat_q = q.reshape(batch, 1, rows, ops.CACHE_ROW_DIM)
    flat_out = _view(out, (batch, 1, rows, ops.LATENT_DIM))
    staged_out = flat_out is None
    if staged_out:
        flat_out, _ = tz.empty(q, (batch, 1, rows, ops.LATENT_DIM), "bfloat16")
    flat_lse = None if lse is None else _view(lse, (batch, 1, rows))
    staged_lse = lse is not None and flat_lse is None
    if staged_lse:
        flat_lse, _ = tz.empty(q, (batch, 1, rows), "float32")
    # A smaller last call can need more workspace (more split-KV parts per row tile).
    ws = workspace_for({(chunk, 1), (rows - (rows - 1) // chunk * chunk, 1)})
    for first in range(0, rows, chunk):
        part = slice(first, min(first + chunk, rows))
        ops.mla_decode(flat_q[:, :, part], kv_cache, block_table, seq_lens,
                       softmax_scale=softmax_scale, output_scale=output_scale,
                       out=flat_out[:, :, part],
                       lse=None if flat_lse is None else flat_lse[:, :, part], workspace=ws)
    if staged_out:
        _copy_into(out, tz.reshape(flat_out, (batch, q_len, heads, ops.LATENT_DIM)))
    if staged_lse:
        _copy_into(lse, tz.reshape(flat_lse, (batch, q_len, heads)))


def require(condition: bool, function: str, message: str) -> None:
    """Raises speedmla.Error("function: message") unless condition (contract §6 wording)."""
    if not condition:
        raise Error(f"{function}: {message}")
