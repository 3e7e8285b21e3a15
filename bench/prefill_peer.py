#!/usr/bin/env python3
r"""speedmla prefill beside cuDNN attention, in one process, on the same inputs.

For each case of issue 12 (B requests of S tokens, H heads, causal, d_qk 192, d_v 128, normal data
with std 1) the calls are interleaved, each after a 256 MB write that flushes the L2, timed with
CUDA events, median of --iters:
  - speedmla.mla_prefill BF16 and FP8 (the same values rounded to e4m3), ragged q [B*S, H, 192],
    k [B*S, H, 192], v [B*S, H, 128], cu_seqlens int32 on the GPU;
  - cuDNN through PyTorch (SDPBackend.CUDNN_ATTENTION), BF16 q/k/v [B, H, S, D] (views of the
    same tensors), is_causal=True;
  - cuDNN's FP8 attention through nvidia-cudnn-frontend (`sdpa_fp8`, e4m3 in and out, unit
    scales) when the package imports and cuDNN builds a plan for 192/128; otherwise the reason.
Then the three extend shapes of issue 12 end to end through MlaBackend (H=128, FP8 cache, chunk
capacity 8192*4), with the values token-major and in the fp8_transposed layout (the new tokens'
v as the model's pack_prefill_kv would write it, the prefix loops' expand packing into it), and
the same sequence step by step through the public operations, each step timed with CUDA events
(the backend does not expose its steps).

Run from the repository root on the GPU machine, with the build's module and tvm_ffi (which
tests/python/run_gpu.sh installs into build/python-packages from the carried .whl/), and
nvidia-cudnn-frontend from .whl/ too (scripts/download_wheels.sh):
  python3 -m pip install --no-index --find-links .whl --no-deps --target build/peer-packages nvidia-cudnn-frontend
  PYTHONPATH=build/python-packages:.deps/pip:python:build/peer-packages \
  SPEEDMLA_LIBRARY=build/libspeedmla_tvm_ffi.so TVM_FFI_DISABLE_TORCH_C_DLPACK=1 \
    python3 bench/prefill_peer.py [--iters 10] [--rest-ms 500] [--cases 128,4,4096 ...] [--no-extend]
"""

import argparse
import itertools
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import speedmla
from peer_timing import GpuSampler, Timer, normal

QK, VD = 192, 128
SCALE = QK ** -0.5
FP8 = torch.float8_e4m3fn
CASES = [(128, 16, 1024), (128, 4, 4096), (128, 1, 8192), (128, 1, 16384), (128, 1, 32768),
         (16, 4, 4096), (16, 1, 16384)]  # (H, B, S), causal
EXTEND_CASES = [("8K new, no prefix", [(0, 8192)]), ("8K new on a 32K prefix", [(32768, 8192)]),
                ("4 x 1K new on 80K prefixes", [(81920, 1024)] * 4)]  # (prefix, new) per request


def prefill_flops(heads, batch, s_q, s_k, causal):
    pairs = s_q * s_k - s_q * (s_q - 1) / 2 if causal else s_q * s_k
    return 2.0 * heads * (QK + VD) * pairs * batch


