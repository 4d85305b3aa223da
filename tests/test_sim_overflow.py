"""Bounded switch buffers in fabric.sim.Simulation (``[congestion] buffer_bytes``,
fabric/core/link.py's queue): overflow drops frames, the programs resend, and no
allreduce path, collective or MoE variant ever returns a wrong element or hangs."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import pytest

from fabric.core.congestion.settings import CongestionSettings
from fabric.core.moe import moe_reference
from fabric.core.topology import leaf_spine, star
from fabric.errors import UsageError
from fabric.sim import Simulation, SimulationError
from tests import fabric_tasks as tasks

#: A shared buffer per switch of about one p2p stream frame (64 KiB) and a few
#: 4 KiB frames, on 10 Gb/s links: fan-in (host-ps, alltoall) overflows it.
BUFFER = 70_000


def _topo(kind: str, workers: int = 8) -> Any:
    if kind == "star":
        t = star(workers, bandwidth_gbps=10, latency_us=1, mtu=4096)
    else:  # two leaves at 4:1: the uplinks are the bottleneck
        t = leaf_spine(2, workers // 2, oversubscription=4, leaf_bandwidth_gbps=10,
                       leaf_latency_us=1, spine_latency_us=1, mtu=4096)
    return t.with_congestion(CongestionSettings(buffer_bytes=BUFFER))


def _allreduce(ctx: Any, n: int, path: str) -> Generator[Any, Any, int]:
    x = np.arange(n, dtype=np.int32) * (ctx.rank + 1)
    y = yield ctx.allreduce(x, path=path)
    want = np.arange(n, dtype=np.int32) * sum(range(1, ctx.world + 1))
    return int(np.count_nonzero(y != want))


def _collectives(ctx: Any, m: int, path: str) -> Generator[Any, Any, int]:
    rng = np.random.default_rng(ctx.rank + 1)
    x = rng.integers(-1000, 1000, size=m * ctx.world, dtype=np.int32)
    wrong = 0
    mine = x[:m].copy()
    got = yield ctx.all_gather(mine, path=path)
    every = [np.random.default_rng(r + 1).integers(-1000, 1000, size=m * ctx.world,
                                                   dtype=np.int32) for r in range(ctx.world)]
    wrong += int(np.count_nonzero(got != np.concatenate([e[:m] for e in every])))
    got = yield ctx.alltoall(x, path="host-p2p")
    want = np.concatenate([e[ctx.rank * m:(ctx.rank + 1) * m] for e in every])
    wrong += int(np.count_nonzero(got != want))
    return wrong


@pytest.mark.parametrize("kind", ["star", "leaf_spine"])
@pytest.mark.parametrize("path", ["ina", "host-ring", "host-ps"])
def test_overflow_drops_never_give_a_wrong_element(kind: str, path: str) -> None:
    r = Simulation(_topo(kind), timeout_s=30).run(_allreduce, 1 << 16, path)
    assert r.results == [0] * 8
    if path == "host-ps":  # eight workers into one host port: the buffer overflows
        assert r.overflow_drops > 0 and r.retransmits > 0
    else:  # ina and the ring are self-clocked: they never fill it
        assert r.overflow_drops == 0


@pytest.mark.parametrize("path", ["ina", "host-p2p"])
def test_collectives_stay_exact_through_overflow(path: str) -> None:
    r = Simulation(_topo("star", 4), timeout_s=30).run(_collectives, 1 << 13, path)
    assert r.results == [0] * 4
    assert r.overflow_drops > 0 and r.retransmits > 0


def test_no_buffer_means_no_overflow_and_a_lossless_run() -> None:
    t = star(4, bandwidth_gbps=10, latency_us=1, mtu=4096)
    r = Simulation(t).run(_allreduce, 1 << 14, "host-ring")
    assert r.results == [0] * 4 and r.overflow_drops == 0 and r.retransmits == 0


def test_a_buffer_smaller_than_a_frame_is_refused() -> None:
    t = star(2, bandwidth_gbps=10, mtu=4096).with_congestion(
        CongestionSettings(buffer_bytes=4000))  # a frame is 4096 B and its header
    with pytest.raises(UsageError, match="cannot hold one frame"):
        Simulation(t)


def test_moe_variants_stay_exact_through_overflow() -> None:
    variants = ("flat", "hierarchical", "in-network")
    T, H, K, E = 64, 256, 4, 16
    topo = _topo("leaf_spine")
    res = Simulation(topo, timeout_s=30).run(tasks.moe_workload, variants, T, H, K, E)
    ins = [tasks.moe_inputs(r, T, H, K, E, "float32") for r in range(8)]
    want = moe_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)
    for r in range(8):
        for v in variants:
            np.testing.assert_array_equal(res.results[r][v], want[r], err_msg=f"{v} rank {r}")
    assert res.overflow_drops > 0


def test_in_network_aggregation_leaves_the_host_port_empty_where_host_ps_fills_it() -> None:
    """Eight workers' allreduce: ina is summed in the switch, host-ps converges on
    the host's port, whose queue fills the buffer (and overflows)."""
    t = _topo("star")
    ina = Simulation(t, timeout_s=30).run(_allreduce, 1 << 15, "ina")
    hps = Simulation(t, timeout_s=30).run(_allreduce, 1 << 15, "host-ps")
    assert ina.results == hps.results == [0] * 8
    assert ina.queue_peaks.get("sw0>host0", 0) == 0
    assert 0.5 * BUFFER < hps.queue_peaks["sw0>host0"] <= BUFFER
    assert all(v <= BUFFER for v in hps.queue_peaks.values())
    assert ina.end_s < hps.end_s


