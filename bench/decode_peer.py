#!/usr/bin/env python3
r"""speedmla decode beside FlashMLA, in one process, on the same inputs (issue 13, item 1).

Every cell of performance.md's decode grid (B = 128; s_k 4K, 8K, 16K, 32K; H 16, 32, 64, 128;
q_len 1 and 2), the seed's long-context shape (q_len 4, s_k 81920; B 4 and 16; H 16 and 32) and
few long requests at H 128 (B 1 at s_k 131072 q_len 1, B 2 at 65536 q_len 2: every piece of a
split request ends at about the same time, so the combine has nothing to overlap).
The cache holds normal values (std 1) in pages of 64 drawn at random from one pool of ~4.8 GB
(far larger than the L2), the queries too; the calls are interleaved, each after a 256 MB write
that flushes the L2, timed with CUDA events, median of --iters:
  - FlashMLA 9241ae3 (BF16, page 64), its metadata holder filled by the warm-up calls and reused,
    as an engine reuses it for every layer of a decode step;
  - speedmla.mla_decode BF16 on the same cache, page 64, and on the same memory viewed as pages
    of 32 (each page-64 id p becomes 2p, 2p + 1: the same bytes in the same places);
  - speedmla.mla_decode FP8 on the same values rounded to e4m3, page 64.
speedmla gets preallocated out, lse and workspace, as an engine passes them. Its plan is made
once per cell (mla_decode_plan) and reused by every timed call (mla_decode_with_plan), as an
engine makes it once per decode step for all its layers and as FlashMLA's metadata is reused;
one more column times mla_decode with its planner inside the call (BF16, page 64).
--rest-ms N leaves the GPU idle N ms before each cell (a rested grid); 0 (the default) runs the
cells back to back, as a server runs its layers. The SM clock, power and throttle reasons are
sampled while each cell runs. One check first: speedmla BF16 against FlashMLA on a small case.

--sustained S times each implementation alone, its calls back to back (after a quarter of the
window to warm up), each after an L2 flush and timed by its own events, with no pause for the
host: the board then sits at its power limit, as under a server's sustained load, and the SM
clock and instantaneous power are sampled per implementation. Two windows of S/2 seconds each,
the implementations in one order then the other; the cells run back to back (with --rest-ms,
rested before each). Energy a call = median power × median time.

--fixed-costs (issue 13 item 4) replaces the timing by a kernel trace (torch.profiler, CUPTI's
kernel records) of --iters calls per cell: for speedmla on its reused plan and for FlashMLA, how
long the call runs past the end of its attention kernel (the combine's share of the call), and
the planner kernel's own time (mla_decode_plan; FlashMLA's metadata kernel does not run in a
timed call). The kernels run as they do in a call: the combine is a programmatic dependent of
the main kernel, so it is timed from the main kernel's end to its own.

Run from the repository root on the GPU machine, after building the peer
(../shared/peers/README.md: build-peer/flashmla.tgz is what prepare.sh assembled, compressed):
  tar xzf build-peer/flashmla.tgz -C build-peer && bash build-peer/flashmla/build.sh
  PYTHONPATH=build/python-packages:.deps/pip:python:build-peer/flashmla \
  SPEEDMLA_LIBRARY=build/libspeedmla_tvm_ffi.so TVM_FFI_DISABLE_TORCH_C_DLPACK=1 \
    python3 bench/decode_peer.py [--iters 20] [--rest-ms 0] [--quick] [--fixed-costs | --sustained S]
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import flash_mla
import speedmla
from peer_timing import GpuSampler, Timer, normal

ROW, LATENT = 576, 512
PAGE = 64
FP8 = torch.float8_e4m3fn
SCALE = 192 ** -0.5  # DeepSeek's softmax scale (qk_nope 128 + rope 64)
GRID = [(128, s_k, h, q_len) for s_k in (4096, 8192, 16384, 32768) for h in (16, 32, 64, 128) for q_len in (1, 2)]
SEED_SHAPE = [(b, 81920, h, 4) for b in (4, 16) for h in (16, 32)]  # (B, s_k, H, q_len)
FEW_LONG = [(1, 131072, 128, 1), (2, 65536, 128, 2)]


def decode_flops(batch, s_k, heads, q_len):
    return 2.0 * q_len * batch * s_k * heads * (ROW + LATENT)


def decode_bytes(batch, s_k, heads, q_len, elem):
    return batch * s_k * ROW * elem + batch * q_len * heads * (ROW * elem + LATENT * 2)


class Pool:
    """One pool of BF16 cache pages and its FP8 copy (the same values rounded), shared by all cells."""

    def __init__(self, tokens, generator):
        self.pages = tokens // PAGE + 1  # page 0 is the null page
        self.bf16 = torch.empty((self.pages, PAGE, ROW), dtype=torch.bfloat16, device="cuda")
        for start in range(0, self.pages, 4096):  # filled in slices: no float32 copy of the pool at once
            part = self.bf16[start:start + 4096]
            part.copy_(normal(part.shape, torch.bfloat16, generator))
        self.fp8 = self.bf16.to(FP8)

    def table(self, batch, s_k, generator):
        """[B, s_k / 64] int32 page ids drawn at random from the whole pool (page 0 excluded)."""
        blocks = s_k // PAGE
        ids = torch.randperm(self.pages - 1, generator=generator, device="cuda")[:batch * blocks] + 1
        return ids.to(torch.int32).view(batch, blocks)


class Cell:
    """One grid cell's inputs, FlashMLA's metadata holder and speedmla's plans (made once, reused
    by every call), and the calls to time by name."""

    def __init__(self, pool, batch, s_k, heads, q_len, generator):
        table = pool.table(batch, s_k, generator)
        table32 = torch.stack((2 * table, 2 * table + 1), dim=-1).view(batch, -1)
        seq_lens = torch.full((batch,), s_k, dtype=torch.int32, device="cuda")
        q = normal((batch, q_len, heads, ROW), torch.bfloat16, generator)
        q8 = q.to(FP8)
        cache64 = pool.bf16.view(pool.pages, PAGE, 1, ROW)  # FlashMLA's [pages, page, kv heads, 576]
        cache32 = pool.bf16.view(2 * pool.pages, PAGE // 2, ROW)
        out = torch.empty((batch, q_len, heads, LATENT), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty((batch, q_len, heads), dtype=torch.float32, device="cuda")
        workspace = torch.empty(speedmla.mla_decode_workspace_size(batch, heads, q_len, speedmla.device_sm_count(0)),
                                dtype=torch.uint8, device="cuda")
        meta, splits = flash_mla.get_mla_metadata()

        def make_plan(bt, dtype, page, into=None):  # into: a workspace to remake a plan in
            return speedmla.mla_decode_plan(seq_lens, bt, num_heads=heads, q_len=q_len, dtype=dtype, page_size=page,
                                            workspace=into)

        def with_plan(plan, query, cache, bt):
            return lambda: speedmla.mla_decode_with_plan(plan, query, cache, bt, seq_lens, softmax_scale=SCALE,
                                                         out=out, lse=lse)

        bf16_plan = make_plan(table, "bfloat16", PAGE)
        self.replan = lambda: make_plan(table, "bfloat16", PAGE, bf16_plan.workspace)  # the planner alone
        self.calls = {
            "flashmla": lambda: flash_mla.flash_mla_with_kvcache(q, cache64, table, seq_lens, LATENT, meta, splits,
                                                                 softmax_scale=SCALE, causal=q_len > 1),
            "bf16 p64": with_plan(bf16_plan, q, pool.bf16, table),
            "bf16 p64 planner": lambda: speedmla.mla_decode(q, pool.bf16, table, seq_lens, softmax_scale=SCALE, out=out,
                                                            lse=lse, workspace=workspace),
            "bf16 p32": with_plan(make_plan(table32, "bfloat16", PAGE // 2), q, cache32, table32),
            "fp8 p64": with_plan(make_plan(table, "float8_e4m3fn", PAGE), q8, pool.fp8, table),
        }


SUSTAINED = ("flashmla", "bf16 p64", "bf16 p32", "fp8 p64")  # the columns of --sustained


def sustained_cell(pool, timer, batch, s_k, heads, q_len, seconds, generator):
    """{name: (ms, MHz, W) or the exception its call raised} for SUSTAINED: each implementation
    timed twice, S/2 seconds in SUSTAINED's order, then S/2 in the reverse order, so that a board
    that heats up through the cell favours no column; each figure the mean of the two medians."""
    calls, windows = Cell(pool, batch, s_k, heads, q_len, generator).calls, {name: [] for name in SUSTAINED}
    for name in SUSTAINED + SUSTAINED[::-1]:
        if windows[name] and not isinstance(windows[name][0], tuple):
            continue  # its first window failed
        try:
            ms, sampler = timer.sustained(calls[name], seconds / 2)
        except Exception as error:  # a refused or unsupported call: reported, not fatal
            windows[name].append(error)
            continue
        clock, power = sampler.medians() or (float("nan"), float("nan"))
        windows[name].append((ms, clock, power))

    def merged(w):
        timed = [x for x in w if isinstance(x, tuple)]
        return tuple(statistics.fmean(v) for v in zip(*timed)) if timed else w[0]
    return {name: merged(w) for name, w in windows.items()}


def sustained_row(results):
    """The table cells after B, s_k, H, q for one --sustained cell."""
    times = {name: r[0] if isinstance(r, tuple) else r for name, r in results.items()}

    def per_impl(value):  # value(ms, MHz, W), "—" for a failed implementation
        return " / ".join(f"{value(*r):.0f}" if isinstance(r, tuple) else "—" for r in results.values())
    flashmla = times["flashmla"]
    return (f"{flashmla:.3f}" if isinstance(flashmla, float) else f"failed: {flashmla}",
            ratio(times, "bf16 p64"), ratio(times, "bf16 p32"), ratio(times, "fp8 p64"),
            per_impl(lambda ms, mhz, w: mhz), per_impl(lambda ms, mhz, w: w),
            per_impl(lambda ms, mhz, w: ms * w))  # ms·W = mJ


def cell(pool, timer, batch, s_k, heads, q_len, iters, generator):
    calls = Cell(pool, batch, s_k, heads, q_len, generator).calls
    with GpuSampler() as sampler:
        times = timer.interleaved(calls, iters)
    return times, sampler.summary()


# Kernel names in the trace: each implementation's attention kernels (a name is one of them when
# every part of one of the alternatives is in it; FP8 requests of at most 32 query rows run on
# the narrow kernel) and its combine, and speedmla's planner.
KERNELS = {"speedmla bf16 p64": ((("decode_kernel<", "Bf16Traits"),), "decode_combine_kernel"),
           "speedmla fp8 p64": ((("decode_kernel<", "Fp8Traits"), ("decode_narrow_kernel<",)),
                                "decode_combine_kernel"),
           "flashmla": ((("flash_fwd_splitkv_mla_kernel",),), "flash_fwd_mla_combine_kernel")}
PLANNER = "decode_schedule_kernel"


def kernel_trace(timer, calls, iters):
    """The kernels (name, start µs, end µs) of `iters` rounds of the calls, in start order."""
    for fn in calls:
        timer.once(fn)  # warm: allocations and lazy metadata outside the trace
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            for fn in calls:
                timer.once(fn, i)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    return sorted(kernels, key=lambda k: k[1])


def combine_tails(kernels):
    """{implementation: [(µs its call runs past its attention kernel's end, µs of the call from the
    attention kernel's start)]}: each combine belongs to the attention kernel before it (the calls
    run one at a time)."""
    tails, current = {impl: [] for impl in KERNELS}, None
    for name, start, end in kernels:
        main = next((impl for impl, (alternatives, _) in KERNELS.items()
                     if any(all(part in name for part in parts) for parts in alternatives)), None)
        if main is not None:
            current = (main, start, end)
        elif current is not None and KERNELS[current[0]][1] in name:
            impl, main_start, main_end = current
            tails[impl].append((max(0.0, end - main_end), end - main_start))
            current = None
    return tails


def fixed_costs(pool, timer, batch, s_k, heads, q_len, iters, generator):
    c = Cell(pool, batch, s_k, heads, q_len, generator)
    calls = [c.calls["bf16 p64"], c.calls["fp8 p64"], c.calls["flashmla"], c.replan]
    kernels = kernel_trace(timer, calls, iters)
    cells = []
    for impl, per_call in combine_tails(kernels).items():
        if not per_call:
            cells.append("not traced (kernels: " + ", ".join(sorted({n[:60] for n, _, _ in kernels})) + ")")
            continue
        tail = statistics.median(t for t, _ in per_call)
        share = statistics.median(t / span for t, span in per_call)
        cells.append(f"+{tail:.1f} ({100 * share:.1f} %)")
    planner = [end - start for name, start, end in kernels if PLANNER in name]
    cells.append(f"{statistics.median(planner):.1f}" if planner else "not traced")
    return " | ".join(cells)


def check(pool, generator):
    """speedmla BF16 against FlashMLA on one small case: the two must compute the same thing."""
    batch, s_k, heads, q_len = 4, 1000, 16, 2
    table = pool.table(batch, 1024, generator)
    seq_lens = torch.tensor([1000, 2, 640, 999], dtype=torch.int32, device="cuda")  # >= q_len: every row sees a key
    q = normal((batch, q_len, heads, ROW), torch.bfloat16, generator)
    meta, splits = flash_mla.get_mla_metadata()
    theirs, their_lse = flash_mla.flash_mla_with_kvcache(q, pool.bf16.view(pool.pages, PAGE, 1, ROW), table,
                                                         seq_lens, LATENT, meta, splits, softmax_scale=SCALE,
                                                         causal=True)
    ours, our_lse = speedmla.mla_decode(q, pool.bf16, table, seq_lens, softmax_scale=SCALE, return_lse=True)
    out_diff = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
    lse_diff = (our_lse - their_lse.transpose(1, 2)).abs().max().item()  # FlashMLA: [B, H, q_len]
    print(f"check (B {batch}, q_len {q_len}, H {heads}, ragged lengths): out rel. L2 diff {out_diff:.2e}, "
          f"max |lse diff| {lse_diff:.2e}")
    if not (out_diff < 1e-2 and lse_diff < 1e-3):
        raise SystemExit("speedmla and FlashMLA disagree: the timings below would compare different work")
    plan = speedmla.mla_decode_plan(seq_lens, table, num_heads=heads, q_len=q_len, dtype="bfloat16", page_size=PAGE)
    planned, planned_lse = speedmla.mla_decode_with_plan(plan, q, pool.bf16, table, seq_lens, softmax_scale=SCALE,
                                                         return_lse=True)
    if not (torch.equal(planned, ours) and torch.equal(planned_lse, our_lse)):
        raise SystemExit("mla_decode_with_plan differs from mla_decode: the timed calls would not be what engines get")


def fp8_rates(batch, s_k, heads, q_len, ms):
    """"TB/s | TFLOP/s" of an FP8 call of `ms` by performance.md's formulas; dashes without a time."""
    if ms is None:
        return "— | —"
    return (f"{decode_bytes(batch, s_k, heads, q_len, 1) / (ms * 1e-3) / 1e12:.2f} | "
            f"{decode_flops(batch, s_k, heads, q_len) / (ms * 1e-3) / 1e12:.0f}")


def ratio(times, name):
    t, peer = times.get(name), times["flashmla"]
    if not isinstance(t, float):
        return f"failed: {t}"
    return f"{t:.3f} ({t / peer:.2f}×)" if isinstance(peer, float) else f"{t:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rest-ms", type=int, default=0, help="idle ms before each cell (0: back to back)")
    parser.add_argument("--quick", action="store_true",
                        help="s_k 8K, the seed's shape and the few long requests only")
    parser.add_argument("--fixed-costs", action="store_true",
                        help="trace the kernels instead: the combine's and the planner's share of a call")
    parser.add_argument("--sustained", type=float, default=0, metavar="S",
                        help="time each implementation alone, back to back for S seconds, at the power limit")
    args = parser.parse_args()
    if args.fixed_costs and args.sustained:
        parser.error("--fixed-costs and --sustained are two different runs: choose one")

    generator = torch.Generator(device="cuda").manual_seed(2026)
    pool = Pool(128 * 32768, generator)
    timer = Timer()
    check(pool, generator)
    cells = [c for c in GRID if not args.quick or c[1] == 8192] + SEED_SHAPE + FEW_LONG
    mode = f"rested {args.rest_ms} ms before each cell" if args.rest_ms else "back to back"
    if args.fixed_costs:
        print(f"\nfixed costs, {mode}; µs, median of {args.iters} traced calls (speedmla on its reused plan): "
              "how long a call runs past its attention kernel's end, (%) its share of the call from the "
              "attention kernel's start; the planner kernel's own time (once per decode step)")
        print("| B | s_k | H | q | speedmla bf16 p64 combine | speedmla fp8 p64 combine | FlashMLA combine "
              "| speedmla planner (BF16 p64) |")
        print("|---|---|---|---|---|---|---|---|")
    elif args.sustained:
        print(f"\ndecode under sustained load, cells {mode}; ms, median call of each implementation run "
              f"alone back to back, mean of two {args.sustained / 2:g} s windows in opposite orders (each after "
              f"{args.sustained / 8:g} s of warm-up), "
              "L2 flushed before each call; (×) = time / FlashMLA's time; SM clock, instantaneous power "
              "and energy a call, each as FlashMLA / bf16 p64 / bf16 p32 / fp8 p64")
        print("| B | s_k | H | q | FlashMLA bf16 p64 | speedmla bf16 p64 | speedmla bf16 p32 | speedmla fp8 p64 "
              "| fp8 TB/s | fp8 TFLOP/s | SM MHz | W | mJ a call |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print(f"\ndecode, {mode}; ms, median of {args.iters} interleaved calls, L2 flushed; "
              "(×) = time / FlashMLA's time, below 1 is faster; speedmla on a plan made once per cell "
              "except the planner column (mla_decode, planner in the call)")
        print("| B | s_k | H | q | FlashMLA bf16 p64 | speedmla bf16 p64 | bf16 p64, planner in the call "
              "| speedmla bf16 p32 | speedmla fp8 p64 | fp8 TB/s | fp8 TFLOP/s | SM clock, power, throttle |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, s_k, heads, q_len in cells:
        if args.rest_ms:
            time.sleep(args.rest_ms / 1000)
        if args.fixed_costs:
            print(f"| {batch} | {s_k} | {heads} | {q_len} | "
                  f"{fixed_costs(pool, timer, batch, s_k, heads, q_len, args.iters, generator)} |", flush=True)
            continue
        if args.sustained:
            results = sustained_cell(pool, timer, batch, s_k, heads, q_len, args.sustained, generator)
            flashmla, bf16, bf16_p32, fp8, clocks, powers, energies = sustained_row(results)
            fp8_ms = results["fp8 p64"][0] if isinstance(results["fp8 p64"], tuple) else None
            print(f"| {batch} | {s_k} | {heads} | {q_len} | {flashmla} | {bf16} | {bf16_p32} | {fp8} | "
                  f"{fp8_rates(batch, s_k, heads, q_len, fp8_ms)} | {clocks} | {powers} | {energies} |", flush=True)
            continue
        times, state = cell(pool, timer, batch, s_k, heads, q_len, args.iters, generator)
        fp8 = times.get("fp8 p64")
        rates = fp8_rates(batch, s_k, heads, q_len, fp8 if isinstance(fp8, float) else None)
        flashmla = times["flashmla"]
        flashmla_text = f"{flashmla:.3f}" if isinstance(flashmla, float) else f"failed: {flashmla}"
        print(f"| {batch} | {s_k} | {heads} | {q_len} | {flashmla_text} | {ratio(times, 'bf16 p64')} | "
              f"{ratio(times, 'bf16 p64 planner')} | {ratio(times, 'bf16 p32')} | {ratio(times, 'fp8 p64')} | "
              f"{rates} | {state} |", flush=True)


if __name__ == "__main__":
    main()
