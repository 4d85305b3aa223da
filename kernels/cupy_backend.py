"""The ``cupy`` backend: the array-API backend on CuPy (GPU arrays).

Methods accept CuPy or NumPy arrays; host outputs get results copied back.
bfloat16 lives on the GPU as uint16 bit patterns. Import this module only
through :func:`kernels.get_backend`, which checks that cupy and a GPU exist.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .xp_backend import ArrayModuleBackend


class CupyBackend(ArrayModuleBackend):
    """CuPy on CUDA device 0."""

    def __init__(self) -> None:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        super().__init__(cupy, "cupy", f"cuda:0 {name}")

    def _get(self, a: Any) -> np.ndarray:
        return np.asarray(self.xp.asnumpy(a))

    def synchronize(self) -> None:
        self.xp.cuda.Device().synchronize()