@pytest.mark.parametrize("cc", [None, "nscc", "dcqcn"])
def test_trimmed_frames_cross_the_spine_and_are_asked_for_at_once(cc: str | None) -> None:
    """With trimming, a frame cut at a leaf's uplink travels on as a header through
    the spine and the far leaf; its receiver NACKs it and the sender resends at
    once: exact, and no stream waits for its retransmission timer."""
    t = leaf_spine(2, 4, oversubscription=4, leaf_bandwidth_gbps=10, leaf_latency_us=1,
                   spine_latency_us=1, mtu=4096).with_congestion(
        CongestionSettings(buffer_bytes=40_000, trim=True, cc=cc))
    r = Simulation(t, timeout_s=30).run(_collectives, 1 << 13, "host-p2p")
    assert r.results == [0] * 8
    assert r.trims > 0 and r.overflow_drops == 0
    assert sum(n.trims_received for n in r.nodes.values()) == r.trims
    assert sum(n.timeouts for n in r.nodes.values()) == 0
    spine = r.switch_stats["spine0"]
    assert spine.trimmed_forwarded > 0 and spine.malformed == 0


@pytest.mark.parametrize("cc", ["nscc", "dcqcn"])
def test_host_ps_under_a_policy_is_exact_and_in_network_leaves_the_host_port_empty(
        cc: str) -> None:
    t = star(8, bandwidth_gbps=10, latency_us=5, mtu=4096).with_congestion(
        CongestionSettings(buffer_bytes=BUFFER, cc=cc))
    hps = Simulation(t, timeout_s=30).run(_allreduce, 1 << 15, "host-ps")
    ina = Simulation(t, timeout_s=30).run(_allreduce, 1 << 15, "ina")
    assert hps.results == ina.results == [0] * 8
    assert hps.ecn_marks > 0 and hps.queue_peaks["sw0>host0"] > 0.5 * BUFFER
    assert ina.queue_peaks.get("sw0>host0", 0) == 0 and ina.end_s < hps.end_s


def _alltoall(ctx: Any, n: int) -> Generator[Any, Any, int]:
    x = (np.arange(n, dtype=np.int32) + ctx.rank * n).astype(np.int32)
    got = yield ctx.alltoall(x, path="host-p2p")
    m = n // ctx.world
    want = np.concatenate([np.arange(ctx.rank * m, (ctx.rank + 1) * m, dtype=np.int32) + r * n
                           for r in range(ctx.world)])
    return int(np.count_nonzero(got != want))


def test_tail_drop_behind_a_full_queue_costs_round_trips_not_seconds() -> None:
    """16 streams of 64 KiB frames share each 4:1 uplink and the buffer holds six
    frames: losses end in timeouts. Bounded by two windows' time on the path, the
    backoff keeps the alltoall within a few times its unbounded time; a 1 s
    ceiling (``rto_max_us``) makes it an order of magnitude slower."""
    t = leaf_spine(2, 4, oversubscription=4, leaf_bandwidth_gbps=2)
    n = 1 << 18  # 1 MiB per rank
    free = Simulation(t, timeout_s=60).run(_alltoall, n)
    cong = CongestionSettings(buffer_bytes=400_000)
    short = Simulation(t.with_congestion(cong), timeout_s=60).run(_alltoall, n)
    long_ = Simulation(t.with_congestion(CongestionSettings(buffer_bytes=400_000,
                                                            rto_max_us=1e6)),
                       timeout_s=60).run(_alltoall, n)
    assert free.results == short.results == long_.results == [0] * 8
    assert short.overflow_drops > 0 and long_.overflow_drops > 0
    assert short.end_s < 4.5 * free.end_s  # 39 ms against 10.8 ms (a cold first call)
    assert long_.end_s > 5 * short.end_s  # 395 ms


