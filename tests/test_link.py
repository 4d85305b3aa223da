"""One link direction (fabric.core.link.LinkPipeline): link-level retry (``llr``),
a link that replays what it damaged instead of losing it."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core import frame as fr
from fabric.core.faults import parse_faults
from fabric.core.link import LinkPipeline
from fabric.core.topology import LinkParams

#: 8 Gb/s (1 byte per ns), 10 us of flight.
PARAMS = LinkParams(bandwidth_gbps=8.0, latency_us=10.0)
SIZE = 968  # + the 32-byte header: 1 us on the wire
EPS = 1e-12  # past a time computed in floating point


def _frames(n: int) -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(11)
    out = []
    for psn in range(n):
        body = rng.integers(0, 256, SIZE, dtype=np.uint8)
        out.append((fr.encode_header(fr.Op.WRITE, src=1, dst=2, flow=16, psn=psn,
                                     payload=body), body))
    return out


def _run(pipe: LinkPipeline, frames: list, gap_s: float) -> list[tuple[float, int]]:
    """Push a frame every ``gap_s``; (arrival, psn) of everything that comes out."""
    got = []
    for i, item in enumerate(frames):
        pipe.push(item, i * gap_s)
    while len(pipe):
        t = pipe.get_timer()
        assert t is not None
        got += [(t, fr.decode(h, p).psn) for h, p in pipe.pop_due(t)]
    return got


@pytest.mark.parametrize("spec", ["loss=0.2", "corrupt=0.2", "loss=0.1,dup=0.2,reorder=0.3:3"])
def test_a_retrying_link_delivers_every_frame_once_in_order(spec: str) -> None:
    frames = _frames(300)
    pipe = LinkPipeline(PARAMS.replace(llr=True), parse_faults(spec), seed=3)
    got = _run(pipe, frames, 2e-6)
    assert [psn for _t, psn in got] == list(range(300))
    times = [t for t, _psn in got]
    assert times == sorted(times)
    st = pipe.statistics()
    f = st.faults
    assert f is not None
    assert st.llr_replays == f.lost + f.corrupted > 20
    assert st.frames == 300 + st.llr_replays  # every copy was on the wire


def test_a_replay_costs_a_round_trip_and_holds_back_what_follows() -> None:
    """One frame lost at a time on an idle link: it arrives one serialisation and a
    round trip of the link late, and the next frame does not pass it."""
    frames = _frames(400)
    clean = _run(LinkPipeline(PARAMS), frames, 100e-6)
    pipe = LinkPipeline(PARAMS.replace(llr=True), parse_faults("loss=0.05"), seed=1)
    got = _run(pipe, frames, 100e-6)  # far apart: no frame waits for another
    late = [b[0] - a[0] for a, b in zip(clean, got, strict=True)]
    # a replay: the damaged copy's serialisation, its flight and the NAK's (the
    # replay's own flight is in the clean time too), so late by whole replays
    once = 1e-6 + 2 * 10e-6
    reps = [round(d / once) for d in late]
    assert sum(reps) == pipe.llr_replays > 5
    assert all(d == pytest.approx(r * once, abs=1e-9) for d, r in zip(late, reps, strict=True))
    # back to back, a replay delays the frames behind it as well
    pipe = LinkPipeline(PARAMS.replace(llr=True), parse_faults("loss=0.05"), seed=1)
    back = _run(pipe, frames, 0.0)
    assert [psn for _t, psn in back] == list(range(400))
    assert back[-1][0] == pytest.approx(400e-6 + 10e-6 + pipe.llr_replays * once, rel=1e-9)


def test_without_retry_the_same_link_loses_frames() -> None:
    frames = _frames(300)
    got = _run(LinkPipeline(PARAMS, parse_faults("loss=0.2"), seed=3), frames, 2e-6)
    assert 30 < 300 - len(got) < 90


def test_an_unshaped_retrying_link_replays_at_once() -> None:
    pipe = LinkPipeline(LinkParams(llr=True), parse_faults("loss=0.3"), seed=2)
    got = _run(pipe, _frames(100), 1e-6)
    assert [psn for _t, psn in got] == list(range(100))
    assert all(t == pytest.approx(i * 1e-6) for i, (t, _psn) in enumerate(got))
    assert pipe.llr_replays > 10


def test_a_pause_moves_the_frames_not_yet_begun_in_order() -> None:
    """PFC's PAUSE at the sending end: the frame on the wire goes on, the rest start
    after the pause, back to back, in order, and the time paused is counted."""
    frames = _frames(5)
    pipe = LinkPipeline(PARAMS, pausable=True)
    for item in frames:
        pipe.push(item, 0.0)  # 1 us each on the wire: starts at 0, 1, 2, 3, 4 us
    pipe.pause(1.5e-6, 20e-6)  # frames 0 and 1 have begun
    got = []
    while len(pipe):
        t = pipe.get_timer()
        assert t is not None
        got += [(t, fr.decode(h, p).psn) for h, p in pipe.pop_due(t)]
    assert [psn for _t, psn in got] == list(range(5))
    want = [11e-6, 12e-6, 31e-6, 32e-6, 33e-6]  # + 10 us of flight
    assert [t for t, _psn in got] == pytest.approx(want)
    st = pipe.statistics()
    assert st.pauses == 1 and st.paused_s == pytest.approx(18.5e-6)
    pipe.pause(40e-6, 41e-6)  # nothing left to move: the link just waits
    pipe.push(frames[0], 40e-6)
    assert pipe.get_timer() == pytest.approx(52e-6)


def test_a_credit_link_waits_for_credit_and_sends_in_order() -> None:
    """Credit for two frames: the third waits until the far end frees the first
    (the credit takes the link's latency back); the link's idle time is counted."""
    frames = _frames(4)
    pipe = LinkPipeline(PARAMS, credit_bytes=2 * (SIZE + fr.HEADER_SIZE))
    for i, item in enumerate(frames):
        pipe.push(item, 0.0, credit_back=("in", 100 + i))
    got = [(t, fr.decode(h, p).psn) for t in (11e-6 + EPS, 12e-6 + EPS)
           for h, p in pipe.pop_due(t)]
    assert got == [(11e-6 + EPS, 0), (12e-6 + EPS, 1)]
    assert len(pipe) == 2 and pipe.get_timer() is None  # no credit: nothing to do
    # each frame's cause is freed once that frame has left (its last byte at 1, 2 us)
    assert pipe.take_credit_returns() == [("in", 100, pytest.approx(1e-6)),
                                          ("in", 101, pytest.approx(2e-6))]
    pipe.credit_freed(15e-6, SIZE + fr.HEADER_SIZE)  # frame 0 left the far end
    assert pipe.get_timer() == pytest.approx(25e-6)  # + 10 us back
    assert pipe.pop_due(25e-6 + EPS) == []
    assert pipe.take_credit_returns() == [("in", 102, pytest.approx(26e-6))]
    assert pipe.get_timer() == pytest.approx(36e-6)  # frame 2: 25 + 1 + 10 us
    assert [fr.decode(h, p).psn for h, p in pipe.pop_due(36e-6 + EPS)] == [2]
    st = pipe.statistics()
    assert st.credit_stalls == 1 and st.credit_stalled_s == pytest.approx(23e-6)  # 2..25 us
    pipe.credit_freed(40e-6, 2 * (SIZE + fr.HEADER_SIZE))
    pipe.pop_due(50e-6 + EPS)
    assert [fr.decode(h, p).psn for h, p in pipe.pop_due(61e-6 + EPS)] == [3]


def test_a_credit_link_into_a_node_frees_each_frame_as_it_arrives() -> None:
    """A node takes frames as they come: with credit for one round trip of the link
    (and one frame more), a steady stream never waits for it."""
    from fabric.core.congestion.credit import link_grant

    grant = link_grant(PARAMS.replace(credit=True, mtu=SIZE))
    assert grant > 0 and link_grant(PARAMS) == 0  # credit is a link's own setting
    frames = _frames(200)
    alone = _run(LinkPipeline(PARAMS), frames, 0.0)
    credited = LinkPipeline(PARAMS, credit_bytes=grant, frees_on_arrival=True)
    assert _run(credited, frames, 0.0) == alone
    assert credited.statistics().credit_stalls == 0
    # half the credit: the same frames, in order, later
    short = LinkPipeline(PARAMS, credit_bytes=grant // 2, frees_on_arrival=True)
    slow = _run(short, frames, 0.0)
    assert [psn for _t, psn in slow] == list(range(200)) and slow[-1][0] > alone[-1][0]
    assert short.statistics().credit_stalls > 0


def test_a_frame_larger_than_the_grant_goes_once_every_credit_is_back() -> None:
    frames = _frames(2)
    pipe = LinkPipeline(PARAMS, credit_bytes=SIZE // 2)
    for item in frames:
        pipe.push(item, 0.0)
    assert [fr.decode(h, p).psn for h, p in pipe.pop_due(11e-6 + EPS)] == [0]
    assert pipe.pop_due(1.0) == []  # the second waits for the first's credit
    pipe.credit_freed(11e-6, SIZE + fr.HEADER_SIZE)  # (more than the grant: capped)
    assert pipe.credit is not None and pipe.get_timer() == pytest.approx(21e-6)
    pipe.pop_due(21e-6 + EPS)
    assert [fr.decode(h, p).psn for h, p in pipe.pop_due(32e-6 + EPS)] == [1]
