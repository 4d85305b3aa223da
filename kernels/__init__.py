"""Kernels of semfab: seeded tensors, reductions, fixed point, MoE gating, a toy decoder.

One NumPy reference per kernel (:mod:`kernels.reference`, the spec) and the
same methods on every backend: ``numpy``, ``numba-cpu``, ``numba-cuda``,
``cupy``. Pick one with :func:`get_backend` (``"auto"`` by default).
"""

from .backends import (
    Backend,
    BackendInfo,
    BackendUnavailable,
    describe_backends,
    get_backend,
    gpu_info,
)
from .dtypes import DTYPES, OPS, np_dtype
from .reference import ToyDecoder, count_wrong, expected_allreduce

__all__ = [
    "DTYPES",
    "OPS",
    "Backend",
    "BackendInfo",
    "BackendUnavailable",
    "ToyDecoder",
    "count_wrong",
    "describe_backends",
    "expected_allreduce",
    "get_backend",
    "gpu_info",
    "np_dtype",
]
