"""Allreduce compositions the emulation driver builds from programs.

The four paths themselves (``ina``, ``ina-mem``, ``host-ps``, ``host-ring``)
are pure programs in :mod:`fabric.programs`, run by
:meth:`fabric.endpoint.Endpoint.run` (and by the simulator). What stays here
needs the emulated node's registered memory: the memory plane's scratch
region, and fixed-point numerics on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fabric.errors import UsageError
from fabric.programs import HOST_PS_FLOW, RING_FLOW

if TYPE_CHECKING:
    from fabric.endpoint import Endpoint

__all__ = ["HOST_PS_FLOW", "RING_FLOW", "allreduce_fixed", "scratch_region"]


def scratch_region(ep: Endpoint, nbytes: int) -> np.ndarray:
    """A registered byte region of at least ``nbytes``, reused across calls."""
    if ep.scratch is None or ep.scratch.nbytes < nbytes:
        ep.scratch = ep.alloc(-(-nbytes // 8), "int64").view(np.uint8)
    return ep.scratch[:nbytes]


def allreduce_fixed(ep: Endpoint, x: np.ndarray, out: np.ndarray, path: str,
                    group: Any = None) -> None:
    """Sum float32 ``x`` as fixed-point int32 (see :func:`fabric.programs.fixed_program`).

    The memory plane's integers must live in a registered region, so that path
    is composed here; every other path runs the pure program.
    """
    from fabric.programs import (
        Tensor,
        fixed_dequantize,
        fixed_maxima,
        fixed_program,
        fixed_quantize,
    )

    if x.dtype != np.float32:
        raise UsageError("fixed-point numerics take float32 tensors")
    if path != "ina-mem":
        ep.run(fixed_program(ep.state, Tensor(x.size, "float32", x, out), path, group),
               f"allreduce {path} (fixed point)")
        return
    maxima = fixed_maxima(x)
    # the scalar agreement travels in-network too (ina: a few bytes are not worth a region)
    ep.allreduce(maxima, op="max", path="ina", out=maxima, group=group)
    q = _scratch_ints(ep, x.size)
    size = group.size if group is not None else ep.world
    scales = fixed_quantize(x, maxima, size, q)
    ep.allreduce(q, op="sum", path=path, out=q, group=group)
    fixed_dequantize(q, scales, out)


def _scratch_ints(ep: Endpoint, n: int) -> np.ndarray:
    """A registered int32 region for the memory plane's fixed-point sum."""
    if ep.fixed_scratch is None or ep.fixed_scratch.size < n:
        ep.fixed_scratch = ep.alloc(n, "int32")
    return ep.fixed_scratch[:n]
