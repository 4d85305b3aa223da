"""Tenants share a switch safely: a per-tenant quota of slots and memory (from the
topology file) with the refused job falling back to a host path and reported,
statistics per tenant, and no tenant touching another's jobs or barriers."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import NackCode, Op
from fabric.core.topology import TopologyError, loads
from fabric.emulation.launcher import launch
from fabric.sim import Simulation
from tests import fabric_tasks as tasks
from tests.test_switch_core import Net, _group


def _check(results, per: int, n: int) -> None:
    for r, out in enumerate(results):
        mine = range(per) if r < per else range(per, 2 * per)
        want = sum(tasks.coll_input(k, 0, n, "int32") for k in mine)
        np.testing.assert_array_equal(out["int"], want)
        np.testing.assert_array_equal(out["float"], want.astype(np.float32))


def test_a_tenant_over_its_quota_falls_back_and_both_stay_exact() -> None:
    topo = tasks.tenant_topology(2, a_slots=8)  # room for one 8-slot job
    res = Simulation(topo).run(tasks.tenants_workload, 2, 30_001)
    _check(res.results, 2, 30_001)
    use = res.switch_stats["sw0"].tenants
    assert use["a"]["refused"] >= 1 and use["a"]["slots"] <= 8, use
    assert use["b"]["refused"] == 0 and use["b"]["jobs"] == 2, use
    falls = [f for name in ("w0", "w1") for f in res.nodes[name].fallbacks]
    assert falls and all("tenant 'a'" in f for f in falls), falls
    assert not res.nodes["w2"].fallbacks


def test_tenants_in_emulation(tmp_path) -> None:
    topo = tasks.tenant_topology(2, a_slots=8)
    with launch(topology=topo, run_dir=tmp_path, timeout_s=30) as fab:
        res = fab.run(tasks.tenants_task, 2, 20_011)
        stats = fab.switch_stats()["sw0"]["tenants"]
    _check(res, 2, 20_011)
    assert res[0]["fallbacks"] and not res[2]["fallbacks"]
    assert stats["a"]["refused"] >= 1 and stats["b"]["jobs"] == 2


def test_a_job_across_tenants_is_refused_and_a_barrier_counts_members_only() -> None:
    net = Net(tasks.tenant_topology(2))
    ids = [w.id for w in net.topo.workers]
    net.ctrl("w0", "job", job=5, members=[ids[0], ids[2]], dtype="int32", op="sum", slots=2,
             slot_elems=16)
    reply = control.parse(net.take("w0")[-1].payload)
    assert not reply["granted"] and "share one tenant" in reply["reason"]
    gid = _group(net, ["w0", "w1"])
    w2 = net.topo.node("w2")
    net.send("w2", fr.encode(Op.CTRL, src=w2.id, dst=net.topo.node("sw0").id,
                             payload=control.pack("barrier", id=gid << 32 | 1, n=2)))
    (nack,) = net.take("w2")
    assert nack.op is Op.NACK and nack.nack_code is NackCode.PERMISSION


def test_tenant_quotas_in_the_topology_file() -> None:
    topo = tasks.tenant_topology(2, a_slots=16)
    again = loads(topo.to_toml())
    assert again == topo and again.tenants["a"].slots == 16
    assert again.tenant_of("w3") == "b" and again.tenant_of("host0") == "default"
    bad = topo.to_toml().replace("slots = 16", "slots = -1")
    with pytest.raises(TopologyError, match="non-negative"):
        loads(bad)
    with pytest.raises(TopologyError, match="only workers"):
        loads(topo.to_toml().replace('kind = "host"', 'kind = "host"\ntenant = "a"'))
