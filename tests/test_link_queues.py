"""A switch egress's queue in a link pipeline (fabric.core.link with
fabric.core.congestion.switchq): tail drop, trimming ahead of the data, RED
marks on the queue a frame joins; and the queues a [congestion] table makes."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from fabric.core import frame as fr
from fabric.core.congestion import CongestionConfigError, RedMarker, SharedBuffer
from fabric.core.congestion.settings import CongestionSettings
from fabric.core.congestion.switchq import SwitchQueues, switch_queues
from fabric.core.congestion.timed import TimedBuffer
from fabric.core.link import LinkPipeline
from fabric.core.topology import LinkParams, star

#: 8 Gb/s (1 byte per ns), 10 us of flight.
PARAMS = LinkParams(bandwidth_gbps=8.0, latency_us=10.0)


def _frames(n: int, size: int) -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for psn in range(n):
        body = rng.integers(0, 256, size, dtype=np.uint8)
        out.append((fr.encode_header(fr.Op.WRITE, src=1, dst=2, flow=16, psn=psn,
                                     payload=body), body))
    return out


def _pipe(buffer: int, *, trim: bool = False, kmin: int | None = None,
          kmax: int | None = None) -> LinkPipeline:
    buf = SharedBuffer(buffer + (64 if trim else 0), alpha=math.inf, trim_bytes=64 if trim else 0,
                       trim_reserve_bytes=64 if trim else 0)
    marker = RedMarker(kmin, kmax or kmin, 1.0, random.Random(0)) if kmin is not None else None
    return LinkPipeline(PARAMS, queues=SwitchQueues(TimedBuffer(buf), marker), port=7)


def test_a_full_buffer_drops_at_the_tail_and_frees_room_as_frames_leave() -> None:
    pipe = _pipe(3 * 1032)
    frames = _frames(5, 1000)  # 1032 B each on the wire
    for item in frames[:4]:
        pipe.push(item, 0.0)
    assert pipe.statistics().overflow_drops == 1
    assert pipe.statistics().peak_queue_bytes == 3 * 1032
    pipe.push(frames[4], 1.1e-6)  # the first frame's last byte left at 1.032 us
    assert pipe.statistics().overflow_drops == 1
    got = [fr.decode(h, p).psn for h, p in pipe.pop_due(1.0)]
    assert got == [0, 1, 2, 4]


def test_a_trimmed_header_overtakes_the_queued_data() -> None:
    pipe = _pipe(2 * 1032, trim=True)
    frames = _frames(3, 1000)
    for item in frames:
        pipe.push(item, 0.0)
    st = pipe.statistics()
    assert (st.trims, st.overflow_drops) == (1, 0)
    out = pipe.pop_due(1.0)
    header, payload = out[0]  # the header of frame 2, first: a class served first
    assert payload is None and fr.is_trimmed(header, payload)
    assert fr.decode_trimmed(header).psn == 2
    assert [fr.decode(h, p).psn for h, p in out[1:]] == [0, 1]


def test_red_marks_by_the_queue_a_frame_joins() -> None:
    pipe = _pipe(10 * 1032, kmin=1032, kmax=1032)  # every frame above one queued frame
    for item in _frames(4, 1000):
        pipe.push(item, 0.0)
    flags = [bool(fr.decode(h, p).flags & fr.Flag.ECN) for h, p in pipe.pop_due(1.0)]
    assert flags == [False, False, True, True]  # joined 0, 1032 (= Kmin), 2064, 3096 B
    assert pipe.statistics().ecn_marks == 2


def test_an_unshaped_link_never_queues() -> None:
    buf = TimedBuffer(SharedBuffer(2000))
    pipe = LinkPipeline(LinkParams(latency_us=1.0), queues=SwitchQueues(buf, None))
    for item in _frames(5, 1000):
        pipe.push(item, 0.0)
    assert len(pipe.pop_due(1.0)) == 5 and pipe.statistics().overflow_drops == 0


def test_the_congestion_table_makes_each_switch_its_queues() -> None:
    t = star(3, bandwidth_gbps=10, mtu=4096)
    assert switch_queues(t) == {}  # no buffer_bytes: queues never fill
    q = switch_queues(t.with_congestion(CongestionSettings(buffer_bytes=100_000)))
    assert q[("sw0", "scaleup")].marker is None  # no policy and no ecn_* key: no marks
    q = switch_queues(t.with_congestion(CongestionSettings(buffer_bytes=100_000, cc="nscc")))
    marker = q[("sw0", "scaleup")].marker
    assert marker is not None and (marker.kmin, marker.kmax) == (4000, 16000)  # htsim's 0.2/0.8
    q = switch_queues(t.with_congestion(CongestionSettings(buffer_bytes=20_000, trim=True,
                                                           ecn_kmin_bytes=5000)))
    marker = q[("sw0", "scaleup")].marker
    assert marker is not None and (marker.kmin, marker.kmax) == (5000, 16000)
    assert q[("sw0", "scaleup")].buffer.buffer.trim_bytes == 64
    with pytest.raises(CongestionConfigError, match="cannot hold one frame"):
        switch_queues(t.with_congestion(CongestionSettings(buffer_bytes=4000)))


def test_only_a_streams_data_is_trimmed() -> None:
    pipe = _pipe(1032, trim=True)
    body = np.arange(1000, dtype=np.uint8)
    stream = fr.encode_header(fr.Op.WRITE, src=1, dst=2, flow=20, psn=1, payload=body)
    other = fr.encode_header(fr.Op.WRITE, src=1, dst=2, flow=2, psn=2, payload=body)
    group = fr.encode_header(fr.Op.WRITE, src=1, dst=2, flow=16, psn=3, payload=body,
                             flags=fr.Flag.MCAST)
    pipe.push(_frames(1, 1000)[0], 0.0)  # fills the buffer
    for header in (stream, other, group):
        pipe.push((header, body), 0.0)
    st = pipe.statistics()
    assert (st.trims, st.overflow_drops) == (1, 2)
    assert fr.trimmable(stream) and not fr.trimmable(other) and not fr.trimmable(group)


def test_a_memory_plane_frame_is_dropped_not_trimmed() -> None:
    """A referenced frame moves the bytes it names over the link: cut to its header
    it would deliver them for nothing, so a full trimming buffer drops it."""
    pipe = _pipe(1032, trim=True)
    pipe.push(_frames(1, 1000)[0], 0.0)  # fills the buffer
    ref = fr.encode_header(fr.Op.RESULT, src=1, dst=2, job=3, psn=0, length=1000,
                           flags=fr.Flag.REF)
    pipe.push((ref, None), 0.0)
    st = pipe.statistics()
    assert (st.trims, st.overflow_drops) == (0, 1)


def test_masked_multicast_rows_are_trimmed_and_other_multicast_is_not() -> None:
    """MoE dispatch rows (flow MASKED_FLOW, a member mask in key): their members NACK
    a trimmed copy; a multicast stream's frame (key 0: every member) is dropped."""
    body = np.arange(100, dtype=np.uint8)
    row = fr.encode_header(fr.Op.WRITE, src=1, dst=3, flow=fr.MASKED_FLOW, key=0b110,
                           offset=1, payload=body, flags=fr.Flag.MCAST)
    every = fr.encode_header(fr.Op.WRITE, src=1, dst=3, flow=fr.MASKED_FLOW, key=0,
                             payload=body, flags=fr.Flag.MCAST)
    assert fr.trimmable(row) and not fr.trimmable(every)


