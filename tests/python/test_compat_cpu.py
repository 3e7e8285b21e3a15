"""The drop-in APIs (speedmla.compat.tokenspeed_mla, speedmla.compat.flash_mla) on the CPU with
NumPy arrays: each against the native call it wraps and against the NumPy reference, every
element, outputs poisoned first; and their argument errors."""

import types

import numpy as np
import pytest

import numpy_reference as ref
import speedmla
from speedmla.compat import flash_mla, tokenspeed_mla as ts

LOG2_E = 1 / np.log(2)
BF16_NAN = 0x7FC0  # poison for BF16 outputs: a row the shim forgets to write stays NaN


def decode_reference(q, cache, block_table, seq_lens, scale, causal):
    """Decode in float64: query token t of request b sees keys k < seq_lens[b] - (q_len - 1) + t
    (causal), or all seq_lens[b] keys."""
    batch, q_len, heads, _ = q.shape
    page = cache.shape[1]
    out, lse = np.zeros((batch, q_len, heads, 512)), np.full((batch, q_len, heads), -np.inf)
    for b in range(batch):
        n = int(seq_lens[b])
        rows = np.array([cache[block_table[b, j // page], j % page] for j in range(n)]).reshape(n, 576)
        for t in range(q_len):
            visible = n - (q_len - 1) + t if causal else n
            for h in range(heads):
                out[b, t, h], lse[b, t, h] = ref.attention(q[b, t, h], rows, rows[:, :512], scale,
                                                           visible=visible)
    return out, lse


def paged_problem(rng, batch, q_len, heads, page, lengths, num_pages=None):
    """Random BF16 bits for q and a cache whose unused rows are NaN, and a shuffled block table."""
    pages_per = max(1, max(-(-n // page) for n in lengths))
    num_pages = num_pages or 1 + batch * pages_per
    values = rng.uniform(-1, 1, (num_pages, page, 576))
    table = (1 + rng.permutation(batch * pages_per)).astype(np.int32).reshape(batch, pages_per)
    used = np.zeros((num_pages, page), bool)
    for b, n in enumerate(lengths):
        for j in range(n):
            used[table[b, j // page], j % page] = True
    values[~used] = np.nan  # unused slots may hold anything (contract §3)
    cache = ref.bf16_bits(values)
    q = ref.bf16_bits(rng.uniform(-1, 1, (batch, q_len, heads, 576)))
    return q, cache, table, np.array(lengths, np.int32)


@pytest.mark.parametrize("q_len", [1, 2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_seed_decode_matches_the_reference_and_mla_decode(rng, q_len, causal):
    heads, page, scale = 3, 8, 0.07
    q, cache, table, lens = paged_problem(rng, 3, q_len, heads, page, [q_len, 13, 24])
    out = np.full((3, q_len, heads, 512), BF16_NAN, np.uint16)
    result, lse = ts.tokenspeed_mla_decode(q, cache, np.zeros(16, np.int8), 512, 64, table, lens, 24, scale,
                                           out=out, causal_mask=causal, return_lse=True)
    assert result is out and lse.shape == (3, q_len, heads) and lse.dtype == np.float32
    expected, expected_lse = decode_reference(ref.bf16_values(q), ref.bf16_values(cache), table, lens,
                                              scale, causal)
    np.testing.assert_allclose(ref.bf16_values(out), expected, rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(lse, expected_lse * LOG2_E, rtol=1e-5)  # base 2, as TokenSpeed
    if causal:  # the same call as speedmla.mla_decode, so the same bits (LSE in natural log there)
        native, native_lse = speedmla.mla_decode(q, cache, table, lens, softmax_scale=scale, return_lse=True)
        assert np.array_equal(native, out)
        assert np.array_equal(native_lse * np.float32(LOG2_E), lse)
    plain = ts.tokenspeed_mla_decode(q, cache.reshape(-1, 1, page, 576), None, 512, 64, table,
                                     lens.astype(np.int64), 24, scale, causal_mask=causal)
    assert np.array_equal(plain, out)  # 4-D cache view, int64 lengths, no LSE: the same output


def test_seed_prefill_matches_the_reference(rng):
    heads, cu_q, cu_k = 4, np.array([0, 3, 3, 8, 8], np.int32), np.array([0, 5, 7, 15, 15], np.int32)
    q = ref.bf16_bits(rng.uniform(-1, 1, (8, heads, 192)))
    k = ref.bf16_bits(rng.uniform(-1, 1, (15, 2, 192)))
    v = ref.bf16_bits(rng.uniform(-1, 1, (15, 2, 128)))
    for causal in (True, False):
        out = np.full((8, heads, 128), BF16_NAN, np.uint16)
        result, lse = ts.tokenspeed_mla_prefill(q, k, v, np.diff(cu_k), cu_k, 8, 4, 0.1, is_causal=causal,
                                                return_lse=True, cum_seq_lens_q=cu_q, max_seq_len_q=5, out=out)
        assert result is out
        expected, expected_lse = ref.prefill(ref.bf16_values(q), ref.bf16_values(k), ref.bf16_values(v),
                                             cu_q, cu_k, causal, 0.1)
        np.testing.assert_allclose(ref.bf16_values(out), expected, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-5)  # natural log, as TokenSpeed's prefill
    # Without cum_seq_lens_q the query lengths are the key lengths.
    same = ts.tokenspeed_mla_prefill(q, k[:8], v[:8], None, cu_q, 5, 4, 0.1)
    expected, _ = ref.prefill(ref.bf16_values(q), ref.bf16_values(k[:8]), ref.bf16_values(v[:8]),
                              cu_q, cu_q, True, 0.1)
    np.testing.assert_allclose(ref.bf16_values(same), expected, rtol=1e-2, atol=1e-2)


def test_seed_kv_pack_follows_its_formula(rng):
    k_nope = rng.uniform(-300, 300, (5, 3, 128)).astype(np.float32)
    k_pe = rng.uniform(-300, 300, (5, 1, 64)).astype(np.float32)
    v = rng.uniform(-300, 300, (5, 3, 128)).astype(np.float32)
    k, v_out = ts.mla_kv_pack_quantize_fp8(k_nope, k_pe, v, 2.0, 0.5)
    packed = np.concatenate([k_nope, np.broadcast_to(k_pe, (5, 3, 64))], axis=-1)
    # fp8(x × scale): round to nearest even, saturating to ±448 (values here reach ±600).
    assert np.array_equal(k, ref.fp8_codes(packed * np.float32(2.0)))
    assert np.array_equal(v_out, ref.fp8_codes(v * np.float32(0.5)))


def flash_reference(q, cache, table, lens, causal, scale):
    """FlashMLA's conventions from the definition: lse [B, h_q, s_q], +inf where no key."""
    batch, s_q, h_q, _ = q.shape
    h_k = cache.shape[2]
    out = np.zeros((batch, s_q, h_q, 512))
    lse = np.zeros((batch, h_q, s_q))
    for g in range(h_k):
        heads = slice(g * (h_q // h_k), (g + 1) * (h_q // h_k))
        o, l = decode_reference(q[:, :, heads], cache[:, :, g], table, lens, scale, causal and s_q > 1)
        out[:, :, heads], lse[:, heads] = o, l.transpose(0, 2, 1)
    lse[np.isneginf(lse)] = np.inf
    return out, lse


@pytest.mark.parametrize("h_k", [1, 2])
@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True), (2, False), (3, True)])
def test_flash_mla_api_matches_its_conventions(rng, h_k, s_q, causal):
    h_q, page, batch = 4, 8, 3
    lens = [0, 13, 22]  # a request without keys: out 0, lse +inf
    q, _, table, lens = paged_problem(rng, batch, s_q, h_q, page, lens)
    cache = ref.bf16_bits(rng.uniform(-1, 1, (1 + table.size, page, h_k, 576)))
    meta, splits = flash_mla.get_mla_metadata()
    assert splits is None and not meta.have_initialized
    out, lse = flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, splits, causal=causal)
    assert out.shape == (batch, s_q, h_q, 512) and out.dtype == np.uint16
    assert lse.shape == (batch, h_q, s_q) and lse.dtype == np.float32
    expected, expected_lse = flash_reference(ref.bf16_values(q), ref.bf16_values(cache), table, lens, causal,
                                             576 ** -0.5)
    np.testing.assert_allclose(ref.bf16_values(out), expected, rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5)
    assert np.isposinf(lse[0]).all() and not ref.bf16_values(out[0]).any()
    # The holder is reused for the next layer; a different configuration is refused.
    again, _ = flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, None, causal=causal)
    assert np.array_equal(again, out) and meta.have_initialized and meta.config.h_k == h_k
    with pytest.raises(speedmla.Error, match="causal"):
        flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, None, causal=not causal)


def test_flash_mla_api_with_an_fp8_cache_is_mla_decode_on_quantised_queries(rng):
    q, cache, table, lens = paged_problem(rng, 2, 2, 4, 16, [5, 30])
    cache8 = speedmla.quantize_fp8(ref.bf16_values(cache).astype(np.float32))
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, cache8.reshape(-1, 16, 1, 576), table, lens, 512, meta,
                                                softmax_scale=0.06, causal=True, is_fp8_kvcache=True)
    q8 = speedmla.quantize_fp8(ref.bf16_values(q).astype(np.float32))
    native, native_lse = speedmla.mla_decode(q8, cache8, table, lens, softmax_scale=0.06, return_lse=True)
    assert np.array_equal(out, native)
    assert np.array_equal(lse, native_lse.transpose(0, 2, 1))


def test_flash_mla_holder_keeps_a_plan_per_lengths_tensor(rng):
    # FlashMLA's holder carries its metadata from a step's first layer to the others; here it
    # carries speedmla's split-KV plan, remade when another cache_seqlens tensor comes.
    q, cache, table, lens = paged_problem(rng, 3, 2, 4, 16, [5, 30, 17])
    cache = cache.reshape(-1, 16, 1, 576)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, causal=True)
    plan = meta.tile_scheduler_metadata
    assert isinstance(plan, speedmla.DecodePlan) and plan.seq_lens is lens and plan.block_table_width == table.shape[1]
    again, lse_again = flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, causal=True)
    assert meta.tile_scheduler_metadata is plan
    assert np.array_equal(again, out) and np.array_equal(lse_again, lse)
    other_lens = lens.copy()
    third, _ = flash_mla.flash_mla_with_kvcache(q, cache, table, other_lens, 512, meta, causal=True)
    assert meta.tile_scheduler_metadata is not plan and meta.tile_scheduler_metadata.seq_lens is other_lens
    assert np.array_equal(third, out)
    native = speedmla.mla_decode(q, cache[:, :, 0], table, lens, softmax_scale=576 ** -0.5)
    assert np.array_equal(out, native)


def test_small_helpers():
    assert ts.has_binary_prefill()
    ts.warmup_compile_prefill()
    ts.warmup_compile_prefill("bfloat16", 192, 128, enable_pdl=True)
    with pytest.raises(speedmla.Error, match="get_num_sm: device must be a CUDA device"):
        ts.get_num_sm(types.SimpleNamespace(type="cpu", index=None))


def decode_args(**changes):
    q = np.zeros((1, 2, 2, 576), np.uint16)
    args = dict(query=q, kv_cache=np.zeros((2, 8, 576), np.uint16), workspace_buffer=np.zeros(8, np.int8),
                kv_lora_rank=512, qk_rope_head_dim=64, block_tables=np.zeros((1, 1), np.int32),
                seq_lens=np.full(1, 2, np.int32), max_seq_len=8, softmax_scale=0.1)
    args.update(changes)
    return args


def flash_args(**changes):
    args = dict(q=np.zeros((1, 1, 2, 576), np.uint16), k_cache=np.zeros((2, 64, 1, 576), np.uint16),
                block_table=np.zeros((1, 1), np.int32), cache_seqlens=np.ones(1, np.int32), head_dim_v=512,
                tile_scheduler_metadata=flash_mla.get_mla_metadata()[0])
    args.update(changes)
    return args


@pytest.mark.parametrize("call, message", [
    (lambda: ts.tokenspeed_mla_decode(**decode_args(cp_world=2, cp_rank=1)),
     "causal_seqs (the requests' global KV lengths, [B] int32) is required when cp_world > 1"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(cp_world=2, cp_rank=1, causal_seqs=np.ones(2, np.int32))),
     "context_parallel.causal_seqs.shape[0] must be 1, got 2"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(cp_world=0)), "cp_world must be an int >= 1, got 0"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(cp_world=2, cp_rank=2)), "cp_rank must be in [0, cp_world=2)"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(kv_lora_rank=256)), "kv_lora_rank must be 512, got 256"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(qk_rope_head_dim=32)), "qk_rope_head_dim must be 64"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(max_seq_len=0)), "max_seq_len must be > 0, got 0"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(workspace_buffer=np.zeros(8, np.float32))),
     "workspace_buffer must be int8 (or uint8) bytes, got float32"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(kv_cache=np.zeros((2, 2, 8, 576), np.uint16))),
     "a 4-D kv_cache must be [num_pages, 1, page_size, 576]"),
    (lambda: ts.tokenspeed_mla_decode(**decode_args(kv_cache=np.zeros((2, 8, 576), np.uint8))),
     "kv_cache must have the dtype of q"),
    (lambda: ts.tokenspeed_mla_prefill(np.zeros((2, 1, 192), np.uint16), np.zeros((2, 1, 192), np.uint16),
                                       np.zeros((2, 1, 128), np.uint16), None, np.array([0, 2], np.int32), 2, 2,
                                       0.1), "cum_seq_lens must have shape [batch_size + 1] = [3], got [2]"),
    (lambda: ts.tokenspeed_mla_prefill(np.zeros((2, 1, 192), np.uint16), np.zeros((2, 1, 192), np.uint16),
                                       np.zeros((2, 1, 128), np.uint16), None, np.array([0, 2], np.int32), -1, 1,
                                       0.1), "max_seq_len must be >= 0, got -1"),
    (lambda: ts.mla_kv_pack_quantize_fp8(np.zeros((1, 1, 128), np.float32), np.zeros((1, 64), np.float32),
                                         np.zeros((1, 1, 128), np.float32), fp8_dtype="float8_e5m2"),
     "float8_e5m2 needs PyTorch tensors"),
    (lambda: ts.mla_kv_pack_quantize_fp8(np.zeros((1, 1, 128), np.float32), np.zeros((1, 64), np.float32),
                                         np.zeros((1, 1, 128), np.float32), fp8_dtype="float16"),
     "fp8_dtype must be float8_e4m3fn or float8_e5m2, got float16"),
    (lambda: ts.warmup_compile_prefill(d_qk=128), "d_qk must be 192"),
    (lambda: ts.warmup_compile_prefill("float16"), "q_dtype must be float8_e4m3fn or bfloat16, got float16"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(num_splits=np.zeros(2, np.int32))),
     "num_splits must be None"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(tile_scheduler_metadata=None)),
     "tile_scheduler_metadata must be the FlashMLASchedMeta"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(indices=np.zeros((1, 1, 64), np.int32))),
     "indices must be None: speedmla implements dense attention only"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(head_dim_v=576)), "head_dim_v must be 512, got 576"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(is_fp8_kvcache=True)),
     "k_cache must be float8_e4m3fn with is_fp8_kvcache=True, got bfloat16"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(k_cache=np.zeros((2, 64, 1, 656), np.uint8),
                                                           is_fp8_kvcache=True)),
     "656-byte sparse FP8 layout is not supported"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(k_cache=np.zeros((2, 64, 3, 576), np.uint16))),
     "h_q = 2) must be a multiple of k_cache.shape[2] (h_k = 3)"),
    (lambda: flash_mla.flash_mla_with_kvcache(**flash_args(block_table=None)), "block_table and cache_seqlens"),
])
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(speedmla.Error) as info:
        call()
    assert message in str(info.value), str(info.value)


def test_the_flashmla_test_runner_rewrites_only_the_import_line():
    import run_flashmla_test as runner

    source = "import torch\n\nimport kernelkit as kk\nimport flash_mla\n\nx = flash_mla.get_mla_metadata()\n"
    rewritten = runner.rewrite(source)
    assert rewritten == source.replace("import flash_mla\n", "import speedmla.compat.flash_mla as flash_mla\n")
    for bad in ("import torch\n", "import flash_mla\nimport flash_mla\n"):
        with pytest.raises(SystemExit, match="exactly one line 'import flash_mla'"):
            runner.rewrite(bad)
