"""Functions the end-to-end tests run on fabric workers (importable by module name)."""

from __future__ import annotations

import time

import numpy as np

from kernels.reference import count_wrong, expected_allreduce, make_tensor


def allreduce_check(ep, path: str, count: int, dtype: str, op: str, chunk_bytes: int,
                    steps: int = 2, in_place: bool = True) -> dict:
    """Allreduce fresh seeded tensors ``steps`` times; count wrong elements."""
    ep.chunk_bytes[path] = chunk_bytes
    x = ep.alloc(count, dtype)
    wrong = 0
    for step in range(steps):
        np.copyto(x, make_tensor(ep.rank, step, count, dtype, seed=11))
        original = x.copy()
        out = x if in_place else None
        y = ep.allreduce(x, op=op, path=path, out=out)
        wrong += count_wrong(y, expected_allreduce(ep.world, step, count, dtype, op, seed=11))
        if not in_place:
            wrong += int((x != original).sum())  # input must be left alone
    return {"wrong": wrong, "sem": ep.sem(path).per_chunk(), "fallbacks": list(ep.fallbacks)}


def fail_on_rank1(ep) -> int:
    if ep.rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    return ep.rank


def sleep_then_allreduce(ep, seconds: float) -> int:
    time.sleep(seconds)
    x = ep.alloc(1000, "float32")
    ep.allreduce(x, path="ina", out=x)
    return 0


def fixed_point_all_paths(ep, count: int) -> dict:
    """Fixed-point sums of random floats: bitwise equal on every path."""
    rng = np.random.default_rng(1000 + ep.rank)
    x = (rng.standard_normal(count) * (10.0 ** rng.integers(-3, 4, count))).astype(np.float32)
    results = {}
    for path in ("ina", "ina-mem", "host-ps", "host-ring"):
        results[path] = ep.allreduce(x, op="sum", path=path, numerics="fixed").tobytes()
    return results


def whoami(ep) -> tuple[str, int]:
    return ep.name, ep.node_id


def median_allreduce_s(ep, path: str, count: int, iters: int) -> float:
    """Median wall time of ``iters`` barrier-separated allreduces."""
    x = ep.alloc(count, "float32")
    x[:] = 1.0
    times = []
    for _ in range(iters):
        ep.barrier()
        t0 = time.perf_counter()
        ep.allreduce(x, path=path, out=x)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def lossy_allreduce(ep, path: str, count: int, steps: int) -> dict:
    """Exact results under injected faults; returns the retransmit counters too."""
    ep.chunk_bytes[path] = 4096
    out = allreduce_check(ep, path, count, "float32", "sum", 4096, steps)
    out.update(retransmits=ep.retransmits, duplicates=ep.duplicates, bad=ep.bad_frames)
    return out


def switch_stats(ep) -> dict:
    return ep.switch_stats()


def alloc_free_cycle(ep) -> tuple[int, int]:
    """Regions come and go; the switch forgets freed ones."""
    before = ep.switch_stats()["regions"]
    arrays = [ep.alloc(1000, "float32") for _ in range(3)]
    for a in arrays:
        a[:] = ep.rank + 1
    y = ep.allreduce(arrays[1], path="ina-mem", out=arrays[1])
    ok = int(y[0]) == sum(range(1, ep.world + 1))
    for a in arrays:
        ep.free(a)
    ep.barrier()
    return ok, ep.switch_stats()["regions"] - before


def seeded_sum_workload(ctx, paths, count: int, dtype: str, steps: int = 2):
    """A workload for both worlds (fabric.core.workload): allreduce seeded tensors on
    every path; returns each path's last result."""
    out = {}
    for path in paths:
        for step in range(steps):
            x = make_tensor(ctx.rank, step, count, dtype, seed=5)
            y = yield ctx.allreduce(x, path=path)
        yield ctx.barrier()
        out[path] = np.asarray(y)
    return out


def timed_allreduce_workload(ctx, path: str, count: int, dtype: str = "int32"):
    """One barrier-separated allreduce; returns its time in seconds."""
    x = make_tensor(ctx.rank, 0, count, dtype, seed=5)
    yield ctx.allreduce(x, path=path)  # warm-up: job registration, first wake-ups
    yield ctx.barrier()
    t0 = yield ctx.clock()
    yield ctx.allreduce(x, path=path)
    t1 = yield ctx.clock()
    return t1 - t0


