#!/usr/bin/env bash
# Compiles one decode kernel instantiation on its own, with ptxas's register and spill report,
# into a scratch object (the build folder's own objects stay as ninja made them), then runs the
# SASS checks of tests/sass on it. The quick loop while editing a kernel, no GPU needed:
#
#   scripts/check-decode-tu.sh fp8|bf16
#
# Needs a configured build folder (scripts/setup.sh; SPEEDMLA_BUILD_DIR to use another).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="${SPEEDMLA_BUILD_DIR:-$root/build}"
dtype=${1:?usage: $0 fp8|bf16}
case "$dtype" in fp8 | bf16) ;; *) echo "usage: $0 fp8|bf16" >&2; exit 2 ;; esac
object="CMakeFiles/speedmla.dir/src/kernels/decode/sm90/decode_$dtype.cu.o"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# ninja's own command for the object, redirected to the scratch folder.
command=$(cd "$build" && ninja -t commands "$object" | tail -1)
[[ "$command" == *" -o $object" ]] || { echo "unexpected compile command: $command" >&2; exit 1; }
command="${command% -o "$object"} -o $scratch/decode.o"
command=${command//" -MF $object.d"/" -MF $scratch/decode.o.d"}
(cd "$build" && eval "$command -Xptxas=-v") 2>&1 | grep -E "error|warning|spill|Used [0-9]+ registers" || true
python3 "$root/tests/sass/check_kernel_sass.py" --cuobjdump "$root/.deps/pip/nvidia/cu13/bin/cuobjdump" \
  --kernel-regex decode_kernel --kernels 1 --max-waits 12 "$scratch/decode.o"
