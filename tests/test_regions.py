"""Memory-plane regions only over the owner's own memory (issue 25, part 2).

A region is named by its handle (run, the registering node, key), never by a
path: the switch maps only the file the fabric made for that node. Each kind
of foreign memory a worker might name is refused: another node's region (of
its own or another tenant), an ordinary file, a symbolic or hard link to
either, another run's region; in both worlds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fabric.core import control
from fabric.core.topology import star
from fabric.emulation.launcher import launch
from fabric.emulation.shm import SHM_DIR, SharedRegion, region_name
from fabric.sim import Simulation
from switchd.memplane import SharedMemoryPlane
from tests.test_switch_core import Net

RUN = f"r{os.getpid()}"


@pytest.fixture
def victim():
    """Node w0's region 0x51 of run RUN, holding data that must not change."""
    r = SharedRegion.create(region_name(RUN, "w0", 0x51), 64)
    r.array(np.int32, 16)[:] = np.arange(16)
    made = [r.path]
    yield r, made
    for p in made:
        p.unlink(missing_ok=True)
    r.close()


def test_only_the_registering_nodes_own_region_is_mapped(victim, tmp_path) -> None:
    region, made = victim
    plane = SharedMemoryPlane(run_id=RUN)
    plane.attach(0x51, "w0", RUN, 64)  # its owner: fine
    plane.detach(0x51)
    with pytest.raises(OSError):
        plane.attach(0x51, "w2", RUN, 64)  # w2 names w0's key: no such file of w2's
    # a link in w2's name to w0's region, or to an ordinary file, is refused
    plain = tmp_path / "ordinary"
    plain.write_bytes(b"x" * 64)
    for n, (kind, target) in enumerate((("symlink", region.path), ("symlink", plain),
                                        ("hardlink", region.path))):
        name = SHM_DIR / region_name(RUN, "w2", 0x60 + n)
        made.append(name)
        (os.symlink if kind == "symlink" else os.link)(target, name)
        with pytest.raises((OSError, ValueError)):
            plane.attach(0x60 + n, "w2", RUN, 64)
    # names that would leave the shared-memory folder or pose as another node's
    for run, owner in ((RUN, "../w0"), ("../../tmp", "w2"), ("x-w0", "51"), ("", "w2")):
        with pytest.raises(ValueError):
            plane.attach(9, owner, run, 64)
    with pytest.raises(ValueError, match="serves run"):  # another run's region
        plane.attach(0x51, "w0", "otherrun", 64)
    np.testing.assert_array_equal(region.array(np.int32, 16), np.arange(16))
    plane.close()


def test_a_region_request_with_a_path_is_refused() -> None:
    net = Net(star(2))
    net.ctrl("w1", "region", key=5, size=64, run="x", path="/dev/shm/semfab-x-w0-5")
    reply = control.parse(net.take("w1")[-1].payload)
    assert reply["t"] == "region_reply" and not reply["ok"] and "not a path" in reply["reason"]


def foreign_region_task(ep, victim_key: int):
    """w1 asks the switch to map w0's region by w0's key, and with a path."""
    if ep.rank != 1:
        return None
    by_key = ep.request("region", "region_reply", key=victim_key, size=64, run=ep.run_id,
                        match=lambda m: m.get("key") == victim_key)
    by_path = ep.request("region", "region_reply", key=victim_key + 1, size=64,
                         run=ep.run_id, path=f"/dev/shm/semfab-{ep.run_id}-w0-{victim_key:x}",
                         match=lambda m: m.get("key") == victim_key + 1)
    return by_key, by_path


def alloc_task(ep):
    x = ep.alloc(16, "int32")
    x[:] = np.arange(16) + 100 * ep.rank
    return [k for _, _, k, _ in ep.regions]


def test_foreign_regions_are_refused_in_emulation(tmp_path) -> None:
    with launch(workers=2, run_dir=tmp_path, timeout_s=20) as fab:
        keys = fab.run(alloc_task)
        by_key, by_path = fab.run(foreign_region_task, keys[0][0])[1]
        y = fab.run(_sum_task)
    assert not by_key["ok"] and not by_path["ok"] and "not a path" in by_path["reason"]
    for r in (0, 1):
        np.testing.assert_array_equal(y[r], 2 * np.arange(16) + 100)


def _sum_task(ep):
    x = np.arange(16, dtype=np.int32) + 100 * ep.rank
    return ep.allreduce(x, path="ina-mem")


def foreign_region_workload(ctx):
    """In simulation: w1 names region 1 (w0's, the first registered) as its own."""
    x = np.arange(16, dtype=np.int32) + 100 * ctx.rank
    y = yield ctx.allreduce(x, path="ina-mem")
    replies = []
    if ctx.rank == 1:
        for key in (1, 99):  # w0's key; a key no one holds
            replies.append((yield ctx.control("region", "region_reply", key=key, size=64,
                                              run="sim")))
    return np.array(y), replies


def test_foreign_regions_are_refused_in_simulation() -> None:
    res = Simulation(star(2)).run(foreign_region_workload)
    for r in (0, 1):
        np.testing.assert_array_equal(res.results[r][0], 2 * np.arange(16) + 100)
    theirs, unknown = res.results[1][1]
    assert not theirs["ok"] and "belongs to node" in theirs["reason"]
    assert not unknown["ok"] and "no simulated region 99 of w1" in unknown["reason"]


def test_region_names_stay_in_the_shared_memory_folder() -> None:
    assert Path(SHM_DIR / region_name("run1", "w0", 0xAB)).parent == SHM_DIR
    for bad in ("a/b", "..", ".hidden", "a-b", "a.b", ""):
        with pytest.raises(ValueError):
            region_name(bad, "w0", 1)


def test_a_tenant_holds_at_most_its_quota_of_regions() -> None:
    from fabric.core.topology import Topology
    from tests import fabric_tasks as tasks

    d = tasks.tenant_topology(2).to_dict()
    d["tenants"]["a"]["regions"] = 2
    topo = Topology.from_dict(d)
    assert Topology.from_dict(topo.to_dict()).tenants["a"].regions == 2
    registry: dict[str, np.ndarray] = {}
    from fabric.sim.engine import ArrayMemoryPlane
    from switchd.core import SwitchCore

    for owner, key in (("w0", 1), ("w1", 2), ("w0", 3), ("w2", 4)):
        registry[ArrayMemoryPlane.name("sim", owner, key)] = np.zeros(64, np.uint8)
    net = Net(topo)
    net.cores["sw0"] = SwitchCore(topo, "sw0", memory=ArrayMemoryPlane(registry))

    def ask(node: str, key: int) -> dict:
        net.ctrl(node, "region", key=key, size=64, run="sim")
        return control.parse(net.take(node)[-1].payload)

    assert ask("w0", 1)["ok"] and ask("w1", 2)["ok"]
    third = ask("w0", 3)
    assert not third["ok"] and "tenant 'a'" in third["reason"] and "quota of 2" in third["reason"]
    assert ask("w2", 4)["ok"]  # tenant b has no quota
    assert ask("w0", 1)["ok"]  # registering a held key again is not one more
    net.ctrl("w1", "unregister", key=2)
    net.take("w1")
    assert ask("w0", 3)["ok"]  # freed one: room again
    stats = net.cores["sw0"].statistics().services["regions"]
    assert stats.by_tenant == {"a": 2, "b": 1}
