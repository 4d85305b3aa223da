"""The collective programs without sockets: a fake clock, frames handed in."""

from __future__ import annotations

import numpy as np
import pytest

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Flag, NackCode, Op
from fabric.core.programs import (
    CTRL_RETRY_MIN_S,
    CTRL_RETRY_S,
    STREAM_SPAN,
    STREAM_WINDOW,
    HostRingAllreduce,
    InaAllreduce,
    JobState,
    NodeState,
    Request,
    StreamRecv,
    StreamSend,
    Tensor,
)
from fabric.core.topology import star
from fabric.errors import FabricTimeout, PeerFailed


def _state(name: str = "w0", world: int = 3) -> NodeState:
    return NodeState(star(world), name, timeout_s=1.0)


def _reply(src: int, dst: int, t: str, **fields) -> fr.Frame:
    return fr.decode(fr.encode(Op.CTRL, src=src, dst=dst, payload=control.pack(t, **fields)))


def test_request_resends_with_backoff_then_times_out() -> None:
    st = _state()
    req = Request(st, "barrier", "barrier_done", id=1, n=3)
    assert len(req.start(0.0)) == 1
    due = req.get_timer()
    assert due == pytest.approx(CTRL_RETRY_S)
    sends = req.handle_timer(due)
    assert len(sends) == 1 and req.get_timer() == pytest.approx(due + 2 * CTRL_RETRY_S)
    with pytest.raises(FabricTimeout, match="barrier"):
        t = 0.0
        while True:
            t = req.get_timer()
            req.handle_timer(t)


def test_request_resends_after_the_measured_control_round_trip() -> None:
    st = _state()
    hello = Request(st, "hello", "welcome", name="w0")
    hello.start(1.0)
    hello.handle_frame(_reply(st.switch_id, st.node_id, "welcome"), 1.001)  # 1 ms round trip
    assert st.ctrl_rtt(st.switch_id).srtt == pytest.approx(0.001)
    # a lost request now costs the RTO of that round trip (at its floor), not CTRL_RETRY_S
    req = Request(st, "stats", "stats")
    req.start(2.0)
    assert req.get_timer() == pytest.approx(2.0 + CTRL_RETRY_MIN_S)
    # an answer that waited for other nodes is no round trip: no sample
    bar = Request(st, "barrier", "barrier_done", waits=True, id=1, n=3)
    bar.start(3.0)
    bar.handle_frame(_reply(st.switch_id, st.node_id, "barrier_done", id=1), 5.0)
    # nor is an answer to a resent request (Karn)
    again = Request(st, "stats", "stats")
    again.start(6.0)
    again.handle_timer(again.get_timer())
    again.handle_frame(_reply(st.switch_id, st.node_id, "stats"), 6.5)
    assert st.ctrl_rtt(st.switch_id).srtt == pytest.approx(0.001)
    # each node asked has its own estimate
    assert st.ctrl_rtt(st.worker_ids[1]).srtt is None


def test_request_takes_its_answer_only_from_the_node_asked() -> None:
    st = _state()
    req = Request(st, "job", "job_reply", job=1, match=lambda m: m.get("job") == 1)
    req.start(0.0)
    forged = _reply(src=st.worker_ids[1], dst=st.node_id, t="job_reply", job=1, granted=True)
    assert not req.wants(forged)
    other_job = _reply(src=st.switch_id, dst=st.node_id, t="job_reply", job=2, granted=True)
    assert not req.wants(other_job)
    real = _reply(src=st.switch_id, dst=st.node_id, t="job_reply", job=1, granted=False)
    assert req.wants(real)
    req.handle_frame(real, 0.01)
    assert req.done and req.result["granted"] is False


