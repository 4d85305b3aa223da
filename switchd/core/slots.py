"""One aggregation job's slot state: the engine's memory and bitmaps for it.

Lists are indexed by ``2 * slot + version`` (:mod:`switchd.core.engine` explains
the slot algorithm). The frame plane reduces into ``mem``; a memory-plane job
(``JobSpec.referenced``) keeps bitmaps and lengths only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np

from kernels.dtypes import UFUNCS as _OP_UFUNCS
from switchd.core.events import DTYPES, AggOp, JobSpec

__all__ = ["JobSlots", "absmax"]

_UFUNCS: Final[dict[AggOp, Callable[..., Any]]] = {op: _OP_UFUNCS[op.value] for op in AggOp}




def absmax(a: np.ndarray) -> int:
    """The largest magnitude in ``a``, as a Python int."""
    # Python ints: -INT_MIN does not fit the dtype, and the bound must not wrap.
    return max(int(a.max()), -int(a.min()))


class JobSlots:
    """Per-job slot state. Lists indexed by ``2 * slot + version``."""

    __slots__ = (
        "overflowed",
        "spec",
        "slots",
        "elems",
        "dtype",
        "ufunc",
        "mem",
        "bits",
        "full",
        "held",
        "bitmap",
        "length",
        "bound",
        "int_max",
        "scratch",
        "nbytes",
    )

    def __init__(self, spec: JobSpec, mem: np.ndarray | None, nbytes: int) -> None:
        s = spec.slots
        self.spec = spec
        self.slots = s
        self.elems = spec.slot_elems
        self.dtype = DTYPES[spec.dtype]
        self.ufunc = _UFUNCS[spec.op]
        self.mem = mem
        self.nbytes = nbytes
        self.bits = {m: 1 << i for i, m in enumerate(spec.members)}
        self.full = (1 << len(spec.members)) - 1
        # Each version starts as if it held the *completed* chunk c - 2S for its
        # first chunk c = slot + version*S: the reuse rule then needs no special
        # case for fresh slots, and a first chunk >= 2S is rightly out of window.
        self.held = [(i >> 1) + (i & 1) * s - 2 * s for i in range(2 * s)]
        self.bitmap = [self.full] * (2 * s)
        self.length = [0] * (2 * s)
        # Integer SUM only: a bound on max|partial sum| per slot version, to
        # prove cheaply that the next add cannot wrap.
        sum_int = spec.op is AggOp.SUM and self.dtype.kind == "i" and mem is not None
        self.int_max = int(np.iinfo(self.dtype).max) if sum_int else 0
        self.bound = [0] * (2 * s) if sum_int else []
        self.scratch: np.ndarray | None = None
        # per slot version: why its chunk ended in an overflow (None: it did not)
        self.overflowed: list[str | None] = [None] * (2 * s)

    def view(self, idx: int, n: int) -> np.ndarray | None:
        if self.mem is None:
            return None
        v = self.mem[idx >> 1, idx & 1, :n]
        v.flags.writeable = False  # the daemon must not scribble on slot memory
        return v

    def add_int_checked(self, dst: np.ndarray, data: np.ndarray, idx: int) -> str | None:
        """Integer sum that never wraps silently; returns a reason when it would."""
        m = absmax(data)
        bound = self.bound[idx] + m
        if bound <= self.int_max:
            np.add(dst, data, out=dst)
            self.bound[idx] = bound
            return None
        # Rare path: the cheap bound failed; check element-wise with two scratch
        # rows (allocated once per job) before touching the slot.
        n = dst.shape[0]
        if self.scratch is None:
            self.scratch = np.empty((2, self.elems), dtype=self.dtype)
        s, t = self.scratch[0, :n], self.scratch[1, :n]
        np.add(dst, data, out=s)  # wrapping sum
        # Overflow iff both operands have the sign the wrapped sum lacks.
        np.bitwise_xor(dst, s, out=t)
        np.bitwise_xor(data, s, out=s)
        np.bitwise_and(t, s, out=t)
        if int(t.min()) < 0:
            i = int(np.argmax(t < 0))
            return (
                f"{self.dtype.name} sum would wrap at element {i} "
                f"({int(dst[i])} + {int(data[i])}); workers must scale to leave "
                f"headroom for {len(self.bits)} members"
            )
        np.add(dst, data, out=dst)
        self.bound[idx] = absmax(dst)
        return None


# --------------------------------------------------------------------- engine


