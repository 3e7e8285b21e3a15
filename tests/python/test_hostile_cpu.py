"""Hostile arguments through the Python face, on NumPy arrays: a seeded run of calls of every
operation, most broken in one or two ways (dtypes, ranks, extents, non-contiguous or reversed
views, non-arrays, bad scales, out-of-range indices). Each must raise speedmla.Error whose
message starts with the operation's name, or give exactly what the same call gives on
contiguous copies of its arrays; any other exception (or a crash) fails."""

import numpy as np
import pytest

import numpy_reference as ref
import speedmla

CASES_PER_OP = 150


def _bf16(rng, shape):
    return ref.bf16_bits(rng.uniform(-1, 1, shape))


def _fp8(rng, shape):
    return ref.fp8_codes(rng.uniform(-1, 1, shape))


def _valid(op, rng):
    """(function, positional arrays, keyword arguments) of a small valid call."""
    i = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    if op == "mla_decode":
        b, q_len, h, ps, pages, width = i(1, 3), i(1, 2), i(1, 3), i(1, 8), i(1, 5), i(1, 3)
        q = _bf16(rng, (b, q_len, h, 576))
        cache = _bf16(rng, (pages, ps, 576))
        table = rng.integers(0, pages, (b, width)).astype(np.int32)
        lens = rng.integers(0, width * ps + 1, b).astype(np.int32)
        return speedmla.mla_decode, [q, cache, table, lens], {"softmax_scale": 0.05}
    if op == "mla_decode_with_plan":
        # A plan made from the call's own (possibly broken) lengths and table, for the valid
        # call's shapes: a broken array is refused by the plan or by the planned call.
        _, args, kwargs = _valid("mla_decode", rng)
        _, q_len, h, _ = args[0].shape
        page_size = args[1].shape[1]

        def decode_with_plan(q, cache, table, lens, **kw):
            plan = speedmla.mla_decode_plan(lens, table, num_heads=h, q_len=q_len, dtype="bfloat16",
                                            page_size=page_size)
            return speedmla.mla_decode_with_plan(plan, q, cache, table, lens, **kw)
        return decode_with_plan, args, kwargs
    if op == "mla_prefill":
        b, h = i(1, 3), i(1, 2)
        lq, lk = rng.integers(0, 6, b), rng.integers(0, 7, b)
        cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        q, k = _bf16(rng, (int(cu_q[-1]), h, 192)), _bf16(rng, (int(cu_k[-1]), h, 192))
        v = _bf16(rng, (int(cu_k[-1]), h, 128))
        return speedmla.mla_prefill, [q, k, v, cu_q, cu_k], {"causal": bool(i(0, 1)), "softmax_scale": 0.07}
    if op == "merge_attn_states":
        t, h, d = i(0, 3), i(1, 3), int(rng.choice([1, 8, 64]))
        out_a, out_b = rng.normal(size=(2, t, h, d)).astype(np.float32)
        lse_a, lse_b = rng.normal(size=(2, t, h)).astype(np.float32)
        return speedmla.merge_attn_states, [out_a, lse_a, out_b, lse_b], {}
    if op == "kv_cache_write":
        pages, ps, t = i(1, 3), i(1, 4), i(0, 4)
        cache = _fp8(rng, (pages, ps, 576))
        slots = rng.permutation(pages * ps)[:t].astype(np.int64)
        latent = rng.uniform(-2, 2, (len(slots), 512)).astype(np.float32)
        rope = rng.uniform(-2, 2, (len(slots), 64)).astype(np.float32)
        return speedmla.kv_cache_write, [cache, slots, latent, rope], {"scale_inv": 0.5}
    if op == "gather_cache":
        pages, ps = i(1, 3), i(1, 4)
        cache = _bf16(rng, (pages, ps, 576))
        slots = rng.integers(-1, pages * ps, i(0, 4)).astype(np.int64)
        return speedmla.gather_cache, [cache, slots], {"scale": 2.0}
    if op == "quantize_fp8":
        shape = tuple(int(s) for s in rng.integers(1, 4, i(1, 3))) + (i(1, 20),)
        return speedmla.quantize_fp8, [rng.uniform(-500, 500, shape).astype(np.float32)], {"scale_inv": 0.5}
    t, h = i(0, 3), i(1, 2)
    return (speedmla.pack_prefill_kv,
            [rng.normal(size=(t, h, 128)).astype(np.float32), rng.normal(size=(t, 64)).astype(np.float32),
             rng.normal(size=(t, h, 128)).astype(np.float32)], {})


