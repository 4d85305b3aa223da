"""The simulator: the same core in virtual time, exact, deterministic, and
faithful to the emulator on shaped links."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.topology import leaf_spine, star
from fabric.errors import UsageError
from fabric.sim import Simulation, SimulationError
from kernels.reference import expected_allreduce
from tests import fabric_tasks as tasks

PATHS = ("ina", "ina-mem", "host-ring", "host-ps")


@pytest.mark.parametrize("topo", [star(4), star(8), leaf_spine(2, 4), leaf_spine(3, 3)],
                         ids=["star4", "star8", "2x4", "3x3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_every_path_is_exact(topo, dtype: str) -> None:
    count = 50_021  # odd: a short last chunk and uneven ring segments
    res = Simulation(topo).run(tasks.seeded_sum_workload, PATHS, count, dtype)
    want = expected_allreduce(len(topo.workers), 1, count, dtype, "sum", seed=5)
    for rank, out in enumerate(res.results):
        for path in PATHS:
            np.testing.assert_array_equal(out[path], want, err_msg=f"{path} rank {rank}")


def test_same_seed_same_run_and_loss_is_recovered_exactly() -> None:
    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=10.0)
    runs = [Simulation(topo, seed=3, faults="loss=0.05").run(
        tasks.seeded_sum_workload, ("ina",), 200_000, "int32") for _ in range(2)]
    assert runs[0].end_s == runs[1].end_s and runs[0].events == runs[1].events
    want = expected_allreduce(4, 1, 200_000, "int32", "sum", seed=5)
    for out in runs[0].results:
        np.testing.assert_array_equal(out["ina"], want)
    assert runs[0].retransmits > 0
    # timer expiries are counted apart from the resends they cause (and from
    # the resends a SACK threshold or a MISSING ask made without waiting)
    timeouts = sum(st.timeouts for st in runs[0].nodes.values())
    assert 0 <= timeouts <= runs[0].retransmits
    clean = Simulation(topo, seed=3).run(tasks.seeded_sum_workload, ("ina",), 200_000, "int32")
    assert sum(st.timeouts for st in clean.nodes.values()) == 0 == clean.retransmits
    lost = sum(sum(p.statistics().lost_by_op.values()) for p in Simulation(topo).pipes.values())
    assert lost == 0  # a fresh, fault-free simulation loses nothing


def test_a_workload_must_yield() -> None:
    def blocking(ctx):
        return ctx.rank

    with pytest.raises(UsageError, match="generator"):
        Simulation(star(2)).run(blocking)


def test_ranks_that_disagree_are_reported_not_hung() -> None:
    def odd(ctx):
        if ctx.rank == 0:
            yield ctx.barrier()
        return 0

    with pytest.raises(SimulationError, match="never finished|within"):
        Simulation(star(2), timeout_s=1.0).run(odd)


def test_switch_to_switch_links_are_shaped_once() -> None:
    """A leaf->spine frame occupies that link once: the spine's ingress is not re-shaped."""
    topo = leaf_spine(2, 1, leaf_bandwidth_gbps=1.0)
    sim = Simulation(topo)

    def one(ctx):
        yield ctx.allreduce(None, path="ina", count=65536, dtype="float32")
        return 0

    sim.run(one)
    up = sim.pipes[("leaf0", "spine0")].statistics()
    assert up.frames >= 1 and up.bytes > 65536 * 4
    assert ("spine0", "leaf0") in sim.pipes  # one pipeline per direction, no more
    assert len(sim.pipes) == 2 * len(topo.links)


def test_ring_over_ina_tends_to_the_textbook_ratio_on_shaped_links() -> None:
    res = {}
    topo = star(4, bandwidth_gbps=1.0)
    for path in ("ina", "host-ring"):
        res[path] = max(Simulation(topo).run(tasks.timed_allreduce_workload, path,
                                             1 << 20).results)
    ratio = res["host-ring"] / res["ina"]
    assert 1.3 < ratio < 2.0, ratio  # 2(n-1)/n = 1.5, plus the ring's per-step hops


