"""Scalar element functions shared by the numba-cpu and numba-cuda kernels.

These are plain Python written in the subset Numba compiles for both
targets. :func:`build` compiles one copy per target: each function is cloned
with a globals dict where its siblings are the compiled versions, so
``counter_hash`` calls the compiled ``mix64`` on that target. Functions that
need a target-specific primitive (the float32 <-> uint32 bit casts) get it
through ``overrides``. Writing the math once keeps the CPU and GPU results
bitwise identical; the numba-cpu tests check these against NumPy.

The default bit casts use ``ndarray.view`` on NumPy scalars, which is what
the CUDA simulator runs (it executes kernels as Python).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from .reference import _U1, _U11, _U16, GOLDEN, mix64

_U32_16 = np.uint32(16)
_TWO_M53 = 2.0**-53
_TWO_M24 = 2.0**-24
_TWO_24 = 16777216.0
_TWO_52 = 4503599627370496.0


def f32_from_bits(u: Any) -> Any:
    """Reinterpret a uint32 bit pattern as float32."""
    return np.uint32(u).view(np.float32)


def bits_from_f32(f: Any) -> Any:
    """Reinterpret a float32 as its uint32 bit pattern."""
    return np.float32(f).view(np.uint32)


def counter_hash(key: Any, i: Any) -> Any:
    """Element ``i`` of stream ``key``: ``mix64(key + (i + 1) * GOLDEN)``."""
    return mix64(key + (np.uint64(i) + _U1) * GOLDEN)


def tensor_int(key: Any, i: Any, mask: Any) -> Any:
    """The signed integer ``+-m`` of make_tensor element ``i`` (see reference)."""
    h = counter_hash(key, i)
    mag = np.int64((h >> _U16) & mask) + 1
    if h & _U1:
        return -mag
    return mag


def unit_float(h: Any) -> Any:
    """uint64 hash -> float64 in (0, 1)."""
    return (np.float64(h >> _U11) + 0.5) * _TWO_M53


def row_key(base: Any, b: Any, pos: Any) -> Any:
    """Continue ``derive_key`` on the device: ``mix64(mix64(base ^ b) ^ pos)``."""
    return mix64(mix64(base ^ np.uint64(b)) ^ np.uint64(pos))


def gumbel(key: Any, v: Any) -> Any:
    """Gumbel(0, 1) sample for vocab entry ``v`` of the stream ``key``."""
    return -math.log(-math.log(unit_float(counter_hash(key, v))))


def combine(a: Any, b: Any, op: Any) -> Any:
    """``op(a, b)`` with np.add / np.maximum / np.minimum semantics."""
    if op == 0:
        return a + b
    if op == 1:
        return a if (a > b or a != a) else b
    return a if (a < b or a != a) else b


def bf16_widen(b: Any) -> Any:
    """bfloat16 bits (uint16) -> float32, exact."""
    return f32_from_bits(np.uint32(np.uint32(b) << _U32_16))


def bf16_narrow(f: Any) -> Any:
    """float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN)."""
    u = bits_from_f32(f)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((u >> 16) | 0x0040)
    # No uint32 overflow: the largest finite pattern 0xFF7FFFFF + 0x8000 fits.
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def f16_widen(b: Any) -> Any:
    """float16 bits (uint16) -> float32, exact (numba-cpu has no float16 type)."""
    w = np.uint32(b)
    sign = (w & 0x8000) << 16
    e = (w >> 10) & 0x1F
    m = w & 0x3FF
    if e == 0x1F:  # inf / NaN: keep the payload
        return f32_from_bits(np.uint32(sign | 0x7F800000 | (m << 13)))
    if e == 0:  # zero / subnormal: m * 2**-24, exact in float32
        v = np.float32(np.float64(m) * _TWO_M24)
        return -v if sign else v
    return f32_from_bits(np.uint32(sign | ((e + 112) << 23) | (m << 13)))


def f16_narrow(f: Any) -> Any:
    """float32 -> float16 bits, round to nearest even, like ``astype(float16)``."""
    u = bits_from_f32(f)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN
        return np.uint16(sign | 0x7E00 | ((a >> 13) & 0x3FF))
    if a >= 0x477FF000:  # >= 65520 rounds to inf (65504 has an odd significand)
        return np.uint16(sign | 0x7C00)
    if a >= 0x38800000:  # normal: rebias the exponent, round the 13 dropped bits
        r = a - 0x38000000
        return np.uint16(sign | ((r + 0xFFF + ((r >> 13) & 1)) >> 13))
    # Subnormal or zero: |f| * 2**24 < 1024 is exact in float64; adding and
    # subtracting 2**52 rounds it to an integer, half to even.
    x = abs(np.float64(f)) * _TWO_24
    t = (x + _TWO_52) - _TWO_52
    return np.uint16(sign | np.int64(t))


def rint_f64(v: Any) -> Any:
    """Round a float64 to an integral value, half to even (like np.rint)."""
    if abs(v) >= _TWO_52 or v != v:
        return v  # already integral (or NaN)
    if v >= 0:
        return (v + _TWO_52) - _TWO_52
    return (v - _TWO_52) + _TWO_52


def quantize_one(x: Any, scale: Any, lim: Any) -> Any:
    """One element of reference.quantize: NaN -> 0, clip to +-lim, rint, as int64."""
    v = np.float64(x) * scale
    if v != v:
        return np.int64(0)
    if v > lim:
        v = lim
    elif v < -lim:
        v = -lim
    return np.int64(rint_f64(v))


def row_topk(logits: Any, r: Any, k: Any, ids: Any, w: Any) -> None:
    """Top-k of row ``r`` into ``ids[r]``/``w[r]``, then softmax weights in place.

    Insertion into a k-long sorted list while scanning experts in ascending
    index: a new value only moves ahead of strictly smaller ones, so ties keep
    the lower index first, and a full list only admits strictly larger values.
    """
    ne = logits.shape[1]
    cnt = 0
    for e in range(ne):
        x = logits[r, e]
        if cnt < k:
            p = cnt
            cnt += 1
        elif x > w[r, k - 1]:
            p = k - 1
        else:
            continue
        while p > 0 and w[r, p - 1] < x:
            w[r, p] = w[r, p - 1]
            ids[r, p] = ids[r, p - 1]
            p -= 1
        w[r, p] = x
        ids[r, p] = e
    m = np.float64(w[r, 0])
    total = 0.0
    for j in range(k):
        total += math.exp(np.float64(w[r, j]) - m)
    for j in range(k):
        w[r, j] = np.float32(math.exp(np.float64(w[r, j]) - m) / total)


_NAMES = (
    "mix64",
    "f32_from_bits",
    "bits_from_f32",
    "counter_hash",
    "tensor_int",
    "unit_float",
    "row_key",
    "gumbel",
    "combine",
    "bf16_widen",
    "bf16_narrow",
    "f16_widen",
    "f16_narrow",
    "rint_f64",
    "quantize_one",
    "row_topk",
)


def build(jit: Callable[[Any], Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compile every element function for one target.

    ``jit`` compiles a Python function (``numba.njit``, ``cuda.jit(device=True)``);
    ``overrides`` maps names to already-compiled replacements. Returns name ->
    compiled function. Compilation itself is lazy (on first call).
    """
    overrides = overrides or {}
    compiled: dict[str, Any] = {}
    scopes: list[dict[str, Any]] = []
    for name in _NAMES:
        if name in overrides:
            compiled[name] = overrides[name]
            continue
        src = globals()[name]
        scope = dict(src.__globals__)
        scopes.append(scope)
        clone = types.FunctionType(
            src.__code__, scope, src.__name__, src.__defaults__, src.__closure__
        )
        compiled[name] = jit(clone)
    # Numba resolves globals when it compiles (first call), so filling the
    # scopes now lets every clone see every compiled sibling.
    for scope in scopes:
        scope.update(compiled)
    return compiled
