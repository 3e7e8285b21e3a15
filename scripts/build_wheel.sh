#!/usr/bin/env bash
# Builds speedmla's wheel (pip wheel ., i.e. scikit-build-core through CMakeLists.txt, as
# `pip install .` does) into .whl/, and downloads there, for the GPU machine's Python, the wheels
# it and the Python tests need (apache-tvm-ffi, pytest; scripts/download_wheels.sh). That machine
# has no internet: carry .whl/ there and run `scripts/gpu-check.sh --wheel`, which installs the
# wheel offline into a fresh virtual environment and runs the Python tests against it.
#
#   scripts/build_wheel.sh [python version of the GPU machine, default 3.12 | --no-downloads]
#
# SPEEDMLA_WHEEL_DIR puts the wheels elsewhere than .whl/.
# Run scripts/setup.sh first where you can: the wheel then takes the headers from .deps/ and
# ccache serves its compiles from the main build's (otherwise every kernel compiles again).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="${SPEEDMLA_WHEEL_DIR:-$root/.whl}" python_version=3.12 downloads=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-downloads) downloads=0 ;;
    [0-9]*) python_version="$1" ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$dest"
# The main build's C++ compiler: scikit-build-core otherwise sets CXX to Python's (g++, where
# CMake picks c++), and ccache, which hashes the compiler's name, would miss the main build's
# objects.
cache="${SPEEDMLA_BUILD_DIR:-$root/build}/CMakeCache.txt"
if [ -z "${CXX:-}" ] && [ -f "$cache" ]; then
  CXX=$(sed -n 's/^CMAKE_CXX_COMPILER:FILEPATH=//p' "$cache")
  export CXX
fi
# One speedmla wheel in the folder: the version does not change with every commit.
rm -f "$dest"/speedmla-*.whl
CMAKE_BUILD_PARALLEL_LEVEL="${SPEEDMLA_JOBS:-$(nproc)}" \
  "${PYTHON:-python3}" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$dest" "$root"
if [ "$downloads" = 1 ]; then
  # numpy is not among them: the GPU machine's PyTorch brings it.
  "$root/scripts/download_wheels.sh" "$python_version" apache-tvm-ffi typing-extensions pytest \
    pluggy iniconfig packaging
fi
ls -l "$dest"/speedmla-*.whl
