"""Fault models: parsing, reproducibility, statistics, corruption against the codec, the link."""

from __future__ import annotations

import math

import pytest

from fabric.core.faults import (
    NO_FAULTS,
    FaultInjector,
    FaultSpec,
    FaultSpecError,
    GilbertElliott,
    parse_faults,
)
from fabric.core.frame import FrameError, NackCode, Op, decode, encode
from fabric.testing import FakeClock, MemoryLink

# ---------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------


def test_parse_full_example() -> None:
    spec = parse_faults(
        "loss=0.01,reorder=0.05:3,dup=0.001,corrupt=1e-4,delay=50us:10us,ge=0.01:0.3:0.5"
    )
    assert spec.loss == 0.01
    assert (spec.reorder, spec.reorder_max) == (0.05, 3)
    assert spec.duplicate == 0.001 and spec.corrupt == 1e-4 and spec.corrupt_bits == 1
    assert (spec.delay_us, spec.jitter_us) == (50.0, 10.0)
    assert spec.gilbert_elliott == GilbertElliott(0.01, 0.3, 0.5, 0.0)


def test_parse_units_percentages_and_empty() -> None:
    assert parse_faults("delay=1.5ms:200ns").delay_us == 1500.0
    assert parse_faults("delay=1.5ms:200ns").jitter_us == pytest.approx(0.2)
    assert parse_faults("delay=7").delay_us == 7.0  # bare number: microseconds
    assert parse_faults("delay=0.001s").delay_us == pytest.approx(1000.0)
    assert parse_faults("loss=1%").loss == 0.01
    assert parse_faults("reorder=0.1:2:30us").reorder_timeout_us == 30.0
    assert parse_faults("corrupt=0.5:3").corrupt_bits == 3
    assert parse_faults("ge=0.1:0.2").gilbert_elliott == GilbertElliott(0.1, 0.2, 1.0, 0.0)
    for empty in ("", "none", " ", None):
        assert parse_faults(empty) == NO_FAULTS and NO_FAULTS.clean
    spec = FaultSpec(loss=0.5)
    assert parse_faults(spec) is spec


def test_text_form_round_trips() -> None:
    for text in (
        "loss=0.01,reorder=0.05:3,dup=0.001,corrupt=1e-4:2,delay=50us:10us,ge=0.01:0.3:0.5:0.001",
        "delay=3us",
        "none",
    ):
        spec = parse_faults(text)
        assert parse_faults(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("loss=2", "loss must be a probability in [0, 1], got 2.0"),
        ("loss=-0.1", "probability"),
        ("los=0.1", "unknown fault 'los'; valid: corrupt, delay, dup, ge, loss, reorder"),
        ("loss", "needs KEY=VALUE"),
        ("loss=abc", "loss: 'abc' is not a number"),
        ("loss=0.1,loss=0.2", "'loss' given twice"),
        ("loss=0.1,,dup=0.1", "empty item"),
        ("reorder=0.1", "expected reorder=P:K"),
        ("reorder=0.1:0", "max displacement >= 1"),
        ("reorder=0.1:2.5", "'2.5' is not a whole number"),
        ("delay=5parsecs", "is not a time; write e.g. 50us"),
        ("delay=-5us", "a time in 0..3.6e+09 us"),
        ("delay=1e308us", "a time in 0..3.6e+09 us"),
        ("ge=0.1", "expected ge=P_GOOD_TO_BAD:P_BAD_TO_GOOD"),
        ("ge=0.1:0", "stays bad forever"),
        ("ge=0.1:1.5", "ge p_bad_to_good must be a probability"),
        ("corrupt=0.1:0", "corrupt bits must be >= 1"),
        ("dup=nan", "not a finite number"),
        # a link that drops every frame never delivers anything: refused
        ("loss=1", "loss must be below 1"),
        ("loss=100%", "nothing is ever delivered"),
        ("ge=0.1:0.5:1:1", "ge loses every frame"),
        ("ge=0:0:0:1", "ge loses every frame"),
    ],
)
def test_parse_errors_are_clear(text: str, needle: str) -> None:
    with pytest.raises(FaultSpecError) as exc:
        parse_faults(text)
    assert needle in str(exc.value)
    assert str(exc.value).startswith(f"bad fault spec {text!r}")
    assert isinstance(exc.value, ValueError)


