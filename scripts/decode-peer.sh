#!/usr/bin/env bash
# speedmla decode beside FlashMLA on the GPU machine (bench/decode_peer.py): builds the peer from
# build-peer/flashmla.tgz once (../shared/peers/README.md says how to assemble it on the
# development machine), installs tvm_ffi from the carried .whl/ into the build folder once, then
# runs the harness with the given arguments, e.g.
#   scripts/decode-peer.sh --rest-ms 0        # back to back, the whole grid
#   scripts/decode-peer.sh --rest-ms 1000     # rested
#   scripts/decode-peer.sh --sustained 0.8    # each implementation alone, at the board's power limit
#   scripts/decode-peer.sh --quick --fixed-costs  # the combine's and the planner's share (kernel trace)
# With the device tool, carry build, .whl (tvm_ffi) and build-peer/flashmla.tgz.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="${SPEEDMLA_BUILD_DIR:-$root/build}"
peer="$root/build-peer/flashmla"
if ! ls "$peer"/flash_mla/*.so > /dev/null 2>&1; then
  [ -d "$peer" ] || tar xzf "$root/build-peer/flashmla.tgz" -C "$root/build-peer"
  bash "$peer/build.sh" > "$root/build-peer/flashmla-build.log" 2>&1 \
    || { tail -20 "$root/build-peer/flashmla-build.log"; exit 1; }
fi
site="$build/python-packages"
PYTHONPATH="$site" python3 -c "import tvm_ffi" 2>/dev/null \
  || python3 -m pip install --quiet --no-index --no-deps --target "$site" \
       "$root"/.whl/apache_tvm_ffi-*.whl "$root"/.whl/typing_extensions-*.whl
cd "$root"
PYTHONPATH="$site:$root/.deps/pip:$root/python:$peer" SPEEDMLA_LIBRARY="$build/libspeedmla_tvm_ffi.so" \
TVM_FFI_DISABLE_TORCH_C_DLPACK=1 python3 bench/decode_peer.py "$@"