def _mutate(args, kwargs, rng):
    """Breaks one thing in place; returns what."""
    arrays = [i for i, a in enumerate(args) if isinstance(a, np.ndarray)]
    if not arrays:
        return "none"
    which = arrays[int(rng.integers(len(arrays)))]
    x = args[which]
    kind = int(rng.integers(9))
    if kind == 0:
        dtype = rng.choice([np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8,
                            np.uint16, np.bool_])
        with np.errstate(over="ignore", invalid="ignore"):  # wrapping casts are part of the point
            args[which] = x.astype(dtype)
    elif kind == 1:
        args[which] = x[None]
    elif kind == 2 and x.ndim > 1 and x.shape[-1] > 0:
        args[which] = x[..., 0]
    elif kind == 3 and x.ndim > 0:
        args[which] = np.concatenate([x, x[..., :1]], axis=-1)
    elif kind == 4 and x.ndim > 0:  # a gap between the elements of the last dim, same values
        args[which] = np.repeat(x, 2, axis=-1)[..., ::2]
    elif kind == 5 and x.ndim > 0:  # negative leading stride
        args[which] = x[::-1]
    elif kind == 6:
        args[which] = [None, 3, x.tolist(), "x"][int(rng.integers(4))]
    elif kind == 7:
        names = [k for k in kwargs if "scale" in k]
        if names:
            kwargs[names[0]] = [float("nan"), float("inf"), "a", None][int(rng.integers(4))]
    elif x.dtype in (np.int32, np.int64) and x.size:  # indices and lengths out of range
        flat = x.reshape(-1).copy()
        flat[int(rng.integers(flat.size))] = rng.choice([-1, -(2 ** 31) + 1, 2 ** 30, 10 ** 6])
        args[which] = flat.reshape(x.shape)
    return f"arg {which} kind {kind}"


def _results(value):
    return list(value) if isinstance(value, tuple) else [value]


@pytest.mark.parametrize("op", ["mla_decode", "mla_decode_with_plan", "mla_prefill", "merge_attn_states",
                                "kv_cache_write", "gather_cache", "quantize_fp8", "pack_prefill_kv"])
def test_refused_with_the_operation_named_or_same_as_contiguous(op, rng):
    refused = accepted = 0
    for case in range(CASES_PER_OP):
        function, args, kwargs = _valid(op, rng)
        what = "valid"
        for _ in range(int(rng.integers(0, 3))):
            what = _mutate(args, kwargs, rng)
        # The call mutates its first array in place for kv_cache_write: run both on copies.
        copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        try:
            got = function(*args, **kwargs)
        except speedmla.Error as error:
            names = ("mla_decode_plan", op) if op == "mla_decode_with_plan" else (op,)
            assert str(error).startswith(tuple(n + ": " for n in names)), f"case {case} ({what}): {error}"
            refused += 1
            continue
        accepted += 1
        contiguous = [np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a for a in copies]
        expected = function(*contiguous, **kwargs)
        if op == "kv_cache_write":
            got, expected = args[0], contiguous[0]
        for g, e in zip(_results(got), _results(expected)):
            assert np.array_equal(g, e, equal_nan=g.dtype.kind == "f"), f"case {case} ({what})"
    assert refused >= CASES_PER_OP // 10 and accepted >= CASES_PER_OP // 10, (refused, accepted)
