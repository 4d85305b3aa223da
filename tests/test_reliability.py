"""Reliability state machines: exact RTO arithmetic, loss detection, policies, exactly-once.

Times are chosen as binary fractions (0.125, 1.0, ...) so the RFC 6298
arithmetic is exact in floating point and deadlines can be compared with ==.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fabric.core.faults import FaultInjector
from fabric.core.frame import Flag, NackCode, Op, decode
from fabric.core.reliability import (
    GAP_NACK_CODE,
    PACKET_THRESHOLD,
    POLICIES,
    PSN_MASK,
    RTO_ALPHA,
    RTO_BETA,
    RTO_K,
    Ack,
    FlightInfo,
    PeerRefused,
    Receiver,
    ReliabilityError,
    RetransmitPolicy,
    RetryLimitExceeded,
    Sender,
    Transmit,
    get_policy,
    psn_add,
    psn_diff,
    psn_lt,
    register_policy,
)
from fabric.errors import FabricTimeout, PeerFailed
from fabric.testing import (
    FakeClock,
    MemoryLink,
    TransferResult,
    run_transfer,
    simulate_transfer,
)

NONE = PSN_MASK  # the cumulative ACK meaning "nothing received yet" when first_psn = 0


def make_sender(**kw: object) -> Sender[int]:
    args: dict[str, object] = dict(rto_initial=0.5, rto_min=0.25, rto_max=4.0, granularity=0.0)
    args.update(kw)
    return Sender(3, **args)  # type: ignore[arg-type]


def psns(ts: Iterable[Transmit[int]]) -> list[int]:
    return [t.psn for t in ts]


# ---------------------------------------------------------------------------
# constants and serial arithmetic
# ---------------------------------------------------------------------------


def test_constants_are_the_rfc_values() -> None:
    assert (RTO_ALPHA, RTO_BETA, RTO_K) == (1 / 8, 1 / 4, 4)  # RFC 6298 §2
    assert PACKET_THRESHOLD == 3  # RFC 9002 §6.1.1 kPacketThreshold
    assert set(POLICIES) >= {"selective", "gbn"}


def test_serial_number_arithmetic_wraps() -> None:
    assert psn_add(PSN_MASK, 1) == 0
    assert psn_add(0, -1) == PSN_MASK
    assert psn_diff(2, PSN_MASK - 1) == 4
    assert psn_diff(PSN_MASK - 1, 2) == -4
    assert psn_lt(PSN_MASK, 0) and not psn_lt(0, PSN_MASK)
    assert psn_diff(5, 5) == 0


# ---------------------------------------------------------------------------
# RTO: exact deadlines (RFC 6298)
# ---------------------------------------------------------------------------


def test_initial_rto_deadline() -> None:
    tx = make_sender()
    assert tx.get_timer() is None  # nothing in flight, no timer (RFC 6298 §5.2)
    out = tx.send(10, 100, now=2.0)
    assert psns(out) == [0]
    assert out[0].ack_req and not out[0].retransmit  # last of the burst asks for an ACK
    assert tx.get_timer() == 2.5  # rto_initial after the send
    assert tx.handle_timer(2.25) == []  # not yet due
    st0 = tx.statistics()
    assert (st0.srtt, st0.rttvar, st0.rto, st0.sent) == (None, None, 0.5, 1)


def test_first_rtt_sample_sets_srtt_rttvar_rto() -> None:
    tx = make_sender(rto_min=0.001)
    tx.send(0, 100, now=0.0)
    assert tx.handle_ack(0, 0, now=0.125) == []
    s = tx.statistics()
    # RFC 6298 §2.2: SRTT = R, RTTVAR = R/2, RTO = SRTT + max(G, K*RTTVAR) = R + 2R
    assert (s.srtt, s.rttvar, s.rto, s.min_rtt) == (0.125, 0.0625, 0.375, 0.125)
    assert tx.done and tx.get_timer() is None
    assert tx.pop_acked() == [0] and tx.pop_acked() == []
    tx.send(1, 100, now=1.0)
    assert tx.get_timer() == 1.375


def test_second_rtt_sample_follows_rfc6298_2_3() -> None:
    tx = make_sender(rto_min=0.001)
    tx.send(0, 100, now=0.0)
    tx.handle_ack(0, 0, now=0.125)
    tx.send(1, 100, now=1.0)
    tx.handle_ack(1, 0, now=1.25)  # R' = 0.25
    s = tx.statistics()
    rttvar = 0.75 * 0.0625 + 0.25 * abs(0.125 - 0.25)  # uses the old SRTT
    srtt = 0.875 * 0.125 + 0.125 * 0.25
    assert s.rttvar == pytest.approx(rttvar, rel=1e-15)
    assert s.srtt == pytest.approx(srtt, rel=1e-15)
    assert s.rto == pytest.approx(srtt + 4 * rttvar, rel=1e-15)
    assert s.min_rtt == 0.125


def test_rto_is_clamped_to_min_and_max() -> None:
    tx = make_sender(rto_min=0.25)
    tx.send(0, 1, now=0.0)
    tx.handle_ack(0, 0, now=0.015625)  # 3R = 0.046875 < rto_min
    assert tx.rto == 0.25
    tx = make_sender(rto_max=1.0, rto_initial=0.5)
    tx.send(0, 1, now=0.0)
    tx.handle_ack(0, 0, now=0.5)  # 3R = 1.5 > rto_max
    assert tx.rto == 1.0


def test_backoff_doubles_until_rto_max() -> None:
    tx = make_sender(rto_min=0.001, rto_max=3.0, max_retries=10)
    tx.send(0, 1, now=0.0)
    tx.handle_ack(0, 0, now=0.125)  # RTO = 0.375
    tx.send(1, 1, now=1.0)
    deadlines, rtos = [], []
    for _ in range(5):
        t = tx.get_timer()
        assert t is not None
        deadlines.append(t)
        out = tx.handle_timer(t)
        assert psns(out) == [1] and out[0].retransmit and out[0].ack_req
        rtos.append(tx.rto)
    # each deadline = previous retransmission + backed-off RTO (RFC 6298 §5.5)
    assert deadlines == [1.375, 2.125, 3.625, 6.625, 9.625]
    assert rtos == [0.75, 1.5, 3.0, 3.0, 3.0]
    s = tx.statistics()
    assert (s.timeouts, s.retransmitted, s.lost_declared) == (5, 5, 5)


def test_karn_no_sample_from_retransmitted_frame_and_backoff_kept() -> None:
    tx = make_sender(rto_min=0.001)
    tx.send(0, 1, now=0.0)
    tx.handle_ack(0, 0, now=0.125)  # SRTT 0.125, RTO 0.375
    tx.send(1, 1, now=1.0)
    tx.handle_timer(1.375)  # retransmit PSN 1, RTO -> 0.75
    tx.handle_ack(1, 0, now=1.5)  # ambiguous: original or retransmission?
    s = tx.statistics()
    assert s.srtt == 0.125 and s.rttvar == 0.0625  # Karn: no sample
    assert s.rto == 0.75  # the backed-off RTO stays until a valid sample
    tx.send(2, 1, now=2.0)
    tx.handle_ack(2, 0, now=2.125)  # a clean sample ends the backoff
    s = tx.statistics()
    assert s.rto == pytest.approx(0.125 + 4 * 0.75 * 0.0625)


def test_spurious_retransmit_detected_by_rtt_evidence() -> None:
    tx = make_sender(rto_min=0.001)
    tx.send(0, 1, now=0.0)
    tx.handle_ack(0, 0, now=0.125)  # min_rtt = 0.125
    tx.send(1, 1, now=1.0)
    assert psns(tx.handle_timer(1.375)) == [1]
    tx.handle_ack(1, 0, now=1.4)  # 25 ms after the resend < min_rtt / 2: the original's ACK
    tx.send(2, 1, now=2.0)
    t = tx.get_timer()
    assert t is not None and psns(tx.handle_timer(t)) == [2]
    tx.handle_ack(2, 0, now=t + 0.125)  # a full RTT after the resend: plausibly its own ACK
    assert tx.statistics().spurious_retransmits == 1


def test_per_frame_deadline_is_oldest_unacked_send_time_plus_rto() -> None:
    # a third frame stays queued behind the window (two in flight, a span of
    # four), so the stream's tail (early retransmit) does not apply
    tx = make_sender(window_frames=2, span_frames=4)
    tx.send(0, 1, now=0.0)
    tx.send(1, 1, now=0.25)
    tx.send(2, 1, now=0.25)
    assert tx.get_timer() == 0.5
    # SACK PSN 1 only: R = 0.125, RTO = 0.375; the pipe has room for PSN 2
    assert psns(tx.handle_ack(NONE, 0b10, now=0.375)) == [2]
    assert tx.rto == 0.375
    assert tx.get_timer() == 0.375  # PSN 0, sent at 0, with the new RTO
    tx.handle_ack(2, 0, now=0.4375)
    assert tx.get_timer() is None and tx.done


def test_early_retransmit_at_the_tail_of_a_stream() -> None:
    # RFC 5827: nothing left to send and every frame sent after PSN 0 acknowledged:
    # fewer than 3 suffice, after a round trip and RACK's reordering window
    tx = make_sender()
    tx.send_many([(0, 1), (1, 1), (2, 1)], now=0.0)
    assert psns(tx.handle_ack(NONE, 0b10, now=0.1)) == []  # PSN 1: R = 0.1
    assert psns(tx.handle_ack(NONE, 0b110, now=0.1)) == []
    # sent at 0, a round trip (0.1) and min RTT / 4 (0.025) later, well before the RTO
    assert tx.get_timer() == pytest.approx(0.125)
    assert psns(tx.handle_timer(0.12)) == []
    assert psns(tx.handle_timer(0.125)) == [0]
    tx.handle_ack(2, 0, now=0.2)
    assert tx.done and tx.statistics().timeouts == 0


def test_a_frame_overtaken_at_the_tail_is_not_resent() -> None:
    tx = make_sender()
    tx.send_many([(0, 1), (1, 1)], now=0.0)
    tx.handle_ack(NONE, 0b10, now=0.1)  # PSN 1 overtook PSN 0
    assert tx.get_timer() == pytest.approx(0.125)
    tx.handle_ack(1, 0, now=0.11)  # PSN 0 arrives within the reordering wait
    assert tx.done and tx.get_timer() is None
    assert tx.statistics().retransmitted == 0


def test_no_early_retransmit_while_frames_are_queued() -> None:
    tx = make_sender(window_frames=2, span_frames=4)
    tx.send_many([(0, 1), (1, 1), (2, 1)], now=0.0)
    # PSN 1 acked, PSN 2 goes out: one frame after PSN 0 is not three
    assert psns(tx.handle_ack(NONE, 0b10, now=0.1)) == [2]
    assert tx.statistics().lost_declared == 0


def test_a_span_wider_than_the_window_sends_past_a_hole() -> None:
    tx = make_sender(window_frames=2, span_frames=8)
    assert psns(tx.send_many([(i, 1) for i in range(8)], now=0.0)) == [0, 1]
    assert psns(tx.handle_ack(NONE, 0b10, now=0.1)) == [2]  # PSN 0 still missing
    assert psns(tx.handle_ack(NONE, 0b110, now=0.11)) == [3]
    assert tx.statistics().inflight == 2
    # PSNs 1-3 sent after PSN 0 acknowledged: lost; its resend and PSN 4 go
    assert psns(tx.handle_ack(NONE, 0b1110, now=0.12)) == [0, 4]


def test_a_lost_resend_is_found_by_the_frames_sent_after_it() -> None:
    tx = make_sender(window_frames=2, span_frames=16)
    tx.send_many([(i, 1) for i in range(12)], now=0.0)
    tx.handle_ack(NONE, 0b10, now=0.1)  # -> 2
    tx.handle_ack(NONE, 0b110, now=0.11)  # -> 3
    assert psns(tx.handle_ack(NONE, 0b1110, now=0.12)) == [0, 4]  # resend of 0 (lost)
    sack = 0b1110
    out: list[int] = []
    for k in (4, 5, 6):  # frames sent after the resend arrive; the resend does not
        sack |= 1 << k
        out += psns(tx.handle_ack(NONE, sack, now=0.13 + k / 100))
    assert out.count(0) == 1 and tx.statistics().timeouts == 0


def test_span_must_hold_the_window() -> None:
    with pytest.raises(ValueError, match="span_frames"):
        make_sender(window_frames=8, span_frames=4)


# ---------------------------------------------------------------------------
# loss detection
# ---------------------------------------------------------------------------


def test_packet_threshold_three_later_frames_acked() -> None:
    tx = make_sender()
    for i in range(8):
        tx.send(i, 1, now=0.0)
    # PSN 0 missing; 1 and 2 acknowledged by SACK (bit i = PSN cum+1+i = i)
    assert tx.handle_ack(NONE, 0b0110, now=0.01) == []
    out = tx.handle_ack(NONE, 0b1110, now=0.02)  # third later frame: PSN 0 is lost
    assert psns(out) == [0] and out[0].retransmit
    # the same evidence does not declare it lost again
    assert tx.handle_ack(NONE, 0b11110, now=0.03) == []
    assert tx.statistics().lost_declared == 1
    # new frames sent after the retransmission, acknowledged: lost again
    for i in range(8, 11):
        tx.send(i, 1, now=0.04)
    out = tx.handle_ack(NONE, 0b111_1111_1110, now=0.05)
    assert psns(out) == [0]
    assert tx.statistics().retransmitted == 2


def test_reordering_below_threshold_is_not_loss() -> None:
    tx = make_sender()
    for i in range(6):
        tx.send(i, 1, now=0.0)
    assert tx.handle_ack(NONE, 0b100, now=0.01) == []  # 1 later frame
    assert tx.handle_ack(NONE, 0b110, now=0.01) == []  # 2 later frames
    assert tx.handle_ack(2, 0, now=0.02) == []  # the reordered ones arrive
    assert tx.statistics().retransmitted == 0


def test_stale_and_invalid_acks() -> None:
    tx = make_sender()
    for i in range(4):
        tx.send(i, 1, now=0.0)
    tx.handle_ack(1, 0, now=0.01)
    tx.handle_ack(0, 0b10, now=0.02)  # older ACK arriving late; SACKs PSN 2
    assert tx.handle_ack(1000, 0, now=0.03) == []  # acknowledges unsent PSNs
    s = tx.statistics()
    assert (s.acks_stale, s.acks_invalid, s.acked) == (1, 1, 3)


def test_nack_retransmits_once_then_ignores_stale_nacks() -> None:
    tx = make_sender()
    for i in range(4):
        tx.send(i, 1, now=0.0)
    tx.handle_ack(0, 0, now=0.125)  # min_rtt 0.125
    out = tx.handle_nack(1, GAP_NACK_CODE, now=0.13)
    assert psns(out) == [1]
    assert tx.handle_nack(1, GAP_NACK_CODE, now=0.14) == []  # about the old copy
    assert psns(tx.handle_nack(1, NackCode.BAD_CHECKSUM, now=0.3)) == [1]  # new copy lost too
    assert tx.handle_nack(9, GAP_NACK_CODE, now=0.3) == []  # not in flight
    assert tx.handle_nack(2, NackCode.NO_RESOURCE, now=0.3) == []  # left to the RTO
    s = tx.statistics()
    assert (s.nacks_received, s.nacks_ignored, s.retransmitted) == (5, 3, 2)


@pytest.mark.parametrize("code", [NackCode.BAD_KEY, NackCode.PERMISSION, NackCode.UNKNOWN_JOB])
def test_fatal_nack_raises_peer_refused(code: NackCode) -> None:
    tx: Sender[int] = Sender(5, peer="sw0", operation="READ")
    tx.send(0, 1, now=0.0)
    with pytest.raises(PeerRefused) as exc:
        tx.handle_nack(0, code, now=0.1)
    msg = str(exc.value)
    assert "sw0" in msg and "flow 5" in msg and "PSN 0" in msg and "READ" in msg
    assert code.name in msg
    assert isinstance(exc.value, PeerFailed) and exc.value.code is code
    with pytest.raises(PeerRefused):  # the sender stays failed
        tx.handle_ack(0, 0, now=0.2)


def test_retry_limit_names_peer_flow_psn_operation() -> None:
    tx: Sender[int] = Sender(
        3,
        peer="w1",
        operation="WRITE stream",
        max_retries=8,
        rto_initial=0.0078125,
        rto_min=0.0078125,
        rto_max=1.0,
    )
    for i in range(18):
        tx.send(i, 10, now=0.0)
    tx.handle_ack(16, 0, now=0.0)  # 0..16 delivered, 17 is the one that never arrives
    for _ in range(8):
        t = tx.get_timer()
        assert t is not None
        assert psns(tx.handle_timer(t)) == [17]
    t = tx.get_timer()
    assert t is not None
    with pytest.raises(RetryLimitExceeded) as exc:
        tx.handle_timer(t)
    err = exc.value
    assert str(err).startswith("no ACK from w1 for flow 3 PSN 17 (WRITE stream) after 8 retrans")
    assert (err.peer, err.flow, err.psn, err.operation) == ("w1", 3, 17, "WRITE stream")
    assert isinstance(err, ReliabilityError) and isinstance(err, FabricTimeout)
    # RTO 1/128 s doubling, clamped at 1 s: 1/128 * (2**8 - 1) + 1
    assert err.elapsed == 2.9921875 and "over 2.99 s" in str(err)
    assert tx.get_timer() is None
    with pytest.raises(RetryLimitExceeded):
        tx.send(99, 1, now=10.0)



def test_give_up_s_keeps_retrying_past_the_count_until_its_time() -> None:
    """With a short ceiling the retry count alone would give up in a few tens of
    ms; ``give_up_s`` keeps the frame alive until that long after its first send."""
    tx: Sender[int] = Sender(3, peer="w1", max_retries=2, rto_initial=0.125, rto_min=0.125,
                             rto_max=0.25, give_up_s=2.0)
    tx.send(0, 10, now=0.0)
    times = []
    while True:
        t = tx.get_timer()
        assert t is not None
        try:
            assert psns(tx.handle_timer(t)) == [0]
        except RetryLimitExceeded as exc:
            assert t >= 2.0 and exc.elapsed == t
            break
        times.append(t)
    # 0.125, then 0.25 each (the ceiling), and no give-up before 2 s
    assert times[:3] == [0.125, 0.375, 0.625] and times[-1] < 2.0 <= times[-1] + 0.25
    assert len(times) > 2  # past max_retries


def test_jittered_backoff_is_seeded_and_bounded() -> None:
    import random

    def expiries(seed: str) -> list[float]:
        tx: Sender[int] = Sender(3, max_retries=50, rto_initial=0.125, rto_min=0.125,
                                 rto_max=1.0, rto_jitter=0.5, rng=random.Random(seed))
        tx.send(0, 10, now=0.0)
        out, last = [], 0.0
        for _ in range(8):
            t = tx.get_timer()
            assert t is not None
            tx.handle_timer(t)
            out.append(t - last)
            last = t
        return out

    a, b = expiries("x"), expiries("x")
    assert a == b  # a seed repeats
    assert a != expiries("y")
    assert a[0] == 0.125  # the first timeout is not backed off yet
    prev = a[0]
    for gap in a[1:]:  # twice the last, capped at 1 s, stretched by [0, 50%)
        lo = min(2 * prev, 1.0)
        assert lo <= gap < 1.5 * lo + 1e-12
        prev = gap
    assert max(a) > 1.0  # the ceiling is stretched too
    with pytest.raises(ValueError, match="needs an rng"):
        Sender(3, rto_jitter=0.5)
    with pytest.raises(ValueError, match="give_up_s"):
        Sender(3, give_up_s=-1.0)

# ---------------------------------------------------------------------------
# window
# ---------------------------------------------------------------------------


def test_window_frames_and_bytes_limit_flight() -> None:
    tx = make_sender(window_frames=4)
    out = tx.send_many([(i, 1) for i in range(10)], now=0.0)
    assert psns(out) == [0, 1, 2, 3]
    assert [t.ack_req for t in out] == [False, False, False, True]  # window full
    assert tx.statistics().queued == 6
    # SACKed frames still occupy the window (the receiver holds them)
    assert tx.handle_ack(NONE, 0b1110, now=0.1) == [Transmit(0, 0, 1, True, True)]
    assert psns(tx.handle_ack(3, 0, now=0.2)) == [4, 5, 6, 7]
    tb = make_sender(window_bytes=250)
    sent = []
    for i in range(4):
        sent += tb.send(i, 100, now=0.0)
    assert psns(sent) == [0, 1]
    big = make_sender(window_bytes=10)
    assert psns(big.send(0, 1000, now=0.0)) == [0]  # one frame always fits


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown retransmit policy 'nope'; valid: .*gbn"):
        Sender(1, policy="nope")
    with pytest.raises(ValueError, match="rto_initial"):
        Sender(1, rto_initial=10.0, rto_max=1.0)
    with pytest.raises(ValueError, match="window"):
        Receiver(1, window=0)


# ---------------------------------------------------------------------------
# receiver
# ---------------------------------------------------------------------------


def test_receiver_in_order_coalesces_acks() -> None:
    rx: Receiver[str] = Receiver(1, ack_every=2, max_ack_delay=0.001)
    got, ack = rx.handle_frame(0, "a", now=0.0)
    assert [d.handle for d in got] == ["a"] and ack is None
    assert rx.get_timer() == 0.001
    got, ack = rx.handle_frame(1, "b", now=0.0002)
    assert ack == Ack(1, 0) and rx.get_timer() is None
    rx.handle_frame(2, "c", now=0.01)
    assert rx.handle_timer(0.0105) is None
    assert rx.handle_timer(0.011) == Ack(2, 0)
    _, ack = rx.handle_frame(3, "d", now=0.02, flags=Flag.ACK_REQ)
    assert ack == Ack(3, 0)  # ACK_REQ: at once


def test_receiver_buffers_gap_sacks_and_nacks_once_per_interval() -> None:
    rx: Receiver[int] = Receiver(1, nack_interval=0.5)
    got, ack = rx.handle_frame(1, 1, now=0.0)
    assert got == [] and ack == Ack(NONE, 0b10)  # bit i = PSN cum+1+i
    rx.handle_frame(2, 2, now=0.0)
    got, ack = rx.handle_frame(4, 4, now=0.0)
    assert ack is not None and ack.sack == 0b10110 and ack.nack_psn == 0  # 3 after the gap
    assert ack.nack_code is GAP_NACK_CODE
    _, ack = rx.handle_frame(5, 5, now=0.1)
    assert ack is not None and ack.nack_psn is None  # this gap was NACKed < 0.5 s ago
    _, ack = rx.handle_frame(6, 6, now=0.6)
    assert ack is not None and ack.nack_psn == 0
    got, ack = rx.handle_frame(0, 0, now=0.7, flags=Flag.RETX)
    assert [d.handle for d in got] == [0, 1, 2]  # the gap is filled: in order
    assert ack == Ack(2, 0b1110)  # 3 missing; 4, 5, 6 held
    got, _ = rx.handle_frame(3, 3, now=0.8)
    assert [d.psn for d in got] == [3, 4, 5, 6]
    s = rx.statistics()
    assert (s.delivered, s.buffered, s.max_buffered, s.nacks_sent) == (7, 0, 5, 2)


def test_receiver_duplicates_and_out_of_window() -> None:
    rx: Receiver[int] = Receiver(1, window=4)
    rx.handle_frame(0, 0, now=0.0)
    rx.handle_frame(2, 2, now=0.0)
    got, ack = rx.handle_frame(0, 0, now=0.0, flags=Flag.RETX)
    assert got == [] and ack == Ack(0, 0b10)  # duplicates are ACKed at once
    got, ack = rx.handle_frame(2, 2, now=0.0)
    assert got == [] and ack is not None
    got, ack = rx.handle_frame(5, 5, now=0.0)  # window is PSN 1..4
    assert got == [] and ack is not None
    s = rx.statistics()
    assert (s.duplicates, s.duplicate_retransmits, s.out_of_window) == (2, 1, 1)


def test_receiver_unordered_delivers_once_on_arrival() -> None:
    rx: Receiver[int] = Receiver(1, ordered=False)
    seen = []
    for p in [3, 1, 0, 3, 2, 1, 4]:
        got, _ = rx.handle_frame(p, p, now=0.0)
        seen += [d.handle for d in got]
    assert seen == [3, 1, 0, 2, 4] and rx.cum_psn == 4


def test_gbn_receiver_discards_out_of_order_and_nacks() -> None:
    rx: Receiver[int] = Receiver(1, policy="gbn", nack_interval=1.0)
    rx.handle_frame(0, 0, now=0.0)
    got, ack = rx.handle_frame(2, 2, now=0.0)
    assert got == [] and ack is not None and ack.nack_psn == 1 and ack.sack == 0
    got, ack = rx.handle_frame(3, 3, now=0.1)
    assert got == [] and ack is None  # NACKed already, frame silently dropped
    got, _ = rx.handle_frame(1, 1, now=0.2)
    assert [d.psn for d in got] == [1]  # 2 and 3 were discarded, must be resent
    assert rx.statistics().discarded_out_of_order == 2


def test_receiver_state_is_bounded_by_window() -> None:
    import random

    rng = random.Random(7)
    rx: Receiver[int] = Receiver(1, window=16)
    for _ in range(5000):
        p = psn_add(rx.cum_psn, rng.randint(-40, 40))
        rx.handle_frame(p, p, now=0.0)
        assert len(rx._held) <= 15 and rx._bits < 1 << 16
    assert rx.statistics().max_buffered <= 15


def test_ack_frames_encode_for_the_codec() -> None:
    frames = Ack(7, (1 << 63) | 5, nack_psn=8).frames(src=2, dst=1, flow=9, crc=True)
    ack, nack = (decode(f) for f in frames)
    assert (ack.op, ack.psn, ack.sack, ack.flow, ack.src, ack.dst) == (
        Op.ACK,
        7,
        (1 << 63) | 5,
        9,
        2,
        1,
    )
    assert (nack.op, nack.psn, nack.nack_code) == (Op.NACK, 8, GAP_NACK_CODE)
    assert len(Ack(1, 0).frames(src=0, dst=1, flow=1)) == 1  # no NACK, no CRC: 32 B
    assert len(Ack(1, 0).frames(src=0, dst=1, flow=1)[0]) == 32


# ---------------------------------------------------------------------------
# PSN wraparound
# ---------------------------------------------------------------------------


def test_psn_wraparound_unit() -> None:
    first = PSN_MASK - 1  # PSNs 2**32-2, 2**32-1, 0, 1, ...
    tx: Sender[int] = Sender(1, first_psn=first)
    rx: Receiver[int] = Receiver(1, first_psn=first)
    out = []
    for i in range(5):
        out += tx.send(i, 1, now=0.0)
    assert psns(out) == [PSN_MASK - 1, PSN_MASK, 0, 1, 2]
    # lose the frame at 2**32-1; the rest arrive
    acks = []
    for t in out:
        if t.psn != PSN_MASK:
            got, ack = rx.handle_frame(t.psn, t.handle, now=0.0)
            acks.append(ack)
    last = acks[-1]
    assert last is not None and last.cum_psn == PSN_MASK - 1 and last.sack == 0b1110
    retx = tx.handle_ack(last.cum_psn, last.sack, now=0.01)
    assert psns(retx) == [PSN_MASK]
    got, ack = rx.handle_frame(PSN_MASK, 1, now=0.02, flags=Flag.RETX)
    assert [d.handle for d in got] == [1, 2, 3, 4] and ack == Ack(2, 0)
    tx.handle_ack(ack.cum_psn, ack.sack, now=0.03)
    assert tx.done and tx.next_psn == 3


def test_psn_wraparound_transfer_under_loss() -> None:
    res = simulate_transfer(
        "selective", "loss=0.03", messages=600, seed=4, first_psn=PSN_MASK - 250
    )
    assert res.completed and res.delivered == list(range(600))
    assert res.sender.retransmitted >= res.forward.faults.lost > 0


# ---------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------


class ProbeNext(RetransmitPolicy):
    """Toy policy: resend each lost frame and also the next unacknowledged one."""

    name = "probe-next"
    receiver_buffers = True

    def on_loss(self, lost: Sequence[int], flight: Sequence[FlightInfo]) -> list[int]:
        order = [f.psn for f in flight if not f.acked]
        out = []
        for p in lost:
            out.append(p)
            i = order.index(p)
            if i + 1 < len(order):
                out.append(order[i + 1])
        return out


def test_custom_policy_registers_and_runs() -> None:
    register_policy("probe-next", ProbeNext)
    try:
        assert get_policy("probe-next") is ProbeNext
        with pytest.raises(ValueError, match="already registered"):
            register_policy("probe-next", type("Other", (ProbeNext,), {}))
        tx: Sender[int] = Sender(1, policy="probe-next")
        for i in range(6):
            tx.send(i, 1, now=0.0)
        out = tx.handle_ack(NONE, 0b111000, now=0.01)  # 3,4,5 acked -> 0,1,2 lost
        assert psns(out) == [0, 1, 2]
        res = _transfer("probe-next", "loss=0.02", n=500)
        assert res.completed and res.delivered == list(range(500))
        assert res.sender.retransmitted > res.sender.lost_declared  # it resends extra
    finally:
        del POLICIES["probe-next"]


def test_register_policy_rejects_non_policies() -> None:
    with pytest.raises(TypeError):
        register_policy("bad", int)  # type: ignore[arg-type]


def _transfer(policy: str, faults: str, *, n: int, seed: int = 1) -> TransferResult:
    return simulate_transfer(policy, faults, back_faults="", messages=n, seed=seed)


# ---------------------------------------------------------------------------
# simulated transfers on the in-memory link
# ---------------------------------------------------------------------------


def test_reordering_below_three_causes_zero_retransmits() -> None:
    for policy_threshold, spec in ((3, "reorder=0.3:2:20us"), (4, "reorder=0.3:3:20us")):
        clock = FakeClock()
        fwd = MemoryLink(FaultInjector(spec + ",delay=5us", 11), clock, bandwidth_gbps=10)
        back = MemoryLink(FaultInjector("delay=5us", 11, stream="b"), clock, bandwidth_gbps=10)
        tx: Sender[int] = Sender(
            1, rto_initial=0.001, rto_min=0.0002, packet_threshold=policy_threshold
        )
        rx: Receiver[int] = Receiver(1, packet_threshold=policy_threshold, nack_interval=0.0002)
        res = run_transfer(tx, rx, [(i, 1024) for i in range(2000)], fwd, back, clock)
        assert res.completed and res.delivered == list(range(2000))
        assert res.forward.faults.reordered > 400
        assert res.sender.retransmitted == 0
        assert res.sender.spurious_retransmits == 0 and res.receiver.duplicates == 0


def test_selective_retransmits_about_once_per_loss_and_beats_gbn() -> None:
    sel = simulate_transfer("selective", "loss=0.01", back_faults="", messages=4000, seed=2)
    gbn = simulate_transfer("gbn", "loss=0.01", back_faults="", messages=4000, seed=2)
    for r in (sel, gbn):
        assert r.completed and r.delivered == list(range(4000))
    assert sel.data_frames_lost > 10
    assert sel.sender.retransmitted / sel.data_frames_lost <= 1.1
    assert gbn.sender.retransmitted > 2 * sel.sender.retransmitted
    assert sel.goodput_gbps > gbn.goodput_gbps


def test_transfer_with_every_fault_completes_in_order() -> None:
    for policy in ("selective", "gbn"):
        res = simulate_transfer(
            policy,
            "loss=0.02,dup=0.02,reorder=0.05:2:20us,corrupt=0.01,delay=5us:2us",
            messages=800,
            seed=5,
        )
        assert res.completed and res.delivered == list(range(800)), policy
        assert res.corrupt_dropped > 0 and res.forward.faults.duplicated > 0


# ---------------------------------------------------------------------------
# property: random schedules of loss, duplication, reordering and delay
# ---------------------------------------------------------------------------


class ReliabilityMachine(RuleBasedStateMachine):
    """A Sender and Receiver over a network the test controls frame by frame."""

    POLICY = "selective"
    ORDERED = True
    WINDOW = 8
    FIRST = PSN_MASK - 5  # cross the 2**32 wrap in most runs

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.tx: Sender[int] = Sender(
            7,
            policy=self.POLICY,
            window_frames=self.WINDOW,
            max_retries=1_000_000,
            rto_initial=0.004,
            rto_min=0.001,
            rto_max=0.016,
            first_psn=self.FIRST,
        )
        self.rx: Receiver[int] = Receiver(
            7,
            policy=self.POLICY,
            ordered=self.ORDERED,
            window=self.WINDOW,
            first_psn=self.FIRST,
            nack_interval=0.001,
        )
        self.n = 0
        self.data: list[tuple[int, int, Flag]] = []
        self.back: list[tuple[str, int, int]] = []
        self.delivered: list[int] = []

    # -- helpers --
    def _put(self, ts: list[Transmit[int]]) -> None:
        self.data += [(t.psn, t.handle, t.flags) for t in ts]

    def _to_rx(self, frame: tuple[int, int, Flag]) -> None:
        got, ack = self.rx.handle_frame(frame[0], frame[1], self.now, flags=frame[2])
        self.delivered += [d.handle for d in got]
        self._feedback(ack)

    def _feedback(self, ack: Ack | None) -> None:
        if ack is not None:
            self.back.append(("ack", ack.cum_psn, ack.sack))
            if ack.nack_psn is not None:
                self.back.append(("nack", ack.nack_psn, int(ack.nack_code)))

    def _to_tx(self, fb: tuple[str, int, int]) -> None:
        kind, a, b = fb
        if kind == "ack":
            self._put(self.tx.handle_ack(a, b, self.now))
        else:
            self._put(self.tx.handle_nack(a, b, self.now))

    def _timers(self) -> None:
        t = self.rx.get_timer()
        if t is not None and t <= self.now:
            self._feedback(self.rx.handle_timer(self.now))
        t = self.tx.get_timer()
        if t is not None and t <= self.now:
            self._put(self.tx.handle_timer(self.now))

    # -- rules --
    @rule(k=st.integers(1, 4))
    def send(self, k: int) -> None:
        for _ in range(k):
            self._put(self.tx.send(self.n, 100, self.now))
            self.n += 1

    @rule(i=st.integers(0, 63), keep_copy=st.booleans())
    def deliver_data(self, i: int, keep_copy: bool) -> None:
        if self.data:
            j = i % len(self.data)  # any frame, not just the oldest: reordering
            frame = self.data[j] if keep_copy else self.data.pop(j)  # keep = duplicate
            self._to_rx(frame)

    @rule(i=st.integers(0, 63))
    def lose_data(self, i: int) -> None:
        if self.data:
            self.data.pop(i % len(self.data))

    @rule(i=st.integers(0, 63), keep_copy=st.booleans())
    def deliver_feedback(self, i: int, keep_copy: bool) -> None:
        if self.back:
            j = i % len(self.back)
            fb = self.back[j] if keep_copy else self.back.pop(j)
            self._to_tx(fb)

    @rule(i=st.integers(0, 63))
    def lose_feedback(self, i: int) -> None:
        if self.back:
            self.back.pop(i % len(self.back))

    @rule(dt=st.sampled_from([0.0001, 0.0005, 0.001, 0.003, 0.01]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._timers()

    # -- invariants --
    @invariant()
    def exactly_once_and_in_order(self) -> None:
        if self.ORDERED:
            assert self.delivered == list(range(len(self.delivered)))
        else:
            assert len(set(self.delivered)) == len(self.delivered)
            assert set(self.delivered) <= set(range(self.n))

    @invariant()
    def state_is_bounded(self) -> None:
        s = self.tx.statistics()
        assert s.inflight <= self.WINDOW and len(self.tx._flight) <= self.WINDOW
        r = self.rx.statistics()
        assert r.buffered < self.WINDOW and len(self.rx._held) < self.WINDOW
        assert self.rx._bits < 1 << self.WINDOW

    def teardown(self) -> None:
        # The schedule is over: a perfect network from now on. Everything completes.
        for _ in range(20_000):
            if self.tx.done and not self.data and not self.back:
                break
            if self.data:
                self._to_rx(self.data.pop(0))
            elif self.back:
                self._to_tx(self.back.pop(0))
            else:
                timers = [t for t in (self.rx.get_timer(), self.tx.get_timer()) if t is not None]
                assert timers, "nothing in flight, no timer, but the sender is not done"
                self.now = max(self.now, min(timers))
                self._timers()
        assert self.tx.done
        if self.ORDERED:
            assert self.delivered == list(range(self.n))
        else:
            assert sorted(self.delivered) == list(range(self.n))


class GoBackNMachine(ReliabilityMachine):
    POLICY = "gbn"


class UnorderedMachine(ReliabilityMachine):
    ORDERED = False


_machine_settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSelectiveMachine = ReliabilityMachine.TestCase
TestSelectiveMachine.settings = _machine_settings
TestGoBackNMachine = GoBackNMachine.TestCase
TestGoBackNMachine.settings = _machine_settings
TestUnorderedMachine = UnorderedMachine.TestCase
TestUnorderedMachine.settings = _machine_settings
