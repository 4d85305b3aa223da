"""Endpoints of the packet-level fabric: hosts that send flows under a congestion-
control policy and receive them exactly.

A sender cuts its bytes into frames of one MTU (header included) with real
semfab WRITE headers; a frame leaves when its host's NIC is free, the policy's
window or credit allows and its pacing time has come (retransmissions first).
The receiver stores each payload at the header's offset, answers each frame
with an ACK that echoes the CE bit (DCQCN: a CNP instead, at most one per
50 us), answers a trimmed frame with a NACK at once (EQDS: and grants its bytes
again), and, for receiver-driven policies, paces out credit. A sender resends a
frame on its NACK, or when its retransmission timer expires (a frame dropped
whole). ``wrong`` compares every received byte with what was sent.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from fabric.core import frame as fr
from fabric.core.congestion import CongestionControl
from fabric.core.congestion.dcqcn import CnpPacer
from fabric.core.congestion.eqds import CreditPacer
from fabric.core.frame import Flag, Op
from fabric.sim.network import (
    CONTROL_WIRE_BYTES,
    CTRL,
    DATA,
    K_ACK,
    K_CNP,
    K_CREDIT,
    K_DATA,
    K_NACK,
    K_PAUSE,
    K_PULL,
    K_RESUME,
    Net,
    Node,
    Packet,
    Port,
    credit_packet,
)

__all__ = ["Host", "ReceiverFlow", "SenderFlow"]

_ECN = int(Flag.ECN)
#: CTRL frames' ``msg`` word: which control frame this is.
MSG_CNP, MSG_PULL = 1, 2


class SenderFlow:
    """One flow's sending side."""

    __slots__ = ("fid", "host", "dst", "data", "size", "mtu", "chunk", "nframes", "cc",
                 "rto", "next_psn", "rtx", "sent_at", "acked", "acked_count", "inflight",
                 "last_sent", "last_size", "retransmits", "timeouts", "timer_at",
                 "cc_timer_at", "start", "done_at", "nacks", "ecn_echoes")

    def __init__(self, fid: int, host: Host, dst: int, data: np.ndarray, mtu: int,
                 cc: CongestionControl, rto_s: float, start: float = 0.0) -> None:
        self.fid = fid
        self.host = host
        self.dst = dst
        self.data = data
        self.size = int(data.nbytes)
        self.mtu = mtu
        self.chunk = mtu - fr.HEADER_SIZE
        self.nframes = max(-(-self.size // self.chunk), 1)
        self.cc = cc
        self.rto = rto_s
        self.next_psn = 0
        self.rtx: deque[int] = deque()
        self.sent_at: dict[int, float] = {}  # outstanding psn -> last send time
        self.acked = bytearray(self.nframes)
        self.acked_count = 0
        self.inflight = 0
        self.last_sent = start  # pacing: when the last frame left, and its size
        self.last_size = 0
        self.retransmits = 0
        self.timeouts = 0
        self.nacks = 0
        self.ecn_echoes = 0
        self.timer_at: float | None = None
        self.cc_timer_at: float | None = None
        self.start = start
        self.done_at: float | None = None

    def wire_size(self, psn: int) -> int:
        """Bytes frame ``psn`` puts on the wire (header included)."""
        return fr.HEADER_SIZE + min(self.chunk, self.size - psn * self.chunk)

    @property
    def wire_bytes(self) -> int:
        """Bytes of every frame of the flow, once each."""
        return self.size + self.nframes * fr.HEADER_SIZE

    def next_frame(self) -> int | None:
        """The psn that would go next, or None (nothing left to send)."""
        rtx = self.rtx
        while rtx:
            psn = rtx[0]
            if self.acked[psn] or psn in self.sent_at:
                rtx.popleft()  # acknowledged (or resent) since it was queued
                continue
            return psn
        return self.next_psn if self.next_psn < self.nframes else None

    @property
    def next_time(self) -> float:
        """When pacing lets the next frame go, at the policy's rate now (a rate that
        rose since the last frame counts at once)."""
        rate = self.cc.rate_bps
        if rate >= self.host.nic.rate:
            return self.start
        return self.last_sent + self.last_size * 8 / rate

    def ready(self, t: float) -> bool:
        if self.done_at is not None or t < self.next_time or t < self.start:
            return False
        psn = self.next_frame()
        return psn is not None and self.cc.can_send(self.inflight, self.wire_size(psn))

    def take(self, t: float) -> Packet:
        """Build the next frame (``ready`` said one may go)."""
        psn = self.next_frame()
        assert psn is not None
        if self.rtx and self.rtx[0] == psn:
            self.rtx.popleft()
            self.retransmits += 1
        else:
            self.next_psn += 1
        off = psn * self.chunk
        n = min(self.chunk, self.size - off)
        part = memoryview(self.data.data)[off:off + n]  # a view: the payload is not copied
        # key: the bytes still to send, so a credit-granting receiver knows the backlog
        backlog = max(self.wire_bytes - off - fr.HEADER_SIZE * psn, 0) & 0xFFFF_FFFF
        header = bytearray(fr.encode_header(
            Op.WRITE, src=self.host.hid, dst=self.dst, flow=self.fid, psn=psn, offset=off,
            key=backlog, flags=Flag.LAST if off + n == self.size else Flag.NONE, payload=part))
        size = fr.HEADER_SIZE + n
        self.sent_at[psn] = t
        self.inflight += size
        self.cc.on_send(size, t)
        self.last_sent, self.last_size = t, size
        self._arm(t)
        self._arm_cc()
        return Packet(header, part, size, K_DATA, self.host.hid, self.dst, self.fid, psn, DATA,
                      sent_at=t)

    def on_ack(self, psn: int, ecn: bool, t: float) -> None:
        sent = self.sent_at.pop(psn, None)
        if self.acked[psn]:
            return
        self.acked[psn] = 1
        self.acked_count += 1
        size = self.wire_size(psn)
        if sent is not None:
            self.inflight -= size
            if ecn:
                self.ecn_echoes += 1
            self.cc.on_ack(size, ecn, t - sent, t)
        if self.acked_count == self.nframes:
            self.done_at = t

    def on_nack(self, psn: int, t: float) -> None:
        self.nacks += 1
        if self.acked[psn] or self.sent_at.pop(psn, None) is None:
            return
        size = self.wire_size(psn)
        self.inflight -= size
        self.cc.on_nack(size, t)
        self.rtx.append(psn)

    def on_timer(self, _arg: Any, t: float) -> None:
        self.timer_at = None
        if self.done_at is not None:
            return
        expired = []
        for p, s in self.sent_at.items():  # oldest first
            if s + self.rto > t:
                break
            expired.append(p)
        for psn in expired:
            del self.sent_at[psn]
            size = self.wire_size(psn)
            self.inflight -= size
            self.timeouts += 1
            self.cc.on_timeout(size, t)
            self.rtx.append(psn)
        self._arm(t)
        if expired:
            self.host.nic.kick(t)

    def on_cc_timer(self, _arg: Any, t: float) -> None:
        self.cc_timer_at = None
        due = self.cc.get_timer()
        if due is not None and due <= t:
            self.cc.handle_timer(t)
        self._arm_cc()
        self.host.nic.kick(t)

    def _arm(self, t: float) -> None:
        if self.timer_at is None and self.sent_at:
            # a resend re-inserts its psn, so the dict's first entry is the oldest send
            oldest = next(iter(self.sent_at.values()))
            self.timer_at = max(oldest + self.rto, t)
            self.host.net.at(self.timer_at, self.on_timer)

    def _arm_cc(self) -> None:
        due = self.cc.get_timer()
        if due is not None and (self.cc_timer_at is None or due < self.cc_timer_at):
            self.cc_timer_at = due
            self.host.net.at(due, self.on_cc_timer)


class ReceiverFlow:
    """One flow's receiving side: the bytes, in place, and which frames came."""

    __slots__ = ("fid", "src", "size", "chunk", "nframes", "out", "got", "count", "done_at",
                 "first", "duplicates", "trims", "ce")

    def __init__(self, fid: int, src: int, size: int, mtu: int) -> None:
        self.fid = fid
        self.src = src
        self.size = size
        self.chunk = mtu - fr.HEADER_SIZE
        self.nframes = max(-(-size // self.chunk), 1)
        self.out = np.zeros(size, np.uint8)
        self.got = bytearray(self.nframes)
        self.count = 0
        self.done_at: float | None = None
        self.first = True
        self.duplicates = 0
        self.trims = 0
        self.ce = 0


class Host(Node):
    """A host: one NIC port, the flows it sends, the flows it receives."""

    def __init__(self, net: Net, name: str, hid: int) -> None:
        self.net = net
        self.name = name
        self.hid = hid
        self.nic: Port = Port(net, self, 0, 1.0, 0.0)
        self.senders: list[SenderFlow] = []
        self.by_fid: dict[int, SenderFlow] = {}
        self.receivers: dict[int, ReceiverFlow] = {}
        self.cnp: CnpPacer | None = None
        self.credit: CreditPacer | None = None
        self._rr = 0
        self._wake_at: float | None = None
        self._credit_at: float | None = None
        #: bytes each flow sends before its first credit (receiver-driven policies)
        self.unsolicited_bytes = 0
        #: the link into this host is credit-controlled: return each frame's credit
        self.returns_credit = False

    def attach(self, rate_bps: float, latency_s: float) -> Port:
        self.nic = Port(self.net, self, 0, rate_bps, latency_s)
        return self.nic

    def add_sender(self, flow: SenderFlow) -> None:
        self.senders.append(flow)
        self.by_fid[flow.fid] = flow
        if flow.start > 0:
            self.net.at(flow.start, self._wake)

    # ------------------------------------------------------------------ sending
    def pull(self, port: Port, t: float) -> Packet | None:
        flows = self.senders
        n = len(flows)
        credit = port.credit
        for i in range(n):
            f = flows[(self._rr + i) % n]
            if f.ready(t):
                if credit is not None:
                    psn = f.next_frame()
                    assert psn is not None
                    if not credit.can_send(f.wire_size(psn), t):
                        return None  # a credit return kicks the port again
                self._rr = (self._rr + i + 1) % n
                return f.take(t)
        # nothing ready: wake for the earliest paced flow (window-limited ones wake on ACKs)
        wake = min((f.next_time for f in flows if f.done_at is None and f.next_time > t
                    and f.next_frame() is not None), default=None)
        if wake is not None and (self._wake_at is None or wake < self._wake_at
                                 or self._wake_at <= t):
            self._wake_at = wake
            self.net.at(wake, self._wake)
        return None

    def _wake(self, _arg: Any, t: float) -> None:
        if self._wake_at is not None and self._wake_at <= t:
            self._wake_at = None
        self.nic.kick(t)

    def _control(self, kind: int, dst: int, fid: int, psn: int, t: float, *,
                 flags: int = 0, msg: int = 0, offset: int = 0) -> None:
        op = Op.ACK if kind == K_ACK else Op.NACK if kind == K_NACK else Op.CTRL
        header = bytearray(fr.encode_header(op, src=self.hid, dst=dst, flow=fid, psn=psn,
                                            flags=flags, msg=msg, offset=offset))
        self.nic.enqueue(Packet(header, None, CONTROL_WIRE_BYTES, kind, self.hid, dst, fid,
                                psn, CTRL), t)

    # ------------------------------------------------------------------ receiving
    def receive(self, arrival: tuple[Packet, int], t: float) -> None:
        pkt = arrival[0]
        kind = pkt.kind
        if kind == K_DATA:
            self._data(pkt, t)
            return
        if kind == K_PAUSE or kind == K_RESUME:
            self.nic.set_paused(pkt.flow, kind == K_PAUSE, t)
            return
        if kind == K_CREDIT:
            self.nic.add_credits(pkt.psn, t)
            return
        flow = self.by_fid.get(pkt.flow)
        if flow is None:
            return
        if kind == K_ACK:
            flow.on_ack(pkt.psn, bool(pkt.header[2] & _ECN), t)
        elif kind == K_NACK:
            flow.on_nack(pkt.psn, t)
        elif kind == K_CNP:
            flow.cc.on_cnp(t)
            flow._arm_cc()
        elif kind == K_PULL:
            _op, _fl, _s, _j, _p, _k, offset, _len = fr.peek(bytes(pkt.header))
            flow.cc.on_credit(offset, t)
        self.nic.kick(t)

    def _data(self, pkt: Packet, t: float) -> None:
        if self.returns_credit:  # the NIC takes the frame at once: its room is free
            self.nic.enqueue(credit_packet(pkt.size), t)
        _op, flags, _src, _job, psn, key, offset, length = fr.peek(bytes(pkt.header))
        rx = self.receivers[pkt.flow]
        if rx.first and self.credit is not None:
            # the first frame tells the flow's size (its backlog plus what came before
            # it): grant all of it but what the sender sends unsolicited
            total = int(key) + offset + fr.HEADER_SIZE * psn
            self.credit.request(rx.fid, max(total - self.unsolicited_bytes, 0), t)
            self._arm_credit(t)
        rx.first = False
        if pkt.payload is None:  # trimmed: ask for it again at once
            rx.trims += 1
            self._control(K_NACK, rx.src, rx.fid, psn, t)
            if self.credit is not None:
                self.credit.request(rx.fid, length + fr.HEADER_SIZE, t)
                self._arm_credit(t)
            return
        ce = bool(flags & _ECN)
        if ce:
            rx.ce += 1
        if rx.got[psn]:
            rx.duplicates += 1
        else:
            rx.got[psn] = 1
            rx.count += 1
            rx.out[offset:offset + length] = np.frombuffer(pkt.payload, np.uint8)
            if rx.count == rx.nframes:
                rx.done_at = t
                self.net.pending -= 1
        if self.cnp is not None:
            if ce and self.cnp.on_ce(rx.fid, t):
                self._control(K_CNP, rx.src, rx.fid, psn, t, msg=MSG_CNP)
            self._control(K_ACK, rx.src, rx.fid, psn, t)
        else:
            self._control(K_ACK, rx.src, rx.fid, psn, t, flags=_ECN if ce else 0)

    def _arm_credit(self, t: float) -> None:
        assert self.credit is not None
        due = self.credit.get_timer()
        if due is not None and (self._credit_at is None or due < self._credit_at
                                or self._credit_at < t):
            self._credit_at = due
            self.net.at(due, self._on_credit)

    def _on_credit(self, _arg: Any, t: float) -> None:
        assert self.credit is not None
        if self._credit_at is not None and self._credit_at <= t:
            self._credit_at = None
        for fid, nbytes in self.credit.handle_timer(t):
            self._control(K_PULL, self.receivers[fid].src, fid, 0, t, msg=MSG_PULL,
                          offset=nbytes)
        self._arm_credit(t)