def _innet_moe(ctx: Any, T: int, H: int, K: int, E: int) -> Generator[Any, Any, Any]:
    from fabric.core.moe import expert_partials

    x, idx, w = tasks.moe_inputs(ctx.rank, T, H, K, E, "float32")
    t0 = yield ctx.clock()
    d = yield ctx.moe_dispatch(x, idx, w, E, variant="in-network")
    t1 = yield ctx.clock()
    y = yield ctx.moe_combine(d, expert_partials(d, ctx.rank, ctx.world))
    return y, t1 - t0


def _innet_moe_behind(cong: CongestionSettings) -> Any:
    """In-network MoE (64 tokens of 256, top-4 of 16 experts) on 8 ranks, two leaves
    at 4:1 of 10 Gb/s, behind switches set by ``cong``: every rank's output checked
    against the reference; the run."""
    T, H, K, E = 64, 256, 4, 16
    t = leaf_spine(2, 4, oversubscription=4, leaf_bandwidth_gbps=10, leaf_latency_us=1,
                   spine_latency_us=1, mtu=4096)
    ins = [tasks.moe_inputs(r, T, H, K, E, "float32") for r in range(8)]
    want = moe_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)
    res = Simulation(t.with_congestion(cong), timeout_s=30).run(_innet_moe, T, H, K, E)
    for r in range(8):
        np.testing.assert_array_equal(res.results[r][0], want[r])
    return res


def test_in_network_dispatch_rows_are_trimmed_and_asked_for_at_once() -> None:
    """In-network MoE behind a small buffer with trimming: cut rows cross the spine
    as headers (the multicast service replicates them by their mask), their members
    NACK them and the sender resends at once: exact, and the dispatch takes less
    than a millisecond where tail drop waits 78 ms for the rows' timers."""
    took = {}
    for trim in (True, False):
        res = _innet_moe_behind(CongestionSettings(buffer_bytes=40_000, trim=trim))
        took[trim] = max(r[1] for r in res.results)
        if trim:
            assert res.trims > 0
            assert res.switch_stats["spine0"].trimmed_forwarded > 0
    assert took[True] < 0.1 * took[False]


def test_in_network_combine_sums_are_trimmed_and_asked_for_at_once() -> None:
    """The switches' sums to the tokens' homes are trimmed too, not dropped: a home
    NACKs a cut sum to the switch that kept it, which sends the frame again at
    once. Exact, nothing dropped, and the call takes about twice its unbounded time
    (1.0 against 0.54 ms) where dropped sums waited 100 ms for the homes' timers."""
    free = _innet_moe_behind(CongestionSettings())
    res = _innet_moe_behind(CongestionSettings(buffer_bytes=40_000, trim=True))
    resent = sum(s.services["combine"].resent for s in res.switch_stats.values())
    assert res.overflow_drops == 0 and resent > 0
    assert res.end_s < 4 * free.end_s


def test_a_policy_paces_in_network_moe_behind_tail_drop() -> None:
    """[congestion] cc governs in-network MoE's frames too (dispatch rows, combine
    partials): behind a tail-dropping buffer the policy's window keeps the rows
    from overflowing it, where the rows' own window of 64 frames does (413 drops,
    20 ms against 0.3 ms); exact."""
    runs = {}
    for cc in (None, "none", "nscc"):
        res = _innet_moe_behind(CongestionSettings(buffer_bytes=200_000, cc=cc))
        runs[cc] = (max(r[1] for r in res.results), res.overflow_drops)
    for cc in ("none", "nscc"):
        assert runs[cc][1] < 0.1 * runs[None][1] and runs[cc][0] < 0.1 * runs[None][0]