def test_combine_sums_are_trimmed_and_other_reductions_are_not() -> None:
    """In-network MoE combine frames (REDUCE on COMBINE_FLOW): the home NACKs a
    trimmed sum to the switch that kept it; an allreduce contribution is dropped."""
    body = np.arange(100, dtype=np.uint8)
    total = fr.encode_header(fr.Op.REDUCE, src=9, dst=3, flow=fr.COMBINE_FLOW, offset=1,
                             payload=body)
    chunk = fr.encode_header(fr.Op.REDUCE, src=1, dst=9, flow=0, job=4, payload=body)
    assert fr.trimmable(total) and not fr.trimmable(chunk)


def test_a_lossless_buffer_pauses_an_ingress_until_it_drains_to_xon() -> None:
    """PFC accounting by ingress port (TimedBuffer with PfcIngress): above XOFF the
    ingress is paused until the frames it holds are scheduled to have left down to
    XON; a frame postponed leaves later and holds its bytes until then."""
    from fabric.core.congestion.pfc import PfcIngress

    pfc = PfcIngress(mtu=1000, headroom_bytes=2000, xoff_bytes=2500, resume_offset_bytes=1000)
    tb = TimedBuffer(SharedBuffer(10_000), pfc)
    for i in range(4):  # 1000 B each from ingress 7, leaving at 1, 2, 3, 4 s
        tb.admit_lossless(port=1, nbytes=1000, now=0.0)
        hold = tb.hold(1, 1000, float(i + 1), ingress=7)
    assert pfc.is_paused(7, 0) and pfc.held(7, 0) == 4000
    # XON = 2500 - 1000 = 1500: after the frames leaving at 1, 2 and 3 s
    assert tb.pause_until(7, 0.5) == 3.0
    assert tb.pause_until(8, 0.5) is None  # another ingress: not paused
    tb.postpone(hold, 9.0)  # the last frame leaves at 9 s instead of 4
    tb.advance(5.0)
    assert tb.buffer.used == 1000 and pfc.held(7, 0) == 1000
    tb.advance(8.9)
    assert tb.buffer.used == 1000
    tb.advance(9.0)
    assert tb.buffer.used == 0 and not pfc.is_paused(7, 0)