def test_almost_total_loss_is_still_accepted() -> None:
    assert parse_faults("loss=0.999").loss == 0.999
    assert parse_faults("ge=0.1:0.5:1:0.5").gilbert_elliott is not None
    assert FaultSpec(loss=1.0).loss == 1.0  # tests may still build a black hole directly


# ---------------------------------------------------------------------------
# injector behaviour
# ---------------------------------------------------------------------------


def _run(spec: str, seed: int, n: int = 2000) -> list[list[tuple[float, bytes]]]:
    inj = FaultInjector(spec, seed)
    return [inj.apply(i.to_bytes(4, "little") * 4, now=i * 1e-6) for i in range(n)]


def test_same_seed_same_decisions() -> None:
    spec = "loss=0.05,dup=0.05,reorder=0.1:3,corrupt=0.05,delay=5us:2us,ge=0.02:0.3"
    assert _run(spec, 42) == _run(spec, 42)
    assert _run(spec, 42) != _run(spec, 43)
    # separate streams: another link of the same run gets other faults
    a = FaultInjector("loss=0.1", 1, stream="fwd")
    b = FaultInjector("loss=0.1", 1, stream="back")
    pa = [bool(a.apply(b"x", 0.0)) for _ in range(500)]
    pb = [bool(b.apply(b"x", 0.0)) for _ in range(500)]
    assert pa != pb


def test_changing_one_fault_leaves_the_loss_pattern() -> None:
    def lost(spec: str) -> list[bool]:
        inj = FaultInjector(spec, 9)
        return [not inj.apply(b"abcd", 0.0) for _ in range(3000)]

    assert lost("loss=0.05") == lost("loss=0.05,dup=0.2,corrupt=0.3")


def test_empirical_loss_rate_is_close_to_p() -> None:
    p, n = 0.05, 40_000
    inj = FaultInjector(f"loss={p}", 3)
    lost = sum(1 for _ in range(n) if not inj.apply(b"x", 0.0))
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(lost - n * p) < 4 * sigma
    assert inj.statistics().lost == lost and inj.statistics().frames == n


def _burst_lengths(losses: list[bool]) -> list[int]:
    runs, cur = [], 0
    for x in losses:
        if x:
            cur += 1
        elif cur:
            runs.append(cur)
            cur = 0
    if cur:
        runs.append(cur)
    return runs


def test_gilbert_elliott_is_burstier_than_bernoulli_at_the_same_rate() -> None:
    n = 60_000
    ge = GilbertElliott(0.01, 0.25, 1.0, 0.0)
    mean = ge.mean_loss  # 0.01 / 0.26 ~ 3.8 %
    inj_ge = FaultInjector(FaultSpec(gilbert_elliott=ge), 5)
    inj_b = FaultInjector(FaultSpec(loss=mean), 5)
    ge_loss = [not inj_ge.apply(b"x", 0.0) for _ in range(n)]
    b_loss = [not inj_b.apply(b"x", 0.0) for _ in range(n)]
    assert sum(ge_loss) / n == pytest.approx(mean, rel=0.2)
    assert sum(b_loss) / n == pytest.approx(mean, rel=0.1)
    ge_runs, b_runs = _burst_lengths(ge_loss), _burst_lengths(b_loss)
    ge_mean = sum(ge_runs) / len(ge_runs)
    b_mean = sum(b_runs) / len(b_runs)
    assert ge_mean == pytest.approx(1 / ge.p_bad_to_good, rel=0.2)  # ~4 frames
    assert b_mean < 1.1 and ge_mean > 3 * b_mean
    assert inj_ge.statistics().lost_in_burst == sum(ge_loss)


def test_corruption_flips_bits_and_the_crc_catches_it() -> None:
    frame = encode(Op.WRITE, flow=1, psn=5, payload=bytes(range(256)) * 4, crc=True)
    inj = FaultInjector("corrupt=1", 1)
    codes = []
    for i in range(300):
        out = inj.apply(frame, float(i))
        assert len(out) == 1
        bad = out[0][1]
        assert len(bad) == len(frame)
        diff = sum(bin(a ^ b).count("1") for a, b in zip(bad, frame, strict=True))
        assert diff == 1  # exactly one bit flipped (corrupt bits default 1)
        with pytest.raises(FrameError) as exc:
            decode(bad)
        codes.append(exc.value.code)
    # a flip in the payload or most header fields fails the CRC32C; a flip in
    # the version/opcode/flags/length bytes is refused earlier as malformed
    assert codes.count(NackCode.BAD_CHECKSUM) > 0.9 * len(codes)
    assert set(codes) <= {
        NackCode.BAD_CHECKSUM,
        NackCode.MALFORMED,
        NackCode.UNSUPPORTED,
    }
    assert inj.statistics().corrupted == 300


