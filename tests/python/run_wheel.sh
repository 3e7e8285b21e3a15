#!/usr/bin/env bash
# The Python tests against the installed wheel: a fresh virtual environment, speedmla's wheel
# installed into it with its requirements, the tests' own requirements (pins of
# scripts/setup.sh) where missing, then pytest from outside the source tree with neither
# PYTHONPATH nor SPEEDMLA_LIBRARY, so `import speedmla` must find the installed package
# (SPEEDMLA_EXPECT_INSTALLED makes tests/python/test_import.py check that it did).
#
#   tests/python/run_wheel.sh [--build] [--offline] [--system-site-packages] [--wheels DIR]
#                             [-- pytest arguments]
#
# --build         build the wheel first (scripts/build_wheel.sh --no-downloads) into a temporary
#                 folder; otherwise the wheel is taken from --wheels (default .whl/).
# --offline       install from --wheels only (pip --no-index): the GPU machine, no internet.
# --system-site-packages  the environment sees the system's packages (the GPU machine's PyTorch).
# The CTest python_wheel runs `--build -- -m "not gpu"`; scripts/gpu-check.sh --wheel runs
# `--offline --system-site-packages`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
build=0 wheels="$root/.whl" pip_index=() venv_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=1 ;;
    --offline) pip_index=(--no-index) ;;
    --system-site-packages) venv_args=(--system-site-packages) ;;
    --wheels) wheels=$(cd "$2" && pwd); shift ;;
    --) shift; break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

work=$(mktemp -d "${TMPDIR:-/tmp}/speedmla-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ "$build" = 1 ]; then
  wheels="$work/dist"
  SPEEDMLA_WHEEL_DIR="$wheels" "$root/scripts/build_wheel.sh" --no-downloads
fi
shopt -s nullglob
found=("$wheels"/speedmla-*.whl)
if [ ${#found[@]} -ne 1 ]; then
  echo "run_wheel.sh: expected one speedmla-*.whl in $wheels, found ${#found[@]}" \
       "(scripts/build_wheel.sh builds it)" >&2
  exit 2
fi

venv_python="$work/venv/bin/python"
if "$python" -m venv "${venv_args[@]}" "$work/venv" 2> "$work/venv.log"; then
  pip=("$venv_python" -m pip)
else
  # A Python without ensurepip (Debian's without python3-venv): an environment without a pip of
  # its own, filled by this Python's pip (pip >= 22.3 has --python).
  rm -rf "$work/venv"
  "$python" -m venv --without-pip "${venv_args[@]}" "$work/venv"
  pip=("$python" -m pip --python "$venv_python")
fi
pip+=(install --quiet --disable-pip-version-check "${pip_index[@]}" --find-links "$wheels")
# --system-site-packages reaches the *base* interpreter's packages. When the creating Python is
# itself a virtual environment (the GPU machine's python3 is /opt/torch/.venv/bin/python3, where
# PyTorch and NumPy live), its own site-packages are added with a .pth file, after the new
# environment's (which therefore win).
if [ ${#venv_args[@]} -gt 0 ]; then
  own_site=$("$python" -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')
  if [ -n "$own_site" ]; then
    venv_site=$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$own_site" > "$venv_site/_speedmla_parent_env.pth"
  fi
fi
# The wheel by its file (a package of that name on an index must not win), its requirements
# (apache-tvm-ffi) resolved by pip from its metadata.
"${pip[@]}" "${found[0]}"
# The tests' requirements, pinned by setup.sh; those the environment has already (the GPU
# machine's NumPy, with PyTorch) are kept.
setup="$root/scripts/setup.sh"
eval "$(sed -n 's/^\([A-Z_]*_VERSION\)=\([^ ]*\).*/\1=\2/p' "$setup")"
pin() { eval echo "$(sed -n "s/^install_pip \"\($1==[^\"]*\)\".*/\1/p" "$setup")"; }
missing=()
"$venv_python" -c "import numpy" 2>/dev/null || missing+=("$(pin numpy)")
"$venv_python" -c "import pytest" 2>/dev/null ||
  missing+=("$(pin pytest)" "$(pin iniconfig)" "$(pin pluggy)" "$(pin packaging)")
if [ ${#missing[@]} -gt 0 ]; then "${pip[@]}" --no-deps "${missing[@]}"; fi

# TVM_FFI_DISABLE_TORCH_C_DLPACK: no JIT build of tvm_ffi's optional PyTorch addon (as
# tests/python/run_gpu.sh); the run starts in the temporary folder, away from python/.
cd "$work"
env -u PYTHONPATH -u SPEEDMLA_LIBRARY SPEEDMLA_EXPECT_INSTALLED=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 \
  "$venv_python" -m pytest -q -rs -p no:cacheprovider "$root/tests/python" "$@"
