"""Decode context parallelism on the CPU with NumPy arrays: one global request set split over
cp_world simulated ranks (rank r's cache holds global tokens r, r + cp_world, ...), each rank's
speedmla.mla_decode (and the seed shim's tokenspeed_mla_decode) merged with
speedmla.cp.merge_partials, against the single-rank call on the global cache and the float64
reference; merge_partials' edge cases; the arguments' errors."""

import numpy as np
import pytest

import numpy_reference as ref
import speedmla
from speedmla.compat import tokenspeed_mla as ts

LOG2_E = 1 / np.log(2)
SCALE = 0.07


def global_problem(rng, q_len, heads=3, page=8, lengths=(1, 3, 7, 45, 130)):
    """BF16 bits of q and a paged cache (unused rows NaN), a shuffled block table, the lengths."""
    lengths = list(lengths) + [int(n) for n in rng.integers(2, 200, 2)]
    batch, pages_per = len(lengths), max(1, max(-(-n // page) for n in lengths))
    num_pages = 1 + batch * pages_per
    table = (1 + rng.permutation(batch * pages_per)).astype(np.int32).reshape(batch, pages_per)
    values = np.full((num_pages, page, 576), np.nan)
    for b, n in enumerate(lengths):
        for j in range(n):
            values[table[b, j // page], j % page] = rng.uniform(-1, 1, 576)
    q = ref.bf16_bits(rng.uniform(-1, 1, (batch, q_len, heads, 576)))
    return q, ref.bf16_bits(values), table, np.array(lengths, np.int32)


def rank_share(rng, cache, table, lens, world, rank):
    """Rank `rank`'s own paged cache of every world-th token (global rank, rank + world, ...),
    its block table and LOCAL lengths (pages shuffled again, unused rows NaN)."""
    page = cache.shape[1]
    local = [len(range(rank, int(n), world)) for n in lens]
    pages_per = max(1, max(-(-n // page) for n in local))
    local_table = (1 + rng.permutation(len(lens) * pages_per)).astype(np.int32).reshape(len(lens), pages_per)
    local_cache = np.full((1 + len(lens) * pages_per, page, 576), ref.bf16_bits(np.array(np.nan)), np.uint16)
    for b, n in enumerate(local):
        for k in range(n):
            g = rank + k * world
            local_cache[local_table[b, k // page], k % page] = cache[table[b, g // page], g % page]
    return local_cache, local_table, np.array(local, np.int32)


@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_merged_match_the_single_rank_call(rng, q_len, world):
    q, cache, table, lens = global_problem(rng, q_len)
    single, single_lse = speedmla.mla_decode(q, cache, table, lens, softmax_scale=SCALE, return_lse=True)
    expected, expected_lse = ref.decode(ref.bf16_values(q), ref.bf16_values(cache), table, lens, SCALE)
    outs, lses, seed_outs, seed_lses = [], [], [], []
    for rank in range(world):
        local_cache, local_table, local_lens = rank_share(rng, cache, table, lens, world, rank)
        out, lse = speedmla.mla_decode(q, local_cache, local_table, local_lens, softmax_scale=SCALE,
                                       return_lse=True, causal_seqs=lens, cp_world=world, cp_rank=rank)
        outs.append(out)
        lses.append(lse)
        # The seed's call: int64 lengths, a 4-D cache view, base-2 LSE (same bits otherwise).
        seed_out, seed_lse = ts.tokenspeed_mla_decode(
            q, local_cache.reshape(-1, 1, 8, 576), None, 512, 64, local_table, local_lens, 200, SCALE,
            return_lse=True, causal_seqs=lens.astype(np.int64), cp_world=world, cp_rank=rank)
        assert np.array_equal(seed_out, out) and np.array_equal(seed_lse, lse * np.float32(LOG2_E))
        seed_outs.append(seed_out)
        seed_lses.append(seed_lse / np.float32(LOG2_E))
    merged, merged_lse = speedmla.cp.merge_partials(outs, lses)
    assert merged.dtype == np.float32 and merged_lse.dtype == np.float32 and merged.shape == expected.shape
    # Rows that see no key globally (early draft tokens of requests shorter than q_len): 0, -inf.
    empty = np.isneginf(expected_lse)
    assert np.array_equal(np.isneginf(merged_lse), empty) and not np.isnan(merged).any()
    assert (merged[empty] == 0).all()
    # The ranks' BF16 outputs, merged: within two BF16 roundings of the single-rank result.
    np.testing.assert_allclose(merged, ref.bf16_values(single), rtol=1e-2, atol=4e-3)
    np.testing.assert_allclose(merged, expected, rtol=1e-2, atol=4e-3)
    np.testing.assert_allclose(merged_lse[~empty], single_lse[~empty], rtol=0, atol=2e-5)
    np.testing.assert_allclose(merged_lse[~empty], expected_lse[~empty], rtol=0, atol=2e-5)
    seed_merged, seed_merged_lse = speedmla.cp.merge_partials(seed_outs, seed_lses)
    np.testing.assert_allclose(seed_merged, merged, rtol=0, atol=1e-6)
    np.testing.assert_allclose(seed_merged_lse[~empty], merged_lse[~empty], rtol=0, atol=1e-5)


def test_without_the_causal_mask_each_rank_sees_all_its_keys(rng):
    q, cache, table, lens = global_problem(rng, 3)
    outs, lses = [], []
    for rank in range(4):
        local_cache, local_table, local_lens = rank_share(rng, cache, table, lens, 4, rank)
        out, lse = ts.tokenspeed_mla_decode(q, local_cache, None, 512, 64, local_table, local_lens, 200, SCALE,
                                            causal_mask=False, return_lse=True, cp_world=4, cp_rank=rank)
        outs.append(out)
        lses.append(lse / np.float32(LOG2_E))
    merged, merged_lse = speedmla.cp.merge_partials(outs, lses)
    single, single_lse = ts.tokenspeed_mla_decode(q, cache, None, 512, 64, table, lens, 200, SCALE,
                                                  causal_mask=False, return_lse=True)
    np.testing.assert_allclose(merged, ref.bf16_values(single), rtol=1e-2, atol=4e-3)
    np.testing.assert_allclose(merged_lse, single_lse / np.float32(LOG2_E), rtol=0, atol=2e-5)


def test_merge_partials_edge_cases():
    out_a = np.ones((2, 4), np.float32)
    out_b = np.full((2, 4), np.nan, np.float32)  # weight 0 below: must not leak
    lse_a = np.array([0.0, -np.inf], np.float32)
    lse_b = np.array([-np.inf, -np.inf], np.float32)
    out, lse = speedmla.cp.merge_partials([out_a, out_b], [lse_a, lse_b])
    assert np.array_equal(out[0], np.ones(4)) and lse[0] == 0
    assert np.array_equal(out[1], np.zeros(4)) and np.isneginf(lse[1])  # no key anywhere: 0, -inf
    # Two equal halves: out unchanged, lse + ln 2; BF16 bit arrays are read as BF16.
    out, lse = speedmla.cp.merge_partials([ref.bf16_bits(np.full((1, 3), 0.5))] * 2, [np.zeros(1, np.float32)] * 2)
    assert np.allclose(out, 0.5) and np.isclose(lse[0], np.log(2))
    # NaN propagates (an invalid request stays visible).
    out, lse = speedmla.cp.merge_partials([out_a, out_a], [np.array([np.nan, 0], np.float32), lse_a])
    assert np.isnan(lse[0]) and np.isnan(out[0]).all() and lse[1] == 0
    with pytest.raises(speedmla.Error, match="merge_partials: outs and lses must hold the same number"):
        speedmla.cp.merge_partials([out_a], [])
    with pytest.raises(speedmla.Error, match="merge_partials: part 1 must have out shape"):
        speedmla.cp.merge_partials([out_a, out_a[:1]], [lse_a, lse_a[:1]])


def test_context_parallel_argument_errors(rng):
    q, cache, table, lens = global_problem(rng, 2, lengths=(5, 9))
    call = dict(softmax_scale=SCALE)
    with pytest.raises(speedmla.Error, match=r"mla_decode: cp_world = 2, cp_rank = 1 needs causal_seqs"):
        speedmla.mla_decode(q, cache, table, lens, cp_world=2, cp_rank=1, **call)
    with pytest.raises(speedmla.Error, match=r"context_parallel.rank must be in \[0, world = 2\), got 2"):
        speedmla.mla_decode(q, cache, table, lens, causal_seqs=lens, cp_world=2, cp_rank=2, **call)
    with pytest.raises(speedmla.Error, match=r"context_parallel.world must be in \[1, 65536\], got 2147483647"):
        speedmla.mla_decode(q, cache, table, lens, causal_seqs=lens, cp_world=1 << 40, **call)
    with pytest.raises(speedmla.Error, match="context_parallel.causal_seqs must be int32, got int64"):
        speedmla.mla_decode(q, cache, table, lens, causal_seqs=lens.astype(np.int64), cp_world=2, **call)
    with pytest.raises(speedmla.Error, match="mla_decode: cp_world must be an int, got str"):
        speedmla.mla_decode(q, cache, table, lens, causal_seqs=lens, cp_world="2", **call)
