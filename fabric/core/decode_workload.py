"""The runnable model's decode loop, sharded over the fabric: a workload (written
once, run on real processes or in simulation).

Ranks ``e * tp + r``: attention replica ``e`` (of ``ep``) and TP rank ``r``. Each
replica decodes every ``ep``-th sequence. Per layer:

1. attention: each TP rank computes its heads; the output projection's partial
   sums are summed by an int64 allreduce over the replica's TP group;
2. the router runs on every rank alike; MoE dispatch (``variant``: flat,
   hierarchical, in-network) sends each token to the ranks of its experts'
   group, among the ranks of the same TP rank (``r``) of every replica;
3. each expert group's TP ranks compute their slice of the expert FFN for the
   rows they received (the same rows on every TP rank of the group, put in one
   order by home and token), sum the slices by an int64 allreduce, weigh them by
   the gates, and combine returns the sums to the tokens' homes.

The arithmetic is :mod:`fabric.core.decoder`'s fixed point, so the tokens are
exactly :func:`fabric.core.decoder.generate_reference`'s, whatever the layout.
"""

from __future__ import annotations

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
from fabric.core.model import Layout, get_model
from fabric.errors import UsageError

__all__ = ["COMBINE_LIMIT", "sharded_decode"]

#: MoE rows travel as float32: integers below this sum exactly in any order.
COMBINE_LIMIT = 1 << 23


def sharded_decode(ctx: Any, preset: str, tp: int, ep: int, prompts: Sequence[Sequence[int]],
                   max_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                   weights_seed: int = 0, variant: str = "flat",
                   path: str = "ina") -> Generator[Any, Any, dict[int, list[int]]]:
    """Decode ``max_tokens`` new tokens of every prompt, sharded ``tp`` x ``ep`` over
    the world's ranks; returns {sequence: tokens} for this rank's replica."""
    m = get_model(preset)
    Layout(tp=tp, ep=ep).check(m)
    if ctx.world != tp * ep:
        raise UsageError(f"tp {tp} x ep {ep} needs {tp * ep} workers, the fabric has "
                         f"{ctx.world}")
    if len(prompts) < ep or not all(prompts):
        raise UsageError(f"need at least one non-empty prompt per replica ({ep}), "
                         f"got {len(prompts)}")
    w = TinyWeights(m, weights_seed)
    e, r = divmod(ctx.rank, tp)
    tpg = (yield ctx.group([e * tp + i for i in range(tp)])) if tp > 1 else None
    epg = (yield ctx.group([q * tp + r for q in range(ep)])) if ep > 1 else None
    seqs = np.arange(e, len(prompts), ep)
    feed = [list(prompts[s]) for s in seqs]
    out: dict[int, list[int]] = {int(s): [] for s in seqs}
    per = m.experts // ep
    cache = KvCache()
    steps = max(len(p) for p in prompts) + max_tokens - 1

    def tp_sum(part: np.ndarray) -> Generator[Any, Any, np.ndarray]:
        if tpg is None or not part.size:
            return part
        got = yield ctx.allreduce(np.ascontiguousarray(part.reshape(-1)), path=path, group=tpg)
        return np.asarray(got, np.int64).reshape(part.shape)

    for pos in range(steps):
        tok = np.array([f[pos] if pos < len(f) else out[int(s)][-1] if out[int(s)] else f[-1]
                        for s, f in zip(seqs, feed, strict=True)], np.int64)
        x = w.embed[tok % m.vocab]
        for layer in range(m.layers):
            part = yield from tp_sum(attention_partial(w, layer, rms_norm(x), cache, tp, r))
            x = x + rescale(part, W_BITS)
            xn = rms_norm(x)
            ids, gates = route(w, layer, xn)
            if epg is not None:
                d = yield ctx.moe_dispatch(xn.astype(np.float32), ids,
                                           gates.astype(np.float32), m.experts,
                                           variant=variant, group=epg)
                rows_x = np.asarray(d.x, np.float32).astype(np.int64)
                rows_e, rows_g = np.asarray(d.experts, np.int64), np.asarray(d.weights)
                order = np.lexsort((d.tok, d.src))  # one order on every TP rank
            else:
                d, rows_x, rows_e, rows_g = None, xn, ids, gates.astype(np.float32)
                order = np.arange(len(xn))
            lo, hi = e * per, (e + 1) * per
            pair_row, pair_k = [], []
            for row in order:
                for k in range(m.top_k):
                    if lo <= rows_e[row, k] < hi:
                        pair_row.append(int(row))
                        pair_k.append(k)
            prow, pk = np.array(pair_row, np.int64), np.array(pair_k, np.int64)
            pexp = rows_e[prow, pk] if prow.size else prow
            P = np.zeros((len(prow), m.hidden), np.int64)
            for ex in np.unique(pexp):
                sel = np.flatnonzero(pexp == ex)
                P[sel] = expert_partial(w, layer, int(ex), rows_x[prow[sel]], tp, r)
            P = yield from tp_sum(P)
            contrib = weigh(rescale(P, W_BITS), rows_g[prow, pk].astype(np.int64)) \
                if prow.size else P
            partials = np.zeros((len(rows_x), m.hidden), np.int64)
            np.add.at(partials, prow, contrib)
            if d is not None:
                if partials.size and np.abs(partials).max() >= COMBINE_LIMIT // m.top_k:
                    raise ValueError(f"{ctx.name}: an MoE partial left float32's exact "
                                     "integers; the fixed-point range is too small")
                back = yield ctx.moe_combine(d, partials.astype(np.float32), group=epg)
                x = x + np.asarray(back, np.float32).astype(np.int64)
            else:
                x = x + partials
        nxt = next_tokens(lm_logits(w, x), seqs, np.full(len(seqs), pos), temperature, seed)
        for i, (s, f) in enumerate(zip(seqs, feed, strict=True)):
            if pos >= len(f) - 1 and len(out[int(s)]) < max_tokens:
                out[int(s)].append(int(nxt[i]))
    if tpg is not None:
        yield ctx.close_group(tpg)
    if epg is not None:
        yield ctx.close_group(epg)
    return out
