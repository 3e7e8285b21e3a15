#!/usr/bin/env python3
"""Runs FlashMLA's own dense-decoding test against speedmla.compat.flash_mla (issue 14).

FlashMLA's tests/test_flash_mla_dense_decoding.py (deepseek-ai/FlashMLA at 9241ae3) is not part
of this repository: pass its path; its tests/kernelkit/ helper package must sit beside it (an
archive of FlashMLA's tests/ folder has both). The file's one ``import flash_mla`` line is
rewritten to ``import speedmla.compat.flash_mla as flash_mla``; nothing else of it changes. The
rewritten copy goes to a temporary folder and is loaded as a module, and its ``main`` runs as
``python3 test_flash_mla_dense_decoding.py`` would (BF16): every case of its lists, through its
``test_flash_mla``, against its own reference and tolerances. This runner only counts: every
case runs even after a failure, and the summary says which failed.

    python3 tests/python/run_flashmla_test.py PATH/tests/test_flash_mla_dense_decoding.py \\
        [--no-kineto] [--shard K/N]

--no-kineto: the file's performance cases time FlashMLA's kernel by its name
("flash_fwd_splitkv_mla_kernel") in a CUPTI profile, which speedmla's kernels do not have.
This sets kernelkit's own switch for runs under a profiler (NSYS_PROFILING_SESSION_ID), so those
cases check correctness and print placeholder times. speedmla's timings: bench/.
--shard K/N: only cases K, K+N, K+2N, ... (0 <= K < N), to keep each run short.

Needs PyTorch with a CUDA device of compute capability 9.0, triton (kernelkit imports it), and
speedmla importable (this repository's python/ is added to the path).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
import traceback

ORIGINAL = "import flash_mla"
REPLACEMENT = "import speedmla.compat.flash_mla as flash_mla"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def rewrite(source: str) -> str:
    """The test's text with its import line replaced; refuses a file without exactly one."""
    lines = source.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == ORIGINAL]
    if len(hits) != 1:
        raise SystemExit(f"expected exactly one line '{ORIGINAL}' in the test file, found {len(hits)}")
    newline = "\n" if lines[hits[0]].endswith("\n") else ""
    lines[hits[0]] = REPLACEMENT + newline
    return "".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=pathlib.Path)
    parser.add_argument("--no-kineto", action="store_true")
    parser.add_argument("--shard", default="0/1", help="K/N: run cases K, K+N, ...")
    args = parser.parse_args()
    shard, shards = (int(x) for x in args.shard.split("/"))
    if not 0 <= shard < shards:
        raise SystemExit(f"--shard must be K/N with 0 <= K < N, got {args.shard}")
    test_dir = args.test_file.resolve().parent
    if not (test_dir / "kernelkit").is_dir():
        raise SystemExit(f"FlashMLA's kernelkit/ is missing beside {args.test_file}")
    if args.no_kineto:
        os.environ["NSYS_PROFILING_SESSION_ID"] = "speedmla-run_flashmla_test"
        print("[run_flashmla_test] --no-kineto: performance cases check correctness; their times are "
              "placeholders", flush=True)
    sys.path[:0] = [str(test_dir), str(ROOT / "python")]

    with tempfile.TemporaryDirectory() as tmp:  # kept while the cases run: tracebacks show its lines
        path = pathlib.Path(tmp) / args.test_file.name
        path.write_text(rewrite(args.test_file.read_text()))
        print(f"[run_flashmla_test] {args.test_file}: '{ORIGINAL}' -> '{REPLACEMENT}'", flush=True)
        spec = importlib.util.spec_from_file_location("flashmla_dense_decoding_on_speedmla", path)
        test = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(test)
        seen, failed = [0], []
        original = test.test_flash_mla

        def counted(case):
            index = seen[0]
            seen[0] += 1
            if index % shards != shard:
                return
            try:
                original(case)
            except Exception:  # noqa: BLE001  (a failed case is reported, the others still run)
                traceback.print_exc()
                failed.append((index, case))

        test.test_flash_mla = counted  # main() looks the name up in its module at each call
        test.main(sys.modules["torch"].bfloat16)  # what `python3 FILE` runs (--dtype bf16)
    ran = len(range(shard, seen[0], shards))
    print(f"[run_flashmla_test] shard {shard}/{shards}: {ran - len(failed)} of {ran} cases passed "
          f"({seen[0]} in the file)")
    for index, case in failed:
        print(f"[run_flashmla_test] FAILED case {index}: {case}")
    return 1 if failed or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