def cudnn_fp8_call(q8, k8, v8):
    """A callable running cuDNN's FP8 attention (frontend graph sdpa_fp8) on [B, H, S, D] e4m3
    views, or a string saying why there is none."""
    try:
        import cudnn
    except ImportError as error:
        return f"nvidia-cudnn-frontend not importable ({error})"
    try:
        b, h, s, _ = q8.shape
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3,
                              intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)
        one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device="cuda")
        t_q, t_k, t_v = (graph.tensor_like(t) for t in (q8, k8, v8))
        units = {name: graph.tensor_like(one) for name in
                 ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
        arguments = dict(q=t_q, k=t_k, v=t_v, attn_scale=SCALE, use_causal_mask=True, name="mla_fp8", **units)
        try:
            outputs = graph.sdpa_fp8(generate_stats=False, **arguments)
        except TypeError:  # frontends before generate_stats name it is_inference
            outputs = graph.sdpa_fp8(is_inference=True, **arguments)
        t_o, t_amax_s, t_amax_o = outputs[0], outputs[2], outputs[3]
        o = torch.empty(b, s, h, VD, dtype=FP8, device="cuda").transpose(1, 2)
        amax_s, amax_o = torch.empty_like(one), torch.empty_like(one)
        t_o.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride()))
        for t in (t_amax_s, t_amax_o):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        pack = {t_q: q8, t_k: k8, t_v: v8, t_o: o, t_amax_s: amax_s, t_amax_o: amax_o}
        pack.update({t: one for t in units.values()})
        return lambda: graph.execute(pack, workspace)
    except Exception as error:  # cuDNN has no plan for these shapes, or the API differs
        return f"cuDNN FP8 graph not built: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def fmt(result, flops):
    if isinstance(result, Exception):
        return f"{'failed':>8} {'':>7}"
    return f"{result:8.3f} {flops / result / 1e9:7.1f}"


