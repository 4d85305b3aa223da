"""The collective set and communicators on real processes (emulation): every
collective and path exact, on one switch and across a leaf/spine tree, under
loss, on groups; the endpoint's p2p calls."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.collective_programs import COLLECTIVES
from fabric.core.topology import leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from tests import fabric_tasks as tasks
from tests.test_collective_programs import CASES, check


@pytest.mark.parametrize("topo,faults", [(star(4), None), (leaf_spine(2, 1, hosts=0), None),
                                         (star(4), "loss=0.01")],
                         ids=["star4", "2x1", "star4-loss"])
def test_every_collective_exact_in_emulation(tmp_path, topo, faults) -> None:
    W = len(topo.workers)
    with launch(topology=topo, run_dir=tmp_path, timeout_s=30, faults=faults, seed=5) as fab:
        res = fab.run(run_in_emulation, tasks.collective_set_workload, CASES, 30_001, "float32")
        order = list(range(W))[::-1]
        grp = fab.run(run_in_emulation, tasks.collective_set_workload, CASES, 1001,
                      "bfloat16", order)
    check(res, CASES, W, 30_001, "float32")
    check(grp, CASES, W, 1001, "bfloat16", order)


def test_communicators_and_p2p_on_the_endpoint(tmp_path) -> None:
    with launch(workers=4, run_dir=tmp_path, timeout_s=30) as fab:
        assert fab.run(tasks.p2p_api, 70_001) == [True] * 4
        res = fab.run(tasks.comm_api, 777, 70)
    xs = [tasks.coll_input(r, 0, 777, "int32") for r in range(4)]
    ys = [tasks.coll_input(r, 1, 777 * 4, "int32") for r in range(4)]
    for r, out in enumerate(res):
        np.testing.assert_array_equal(out["tp"], xs[r - r % 2] + xs[r - r % 2 + 1])
        np.testing.assert_array_equal(out["ag"], np.concatenate(xs[::-1]))
        gr = 3 - r
        np.testing.assert_array_equal(out["rs"], sum(ys)[gr * 777:(gr + 1) * 777])
        assert out["rev_rank"] == gr and out["closed"]
        assert out["jobs"] == 0  # 72 communicators made and closed: nothing left behind


def test_multicast_crosses_each_link_once(tmp_path) -> None:
    """A broadcast on ina: the root's uplink carries the tensor once, not once per
    receiver as host-p2p does (counted by the switch)."""
    assert "broadcast" in COLLECTIVES
    with launch(workers=4, run_dir=tmp_path, timeout_s=30) as fab:
        stats = fab.run(_bcast_stats, 1 << 18)
    ina, p2p = stats[0]
    # 1 MiB in 64 KiB frames: each sent once, as one multicast frame, replicated to
    # the 3 receivers by the switch (a repair, if any, is unicast to one receiver)
    assert ina["mcast_frames"] == 16 and ina["mcast_copies"] == 48, ina
    assert p2p["mcast_frames"] == 0 and p2p["bytes_in"] >= 3 * (1 << 20), p2p


def _bcast_stats(ep, n: int):
    x = np.arange(n, dtype=np.float32)
    out = []
    for path in ("ina", "host-p2p"):
        ep.barrier()
        before = ep.switch_stats() if ep.rank == 0 else None
        ep.broadcast(x, path=path, root=0)
        ep.barrier()
        if ep.rank == 0:
            after = ep.switch_stats()
            out.append({k: after[k] - before[k] for k in ("mcast_frames", "mcast_copies",
                                                          "bytes_in")})
    return out
