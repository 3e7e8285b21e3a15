"""Host time per speedmla.mla_decode call from Python, and what it adds to the C++ call.

    PYTHONPATH=python:.deps/pip SPEEDMLA_LIBRARY=build/libspeedmla_tvm_ffi.so \
        python3 bench/host_cost.py [--binary build/speedmla-host-cost] [--calls N] [--rounds N]

Runs the C++ program (bench/host_cost.cpp) for its figures, then the same calls from Python:
with PyTorch and a GPU, the full decode call (B = 1, H = 16, q_len 1, 64 tokens; at most 100
calls a round, the stream drained after each round, untimed: the calling thread's time), with a
workspace passed and without one (then the package allocates it through PyTorch), and
mla_decode_with_plan on a reused plan; it says how tvm_ffi converts the torch tensors; otherwise the validation-only call (B = 0, NumPy arrays
on the CPU) against C++'s B = 0 call on CPU views. Target (issue 16): Python <= 10 us over C++.
Each figure is the best of --rounds rounds, per call.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time


def best_per_call_us(call, calls: int, rounds: int, after_round=lambda: None) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        after_round()
    return best


def cpp_figures(binary: str, calls: int, rounds: int) -> dict[str, float]:
    text = subprocess.run([binary, "--calls", str(calls), "--rounds", str(rounds)], check=True,
                          capture_output=True, text=True).stdout
    print(text, end="")
    figures = {}
    for line in text.splitlines():
        m = re.match(r"\((\w)\) (.*?)\s*:\s*([0-9.]+) us", line)
        if m:
            figures[m.group(2).strip()] = float(m.group(3))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default="build/speedmla-host-cost")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    cpp = cpp_figures(args.binary, args.calls, args.rounds)

    import speedmla

    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False

    if not gpu:
        import numpy as np

        q = np.zeros((0, 1, 16, 576), np.uint8)
        cache = np.zeros((64, 64, 576), np.uint8)
        table = np.zeros((0, 8), np.int32)
        lens = np.zeros((0,), np.int32)
        out = np.zeros((0, 1, 16, 512), np.uint16)
        lse = np.zeros((0, 1, 16), np.float32)
        per_call = best_per_call_us(
            lambda: speedmla.mla_decode(q, cache, table, lens, softmax_scale=0.0417, out=out, lse=lse),
            args.calls * 10, args.rounds)
        base = cpp["mla_decode validation only, B=0, CPU views"]
        print(f"(c) Python mla_decode validation only, B=0, NumPy : {per_call:7.3f} us "
              f"({per_call - base:+.3f} us over C++)")
        return

    # Set by PyTorch itself (2.11 does) or by tvm_ffi's addon (which
    # TVM_FFI_DISABLE_TORCH_C_DLPACK=1 keeps from loading); otherwise each tensor goes through __dlpack__.
    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    print("tensor conversion: " + ("PyTorch's C DLPack exchange API" if fast else "Python __dlpack__ per tensor"))
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        q = torch.zeros((1, 1, 16, 576), dtype=dtype, device="cuda")
        cache = torch.zeros((64, 64, 576), dtype=dtype, device="cuda")
        table = torch.ones((1, 8), dtype=torch.int32, device="cuda")
        lens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
        out = torch.empty((1, 1, 16, 512), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty((1, 1, 16), dtype=torch.float32, device="cuda")
        ws = torch.empty((speedmla.mla_decode_workspace_size(1, 16, 1, speedmla.device_sm_count(0)),),
                         dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            base = next(v for k, v in cpp.items() if k.startswith("mla_decode full GPU call, " + name))
            for label, kwargs in (("workspace given", {"workspace": ws}), ("workspace None ", {})):
                def call():
                    speedmla.mla_decode(q, cache, table, lens, softmax_scale=0.0417, out=out, lse=lse, **kwargs)
                call()
                torch.cuda.synchronize()
                per_call = best_per_call_us(call, min(args.calls, 100), args.rounds, stream.synchronize)
                print(f"(c) Python mla_decode full GPU call, {name:13s} {label}: {per_call:7.3f} us "
                      f"({per_call - base:+.3f} us over C++)")
            plan = speedmla.mla_decode_plan(lens, table, num_heads=16, q_len=1, dtype=name, page_size=64, workspace=ws)
            base = next(v for k, v in cpp.items() if k.startswith("mla_decode_with_plan (plan reused), " + name))

            def call_with_plan():
                speedmla.mla_decode_with_plan(plan, q, cache, table, lens, softmax_scale=0.0417, out=out, lse=lse)
            call_with_plan()
            torch.cuda.synchronize()
            per_call = best_per_call_us(call_with_plan, min(args.calls, 100), args.rounds, stream.synchronize)
            print(f"(c) Python mla_decode_with_plan, {name:13s} plan reused  : {per_call:7.3f} us "
                  f"({per_call - base:+.3f} us over C++)")


if __name__ == "__main__":
    main()
