"""End to end: real processes, real sockets, every allreduce path."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fabric.core.topology import star
from fabric.emulation.launcher import Fabric, TaskFailed, launch
from fabric.errors import FabricTimeout, PeerFailed
from tests import fabric_tasks as tasks

pytestmark = pytest.mark.timeout(180)

PATHS = ["ina", "ina-mem", "host-ps", "host-ring"]


def _all_exited(fab: Fabric) -> bool:
    return all(code is not None for code in fab.exit_codes().values())


@pytest.fixture(scope="module")
def fab2(tmp_path_factory: pytest.TempPathFactory):
    fab = launch(workers=2, run_dir=tmp_path_factory.mktemp("fab2"), timeout_s=20)
    try:
        yield fab
    finally:
        fab.close()
    assert _all_exited(fab)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("dtype", "op"), [("float32", "sum"), ("int32", "sum"),
                                           ("float32", "max"), ("int64", "min"),
                                           ("bfloat16", "sum"), ("float16", "min")])
def test_every_path_exact_with_ragged_sizes(fab2: Fabric, path: str, dtype: str, op: str) -> None:
    # 5003 elements in 1 KiB chunks: many chunks, a window that wraps, a short last chunk
    res = fab2.run(tasks.allreduce_check, path, 5003, dtype, op, 1024)
    assert [r["wrong"] for r in res] == [0, 0]
    assert all(not r["fallbacks"] for r in res)


@pytest.mark.parametrize("path", PATHS)
def test_out_of_place_leaves_input_alone(fab2: Fabric, path: str) -> None:
    res = fab2.run(tasks.allreduce_check, path, 3001, "float32", "sum", 4096, 1, False)
    assert [r["wrong"] for r in res] == [0, 0]


def test_semantic_distance_is_counted_per_path(fab2: Fabric) -> None:
    sem = {p: fab2.run(tasks.allreduce_check, p, 4096, "float32", "sum", 4096)[0]["sem"]
           for p in PATHS}
    assert sem["ina-mem"]["crossings"] == 0 and sem["ina-mem"]["encodes"] == 0
    assert sem["ina"]["encodes"] == 0 and sem["ina"]["hops"] == 1
    # a retransmitted chunk (a slow, loaded machine) counts its hops again
    assert sem["host-ps"]["encodes"] >= 2 and 2 <= sem["host-ps"]["hops"] < 2.1
    assert sem["host-ps"]["copies"] > sem["ina"]["copies"] > sem["ina-mem"]["copies"] - 1


def test_task_error_carries_remote_traceback(fab2: Fabric) -> None:
    with pytest.raises(TaskFailed, match="deliberate failure on rank 1") as info:
        fab2.run(tasks.fail_on_rank1)
    assert "fail_on_rank1" in info.value.tracebacks["w1"]
    # the fabric is still usable after a failed task
    assert fab2.run(tasks.allreduce_check, "ina", 10, "float32", "sum", 1024)[0]["wrong"] == 0


def test_three_workers_all_paths(tmp_path) -> None:
    with launch(workers=3, run_dir=tmp_path, timeout_s=20) as fab:
        for path in PATHS:
            res = fab.run(tasks.allreduce_check, path, 7777, "float32", "sum", 2048)
            assert [r["wrong"] for r in res] == [0, 0, 0], path
    assert _all_exited(fab)


def test_refused_job_falls_back_and_says_so(tmp_path) -> None:
    fab = Fabric(star(2), tmp_path, timeout_s=20, switch_args=["--memory-mb", "1"])
    with fab.start():
        # 8 slots x 2 versions x 256 KiB = 4 MiB > 1 MiB budget: refused
        res = fab.run(tasks.allreduce_check, "ina", 100_000, "float32", "sum", 256 * 1024)
    assert [r["wrong"] for r in res] == [0, 0]
    assert all("refused" in r["fallbacks"][0] for r in res)


def test_switch_death_fails_fast_naming_it(tmp_path) -> None:
    fab = launch(workers=2, run_dir=tmp_path, timeout_s=3)
    try:
        os.kill(fab.procs["sw0"].popen.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((PeerFailed, FabricTimeout), match="sw0"):
            fab.run(tasks.sleep_then_allreduce, 0.2)
        assert time.monotonic() - t0 < 15
    finally:
        fab.close()
    assert _all_exited(fab)


def test_start_timeout_names_who_is_missing(tmp_path) -> None:
    fab = Fabric(star(2), tmp_path, start_timeout_s=0.01)
    with pytest.raises((FabricTimeout, PeerFailed), match="w0|w1|sw0|host0"):
        fab.start()
    assert _all_exited(fab)


def test_fixed_point_is_bitwise_equal_across_paths_and_close_to_float(fab2: Fabric) -> None:
    import numpy as np

    res = fab2.run(tasks.fixed_point_all_paths, 40_000)
    first = res[0]["ina"]
    for r in res:
        assert all(v == first for v in r.values())  # every path, every rank: same bits
    rngs = [np.random.default_rng(1000 + k) for k in range(2)]
    xs = [(g.standard_normal(40_000) * (10.0 ** g.integers(-3, 4, 40_000))).astype(np.float32)
          for g in rngs]
    exact = xs[0].astype(np.float64) + xs[1]
    got = np.frombuffer(first, np.float32)
    # quantisation (half a step per contribution, steps ~ max/2^29) plus the
    # float32 rounding of the result: well under 2^-22 of the largest value
    assert np.max(np.abs(got - exact)) <= np.max(np.abs(exact)) * 2.0**-22


def test_submit_runs_on_hosts_too_and_waits_in_any_order(fab2: Fabric) -> None:
    t1 = fab2.submit(tasks.whoami, nodes=["host0"])
    t2 = fab2.submit(tasks.whoami)
    assert fab2.wait(t2) == [("w0", 0), ("w1", 1)]
    assert fab2.wait(t1) == [("host0", 2)]


def test_shaped_links_reproduce_the_ring_penalty(tmp_path) -> None:
    """DESIGN.md §9 fidelity: on slow links a ring moves 2(n-1)/n of the tensor
    each way, in-network reduction moves it once: ring/ina tends to 4/3 at n=3."""
    topo = star(3, bandwidth_gbps=0.1, mtu=16 * 1024)  # small frames: little store-and-forward
    with launch(topology=topo, run_dir=tmp_path, timeout_s=30) as fab:
        ina = max(fab.run(tasks.median_allreduce_s, "ina", 1 << 18, 3))
        ring = max(fab.run(tasks.median_allreduce_s, "host-ring", 1 << 18, 3))
    wire = (1 << 20) * 8 / 0.1e9  # one tensor over one link: 84 ms
    assert ina >= wire  # the shaper really holds frames back
    assert 1.1 < ring / ina < 1.6


@pytest.mark.parametrize("faults", ["loss=0.05", "loss=0.02,dup=0.05,reorder=0.1:3,corrupt=0.02"])
def test_in_network_paths_exact_under_injected_faults(tmp_path, faults: str) -> None:
    with launch(workers=2, run_dir=tmp_path, timeout_s=20, faults=faults, seed=7) as fab:
        for path in ("ina", "ina-mem"):
            res = fab.run(tasks.lossy_allreduce, path, 20_000, 3)
            assert [r["wrong"] for r in res] == [0, 0], (path, res)
            assert sum(r["retransmits"] for r in res) > 0  # the faults really bit
        stats = fab.run(tasks.switch_stats)[0]
    assert stats["faults"]["in"]["lost"] + stats["faults"]["out"]["lost"] > 0
    assert stats["engine"]["duplicates"] + stats["engine"]["resends"] > 0


def test_links_that_retry_replay_every_loss_and_stay_exact(tmp_path) -> None:
    """The same link pipeline in the switch daemon: 5 % loss on links with
    link-level retry, every lost frame replayed by its link (the protocol's own
    timers may still fire while a rank waits for its peer's turn on the cores)."""
    topo = star(2, loss=0.05, llr=True)
    with launch(topology=topo, run_dir=tmp_path, timeout_s=20, seed=7) as fab:
        for path in ("ina", "ina-mem", "host-ring"):
            res = fab.run(tasks.lossy_allreduce, path, 20_000, 3)
            assert [r["wrong"] for r in res] == [0, 0], (path, res)
        stats = fab.run(tasks.switch_stats)[0]
    lost = stats["faults"]["in"]["lost"] + stats["faults"]["out"]["lost"]
    assert stats["llr_replays"] == lost > 0


TWO_LEAVES = """
[[node]]
name = "w0"
kind = "worker"
[[node]]
name = "w1"
kind = "worker"
[[node]]
name = "leaf0"
kind = "switch"
[[node]]
name = "leaf1"
kind = "switch"
[[node]]
name = "spine"
kind = "switch"
[[link]]
a = "w0"
b = "leaf0"
class = "scaleup"
[[link]]
a = "w1"
b = "leaf1"
class = "scaleup"
[[link]]
a = "leaf0"
b = "spine"
class = "scaleout"
[[link]]
a = "leaf1"
b = "spine"
class = "scaleout"
"""


def test_leaf_spine_fabric_forwards_and_aggregates_in_a_tree(tmp_path) -> None:
    """Two leaves and a spine (5 processes): forwarding across three switches, a
    fabric-wide barrier at the root, in-network allreduce through the tree (each
    leaf sends its partial up, the spine's result comes back down), and a
    memory-plane job spanning switches refused and run on the host ring instead,
    with the fallback reported."""
    from fabric.core.topology import loads

    with launch(topology=loads(TWO_LEAVES), run_dir=tmp_path, timeout_s=20) as fab:
        ring = fab.run(tasks.allreduce_check, "host-ring", 5003, "float32", "sum", 1024)
        assert [r["wrong"] for r in ring] == [0, 0]
        assert ring[0]["sem"]["hops"] > 2  # w0 -> leaf0 -> spine -> leaf1 -> w1
        for dtype, op in (("float32", "sum"), ("int32", "sum"), ("float32", "max")):
            ina = fab.run(tasks.allreduce_check, "ina", 5003, dtype, op, 1024)
            assert [r["wrong"] for r in ina] == [0, 0], (dtype, op)
            assert all(not r["fallbacks"] for r in ina)
        mem = fab.run(tasks.allreduce_check, "ina-mem", 3001, "float32", "sum", 1024)
        assert [r["wrong"] for r in mem] == [0, 0]
        assert all("one switch" in r["fallbacks"][0] and "host-ring" in r["fallbacks"][0]
                   for r in mem)


@pytest.mark.parametrize("faults", ["loss=0.03", "loss=0.02,dup=0.02,corrupt=0.02"])
def test_tree_aggregation_exact_under_faults(tmp_path, faults: str) -> None:
    from fabric.core.topology import loads

    with launch(topology=loads(TWO_LEAVES), run_dir=tmp_path, timeout_s=20,
                faults=faults, seed=3) as fab:
        res = fab.run(tasks.lossy_allreduce, "ina", 20_000, 3)
        assert [r["wrong"] for r in res] == [0, 0]
        assert sum(r["retransmits"] for r in res) > 0


@pytest.mark.parametrize("faults", ["loss=0.1", "loss=0.03,dup=0.03,reorder=0.05:2,corrupt=0.01"])
def test_every_path_recovers_from_faults(tmp_path, faults: str) -> None:
    """Host-staged paths too: host-ps resends a chunk whose reply is late (the host
    answers again from its kept replies), host-ring resends a step its right
    neighbour did not acknowledge."""
    with launch(workers=2, run_dir=tmp_path, timeout_s=30, faults=faults, seed=7) as fab:
        for path in ("ina", "ina-mem", "host-ps", "host-ring"):
            res = fab.run(tasks.allreduce_check, path, 40_003, "float32", "sum", 16384)
            assert [r["wrong"] for r in res] == [0, 0], (path, faults)


def test_a_live_fabric_survives_hostile_frames_and_stays_exact(tmp_path) -> None:
    """Random and mutated frames into a running switch, host and worker (through a
    worker's own port): nothing crashes, and every path is exact afterwards."""
    with launch(workers=2, run_dir=tmp_path, timeout_s=60) as fab:
        res = fab.run(tasks.hostile_then_exact, 20_000, 1, timeout_s=240)
        assert all(set(r["wrong"].values()) == {0} for r in res), res
        assert res[0]["switch"] > 0  # the switch counted what it refused
        assert all(p.popen.poll() is None for p in fab.procs.values())


@pytest.mark.timeout(240)
def test_pfc_pauses_travel_between_switch_daemons(tmp_path) -> None:
    """Three senders into one receiver on two leaves behind lossless buffers: the
    receiver's leaf pauses the spine's link to it by a PAUSE to the spine's daemon,
    and nothing is dropped; every byte exact."""
    import dataclasses

    from bench.incast import incast_work
    from fabric.core.topology import leaf_spine
    from fabric.emulation.workloads import run_in_emulation

    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=0.2, leaf_latency_us=20, spine_latency_us=20,
                      mtu=8192, hosts=0)
    topo = topo.with_congestion(dataclasses.replace(topo.congestion, buffer_bytes=60_000,
                                                    pfc=True))
    with launch(topology=topo, run_dir=tmp_path, timeout_s=60, seed=3) as fab:
        per = fab.run(run_in_emulation, incast_work, 3, 300_000, 1, 1)
        stats = fab.switch_stats()
    assert per[3][0]["wrong"] == 0
    drops = sum(q["overflow_drops"] for sw in stats.values() if isinstance(sw, dict)
                for q in (sw.get("queues") or {}).values())
    assert drops == 0
    pfc = {name: sw["pfc"] for name, sw in stats.items() if isinstance(sw, dict) and "pfc" in sw}
    assert sum(p["pauses_sent_to_switches"] for p in pfc.values()) > 0
    assert sum(p["switch_link_pauses"] for p in pfc.values()) > 0


