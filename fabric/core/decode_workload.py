"""A sharded model's decode loop over the fabric: a workload (written once, run on
real processes or in simulation), timed part by part.

Ranks ``(s * ep + e) * tp + r``: pipeline stage ``s`` (of ``pp``), attention
replica ``e`` (of ``ep``) and TP rank ``r``. Each replica decodes every
``ep``-th sequence; each stage holds its share of the layers. Per layer:

1. attention: each TP rank computes its heads; the output projection's partial
   sums meet in an allreduce over the replica's TP group;
2. the router runs on every rank alike; MoE dispatch (``variant``: flat,
   hierarchical, in-network) sends each token to the ranks of its experts'
   group, among the ranks of the same stage and TP rank of every replica;
3. each expert group's TP ranks compute their slice of the expert FFN for the
   rows they received (the same rows on every TP rank of the group, put in one
   order by home and token), sum the slices in an allreduce, weigh them by the
   gates, and combine returns the sums to the tokens' homes.

Between stages the hidden states go to the same (replica, TP rank) of the next
stage, and the last stage's new tokens back to the first (the stages run in
turn: no micro-batches).

With ``data=True`` (the ``tiny`` preset) the arithmetic is
:mod:`fabric.core.decoder`'s fixed point, so the tokens are exactly
:func:`fabric.core.decoder.generate_reference`'s whatever the layout. With
``data=False`` (any preset) nothing is computed: the operations carry the real
sizes with no payload, routing is drawn uniformly (seeded), and each part's
compute is charged from :func:`fabric.core.model.decode_step` (``gpu``) as
``ctx.compute``. Every step is timed: the wait for each part, and the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from fabric.core.decoder import (
    W_BITS,
    AttentionKernel,
    KvCache,
    TinyWeights,
    attention_partial,
    expert_partial,
    lm_logits,
    rescale,
    rms_norm,
    route,
    sample_tokens,
    weigh,
)
from fabric.core.model import (
    RUNNABLE_PARAMS,
    Layout,
    ModelConfig,
    StepPart,
    decode_step,
    get_gpu,
    get_model,
)
from fabric.errors import UsageError
from kernels.dtypes import np_dtype

__all__ = ["COMBINE_LIMIT", "PARTS", "DecodeShard", "sharded_decode"]

#: MoE rows travel as float32: integers below this sum exactly in any order.
COMBINE_LIMIT = 1 << 23
#: The parts a step's time is split into (each rank's own clock).
PARTS = ("compute", "tp", "dispatch", "combine", "pp")


class _Timer:
    """Per step, the time spent waiting for each part (``ctx.clock`` around it), and
    of the network operations (``"ops"``) those this rank resent in (``"resent"``:
    its retransmit counters moved)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.steps: list[dict[str, float]] = []

    def run(self, part: str, op: Any, also: str = "") -> Generator[Any, Any, Any]:
        net = part != "compute"
        c0 = (yield self.ctx.counters()) if net else None
        t0 = yield self.ctx.clock()
        out = yield op
        t1 = yield self.ctx.clock()
        step = self.steps[-1]
        for key in (part, also) if also else (part,):
            step[key] = step.get(key, 0.0) + (t1 - t0)
        if c0 is not None:
            c1 = yield self.ctx.counters()
            step["ops"] = step.get("ops", 0.0) + 1
            if c1 != c0:
                step["resent"] = step.get("resent", 0.0) + 1
        return out