def test_a_refused_control_request_fails_at_once_a_damaged_one_is_resent() -> None:
    st = _state()
    req = Request(st, "region", "region_reply", key=5)
    req.start(0.0)
    damaged = fr.decode(fr.encode_nack(src=st.switch_id, dst=st.node_id, flow=0, psn=0,
                                       code=NackCode.BAD_CHECKSUM))
    assert req.handle_frame(damaged, 0.0) == [] and not req.done
    refused = fr.decode(fr.encode_nack(src=st.switch_id, dst=st.node_id, flow=0, psn=0,
                                       code=NackCode.PERMISSION))
    with pytest.raises(PeerFailed, match="PERMISSION"):
        req.handle_frame(refused, 0.0)


def _result(st: NodeState, js: JobState, psn: int, data: np.ndarray, src: int | None = None,
            mark: int = 0):
    h = fr.encode_header(Op.RESULT, src=st.switch_id if src is None else src, dst=st.node_id,
                         job=js.job, psn=psn, dtype=fr.dtype_from_name("int32"), payload=data,
                         offset=mark)
    return fr.decode(h, memoryview(data.view(np.uint8)))


@pytest.mark.parametrize(("mark", "resent"), [(5, True), (0, False)])
def test_ina_resends_a_chunk_three_later_results_overtake_below_its_mark(mark, resent) -> None:
    # below the switch's mark to us the chunk is complete or lacks our
    # contribution: three later results say it is lost; at or above, it waits for
    # another member and only its timer may resend it
    st = _state(world=2)
    x = np.arange(30, dtype=np.int32)
    js = JobState(job=8, slots=8, slot_elems=3, granted=True, reason="")
    prog = InaAllreduce(st, Tensor(30, "int32", x, np.zeros_like(x)), "sum", js)
    assert len(prog.start(0.0)) == 8  # a window of 8: three results are not most of it
    out = []
    for i in (1, 2, 3):  # chunk 0's result does not come
        out += prog.handle_frame(_result(st, js, i, x[i * 3:(i + 1) * 3] * 2, mark=mark),
                                 0.001 * i)
    # header bytes: flags at 2, psn (the chunk) at 12..16
    retx = [int.from_bytes(h[12:16], "little") for h, _ in out if h[2] & Flag.RETX]
    assert retx == ([0] if resent else [])


def _ina_under_cc(cc: str, marked: bool) -> tuple[float, float, int]:
    """An in-network allreduce of 64 chunks under policy ``cc`` whose results all come
    marked (or not), each a millisecond after the last: the policy's window and
    rate at the end, and the copies of chunks it sent in all."""
    from fabric.core.congestion.settings import CongestionSettings

    topo = star(2, bandwidth_gbps=10, latency_us=5).with_congestion(CongestionSettings(cc=cc))
    st = NodeState(topo, "w0", timeout_s=5.0)
    x = np.arange(64 * 256, dtype=np.int32)
    js = JobState(job=9, slots=16, slot_elems=256, granted=True, reason="")
    prog = InaAllreduce(st, Tensor(x.size, "int32", x, np.zeros_like(x)), "sum", js)
    assert prog.gate is not None

    def chunks(sends: list) -> list[int]:
        return [int.from_bytes(h[12:16], "little") for h, _ in sends]

    sent = chunks(prog.start(0.0))
    copies = len(sent)
    t = 0.0
    while not prog.done:
        for i in sorted({c for c in sent if not prog.got[c]}):
            t += 1e-3
            seg = x[i * 256:(i + 1) * 256] * 2
            h = fr.encode_header(Op.RESULT, src=st.switch_id, dst=st.node_id, job=js.job,
                                 psn=i, dtype=fr.dtype_from_name("int32"), payload=seg,
                                 flags=Flag.ECN if marked else Flag.NONE)
            more = chunks(prog.handle_frame(fr.decode(h, memoryview(seg.view(np.uint8))), t))
            sent += more
            copies += len(more)
        due = prog.get_timer()
        if not prog.done and due is not None:  # the pacer (or a timer) holds the next
            t = max(t, due)
            more = chunks(prog.handle_timer(t))
            sent += more
            copies += len(more)
    np.testing.assert_array_equal(prog.t.out, x * 2)
    return prog.gate.cwnd, prog.gate.cc.rate_bps, copies


