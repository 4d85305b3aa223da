"""numba-cuda (on Numba's CUDA simulator here: small sizes) and cupy (skipped
without a GPU) against the NumPy reference, with the same conformance checks
as the CPU backends."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import DTYPES, get_backend
from kernels import conformance as C
from kernels import reference as R
from kernels.backends import Backend, _probe_cupy, _probe_numba_cuda

DTYPE_NAMES = list(DTYPES)
OPS = ["sum", "max", "min"]


def _cupy_or_skip() -> Backend:
    pytest.importorskip("cupy", reason="cupy not installed")
    info = _probe_cupy()
    if not info.available:
        pytest.skip(f"cupy backend unavailable: {info.reason}")
    return get_backend("cupy")


def _cuda_or_skip() -> Backend:
    info = _probe_numba_cuda()
    if not info.available:
        pytest.skip(f"numba-cuda unavailable: {info.reason}")
    return get_backend("numba-cuda")


@pytest.fixture(params=["numba-cuda", "cupy"])
def gpu(request: pytest.FixtureRequest) -> Backend:
    return _cuda_or_skip() if request.param == "numba-cuda" else _cupy_or_skip()


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_make_tensor(gpu: Backend, dtype: str) -> None:
    for count, rank, step, seed in [(0, 0, 0, 0), (1, 2, 3, 4), (77, 63, 1000, 2**33 + 1)]:
        C.check_make_tensor(gpu, count, dtype, rank, step, seed)
    t = gpu.make_tensor(1, 1, 10, dtype)
    assert gpu.to_host(t).dtype == np.dtype(DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("op", OPS)
def test_multicast_and_reduce_into(gpu: Backend, dtype: str, op: str) -> None:
    rng = np.random.default_rng([DTYPE_NAMES.index(dtype), OPS.index(op)])
    for ns, nd, alias, on_device in [(1, 2, False, True), (3, 2, True, True), (2, 1, False, False)]:
        srcs = [C.random_array(rng, 70, dtype) for _ in range(ns)]
        C.check_multicast(gpu, srcs, nd, op, alias, on_device)
    acc, x = C.random_array(rng, 50, dtype), C.random_array(rng, 50, dtype)
    C.check_reduce_into(gpu, acc, x, op, on_device=True)
    C.check_reduce_into(gpu, acc, x, op, on_device=False)


def test_multicast_many_sources_and_empty(gpu: Backend) -> None:
    rng = np.random.default_rng(1)
    srcs = [C.random_array(rng, 20, "float32") for _ in range(10)]  # beyond MAX_FUSED
    C.check_multicast(gpu, srcs, 9, "sum", alias=False, on_device=True)
    e = gpu.asarray(np.empty(0, np.float32))
    gpu.multicast_reduce([e, e], [e], "sum")
    with pytest.raises(ValueError):
        gpu.multicast_reduce([e, gpu.asarray(np.empty(0, np.int32))], [e], "sum")


def test_special_values(gpu: Backend) -> None:
    a = np.array([np.nan, 1.0, -0.0, 0.0, np.inf, -np.inf, 3.0, 65519.0], np.float32)
    c = np.array([1.0, np.nan, 0.0, -0.0, -np.inf, 1.0, 3.0, 65519.0], np.float32)
    for dtype in ("float32", "float16", "bfloat16"):
        for op in OPS:
            C.check_multicast(gpu, [a.astype(dtype), c.astype(dtype)], 1, op, False, True)


@pytest.mark.parametrize("out_dtype", ["int32", "int64"])
def test_quantize(gpu: Backend, out_dtype: str) -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([
        C.random_array(rng, 60, "float32"),
        np.array([0.5, 1.5, 2.5, -0.5, -2.5, np.nan, np.inf, -np.inf, 1e30], np.float32),
    ])
    bits = 32 if out_dtype == "int32" else 64
    finite = np.abs(x[np.isfinite(x)])
    C.check_quantize(gpu, x, R.choose_scale(float(finite.max()), 8, bits), out_dtype)
    C.check_quantize(gpu, x, 1.0, out_dtype)


def test_moe_topk(gpu: Backend) -> None:
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((9, 8)) * 2).astype(np.float32)
    logits[0] = [1, 3, 3, 2, 3, -0.0, 0.0, 3]
    for k in (1, 2, 8):
        C.check_moe_topk(gpu, logits, k)
    ids, _ = gpu.moe_topk(logits, 2)
    assert gpu.to_host(ids)[0].tolist() == [1, 2]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decoder(gpu: Backend, temperature: float) -> None:
    rng = np.random.default_rng(4)
    dec = R.ToyDecoder(vocab=24, dim=8, seed=5)
    tokens = rng.integers(0, 24, 3).astype(np.int32)
    hidden = rng.standard_normal((3, 8)).astype(np.float32)
    positions = rng.integers(0, 50, 3).astype(np.int32)
    C.check_decoder(gpu, dec, tokens, hidden, positions, temperature, seed=8)


def test_simulator_is_labelled() -> None:
    b = _cuda_or_skip()
    from kernels.numba_cuda import SIMULATED

    if SIMULATED:
        assert "simulator" in b.device


def test_attention_fixed(gpu: Backend) -> None:
    """The sharded model's attention (small here: the simulator runs it in Python)."""
    rng = np.random.default_rng(6)
    for c, held, d, nkv, group, head0 in [(1, 0, 3, 1, 1, 0), (2, 5, 4, 2, 2, 0),
                                         (1, 9, 5, 1, 3, 4)]:
        nq = nkv * group - (head0 % group)
        q = rng.integers(-(1 << 15), 1 << 15, (c, nq, d))
        kk = rng.integers(-(1 << 15), 1 << 15, (nkv, held + c, d))
        vv = rng.integers(-(1 << 15), 1 << 15, (nkv, held + c, d))
        C.check_attention_fixed(gpu, q, kk, vv, held, head0, group, head0 // group)
