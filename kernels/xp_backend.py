"""A backend written against the NumPy array API, parameterised by module (``xp``).

The ``cupy`` backend is this class with ``xp = cupy``. With ``xp = numpy`` it
runs on the CPU, which is how its logic (bfloat16 as uint16 bits, stable
top-k keys, hashing with array ops) is tested on machines without a GPU.
It uses only array operations CuPy implements with NumPy semantics, and
spells out ``max``/``min`` with ``where`` so the sign of zero matches NumPy.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import reference
from .base import Backend
from .dtypes import BF16, DTYPES, FLOAT_DTYPES, dtype_name, np_dtype, op_code
from .reference import _U1, _U16, GOLDEN, QUANT_MAX, TENSOR_SPEC, ToyDecoder, mix64

_U32_16 = np.uint32(16)


class ArrayModuleBackend(Backend):
    """Every kernel as whole-array operations of the module ``xp``."""

    def __init__(self, xp: Any, name: str, device: str) -> None:
        self.xp = xp
        self.name = name
        self.device = device
        self._weights: weakref.WeakKeyDictionary[ToyDecoder, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )

    # --- data movement -------------------------------------------------
    def _is_native(self, a: Any) -> bool:
        if self.xp is np:
            return isinstance(a, np.ndarray) and a.dtype != BF16
        return isinstance(a, self.xp.ndarray)

    def _get(self, a: Any) -> np.ndarray:
        """Device array -> host array (raw dtype)."""
        return np.asarray(a)

    def asarray(self, a: np.ndarray) -> Any:
        if self._is_native(a):
            return a
        h = np.ascontiguousarray(a)
        return self.xp.asarray(h.view(np.uint16) if h.dtype == BF16 else h)

    def to_host(self, a: Any) -> np.ndarray:
        h = a if isinstance(a, np.ndarray) else self._get(a)
        return h.view(BF16) if h.dtype == np.uint16 else h

    def empty(self, shape: int | tuple[int, ...], dtype: str) -> Any:
        dt = np_dtype(dtype)
        return self.xp.empty(shape, dtype=np.uint16 if dt == BF16 else dt)

    # --- bfloat16 as uint16 bits ----------------------------------------
    def _bf16_widen(self, b: Any) -> Any:
        return (b.astype(self.xp.uint32) << _U32_16).view(self.xp.float32)

    def _bf16_narrow(self, f: Any) -> Any:
        xp = self.xp
        u = f.astype(xp.float32).view(xp.uint32)
        rounded = (u + np.uint32(0x7FFF) + ((u >> _U32_16) & np.uint32(1))) >> _U32_16
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        return xp.where(nan, (u >> _U32_16) | np.uint32(0x40), rounded).astype(xp.uint16)

    def _widen(self, a: Any) -> Any:
        if a.dtype == np.uint16:
            return self._bf16_widen(a)
        if a.dtype == np.float16:
            return a.astype(self.xp.float32)
        return a

    def _narrow(self, acc: Any, dt: np.dtype) -> Any:
        if dt == np.uint16:
            return self._bf16_narrow(acc)
        return acc.astype(dt, copy=False)

    # --- kernels ---------------------------------------------------------
    def make_tensor(self, rank: int, step: int, count: int, dtype: str, seed: int = 0) -> Any:
        xp = self.xp
        name = dtype_name(np_dtype(dtype))
        count = reference._check_count(count)
        bits, shift = TENSOR_SPEC[name]
        key = np.uint64(reference.tensor_key(seed, rank, step))
        h = mix64(key + (xp.arange(count, dtype=xp.uint64) + _U1) * GOLDEN)
        mag = ((h >> _U16) & np.uint64((1 << bits) - 1)).astype(xp.int64) + 1
        v = xp.where((h & _U1).astype(bool), -mag, mag)
        if name not in FLOAT_DTYPES:
            return v.astype(DTYPES[name])
        f = (v.astype(xp.float64) * 2.0**-shift).astype(xp.float32)
        if name == "bfloat16":
            return self._bf16_narrow(f)
        return f.astype(DTYPES[name])

    def multicast_reduce(self, srcs: Sequence[Any], dsts: Sequence[Any], op: str) -> None:
        xp = self.xp
        code = op_code(op)
        devs: dict[int, Any] = {}
        for a in list(srcs) + list(dsts):
            if id(a) not in devs:
                devs[id(a)] = self.asarray(a)
        dsrc = [devs[id(a)] for a in srcs]
        ddst = [devs[id(a)] for a in dsts]
        _, dt = reference.check_multicast(dsrc, ddst)
        acc = self._widen(dsrc[0]).copy()  # a copy: aliasing between srcs and dsts is harmless
        for s in dsrc[1:]:
            w = self._widen(s)
            if code == 0:
                xp.add(acc, w, out=acc)
            elif code == 1:
                acc = xp.where((acc > w) | (acc != acc), acc, w)
            else:
                acc = xp.where((acc < w) | (acc != acc), acc, w)
        res = self._narrow(acc, dt)
        for d in ddst:
            d[...] = res
        if xp is not np:  # host outputs get the result copied back
            for a in dsts:
                if isinstance(a, np.ndarray):
                    a[...] = self.to_host(devs[id(a)])

    def quantize(self, x: Any, scale: float, out_dtype: str = "int32") -> Any:
        xp = self.xp
        scale = reference._check_scale(scale)
        name = reference.quant_dtype(out_dtype)
        dx = self.asarray(np.asarray(x, dtype=np.float32) if isinstance(x, np.ndarray) else x)
        v = self._widen(dx).astype(xp.float32).astype(xp.float64) * scale
        v = xp.where(xp.isnan(v), 0.0, v)
        lim = QUANT_MAX[name]
        return xp.rint(xp.clip(v, -lim, lim)).astype(DTYPES[name])

    def dequantize(self, q: Any, scale: float) -> Any:
        scale = reference._check_scale(scale)
        dq = self.asarray(q)
        return (dq.astype(self.xp.float64) / scale).astype(self.xp.float32)

    def moe_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        xp = self.xp
        x = self._widen(
            self.asarray(
                np.asarray(logits, dtype=np.float32) if isinstance(logits, np.ndarray) else logits
            )
        ).astype(xp.float32)
        k = reference.check_topk(tuple(x.shape), k)
        # Sort a unique uint64 key per entry: high half orders by descending
        # value (-0.0 folded into +0.0), low half is the expert index, so ties
        # go to the lower index without relying on a stable sort.
        u = (x + np.float32(0.0)).view(xp.uint32)
        neg = (u >> np.uint32(31)).astype(bool)
        ascending = xp.where(neg, ~u, u | np.uint32(0x80000000))
        desc = (~ascending).astype(xp.uint64)
        idx = xp.arange(x.shape[1], dtype=xp.uint64)
        keys = xp.sort((desc << np.uint64(32)) | idx[None, :], axis=1)[:, :k]
        ids = (keys & np.uint64(0xFFFFFFFF)).astype(xp.int32)
        sel = xp.take_along_axis(x, ids.astype(xp.int64), axis=1).astype(xp.float64)
        e = xp.exp(sel - sel[:, :1])
        total = xp.cumsum(e, axis=1)[:, -1:]
        return ids, (e / total).astype(xp.float32)

    def _weights_on_device(self, weights: ToyDecoder) -> tuple[Any, Any]:
        if weights not in self._weights:
            self._weights[weights] = (
                self.xp.asarray(weights.embedding),
                self.xp.asarray(weights.projection64),
            )
        return self._weights[weights]

    def decoder_step(
        self,
        weights: ToyDecoder,
        tokens: Any,
        hidden: Any,
        positions: Any,
        temperature: float,
        seed: int,
    ) -> tuple[Any, Any]:
        xp = self.xp
        tok, hid, pos, t = reference.check_decoder_args(
            weights, self.to_host(tokens), self.to_host(hidden), self.to_host(positions),
            temperature,
        )
        emb, w64 = self._weights_on_device(weights)
        dtok, dhid = xp.asarray(tok), xp.asarray(hid)
        x = 0.5 * dhid.astype(xp.float64) + emb[dtok].astype(xp.float64)
        new_hidden = xp.tanh(x).astype(xp.float32)
        # A BLAS matmul sums in its own order: results match the reference
        # except (in principle) at float64 near-ties.
        scores = new_hidden.astype(xp.float64) @ w64
        if t > 0:
            base = np.uint64(reference.derive_key(reference.TAG_GUMBEL, seed))
            b = xp.arange(tok.shape[0], dtype=xp.uint64)
            dpos = xp.asarray(pos).astype(xp.int64).astype(xp.uint64)
            keys = mix64(mix64(base ^ b) ^ dpos)
            v = xp.arange(weights.vocab, dtype=xp.uint64)
            h = mix64(keys[:, None] + (v[None, :] + _U1) * GOLDEN)
            u = ((h >> np.uint64(11)).astype(xp.float64) + 0.5) * 2.0**-53
            scores = scores / t + -xp.log(-xp.log(u))
        return xp.argmax(scores, axis=1).astype(xp.int32), new_hidden


def numpy_array_module_backend() -> ArrayModuleBackend:
    """The array-API backend on NumPy: exercises the cupy code path without a GPU."""
    return ArrayModuleBackend(np, "xp-numpy", "cpu (array-API code path of the cupy backend)")

