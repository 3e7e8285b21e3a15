"""The drop-in APIs on a CUDA device (the GPU machine runs these): the seed's decode with FP8 and
BF16 caches, pages 32 and 64, q_len 1-4, with and without return_lse, causal and not; its
prefill causal and not; mla_kv_pack_quantize_fp8 against its documented formula; FlashMLA's API
with its metadata. Each against the native call it wraps (same bits) and against a float64
reference from the definition, per request, outputs poisoned first. Skipped without PyTorch or
a CUDA device."""

import math

import pytest

import speedmla
from speedmla.compat import flash_mla, tokenspeed_mla as ts
from test_gpu import CUDA_TORCH_MARKS, prefill_reference, rel_l2, torch

pytestmark = CUDA_TORCH_MARKS

# Per request, against float64 (as tests/gpu/decode_test.cpp): output rel. L2 and max |ΔLSE| in
# natural-log units. FP8 rounds probabilities to e4m3; a layout or mask bug costs order 1.
OUT_BOUND = {"bfloat16": 1e-2, "float8_e4m3fn": 6e-2}
LSE_BOUND = {"bfloat16": 2e-3, "float8_e4m3fn": 4e-2}
LOG2_E = 1 / math.log(2)


def paged_problem(g, dtype, batch, q_len, heads, page, lengths, h_k=1):
    """q [B, q_len, H, 576], a cache [pages, page, h_k, 576] with NaN in every unused row, a
    shuffled block table padded with page ids past the cache, and int32 lengths; all on the CPU."""
    torch_dtype = getattr(torch, dtype)
    pages_per = max(1, max(-(-n // page) for n in lengths)) + 1  # one padded column at least
    num_pages = 1 + batch * pages_per
    table = (1 + torch.randperm(batch * pages_per, generator=g)).to(torch.int32).reshape(batch, pages_per)
    values = torch.rand(num_pages, page, h_k, 576, generator=g) * 2 - 1
    used = torch.zeros(num_pages, page, dtype=torch.bool)
    for b, n in enumerate(lengths):
        for j in range(n):
            used[table[b, j // page], j % page] = True
        table[b, -(-n // page):] = 2 ** 31 - 1  # padding is never read (FlashMLA's test does this too)
    values[~used] = float("nan")
    q = (torch.rand(batch, q_len, heads, 576, generator=g) * 2 - 1).to(torch_dtype)
    return q, values.to(torch_dtype), table, torch.tensor(lengths, dtype=torch.int32)


def decode_reference(q, cache, table, lens, scale, causal):
    """float64 decode of one KV head, cache [pages, page, 576]: (out [B, q_len, H, 512], natural-log
    lse [B, q_len, H], -inf where no key)."""
    q, cache = q.cpu().double(), cache.cpu().double()
    batch, q_len, heads, _ = q.shape
    page = cache.shape[1]
    out = torch.zeros(batch, q_len, heads, 512, dtype=torch.float64)
    lse = torch.full((batch, q_len, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        pages = -(-n // page)  # ceil(n / page)
        rows = cache[table[b, :pages].long()].reshape(-1, 576)[:n]
        scores = torch.einsum("thd,kd->thk", q[b], rows) * scale
        visible = torch.arange(n)[None, :] < (torch.arange(q_len)[:, None] + n - (q_len - 1) if causal else n)
        scores = scores.masked_fill(~visible[:, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)
        weights = torch.nan_to_num(torch.exp(scores - row_lse[..., None]), nan=0.0)
        out[b] = torch.einsum("thk,kd->thd", weights, rows[:, :512])
        lse[b] = row_lse
    return out, lse


def check_requests(out, lse, expected, expected_lse, dtype, what):
    """Every request's output rel. L2 and every row's LSE (natural log), -inf rows exactly."""
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.isfinite(out).all(), what + ": output holds NaN/inf (a row left unwritten?)"
    for b in range(out.shape[0]):
        where = f"{what}, request {b}"
        none = torch.isneginf(expected_lse[b])
        assert torch.equal(torch.isneginf(lse[b]), none), where
        assert (out[b][none] == 0).all(), where
        if (~none).any():
            assert rel_l2(out[b][~none], expected[b][~none]) < OUT_BOUND[dtype], where
            assert (lse[b][~none] - expected_lse[b][~none]).abs().max() < LSE_BOUND[dtype], where


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("return_lse", [True, False])
def test_seed_decode(dtype, page, q_len, return_lse):
    g = torch.Generator().manual_seed(100 * q_len + page)
    heads, scale = 16, 0.06
    lengths = [q_len, 77, 600, 2048 + 5, 64 * 5]
    q, cache, table, lens = paged_problem(g, dtype, len(lengths), q_len, heads, page, lengths)
    cache = cache[:, :, 0]
    dq, dcache, dtable, dlens = q.cuda(), cache.cuda(), table.cuda(), lens.cuda()
    # The workspace exactly as the seed's backend sizes it (q_len capacity 8).
    workspace = torch.empty(ts.get_num_sm(dq.device) * heads * 8 * 513 * 4, dtype=torch.int8, device="cuda")
    out = torch.full((len(lengths), q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    result = ts.tokenspeed_mla_decode(query=dq, kv_cache=dcache, workspace_buffer=workspace, kv_lora_rank=512,
                                      qk_rope_head_dim=64, block_tables=dtable, seq_lens=dlens,
                                      max_seq_len=4096, softmax_scale=scale, out=out, enable_pdl=True,
                                      return_lse=return_lse)
    native_out, native_lse = speedmla.mla_decode(dq, dcache, dtable, dlens, softmax_scale=scale, return_lse=True)
    torch.cuda.synchronize()
    if return_lse:
        result, lse = result
        assert lse.shape == (len(lengths), q_len, heads) and lse.dtype == torch.float32
        assert torch.equal(lse, native_lse * LOG2_E)  # base 2, from the same kernel
    assert result is out and torch.equal(out, native_out)
    expected, expected_lse = decode_reference(q, cache, table, lens, scale, causal=True)
    check_requests(out, native_lse, expected, expected_lse, dtype, f"{dtype} page {page} q_len {q_len}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("q_len, heads", [(2, 16), (4, 16), (3, 128)])  # 3 x 128 heads: three calls
def test_seed_decode_without_the_causal_mask(dtype, q_len, heads):
    g = torch.Generator().manual_seed(7 * q_len + heads)
    lengths = [q_len, 130, 1000]
    q, cache, table, lens = paged_problem(g, dtype, len(lengths), q_len, heads, 64, lengths)
    cache = cache[:, :, 0]
    too_small = torch.empty(16, dtype=torch.int8, device="cuda")  # the shim then allocates its own
    out, lse = ts.tokenspeed_mla_decode(q.cuda(), cache.cuda(), too_small, 512, 64, table.cuda(), lens.cuda(),
                                        1000, 0.06, causal_mask=False, return_lse=True)
    torch.cuda.synchronize()
    expected, expected_lse = decode_reference(q, cache, table, lens, 0.06, causal=False)
    check_requests(out, lse / LOG2_E, expected, expected_lse, dtype, f"{dtype} q_len {q_len} H {heads}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("causal", [True, False])
def test_seed_prefill(dtype, causal):
    g = torch.Generator().manual_seed(11)
    heads, scale = 16, 192 ** -0.5
    lengths = [(0, 3), (5, 0), (70, 130), (129, 129), (300, 300)]
    cu_q = torch.tensor([0] + [n for n, _ in lengths]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [n for _, n in lengths]).cumsum(0).to(torch.int32)
    torch_dtype = getattr(torch, dtype)
    q = torch.randn(int(cu_q[-1]), heads, 192, generator=g).to(torch_dtype)
    k = torch.randn(int(cu_k[-1]), heads, 192, generator=g).to(torch_dtype)
    v = torch.randn(int(cu_k[-1]), heads, 128, generator=g).to(torch_dtype)
    out = torch.full((q.shape[0], heads, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    result, lse = ts.tokenspeed_mla_prefill(
        query=q.cuda(), key=k.cuda(), value=v.cuda(), seq_lens=(cu_k[1:] - cu_k[:-1]).cuda(),
        cum_seq_lens=cu_k.cuda(), max_seq_len=300, batch_size=len(lengths), softmax_scale=scale,
        is_causal=causal, return_lse=True, cum_seq_lens_q=cu_q.cuda(), max_seq_len_q=300, enable_pdl=True,
        out=out)
    native, native_lse = speedmla.mla_prefill(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(),
                                              causal=causal, softmax_scale=scale, return_lse=True)
    torch.cuda.synchronize()
    assert result is out and torch.equal(out, native) and torch.equal(lse, native_lse)
    expected, expected_lse = prefill_reference(q, k, v, cu_q, cu_k, causal, scale)
    out_bound, lse_bound = {"bfloat16": (5e-3, 2e-3), "float8_e4m3fn": (6e-2, 4e-2)}[dtype]
    for b in range(len(lengths)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        none = torch.isneginf(expected_lse[rows])
        assert torch.equal(torch.isneginf(lse[rows].cpu()), none), b
        assert (out[rows].cpu()[none] == 0).all(), b
        if (~none).any():
            assert rel_l2(out[rows].cpu()[~none], expected[rows][~none]) <= out_bound, b
            assert (lse[rows].cpu().double()[~none] - expected_lse[rows][~none]).abs().max() <= lse_bound, b


def test_seed_kv_pack_follows_its_formula():
    g = torch.Generator().manual_seed(12)
    k_nope = (torch.randn(300, 16, 128, generator=g) * 200).bfloat16().cuda()
    k_pe = (torch.randn(300, 1, 64, generator=g) * 200).bfloat16().cuda()
    v = (torch.randn(300, 16, 128, generator=g) * 200).bfloat16().cuda()
    packed = torch.cat((k_nope, k_pe.expand(300, 16, 64)), dim=-1).float()
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        k_out = torch.full((300, 16, 192), float("nan"), device="cuda").to(fp8)
        v_out = torch.full((300, 16, 128), float("nan"), device="cuda").to(fp8)
        k, v8 = ts.mla_kv_pack_quantize_fp8(k_nope, k_pe, v, 0.5, 2.0, k_out=k_out, v_out=v_out, fp8_dtype=fp8,
                                            enable_pdl=True)
        assert k is k_out and v8 is v_out
        # The formula: fp8(x × scale), to nearest even; e4m3 saturates to ±448 (values reach ±2000
        # here), e5m2 is PyTorch's conversion.
        bound = 448.0 if fp8 == torch.float8_e4m3fn else math.inf
        assert torch.equal(k.view(torch.uint8), (packed * 0.5).clamp(-bound, bound).to(fp8).view(torch.uint8))
        assert torch.equal(v8.view(torch.uint8), (v.float() * 2.0).clamp(-bound, bound).to(fp8).view(torch.uint8))


def flash_reference(q, cache, table, lens, causal, scale):
    """FlashMLA's conventions from the definition: lse [B, h_q, s_q], +inf where no key."""
    h_q, h_k = q.shape[2], cache.shape[2]
    outs, lses = [], []
    for head_k in range(h_k):
        heads = slice(head_k * (h_q // h_k), (head_k + 1) * (h_q // h_k))
        out, lse = decode_reference(q[:, :, heads], cache[:, :, head_k], table, lens, scale,
                                    causal and q.shape[1] > 1)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


@pytest.mark.parametrize("h_q, h_k", [(16, 1), (128, 1), (64, 2)])
@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_mla_api(h_q, h_k, s_q, causal):
    g = torch.Generator().manual_seed(h_q + s_q)
    lengths = [0, s_q, 300, 4100, 64 * 3]  # a request without keys: out 0, lse +inf
    q, cache, table, lens = paged_problem(g, "bfloat16", len(lengths), s_q, h_q, 64, lengths, h_k=h_k)
    meta, num_splits = flash_mla.get_mla_metadata()
    args = (q.cuda(), cache.cuda(), table.cuda(), lens.cuda(), 512, meta, num_splits)
    out, lse = flash_mla.flash_mla_with_kvcache(*args, causal=causal)
    again, lse_again = flash_mla.flash_mla_with_kvcache(*args, causal=causal)  # the holder reused
    torch.cuda.synchronize()
    assert out.shape == (len(lengths), s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (len(lengths), h_q, s_q) and lse.dtype == torch.float32
    assert torch.equal(again, out) and torch.equal(lse_again, lse)
    assert torch.isposinf(lse[0]).all() and (out[0] == 0).all()
    expected, expected_lse = flash_reference(q, cache, table, lens, causal, 576 ** -0.5)
    lse_by_token = lse.transpose(1, 2).clone()
    lse_by_token[torch.isposinf(lse_by_token)] = -math.inf
    check_requests(out, lse_by_token, expected, expected_lse, "bfloat16", f"h_q {h_q} h_k {h_k} s_q {s_q}")
    if h_k == 1 and (causal or s_q == 1):  # the same call as mla_decode, on the holder's plan
        assert isinstance(meta.tile_scheduler_metadata, speedmla.DecodePlan)
        native, native_lse = speedmla.mla_decode(args[0], args[1][:, :, 0], args[2], args[3],
                                                 softmax_scale=576 ** -0.5, return_lse=True)
        assert torch.equal(out, native)
        assert torch.equal(lse.transpose(1, 2), native_lse.masked_fill(native_lse.isneginf(), math.inf))


@pytest.mark.parametrize("page", [32, 64])
def test_flash_mla_api_with_speedmla_fp8_cache(page):
    g = torch.Generator().manual_seed(page)
    q, cache, table, lens = paged_problem(g, "float8_e4m3fn", 3, 2, 16, page, [2, 500, 1500])
    q = (torch.rand(3, 2, 16, 576, generator=g) * 2 - 1).bfloat16()  # BF16 queries, quantised by the shim
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q.cuda(), cache.cuda(), table.cuda(), lens.cuda(), 512, meta,
                                                softmax_scale=0.05, causal=True, is_fp8_kvcache=True)
    native, native_lse = speedmla.mla_decode(speedmla.quantize_fp8(q.cuda()), cache[:, :, 0].cuda(), table.cuda(),
                                             lens.cuda(), softmax_scale=0.05, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out, native) and torch.equal(lse, native_lse.transpose(1, 2))
    expected, expected_lse = decode_reference(q.to(torch.float8_e4m3fn), cache[:, :, 0], table, lens, 0.05, True)
    check_requests(out, lse.transpose(1, 2), expected, expected_lse, "float8_e4m3fn", f"FP8 page {page}")


def test_bad_arguments_on_the_gpu():
    q = torch.zeros(1, 1, 16, 576, dtype=torch.float8_e4m3fn, device="cuda")
    cache = torch.zeros(2, 64, 576, dtype=torch.float8_e4m3fn, device="cuda")
    table, lens = torch.ones(1, 1, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(speedmla.Error, match="context_parallel.causal_seqs must be on cuda:0, got cpu"):
        ts.tokenspeed_mla_decode(q, cache, None, 512, 64, table, lens, 64, 0.1, causal_seqs=lens.cpu(), cp_world=2,
                                 cp_rank=1, return_lse=True)
    page_6 = torch.zeros(2, 6, 576, dtype=torch.float8_e4m3fn, device="cuda")
    with pytest.raises(speedmla.Error, match="page_size"):
        ts.tokenspeed_mla_decode(q, page_6, None, 512, 64, table, lens, 64, 0.1)
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(speedmla.Error, match="k_cache must be bfloat16"):
        flash_mla.flash_mla_with_kvcache(q.bfloat16(), cache.view(2, 64, 1, 576), table, lens, 512, meta)


def rank_share(g, cache, table, lens, world, rank):
    """Rank `rank`'s own paged cache [pages, page, 576] of every world-th token of each request
    (global tokens rank, rank + world, ...), a shuffled block table and the LOCAL int32 lengths;
    unused rows NaN. All on the CPU."""
    page, batch = cache.shape[1], len(lens)
    local = [len(range(rank, int(n), world)) for n in lens]
    pages_per = max(1, max(-(-n // page) for n in local))
    local_table = (1 + torch.randperm(batch * pages_per, generator=g)).to(torch.int32).reshape(batch, pages_per)
    values = torch.full((1 + batch * pages_per, page, 576), float("nan"))  # float32: exact for FP8 and BF16
    source = cache.float()
    for b, n in enumerate(local):
        k = torch.arange(n)
        glob = rank + k * world
        values[local_table[b, k // page].long(), k % page] = source[table[b, glob // page].long(), glob % page]
    return values.to(cache.dtype), local_table, torch.tensor(local, dtype=torch.int32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_seed_decode_context_parallel(dtype, page, world, q_len):
    """The seed's cp_world / cp_rank / causal_seqs over simulated ranks on one GPU, the ranks'
    partials merged by speedmla.cp.merge_partials, against the float64 single-rank result."""
    g = torch.Generator().manual_seed(1000 * world + 10 * q_len + page)
    heads, scale = 16, 0.06
    lengths = [1, 3, 7, 130, 701, 2048 + 5]  # shorter than every world, than q_len; across pages
    q, cache, table, lens = paged_problem(g, dtype, len(lengths), q_len, heads, page, lengths)
    cache = cache[:, :, 0]
    dq, dlens = q.cuda(), lens.cuda()
    outs, lses = [], []
    for rank in range(world):
        local_cache, local_table, local_lens = rank_share(g, cache, table, lens, world, rank)
        args = (dq, local_cache.cuda(), local_table.cuda(), local_lens.cuda())
        out, lse = ts.tokenspeed_mla_decode(args[0], args[1], None, 512, 64, args[2], args[3], 4096, scale,
                                            return_lse=True, causal_seqs=dlens, cp_world=world, cp_rank=rank)
        native, native_lse = speedmla.mla_decode(*args, softmax_scale=scale, return_lse=True, causal_seqs=dlens,
                                                 cp_world=world, cp_rank=rank)
        torch.cuda.synchronize()
        assert torch.equal(out, native) and torch.equal(lse, native_lse * LOG2_E)  # the same kernel
        outs.append(out)
        lses.append(native_lse)
    merged, merged_lse = speedmla.cp.merge_partials(outs, lses)
    assert merged.dtype == torch.bfloat16 and merged.is_cuda and merged_lse.dtype == torch.float32
    expected, expected_lse = decode_reference(q, cache, table, lens, scale, causal=True)
    check_requests(merged, merged_lse, expected, expected_lse, dtype, f"{dtype} page {page} world {world} q_len {q_len}")
