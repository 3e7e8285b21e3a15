"""Each operation's CPU path (NumPy arrays) against the NumPy reference, and clear errors."""

import numpy as np
import pytest

import numpy_reference as ref
import speedmla


def same_values(actual, expected):
    """Equal as numbers (+0 == -0) or both NaN."""
    return np.all((actual == expected) | (np.isnan(actual) & np.isnan(expected)))


def test_quantize_fp8_rounds_to_nearest_even_and_saturates(rng):
    x = np.concatenate([rng.uniform(-500, 500, 300), rng.uniform(-0.02, 0.02, 99),
                        [1.0625, 1.1875, -1.0625, 448.0, 464.0, 1e6, -1e6]]).astype(np.float32)
    for scale_inv in (1.0, 0.37):
        codes = speedmla.quantize_fp8(x.reshape(7, -1), scale_inv=scale_inv)
        assert codes.dtype == np.uint8 and codes.shape == (7, 58)
        expected = ref.fp8_values(ref.fp8_codes(x.astype(np.float64) * np.float32(scale_inv)))
        assert same_values(ref.fp8_values(codes).ravel(), expected)
    out = np.zeros((7, 58), np.uint8)
    assert speedmla.quantize_fp8(x.reshape(7, -1), out=out) is out


def test_kv_cache_write_converts_and_skips_negative_slots(rng):
    for bits, decode, encode in ((np.uint8, ref.fp8_values, ref.fp8_codes),
                                 (np.uint16, ref.bf16_values, ref.bf16_bits)):
        cache = np.zeros((3, 4, 576), bits)
        latent = rng.uniform(-3, 3, (3, 512)).astype(np.float32)
        rope = rng.uniform(-3, 3, (3, 64)).astype(np.float32)
        slots = np.array([5, -1, 11], np.int64)
        speedmla.kv_cache_write(cache, slots, latent, rope, scale_inv=0.5)
        flat = cache.reshape(12, 576)
        for row, slot in ((0, 5), (2, 11)):
            expected = encode(np.concatenate([latent[row], rope[row]]) * np.float32(0.5))
            assert same_values(decode(flat[slot]), decode(expected))
        untouched = [s for s in range(12) if s not in (5, 11)]
        assert not flat[untouched].any()


def test_gather_cache_dequantises_to_bf16(rng):
    cache = ref.bf16_bits(rng.uniform(-2, 2, (4, 8, 576)))
    slots = np.array([31, -1, 0, 9], np.int64)
    rows = speedmla.gather_cache(cache, slots, scale=2.0)
    assert rows.dtype == np.uint16 and rows.shape == (4, 576)
    flat = ref.bf16_values(cache.reshape(32, 576))
    for i, slot in enumerate(slots):
        expected = np.zeros(576) if slot < 0 else flat[slot] * 2.0
        assert same_values(ref.bf16_values(rows[i]), expected)


def test_merge_attn_states_by_lse(rng):
    out_a, out_b = rng.normal(size=(2, 5, 3, 16)).astype(np.float32)
    lse_a, lse_b = rng.normal(size=(2, 5, 3)).astype(np.float32)
    lse_a[0, 0] = lse_b[0, 0] = -np.inf  # no keys on either side
    lse_a[1, 1] = -np.inf  # only b
    out, lse = speedmla.merge_attn_states(out_a, lse_a, out_b, lse_b)
    m = np.maximum(lse_a, lse_b).astype(np.float64)
    with np.errstate(invalid="ignore"):
        w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)
        expected = (w_a[..., None] * out_a + w_b[..., None] * out_b) / (w_a + w_b)[..., None]
        expected_lse = m + np.log(w_a + w_b)
    expected[0, 0], expected_lse[0, 0] = 0.0, -np.inf
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-6)
    # In place into a.
    speedmla.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out_a, lse=lse_a)
    np.testing.assert_allclose(out_a, expected, rtol=1e-5, atol=1e-6)


def test_mla_prefill_matches_reference(rng):
    heads, cu_q, cu_k = 4, np.array([0, 3, 3, 8], np.int32), np.array([0, 5, 7, 15], np.int32)
    q = ref.bf16_bits(rng.uniform(-1, 1, (8, heads, 192)))
    k = ref.bf16_bits(rng.uniform(-1, 1, (15, 2, 192)))
    v = ref.bf16_bits(rng.uniform(-1, 1, (15, 2, 128)))
    for causal in (True, False):
        out, lse = speedmla.mla_prefill(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=0.1,
                                        return_lse=True)
        expected, expected_lse = ref.prefill(ref.bf16_values(q), ref.bf16_values(k),
                                             ref.bf16_values(v), cu_q, cu_k, causal, 0.1)
        np.testing.assert_allclose(ref.bf16_values(out), expected, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-5)