def fixed_sum_workload(ctx, paths, count: int):
    """Fixed-point float32 sums (bitwise reproducible) on every path."""
    out = {}
    for path in paths:
        x = (np.sin(np.arange(count, dtype=np.float64) * (ctx.rank + 1)) * 3).astype(np.float32)
        out[path] = np.asarray((yield ctx.allreduce(x, path=path, numerics="fixed")))
    return out


def pairwise_stream_workload(ctx, nbytes: int, policy: str = "selective"):
    """Round k: every rank streams to and from rank ^ k at the same time (both
    directions of every pair of a power-of-two world); counts wrong bytes."""
    wrong = 0
    for k in range(1, ctx.world):
        peer = ctx.rank ^ k
        x = ((np.arange(nbytes) * 7 + ctx.rank * 31 + k) % 251).astype(np.uint8)
        out = np.zeros(nbytes, np.uint8)
        yield ctx.sendrecv(x, peer, out, peer, policy=policy)
        want = ((np.arange(nbytes) * 7 + peer * 31 + k) % 251).astype(np.uint8)
        wrong += int((out != want).sum())
    return wrong


def timed_stream_workload(ctx, nbytes: int):
    """Rank 0 streams ``nbytes`` to rank 1; returns the time at rank 0."""
    yield ctx.barrier()
    t0 = yield ctx.clock()
    if ctx.rank == 0:
        yield ctx.send(np.ones(nbytes, np.uint8), 1)
    elif ctx.rank == 1:
        yield ctx.recv(np.zeros(nbytes, np.uint8), 0)
    t1 = yield ctx.clock()
    return t1 - t0


