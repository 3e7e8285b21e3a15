"""speedmla.torch_ops: the operations as torch.library custom ops.

On the CPU (marker `torch`, skipped without PyTorch >= 2.4): torch.library.opcheck of every
operator (schema, declared mutation, fake implementation against the real outputs' shapes,
dtypes and strides, also with dynamic shapes), and a decode step compiled with
torch.compile(fullgraph=True) equal to the eager step. On a CUDA device (marker `gpu`): the same
step compiled by Inductor against the eager step and the CPU reference, and the compiled step
captured once in a CUDA graph and replayed with three batches of other lengths and pages.

CI has no PyTorch (PyPI's Linux wheels bring the CUDA libraries, gigabytes); these run on the
GPU machine, whose Python has it (tests/python/run_gpu.sh, scripts/gpu-check.sh)."""

import pytest

try:
    import torch
    import speedmla.torch_ops  # noqa: F401  (registers torch.ops.speedmla)
except ImportError:  # no PyTorch, or one without torch.library.custom_op
    torch = None

pytestmark = [pytest.mark.torch,
              pytest.mark.skipif(torch is None, reason="needs PyTorch >= 2.4")]
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                reason="needs PyTorch with a CUDA device")

PAGE, PAGES_PER_REQUEST, HEADS, SCALE = 16, 4, 8, 0.04
# Decode bounds against the CPU reference: output rel. L2 as tests/python/test_gpu.py, LSE max
# abs. as tests/gpu/decode_test.cpp.
BOUND = {torch.bfloat16: 1e-2, torch.float8_e4m3fn: 6e-2} if torch else {}
LSE_BOUND = {torch.bfloat16: 2e-3, torch.float8_e4m3fn: 4e-2} if torch else {}


def rel_l2(actual, expected):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).norm() / expected.norm()).item()


