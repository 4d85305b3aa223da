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
    KvCache,
    TinyWeights,
    attention_partial,
    expert_partial,
    lm_logits,
    next_tokens,
    rescale,
    rms_norm,
    route,
    weigh,
)
from fabric.core.model import Layout, ModelConfig, StepPart, decode_step, get_gpu, get_model
from fabric.errors import UsageError
from kernels.dtypes import np_dtype

__all__ = ["COMBINE_LIMIT", "PARTS", "sharded_decode"]

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

    def at(rank: int) -> int:
        """The world rank of layout rank ``rank`` (decode ranks are every spread-th)."""
        return rank * spread

    if len(prompts) < ep or not all(prompts):
        raise UsageError(f"need at least one non-empty prompt per replica ({ep}), "
                         f"got {len(prompts)}")
    if data and m.params() > 100_000_000:
        raise UsageError(f"{m.name} is too large to compute here; run it timing-only "
                         "(data=False)")
    s, rest = divmod(ctx.rank // spread, tp * ep)
    e, r = divmod(rest, tp)
    base = s * tp * ep
    tpg = (yield ctx.group([at(base + e * tp + i) for i in range(tp)])) if tp > 1 else None
    epg = (yield ctx.group([at(base + q * tp + r) for q in range(ep)])) if ep > 1 else None
    mine = range(s * m.layers // pp, (s + 1) * m.layers // pp)
    seqs = np.arange(e, len(prompts), ep)
    feed = [list(prompts[q]) for q in seqs]
    out: dict[int, list[int]] = {int(q): [] for q in seqs}
    w = TinyWeights(m, weights_seed) if data else None
    dt = np_dtype(m.dtype)

    def pad(*shape: int) -> np.ndarray | None:
        """A timing-only operation's payload: zeros of its size, or None (sizes only)."""
        return np.zeros(shape, dt) if payloads and not data else None

    spec = get_gpu(gpu) if gpu is not None else None
    cache = KvCache()
    clock = _Timer(ctx)
    # data: a prompt is fed a token a step; timing-only: the first step is a batched
    # prefill of every prompt's tokens at once, which gives the first new token
    plen = max(len(p) for p in prompts)
    steps = plen + max_tokens - 1 if data else max_tokens
    prev = at((s - 1) * tp * ep + e * tp + r) if s else None
    nxt_rank = at((s + 1) * tp * ep + e * tp + r if s < pp - 1 else e * tp + r)

    def compute(costs: dict[str, StepPart], name: str, scale: float = 1.0,
                also: str = "") -> Generator[Any, Any, None]:
        """Charge ``scale`` times one layer's ``name`` part of the cost model (its
        time also under ``also``)."""
        part = costs.get(name)
        secs = part.compute_us * 1e-6 * scale if part is not None else 0.0
        if secs > 0:
            yield from clock.run("compute", ctx.compute(secs), also)

    def tp_sum(part: np.ndarray | None, count: int) -> Generator[Any, Any, Any]:
        if tpg is None or count == 0:
            return part
        if part is None:
            yield from clock.run("tp", ctx.allreduce(pad(count), count=count, dtype=m.dtype,
                                                     path=path, group=tpg))
            return None
        got = yield from clock.run("tp", ctx.allreduce(
            np.ascontiguousarray(part.reshape(-1)), path=path, group=tpg))
        return np.asarray(got, np.int64).reshape(part.shape)

    for pos in range(steps):
        prefill = pos < plen - 1 if data else pos == 0
        clock.steps.append({"prefill": float(prefill)})
        rows = len(seqs) * (plen if prefill and not data else 1)  # rows through the layers
        hand_off = max(rows * m.hidden // tp, 1)  # elements a TP rank hands the next stage
        t_step = yield ctx.clock()
        costs = {p.name: p for p in decode_step(
            m, Layout(tp=tp, ep=ep, pp=pp), spec,
            batch=len(prompts) * (rows // len(seqs)), context=context + pos).parts} \
            if spec is not None else {}
        if s == 0:
            tok = np.array([f[pos] if pos < len(f) else out[int(q)][-1] if out[int(q)]
                            else f[-1] for q, f in zip(seqs, feed, strict=True)], np.int64)
            x = w.embed[tok % m.vocab] if w is not None else None
        else:
            x = yield from clock.run("pp", ctx.recv(
                np.empty((len(seqs), m.hidden), np.int64) if data else pad(hand_off), prev,
                nbytes=hand_off * m.elem_bytes))
        for layer in mine:
            x = yield from _layer(ctx, m, w, layer, x, cache, tp, ep, r, e, epg, variant,
                                  clock, compute, tp_sum, pad, costs, rows, seed, pos)
        if s < pp - 1:
            yield from clock.run("pp", ctx.send(x if data else pad(hand_off), nxt_rank,
                                                nbytes=hand_off * m.elem_bytes))
            new = None
            if s == 0:  # the last stage's tokens come back
                new = yield from clock.run("pp", ctx.recv(
                    np.empty(len(seqs), np.int64) if data or payloads else None,
                    at((pp - 1) * tp * ep + e * tp + r), nbytes=8 * len(seqs)))
        else:
            yield from compute(costs, "lm-head", pp, also="head")
            new = next_tokens(lm_logits(w, x), seqs, np.full(len(seqs), pos), temperature,
                              seed) if w is not None and x is not None \
                else np.zeros(len(seqs), np.int64)
            if pp > 1:
                yield from clock.run("pp", ctx.send(new if data or payloads else None, nxt_rank,
                                                    nbytes=8 * len(seqs)))
        if s == 0 and new is not None:
            for i, (q, f) in enumerate(zip(seqs, feed, strict=True)):
                if pos >= (len(f) - 1 if data else 0) and len(out[int(q)]) < max_tokens:
                    out[int(q)].append(int(new[i]))
        t_end = yield ctx.clock()
        clock.steps[-1]["step"] = t_end - t_step
    if tpg is not None:
        yield ctx.close_group(tpg)
    if epg is not None:
        yield ctx.close_group(epg)
    return {"tokens": out if s == 0 else {}, "steps": clock.steps,
            "stage": s, "replica": e, "tp_rank": r}


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


def _layer(ctx: Any, m: ModelConfig, w: TinyWeights | None, layer: int, x: Any,
           cache: KvCache, tp: int, ep: int, r: int, e: int, epg: Any, variant: str,
           clock: _Timer, compute: Any, tp_sum: Any, pad: Any, costs: dict[str, StepPart],
           nseq: int, seed: int, pos: int) -> Generator[Any, Any, Any]:
    """One layer on this rank; returns the new hidden rows (None timing-only)."""
    yield from compute(costs, "attention")
    part = attention_partial(w, layer, rms_norm(x), cache, tp, r) if w is not None else None
    part = yield from tp_sum(part, nseq * m.hidden)
    if w is not None:
        x = x + rescale(part, W_BITS)
    dense = not m.moe or layer < m.dense_layers
    if dense:  # dense FFN over tp (timing-only presets: deepseek-v3's first layers)
        yield from compute(costs, "ffn")
        yield from tp_sum(None, nseq * m.hidden)
        return x
    if m.shared_experts:
        yield from compute(costs, "shared")
    if w is not None:
        xn = rms_norm(x)
        ids, gates = route(w, layer, xn)
    else:  # uniform routing, the same on a replica's TP ranks
        rng = np.random.default_rng([seed, e, pos, layer])
        ids = np.argsort(rng.random((nseq, m.experts)), axis=1)[:, :m.top_k]
        gates = np.full(ids.shape, 1.0 / m.top_k)
    per = m.experts // ep
    if epg is not None:
        d = yield from clock.run("dispatch", ctx.moe_dispatch(
            xn.astype(np.float32) if w is not None else pad(nseq, m.hidden), ids,
            gates.astype(np.float32), m.experts, variant=variant, group=epg,
            hidden=m.hidden, dtype=m.dtype))
        rows_e = np.asarray(d.experts, np.int64)
        rows_x = np.asarray(d.x, np.float32).astype(np.int64) if w is not None else None
        rows_g = np.asarray(d.weights)
        order = np.lexsort((d.tok, d.src))  # one order on every TP rank
    else:
        d, rows_e, rows_g = None, ids, gates.astype(np.float32)
        rows_x = xn if w is not None else None
        order = np.arange(nseq)
    lo, hi = e * per, (e + 1) * per
    pair_row, pair_k = [], []
    for row in order:
        for k in range(m.top_k):
            if lo <= rows_e[row, k] < hi:
                pair_row.append(int(row))
                pair_k.append(k)
    prow, pk = np.array(pair_row, np.int64), np.array(pair_k, np.int64)
    # the experts' compute: the model's average, scaled to the pairs that came
    expected = nseq * m.top_k
    yield from compute(costs, "experts", len(prow) / expected if expected else 0.0)
    nrows = len(rows_e)
    if w is None:
        yield from tp_sum(None, len(prow) * m.hidden)
        partials = None
    else:
        assert rows_x is not None
        pexp = rows_e[prow, pk] if prow.size else prow
        P = np.zeros((len(prow), m.hidden), np.int64)
        for ex in np.unique(pexp):
            sel = np.flatnonzero(pexp == ex)
            P[sel] = expert_partial(w, layer, int(ex), rows_x[prow[sel]], tp, r)
        P = yield from tp_sum(P, P.size)
        contrib = weigh(rescale(P, W_BITS), rows_g[prow, pk].astype(np.int64)) \
            if prow.size else P
        partials = np.zeros((nrows, m.hidden), np.int64)
        np.add.at(partials, prow, contrib)
    if d is None:
        return x + partials if partials is not None else x
    if partials is not None and partials.size and \
            np.abs(partials).max() >= COMBINE_LIMIT // m.top_k:
        raise ValueError(f"{ctx.name}: an MoE partial left float32's exact integers; the "
                         "fixed-point range is too small")
    back = yield from clock.run("combine", ctx.moe_combine(
        d, partials.astype(np.float32) if partials is not None else pad(nrows, m.hidden),
        group=epg))
    if w is None:
        return None
    return x + np.asarray(back, np.float32).astype(np.int64)
