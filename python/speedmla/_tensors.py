"""Framework glue: what the operations need to know about PyTorch and NumPy arrays.

Tensors go to the compiled module as DLPack views, without copies. PyTorch is never imported
here: a torch.Tensor argument means the caller has imported it already. NumPy has no bfloat16
or float8 dtype, so NumPy callers hand such data over as bit patterns: a uint16 array where
bfloat16 data is expected and a uint8 array where float8_e4m3fn data is expected (no operation
takes those integer types otherwise), and outputs of those types come back as such bit arrays.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Sequence

from ._native import Error, lib

# NumPy storage of the dtypes NumPy lacks.
_NUMPY_BITS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8"}
_FROM_NUMPY_BITS = {bits: name for name, bits in _NUMPY_BITS.items()}
# The same by NumPy's one-letter type code: dtype.name is computed in Python (about 5 us a
# call), dtype.char is a plain attribute, and arg() runs for every array of every call.
_FROM_NUMPY_CHAR = {"H": "bfloat16", "B": "float8_e4m3fn"}  # uint16, uint8


@functools.cache
def _framework(cls: type) -> str:
    """The top-level package of an array type ("torch", "numpy", ...), worked out once per type:
    is_torch and is_numpy run for every array of every call."""
    return cls.__module__.split(".")[0]


def is_torch(x: Any) -> bool:
    return _framework(type(x)) == "torch"


def is_numpy(x: Any) -> bool:
    return _framework(type(x)) == "numpy"


def dtype_name(x: Any) -> str:
    """The dtype as speedmla names it ("bfloat16", "float8_e4m3fn", "int32", ...); NumPy bit
    arrays by the dtype they carry."""
    if is_torch(x):
        return str(x.dtype).removeprefix("torch.")
    if is_numpy(x):
        return _FROM_NUMPY_BITS.get(x.dtype.name, x.dtype.name)
    return str(x.dtype)


def shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def dims(x: Any, ndim: int, function: str, name: str) -> tuple[int, ...]:
    """The shape of `x`, which must have `ndim` dimensions (the operations read sizes from it
    to allocate outputs before the compiled module checks anything)."""
    s = tuple(x.shape)
    if len(s) != ndim:
        raise Error(f"{function}: {name} must have {ndim} dimensions, got shape {list(s)}")
    return s


def is_cuda(x: Any) -> bool:
    if is_torch(x):
        return x.is_cuda
    if is_numpy(x):
        return False
    return x.device.dlpack_device_type() != 1  # tvm_ffi.Tensor; kDLCPU is 1


# Types arg() passes through whatever the array holds (all but NumPy's), learnt as they come:
# one set lookup per array on the hot path instead of two calls.
_PASS_THROUGH: set[type] = {type(None)}


def arg(x: Any) -> Any:
    """`x` as the compiled module takes it: a NumPy bit array becomes a bfloat16 or float8
    view of the same memory; everything else passes through (tvm_ffi reads DLPack)."""
    cls = type(x)
    if cls in _PASS_THROUGH:
        return x
    if _framework(cls) != "numpy":
        _PASS_THROUGH.add(cls)
        return x
    if x.dtype.char in _FROM_NUMPY_CHAR:
        return lib().view_as_dtype(x, _FROM_NUMPY_CHAR[x.dtype.char])
    return x


def empty(like: Any, dims: Sequence[int], dtype: str) -> tuple[Any, Any]:
    """A new uninitialised array on `like`'s framework and device, and its `arg` form.

    PyTorch allocates through its caching allocator (so this is safe inside torch.cuda.graph
    capture); NumPy allocates on the host, bfloat16/float8 as uint16/uint8 bit arrays.
    """
    dims = tuple(int(d) for d in dims)
    if is_torch(like):
        torch = sys.modules["torch"]
        t = torch.empty(dims, dtype=getattr(torch, dtype), device=like.device)
        return t, t
    if is_numpy(like) or not is_cuda(like):
        import numpy as np  # noqa: PLC0415

        a = np.empty(dims, dtype=_NUMPY_BITS.get(dtype, dtype))
        return a, arg(a)
    raise Error(f"speedmla: cannot allocate a {dtype} array like a {type(like).__name__} on a "
                "GPU without PyTorch; pass the output array explicitly")


def reshape(x: Any, dims: Sequence[int]) -> Any:
    """A view of `x` with another shape; never a copy (writes through it must reach `x`)."""
    if is_torch(x):
        return x.view(*dims)
    if is_numpy(x):
        v = x.view()
        v.shape = tuple(dims)  # raises instead of copying when no view exists
        return v
    if tuple(x.shape) != tuple(dims):
        raise Error(f"speedmla: cannot reshape a {type(x).__name__} of shape {tuple(x.shape)} "
                    f"to {tuple(dims)}; pass a PyTorch or NumPy array")
    return x


def to_dtype(x: Any, dtype: str) -> Any:
    """`x` converted to `dtype` (PyTorch only; a no-op when it already has that dtype)."""
    if dtype_name(x) == dtype:
        return x
    if is_torch(x):
        return x.to(getattr(sys.modules["torch"], dtype))
    raise Error(f"speedmla: expected a {dtype} array, got {dtype_name(x)}")


def host_int32(x: Any) -> Any:
    """Lengths (a CPU or GPU tensor, an array or a list) as a contiguous int32 host array.
    Reading a GPU tensor waits for the device: only for the extend path, as the seed does."""
    if is_torch(x):
        return x.to("cpu").to(sys.modules["torch"].int32).contiguous()
    import numpy as np  # noqa: PLC0415

    return np.ascontiguousarray(x, dtype=np.int32)


def like(t: Any, reference: Any) -> Any:
    """A tensor returned by the compiled module (tvm_ffi.Tensor) as `reference`'s framework:
    a torch.Tensor or a NumPy array over the same memory (bfloat16/float8 as bit arrays)."""
    if is_torch(reference):
        return sys.modules["torch"].from_dlpack(t)
    import numpy as np  # noqa: PLC0415

    name = str(t.dtype)
    if name in _NUMPY_BITS:
        t = lib().view_as_dtype(t, _NUMPY_BITS[name])
    return np.from_dlpack(t)


def _is_array(x: Any) -> bool:
    return is_torch(x) or is_numpy(x) or hasattr(x, "__dlpack__")


# Parameters of the operations that are numbers or flags rather than tensors.
_FLAGS = ("causal", "return_lse", "dtype", "plan")  # plan: checked by mla_decode_with_plan itself
_INTS = ("cp_world", "cp_rank", "num_heads", "q_len", "page_size", "invariant_split_tokens")


def raise_argument_error(function: Callable, arguments: dict, failure: Exception) -> None:
    """Called by an operation whose body raised `failure` (its `except` clause, which costs
    nothing until something is raised): re-raises it as an :class:`Error` naming the argument
    when a tensor argument is not an array (a list, None, a number) or a scale is not a number,
    which otherwise fail deep in the call naming nothing of it; re-raises it unchanged otherwise
    (a speedmla.Error among them). `arguments` is the operation's locals()."""
    if isinstance(failure, Error):
        raise failure
    for name, parameter in inspect.signature(function).parameters.items():
        value = arguments.get(name)
        if name in _FLAGS:
            continue
        if name in _INTS:
            if not isinstance(value, int):
                raise Error(f"{function.__name__}: {name} must be an int, got {type(value).__name__}") from failure
            continue
        if "scale" in name:
            try:
                float(value)
            except (TypeError, ValueError):
                raise Error(f"{function.__name__}: {name} must be a number, got "
                            f"{type(value).__name__}") from failure
            continue
        required = parameter.default is inspect.Parameter.empty
        if (value is not None and not _is_array(value)) or (value is None and required):
            raise Error(f"{function.__name__}: {name} must be a torch.Tensor, a numpy.ndarray or a "
                        f"DLPack tensor, got {type(value).__name__}") from failure
    raise failure