class DecodeProblem:
    """A paged cache with random rows, random lengths and pages, and a step's new tokens: the
    last q_len positions of each request (their cache rows are written by the step)."""

    def __init__(self, gen, dtype, batch=3, q_len=2, heads=HEADS, lengths=None):
        pages = batch * PAGES_PER_REQUEST
        self.kv_cache = (torch.rand(1 + pages, PAGE, 576, generator=gen) * 2 - 1).to(dtype)
        # Page 0 is the null page; each request owns PAGES_PER_REQUEST shuffled pages.
        self.block_table = (1 + torch.randperm(pages, generator=gen)).to(torch.int32)
        self.block_table = self.block_table.reshape(batch, PAGES_PER_REQUEST)
        if lengths is None:
            lengths = torch.randint(q_len, PAGE * PAGES_PER_REQUEST + 1, (batch,), generator=gen)
        self.seq_lens = torch.as_tensor(lengths, dtype=torch.int32)
        self.slots = torch.tensor(
            [int(self.block_table[b, pos // PAGE]) * PAGE + pos % PAGE
             for b, n in enumerate(self.seq_lens.tolist()) for pos in range(n - q_len, n)],
            dtype=torch.int64)
        self.q_nope = torch.randn(batch, q_len, heads, 512, generator=gen).bfloat16()
        self.q_rope = torch.randn(batch, q_len, heads, 64, generator=gen).bfloat16()
        self.latent = torch.randn(batch * q_len, 512, generator=gen).bfloat16()
        self.rope = torch.randn(batch * q_len, 64, generator=gen).bfloat16()

    def args(self, device):
        """The step's arguments on `device`; the cache is a fresh copy (the step writes it)."""
        return [t.to(device, copy=True) for t in (self.q_nope, self.q_rope, self.latent, self.rope,
                                                  self.kv_cache, self.slots, self.block_table,
                                                  self.seq_lens)]


def decode_step(q_nope, q_rope, latent, rope, kv_cache, slots, block_table, seq_lens):
    """What an engine's attention layer does in a decode step, through torch.ops.speedmla."""
    q = torch.cat([q_nope, q_rope], dim=-1)
    if kv_cache.dtype == torch.float8_e4m3fn:
        q = torch.ops.speedmla.quantize_fp8(q, 1.0)
    torch.ops.speedmla.kv_cache_write(kv_cache, slots, latent, rope, 1.0)
    out, lse = torch.ops.speedmla.mla_decode(q, kv_cache, block_table, seq_lens, SCALE, 1.0)
    return out.float() * 0.5, lse


def assert_same_step(actual, expected, actual_cache, expected_cache):
    """Bit-identical outputs, LSE and cache (the kernels are deterministic: no atomics)."""
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert torch.equal(actual_cache.view(torch.uint8), expected_cache.view(torch.uint8))


# ---- CPU -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_opcheck_every_operator(dtype, device):
    gen = torch.Generator().manual_seed(11)
    dtype = getattr(torch, dtype)
    p = DecodeProblem(gen, dtype)
    ops = torch.ops.speedmla
    q = torch.cat([p.q_nope, p.q_rope], dim=-1).to(dtype)
    t, heads = 9, 4
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    k_nope, v = torch.randn(2, t, heads, 128, generator=gen).bfloat16()
    k_rope = torch.randn(t, 64, generator=gen).bfloat16()
    k, v_packed = ops.pack_prefill_kv(k_nope, k_rope, v, dtype)
    out_a, out_b = torch.randn(2, t, heads, 128, generator=gen)
    lse_a, lse_b = torch.randn(2, t, heads, generator=gen)
    cases = [
        (ops.mla_decode, (q, p.kv_cache, p.block_table, p.seq_lens, SCALE, 0.5)),
        (ops.kv_cache_write, (p.kv_cache.clone(), p.slots, p.latent, p.rope, 0.5)),
        (ops.gather_cache, (p.kv_cache, p.slots, 2.0)),
        (ops.quantize_fp8, (p.latent, 0.5)),
        (ops.pack_prefill_kv, (k_nope, k_rope, v, dtype, 0.5, 2.0)),
        (ops.mla_prefill, (torch.randn(t, heads, 192, generator=gen).to(dtype), k, v_packed, cu, cu,
                           True, 0.07, 1.0)),
        (ops.merge_attn_states, (out_a, lse_a, out_b, lse_b)),
    ]
    # test_schema compares inputs before and after to find undeclared mutations, with arithmetic
    # PyTorch lacks for float8 tensors; the schema does not depend on the dtype, so BF16 checks
    # it for every operator and FP8 runs the other checks.
    checks = {} if dtype == torch.bfloat16 else {"test_utils": (
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")}
    for op, args in cases:
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(op, args, **checks)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_compiled_decode_step_on_the_cpu_equals_eager(dtype):
    # aot_eager: Dynamo and AOTAutograd with the fake implementations, without code generation
    # (Inductor's C++ build of the CPU step takes about a minute; the CUDA test runs Inductor).
    # fullgraph=True fails on any graph break.
    torch._dynamo.reset()
    step = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    p = DecodeProblem(torch.Generator().manual_seed(12), getattr(torch, dtype))
    compiled_args, eager_args = p.args("cpu"), p.args("cpu")
    assert_same_step(step(*compiled_args), decode_step(*eager_args), compiled_args[4], eager_args[4])
    assert not torch.equal(compiled_args[4].view(torch.uint8), p.kv_cache.view(torch.uint8)), \
        "the step must have written the new tokens' rows"


def test_fake_implementations_give_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    with FakeTensorMode():
        q = torch.empty(5, 3, 16, 576, dtype=torch.float8_e4m3fn, device="cuda"
                        if torch.cuda.is_available() else "cpu")
        cache = torch.empty(10, 64, 576, dtype=torch.float8_e4m3fn, device=q.device)
        table = torch.empty(5, 7, dtype=torch.int32, device=q.device)
        out, lse = torch.ops.speedmla.mla_decode(q, cache, table, table[:, 0], 0.1, 1.0)
        assert out.shape == (5, 3, 16, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (5, 3, 16) and lse.dtype == torch.float32 and lse.device == q.device


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_inductor_compiled_decode_step_on_cuda(dtype):
    torch._dynamo.reset()
    step = torch.compile(decode_step, fullgraph=True)
    dtype = getattr(torch, dtype)
    p = DecodeProblem(torch.Generator().manual_seed(13), dtype, batch=4, q_len=3, heads=16)
    compiled_args, eager_args, cpu_args = p.args("cuda"), p.args("cuda"), p.args("cpu")
    compiled = step(*compiled_args)
    eager = decode_step(*eager_args)
    torch.cuda.synchronize()
    assert_same_step(compiled, eager, compiled_args[4], eager_args[4])
    reference = decode_step(*cpu_args)  # the CPU reference through the same operators
    assert torch.equal(compiled_args[4].cpu().view(torch.uint8), cpu_args[4].view(torch.uint8))
    assert rel_l2(compiled[0], reference[0]) < BOUND[dtype]
    assert (compiled[1].cpu() - reference[1]).abs().max().item() < LSE_BOUND[dtype]


@pytest.mark.gpu
@needs_cuda
def test_compiled_decode_step_captured_in_a_cuda_graph_replays_new_batches():
    torch._dynamo.reset()
    step = torch.compile(decode_step, fullgraph=True)
    gen = torch.Generator().manual_seed(14)
    dtype, batch, q_len = torch.float8_e4m3fn, 4, 2
    # The engine's static buffers, captured once; every replay sees new contents. The cache
    # keeps its pages across steps, as an engine's does.
    static = DecodeProblem(gen, dtype, batch=batch, q_len=q_len).args("cuda")
    side = torch.cuda.Stream()  # warm up (compile) outside capture, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(*static)

    for lengths in ([64, 2, 17, 40], [3, 33, 64, 16], [2, 2, 2, 63]):
        p = DecodeProblem(gen, dtype, batch=batch, q_len=q_len, lengths=lengths)
        fresh = p.args("cuda")
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        expected_args = p.args("cuda")
        out.fill_(float("nan"))  # poison: the replay must write every element
        lse.fill_(float("nan"))
        graph.replay()
        expected = decode_step(*expected_args)
        torch.cuda.synchronize()
        assert_same_step((out, lse), expected, static[4], expected_args[4])
        reference = decode_step(*p.args("cpu"))
        assert rel_l2(out, reference[0]) < BOUND[dtype], lengths
