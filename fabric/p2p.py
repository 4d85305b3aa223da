"""Point-to-point bulk WRITE streams between two workers, through the switch.

The driver loops around :class:`fabric.reliability.Sender` and ``Receiver``
(pure): frames are WRITEs carrying a slice of the source buffer at its byte
offset; the receiver stores each slice at that offset on first arrival
(unordered delivery, as RDMA WRITEs to distinct addresses) and answers with
ACK (cumulative PSN + SACK bitmap) and gap NACKs. The retransmit policy
(``selective`` or ``gbn``, or any registered one) is chosen by name.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from fabric import frame as fr
from fabric.errors import FabricTimeout, UsageError
from fabric.frame import Op
from fabric.reliability import Receiver, Sender

if TYPE_CHECKING:
    from fabric.endpoint import Endpoint

#: Flow ids of p2p streams start here (other flows: 2 host-ps, 3 ring).
P2P_FLOW = 16
#: A FIN tells the receiver the sender saw every ACK it needed.
_FIN = 0xFFFF_FFFF
#: How long a finished receiver keeps answering retransmissions without a FIN.
LINGER_S = 1.0
#: Retransmissions of one frame before a stream fails, and the RTO ceiling.
#: Go-back-N resends a whole burst whenever any frame of it is lost, so under
#: heavy loss (5% per link, two links per path) a tail frame is "lost" in most
#: rounds; the sender's general defaults (8, 2 s) would fail such streams, and a
#: fabric's round trip is milliseconds, not the seconds RFC 6298 allows for.
STREAM_MAX_RETRIES = 64
STREAM_RTO_MAX_S = 0.25
#: Frames in flight per stream. The emulated path's bandwidth-delay product is
#: a few frames; a deeper window only queues in the sockets, inflating the RTT
#: the retransmit timer must track.
STREAM_WINDOW = 16


def _poll(ep: Endpoint, deadline: float | None) -> bool:
    wait = 1000 if deadline is None else max(math.ceil((deadline - time.monotonic()) * 1000), 0)
    return bool(ep.sock.poll(min(wait, 1000)))


def _from_stash(ep: Endpoint, flow: int, peer: int, sid: int) -> fr.Frame | None:
    """A deferred frame of this stream (it may have arrived while this node was
    still in a barrier); deferred frames of earlier streams are dropped."""
    keep = []
    found = None
    while ep.stash:
        f = ep.stash.popleft()
        if f.flow == flow and f.src == peer:
            if f.job == sid and found is None:
                found = f
            elif f.job == sid:
                keep.append(f)
            continue  # an earlier stream's leftover
        keep.append(f)
    ep.stash.extend(keep)
    return found


def _recv(ep: Endpoint) -> fr.Frame | None:
    parts = ep.sock.recv_multipart(copy=False)
    try:
        return fr.decode(parts[0].buffer, parts[1].buffer if len(parts) > 1 else None)
    except fr.FrameError:
        ep.bad_frames += 1
        return None


def _stream_id(ep: Endpoint, peer: int) -> int:
    """The next stream id between this node and ``peer`` (both ends count alike).

    It travels in the ``job`` field of every frame of the stream, so a late
    retransmission or FIN of an earlier stream can never be taken for this one.
    """
    sid = ep.streams.get(peer, 0) + 1
    ep.streams[peer] = sid
    return sid & 0xFFFF


def stream_send(ep: Endpoint, dst_rank: int, data: np.ndarray, *, policy: str = "selective",
                frame_bytes: int = 64 * 1024, flow: int = P2P_FLOW,
                window_frames: int = STREAM_WINDOW) -> dict[str, Any]:
    """Send ``data``'s bytes reliably to worker ``dst_rank``; returns sender statistics
    plus ``seconds`` (first send to last ACK)."""
    if not 0 <= dst_rank < ep.world or dst_rank == ep.rank:
        raise UsageError(f"dst_rank must be another worker's rank, got {dst_rank}")
    buf = data.reshape(-1).view(np.uint8)
    dst = ep.worker_ids[dst_rank]
    sid = _stream_id(ep, dst)
    nframes = max(-(-buf.nbytes // frame_bytes), 1)
    peer = ep.topo.by_id(dst).name
    sender: Sender[int] = Sender(flow, policy=policy, window_frames=window_frames,
                                 max_retries=STREAM_MAX_RETRIES, rto_max=STREAM_RTO_MAX_S,
                                 peer=peer, operation="WRITE stream")

    def put(transmits: list[Any]) -> None:
        for t in transmits:
            off = t.handle * frame_bytes
            part = buf[off : off + frame_bytes]
            ep.send(fr.encode_header(Op.WRITE, src=ep.node_id, dst=dst, flow=flow, job=sid,
                                     psn=t.psn, offset=off, flags=t.flags, payload=part,
                                     crc=ep.crc), part)

    t0 = time.monotonic()
    put(sender.send_many(((i, min(frame_bytes, buf.nbytes - i * frame_bytes))
                          for i in range(nframes)), t0))
    while not sender.done:
        f = _from_stash(ep, flow, dst, sid) if ep.stash else None
        if f is None:
            if not _poll(ep, sender.get_timer()):
                put(sender.handle_timer(time.monotonic()))
                continue
            f = _recv(ep)
        if f is None or f.flow != flow or f.src != dst or f.job != sid:
            if f is not None and not (f.flow == flow and f.src == dst):
                ep.defer(f)  # not of this stream's kind: someone else's; old ones drop
            continue
        now = time.monotonic()
        if f.op is Op.ACK:
            put(sender.handle_ack(f.psn, f.sack, now))
        elif f.op is Op.NACK:
            put(sender.handle_nack(f.psn, f.nack_code, now))
    seconds = time.monotonic() - t0
    ep.send(fr.encode_header(Op.ACK, src=ep.node_id, dst=dst, flow=flow, job=sid, psn=_FIN))
    stats = asdict(sender.statistics())
    stats["seconds"] = seconds
    return stats


def stream_recv(ep: Endpoint, src_rank: int, out: np.ndarray, *, policy: str = "selective",
                frame_bytes: int = 64 * 1024, flow: int = P2P_FLOW,
                window_frames: int = STREAM_WINDOW) -> dict[str, Any]:
    """Receive a stream from worker ``src_rank`` into ``out``; returns receiver statistics."""
    buf = out.reshape(-1).view(np.uint8)
    src = ep.worker_ids[src_rank]
    sid = _stream_id(ep, src)
    nframes = max(-(-buf.nbytes // frame_bytes), 1)
    receiver: Receiver[int] = Receiver(flow, policy=policy, ordered=False, window=window_frames)
    got = bytearray(nframes)
    done = 0
    finished_at: float | None = None
    last_heard = time.monotonic()
    while True:
        now = time.monotonic()
        if finished_at is not None and now - last_heard > LINGER_S:
            break
        if now - last_heard > ep.timeout_s:
            raise FabricTimeout(f"{ep.name}: WRITE stream {sid} from {ep.topo.by_id(src).name}: "
                                f"nothing for {ep.timeout_s:g}s ({done}/{nframes} frames; "
                                f"{receiver.statistics()})")
        f = _from_stash(ep, flow, src, sid) if ep.stash else None
        if f is None:
            if not _poll(ep, receiver.get_timer()):
                ack = receiver.handle_timer(time.monotonic())
                if ack is not None:
                    for frame in ack.frames(src=ep.node_id, dst=src, flow=flow, job=sid,
                                            crc=ep.crc):
                        ep.send(frame)
                continue
            f = _recv(ep)
        if f is None or f.flow != flow or f.src != src or f.job != sid:
            if f is not None and not (f.flow == flow and f.src == src):
                ep.defer(f)  # not a stream frame; earlier streams' leftovers drop
            continue
        last_heard = time.monotonic()
        if f.op is Op.ACK and f.psn == _FIN:
            break
        if f.op is not Op.WRITE:
            continue
        index = f.offset // frame_bytes
        if index >= nframes or f.offset % frame_bytes or f.offset + f.length > buf.nbytes:
            continue  # not ours (or damaged): never write outside the buffer
        delivered, ack = receiver.handle_frame(f.psn, index, last_heard, flags=f.flags)
        for d in delivered:
            if not got[d.handle]:
                got[d.handle] = 1
                done += 1
                buf[f.offset : f.offset + f.length] = np.frombuffer(f.payload, np.uint8)
        if ack is not None:
            for frame in ack.frames(src=ep.node_id, dst=src, flow=flow, job=sid, crc=ep.crc):
                ep.send(frame)
        if done == nframes and finished_at is None:
            finished_at = last_heard
    return asdict(receiver.statistics())