@pytest.mark.parametrize("cc", ["nscc", "dcqcn"])
def test_ina_chunks_go_as_the_congestion_policy_lets_them(cc: str) -> None:
    """[congestion] cc governs in-network chunks: a result that comes marked (the
    chunk met congestion on its way, anywhere in its tree) shrinks the policy's
    window or rate; every chunk still lands, exact."""
    cwnd, rate, copies = _ina_under_cc(cc, marked=False)
    cwnd_m, rate_m, copies_m = _ina_under_cc(cc, marked=True)
    assert copies >= 64 and copies_m >= 64
    assert cwnd_m < cwnd if cc == "nscc" else rate_m < rate


def test_ina_window_is_self_clocked_and_forged_results_are_ignored() -> None:
    st = _state()
    x = np.arange(10, dtype=np.int32)
    out = np.zeros_like(x)
    js = JobState(job=7, slots=2, slot_elems=3, granted=True, reason="")
    prog = InaAllreduce(st, Tensor(10, "int32", x, out), "sum", js)
    first = prog.start(0.0)
    assert len(first) == 2  # the window: 2 of the 4 chunks
    assert not prog.wants(_result(st, js, 0, x[:3] * 3, src=st.worker_ids[1]))
    for i in range(4):
        seg = x[i * 3:(i + 1) * 3] * 3
        f = _result(st, js, i, seg)
        assert prog.wants(f)
        sends = prog.handle_frame(f, 0.001 * (i + 1))
        assert len(sends) == (1 if i + 2 < 4 else 0)
    assert prog.done
    np.testing.assert_array_equal(out, x * 3)


def test_ring_takes_frames_of_a_later_step_early() -> None:
    """The left neighbour may be a step ahead: its frames wait for our step."""
    st = _state("w1", world=2)
    x = np.arange(6, dtype=np.int32)
    out = np.empty_like(x)
    prog = HostRingAllreduce(st, Tensor(6, "int32", x, out), "sum")
    assert prog.start(0.0)
    left = st.worker_ids[0]

    def frame(step: int, data: np.ndarray) -> fr.Frame:
        h = fr.encode_header(Op.WRITE, src=left, dst=st.node_id, flow=3, psn=step << 16,
                             msg=prog.msg, dtype=fr.dtype_from_name("int32"), payload=data)
        return fr.decode(h, memoryview(data.view(np.uint8)))

    # step 1 (all-gather) arrives before step 0 (reduce-scatter)
    assert prog.handle_frame(frame(1, np.array([100, 200, 300], np.int32)), 0.0) == []
    sends = prog.handle_frame(frame(0, np.array([10, 10, 10], np.int32)), 0.0)
    assert [h for h, _ in sends if fr.peek(h)[0] is Op.ACK]  # step ACKs to the left
    assert not prog.done  # until the right neighbour ACKs what we sent
    for step in (0, 1):
        ack = fr.decode(fr.encode_header(Op.ACK, src=left, dst=st.node_id, flow=3, psn=step,
                                         msg=prog.msg))
        assert prog.wants(ack)
        prog.handle_frame(ack, 0.01)
    assert prog.done
    # rank 1 reduces segment 0 (x[:3] + left), then gathers segment 1 from the left
    np.testing.assert_array_equal(out, [10, 11, 12, 100, 200, 300])


def test_a_selective_stream_spans_the_sack_bitmap_and_go_back_n_its_window() -> None:
    # selective repeat: new frames pass a hole; go-back-N would only resend them
    data = np.arange(64 * 1024, dtype=np.float32)  # 256 KiB, 16 frames of 16 KiB
    for policy, span in (("selective", STREAM_SPAN), ("gbn", STREAM_WINDOW)):
        tx = StreamSend(_state("w0", 2), 1, data, policy=policy, frame_bytes=16 * 1024)
        rx = StreamRecv(_state("w1", 2), 0, np.empty_like(data), policy=policy,
                        frame_bytes=16 * 1024)
        assert tx.sender.window_frames == STREAM_WINDOW
        assert tx.sender.span_frames == span and rx.receiver.window == span
