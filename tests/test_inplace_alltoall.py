"""In-place alltoall (issue 25, part 5): the output may be the input array; what
is still to be sent is staged first. Exact in both worlds, under loss too."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.topology import star
from fabric.emulation.launcher import launch
from fabric.sim import Simulation
from tests import fabric_tasks as tasks

M = 333  # elements per segment (odd)


def inplace_workload(ctx, m: int):
    x = tasks.coll_input(ctx.rank, 7, ctx.world * m, "float32")
    y = yield ctx.alltoall(x, out=x)  # in place
    return np.array(y)


def _check(results, world: int) -> None:
    ins = [tasks.coll_input(r, 7, world * M, "float32") for r in range(world)]
    for r in range(world):
        want = np.concatenate([ins[k][r * M:(r + 1) * M] for k in range(world)])
        np.testing.assert_array_equal(results[r], want, err_msg=f"rank {r}")


@pytest.mark.parametrize("faults", [None, "loss=0.05"])
def test_inplace_alltoall_in_simulation(faults) -> None:
    _check(Simulation(star(4), seed=1, faults=faults).run(inplace_workload, M).results, 4)


def inplace_task(ep, m: int):
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, inplace_workload, m)


def test_inplace_alltoall_in_emulation(tmp_path) -> None:
    with launch(workers=3, run_dir=tmp_path, timeout_s=30, faults="loss=0.05", seed=3) as fab:
        _check(fab.run(inplace_task, M), 3)
