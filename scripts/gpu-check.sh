#!/usr/bin/env bash
# One command for the GPU machine: every GPU test, then the decode and prefill benchmarks; a
# short summary last. Full logs go under $OUT when it is set (the device tool brings them back), else under
# build/gpu-check/.
#
#   scripts/gpu-check.sh [--tests-only | --bench-only] [--filter GTEST_FILTER] [--bench-args "..."]
#                        [--sanitize] [--host-cost] [--wheel]
#
# --filter narrows the GoogleTest cases and leaves the Python GPU tests out.
# --wheel runs the Python tests (all of them) against the wheel in .whl/ (scripts/build_wheel.sh
# here), installed offline into a fresh virtual environment that sees the system's PyTorch,
# instead of against the build folder's module (tests/python/run_wheel.sh).
# Expects a build folder made by scripts/setup.sh (here or carried to the GPU machine); set
# SPEEDMLA_BUILD_DIR to use another. --sanitize also runs a small subset of every GPU operation
# (decode both dtypes, every page size, q_len > 1; prefill; merge; cache write and gather;
# quantize and pack; the backend's metadata kernels; captured-graph replays; the check mode's
# kernels; a short GPU fuzz and the hostile device-side values) under compute-sanitizer memcheck,
# racecheck and synccheck, and initcheck on the tests whose inputs are all written before use.
# The tests print "[ budget ]" lines (tests/common/error_budget.h); the worst error per
# operation and dtype goes to error_budget.md in the log folder (docs/error-budget.md).
# --bench-args go to the decode
# benchmark; the prefill grid (speedmla-bench --prefill) runs after it with its defaults.
# --host-cost also measures the host time per mla_decode call, C++ (build/speedmla-host-cost)
# and Python (bench/host_cost.py, with the packages the Python GPU tests installed into the
# build folder: run it with the tests once).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="${SPEEDMLA_BUILD_DIR:-$root/build}"
logs="${OUT:-$build/gpu-check}"
mkdir -p "$logs"

run_tests=1 run_bench=1 sanitize=0 host_cost=0 wheel=0 filter="*" bench_args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only) run_bench=0 ;;
    --bench-only) run_tests=0 ;;
    --filter) filter="$2"; shift ;;
    --bench-args) bench_args="$2"; shift ;;
    --sanitize) sanitize=1 ;;
    --host-cost) host_cost=1 ;;
    --wheel) wheel=1 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader \
  > "$logs/gpu.txt" 2>&1 || true
# The binaries' commit is what the build recorded (build/commit.txt, written when it is made);
# the tree's own git state on the GPU machine may lag behind the copied files.
commit=$(cat "$build/commit.txt" 2>/dev/null || echo "unknown (no $build/commit.txt)")
summary+=("gpu: $(head -1 "$logs/gpu.txt")  build of: $commit")

status=0
if [ "$sanitize" = 1 ]; then
  # A subset of every GPU operation, small sizes. initcheck only where every input is written
  # before the kernels read it (some other tests hand over allocated-but-unwritten inputs).
  every_op='*DecodeGpu.PageSizes*:*DecodeGpu.EmptyAndShortRows*:*PrefillGpu.StridedViews*'
  every_op+=':PrefillGpuTransposedValues.SmallRaggedBatch'
  every_op+=':*BackendPrefillGpu.SingleLoopAndNoLoop*:*MergeGpu.MatchesReference*:*CacheGpu.*:CacheGpuGraph.*'
  every_op+=':*DecodePlanGpu.OnePlanServesEveryLayerOfAStep*:*QuantizeGpu.*:BackendGpu.BlockTablesFollowTheHostRule'
  every_op+=':BackendGpu.ExtendSlotListsFollowThePageTable'
  every_op+=':BackendGpu.CapturedGraphReplaysWithThreeBatches:*DeviceValuesGpu.*:DeviceChecksGpu.*:*GpuFuzz.*'
  initcheck_set='*DecodeGpu.PageSizes*:*DecodeGpu.EmptyAndShortRows*:*GpuFuzz.*:*DeviceValuesGpu.*:DeviceChecksGpu.*:*DeterminismGpu.Prefill/*:*PrefillGpu.RaggedEdgeCases/*:DeterminismGpuMerge.*'
  # The four tools run side by side and beside the tests (each is bound by one host core; the
  # GPU has room for all; nothing here is timed), collected after the tests.
  declare -A tool_pid
  for tool in memcheck racecheck synccheck initcheck; do
    tool_filter="$every_op"
    [ "$tool" = initcheck ] && tool_filter="$initcheck_set"
    SPEEDMLA_FUZZ_CASES=40 timeout 400 compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/speedmla_gpu_tests" \
      --gtest_color=no --gtest_filter="$tool_filter" \
      > "$logs/sanitize_$tool.log" 2>&1 &
    tool_pid[$tool]=$!
  done
fi

