"""The reliable sender under a congestion-control policy (fabric.core.reliability
with fabric.core.congestion), on a fake clock: window, pacing, the ECN echo,
CNP pacing, trimmed frames."""

from __future__ import annotations

from typing import Any

import pytest

from fabric.core.congestion import CcPath, CongestionControl, make_cc
from fabric.core.congestion.dcqcn import CNP_INTERVAL_S
from fabric.core.frame import Flag, NackCode, Op, decode
from fabric.core.reliability import Receiver, Sender

#: 10 Gb/s, 10 us: a BDP of 12 500 B.
PATH = CcPath(link_gbps=10.0, base_rtt_s=10e-6, mtu=1000)


class Recording(CongestionControl):
    """A policy with a fixed window and rate that writes down what it hears."""

    name = "recording"

    def __init__(self, path: CcPath, now: float = 0.0, *, cwnd: float = 3000.0,
                 rate_bps: float | None = None) -> None:
        super().__init__(path, now)
        self.cwnd = cwnd
        if rate_bps is not None:
            self.rate_bps = rate_bps
        self.events: list[tuple[Any, ...]] = []

    def on_send(self, nbytes: int, now: float) -> None:
        self.events.append(("send", nbytes, now))

    def on_ack(self, acked: int, ecn: bool, rtt_s: float, now: float) -> None:
        self.events.append(("ack", acked, ecn, round(rtt_s, 9)))

    def on_nack(self, nbytes: int, now: float) -> None:
        self.events.append(("nack", nbytes))

    def on_timeout(self, nbytes: int, now: float) -> None:
        self.events.append(("timeout", nbytes))

    def on_cnp(self, now: float) -> None:
        self.events.append(("cnp", now))


def _sender(cc: CongestionControl) -> Sender[int]:
    return Sender(1, cc=cc, window_frames=64, rto_initial=0.01, rto_min=0.001)


def test_the_window_caps_the_bytes_in_flight_and_acks_open_it() -> None:
    cc = Recording(PATH, cwnd=3000.0)
    tx = _sender(cc)
    out = tx.send_many([(i, 1000) for i in range(10)], 0.0)
    assert [t.psn for t in out] == [0, 1, 2]  # 3000 B of window, 1000 B frames
    more = tx.handle_ack(0, 0, 20e-6)  # frame 0 acknowledged: one more may go
    assert [t.psn for t in more] == [3]
    assert ("ack", 1000, False, 20e-6) in cc.events
    assert [e for e in cc.events if e[0] == "send"] == [("send", 1000, 0.0)] * 3 + [
        ("send", 1000, 20e-6)]


def test_one_frame_always_goes_whatever_the_window() -> None:
    tx = _sender(Recording(PATH, cwnd=10.0))
    assert [t.psn for t in tx.send_many([(0, 1000), (1, 1000)], 0.0)] == [0]


def test_a_rate_below_the_line_rate_paces_frames_by_a_timer() -> None:
    cc = Recording(PATH, cwnd=1e9, rate_bps=1e9)  # 1000 B at 1 Gb/s: 8 us apart
    tx = _sender(cc)
    assert [t.psn for t in tx.send_many([(i, 1000) for i in range(3)], 0.0)] == [0]
    assert tx.get_timer() == pytest.approx(8e-6)
    assert tx.handle_timer(7e-6) == []
    assert [t.psn for t in tx.handle_timer(8e-6)] == [1]
    assert tx.get_timer() == pytest.approx(16e-6)


def test_the_line_rate_does_not_pace() -> None:
    tx = _sender(Recording(PATH, cwnd=1e9))
    assert len(tx.send_many([(i, 1000) for i in range(5)], 0.0)) == 5


def test_the_receiver_echoes_congestion_once_per_ack() -> None:
    rx: Receiver[int] = Receiver(1, ack_every=2)
    _d, ack = rx.handle_frame(0, 0, 0.0, flags=Flag.ECN)
    assert ack is None
    _d, ack = rx.handle_frame(1, 1, 1e-6)
    assert ack is not None and ack.ecn  # the mark of frame 0 rides on this ACK
    frame = decode(ack.frames(src=2, dst=1, flow=1)[0])
    assert frame.op is Op.ACK and frame.flags & Flag.ECN
    _d, ack = rx.handle_frame(2, 2, 2e-6, flags=Flag.ACK_REQ)
    assert ack is not None and not ack.ecn
    assert rx.statistics().ce_frames == 1


