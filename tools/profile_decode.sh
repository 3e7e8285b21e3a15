#!/usr/bin/env bash
# Profiles one decode case with Nsight Compute on the GPU machine (run from the repository root
# with the carried build/): the speed-of-light and warp-state summaries, and per-SASS-instruction
# stall samples as CSV, under $OUT (or build/profile/).
#   tools/profile_decode.sh fp8,64,128,8192,16,1 [more cases...]
set -uo pipefail
out="${OUT:-build/profile}"
mkdir -p "$out"
for case in "$@"; do
  name=$(echo "$case" | tr ',' '_')
  timeout 200 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats \
    -o "$out/$name" build/speedmla-bench --case "$case" --iters 3 > "$out/$name.ncu.log" 2>&1
  ncu --import "$out/$name.ncu-rep" --page details > "$out/$name.details.txt" 2>&1
  ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv" 2>&1
  rm -f "$out/$name.ncu-rep"
  grep -E "Duration|SM Frequency|DRAM Throughput|Issued Warp Per|No Eligible" "$out/$name.details.txt" | sed "s/^/$name /"
done
