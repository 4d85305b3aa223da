"""The ``numba-cpu`` backend: parallel (prange) Numba kernels on host arrays.

float16 and bfloat16 are handled as uint16 bit patterns (Numba's CPU target
has no float16 type): widened to float32 exactly, narrowed back with
round-to-nearest-even (see :mod:`kernels._device`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import _device, reference
from .base import Backend
from .dtypes import BF16, DTYPES, dtype_name, np_dtype, op_code
from .reference import QUANT_MAX, TENSOR_SPEC, ToyDecoder

# --------------------------------------------------------------------------
# Bit casts (LLVM bitcast; no memory round trip)
# --------------------------------------------------------------------------


def _as_i32(builder: Any, val: Any) -> Any:
    width = val.type.width
    if width > 32:
        return builder.trunc(val, ir.IntType(32))
    if width < 32:
        return builder.zext(val, ir.IntType(32))
    return val


@intrinsic
def _f32_from_bits(typingctx: Any, u: Any) -> Any:
    if not isinstance(u, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(_as_i32(builder, args[0]), ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def _bits_from_f32(typingctx: Any, f: Any) -> Any:
    if f != types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(f), codegen


_D = _device.build(
    lambda f: njit(nogil=True)(f),
    {"f32_from_bits": _f32_from_bits, "bits_from_f32": _bits_from_f32},
)
_tensor_int = _D["tensor_int"]
_row_key = _D["row_key"]
_gumbel = _D["gumbel"]
_f16_widen = _D["f16_widen"]
_f16_narrow = _D["f16_narrow"]
_bf16_widen = _D["bf16_widen"]
_bf16_narrow = _D["bf16_narrow"]
_quantize_one = _D["quantize_one"]
_row_topk = _D["row_topk"]

#: Public for tests: the compiled scalar conversions.
f16_widen, f16_narrow, bf16_widen, bf16_narrow = _f16_widen, _f16_narrow, _bf16_widen, _bf16_narrow

KIND_F16, KIND_BF16 = 1, 2
#: Sources/destinations the fused kernel takes (tuples are padded to this,
#: so one compiled kernel serves every count).
MAX_FUSED = 8
#: Elements per chunk (64 KiB of float32): the scratch stays in L2 while
#: the sources stream through (4096 measured slower on one thread).
CHUNK = 16384
#: Below this many elements multicast_reduce uses the NumPy path (identical
#: results): it is as fast when everything is in cache and never waits for
#: worker threads, which costs milliseconds on an oversubscribed host.
PARALLEL_MIN = 1 << 16


# --------------------------------------------------------------------------
# Fused multicast reduction
# --------------------------------------------------------------------------


@njit(nogil=True)
def _first(buf: Any, a: Any, b: Any, ns: int, op: int) -> None:
    # buf = a (one source) or op(a, b); loops stay simple so LLVM vectorises.
    m = buf.size
    if ns == 1:
        for j in range(m):
            buf[j] = a[j]
    elif op == 0:
        for j in range(m):
            buf[j] = a[j] + b[j]
    elif op == 1:
        for j in range(m):
            x = a[j]
            y = b[j]
            buf[j] = x if (x > y or x != x) else y
    else:
        for j in range(m):
            x = a[j]
            y = b[j]
            buf[j] = x if (x < y or x != x) else y


@njit(nogil=True)
def _fold(buf: Any, s: Any, op: int) -> None:
    m = buf.size
    if op == 0:
        for j in range(m):
            buf[j] += s[j]
    elif op == 1:
        for j in range(m):
            x = buf[j]
            y = s[j]
            buf[j] = x if (x > y or x != x) else y
    else:
        for j in range(m):
            x = buf[j]
            y = s[j]
            buf[j] = x if (x < y or x != x) else y


@njit(nogil=True)
def _widen16(out: Any, s: Any, kind: int) -> None:
    if kind == KIND_F16:
        for j in range(out.size):
            out[j] = _f16_widen(s[j])
    else:
        for j in range(out.size):
            out[j] = _bf16_widen(s[j])


@njit(nogil=True)
def _narrow16(out: Any, buf: Any, kind: int) -> None:
    if kind == KIND_F16:
        for j in range(out.size):
            out[j] = _f16_narrow(buf[j])
    else:
        for j in range(out.size):
            out[j] = _bf16_narrow(buf[j])


def _mc_native_py(srcs: Any, ns: int, dsts: Any, nd: int, op: int) -> None:
    # Chunked so each source byte is read once and each output written once;
    # the chunk result lives in a small scratch that stays in cache, and all
    # sources of a chunk are read before any output is written (aliasing-safe).
    n = srcs[0].size
    nch = (n + CHUNK - 1) // CHUNK
    for c in prange(nch):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        buf = np.empty(hi - lo, dsts[0].dtype)
        _first(buf, srcs[0][lo:hi], srcs[1][lo:hi], ns, op)
        for k in range(2, ns):
            _fold(buf, srcs[k][lo:hi], op)
        for d in range(nd):
            dsts[d][lo:hi] = buf


def _mc_16_py(srcs: Any, ns: int, dsts: Any, nd: int, op: int, kind: int) -> None:
    # Same shape as _mc_native_py; accumulates in float32, rounds once.
    n = srcs[0].size
    nch = (n + CHUNK - 1) // CHUNK
    for c in prange(nch):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        buf = np.empty(hi - lo, np.float32)
        tmp = np.empty(hi - lo, np.float32)
        out = np.empty(hi - lo, np.uint16)
        _widen16(buf, srcs[0][lo:hi], kind)
        for k in range(1, ns):
            _widen16(tmp, srcs[k][lo:hi], kind)
            _fold(buf, tmp, op)
        _narrow16(out, buf, kind)
        for d in range(nd):
            dsts[d][lo:hi] = out


_mc_native = njit(parallel=True, nogil=True)(_mc_native_py)


@njit(nogil=True)
def _pair_inplace(a: Any, b: Any, op: int) -> None:
    # a = b = op(a, b), one pass (the memory plane's two-member call); the same
    # element rules as _first.
    if op == 0:
        for j in range(a.size):
            r = a[j] + b[j]
            a[j] = r
            b[j] = r
    else:
        for j in range(a.size):
            x = a[j]
            y = b[j]
            r = x if ((x > y if op == 1 else x < y) or x != x) else y
            a[j] = r
            b[j] = r
_mc_16 = njit(parallel=True, nogil=True)(_mc_16_py)


# --------------------------------------------------------------------------
# Other kernels
# --------------------------------------------------------------------------


@njit(parallel=True, nogil=True)
def _make_int(out: Any, key: Any, mask: Any) -> None:
    for i in prange(out.size):
        out[i] = _tensor_int(key, i, mask)


@njit(parallel=True, nogil=True)
def _make_f32(out: Any, key: Any, mask: Any, scale: float) -> None:
    for i in prange(out.size):
        out[i] = np.float32(np.float64(_tensor_int(key, i, mask)) * scale)


@njit(parallel=True, nogil=True)
def _make_16(out: Any, key: Any, mask: Any, scale: float, kind: int) -> None:
    for i in prange(out.size):
        f = np.float32(np.float64(_tensor_int(key, i, mask)) * scale)
        out[i] = _f16_narrow(f) if kind == KIND_F16 else _bf16_narrow(f)


@njit(parallel=True, nogil=True)
def _quantize(x: Any, scale: float, lim: float, out: Any) -> None:
    for i in prange(x.size):
        out[i] = _quantize_one(x[i], scale, lim)


@njit(parallel=True, nogil=True)
def _dequantize(q: Any, scale: float, out: Any) -> None:
    for i in prange(q.size):
        out[i] = np.float32(np.float64(q[i]) / scale)


@njit(parallel=True, nogil=True)
def _topk(logits: Any, k: int, ids: Any, w: Any) -> None:
    for r in prange(logits.shape[0]):
        _row_topk(logits, r, k, ids, w)


@njit(parallel=True, nogil=True)
def _decode(
    emb: Any,
    w64: Any,
    tokens: Any,
    hidden: Any,
    positions: Any,
    temperature: float,
    base: Any,
    next_tok: Any,
    new_hidden: Any,
) -> None:
    dim = hidden.shape[1]
    vocab = w64.shape[1]
    for b in prange(hidden.shape[0]):
        tok = tokens[b]
        for d in range(dim):
            x = 0.5 * np.float64(hidden[b, d]) + np.float64(emb[tok, d])
            new_hidden[b, d] = np.float32(math.tanh(x))
        # d-outer / v-inner: same per-logit summation order as the reference,
        # but streams rows of W contiguously.
        acc = np.zeros(vocab)
        for d in range(dim):
            hd = np.float64(new_hidden[b, d])
            for v in range(vocab):
                acc[v] += hd * w64[d, v]
        if temperature > 0:
            rk = _row_key(base, b, positions[b])
            for v in range(vocab):
                acc[v] = acc[v] / temperature + _gumbel(rk, v)
        best = 0
        top = acc[0]
        for v in range(1, vocab):
            if acc[v] > top:
                best = v
                top = acc[v]
        next_tok[b] = best


@njit(nogil=True)
def _pairwise_sum(a: Any, lo: int, n: int) -> float:
    # NumPy's pairwise summation of a contiguous float64 array, step for step
    # (blocks of 8 partial sums up to 128 elements, halves above), so a softmax
    # denominator has NumPy's bits
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    if n <= 128:
        r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
        r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
        i = 8
        end = n - n % 8
        while i < end:
            r0 += a[lo + i]
            r1 += a[lo + i + 1]
            r2 += a[lo + i + 2]
            r3 += a[lo + i + 3]
            r4 += a[lo + i + 4]
            r5 += a[lo + i + 5]
            r6 += a[lo + i + 6]
            r7 += a[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise_sum(a, lo, n2) + _pairwise_sum(a, lo + n2, n - n2)


@njit(nogil=True)
def _attention(q: Any, kk: Any, vv: Any, held: int, head0: int, group: int, kv0: int,
               frac: int, out: Any) -> None:
    # reference.attention_fixed, one (row, head) at a time: the integer dot
    # products are exact in any order, the float64 steps are the reference's
    c, nq, d = q.shape
    one = 1 << frac
    scale = float(one * one)
    root = math.sqrt(float(d))
    half = one >> 1
    total = kk.shape[1]
    p = np.empty(total)
    w = np.empty(total, np.int64)
    row = np.zeros(d, np.int64)
    for i in range(c):
        upto = held + i + 1
        for j in range(nq):
            kv = (head0 + j) // group - kv0
            top = -math.inf
            for t in range(upto):
                acc = 0
                for e in range(d):
                    acc += kk[kv, t, e] * q[i, j, e]
                s = float(acc) / scale / root
                p[t] = s
                if s > top:
                    top = s
            for t in range(upto):
                p[t] = math.exp(p[t] - top)
            denom = _pairwise_sum(p, 0, upto)
            for t in range(upto):
                w[t] = np.int64(np.rint(p[t] / denom * one))
            row[:] = 0
            for t in range(upto):  # along the values' rows: contiguous reads
                wt = w[t]
                for e in range(d):
                    row[e] += wt * vv[kv, t, e]
            for e in range(d):
                out[i, j * d + e] = (row[e] + half) >> frac


# --------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------


def _ro_flat(a: np.ndarray) -> np.ndarray:
    # One array type for every source (1-D, C, read-only), so all sources fit
    # a homogeneous tuple whether or not the caller's buffers are writable.
    v = np.ascontiguousarray(a).reshape(-1)
    if v.dtype == np.float16 or v.dtype == BF16:
        v = v.view(np.uint16)
    v = v.view()
    v.flags.writeable = False
    return v


def _kind16(dt: np.dtype) -> int:
    if dt.itemsize != 2:  # the common case, without the dtype comparisons (~0.3 us each)
        return 0
    if dt == np.float16:
        return KIND_F16
    if dt == BF16:
        return KIND_BF16
    return 0


class NumbaCpuBackend(Backend):
    """Numba ``parallel=True`` kernels on host NumPy arrays."""

    name = "numba-cpu"

    def __init__(self) -> None:
        self.device = f"cpu ({numba.get_num_threads()} threads)"
        #: Sources of at most this many bytes are reduced on the calling thread
        #: (the NumPy path) whatever their element count, for the dtypes that
        #: compute in themselves. The switch daemon raises it
        #: (switchd.memplane.SERIAL_MAX_BYTES): below its workers' spin limit a
        #: pool thread on their cores waits behind them.
        self.serial_bytes = 0

    def set_threads(self, n: int) -> None:
        """Use ``n`` worker threads (at most NUMBA_NUM_THREADS); 1 when many
        emulated nodes share a host, to avoid oversubscription."""
        numba.set_num_threads(int(n))
        self.device = f"cpu ({numba.get_num_threads()} threads)"

    def asarray(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a)

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def make_tensor(self, rank: int, step: int, count: int, dtype: str, seed: int = 0) -> Any:
        dt = np_dtype(dtype)
        name = dtype_name(dt)
        count = reference._check_count(count)
        bits, shift = TENSOR_SPEC[name]
        key = np.uint64(reference.tensor_key(seed, rank, step))
        mask = np.uint64((1 << bits) - 1)
        out = np.empty(count, dtype=dt)
        kind = _kind16(dt)
        if kind:
            _make_16(out.view(np.uint16), key, mask, 2.0**-shift, kind)
        elif dt == np.float32:
            _make_f32(out, key, mask, 2.0**-shift)
        else:
            _make_int(out, key, mask)
        return out

    def multicast_reduce(self, srcs: Sequence[Any], dsts: Sequence[Any], op: str) -> None:
        code = op_code(op)
        srcs = [s if s.__class__ is np.ndarray else np.asarray(s) for s in srcs]
        shape, dt = reference.check_multicast(srcs, dsts)
        size = srcs[0].size
        if size == 0 or len(dsts) == 0:
            return
        if (size < PARALLEL_MIN or size * dt.itemsize <= self.serial_bytes) \
                and not _kind16(dt):
            reference.multicast_reduce_native(srcs, dsts, code)  # small: no thread pool
            return
        if (
            size < PARALLEL_MIN
            or len(srcs) > MAX_FUSED
            or len(dsts) > MAX_FUSED
            or not all(isinstance(d, np.ndarray) and d.flags.c_contiguous for d in dsts)
        ):
            # Small inputs, or what the fused kernel does not take.
            reference.multicast_reduce(srcs, dsts, op)
            return
        src_t = tuple(_ro_flat(s) for s in srcs)
        kind = _kind16(dt)
        dst_t = tuple(d.reshape(-1).view(np.uint16) if kind else d.reshape(-1) for d in dsts)
        ns, nd = len(src_t), len(dst_t)
        src_t = src_t + (src_t[0],) * (MAX_FUSED - ns)
        dst_t = dst_t + (dst_t[0],) * (MAX_FUSED - nd)
        if kind:
            _mc_16(src_t, ns, dst_t, nd, code, kind)
        else:
            _mc_native(src_t, ns, dst_t, nd, code)

    def reduce_pair(self, a: np.ndarray, b: np.ndarray, op: str) -> None:
        if a.nbytes <= max(self.serial_bytes, (PARALLEL_MIN - 1) * a.itemsize) \
                and not _kind16(a.dtype):
            # one compiled pass on this thread: the checks and NumPy fold of
            # multicast_reduce cost ~2-3 us a call, more than 4 KiB of arithmetic
            _pair_inplace(a, b, op_code(op))
        else:
            self.multicast_reduce([a, b], [a, b], op)

    def quantize(self, x: Any, scale: float, out_dtype: str = "int32") -> Any:
        scale = reference._check_scale(scale)
        name = reference.quant_dtype(out_dtype)
        xs = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty(xs.shape, dtype=DTYPES[name])
        _quantize(xs.reshape(-1), scale, QUANT_MAX[name], out.reshape(-1))
        return out

    def dequantize(self, q: Any, scale: float) -> Any:
        scale = reference._check_scale(scale)
        qs = np.ascontiguousarray(q)
        if qs.dtype not in (np.int32, np.int64):
            qs = qs.astype(np.int64)
        out = np.empty(qs.shape, dtype=np.float32)
        _dequantize(qs.reshape(-1), scale, out.reshape(-1))
        return out

    def moe_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        x = np.ascontiguousarray(logits, dtype=np.float32)
        k = reference.check_topk(x.shape, k)
        ids = np.empty((x.shape[0], k), dtype=np.int32)
        w = np.empty((x.shape[0], k), dtype=np.float32)
        _topk(x, k, ids, w)
        return ids, w

    def attention_fixed(self, q: Any, kk: Any, vv: Any, held: int, head0: int, group: int,
                        kv0: int, frac_bits: int) -> Any:
        qa, ka, va = reference.check_attention_args(q, kk, vv, held, head0, group, kv0)
        out = np.zeros((qa.shape[0], qa.shape[1] * qa.shape[2]), np.int64)
        _attention(qa, ka, va, held, head0, group, kv0, frac_bits, out)
        return out

    def decoder_step(
        self,
        weights: ToyDecoder,
        tokens: Any,
        hidden: Any,
        positions: Any,
        temperature: float,
        seed: int,
    ) -> tuple[Any, Any]:
        tok, hid, pos, t = reference.check_decoder_args(
            weights, tokens, hidden, positions, temperature
        )
        base = np.uint64(reference.derive_key(reference.TAG_GUMBEL, seed))
        next_tok = np.empty(tok.shape[0], dtype=np.int32)
        new_hidden = np.empty_like(hid)
        _decode(
            weights.embedding, weights.projection64, tok, hid, pos, t, base, next_tok, new_hidden
        )
        return next_tok, new_hidden
