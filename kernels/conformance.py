"""Conformance checks: does a backend match the NumPy reference?

Each ``check_*`` runs one kernel on a backend with the given host inputs,
runs :mod:`kernels.reference` on the same inputs and raises AssertionError
on any difference. Comparisons are bitwise (NaN-aware) except where the
reference documents last-ulp freedom (softmax weights, tanh). The test suite
runs these for every backend; ``semfab`` tooling can run them on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import reference
from .base import Backend
from .dtypes import FLOAT_DTYPES, np_dtype


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bit patterns of an array (as unsigned ints of the same width)."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Bitwise equality, except that any NaN matches any NaN."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(
            f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
        )
    gb, wb = bits(got), bits(want)
    same = gb == wb
    if got.dtype.kind in "fV":  # float16/32/64 and ml_dtypes bfloat16
        gf = got.astype(np.float32)
        wf = want.astype(np.float32)
        same |= np.isnan(gf) & np.isnan(wf)
    if not same.all():
        idx = np.flatnonzero(~same.reshape(-1))[:5]
        raise AssertionError(
            f"{what}: {idx.size} element(s) differ, first at {idx.tolist()}: "
            f"got {got.reshape(-1)[idx]}, want {want.reshape(-1)[idx]}"
        )


def random_array(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Fresh random values of a dtype: wide magnitudes, both signs, some exact
    zeros of either sign and (for floats) ties; never all zeros."""
    dt = np_dtype(dtype)
    if dtype in FLOAT_DTYPES:
        scale = 10.0 ** rng.uniform(-3, 3, n)
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        if n >= 8:
            pick = rng.choice(n, size=max(1, n // 8), replace=False)
            x[pick[::2]] = np.where(rng.random(pick[::2].size) < 0.5, 0.0, -0.0)
            x[pick[1::2]] = np.round(x[pick[1::2]])  # small integers: equal values and ties
        out = x.astype(dt)
    else:
        info = np.iinfo(dt)
        big = rng.integers(info.min // 2, info.max // 2, n, dtype=dt, endpoint=True)
        small = rng.integers(-100, 100, n, dtype=dt, endpoint=True)
        out = np.where(rng.random(n) < 0.5, big, small).astype(dt)
    if n and not np.any(out.astype(np.float64) != 0):
        out[0] = 1
    return out


def check_make_tensor(b: Backend, count: int, dtype: str, rank: int, step: int, seed: int) -> None:
    """make_tensor on ``b`` equals the reference bit for bit."""
    got = b.to_host(b.make_tensor(rank, step, count, dtype, seed))
    assert_same(got, reference.make_tensor(rank, step, count, dtype, seed), f"make_tensor {dtype}")


def check_multicast(
    b: Backend, srcs: Sequence[np.ndarray], ndst: int, op: str, alias: bool, on_device: bool
) -> None:
    """multicast_reduce on ``b`` equals the reference, for host or device arrays.

    ``alias`` makes the first ``ndst`` sources double as destinations (plus
    fresh arrays when ``ndst`` exceeds the number of sources).
    """
    want = [np.empty_like(srcs[0])]
    reference.multicast_reduce([s.copy() for s in srcs], want, op)
    host = [s.copy() for s in srcs]
    if on_device:
        src_arrays = [b.asarray(s) for s in host]
    else:
        src_arrays = list(host)
    if alias:
        dst_arrays = src_arrays[:ndst]
    else:
        dst_arrays = []
    while len(dst_arrays) < ndst:
        fresh = np.empty_like(srcs[0])
        dst_arrays.append(b.asarray(fresh) if on_device else fresh)
    b.multicast_reduce(src_arrays, dst_arrays, op)
    for i, d in enumerate(dst_arrays):
        assert_same(b.to_host(d), want[0], f"multicast_reduce {srcs[0].dtype} {op} dst {i}")
    if not alias:
        for s, orig in zip(src_arrays, srcs, strict=True):
            assert_same(b.to_host(s), orig, "multicast_reduce must not modify sources")


def check_reduce_into(b: Backend, acc: np.ndarray, x: np.ndarray, op: str, on_device: bool) -> None:
    """reduce_into on ``b`` equals the reference (in place)."""
    want = acc.copy()
    reference.reduce_into(want, x, op)
    got: Any = acc.copy()
    xx: Any = x
    if on_device:
        got, xx = b.asarray(got), b.asarray(x)
    b.reduce_into(got, xx, op)
    assert_same(b.to_host(got), want, f"reduce_into {acc.dtype} {op}")


def check_quantize(b: Backend, x: np.ndarray, scale: float, out_dtype: str) -> None:
    """quantize and dequantize on ``b`` equal the reference bit for bit."""
    want = reference.quantize(x, scale, out_dtype)
    got = b.to_host(b.quantize(x, scale, out_dtype))
    assert_same(got, want, f"quantize {out_dtype}")
    back = b.to_host(b.dequantize(want, scale))
    assert_same(back, reference.dequantize(want, scale), "dequantize")


def check_moe_topk(b: Backend, logits: np.ndarray, k: int) -> None:
    """ids bitwise equal to the reference, weights within 1e-6 relative."""
    ids, w = b.moe_topk(logits, k)
    rids, rw = reference.moe_topk(logits, k)
    assert_same(b.to_host(ids), rids, "moe_topk ids")
    got_w = b.to_host(w)
    if got_w.dtype != np.float32 or got_w.shape != rw.shape:
        raise AssertionError(f"moe_topk weights: {got_w.dtype}{got_w.shape}")
    np.testing.assert_allclose(got_w, rw, rtol=1e-6, atol=1e-12, err_msg="moe_topk weights")


def check_decoder(
    b: Backend,
    weights: reference.ToyDecoder,
    tokens: np.ndarray,
    hidden: np.ndarray,
    positions: np.ndarray,
    temperature: float,
    seed: int,
) -> None:
    """Same next tokens as the reference (unless the reference scores tie to
    within 1e-12 relative) and hidden states within 1e-6."""
    nt, nh = b.decoder_step(weights, tokens, hidden, positions, temperature, seed)
    got_t, got_h = b.to_host(nt), b.to_host(nh)
    want_t, want_h = reference.decoder_step(weights, tokens, hidden, positions, temperature, seed)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-6, atol=1e-7, err_msg="decoder hidden")
    if got_t.dtype != np.int32 or got_t.shape != want_t.shape:
        raise AssertionError(f"decoder tokens: {got_t.dtype}{got_t.shape}")
    diff = np.flatnonzero(got_t != want_t)
    if diff.size:
        scores = _reference_scores(weights, want_h, positions, temperature, seed)
        for r in diff:
            a, c = scores[r, got_t[r]], scores[r, want_t[r]]
            if not abs(a - c) <= 1e-12 * max(abs(a), abs(c)):
                raise AssertionError(f"decoder row {r}: token {got_t[r]} vs {want_t[r]}")


def check_attention_fixed(b: Backend, q: np.ndarray, kk: np.ndarray, vv: np.ndarray,
                          held: int, head0: int, group: int, kv0: int,
                          frac_bits: int = 12) -> None:
    """Every output element equal to the reference's (int64, bitwise)."""
    got = b.to_host(np.asarray(b.attention_fixed(q, kk, vv, held, head0, group, kv0,
                                                 frac_bits)))
    want = reference.attention_fixed(q, kk, vv, held, head0, group, kv0, frac_bits)
    assert_same(np.asarray(got), want, "attention_fixed")


def _reference_scores(
    weights: reference.ToyDecoder,
    new_hidden: np.ndarray,
    positions: np.ndarray,
    temperature: float,
    seed: int,
) -> np.ndarray:
    logits = new_hidden.astype(np.float64) @ weights.projection64
    if temperature > 0:
        noise = reference.gumbel_noise(
            reference.row_keys(seed, np.asarray(positions)), weights.vocab
        )
        return logits / temperature + noise
    return logits


__all__ = [
    "assert_same",
    "bits",
    "check_attention_fixed",
    "check_decoder",
    "check_make_tensor",
    "check_moe_topk",
    "check_multicast",
    "check_quantize",
    "check_reduce_into",
    "random_array",
]
