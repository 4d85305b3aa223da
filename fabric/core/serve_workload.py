"""A sharded model serving requests, as a workload: the decode loop of
`semfab serve --model` with requests that arrive, join a running batch
(continuous batching) and leave, for `semfab bench tokens --sim`.

The layout's first rank, the leader, holds the requests. A fabric of ``dp``
times the layout's ranks runs ``dp`` such generators side by side (data
parallel), sharing its links: consecutive ranks form one, and the requests are
dealt to them in turn as host0 would (its least-loaded choice, with requests of
one size: in an open loop request ``i`` goes to generator ``i % dp``; in a
closed loop each client's requests go to one generator, client ``k`` to
``k % dp``). Before each step it
sends every other rank the step's plan over reliable streams, as the emulated
server does (:mod:`fabric.serving.sharded`): a header ``[joining, stop]`` and
a row ``[request, replica, prompt tokens, output tokens]`` per joining request.
Then every rank takes the step (:class:`fabric.core.decode_workload.DecodeShard`,
timing-only: real sizes, compute charged from the cost model). A joining
prompt is prefilled in its first step; a request leaves when it has its
output tokens.

Requests arrive on a schedule (``arrivals``: seconds from the start, an open
loop) or, with ``concurrency``, in a closed loop: that many at the start, and
each finished request's client sends the next ``think_s`` after its last
token reached it (``frontend_s`` each way between the leader and the client).

The leader returns, per request, when it arrived and when each of its tokens
was ready (the leader's clock at the end of the step that gave it), and per
step its parts (:data:`fabric.core.decode_workload.PARTS`, ``plan``) and how
many tokens it gave (``rows``; ``first``: first tokens of their requests).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from fabric.core.decode_workload import DecodeShard
from fabric.core.model import Layout, get_model
from fabric.core.workload import Together
from fabric.errors import UsageError

__all__ = ["PLAN_ROW", "deal", "served_decode"]

#: Ints per joining request in a plan: request, replica, prompt tokens, output tokens.
PLAN_ROW = 4
#: The post channel of a checkpoint (the tokens go on channel 0, beside it).
CHECKPOINT_CHANNEL = 1


def served_decode(ctx: Any, preset: str, tp: int, ep: int, prompt_len: Sequence[int],
                  output_len: Sequence[int], *, pp: int = 1,
                  arrivals: Sequence[float] | None = None, concurrency: int = 0,
                  max_batch: int = 64, gpu: str | None = "h100", variant: str = "flat",
                  path: str = "ina", layers: int | None = None, seed: int = 0,
                  frontend_s: float = 0.0, think_s: float = 0.0,
                  post_to: str | None = None, record_bytes: int = 32,
                  checkpoint_bytes: int = 0) -> Generator[Any, Any, dict[str, Any]]:
    """Serve ``len(prompt_len)`` requests (request ``i``: ``prompt_len[i]`` prompt
    tokens, ``output_len[i]`` new ones) on ``tp x ep x pp`` ranks, timing-only.

    ``arrivals`` (open loop) or ``concurrency`` (closed loop) schedule them;
    ``max_batch`` sequences per attention replica at most (the rest queue).
    ``layers`` runs that many of the model's layers on the fabric and charges
    each step the rest as their share of it (the per-layer parts scaled up), so
    queueing and arrivals follow the whole model's step times.
    ``post_to`` (a node: ``"host0"``): after each step the leader posts its
    tokens there, ``record_bytes`` each, as frames over the fabric's links
    (``ctx.post``: in the background, the next step starts at once); each token
    then names its post, whose arrival the simulation logs. ``checkpoint_bytes``:
    as decoding starts, every rank posts that many bytes there too (its shard of
    a checkpoint, sharing the links with the tokens).
    Returns, on the leader, ``{"requests": [{"arrival", "tokens": [times],
    "posts": [post numbers]}], "steps": [parts], "leader": its node, "start":
    the clock the times count from}`` (seconds of virtual time); on the others
    ``{}``.
    """
    import dataclasses

    m = get_model(preset)
    scale = 1.0  # the model's layers over those run
    if layers is not None:
        if not 1 <= layers <= m.layers:
            raise UsageError(f"layers={layers}: 1..{m.layers}")
        scale = m.layers / layers
        m = dataclasses.replace(m, layers=layers,
                                dense_layers=round(m.dense_layers * layers / m.layers))
    Layout(tp=tp, ep=ep, pp=pp).check(m)
    size = tp * ep * pp
    dp, extra = divmod(ctx.world, size)
    if extra or not dp:
        raise UsageError(f"tp {tp} x ep {ep} x pp {pp} needs {size} workers (or a multiple, "
                         f"for data parallel generators), the fabric has {ctx.world}")
    total = len(prompt_len)
    if total == 0 or len(output_len) != total or min(prompt_len) < 1 or min(output_len) < 1:
        raise UsageError("every request needs a prompt and output length >= 1")
    if (arrivals is None) == (concurrency < 1):
        raise UsageError("schedule the requests: arrivals (open loop) or concurrency >= 1 "
                         "(closed loop), one of the two")
    if arrivals is not None and len(arrivals) != total:
        raise UsageError(f"{len(arrivals)} arrival times for {total} requests")
    if max_batch < 1:
        raise UsageError("max_batch must be >= 1")
    base = ctx.rank - ctx.rank % size  # this generator's first world rank
    group = base // size
    ids, concurrency = deal(total, dp, group, concurrency if arrivals is None else 0)
    prompt_len = [prompt_len[i] for i in ids]
    output_len = [output_len[i] for i in ids]
    if arrivals is not None:
        arrivals = [arrivals[i] for i in ids]
    n = len(ids)
    shard = DecodeShard(ctx, m, tp, ep, pp, ctx.rank - base, base=base, data=False,
                        variant=variant, path=path, gpu=gpu, seed=seed)
    yield from shard.open()
    leader = ctx.rank == base
    hdr = np.zeros(2, np.int64)
    # every rank's copy of every replica's batch: [request, prompt left to feed, output left]
    running: list[list[list[int]]] = [[] for _ in range(ep)]
    context = np.asarray(prompt_len, np.int64).copy()  # tokens each request's cache holds
    start = yield ctx.clock()
    if checkpoint_bytes:
        if post_to is None:
            raise UsageError("a checkpoint goes to a node: give post_to")
        yield ctx.post(post_to, checkpoint_bytes, channel=CHECKPOINT_CHANNEL)
    arrive = np.full(n, np.inf)
    if arrivals is not None:
        arrive[:] = start + np.asarray(arrivals, np.float64)
    else:
        arrive[:min(concurrency, n)] = start
    tokens: list[list[float]] = [[] for _ in range(n)]
    posts: list[list[int]] = [[] for _ in range(n)]
    steps: list[dict[str, float]] = []
    nxt = 0  # the next request not yet admitted
    followers = list(range(base + 1, base + size))
    index = 0
    while True:
        t0 = yield ctx.clock()
        if leader:
            busy = any(running)
            if not busy and nxt < n and arrive[nxt] > t0:
                if not np.isfinite(arrive[nxt]):  # closed loop: nothing left to send it
                    raise RuntimeError("closed loop lost a request")
                yield ctx.compute(float(arrive[nxt] - t0))  # idle until it arrives
                t0 = yield ctx.clock()
            joins: list[int] = []
            sizes = [len(r) for r in running]
            while nxt < n and arrive[nxt] <= t0:
                q = int(np.argmin(sizes))
                if sizes[q] >= max_batch:
                    break
                joins += [nxt, q, int(prompt_len[nxt]), int(output_len[nxt])]
                sizes[q] += 1
                nxt += 1
            done = nxt >= n and not any(running) and not joins
            hdr[:] = (len(joins) // PLAN_ROW, int(done))
            body = np.array(joins, np.int64)
            if followers:
                yield Together(tuple(ctx.send(hdr, f) for f in followers))
                if len(joins):
                    yield Together(tuple(ctx.send(body, f) for f in followers))
        else:
            got = yield ctx.recv(hdr, base)
            hdr[:] = np.asarray(got, np.int64)  # (the simulator hands back its own copy)
            body = np.zeros(int(hdr[0]) * PLAN_ROW, np.int64)
            if hdr[0]:
                body = np.asarray((yield ctx.recv(body, base)), np.int64)
            done = bool(hdr[1])
        if done:
            break
        for i in range(0, len(body), PLAN_ROW):
            rid, q, plen, olen = (int(v) for v in body[i:i + PLAN_ROW])
            running[q].append([rid, plen, olen])
        t_plan = yield ctx.clock()
        mine = running[shard.e]
        counts = np.array([max(s[1], 1) for s in mine], np.int64)
        rids = [s[0] for s in mine]
        rows = sum(max(s[1], 1) for r in running for s in r)
        first = sum(1 for r in running for s in r if s[1] > 0)
        active = [s[0] for r in running for s in r]
        ctx_mean = int(context[active].mean()) if active else 0
        k = len(mine)
        yield from shard.step(counts, None, rids, np.zeros(k, np.int64), np.zeros(k, np.int64),
                              np.zeros(k), np.zeros(k, np.uint64), index=index, batch=rows,
                              context=ctx_mean, prefill=first > 0)
        t_end = yield ctx.clock()
        part = shard.clock.steps.pop()
        if scale != 1.0:  # the layers not run: their share of the step, charged now
            fixed = part.get("head", 0.0) + part.get("pp", 0.0)
            if leader:  # (the others wait for its next plan: were each to charge its own
                # share, its waits for the others would be scaled again, step after step)
                yield ctx.compute(max(t_end - t_plan - fixed, 0.0) * (scale - 1.0))
            for key in ("compute", "tp", "dispatch", "combine"):
                head = part.get("head", 0.0) if key == "compute" else 0.0
                if key in part:
                    part[key] = (part[key] - head) * scale + head
            t_end = yield ctx.clock()
        part["plan"] = t_plan - t0
        part["step"] = t_end - t0
        part["rows"] = float(len(active))
        part["first"] = float(first)
        part["t"] = t_end
        post = -1
        if leader:
            steps.append(part)
            if post_to is not None and active:  # the step's tokens, on their way to host0
                post = yield ctx.post(post_to, record_bytes * len(active))
        for r in running:
            for s in r:
                if leader:
                    tokens[s[0]].append(t_end)
                    posts[s[0]].append(post)
                s[1] = 0
                s[2] -= 1
                context[s[0]] += 1
            gone = [s[0] for s in r if s[2] <= 0]
            r[:] = [s for s in r if s[2] > 0]
            for rid in gone:
                if rid in rids:
                    shard.cache.drop(rid)
                if leader and arrivals is None:  # the client sends its next request
                    later = t_end + 2 * frontend_s + think_s
                    unsent = np.flatnonzero(np.isinf(arrive))
                    if unsent.size:
                        arrive[unsent[0]] = later
        index += 1
    yield from shard.close()
    if not leader:
        return {}
    return {"requests": [{"id": ids[i], "arrival": float(arrive[i] - start),
                          "tokens": [t - start for t in tokens[i]], "posts": posts[i]}
                         for i in range(n)],
            "steps": steps, "group": group, "leader": ctx.name, "start": start}


def deal(total: int, dp: int, group: int, concurrency: int = 0) -> tuple[list[int], int]:
    """The requests (indices of ``total``) generator ``group`` of ``dp`` serves, and
    its share of a closed loop's ``concurrency`` clients (0: an open loop, where
    request ``i`` goes to generator ``i % dp``). In a closed loop the requests
    are the clients' in turn (request ``i`` is client ``i % concurrency``'s) and
    client ``k`` sends to generator ``k % dp``."""
    if not concurrency:
        return list(range(group, total, dp)), 0
    clients = min(concurrency, total)
    mine = [i for i in range(total) if i % clients % dp == group]
    return mine, len(range(group, clients, dp))
