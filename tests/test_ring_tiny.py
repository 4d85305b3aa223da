"""host-ring allreduce of fewer elements than ranks (issue 25, part 5): some ring
steps carry no data; none of them may wait for an ACK that, lost, is never asked
for again. Many calls under loss and reordering, exact, in both worlds."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.topology import star
from fabric.emulation.launcher import launch
from fabric.sim import Simulation
from tests import fabric_tasks as tasks

CALLS = 60


def tiny_calls(ctx, n: int, calls: int):
    out = []
    for c in range(calls):
        x = tasks.coll_input(ctx.rank, c, n, "int32")
        out.append(np.array((yield ctx.allreduce(x, path="host-ring"))))
    return out


def _check(results, world: int, n: int, calls: int) -> None:
    for c in range(calls):
        want = sum(tasks.coll_input(k, c, n, "int32") for k in range(world))
        for r in range(world):
            np.testing.assert_array_equal(results[r][c], want, err_msg=f"rank {r} call {c}")


@pytest.mark.parametrize("faults", ["loss=0.01", "loss=0.05", "reorder=0.2:3", None])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_host_ring_in_simulation(n, faults) -> None:
    """Hung within 60 calls at 1% loss for every seed tried (an empty step's ACK lost)."""
    res = Simulation(star(4), seed=n, faults=faults, timeout_s=5).run(tiny_calls, n, CALLS)
    _check(res.results, 4, n, CALLS)


def tiny_task(ep, n: int, calls: int):
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, tiny_calls, n, calls)


def test_tiny_host_ring_in_emulation(tmp_path) -> None:
    with launch(workers=3, run_dir=tmp_path, timeout_s=20, faults="loss=0.05", seed=4) as fab:
        _check(fab.run(tiny_task, 2, 25), 3, 2, 25)