def test_mla_decode_matches_reference(rng):
    batch, q_len, heads, page = 2, 2, 3, 8
    cache = ref.bf16_bits(rng.uniform(-1, 1, (6, page, 576)))
    block_table = np.array([[3, 1, 0], [5, 2, 4]], np.int32)
    seq_lens = np.array([12, 24], np.int32)
    q = ref.bf16_bits(rng.uniform(-1, 1, (batch, q_len, heads, 576)))
    out, lse = speedmla.mla_decode(q, cache, block_table, seq_lens, softmax_scale=0.05,
                                   output_scale=0.5, return_lse=True)
    expected, expected_lse = ref.decode(ref.bf16_values(q), ref.bf16_values(cache), block_table,
                                        seq_lens, 0.05, 0.5)
    np.testing.assert_allclose(ref.bf16_values(out), expected, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5)
    assert speedmla.mla_decode(q, cache, block_table, seq_lens, softmax_scale=0.05).dtype == np.uint16


def test_mla_decode_with_plan_gives_mla_decodes_bits_and_checks_the_plan(rng):
    batch, q_len, heads, page = 2, 2, 3, 8
    cache = ref.bf16_bits(rng.uniform(-1, 1, (6, page, 576)))
    block_table = np.array([[3, 1, 0], [5, 2, 4]], np.int32)
    seq_lens = np.array([12, 24], np.int32)
    plan = speedmla.mla_decode_plan(seq_lens, block_table, num_heads=heads, q_len=q_len, dtype="bfloat16",
                                    page_size=page)
    for layer in range(3):  # one plan serves every layer of the step
        q = ref.bf16_bits(rng.uniform(-1, 1, (batch, q_len, heads, 576)))
        out = np.full((batch, q_len, heads, 512), 0x7FC0, np.uint16)  # poisoned: NaN
        lse = np.full((batch, q_len, heads), np.nan, np.float32)
        speedmla.mla_decode_with_plan(plan, q, cache, block_table, seq_lens, softmax_scale=0.05,
                                      output_scale=0.5, out=out, lse=lse)
        expected, expected_lse = speedmla.mla_decode(q, cache, block_table, seq_lens, softmax_scale=0.05,
                                                     output_scale=0.5, return_lse=True)
        assert np.array_equal(out, expected) and np.array_equal(lse, expected_lse), layer
    with pytest.raises(speedmla.Error, match="q_len"):
        speedmla.mla_decode_with_plan(plan, np.zeros((batch, 1, heads, 576), np.uint16), cache, block_table,
                                      seq_lens, softmax_scale=0.05)
    with pytest.raises(speedmla.Error, match="seq_lens"):
        speedmla.mla_decode_with_plan(plan, q, cache, block_table, seq_lens.copy(), softmax_scale=0.05)
    with pytest.raises(speedmla.Error, match="plan must be the DecodePlan"):
        speedmla.mla_decode_with_plan(object(), q, cache, block_table, seq_lens, softmax_scale=0.05)
    with pytest.raises(speedmla.Error, match="dtype must be"):
        speedmla.mla_decode_plan(seq_lens, block_table, num_heads=heads, q_len=q_len, dtype="float16",
                                 page_size=page)
    with pytest.raises(speedmla.Error, match="num_heads must be an int"):
        speedmla.mla_decode_plan(seq_lens, block_table, num_heads=3.0, q_len=q_len, dtype="bfloat16",
                                 page_size=page)


def test_pack_prefill_kv(rng):
    k_nope = rng.uniform(-4, 4, (5, 3, 128)).astype(np.float32)
    k_rope = rng.uniform(-4, 4, (5, 64)).astype(np.float32)
    v = rng.uniform(-4, 4, (5, 3, 128)).astype(np.float32)
    k, v_out = speedmla.pack_prefill_kv(k_nope, k_rope, v, k_scale_inv=2.0, v_scale_inv=0.5)
    assert k.shape == (5, 3, 192) and v_out.shape == (5, 3, 128) and k.dtype == np.uint8
    expected_k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, None], (5, 3, 64))], axis=-1)
    assert same_values(ref.fp8_values(k), ref.fp8_values(ref.fp8_codes(expected_k * np.float32(2.0))))
    assert same_values(ref.fp8_values(v_out), ref.fp8_values(ref.fp8_codes(v * np.float32(0.5))))
    k16, _ = speedmla.pack_prefill_kv(k_nope, k_rope, v, dtype="bfloat16")
    assert same_values(ref.bf16_values(k16), ref.bf16_values(ref.bf16_bits(expected_k)))


