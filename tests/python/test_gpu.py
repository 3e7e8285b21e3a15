"""speedmla with PyTorch on a CUDA device: operations against their CPU path, decode plans
reused across layers (and the batch-invariant plan), a decode step through the backend against
the CPU backend (the reference), a torch.cuda.graph captured once
and replayed with three different batches, mla_prefill against a float64 reference, the
chunked prefill through the backend against its CPU path, and broken CUDA calls refused with a
clear error. Skipped without PyTorch or a CUDA device."""

from types import SimpleNamespace

import pytest

import speedmla

try:
    import torch
except ImportError:
    torch = None

# The marks of every module that needs PyTorch with a CUDA device (test_compat_gpu.py too).
CUDA_TORCH_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                       reason="needs PyTorch with a CUDA device"),
]
pytestmark = CUDA_TORCH_MARKS

# Output bounds against the CPU reference (as the C++ decode tests): FP8 probabilities are
# rounded to e4m3 inside the kernel; a layout or masking bug gives errors of order 1.
BOUND = {"bfloat16": 1e-2, "float8_e4m3fn": 6e-2}
PAGE, HEADS, POOL = 16, 4, 4


def rel_l2(actual, expected):
    actual, expected = actual.float().cpu(), expected.float().cpu()
    return ((actual - expected).norm() / expected.norm()).item()


def config(device, **changes):
    values = dict(num_heads=HEADS * 2, tp_size=2, page_size=PAGE, kv_cache_dtype="float8_e4m3fn",
                  context_len=64, max_batch=4, max_graph_batch=4, num_draft_tokens=2, device=device)
    values.update(changes)
    return speedmla.MlaBackendConfig(**values)


def req_to_page(device):
    """Pool row p owns pages 1 + 4p .. 4 + 4p; page 0 is the null page."""
    return (torch.arange(POOL * 4, dtype=torch.int32) + 1).reshape(POOL, 4).to(device)


def random_cache(dtype, generator):
    values = torch.rand((1 + 4 * POOL) * PAGE, 1, 576, generator=generator) * 2 - 1
    return values.to(getattr(torch, dtype))


def layer(k_scale=None):
    return SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, scaling=0.05, k_scale_float=k_scale)