@pytest.mark.parametrize("path", ["host-ps", "host-p2p"])
def test_pfc_pauses_senders_instead_of_dropping(path: str) -> None:
    """The same fan-in behind a lossless buffer (``pfc``): nothing dropped, nothing
    resent, every element exact; the senders' links were paused instead, and no
    ingress port went past its headroom. (Unicast, the buffer's use above its pool
    is within the ports' headrooms; a multicast's or an aggregation's further
    copies are charged to no ingress port, so PFC does not bound them.)"""
    import dataclasses

    def run(pfc: bool) -> Any:
        t = _topo("leaf_spine")
        t = t.with_congestion(dataclasses.replace(t.congestion, pfc=pfc))
        sim = Simulation(t, timeout_s=30)
        if path == "host-ps":
            res = sim.run(_allreduce, 1 << 16, path)
            assert res.results == [0] * 8
        else:
            res = sim.run(_collectives, 1 << 13, "ina")
            assert res.results == [0] * 8
        return sim, res

    sim, lossless = run(True)
    assert lossless.overflow_drops == 0 and lossless.retransmits == 0
    assert lossless.pauses > 0 and lossless.paused_s > 0
    for q in sim._queues.values():
        pfc = q.buffer.pfc
        assert pfc is not None and pfc.headroom_overflows == 0
        if path == "host-ps":  # unicast: at most each ingress port's headroom
            assert q.buffer.buffer.headroom_peak <= pfc.headroom * 9
    _sim, lossy = run(False)
    assert lossy.overflow_drops > 0 and lossy.pauses == 0


@pytest.mark.parametrize("kind", ["star", "leaf_spine"])
def test_credit_links_lose_nothing_and_hold_senders_back(kind: str) -> None:
    """Credit-based links ([congestion] credit): fan-in makes senders wait for
    credit instead of queueing at the switch; nothing is dropped or resent, every
    element exact; a self-clocked path (ina) never waits, and its time is the
    unbounded fabric's (the grant covers a link's round trip)."""
    base = _topo(kind).with_congestion(CongestionSettings())
    credit = base.with_congestion(CongestionSettings(credit=True))
    for path in ("host-ps", "ina"):
        r = Simulation(credit, timeout_s=30).run(_allreduce, 1 << 16, path)
        free = Simulation(base, timeout_s=30).run(_allreduce, 1 << 16, path)
        assert r.results == [0] * 8
        assert r.overflow_drops == 0 and r.retransmits == 0
        if path == "host-ps":  # eight workers into one host port
            assert r.credit_stalls > 0 and r.credit_stalled_s > 0
            assert r.end_s == pytest.approx(free.end_s, rel=0.05)  # the host link decides
        else:
            assert r.credit_stalls == 0 and r.end_s == pytest.approx(free.end_s)
    r = Simulation(credit, timeout_s=30).run(_collectives, 1 << 13, "ina")
    assert r.results == [0] * 8 and r.credit_stalls > 0


def test_credit_holds_a_cluster_scale_up_switch_back_per_link() -> None:
    """A cluster's scale-up links are credit-controlled by default; an alltoall
    through its domains stays exact whichever way the switches hold it back."""
    from fabric.core.topology import cluster

    t = cluster(2, 4, scaleup={"bandwidth_gbps": 10.0}, scaleout={"bandwidth_gbps": 5.0})
    assert all(lk.params.credit for lk in t.links if lk.cls == "scaleup")
    r = Simulation(t, timeout_s=30).run(_collectives, 1 << 13, "ina")
    assert r.results == [0] * 8 and r.retransmits == 0


def _ring(n: int, credit: bool) -> Any:
    """``n`` switches in a ring, a worker on each, every link 10 Gb/s."""
    from fabric.core.topology import loads

    out = ["[fabric]", 'name = "ring"', "[defaults.scaleup]", "bandwidth_gbps = 10.0",
           "latency_us = 1.0", "mtu = 4096", f"credit = {'true' if credit else 'false'}"]
    for kind, prefix in (("worker", "w"), ("switch", "s")):
        for i in range(n):
            out += ["[[node]]", f'name = "{prefix}{i}"', f'kind = "{kind}"']
    for i in range(n):
        out += ["[[link]]", f'a = "w{i}"', f'b = "s{i}"', 'class = "scaleup"']
        out += ["[[link]]", f'a = "s{i}"', f'b = "s{(i + 1) % n}"', 'class = "scaleup"']
    return loads("\n".join(out))


def _two_ahead(ctx: Any, n: int) -> Generator[Any, Any, int]:
    x = np.full(n, ctx.rank, np.int32)
    out = np.empty(n, np.int32)
    yield ctx.sendrecv(x, (ctx.rank + 2) % ctx.world, out, (ctx.rank - 2) % ctx.world)
    return int(np.count_nonzero(out != (ctx.rank - 2) % ctx.world))


def test_a_credit_deadlock_is_reported_by_its_cycle_of_links() -> None:
    """Five switches in a ring, each worker streaming to the one two switches on:
    every route takes two ring links the same way round, so each ring link's
    credit is held by frames waiting for the next one's. Without credit the run
    finishes exact; with it the simulator names the cycle instead of a timeout."""
    assert Simulation(_ring(5, False), timeout_s=5).run(_two_ahead, 1 << 18).results == [0] * 5
    with pytest.raises(SimulationError, match=r"credit deadlock .*s0>s1, s1>s2, s2>s3, "
                       r"s3>s4, s4>s0"):
        Simulation(_ring(5, True), timeout_s=5).run(_two_ahead, 1 << 18)


