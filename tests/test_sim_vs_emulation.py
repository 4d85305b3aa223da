"""One workload, two worlds: the simulator gives the emulator's answers bitwise,
and on shaped links its virtual time follows the emulator's wall time."""

from __future__ import annotations

import pytest

from fabric.core.topology import leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from fabric.sim import Simulation
from tests import fabric_tasks as tasks


@pytest.mark.parametrize("topo", [star(4), leaf_spine(2, 1, hosts=0)], ids=["star4", "2x1"])
def test_simulated_results_equal_emulated_bitwise(tmp_path, topo) -> None:
    paths = ("ina", "host-ring", "host-ps") if topo.hosts else ("ina", "host-ring")
    count = 70_001
    with launch(topology=topo, run_dir=tmp_path, timeout_s=30) as fab:
        emu = fab.run(run_in_emulation, tasks.seeded_sum_workload, paths, count, "int32")
        emu_fixed = fab.run(run_in_emulation, tasks.fixed_sum_workload, ("ina", "host-ring"),
                            count)
    sim = Simulation(topo).run(tasks.seeded_sum_workload, paths, count, "int32").results
    sim_fixed = Simulation(topo).run(tasks.fixed_sum_workload, ("ina", "host-ring"),
                                     count).results
    for rank in range(len(topo.workers)):
        for path in paths:
            assert emu[rank][path].tobytes() == sim[rank][path].tobytes(), (path, rank)
        for path in ("ina", "host-ring"):
            assert emu_fixed[rank][path].tobytes() == sim_fixed[rank][path].tobytes()
    # fixed point: bitwise the same on every path too
    assert emu_fixed[0]["ina"].tobytes() == emu_fixed[0]["host-ring"].tobytes()


def test_simulated_time_follows_emulated_time_on_slow_links(tmp_path) -> None:
    """Links slow enough that the wire dominates: virtual time within 10% of wall time
    (3 emulated runs, their median)."""
    # slow enough that the wire dominates the emulator's per-hop processing even on
    # a loaded 2-core machine: 2 chunks of 256 KiB, ~210 ms each on the wire
    topo = star(4, bandwidth_gbps=0.01)
    count = 128 * 1024
    with launch(topology=topo, run_dir=tmp_path, timeout_s=60) as fab:
        emu = sorted(max(fab.run(run_in_emulation, tasks.timed_allreduce_workload, "ina",
                                 count)) for _ in range(3))[1]
    sim = max(Simulation(topo).run(tasks.timed_allreduce_workload, "ina", count).results)
    assert abs(sim - emu) / emu < 0.10, (sim, emu)


def test_streams_in_both_directions_at_once_exact_in_emulation(tmp_path) -> None:
    """Every pair of 4 workers streams both ways at the same moment, under 1% loss."""
    with launch(workers=4, run_dir=tmp_path, timeout_s=60, faults="loss=0.01",
                seed=3) as fab:
        assert fab.run(run_in_emulation, tasks.pairwise_stream_workload, 100_003) == [0] * 4


def test_simulated_stream_time_follows_emulated_time_on_a_slow_link(tmp_path) -> None:
    topo = star(2, bandwidth_gbps=0.02)
    nbytes = 1 << 20  # ~420 ms on the wire
    with launch(topology=topo, run_dir=tmp_path, timeout_s=60) as fab:
        emu = sorted(fab.run(run_in_emulation, tasks.timed_stream_workload, nbytes)[0]
                     for _ in range(3))[1]
    sim = Simulation(topo).run(tasks.timed_stream_workload, nbytes).results[0]
    assert abs(sim - emu) / emu < 0.10, (sim, emu)
