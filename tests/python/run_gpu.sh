#!/usr/bin/env bash
# The Python GPU tests, and those that need PyTorch on the CPU (test_torch.py: CI has no
# PyTorch), on the GPU machine (scripts/gpu-check.sh calls this). That machine has
# PyTorch but no internet: the Python packages it lacks (apache-tvm-ffi, pytest and its
# requirements, numpy) are installed from the carried wheels in .whl/ (scripts/download_wheels.sh
# with its Python version) into the build folder, once. The compiled module is the build's.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build="${SPEEDMLA_BUILD_DIR:-$root/build}"
python=${PYTHON:-python3}
site="$build/python-packages"
# Packages already importable (a .deps/pip that setup.sh filled with this Python's wheels, or the
# system's) are used as they are; the private folder comes first, so it also shadows unusable
# ones (wheels of another Python version).
path="$site:$root/.deps/pip"

missing=()
PYTHONPATH="$path" "$python" -c "import tvm_ffi" 2>/dev/null || missing+=(apache-tvm-ffi typing-extensions)
PYTHONPATH="$path" "$python" -c "import pytest" 2>/dev/null || missing+=(pytest pluggy iniconfig packaging)
PYTHONPATH="$path" "$python" -c "import numpy" 2>/dev/null || missing+=(numpy)
if [ ${#missing[@]} -gt 0 ]; then
  "$python" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$root/.whl" \
    --no-deps --target "$site" "${missing[@]}"
fi

# TVM_FFI_DISABLE_TORCH_C_DLPACK: no JIT build of tvm_ffi's optional PyTorch addon on the device;
# PyTorch tensors then go through its own DLPack exchange (or tvm_ffi's fallback), which also
# records the current stream.
PYTHONPATH="$path:$root/python" SPEEDMLA_LIBRARY="$build/libspeedmla_tvm_ffi.so" \
TVM_FFI_DISABLE_TORCH_C_DLPACK=1 \
  exec "$python" -m pytest -q -rs -p no:cacheprovider -m "gpu or torch" "$root/tests/python"
