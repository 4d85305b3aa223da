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
``in-network``
    the switches do it (the dynamic in-switch idea of DySHARP): each token is
    one frame with a member mask (``Flag.MCAST``, ``key`` = mask of a block of
    32 members, ``offset`` = the block; a token with targets in several blocks
    goes once per block), replicated by each switch to the ports of its
    targets only, so it crosses every link once per block; in combine each rank
    sends its partial towards the token's home and the first switch (its leaf)
    sums the partials of that token from every rank below it, sending one
    vector on (``switchd.core`` ``_on_combine``).

Each phase is an alltoallv of (metadata, rows) of :mod:`fabric.core.collective_programs`;
the receive counts of dispatch are exchanged first (an alltoall of counts),
combine needs none (it mirrors dispatch).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from fabric.core import frame as fr
from fabric.core.collective_programs import collective_program
from fabric.core.frame import Flag, NackCode, Op
from fabric.core.programs import Chain, Group, NodeState, Program, Send
from fabric.errors import UsageError
from kernels.dtypes import np_dtype

__all__ = ["MOE_VARIANTS", "Dispatched", "expert_partials", "make_inputs", "moe_combine_program",
           "moe_dispatch_program", "moe_reference", "parse_routing"]

MOE_VARIANTS: Final = ("flat", "hierarchical", "in-network")
#: Flow of in-network dispatch rows (masked multicast), ACKs on MASKED_FLOW + 1.
MASKED_FLOW: Final = fr.MASKED_FLOW
#: Rows in flight per sender (in-network dispatch), contributions per rank (combine).
ROWS_WINDOW: Final = 64
#: Members one in-network dispatch frame can name: a block of the frame's 32-bit
#: mask (fabric.core.frame.MASK_BITS); larger groups take a frame per block.
MASK_MEMBERS: Final = fr.MASK_BITS
#: Dispatch rows with the same targets travel together, up to this many bytes a frame.
ROWS_FRAME_BYTES: Final = 64 * 1024


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
    if variant == "in-network":
        return Chain(_innet_dispatch(st, g, x, idx, wbits, ranks_of, T, H, K, dtype,
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
    steps = {"flat": _flat_combine, "hierarchical": _hier_combine,
             "in-network": _innet_combine}[d.variant]
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


# ---------------------------------------------------------------------- in the network
class _AckedFrames(Program):
    """Frames sent in a window, each until every node it waits on ACKed it; one RTO
    (RFC 6298, per node and role across calls) resends a frame to whoever still
    owes its ACK. Subclasses say what a frame is (:meth:`_frame`), its payload's
    size (:meth:`_size`), who ACKs it (:meth:`_ackers`) and which ACKs are theirs
    (:meth:`wants`).

    With a congestion-control policy (``[congestion] cc``) a frame also waits for
    the policy's window and pacer; a frame is acknowledged when its last ACK is
    in, congestion experienced when any of them echoed a mark. Its path is the
    round trip to ``far``: the switch that ACKs (the combine), or the tree's top,
    beyond which the targets are (the dispatch)."""

    role = "frames"

    def __init__(self, st: NodeState, count: int, *, rto_min: float = 0.02,
                 far: int | None = None, frame_bytes: int = 0) -> None:
        from fabric.core.reliability import RttEstimator

        self.st, self.count = st, count
        self.pending: dict[int, set[int]] = {}  # frame -> node ids still to ACK it
        self.sent_at: dict[int, float] = {}
        self.tries: dict[int, int] = {}
        self.next = 0
        # one estimator per node and role: later calls start from what earlier ones measured
        self.rtt: RttEstimator = st.estimator(f"moe_{self.role}", rto_min)
        self.gate = st.congestion_gate(far if far is not None else st.root_switch_id,
                                       frame_bytes or st.stream_frame_bytes, st.node_id)
        self.marked: set[int] = set()  # frames an ACK of which echoed a mark

    def _frame(self, j: int, left: set[int]) -> Send:
        raise NotImplementedError

    def _size(self, j: int) -> int:
        raise NotImplementedError

    def _ackers(self, j: int) -> set[int]:
        raise NotImplementedError

    def _pump(self, now: float) -> list[Send]:
        out: list[Send] = []
        gate = self.gate
        if gate is not None:
            gate.begin(now)
        while self.next < self.count and len(self.pending) < ROWS_WINDOW:
            j = self.next
            if gate is not None:
                if not gate.allows(self._size(j), now):
                    break
                gate.sent(self._size(j), now)
            self.next += 1
            self.pending[j] = left = self._ackers(j)
            self.sent_at[j] = now
            out.append(self._frame(j, left))
        if gate is not None:
            gate.end()
        if self.next == self.count and not self.pending:
            self.done = True
        return out

    def _resend(self, j: int, left: set[int], now: float, *, timeout: bool) -> Send:
        """Frame ``j`` again, to whoever of ``left`` still owes its ACK."""
        if self.gate is not None:
            self.gate.lost(self._size(j), now, timeout=timeout)
            self.gate.sent(self._size(j), now)
        return self._frame(j, left)

    def start(self, now: float) -> list[Send]:
        return self._pump(now)

    def _acked(self, j: int, who: int, now: float, marked: bool = False) -> list[Send]:
        left = self.pending.get(j)
        if left is None or who not in left:
            return []
        left.discard(who)
        if marked and self.gate is not None:
            self.marked.add(j)
        if not left:
            del self.pending[j]
            rtt = now - self.sent_at[j]
            if not self.tries.get(j):  # Karn: only frames sent once
                self.rtt.sample(rtt)
            if self.gate is not None:
                self.gate.acked(self._size(j), j in self.marked,
                                0.0 if self.tries.get(j) else rtt, now)
                self.marked.discard(j)
        return self._pump(now)

    def get_timer(self) -> float | None:
        if self.done:
            return None
        due = min(self.sent_at[j] for j in self.pending) + self.rtt.rto \
            if self.pending else None
        pace = self.gate.pace_wait if self.gate is not None and self.next < self.count \
            else None
        if pace is not None and (due is None or pace < due):
            return pace
        return due

    def handle_timer(self, now: float) -> list[Send]:
        out: list[Send] = []
        rto = self.rtt.rto
        for j, left in self.pending.items():
            if self.sent_at[j] + rto <= now:
                n = self.tries[j] = self.tries.get(j, 0) + 1
                if n > 64:
                    from fabric.errors import FabricTimeout

                    names = ", ".join(self.st.topo.by_id(m).name for m in sorted(left))
                    raise FabricTimeout(f"{self.st.name}: moe {self.role} frame {j}: no ACK "
                                        f"from {names} after {n - 1} retransmissions")
                self.sent_at[j] = now
                out.append(self._resend(j, left, now, timeout=True))
        if out:
            self.rtt.backoff()
            self.st.retransmits += len(out)
            self.st.timeouts += len(out)  # each frame's own timer ran out
        if self.gate is not None:
            out.extend(self._pump(now))  # the pacer's time
        return out

    def waiting_for(self) -> str:
        late = sorted({m for left in self.pending.values() for m in left})
        return f"ACKs of moe {self.role} frames from " + ", ".join(
            self.st.topo.by_id(m).name for m in late[:8])


class RowsSend(_AckedFrames):
    """Dispatch rows as masked multicast frames (``key`` = the mask of the target
    members in one block of 32, ``offset`` = the block; rows with the same targets
    in a block share a frame); each target ACKs each frame; a frame some targets
    lack by its RTO goes again to those alone (a smaller mask)."""

    role = "dispatch"

    def __init__(self, st: NodeState, g: Group, rows: list[tuple[int, list[int], Any]], *,
                 sid: int, msg: int) -> None:
        super().__init__(st, len(rows), frame_bytes=max(
            (memoryview(r[2]).nbytes for r in rows), default=0))
        self.g, self.rows, self.sid, self.msg = g, rows, sid, msg
        self.order = sorted(g.ids)  # mask bit i: the i-th member by id

    def _ackers(self, j: int) -> set[int]:
        return {self.g.ids[k] for k in self.rows[j][1]}

    def _size(self, j: int) -> int:
        return fr.HEADER_SIZE + memoryview(self.rows[j][2]).nbytes

    def _frame(self, j: int, left: set[int]) -> Send:
        mask = block = 0
        for m in left:  # the targets of one frame share a block
            block, bit = divmod(self.order.index(m), MASK_MEMBERS)
            mask |= 1 << bit
        body = self.rows[j][2]
        return (fr.encode_header(Op.WRITE, src=self.st.node_id, dst=self.g.gid,
                                 flags=Flag.MCAST, flow=MASKED_FLOW, job=self.sid, psn=j,
                                 key=mask, offset=block, msg=self.msg, payload=body,
                                 crc=self.st.crc), body)

    def wants(self, f: fr.Frame) -> bool:
        return (f.op in (Op.ACK, Op.NACK) and f.flow == MASKED_FLOW + 1 and f.job == self.sid
                and f.msg == self.msg)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        if f.op is Op.NACK:  # a switch trimmed our frame on its way to this member
            left = self.pending.get(f.psn)
            if f.offset != NackCode.TRIMMED or left is None or f.src not in left:
                return []
            self.tries[f.psn] = self.tries.get(f.psn, 0) + 1  # Karn: no RTT sample
            self.st.retransmits += 1
            return [self._resend(f.psn, {f.src}, now, timeout=False)]
        return self._acked(f.psn, f.src, now, f.has(Flag.ECN))


class RowsRecv(Program):
    """Receive the dispatch rows every other member sends us (``counts[k]`` rows of
    ``row_bytes`` from group rank ``k``), ACKing each frame; the result is
    {(k, frame): payload}."""

    def __init__(self, st: NodeState, g: Group, counts: Sequence[int], row_bytes: int, *,
                 sid: int, msg: int) -> None:
        self.st, self.g, self.sid, self.msg = st, g, sid, msg
        self.row_bytes = row_bytes
        self.rank_of = {nid: k for k, nid in enumerate(g.ids)}
        self.need = {g.ids[k]: int(c) for k, c in enumerate(counts) if k != g.rank and c}
        self.got: dict[tuple[int, int], bytes] = {}
        self.have = dict.fromkeys(self.need, 0)
        self.result = self.got
        self.last = 0.0

    def _check(self) -> None:
        if all(self.have[n] >= c for n, c in self.need.items()):
            self.done = True
            for nid in self.need:  # a late copy (our ACK was lost) is ACKed again
                self.st.stream_done(nid, MASKED_FLOW, self.sid, self.msg, -1)

    def start(self, now: float) -> list[Send]:
        self.last = now
        self._check()
        return []

    def wants(self, f: fr.Frame) -> bool:
        return (f.op is Op.WRITE and f.flow == MASKED_FLOW and f.job == self.sid
                and f.msg == self.msg and f.src in self.need)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        self.last = now
        key = (self.rank_of[f.src], f.psn)
        if key not in self.got and f.length and f.length % self.row_bytes == 0:
            self.got[key] = bytes(f.payload)
            self.have[f.src] += f.length // self.row_bytes
            self._check()
        # the ACK echoes a congestion mark the row met, for its sender's policy
        return [(fr.encode_header(Op.ACK, src=self.st.node_id, dst=f.src,
                                  flow=MASKED_FLOW + 1, job=self.sid, psn=f.psn, msg=self.msg,
                                  flags=Flag.ECN if f.has(Flag.ECN) else Flag.NONE,
                                  crc=self.st.crc), None)]

    def get_timer(self) -> float | None:
        return None if self.done else self.last + self.st.timeout_s

    def handle_timer(self, now: float) -> list[Send]:
        if now >= self.last + self.st.timeout_s:
            from fabric.errors import FabricTimeout

            late = [self.st.topo.by_id(n).name for n, c in self.need.items()
                    if self.have[n] < c]
            raise FabricTimeout(f"{self.st.name}: moe dispatch: rows from {', '.join(late)} "
                                f"missing after {self.st.timeout_s:g}s")
        return []

    def waiting_for(self) -> str:
        return "dispatch rows from " + ", ".join(
            self.st.topo.by_id(n).name for n, c in self.need.items() if self.have[n] < c)


def _innet_dispatch(st: NodeState, g: Group, x: np.ndarray | None, idx: np.ndarray,
                    wbits: np.ndarray, ranks_of: list[list[int]], T: int, H: int, K: int,
                    dtype: str, E: int) -> Generator[Program, Any, Dispatched]:
    from fabric.core.collective_programs import stream_id
    from fabric.core.programs import Parallel

    W, r = g.size, g.rank
    # a frame's mask names members by their place among the group's ids, in blocks
    pos = {nid: i for i, nid in enumerate(sorted(g.ids))}
    block_of = [pos[nid] // MASK_MEMBERS for nid in g.ids]
    item = np_dtype(dtype).itemsize
    nm = (1 + 2 * K) * 4
    row_bytes = nm + H * item
    per_frame = max(1, min(ROWS_FRAME_BYTES, st.mtu) // row_bytes)
    sc = [0] * W
    by_targets: dict[tuple[int, ...], list[bytes]] = {}
    mine: list[int] = []  # our own tokens we hold experts of
    zeros_row = bytes(H * item)
    for t in range(T):
        targets = tuple(q for q in ranks_of[t] if q != r)
        if r in ranks_of[t]:
            mine.append(t)
        for q in targets:
            sc[q] += 1
        if targets:
            row = np.array([t, *idx[t], *wbits[t]], np.int32).tobytes() + (
                x[t].tobytes() if x is not None else zeros_row)
            for b in sorted({block_of[q] for q in targets}):  # a frame per block
                by_targets.setdefault(tuple(q for q in targets if block_of[q] == b),
                                      []).append(row)
    frames: list[tuple[int, list[int], Any]] = []
    for targets, rows in sorted(by_targets.items()):
        for a in range(0, len(rows), per_frame):
            frames.append((a, list(targets), b"".join(rows[a: a + per_frame])))
    counts = yield collective_program(st, "alltoall", np.array(sc, np.int32),
                                      np.empty(W, np.int32), path="host-p2p", group=g)
    msg = g.next_msg()
    got = yield Parallel([RowsSend(st, g, frames, sid=stream_id(msg, 0), msg=msg),
                          RowsRecv(st, g, counts.tolist(), row_bytes, sid=stream_id(msg, 0),
                                   msg=msg)])  # ints, not NumPy's: compiled code checks
    received = got[1]
    bodies = [(k, received[(k, j)][a: a + row_bytes]) for k, j in sorted(received)
              for a in range(0, len(received[(k, j)]), row_bytes)]
    src = np.array([r] * len(mine) + [k for k, _b in bodies], np.int64)
    meta = np.empty((len(src), 1 + 2 * K), np.int32)
    vecs = np.empty((len(src), H), np_dtype(dtype)) if x is not None else None
    for i, t in enumerate(mine):
        meta[i] = [t, *idx[t], *wbits[t]]
        if vecs is not None and x is not None:
            vecs[i] = x[t]
    for i, (_k, body) in enumerate(bodies, start=len(mine)):
        meta[i] = np.frombuffer(body[:nm], np.int32)
        if vecs is not None:
            vecs[i] = np.frombuffer(body[nm:], np_dtype(dtype))
    plan = {"ranks_of": ranks_of}
    return Dispatched(vecs, src, meta[:, 0].copy(), meta[:, 1:1 + K].copy(),
                      meta[:, 1 + K:].copy().view(np.float32), E, "in-network", T, H, dtype,
                      plan)


class CombineSend(_AckedFrames):
    """Each dispatched row's partial, towards the token's home; this rank's switch
    sums the partials of one token from every rank below it. Rows of one home with
    the same count of contributions below the switch (``key``) share a frame
    (``offset`` tokens: their ids, then their vectors); the switch ACKs each."""

    role = "combine"

    def __init__(self, st: NodeState, frames: list[tuple[int, int, int, bytes]], *,
                 sid: int, msg: int, dtype: str) -> None:
        super().__init__(st, len(frames), far=st.switch_id,
                         frame_bytes=max((len(f[3]) for f in frames), default=0))
        self.frames = frames  # (home node id, tokens, contributions below our switch, body)
        self.sid, self.msg = sid, msg
        self.code = fr.dtype_from_name(dtype)

    def _ackers(self, j: int) -> set[int]:
        return {self.st.switch_id}

    def _size(self, j: int) -> int:
        return fr.HEADER_SIZE + len(self.frames[j][3])

    def _frame(self, j: int, left: set[int]) -> Send:
        from switchd.core import COMBINE_FLOW

        home, n, below, body = self.frames[j]
        return (fr.encode_header(Op.REDUCE, src=self.st.node_id, dst=home, flow=COMBINE_FLOW,
                                 job=self.sid, psn=j, key=below, offset=n, msg=self.msg,
                                 dtype=self.code, payload=body, crc=self.st.crc), body)

    def wants(self, f: fr.Frame) -> bool:
        from switchd.core import COMBINE_FLOW

        return (f.op is Op.ACK and f.flow == COMBINE_FLOW + 1 and f.job == self.sid
                and f.msg == self.msg and f.src == self.st.switch_id)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        return self._acked(f.psn, f.src, now, f.has(Flag.ECN))


class CombineRecv(Program):
    """At a token's home: one summed partial per leaf that holds its experts (frames
    of several tokens); a missing one is asked for again (NACK to that switch,
    which kept it)."""

    def __init__(self, st: NodeState, expect: dict[tuple[int, int], None], T: int, H: int,
                 *, sid: int, msg: int, data: bool) -> None:

        self.st, self.sid, self.msg = st, sid, msg
        self.expect = expect  # (token, switch id) still to come
        self.out = np.zeros((T, H), np.float32) if data else None
        self.result = self.out
        # one estimator per node and role: later calls start from what earlier ones measured
        self.rtt = st.estimator("moe_home", 0.05)
        self.last = 0.0
        self.quiet_since = 0.0

    def start(self, now: float) -> list[Send]:
        self.last = self.quiet_since = now
        self.done = not self.expect
        return []

    def wants(self, f: fr.Frame) -> bool:
        from switchd.core import COMBINE_FLOW

        return (f.op is Op.REDUCE and f.flow == COMBINE_FLOW and f.job == self.sid
                and f.msg == self.msg and f.dst == self.st.node_id)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        from kernels.dtypes import DTYPES

        n = f.offset
        raw = np.frombuffer(f.payload, np.uint8)
        if n <= 0 or raw.size <= 4 * n:
            return []
        tokens = raw[:4 * n].view(np.int32).tolist()
        vecs = raw[4 * n:].view(DTYPES[fr.DTYPE_NAMES[f.dtype]]).reshape(n, -1)
        for t, v in zip(tokens, vecs, strict=True):
            k = (t, f.src)
            if k not in self.expect:
                continue  # a late copy
            del self.expect[k]
            self.last = now
            if self.out is not None:
                self.out[t] += v
        self.done = not self.expect
        return []

    def get_timer(self) -> float | None:
        return None if self.done else self.last + self.rtt.rto

    def handle_timer(self, now: float) -> list[Send]:
        from switchd.core import COMBINE_FLOW

        if now < self.last + self.rtt.rto:
            return []
        if now >= self.quiet_since + self.st.timeout_s and now >= self.last + self.st.timeout_s:
            from fabric.errors import FabricTimeout

            raise FabricTimeout(f"{self.st.name}: moe combine: {len(self.expect)} partial sums "
                                f"never came (e.g. token {next(iter(self.expect))[0]})")
        self.rtt.backoff()
        self.last = now
        out: list[Send] = []
        for t, sw in list(self.expect)[:ROWS_WINDOW]:  # ask the switch that kept each
            out.append((fr.encode_header(Op.NACK, src=self.st.node_id, dst=sw,
                                         flow=COMBINE_FLOW, job=self.sid, psn=t, msg=self.msg,
                                         offset=int(NackCode.MISSING), crc=self.st.crc), None))
        return out

    def waiting_for(self) -> str:
        return "switches summing this rank's tokens (in-network combine)"


def _innet_combine(st: NodeState, g: Group, d: Dispatched,
                   partials: np.ndarray | None) -> Generator[Program, Any, Any]:
    from fabric.core.collective_programs import stream_id
    from fabric.core.programs import Parallel

    W, r = g.size, g.rank
    topo = st.topo
    sw_of = [topo.node(topo.switch_of(topo.by_id(nid).name)).id for nid in g.ids]
    per = d.num_experts // W
    item = np_dtype(d.dtype).itemsize
    zeros_row = bytes(d.hidden * item)
    per_frame = max(1, min(ROWS_FRAME_BYTES, st.mtu) // (4 + d.hidden * item))
    groups: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    for i in range(d.src.shape[0]):
        targets = {int(e) // per for e in d.experts[i]}
        below = sum(1 for q in targets if sw_of[q] == sw_of[r])
        body = (np.ascontiguousarray(partials[i]).tobytes() if partials is not None
                else zeros_row)
        groups.setdefault((g.ids[int(d.src[i])], below), []).append((int(d.tok[i]), body))
    frames: list[tuple[int, int, int, bytes]] = []
    for (home, below), rows in sorted(groups.items()):
        for a in range(0, len(rows), per_frame):
            chunk = rows[a: a + per_frame]
            ids = np.array([t for t, _ in chunk], np.int32).tobytes()
            frames.append((home, len(chunk), below, ids + b"".join(b for _, b in chunk)))
    expect: dict[tuple[int, int], None] = {}
    ranks_of = d.plan["ranks_of"]
    for t in range(d.tokens):
        for sw in sorted({sw_of[q] for q in ranks_of[t]}):
            expect[(t, sw)] = None
    msg = g.next_msg()
    sid = stream_id(msg, 0)
    got = yield Parallel([CombineSend(st, frames, sid=sid, msg=msg, dtype=d.dtype),
                          CombineRecv(st, expect, d.tokens, d.hidden, sid=sid, msg=msg,
                                      data=partials is not None)])
    out = got[1]
    return None if out is None else out.astype(np_dtype(d.dtype))
