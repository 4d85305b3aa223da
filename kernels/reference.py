"""NumPy reference for every kernel: this module IS the specification.

Every backend must return what these functions return, with the same
signatures. Where a backend may legitimately differ (the last ulp of an
``exp`` or ``tanh``), the docstring says so; everything else is bitwise.

Seeded values come from a counter-based hash (splitmix64's finaliser applied
to ``key + (i + 1) * golden``), so any backend can compute element ``i`` on
its own, in any order, on any device, and get the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import BF16, DTYPES, FLOAT_DTYPES, dtype_name, np_dtype, op_code

# --------------------------------------------------------------------------
# Counter-based hashing
# --------------------------------------------------------------------------

MASK64 = (1 << 64) - 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_U1 = np.uint64(1)
_U11 = np.uint64(11)
_U16 = np.uint64(16)
_TWO_M53 = 2.0**-53


def _tag(text: str) -> int:
    return int.from_bytes(text.encode().ljust(8, b"\0")[:8], "little")


# Domain-separation tags: each use of the hash gets its own stream.
TAG_TENSOR = _tag("sf:tensr")
TAG_GUMBEL = _tag("sf:gumbl")
TAG_EMBED = _tag("sf:embed")
TAG_PROJ = _tag("sf:proj")


def mix64(z: Any) -> Any:
    """splitmix64 finaliser on ``np.uint64`` scalars or arrays (wrapping arithmetic).

    The compiled backends compile this very function, so it is written with
    operators only.
    """
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def mix64_int(z: int) -> int:
    """:func:`mix64` on a Python int (no NumPy overflow warnings; used for keys)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def derive_key(*words: int) -> int:
    """Fold words (seed, rank, step, ...) into a 64-bit stream key.

    ``k = 0; for w in words: k = mix64(k ^ w)``. Negative words are taken
    modulo 2**64. Kernels continue the same fold on the device (see
    :func:`row_keys`).
    """
    k = 0
    for w in words:
        k = mix64_int(k ^ (int(w) & MASK64))
    return k


def counter_hashes(key: int, count: int) -> np.ndarray:
    """``mix64(key + (i + 1) * GOLDEN)`` for ``i in range(count)``, as uint64."""
    i = np.arange(count, dtype=np.uint64)
    return mix64(np.uint64(key) + (i + _U1) * GOLDEN)


def unit_float(h: np.ndarray) -> np.ndarray:
    """Map uint64 hashes to float64 uniformly in the open interval (0, 1)."""
    return ((h >> _U11).astype(np.float64) + 0.5) * _TWO_M53


# --------------------------------------------------------------------------
# Seeded tensors with an exactly known allreduce
# --------------------------------------------------------------------------

#: Most ranks whose sum :func:`make_tensor` guarantees to be exact.
MAX_WORLD = 64

#: dtype -> (magnitude bits, binary shift). Element = +-m * 2**-shift with
#: 1 <= m <= 2**bits. The sum of 64 such values, and every partial sum in any
#: order, is an integer multiple of 2**-shift no larger than 2**(bits+6) units,
#: which fits the significand: float32 2**23 <= 2**24, float16 2**11 <= 2**11,
#: bfloat16 2**8 <= 2**8 (8-bit significand: only m in 1..4). All values are
#: normal numbers in their dtype.
TENSOR_SPEC: dict[str, tuple[int, int]] = {
    "float32": (17, 8),
    "float16": (5, 4),
    "bfloat16": (2, 2),
    "int32": (20, 0),
    "int64": (40, 0),
}


def tensor_key(seed: int, rank: int, step: int) -> int:
    """The stream key of ``make_tensor(rank, step, ..., seed)``."""
    return derive_key(TAG_TENSOR, seed, rank, step)


def _check_count(count: int) -> int:
    count = int(count)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return count