def test_fp8_transposed_values_give_the_token_major_result(rng):
    heads, tokens = 2, 37
    cu = np.array([0, 5, 21, tokens], np.int32)  # requests starting off the layout's 16-token groups
    k_nope = rng.uniform(-4, 4, (tokens, heads, 128)).astype(np.float32)
    k_rope = rng.uniform(-4, 4, (tokens, 64)).astype(np.float32)
    v = rng.uniform(-4, 4, (tokens, heads, 128)).astype(np.float32)
    k, v_plain = speedmla.pack_prefill_kv(k_nope, k_rope, v)
    k_t, v_t = speedmla.pack_prefill_kv(k_nope, k_rope, v, v_layout="fp8_transposed")
    assert v_t.shape == (heads, 128, 48) and np.array_equal(k, k_t)
    q = speedmla.quantize_fp8(rng.uniform(-2, 2, (tokens, heads, 192)).astype(np.float32))
    for causal in (True, False):
        out, lse = speedmla.mla_prefill(q, k, v_plain, cu, cu, causal=causal, softmax_scale=0.1, return_lse=True)
        out_t, lse_t = speedmla.mla_prefill(q, k_t, v_t, cu, cu, causal=causal, softmax_scale=0.1,
                                            return_lse=True, v_layout="fp8_transposed")
        assert np.array_equal(out, out_t) and np.array_equal(lse, lse_t)
    with pytest.raises(Exception, match="v_layout"):
        speedmla.mla_prefill(q, k, v_plain, cu, cu, causal=True, softmax_scale=0.1, v_layout="transposed")
    with pytest.raises(speedmla.Error, match="k_out must be FP8 e4m3 with v_layout kFp8Transposed"):
        speedmla.pack_prefill_kv(k_nope, k_rope, v, dtype="bfloat16", v_layout="fp8_transposed")


def test_small_helpers():
    assert speedmla.decode_page_size_supported(64) and not speedmla.decode_page_size_supported(48)
    assert speedmla.mla_decode_workspace_size(4, 16, 2, 132) > 0
    balanced = speedmla.mla_decode_workspace_size(4, 16, 2, 132)
    invariant = speedmla.mla_decode_workspace_size(4, 16, 2, 132, max_kv_tokens=1 << 22,
                                                   invariant_split_tokens=4096)
    assert invariant > balanced  # room for the invariant plan's 4 x 1024 pieces of partial results
    with pytest.raises(speedmla.Error):
        speedmla.mla_decode_workspace_size(4, 16, 2, 132, max_kv_tokens=8192, invariant_split_tokens=100)


@pytest.mark.parametrize("call, message", [
    (lambda: speedmla.mla_decode(np.zeros((1, 1, 2, 576), np.uint16), np.zeros((2, 8, 512), np.uint16),
                                 np.zeros((1, 1), np.int32), np.ones(1, np.int32), softmax_scale=0.1),
     "kv_cache.shape[2] must be 576"),
    (lambda: speedmla.mla_decode(np.zeros((1, 1, 2, 576), np.float32), np.zeros((2, 8, 576), np.uint16),
                                 np.zeros((1, 1), np.int32), np.ones(1, np.int32), softmax_scale=0.1),
     "q must be float8_e4m3fn or bfloat16, got float32"),
    (lambda: speedmla.quantize_fp8(np.zeros(3, np.int16)), "unsupported DLPack dtype"),
    (lambda: speedmla.mla_prefill(np.zeros((2, 1, 192), np.uint16), np.zeros((2, 1, 192), np.uint16),
                                  np.zeros((2, 1, 128), np.uint16), np.array([0, 2, 1], np.int32),
                                  np.array([0, 1, 2], np.int32), causal=True, softmax_scale=0.1),
     "cu_seqlens_q"),
    (lambda: speedmla.kv_cache_write(np.zeros((2, 4, 576), np.uint8), np.zeros(2, np.int32),
                                     np.zeros((2, 512), np.float32), np.zeros((2, 64), np.float32)),
     "slots must be int64"),
    (lambda: speedmla.merge_attn_states(np.zeros((2, 3, 8), np.float32), np.zeros((2, 3), np.float32),
                                        np.zeros((2, 3, 9), np.float32), np.zeros((2, 3), np.float32)),
     "out_b"),
])
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(speedmla.Error) as info:
        call()
    assert message in str(info.value), str(info.value)