def new_token_slots(pool, seq_lens, q_len):
    """Cache slots of the last q_len positions of every request."""
    table = req_to_page("cpu")
    slots = [int(table[p, pos // PAGE]) * PAGE + pos % PAGE
             for p, n in zip(pool.tolist(), seq_lens.tolist()) for pos in range(n - q_len, n)]
    return torch.tensor(slots, dtype=torch.int64)


def test_operations_match_their_cpu_path():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=g) * 100
    assert torch.equal(speedmla.quantize_fp8(x.cuda(), scale_inv=0.5).cpu().view(torch.uint8),
                       speedmla.quantize_fp8(x, scale_inv=0.5).view(torch.uint8))
    cache = random_cache("float8_e4m3fn", g).view(-1, PAGE, 576)
    slots = torch.tensor([3, -1, 40, 77], dtype=torch.int64)
    assert torch.equal(speedmla.gather_cache(cache.cuda(), slots.cuda(), scale=2.0).cpu(),
                       speedmla.gather_cache(cache, slots, scale=2.0))
    latent, rope = torch.randn(4, 512, generator=g), torch.randn(4, 64, generator=g)
    gpu_cache = cache.cuda()
    speedmla.kv_cache_write(gpu_cache, slots.cuda(), latent.cuda(), rope.cuda(), scale_inv=0.5)
    speedmla.kv_cache_write(cache, slots, latent, rope, scale_inv=0.5)
    assert torch.equal(gpu_cache.cpu().view(torch.uint8), cache.view(torch.uint8))
    out_a, out_b = torch.randn(2, 8, 3, 128, generator=g)
    lse_a, lse_b = torch.randn(2, 8, 3, generator=g)
    gpu = speedmla.merge_attn_states(out_a.cuda(), lse_a.cuda(), out_b.cuda(), lse_b.cuda())
    cpu = speedmla.merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("page", [1, 64])
def test_one_plan_serves_every_layer_with_mla_decodes_bits(dtype, page):
    g = torch.Generator().manual_seed(7)
    batch, q_len, heads, max_pages = 5, 2, 16, 4096 // page
    seq_lens = torch.tensor([4096, 1, 700, 3000, 64], dtype=torch.int32).cuda()
    block_table = (torch.randperm(batch * max_pages, generator=g).to(torch.int32) + 1).view(batch, max_pages).cuda()
    cache = (torch.rand(batch * max_pages + 1, page, 576, generator=g) * 2 - 1).to(getattr(torch, dtype)).cuda()
    plan = speedmla.mla_decode_plan(seq_lens, block_table, num_heads=heads, q_len=q_len, dtype=dtype,
                                    page_size=page)
    for layer_index in range(3):
        q = (torch.rand(batch, q_len, heads, 576, generator=g) * 2 - 1).to(getattr(torch, dtype)).cuda()
        out = torch.full((batch, q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((batch, q_len, heads), float("nan"), device="cuda")
        speedmla.mla_decode_with_plan(plan, q, cache, block_table, seq_lens, softmax_scale=0.05, out=out, lse=lse)
        expected, expected_lse = speedmla.mla_decode(q, cache, block_table, seq_lens, softmax_scale=0.05,
                                                     return_lse=True)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), layer_index
        assert torch.equal(lse, expected_lse), layer_index
        reference, _ = speedmla.mla_decode(q.cpu(), cache.cpu(), block_table.cpu(), seq_lens.cpu(),
                                           softmax_scale=0.05, return_lse=True)
        assert rel_l2(out, reference) < BOUND[dtype]


def test_a_batch_invariant_plan_gives_a_request_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(8)
    heads, q_len, page, max_pages = 16, 1, 64, 256
    cache = (torch.rand(1 + 8 * max_pages, page, 576, generator=g) * 2 - 1).to(torch.bfloat16).cuda()
    table = (torch.arange(8 * max_pages, dtype=torch.int32) + 1).view(8, max_pages).cuda()
    q = (torch.rand(8, q_len, heads, 576, generator=g) * 2 - 1).to(torch.bfloat16).cuda()
    outputs = []
    for lens in ([16000, 20, 9000, 1, 300, 16384, 5000, 64], [16000, 16384, 16384, 16384, 1, 1, 1, 1]):
        seq_lens = torch.tensor(lens, dtype=torch.int32).cuda()
        plan = speedmla.mla_decode_plan(seq_lens, table, num_heads=heads, q_len=q_len, dtype="bfloat16",
                                        page_size=page, invariant_split_tokens=4096)
        outputs.append(speedmla.mla_decode_with_plan(plan, q, cache, table, seq_lens, softmax_scale=0.05))
    # Request 0 has the same query, pages and length in both batches; the rest of the batch differs.
    assert torch.equal(outputs[0][0].view(torch.int16), outputs[1][0].view(torch.int16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_decode_step_through_the_backend_equals_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    bs, q_len = 3, 2
    pool = torch.tensor([2, 0, 3], dtype=torch.int64)
    seq_lens = torch.tensor([33, 2, 64], dtype=torch.int32)
    q = (torch.rand(bs * q_len, HEADS * 576, generator=g) * 2 - 1).bfloat16()
    k = (torch.rand(bs * q_len, 1, 576, generator=g) * 2 - 1).bfloat16()
    slots = new_token_slots(pool, seq_lens, q_len)
    results, caches = {}, {}
    for device in ("cpu", "cuda"):
        backend = speedmla.MlaBackend(config(device, kv_cache_dtype=dtype))
        cache = random_cache(dtype, torch.Generator().manual_seed(3)).to(device)
        seq = seq_lens.to(device)
        backend.init_forward_metadata(bs, 0, pool.to(device), seq, "decode", req_to_page(device))
        md = backend.forward_decode_metadata
        assert md.block_kv_indices.device.type == device and md.block_kv_indices.dtype == torch.int32
        stream = torch.cuda.Stream() if device == "cuda" else None
        with torch.cuda.stream(stream):  # any current stream is honoured
            results[device] = backend.forward_decode(q.to(device), k.to(device), None, layer(0.75),
                                                     slots.to(device), SimpleNamespace(
                                                         get_key_buffer=lambda _, c=cache: c), bs)
        torch.cuda.synchronize()
        caches[device] = cache.cpu()
    assert torch.equal(caches["cuda"].view(torch.uint8), caches["cpu"].view(torch.uint8))
    assert results["cuda"].shape == (bs * q_len, HEADS * 512)
    assert rel_l2(results["cuda"], results["cpu"]) < BOUND[dtype]


def test_cuda_graph_captured_once_replays_three_batches():
    g = torch.Generator().manual_seed(4)
    graph_bs, q_len, dtype = 4, 2, "float8_e4m3fn"
    backend = speedmla.MlaBackend(config("cuda"))
    reference = speedmla.MlaBackend(config("cpu"))
    cache = random_cache(dtype, g)
    gpu_cache = cache.cuda()
    table = req_to_page("cuda")
    # The engine's static buffers.
    seq_lens_buf = torch.ones(graph_bs, dtype=torch.int32, device="cuda")
    pool_buf = torch.zeros(graph_bs, dtype=torch.int64, device="cuda")
    q_buf = torch.zeros(graph_bs * q_len, HEADS, 576, dtype=torch.bfloat16, device="cuda")
    k_buf = torch.zeros(graph_bs * q_len, 1, 576, dtype=torch.bfloat16, device="cuda")
    slots_buf = torch.full((graph_bs * q_len,), -1, dtype=torch.int64, device="cuda")

    backend.init_cuda_graph_state(graph_bs, seq_lens_buf)
    backend.init_forward_metadata_capture_cuda_graph(graph_bs, pool_buf, seq_lens_buf, "decode")

    def step():
        return backend.forward_decode(q_buf, k_buf, None, layer(), slots_buf, gpu_cache, graph_bs)

    side = torch.cuda.Stream()  # warm up outside capture, as torch.cuda.graph recommends
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    batches = [([3, 1], [64, 17]), ([0, 2, 1, 3], [2, 40, 63, 8]), ([2, 1, 0], [16, 33, 5])]
    for pool, lens in batches:
        real = len(pool)
        pool_t, lens_t = torch.tensor(pool), torch.tensor(lens, dtype=torch.int32)
        q = (torch.rand(real * q_len, HEADS, 576, generator=g) * 2 - 1).bfloat16()
        k = (torch.rand(real * q_len, 1, 576, generator=g) * 2 - 1).bfloat16()
        slots = new_token_slots(pool_t, lens_t, q_len)
        # The engine fills the static buffers; padded rows: one key on the null page, no write.
        seq_lens_buf.fill_(backend.get_cuda_graph_seq_len_fill_value())
        seq_lens_buf[:real] = lens_t.cuda()
        pool_buf.zero_()
        pool_buf[:real] = pool_t.cuda()
        q_buf.zero_()
        q_buf[:real * q_len] = q.cuda()
        k_buf[:real * q_len] = k.cuda()
        slots_buf.fill_(-1)
        slots_buf[:real * q_len] = slots.cuda()
        backend.init_forward_metadata_replay_cuda_graph(graph_bs, pool_buf, seq_lens_buf, None, table,
                                                        num_real=real)
        graph.replay()
        torch.cuda.synchronize()

        reference.init_forward_metadata(real, 0, pool_t, lens_t, "decode", req_to_page("cpu"))
        expected = reference.forward_decode(q, k, None, layer(), slots, cache, real)
        assert torch.equal(gpu_cache.cpu().view(torch.uint8), cache.view(torch.uint8))
        assert rel_l2(out[:real * q_len], expected) < BOUND[dtype]
        assert torch.isfinite(out[real * q_len:].float()).all()


# mla_prefill bounds per request against a float64 reference (as tests/gpu/prefill_test.cpp):
# BF16 rounds P and the output to BF16; FP8 rounds P to e4m3 (2-3e-2 expected). A wrong mask,
# head or row costs far more (rel. L2 0.2 to 1.4).
PREFILL_BOUND = {"bfloat16": (5e-3, 2e-3), "float8_e4m3fn": (6e-2, 4e-2)}  # (out rel L2, lse max abs)


def prefill_reference(q, k, v, cu_q, cu_k, causal, scale):
    """Ragged attention in float64 on the CPU, straight from the definition (contract §4.2)."""
    q, k, v = (t.cpu().double() for t in (q, k, v))
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], heads, 128, dtype=torch.float64)
    lse = torch.full((q.shape[0], heads), float("-inf"), dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0 or len_k == 0:
            continue
        keys = k[k0:k1].repeat_interleave(group, dim=1)
        values = v[k0:k1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], keys) * scale
        if causal:  # bottom-right: query i sees key j iff j <= i + len_k - len_q
            hidden = torch.arange(len_k)[None, :] > torch.arange(len_q)[:, None] + (len_k - len_q)
            scores = scores.masked_fill(hidden, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        weights = torch.nan_to_num(torch.exp(scores - row_lse[..., None]), nan=0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", weights, values)
        lse[q0:q1] = row_lse.T
    return out, lse


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [16, 1])
def test_mla_prefill_on_cuda_matches_a_float64_reference(dtype, causal, kv_heads):
    g = torch.Generator().manual_seed(6)
    heads, scale = 16, 192 ** -0.5
    lengths = [(0, 3), (5, 0), (1, 1), (70, 130), (130, 70), (65, 65), (129, 129), (300, 300), (0, 0)]
    cu_q = torch.tensor([0] + [q for q, _ in lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    torch_dtype = getattr(torch, dtype)  # normal data, rounded to the dtype; the reference reads it
    q = torch.randn(int(cu_q[-1]), heads, 192, generator=g).to(torch_dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, 192, generator=g).to(torch_dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, 128, generator=g).to(torch_dtype)
    out, lse = speedmla.mla_prefill(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), causal=causal,
                                    softmax_scale=scale, return_lse=True)
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    expected_out, expected_lse = prefill_reference(q, k, v, cu_q, cu_k, causal, scale)
    out, lse = out.cpu().double(), lse.cpu().double()
    out_bound, lse_bound = PREFILL_BOUND[dtype]
    for b, (len_q, len_k) in enumerate(lengths):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        where = f"request {b} (len_q {len_q}, len_k {len_k})"
        no_key = torch.isneginf(expected_lse[rows])
        assert torch.equal(torch.isneginf(lse[rows]), no_key), where
        assert torch.all(out[rows][no_key] == 0), where + ": rows without keys must be exactly 0"
        assert torch.isfinite(out[rows]).all() and not torch.isnan(lse[rows]).any(), where
        if (~no_key).any():
            assert rel_l2(out[rows], expected_out[rows]) <= out_bound, where
            assert (lse[rows][~no_key] - expected_lse[rows][~no_key]).abs().max() <= lse_bound, where


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_chunked_prefill_on_the_gpu_equals_the_cpu_path(dtype):
    g = torch.Generator().manual_seed(5)
    torch_dtype = getattr(torch, dtype)
    heads, prefix, fresh = 2, [23, 4, 0], [3, 6, 2]
    table = torch.zeros(4, 13, dtype=torch.int32)
    table[1, :2], table[3, 0], table[0, 0] = torch.tensor([7, 3]), 9, 5
    pool = torch.tensor([1, 3, 0])
    cache = (torch.rand(13 * PAGE, 1, 576, generator=g) * 2 - 1).to(torch_dtype)
    w_k = torch.rand(heads, 512, 128, generator=g) * 0.1 - 0.05
    w_v = torch.rand(heads, 512, 128, generator=g) - 0.5
    q = (torch.rand(sum(fresh), heads, 192, generator=g) * 2 - 1).to(torch_dtype)
    self_k = (torch.rand(sum(fresh), heads, 192, generator=g) * 2 - 1).bfloat16()
    self_v = (torch.rand(sum(fresh), heads, 128, generator=g) * 2 - 1).bfloat16()
    cu_q = torch.tensor([0, 3, 9, 11], dtype=torch.int32)

    def expand(latent, k, v):  # the model's kv_b_proj; k and v in q's dtype
        x = latent[:, :512].float()
        k[..., :128] = torch.einsum("nd,hde->nhe", x, w_k.to(x.device)).to(k.dtype)
        k[..., 128:] = latent[:, None, 512:].to(k.dtype)
        v[...] = torch.einsum("nd,hde->nhe", x, w_v.to(x.device)).to(v.dtype)

    results = {}
    for device in ("cpu", "cuda"):
        backend = speedmla.MlaBackend(config(device, num_heads=heads, tp_size=1, kv_cache_dtype=dtype,
                                             context_len=200, chunked_prefill_capacity=10))
        backend.init_forward_metadata(3, 3, pool.to(device), torch.tensor([26, 10, 2], dtype=torch.int32,
                                                                          device=device),
                                      "extend", table.to(device), extend_prefix_lens_cpu=prefix,
                                      extend_seq_lens_cpu=fresh)
        out, lse = backend.forward_extend_chunked(
            q.to(device), self_k.to(device), self_v.to(device), 0.08, None,
            cum_seq_lens_q=cu_q.to(device), cum_seq_lens_kv=cu_q.to(device), causal=True)
        backend.attend_cached_prefix(q.to(device), cache.to(device), expand, out, lse, 0.08)
        results[device] = (out.cpu(), lse.cpu())
    # The CPU path computes in FP64 from the same inputs: the GPU's error is the kernels' (FP8 P
    # rounding) plus one BF16 rounding of the running output per merge.
    out_bound, lse_bound = {"bfloat16": (2e-2, 1e-3), "float8_e4m3fn": (8e-2, 4e-2)}[dtype]
    assert rel_l2(results["cuda"][0], results["cpu"][0]) < out_bound
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], rtol=lse_bound, atol=lse_bound)


@pytest.mark.parametrize("break_call, message", [
    # A CPU tensor among CUDA ones, and the reverse: refused before anything is read.
    (lambda a: a.update(block_table=a["block_table"].cpu()), "mla_decode: block_table must be on cuda"),
    (lambda a: a.update(q=a["q"].cpu(), out=None), "mla_decode: kv_cache must be on cpu"),
    # Types PyTorch has and the operations do not take, or not an array at all.
    (lambda a: a.update(seq_lens=a["seq_lens"].double()), "mla_decode: seq_lens"),
    (lambda a: a.update(seq_lens=a["seq_lens"].tolist()), "mla_decode: seq_lens must be a torch.Tensor"),
    # Layouts the kernels cannot take.
    (lambda a: a.update(q=torch.cat([a["q"], a["q"]], dim=-1)[..., ::2]),
     "mla_decode: q must be contiguous in its last dimension"),
    (lambda a: a.update(kv_cache=a["kv_cache"][:, :12]), "mla_decode: kv_cache.shape[1] (page_size) must be"),
    (lambda a: a.update(softmax_scale=float("nan")), "mla_decode: softmax_scale must be finite"),
])
def test_bad_cuda_calls_raise_clear_errors(break_call, message):
    """Deterministic breakages of a valid CUDA decode call: each raises speedmla.Error naming the
    operation and the argument, and leaves the device usable (a valid call runs after it)."""
    generator = torch.Generator().manual_seed(5)
    args = dict(q=torch.rand(2, 1, HEADS, 576, generator=generator).to("cuda", torch.bfloat16),
                kv_cache=random_cache("bfloat16", generator).reshape(-1, PAGE, 576).to("cuda"),
                block_table=req_to_page("cuda")[:2],
                seq_lens=torch.tensor([5, 40], dtype=torch.int32, device="cuda"), softmax_scale=0.05, out=None)
    break_call(args)
    with pytest.raises(speedmla.Error) as info:
        speedmla.mla_decode(args.pop("q"), args.pop("kv_cache"), args.pop("block_table"), args.pop("seq_lens"),
                            **args)
    assert message in str(info.value), str(info.value)
    q = torch.zeros(1, 1, HEADS, 576, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(2, PAGE, 576, dtype=torch.bfloat16, device="cuda")
    out = speedmla.mla_decode(q, cache, torch.ones(1, 1, dtype=torch.int32, device="cuda"),
                              torch.ones(1, dtype=torch.int32, device="cuda"), softmax_scale=0.05)
    torch.cuda.synchronize()
    assert out.abs().sum().item() == 0
