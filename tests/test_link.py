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