def hostile_then_exact(ep, n: int, seed: int) -> dict:
    """Rank 0 sends ``n`` random and mutated frames (control, REDUCE, RESULT, host-ps
    messages; random bytes) to the switch and the host through its own port; then
    every path must still be exact on every rank."""
    import random

    from fabric.core import control
    from fabric.core import frame as fr

    if ep.rank == 0:
        rng = random.Random(seed)
        good = [
            fr.encode(fr.Op.CTRL, src=ep.node_id, dst=ep.switch_id,
                      payload=control.pack("job", job=rng.randrange(1 << 16), members=[0, 999],
                                           dtype="int32", op="sum", slots=1, slot_elems=4)),
            fr.encode(fr.Op.CTRL, src=ep.node_id, dst=ep.switch_id,
                      payload=control.pack("region", key=5, size=-3, path="/nonexistent")),
            fr.encode(fr.Op.CTRL, src=ep.node_id, dst=ep.switch_id,
                      payload=control.pack("unregister", key=rng.randrange(1 << 32))),
            fr.encode(fr.Op.REDUCE, src=ep.node_id, dst=ep.switch_id, job=1, psn=3,
                      payload=b"\x01" * 12),
            fr.encode(fr.Op.RESULT, src=ep.node_id, dst=ep.switch_id, job=1, psn=0,
                      payload=b"\x02" * 16),
            fr.encode(fr.Op.WRITE, src=ep.node_id, dst=ep.host_id, flow=2, psn=0,
                      payload=b"\x93\x01\x02"),
            fr.encode(fr.Op.WRITE, src=ep.node_id, dst=ep.host_id, flow=2, psn=0,
                      payload=b"\x85\xa3seq\x01\xa5chunk\x00\xa7members\x91\x00"
                              b"\xa2op\xa3sum\xa5dtype\xa5int32"),
        ]
        for i in range(n):
            blob = bytearray(rng.choice(good))
            for _ in range(rng.randrange(0, 4)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
            if i % 7 == 0:
                blob = bytearray(rng.randbytes(rng.randrange(0, 64)))
            ep.sock.send(bytes(blob))
    ep.barrier()
    wrong = {}
    for path in ("ina", "ina-mem", "host-ps", "host-ring"):
        x = ep.alloc(10_007, "int32")
        x[:] = (np.arange(10_007) % 1000) * (ep.rank + 1)
        ep.allreduce(x, path=path, out=x)
        want = (np.arange(10_007) % 1000) * sum(range(1, ep.world + 1))
        wrong[path] = int((x != want).sum())
    return {"wrong": wrong, "stash": len(ep.stash), "switch": ep.switch_stats()["malformed"]}


# ---------------------------------------------------------------------- the collective set
def coll_input(rank: int, tag: int, n: int, dtype: str, seed: int = 11) -> np.ndarray:
    """Fresh small integers (never zeros everywhere) in ``dtype``: sums of up to a
    hundred ranks stay exact in bfloat16, whatever the arrival order."""
    from kernels.dtypes import np_dtype

    rng = np.random.default_rng([seed, rank, tag, n])
    v = rng.integers(-2, 3, n)
    v[v == 0] = 1
    return v.astype(np.float64).astype(np_dtype(dtype))


def vcount(src: int, dst: int, m: int) -> int:
    """alltoallv: elements rank ``src`` sends rank ``dst`` (uneven, some zero)."""
    return 0 if (src + dst) % 3 == 0 and src != dst else (src * 3 + dst * 5) % 7 + m


def collective_set_workload(ctx, cases, m: int, dtype: str, group_ranks=None, seed: int = 11):
    """Every (kind, path) of ``cases`` on seeded inputs; returns {kind/path: output}.
    With ``group_ranks`` the collectives run on that communicator (then closed)."""
    g = None
    if group_ranks is not None:
        if ctx.rank not in group_ranks:
            return {}
        g = yield ctx.group(group_ranks)
    W = len(group_ranks) if group_ranks is not None else ctx.world
    r = group_ranks.index(ctx.rank) if group_ranks is not None else ctx.rank
    out = {}
    for tag, (kind, path) in enumerate(cases):
        size = {"all_gather": m, "broadcast": m, "reduce": m, "gather": m}.get(kind, W * m)
        x = coll_input(r, tag, size, dtype, seed)
        kw = {"path": path, "group": g}
        if kind in ("broadcast", "reduce", "gather", "scatter"):
            kw["root"] = (tag + 1) % W
        if kind == "alltoallv":
            sc = [vcount(r, k, m) for k in range(W)]
            rc = [vcount(k, r, m) for k in range(W)]
            x = coll_input(r, tag, sum(sc), dtype, seed)
            y = yield ctx.alltoallv(x, sc, np.empty(sum(rc), x.dtype), rc, **kw)
        else:
            y = yield ctx.collective(kind, x, **kw)
        out[f"{kind}/{path}"] = None if y is None else np.array(y)
    if g is not None:
        yield ctx.close_group(g)
    return out


def collective_reference(kind: str, r: int, W: int, tag: int, m: int, dtype: str,
                         seed: int = 11) -> np.ndarray | None:
    """What rank ``r`` of ``W`` must get from collective_set_workload's case ``tag``."""
    size = {"all_gather": m, "broadcast": m, "reduce": m, "gather": m}.get(kind, W * m)
    xs = [coll_input(k, tag, size, dtype, seed) for k in range(W)]
    root = (tag + 1) % W
    if kind == "all_gather":
        return np.concatenate(xs)
    if kind == "reduce_scatter":
        return np.sum(np.stack(xs).astype(np.float64), axis=0).astype(xs[0].dtype)[
            r * m:(r + 1) * m]
    if kind == "broadcast":
        return xs[root]
    if kind == "reduce":
        return (np.sum(np.stack(xs).astype(np.float64), axis=0).astype(xs[0].dtype)
                if r == root else None)
    if kind == "alltoall":
        return np.concatenate([xs[k][r * m:(r + 1) * m] for k in range(W)])
    if kind == "gather":
        return np.concatenate(xs) if r == root else None
    if kind == "scatter":
        return xs[root][r * m:(r + 1) * m]
    assert kind == "alltoallv"
    parts = []
    for k in range(W):
        sc = [vcount(k, j, m) for j in range(W)]
        xk = coll_input(k, tag, sum(sc), dtype, seed)
        lo = sum(sc[:r])
        parts.append(xk[lo: lo + sc[r]])
    return np.concatenate(parts)


def concurrent_groups_workload(ctx, m: int, rounds: int = 3):
    """Tensor-parallel pairs and expert-parallel fours active at once, closed and made
    again each round; returns the last results of both."""
    pair = [ctx.rank - ctx.rank % 2, ctx.rank - ctx.rank % 2 + 1]
    four = [ctx.rank - ctx.rank % 4 + k for k in range(4)]
    out = {}
    for rnd in range(rounds):
        tp = yield ctx.group(pair)
        ep = yield ctx.group(four)
        x = coll_input(ctx.rank, rnd, m, "int32")
        out["tp"] = yield ctx.allreduce(x, path="ina", group=tp)
        out["ep"] = yield ctx.allreduce(x, path="ina", group=ep)
        out["ag"] = yield ctx.all_gather(x, path="ina", group=ep)
        yield ctx.barrier(group=tp)
        yield ctx.close_group(tp)
        yield ctx.close_group(ep)
    return {k: np.array(v) for k, v in out.items()}


def group_churn_workload(ctx, cycles: int):
    """Make, use and close a communicator ``cycles`` times (more than the switch has
    group ids, and more jobs than fit its memory at once)."""
    total = 0
    for c in range(cycles):
        g = yield ctx.group(range(ctx.world))
        y = yield ctx.allreduce(np.full(8, c, np.int32), path="ina", group=g)
        total += int(y[0])
        yield ctx.close_group(g)
    return total


def p2p_api(ep, n: int) -> bool:
    """ep.send / ep.recv / ep.sendrecv between ranks (a ring and a pair)."""
    W, r = ep.world, ep.rank
    x = coll_input(r, 0, n, "float32")
    got = ep.sendrecv(x, (r + 1) % W, np.empty(n, np.float32), (r - 1) % W)
    ok = np.array_equal(got, coll_input((r - 1) % W, 0, n, "float32"))
    if r == 0:
        ep.send(x, 1)
    elif r == 1:
        ok &= np.array_equal(ep.recv(np.empty(n, np.float32), 0), coll_input(0, 0, n, "float32"))
    return bool(ok)


def comm_api(ep, m: int, cycles: int) -> dict:
    """Communicators on the endpoint: pairs and the world at once, then churn."""
    pair = ep.group([ep.rank - ep.rank % 2, ep.rank - ep.rank % 2 + 1])
    with ep.group(range(ep.world)[::-1]) as rev:
        x = coll_input(ep.rank, 0, m, "int32")
        tp = pair.allreduce(x, path="ina")
        ag = rev.all_gather(x, path="ina")
        rs = rev.reduce_scatter(coll_input(ep.rank, 1, m * ep.world, "int32"), path="ina")
        pair.barrier()
    pair.close()
    for _ in range(cycles):
        with ep.group(range(ep.world)) as g:
            g.allreduce(x, path="ina")
    stats = ep.switch_stats()
    return {"tp": tp, "ag": ag, "rs": rs, "rev_rank": rev.rank, "closed": rev.closed,
            "jobs": stats["engine"]["jobs"]}


# ---------------------------------------------------------------------- MoE
def moe_inputs(rank: int, T: int, H: int, K: int, E: int, dtype: str, seed: int = 7,
               skew: float = 0.0):
    """Seeded MoE inputs (fabric.core.moe.make_inputs): uniform, or Zipf-skewed routing."""
    from fabric.core.moe import make_inputs

    return make_inputs(rank, T, H, K, E, dtype, seed, f"zipf:{skew}" if skew else "uniform")


def moe_workload(ctx, variants, T: int, H: int, K: int, E: int, dtype: str = "float32",
                 skew: float = 0.0):
    """combine(dispatch(x)) with identity experts, per variant; returns outputs."""
    from fabric.core.moe import expert_partials

    x, idx, w = moe_inputs(ctx.rank, T, H, K, E, dtype, skew=skew)
    out = {}
    for v in variants:
        d = yield ctx.moe_dispatch(x, idx, w, E, variant=v)
        y = yield ctx.moe_combine(d, expert_partials(d, ctx.rank, ctx.world))
        out[v] = np.array(y)
        out[v + "/rows"] = int(d.src.shape[0])
    return out


def moe_timing_workload(ctx, variant: str, T: int, H: int, K: int, E: int,
                        dtype: str = "bfloat16", skew: float = 0.0, iters: int = 1):
    """Timing-only MoE (real routing, zero payloads): (dispatch s, combine s)."""
    _x, idx, w = moe_inputs(ctx.rank, T, 1, K, E, "float32", skew=skew)
    t = []
    for _ in range(iters):
        yield ctx.barrier()
        t0 = yield ctx.clock()
        d = yield ctx.moe_dispatch(None, idx, w, E, variant=variant, hidden=H, dtype=dtype)
        t1 = yield ctx.clock()
        yield ctx.moe_combine(d, None)
        t2 = yield ctx.clock()
        t.append((t1 - t0, t2 - t1))
    return t


def tenant_topology(per_tenant: int = 2, a_slots: int = 8):
    """A star of two tenants ("a": the first ``per_tenant`` workers, "b": the rest);
    tenant a may hold ``a_slots`` switch slots, b has no limit."""
    from fabric.core.topology import Topology, star

    d = star(2 * per_tenant).to_dict()
    for n in d["node"]:
        if n["kind"] == "worker":
            n["tenant"] = "a" if int(n["name"][1:]) < per_tenant else "b"
    d["tenants"] = {"a": {"slots": a_slots}}
    return Topology.from_dict(d)


def tenants_workload(ctx, per_tenant: int, n: int):
    """Each tenant on its own communicator: two in-network jobs (int32, float32), the
    second beyond tenant a's quota; returns both results."""
    mine = list(range(per_tenant)) if ctx.rank < per_tenant else \
        list(range(per_tenant, 2 * per_tenant))
    g = yield ctx.group(mine)
    x = coll_input(ctx.rank, 0, n, "int32")
    y = yield ctx.allreduce(x, path="ina", group=g)
    z = yield ctx.allreduce(x.astype(np.float32), path="ina", group=g)
    yield ctx.barrier(group=g)
    return {"int": np.array(y), "float": np.array(z)}


def tenants_task(ep, per_tenant: int, n: int) -> dict:
    """tenants_workload on an endpoint, with its fallbacks."""
    from fabric.emulation.workloads import run_in_emulation

    out = run_in_emulation(ep, tenants_workload, per_tenant, n)
    out["fallbacks"] = list(ep.fallbacks)
    return out


def in_place_workload(ctx, m: int):
    """NCCL's in-place forms: all_gather's input is its slice of the output,
    reduce_scatter's output its slice of the input, broadcast/reduce one buffer."""
    from fabric.core.collective_programs import COLLECTIVES

    W, r = ctx.world, ctx.rank
    out = {}
    for path in COLLECTIVES["all_gather"]:
        buf = np.zeros(W * m, np.int32)
        buf[r * m:(r + 1) * m] = coll_input(r, 0, m, "int32")
        y = yield ctx.all_gather(buf[r * m:(r + 1) * m], buf, path=path)
        out[f"all_gather/{path}"] = np.array(y)
    for path in COLLECTIVES["reduce_scatter"]:
        buf = coll_input(r, 1, W * m, "int32")
        y = yield ctx.reduce_scatter(buf, buf[r * m:(r + 1) * m], path=path)
        out[f"reduce_scatter/{path}"] = np.array(y)
    for path in COLLECTIVES["reduce"]:
        buf = coll_input(r, 2, m, "int32")
        y = yield ctx.reduce(buf, buf if r == 0 else None, path=path, root=0)
        out[f"reduce/{path}"] = None if y is None else np.array(y)
    return out


def placed_collectives(ep, count: int = 3001) -> dict:
    """Placed runs: int32 allreduce on every frame-plane path, all_gather and
    alltoall, exact; the switch's counters at that point (rank 0); then the
    memory plane (which falls back to ina when the switch is on another host)."""
    W, r = ep.world, ep.rank

    def inp(rank: int, tag: int, n: int) -> np.ndarray:
        return np.random.default_rng([tag, rank]).integers(-1000, 1000, n, dtype=np.int32)

    wrong = {}
    for tag, path in enumerate(("ina", "host-ps", "host-ring")):
        x = inp(r, tag, count)
        out = np.empty_like(x)
        ep.allreduce(x, path=path, out=out)
        wrong[path] = int((out != sum(inp(q, tag, count) for q in range(W))).sum())
    x = inp(r, 10, count)
    got = ep.all_gather(x, path="ina")
    wrong["all_gather"] = int((got != np.concatenate([inp(q, 10, count) for q in range(W)]))
                              .sum())
    k = 257
    x = inp(r, 11, W * k)
    got = ep.alltoall(x)
    want = np.concatenate([inp(q, 11, W * k)[r * k:(r + 1) * k] for q in range(W)])
    wrong["alltoall"] = int((got != want).sum())
    ep.barrier()  # every frame of the above is counted before rank 0 reads
    counters = None
    if r == 0:
        stats = ep.switch_stats()
        counters = {key: stats[key] for key in ("frames_in", "ctrl_frames", "bytes_in",
                                                "reduce_frames", "results_sent", "forwarded")}
    ep.barrier()
    m = ep.alloc(count, "int32")
    m[:] = inp(r, 12, count)
    ep.allreduce(m, path="ina-mem", out=m)
    wrong["ina-mem"] = int((m != sum(inp(q, 12, count) for q in range(W))).sum())
    return {"wrong": wrong, "fallbacks": list(ep.fallbacks), "retransmits": ep.retransmits,
            "counters": counters}


def placed_loop(ep, iters: int) -> int:
    """Placed runs: allreduces for a while (a link is cut meanwhile)."""
    x = np.arange(1024, dtype=np.int32)
    for _ in range(iters):
        ep.allreduce(x, path="ina", out=np.empty_like(x))
        time.sleep(0.02)
    return iters
