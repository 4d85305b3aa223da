"""The ``numba-cuda`` backend: Numba CUDA kernels (grid-stride loops).

Methods accept host NumPy arrays or device arrays (Numba device arrays or
anything with ``__cuda_array_interface__``), copy host inputs to the device,
write results back into host outputs, and return device arrays. bfloat16
lives on the device as uint16 bit patterns; float16 is native.

With ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run on Numba's CUDA
simulator (Python threads on the CPU): correct, very slow, for tests only.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numba import cuda as _numba_cuda

from . import _device, reference
from .base import Backend, cuda_simulator_enabled
from .dtypes import BF16, DTYPES, dtype_name, np_dtype, op_code
from .reference import QUANT_MAX, TENSOR_SPEC, ToyDecoder

# Typed as Any: numba's partial annotations (cuda.grid etc.) confuse mypy.
cuda: Any = _numba_cuda
SIMULATED = cuda_simulator_enabled()

if SIMULATED:
    # The simulator runs device functions as Python: NumPy-scalar bit casts work.
    _overrides: dict[str, Any] = {}
else:
    from numba.cuda import libdevice

    def _f32_from_bits_gpu(u: Any) -> Any:
        return libdevice.int_as_float(np.int32(u))

    def _bits_from_f32_gpu(f: Any) -> Any:
        return np.uint32(libdevice.float_as_int(f))

    _overrides = {
        "f32_from_bits": cuda.jit(device=True)(_f32_from_bits_gpu),
        "bits_from_f32": cuda.jit(device=True)(_bits_from_f32_gpu),
    }

_D = _device.build(lambda f: cuda.jit(device=True)(f), _overrides)
_tensor_int = _D["tensor_int"]
_combine = _D["combine"]
_bf16_widen = _D["bf16_widen"]
_bf16_narrow = _D["bf16_narrow"]
_quantize_one = _D["quantize_one"]
_row_topk = _D["row_topk"]
_row_key = _D["row_key"]
_gumbel = _D["gumbel"]

MAX_FUSED = 8
_THREADS = 32 if SIMULATED else 256
_MAX_BLOCKS = 2 if SIMULATED else 4096  # the simulator runs every thread in Python


def _grid(n: int) -> tuple[int, int]:
    return max(1, min(_MAX_BLOCKS, -(-n // _THREADS))), _THREADS


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # On the simulator uint64 hashing runs on NumPy scalars, which warn on the
    # (intended) wrap-around; real kernels wrap silently.
    if SIMULATED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    else:
        yield


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@cuda.jit
def _k_make_int(out: Any, key: Any, mask: Any) -> None:
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = _tensor_int(key, i, mask)


@cuda.jit
def _k_make_float(out: Any, key: Any, mask: Any, scale: float) -> None:
    # float32 or float16 output (the store rounds float32 -> float16 exactly here).
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = np.float32(np.float64(_tensor_int(key, i, mask)) * scale)


@cuda.jit
def _k_make_bf16(out: Any, key: Any, mask: Any, scale: float) -> None:
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = _bf16_narrow(np.float32(np.float64(_tensor_int(key, i, mask)) * scale))


@cuda.jit
def _k_mc(srcs: Any, ns: int, dsts: Any, nd: int, op: int) -> None:
    # Each thread reads all sources of its elements before writing: aliasing-safe.
    for i in range(cuda.grid(1), srcs[0].size, cuda.gridsize(1)):
        v = srcs[0][i]
        for k in range(1, ns):
            v = _combine(v, srcs[k][i], op)
        for d in range(nd):
            dsts[d][i] = v


@cuda.jit
def _k_mc_f16(srcs: Any, ns: int, dsts: Any, nd: int, op: int) -> None:
    for i in range(cuda.grid(1), srcs[0].size, cuda.gridsize(1)):
        v = np.float32(srcs[0][i])
        for k in range(1, ns):
            v = _combine(v, np.float32(srcs[k][i]), op)
        h = np.float16(v)
        for d in range(nd):
            dsts[d][i] = h


@cuda.jit
def _k_mc_bf16(srcs: Any, ns: int, dsts: Any, nd: int, op: int) -> None:
    for i in range(cuda.grid(1), srcs[0].size, cuda.gridsize(1)):
        v = _bf16_widen(srcs[0][i])
        for k in range(1, ns):
            v = _combine(v, _bf16_widen(srcs[k][i]), op)
        h = _bf16_narrow(v)
        for d in range(nd):
            dsts[d][i] = h


@cuda.jit
def _k_quantize(x: Any, scale: float, lim: float, out: Any) -> None:
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = _quantize_one(x[i], scale, lim)


@cuda.jit
def _k_dequantize(q: Any, scale: float, out: Any) -> None:
    for i in range(cuda.grid(1), q.size, cuda.gridsize(1)):
        out[i] = np.float32(np.float64(q[i]) / scale)


@cuda.jit
def _k_topk(logits: Any, k: int, ids: Any, w: Any) -> None:
    for r in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        _row_topk(logits, r, k, ids, w)


@cuda.jit
def _k_hidden(emb: Any, tokens: Any, hidden: Any, new_hidden: Any) -> None:
    dim = hidden.shape[1]
    for j in range(cuda.grid(1), hidden.size, cuda.gridsize(1)):
        b = j // dim
        d = j - b * dim
        x = 0.5 * np.float64(hidden[b, d]) + np.float64(emb[tokens[b], d])
        new_hidden[b, d] = np.float32(math.tanh(x))


@cuda.jit
def _k_scores(
    new_hidden: Any, w64: Any, positions: Any, temperature: float, base: Any, scores: Any
) -> None:
    # One thread per (row, vocab entry); the d loop keeps the reference's
    # summation order (float32 products are exact in float64, so FMA is too).
    vocab = w64.shape[1]
    dim = w64.shape[0]
    for j in range(cuda.grid(1), scores.size, cuda.gridsize(1)):
        b = j // vocab
        v = j - b * vocab
        acc = 0.0
        for d in range(dim):
            acc += np.float64(new_hidden[b, d]) * w64[d, v]
        if temperature > 0:
            acc = acc / temperature + _gumbel(_row_key(base, b, positions[b]), v)
        scores[b, v] = acc


@cuda.jit
def _k_argmax(scores: Any, out: Any) -> None:
    for b in range(cuda.grid(1), scores.shape[0], cuda.gridsize(1)):
        best = 0
        top = scores[b, 0]
        for v in range(1, scores.shape[1]):
            if scores[b, v] > top:
                best = v
                top = scores[b, v]
        out[b] = best


@cuda.jit
def _k_attention(q: Any, kk: Any, vv: Any, held: int, head0: int, group: int, kv0: int,
                 frac: int, p: Any, w: Any, out: Any) -> None:
    # One thread per (new row, query head): reference.attention_fixed's steps, the
    # softmax's denominator summed in order (the reference sums pairwise: the two
    # differ by ulps, which a 12-bit weight shows about once in 1e11 elements)
    c, nq, d = q.shape
    one = 1 << frac
    scale = float(one * one)
    root = math.sqrt(float(d))
    for j in range(cuda.grid(1), c * nq, cuda.gridsize(1)):
        i = j // nq
        h = j - i * nq
        upto = held + i + 1
        kv = (head0 + h) // group - kv0
        top = -math.inf
        for t in range(upto):
            acc = 0
            for e in range(d):
                acc += kk[kv, t, e] * q[i, h, e]
            sc = float(acc) / scale / root
            p[j, t] = sc
            if sc > top:
                top = sc
        denom = 0.0
        for t in range(upto):
            p[j, t] = math.exp(p[j, t] - top)
            denom += p[j, t]
        for t in range(upto):
            w[j, t] = np.int64(round(p[j, t] / denom * one))
        for e in range(d):
            acc = 0
            for t in range(upto):
                acc += w[j, t] * vv[kv, t, e]
            out[i, h * d + e] = (acc + (one >> 1)) >> frac


# --------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------


def _is_device(a: Any) -> bool:
    return hasattr(a, "copy_to_host")


def _host_view(a: np.ndarray) -> np.ndarray:
    # bfloat16 travels as its uint16 bits.
    return a.view(np.uint16) if a.dtype == BF16 else a


class NumbaCudaBackend(Backend):
    """Numba CUDA kernels (or the CUDA simulator when NUMBA_ENABLE_CUDASIM=1)."""

    name = "numba-cuda"

    def __init__(self) -> None:
        if SIMULATED:
            self.device = "cuda-simulator (cpu)"
        else:
            dev = cuda.get_current_device()
            name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            self.device = f"cuda:0 {name}"
        self._weights: weakref.WeakKeyDictionary[ToyDecoder, tuple[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )

    # --- data movement -------------------------------------------------
    def asarray(self, a: np.ndarray) -> Any:
        if _is_device(a):
            return a
        return cuda.to_device(np.ascontiguousarray(_host_view(np.asarray(a))))

    def to_host(self, a: Any) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        if not _is_device(a):
            a = cuda.as_cuda_array(a)
        h = np.asarray(a.copy_to_host())
        return h.view(BF16) if h.dtype == np.uint16 else h

    def empty(self, shape: int | tuple[int, ...], dtype: str) -> Any:
        dt = np_dtype(dtype)
        return cuda.device_array(shape, dtype=np.uint16 if dt == BF16 else dt)

    def synchronize(self) -> None:
        cuda.synchronize()

    def _dev(self, a: Any) -> Any:
        if _is_device(a):
            return a
        if hasattr(a, "__cuda_array_interface__"):
            return cuda.as_cuda_array(a)
        return self.asarray(np.asarray(a))

    # --- kernels ---------------------------------------------------------
    def make_tensor(self, rank: int, step: int, count: int, dtype: str, seed: int = 0) -> Any:
        dt = np_dtype(dtype)
        name = dtype_name(dt)
        count = reference._check_count(count)
        bits, shift = TENSOR_SPEC[name]
        key = np.uint64(reference.tensor_key(seed, rank, step))
        mask = np.uint64((1 << bits) - 1)
        out = self.empty(count, name)
        if count == 0:
            return out
        grid = _grid(count)
        with _quiet():
            if dt == BF16:
                _k_make_bf16[grid](out, key, mask, 2.0**-shift)
            elif dt in (np.float32, np.float16):
                _k_make_float[grid](out, key, mask, 2.0**-shift)
            else:
                _k_make_int[grid](out, key, mask)
        return out

    def multicast_reduce(self, srcs: Sequence[Any], dsts: Sequence[Any], op: str) -> None:
        code = op_code(op)
        if len(srcs) == 0:
            raise ValueError("multicast_reduce needs at least one source")
        # One device array per distinct input object, so aliases stay aliases.
        devs: dict[int, Any] = {}
        for a in list(srcs) + list(dsts):
            if id(a) not in devs:
                devs[id(a)] = self._dev(a)
        dsrc = [devs[id(a)] for a in srcs]
        ddst = [devs[id(a)] for a in dsts]
        shape, dt = reference.check_multicast(dsrc, ddst)
        if math.prod(shape) == 0 or not ddst:
            return
        if len(dsrc) > MAX_FUSED or len(ddst) > MAX_FUSED:
            self._multicast_on_host(srcs, dsts, op)
            return
        src_t = tuple(a.reshape(-1) for a in dsrc)
        dst_t = tuple(a.reshape(-1) for a in ddst)
        ns, nd = len(src_t), len(dst_t)
        src_t = src_t + (src_t[0],) * (MAX_FUSED - ns)
        dst_t = dst_t + (dst_t[0],) * (MAX_FUSED - nd)
        kernel = {np.dtype(np.uint16): _k_mc_bf16, np.dtype(np.float16): _k_mc_f16}.get(dt, _k_mc)
        with _quiet():
            kernel[_grid(src_t[0].size)](src_t, ns, dst_t, nd, code)
        for a in dsts:  # copy results back into host outputs
            if isinstance(a, np.ndarray):
                a[...] = self.to_host(devs[id(a)]).reshape(a.shape)

    def _multicast_on_host(self, srcs: Sequence[Any], dsts: Sequence[Any], op: str) -> None:
        # More arrays than the fused kernel takes: reduce on the host (rare, slow).
        hs = [self.to_host(a) for a in srcs]
        hd = [np.empty_like(hs[0]) for _ in dsts]
        reference.multicast_reduce(hs, hd, op)
        for a, h in zip(dsts, hd, strict=True):
            if isinstance(a, np.ndarray):
                a[...] = h
            else:
                self._dev(a).copy_to_device(_host_view(h).reshape(a.shape))

    def quantize(self, x: Any, scale: float, out_dtype: str = "int32") -> Any:
        scale = reference._check_scale(scale)
        name = reference.quant_dtype(out_dtype)
        dx = self._dev(x if _is_device(x) else np.asarray(x, dtype=np.float32))
        if dx.dtype != np.float32:
            raise ValueError(f"quantize takes float32, got {dx.dtype}")
        out = cuda.device_array(dx.shape, dtype=DTYPES[name])
        if dx.size:
            with _quiet():
                _k_quantize[_grid(dx.size)](
                    dx.reshape(-1), scale, QUANT_MAX[name], out.reshape(-1)
                )
        return out

    def dequantize(self, q: Any, scale: float) -> Any:
        scale = reference._check_scale(scale)
        dq = self._dev(q)
        out = cuda.device_array(dq.shape, dtype=np.float32)
        if dq.size:
            with _quiet():
                _k_dequantize[_grid(dq.size)](dq.reshape(-1), scale, out.reshape(-1))
        return out

    def moe_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        dl = self._dev(logits if _is_device(logits) else np.asarray(logits, dtype=np.float32))
        k = reference.check_topk(tuple(dl.shape), k)
        ids = cuda.device_array((dl.shape[0], k), dtype=np.int32)
        w = cuda.device_array((dl.shape[0], k), dtype=np.float32)
        if dl.shape[0]:
            with _quiet():
                _k_topk[_grid(dl.shape[0])](dl, k, ids, w)
        return ids, w

    def attention_fixed(self, q: Any, kk: Any, vv: Any, held: int, head0: int, group: int,
                        kv0: int, frac_bits: int) -> Any:
        qa, ka, va = reference.check_attention_args(q, kk, vv, held, head0, group, kv0)
        c, nq, d = qa.shape
        out = np.zeros((c, nq * d), np.int64)
        if c and nq and d:
            total = ka.shape[1]
            dout = cuda.to_device(out)
            p = cuda.device_array((c * nq, total), dtype=np.float64)
            w = cuda.device_array((c * nq, total), dtype=np.int64)
            with _quiet():
                _k_attention[_grid(c * nq)](cuda.to_device(qa), cuda.to_device(ka),
                                            cuda.to_device(va), held, head0, group, kv0,
                                            frac_bits, p, w, dout)
            dout.copy_to_host(out)
        return out

    def _weights_on_device(self, weights: ToyDecoder) -> tuple[Any, Any]:
        if weights not in self._weights:
            self._weights[weights] = (
                cuda.to_device(weights.embedding),
                cuda.to_device(weights.projection64),
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
        # Validation needs the values (token range): small per-step copies.
        tok, hid, pos, t = reference.check_decoder_args(
            weights,
            self.to_host(tokens) if not isinstance(tokens, np.ndarray) else tokens,
            self.to_host(hidden) if not isinstance(hidden, np.ndarray) else hidden,
            self.to_host(positions) if not isinstance(positions, np.ndarray) else positions,
            temperature,
        )
        emb, w64 = self._weights_on_device(weights)
        batch = tok.shape[0]
        dtok, dhid, dpos = cuda.to_device(tok), cuda.to_device(hid), cuda.to_device(pos)
        new_hidden = cuda.device_array(hid.shape, dtype=np.float32)
        scores = cuda.device_array((batch, weights.vocab), dtype=np.float64)
        next_tok = cuda.device_array(batch, dtype=np.int32)
        base = np.uint64(reference.derive_key(reference.TAG_GUMBEL, seed))
        if batch:
            with _quiet():
                _k_hidden[_grid(hid.size)](emb, dtok, dhid, new_hidden)
                _k_scores[_grid(scores.size)](new_hidden, w64, dpos, t, base, scores)
                _k_argmax[_grid(batch)](scores, next_tok)
        return next_tok, new_hidden