if [ "$run_tests" = 1 ]; then
  # Line-buffered, with a time limit: a hung kernel must still leave its log behind.
  timeout 400 stdbuf -oL -eL "$build/speedmla_gpu_tests" --gtest_color=no --gtest_filter="$filter" \
    > "$logs/gpu_tests.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("gpu tests (rc=$rc): $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]' "$logs/gpu_tests.log" | tr '\n' ' ')")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E '^\[  FAILED  \] [A-Za-z]' "$logs/gpu_tests.log" | head -20)
  # Worst measured errors per dtype, from the decode and prefill tests' own report lines.
  for dtype in float8_e4m3fn bfloat16; do
    worst=$(grep "^\[ decode \] $dtype" "$logs/gpu_tests.log" | sed -E 's/.*rel_l2=([^ ]+).*/\1/' | sort -g | tail -1)
    [ -n "$worst" ] && summary+=("  decode $dtype: worst rel L2 error $worst over $(grep -c "^\[ decode \] $dtype" "$logs/gpu_tests.log") cases")
    lines=$(grep "^\[ prefill \] $dtype" "$logs/gpu_tests.log")
    if [ -n "$lines" ]; then
      worst=$(sed -E 's/.* out rel_l2=([^ ]+).*/\1/' <<< "$lines" | sort -g | tail -1)
      worst_lse=$(sed -E 's/.* lse max_abs=([^ ]+).*/\1/' <<< "$lines" | sort -g | tail -1)
      summary+=("  prefill $dtype: worst per-request rel L2 error $worst, worst lse error $worst_lse over $(wc -l <<< "$lines") cases")
    fi
  done
  # Worst measured error per operation and dtype against its bound, from the "[ budget ]" lines.
  if grep -q '^\[ budget \]' "$logs/gpu_tests.log"; then
    { echo "build of: $commit; gpu: $(head -1 "$logs/gpu.txt")"
      echo
      echo "| operation | dtype | measurements | worst out rel. L2 | worst out max abs | worst LSE max abs |"
      echo "|---|---|---|---|---|---|"
      grep '^\[ budget \]' "$logs/gpu_tests.log" | awk '
        { key = $4 " " $5; n[key]++
          for (i = 6; i <= 8; i++) { split($i, kv, "="); v = kv[2] + 0
            if (!(key SUBSEP kv[1] in w) || v > w[key, kv[1]]) w[key, kv[1]] = v } }
        END { for (k in n) { split(k, p, " ")
                printf "| %s | %s | %d | %.3g | %.3g | %.3g |\n", p[1], p[2], n[k],
                       w[k, "out_rel_l2"], w[k, "out_max_abs"], w[k, "lse_max_abs"] } }' | sort
      echo
      echo "(-1: not measured by that operation's tests)"
    } > "$logs/error_budget.md"
    summary+=("error budget: $logs/error_budget.md")
    while IFS= read -r line; do summary+=("  $line"); done < <(grep '^| [a-zA-Z]' "$logs/error_budget.md" | grep -v '^| operation')
  fi
  # The Python tests take no GoogleTest filter: they run with the full set only.
  if [ "$filter" = "*" ] && [ "$wheel" = 1 ]; then
    timeout 400 "$root/tests/python/run_wheel.sh" --offline --system-site-packages \
      > "$logs/python_wheel_tests.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    summary+=("python tests against the installed wheel (rc=$rc): $(tail -1 "$logs/python_wheel_tests.log")")
  elif [ "$filter" = "*" ] && [ -x "$root/tests/python/run_gpu.sh" ]; then
    timeout 300 "$root/tests/python/run_gpu.sh" > "$logs/python_gpu_tests.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    summary+=("python gpu tests (rc=$rc): $(tail -1 "$logs/python_gpu_tests.log")")
  fi
fi

if [ "$sanitize" = 1 ]; then
  for tool in memcheck racecheck synccheck initcheck; do
    wait "${tool_pid[$tool]}"
    rc=$?
    [ $rc -ne 0 ] && status=1
    summary+=("compute-sanitizer $tool (rc=$rc): $(grep -E '(ERROR|RACECHECK) SUMMARY' "$logs/sanitize_$tool.log" | tail -1) $(grep -E '^\[  (PASSED|FAILED)  \]' "$logs/sanitize_$tool.log" | tr '\n' ' ')")
  done
fi

if [ "$host_cost" = 1 ]; then
  # The GPU idle apart from these calls; same Python environment as tests/python/run_gpu.sh.
  # TVM_FFI_DISABLE_TORCH_C_DLPACK=1 (as in the tests) only stops tvm_ffi from JIT-building its
  # own C DLPack addon; a PyTorch that exposes the C DLPack exchange API itself
  # (torch.Tensor.__dlpack_c_exchange_api__, PyTorch 2.11 does) is converted through it all the
  # same, which is what a user gets. host_cost.py prints which conversion path the run took.
  log="$logs/host_cost.log"
  PYTHONPATH="$build/python-packages:$root/.deps/pip:$root/python" SPEEDMLA_LIBRARY="$build/libspeedmla_tvm_ffi.so" \
  TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 300 "${PYTHON:-python3}" "$root/bench/host_cost.py" \
    --binary "$build/speedmla-host-cost" > "$log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("host cost (rc=$rc): $log")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E '^\([abc]\)|^tensor conversion' "$log")
fi

if [ "$run_bench" = 1 ]; then
  # shellcheck disable=SC2086
  timeout 400 stdbuf -oL "$build/speedmla-bench" $bench_args > "$logs/bench.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("benchmark (rc=$rc): $logs/bench.log")
  timeout 300 stdbuf -oL "$build/speedmla-bench" --prefill > "$logs/bench_prefill.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("prefill benchmark (rc=$rc): $logs/bench_prefill.log")
fi

echo
echo "==================== speedmla gpu-check summary ===================="
printf '%s\n' "${summary[@]}"
if [ "$run_bench" = 1 ]; then cat "$logs/bench.log" "$logs/bench_prefill.log"; fi
exit $status