def test_duplicate_gives_two_copies() -> None:
    inj = FaultInjector("dup=1,delay=10us", 0)
    out = inj.apply(b"frame", 1.0)
    assert out == [(1.00001, b"frame"), (1.00001, b"frame")]
    assert inj.statistics().duplicated == 1


def test_delay_and_jitter_bounds_and_fifo() -> None:
    inj = FaultInjector("delay=50us:10us", 2)
    last = -1.0
    for i in range(2000):
        now = i * 1e-6
        ((at, _),) = inj.apply(b"x", now)
        assert now + 40e-6 - 1e-12 <= at <= max(now + 60e-6, last) + 1e-12
        assert at >= last  # jitter never reorders
        last = at


def test_reorder_displacement_is_bounded_and_timeouts_release() -> None:
    k = 3
    inj = FaultInjector(f"reorder=0.3:{k}:50us,delay=1us", 8)
    arrivals: list[tuple[float, int]] = []
    n = 5000
    for i in range(n):
        for at, data in inj.apply(i.to_bytes(4, "little"), now=i * 1e-6):
            arrivals.append((at, int.from_bytes(data, "little")))
    assert inj.next_deadline() is not None  # the tail is held
    arrivals += [(at, int.from_bytes(d, "little")) for at, d in inj.poll(1.0)]
    assert inj.next_deadline() is None
    order = [x for _, x in arrivals]
    assert sorted(order) == list(range(n))  # nothing lost, nothing doubled
    assert [a for a, _ in arrivals] == sorted(a for a, _ in arrivals)
    # displacement: frames sent after x that arrive before x
    pos = {x: i for i, x in enumerate(order)}
    worst = max(sum(1 for y in order[: pos[x]] if y > x) for x in range(0, n, 7))
    assert worst == k
    assert inj.statistics().reordered > 0.25 * n


def test_memory_link_serialises_with_bandwidth_and_delivers_in_order() -> None:
    clock = FakeClock()
    link = MemoryLink(FaultInjector("delay=10us", 0), clock, bandwidth_gbps=1.0)
    for i in range(3):
        link.send(bytes([i]) * 125)  # 1000 bits = 1 us at 1 Gb/s
    assert link.next_delivery() == pytest.approx(11e-6)
    assert link.receive(10.5e-6) == []
    clock.advance_to(12e-6)
    assert link.receive() == [bytes([0]) * 125, bytes([1]) * 125]
    clock.advance(1e-6)
    assert link.receive() == [bytes([2]) * 125]
    s = link.statistics()
    assert (s.sent, s.delivered, s.in_flight) == (3, 3, 0)
    with pytest.raises(ValueError):
        clock.advance(-1.0)


def test_a_retrying_link_sees_the_same_losses_and_counts_corruption() -> None:
    """damaged(): the loss decisions of apply() (same streams), plus corruption;
    nothing else (a retrying link neither duplicates nor reorders)."""
    spec = "loss=0.05,dup=0.3,reorder=0.2:3,corrupt=0.02"
    a, b = FaultInjector(spec, 5), FaultInjector(spec, 5)
    lost_apply = []
    for i in range(4000):
        before = a.lost
        a.apply(i.to_bytes(4, "little"), i * 1e-6)
        lost_apply.append(a.lost > before)
    lost_llr = []
    for _ in range(4000):
        before = b.lost
        damaged = b.damaged()
        lost_llr.append(b.lost > before)
        assert damaged or b.lost == before
    assert lost_llr == lost_apply
    s = b.statistics()
    assert s.frames == 4000 and s.duplicated == 0 and s.reordered == 0
    assert 0.01 < s.corrupted / 4000 < 0.03 and 0.035 < s.lost / 4000 < 0.065
