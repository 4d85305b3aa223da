"""LinkPipeline: one direction of one emulated link, sans-IO.

A frame pushed into the pipeline goes through, in this order:

1. **faults** (:class:`fabric.core.faults.FaultInjector`, seeded): loss, bursts,
   duplication, reordering, corruption, delay. A link with link-level retry
   (``llr``) loses nothing: a frame lost or corrupted on it is replayed by the
   link (``llr_replays``) once the far end's negative acknowledgement is back,
   one round trip of the link later. The link sends nothing else meanwhile, so
   what follows stays behind it: go-back-N, as the frames sent in that round
   trip would be refused and sent again;
2. **the queue** (optional, a switch's egress,
   :class:`~fabric.core.congestion.switchq.SwitchQueues`): a frame that would not
   fit in the switch's buffer beside the frames still waiting to leave is dropped
   at the tail (``overflow_drops``; the senders' own recovery resends it) or, in a
   buffer that trims, cut to its header (``trims``), which is sent ahead of the
   queued data so the receiver asks for the frame at once; an admitted frame is
   marked congestion experienced (``Flag.ECN``, ``ecn_marks``) by the switch's
   RED marker on the data its port holds. A lossless buffer (``[congestion]
   pfc``) drops nothing: it counts what each ingress port holds
   (:class:`~fabric.core.congestion.pfc.PfcIngress`), and above XOFF it asks
   for that port's sender to be paused until what it holds drains to XON
   (:meth:`LinkPipeline.take_pause`; the driver calls :meth:`pause` on the
   link the frame came on, which moves that link's frames not yet begun);
   frames already on their way land in the headroom;
   A credit-controlled link (``credit``, :mod:`fabric.core.congestion.credit`)
   has no such queue: it sends a frame only while it holds credit for it (the far
   end's input buffer, granted up front) and otherwise keeps it, in order, with
   those behind it, until credit comes back (:meth:`LinkPipeline.credit_freed`:
   the far end freed that many bytes at a time, and the credit takes the link's
   latency to return). A node frees a frame as it arrives; a switch when the
   frame has left through its egress port, or when it consumed it (an
   aggregation's contribution): the driver passes the frame's ``credit_back``
   along with the first frame it caused, and hands each
   :meth:`LinkPipeline.take_credit_returns` to the link it came on;
3. **shaping** (:class:`LinkShaper`): it waits for the link to be free, occupies
   it for its serialisation time at the link's bandwidth, then travels
   ``latency_us``; a memory-plane frame is charged the bytes it names (the load
   or store it stands for);
4. **the hold queue**: it comes out of :meth:`LinkPipeline.pop_due` at its time.

Every link direction has exactly one pipeline, owned by whoever drives that
direction (the switch daemon for its ports in emulation, the simulator for
every link), so a frame is shaped and faulted once per link it crosses.

Items are ``(header, payload)`` pairs; the pipeline's owner knows where the
link leads.

A queue's depth over time can be recorded (``depth = []``): at each frame that
joins, the data bytes the port holds with it (drops and trims at the bytes it
held), at most ``DEPTH_POINTS`` points.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

from fabric.core import frame as fr
from fabric.core.congestion.buffer import Admission
from fabric.core.congestion.credit import CreditLink
from fabric.core.congestion.switchq import SwitchQueues
from fabric.core.congestion.timed import HEADER_CLASS
from fabric.core.faults import FaultInjector, FaultSpec, FaultStats
from fabric.core.frame import Flag, FrameError
from fabric.core.topology import LinkParams

__all__ = ["DEPTH_POINTS", "LinkPipeline", "LinkShaper", "PipelineStats", "wire_bytes"]

#: Queue-depth samples a recording pipeline keeps (a long run has millions).
DEPTH_POINTS: Final = 200_000
_F_REF: Final = int(Flag.REF)

Item = tuple[Any, Any]
#: What a frame's credit goes back to, and how many bytes: the driver's token for
#: the link it came on (opaque here), and its size on that link.
CreditBack = tuple[Any, int]


class LinkShaper:
    """Serialisation + propagation delay of one link direction (seconds).

    A frame of ``n`` bytes entering at ``now`` starts when the link is free,
    occupies it for ``n * 8 / bandwidth`` and arrives ``latency`` later: the
    store-and-forward model of one switch port. Departures never decrease, so
    deliveries on one link are never reordered.
    """

    def __init__(self, params: LinkParams) -> None:
        self.params = params
        self._free_at = 0.0
        self._latency_s = params.latency_us / 1e6
        self.frames = 0
        self.bytes = 0
        self.busy_s = 0.0

    @property
    def active(self) -> bool:
        """False when the link adds neither delay nor a bandwidth limit."""
        return self.params.shaped or self.params.latency_us > 0

    def schedule(self, nbytes: int, now: float) -> float:
        """Deliver time of ``nbytes`` entering the link at ``now``."""
        start = now if now > self._free_at else self._free_at
        wire = self.params.serialization_us(nbytes) / 1e6
        self._free_at = start + wire
        self.frames += 1
        self.bytes += nbytes
        self.busy_s += wire
        return self._free_at + self._latency_s

    def schedule_cut_through(self, nbytes: int, now: float, tail_in: float,
                             packet: int) -> tuple[float, float]:
        """``(head, tail)`` arrival of a frame sent as ``packet``-byte packets that
        starts entering at ``now`` and has fully entered by ``tail_in``: a switch
        forwards each packet as it comes (cut-through), so a frame crosses several
        hops in one serialisation time plus one packet time per hop."""
        start = now if now > self._free_at else self._free_at
        wire = self.params.serialization_us(nbytes) / 1e6
        pkt = self.params.serialization_us(min(packet, nbytes)) / 1e6
        end = max(start + wire, tail_in + pkt)  # never done before the tail came in
        self._free_at = end
        self.frames += 1
        self.bytes += nbytes
        self.busy_s += wire
        return start + pkt + self._latency_s, end + self._latency_s

    def hold_until(self, t: float) -> None:
        """Send nothing before ``t`` (a link replaying a frame, or paused)."""
        if t > self._free_at:
            self._free_at = t

    def backlog_s(self, now: float) -> float:
        """How long a frame entering now would wait for the link to be free."""
        return max(self._free_at - now, 0.0)

    @property
    def free_at(self) -> float:
        """When the last frame scheduled has left (its last byte on the wire)."""
        return self._free_at


def wire_bytes(header: Any, payload: Any) -> int:
    """Bytes a frame puts on its link: a referenced (memory-plane) frame also
    moves the ``length`` bytes it names, loaded or stored over that link."""
    head: int = len(header)
    size = head if payload is None else head + _nbytes(payload)
    # the flags byte first: only a referenced frame needs its header read
    if isinstance(header, bytes) and (head < fr.HEADER_SIZE or not header[2] & _F_REF):
        return size
    try:
        _op, flags, _s, _j, _p, _k, _o, length = fr.peek(header)
    except FrameError:
        return size
    return size + length if int(flags) & _F_REF else size


def _nbytes(payload: Any) -> int:
    # arrays and views know their size: a memoryview of them is made only for
    # other buffers (bytes)
    if isinstance(payload, (bytes, bytearray)):
        return len(payload)
    n = getattr(payload, "nbytes", None)
    return n if isinstance(n, int) else memoryview(payload).nbytes


@dataclass(frozen=True)
class PipelineStats:
    """What one link direction did."""

    frames: int
    bytes: int
    busy_s: float
    held: int
    lost_by_op: dict[str, int] = field(default_factory=dict)
    faults: FaultStats | None = None
    overflow_drops: int = 0  # frames the switch's buffer had no room for
    trims: int = 0  # frames cut to their header for lack of room
    ecn_marks: int = 0  # frames marked congestion experienced
    peak_queue_bytes: int = 0  # the most data bytes this port's queue held
    llr_replays: int = 0  # frames the link sent again (link-level retry)
    pauses_sent: int = 0  # PAUSEs this (lossless) port asked for its frames' senders
    pauses: int = 0  # PAUSEs this link received from its far end
    paused_s: float = 0.0  # time this link was paused, in total
    credit_stalls: int = 0  # frames that left later than the link could send them
    credit_stalled_s: float = 0.0  # time the link stood idle for want of credit


def _split(blob: bytes) -> tuple[bytes, memoryview | None]:
    """A contiguous (possibly corrupted) frame back into header and payload."""
    head_len = fr.HEADER_SIZE + (fr.CRC_SIZE if len(blob) > 2 and blob[2] & Flag.CRC else 0)
    if len(blob) <= head_len:
        return blob, None
    view = memoryview(blob)
    return bytes(view[:head_len]), view[head_len:]


class LinkPipeline:
    """Faults, then shaping, then the hold queue, for one direction of one link."""

    def __init__(self, params: LinkParams | None = None, faults: FaultSpec | None = None,
                 *, seed: int = 0, stream: str = "", cut_through: int = 0,
                 to_switch: bool = False, injector: FaultInjector | None = None,
                 queues: SwitchQueues | None = None, port: int = 0,
                 pausable: bool = False, credit_bytes: int = 0,
                 frees_on_arrival: bool = False) -> None:
        self.shaper = LinkShaper(params) if params is not None else None
        if self.shaper is not None and not self.shaper.active:
            self.shaper = None
        # a bounded queue: the switch's buffer, this link its port ``port`` (an
        # unshaped link never holds a frame back, so never queues)
        shaped = self.shaper is not None and self.shaper.params.shaped
        # credit-based flow control (``credit_bytes`` granted by the far end, which
        # frees each frame as it arrives when ``frees_on_arrival``: a node); such a
        # link waits instead of overflowing, so it has no switch queue to drop from
        self.credit = CreditLink(credit_bytes, mtu=1) if credit_bytes and shaped else None
        self.frees_on_arrival = frees_on_arrival
        self._blocked: deque[tuple[Item, float | None, int, CreditBack | None, int, float]] = \
            deque()
        # frames that left later than the link could have sent them, and the time
        # the link stood idle for want of credit
        self.credit_stalls = 0
        self.credit_stalled_s = 0.0
        self._refills: list[tuple[float, int]] = []  # (when credit arrives, bytes)
        self._returns: list[tuple[Any, int, float]] = []  # (token, bytes, freed at)
        self.queues = queues if shaped and self.credit is None else None
        self.port = port
        self.overflow_drops = 0
        self.trims = 0
        self.ecn_marks = 0
        self.peak_queue = 0
        #: ``[(now, data bytes queued)]`` at each arrival when set to a list
        self.depth: list[tuple[float, int]] | None = None
        if injector is not None:  # a caller's own, already seeded
            self.injector: FaultInjector | None = injector
        else:
            self.injector = (FaultInjector(faults, seed, stream=stream)
                             if faults is not None and not faults.clean else None)
        # cut-through (simulation): packets of this many bytes; a frame into a
        # switch is handed over when its head arrives, into a node at its tail
        self.cut_through = cut_through if self.shaper is not None else 0
        self.to_switch = to_switch
        # link-level retry: damaged frames are replayed here, not lost
        self.llr = params is not None and params.llr
        self.llr_replays = 0
        # a lossless queue (PFC): it pauses senders instead of dropping
        self.lossless = self.queues is not None and self.queues.lossless
        self._pause_request: tuple[int, float] | None = None
        self.pauses_sent = 0
        self.pauses = 0
        self.paused_s = 0.0
        self._paused_until = 0.0
        # frames scheduled and not yet delivered: seq -> (start, bytes, buffer hold),
        # so a pause can move those not yet begun (``pausable``: the far end may
        # send PAUSEs; not with cut-through). Kept only then: it costs every frame
        self._sched: dict[int, tuple[float, int, int]] = {}
        self.pausable = pausable and self.shaper is not None and not self.cut_through
        self._held: list[tuple[float, int, Item, float]] = []
        self._seq = itertools.count()
        # Without corruption the injector decides on an 8-byte token that stands
        # for the frame, so a large payload is not copied per link.
        self._tokens: dict[bytes, Item] = {}
        self._token_seq = itertools.count()
        self._lost_by_op: dict[str, int] = {}

    @property
    def active(self) -> bool:
        """False when frames pass straight through (no shaping, no faults)."""
        return self.shaper is not None or self.injector is not None

    def push(self, item: Item, now: float, tail: float | None = None,
             ingress: int = -1, credit_back: CreditBack | None = None) -> None:
        """A frame ``(header, payload)`` enters the link at ``now`` (cut-through:
        its last byte has entered by ``tail``); ``ingress``: the node id of the
        port it came into this switch on (a lossless buffer accounts by it);
        ``credit_back``: the credit of the frame that caused it, freed once it has
        left (:meth:`take_credit_returns`)."""
        inj = self.injector
        if inj is None:
            self._gate(item, now, tail, ingress, credit_back)
            return
        if self.llr:
            self._gate(item, self._replayed(inj, item, now), tail, ingress, credit_back)
            return
        if credit_back is not None:  # what a lossy link does to it frees the buffer now
            self._returns.append((credit_back[0], credit_back[1], now))
        for at, arrived in self._inject(inj, item, now):
            self._gate(arrived, max(at, now), tail, ingress, None)

    def credit_freed(self, at: float, nbytes: int) -> None:
        """The far end freed ``nbytes`` of this link's frames at ``at`` (a frame left
        it, or was consumed there): the credit is back one link latency later, and
        frames waiting for it go then (:meth:`pop_due`, :meth:`get_timer`)."""
        if self.credit is None or nbytes <= 0:
            return
        back = at + (self.shaper.params.latency_us * 1e-6 if self.shaper is not None else 0.0)
        heapq.heappush(self._refills, (back, nbytes))

    @property
    def waiting(self) -> int:
        """Frames waiting for credit."""
        return len(self._blocked)

    def waiting_tokens(self) -> list[Any]:
        """The ``credit_back`` tokens of the frames waiting for credit here: the
        links whose credit those frames hold (what a credit deadlock is made of)."""
        return [back[0] for _i, _t, _g, back, _n, _s in self._blocked if back is not None]

    @property
    def returning(self) -> bool:
        """Whether :meth:`take_credit_returns` has something."""
        return bool(self._returns)

    def take_credit_returns(self) -> list[tuple[Any, int, float]]:
        """``(token, bytes, freed_at)`` for each frame whose ``credit_back`` is due
        since the last call: the frame it stood for left the far end's buffer at
        ``freed_at`` (the driver calls :meth:`credit_freed` on the token's link)."""
        out, self._returns = self._returns, []
        return out

    def pop_due(self, now: float) -> list[Item]:
        """Every frame whose arrival time has come, in arrival order."""
        return [item for item, _tail in self.pop_due_timed(now)]

    def pop_due_timed(self, now: float) -> list[tuple[Item, float]]:
        """Like :meth:`pop_due`, with each frame's tail arrival time (cut-through)."""
        if self.injector is not None and self.injector.next_deadline() is not None:
            for at, arrived in self._resolve(self.injector.poll(now)):
                self._gate(arrived, max(at, now), None)
        if self._refills and self._refills[0][0] <= now:
            self._refill(now)
        out: list[tuple[Item, float]] = []
        held = self._held
        sched = self._sched
        while held and held[0][0] <= now:
            _due, seq, item, tail = heapq.heappop(held)
            if sched:
                sched.pop(seq, None)
            out.append((item, tail))
        return out

    def take_pause(self) -> tuple[int, float] | None:
        """``(ingress, until)`` when the last frame pushed took its ingress port
        above XOFF: pause the link it came on until then (the driver does, with
        :meth:`pause` on that link); None otherwise. Asked once per push."""
        req, self._pause_request = self._pause_request, None
        return req

    def pause(self, now: float, until: float) -> None:
        """The far end's port is full (PFC's PAUSE, or no credit): begin sending no
        frame before ``until``. A frame already on the wire at ``now`` goes on (it
        lands in the far end's headroom); those scheduled to begin later move, in
        order, and stay that much longer in this end's buffer, which may fill and
        pause the link before it in turn. An unshaped link holds nothing back, so
        has nothing to pause."""
        sh = self.shaper
        if sh is None or until <= now:
            return
        if now >= self._paused_until:
            self.pauses += 1
        if until > self._paused_until:
            self.paused_s += until - max(now, self._paused_until)
            self._paused_until = until
        # the frames not yet begun: the last ones scheduled (their starts only grow
        # with their sequence, and a pause keeps that order), found from the end
        later: list[int] = []
        for seq, (start, _n, _h) in reversed(self._sched.items()):
            if start < now:
                break
            later.append(seq)
        later.reverse()
        if not later or self._sched[later[0]][0] >= until:
            sh.hold_until(until)
            return
        moved = set(later)
        items = {e[1]: e[2] for e in self._held if e[1] in moved}
        self._held = [e for e in self._held if e[1] not in moved]
        heapq.heapify(self._held)
        buf = self.queues.buffer if self.queues is not None else None
        latency = sh.params.latency_us * 1e-6
        t = until
        for seq in later:
            start, nbytes, hold = self._sched[seq]
            begin = max(t, start)
            t = begin + sh.params.serialization_us(nbytes) * 1e-6
            if buf is not None and hold >= 0:
                hold = buf.postpone(hold, t)
            self._sched[seq] = (begin, nbytes, hold)
            heapq.heappush(self._held, (t + latency, seq, items[seq], t + latency))
        sh.hold_until(t)

    def get_timer(self) -> float | None:
        """When :meth:`pop_due` next has something, or None."""
        due = self._held[0][0] if self._held else None
        # credit coming back matters only to frames waiting for it (else it is
        # counted when the next frame asks)
        if self._blocked and self._refills and (due is None or self._refills[0][0] < due):
            due = self._refills[0][0]
        if self.injector is not None:
            d = self.injector.next_deadline()
            if d is not None and (due is None or d < due):
                due = d
        return due

    def __len__(self) -> int:
        return len(self._held) + len(self._blocked)

    def statistics(self) -> PipelineStats:
        """A frozen snapshot."""
        sh = self.shaper
        return PipelineStats(
            frames=sh.frames if sh else 0, bytes=sh.bytes if sh else 0,
            busy_s=sh.busy_s if sh else 0.0, held=len(self._held),
            lost_by_op=dict(self._lost_by_op),
            faults=self.injector.statistics() if self.injector is not None else None,
            overflow_drops=self.overflow_drops, trims=self.trims, ecn_marks=self.ecn_marks,
            peak_queue_bytes=self.peak_queue, llr_replays=self.llr_replays,
            pauses_sent=self.pauses_sent, pauses=self.pauses, paused_s=self.paused_s,
            credit_stalls=self.credit_stalls, credit_stalled_s=self.credit_stalled_s)

    # ------------------------------------------------------------------ internals
    def _gate(self, item: Item, now: float, tail: float | None, ingress: int = -1,
              back: CreditBack | None = None) -> None:
        """Credit flow control before shaping: a frame goes when the link holds
        credit for it and none waits before it; else it waits its turn."""
        cr = self.credit
        if cr is not None:
            if self._refills and self._refills[0][0] <= now:
                self._refill(now)
            # a frame larger than the whole grant goes once every credit is back
            size = wire_bytes(item[0], item[1])
            nbytes = min(size, cr.granted)
            if self._blocked or nbytes > cr.credits:
                self._blocked.append((item, tail, ingress, back, nbytes, now))
                return
            cr.spend(nbytes, now)
            self._shape(item, now, tail, ingress, back, size)
            return
        self._shape(item, now, tail, ingress, back)

    def _refill(self, now: float) -> None:
        """Credit that has come back by ``now``, each return at its own time: the
        frames waiting for it go then, in order."""
        cr = self.credit
        assert cr is not None
        refills = self._refills
        blocked = self._blocked
        sh = self.shaper
        while refills and refills[0][0] <= now:
            t, nbytes = heapq.heappop(refills)
            cr.refill(min(nbytes, cr.granted - cr.credits))
            while blocked and blocked[0][4] <= cr.credits:
                item, tail, ingress, back, n, since = blocked.popleft()
                cr.spend(n, t)
                # idle for want of credit: from when the link could have sent it
                idle = t - max(since, sh.free_at if sh is not None else since)
                if idle > 0:
                    self.credit_stalls += 1
                    self.credit_stalled_s += idle
                self._shape(item, t, tail, ingress, back)

    def _shape(self, item: Item, now: float, tail: float | None, ingress: int = -1,
               back: CreditBack | None = None, size: int = -1) -> None:
        if self.shaper is None:
            due = end = now if tail is None else max(now, tail)
            if back is not None:
                self._returns.append((back[0], back[1], now))
        else:
            nbytes = size if size >= 0 else wire_bytes(item[0], item[1])
            q = self.queues
            buf = q.buffer if q is not None else None
            if q is not None and buf is not None:
                if back is not None:  # the frame leaves (or is dropped) as decided below
                    self._returns.append((back[0], back[1], now))
                    back = None
                if item[1] is None and fr.is_trimmed(item[0]):
                    self._trim(item, now, again=True)  # cut upstream: a header already
                    return
                queued = buf.queued(self.port, now)
                depth = self.depth
                if depth is not None and len(depth) < DEPTH_POINTS:
                    depth.append((now, queued))  # replaced below if the frame joins
                # a frame of a header alone goes ahead whole; a stream's is cut to its
                # header; any other is dropped (its receiver could not ask for it), a
                # memory-plane frame too (the bytes it names would ride free)
                admitted = buf.admit_lossless(self.port, nbytes, now) if self.lossless else \
                    buf.admit(self.port, nbytes, now,
                              trimmable=(item[1] is None and nbytes <= len(item[0]))
                              or fr.trimmable(item[0]))
                if admitted is Admission.DROP:
                    self.overflow_drops += 1
                    self._count_lost(item[0])
                    return
                if admitted is Admission.TRIM:
                    self._trim(item, now)
                    return
                if queued + nbytes > self.peak_queue:
                    self.peak_queue = queued + nbytes
                if depth is not None and depth and depth[-1] == (now, queued):
                    depth[-1] = (now, queued + nbytes)
                if q.marker is not None and q.marker.mark(queued):
                    self.ecn_marks += 1
                    item = (fr.mark_ce(item[0], item[1]), item[1])
            if self.cut_through:
                head, end = self.shaper.schedule_cut_through(
                    nbytes, now, now if tail is None else tail, self.cut_through)
                due = head if self.to_switch else end
            else:
                due = end = self.shaper.schedule(nbytes, now)
            hold = buf.hold(self.port, nbytes, self.shaper.free_at, ingress=ingress) \
                if buf is not None else -1
            if back is not None:  # its cause's buffer is free once it has left
                self._returns.append((back[0], back[1], self.shaper.free_at))
            if self.frees_on_arrival and self.credit is not None:
                # a node takes the frame as it comes: its credit heads back then
                self.credit_freed(due, min(nbytes, self.credit.granted))
            if self.lossless and ingress >= 0 and buf is not None:
                until = buf.pause_until(ingress, now)
                if until is not None:
                    self.pauses_sent += 1
                    self._pause_request = (ingress, until)
            if self.pausable:
                seq = next(self._seq)
                ser = self.shaper.params.serialization_us(nbytes) * 1e-6
                self._sched[seq] = (self.shaper.free_at - ser, nbytes, hold)
                heapq.heappush(self._held, (due, seq, item, end))
                return
        heapq.heappush(self._held, (due, next(self._seq), item, end))

    def _replayed(self, inj: FaultInjector, item: Item, now: float) -> float:
        """When a frame entering a link with link-level retry at ``now`` is sent for
        the last time: each damaged copy occupies the link for its serialisation,
        reaches the far end, whose negative acknowledgement takes the link's
        latency back; the link sends nothing meanwhile. (With neither bandwidth
        nor latency the replay costs nothing but its count.)"""
        t = now
        sh = self.shaper
        while inj.damaged():
            self.llr_replays += 1
            if sh is not None:
                arrived = sh.schedule(wire_bytes(item[0], item[1]), t)
                t = arrived + sh.params.latency_us * 1e-6  # the NAK is back
                sh.hold_until(t)
        return t

    def _trim(self, item: Item, now: float, again: bool = False) -> None:
        """Send ``item``'s header alone, ahead of the queued data (a class served
        first: it waits for no data frame, and its few bytes are not charged to the
        link's schedule); ``again``: it came trimmed (not counted twice; headers are
        charged to a switch's buffer where they are cut, not on every hop)."""
        assert self.shaper is not None and self.queues is not None
        header = item[0]
        params = self.shaper.params
        sent = now + params.serialization_us(len(header)) * 1e-6
        if not again:
            if item[1] is not None and memoryview(item[1]).nbytes:
                self.trims += 1  # (a frame of a header alone loses nothing: not counted)
            self.queues.buffer.hold(self.port, self.queues.buffer.buffer.trim_bytes, sent,
                                    HEADER_CLASS)
        due = sent + params.latency_us * 1e-6
        heapq.heappush(self._held, (due, next(self._seq), (header, None), due))

    def _count_lost(self, header: Any) -> None:
        try:
            name = fr.peek(header)[0].name
        except FrameError:
            name = "MALFORMED"
        self._lost_by_op[name] = self._lost_by_op.get(name, 0) + 1

    def _inject(self, inj: FaultInjector, item: Item, now: float) -> list[tuple[float, Item]]:
        header, payload = item
        lost_before = inj.lost
        token = b""
        if inj.spec.corrupt:
            blob = bytes(header) + (memoryview(payload).tobytes() if payload is not None else b"")
            out = self._resolve(inj.apply(blob, now))
        else:
            token = next(self._token_seq).to_bytes(8, "little")
            self._tokens[token] = item
            out = self._resolve(inj.apply(token, now))
        if inj.lost != lost_before:
            self._count_lost(header)
            self._tokens.pop(token, None)
        return out

    def _resolve(self, arrivals: list[tuple[float, bytes]]) -> list[tuple[float, Item]]:
        """Injector arrivals back into items (tokens, or corrupted copies).

        All copies of one frame come out of the injector in the same call, so a
        token is forgotten once that call's arrivals are resolved."""
        out: list[tuple[float, Item]] = []
        done = set()
        for at, blob in arrivals:
            known = self._tokens.get(blob) if len(blob) == 8 else None
            if known is not None:
                out.append((at, known))
                done.add(blob)
            else:
                out.append((at, _split(blob)))
        for token in done:
            del self._tokens[token]
        return out
