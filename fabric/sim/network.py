"""A packet-level fabric in virtual time: frames at MTU through queued ports.

Where :class:`fabric.sim.engine.Simulation` moves whole frames of up to the
topology's MTU through link pipelines that never fill, this model is for the
questions where queues decide: every frame is at most one MTU, every switch
egress port has a FIFO per traffic class drawing on the switch's
:class:`~fabric.core.congestion.SharedBuffer`, and the pure mechanisms of
:mod:`fabric.core.congestion` decide admission (tail drop or trimming), ECN
marks and PFC pauses. Endpoints (:mod:`fabric.sim.transport`) send and
receive real semfab frame headers; the switch sets the header's CE bit.

Traffic classes: ``CTRL`` (ACKs, NACKs, CNPs, credits, PFC frames and trimmed
headers) is served first, strictly; ``DATA`` carries payload, and is the class
PFC pauses. Control frames are not charged to the buffer, except trimmed
headers (they stand for data).

Credit-based link flow control (:mod:`fabric.core.congestion.credit`): a port
with a :class:`~fabric.core.congestion.credit.CreditLink` sends a data frame only
while it holds credits for it; the switch (or host) at the other end returns
them in a ``K_CREDIT`` control frame when the frame leaves its buffer (a host:
when it arrives).

One event loop (:class:`Net`): a heap of ``(time, seq, callback, argument)``;
nothing reads the wall clock, and one seed gives one run.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from fabric.core.congestion import (
    Admission,
    PauseState,
    PfcEvent,
    PfcIngress,
    RedMarker,
    SharedBuffer,
    find_pause_cycle,
)
from fabric.core.congestion.config import TRIM_HEADER_BYTES
from fabric.core.congestion.credit import CreditLink
from fabric.core.frame import Flag

__all__ = ["CTRL", "DATA", "CONTROL_WIRE_BYTES", "Net", "Node", "Packet", "PfcWatchdog", "Port",
           "Switch", "credit_packet", "pause_waits"]

#: Traffic classes: control (strict priority) and data.
CTRL, DATA = 0, 1
#: Bytes a control frame occupies on the wire: the minimum Ethernet frame
#: (IEEE 802.3), which also holds our 32-byte header.
CONTROL_WIRE_BYTES = 64
#: Packet kinds (what the header's opcode says, kept for cheap dispatch).
K_DATA, K_ACK, K_NACK, K_CNP, K_PULL, K_PAUSE, K_RESUME, K_CREDIT = range(8)

_ECN = int(Flag.ECN)


class Packet:
    """One frame on the wire: its header bytes (the CE bit is set in place), its
    payload (None: none, or trimmed away) and what the model needs to move it."""

    __slots__ = ("header", "payload", "size", "kind", "src", "dst", "flow", "psn", "tc",
                 "in_port", "sent_at")

    def __init__(self, header: bytearray, payload: Any, size: int, kind: int, src: int,
                 dst: int, flow: int, psn: int, tc: int, sent_at: float = 0.0) -> None:
        self.header = header
        self.payload = payload
        self.size = size
        self.kind = kind
        self.src = src
        self.dst = dst
        self.flow = flow
        self.psn = psn
        self.tc = tc
        self.in_port = -1
        self.sent_at = sent_at

    @property
    def ecn(self) -> bool:
        """The congestion-experienced bit of the header."""
        return bool(self.header[2] & _ECN)

    @property
    def trimmed(self) -> bool:
        """A data frame whose payload a switch cut away."""
        return self.kind == K_DATA and self.payload is None


class Net:
    """The event loop."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        #: flows not yet received whole (receivers count down; scenarios stop at 0)
        self.pending = 0
        self._heap: list[tuple[float, int, Callable[[Any, float], None], Any]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[Any, float], None], arg: Any = None) -> None:
        """Call ``fn(arg, t)`` at virtual time ``t``."""
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def run(self, until: Callable[[], bool], limit_s: float) -> bool:
        """Run events until ``until()`` or nothing is left or ``limit_s`` passes;
        True when ``until()`` holds."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until():
                return True
            t, _s, fn, arg = pop(heap)
            if t > limit_s:
                heapq.heappush(heap, (t, _s, fn, arg))
                break
            self.now = t
            self.events += 1
            fn(arg, t)
        return until()


class Node:
    """Something with ports: a switch or a host."""

    name = ""

    def receive(self, arrival: tuple[Packet, int], t: float) -> None:
        raise NotImplementedError

    def pull(self, port: Port, t: float) -> Packet | None:
        """A free port with empty queues asks its owner for a frame (hosts send this way)."""
        return None

    def departed(self, port: Port, pkt: Packet, t: float) -> None:
        """``pkt`` finished leaving through ``port``."""


class Port:
    """One egress port and its link: a FIFO per class, serialisation at ``rate``, then
    ``latency`` to the peer's ingress ``peer_in``."""

    __slots__ = ("net", "owner", "index", "peer", "peer_in", "rate", "latency", "ctrl", "data",
                 "busy", "pause", "data_bytes", "peak_bytes", "sent_frames", "sent_bytes",
                 "depth", "name", "q_area", "q_t", "pause_log", "credit")

    def __init__(self, net: Net, owner: Node, index: int, rate_bps: float,
                 latency_s: float) -> None:
        self.net = net
        self.owner = owner
        self.index = index
        self.peer: Node = owner
        self.peer_in = -1
        self.rate = rate_bps
        self.latency = latency_s
        self.ctrl: deque[Packet] = deque()
        self.data: deque[Packet] = deque()
        self.busy = False
        self.pause = PauseState()
        self.data_bytes = 0
        self.peak_bytes = 0
        self.sent_frames = 0
        self.sent_bytes = 0
        self.depth: list[tuple[float, int]] | None = None  # (t, data bytes) when traced
        self.pause_log: list[tuple[float, bool]] | None = None  # (t, data paused) when traced
        self.q_area = 0.0  # integral of the data queue over time (byte-seconds)
        self.q_t = 0.0
        self.name = f"{owner.name}:{index}"
        #: credit-based flow control of this link (None: off)
        self.credit: CreditLink | None = None

    def connect(self, peer: Node, peer_in: int) -> None:
        self.peer, self.peer_in = peer, peer_in

    def enqueue(self, pkt: Packet, t: float) -> None:
        """Queue ``pkt`` (admission is the owner's business) and start if idle."""
        if pkt.tc == CTRL:
            self.ctrl.append(pkt)
        else:
            self.data.append(pkt)
            self.q_area += self.data_bytes * (t - self.q_t)
            self.q_t = t
            self.data_bytes += pkt.size
            if self.data_bytes > self.peak_bytes:
                self.peak_bytes = self.data_bytes
            if self.depth is not None:
                self.depth.append((t, self.data_bytes))
        if not self.busy:
            self._start(t)

    def mean_queue(self, t: float) -> float:
        """Time-average bytes in the data queue from 0 to ``t``."""
        area = self.q_area + self.data_bytes * (t - self.q_t)
        return area / t if t > 0 else 0.0

    def kick(self, t: float) -> None:
        """Something may be ready to send (a host's flow, a resumed class)."""
        if not self.busy:
            self._start(t)

    def set_paused(self, tc: int, paused: bool, t: float) -> None:
        """A PFC frame from the peer arrived."""
        if self.pause_log is not None and tc == DATA:
            self.pause_log.append((t, paused))
        if paused:
            self.pause.pause(tc, t)
        else:
            self.pause.resume(tc, t)
            self.kick(t)

    def add_credits(self, nbytes: int, t: float) -> None:
        """A credit return from the peer arrived."""
        assert self.credit is not None
        self.credit.refill(nbytes)
        self.kick(t)

    def _start(self, t: float) -> None:
        pkt: Packet | None
        credit = self.credit
        if self.ctrl:
            pkt = self.ctrl.popleft()
        elif self.pause.is_paused(DATA):
            pkt = None
        elif credit is not None and self.data and not credit.can_send(self.data[0].size, t):
            pkt = None  # the head waits for credits, and everything behind it
        elif self.data:
            pkt = self.data.popleft()
            self.q_area += self.data_bytes * (t - self.q_t)
            self.q_t = t
            self.data_bytes -= pkt.size
            if self.depth is not None:
                self.depth.append((t, self.data_bytes))
        else:
            pkt = self.owner.pull(self, t)
            if pkt is not None and credit is not None and pkt.tc == DATA:
                if not credit.can_send(pkt.size, t):  # (a host's pull checks first)
                    raise AssertionError(f"{self.name}: pulled a frame without credit")
        if pkt is None:
            self.busy = False
            return
        if credit is not None and pkt.tc == DATA:
            credit.spend(pkt.size, t)
        self.busy = True
        self.net.at(t + pkt.size * 8 / self.rate, self._done, pkt)

    def _done(self, pkt: Packet, t: float) -> None:
        self.sent_frames += 1
        self.sent_bytes += pkt.size
        self.owner.departed(self, pkt, t)
        self.net.at(t + self.latency, self.peer.receive, (pkt, self.peer_in))
        self._start(t)


