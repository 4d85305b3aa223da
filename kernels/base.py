"""What every kernel backend is: the :class:`Backend` interface (the signatures
of :mod:`kernels.reference`), its availability record, and the error for one
that cannot run here. The registry that picks one is :mod:`kernels.backends`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import reference

if TYPE_CHECKING:
    from .reference import ToyDecoder


class BackendUnavailable(ValueError):
    """The requested backend cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class BackendInfo:
    """Availability of one backend, as shown by ``semfab info``."""

    name: str
    available: bool
    reason: str
    device: str


class Backend(ABC):
    """One implementation of every kernel, with the signatures of :mod:`kernels.reference`.

    Arrays are the backend's own (NumPy for CPU backends, device arrays on a
    GPU); device backends also accept host NumPy arrays and copy as needed,
    writing results back into host outputs. On device backends bfloat16 is
    held as uint16 bit patterns (``to_host`` restores the ml_dtypes type).
    """

    name: str = ""
    device: str = ""

    # --- data movement -------------------------------------------------
    @abstractmethod
    def asarray(self, a: np.ndarray) -> Any:
        """Copy (or wrap) a host array into this backend's memory."""

    @abstractmethod
    def to_host(self, a: Any) -> np.ndarray:
        """Return a host NumPy array (bfloat16 as ml_dtypes.bfloat16)."""

    def empty(self, shape: int | tuple[int, ...], dtype: str) -> Any:
        """Uninitialised array of a project dtype in this backend's memory."""
        from .dtypes import np_dtype

        return self.asarray(np.empty(shape, dtype=np_dtype(dtype)))

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU backends); use before timing."""
        return None

    # --- kernels ---------------------------------------------------------
    @abstractmethod
    def make_tensor(self, rank: int, step: int, count: int, dtype: str, seed: int = 0) -> Any:
        """See :func:`kernels.reference.make_tensor`."""

    @abstractmethod
    def multicast_reduce(self, srcs: Sequence[Any], dsts: Sequence[Any], op: str) -> None:
        """See :func:`kernels.reference.multicast_reduce`."""

    def reduce_pair(self, a: Any, b: Any, op: str) -> None:
        """``a = b = op(a, b)`` in place, for two 1-D contiguous arrays of one dtype
        and size (the memory plane's two-member reduction); backends with a
        cheaper call override it."""
        self.multicast_reduce([a, b], [a, b], op)

    def attention_fixed(self, q: Any, kk: Any, vv: Any, held: int, head0: int, group: int,
                        kv0: int, frac_bits: int) -> Any:
        """See :func:`kernels.reference.attention_fixed` (host int64 arrays in and
        out); backends without their own kernel run the reference."""
        return reference.attention_fixed(q, kk, vv, held, head0, group, kv0, frac_bits)

    def reduce_into(self, acc: Any, x: Any, op: str) -> None:
        """``acc = op(acc, x)`` in place; see :func:`kernels.reference.reduce_into`."""
        self.multicast_reduce([acc, x], [acc], op)

    def choose_scale(self, max_abs: float, contributors: int, bits: int = 32) -> float:
        """See :func:`kernels.reference.choose_scale` (host arithmetic, same everywhere)."""
        return reference.choose_scale(max_abs, contributors, bits)

    @abstractmethod
    def quantize(self, x: Any, scale: float, out_dtype: str = "int32") -> Any:
        """See :func:`kernels.reference.quantize`."""

    @abstractmethod
    def dequantize(self, q: Any, scale: float) -> Any:
        """See :func:`kernels.reference.dequantize`."""

    @abstractmethod
    def moe_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        """See :func:`kernels.reference.moe_topk`."""

    @abstractmethod
    def decoder_step(
        self,
        weights: ToyDecoder,
        tokens: Any,
        hidden: Any,
        positions: Any,
        temperature: float,
        seed: int,
    ) -> tuple[Any, Any]:
        """See :func:`kernels.reference.decoder_step`."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"


def cuda_simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is (or will be) active in this process."""
    try:
        from numba import config
    except Exception:
        return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    return bool(getattr(config, "ENABLE_CUDASIM", 0))
