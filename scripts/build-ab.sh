#!/usr/bin/env bash
# Builds the decode test and benchmark binaries of several commits or branches, for one A/B run
# on the GPU machine (scripts/ab-decode.sh):
#
#   scripts/build-ab.sh REF...        # e.g. main pipelined-transposes
#
# Each REF is checked out into its own worktree and built there (build-ab-work/, incremental
# when re-run); its two binaries and commit.txt land in build-ab/<REF with / as ->/. Carry
# build-ab to the GPU machine and run, from the repository root:
#
#   scripts/ab-decode.sh "--iters 20 --case fp8,64,128,32768,16,1" build-ab/main build-ab/...
#
# Needs scripts/setup.sh to have run once (the pinned dependencies in .deps/).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work="$root/build-ab-work"
[ -d "$root/.deps" ] || { echo "run scripts/setup.sh first (.deps/ is missing)" >&2; exit 2; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
for ref in "$@"; do
  name=${ref//\//-}
  commit=$(git -C "$root" rev-parse --short "$ref^{commit}")
  tree="$work/src-$name" build="$work/build-$name" out="$root/build-ab/$name"
  if [ -d "$tree" ]; then
    git -C "$tree" checkout -q --detach "$commit"
  else
    git -C "$root" worktree add -q --detach "$tree" "$commit"
  fi
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$tree" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
          -DSPEEDMLA_DEPS_DIR="$root/.deps" -DPython3_EXECUTABLE="$(command -v "${PYTHON:-python3}")" > /dev/null
  fi
  cmake --build "$build" -j "${SPEEDMLA_JOBS:-$(nproc)}" --target speedmla_gpu_tests speedmla-bench
  mkdir -p "$out"
  cp "$build/speedmla_gpu_tests" "$build/speedmla-bench" "$out/"
  echo "$ref $commit" > "$out/commit.txt"
  echo "built $ref ($commit) -> build-ab/$name"
done
