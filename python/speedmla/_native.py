"""Loading the compiled module (libspeedmla_tvm_ffi.so) through apache-tvm-ffi, on first use.

Importing speedmla never loads it, so the package imports on machines without a GPU, without
PyTorch and even without a build; the first operation loads it and says how to build it if it
is missing.
"""

from __future__ import annotations

import os
import pathlib
import threading

LIBRARY_NAME = "libspeedmla_tvm_ffi.so"
# The wheel (pip install .) installs the module here, and scripts/setup.sh copies the built one
# here for the in-tree route (PYTHONPATH=python); SPEEDMLA_LIBRARY overrides (the CTest entries
# point it at the build folder).
_PACKAGED = pathlib.Path(__file__).resolve().parent / "_lib" / LIBRARY_NAME

_lock = threading.Lock()
_module = None


class Error(ValueError):
    """Raised for every invalid argument, unsupported configuration and CUDA failure.

    The message names the function, the argument and what was expected, e.g.
    ``mla_decode: kv_cache.shape[2] must be 576 (512 latent + 64 rope), got 512``.
    It is the Python face of the C++ ``speedmla::Error``.
    """


def library_path() -> pathlib.Path:
    """Where the compiled module is looked for: $SPEEDMLA_LIBRARY, else speedmla/_lib/."""
    override = os.environ.get("SPEEDMLA_LIBRARY")
    return pathlib.Path(override) if override else _PACKAGED


def lib():
    """The loaded tvm_ffi module (loaded once, thread-safe)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            path = library_path()
            if not path.is_file():
                raise Error(
                    f"speedmla: the compiled module {path} is missing; build it with "
                    "scripts/setup.sh (or set SPEEDMLA_LIBRARY to its path), or install the "
                    "package with `pip install .` from the repository"
                )
            import tvm_ffi  # noqa: PLC0415  (deferred: importing speedmla must stay cheap)

            tvm_ffi.register_error("speedmla.Error", Error)
            _module = tvm_ffi.load_module(str(path))
    return _module
