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

from fabric.emulation.shm import SHM_DIR, SharedRegion, region_name
from kernels.reference import sum_wrap

#: Chunk views kept (each a few hundred bytes); beyond it they are made anew.
VIEWS_KEPT = 4096
#: Chunks up to this size are reduced on the switch's own thread, not the
#: kernel's pool. Below the workers' spin limit (fabric.emulation.doorbell.SPIN_MAX_BYTES)
#: they spin on the other cores, and a pool thread there waits behind them: at
#: 2 workers on 2 cores (4 launches each, medians of 3 rounds of 60 calls in
#: place), 256 KiB took 193-261 us serial against 238-338 us with the pool and
#: 512 KiB 212-333 against 232-308, while 1 MiB was 303-415 against 307-392
#: (docs/BENCHMARKS.md, "The switch's kernel below 1 MiB").
SERIAL_MAX_BYTES = 512 * 1024


class SharedMemoryPlane:
    """Regions by key, mapped from shared-memory files; the kernel loaded on demand."""

    def __init__(self, backend: str = "numba-cpu", run_id: str | None = None) -> None:
        self.backend_name = backend
        self.run_id = run_id  # when set, regions of other runs are refused
        self._kernel: Any = None
        self._mapped: dict[int, SharedRegion] = {}
        # array views of the chunks reduced so far, by (key, offset, count, dtype):
        # a call reduces the same chunks of the same regions again, and making a
        # view costs more than reducing 4 KiB
        self._views: dict[tuple[int, int, int], np.ndarray] = {}
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
        if hasattr(self._kernel, "serial_bytes"):
            # the process's shared backend: in a switch daemon the plane is its only user
            self._kernel.serial_bytes = SERIAL_MAX_BYTES

    def attach(self, key: int, owner: str, run: str, size: int) -> None:
        """Map node ``owner``'s region ``key`` of run ``run``: the file the fabric made
        for it, nothing else (OSError / ValueError when it cannot be)."""
        if self.run_id is not None and run != self.run_id:
            raise ValueError(f"region of run {run!r}: this switch serves run {self.run_id!r}")
        region = SharedRegion.attach_checked(SHM_DIR / region_name(run, owner, key), size)
        self._forget_views(key)  # a key mapped anew: its old views are of the old map
        self._mapped[key] = region

    def detach(self, key: int) -> None:
        """Unmap region ``key`` (unknown keys are ignored)."""
        region = self._mapped.pop(key, None)
        if region is not None:
            self._forget_views(key)
            region.close()

    def _forget_views(self, key: int) -> None:
        if any(k[0] == key for k in self._views):
            self._views = {k: v for k, v in self._views.items() if k[0] != key}

    def reduce(self, dtype: np.dtype[Any], op: str, refs: list[tuple[int, int]],
               count: int) -> str | None:
        """ld_reduce from every ``(key, offset)``, st the result into every one; an
        integer sum that would wrap stores nothing and says why."""
        if self._kernel is None:
            self.prepare(self.backend_name)
        views = self._views
        arrays = []
        for key, offset in refs:
            v = views.get((key, offset, count))
            if v is None or v.dtype is not dtype:  # (hashing a dtype per chunk costs)
                if len(views) >= VIEWS_KEPT:
                    views.clear()
                v = views[(key, offset, count)] = self._mapped[key].array(
                    dtype, count, offset)
            arrays.append(v)
        if op == "sum" and dtype.kind == "i":
            wrap = sum_wrap(arrays)
            if wrap is not None:
                return wrap
        t0 = time.perf_counter()
        if len(arrays) == 2:  # views this plane made: 1-D, contiguous, one dtype
            self._kernel.reduce_pair(arrays[0], arrays[1], op)
        else:
            self._kernel.multicast_reduce(arrays, arrays, op)
        self.reduce_seconds += time.perf_counter() - t0
        return None

    def close(self) -> None:
        """Unmap every region."""
        self._views.clear()
        for region in self._mapped.values():
            region.close()
        self._mapped.clear()