@pytest.mark.timeout(240)
def test_credit_returns_travel_between_switch_daemons(tmp_path) -> None:
    """Three senders into one receiver on two leaves over credit-controlled links:
    each switch daemon returns the credit of what it forwarded to the neighbour
    that sent it, by message; senders wait for credit, nothing is dropped or lost,
    every byte exact."""
    import dataclasses

    from bench.incast import incast_work
    from fabric.core.topology import leaf_spine
    from fabric.emulation.workloads import run_in_emulation

    topo = leaf_spine(2, 2, leaf_bandwidth_gbps=0.2, leaf_latency_us=20, spine_latency_us=20,
                      mtu=8192, hosts=0)
    topo = topo.with_congestion(dataclasses.replace(topo.congestion, credit=True))
    with launch(topology=topo, run_dir=tmp_path, timeout_s=60, seed=3) as fab:
        per = fab.run(run_in_emulation, incast_work, 3, 300_000, 1, 1)
        stats = fab.switch_stats()
    assert per[3][0]["wrong"] == 0
    credit = {name: sw["credit"] for name, sw in stats.items()
              if isinstance(sw, dict) and "credit" in sw}
    assert set(credit) == {"spine0", "leaf0", "leaf1"}
    assert all(c["returns_sent_to_switches"] > 0 for c in credit.values())
    assert sum(c["stalls"] for c in credit.values()) > 0
    assert sum(c["returns_refused"] for c in credit.values()) == 0
    assert all(sw["held_frames"] == 0 for sw in stats.values() if isinstance(sw, dict))


