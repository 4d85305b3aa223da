"""A job for tests/test_torch_ops.py: every operation of the semfab backend, on
groups of every path, checked element by element against the result computed
locally from every rank's (seeded) inputs.

    semfab launch --workers 2 --run tests/torch_ops_job.py:main

Inputs are random non-zero small integers, so every sum is exact in any order
(and in bfloat16). Returns what went wrong per check (nothing when all passed)
and the switch's REDUCE frames per group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import fabric.torch
from fabric.torch import Options

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)


def inputs(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 7 * n + salt)
    return torch.randint(1, 9, (n,), generator=g).to(dtype)


def check(bad: dict[str, str], name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        bad[name] = f"got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}"


def ops_on(pg: Any, tag: str, bad: dict[str, str]) -> None:
    r, w = dist.get_rank(pg), dist.get_world_size(pg)
    every = range(w)
    for dt in DTYPES:
        n = 1001
        x = inputs(r, n, dt)
        dist.all_reduce(x, group=pg)
        check(bad, f"{tag} allreduce {dt}", x, sum(inputs(k, n, dt) for k in every))
        for op, fn in ((dist.ReduceOp.MAX, torch.maximum), (dist.ReduceOp.MIN, torch.minimum)):
            y = inputs(r, n, dt, 1)
            dist.all_reduce(y, op=op, group=pg)
            want = inputs(0, n, dt, 1)
            for k in range(1, w):
                want = fn(want, inputs(k, n, dt, 1))
            check(bad, f"{tag} allreduce {op} {dt}", y, want)
        out = torch.empty(w * n, dtype=dt)
        dist.all_gather_into_tensor(out, inputs(r, n, dt), group=pg)
        check(bad, f"{tag} all_gather_into_tensor {dt}", out,
              torch.cat([inputs(k, n, dt) for k in every]))
        rs = torch.empty(n, dtype=dt)
        dist.reduce_scatter_tensor(rs, inputs(r, w * n, dt), group=pg)
        check(bad, f"{tag} reduce_scatter_tensor {dt}", rs,
              sum(inputs(k, w * n, dt) for k in every)[r * n:(r + 1) * n])
    n = 37
    avg = inputs(r, n, torch.float32) * w  # a multiple of w: the mean is exact
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=pg)
    check(bad, f"{tag} allreduce AVG", avg, sum(inputs(k, n, torch.float32) for k in every))
    strided = torch.stack([inputs(r, n, torch.float32), torch.full((n,), -1.0)], dim=1)
    dist.all_reduce(strided[:, 0], group=pg)  # a view with stride 2: staged, copied back
    check(bad, f"{tag} allreduce of a strided view", strided, torch.stack(
        [sum(inputs(k, n, torch.float32) for k in every), torch.full((n,), -1.0)], dim=1))
    a, b = inputs(r, n, torch.float32), inputs(r, 5, torch.float32)
    dist.all_reduce_coalesced([a, b], group=pg)
    check(bad, f"{tag} allreduce_coalesced", torch.cat([a, b]), torch.cat(
        [sum(inputs(k, n, torch.float32) for k in every),
         sum(inputs(k, 5, torch.float32) for k in every)]))
    root = w - 1
    for dt in (torch.float32, torch.float64, torch.bool, torch.int8, torch.uint8):
        t = inputs(r, n, torch.int64).to(dt).reshape(1, n)
        dist.broadcast(t, src=dist.get_global_rank(pg, root), group=pg)
        check(bad, f"{tag} broadcast {dt}", t, inputs(root, n, torch.int64).to(dt).reshape(1, n))
        lst = [torch.empty(n, dtype=dt) for _ in every]
        dist.all_gather(lst, inputs(r, n, torch.int64).to(dt), group=pg)
        check(bad, f"{tag} all_gather {dt}", torch.stack(lst),
              torch.stack([inputs(k, n, torch.int64).to(dt) for k in every]))
    red = inputs(r, n, torch.float32)
    dist.reduce(red, dst=dist.get_global_rank(pg, root), group=pg)
    if r == root:
        check(bad, f"{tag} reduce", red, sum(inputs(k, n, torch.float32) for k in every))
    gl = [torch.empty(n) for _ in every] if r == root else None
    dist.gather(inputs(r, n, torch.float32), gl, dst=dist.get_global_rank(pg, root), group=pg)
    if gl is not None:
        check(bad, f"{tag} gather", torch.stack(gl),
              torch.stack([inputs(k, n, torch.float32) for k in every]))
    sc = torch.empty(n)
    parts = [inputs(root, n, torch.float32, k) for k in every] if r == root else None
    dist.scatter(sc, parts, src=dist.get_global_rank(pg, root), group=pg)
    check(bad, f"{tag} scatter", sc, inputs(root, n, torch.float32, r))
    rsl = torch.empty(n)
    dist.reduce_scatter(rsl, [inputs(r, n, torch.float32, k) for k in every], group=pg)
    check(bad, f"{tag} reduce_scatter list", rsl,
          sum(inputs(k, n, torch.float32, r) for k in every))
    # alltoall: rank k sends k + j + 1 rows of 3 to rank j (uneven)
    rows = [r + j + 1 for j in every]
    src = torch.cat([torch.full((c, 3), float(100 * r + j)) for j, c in enumerate(rows)])
    out = torch.empty(sum(k + r + 1 for k in every), 3)
    dist.all_to_all_single(out, src, [k + r + 1 for k in every], rows, group=pg)
    check(bad, f"{tag} all_to_all_single uneven", out,
          torch.cat([torch.full((k + r + 1, 3), float(100 * k + r)) for k in every]))
    lo = [torch.empty(4) for _ in every]
    dist.all_to_all(lo, [torch.full((4,), float(10 * r + j)) for j in every], group=pg)
    check(bad, f"{tag} all_to_all list", torch.stack(lo),
          torch.stack([torch.full((4,), float(10 * k + r)) for k in every]))
    # point to point: both sides isend first, then irecv (run together); a batch
    peer = dist.get_global_rank(pg, (r + 1) % w)
    back = dist.get_global_rank(pg, (r - 1) % w)
    got = torch.empty(n)
    works = [dist.isend(inputs(r, n, torch.float32), peer, group=pg),
             dist.irecv(got, back, group=pg)]
    for wk in works:
        wk.wait()
    check(bad, f"{tag} isend/irecv", got, inputs((r - 1) % w, n, torch.float32))
    got2 = torch.empty(n)
    for wk in dist.batch_isend_irecv([dist.P2POp(dist.isend, inputs(r, n, torch.float32, 3),
                                                 peer, pg),
                                      dist.P2POp(dist.irecv, got2, back, pg)]):
        wk.wait()
    check(bad, f"{tag} batch_isend_irecv", got2, inputs((r - 1) % w, n, torch.float32, 3))
    # async: the future resolves to the output tensors
    z = inputs(r, n, torch.float32)
    fut = dist.all_reduce(z, group=pg, async_op=True).get_future()
    check(bad, f"{tag} async future", fut.wait()[0], sum(inputs(k, n, torch.float32)
                                                          for k in every))
    dist.barrier(group=pg)


def reduce_frames() -> int:
    return int(fabric.torch.switch_stats()["reduce_frames"])


def main(ep: Any = None) -> dict[str, Any]:
    """Every operation on the world group (ina) and on a group per path; what went
    wrong, and the REDUCE frames the switch took in during each group's run."""
    fabric.torch.init(ep)
    bad: dict[str, str] = {}
    frames: dict[str, int] = {}
    try:
        groups = [("ina", dist.group.WORLD)] + [
            (tag, dist.new_group(backend="semfab", pg_options=opts)) for tag, opts in
            (("ina-mem", Options(path="ina-mem")), ("host-ring", Options(path="host-ring")),
             ("fixed", Options(numerics="fixed")))]
        # pairs of ranks (one group of both on 2 ranks): group ranks are not world ranks
        pair, _ = dist.new_subgroups(2, backend="semfab")
        groups.append(("pairs", pair))
        for tag, pg in groups:
            dist.barrier()
            before = reduce_frames()
            ops_on(pg, tag, bad)
            dist.barrier()
            frames[tag] = reduce_frames() - before
            if pg is not dist.group.WORLD:
                # releases the group's jobs at the switch: its slot memory is finite
                dist.destroy_process_group(pg)
        bad.update({f"fallback {i}": note for i, note in enumerate(fabric.torch.fallbacks())})
    except Exception as exc:  # a failure is a result to report, with its type
        bad["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        fabric.torch.shutdown()
    return {"wrong": bad, "reduce_frames": frames}
