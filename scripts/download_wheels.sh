#!/usr/bin/env bash
# Downloads the wheels of every PyPI pin of scripts/setup.sh, for another machine's Python, into
# .whl/ — for machines without internet (the GPU machine). There, install them with
#   PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" PYTHON=python3.12 scripts/setup.sh
# (a fresh .deps/: the stamps of a copied one would skip the installs). apache-tvm-ffi and numpy
# have one wheel per Python version; the compiled speedmla module itself does not.
# Usage: scripts/download_wheels.sh [python version, default 3.12]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python_version=${1:-3.12}
setup="$root/scripts/setup.sh"

# The pins, read from setup.sh (the only place they are written).
eval "$(sed -n 's/^\([A-Z_]*_VERSION\)=\([^ ]*\).*/\1=\2/p' "$setup")"
mkdir -p "$root/.whl"
sed -n 's/^install_pip "\([^"]*\)".*/\1/p' "$setup" | while read -r spec; do
  spec=$(eval echo "$spec")
  "${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any --dest "$root/.whl" "$spec"
done
ls -l "$root/.whl"
