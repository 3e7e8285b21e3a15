"""speedmla.MlaBackend on the CPU with NumPy: metadata, a decode step (BF16 and FP8 caches,
with the KV write), CUDA-graph bookkeeping, a chunked prefill over several prefix loops against
one-shot attention, and configuration errors."""

from types import SimpleNamespace

import numpy as np
import pytest

import numpy_reference as ref
import speedmla


def config(**changes):
    values = dict(num_heads=8, tp_size=2, page_size=16, kv_cache_dtype="bfloat16", context_len=64,
                  max_batch=4, max_graph_batch=4)
    values.update(changes)
    return speedmla.MlaBackendConfig(**values)


# Pool row p owns pages 1 + 4p .. 4 + 4p (page 0 stays the null page).
REQ_TO_PAGE = (np.arange(12, dtype=np.int32).reshape(3, 4) + 1)


def test_decode_metadata_block_table():
    backend = speedmla.MlaBackend(config())
    assert backend.block_table_width == 8  # 4 pages rounded up to a multiple of 128 / 16
    seq_lens = np.array([20, 64], np.int32)
    backend.init_forward_metadata(2, 0, np.array([2, 0], np.int64), seq_lens, "decode", REQ_TO_PAGE)
    md = backend.forward_decode_metadata
    assert md.num_extends == 0 and md.max_seq_len_k == 64
    np.testing.assert_array_equal(md.block_kv_indices, [[9, 10, 11, 12, 0, 0, 0, 0],
                                                        [1, 2, 3, 4, 0, 0, 0, 0]])
    assert np.shares_memory(md.seq_lens_k, seq_lens)
    assert backend.forward_prefill_metadata is None


class EngineMode:
    """An engine's forward mode (TokenSpeed/SGLang style)."""

    def __init__(self, extend_or_mixed, mixed):
        self._extend_or_mixed, self._mixed = extend_or_mixed, mixed

    def is_extend_or_mixed(self):
        return self._extend_or_mixed

    def is_mixed(self):
        return self._mixed


def test_mixed_batch_metadata_and_override():
    backend = speedmla.MlaBackend(config())
    seq_lens = np.array([30, 17, 40], np.int32)
    backend.init_forward_metadata(3, 1, np.array([1, 0, 2], np.int32), seq_lens, EngineMode(True, True),
                                  REQ_TO_PAGE, extend_prefix_lens_cpu=[18], extend_seq_lens_cpu=[12])
    assert backend.forward_decode_metadata.num_extends == 1
    prefill = backend.forward_prefill_metadata
    np.testing.assert_array_equal(prefill.cum_seq_lens, [0, 30])
    chunked = backend.chunked_prefill_metadata
    np.testing.assert_array_equal(chunked.cum_extend_seq_lens, [0, 12])
    assert chunked.chunked_loop_num == 1 and chunked.max_extend_seq_len == 12
    # Pool row 1 owns pages 5, 6: slots of prefix positions 0..17.
    np.testing.assert_array_equal(chunked.chunk_kv_indices_list[0],
                                  [5 * 16 + p for p in range(16)] + [6 * 16, 6 * 16 + 1])
    with backend.override_num_extends(0):
        assert backend.forward_decode_metadata.num_extends == 0
    assert backend.forward_decode_metadata.num_extends == 1


def layer(heads, scaling, k_scale=None):
    return SimpleNamespace(layer_id=0, tp_q_head_num=heads, scaling=scaling, k_scale_float=k_scale)


class Pool:
    """The engine's KV pool: one flat [slots, 1, 576] buffer per layer."""

    def __init__(self, cache):
        self.cache = cache

    def get_key_buffer(self, layer_id):
        assert layer_id == 0
        return self.cache


def test_decode_step_bf16_cache(rng):
    backend = speedmla.MlaBackend(config())
    heads, bs = 4, 2
    cache = ref.bf16_bits(rng.uniform(-1, 1, (13 * 16, 1, 576)))
    seq_lens = np.array([20, 33], np.int32)
    pool = np.array([2, 0], np.int64)
    backend.init_forward_metadata(bs, 0, pool, seq_lens, speedmla.ForwardMode.DECODE, REQ_TO_PAGE)
    q = ref.bf16_bits(rng.uniform(-1, 1, (bs, heads * 576)))
    out = backend.forward_decode(q, None, None, layer(heads, 0.07), None, Pool(cache), bs,
                                 save_kv_cache=False)
    assert out.shape == (bs, heads * 512) and out.dtype == np.uint16
    pages = ref.bf16_values(cache.reshape(13, 16, 576))
    expected, _ = ref.decode(ref.bf16_values(q).reshape(bs, 1, heads, 576), pages,
                             REQ_TO_PAGE[pool], seq_lens, 0.07)
    np.testing.assert_allclose(ref.bf16_values(out).reshape(bs, 1, heads, 512), expected,
                               rtol=1e-2, atol=2e-3)


