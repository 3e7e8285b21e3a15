"""Independent NumPy references for the Python tests: bfloat16/FP8 bit conversions and the
attention formulas of the contract, in float64. Nothing here calls speedmla."""

from __future__ import annotations

import numpy as np

# ---- bit conversions -----------------------------------------------------------------------


def bf16_bits(x) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), round to nearest even (finite x)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_values(bits) -> np.ndarray:
    """bfloat16 bit patterns -> float64."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _fp8_table() -> np.ndarray:
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values[code] = np.nan
        elif exponent == 0:
            values[code] = sign * mantissa / 8 * 2.0**-6
        else:
            values[code] = sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return values


FP8_VALUES = _fp8_table()


def fp8_values(codes) -> np.ndarray:
    """float8_e4m3fn codes (uint8) -> float64."""
    return FP8_VALUES[np.asarray(codes, dtype=np.uint8)]


def fp8_codes(x) -> np.ndarray:
    """Values -> float8_e4m3fn codes: nearest, ties to an even code, saturating to ±448."""
    x = np.clip(np.asarray(x, dtype=np.float64), -448.0, 448.0)
    finite = np.flatnonzero(np.isfinite(FP8_VALUES))
    distance = np.abs(x[..., None] - FP8_VALUES[finite])
    best = distance.min(axis=-1, keepdims=True)
    # Among equally near codes prefer an even mantissa, then +0 over -0.
    candidates = np.where(distance == best, finite, 1 << 20)
    even = np.where((candidates & 1) == 0, candidates, 1 << 20)
    pick = np.where(even.min(axis=-1) < (1 << 20), even.min(axis=-1), candidates.min(axis=-1))
    return pick.astype(np.uint8)


# ---- attention -----------------------------------------------------------------------------


def attention(q, keys, values, softmax_scale, output_scale=1.0, visible=None):
    """One query row against keys [n, d] and values [n, dv]: (out [dv], lse), float64.
    visible: optional number of leading keys the query sees."""
    n = keys.shape[0] if visible is None else visible
    if n <= 0:
        return np.zeros(values.shape[1]), -np.inf
    s = softmax_scale * (keys[:n] @ q)
    m = s.max()
    w = np.exp(s - m)
    return output_scale * (w @ values[:n]) / w.sum(), m + np.log(w.sum())


def prefill(q, k, v, cu_q, cu_k, causal, softmax_scale):
    """Ragged prefill, float64: q [Tq, H, d], k [Tk, H_kv, d], v [Tk, H_kv, dv]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = np.zeros((q.shape[0], heads, v.shape[2]))
    lse = np.full((q.shape[0], heads), -np.inf)
    for b in range(len(cu_q) - 1):
        len_q, len_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for i in range(len_q):
            for h in range(heads):
                g = h // (heads // kv_heads)
                keys, vals = k[cu_k[b]:cu_k[b + 1], g], v[cu_k[b]:cu_k[b + 1], g]
                visible = min(len_k, i + (len_k - len_q) + 1) if causal else len_k
                out[cu_q[b] + i, h], lse[cu_q[b] + i, h] = attention(
                    q[cu_q[b] + i, h], keys, vals, softmax_scale, visible=visible)
    return out, lse


def decode(q, cache, block_table, seq_lens, softmax_scale, output_scale=1.0):
    """Paged decode, float64: q [B, q_len, H, 576], cache [pages, page_size, 576] values."""
    batch, q_len, heads, _ = q.shape
    page_size = cache.shape[1]
    out = np.zeros((batch, q_len, heads, 512))
    lse = np.full((batch, q_len, heads), -np.inf)
    for b in range(batch):
        n = int(seq_lens[b])
        rows = np.stack([cache[block_table[b, j // page_size], j % page_size] for j in range(n)])
        for t in range(q_len):
            for h in range(heads):
                out[b, t, h], lse[b, t, h] = attention(q[b, t, h], rows, rows[:, :512], softmax_scale,
                                                       output_scale, visible=n - (q_len - 1) + t)
    return out, lse
