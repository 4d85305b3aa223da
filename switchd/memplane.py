"""The emulated memory plane: shared-memory regions mapped by the switch.

Injected into :class:`switchd.core.SwitchCore` by the daemon. A region is a
file in /dev/shm the worker created; the switch maps it and runs one fused
load-reduce-store kernel (``kernels.multicast_reduce``) over the members'
chunks, the NVLink SHARP ``ld_reduce``/``st`` model.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fabric.shm import SharedRegion


class SharedMemoryPlane:
    """Regions by key, mapped from shared-memory files; the kernel loaded on demand."""

    def __init__(self, backend: str = "numba-cpu") -> None:
        self.backend_name = backend
        self._kernel: Any = None
        self._mapped: dict[int, SharedRegion] = {}
        self.reduce_seconds = 0.0  # time in the fused kernel (driver-side: it reads a clock)

    def prepare(self, backend: str) -> None:
        """Load the reduction kernel a job asks for; ValueError for an unknown one."""
        if self._kernel is not None:
            return
        from kernels.backends import get_backend

        try:
            self._kernel = get_backend(backend)
        except Exception as exc:  # unknown or unavailable: the job is refused
            raise ValueError(f"kernel backend {backend!r}: {exc}") from None
        self.backend_name = backend

    def attach(self, key: int, path: str, size: int) -> None:
        """Map the region file at ``path`` (OSError / ValueError when it cannot be)."""
        self._mapped[key] = SharedRegion.attach(path, size)

    def detach(self, key: int) -> None:
        """Unmap region ``key`` (unknown keys are ignored)."""
        region = self._mapped.pop(key, None)
        if region is not None:
            region.close()

    def reduce(self, dtype: np.dtype[Any], op: str, refs: list[tuple[int, int]],
               count: int) -> None:
        """ld_reduce from every ``(key, offset)``, st the result into every one."""
        if self._kernel is None:
            self.prepare(self.backend_name)
        arrays = [self._mapped[key].array(dtype, count, offset) for key, offset in refs]
        t0 = time.perf_counter()
        self._kernel.multicast_reduce(arrays, arrays, op)
        self.reduce_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Unmap every region."""
        for region in self._mapped.values():
            region.close()
        self._mapped.clear()
