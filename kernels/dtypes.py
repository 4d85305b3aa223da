"""Dtype and reduction-op names shared by every backend.

The project names dtypes by string ("float32", "bfloat16", ...) everywhere;
this module maps those names to NumPy dtypes. bfloat16 uses ``ml_dtypes`` on
the host. Device backends (numba-cuda, cupy) hold bfloat16 as ``uint16`` bit
patterns because neither library knows the ml_dtypes type.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BF16,
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INT_DTYPES = ("int32", "int64")

OPS: tuple[str, ...] = ("sum", "max", "min")
OP_SUM, OP_MAX, OP_MIN = 0, 1, 2
#: The NumPy ufunc of each reduction op (host-side reductions everywhere).
UFUNCS: dict[str, Any] = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def np_dtype(name: str | np.dtype | type) -> np.dtype:
    """Return the NumPy dtype for a project dtype name (or a supported dtype)."""
    if isinstance(name, str):
        try:
            return DTYPES[name]
        except KeyError:
            raise ValueError(
                f"unknown dtype {name!r}; valid names: {', '.join(DTYPES)}"
            ) from None
    dt = np.dtype(name)
    if dt not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dt}; valid names: {', '.join(DTYPES)}")
    return dt


def dtype_name(dt: Any) -> str:
    """Inverse of :func:`np_dtype`: the project name of a supported dtype."""
    dt = np.dtype(dt)
    for name, d in DTYPES.items():
        if d == dt:
            return name
    raise ValueError(f"unsupported dtype {dt}; valid names: {', '.join(DTYPES)}")


def op_code(op: str) -> int:
    """Map "sum"/"max"/"min" to the small int code the compiled kernels use."""
    try:
        return OPS.index(op)
    except ValueError:
        raise ValueError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}") from None


def byte_view(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes as a uint8 array, no copy: what sockets and codecs are given
    (Python's buffer protocol has no code for bfloat16)."""
    return a.reshape(-1).view(np.uint8)
