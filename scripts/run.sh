#!/usr/bin/env bash
# Sets everything up (pinned dependencies, build) and runs the library's main job,
# speedmla-run: decode/verify and prefill on a DeepSeek-V3-shaped batch, on the GPU when there
# is one and on the CPU reference otherwise. Arguments go to speedmla-run (--help lists them).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
exec "${SPEEDMLA_BUILD_DIR:-$root/build}/speedmla-run" "$@"
