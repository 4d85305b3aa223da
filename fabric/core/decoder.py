"""The arithmetic of a small MoE decoder that really runs, in fixed point, so that
any tensor- and expert-parallel split of it gives exactly the unsharded tokens.

Activations are int64 with :data:`ACT_BITS` fractional bits, weights small
integers with :data:`W_BITS`. Every product and sum is integer, so a dot product
split over TP ranks and summed by an allreduce is bit-for-bit the unsharded one,
in any order. What is not linear (RMS norm, softmax, SiLU, the router's top-k)
runs in float64 on values every rank holds alike, then is rounded back to fixed
point. MoE results travel as float32 holding integers below 2**24 (dispatch and
combine carry float32), which sum exactly in any order.

Layer (pre-norm): ``x += attention(norm(x))``; ``x += moe(norm(x))``; then the LM
head on ``norm(x)``, greedy or Gumbel-max sampling keyed by (seed, sequence,
position) as the toy decoder does (kernels.reference).

Pure: NumPy only. :mod:`fabric.core.decode_workload` runs it sharded on the
fabric; :func:`generate_reference` runs it unsharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fabric.core.model import ModelConfig
from kernels.reference import (
    attention_fixed,
    derive_key,
    gumbel_noise,
    mix64,
    moe_topk,
    uniform_pm1,
)

#: The attention of one sequence's new rows (:func:`kernels.reference.attention_fixed`'s
#: signature: q, kk, vv, held, head0, group, kv0, frac_bits).
AttentionKernel = Callable[[np.ndarray, np.ndarray, np.ndarray, int, int, int, int, int],
                           np.ndarray]

__all__ = ["ACT_BITS", "W_BITS", "GATE_BITS", "AttentionKernel", "KvCache", "TinyWeights",
           "attention_partial", "expert_partial", "generate_reference", "lm_logits",
           "next_tokens", "rms_norm", "rescale", "route", "sample_tokens"]

#: Fractional bits of activations (int64): 2**-12 resolution, values up to ~2**18.
ACT_BITS = 12
#: Fractional bits of weights: integers in [-2**W_BITS, 2**W_BITS].
W_BITS = 7
#: Fractional bits of the router's gating weights.
GATE_BITS = 8
#: RMS norm's epsilon (Mixtral's and DeepSeek-V3's config value).
NORM_EPS = 1e-6

_TAG_WEIGHTS = 0x5EA1D0C0


def rescale(acc: np.ndarray, bits: int) -> np.ndarray:
    """``acc / 2**bits`` rounded half up (an arithmetic shift: the same on every rank)."""
    return (acc + (1 << (bits - 1))) >> bits


def _fix(x: np.ndarray) -> np.ndarray:
    """float64 -> fixed-point activations (round half to even)."""
    return np.round(x * (1 << ACT_BITS)).astype(np.int64)


def _flt(x: np.ndarray, bits: int = ACT_BITS) -> np.ndarray:
    return x.astype(np.float64) / (1 << bits)


def rms_norm(x: np.ndarray) -> np.ndarray:
    """RMS norm of each row (no learned scale), fixed point in and out."""
    f = _flt(x)
    return _fix(f / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + NORM_EPS))


def _weights(key: int, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """Integer weights, uniform, scaled so a layer keeps its inputs' magnitude."""
    u = uniform_pm1(key, int(np.prod(shape))).reshape(shape)
    scale = (1 << W_BITS) * min(1.0, 2.0 / np.sqrt(fan_in))
    return np.round(u * scale).astype(np.int64)


@dataclass(frozen=True, eq=False)
class TinyWeights:
    """Seeded integer weights of a :class:`ModelConfig` small enough to run here."""

    model: ModelConfig
    seed: int = 0
    embed: np.ndarray = field(init=False, repr=False)
    layers: list[dict[str, np.ndarray]] = field(init=False, repr=False)
    lm_head: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        m = self.model
        if not m.moe or m.dense_layers or m.shared_experts or m.kv_lora_rank:
            raise ValueError(f"{m.name}: the runnable decoder is MoE in every layer, "
                             "grouped-query attention, no shared experts")
        h, q, kv, f, e = (m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.moe_ffn,
                          m.experts)

        def key(*parts: int) -> int:
            return derive_key(_TAG_WEIGHTS, self.seed, *parts)

        emb = _fix(uniform_pm1(key(0), m.vocab * h).reshape(m.vocab, h))
        layers = []
        for i in range(m.layers):
            layers.append({
                "wq": _weights(key(1, i, 0), (h, q), h), "wk": _weights(key(1, i, 1), (h, kv), h),
                "wv": _weights(key(1, i, 2), (h, kv), h), "wo": _weights(key(1, i, 3), (q, h), q),
                "gate": _weights(key(1, i, 4), (h, e), h),
                "w1": _weights(key(1, i, 5), (e, h, f), h),
                "w3": _weights(key(1, i, 6), (e, h, f), h),
                "w2": _weights(key(1, i, 7), (e, f, h), f),
            })
        object.__setattr__(self, "embed", emb)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "lm_head", _weights(key(2), (h, m.vocab), h))


