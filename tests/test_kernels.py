"""kernels/: the reference's properties, and the CPU backends against it.

Backends here: ``numba-cpu`` (compiled kernels), ``xp-numpy`` (the cupy
backend's array-API code running on NumPy) and ``numpy`` (the reference
behind the Backend interface). Every input is fresh random data (seeded rng
or hypothesis), never zeros. numba-cuda and cupy: tests/test_kernels_cuda.py.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import DTYPES, count_wrong, expected_allreduce, get_backend, np_dtype, numba_cpu
from kernels import conformance as C
from kernels import reference as R
from kernels._device import counter_hash
from kernels.backends import Backend
from kernels.xp_backend import numpy_array_module_backend

DTYPE_NAMES = list(DTYPES)
OPS = ["sum", "max", "min"]
BACKENDS = ["numba-cpu", "xp-numpy", "numpy"]
FAST = settings(max_examples=25, deadline=None)


def backend(name: str) -> Backend:
    return numpy_array_module_backend() if name == "xp-numpy" else get_backend(name)


@pytest.fixture
def fused_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make numba-cpu use its fused prange kernel even for tiny arrays."""
    monkeypatch.setattr(numba_cpu, "PARALLEL_MIN", 0)


# --------------------------------------------------------------------------
# dtypes and hashing
# --------------------------------------------------------------------------


def test_dtype_names() -> None:
    assert list(DTYPES) == ["float32", "float16", "bfloat16", "int32", "int64"]
    assert np_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert np_dtype(np.int64) == np.dtype(np.int64)
    with pytest.raises(ValueError, match="valid names"):
        np_dtype("float8")
    with pytest.raises(ValueError):
        np_dtype(np.uint8)


@given(st.integers(0, 2**64 - 1), st.integers(0, 10**6))
@FAST
def test_hash_forms_agree(key: int, i: int) -> None:
    # Python-int, array and scalar forms of the counter hash are one function.
    with np.errstate(over="ignore"):
        scalar = int(counter_hash(np.uint64(key), i))
        assert int(R.mix64(np.uint64(key))) == R.mix64_int(key)
    assert scalar == R.mix64_int(key + (i + 1) * 0x9E3779B97F4A7C15)
    assert int(R.counter_hashes(key, i + 1)[i]) == scalar


# --------------------------------------------------------------------------
# make_tensor / expected_allreduce / count_wrong (the reference itself)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_tensor_values(dtype: str) -> None:
    t = R.make_tensor(3, 7, 5000, dtype, seed=11)
    bits, shift = R.TENSOR_SPEC[dtype]
    v = t.astype(np.float64) * 2.0**shift
    assert t.dtype == np_dtype(dtype) and t.shape == (5000,)
    assert np.all(v != 0), "never zero"
    assert np.all(v == np.round(v)), "integer multiples of 2**-shift"
    assert np.abs(v).max() <= 2**bits
    assert len(np.unique(t)) > min(50, 2 ** (bits + 1) - 1)
    assert (v > 0).mean() == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tensor_spec_fits_significand(dtype: str) -> None:
    # 64 ranks of the largest magnitude must stay exactly representable.
    bits, _ = R.TENSOR_SPEC[dtype]
    nmant = {"float32": 23, "float16": 10, "bfloat16": 7}[dtype]
    assert 2 ** (bits + 6) <= 2 ** (nmant + 1)
    assert R.MAX_WORLD == 64


def test_make_tensor_varies_with_every_input() -> None:
    base = R.make_tensor(0, 0, 2000, "float32", seed=0)
    for other in (
        R.make_tensor(1, 0, 2000, "float32", seed=0),
        R.make_tensor(0, 1, 2000, "float32", seed=0),
        R.make_tensor(0, 0, 2000, "float32", seed=1),
    ):
        assert np.mean(base == other) < 0.01
    assert np.mean(base[1:] == base[:-1]) < 0.01
    # A prefix is the same tensor: element i does not depend on count.
    assert np.array_equal(R.make_tensor(0, 0, 10, "float32"), base[:10])


