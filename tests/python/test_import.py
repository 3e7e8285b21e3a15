"""The package imports, and runs on the CPU, without PyTorch and without a GPU."""

import os
import pathlib
import subprocess
import sys

import pytest

import speedmla


def run_python(code: str) -> subprocess.CompletedProcess:
    # CUDA_VISIBLE_DEVICES="" hides any GPU; sys.modules["torch"] = None makes `import torch` fail.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=False)


def test_imports_without_torch_or_gpu_and_runs_on_the_cpu():
    result = run_python(
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import numpy as np, speedmla\n"
        "assert 'tvm_ffi' not in sys.modules, 'import must not load the native module'\n"
        "codes = speedmla.quantize_fp8(np.array([1.0, -2.5, 1000.0], np.float32))\n"
        "assert codes.dtype == np.uint8 and codes.tolist() == [0x38, 0xC2, 0x7E], codes\n"
        "print('ok')\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_import_leaves_pytorch_alone():
    """`import speedmla` never imports PyTorch (slow, and optional); speedmla.torch_ops does."""
    result = run_python("import sys, speedmla\n"
                        "assert 'torch' not in sys.modules and 'speedmla.torch_ops' not in sys.modules\n"
                        "print('ok')\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_public_names():
    for name in ("mla_decode", "mla_prefill", "merge_attn_states", "kv_cache_write", "gather_cache",
                 "quantize_fp8", "pack_prefill_kv", "MlaBackend", "MlaBackendConfig", "ForwardMode",
                 "Error"):
        assert hasattr(speedmla, name), name
        assert getattr(speedmla, name).__doc__, f"{name} has no docstring"
    assert issubclass(speedmla.Error, ValueError)


def test_missing_library_is_reported_clearly():
    result = subprocess.run(
        [sys.executable, "-c", "import speedmla, numpy as np\n"
         "try:\n    speedmla.quantize_fp8(np.zeros(2, np.float32))\n"
         "except speedmla.Error as e:\n    print(e)\n"],
        env=dict(os.environ, SPEEDMLA_LIBRARY="/nonexistent/libspeedmla_tvm_ffi.so"),
        capture_output=True, text=True, check=False)
    assert "is missing; build it with scripts/setup.sh" in result.stdout, result.stdout + result.stderr
    assert "pip install" in result.stdout, result.stdout


def test_installed_package_is_the_one_imported():
    """Under tests/python/run_wheel.sh (SPEEDMLA_EXPECT_INSTALLED=1): speedmla and its compiled
    module come from the installed wheel, not from the source tree or a build folder."""
    if not os.environ.get("SPEEDMLA_EXPECT_INSTALLED"):
        pytest.skip("runs against an installed wheel (tests/python/run_wheel.sh)")
    package = pathlib.Path(speedmla.__file__).resolve().parent
    assert "site-packages" in package.parts, package
    assert "SPEEDMLA_LIBRARY" not in os.environ
    assert speedmla.library_path() == package / "_lib" / "libspeedmla_tvm_ffi.so"
    assert speedmla.library_path().is_file()
    source_tree = pathlib.Path(__file__).resolve().parents[2]
    assert source_tree not in package.parents, package
