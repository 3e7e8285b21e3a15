#!/usr/bin/env bash
# A/B comparison of decode builds on the GPU machine, in one run so that every build sees the
# same card state: the decode GPU tests of each build, then the same benchmark cases,
# interleaved build by build and repeated, so clock drift during the run hits all alike.
#
#   scripts/ab-decode.sh "BENCH ARGS" BUILD_DIR...
#
# Each BUILD_DIR needs speedmla_gpu_tests and speedmla-bench (a full build folder or just the
# two binaries). Logs go under $OUT (or /tmp/ab-decode), one folder per build.
set -uo pipefail
bench_args="$1"; shift
logs="${OUT:-/tmp/ab-decode}"
rounds="${AB_ROUNDS:-2}"
for build in "$@"; do
  name=$(basename "$build")
  mkdir -p "$logs/$name"
  timeout 300 stdbuf -oL "$build/speedmla_gpu_tests" --gtest_color=no --gtest_filter='*Decode*' \
    > "$logs/$name/tests.log" 2>&1
  echo "$name tests (rc=$?): $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$logs/$name/tests.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$logs/$name/tests.log" | head -10
  for dtype in float8_e4m3fn bfloat16; do
    worst=$(grep "^\[ decode \] $dtype" "$logs/$name/tests.log" | sed -E 's/.*rel_l2=([^ ]+).*/\1/' | sort -g | tail -1)
    [ -n "$worst" ] && echo "  $dtype worst rel L2 $worst"
  done
done
for round in $(seq "$rounds"); do
  for build in "$@"; do
    name=$(basename "$build")
    # shellcheck disable=SC2086
    timeout 200 stdbuf -oL "$build/speedmla-bench" $bench_args > "$logs/$name/bench.$round.log" 2>&1
    echo "== $name round $round"
    # One line per case: dtype page B s_k H q -> ms
    awk '/^(fp8|bf16) / {printf "%s/%s/%s/%s/%s/%s %s  ", $1, $2, $3, $4, $5, $6, $8} END {print ""}' \
      "$logs/$name/bench.$round.log"
  done
done
