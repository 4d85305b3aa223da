"""A sharded model serving requests in virtual time (fabric.core.serve_workload):
continuous batching, open and closed loops, the leader's plans."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core.serve_workload import served_decode
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