def test_in_network_paths_exact_under_a_congestion_policy(tmp_path) -> None:
    """[congestion] cc on the in-network paths of launched processes: chunks wait
    for the policy's window and pacer, results that come marked cut it (ECN from
    the first queued byte here), every element exact."""
    import dataclasses

    topo = star(2, bandwidth_gbps=0.5, latency_us=50, mtu=8192)
    topo = topo.with_congestion(dataclasses.replace(
        topo.congestion, buffer_bytes=200_000, cc="nscc", ecn_kmin_bytes=0,
        ecn_kmax_bytes=20_000))
    with launch(topology=topo, run_dir=tmp_path, timeout_s=30, seed=5) as fab:
        for path in ("ina", "ina-mem", "host-ring"):  # (the ring: frame ACKs clock it)
            res = fab.run(tasks.lossy_allreduce, path, 60_000, 3)
            assert [r["wrong"] for r in res] == [0, 0], (path, res)
        stats = fab.run(tasks.switch_stats)[0]
    # the results queue behind each other at the switch's ports: marked
    assert sum(q["ecn_marks"] for q in stats["queues"].values()) > 0


def test_in_network_moe_exact_behind_trimming_switch_daemons(tmp_path) -> None:
    """In-network MoE on launched processes behind small trimming buffers: rows
    and the leaves' sums cut on the way are asked for at once (the homes NACK a
    trimmed sum to the leaf that kept it); nothing dropped, every element exact."""
    import dataclasses

    import numpy as np

    from fabric.core.moe import moe_reference
    from fabric.core.topology import leaf_spine
    from fabric.emulation.workloads import run_in_emulation

    topo = leaf_spine(2, 1, leaf_bandwidth_gbps=0.2, leaf_latency_us=20, spine_latency_us=20,
                      mtu=4096, hosts=0)
    topo = topo.with_congestion(dataclasses.replace(topo.congestion, buffer_bytes=9_000,
                                                    trim=True))
    T, H, K, E = 61, 257, 3, 8
    with launch(topology=topo, run_dir=tmp_path, timeout_s=60, seed=3) as fab:
        res = fab.run(run_in_emulation, tasks.moe_workload, ("in-network",), T, H, K, E)
        stats = fab.switch_stats()
    ins = [tasks.moe_inputs(r, T, H, K, E, "float32") for r in range(2)]
    want = moe_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)
    for r in range(2):
        np.testing.assert_array_equal(res[r]["in-network"], want[r])
    queues = [q for sw in stats.values() if isinstance(sw, dict)
              for q in (sw.get("queues") or {}).values()]
    assert sum(q["overflow_drops"] for q in queues) == 0
    assert sum(q["trims"] for q in queues) > 0
    # the leaves sent trimmed sums again when their homes asked
    assert sum(sw["services"]["combine"]["resent"] for sw in stats.values()
               if isinstance(sw, dict) and "combine" in sw.get("services", {})) > 0