@dataclass
class KvCache:
    """Keys and values of one attention shard: per layer, per sequence slot, arrays
    of (kv heads, T, d)."""

    keys: list[dict[int, np.ndarray]] = field(default_factory=list)
    values: list[dict[int, np.ndarray]] = field(default_factory=list)

    def drop(self, slot: int) -> None:
        """Forget sequence ``slot`` (it finished or was aborted)."""
        for per_layer in (*self.keys, *self.values):
            per_layer.pop(slot, None)

    def length(self, slot: int) -> int:
        """Tokens held for ``slot`` (in the first layer)."""
        if not self.keys or slot not in self.keys[0]:
            return 0
        return int(self.keys[0][slot].shape[1])


def _heads(m: ModelConfig, tp: int, r: int) -> tuple[range, range]:
    """(query heads, kv heads) of TP rank ``r``: the heads split evenly; a KV head
    shared by queries on several ranks is computed on each of them."""
    per = m.heads // tp
    qh = range(r * per, (r + 1) * per)
    group = m.heads // m.kv_heads
    return qh, range(qh.start // group, (qh.stop - 1) // group + 1)


def attention_partial(w: TinyWeights, layer: int, xn: np.ndarray, cache: KvCache,
                      tp: int = 1, r: int = 0, slots: Sequence[int] | None = None,
                      counts: Sequence[int] | None = None,
                      kernel: AttentionKernel | None = None) -> np.ndarray:
    """TP rank ``r``'s share of the attention output of normed rows ``xn``
    (rows, hidden): the output projection of this rank's heads, unrescaled
    (scale ACT + W bits), to be summed over the TP ranks.

    The rows are ``counts[i]`` consecutive new tokens of sequence ``slots[i]``
    (default: one row per sequence, slots 0, 1, ...); each row attends over its
    sequence's cache and its own sequence's rows up to itself (causal), so a
    prompt fed in one call gives bit for bit what it gives a token per call.

    ``kernel`` computes each sequence's attention
    (:func:`kernels.reference.attention_fixed`, the default, or a backend's
    ``attention_fixed``: a driver passes the one its ``--backend`` names)."""
    m = w.model
    L = w.layers[layer]
    d = m.head_dim
    qh, kvh = _heads(m, tp, r)
    qcols = slice(qh.start * d, qh.stop * d)
    kvcols = slice(kvh.start * d, kvh.stop * d)
    n = len(xn)
    if counts is None:
        counts = [1] * n
    if slots is None:
        slots = range(len(counts))
    if sum(counts) != n or len(slots) != len(counts):
        raise ValueError(f"{n} rows, but counts {list(counts)} for {len(slots)} slots")
    q = rescale(xn @ L["wq"][:, qcols], W_BITS).reshape(n, len(qh), d)
    k = rescale(xn @ L["wk"][:, kvcols], W_BITS).reshape(n, len(kvh), d)
    v = rescale(xn @ L["wv"][:, kvcols], W_BITS).reshape(n, len(kvh), d)
    while len(cache.keys) <= layer:
        cache.keys.append({})
        cache.values.append({})
    ks, vs = cache.keys[layer], cache.values[layer]
    group = m.heads // m.kv_heads
    attend = kernel if kernel is not None else attention_fixed
    out = np.zeros((n, len(qh) * d), np.int64)
    row = 0
    for slot, c in zip(slots, counts, strict=True):
        empty = np.zeros((len(kvh), 0, d), np.int64)
        kk = np.concatenate([ks.get(slot, empty), k[row:row + c].transpose(1, 0, 2)], axis=1)
        vv = np.concatenate([vs.get(slot, empty), v[row:row + c].transpose(1, 0, 2)], axis=1)
        ks[slot], vs[slot] = kk, vv
        held = kk.shape[1] - c  # tokens before this call's
        out[row:row + c] = attend(q[row:row + c], kk, vv, held, qh.start, group, kvh.start,
                                  ACT_BITS)
        row += c
    return out @ L["wo"][qcols, :]


def route(w: TinyWeights, layer: int, xn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The router: each row's ``top_k`` experts and their gating weights as integers
    with GATE_BITS fractional bits."""
    logits = _flt(xn @ w.layers[layer]["gate"], ACT_BITS + W_BITS).astype(np.float32)
    ids, gw = moe_topk(logits, w.model.top_k)
    return ids.astype(np.int64), np.round(gw.astype(np.float64) * (1 << GATE_BITS)).astype(
        np.int64)


def expert_partial(w: TinyWeights, layer: int, expert: int, xn: np.ndarray, tp: int = 1,
                   r: int = 0) -> np.ndarray:
    """TP rank ``r``'s share of expert ``expert``'s SwiGLU FFN on rows ``xn``: its
    slice of the intermediate columns through the down projection, unrescaled
    (scale ACT + W bits), to be summed over the TP ranks."""
    L = w.layers[layer]
    f = w.model.moe_ffn
    lo, hi = r * f // tp, (r + 1) * f // tp
    h1 = _flt(rescale(xn @ L["w1"][expert][:, lo:hi], W_BITS))
    h3 = _flt(rescale(xn @ L["w3"][expert][:, lo:hi], W_BITS))
    a = _fix(h1 / (1.0 + np.exp(-h1)) * h3)
    return a @ L["w2"][expert][lo:hi, :]


def weigh(y: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """An expert's rescaled output times its gating weight, back to fixed point."""
    return rescale(y * gate[:, None], GATE_BITS)


def lm_logits(w: TinyWeights, x: np.ndarray) -> np.ndarray:
    """float64 logits of final rows ``x`` (fixed point)."""
    return _flt(rms_norm(x) @ w.lm_head, ACT_BITS + W_BITS)


def next_tokens(logits: np.ndarray, seqs: np.ndarray, positions: np.ndarray,
                temperature: float, seed: int) -> np.ndarray:
    """Greedy (temperature 0: the lowest index of the largest logit) or Gumbel-max,
    the noise keyed by (seed, sequence id, position) so the split cannot change it."""
    if temperature == 0:
        return np.argmax(logits, axis=1).astype(np.int64)
    base = np.uint64(derive_key(0x70CE5, seed))
    keys = mix64(mix64(base ^ seqs.astype(np.uint64)) ^ positions.astype(np.uint64))
    return np.argmax(logits / temperature + gumbel_noise(keys, logits.shape[1]),
                     axis=1).astype(np.int64)


def sample_tokens(logits: np.ndarray, keys: np.ndarray, positions: np.ndarray,
                  temperatures: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """:func:`next_tokens` row by row with each row's own temperature and seed (rows
    that share both are sampled in one call)."""
    out = np.zeros(len(logits), np.int64)
    for t, sd in sorted({(float(a), int(b)) for a, b in
                         zip(temperatures.tolist(), seeds.tolist(), strict=True)}):
        rows = np.flatnonzero((temperatures == t) & (seeds == sd))
        out[rows] = next_tokens(logits[rows], keys[rows], positions[rows], t, sd)
    return out


def generate_reference(w: TinyWeights, prompts: list[list[int]], max_tokens: int,
                       temperature: float = 0.0, seed: int = 0,
                       kernel: AttentionKernel | None = None) -> list[list[int]]:
    """The unsharded model: each sequence's ``max_tokens`` new tokens. One token of
    every sequence per step (its prompt first, then what it generated); ``kernel``
    as in :func:`attention_partial`."""
    m = w.model
    cache = KvCache()
    seqs = np.arange(len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    feed = [list(p) for p in prompts]
    steps = max(len(p) for p in prompts) + max_tokens - 1
    for pos in range(steps):
        tok = np.array([f[pos] if pos < len(f) else out[i][-1] if out[i] else f[-1]
                        for i, f in enumerate(feed)], np.int64)
        x = w.embed[tok % m.vocab]
        for layer in range(m.layers):
            x = x + rescale(attention_partial(w, layer, rms_norm(x), cache, kernel=kernel),
                            W_BITS)
            xn = rms_norm(x)
            ids, gates = route(w, layer, xn)
            moe = np.zeros_like(x)
            for k in range(m.top_k):
                for e in np.unique(ids[:, k]):
                    rows = np.flatnonzero(ids[:, k] == e)
                    y = rescale(expert_partial(w, layer, int(e), xn[rows]), W_BITS)
                    moe[rows] += weigh(y, gates[rows, k])
            x = x + moe
        nxt = next_tokens(lm_logits(w, x), seqs, np.full(len(seqs), pos), temperature, seed)
        for i, f in enumerate(feed):
            if pos >= len(f) - 1 and len(out[i]) < max_tokens:
                out[i].append(int(nxt[i]))
    return out
