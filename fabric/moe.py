"""MoE expert parallelism: dispatch and combine as pure programs (both worlds).

Every rank holds ``T`` tokens (hidden vectors of ``H`` elements) with top-k
expert ids and weights from its gating; experts ``0..E-1`` sit on ranks in
blocks of ``E / size`` (expert ``e`` on rank ``e // (E / size)``).

* **dispatch** sends each token's vector once to every rank that holds one of
  its experts (DeepEP dedups per rank, not per expert) and returns what a rank
  received: rows, their home rank and token index, the experts and weights;
* **combine** takes one vector per received row (the rank's weighted sum of its
  local experts' outputs for that token, :func:`expert_partials`) and returns,
  at each token's home rank, the sum over ranks: ``sum_k w_k * expert_k(x)``.

Variants, side by side:

``flat``
    one alltoallv of rows over direct streams (each copy crosses the spine
    on its own).
``hierarchical``
    DeepEP's normal kernels: a token bound for ranks below a remote leaf
    crosses the spine once, to the rank of that leaf with the sender's local
    index, which forwards it inside its leaf; combine runs backwards, the relay
    summing its leaf's partials so one vector per token and leaf crosses back.

Each phase is an alltoallv of (metadata, rows) of :mod:`fabric.collective_programs`;
the receive counts of dispatch are exchanged first (an alltoall of counts),
combine needs none (it mirrors dispatch).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric.collective_programs import collective_program
from fabric.errors import UsageError
from fabric.programs import Chain, Group, NodeState, Program
from kernels.dtypes import np_dtype

__all__ = ["MOE_VARIANTS", "Dispatched", "expert_partials", "make_inputs", "moe_combine_program",
           "moe_dispatch_program", "moe_reference", "parse_routing"]

MOE_VARIANTS = ("flat", "hierarchical")


@dataclass
class Dispatched:
    """What dispatch delivered to one rank (rows in arrival order), and the plan
    combine follows back."""

    x: np.ndarray | None  # (N, H) token vectors; None when timing-only
    src: np.ndarray  # (N,) home rank (group rank) of each row
    tok: np.ndarray  # (N,) token index at its home
    experts: np.ndarray  # (N, K) the token's expert ids
    weights: np.ndarray  # (N, K) float32 gating weights
    num_experts: int
    variant: str
    tokens: int  # T: tokens this rank sent (combine returns that many)
    hidden: int
    dtype: str
    plan: dict[str, Any] = field(default_factory=dict)

    def local_mask(self, rank: int, size: int) -> np.ndarray:
        """(N, K) True where the expert lives on ``rank``."""
        per = self.num_experts // size
        return (self.experts // per) == rank


def expert_partials(d: Dispatched, rank: int, size: int, experts: Any = None) -> np.ndarray:
    """Per received row, ``sum_k w_k * expert_k(x)`` over this rank's experts (in k
    order, float32, returned in the rows' dtype). ``experts(e, rows) -> rows``
    computes expert ``e``; the default is the identity."""
    assert d.x is not None
    mask = d.local_mask(rank, size)
    xf = d.x.astype(np.float32)
    out = np.zeros(xf.shape, np.float32)
    for k in range(d.experts.shape[1]):
        rows = np.nonzero(mask[:, k])[0]
        if experts is None:
            out[rows] += d.weights[rows, k:k + 1] * xf[rows]
            continue
        for e in np.unique(d.experts[rows, k]):
            sel = rows[d.experts[rows, k] == e]
            y = np.asarray(experts(int(e), xf[sel]), np.float32)
            out[sel] += d.weights[sel, k:k + 1] * y
    return out.astype(d.x.dtype)


def parse_routing(text: str) -> tuple[str, float]:
    """``uniform``, ``zipf:S`` or ``lognormal:SIGMA`` -> (kind, parameter)."""
    kind, _, arg = text.partition(":")
    if kind == "uniform" and not arg:
        return kind, 0.0
    if kind in ("zipf", "lognormal"):
        try:
            v = float(arg or (1.2 if kind == "zipf" else 1.0))
        except ValueError:
            v = -1.0
        if v > 0:
            return kind, v
    raise UsageError(f"routing {text!r}: use uniform, zipf:S (S > 0, e.g. zipf:1.2) or "
                     "lognormal:SIGMA (e.g. lognormal:1.0)")


def make_inputs(rank: int, tokens: int, hidden: int, k: int, experts: int, dtype: str,
                seed: int = 7, routing: str = "uniform") -> tuple[np.ndarray, np.ndarray,
                                                                    np.ndarray]:
    """Seeded MoE inputs of one rank: tokens of small non-zero integers, ``k``
    distinct experts per token drawn uniformly or with skewed expert load (Zipf
    or log-normal popularity, the same on every rank), and dyadic weights, so
    every sum is exact in any order. Returns (x, topk_idx, topk_weights)."""
    kind, arg = parse_routing(routing)
    if not 0 < k <= experts:
        raise UsageError(f"top-k {k} must be between 1 and the {experts} experts")
    rng = np.random.default_rng([seed, rank, tokens, hidden])
    x = rng.integers(-4, 5, (tokens, hidden)).astype(np.float64)
    x[x == 0] = 1
    p = None
    if kind == "zipf":
        p = 1.0 / np.arange(1, experts + 1) ** arg
    elif kind == "lognormal":
        p = np.random.default_rng([seed, experts]).lognormal(0.0, arg, experts)
    if p is not None:
        p = p / p.sum()
    idx = np.stack([rng.choice(experts, k, replace=False, p=p) for _ in range(tokens)]) \
        if tokens else np.empty((0, k), np.int64)
    w = (2.0 ** -rng.integers(1, 4, (tokens, k))).astype(np.float32)
    return x.astype(np_dtype(dtype)), idx.astype(np.int64), w


def moe_reference(xs: Sequence[np.ndarray], idx: Sequence[np.ndarray],
                  ws: Sequence[np.ndarray], num_experts: int) -> list[np.ndarray]:
    """NumPy: what combine(dispatch(x)) returns on every rank with identity experts
    (per rank, then summed in rank order, as combine adds)."""
    W = len(xs)
    per = num_experts // W
    outs = []
    for r in range(W):
        x = xs[r].astype(np.float32)
        total = np.zeros(x.shape, np.float32)
        for q in range(W):
            part = np.zeros(x.shape, np.float32)
            for k in range(idx[r].shape[1]):
                sel = (idx[r][:, k] // per) == q
                part[sel] += ws[r][sel, k:k + 1] * x[sel]
            total += part.astype(xs[r].dtype).astype(np.float32)
        outs.append(total.astype(xs[r].dtype))
    return outs


# ---------------------------------------------------------------------- helpers
def _check(st: NodeState, g: Group, idx: np.ndarray, w: np.ndarray, T: int,
           num_experts: int) -> None:
    if idx.ndim != 2 or idx.shape[0] != T or w.shape != idx.shape:
        raise UsageError(f"{st.name}: moe_dispatch needs topk_idx and topk_weights of shape "
                         f"(tokens={T}, k), got {idx.shape} and {w.shape}")
    if num_experts % g.size or num_experts <= 0:
        raise UsageError(f"moe: {num_experts} experts do not divide over {g.size} ranks")
    if idx.size and (idx.min() < 0 or idx.max() >= num_experts):
        bad = int(idx[(idx < 0) | (idx >= num_experts)][0])
        raise UsageError(f"{st.name} (rank {g.rank}): moe_dispatch: expert id {bad} out of "
                         f"range 0..{num_experts - 1}")


def _a2av(st: NodeState, g: Group, x: np.ndarray | None, sc: Sequence[int],
          rc: Sequence[int], dtype: str) -> Program:
    out = None if x is None else np.empty(int(sum(rc)), x.dtype)
    return collective_program(st, "alltoallv", x, out, path="host-p2p", group=g,
                              send_counts=[int(c) for c in sc], recv_counts=[int(c) for c in rc],
                              count=int(sum(sc)), dtype=dtype)


def _exchange(st: NodeState, g: Group, rows_to: Sequence[Sequence[Any]],
              x_to: Sequence[np.ndarray] | None, ncol: int, H: int, dtype: str,
              rc: Sequence[int] | None = None) -> Generator[Program, Any, Any]:
    """One phase: send rank k the metadata rows ``rows_to[k]`` (int32, ``ncol`` each)
    and their vectors; returns (metadata (N, ncol), vectors (N, H) or None, counts)."""
    W = g.size
    sc = [len(r) for r in rows_to]
    if rc is None:  # receivers learn their counts first
        counts = yield collective_program(st, "alltoall", np.array(sc, np.int32),
                                          np.empty(W, np.int32), path="host-p2p", group=g)
        rc = [int(c) for c in counts]
    meta = np.concatenate([np.asarray(r, np.int32).reshape(-1, ncol) if len(r) else
                           np.empty((0, ncol), np.int32) for r in rows_to]).reshape(-1)
    got = yield _a2av(st, g, meta, [c * ncol for c in sc], [c * ncol for c in rc], "int32")
    vecs = None
    if x_to is not None:
        parts = [v for v in x_to if len(v)]
        flat = (np.concatenate(parts).reshape(-1) if parts
                else np.empty(0, np_dtype(dtype)))
        vecs = yield _a2av(st, g, flat, [c * H for c in sc], [c * H for c in rc], dtype)
        vecs = vecs.reshape(-1, H)
    else:  # timing-only: the same bytes, no values
        yield _a2av(st, g, None, [c * H for c in sc], [c * H for c in rc], dtype)
    return got.reshape(-1, ncol), vecs, rc


def _leaves(st: NodeState, g: Group) -> tuple[list[list[int]], list[int], list[int]]:
    """Group ranks by leaf switch: (ranks of each leaf, leaf of each rank, local index)."""
    by: dict[str, list[int]] = {}
    for k, nid in enumerate(g.ids):
        by.setdefault(st.topo.switch_of(st.topo.by_id(nid).name), []).append(k)
    leaves = [by[s] for s in sorted(by)]
    leaf_of, local = [0] * g.size, [0] * g.size
    for b, ranks in enumerate(leaves):
        for i, k in enumerate(ranks):
            leaf_of[k], local[k] = b, i
    return leaves, leaf_of, local


# ---------------------------------------------------------------------- dispatch
def moe_dispatch_program(st: NodeState, x: np.ndarray | None, topk_idx: np.ndarray,
                         topk_weights: np.ndarray, num_experts: int, *,
                         variant: str = "flat", group: Group | None = None,
                         hidden: int = 0, dtype: str = "bfloat16") -> Program:
    """Dispatch this rank's tokens (``x``: (T, H); None with ``hidden``/``dtype`` for
    timing-only) to the ranks of their experts; the result is a :class:`Dispatched`."""
    g = group or st.world_group
    g.check_open("moe_dispatch")
    if variant not in MOE_VARIANTS:
        raise UsageError(f"unknown MoE variant {variant!r}; choose one of "
                         f"{', '.join(MOE_VARIANTS)}")
    idx = np.asarray(topk_idx, np.int64)
    w = np.asarray(topk_weights, np.float32)
    if x is not None:
        if x.ndim != 2 or not x.flags.c_contiguous:
            raise UsageError("moe_dispatch takes x as a contiguous (tokens, hidden) array")
        from kernels.dtypes import dtype_name

        T, H, dtype = x.shape[0], x.shape[1], dtype_name(x.dtype)
    else:
        T, H = idx.shape[0], hidden
    _check(st, g, idx, w, T, num_experts)
    K = idx.shape[1]
    per = num_experts // g.size
    ranks_of = [sorted({int(e) // per for e in idx[t]}) for t in range(T)]
    wbits = w.view(np.int32)
    if variant == "flat":
        return Chain(_flat_dispatch(st, g, x, idx, wbits, ranks_of, T, H, K, dtype,
                                    num_experts))
    return Chain(_hier_dispatch(st, g, x, idx, wbits, ranks_of, T, H, K, dtype, num_experts))


def _flat_dispatch(st: NodeState, g: Group, x: np.ndarray | None, idx: np.ndarray,
                   wbits: np.ndarray, ranks_of: list[list[int]], T: int, H: int, K: int,
                   dtype: str, E: int) -> Generator[Program, Any, Dispatched]:
    W = g.size
    toks: list[list[int]] = [[] for _ in range(W)]
    for t in range(T):
        for q in ranks_of[t]:
            toks[q].append(t)
    rows = [[[t, *idx[t], *wbits[t]] for t in toks[q]] for q in range(W)]
    xs = None if x is None else [x[toks[q]] for q in range(W)]
    meta, vecs, rc = yield from _exchange(st, g, rows, xs, 1 + 2 * K, H, dtype)
    src = np.repeat(np.arange(W), rc)
    return Dispatched(vecs, src, meta[:, 0].copy(), meta[:, 1:1 + K].copy(),
                      meta[:, 1 + K:].copy().view(np.float32), E, "flat", T, H, dtype,
                      {"toks": toks, "rc": rc})


def _hier_dispatch(st: NodeState, g: Group, x: np.ndarray | None, idx: np.ndarray,
                   wbits: np.ndarray, ranks_of: list[list[int]], T: int, H: int, K: int,
                   dtype: str, E: int) -> Generator[Program, Any, Dispatched]:
    W, r = g.size, g.rank
    leaves, leaf_of, local = _leaves(st, g)
    if max(len(lv) for lv in leaves) > 62:
        raise UsageError("moe hierarchical: at most 62 ranks below one leaf (target masks)")
    me = leaf_of[r]
    # phase 1: leaf-mates directly; one copy per remote leaf to the relay (same local
    # index there) with the mask of that leaf's targets. Row: t, relay?, mask lo, hi, ...
    rows1: list[list[Any]] = [[] for _ in range(W)]
    sel1: list[list[int]] = [[] for _ in range(W)]
    for t in range(T):
        remote: dict[int, int] = {}
        for q in ranks_of[t]:
            if leaf_of[q] == me:
                rows1[q].append([t, 0, 0, 0, *idx[t], *wbits[t]])
                sel1[q].append(t)
            else:
                remote[leaf_of[q]] = remote.get(leaf_of[q], 0) | 1 << local[q]
        for b, mask in sorted(remote.items()):
            relay = leaves[b][local[r] % len(leaves[b])]
            rows1[relay].append([t, 1, mask & 0x7FFFFFFF, mask >> 31, *idx[t], *wbits[t]])
            sel1[relay].append(t)
    xs1 = None if x is None else [x[s] for s in sel1]
    meta1, vecs1, rc1 = yield from _exchange(st, g, rows1, xs1, 4 + 2 * K, H, dtype)
    src1 = np.repeat(np.arange(W), rc1)
    # phase 2: a relay forwards each relayed row to the other targets in its leaf
    mine = leaves[me]
    rows2: list[list[Any]] = [[] for _ in range(W)]
    sel2: list[list[int]] = [[] for _ in range(W)]
    keep: list[int] = []  # rows of phase 1 this rank keeps (it is a target)
    for i, row in enumerate(meta1):
        if not row[1]:
            keep.append(i)
            continue
        mask = int(row[2]) | int(row[3]) << 31
        for li, p in enumerate(mine):
            if mask >> li & 1:
                if p == r:
                    keep.append(i)
                else:
                    rows2[p].append([int(src1[i]), *row[[0, *range(4, 4 + 2 * K)]]])
                    sel2[p].append(i)
    xs2 = None if vecs1 is None else [vecs1[s] for s in sel2]
    meta2, vecs2, rc2 = yield from _exchange(st, g, rows2, xs2, 2 + 2 * K, H, dtype)
    keep_arr = np.array(keep, np.int64)
    src = np.concatenate([src1[keep_arr], meta2[:, 0]]).astype(np.int64)
    tok = np.concatenate([meta1[keep_arr, 0], meta2[:, 1]])
    ex = np.concatenate([meta1[keep_arr, 4:4 + K], meta2[:, 2:2 + K]])
    wb = np.concatenate([meta1[keep_arr, 4 + K:], meta2[:, 2 + K:]])
    vecs = None if vecs1 is None or vecs2 is None else np.concatenate([vecs1[keep_arr], vecs2])
    # what combine retraces: who sent each kept / forwarded row
    from2 = np.repeat(np.arange(W), rc2)
    plan = {"meta1": meta1, "src1": src1, "keep": keep, "sel2": sel2, "from2": from2,
            "sent": [[(int(row[0]), int(row[1])) for row in rows1[k]] for k in range(W)]}
    return Dispatched(vecs, src, tok.copy(), ex.copy(), wb.copy().view(np.float32), E,
                      "hierarchical", T, H, dtype, plan)


# ---------------------------------------------------------------------- combine
def moe_combine_program(st: NodeState, d: Dispatched, partials: np.ndarray | None, *,
                        group: Group | None = None) -> Program:
    """Return each row's partial (one vector per row of ``d``) to the token's home;
    the result is (T, H): at each token, the sum over ranks of the partials."""
    g = group or st.world_group
    g.check_open("moe_combine")
    n = d.src.shape[0]
    if partials is not None and partials.shape != (n, d.hidden):
        raise UsageError(f"{st.name}: moe_combine takes one vector per dispatched row: "
                         f"({n}, {d.hidden}), got {partials.shape}")
    steps = _flat_combine if d.variant == "flat" else _hier_combine
    return Chain(steps(st, g, d, partials))


def _flat_combine(st: NodeState, g: Group, d: Dispatched,
                  partials: np.ndarray | None) -> Generator[Program, Any, Any]:
    toks, rc = d.plan["toks"], d.plan["rc"]
    H = d.hidden
    sc = [len(t) for t in toks]
    flat = None if partials is None else np.ascontiguousarray(partials).reshape(-1)
    back = yield _a2av(st, g, flat, [c * H for c in rc], [c * H for c in sc], d.dtype)
    if back is None:
        return None
    back = back.reshape(-1, H).astype(np.float32)
    out = np.zeros((d.tokens, H), np.float32)
    at = 0
    for tq in toks:  # rank order: the same sums on every run
        out[tq] += back[at: at + len(tq)]
        at += len(tq)
    return out.astype(np_dtype(d.dtype))


def _hier_combine(st: NodeState, g: Group, d: Dispatched,
                  partials: np.ndarray | None) -> Generator[Program, Any, Any]:
    W, H = g.size, d.hidden
    p = d.plan
    keep, sel2, meta1, src1, sent = p["keep"], p["sel2"], p["meta1"], p["src1"], p["sent"]
    data = partials is not None
    part = None if partials is None else np.asarray(partials, np.float32)
    dt = np_dtype(d.dtype)
    # phase A (inside the leaf): the partial of a direct row goes home, that of a
    # forwarded row to its relay; a relay keeps its own partial of a relayed row
    to_a: list[list[int]] = [[] for _ in range(W)]  # rows of `partials`, per destination
    own: dict[int, int] = {}  # relayed phase-1 row -> our partial of it
    for j, i in enumerate(keep):
        if meta1[i][1]:
            own[i] = j
        else:
            to_a[int(src1[i])].append(j)
    for j, k in enumerate(p["from2"]):
        to_a[int(k)].append(len(keep) + j)
    # from rank k come: partials of the direct rows we sent k, then of the rows we
    # forwarded to k (the order k appended them above)
    direct = [[t for t, relayed in sent[k] if not relayed] for k in range(W)]
    rc_a = [len(direct[k]) + len(sel2[k]) for k in range(W)]
    flat = None if part is None else np.concatenate(
        [part[v] for v in to_a if v] or [np.empty((0, H), np.float32)]).astype(dt).reshape(-1)
    got = yield _a2av(st, g, flat, [len(v) * H for v in to_a], [c * H for c in rc_a], d.dtype)
    out = np.zeros((d.tokens, H), np.float32)
    sums: dict[int, np.ndarray] = {}  # relayed phase-1 row -> its leaf's sum so far
    if data:
        assert got is not None and part is not None
        blk = got.reshape(-1, H).astype(np.float32)
        at = 0
        for k in range(W):  # rank order: the same sums on every run
            for t in direct[k]:
                out[t] += blk[at]
                at += 1
            for i in sel2[k]:
                sums[i] = blk[at] if i not in sums else sums[i] + blk[at]
                at += 1
        for i, j in own.items():
            sums[i] = part[j] if i not in sums else sums[i] + part[j]
    # phase B (across the spine): one summed vector per relayed row, to its home
    to_b: list[list[int]] = [[] for _ in range(W)]
    for i, row in enumerate(meta1):
        if row[1]:
            to_b[int(src1[i])].append(i)
    flat_b = None
    if data:
        vecs = [sums[i] for v in to_b for i in v]
        flat_b = (np.array(vecs, np.float32) if vecs else np.empty((0, H), np.float32)
                  ).astype(dt).reshape(-1)
    rc_b = [sum(1 for _t, relayed in sent[k] if relayed) for k in range(W)]
    got_b = yield _a2av(st, g, flat_b, [len(v) * H for v in to_b], [c * H for c in rc_b],
                        d.dtype)
    if not data:
        return None
    assert got_b is not None
    blk_b = got_b.reshape(-1, H).astype(np.float32)
    at = 0
    for k in range(W):
        for t, relayed in sent[k]:
            if relayed:
                out[t] += blk_b[at]
                at += 1
    return out.astype(dt)
