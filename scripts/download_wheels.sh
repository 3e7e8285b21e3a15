#!/usr/bin/env bash
# Downloads the wheels of every PyPI pin of scripts/setup.sh, for another machine's Python, into
# .whl/ — for machines without internet (the GPU machine). There, install them with
#   PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" PYTHON=python3.12 scripts/setup.sh
# (a fresh .deps/: the stamps of a copied one would skip the installs). apache-tvm-ffi and numpy
# have one wheel per Python version; the compiled speedmla module itself does not.
# Also the peers' wheels (PEER_WHEELS below), which only bench/prefill_peer.py uses.
# Usage: scripts/download_wheels.sh [python version, default 3.12] [package names...]
# With names, only those pins (scripts/build_wheel.sh takes what the speedmla wheel and the Python
# tests need) and no peers. SPEEDMLA_WHEEL_DIR replaces .whl/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python_version=${1:-3.12}
shift || true
only=("$@")
dest="${SPEEDMLA_WHEEL_DIR:-$root/.whl}"
setup="$root/scripts/setup.sh"

# nvidia-cudnn-frontend: cuDNN's FP8 attention graphs for bench/prefill_peer.py (optional there;
# PyTorch on the GPU machine brings cuDNN itself). 1.32.0 has CPython 3.12 manylinux_2_28 wheels.
PEER_WHEELS=("nvidia-cudnn-frontend==1.32.0")

download() {
  "${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any --dest "$dest" "$1"
}

# The pins, read from setup.sh (the only place they are written).
eval "$(sed -n 's/^\([A-Z_]*_VERSION\)=\([^ ]*\).*/\1=\2/p' "$setup")"
mkdir -p "$dest"
sed -n 's/^install_pip "\([^"]*\)".*/\1/p' "$setup" | while read -r spec; do
  spec=$(eval echo "$spec")
  if [ ${#only[@]} -gt 0 ] && [[ " ${only[*]} " != *" ${spec%%==*} "* ]]; then continue; fi
  download "$spec"
done
if [ ${#only[@]} -eq 0 ]; then
  for spec in "${PEER_WHEELS[@]}"; do download "$spec"; done
fi
ls -l "$dest"