def test_three_networks_each_with_its_own_protocol() -> None:
    """A cluster whose scale-out is lossless (PFC) and whose front-end is lossy
    with DCTCP ([congestion.scaleout], [congestion.frontend]): host-ps chunks to
    the host cross the front-end, held by DCTCP's window near its marking
    threshold behind a 60 kB tail-drop port; an alltoall across domains pauses
    the scale-out links and drops nothing. Both exact."""
    from fabric.core.topology import cluster, loads

    base = cluster(2, 2, hosts=1, scaleout={"bandwidth_gbps": 2.0},
                   frontend={"bandwidth_gbps": 1.0})
    t = loads(base.to_toml() + """
[congestion]
cc = "nscc"

[congestion.scaleout]
buffer_bytes = 200000
pfc = true

[congestion.frontend]
buffer_bytes = 60000
cc = "dctcp"
""")
    free = Simulation(base, timeout_s=30).run(_allreduce, 1 << 18, "host-ps")
    ps = Simulation(t, timeout_s=30).run(_allreduce, 1 << 18, "host-ps")
    assert ps.results == [0] * 4 and ps.pauses == 0 and ps.ecn_marks > 0
    assert ps.queue_peaks["spine0>host0"] <= 60_000
    assert ps.end_s < 1.1 * free.end_s  # the front-end's link stays busy
    a2a = Simulation(t, timeout_s=30).run(_alltoall, 1 << 18)
    assert a2a.results == [0] * 4 and a2a.overflow_drops == 0 and a2a.pauses > 0


def test_host_ring_behind_tail_drop_resends_only_what_was_lost() -> None:
    """A ring through an 8:1 uplink behind a 60 kB shared tail-drop buffer. The ring
    used to resend whole steps into the full queue, which lost the same frames
    every time, and never finished. Now the right neighbour ACKs each frame, a
    timeout resends only what it lacks, and three later ACKs find a loss at once;
    under a policy those ACKs clock its window. Exact; 2.7x the unbounded time
    with no policy, within 10 % under nscc."""
    t = leaf_spine(2, 4, oversubscription=8, leaf_bandwidth_gbps=2, leaf_latency_us=2,
                   spine_latency_us=2, mtu=8192, hosts=0)
    n = 1 << 18
    free = Simulation(t, timeout_s=30).run(_allreduce, n, "host-ring")
    plain = Simulation(t.with_congestion(CongestionSettings(buffer_bytes=60_000)),
                       timeout_s=30).run(_allreduce, n, "host-ring")
    nscc = Simulation(t.with_congestion(CongestionSettings(buffer_bytes=60_000, cc="nscc")),
                      timeout_s=30).run(_allreduce, n, "host-ring")
    assert free.results == plain.results == nscc.results == [0] * 8
    assert plain.overflow_drops > 0 and nscc.overflow_drops > 0
    assert plain.end_s < 3.5 * free.end_s and nscc.end_s < 1.1 * free.end_s


_SMALL = {"star": star(8, bandwidth_gbps=2, latency_us=2, mtu=8192),
          "8:1": leaf_spine(2, 4, oversubscription=8, leaf_bandwidth_gbps=2, leaf_latency_us=2,
                            spine_latency_us=2, mtu=8192, hosts=1)}


@pytest.mark.parametrize("kind", sorted(_SMALL))
@pytest.mark.parametrize("cong", [CongestionSettings(buffer_bytes=40_000),
                                  CongestionSettings(buffer_bytes=40_000, trim=True),
                                  CongestionSettings(buffer_bytes=40_000, cc="nscc")],
                         ids=["tail-drop", "trim", "nscc"])
@pytest.mark.parametrize("path", ["ina", "ina-mem", "host-ps", "host-ring"])
def test_every_allreduce_path_finishes_behind_a_small_shared_buffer(
        kind: str, cong: CongestionSettings, path: str) -> None:
    """Five frames of shared buffer per switch. Three ways this hung before: a ring
    resent whole steps into the full queue and lost the same frames each time;
    under a policy, members whose windows held different ina chunks waited on each
    other (the lowest chunk now goes first, through a full window if need be);
    and an ina-mem chunk larger than the buffer was never admitted (chunks are
    cut to the MTU where buffers are bounded)."""
    t = _SMALL[kind].with_congestion(cong)
    r = Simulation(t, timeout_s=20).run(_allreduce, 1 << 17, path)
    assert r.results == [0] * 8