class DecodeShard:
    """One rank of a sharded model: where it sits in the layout, what it holds (its
    stage's layers, its heads, its replica's KV cache, its experts) and one
    decode step of its replica's sequences over the fabric (:meth:`step`).

    Layout rank ``(s * ep + e) * tp + r`` is world rank ``base + spread * rank``.
    Every rank of the layout takes every step together; what a step feeds is
    known to every rank of the replica alike (its TP ranks and its stages).
    """

    def __init__(self, ctx: Any, m: ModelConfig, tp: int, ep: int, pp: int, rank: int, *,
                 base: int = 0, spread: int = 1, data: bool = True, weights_seed: int = 0,
                 variant: str = "flat", path: str = "ina", gpu: str | None = None,
                 payloads: bool = False, seed: int = 0,
                 attention: AttentionKernel | None = None) -> None:
        Layout(tp=tp, ep=ep, pp=pp).check(m)
        if data and m.params() > RUNNABLE_PARAMS:
            raise UsageError(f"{m.name} is too large to compute here; run it timing-only "
                             "(data=False)")
        self.ctx, self.m = ctx, m
        self.tp, self.ep, self.pp = tp, ep, pp
        self.base, self.spread = base, spread
        self.s, rest = divmod(rank, tp * ep)
        self.e, self.r = divmod(rest, tp)
        self.variant, self.path, self.payloads, self.seed = variant, path, payloads, seed
        self.attention = attention  # None: kernels.reference.attention_fixed
        self.w = TinyWeights(m, weights_seed) if data else None
        self.cache = KvCache()
        self.clock = _Timer(ctx)
        self.spec = get_gpu(gpu) if gpu is not None else None
        self.dt = np_dtype(m.dtype)
        self.mine = range(self.s * m.layers // pp, (self.s + 1) * m.layers // pp)
        self.tpg: Any = None
        self.epg: Any = None
        self.costs: dict[str, StepPart] = {}  # this step's, from the cost model

    def at(self, rank: int) -> int:
        """The world rank of layout rank ``rank``."""
        return self.base + rank * self.spread

    def open(self) -> Generator[Any, Any, None]:
        """Make this rank's TP group (its replica's TP ranks) and EP group (the same
        stage and TP rank of every replica)."""
        ctx, tp, ep, s, e, r = self.ctx, self.tp, self.ep, self.s, self.e, self.r
        first = s * tp * ep
        if tp > 1:
            self.tpg = yield ctx.group([self.at(first + e * tp + i) for i in range(tp)])
        if ep > 1:
            self.epg = yield ctx.group([self.at(first + q * tp + r) for q in range(ep)])

    def close(self) -> Generator[Any, Any, None]:
        """Close the groups :meth:`open` made."""
        if self.tpg is not None:
            yield self.ctx.close_group(self.tpg)
            self.tpg = None
        if self.epg is not None:
            yield self.ctx.close_group(self.epg)
            self.epg = None

    def _pad(self, *shape: int) -> np.ndarray | None:
        """A timing-only operation's payload: zeros of its size, or None (sizes only)."""
        return np.zeros(shape, self.dt) if self.payloads and self.w is None else None

    def _compute(self, name: str, scale: float = 1.0,
                 also: str = "") -> Generator[Any, Any, None]:
        """Charge ``scale`` times one layer's ``name`` part of the cost model (its
        time also under ``also``)."""
        part = self.costs.get(name)
        secs = part.compute_us * 1e-6 * scale if part is not None else 0.0
        if secs > 0:
            yield from self.clock.run("compute", self.ctx.compute(secs), also)

    def _tp_sum(self, part: np.ndarray | None, count: int) -> Generator[Any, Any, Any]:
        if self.tpg is None or count == 0:
            return part
        ctx, m = self.ctx, self.m
        if part is None:
            yield from self.clock.run("tp", ctx.allreduce(
                self._pad(count), count=count, dtype=m.dtype, path=self.path, group=self.tpg))
            return None
        got = yield from self.clock.run("tp", ctx.allreduce(
            np.ascontiguousarray(part.reshape(-1)), path=self.path, group=self.tpg))
        return np.asarray(got, np.int64).reshape(part.shape)

    def step(self, counts: np.ndarray, feed: np.ndarray | None, slots: Sequence[int],
             keys: np.ndarray, positions: np.ndarray, temperatures: np.ndarray,
             seeds: np.ndarray, *, index: int, batch: int, context: int = 0,
             prefill: bool = False) -> Generator[Any, Any, np.ndarray | None]:
        """One decode step of this replica's sequences: sequence ``i`` (cache slot
        ``slots[i]``) feeds ``counts[i]`` tokens (stage 0: ``feed``, concatenated)
        and gets one new token, sampled at ``temperatures[i]`` with noise keyed by
        (``seeds[i]``, ``keys[i]``, ``positions[i]``).

        Returns the new tokens on the first and the last stage (timing-only:
        zeros), None on the others. ``index`` numbers the step (timing-only
        routing is drawn from it); ``batch`` (token rows over every replica) and
        ``context`` size the cost model's compute; the step's part times are
        appended to ``self.clock.steps``.
        """
        ctx, m, tp, ep, pp, s, e, r = (self.ctx, self.m, self.tp, self.ep, self.pp, self.s,
                                       self.e, self.r)
        clock, w = self.clock, self.w
        nseq = len(counts)
        rows = int(np.sum(counts))
        clock.steps.append({"prefill": float(prefill)})
        hand_off = max(rows * m.hidden // tp, 1)  # elements a TP rank hands the next stage
        t_step = yield ctx.clock()
        self.costs = {p.name: p for p in decode_step(
            m, Layout(tp=tp, ep=ep, pp=pp), self.spec, batch=batch, context=context).parts} \
            if self.spec is not None else {}
        prev = self.at((s - 1) * tp * ep + e * tp + r) if s else None
        nxt = self.at((s + 1) * tp * ep + e * tp + r if s < pp - 1 else e * tp + r)
        x: Any = None
        if s == 0:
            if w is not None:
                assert feed is not None and len(feed) == rows
                x = w.embed[np.asarray(feed, np.int64) % m.vocab]
        else:
            assert prev is not None
            x = yield from clock.run("pp", ctx.recv(
                np.empty((rows, m.hidden), np.int64) if w is not None else self._pad(hand_off),
                prev, nbytes=hand_off * m.elem_bytes))
        for layer in self.mine:
            x = yield from self._layer(layer, x, counts, slots, rows, index)
        new: np.ndarray | None = None
        if s < pp - 1:
            yield from clock.run("pp", ctx.send(x if w is not None else self._pad(hand_off), nxt,
                                                nbytes=hand_off * m.elem_bytes))
            if s == 0:  # the last stage's tokens come back
                got = yield from clock.run("pp", ctx.recv(
                    np.empty(nseq, np.int64) if w is not None or self.payloads else None,
                    self.at((pp - 1) * tp * ep + e * tp + r), nbytes=8 * nseq))
                new = np.asarray(got, np.int64) if got is not None else np.zeros(nseq, np.int64)
        else:
            yield from self._compute("lm-head", pp, also="head")
            if w is not None and x is not None:
                last = np.cumsum(counts) - 1  # each sequence's last row
                new = sample_tokens(lm_logits(w, x[last]), keys, positions, temperatures, seeds)
            else:
                new = np.zeros(nseq, np.int64)
            if pp > 1:
                yield from clock.run("pp", ctx.send(new if w is not None or self.payloads
                                                    else None, nxt, nbytes=8 * nseq))
        t_end = yield ctx.clock()
        clock.steps[-1]["step"] = t_end - t_step
        return new

    def _layer(self, layer: int, x: Any, counts: np.ndarray, slots: Sequence[int], nrows: int,
               index: int) -> Generator[Any, Any, Any]:
        """One layer on this rank; returns the new hidden rows (None timing-only)."""
        ctx, m, w, clock, ep, e, r = (self.ctx, self.m, self.w, self.clock, self.ep, self.e,
                                      self.r)
        yield from self._compute("attention")
        part = attention_partial(w, layer, rms_norm(x), self.cache, self.tp, r, slots,
                                 counts.tolist(), kernel=self.attention) \
            if w is not None else None
        part = yield from self._tp_sum(part, nrows * m.hidden)
        if w is not None:
            x = x + rescale(part, W_BITS)
        dense = not m.moe or layer < m.dense_layers
        if dense:  # dense FFN over tp (timing-only presets: deepseek-v3's first layers)
            yield from self._compute("ffn")
            yield from self._tp_sum(None, nrows * m.hidden)
            return x
        if m.shared_experts:
            yield from self._compute("shared")
        if w is not None:
            xn = rms_norm(x)
            ids, gates = route(w, layer, xn)
        else:  # uniform routing, the same on a replica's TP ranks
            rng = np.random.default_rng([self.seed, e, index, layer])
            ids = np.argsort(rng.random((nrows, m.experts)), axis=1)[:, :m.top_k]
            gates = np.full(ids.shape, 1.0 / m.top_k)
        per = m.experts // ep
        if self.epg is not None:
            d = yield from clock.run("dispatch", ctx.moe_dispatch(
                xn.astype(np.float32) if w is not None else self._pad(nrows, m.hidden), ids,
                gates.astype(np.float32), m.experts, variant=self.variant, group=self.epg,
                hidden=m.hidden, dtype=m.dtype))
            rows_e = np.asarray(d.experts, np.int64)
            rows_x = np.asarray(d.x, np.float32).astype(np.int64) if w is not None else None
            rows_g = np.asarray(d.weights)
            order = np.lexsort((d.tok, d.src))  # one order on every TP rank
        else:
            d, rows_e, rows_g = None, ids, gates.astype(np.float32)
            rows_x = xn if w is not None else None
            order = np.arange(nrows)
        lo, hi = e * per, (e + 1) * per
        pair_row, pair_k = [], []
        for row in order:
            for k in range(m.top_k):
                if lo <= rows_e[row, k] < hi:
                    pair_row.append(int(row))
                    pair_k.append(k)
        prow, pk = np.array(pair_row, np.int64), np.array(pair_k, np.int64)
        # the experts' compute: the model's average, scaled to the pairs that came
        expected = nrows * m.top_k
        yield from self._compute("experts", len(prow) / expected if expected else 0.0)
        nin = len(rows_e)
        if w is None:
            yield from self._tp_sum(None, len(prow) * m.hidden)
            partials = None
        else:
            assert rows_x is not None
            pexp = rows_e[prow, pk] if prow.size else prow
            P = np.zeros((len(prow), m.hidden), np.int64)
            for ex in np.unique(pexp):
                sel = np.flatnonzero(pexp == ex)
                P[sel] = expert_partial(w, layer, int(ex), rows_x[prow[sel]], self.tp, r)
            P = yield from self._tp_sum(P, P.size)
            contrib = weigh(rescale(P, W_BITS), rows_g[prow, pk].astype(np.int64)) \
                if prow.size else P
            partials = np.zeros((nin, m.hidden), np.int64)
            np.add.at(partials, prow, contrib)
        if d is None:
            return x + partials if partials is not None else x
        if partials is not None and partials.size and \
                np.abs(partials).max() >= COMBINE_LIMIT // m.top_k:
            raise ValueError(f"{ctx.name}: an MoE partial left float32's exact integers; the "
                             "fixed-point range is too small")
        back = yield from clock.run("combine", ctx.moe_combine(
            d, partials.astype(np.float32) if partials is not None else self._pad(nin, m.hidden),
            group=self.epg))
        if w is None:
            return None
        return x + np.asarray(back, np.float32).astype(np.int64)


def sharded_decode(ctx: Any, preset: str, tp: int, ep: int, prompts: Sequence[Sequence[int]],
                   max_tokens: int, *, pp: int = 1, temperature: float = 0.0, seed: int = 0,
                   weights_seed: int = 0, variant: str = "flat", path: str = "ina",
                   data: bool = True, gpu: str | None = None, context: int = 0,
                   layers: int | None = None, payloads: bool = False,
                   background_bytes: int = 0) -> Generator[Any, Any, dict[str, Any]]:
    """Decode ``max_tokens`` new tokens of every prompt, sharded ``pp`` x ``ep`` x
    ``tp`` over the world's ranks.

    Returns ``{"tokens": {sequence: tokens}}`` (``data``: this rank's replica's
    sequences) and ``"steps"``: per step, its time (``"step"``) and each part's
    (:data:`PARTS`), in seconds of this rank's clock, and ``"prefill"`` 1.0 for a
    step that still feeds prompts (data: a token a step; timing-only: the first
    step, every prompt's tokens at once). ``gpu`` (a
    :data:`fabric.core.model.GPUS` name) charges each part's compute from the
    cost model, at a context of ``context`` tokens plus the position; the LM
    head's share of it is also under ``"head"``. ``layers`` (timing-only) runs
    that many of the model's layers (its dense ones in proportion), for a study
    that extrapolates the per-layer parts to the whole model. ``payloads``
    (timing-only): the operations carry zero-filled payloads of their sizes, as
    an emulated run needs (a simulation moves sizes alone).

    ``background_bytes`` > 0: a checkpoint burst beside the decode. The world is
    twice the layout: even ranks decode (layout rank = world rank / 2), odd ranks
    each exchange ``background_bytes`` with the odd rank half the world away, so
    both kinds share every leaf and its uplinks; an odd rank returns
    ``{"background_s": seconds}``.
    """
    m = get_model(preset)
    if layers is not None:
        if data or not 1 <= layers <= m.layers:
            raise UsageError(f"layers={layers}: a timing-only run of 1..{m.layers} layers")
        m = dataclasses.replace(m, layers=layers,
                                dense_layers=round(m.dense_layers * layers / m.layers))
    Layout(tp=tp, ep=ep, pp=pp).check(m)
    spread = 2 if background_bytes > 0 else 1
    if ctx.world != tp * ep * pp * spread:
        raise UsageError(f"pp {pp} x ep {ep} x tp {tp}"
                         f"{' beside as many checkpointing ranks' if spread > 1 else ''} needs "
                         f"{tp * ep * pp * spread} workers, the fabric has {ctx.world}")
    if spread > 1 and (tp * ep * pp) % 2:
        raise UsageError(f"a checkpoint burst pairs its ranks across the fabric: the layout "
                         f"needs an even number of GPUs, not {tp * ep * pp}")
    if ctx.rank % spread:
        return (yield from _background(ctx, background_bytes, payloads))
    if len(prompts) < ep or not all(prompts):
        raise UsageError(f"need at least one non-empty prompt per replica ({ep}), "
                         f"got {len(prompts)}")
    shard = DecodeShard(ctx, m, tp, ep, pp, ctx.rank // spread, spread=spread, data=data,
                        weights_seed=weights_seed, variant=variant, path=path, gpu=gpu,
                        payloads=payloads, seed=seed)
    yield from shard.open()
    seqs = np.arange(shard.e, len(prompts), ep)
    feed = [list(prompts[int(q)]) for q in seqs]
    out: dict[int, list[int]] = {int(q): [] for q in seqs}
    # data: a prompt is fed a token a step; timing-only: the first step is a batched
    # prefill of every prompt's tokens at once, which gives the first new token
    plen = max(len(p) for p in prompts)
    steps = plen + max_tokens - 1 if data else max_tokens
    n = len(seqs)
    for pos in range(steps):
        prefill = pos < plen - 1 if data else pos == 0
        per_seq = plen if prefill and not data else 1
        tok = np.array([f[pos] if pos < len(f) else out[int(q)][-1] if out[int(q)]
                        else f[-1] for q, f in zip(seqs, feed, strict=True)], np.int64) \
            if data and shard.s == 0 else None
        new = yield from shard.step(
            np.full(n, per_seq, np.int64), tok, seqs.tolist(), seqs.astype(np.int64),
            np.full(n, pos, np.int64), np.full(n, temperature), np.full(n, seed, np.uint64),
            index=pos, batch=len(prompts) * per_seq, context=context + pos, prefill=prefill)
        if shard.s == 0 and new is not None:
            for i, (q, f) in enumerate(zip(seqs, feed, strict=True)):
                if pos >= (len(f) - 1 if data else 0) and len(out[int(q)]) < max_tokens:
                    out[int(q)].append(int(new[i]))
    yield from shard.close()
    return {"tokens": out if shard.s == 0 else {}, "steps": shard.clock.steps,
            "stage": shard.s, "replica": shard.e, "tp_rank": shard.r}


def _background(ctx: Any, nbytes: int, payloads: bool) -> Generator[Any, Any, dict[str, Any]]:
    """An odd rank's checkpoint burst: ``nbytes`` to and from the odd rank half the
    world away, at once (payloads of zeros where the world needs arrays)."""
    partner = (ctx.rank + ctx.world // 2) % ctx.world  # odd: the world is 4k
    t0 = yield ctx.clock()
    x = np.zeros(nbytes, np.uint8) if payloads else None
    out = np.empty(nbytes, np.uint8) if payloads else None
    yield ctx.sendrecv(x, partner, out, partner, nbytes=nbytes)
    t1 = yield ctx.clock()
    return {"background_s": t1 - t0}