@given(
    dtype=st.sampled_from(DTYPE_NAMES),
    op=st.sampled_from(OPS),
    world=st.integers(1, 64),
    step=st.integers(0, 1000),
    seed=st.integers(0, 2**32),
    order_seed=st.integers(0, 2**32),
)
@FAST
def test_allreduce_exact_in_any_order(
    dtype: str, op: str, world: int, step: int, seed: int, order_seed: int
) -> None:
    # Accumulating IN the dtype (bf16 rounds after every add) in a random
    # order, or as a tree, gives exactly the expected result.
    want = expected_allreduce(world, step, 301, dtype, op, seed)
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    parts = [R.make_tensor(r, step, 301, dtype, seed) for r in range(world)]
    order = np.random.default_rng(order_seed).permutation(world)
    acc = parts[order[0]].copy()
    for r in order[1:]:
        acc = ufunc(acc, parts[r]).astype(acc.dtype)
    assert count_wrong(acc, want) == 0
    level = [parts[r] for r in order]
    while len(level) > 1:
        nxt = [ufunc(a, c).astype(a.dtype) for a, c in zip(level[::2], level[1::2], strict=False)]
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    assert count_wrong(level[0], want) == 0


def test_expected_allreduce_definition() -> None:
    parts = np.stack([R.make_tensor(r, 2, 100, "int64", 5) for r in range(5)])
    assert np.array_equal(expected_allreduce(5, 2, 100, "int64", "sum", 5), parts.sum(0))
    assert np.array_equal(expected_allreduce(5, 2, 100, "int64", "max", 5), parts.max(0))
    assert np.array_equal(expected_allreduce(5, 2, 100, "int64", "min", 5), parts.min(0))
    with pytest.raises(ValueError, match="64"):
        expected_allreduce(65, 0, 10, "float32", "sum")
    expected_allreduce(65, 0, 10, "float32", "max")  # max/min are exact at any size
    with pytest.raises(ValueError, match="valid ops"):
        expected_allreduce(2, 0, 10, "float32", "prod")


def test_count_wrong() -> None:
    e = R.make_tensor(0, 0, 100, "bfloat16")
    r = e.copy()
    assert count_wrong(r, e) == 0
    r[[3, 50]] = r[[3, 50]] * 2
    assert count_wrong(r, e) == 2
    r = e.astype(np.float32)
    r[7] = np.nan
    assert count_wrong(r, e.astype(np.float32)) == 1, "NaN counts as wrong"
    assert count_wrong(np.array([-0.0]), np.array([0.0])) == 0
    with pytest.raises(ValueError, match="shape"):
        count_wrong(e[:5], e)
    with pytest.raises(ValueError, match="dtype"):
        count_wrong(e.astype(np.float32), e)


# --------------------------------------------------------------------------
# Backends against the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_tensor_matches(name: str, dtype: str) -> None:
    b = backend(name)
    for count, rank, step, seed in [(0, 0, 0, 0), (1, 1, 2, 3), (3001, 63, 99, 2**40 + 5)]:
        C.check_make_tensor(b, count, dtype, rank, step, seed)


