"""Links with different MTUs (issue 25, part 5): every member derives one frame
size from the topology (the smallest MTU of the links a collective crosses, the
host's link too for host-ps), so members on links that differ still agree on
chunks. Exact in both worlds."""

from __future__ import annotations

import numpy as np

from fabric.core.programs import NodeState
from fabric.core.topology import Topology, star
from fabric.emulation.launcher import launch
from fabric.sim import Simulation
from tests import fabric_tasks as tasks

N = 100_001
PATHS = ("ina", "host-ps", "host-ring")


def mixed_mtu_star() -> Topology:
    d = star(3, hosts=1).to_dict()
    for lk, mtu in zip(d["link"], (8192, 65536, 16384, 4096), strict=True):
        lk["mtu"] = mtu  # w0, w1, w2, host0
    return Topology.from_dict(d)


def paths_workload(ctx, n: int):
    out = {}
    for p in PATHS:
        x = tasks.coll_input(ctx.rank, PATHS.index(p), n, "int32")
        out[p] = np.array((yield ctx.allreduce(x, path=p)))
    return out


def _check(results) -> None:
    for p in PATHS:
        want = sum(tasks.coll_input(r, PATHS.index(p), N, "int32") for r in range(3))
        for r in range(3):
            np.testing.assert_array_equal(results[r][p], want, err_msg=f"{p} rank {r}")


def test_every_member_agrees_on_one_frame_size() -> None:
    topo = mixed_mtu_star()
    states = [NodeState(topo, w.name) for w in topo.workers]
    assert {s.mtu for s in states} == {8192}  # the workers' smallest, not their own
    assert {s.host_mtu for s in states} == {4096}
    assert len({s.chunk_elems("ina", 4) for s in states}) == 1


def test_mixed_mtus_in_simulation() -> None:
    """Refused before: the members asked for jobs of different chunk sizes."""
    _check(Simulation(mixed_mtu_star()).run(paths_workload, N).results)


def paths_task(ep, n: int):
    from fabric.emulation.workloads import run_in_emulation

    return run_in_emulation(ep, paths_workload, n)


def test_mixed_mtus_in_emulation(tmp_path) -> None:
    with launch(topology=mixed_mtu_star(), run_dir=tmp_path, timeout_s=30) as fab:
        _check(fab.run(paths_task, N))