def test_an_echo_reaches_the_policy_with_the_round_trip() -> None:
    cc = Recording(PATH, cwnd=1e9)
    tx = _sender(cc)
    tx.send_many([(0, 1000), (1, 1000)], 0.0)
    tx.handle_ack(1, 0, 30e-6, ecn=True)
    assert ("ack", 2000, True, 30e-6) in cc.events
    assert tx.statistics().ecn_echoes == 1


def test_cnps_are_paced_like_a_notification_point() -> None:
    class Cnp(Recording):
        wants_cnp = True

    cc = Cnp(PATH, cwnd=1e9)
    tx = _sender(cc)
    tx.send_many([(i, 1000) for i in range(4)], 0.0)
    for k, t in enumerate((10e-6, 20e-6, 10e-6 + CNP_INTERVAL_S)):
        tx.handle_ack(k, 0, t, ecn=True)
    assert [e[1] for e in cc.events if e[0] == "cnp"] == [10e-6, 10e-6 + CNP_INTERVAL_S]
    # the ACKs themselves reach the policy without the mark (it came as a CNP)
    assert all(not e[2] for e in cc.events if e[0] == "ack")


def test_a_trimmed_frame_is_resent_at_once_even_if_it_was_a_resend() -> None:
    cc = Recording(PATH, cwnd=1e9)
    tx = _sender(cc)
    tx.send_many([(0, 1000), (1, 1000)], 0.0)
    tx.handle_ack(1, 0, 20e-6)  # an RTT sample: srtt 20 us
    tx.send_many([(2, 1000)], 20e-6)
    first = tx.handle_nack(2, NackCode.TRIMMED, 25e-6)
    again = tx.handle_nack(2, NackCode.TRIMMED, 26e-6)  # its resend was trimmed too
    assert [(t.psn, t.retransmit) for t in first + again] == [(2, True), (2, True)]
    assert [e for e in cc.events if e[0] == "nack"] == [("nack", 1000), ("nack", 1000)]
    # a gap NACK about the same frame this soon is about an older copy: ignored
    assert tx.handle_nack(2, NackCode.OUT_OF_WINDOW, 27e-6) == []


def test_a_timeout_is_told_to_the_policy_and_frees_its_window() -> None:
    cc = Recording(PATH, cwnd=1000.0)
    tx = _sender(cc)
    assert [t.psn for t in tx.send_many([(0, 1000), (1, 1000)], 0.0)] == [0]
    resent = tx.handle_timer(0.011)
    assert [(t.psn, t.retransmit) for t in resent] == [(0, True)]
    assert ("timeout", 1000) in cc.events


def test_nscc_and_dcqcn_drive_a_stream_sender() -> None:
    for name in ("nscc", "dcqcn", "none"):
        tx = _sender(make_cc(name, PATH))
        assert tx.send_many([(i, 1000) for i in range(40)], 0.0)


def test_a_credit_policy_sends_its_first_bdp_then_what_the_receiver_grants() -> None:
    cc = make_cc("eqds", PATH)  # 12 500 B unsolicited
    tx = _sender(cc)
    first = tx.send_many([(i, 1000) for i in range(20)], 0.0)
    assert [t.psn for t in first] == list(range(12))
    assert tx.get_timer() == pytest.approx(0.01)  # the RTO only: no timer waits for credit
    assert [t.psn for t in tx.grant(500, 1e-6)] == [12]  # 500 B were left: one frame
    assert tx.grant(500, 2e-6) == []
    assert [t.psn for t in tx.grant(3000, 3e-6)] == [13, 14, 15]
    assert cc.granted == 4000


def test_a_credit_policy_resends_a_trimmed_frame_on_a_new_grant_and_a_lost_one_at_once(
) -> None:
    """The receiver grants a trimmed frame again (it saw the header); a frame lost
    whole, found by the RTO or a gap, reuses its own credit."""
    cc = make_cc("eqds", PATH)
    tx = _sender(cc)
    tx.send_many([(i, 1000) for i in range(12)], 0.0)  # all the credit spent
    assert tx.handle_nack(3, NackCode.TRIMMED, 5e-6) == []  # waits for its grant
    assert [(t.psn, t.retransmit) for t in tx.grant(1000, 6e-6)] == [(3, True)]
    cc2 = make_cc("eqds", PATH)
    tx2 = _sender(cc2)
    tx2.send_many([(i, 1000) for i in range(12)], 0.0)
    tx2.handle_ack(10, 0, 20e-6)  # frame 11 never arrives
    resent = tx2.handle_timer(1.0)
    assert [(t.psn, t.retransmit) for t in resent] == [(11, True)]
    # a gap the receiver reports (it never saw the frame cut): at once, on its credit
    tx3 = _sender(make_cc("eqds", PATH))
    tx3.send_many([(i, 1000) for i in range(12)], 0.0)
    again = tx3.handle_nack(4, NackCode.OUT_OF_WINDOW, 5e-6)
    assert [(t.psn, t.retransmit) for t in again] == [(4, True)]