def test_cut_through_ring_meets_the_bandwidth_bound() -> None:
    """With cut-through switches and no latency, ring / in-network time tends to
    2(n-1)/n on a non-blocking leaf/spine (the bandwidth-bound ratio)."""
    from fabric.sim import TimingModel
    from fabric.sim.cli import _scale_workload

    topo = leaf_spine(2, 8, leaf_bandwidth_gbps=100.0, hosts=0)
    t = {}
    for path in ("ina", "host-ring"):
        res = Simulation(topo, timing=TimingModel(cut_through_bytes=4096)).run(
            _scale_workload, path, 4 << 20)
        t[path] = max(res.results)
    n = 16
    assert abs(t["host-ring"] / t["ina"] / (2 * (n - 1) / n) - 1) < 0.05, t


@pytest.mark.parametrize("policy", ["selective", "gbn"])
def test_bidirectional_streams_between_every_pair_under_loss(policy: str) -> None:
    topo = star(4, bandwidth_gbps=10.0)
    res = Simulation(topo, seed=11, faults="loss=0.01").run(
        tasks.pairwise_stream_workload, 300_001, policy)
    assert res.results == [0, 0, 0, 0]
    assert res.retransmits > 0


def test_frames_of_a_later_step_that_came_early_are_not_lost() -> None:
    """w1's ring frames reach w0 while w0 still waits for its (slow) job reply: the
    refused ina-mem job falls back to host-ring, whose frames were stashed early."""
    from fabric.core.topology import loads
    from tests.test_fabric_e2e import TWO_LEAVES

    slow = TWO_LEAVES.replace('a = "w0"\nb = "leaf0"\nclass = "scaleup"',
                              'a = "w0"\nb = "leaf0"\nclass = "scaleup"\nlatency_us = 2000')
    topo = loads(slow)
    assert topo.link_between("w0", "leaf0").params.latency_us == 2000
    res = Simulation(topo).run(tasks.seeded_sum_workload, ("ina-mem",), 5003, "int32")
    want = expected_allreduce(2, 1, 5003, "int32", "sum", seed=5)
    for out in res.results:
        np.testing.assert_array_equal(out["ina-mem"], want)
    assert all("one switch" in f for st in res.nodes.values() for f in st.fallbacks)


@pytest.mark.parametrize("faults", ["loss=0.05", "loss=0.03,dup=0.05,reorder=0.1:3"])
def test_host_staged_paths_recover_from_loss_exactly(faults: str) -> None:
    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=10.0)
    res = Simulation(topo, seed=5, faults=faults).run(
        tasks.seeded_sum_workload, ("host-ring", "host-ps", "ina"), 150_001, "int32")
    want = expected_allreduce(4, 1, 150_001, "int32", "sum", seed=5)
    for out in res.results:
        for path in ("host-ring", "host-ps", "ina"):
            np.testing.assert_array_equal(out[path], want, err_msg=path)
    assert res.retransmits > 0