def make_tensor(rank: int, step: int, count: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Seeded test tensor of ``count`` elements for ``rank`` at ``step``.

    Element ``i`` is ``+-m * 2**-shift`` (see :data:`TENSOR_SPEC`) with sign
    and ``m`` taken from ``h = mix64(key + (i+1)*GOLDEN)``: sign = bit 0,
    ``m = 1 + ((h >> 16) & (2**bits - 1))``. Never zero, so never all zeros;
    varies with rank, step, seed and index; the allreduce over up to
    :data:`MAX_WORLD` ranks is exact in any order.
    """
    name = dtype_name(np_dtype(dtype))
    count = _check_count(count)
    bits, shift = TENSOR_SPEC[name]
    h = counter_hashes(tensor_key(seed, rank, step), count)
    mag = ((h >> _U16) & np.uint64((1 << bits) - 1)).astype(np.int64) + 1
    v = np.where((h & _U1).astype(bool), -mag, mag)
    if name in FLOAT_DTYPES:
        # float64 holds the exact value; the cast to the dtype is exact too.
        return (v.astype(np.float64) * 2.0**-shift).astype(DTYPES[name])
    return v.astype(DTYPES[name])


def expected_allreduce(
    world: int, step: int, count: int, dtype: str, op: str, seed: int = 0
) -> np.ndarray:
    """The exact allreduce of ``make_tensor(r, step, count, dtype, seed)`` over ``r < world``.

    Computed from the definition in float64/int64 (exact), never by running
    a collective. ``op="sum"`` requires ``world <= MAX_WORLD``.
    """
    code = op_code(op)
    world = int(world)
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if code == 0 and world > MAX_WORLD:
        raise ValueError(f"exact sums are guaranteed for world <= {MAX_WORLD}, got {world}")
    name = dtype_name(np_dtype(dtype))
    wide = np.float64 if name in FLOAT_DTYPES else np.int64
    acc = make_tensor(0, step, count, name, seed).astype(wide)
    ufunc = (np.add, np.maximum, np.minimum)[code]
    for r in range(1, world):
        ufunc(acc, make_tensor(r, step, count, name, seed).astype(wide), out=acc)
    return acc.astype(DTYPES[name])


def count_wrong(result: Any, expected: np.ndarray) -> int:
    """Number of elements of ``result`` that differ from ``expected``.

    The comparison is EXACT (``==`` per element) because :func:`make_tensor`
    values make every allreduce exactly representable: any rounding error
    is a bug. NaN never equals anything, so it counts as wrong. ``-0.0``
    equals ``0.0``. Shapes and dtypes must match (host arrays).
    """
    r = np.asarray(result)
    e = np.asarray(expected)
    if r.shape != e.shape:
        raise ValueError(f"shape mismatch: result {r.shape} vs expected {e.shape}")
    if r.dtype != e.dtype:
        raise ValueError(f"dtype mismatch: result {r.dtype} vs expected {e.dtype}")
    return int(np.count_nonzero(~(r == e)))


# --------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------

_UFUNCS = (np.add, np.maximum, np.minimum)


def wide_dtype(dt: np.dtype) -> np.dtype:
    """Accumulation dtype: float32 for the 16-bit floats, else the dtype itself."""
    if dt == np.float16 or dt == BF16:
        return np.dtype(np.float32)
    return np.dtype(dt)


def check_multicast(srcs: Sequence[Any], dsts: Sequence[Any]) -> tuple[tuple[int, ...], np.dtype]:
    """Validate multicast_reduce arguments; return the common shape and dtype."""
    if len(srcs) == 0:
        raise ValueError("multicast_reduce needs at least one source")
    shape = tuple(srcs[0].shape)
    dt = np.dtype(srcs[0].dtype)
    # ndarray shapes are tuples and dtypes compare directly: no conversion per
    # array (this check runs on every call, small ones included)
    for seq in (srcs, dsts):
        for a in seq:
            if a.shape != shape or a.dtype != dt:
                raise ValueError(
                    f"all srcs and dsts must share shape and dtype: {shape}/{dt} vs "
                    f"{a.shape}/{a.dtype}"
                )
    return shape, dt


def multicast_reduce(srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], op: str) -> None:
    """Reduce ``srcs`` element-wise and store the result into every array in ``dsts``.

    Semantics (bitwise, every backend): a left fold ``r = srcs[0]; r = op(r, s)``
    in source order. float32/int32/int64 compute in their own dtype (integers
    wrap on overflow); float16/bfloat16 accumulate in float32 and round to
    nearest-even once at the end. ``max``/``min`` follow ``np.maximum`` /
    ``np.minimum`` (NaN propagates; on equal values the later operand wins,
    which decides the sign of zero). ``dsts`` may be the same arrays as
    ``srcs`` (all sources are read before an element is written), but must
    not partially overlap them.
    """
    ufunc = _UFUNCS[op_code(op)]
    _, dt = check_multicast(srcs, dsts)
    wide = wide_dtype(dt)
    acc = np.array(srcs[0], dtype=wide, copy=True)  # a copy, so aliasing is harmless
    with np.errstate(all="ignore"):  # inf - inf -> NaN and overflow are defined results
        for s in srcs[1:]:
            ufunc(acc, np.asarray(s).astype(wide, copy=False), out=acc)
        res = acc.astype(dt, copy=False)
    for d in dsts:
        d[...] = res


def multicast_reduce_native(srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray],
                            code: int) -> None:
    """:func:`multicast_reduce` for checked arguments of a dtype that computes in
    itself (not float16/bfloat16), op given by its registry code: the same left
    fold with none of the per-call checks, for small tensors where those cost
    more than the arithmetic."""
    ufunc = _UFUNCS[code]
    if code == 0 and srcs[0].dtype.kind == "f":
        # only a float sum raises floating-point flags (overflow, inf - inf);
        # max/min and integer arithmetic never do, and errstate costs 2 us
        with np.errstate(all="ignore"):
            _fold(ufunc, srcs, dsts)
    else:
        _fold(ufunc, srcs, dsts)


def _fold(ufunc: Any, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray]) -> None:
    acc = ufunc(srcs[0], srcs[1]) if len(srcs) > 1 else np.array(srcs[0], copy=True)
    for s in srcs[2:]:
        ufunc(acc, s, out=acc)
    for d in dsts:
        d[...] = acc


def reduce_into(acc: np.ndarray, x: np.ndarray, op: str) -> None:
    """``acc = op(acc, x)`` in place; same as ``multicast_reduce([acc, x], [acc], op)``."""
    multicast_reduce([acc, x], [acc], op)


def first_wrap(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first index where the signed-integer sum ``a + b`` would wrap, or None
    (also None for other dtypes: floats overflow to inf, as IEEE says)."""
    if a.dtype.kind != "i":
        return None
    with np.errstate(over="ignore"):
        s = a + b  # wraps
    # overflow iff both operands have the sign the wrapped sum lacks
    bad = ((a ^ s) & (b ^ s)) < 0
    return int(np.argmax(bad)) if bad.any() else None


def sum_wrap(arrays: list[np.ndarray]) -> str | None:
    """Why the signed-integer sum of ``arrays``, added in order, would wrap, or None
    (always None for other dtypes). The memory plane asks before it stores a sum."""
    if len(arrays) < 2 or arrays[0].dtype.kind != "i":
        return None
    acc = arrays[0]
    for k, b in enumerate(arrays[1:], 1):
        i = first_wrap(acc, b)
        if i is not None:
            return (f"{acc.dtype.name} sum would wrap at element {i} ({int(acc[i])} + "
                    f"{int(b[i])}, adding member {k}); workers must scale to leave headroom "
                    f"for {len(arrays)} members")
        with np.errstate(over="ignore"):
            acc = acc + b
    return None


# --------------------------------------------------------------------------
# Fixed point (SwitchML-style)
# --------------------------------------------------------------------------

QUANT_DTYPES = ("int32", "int64")
#: Largest magnitude a quantised value may take: the int max for int32, and
#: for int64 the largest float64 below 2**63 (the conversion must not overflow).
QUANT_MAX: dict[str, float] = {"int32": 2147483647.0, "int64": 9223372036854774784.0}
_MAX_SCALE_EXP = 126


def choose_scale(max_abs: float, contributors: int, bits: int = 32) -> float:
    """Largest power-of-two scale so that summing ``contributors`` quantised values fits.

    With ``q = rint(x * scale)`` and ``|x| <= max_abs``, every ``|q| <=
    (2**(bits-1) - 1) // contributors``, so the integer sum of
    ``contributors`` of them never overflows a ``bits``-wide signed
    accumulator (32 -> int32, 64 -> int64). The scale is capped at 2**126;
    ``max_abs == 0`` returns the cap.
    """
    max_abs = float(max_abs)
    contributors = int(contributors)
    bits = int(bits)
    if not math.isfinite(max_abs) or max_abs < 0:
        raise ValueError(f"max_abs must be finite and >= 0, got {max_abs}")
    if contributors < 1:
        raise ValueError(f"contributors must be >= 1, got {contributors}")
    if not 2 <= bits <= 64:
        raise ValueError(f"bits must be in 2..64, got {bits}")
    limit = ((1 << (bits - 1)) - 1) // contributors
    if bits == 64:
        limit = min(limit, int(QUANT_MAX["int64"]))
    if limit < 1:
        raise ValueError(f"{contributors} contributors cannot share a {bits}-bit sum")
    if max_abs == 0.0:
        return math.ldexp(1.0, _MAX_SCALE_EXP)
    _, ex = math.frexp(max_abs)  # max_abs < 2**ex
    e = limit.bit_length() - 1 - ex  # max_abs * 2**e < 2**(bl-1) <= limit
    # Python compares float with int exactly, so this is exact.
    while e < _MAX_SCALE_EXP and math.ldexp(max_abs, e + 1) <= limit:
        e += 1
    return math.ldexp(1.0, min(e, _MAX_SCALE_EXP))


def _check_scale(scale: float) -> float:
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return scale


def quant_dtype(out_dtype: str | np.dtype) -> str:
    """Validate a quantisation output dtype (int32 or int64); return its name."""
    name = dtype_name(np_dtype(out_dtype))
    if name not in QUANT_DTYPES:
        raise ValueError(f"quantize out_dtype must be int32 or int64, got {name}")
    return name


def quantize(x: np.ndarray, scale: float, out_dtype: str = "int32") -> np.ndarray:
    """``q = rint(float64(float32(x)) * scale)`` (round half to even) as ``out_dtype``.

    The product is computed in float64, exact for a power-of-two scale.
    Out-of-range values saturate at ``+-QUANT_MAX``; NaN becomes 0.
    """
    scale = _check_scale(scale)
    name = quant_dtype(out_dtype)
    v = np.asarray(x, dtype=np.float32).astype(np.float64) * scale
    v[np.isnan(v)] = 0.0
    lim = QUANT_MAX[name]
    np.clip(v, -lim, lim, out=v)
    return np.rint(v).astype(DTYPES[name])


def dequantize(q: np.ndarray, scale: float) -> np.ndarray:
    """``float32(float64(q) / scale)``: the inverse of :func:`quantize`."""
    scale = _check_scale(scale)
    return (np.asarray(q).astype(np.float64) / scale).astype(np.float32)


# --------------------------------------------------------------------------
# MoE top-k gating
# --------------------------------------------------------------------------


def check_topk(shape: tuple[int, ...], k: int) -> int:
    """Validate ``moe_topk`` arguments: 2-D logits and ``1 <= k <= experts``."""
    if len(shape) != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {shape}")
    k = int(k)
    if not 1 <= k <= shape[1]:
        raise ValueError(f"k must be in 1..{shape[1]}, got {k}")
    return k


def moe_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Mixtral-style gating: top-k experts per token and softmax over those k.

    ``ids[t]`` are the k largest logits of row t by descending value, ties
    broken by lower expert index (``-0.0 == 0.0``); logits must be finite.
    ``weights[t] = softmax(logits[t, ids[t]])`` computed in float64 (max
    subtracted, sequential sum) and rounded to float32. ids are bitwise
    identical on every backend; weights may differ in the last ulp (``exp``).
    """
    x = np.asarray(logits, dtype=np.float32)
    k = check_topk(x.shape, k)
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]  # stable: lower index first
    sel = np.take_along_axis(x, order, axis=1).astype(np.float64)
    e = np.exp(sel - sel[:, :1])
    # cumsum sums left to right, like the compiled kernels (np.sum is pairwise).
    total = np.cumsum(e, axis=1)[:, -1:]
    return order.astype(np.int32), (e / total).astype(np.float32)


# --------------------------------------------------------------------------
# Toy decoder
# --------------------------------------------------------------------------


def uniform_pm1(key: int, count: int) -> np.ndarray:
    """Seeded float64 values uniform in (-1, 1)."""
    return 2.0 * unit_float(counter_hashes(key, count)) - 1.0


@dataclass(frozen=True, eq=False)
class ToyDecoder:
    """Seeded weights of a one-layer toy decoder (read-only float32 arrays).

    ``embedding`` is [vocab, dim] uniform in (-1, 1); ``projection`` is
    [dim, vocab] uniform in (-1, 1) / sqrt(dim), so logits are O(1).
    """

    vocab: int = 512
    dim: int = 256
    seed: int = 0
    embedding: np.ndarray = field(init=False, repr=False)
    projection: np.ndarray = field(init=False, repr=False)
    projection64: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.vocab < 2 or self.dim < 1:
            raise ValueError(f"need vocab >= 2 and dim >= 1, got {self.vocab}, {self.dim}")
        v, d = self.vocab, self.dim
        emb = uniform_pm1(derive_key(TAG_EMBED, self.seed), v * d).reshape(v, d)
        proj = uniform_pm1(derive_key(TAG_PROJ, self.seed), d * v).reshape(d, v)
        proj *= 1.0 / math.sqrt(d)
        arrays = {
            "embedding": emb.astype(np.float32),
            "projection": proj.astype(np.float32),
        }
        arrays["projection64"] = arrays["projection"].astype(np.float64)
        for name, a in arrays.items():
            a.setflags(write=False)  # backends cache device copies: weights never change
            object.__setattr__(self, name, a)

    def init_hidden(self, batch: int) -> np.ndarray:
        """A zero hidden state for ``batch`` sequences."""
        return np.zeros((int(batch), self.dim), dtype=np.float32)


def check_decoder_args(
    weights: ToyDecoder, tokens: Any, hidden: Any, positions: Any, temperature: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Validate and convert host decoder arguments (raises ValueError)."""
    tok = np.ascontiguousarray(tokens, dtype=np.int32)
    hid = np.ascontiguousarray(hidden, dtype=np.float32)
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    if tok.ndim != 1 or hid.shape != (tok.shape[0], weights.dim) or pos.shape != tok.shape:
        raise ValueError(
            f"need tokens [batch], hidden [batch, {weights.dim}], positions [batch]; "
            f"got {tok.shape}, {hid.shape}, {pos.shape}"
        )
    if tok.size and (tok.min() < 0 or tok.max() >= weights.vocab):
        raise ValueError(f"tokens must be in [0, {weights.vocab})")
    if pos.size and pos.min() < 0:
        raise ValueError("positions must be >= 0")
    t = float(temperature)
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    return tok, hid, pos, t


def row_keys(seed: int, positions: np.ndarray) -> np.ndarray:
    """Per-sequence noise keys: ``derive_key(TAG_GUMBEL, seed, b, positions[b])``."""
    base = np.uint64(derive_key(TAG_GUMBEL, seed))
    b = np.arange(positions.shape[0], dtype=np.uint64)
    return mix64(mix64(base ^ b) ^ positions.astype(np.int64).astype(np.uint64))


def gumbel_noise(keys: np.ndarray, vocab: int) -> np.ndarray:
    """Gumbel(0, 1) noise [len(keys), vocab]: ``-log(-log(u))``, u from the counter hash."""
    v = np.arange(vocab, dtype=np.uint64)
    h = mix64(keys[:, None] + (v[None, :] + _U1) * GOLDEN)
    return -np.log(-np.log(unit_float(h)))


def decoder_step(
    weights: ToyDecoder,
    tokens: np.ndarray,
    hidden: np.ndarray,
    positions: np.ndarray,
    temperature: float,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One decoding step for a batch of sequences; returns (next_tokens, new_hidden).

    ``new_hidden = float32(tanh(0.5*h + E[tok]))`` (computed in float64);
    ``logits = new_hidden @ W`` accumulated in float64 over ``d`` in
    ascending order (products of two float32 are exact in float64, so every
    backend that keeps this order gets the same bits). Temperature 0 picks
    the argmax (lowest index on ties); otherwise Gumbel-max sampling:
    ``argmax(logits / T + g)`` with noise keyed by (seed, sequence index b,
    positions[b], vocab index), so a stream is deterministic per seed and
    the same on every backend. tanh/log may differ in the last float64 ulp
    between backends, which can only matter at exact ties.
    """
    tok, hid, pos, t = check_decoder_args(weights, tokens, hidden, positions, temperature)
    x = 0.5 * hid.astype(np.float64) + weights.embedding[tok].astype(np.float64)
    new_hidden = np.tanh(x).astype(np.float32)
    h64 = new_hidden.astype(np.float64)
    logits = np.zeros((tok.shape[0], weights.vocab))
    w64 = weights.projection64
    for d in range(weights.dim):  # fixed summation order (see docstring)
        logits += h64[:, d : d + 1] * w64[d]
    if t > 0:
        scores = logits / t + gumbel_noise(row_keys(seed, pos), weights.vocab)
    else:
        scores = logits
    return np.argmax(scores, axis=1).astype(np.int32), new_hidden


# --------------------------------------------------------------------------
# Fixed-point attention (the sharded model's, fabric.core.decoder)
# --------------------------------------------------------------------------


def check_attention_args(q: Any, kk: Any, vv: Any, held: int, head0: int, group: int,
                         kv0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert :func:`attention_fixed`'s arguments (ValueError)."""
    qa = np.ascontiguousarray(q, dtype=np.int64)
    ka = np.ascontiguousarray(kk, dtype=np.int64)
    va = np.ascontiguousarray(vv, dtype=np.int64)
    if qa.ndim != 3 or ka.ndim != 3 or ka.shape != va.shape or qa.shape[2] != ka.shape[2]:
        raise ValueError(f"need q [rows, heads, d], kk and vv [kv heads, tokens, d]; got "
                         f"{qa.shape}, {ka.shape}, {va.shape}")
    c, nq, _d = qa.shape
    if held < 0 or held + c != ka.shape[1]:
        raise ValueError(f"{ka.shape[1]} tokens of keys for {held} held and {c} new rows")
    if group < 1 or head0 < 0 or kv0 < 0:
        raise ValueError("group must be >= 1, head0 and kv0 >= 0")
    if nq and not (0 <= head0 // group - kv0 and (head0 + nq - 1) // group - kv0 < ka.shape[0]):
        raise ValueError(f"query heads {head0}..{head0 + nq - 1} (group {group}) read kv heads "
                         f"outside {kv0}..{kv0 + ka.shape[0] - 1}")
    return qa, ka, va


def attention_fixed(q: np.ndarray, kk: np.ndarray, vv: np.ndarray, held: int, head0: int,
                    group: int, kv0: int, frac_bits: int) -> np.ndarray:
    """Causal attention of ``c`` new rows of one sequence, in fixed point; returns
    ``[c, heads * d]`` int64 (``frac_bits`` fractional bits).

    ``q`` is ``[c, heads, d]``: the new rows' queries for query heads ``head0 ..``,
    ``kk`` and ``vv`` ``[kv heads, held + c, d]``: keys and values of KV heads
    ``kv0 ..``, the ``held`` cached tokens then the new rows; query head ``h``
    reads KV head ``h // group``. All in ``frac_bits`` fractional bits. Row ``i``
    attends to tokens ``0 .. held + i``: scores ``(k . q) / 2**(2 frac) /
    sqrt(d)`` in float64 (the dot product is exact in int64), softmax weights
    ``exp(s - max)`` over their sum (NumPy's pairwise order), rounded half to
    even to ``frac_bits``; the output ``(weights . v) / 2**frac`` rounded half up.

    The weights are rounded to 12 bits or so, so backends whose ``exp`` differs
    from NumPy's in the last ulp give the same integers unless a weight lies
    within about 1e-16 of a rounding boundary (about one element in 10**12).
    """
    qa, ka, va = check_attention_args(q, kk, vv, held, head0, group, kv0)
    c, nq, d = qa.shape
    out = np.zeros((c, nq * d), np.int64)
    one = 1 << frac_bits
    for i in range(c):
        upto = held + i + 1
        for j in range(nq):
            kv = (head0 + j) // group - kv0
            scores = (ka[kv, :upto] @ qa[i, j]).astype(np.float64) / (one * one) / np.sqrt(d)
            p = np.exp(scores - scores.max())
            pq = np.round(p / p.sum() * one).astype(np.int64)
            out[i, j * d:(j + 1) * d] = (pq @ va[kv, :upto] + (one >> 1)) >> frac_bits
    return out
