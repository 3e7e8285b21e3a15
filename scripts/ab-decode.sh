#!/usr/bin/env bash
# A/B comparison of decode builds on the GPU machine, in one run so that every build sees the
# same card state: the decode GPU tests of each build, then the same benchmark cases,
# interleaved build by build and repeated, so clock drift during the run hits all alike.
#
#   scripts/ab-decode.sh "BENCH ARGS" BUILD_DIR...
#
# Each BUILD_DIR needs speedmla_gpu_tests and speedmla-bench (a full build folder or just the
# two binaries). Logs go under $OUT (or /tmp/ab-decode), one folder per build; the tests are
# gpu-check.sh's (--tests-only --filter "$AB_FILTER", '*Decode*' by default); AB_TESTED="NAME..."
# skips them for builds whose tests passed in an earlier run.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bench_args="$1"; shift
logs="${OUT:-/tmp/ab-decode}"
rounds="${AB_ROUNDS:-2}"
filter="${AB_FILTER:-*Decode*}"
for build in "$@"; do
  name=$(basename "$build")
  mkdir -p "$logs/$name"
  [[ " ${AB_TESTED:-} " == *" $name "* ]] && continue
  echo "== $name"
  # gpu-check's decode tests and its summary (pass/fail counts, worst errors per type).
  SPEEDMLA_BUILD_DIR="$build" OUT="$logs/$name" "$root/scripts/gpu-check.sh" --tests-only --filter "$filter" |
    sed '1,/gpu-check summary/d'
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
