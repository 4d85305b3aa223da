"""CcGate (fabric.core.congestion.gate) on a fake clock: the window, the pacer,
echoes and CNP pacing, losses, the lazy policy timer."""

from __future__ import annotations

import pytest

from fabric.core.congestion import CcPath, make_cc
from fabric.core.congestion.dcqcn import CNP_INTERVAL_S
from fabric.core.congestion.gate import CcGate
from fabric.core.congestion.policy import FixedWindow

PATH = CcPath(link_gbps=10.0, base_rtt_s=10e-6, mtu=1000)  # BDP 12 500 B


def test_the_window_counts_bytes_in_flight_and_losses_free_them() -> None:
    gate = CcGate(FixedWindow(PATH))  # 1.5 BDP: 18 750 B
    sent = 0
    while gate.allows(1000, 0.0):
        gate.sent(1000, 0.0)
        sent += 1
    assert sent == 18 and gate.inflight == 18_000
    gate.acked(1000, False, 12e-6, 1e-5)
    assert gate.allows(1000, 1e-5)
    gate.lost(2000, 1e-5, timeout=True)
    assert gate.inflight == 15_000


def test_the_pacer_spaces_frames_at_the_policys_rate() -> None:
    cc = FixedWindow(PATH)
    cc.rate_bps = 1e9  # 1000 B: 8 us apart
    gate = CcGate(cc)
    gate.begin(0.0)
    assert gate.allows(1000, 0.0)
    gate.sent(1000, 0.0)
    assert not gate.allows(1000, 4e-6) and gate.pace_wait == pytest.approx(8e-6)
    gate.end()
    gate.begin(11e-6)  # the driver woke 3 us late: the next is due at 16, not 19
    assert gate.allows(1000, 11e-6)
    gate.sent(1000, 11e-6)
    assert gate.pace_at == pytest.approx(16e-6)


def test_echoes_reach_a_cnp_policy_once_per_interval() -> None:
    gate = CcGate(make_cc("dcqcn", PATH), flow=7)
    line = gate.cc.rate_bps
    gate.sent(1000, 0.0)
    gate.acked(1000, True, 10e-6, 10e-6)
    cut = gate.cc.rate_bps
    assert cut < line
    gate.echo(20e-6)  # within the CNP interval: no second cut
    assert gate.cc.rate_bps == cut and gate.echoes == 2
    gate.echo(10e-6 + CNP_INTERVAL_S)
    assert gate.cc.rate_bps < cut


def test_the_policy_timer_runs_when_the_sender_acts() -> None:
    gate = CcGate(make_cc("dcqcn", PATH))
    gate.acked(0, True, 10e-6, 0.0)
    cut = gate.cc.rate_bps
    gate.tick(20 * 55e-6)  # twenty recovery periods later, in one call
    assert gate.cc.rate_bps > cut


def test_a_credit_policy_reuses_credit_only_where_told() -> None:
    """reclaim: a frame resent that its receiver will not grant again gets its
    credit back; other policies have none to reuse."""
    gate = CcGate(make_cc("eqds", PATH))
    before = gate.cc.credit
    gate.sent(1000, 0.0)
    gate.reclaim(1000)
    assert gate.cc.credit == before
    window = CcGate(make_cc("nscc", PATH))
    window.reclaim(1000)
    assert window.cc.credit == 0
