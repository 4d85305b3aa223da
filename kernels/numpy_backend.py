"""The ``numpy`` backend: the reference functions behind the Backend interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import reference
from .base import Backend
from .reference import ToyDecoder


class NumpyBackend(Backend):
    """Runs :mod:`kernels.reference` directly (host arrays, always available)."""

    name = "numpy"
    device = "cpu (NumPy reference)"

    def asarray(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a)

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def make_tensor(self, rank: int, step: int, count: int, dtype: str, seed: int = 0) -> Any:
        return reference.make_tensor(rank, step, count, dtype, seed)

    def multicast_reduce(self, srcs: Sequence[Any], dsts: Sequence[Any], op: str) -> None:
        reference.multicast_reduce(srcs, dsts, op)

    def quantize(self, x: Any, scale: float, out_dtype: str = "int32") -> Any:
        return reference.quantize(x, scale, out_dtype)

    def dequantize(self, q: Any, scale: float) -> Any:
        return reference.dequantize(q, scale)

    def moe_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        return reference.moe_topk(logits, k)

    def decoder_step(
        self,
        weights: ToyDecoder,
        tokens: Any,
        hidden: Any,
        positions: Any,
        temperature: float,
        seed: int,
    ) -> tuple[Any, Any]:
        return reference.decoder_step(weights, tokens, hidden, positions, temperature, seed)
