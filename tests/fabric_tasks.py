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
    """A workload for both worlds (fabric.workload): allreduce seeded tensors on
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
