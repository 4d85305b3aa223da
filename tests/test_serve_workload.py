"""A sharded model serving requests in virtual time (fabric.core.serve_workload):
continuous batching, open and closed loops, the leader's plans."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.serve_workload import deal, served_decode
from fabric.core.topology import star
from fabric.errors import UsageError
from fabric.sim import Simulation
from fabric.sim.engine import SimulationError


def _run(tp: int, ep: int, n: int, out: int, **kw):
    topo = star(tp * ep, bandwidth_gbps=400, latency_us=1, hosts=1)
    return Simulation(topo, timeout_s=60).run(served_decode, "mixtral-8x7b", tp, ep, [64] * n,
                                              [out] * n, layers=2, **kw).results


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (1, 4)])
def test_a_closed_loop_keeps_concurrency_requests_open(tp: int, ep: int) -> None:
    res = _run(tp, ep, 6, 5, concurrency=2)
    lead = res[0]
    assert all(r == {} for r in res[1:])
    reqs = lead["requests"]
    assert [len(q["tokens"]) for q in reqs] == [5] * 6
    arrivals = [q["arrival"] for q in reqs]
    assert arrivals[:2] == [0.0, 0.0] and arrivals == sorted(arrivals)
    for q in reqs:
        assert q["tokens"][0] > q["arrival"] and np.all(np.diff(q["tokens"]) > 0)
    # a request arrives when an earlier one has its last token: two are open at a time
    ends = sorted(q["tokens"][-1] for q in reqs)
    for i, q in enumerate(reqs[2:]):
        assert q["arrival"] == pytest.approx(ends[i])
    steps = lead["steps"]
    assert sum(s["rows"] - s["first"] for s in steps) == 6 * 4  # tokens after the first
    if ep > 1:
        assert all(s.get("dispatch", 0) > 0 for s in steps)


def test_an_open_loop_idles_until_requests_arrive() -> None:
    lead = _run(2, 2, 3, 4, arrivals=[0.0, 0.5, 0.5])[0]
    reqs = lead["requests"]
    assert [q["arrival"] for q in reqs] == pytest.approx([0.0, 0.5, 0.5])
    assert reqs[0]["tokens"][-1] < 0.5 < reqs[1]["tokens"][0]  # the first left before
    assert reqs[1]["tokens"] == reqs[2]["tokens"]  # the two later ones share every step


def test_a_full_batch_queues_requests() -> None:
    lead = _run(1, 2, 5, 3, concurrency=5, max_batch=1)[0]
    first = sorted(q["tokens"][0] for q in lead["requests"])
    assert first[0] == first[1] < first[2]  # one sequence per replica: two at a time


def test_charging_the_layers_not_run_scales_the_step() -> None:
    """Two layers run or four, the step is the whole model's (TP only: every layer
    alike; with EP each layer's random routing is a sample of its own)."""
    two = _run(2, 1, 2, 4, concurrency=2)[0]
    topo = star(2, bandwidth_gbps=400, latency_us=1, hosts=1)
    four = Simulation(topo, timeout_s=60).run(served_decode, "mixtral-8x7b", 2, 1, [64] * 2,
                                              [4] * 2, layers=4, concurrency=2).results[0]
    itl2 = np.diff(two["requests"][0]["tokens"]).mean()
    itl4 = np.diff(four["requests"][0]["tokens"]).mean()
    assert itl4 == pytest.approx(itl2, rel=0.02)  # both charge all 32 layers
    one = Simulation(topo, timeout_s=60).run(served_decode, "mixtral-8x7b", 2, 1, [64] * 2,
                                             [4] * 2, layers=32, concurrency=2).results[0]
    assert np.diff(one["requests"][0]["tokens"]).mean() == pytest.approx(itl2, rel=0.02)


def test_bad_schedules_are_refused() -> None:
    with pytest.raises((UsageError, SimulationError)):
        _run(1, 2, 2, 2)  # neither arrivals nor concurrency
    with pytest.raises((UsageError, SimulationError)):
        _run(1, 2, 2, 2, arrivals=[0.0], concurrency=0)


def test_requests_are_dealt_to_generators_in_turn() -> None:
    assert deal(7, 2, 0) == ([0, 2, 4, 6], 0) and deal(7, 2, 1) == ([1, 3, 5], 0)
    # closed loop: client k (requests k, k + 3, ...) sends to generator k % 2
    assert deal(7, 2, 0, concurrency=3) == ([0, 2, 3, 5, 6], 2)
    assert deal(7, 2, 1, concurrency=3) == ([1, 4], 1)
    assert deal(4, 3, 2, concurrency=2) == ([], 0)  # fewer clients than generators
    for dp, c in ((1, 1), (2, 3), (3, 8), (4, 2)):
        served = sorted(i for g in range(dp) for i in deal(9, dp, g, c)[0])
        assert served == list(range(9))
        assert sum(deal(9, dp, g, c)[1] for g in range(dp)) == min(c, 9)


@pytest.mark.parametrize("loop", [{"concurrency": 3}, {"arrivals": [0.0] * 5}])
def test_data_parallel_generators_share_the_fabric(loop: dict) -> None:
    """Two generators of tp 2 on four workers: each leader serves its requests and
    no request is served twice; three clients on two generators: two and one."""
    topo = star(4, bandwidth_gbps=400, latency_us=1, hosts=1)
    res = Simulation(topo, timeout_s=60).run(served_decode, "mixtral-8x7b", 2, 1, [64] * 5,
                                             [4] * 5, layers=2, **loop).results
    assert res[1] == {} and res[3] == {}
    a, b = res[0], res[2]
    assert (a["group"], b["group"]) == (0, 1)
    ids = [q["id"] for q in a["requests"]] + [q["id"] for q in b["requests"]]
    assert sorted(ids) == list(range(5))
    for lead in (a, b):
        for q in lead["requests"]:
            assert len(q["tokens"]) == 4 and q["tokens"][0] > q["arrival"]
    if "concurrency" in loop:
        opening = [sum(q["arrival"] == 0.0 for q in lead["requests"]) for lead in (a, b)]
        assert opening == [2, 1]


def test_a_fabric_that_is_no_multiple_of_the_layout_is_refused() -> None:
    topo = star(3, bandwidth_gbps=400, latency_us=1, hosts=1)
    with pytest.raises((UsageError, SimulationError), match="multiple"):
        Simulation(topo, timeout_s=60).run(served_decode, "mixtral-8x7b", 2, 1, [64] * 2,
                                           [2] * 2, layers=2, concurrency=2)