@pytest.mark.parametrize("name", ["numba-cpu", "xp-numpy"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_multicast_matches(name: str, dtype: str, fused_always: None) -> None:
    b = backend(name)
    rng = np.random.default_rng([7, DTYPE_NAMES.index(dtype)])
    n = numba_cpu.CHUNK + 123  # a full chunk and a partial one
    for op, ns, nd, alias in [
        ("sum", 1, 1, False),
        ("sum", 2, 2, True),
        ("sum", 3, 1, False),
        ("max", 4, 3, True),
        ("min", 8, 8, True),
        ("max", 2, 1, False),
        ("min", 5, 2, False),
        ("sum", 8, 2, False),
    ]:
        srcs = [C.random_array(rng, n, dtype) for _ in range(ns)]
        C.check_multicast(b, srcs, nd, op, alias, on_device=False)
        C.check_multicast(b, srcs, nd, op, alias, on_device=True)


@given(
    dtype=st.sampled_from(DTYPE_NAMES),
    op=st.sampled_from(OPS),
    ns=st.integers(1, 8),
    nd=st.integers(1, 8),
    n=st.integers(0, 300),
    alias=st.booleans(),
    seed=st.integers(0, 2**32),
)
@FAST
def test_multicast_numba_fused_random(
    dtype: str, op: str, ns: int, nd: int, n: int, alias: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    srcs = [C.random_array(rng, n, dtype) for _ in range(ns)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numba_cpu, "PARALLEL_MIN", 0)
        C.check_multicast(get_backend("numba-cpu"), srcs, nd, op, alias, on_device=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_multicast_numba_size_threshold(dtype: str) -> None:
    # Real thresholds: a small call takes the NumPy path, a large one the kernel.
    b = get_backend("numba-cpu")
    rng = np.random.default_rng(3)
    for n in (numba_cpu.PARALLEL_MIN - 1, numba_cpu.PARALLEL_MIN + 77):
        srcs = [C.random_array(rng, n, dtype) for _ in range(3)]
        C.check_multicast(b, srcs, 3, "sum", alias=True, on_device=False)


@pytest.mark.parametrize("dtype", ["float32", "int64", "int32", "bfloat16"])
def test_multicast_numba_serial_bytes(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # serial_bytes keeps a call above PARALLEL_MIN on the calling thread (the
    # 16-bit floats, which need the kernel's widening, keep to the kernel)
    serial = []
    native = R.multicast_reduce_native
    monkeypatch.setattr(numba_cpu.reference, "multicast_reduce_native",
                        lambda *a: (serial.append(1), native(*a)))
    b = numba_cpu.NumbaCpuBackend()
    rng = np.random.default_rng(11)
    srcs = [C.random_array(rng, numba_cpu.PARALLEL_MIN + 333, dtype) for _ in range(2)]
    C.check_multicast(b, srcs, 2, "sum", alias=True, on_device=False)
    assert not serial  # by default a call this large takes the kernel
    b.serial_bytes = 1 << 21
    C.check_multicast(b, srcs, 2, "sum", alias=True, on_device=False)
    C.check_multicast(b, srcs, 1, "max", alias=False, on_device=False)
    assert len(serial) == (0 if dtype == "bfloat16" else 2)


@pytest.mark.parametrize("name", ["numba-cpu", "xp-numpy"])
def test_multicast_awkward_arrays(name: str, fused_always: None) -> None:
    b = backend(name)
    rng = np.random.default_rng(5)
    a = C.random_array(rng, 1000, "float32")
    ro = np.frombuffer(C.random_array(rng, 1000, "float32").tobytes(), dtype=np.float32)
    strided = C.random_array(rng, 2000, "float32")[::2]
    assert not ro.flags.writeable and not strided.flags.c_contiguous
    want = np.empty_like(a)
    R.multicast_reduce([a, ro, strided], [want], "sum")
    out = np.empty_like(a)
    b.multicast_reduce([a, ro, strided], [out], "sum")
    C.assert_same(out, want, "read-only and strided sources")
    holder = np.empty(2000, np.float32)
    b.multicast_reduce([a, ro, strided], [holder[::2]], "sum")  # strided destination
    C.assert_same(holder[::2], want, "strided destination")
    many = [C.random_array(rng, 100, "int64") for _ in range(11)]  # beyond MAX_FUSED
    C.check_multicast(b, many, 10, "max", alias=True, on_device=False)
    m2 = np.zeros((4, 25), np.int64)
    b.multicast_reduce([x.reshape(4, 25) for x in many[:3]], [m2], "sum")  # 2-D works too
    C.assert_same(m2.reshape(-1), many[0] + many[1] + many[2], "2-D")


@pytest.mark.parametrize("name", BACKENDS)
def test_multicast_errors(name: str) -> None:
    b = backend(name)
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError):
        b.multicast_reduce([], [a], "sum")
    with pytest.raises(ValueError, match="shape and dtype"):
        b.multicast_reduce([a, np.ones(4, np.int32)], [a], "sum")
    with pytest.raises(ValueError, match="shape and dtype"):
        b.multicast_reduce([a, a], [np.ones(5, np.float32)], "sum")
    with pytest.raises(ValueError, match="valid ops"):
        b.multicast_reduce([a, a], [a], "avg")


@pytest.mark.parametrize("name", ["numba-cpu", "xp-numpy", "numpy"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_reduce_into_matches(name: str, dtype: str, op: str, fused_always: None) -> None:
    rng = np.random.default_rng([11, DTYPE_NAMES.index(dtype), OPS.index(op)])
    acc, x = C.random_array(rng, 777, dtype), C.random_array(rng, 777, dtype)
    C.check_reduce_into(backend(name), acc, x, op, on_device=False)
    C.check_reduce_into(backend(name), acc, x, op, on_device=True)


def test_multicast_special_values(fused_always: None) -> None:
    # NaN propagation and the sign of zero follow np.maximum / np.minimum.
    b = get_backend("numba-cpu")
    a = np.array([np.nan, 1.0, -0.0, 0.0, np.inf, -np.inf, 3.0, np.nan], np.float32)
    c = np.array([1.0, np.nan, 0.0, -0.0, -np.inf, 1.0, 3.0, np.nan], np.float32)
    for dtype in ("float32", "float16", "bfloat16"):
        for op in OPS:
            C.check_multicast(b, [a.astype(dtype), c.astype(dtype)], 1, op, False, False)
            C.check_multicast(b, [c.astype(dtype), a.astype(dtype)], 1, op, False, False)


# --------------------------------------------------------------------------
# float16 / bfloat16 bit conversions of numba-cpu (all 16-bit patterns)
# --------------------------------------------------------------------------


@numba.njit
def _widen_all(bits: np.ndarray, kind: int) -> np.ndarray:
    out = np.empty(bits.size, np.float32)
    for i in range(bits.size):
        out[i] = numba_cpu.f16_widen(bits[i]) if kind == 1 else numba_cpu.bf16_widen(bits[i])
    return out


@numba.njit
def _narrow_all(x: np.ndarray, kind: int) -> np.ndarray:
    out = np.empty(x.size, np.uint16)
    for i in range(x.size):
        out[i] = numba_cpu.f16_narrow(x[i]) if kind == 1 else numba_cpu.bf16_narrow(x[i])
    return out


def test_16bit_conversions_exhaustive_and_random() -> None:
    every = np.arange(65536, dtype=np.uint16)
    C.assert_same(_widen_all(every, 1), every.view(np.float16).astype(np.float32), "f16 widen")
    bf = every.view(ml_dtypes.bfloat16).astype(np.float32)
    C.assert_same(_widen_all(every, 2), bf, "bf16 widen")
    rng = np.random.default_rng(9)
    patterns = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([
        patterns.view(np.float32),
        # float16 boundaries: max, overflow tie, min normal, subnormal ties, zero
        np.array([65504, 65519.996, 65520, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25,
                  1.5 * 2.0**-24, 2.0**-14 - 2.0**-25, 1e-9, 0.0, -0.0], np.float32),
        np.linspace(-70000, 70000, 20001, dtype=np.float32),
    ])
    xs = np.concatenate([x, -x])
    with np.errstate(all="ignore"):  # overflow to inf is part of the test
        want16, want_bf = xs.astype(np.float16), xs.astype(ml_dtypes.bfloat16)
    C.assert_same(_narrow_all(xs, 1).view(np.float16), want16, "f16 narrow")
    C.assert_same(_narrow_all(xs, 2).view(ml_dtypes.bfloat16), want_bf, "bf16 narrow")


# --------------------------------------------------------------------------
# Fixed point
# --------------------------------------------------------------------------


@given(
    max_abs=st.floats(0, 2.0**100, allow_nan=False, width=32),
    contributors=st.integers(1, 4096),
    bits=st.sampled_from([32, 64]),
)
@FAST
def test_choose_scale_is_tight_and_safe(max_abs: float, contributors: int, bits: int) -> None:
    s = R.choose_scale(max_abs, contributors, bits)
    m, e = math.frexp(s)
    assert m == 0.5, "a power of two"
    limit = ((1 << (bits - 1)) - 1) // contributors
    q = R.quantize(np.array([max_abs, -max_abs], np.float32), s, f"int{bits}")
    assert contributors * int(np.abs(q.astype(object)).max()) <= 2 ** (bits - 1) - 1
    if s < 2.0**126:
        assert max_abs * 2 * s > limit, "doubling the scale would overflow"


def test_choose_scale_errors() -> None:
    for args in [(-1.0, 2, 32), (math.inf, 2, 32), (1.0, 0, 32), (1.0, 2, 1), (1.0, 2**40, 32)]:
        with pytest.raises(ValueError):
            R.choose_scale(*args)
    assert R.choose_scale(0.0, 8, 32) == 2.0**126


@pytest.mark.parametrize("name", BACKENDS)
def test_quantize_rounding_and_saturation(name: str) -> None:
    b = backend(name)
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, np.nan, np.inf, -np.inf,
                  3e9, -3e9, 1e30], np.float32)
    q32 = b.to_host(b.quantize(x, 1.0, "int32"))
    assert q32.dtype == np.int32
    assert q32.tolist() == [0, 2, 2, 0, -2, -2, 0, 0, 2**31 - 1, -(2**31 - 1), 2**31 - 1,
                            -(2**31 - 1), 2**31 - 1]
    q64 = b.to_host(b.quantize(x, 1.0, "int64"))
    assert q64[10] == 3_000_000_000 and q64[8] == int(R.QUANT_MAX["int64"])
    with pytest.raises(ValueError):
        b.quantize(x, 0.0, "int32")
    with pytest.raises(ValueError):
        b.quantize(x, 1.0, "float32")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("out_dtype", ["int32", "int64"])
def test_quantize_matches(name: str, out_dtype: str) -> None:
    rng = np.random.default_rng(21)
    x = C.random_array(rng, 5000, "float32")
    bits = 32 if out_dtype == "int32" else 64
    for contributors in (1, 7, 64):
        scale = R.choose_scale(float(np.abs(x).max()), contributors, bits)
        C.check_quantize(backend(name), x, scale, out_dtype)
    C.check_quantize(backend(name), x, 0.75, out_dtype)  # any positive scale is defined


@given(
    data=st.data(),
    contributors=st.integers(2, 12),
    n=st.integers(1, 40),
    bits=st.sampled_from([32, 64]),
)
@FAST
def test_fixed_point_sum_is_order_independent(
    data: st.DataObject, contributors: int, n: int, bits: int
) -> None:
    floats = st.floats(-1e6, 1e6, allow_nan=False, width=32)
    xs = [np.array(data.draw(st.lists(floats, min_size=n, max_size=n)), np.float32)
          for _ in range(contributors)]
    max_abs = max(float(np.abs(x).max()) for x in xs)
    qdt = f"int{bits}"
    scale = R.choose_scale(max_abs, contributors, bits)
    b = get_backend("numba-cpu")
    qs = [b.quantize(x, scale, qdt) for x in xs]
    exact = sum(q.astype(object) for q in qs)  # Python ints: no overflow possible
    results = []
    for perm in [list(range(contributors)),
                 data.draw(st.permutations(range(contributors))),
                 data.draw(st.permutations(range(contributors)))]:
        acc = qs[perm[0]].copy()
        for i in perm[1:]:
            b.reduce_into(acc, qs[i], "sum")
        results.append(acc)
        assert [int(v) for v in acc] == list(exact), "no overflow: equals the exact sum"
    out = [np.empty_like(qs[0])]
    b.multicast_reduce(qs[::-1], out, "sum")  # fused kernel, reversed order
    results.append(out[0])
    for r in results[1:]:
        C.assert_same(r, results[0], "integer sums are associative")
    back = b.dequantize(results[0], scale)
    err = np.abs(back.astype(np.float64) - np.sum([x.astype(np.float64) for x in xs], axis=0))
    tol = contributors * 0.5 / scale + 1e-6 * np.abs(back.astype(np.float64))
    assert np.all(err <= tol)


# --------------------------------------------------------------------------
# MoE top-k
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_moe_topk_matches(name: str) -> None:
    rng = np.random.default_rng(31)
    logits = (rng.standard_normal((67, 16)) * 3).astype(np.float32)
    for k in (1, 2, 4, 16):
        C.check_moe_topk(backend(name), logits, k)
    C.check_moe_topk(backend(name), logits[:0], 2)  # zero tokens


@pytest.mark.parametrize("name", BACKENDS)
def test_moe_topk_tie_rule(name: str) -> None:
    b = backend(name)
    logits = np.array(
        [[1, 3, 3, 2, 3], [0, 0, 0, 0, 0], [-0.0, 0.0, -1, 5, 0.0], [4, 1, 4, 1, 4]], np.float32
    )
    ids, w = b.moe_topk(logits, 2)
    assert b.to_host(ids).tolist() == [[1, 2], [0, 1], [3, 0], [0, 2]]
    np.testing.assert_allclose(b.to_host(w)[[0, 1, 3]], 0.5)
    ids3, _ = b.moe_topk(logits, 3)
    assert b.to_host(ids3).tolist() == [[1, 2, 4], [0, 1, 2], [3, 0, 1], [0, 2, 4]]


@given(data=st.data(), tokens=st.integers(1, 20), experts=st.integers(1, 12))
@FAST
def test_moe_topk_ties_random(data: st.DataObject, tokens: int, experts: int) -> None:
    # Few distinct values -> many ties; ids must match the reference exactly.
    vals = st.sampled_from([-2.0, -0.0, 0.0, 1.0, 1.5, 7.0])
    logits = np.array(
        data.draw(st.lists(st.lists(vals, min_size=experts, max_size=experts),
                           min_size=tokens, max_size=tokens)), np.float32)
    k = data.draw(st.integers(1, experts))
    for name in ("numba-cpu", "xp-numpy"):
        C.check_moe_topk(backend(name), logits, k)


@pytest.mark.parametrize("name", BACKENDS)
def test_moe_topk_errors(name: str) -> None:
    b = backend(name)
    with pytest.raises(ValueError):
        b.moe_topk(np.ones((3, 4), np.float32), 0)
    with pytest.raises(ValueError):
        b.moe_topk(np.ones((3, 4), np.float32), 5)
    with pytest.raises(ValueError):
        b.moe_topk(np.ones(4, np.float32), 1)


# --------------------------------------------------------------------------
# Toy decoder
# --------------------------------------------------------------------------


def _stream(b: Backend, dec: R.ToyDecoder, steps: int, temperature: float, seed: int) -> list:
    tokens = np.array([0, 5, 17, 3], np.int32)
    hidden = dec.init_hidden(4)
    out = []
    for pos in range(steps):
        positions = np.full(4, pos, np.int32)
        t, h = b.decoder_step(dec, tokens, hidden, positions, temperature, seed)
        tokens, hidden = b.to_host(t), b.to_host(h)
        out.append(tokens.tolist())
    return out


def test_toy_decoder_weights() -> None:
    dec = R.ToyDecoder()
    assert dec.vocab >= 256 and dec.dim >= 256, "real arithmetic by default"
    assert dec.embedding.shape == (dec.vocab, dec.dim) and dec.embedding.dtype == np.float32
    assert dec.projection.shape == (dec.dim, dec.vocab) and dec.projection.dtype == np.float32
    assert np.array_equal(R.ToyDecoder(seed=3).embedding, R.ToyDecoder(seed=3).embedding)
    assert not np.array_equal(R.ToyDecoder(seed=3).projection, R.ToyDecoder(seed=4).projection)
    with pytest.raises(ValueError):
        dec.embedding[0, 0] = 1.0  # read-only: backends cache device copies


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 5.0])
def test_decoder_matches(name: str, temperature: float) -> None:
    rng = np.random.default_rng(41)
    dec = R.ToyDecoder(vocab=300, dim=64, seed=2)
    tokens = rng.integers(0, 300, 9).astype(np.int32)
    hidden = rng.standard_normal((9, 64)).astype(np.float32)
    positions = rng.integers(0, 1000, 9).astype(np.int32)
    C.check_decoder(backend(name), dec, tokens, hidden, positions, temperature, seed=77)


def test_decoder_stream_deterministic_per_seed() -> None:
    dec = R.ToyDecoder(vocab=200, dim=48, seed=1)
    cpu, ref, xp = get_backend("numba-cpu"), get_backend("numpy"), backend("xp-numpy")
    s1 = _stream(cpu, dec, 12, 1.0, seed=5)
    assert s1 == _stream(cpu, dec, 12, 1.0, seed=5), "same seed, same stream"
    assert s1 == _stream(ref, dec, 12, 1.0, seed=5) == _stream(xp, dec, 12, 1.0, seed=5)
    assert s1 != _stream(cpu, dec, 12, 1.0, seed=6), "another seed, another stream"
    greedy = _stream(cpu, dec, 6, 0.0, seed=5)
    assert greedy == _stream(cpu, dec, 6, 0.0, seed=99), "temperature 0 ignores the seed"
    assert greedy == _stream(ref, dec, 6, 0.0, seed=0)


def test_decoder_sampling_follows_softmax() -> None:
    # Gumbel-max: sampled frequencies approach softmax(logits / T).
    dec = R.ToyDecoder(vocab=8, dim=4, seed=0)
    n = 4000
    tokens = np.zeros(n, np.int32)
    hidden = np.zeros((n, 4), np.float32)
    t, h = R.decoder_step(dec, tokens, hidden, np.zeros(n, np.int32), 1.0, seed=3)
    logits = h[0].astype(np.float64) @ dec.projection64
    p = np.exp(logits - logits.max())
    p /= p.sum()
    freq = np.bincount(t, minlength=8) / n
    assert np.abs(freq - p).max() < 0.04


@pytest.mark.parametrize("name", BACKENDS)
def test_decoder_errors(name: str) -> None:
    b = backend(name)
    dec = R.ToyDecoder(vocab=10, dim=4)
    h = dec.init_hidden(2)
    with pytest.raises(ValueError, match="tokens"):
        b.decoder_step(dec, np.array([0, 10], np.int32), h, np.zeros(2, np.int32), 0.0, 0)
    with pytest.raises(ValueError, match="temperature"):
        b.decoder_step(dec, np.zeros(2, np.int32), h, np.zeros(2, np.int32), -1.0, 0)
    with pytest.raises(ValueError, match="positions"):
        b.decoder_step(dec, np.zeros(2, np.int32), h, np.array([0, -1], np.int32), 0.0, 0)



def test_microbench_runs() -> None:
    from kernels.microbench import main, multicast_bandwidth

    r = multicast_bandwidth("numba-cpu", 2, nbytes=1 << 20, repeats=1)
    assert r.gbps > 0 and r.nsrc == 2 and r.ndst == 2
    main(["--backends", "numpy", "--nsrc", "3", "--mib", "0.25", "--repeats", "1"])


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64"])
@pytest.mark.parametrize("op", OPS)
def test_multicast_small_path_any_destination_order(dtype: str, op: str) -> None:
    # the native path reads both sources before it writes a destination:
    # right whether a destination is the first source, the second, or neither
    b = get_backend("numba-cpu")
    rng = np.random.default_rng([11, OPS.index(op)])
    n = 1001
    a, c = C.random_array(rng, n, dtype), C.random_array(rng, n, dtype)
    want = np.empty_like(a)
    R.multicast_reduce([a.copy(), c.copy()], [want], op)
    for order in ("ab", "ba", "fa", "b"):
        x, y = a.copy(), c.copy()
        fresh = np.empty_like(a)
        dsts = [{"a": x, "b": y, "f": fresh}[k] for k in order]
        b.multicast_reduce([x, y], dsts, op)
        for i, d in enumerate(dsts):
            C.assert_same(d, want, f"{dtype} {op} dsts {order!r} #{i}")


def test_multicast_small_path_overflow_is_quiet() -> None:
    # a float sum that overflows gives inf, and inf - inf NaN, without a warning
    b = get_backend("numba-cpu")
    big = np.full(100, 3e38, np.float32)
    inf = np.array([np.inf, -np.inf] * 50, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = np.empty_like(big)
        b.multicast_reduce([big, big], [out], "sum")
        assert np.isposinf(out).all()
        b.multicast_reduce([inf, inf[::-1].copy()], [out], "sum")
        assert np.isnan(out).all()
        b.multicast_reduce([inf, np.full(100, np.nan, np.float32)], [out], "max")
        assert np.isnan(out).all()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_reduce_pair_is_the_multicast_of_two_in_place(name: str, dtype: str, op: str) -> None:
    # the memory plane's two-member call: a = b = op(a, b), bitwise as the reference,
    # NaN and the small/large switch included (numba-cpu's one-pass kernel below
    # its serial limit, multicast_reduce above it)
    b = backend(name)
    rng = np.random.default_rng([11, DTYPE_NAMES.index(dtype), OPS.index(op)])
    for n in (1, 1023, numba_cpu.PARALLEL_MIN + 5):
        x, y = C.random_array(rng, n, dtype), C.random_array(rng, n, dtype)
        if np_dtype(dtype).kind == "f":
            x[n // 2] = np.nan
        want = x.copy()
        R.multicast_reduce([x, y], [want], op)
        b.reduce_pair(x, y, op)
        C.assert_same(x, want, f"{name} {dtype} {op} n={n} a")
        C.assert_same(y, want, f"{name} {dtype} {op} n={n} b")


def test_reduce_pair_takes_the_one_pass_kernel_when_small(monkeypatch: pytest.MonkeyPatch) -> None:
    b = get_backend("numba-cpu")
    calls: list[int] = []
    monkeypatch.setattr(numba_cpu, "_pair_inplace", lambda x, y, code: calls.append(code))
    small = np.ones(1024, np.float32)
    b.reduce_pair(small, small.copy(), "max")
    assert calls == [1]
    bf16 = np_dtype("bfloat16")
    b.reduce_pair(np.ones(8, bf16), np.ones(8, bf16), "sum")  # widened: not the pair kernel
    assert calls == [1]


# --------------------------------------------------------------------------
# Fixed-point attention (the sharded model's)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_fixed_matches_the_reference(name: str) -> None:
    """Fresh random keys, values and queries (never zeros), odd head sizes, grouped
    query heads, a rank's slice of the heads (head0, kv0), prefill and decode rows,
    contexts past NumPy's 8- and 128-element summation blocks."""
    b = backend(name)
    rng = np.random.default_rng(123)
    for c, held, d, nkv, group, head0 in [(1, 0, 7, 1, 1, 0), (3, 5, 5, 2, 2, 0),
                                         (1, 130, 9, 1, 3, 4), (6, 0, 16, 2, 1, 2),
                                         (2, 300, 3, 1, 2, 2), (1, 7, 1, 3, 1, 0)]:
        nq = nkv * group - (head0 % group)
        kv0 = head0 // group
        lim = 1 << 15
        q = rng.integers(-lim, lim, (c, nq, d))
        q[q == 0] = 1
        kk = rng.integers(-lim, lim, (nkv, held + c, d))
        vv = rng.integers(-lim, lim, (nkv, held + c, d))
        C.check_attention_fixed(b, q, kk, vv, held, head0, group, kv0)


def test_attention_fixed_is_causal_and_refuses_bad_shapes() -> None:
    rng = np.random.default_rng(7)
    q = rng.integers(-999, 999, (3, 2, 4))
    kk = rng.integers(-999, 999, (1, 5, 4))
    vv = rng.integers(-999, 999, (1, 5, 4))
    full = R.attention_fixed(q, kk, vv, 2, 0, 2, 0, 12)
    # row i sees tokens 0 .. 2 + i: changing the last token moves only the last row
    kk2, vv2 = kk.copy(), vv.copy()
    kk2[0, 4] += 100
    vv2[0, 4] += 100
    moved = R.attention_fixed(q, kk2, vv2, 2, 0, 2, 0, 12)
    assert (moved[:2] == full[:2]).all() and (moved[2] != full[2]).any()
    # one token: its value, whatever the scores
    one = R.attention_fixed(q[:1], kk[:, :1], vv[:, :1], 0, 0, 2, 0, 12)
    assert (one.reshape(2, 4) == vv[0, 0]).all()
    for args in [(q, kk[:, :4], vv[:, :4], 2), (q[0], kk, vv, 2), (q, kk, vv[:, :4], 2),
                 (q, kk, vv, 3)]:
        with pytest.raises(ValueError):
            R.attention_fixed(*args, 0, 2, 0, 12)
    with pytest.raises(ValueError, match="kv heads"):
        R.attention_fixed(q, kk, vv, 2, 0, 1, 0, 12)  # head 1 reads kv head 1: absent
