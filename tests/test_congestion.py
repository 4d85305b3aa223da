"""The pure congestion mechanisms on a fake clock: shared buffer, ECN, PFC, and the
congestion-control policies' own reactions (fabric/core/congestion/).

Fairness and queue targets of the policies through a bottleneck are in
tests/test_congestion_cc.py (they need the simulated network)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.core.congestion import (
    CC_POLICIES,
    Admission,
    CcPath,
    CongestionConfigError,
    CongestionControl,
    PauseState,
    PfcEvent,
    PfcIngress,
    RedMarker,
    SharedBuffer,
    find_pause_cycle,
    get_cc,
    make_cc,
    register_cc,
)
from fabric.core.congestion.dcqcn import (
    ALPHA_TIMER_S,
    CNP_INTERVAL_S,
    FAST_RECOVERY_STEPS,
    INCREASE_TIMER_S,
    CnpPacer,
    Dcqcn,
    G,
)
from fabric.core.congestion.eqds import CreditPacer, Eqds
from fabric.core.congestion.nscc import Nscc
from fabric.core.congestion.policy import FIXED_WINDOW_BDP, FixedWindow
from fabric.testing import FakeClock

PATH = CcPath(link_gbps=100.0, base_rtt_s=12e-6, mtu=4150, trimming=True)


# ---------------------------------------------------------------------- buffer
def test_static_pool_drops_exactly_what_overflows() -> None:
    buf = SharedBuffer(10_000, alpha=math.inf)
    got = [buf.offer(0, 0, 1000) for _ in range(12)]
    assert got == [Admission.ACCEPT] * 10 + [Admission.DROP] * 2
    assert (buf.used, buf.accepted, buf.drops, buf.trims) == (10_000, 10, 2, 0)
    buf.release(0, 0, 1000)
    assert buf.offer(0, 0, 1000) is Admission.ACCEPT
    assert buf.offer(0, 0, 1) is Admission.DROP


def test_trimming_keeps_the_header_in_its_class_until_even_that_does_not_fit() -> None:
    buf = SharedBuffer(3100, alpha=math.inf, trim_bytes=64)
    assert [buf.offer(1, 0, 1000, trim_tc=7) for _ in range(3)] == [Admission.ACCEPT] * 3
    assert buf.offer(1, 0, 1000, trim_tc=7) is Admission.TRIM  # 100 B free: header fits
    assert buf.queue_bytes(1, 7) == 64 and buf.queue_bytes(1, 0) == 3000
    assert buf.offer(1, 0, 1000) is Admission.DROP  # no class for a header: dropped
    assert buf.offer(1, 0, 1000, trim_tc=7) is Admission.DROP  # 36 B free: no header fits
    assert (buf.accepted, buf.trims, buf.drops, buf.used) == (3, 1, 2, 3064)


def test_dynamic_threshold_admits_by_alpha_times_free() -> None:
    """alpha 1, 1000 B: a queue may grow while q + n <= free (Choudhury-Hahne)."""
    buf = SharedBuffer(1000, alpha=1.0)
    first = [buf.offer(0, 0, 100) for _ in range(7)]
    # q before: 0,100,..,400 fit (q+100 <= 1000-q); at q=500: 600 > 500
    assert first == [Admission.ACCEPT] * 5 + [Admission.DROP] * 2
    second = [buf.offer(1, 0, 100) for _ in range(5)]
    # free 500: q2+100 <= 500-q2 for q2 = 0, 100; at q2 = 200: 300 <= 300 still fits
    assert second == [Admission.ACCEPT] * 3 + [Admission.DROP] * 2
    assert buf.threshold() == 200.0
    assert buf.statistics().queue_peaks == {"0/0": 500, "1/0": 300}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(1, 900),
                          st.booleans()), min_size=1, max_size=200),
       st.sampled_from([0.25, 1.0, 4.0, math.inf]), st.integers(0, 80))
def test_buffer_accounting_invariants(ops: list[tuple[int, int, int, bool]], alpha: float,
                                      trim: int) -> None:
    buf = SharedBuffer(4000, alpha=alpha, trim_bytes=trim)
    held: dict[tuple[int, int], list[int]] = {}
    offers = 0
    for port, tc, n, release in ops:
        key = (port, tc)
        if release and held.get(key):
            buf.release(port, tc, held[key].pop(0))
            continue
        offers += 1
        before_q, before_free = buf.queue_bytes(port, tc), buf.free
        verdict = buf.offer(port, tc, n, trim_tc=2)
        if verdict is Admission.ACCEPT:
            assert n <= before_free and before_q + n <= alpha * before_free
            held.setdefault(key, []).append(n)
        elif verdict is Admission.TRIM:
            assert trim and (n > before_free or before_q + n > alpha * before_free)
            held.setdefault((port, 2), []).append(trim)
        assert buf.used == sum(sum(v) for v in held.values()) <= buf.size
        assert all(buf.queue_bytes(p, c) == sum(v) for (p, c), v in held.items())
    assert buf.accepted + buf.trims + buf.drops == offers


def test_buffer_refuses_bad_settings_and_bad_release() -> None:
    for bad in (-1, math.nan, 1 << 40):
        with pytest.raises(CongestionConfigError):
            SharedBuffer(bad)
    with pytest.raises(CongestionConfigError, match="alpha"):
        SharedBuffer(1000, alpha=0.0)
    buf = SharedBuffer(1000)
    buf.offer(0, 0, 100)
    with pytest.raises(ValueError, match="holds 100"):
        buf.release(0, 0, 200)


# ---------------------------------------------------------------------- ECN
def test_red_probability_is_piecewise_linear() -> None:
    red = RedMarker(100, 300, 0.2, random.Random(0))
    got = [red.probability(q) for q in (0, 100, 150, 200, 300, 301, 10_000)]
    assert got == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.2, 1.0, 1.0])


@pytest.mark.parametrize("queue,p", [(150, 0.05), (200, 0.1), (290, 0.19), (500, 1.0), (50, 0.0)])
def test_red_marks_at_its_probability(queue: int, p: float) -> None:
    n = 20_000
    red = RedMarker(100, 300, 0.2, random.Random(7))
    marks = sum(red.mark(queue) for _ in range(n))
    assert red.seen == n and red.marked == marks
    assert abs(marks / n - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_red_is_reproducible_from_its_seed() -> None:
    a, b = (RedMarker(0, 1000, 1.0, random.Random(3)) for _ in range(2))
    qs = [random.Random(1).randrange(1200) for _ in range(500)]
    assert [a.mark(q) for q in qs] == [b.mark(q) for q in qs]


def test_red_refuses_kmin_above_kmax_and_bad_pmax() -> None:
    with pytest.raises(CongestionConfigError, match="Kmin 500 B is above Kmax 400 B"):
        RedMarker(500, 400, 0.2, random.Random(0))
    for pmax in (0.0, 1.5, math.nan):
        with pytest.raises(CongestionConfigError, match="Pmax"):
            RedMarker(1, 2, pmax, random.Random(0))


# ---------------------------------------------------------------------- PFC
def test_pfc_pauses_above_xoff_and_resumes_at_xon() -> None:
    pfc = PfcIngress(mtu=1000, headroom_bytes=2000, xoff_bytes=3000, resume_offset_bytes=1000)
    events = [pfc.on_enqueue(4, 3, 1000, free_bytes=10**6) for _ in range(5)]
    assert events == [None, None, None, PfcEvent(4, 3, True), None]
    assert pfc.is_paused(4, 3) and pfc.held(4, 3) == 5000 and pfc.pauses_sent == 1
    # XON = XOFF - offset = 2000: resumes when the fourth frame has left
    out = [pfc.on_dequeue(4, 3, 1000, free_bytes=10**6) for _ in range(4)]
    assert out == [None, None, PfcEvent(4, 3, False), None]
    assert not pfc.is_paused(4, 3) and pfc.headroom_overflows == 0
    # another class on the same port is independent
    assert pfc.on_enqueue(4, 0, 3500, free_bytes=10**6) == PfcEvent(4, 0, True)


def test_pfc_dynamic_threshold_and_headroom_overflow() -> None:
    pfc = PfcIngress(mtu=500, headroom_bytes=500, alpha=0.125)
    assert pfc.threshold(8000) == 1000.0
    assert pfc.on_enqueue(0, 0, 1000, free_bytes=8000) is None  # 1000 <= 1000
    assert pfc.on_enqueue(0, 0, 1, free_bytes=7999) == PfcEvent(0, 0, True)
    # paused at 1001 B: the headroom takes 500 B more, whatever the threshold does
    assert pfc.on_enqueue(0, 0, 500, free_bytes=7500) is None
    assert pfc.headroom_overflows == 0
    assert pfc.on_enqueue(0, 0, 1, free_bytes=7499) is None
    assert pfc.headroom_overflows == 1
    with pytest.raises(ValueError, match="holds 1502"):
        pfc.on_dequeue(0, 0, 3000, free_bytes=7000)


def test_pfc_refuses_headroom_below_one_mtu_and_ambiguous_thresholds() -> None:
    with pytest.raises(CongestionConfigError, match="headroom 4000 B is below one MTU"):
        PfcIngress(mtu=4150, headroom_bytes=4000, xoff_bytes=10_000)
    with pytest.raises(CongestionConfigError, match="either"):
        PfcIngress(mtu=1000, headroom_bytes=1000, xoff_bytes=1, alpha=0.1)
    with pytest.raises(CongestionConfigError, match="either"):
        PfcIngress(mtu=1000, headroom_bytes=1000)


def test_pause_state_counts_pauses_time_and_the_watchdog() -> None:
    clock = FakeClock()
    ps = PauseState()
    clock.advance(1.0)
    ps.pause(3, clock.now)
    ps.pause(3, clock.now + 0.1)  # repeated: no new pause
    clock.advance(0.5)
    ps.resume(3, clock.now)
    ps.resume(3, clock.now)  # no pause pending: nothing
    clock.advance(0.5)
    ps.pause(3, clock.now)
    ps.pause(1, clock.now)
    clock.advance(0.25)
    assert ps.pauses == 3 and ps.is_paused(3) and ps.is_paused(1) and not ps.is_paused(0)
    assert ps.paused_s(clock.now, 3) == pytest.approx(0.75)
    assert ps.paused_s(clock.now) == pytest.approx(1.0)
    assert ps.stuck(clock.now, 0.2) == [1, 3] and ps.stuck(clock.now, 0.3) == []


def test_deadlock_cycle_found_and_named_the_same_way() -> None:
    ring = {("s1", 2): [("s2", 2)], ("s2", 2): [("s3", 1)], ("s3", 1): [("s1", 2)],
            ("s0", 1): [("s1", 2)]}
    assert find_pause_cycle(ring) == [("s1", 2), ("s2", 2), ("s3", 1)]
    rotated = {k: v for k, v in reversed(list(ring.items()))}
    assert find_pause_cycle(rotated) == [("s1", 2), ("s2", 2), ("s3", 1)]
    assert find_pause_cycle({"a": ["b"], "b": ["c"], "c": []}) is None
    assert find_pause_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None  # a diamond
    assert find_pause_cycle({"x": ["x"]}) == ["x"]
    assert find_pause_cycle({}) is None


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(0, 7), st.lists(st.integers(0, 7), max_size=3), max_size=8))
def test_deadlock_detection_agrees_with_a_reachability_check(g: dict[int, list[int]]) -> None:
    def reach(a: int) -> set[int]:
        seen, todo = set(), list(g.get(a, []))
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo += g.get(x, [])
        return seen

    has_cycle = any(a in reach(a) for a in g)
    cycle = find_pause_cycle(g)
    assert (cycle is not None) == has_cycle
    if cycle is not None:
        for i, node in enumerate(cycle):
            assert cycle[(i + 1) % len(cycle)] in g[node]


# ---------------------------------------------------------------------- policies
def test_registry_has_the_builtins_and_refuses_unknown_names() -> None:
    assert {"none", "dcqcn", "nscc", "eqds"} <= set(CC_POLICIES)
    assert get_cc("nscc") is Nscc and isinstance(make_cc("eqds", PATH), Eqds)
    with pytest.raises(CongestionConfigError, match="unknown congestion control 'cubic'"):
        get_cc("cubic")

    class Mine(FixedWindow):
        name = "mine-test"

    register_cc("mine-test", Mine)
    try:
        assert isinstance(make_cc("mine-test", PATH), CongestionControl)
        with pytest.raises(ValueError, match="already registered"):
            register_cc("mine-test", FixedWindow)
        with pytest.raises(TypeError):
            register_cc("bad", int)  # type: ignore[arg-type]
    finally:
        CC_POLICIES.pop("mine-test")


def test_none_is_a_fixed_window_that_reacts_to_nothing() -> None:
    cc = make_cc("none", PATH)
    assert cc.cwnd == FIXED_WINDOW_BDP * PATH.bdp == 225_000
    cc.on_ack(4150, True, 1e-3, 0.0)
    cc.on_nack(4150, 0.0)
    assert cc.cwnd == 225_000 and cc.rate_bps == 100e9
    assert cc.can_send(0, 10**9)  # one frame may always go
    assert cc.can_send(220_000, 5000) and not cc.can_send(221_000, 5000)


def test_dcqcn_cuts_on_cnp_and_recovers_on_its_timers() -> None:
    clock = FakeClock()
    cc = Dcqcn(PATH)
    assert cc.get_timer() is None and cc.rate_bps == 100e9
    cc.on_cnp(clock.now)  # alpha 1: the rate halves
    assert cc.rate_bps == 50e9 and cc.target == 100e9
    assert cc.alpha == pytest.approx(1 - G + G)
    cc.on_cnp(clock.now)
    assert cc.rate_bps == pytest.approx(25e9) and cc.target == pytest.approx(50e9)
    # timers: alpha decays and the rate recovers towards the target (fast recovery)
    rates = []
    for _ in range(FAST_RECOVERY_STEPS - 1):
        t = cc.get_timer()
        assert t is not None
        clock.now = t
        cc.handle_timer(t)
        rates.append(cc.rate_bps)
    assert rates == pytest.approx([50e9 - 25e9 / 2 ** k for k in range(1, FAST_RECOVERY_STEPS)])
    assert cc.target == pytest.approx(50e9)
    assert clock.now == pytest.approx((FAST_RECOVERY_STEPS - 1) * INCREASE_TIMER_S)
    assert cc.alpha < 1.0 and ALPHA_TIMER_S == INCREASE_TIMER_S
    # then additive increase: the target climbs, the rate follows, then timers stop
    for _ in range(100_000):
        t = cc.get_timer()
        if t is None:
            break
        cc.handle_timer(t)
    assert cc.rate_bps == 100e9 and cc.target == 100e9 and cc.get_timer() is None


def test_cnp_pacer_sends_at_most_one_per_interval_per_flow() -> None:
    p = CnpPacer()
    times = [0.0, 10e-6, CNP_INTERVAL_S, CNP_INTERVAL_S + 1e-6, 2.5 * CNP_INTERVAL_S]
    assert [p.on_ce(1, t) for t in times] == [True, False, True, False, True]
    assert p.on_ce(2, 10e-6) and p.sent == 4


def test_nscc_decreases_on_marks_above_target_once_per_rtt() -> None:
    cc = Nscc(PATH)
    start = cc.cwnd
    assert start == pytest.approx(1.5 * PATH.bdp) and cc.target == pytest.approx(9e-6)
    rtt = PATH.base_rtt_s + 3 * cc.target  # far above target
    for _ in range(400):  # let the delay average climb above the target
        cc.avg_delay = 3 * cc.target
        cc.on_ack(100, True, rtt, 1e-6)
    assert cc.decreases == 1  # all within one base RTT
    assert cc.cwnd == pytest.approx(start * max(1 - 0.8 * (2 / 3), 0.5))
    cc.on_ack(100, True, rtt, 1e-6 + 2 * PATH.base_rtt_s)
    assert cc.decreases == 2


def test_nscc_grows_below_target_and_quick_adapts_after_a_loss() -> None:
    cc = Nscc(PATH)
    cc.cwnd = 20_000.0
    t = 0.0
    for _ in range(50):
        t += 2e-6
        cc.on_send(4150, t)
        cc.on_ack(4150, False, PATH.base_rtt_s + 2e-6, t)
    assert cc.cwnd > 20_000.0
    grown = cc.cwnd
    cc.on_nack(4150, t)  # one trimmed frame: cut by its size ...
    assert cc.cwnd == pytest.approx(grown - 4150)
    # ... and at the end of the window the window becomes what was achieved
    cc._achieved = 9000
    t += PATH.base_rtt_s + cc.target + 1e-6
    cc.on_nack(4150, t)
    assert cc.cwnd == 9000 and cc.quick_adapts == 1


def test_dctcp_starts_slow_then_cuts_by_the_marked_fraction() -> None:
    """RFC 5681's slow start and window growth; RFC 8257's alpha, updated once per
    window of ACKs, cuts the window by alpha / 2 where any ACK came marked."""
    from fabric.core.congestion.dctcp import ALPHA_GAIN, INITIAL_WINDOW_MSS, Dctcp

    cc = Dctcp(PATH)
    mss = PATH.mtu
    assert cc.cwnd == INITIAL_WINDOW_MSS * mss and cc.alpha == 1.0
    cc.on_ack(4 * mss, False, PATH.base_rtt_s, 1e-6)
    assert cc.cwnd == (INITIAL_WINDOW_MSS + 4) * mss  # slow start: a segment per segment
    # a window of ACKs (one base RTT), an eighth of them marked: alpha moves a
    # sixteenth of the way to 1/8, and the window is cut once
    t = PATH.base_rtt_s
    cc.on_ack(3 * mss, False, PATH.base_rtt_s, t / 2)
    before = cc.cwnd
    cc.on_ack(mss, True, PATH.base_rtt_s, t)
    alpha = 1.0 + ALPHA_GAIN * (1 / 8 - 1.0)
    assert cc.alpha == pytest.approx(alpha)
    assert cc.cwnd == pytest.approx(before * (1 - alpha / 2)) and cc.cuts == 1
    # out of slow start: one segment per window
    w = cc.cwnd
    cc.on_ack(int(w), False, PATH.base_rtt_s, t + 1e-7)
    assert cc.cwnd == pytest.approx(w + mss, rel=1e-3)
    # a window without marks: alpha decays, no cut
    cc.on_ack(mss, False, PATH.base_rtt_s, 10 * t)
    assert cc.alpha < alpha and cc.cuts == 1
    # a loss halves; a timeout restarts from one segment
    w = cc.cwnd
    cc.on_nack(mss, 11 * t)
    assert cc.cwnd == pytest.approx(w / 2)
    cc.on_timeout(mss, 12 * t)
    assert cc.cwnd == mss and cc.ssthresh >= 2 * mss


def test_eqds_sends_only_what_was_granted() -> None:
    cc = Eqds(PATH)
    assert cc.credit == PATH.bdp  # the unsolicited first BDP
    sent = 0
    while cc.can_send(0, 4150):
        cc.on_send(4150, 0.0)
        sent += 4150
    assert sent == (PATH.bdp // 4150) * 4150 and not cc.can_send(0, 4150)
    cc.on_credit(4150, 1e-6)
    assert cc.can_send(0, 4150) and cc.granted == 4150


def test_credit_pacer_grants_round_robin_at_its_rate() -> None:
    pacer = CreditPacer(100.0, 1000)
    assert pacer.get_timer() is None
    pacer.request(1, 2500, 0.0)
    pacer.request(2, 1000, 0.0)
    got, times = [], []
    while (t := pacer.get_timer()) is not None:
        times.append(t)
        got += pacer.handle_timer(t)
    assert got == [(1, 1000), (2, 1000), (1, 1000), (1, 500)]
    gap = pacer.interval
    assert times == pytest.approx([0.0, gap, 2 * gap, 3 * gap])
    assert pacer.handle_timer(10.0) == [] and pacer.granted == 3500
    # a new request does not jump the pace of the last grant
    pacer2 = CreditPacer(100.0, 1000)
    pacer2.request(1, 1000, 0.0)
    pacer2.handle_timer(0.0)
    pacer2.request(1, 1000, 0.0)
    assert pacer2.get_timer() == pytest.approx(pacer2.interval)


def test_credit_pacer_forgets_a_flow_and_a_late_grant_does_not_slow_it() -> None:
    pacer = CreditPacer(100.0, 1000)
    gap = pacer.interval
    pacer.request(1, 5000, 0.0)
    pacer.request(2, 5000, 0.0)
    assert pacer.handle_timer(0.0) == [(1, 1000)]
    pacer.forget(1)  # flow 1 has every byte
    assert pacer.demand(1) == 0
    # woken a third of a gap late: the grant after it keeps the schedule
    assert pacer.handle_timer(gap * 4 / 3) == [(2, 1000)]
    assert pacer.get_timer() == pytest.approx(2 * gap)
    # woken very late: at most one interval is made up
    assert pacer.handle_timer(10 * gap) == [(2, 1000)]
    assert pacer.get_timer() == pytest.approx(10 * gap)
    pacer.forget(2)
    assert pacer.get_timer() is None
