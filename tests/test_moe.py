"""MoE dispatch and combine (fabric.core.moe): flat and hierarchical, exact in both
worlds against NumPy (identity experts), the hierarchical variant's saving of
cross-spine bytes counted by the switches, and bad routing refused."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.moe import MOE_VARIANTS, moe_reference
from fabric.core.topology import leaf_spine, star
from fabric.emulation.launcher import launch
from fabric.emulation.workloads import run_in_emulation
from fabric.errors import UsageError
from fabric.sim import Simulation, SimulationError
from tests import fabric_tasks as tasks


def _want(W: int, T: int, H: int, K: int, E: int, dtype: str, skew: float = 0.0):
    ins = [tasks.moe_inputs(r, T, H, K, E, dtype, skew=skew) for r in range(W)]
    return moe_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)


@pytest.mark.parametrize("topo", [star(4), leaf_spine(2, 2), leaf_spine(3, 3)],
                         ids=["star4", "2x2", "3x3"])
@pytest.mark.parametrize("dtype,skew", [("float32", 0.0), ("bfloat16", 0.0),
                                        ("float32", 1.2)], ids=["f32", "bf16", "zipf"])
def test_combine_of_dispatch_is_the_weighted_sum_in_simulation(topo, dtype, skew) -> None:
    W = len(topo.workers)
    T, H, K, E = 37, 33, 3 if dtype == "bfloat16" else 5, 2 * W
    res = Simulation(topo).run(tasks.moe_workload, MOE_VARIANTS, T, H, K, E, dtype, skew)
    want = _want(W, T, H, K, E, dtype, skew)
    for r in range(W):
        for v in MOE_VARIANTS:
            assert res.results[r][v].dtype == want[r].dtype
            np.testing.assert_array_equal(res.results[r][v], want[r], err_msg=f"{v} rank {r}")


def test_moe_exact_at_64_ranks() -> None:
    topo = leaf_spine(8, 8)
    T, H, K, E = 16, 8, 8, 128
    variants = ("flat", "hierarchical", "in-network")  # in-network: two mask blocks
    res = Simulation(topo).run(tasks.moe_workload, variants, T, H, K, E)
    want = _want(64, T, H, K, E, "float32")
    for r in range(64):
        for v in variants:
            np.testing.assert_array_equal(res.results[r][v], want[r])


@pytest.mark.parametrize("leaves,per", [(4, 8), (4, 9), (10, 10)])
def test_in_network_moe_exact_within_and_beyond_one_mask_block(leaves: int, per: int) -> None:
    """32 ranks fit one frame's mask; 36 and 100 take a frame per block of 32 that a
    token's targets fall in (the mask's ``offset``)."""
    W = leaves * per
    T, H, K, E = 16, 8, 8, 2 * W
    res = Simulation(leaf_spine(leaves, per)).run(tasks.moe_workload, ("in-network",), T, H,
                                                  K, E)
    want = _want(W, T, H, K, E, "float32")
    for r in range(W):
        np.testing.assert_array_equal(res.results[r]["in-network"], want[r])


def test_moe_exact_under_loss() -> None:
    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=10.0)
    res = Simulation(topo, seed=3, faults="loss=0.02").run(tasks.moe_workload, MOE_VARIANTS,
                                                           40, 64, 4, 8)
    want = _want(4, 40, 64, 4, 8, "float32")
    for r in range(4):
        for v in MOE_VARIANTS:
            np.testing.assert_array_equal(res.results[r][v], want[r])


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_moe_exact_under_corruption(seed) -> None:
    """The leaf's combine sums carry a CRC like every frame a switch originates:
    a damaged one is dropped and asked for again, never summed (seeds 0, 2 and 3
    returned wrong in-network sums when the leaf sent them unchecked)."""
    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=10.0)
    res = Simulation(topo, seed=seed, faults="corrupt=0.05", crc=True).run(
        tasks.moe_workload, MOE_VARIANTS, 40, 64, 4, 8)
    want = _want(4, 40, 64, 4, 8, "float32")
    for r in range(4):
        for v in MOE_VARIANTS:
            np.testing.assert_array_equal(res.results[r][v], want[r], err_msg=f"{v} {r}")


def test_moe_exact_under_corruption_in_emulation(tmp_path) -> None:
    topo = leaf_spine(2, 1, hosts=0)
    T, H, K, E = 29, 65, 3, 8
    with launch(topology=topo, run_dir=tmp_path, timeout_s=30, faults="corrupt=0.05",
                seed=5) as fab:
        res = fab.run(run_in_emulation, tasks.moe_workload, ("in-network",), T, H, K, E)
    want = _want(2, T, H, K, E, "float32")
    for r in range(2):
        np.testing.assert_array_equal(res[r]["in-network"], want[r])


def test_hierarchical_and_in_network_cross_the_spine_once_per_leaf() -> None:
    """Top-8 routing, 4 ranks per leaf: the spine carries at least 40% fewer bytes;
    in the network, dispatch needs no relay hop, so it is also faster."""
    topo = leaf_spine(2, 4, leaf_bandwidth_gbps=10.0)
    spine, took = {}, {}
    for v in MOE_VARIANTS:
        res = Simulation(topo).run(tasks.moe_timing_workload, v, 128, 1024, 8, 64)
        spine[v] = res.switch_stats["spine0"].bytes_in
        took[v] = max(t[0][0] + t[0][1] for t in res.results)
    assert spine["hierarchical"] <= 0.6 * spine["flat"], spine
    assert spine["in-network"] <= 0.6 * spine["flat"], spine
    assert took["in-network"] < took["hierarchical"], took


@pytest.mark.parametrize("topo", [star(4), leaf_spine(2, 1, hosts=0)], ids=["star4", "2x1"])
def test_moe_exact_in_emulation(tmp_path, topo) -> None:
    W = len(topo.workers)
    T, H, K, E = 29, 257, 3, 4 * W
    with launch(topology=topo, run_dir=tmp_path, timeout_s=30) as fab:
        res = fab.run(run_in_emulation, tasks.moe_workload, MOE_VARIANTS, T, H, K, E)
        direct = fab.run(_on_endpoint, T, H, K, E)
    want = _want(W, T, H, K, E, "float32")
    for r in range(W):
        for v in MOE_VARIANTS:
            np.testing.assert_array_equal(res[r][v], want[r])
        np.testing.assert_array_equal(direct[r], want[r])


def _on_endpoint(ep, T, H, K, E):
    from fabric.core.moe import expert_partials

    x, idx, w = tasks.moe_inputs(ep.rank, T, H, K, E, "float32")
    d = ep.moe_dispatch(x, idx, w, E, variant="hierarchical")
    return ep.moe_combine(d, expert_partials(d, ep.rank, ep.world))


def test_expert_ids_out_of_range_are_refused_naming_the_rank() -> None:
    def bad(ctx):
        idx = np.array([[0, 9]]) if ctx.rank == 1 else np.array([[0, 1]])
        yield ctx.moe_dispatch(np.ones((1, 4), np.float32), idx, np.ones((1, 2), np.float32), 4)

    with pytest.raises((UsageError, SimulationError), match="rank 1.*expert id 9"):
        Simulation(star(2), timeout_s=2.0).run(bad)