class Switch(Node):
    """A switch: routes by destination, admits to its shared buffer (drop or trim),
    marks CE by RED, and runs PFC on the data class."""

    def __init__(self, net: Net, name: str, buffer: SharedBuffer, *,
                 marker: RedMarker | None = None, pfc: PfcIngress | None = None,
                 trim: bool = False, rng: random.Random | None = None) -> None:
        self.net = net
        self.name = name
        self.buffer = buffer
        #: per port, the pool its queues draw on: ``buffer`` for all (a shared
        #: buffer), unless :meth:`add_port` is given one of the port's own
        self.buffers: list[SharedBuffer] = []
        self.marker = marker
        self.pfc = pfc
        self.trim = trim
        self.rng = rng or random.Random(0)
        self.ports: list[Port] = []
        #: destination host id -> the egress ports that lead there (ECMP choices)
        self.routes: dict[int, list[int]] = {}
        self.spray = False
        #: buffer bytes kept for PFC headroom (every port's): the XOFF threshold is a
        #: fraction of the free bytes outside it, so what a paused sender still has
        #: in flight always fits
        self.pfc_reserve = 0
        #: credit-based flow control on every link into this switch
        self.credit = False
        self.ecn_marks = 0
        self.lossless_drops = 0  # frames PFC should have held back (headroom too small)

    def add_port(self, rate_bps: float, latency_s: float,
                 buffer: SharedBuffer | None = None) -> Port:
        port = Port(self.net, self, len(self.ports), rate_bps, latency_s)
        self.ports.append(port)
        self.buffers.append(buffer if buffer is not None else self.buffer)
        return port

    def pools(self) -> list[SharedBuffer]:
        """Every distinct buffer of the switch."""
        seen: dict[int, SharedBuffer] = {}
        for b in [self.buffer, *self.buffers]:
            seen.setdefault(id(b), b)
        return list(seen.values())

    def receive(self, arrival: tuple[Packet, int], t: float) -> None:
        pkt, in_port = arrival
        if pkt.kind == K_PAUSE or pkt.kind == K_RESUME:
            self.ports[in_port].set_paused(pkt.flow, pkt.kind == K_PAUSE, t)
            return
        if pkt.kind == K_CREDIT:
            self.ports[in_port].add_credits(pkt.psn, t)
            return
        choices = self.routes[pkt.dst]
        if len(choices) == 1:
            out = choices[0]
        elif self.spray:
            out = choices[self.rng.randrange(len(choices))]
        else:  # ECMP: one path per flow
            out = choices[hash((pkt.src, pkt.dst, pkt.flow)) % len(choices)]
        port = self.ports[out]
        if pkt.tc == CTRL:  # not charged to the buffer here (a trimmed header was, where
            pkt.in_port = -1  # it was trimmed)
            port.enqueue(pkt, t)
            return
        pkt.in_port = in_port
        buf = self.buffers[out]
        if self.credit:
            # lossless by credits: the sender had room here for this frame
            verdict = buf.offer_lossless(out, DATA, pkt.size)
            if verdict is not Admission.ACCEPT:
                self.lossless_drops += 1
        elif self.pfc is not None:
            # lossless: PFC, not a threshold, keeps the pool from filling
            verdict = buf.offer_lossless(out, DATA, pkt.size)
            if verdict is Admission.ACCEPT:
                ev = self.pfc.on_enqueue(in_port, DATA, pkt.size,
                                         max(buf.free - self.pfc_reserve, 0))
                if ev is not None:
                    self._pfc_frame(ev, t)
            else:
                self.lossless_drops += 1
        else:
            verdict = buf.offer(out, DATA, pkt.size, trim_tc=CTRL if self.trim else None)
        if verdict is Admission.ACCEPT:
            if self.marker is not None and self.marker.mark(port.data_bytes):
                pkt.header[2] |= _ECN
                self.ecn_marks += 1
            port.enqueue(pkt, t)
        elif verdict is Admission.TRIM:
            pkt.payload = None
            pkt.size = TRIM_HEADER_BYTES
            pkt.tc = CTRL
            port.enqueue(pkt, t)
        elif self.credit:  # dropped after all (a pool smaller than the credits it
            # granted): its room is free at once, so its credit goes back now
            self.ports[in_port].enqueue(credit_packet(pkt.size), t)

    def departed(self, port: Port, pkt: Packet, t: float) -> None:
        if pkt.kind != K_DATA or pkt.in_port < 0:
            return  # control frames are not charged
        buf = self.buffers[port.index]
        if pkt.payload is None:  # a trimmed header, charged to the control class
            buf.release(port.index, CTRL, pkt.size)
            return
        buf.release(port.index, DATA, pkt.size)
        if self.credit:  # its room here is free again: the credit goes back upstream
            self.ports[pkt.in_port].enqueue(credit_packet(pkt.size), t)
        if self.pfc is not None:
            ev = self.pfc.on_dequeue(pkt.in_port, DATA, pkt.size,
                                     max(buf.free - self.pfc_reserve, 0))
            if ev is not None:
                self._pfc_frame(ev, t)

    def _pfc_frame(self, ev: PfcEvent, t: float) -> None:
        """PAUSE or resume to the sender on ingress ``ev.port``: a control frame that
        goes out of our port on that link, ahead of data."""
        kind = K_PAUSE if ev.pause else K_RESUME
        pkt = Packet(bytearray(CONTROL_WIRE_BYTES), None, CONTROL_WIRE_BYTES, kind, -1, -1,
                     ev.tc, 0, CTRL)
        self.ports[ev.port].enqueue(pkt, t)