def test_verify_step_fp8_cache_writes_new_kv(rng):
    backend = speedmla.MlaBackend(config(kv_cache_dtype="fp8_e4m3", num_draft_tokens=2))
    heads, bs, q_len, k_scale = 4, 2, 2, 0.5
    cache = ref.fp8_codes(rng.uniform(-1, 1, (13, 16, 576)))
    seq_lens = np.array([18, 40], np.int32)
    pool = np.array([0, 1], np.int64)
    backend.init_forward_metadata(bs, 0, pool, seq_lens, "decode", REQ_TO_PAGE)
    q = ref.bf16_bits(rng.uniform(-1, 1, (bs * q_len, heads, 576)))
    k = ref.bf16_bits(rng.uniform(-1, 1, (bs * q_len, 1, 576)))
    # The new tokens are the last q_len positions of each request.
    slots = np.array([REQ_TO_PAGE[0, 16 // 16] * 16 + 0, REQ_TO_PAGE[0, 17 // 16] * 16 + 1,
                      REQ_TO_PAGE[1, 38 // 16] * 16 + 6, REQ_TO_PAGE[1, 39 // 16] * 16 + 7], np.int64)
    out = backend.forward_decode(q, k, None, layer(heads, 0.06, k_scale), slots, cache, bs)
    flat = cache.reshape(-1, 576)
    written = ref.fp8_values(ref.fp8_codes(ref.bf16_values(k[:, 0]) / k_scale))
    np.testing.assert_array_equal(ref.fp8_values(flat[slots]), written)
    # Reference: the FP8 query, the dequantised cache (× k_scale) and the scaling.
    q8 = ref.fp8_values(ref.fp8_codes(ref.bf16_values(q))).reshape(bs, q_len, heads, 576)
    expected, _ = ref.decode(q8, ref.fp8_values(cache) * k_scale, REQ_TO_PAGE[pool], seq_lens, 0.06)
    np.testing.assert_allclose(ref.bf16_values(out).reshape(bs, q_len, heads, 512), expected,
                               rtol=2e-2, atol=5e-3)


def test_graph_capture_and_replay_bookkeeping():
    backend = speedmla.MlaBackend(config())
    seq_lens_buf = np.ones(4, np.int32)
    backend.init_cuda_graph_state(4, seq_lens_buf)
    for bs in (1, 2, 4):
        backend.init_forward_metadata_capture_cuda_graph(bs, None, None, "decode")
        assert not backend.forward_decode_metadata.block_kv_indices.any()
    backend.init_forward_metadata_replay_cuda_graph(2, np.array([1, 2], np.int64), None, None,
                                                    REQ_TO_PAGE, num_real=1)
    md = backend.forward_decode_metadata
    assert md is backend.decode_cuda_graph_metadata[2]
    np.testing.assert_array_equal(md.block_kv_indices[:, :4], [[5, 6, 7, 8], [0, 0, 0, 0]])
    assert np.shares_memory(md.seq_lens_k, seq_lens_buf)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    with pytest.raises(speedmla.Error, match="no graph was captured for batch size 3"):
        backend.init_forward_metadata_replay_cuda_graph(3, np.zeros(3, np.int64), None, None, REQ_TO_PAGE)
    with pytest.raises(speedmla.Error, match="CUDA graphs cover decode and verify only"):
        backend.init_forward_metadata_capture_cuda_graph(1, None, None, EngineMode(True, False))


def test_draft_aliases_target_block_table():
    target = speedmla.MlaBackend(config())
    draft = speedmla.MlaBackend(config(is_draft=True))
    target.init_cuda_graph_state(2, np.ones(2, np.int32))
    draft.init_cuda_graph_state(2, np.ones(2, np.int32))
    draft.alias_cuda_graph_block_table(target)
    target.init_forward_metadata_capture_cuda_graph(2)
    draft.init_forward_metadata_capture_cuda_graph(2)
    target.init_forward_metadata_replay_cuda_graph(2, np.array([2, 1]), None, None, REQ_TO_PAGE)
    draft.init_forward_metadata_replay_cuda_graph(2, np.array([0, 0]), None, None, REQ_TO_PAGE)
    np.testing.assert_array_equal(draft.forward_decode_metadata.block_kv_indices[:, :4],
                                  [[9, 10, 11, 12], [5, 6, 7, 8]])


def expand_numpy(w_k, w_v):
    """The model's kv_b_proj stand-in on bit arrays: latent [n, 576] -> k [n, H, 192], v."""

    def expand(latent, k, v):
        x = ref.bf16_values(latent)
        k[..., :128] = ref.bf16_bits(np.einsum("nd,hde->nhe", x[:, :512], w_k))
        k[..., 128:] = latent[:, None, 512:]
        v[...] = ref.bf16_bits(np.einsum("nd,hde->nhe", x[:, :512], w_v))

    return expand


class ChunkedPrefixBatch:
    """Three extend requests with cached prefixes in scattered pages of a BF16 cache (NaN where no
    prefix lives), a backend whose chunked-prefill capacity makes request 0 take 8 loops, and the
    model's kv_b_proj stand-in weights."""

    heads, page = 2, 16
    prefix, fresh = [23, 4, 0], [3, 6, 2]  # chunk = 10 // 3 = 3: request 0 needs 8 loops

    def __init__(self, rng):
        heads, page, n = self.heads, self.page, len(self.prefix)
        self.backend = speedmla.MlaBackend(config(num_heads=heads, tp_size=1, page_size=page,
                                                  context_len=200, chunked_prefill_capacity=10))
        self.req_to_page = np.zeros((4, 13), np.int32)
        page_ids = rng.permutation(np.arange(1, 13))  # scattered pages
        rtp = self.req_to_page
        rtp[1, :2], rtp[3, :1], rtp[0, :1] = page_ids[:2], page_ids[2:3], page_ids[3:4]
        self.pool = np.array([1, 3, 0], np.int64)
        self.cache = np.full((13 * page, 1, 576), 0xFFFF, np.uint16)
        self.w_k = rng.uniform(-0.05, 0.05, (heads, 512, 128))
        self.w_v = rng.uniform(-0.5, 0.5, (heads, 512, 128))
        self.latents = [ref.bf16_bits(rng.uniform(-1, 1, (p + f, 576))) for p, f in zip(self.prefix, self.fresh)]
        for b in range(n):
            for pos in range(self.prefix[b]):
                self.cache[rtp[self.pool[b], pos // page] * page + pos % page, 0] = self.latents[b][pos]
        self.cu_q = np.concatenate([[0], np.cumsum(self.fresh)]).astype(np.int32)

    def init_metadata(self):
        n = len(self.prefix)
        self.backend.init_forward_metadata(n, n, self.pool, np.add(self.prefix, self.fresh).astype(np.int32), "extend",
                                           self.req_to_page, extend_prefix_lens_cpu=self.prefix,
                                           extend_seq_lens_cpu=self.fresh)
        assert self.backend.chunked_prefill_metadata.chunked_loop_num == 8


def test_chunked_prefill_over_several_loops_equals_one_shot(rng):
    batch = ChunkedPrefixBatch(rng)
    heads, prefix, fresh, latents = batch.heads, batch.prefix, batch.fresh, batch.latents
    expand = expand_numpy(batch.w_k, batch.w_v)

    def expanded(rows):
        k = np.zeros((len(rows), heads, 192), np.uint16)
        v = np.zeros((len(rows), heads, 128), np.uint16)
        expand(rows, k, v)
        return k, v

    q = ref.bf16_bits(rng.uniform(-1, 1, (sum(fresh), heads, 192)))
    cu_q = batch.cu_q
    self_k, self_v = expanded(np.concatenate([lat[p:] for lat, p in zip(latents, prefix)]))
    all_k, all_v = expanded(np.concatenate(latents))
    cu_all = np.concatenate([[0], np.cumsum(np.add(prefix, fresh))]).astype(np.int32)

    batch.init_metadata()
    out, lse = batch.backend.forward_extend_chunked(q, self_k, self_v, 0.08, None, cum_seq_lens_q=cu_q,
                                                    cum_seq_lens_kv=cu_q, causal=True)
    batch.backend.attend_cached_prefix(q, batch.cache, expand, out, lse, 0.08)

    expected, expected_lse = ref.prefill(ref.bf16_values(q), ref.bf16_values(all_k),
                                         ref.bf16_values(all_v), cu_q, cu_all, True, 0.08)
    np.testing.assert_allclose(ref.bf16_values(out), expected, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)


def test_attend_cached_prefix_takes_fp8_transposed_values(rng):
    """The FP8 prefix loops with the expander packing v token-major or in the fp8_transposed
    layout (pack_prefill_kv's v_layout): the same bits."""
    batch = ChunkedPrefixBatch(rng)

    def expand_fp8(layout):
        def expand(latent, k, v):
            x = ref.bf16_values(latent)
            k_nope = np.einsum("nd,hde->nhe", x[:, :512], batch.w_k).astype(np.float32)
            values = np.einsum("nd,hde->nhe", x[:, :512], batch.w_v).astype(np.float32)
            speedmla.pack_prefill_kv(k_nope, x[:, 512:].astype(np.float32), values, k_out=k, v_out=v,
                                     v_layout=layout)
        return expand

    q = speedmla.quantize_fp8(rng.uniform(-2, 2, (sum(batch.fresh), batch.heads, 192)).astype(np.float32))
    results = []
    for layout in ("token_major", "fp8_transposed"):
        batch.init_metadata()
        out = np.zeros((sum(batch.fresh), batch.heads, 128), np.uint16)
        lse = np.full((sum(batch.fresh), batch.heads), -np.inf, np.float32)  # nothing attended yet
        batch.backend.attend_cached_prefix(q, batch.cache, expand_fp8(layout), out, lse, 0.08, v_layout=layout)
        results.append((out, lse))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])
    assert np.isfinite(results[0][1]).any()  # the prefixes were attended


def test_forward_extend_chunked_takes_fp8_transposed_values(rng):
    heads = 2
    backend = speedmla.MlaBackend(config(num_heads=heads, tp_size=1))
    cu = np.array([0, 7, 7, 30], np.int32)
    k_nope = rng.uniform(-2, 2, (30, heads, 128)).astype(np.float32)
    k_rope = rng.uniform(-2, 2, (30, 64)).astype(np.float32)
    v = rng.uniform(-2, 2, (30, heads, 128)).astype(np.float32)
    k, v_plain = speedmla.pack_prefill_kv(k_nope, k_rope, v)
    _, v_t = speedmla.pack_prefill_kv(k_nope, k_rope, v, v_layout="fp8_transposed")
    q = speedmla.quantize_fp8(rng.uniform(-2, 2, (30, heads, 192)).astype(np.float32))
    out, lse = backend.forward_extend_chunked(q, k, v_plain, 0.1, None, cum_seq_lens_q=cu, cum_seq_lens_kv=cu,
                                              causal=True)
    out_t, lse_t = backend.forward_extend_chunked(q, k, v_t, 0.1, None, cum_seq_lens_q=cu, cum_seq_lens_kv=cu,
                                                  causal=True, v_layout="fp8_transposed")
    assert np.array_equal(out, out_t) and np.array_equal(lse, lse_t)


@pytest.mark.parametrize("changes, message", [
    (dict(tp_size=3), "must be a multiple of config.tp_size"),
    (dict(num_heads=256, tp_size=1), "heads per rank"),
    (dict(page_size=48), "config.page_size must be one the decode kernels support"),
    (dict(kv_cache_dtype="float16"), "kv_cache_dtype must be float8_e4m3fn or bfloat16"),
    (dict(seed_compatible=True), "config.seed_compatible requires page_size 32 or 64"),
    (dict(seed_compatible=True, page_size=64), "config.seed_compatible requires a float8_e4m3fn"),
    (dict(context_len=0), "config.context_len"),
    (dict(max_batch=0), "config.max_batch must be >= 1"),
    (dict(device="tpu"), "device must be cpu or cuda"),
])
def test_bad_configs_are_rejected_at_construction(changes, message):
    with pytest.raises(speedmla.Error) as info:
        speedmla.MlaBackend(config(**changes))
    assert message in str(info.value), str(info.value)


def test_bad_calls_raise_clear_errors():
    backend = speedmla.MlaBackend(config())
    with pytest.raises(speedmla.Error, match="forward_mode must be"):
        backend.init_forward_metadata(1, 0, np.zeros(1, np.int64), np.ones(1, np.int32), "prefill",
                                      REQ_TO_PAGE)
    with pytest.raises(speedmla.Error, match="needs extend_prefix_lens_cpu"):
        backend.init_forward_metadata(1, 1, np.zeros(1, np.int64), np.ones(1, np.int32), "extend",
                                      REQ_TO_PAGE)
    with pytest.raises(speedmla.Error, match="seq_lens must be int32"):
        backend.init_forward_metadata(1, 0, np.zeros(1, np.int64), np.ones(1, np.int64), "decode",
                                      REQ_TO_PAGE)
    with pytest.raises(speedmla.Error, match="there is no decode metadata"):
        backend.forward_decode(np.zeros((1, 4, 576), np.uint16), None, None, layer(4, 0.1), None,
                               np.zeros((13 * 16, 1, 576), np.uint16), 1, save_kv_cache=False)
    with pytest.raises(speedmla.Error, match="logits_soft_cap is not supported"):
        backend.forward_extend_chunked(None, None, None, 0.1, 30.0, cum_seq_lens_q=None,
                                       cum_seq_lens_kv=None, causal=True)
