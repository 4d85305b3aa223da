"""Link shaping deadlines, asserted exactly with a fake clock."""

from __future__ import annotations

import pytest

from fabric.core.link import LinkShaper
from fabric.core.topology import LinkParams


def test_serialisation_then_latency() -> None:
    s = LinkShaper(LinkParams(bandwidth_gbps=8.0, latency_us=10.0))
    # 8 Gbit/s = 1 byte/ns: 1000 B take 1 us on the wire, then 10 us of flight
    assert s.schedule(1000, now=0.0) == pytest.approx(11e-6)
    # queued behind the first frame: starts at 1 us
    assert s.schedule(1000, now=0.0) == pytest.approx(12e-6)
    # link idle again by t=1 s: starts at once
    assert s.schedule(500, now=1.0) == pytest.approx(1.0 + 0.5e-6 + 10e-6)
    assert s.frames == 3 and s.bytes == 2500
    assert s.backlog_s(1.0) == pytest.approx(0.5e-6)


def test_unshaped_link_is_inactive_and_immediate() -> None:
    s = LinkShaper(LinkParams())
    assert not s.active
    assert s.schedule(10**9, now=5.0) == 5.0


def test_departures_never_reorder() -> None:
    s = LinkShaper(LinkParams(bandwidth_gbps=1.0))
    times = [s.schedule(n, now=t) for t, n in [(0, 100), (0, 10), (1e-9, 5000), (2e-6, 1)]]
    assert times == sorted(times)