def test_the_switch_asks_only_the_member_that_lost_a_contribution() -> None:
    """A lost REDUCE is asked for by the switch (MISSING NACK) from its sender alone;
    retransmissions stay well below one per member per lost frame.

    The median over seeds: a lost RESULT of a call's last chunk can only be found by
    its member's timer, which keeps that member one RTO behind; the others' timers
    for the next call may then run out just before its contributions come and
    resend their window (a known cost, a few seeds in ten)."""
    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=10.0)
    ratios = []
    for seed in range(3, 8):
        sim = Simulation(topo, seed=seed, faults="loss=0.01")
        res = sim.run(tasks.seeded_sum_workload, ("ina",), 1 << 20, "int32", 2)
        lost = sum(p.statistics().lost_by_op.get(op, 0) for p in sim.pipes.values()
                   for op in ("REDUCE", "RESULT"))
        assert lost > 0
        assert sum(s.missing_asked for s in res.switch_stats.values()) > 0
        ratios.append(res.retransmits / lost)
    # four members: every one resending would be ~4
    assert sorted(ratios)[len(ratios) // 2] < 1.5, ratios


@pytest.mark.parametrize("seed", [7, 9, 11])
def test_tree_job_registration_and_aggregation_survive_loss(seed: int) -> None:
    """A leaf asks its parent again on every member retry: a lost upward job request
    (or its answer) once left the job waiting forever."""
    from fabric.core.topology import loads
    from tests.test_fabric_e2e import TWO_LEAVES

    res = Simulation(loads(TWO_LEAVES), seed=seed, faults="loss=0.03", timeout_s=5).run(
        tasks.seeded_sum_workload, ("ina",), 20_000, "int32", 3)
    want = expected_allreduce(2, 2, 20_000, "int32", "sum", seed=5)
    for out in res.results:
        np.testing.assert_array_equal(out["ina"], want)


@pytest.mark.parametrize("path", ["ina", "host-ps"])
def test_chunks_on_slow_links_are_not_resent_while_still_on_the_wire(path: str) -> None:
    """256 KiB chunks on 10 Mbit/s links spend ~0.2 s each on the wire, twice the
    initial RTO: the timers wait for that known wire time, so no copy is sent
    (each spurious copy would also take the link for another 0.2 s)."""
    topo = star(4, bandwidth_gbps=0.01)
    res = Simulation(topo).run(tasks.timed_allreduce_workload, path, 128 * 1024)
    assert res.retransmits == 0
    if path == "ina":  # chunk 0 up; chunk 1 up while result 0 comes down; result 1
        assert max(res.results) == pytest.approx(3 * 262_176 * 8 / 1e7, rel=0.02)


def _llr_work(ctx, count: int, path: str):
    x = (np.arange(count, dtype=np.int32) % 97) * (ctx.rank + 1)
    t0 = yield ctx.clock()
    for _ in range(3):
        y = yield ctx.allreduce(x, path=path)
    t1 = yield ctx.clock()
    want = (np.arange(count, dtype=np.int32) % 97) * sum(range(1, ctx.world + 1))
    return int(np.count_nonzero(y != want)), t1 - t0


@pytest.mark.parametrize("path", ["ina", "host-ring"])
def test_links_that_retry_hide_their_losses_from_the_protocol(path: str) -> None:
    """2 % loss on every link: end to end, the senders' timers recover (exact, slow);
    with link-level retry nothing reaches them, and a call costs a few link round
    trips more than on clean links."""
    runs = {}
    for loss, llr in ((0.0, False), (0.02, False), (0.02, True)):
        topo = star(4, bandwidth_gbps=100, latency_us=1, loss=loss, llr=llr, mtu=8192)
        res = Simulation(topo, seed=1).run(_llr_work, 1 << 16, path)
        assert [w for w, _t in res.results] == [0] * 4
        runs[(loss, llr)] = (max(t for _w, t in res.results), res.retransmits, res.llr_replays)
    clean, e2e, llr = runs[(0.0, False)], runs[(0.02, False)], runs[(0.02, True)]
    assert e2e[1] > 0 and e2e[2] == 0
    assert llr[1] == 0 and llr[2] > 5
    assert clean[0] < llr[0] < 1.5 * clean[0] < e2e[0]


def test_a_workload_that_is_no_generator_is_refused_in_one_line() -> None:
    """A plain function is refused before it runs; a callable without code to look at
    (as a compiled generator function is) when what it returns is no generator."""
    def plain(ctx):
        return 1

    class Opaque:
        def __call__(self, ctx):
            return 1

    for fn in (plain, Opaque()):
        with pytest.raises(UsageError, match="must be a generator function"):
            Simulation(star(2)).run(fn)