def fp8_transposed_values(v8):
    """v8 [T, H, 128] FP8 (T a multiple of 16) in speedmla's fp8_transposed layout [H, 128, T]:
    position 4k + 2a + b of each 16-token group holds token 8a + 2k + b (speedmla/prefill.h)."""
    tokens, heads, dims = v8.shape
    token_of = torch.tensor([8 * ((p // 2) % 2) + 2 * (p // 4) + p % 2 for p in range(16)], device=v8.device)
    groups = v8.view(torch.uint8).view(tokens // 16, 16, heads, dims)[:, token_of]
    return groups.permute(2, 3, 0, 1).reshape(heads, dims, tokens).contiguous().view(FP8)


def prefill_cases(args, timer, generator):
    print(f"\nprefill, causal, d_qk {QK}, d_v {VD}: ms and TFLOP/s (median of {args.iters}, L2 flushed, interleaved)")
    print(f"{'H':>3} {'B':>3} {'S':>6} | {'speedmla bf16':>16} | {'speedmla fp8':>16} | {'fp8, v transposed':>17} | "
          f"{'cuDNN bf16':>16} | {'cuDNN fp8':>16} | {'bf16/cuDNN':>10} {'fp8 speedup':>11} {'fp8t speedup':>12} | "
          f"agree | GPU")
    failures = 0
    for heads, batch, s in CASES:
        if args.cases and f"{heads},{batch},{s}" not in args.cases:
            continue
        time.sleep(args.rest_ms / 1000)
        tokens = batch * s
        q = normal((tokens, heads, QK), torch.bfloat16, generator)
        k = normal((tokens, heads, QK), torch.bfloat16, generator)
        v = normal((tokens, heads, VD), torch.bfloat16, generator)
        q8, k8, v8 = q.to(FP8), k.to(FP8), v.to(FP8)
        vt8 = fp8_transposed_values(v8)
        cu = torch.arange(0, tokens + 1, s, dtype=torch.int32, device="cuda")
        out = torch.empty(tokens, heads, VD, dtype=torch.bfloat16, device="cuda")
        out8 = torch.empty_like(out)
        out8t = torch.empty_like(out)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device="cuda")
        # cuDNN's [B, H, S, D] layout as views of the same tensors (the layout a model's projection
        # gives; cuDNN takes the strides).
        bhsd = [t.view(batch, s, heads, -1).transpose(1, 2) for t in (q, k, v)]
        bhsd8 = [t.view(batch, s, heads, -1).transpose(1, 2) for t in (q8, k8, v8)]
        cudnn_out = {}

        def cudnn_bf16():
            cudnn_out["o"] = F.scaled_dot_product_attention(*bhsd, is_causal=True, scale=SCALE)

        fns = {
            "bf16": lambda: speedmla.mla_prefill(q, k, v, cu, cu, causal=True, softmax_scale=SCALE, out=out, lse=lse),
            "fp8": lambda: speedmla.mla_prefill(q8, k8, v8, cu, cu, causal=True, softmax_scale=SCALE, out=out8, lse=lse),
            "fp8t": lambda: speedmla.mla_prefill(q8, k8, vt8, cu, cu, causal=True, softmax_scale=SCALE, out=out8t,
                                                 lse=lse, v_layout="fp8_transposed"),
            "cudnn": cudnn_bf16,
        }
        fp8_peer = cudnn_fp8_call(*bhsd8) if not args.no_cudnn_fp8 else "--no-cudnn-fp8"
        if callable(fp8_peer):
            fns["cudnn_fp8"] = fp8_peer
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), GpuSampler() as sampler:
            r = timer.interleaved(fns, args.iters)
        flops = prefill_flops(heads, batch, s, s, True)
        ratio = speedup = speedup_t = agree = "-"
        if not isinstance(r["cudnn"], Exception):
            if not isinstance(r["bf16"], Exception):
                ratio = f"{r['bf16'] / r['cudnn']:.3f}"
                ref = cudnn_out["o"].transpose(1, 2).reshape(tokens, heads, VD).float()
                agree = f"{((out.float() - ref).norm() / ref.norm()).item():.1e}"
            if not isinstance(r["fp8"], Exception):
                speedup = f"{r['cudnn'] / r['fp8']:.2f}x"
            if not isinstance(r["fp8t"], Exception):
                speedup_t = f"{r['cudnn'] / r['fp8t']:.2f}x"
        fp8_text = fmt(r["cudnn_fp8"], flops) if "cudnn_fp8" in r else f"{'n/a':>16}"
        if not isinstance(r["fp8"], Exception) and not isinstance(r["fp8t"], Exception):
            # The two FP8 paths sum the same products in blocks cut at other tokens: close, not equal.
            agree += f", fp8t~fp8 {((out8t.float() - out8.float()).norm() / out8.float().norm()).item():.1e}"
        print(f"{heads:3d} {batch:3d} {s:6d} | {fmt(r['bf16'], flops)} | {fmt(r['fp8'], flops)} | "
              f"{fmt(r['fp8t'], flops):>17} | {fmt(r['cudnn'], flops)} | {fp8_text} | {ratio:>10} {speedup:>11} "
              f"{speedup_t:>12} | {agree} | {sampler.summary()}")
        for name, result in r.items():
            if isinstance(result, Exception):
                print(f"    {name}: {type(result).__name__}: {result}")
                failures += name in ("bf16", "fp8", "fp8t")
        if not callable(fp8_peer):
            print(f"    cuDNN FP8: {fp8_peer}")
        sys.stdout.flush()
        del q, k, v, q8, k8, v8, vt8, out, out8, out8t, lse, bhsd, bhsd8, cudnn_out, fns
        torch.cuda.empty_cache()
    return failures


class ExtendBatch:
    """An extend batch on a paged FP8 cache: each request's prefix in the cache (its pages spread
    over the pool), its new tokens' q, k and v, the model's kv_b_proj weights."""

    HEADS, PAGE, CAPACITY = 128, 64, 8192 * 4

    def __init__(self, requests, generator, v_layout="token_major"):
        h, page = self.HEADS, self.PAGE
        self.v_layout = v_layout
        self.n = len(requests)
        prefix, new = [p for p, _ in requests], [x for _, x in requests]
        pages = [math.ceil((p + x) / page) for p, x in requests]
        width = max(pages)
        order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(1)) + 1  # page 0: null
        self.req_to_page = torch.zeros(self.n, width, dtype=torch.int32)
        start = 0
        for r, count in enumerate(pages):
            self.req_to_page[r, :count] = order[start:start + count].to(torch.int32)
            start += count
        self.req_to_page = self.req_to_page.cuda()
        self.cache = torch.empty(1 + sum(pages), page, 576, dtype=FP8, device="cuda")
        for i in range(self.cache.shape[0]):  # page by page: no full-size float32 temporary
            self.cache[i] = normal((page, 576), FP8, generator)
        total_new = sum(new)
        self.q = normal((total_new, h, QK), FP8, generator)
        self.k = normal((total_new, h, QK), FP8, generator)
        self.v = normal((total_new, h, VD), FP8, generator)
        if v_layout == "fp8_transposed":  # as the model's pack_prefill_kv would write it
            padded = torch.zeros(speedmla.value_shape(total_new, 1, v_layout)[2], h, VD, dtype=FP8, device="cuda")
            padded[:total_new] = self.v
            self.v = fp8_transposed_values(padded)
        self.cu = torch.tensor([0] + new, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        self.w_kv = normal((512, h * (128 + VD)), torch.bfloat16, generator) * (512 ** -0.5)
        self.backend = speedmla.MlaBackend(speedmla.MlaBackendConfig(
            num_heads=h, page_size=page, kv_cache_dtype="float8_e4m3fn", context_len=width * page,
            max_batch=self.n, device="cuda", chunked_prefill_capacity=self.CAPACITY))
        self.backend.init_forward_metadata(
            self.n, self.n, torch.arange(self.n, device="cuda"),
            torch.tensor([p + x for p, x in requests], dtype=torch.int32, device="cuda"), "extend",
            self.req_to_page, extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=new)
        md = self.backend.chunked_prefill_metadata
        rows = max(md.max_loop_tokens, 1)
        self.kv_rows = torch.empty(rows, h * (128 + VD), dtype=torch.bfloat16, device="cuda")
        self.latent = torch.empty(rows, 576, dtype=torch.bfloat16, device="cuda")
        self.k_loop = torch.empty(rows, h, QK, dtype=FP8, device="cuda")
        self.v_loop = torch.empty(speedmla.value_shape(rows, h, v_layout), dtype=FP8, device="cuda")
        self.out = torch.empty(total_new, h, VD, dtype=torch.bfloat16, device="cuda")
        self.lse = torch.empty(total_new, h, dtype=torch.float32, device="cuda")
        self.part_out, self.part_lse = torch.empty_like(self.out), torch.empty_like(self.lse)
        self.flops = sum(prefill_flops(h, 1, x, x, True) + prefill_flops(h, 1, x, p, False) for p, x in requests)

    def up_project(self, latent, n):
        """The model's kv_b_proj: the latent rows times W, as [n, H, 256] (k_nope ‖ v per head)."""
        torch.matmul(latent[:, :512], self.w_kv, out=self.kv_rows[:n])
        return self.kv_rows[:n].view(n, self.HEADS, 128 + VD)

    def pack(self, kv, latent, k, v):
        speedmla.pack_prefill_kv(kv[..., :128], latent[:, 512:], kv[..., 128:], k_out=k, v_out=v,
                                 v_layout=self.v_layout)

    def expand(self, latent, k, v):
        self.pack(self.up_project(latent, latent.shape[0]), latent, k, v)

    def through_backend(self):
        out, lse = self.backend.forward_extend_chunked(self.q, self.k, self.v, SCALE, None, cum_seq_lens_q=self.cu,
                                                       cum_seq_lens_kv=self.cu, causal=True, out=self.out,
                                                       v_layout=self.v_layout)
        self.backend.attend_cached_prefix(self.q, self.cache, self.expand, out, lse, SCALE, v_layout=self.v_layout)

    def by_steps(self, timer):
        """The same sequence through the public operations, {step: ms} timed with CUDA events."""
        md = self.backend.chunked_prefill_metadata
        spent = {step: 0.0 for step in ("self-pass", "gather", "expand (kv_b_proj)", "pack", "prefix passes", "merges")}
        events = []

        def step(name, fn):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            events.append((name, begin, end))

        # The sleep lets Python queue the first steps before the GPU reaches them; after that the GPU
        # trails the queue, so no event pair times a launch.
        torch.cuda._sleep(1_000_000)
        timer.flush.fill_(0)
        step("self-pass", lambda: speedmla.mla_prefill(self.q, self.k, self.v, self.cu, self.cu, causal=True,
                                                       softmax_scale=SCALE, out=self.out, lse=self.lse,
                                                       v_layout=self.v_layout))
        for slots, cu_k in zip(md.chunk_kv_indices_list, md.cu_chunked_seq_len):
            n = slots.shape[0]
            latent, k = self.latent[:n], self.k_loop[:n]
            v = self.v_loop[..., :speedmla.value_shape(n, 1, self.v_layout)[2]] if self.v_layout == "fp8_transposed" \
                else self.v_loop[:n]
            step("gather", lambda: speedmla.gather_cache(self.cache, slots, out=latent))
            kv = [None]
            step("expand (kv_b_proj)", lambda: kv.__setitem__(0, self.up_project(latent, n)))
            step("pack", lambda: self.pack(kv[0], latent, k, v))
            step("prefix passes", lambda: speedmla.mla_prefill(self.q, k, v, self.cu, cu_k, causal=False,
                                                               softmax_scale=SCALE, out=self.part_out,
                                                               lse=self.part_lse, v_layout=self.v_layout))
            step("merges", lambda: speedmla.merge_attn_states(self.out, self.lse, self.part_out, self.part_lse,
                                                              out=self.out, lse=self.lse))
        torch.cuda.synchronize()
        for name, begin, end in events:
            spent[name] += begin.elapsed_time(end)
        return spent


def extend_cases(args, timer, generator):
    print("\nextend through MlaBackend (H=128, FP8 cache, capacity 8192*4): forward_extend_chunked + "
          f"attend_cached_prefix, median of {args.iters}; then the same steps through the public operations")
    failures = 0
    for (name, requests), v_layout in itertools.product(EXTEND_CASES, ("token_major", "fp8_transposed")):
        name = f"{name}, v {v_layout}"
        time.sleep(args.rest_ms / 1000)
        try:
            batch = ExtendBatch(requests, generator, v_layout)
            with GpuSampler() as sampler:
                total = timer.interleaved({"backend": batch.through_backend}, args.iters)["backend"]
                if isinstance(total, Exception):
                    raise total
                runs = []
                for _ in range(args.iters):
                    runs.append(batch.by_steps(timer))
        except Exception as error:
            print(f"{name}: {type(error).__name__}: {error}")
            failures += 1
            continue
        loops = batch.backend.chunked_prefill_metadata.chunked_loop_num
        steps = {s: statistics.median(run[s] for run in runs) for s in runs[0]}
        step_sum = sum(steps.values())
        print(f"{name}: {loops} prefix loop(s), end to end {total:.3f} ms "
              f"({batch.flops / total / 1e9:.0f} attention TFLOP/s) | {sampler.summary()}")
        print("    " + ", ".join(f"{s} {ms:.3f} ms ({100 * ms / step_sum:.0f} %)" for s, ms in steps.items())
              + f"; sum of steps {step_sum:.3f} ms")
        sys.stdout.flush()
        del batch
        torch.cuda.empty_cache()
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rest-ms", type=int, default=0, help="idle time before each case")
    parser.add_argument("--cases", nargs="*", help="only these H,B,S prefill cases, e.g. 128,4,4096")
    parser.add_argument("--no-extend", action="store_true", help="skip the extend shapes")
    parser.add_argument("--no-cudnn-fp8", action="store_true", help="skip cuDNN's FP8 attention")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("prefill_peer.py: no CUDA device")
        return 0
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    timer, generator = Timer(), torch.Generator(device="cuda").manual_seed(2026)
    failures = prefill_cases(args, timer, generator)
    if not args.no_extend:
        failures += extend_cases(args, timer, generator)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
