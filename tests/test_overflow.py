"""Integer sums never wrap silently (issue 25, part 3): an allreduce whose sum
would wrap raises SumOverflowError on every rank, on the in-network frame plane,
the host-staged parameter server and the host ring, in both worlds; the call runs to its end
on every rank, and the next call on the same communicator is exact."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.topology import leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.errors import SumOverflowError
from fabric.sim import Simulation
from tests import fabric_tasks as tasks

N = 3001  # several chunks; one of them wraps
PATHS = ("ina", "ina-mem", "host-ps", "host-ring")


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


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_a_wrap_below_the_root_of_a_tree_in_simulation(dtype) -> None:
    """Two leaves of two: the sum wraps at a leaf (its two members' values), so the
    leaf's partial is not a sum; the root ends the chunk for every member, those
    of the other leaf included (they timed out before)."""
    res = Simulation(leaf_spine(2, 2)).run(tree_overflow_workload, dtype)
    _check_tree(res.results, dtype)


def test_a_wrap_below_the_root_of_a_tree_under_loss_in_simulation() -> None:
    for seed in range(3):
        res = Simulation(leaf_spine(2, 2), seed=seed, faults="loss=0.05").run(
            tree_overflow_workload, "int32")
        _check_tree(res.results, "int32")


def tree_overflow_workload(ctx, dtype: str):
    """Ranks 0 and 1 (one leaf) both hold big values at one element: their leaf
    sees the wrap; then an ordinary call."""
    big = np.iinfo(dtype).max // 2 + 1
    x = tasks.coll_input(ctx.rank, 0, N, dtype)
    if ctx.rank < 2:
        x[N // 3] = big
    caught = ""
    try:
        yield ctx.allreduce(x, path="ina")
    except SumOverflowError as exc:
        caught = str(exc)
    y = tasks.coll_input(ctx.rank, 1, N, dtype)
    return caught, np.array((yield ctx.allreduce(y, path="ina")))


def _check_tree(results, dtype: str) -> None:
    _check(results, 4, dtype)


def tree_overflow_task(ep, dtype: str):
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, tree_overflow_workload, dtype)


def test_a_wrap_below_the_root_of_a_tree_in_emulation(tmp_path) -> None:
    with launch(topology=leaf_spine(2, 2), run_dir=tmp_path, timeout_s=30) as fab:
        _check_tree(fab.run(tree_overflow_task, "int32"), "int32")
