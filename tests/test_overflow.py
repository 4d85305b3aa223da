"""Integer sums never wrap silently (issue 25, part 3): an allreduce whose sum
would wrap raises SumOverflowError on every rank, on the in-network frame plane,
the host-staged parameter server and the host ring, in both worlds; the call runs to its end
on every rank, and the next call on the same communicator is exact."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.topology import star
from fabric.emulation.launcher import launch
from fabric.errors import SumOverflowError
from fabric.sim import Simulation
from tests import fabric_tasks as tasks

N = 3001  # several chunks; one of them wraps
PATHS = ("ina", "host-ps", "host-ring")


def overflow_workload(ctx, path: str, dtype: str):
    """A call whose sum wraps at one element, then an ordinary one."""
    big = np.iinfo(dtype).max // 2 + 1  # three of these wrap
    x = tasks.coll_input(ctx.rank, 0, N, dtype)
    x[N // 2] = big
    caught = ""
    try:
        yield ctx.allreduce(x, path=path)
    except SumOverflowError as exc:
        caught = str(exc)
    y = tasks.coll_input(ctx.rank, 1, N, dtype)
    z = yield ctx.allreduce(y, path=path)
    return caught, np.array(z)


def _check(results, world: int, dtype: str) -> None:
    want = sum(tasks.coll_input(r, 1, N, dtype) for r in range(world))
    for r in range(world):
        caught, z = results[r]
        assert "would wrap" in caught, f"rank {r}: {caught!r}"
        np.testing.assert_array_equal(z, want)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("path", PATHS)
def test_every_rank_raises_and_the_next_call_is_exact_in_simulation(path, dtype) -> None:
    res = Simulation(star(3, hosts=1)).run(overflow_workload, path, dtype)
    _check(res.results, 3, dtype)


def overflow_task(ep, path: str, dtype: str):
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, overflow_workload, path, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_every_rank_raises_and_the_next_call_is_exact_in_emulation(tmp_path, path) -> None:
    with launch(topology=star(3, hosts=1), run_dir=tmp_path, timeout_s=30) as fab:
        res = fab.run(overflow_task, path, "int32")
    _check(res, 3, "int32")


def test_a_sum_that_cancels_is_not_an_overflow() -> None:
    from kernels.reference import first_wrap

    imax = np.iinfo(np.int32).max
    a = np.array([imax, -imax, 5, imax], np.int32)
    assert first_wrap(a, np.array([-1, -1, 9, 0], np.int32)) is None
    assert first_wrap(a, np.array([0, -2, 0, 1], np.int32)) == 1
    assert first_wrap(a.astype(np.float32), a.astype(np.float32)) is None