def test_a_grant_without_a_credit_policy_changes_nothing() -> None:
    tx = _sender(make_cc("nscc", PATH))
    tx.send_many([(i, 1000) for i in range(40)], 0.0)
    assert tx.grant(10_000, 1e-6) == []


def test_a_late_wake_does_not_slow_the_pace() -> None:
    cc = Recording(PATH, cwnd=1e9, rate_bps=1e9)  # frames 8 us apart
    tx = _sender(cc)
    tx.send_many([(i, 1000) for i in range(4)], 0.0)
    assert [t.psn for t in tx.handle_timer(11e-6)] == [1]  # woke 3 us late
    assert tx.get_timer() == pytest.approx(16e-6)  # the schedule, not 11 + 8 us
    tx.send_many([(4, 1000)], 16e-6 - 1e-9)  # not yet: frame 2 waits for 16 us
    # woke 24 us late: one interval is made up (frame 3 follows at once), no more
    assert [t.psn for t in tx.handle_timer(40e-6)] == [2, 3]
    assert tx.get_timer() == pytest.approx(48e-6)


def test_the_policy_timer_is_applied_when_the_sender_next_acts() -> None:
    cc = make_cc("dcqcn", PATH)
    tx = _sender(cc)
    tx.send_many([(i, 1000) for i in range(3)], 0.0)
    tx.handle_ack(0, 0, 10e-6, ecn=True)  # a CNP: the rate is cut, timers start
    cut = cc.rate_bps
    assert cut < PATH.line_rate_bps and tx.get_timer() != cc.get_timer()
    tx.handle_ack(1, 0, 10e-6 + 10 * 55e-6)  # ten recovery periods later
    assert cc.rate_bps > cut


def test_a_frame_held_by_the_window_leaves_no_pacing_timer_behind() -> None:
    cc = Recording(PATH, cwnd=1e9, rate_bps=1e9)  # frames 8 us apart
    tx = Sender(1, cc=cc, window_frames=2, rto_initial=0.01, rto_min=0.001)
    tx.send_many([(i, 1000) for i in range(3)], 0.0)
    assert [t.psn for t in tx.handle_timer(8e-6)] == [1]
    assert tx.handle_timer(16e-6) == []  # the pacer would let frame 2 go; the window not
    assert tx.get_timer() == pytest.approx(0.01)  # the RTO, not a deadline gone by


class Halving(Recording):
    """Halves its window on each timeout, down to one frame."""

    def on_timeout(self, nbytes: int, now: float) -> None:
        super().on_timeout(nbytes, now)
        self.cwnd = max(self.cwnd / 2, 1000.0)


def test_resends_after_a_timeout_wait_for_the_window_oldest_first() -> None:
    cc = Halving(PATH, cwnd=4000.0)
    tx = _sender(cc)
    assert [t.psn for t in tx.send_many([(i, 1000) for i in range(6)], 0.0)] == [0, 1, 2, 3]
    out = tx.handle_timer(0.011)  # the whole window was lost: its RTO
    assert [(t.psn, t.retransmit) for t in out] == [(0, True)]  # one frame's window
    assert [e for e in cc.events if e[0] == "timeout"] == [("timeout", 1000)] * 4
    # the others wait for the window, not for timers of their own
    assert tx.get_timer() is not None and tx.get_timer() > 0.012
    out = tx.handle_ack(0, 0, 0.012)
    assert [(t.psn, t.retransmit) for t in out] == [(1, True)]
    out = tx.handle_ack(1, 0, 0.013)
    assert [(t.psn, t.retransmit) for t in out] == [(2, True)]
    # a late ACK for a frame still waiting takes it out of the resends
    out = tx.handle_ack(3, 0, 0.014)
    assert [(t.psn, t.retransmit) for t in out] == [(4, False)]
    assert tx.statistics().retransmitted == 3


def test_a_resend_held_by_the_pacer_keeps_its_timer_with_nothing_new_to_send() -> None:
    cc = Recording(PATH, cwnd=1e9, rate_bps=1e9)  # frames 8 us apart
    tx = _sender(cc)
    assert [t.psn for t in tx.send_many([(0, 1000)], 0.0)] == [0]
    assert tx.handle_nack(0, NackCode.TRIMMED, 1e-6) == []  # the pacer holds the resend
    assert tx.get_timer() == pytest.approx(8e-6)
    assert [(t.psn, t.retransmit) for t in tx.handle_timer(8e-6)] == [(0, True)]
