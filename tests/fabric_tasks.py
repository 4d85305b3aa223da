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


def hostile_then_exact(ep, n: int, seed: int) -> dict:
    """Rank 0 sends ``n`` random and mutated frames (control, REDUCE, RESULT, host-ps
    messages; random bytes) to the switch and the host through its own port; then
    every path must still be exact on every rank."""
    import random

    from fabric import control
    from fabric import frame as fr

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