@pytest.mark.timeout(240)
def test_network_classes_have_their_own_queues_on_switch_daemons(tmp_path) -> None:
    """[congestion.scaleout] and [congestion.frontend] on launched processes: the
    spine's port to the host (front-end: tail drop, marking, DCTCP) queues in a
    buffer of its own, the leaves' scale-out ports are lossless; host-ps (through
    the front-end) exact, with marks on the host's port."""
    from fabric.core.topology import Topology, leaf_spine

    doc = leaf_spine(2, 1, leaf_bandwidth_gbps=0.5, leaf_latency_us=20, spine_latency_us=20,
                     mtu=8192, hosts=1).to_dict()
    for link in doc["link"]:
        if "host0" in (link["a"], link["b"]):
            link["class"] = "frontend"
            link["bandwidth_gbps"], link["mtu"] = 0.2, 8192
    doc["congestion"] = {"cc": "nscc", "scaleout": {"buffer_bytes": 100_000, "pfc": True},
                         "frontend": {"buffer_bytes": 40_000, "cc": "dctcp"}}
    topo = Topology.from_dict(doc)
    with launch(topology=topo, run_dir=tmp_path, timeout_s=60, seed=5) as fab:
        res = fab.run(tasks.lossy_allreduce, "host-ps", 100_000, 2)
        stats = fab.switch_stats()
        classes = fab.class_traffic()
    assert [r["wrong"] for r in res] == [0, 0]
    # each class's links counted by the switches that drive them: host-ps crosses
    # the front-end both ways (into the spine: hops; to host0: not)
    fe = classes["frontend"]
    assert fe["bytes"] >= 2 * 2 * 100_000 and fe["frames"] > fe["hops"] > 0, classes
    assert classes["scaleout"]["frames"] == classes["scaleout"]["hops"] > 0, classes
    spine = stats["spine0"]["queues"]
    assert spine["spine0>host0"]["ecn_marks"] > 0
    assert 0 < spine["spine0>host0"]["peak_queue_bytes"] <= 40_000
    assert "pfc" in stats["leaf0"] and "pfc" in stats["spine0"]
