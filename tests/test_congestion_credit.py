"""Credit-based link flow control (fabric.core.congestion.credit) on a fake clock,
and in the packet-level fabric: a lossless incast without a single pause, and the
head-of-line blocking it shares with PFC."""

from __future__ import annotations

import pytest

from fabric.cli import main
from fabric.core.congestion import CongestionConfigError
from fabric.core.congestion.credit import CreditLink, link_credit_bytes
from fabric.sim.incast import IncastSettings, run_incast
from fabric.sim.pfc_cases import run_victim


def test_a_link_sends_only_into_granted_room_and_counts_its_waits() -> None:
    link = CreditLink(3000, mtu=1000)
    assert link.can_send(1000, 0.0)
    link.spend(1000, 0.0)
    link.spend(1000, 0.0)
    link.spend(1000, 0.0)
    assert not link.can_send(1, 1e-6)
    assert not link.can_send(1000, 2e-6)  # still the same wait: counted once
    assert link.statistics(5e-6).stalls == 1
    link.refill(1000)
    assert link.can_send(1000, 5e-6)
    link.spend(1000, 5e-6)
    st = link.statistics(5e-6)
    assert (st.credits, st.granted, st.stalls, st.returned) == (0, 3000, 1, 1000)
    assert st.stalled_s == pytest.approx(4e-6)  # from the refusal at 1 us to the send at 5
    with pytest.raises(ValueError, match="exceed"):
        link.refill(3001)


def test_credits_below_one_frame_are_refused() -> None:
    with pytest.raises(CongestionConfigError, match="at least one MTU"):
        CreditLink(999, mtu=1000)


def test_a_link_is_granted_its_round_trip_and_a_frame() -> None:
    # 100 Gb/s, 1 us each way, 4150 B frames, 64 B credit returns: 2.34 us of round
    # trip = 29 250 B = 7.05 frames -> 8 frames, plus one
    assert link_credit_bytes(100.0, 1e-6, 4150, 64) == 9 * 4150
    with pytest.raises(CongestionConfigError):
        link_credit_bytes(0.0, 1e-6, 4150, 64)


def test_a_credit_incast_is_lossless_at_line_rate_without_pauses() -> None:
    r = run_incast(IncastSettings(senders=8, size=300_000, cc="none", credit=True))
    assert r["finished"] and r["wrong"] == 0
    assert (r["drops"], r["trims"], r["pauses"], r["retransmits"]) == (0, 0, 0, 0)
    assert r["of_ideal"] < 1.01
    assert r["credit_stalls"] > 0 and r["credit_stalled_s"] > 0
    # the hot port holds at most what its eight senders' links were granted
    s = IncastSettings(senders=8, size=300_000, credit=True).resolved()
    assert r["peak_queue_bytes"] <= 9 * s.link_credits


def test_credits_need_a_buffer_that_holds_them() -> None:
    with pytest.raises(CongestionConfigError, match="below the credits"):
        IncastSettings(senders=8, size=1000, credit=True, buffer=100_000).resolved()
    with pytest.raises(CongestionConfigError, match="choose one"):
        IncastSettings(senders=8, size=1000, credit=True, trim=True).resolved()


def test_credits_block_the_head_of_the_line_as_pfc_does() -> None:
    credit = run_victim(pfc=False, credit=True)
    pfc = run_victim(pfc=True)
    trim = run_victim(pfc=False)
    assert all(r["finished"] and r["wrong"] == 0 for r in (credit, pfc, trim))
    assert credit["pauses"] == 0 and credit["drops"] == credit["trims"] == 0
    assert credit["uplink_credit_stalled_s"] > 0
    # the victim waits behind the incast's frames on the shared link
    assert credit["victim_slowdown"] > 3 and pfc["victim_slowdown"] > 3
    assert trim["victim_slowdown"] < 1.5


def test_credit_with_trimming_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "incast", "--senders", "4", "--size", "10K", "--credit", "--trim"]) == 2
    err = capsys.readouterr().err
    assert "lossless by themselves" in err and len(err.strip().splitlines()) == 1
