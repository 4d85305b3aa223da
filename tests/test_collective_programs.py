"""The collective set and communicators (fabric.core.collective_programs), run by the
simulator: every collective and path exact against NumPy, under loss, at 64
ranks, on groups; bad input gets a typed error naming the rank."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.collective_programs import COLLECTIVES
from fabric.core.topology import leaf_spine, star
from fabric.errors import PeerFailed, UsageError
from fabric.sim import Simulation, SimulationError
from tests import fabric_tasks as tasks

CASES = [(k, p) for k, paths in COLLECTIVES.items() for p in paths]


def check(results, cases, W, m, dtype, order=None) -> None:
    order = order or list(range(W))
    for r, out in enumerate(results):
        if r not in order:
            continue
        gr = order.index(r)
        for tag, (kind, path) in enumerate(cases):
            want = tasks.collective_reference(kind, gr, W, tag, m, dtype)
            got = out[f"{kind}/{path}"]
            if want is None:
                assert got is None, (kind, path, r)
                continue
            assert got is not None and got.dtype == want.dtype, (kind, path, r)
            np.testing.assert_array_equal(got, want, err_msg=f"{kind} {path} rank {r}")


@pytest.mark.parametrize("topo", [star(4), leaf_spine(2, 2), leaf_spine(2, 3)],
                         ids=["star4", "2x2", "2x3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_every_collective_on_every_path_is_exact(topo, dtype: str) -> None:
    m = 3001  # odd: a short last frame, a chunk that does not divide
    res = Simulation(topo).run(tasks.collective_set_workload, CASES, m, dtype)
    check(res.results, CASES, len(topo.workers), m, dtype)


@pytest.mark.parametrize("faults", ["loss=0.02", "loss=0.01,reorder=0.05:3"])
def test_every_collective_is_exact_under_loss(faults: str) -> None:
    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=10.0)
    res = Simulation(topo, seed=4, faults=faults).run(tasks.collective_set_workload, CASES,
                                                      20_011, "float32")
    check(res.results, CASES, 4, 20_011, "float32")
    assert res.retransmits > 0


def test_every_collective_is_exact_at_64_ranks() -> None:
    topo = leaf_spine(8, 8)
    cases = [(k, COLLECTIVES[k][0]) for k in COLLECTIVES] + [("all_gather", "host-ring"),
                                                              ("reduce_scatter", "host-p2p")]
    res = Simulation(topo).run(tasks.collective_set_workload, cases, 257, "bfloat16")
    check(res.results, cases, 64, 257, "bfloat16")


def test_a_group_in_another_rank_order_is_exact() -> None:
    topo = leaf_spine(2, 3)
    order = [4, 0, 5, 2]  # a group across both leaves, not in world order
    res = Simulation(topo).run(tasks.collective_set_workload, CASES, 999, "int32", order)
    check(res.results, CASES, 4, 999, "int32", order)
    assert all(res.results[r] == {} for r in (1, 3))


def test_groups_active_at_once_are_exact_and_released() -> None:
    topo = leaf_spine(2, 4)
    sim = Simulation(topo)
    res = sim.run(tasks.concurrent_groups_workload, 501, 3)
    for r, out in enumerate(res.results):
        pair = [r - r % 2, r - r % 2 + 1]
        four = [r - r % 4 + k for k in range(4)]
        xs = {k: tasks.coll_input(k, 2, 501, "int32") for k in range(8)}
        np.testing.assert_array_equal(out["tp"], sum(xs[k] for k in pair))
        np.testing.assert_array_equal(out["ep"], sum(xs[k] for k in four))
        np.testing.assert_array_equal(out["ag"], np.concatenate([xs[k] for k in four]))
    for name, stats in res.switch_stats.items():
        assert stats.engine.jobs == 0, name  # every group's jobs were released


def test_making_and_closing_groups_never_exhausts_the_switch() -> None:
    cycles = 300  # more than the 255 group ids, and ~1.5 MiB of slots per job
    res = Simulation(star(2)).run(tasks.group_churn_workload, cycles)
    assert res.results == [2 * sum(range(cycles))] * 2


def _run(topo, fn, *args):
    return Simulation(topo, timeout_s=2.0).run(fn, *args)


def test_bad_input_gets_a_typed_error_naming_rank_and_operation() -> None:
    def outside(ctx):
        yield ctx.group([0, 7])

    with pytest.raises((UsageError, SimulationError), match="group ranks"):
        _run(star(2), outside)

    def not_multiple(ctx):
        yield ctx.reduce_scatter(np.ones(5, np.float32))

    with pytest.raises((UsageError, SimulationError), match="multiple of the group size"):
        _run(star(2), not_multiple)

    def bad_root(ctx):
        yield ctx.broadcast(np.ones(4, np.float32), root=3)

    with pytest.raises((UsageError, SimulationError), match="root 3"):
        _run(star(2), bad_root)

    def closed(ctx):
        g = yield ctx.group([0, 1])
        yield ctx.close_group(g)
        yield ctx.all_gather(np.ones(4, np.float32), group=g)

    with pytest.raises((UsageError, SimulationError), match="closed communicator"):
        _run(star(2), closed)


def test_alltoallv_sizes_that_disagree_fail_fast_naming_the_sender() -> None:
    def mismatched(ctx):
        sc = [3, 3] if ctx.rank == 0 else [5, 3]  # rank 0 expects 3 from rank 1, gets 5
        rc = [3, 3] if ctx.rank == 0 else [3, 3]
        x = np.ones(sum(sc), np.float32)
        yield ctx.alltoallv(x, sc, np.empty(sum(rc), np.float32), rc, path="host-p2p")

    with pytest.raises((PeerFailed, SimulationError), match="sizes disagree|refused"):
        _run(star(2), mismatched)


@pytest.mark.parametrize("topo", [star(4), leaf_spine(2, 2)], ids=["star4", "2x2"])
def test_in_place_forms_are_exact(topo) -> None:
    m, W = 2001, len(topo.workers)
    res = Simulation(topo).run(tasks.in_place_workload, m)
    ag = np.concatenate([tasks.coll_input(k, 0, m, "int32") for k in range(W)])
    rs = sum(tasks.coll_input(k, 1, W * m, "int32") for k in range(W))
    rd = sum(tasks.coll_input(k, 2, m, "int32") for k in range(W))
    for r, out in enumerate(res.results):
        for path in COLLECTIVES["all_gather"]:
            np.testing.assert_array_equal(out[f"all_gather/{path}"], ag, err_msg=path)
        for path in COLLECTIVES["reduce_scatter"]:
            np.testing.assert_array_equal(out[f"reduce_scatter/{path}"],
                                          rs[r * m:(r + 1) * m], err_msg=path)
        for path in COLLECTIVES["reduce"]:
            if r == 0:
                np.testing.assert_array_equal(out[f"reduce/{path}"], rd, err_msg=path)
