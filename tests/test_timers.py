"""Aggregation retransmit timers: exact deadlines on a fake clock (RFC 6298)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.core.timers import ChunkTimers, RttEstimator


def test_first_sample_then_smoothing() -> None:
    est = RttEstimator(rto_initial=0.1, rto_min=0.001, rto_max=2.0)
    assert est.rto == 0.1
    est.sample(0.010)  # SRTT = R, RTTVAR = R/2, RTO = R + 4 R/2
    assert est.srtt == pytest.approx(0.010) and est.rttvar == pytest.approx(0.005)
    assert est.rto == pytest.approx(0.030)
    est.sample(0.018)  # RTTVAR = 3/4*5ms + 1/4*8ms; SRTT = 7/8*10 + 1/8*18
    assert est.rttvar == pytest.approx(0.00575)
    assert est.srtt == pytest.approx(0.011)
    assert est.rto == pytest.approx(0.011 + 4 * 0.00575)


def test_rto_clamped() -> None:
    est = RttEstimator(rto_min=0.005, rto_max=0.05)
    est.sample(1e-6)
    assert est.rto == 0.005
    est.sample(10.0)
    assert est.rto == 0.05


def test_backoff_doubles_and_karn_skips_retransmitted_samples() -> None:
    est = RttEstimator(rto_initial=0.1, rto_min=0.001, rto_max=10.0)
    t = ChunkTimers(est, give_up_s=5.0)
    t.sent(0, now=0.0)
    t.sent(1, now=0.0)
    assert t.next_deadline() == pytest.approx(0.1)
    assert t.expired(0.05) == ([], [])
    assert t.expired(0.1) == ([0, 1], [])
    assert t.next_deadline() == pytest.approx(0.1 + 0.2)  # doubled
    assert t.expired(0.31) == ([0, 1], [])
    assert t.next_deadline() == pytest.approx(0.31 + 0.4)
    assert t.acked(0, now=0.32) == (True, [])  # retransmitted: Karn, no sample
    assert est.srtt is None
    assert t.acked(0, now=0.33) == (False, [])  # a duplicate result
    t.sent(2, now=0.4)
    assert t.acked(2, now=0.41)[0]
    assert est.srtt == pytest.approx(0.01)
    assert t.retransmits == 4
    assert t.expiries == 4  # every resend here was a timer running out


def test_gives_up_after_the_limit() -> None:
    t = ChunkTimers(RttEstimator(rto_initial=1.0, rto_max=1.0), give_up_s=2.5)
    t.sent(7, now=0.0)
    assert t.expired(1.0) == ([7], [])
    assert t.expired(2.0) == ([7], [])
    assert t.expired(3.0) == ([], [7])


def test_a_chunk_overtaken_by_three_later_results_is_resent_at_once() -> None:
    t = ChunkTimers(RttEstimator(rto_initial=1.0), give_up_s=10.0)
    for c in range(5):
        t.sent(c, now=0.0)
    assert t.acked(1, now=0.01) == (True, [])
    assert t.acked(2, now=0.02) == (True, [])
    assert t.acked(3, now=0.03) == (True, [0])  # three later results: chunk 0 was lost
    rto = t.rtt.rto
    assert t.fast_retransmits == 1 and t.expiries == 0  # resent without waiting out a timer
    assert t.acked(4, now=0.04) == (True, [])  # 0 was just resent: its count restarts
    assert t.next_deadline() == pytest.approx(0.03 + 2 * rto)  # backed off once


def test_only_chunks_the_switch_says_are_complete_are_resent_when_overtaken() -> None:
    # chunk 0 is overtaken by 1, 2, 3; the switch's mark says chunks below 0 are
    # complete (0 still waits for another member): no resend, its timer stays
    t = ChunkTimers(RttEstimator(rto_initial=0.5), give_up_s=10.0)
    for c in range(5):
        t.sent(c, 0.0)
    for c in (1, 2, 3):
        assert t.acked(c, 0.01, complete_below=0)[1] == []
    assert t.outstanding(0) and t.retransmits == 0
    # once the mark passes it, the next result says its result was lost: resend
    assert t.acked(4, 0.02, complete_below=4)[1] == [0]
    assert t.retransmits == 1


def test_the_known_wire_time_waits_beside_the_rto_and_stays_out_of_the_sample() -> None:
    est = RttEstimator(rto_initial=0.1, rto_min=0.001, rto_max=10.0)
    t = ChunkTimers(est, give_up_s=5.0)
    t.sent(0, now=0.0, allowance=0.5)  # e.g. 256 KiB each way at 10 Mbit/s
    assert len(t) == 1  # in flight
    assert t.next_deadline() == pytest.approx(0.6)
    assert t.expired(0.55) == ([], [])
    assert t.acked(0, now=0.52) == (True, [])
    assert est.srtt == pytest.approx(0.02)  # the wire time is not RTT to learn
    t.sent(1, now=1.0, allowance=0.5)
    assert t.expired(1.0 + 0.5 + est.rto) == ([1], [])
    # the resend waits for its wire time again, beside the backed-off RTO
    assert t.next_deadline() == pytest.approx(1.0 + 0.5 + 0.06 + 0.5 + 0.12)


def test_a_backed_off_rto_is_kept_until_a_sample_and_one_loss_backs_off_once() -> None:
    """RFC 6298 §5.5 and Karn: timers that fire because the RTO is below the true RTT
    must not keep firing on every later chunk (each resend denies the sample)."""
    est = RttEstimator(rto_initial=0.1, rto_min=0.001, rto_max=10.0)
    t = ChunkTimers(est, give_up_s=50.0)
    true_rtt = 0.35
    now = 0.0
    spurious = []
    for chunk in range(6):  # one chunk at a time, each answered after true_rtt
        t.sent(chunk, now)
        resends = 0
        while t.next_deadline() < now + true_rtt:
            resends += len(t.expired(t.next_deadline())[0])
        spurious.append(resends)
        t.acked(chunk, now + true_rtt)
        now += 1.0
    # 0.1 -> 0.2 -> 0.4 in the first chunk; the second waits 0.4 and samples
    assert spurious == [2, 0, 0, 0, 0, 0]
    assert est.srtt == pytest.approx(true_rtt)
    # 8 chunks sent a little apart under one RTO, all lost: one doubling, not eight
    est2 = RttEstimator(rto_initial=0.1, rto_min=0.001, rto_max=10.0)
    t2 = ChunkTimers(est2, give_up_s=50.0)
    for c in range(8):
        t2.sent(c, now=c * 0.001)
    for c in range(8):
        assert t2.expired(0.1 + c * 0.001) == ([c], [])
    assert est2.rto == pytest.approx(0.2)



# ------------------------------------------------------------------ Deadlines
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.one_of(st.none(), st.floats(0, 100)),
                          st.booleans()), max_size=60))
def test_deadlines_agree_with_a_scan(steps) -> None:
    """The lazy heap answers as a scan over every key would, whatever the order
    of sets, finishes and takes."""
    from fabric.core.timers import Deadlines

    d, want, finished = Deadlines(), {}, set()
    for key, t, take in steps:
        if take:
            now = 50.0
            due = d.take_due(now)
            expect = sorted((v, k) for k, v in want.items() if v <= now)
            assert due == [k for _, k in expect]
            for k in due:
                del want[k]
        elif key in finished:
            continue
        elif t is None and key % 3 == 0:
            assert d.set_done(key) is True
            assert d.set_done(key) is False
            finished.add(key)
            want.pop(key, None)
        else:
            d.set(key, t)
            if t is None:
                want.pop(key, None)
            else:
                want[key] = t
        assert d.earliest() == (min(want.values()) if want else None)