def credit_packet(nbytes: int) -> Packet:
    """A credit return of ``nbytes`` (a control frame; the bytes ride in ``psn``)."""
    return Packet(bytearray(CONTROL_WIRE_BYTES), None, CONTROL_WIRE_BYTES, K_CREDIT, -1, -1, 0,
                  nbytes, CTRL)


def pause_waits(switches: list[Switch]) -> dict[str, list[str]]:
    """The wait-for graph of paused ports: a paused egress port waits on the ports of
    the switch that paused it through which the frames it sent there must leave,
    when those are paused too. A cycle is a PFC deadlock: nothing in it can move."""
    waits: dict[str, list[str]] = {}
    for sw in switches:
        for port in sw.ports:
            peer = port.peer
            if not port.pause.is_paused(DATA) or not isinstance(peer, Switch):
                continue
            waits[port.name] = [q.name for q in peer.ports if q.pause.is_paused(DATA)
                                and any(p.in_port == port.peer_in for p in q.data)]
    return waits


class PfcWatchdog:
    """Looks every ``period_s`` for data classes paused longer than ``limit_s`` (the
    802.1Qbb watchdog's trigger); if the paused ports wait on each other in a cycle,
    records it in ``deadlock`` (the ports, in order) and stops the run."""

    def __init__(self, net: Net, switches: list[Switch], period_s: float,
                 limit_s: float) -> None:
        self.net = net
        self.switches = switches
        self.period = period_s
        self.limit = limit_s
        self.deadlock: list[str] | None = None
        self.stuck_seen = 0
        net.at(period_s, self._look)

    def _look(self, _arg: Any, t: float) -> None:
        stuck = [p for sw in self.switches for p in sw.ports if p.pause.stuck(t, self.limit)]
        if stuck:
            self.stuck_seen += 1
            cycle = find_pause_cycle(pause_waits(self.switches))
            if cycle is not None:
                self.deadlock = cycle
                return  # the run's stop condition reads it
        if self.net.pending > 0:
            self.net.at(t + self.period, self._look)
