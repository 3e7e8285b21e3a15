#!/usr/bin/env bash
# Sets everything up (pinned dependencies, build) and runs every test through CTest: the CPU
# tests (C++ and Python) and the GPU tests, which run for real on a CUDA machine and are
# reported as skipped without one. Arguments go to ctest (e.g. -L cpu, -R Decode).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="${SPEEDMLA_BUILD_DIR:-$root/build}"
"$root/scripts/setup.sh"
cd "$build"
exec ctest --output-on-failure -j "${SPEEDMLA_JOBS:-$(nproc)}" "$@"
