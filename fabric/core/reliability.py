"""Per-flow reliable delivery: a sans-IO sender and receiver with pluggable retransmit policies.

This module is pure (DESIGN.md §2): it never reads a clock and never touches a
socket. Every method that depends on time takes ``now`` (seconds, any epoch,
monotonic); timers are reported as absolute deadlines by ``get_timer()`` and
fired by the driver through ``handle_timer(now)``, the way aioquic drives its
QUIC connection. The full design, the constants and their sources are in
``docs/RELIABILITY.md``; this docstring is the summary.

Sender (one per flow, per direction)::

    tx = Sender(flow=3, peer="w1", operation="WRITE stream")
    for t in tx.send(handle, size, now):      # or send_many([(handle, size), ...], now)
        put_on_wire(t)                        # flags |= t.flags (RETX, ACK_REQ)
    tx.handle_ack(cum_psn, sack, now)         # -> more Transmits (window opened, fast retransmit)
    tx.handle_nack(psn, code, now)            # -> Transmits
    tx.get_timer(); tx.handle_timer(now)      # RTO expiry -> Transmits
    tx.pop_acked()                            # handles acknowledged since the last call

Receiver::

    rx = Receiver(flow=3)
    delivered, ack = rx.handle_frame(psn, handle, now, flags=frame.flags)
    if ack: send(ack.frames(src=me, dst=peer, flow=3))   # ACK (+ NACK for a gap)
    rx.get_timer(); rx.handle_timer(now)      # delayed ACK

Loss is declared only on (1) a NACK, (2) RTO expiry, (3) the packet
threshold: at least ``packet_threshold`` (3) frames *sent after* the frame's
latest transmission are acknowledged, or (4) at a stream's tail, where fewer
frames follow, every frame sent after it acknowledged and a round trip plus a
reordering window (min RTT / 4) gone by (early retransmit, RFC 5827/8985).
Reordering by fewer than 3 positions therefore never causes a retransmission,
nor, at the tail, a frame overtaken by less than that window.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, Generic, TypeVar

from mypy_extensions import mypyc_attr

from fabric.core.congestion.gate import CcGate
from fabric.core.congestion.policy import CongestionControl
from fabric.core.frame import PERMANENT_NACKS, Flag, NackCode, Op, encode_header, flag_of
from fabric.core.records import Record
from fabric.errors import FabricTimeout, PeerFailed, SemfabError

__all__ = [
    "PSN_BITS",
    "PSN_MOD",
    "PSN_MASK",
    "RttEstimator",
    "SACK_BITS",
    "RTO_ALPHA",
    "RTO_BETA",
    "RTO_K",
    "PACKET_THRESHOLD",
    "RFC6298_RTO_INITIAL",
    "RFC6298_RTO_MIN",
    "DEFAULT_RTO_INITIAL",
    "DEFAULT_RTO_MIN",
    "DEFAULT_RTO_MAX",
    "DEFAULT_GRANULARITY",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_WINDOW_FRAMES",
    "DEFAULT_WINDOW_BYTES",
    "DEFAULT_ACK_EVERY",
    "DEFAULT_MAX_ACK_DELAY",
    "DEFAULT_NACK_INTERVAL",
    "GAP_NACK_CODE",
    "SPURIOUS_RTT_FRACTION",
    "psn_add",
    "psn_diff",
    "psn_lt",
    "Transmit",
    "Delivered",
    "Ack",
    "FlightInfo",
    "SenderStats",
    "ReceiverStats",
    "ReliabilityError",
    "RetryLimitExceeded",
    "PeerRefused",
    "RetransmitPolicy",
    "SelectiveRepeat",
    "GoBackN",
    "POLICIES",
    "register_policy",
    "get_policy",
    "Sender",
    "Receiver",
]

H = TypeVar("H")
_F_ACK_REQ: Final = int(Flag.ACK_REQ)
_F_ECN: Final = int(Flag.ECN)
_F_RETX: Final = int(Flag.RETX)

# ---------------------------------------------------------------------------
# constants, each with its source
# ---------------------------------------------------------------------------

#: PSNs are 32-bit and wrap (docs/PROTOCOL.md header field ``psn``). Comparisons
#: use serial number arithmetic, RFC 1982 §3.2 with SERIAL_BITS = 32.
PSN_BITS: Final = 32
PSN_MOD: Final = 1 << PSN_BITS
PSN_MASK: Final = PSN_MOD - 1
_HALF: Final = 1 << (PSN_BITS - 1)
#: An ACK carries a 64-bit SACK bitmap beside the cumulative PSN, as the UET
#: ACK_CC header does (UEC spec 1.0, PDS ACK; docs/PROTOCOL.md ``ACK``).
SACK_BITS: Final = 64
_SACK_MASK: Final = (1 << SACK_BITS) - 1

#: RFC 6298 §2.3: SRTT gain alpha = 1/8.
RTO_ALPHA: Final = 1 / 8
#: RFC 6298 §2.3: RTTVAR gain beta = 1/4.
RTO_BETA: Final = 1 / 4
#: RFC 6298 §2.2/2.3: RTO = SRTT + max(G, K*RTTVAR) with K = 4.
RTO_K: Final = 4
#: RFC 6298 §2.1 initial RTO (1 s) and §2.4 minimum (1 s, "SHOULD"). Kept for
#: reference: a fabric's RTT is microseconds, so semfab's defaults are lower,
#: as datacenter stacks do (Linux TCP_RTO_MIN is 200 ms; RDMA NICs and IRN use
#: sub-millisecond timeouts).
RFC6298_RTO_INITIAL: Final = 1.0
RFC6298_RTO_MIN: Final = 1.0
#: RFC 9002 §6.1.1 kPacketThreshold = 3, the same number as TCP's DupThresh
#: (RFC 5681 §3.2, RFC 6675 §2): a frame is lost once 3 frames sent after it
#: have been acknowledged.
PACKET_THRESHOLD: Final = 3

#: semfab defaults (seconds). The initial RTO applies before the first RTT
#: sample; the minimum keeps a noisy shared host (Python drivers, ms-scale
#: scheduling jitter) from firing spurious timeouts; the maximum bounds the
#: exponential backoff (RFC 6298 §2.5 allows any maximum >= 60 s; a fabric
#: operation that has not progressed in 2 s is better failed than waited on).
DEFAULT_RTO_INITIAL: Final = 0.1
DEFAULT_RTO_MIN: Final = 0.005
DEFAULT_RTO_MAX: Final = 2.0
#: Randomised backoff: each backed-off RTO is stretched by up to this share of
#: itself, at random, so that flows that lost frames in the same overflow do not
#: time out and resend in step again (Vasudevan et al., "Safe and Effective
#: Fine-grained TCP Retransmissions for Datacenter Communication", SIGCOMM 2009,
#: randomised timeouts against synchronised incast retransmissions). 0: off.
RTO_JITTER: Final = 0.5
#: RFC 6298 §2 clock granularity G. Callers pass float seconds, so G is tiny.
DEFAULT_GRANULARITY: Final = 1e-6
#: Losses (so retransmissions) of one frame before the operation fails. With
#: the default minimum RTO and doubling this is about 2.5 s of silence
#: (IB's retry_cnt is at most 7).
DEFAULT_MAX_RETRIES: Final = 8
#: Frames in flight. 64 = the SACK bitmap span, so every frame in flight can be
#: selectively acknowledged (UET SACK bitmap; IRN uses a BDP-sized cap).
DEFAULT_WINDOW_FRAMES: Final = 64
DEFAULT_WINDOW_BYTES: Final = 16 * 1024 * 1024
#: Receiver ACK coalescing: one ACK per 2 in-order frames, as TCP's delayed ACK
#: (RFC 5681 §4.2 / RFC 1122 "at least every second full-sized segment").
DEFAULT_ACK_EVERY: Final = 2
#: Longest a receiver holds an ACK for coalescing (QUIC max_ack_delay, RFC 9000
#: §13.2.1, scaled from 25 ms to fabric RTTs).
DEFAULT_MAX_ACK_DELAY: Final = 0.0002
#: A receiver NACKs one gap at most once per this interval ("once per RTT-ish";
#: the driver should set it to about one RTT when it knows the RTT).
DEFAULT_NACK_INTERVAL: Final = 0.002
#: The frame codec has no sequence-error NACK code; a gap NACK (the PSN named
#: is missing, the frames after it are buffered or discarded) uses OUT_OF_WINDOW.
GAP_NACK_CODE: Final = NackCode.OUT_OF_WINDOW

#: A retransmitted frame whose ACK comes back sooner than this fraction of the
#: smallest RTT ever measured was acknowledged through an earlier copy, so the
#: retransmission was spurious (an Eifel-like test, RFC 3522, with RTT evidence
#: instead of timestamps). Half, not all, of min_rtt: retransmissions carry
#: ACK_REQ and are acknowledged at once, while min_rtt may include ACK delay.
SPURIOUS_RTT_FRACTION: Final = 0.5

#: NACK codes after which retransmitting the same frame cannot succeed (the one
#: classification of refusals, in fabric.core.frame).
_FATAL_NACKS: Final = PERMANENT_NACKS


# ---------------------------------------------------------------------------
# serial number arithmetic (RFC 1982)
# ---------------------------------------------------------------------------


def psn_add(psn: int, n: int) -> int:
    """``psn + n`` modulo 2**32."""
    return (psn + n) & PSN_MASK


def psn_diff(a: int, b: int) -> int:
    """Signed serial distance ``a - b`` in ``[-2**31, 2**31)`` (RFC 1982 §3.2)."""
    return ((a - b + _HALF) & PSN_MASK) - _HALF


def unwrap_psn(psn: int, last: int) -> int:
    """The unbounded sequence number nearest ``last`` whose low 32 bits are ``psn``."""
    cand = (last & ~PSN_MASK) | psn
    if cand - last > _HALF:
        cand -= PSN_MOD
    elif last - cand > _HALF:
        cand += PSN_MOD
    return max(cand, 0)


def psn_lt(a: int, b: int) -> bool:
    """True when ``a`` precedes ``b`` in serial order (undefined at distance 2**31)."""
    return psn_diff(a, b) < 0


def _fmt_seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"


# ---------------------------------------------------------------------------
# events and statistics
# ---------------------------------------------------------------------------


class Transmit(Record, Generic[H]):
    """One frame the driver must put on the wire now.

    ``ack_req``: ask the receiver to ACK at once (UET "AR"): set on
    retransmissions and on the last frame of a burst (queue empty or window
    full), so the tail of a burst is not held by the receiver's ACK coalescing.
    """

    __slots__ = ("psn", "handle", "size", "retransmit", "ack_req")
    _fields: ClassVar[tuple[str, ...]] = ("psn", "handle", "size", "retransmit", "ack_req")

    def __init__(self, psn: int, handle: H, size: int, retransmit: bool,
                 ack_req: bool = False) -> None:
        self.psn = psn
        self.handle = handle
        self.size = size
        self.retransmit = retransmit
        self.ack_req = ack_req

    @property
    def flags(self) -> Flag:
        """The header flags this transmission adds (``Flag.RETX``, ``Flag.ACK_REQ``)."""
        return flag_of((_F_RETX if self.retransmit else 0)
                       | (_F_ACK_REQ if self.ack_req else 0))


class Delivered(Record, Generic[H]):
    """A frame handed to the application (exactly once; in PSN order when ordered)."""

    __slots__ = ("psn", "handle")
    _fields: ClassVar[tuple[str, ...]] = ("psn", "handle")

    def __init__(self, psn: int, handle: H) -> None:
        self.psn = psn
        self.handle = handle


class Ack(Record):
    """Feedback a receiver wants sent: an ACK, and possibly a NACK for a gap.

    ``cum_psn``: every PSN up to and including it was received. ``sack``: bit i
    set = PSN ``cum_psn + 1 + i`` received (docs/PROTOCOL.md ``ACK``).
    ``nack_psn``: when not None, also send a NACK for this (missing) PSN with
    ``nack_code``. ``ecn``: a frame this ACK covers arrived congestion
    experienced: the ACK carries ``Flag.ECN`` back to the sender (the ECN echo).
    """

    __slots__ = ("cum_psn", "sack", "nack_psn", "nack_code", "ecn")
    _fields: ClassVar[tuple[str, ...]] = ("cum_psn", "sack", "nack_psn", "nack_code", "ecn")

    def __init__(self, cum_psn: int, sack: int, nack_psn: int | None = None,
                 nack_code: NackCode = GAP_NACK_CODE, ecn: bool = False) -> None:
        self.cum_psn = cum_psn
        self.sack = sack
        self.nack_psn = nack_psn
        self.nack_code = nack_code
        self.ecn = ecn

    def frames(
        self, *, src: int, dst: int, flow: int, job: int = 0, msg: int = 0, crc: bool = False
    ) -> list[bytes]:
        """Encode as wire frames: the ACK, then the NACK when there is one."""
        out = [
            encode_header(
                Op.ACK,
                src=src,
                dst=dst,
                job=job,
                flow=flow,
                psn=self.cum_psn,
                key=self.sack & 0xFFFF_FFFF,
                offset=self.sack >> 32,
                msg=msg,
                flags=Flag.ECN if self.ecn else Flag.NONE,
                crc=crc,
            )
        ]
        if self.nack_psn is not None:
            out.append(
                encode_header(
                    Op.NACK,
                    src=src,
                    dst=dst,
                    job=job,
                    flow=flow,
                    psn=self.nack_psn,
                    offset=int(self.nack_code),
                    msg=msg,
                    crc=crc,
                )
            )
        return out


@dataclass(frozen=True, slots=True)
class FlightInfo:
    """Read-only view of one frame in flight, given to retransmit policies."""

    psn: int
    acked: bool
    retransmissions: int
    last_sent: float


@dataclass(frozen=True, slots=True)
class SenderStats:
    """Counters of a :class:`Sender` (times in seconds; RTT fields None before a sample).

    ``spurious_retransmits`` counts retransmitted frames whose ACK arrived
    sooner after the retransmission than half the smallest RTT ever measured:
    that ACK must have been caused by an earlier copy (an Eifel-like test,
    RFC 3522, using RTT evidence instead of timestamps; see
    ``SPURIOUS_RTT_FRACTION``). The receiver's
    ``duplicate_retransmits`` is the other, receiver-side, measure.
    """

    sent: int
    retransmitted: int
    spurious_retransmits: int
    lost_declared: int
    timeouts: int
    acked: int
    acks_received: int
    acks_stale: int
    acks_invalid: int
    nacks_received: int
    nacks_ignored: int
    srtt: float | None
    rttvar: float | None
    rto: float
    min_rtt: float | None
    inflight: int
    queued: int
    ecn_echoes: int = 0  # ACKs that echoed a congestion mark
    cwnd_bytes: float = math.inf  # the congestion policy's window (inf: no policy)


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """Counters of a :class:`Receiver`.

    ``duplicate_retransmits``: duplicates carrying Flag.RETX, i.e. a
    retransmission of a frame already received (a spurious retransmission,
    unless the link itself duplicated a retransmission).
    """

    received: int
    delivered: int
    duplicates: int
    duplicate_retransmits: int
    out_of_window: int
    discarded_out_of_order: int
    acks_sent: int
    nacks_sent: int
    buffered: int
    max_buffered: int
    ce_frames: int = 0  # frames that arrived congestion experienced (Flag.ECN)


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


class ReliabilityError(SemfabError):
    """A flow cannot make progress; the message names peer, flow, PSN and operation."""

    def __init__(self, message: str, *, peer: str, flow: int, psn: int, operation: str) -> None:
        super().__init__(message)
        self.peer = peer
        self.flow = flow
        self.psn = psn
        self.operation = operation


class RetryLimitExceeded(ReliabilityError, FabricTimeout):
    """A frame was declared lost ``max_retries`` times and lost once more."""

    def __init__(
        self,
        *,
        peer: str,
        flow: int,
        psn: int,
        operation: str,
        retransmissions: int,
        elapsed: float,
    ) -> None:
        super().__init__(
            f"no ACK from {peer} for flow {flow} PSN {psn} ({operation}) after "
            f"{retransmissions} retransmissions over {_fmt_seconds(elapsed)}",
            peer=peer,
            flow=flow,
            psn=psn,
            operation=operation,
        )
        self.retransmissions = retransmissions
        self.elapsed = elapsed


class PeerRefused(ReliabilityError, PeerFailed):
    """The peer NACKed a frame with a code that a retransmission cannot fix."""

    def __init__(self, *, peer: str, flow: int, psn: int, operation: str, code: NackCode) -> None:
        super().__init__(
            f"{peer} refused flow {flow} PSN {psn} ({operation}): NACK {code.name}",
            peer=peer,
            flow=flow,
            psn=psn,
            operation=operation,
        )
        self.code = code


# ---------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------


@mypyc_attr(allow_interpreted_subclasses=True)  # users write their own policies
class RetransmitPolicy(ABC):
    """What to resend when frames are declared lost.

    The core decides *that* frames are lost (NACK, RTO, packet threshold); a
    policy decides *which* frames to resend. It receives the lost PSNs and a
    snapshot of the whole flight in PSN order, and returns PSNs to retransmit
    (each must be in flight and not yet acknowledged; duplicates are merged).
    One instance serves one :class:`Sender`, so a policy may keep state.

    ``receiver_buffers`` tells a :class:`Receiver` built with this policy's
    name whether to keep frames that arrive after a gap (selective repeat) or
    to discard them (go-back-N).
    """

    name: ClassVar[str] = ""
    receiver_buffers: ClassVar[bool] = True

    @abstractmethod
    def on_loss(self, lost: Sequence[int], flight: Sequence[FlightInfo]) -> Iterable[int]:
        """PSNs to retransmit after ``lost`` were declared lost by NACK or packet threshold."""

    def on_timeout(self, expired: Sequence[int], flight: Sequence[FlightInfo]) -> Iterable[int]:
        """PSNs to retransmit after an RTO expiry; ``expired`` timed out. Default: on_loss."""
        return self.on_loss(expired, flight)


class SelectiveRepeat(RetransmitPolicy):
    """Resend only the lost frames (IRN, SIGCOMM '18; UET SACK-based recovery)."""

    name = "selective"
    receiver_buffers = True

    def on_loss(self, lost: Sequence[int], flight: Sequence[FlightInfo]) -> Iterable[int]:
        return lost


class GoBackN(RetransmitPolicy):
    """Resend the first lost frame and every unacknowledged frame after it (RoCE)."""

    name = "gbn"
    receiver_buffers = False

    def on_loss(self, lost: Sequence[int], flight: Sequence[FlightInfo]) -> Iterable[int]:
        if not lost:
            return []
        first = lost[0]
        for p in lost:  # serial order, not integer order: PSNs wrap
            if psn_lt(p, first):
                first = p
        return [f.psn for f in flight if not f.acked and not psn_lt(f.psn, first)]


#: Policy name -> class. Add one with :func:`register_policy`.
POLICIES: dict[str, type[RetransmitPolicy]] = {}


def register_policy(
    name: str, cls: type[RetransmitPolicy], *, replace: bool = False
) -> type[RetransmitPolicy]:
    """Make ``cls`` available as ``Sender(policy=name)`` / ``Receiver(policy=name)``."""
    if not isinstance(cls, type) or not issubclass(cls, RetransmitPolicy):
        raise TypeError(f"policy {name!r}: {cls!r} is not a RetransmitPolicy subclass")
    if not name or not name.replace("-", "_").isidentifier():
        raise ValueError(f"policy name {name!r} must be a word like 'selective'")
    if name in POLICIES and not replace and POLICIES[name] is not cls:
        raise ValueError(f"policy {name!r} is already registered; pass replace=True")
    POLICIES[name] = cls
    return cls


def get_policy(name: str) -> type[RetransmitPolicy]:
    """The policy class registered as ``name``; ValueError naming the valid ones."""
    try:
        return POLICIES[name]
    except KeyError:
        valid = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown retransmit policy {name!r}; valid: {valid}") from None


register_policy("selective", SelectiveRepeat)
register_policy("gbn", GoBackN)


# ---------------------------------------------------------------------------
# sender
# ---------------------------------------------------------------------------


class RttEstimator:
    """RFC 6298 §2: smoothed RTT, its variation and the retransmit timeout.

    The project's one RTO estimator: streams (:class:`Sender`) and the
    aggregation windows (:class:`fabric.core.timers.ChunkTimers`) both use it.
    ``jitter`` > 0 stretches each backed-off RTO by a share in [0, jitter) drawn
    from ``rng`` (:data:`RTO_JITTER`), so a backed-off RTO may exceed ``rto_max``
    by that share. ``ceiling_srtts`` > 0 keeps the ceiling at least that many
    smoothed RTTs: a short ``rto_max`` below the path's true round trip would
    fire on every frame, and Karn's rule would deny the samples that could fix it.
    """

    def __init__(self, rto_initial: float = DEFAULT_RTO_INITIAL,
                 rto_min: float = DEFAULT_RTO_MIN, rto_max: float = DEFAULT_RTO_MAX,
                 granularity: float = DEFAULT_GRANULARITY, *, jitter: float = 0.0,
                 rng: random.Random | None = None, ceiling_srtts: float = 0.0) -> None:
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {jitter}")
        if jitter and rng is None:
            raise ValueError("a jittered RTO needs an rng (a seeded random.Random)")
        self.srtt: float | None = None
        self.rttvar: float | None = None
        self.min_rtt: float | None = None
        self.rto_min, self.rto_max, self.granularity = rto_min, rto_max, granularity
        self.rto = rto_initial
        self.jitter = jitter
        self._rng = rng
        self.ceiling_srtts = ceiling_srtts

    def ceiling(self) -> float:
        """The backoff's bound: ``rto_max``, or ``ceiling_srtts`` smoothed RTTs if more."""
        if self.ceiling_srtts and self.srtt is not None:
            return max(self.rto_max, self.ceiling_srtts * self.srtt)
        return self.rto_max

    def sample(self, rtt: float) -> None:
        """Feed one RTT measurement (never from a retransmitted frame: Karn)."""
        r = max(rtt, 0.0)
        if self.srtt is None or self.rttvar is None:  # §2.2: first measurement
            self.srtt, self.rttvar = r, r / 2
        else:  # §2.3: RTTVAR first, using the old SRTT
            self.rttvar = (1 - RTO_BETA) * self.rttvar + RTO_BETA * abs(self.srtt - r)
            self.srtt = (1 - RTO_ALPHA) * self.srtt + RTO_ALPHA * r
        self.min_rtt = r if self.min_rtt is None else min(self.min_rtt, r)
        rto = self.srtt + max(self.granularity, RTO_K * self.rttvar)
        # §2.4/2.5 clamps; a new sample also ends any backoff
        self.rto = min(max(rto, self.rto_min), self.ceiling())

    def backed_off(self, tries: int) -> float:
        """The timeout of something sent ``tries`` + 1 times: the RTO doubled per
        resend up to the ceiling, jittered as :meth:`backoff` (per-chunk timers)."""
        rto = min(self.rto * (2 ** tries), self.ceiling())
        if tries and self._rng is not None and self.jitter:
            rto *= 1.0 + self.jitter * self._rng.random()
        return rto

    def backoff(self, expired: float | None = None) -> None:
        """§5.5: the timer expired: RTO = RTO * 2, bounded by ``rto_max``.

        ``expired``: the timeout that ran out, when timers run per chunk and may
        have started under an older RTO: the RTO becomes twice that, never lower
        than it is (so one loss spread over many chunks' timers backs off once).
        The longer RTO stays until a new sample (Karn's algorithm, §3)."""
        base = self.rto if expired is None else expired
        rto = min(max(self.rto, 2 * base), self.ceiling())
        if self._rng is not None and self.jitter:
            rto *= 1.0 + self.jitter * self._rng.random()
        self.rto = rto


class _Flight(Generic[H]):
    # written out, not a dataclass: made for every frame sent (see fabric.core.records)
    __slots__ = ("psn", "handle", "size", "first_sent", "last_sent", "tx_seq",
                 "retransmissions", "losses", "acked", "in_pipe", "waiting")

    def __init__(self, psn: int, handle: H, size: int, first_sent: float, last_sent: float,
                 tx_seq: int) -> None:
        self.psn = psn
        self.handle = handle
        self.size = size
        self.first_sent = first_sent
        self.last_sent = last_sent
        self.tx_seq = tx_seq  # order of the latest transmission: "sent after" for loss detection
        self.retransmissions = 0
        self.losses = 0  # times declared lost itself (not resent as a policy's collateral)
        self.acked = False
        self.in_pipe = True  # its size counts in the congestion window's bytes in flight
        self.waiting = False  # declared lost, its resend waits for the policy's window


class Sender(Generic[H]):
    """Reliable sender for one flow.

    The driver gives it frames as ``(handle, size)``: the handle is opaque
    (what the driver needs to encode the frame again: a message id and chunk
    index, a memoryview...), ``size`` counts towards ``window_bytes``. It gets
    back :class:`Transmit` records to put on the wire, as the window allows.

    Window: at most ``window_frames`` frames in flight (sent and neither
    acknowledged nor selectively acknowledged: RFC 6675's "pipe"), at most
    ``span_frames`` PSNs between the oldest unacknowledged and the next to
    send (the receiver must accept that many; default ``window_frames``, so
    a hole stops the flow until it is filled) and at most ``window_bytes`` of
    the span's sizes, except that one frame is always allowed so a frame
    larger than ``window_bytes`` cannot deadlock the flow. A span wider than
    the window lets new frames pass a hole, and frames sent after a resend
    are what shows that the resend was lost too (the packet threshold counts
    frames *sent after*), without waiting for the RTO.

    When nothing is left to send, fewer than ``packet_threshold`` frames
    suffice: every frame sent after it acknowledged, and a smoothed RTT plus
    min RTT / 4 since it was sent (early retransmit, RFC 5827, with RACK's
    reordering window): a loss among the last frames of a stream is found by
    the ACKs of the frames behind it rather than by the RTO.

    Congestion control (``cc``, a :class:`fabric.core.congestion.CongestionControl`
    for this flow, optional; driven through a
    :class:`fabric.core.congestion.gate.CcGate`): a new frame leaves only when the
    policy's window admits it beside the bytes in flight and its pacing time has
    come (a timer); the policy hears every ACK (bytes, the ECN echo, the round
    trip) and every loss (NACK or threshold: ``on_nack``; RTO: ``on_timeout``).
    A frame declared lost waits for the window and the pacer too, ahead of new
    frames (without that, an RTO that finds a whole window lost resends all of
    it into the queue that dropped it, and the resends are lost again).
    A receiver-driven policy (``eqds``) sends what its receiver grants
    (:meth:`grant`), which grants a trimmed frame again; a frame resent for any
    other reason reuses its own credit.

    Timers: the RTO backs off from ``rto_min`` to ``rto_max`` (or
    ``ceiling_srtts`` smoothed RTTs if more), each backoff stretched at random by
    up to ``rto_jitter`` of itself (drawn from ``rng``; :data:`RTO_JITTER`).

    Errors: :class:`RetryLimitExceeded` from ``handle_timer`` / ``handle_ack``
    / ``handle_nack`` when a frame is declared lost again after
    ``max_retries`` losses (each loss = one retransmission of it) and at least
    ``give_up_s`` after its first transmission;
    :class:`PeerRefused` from ``handle_nack`` for a NACK code a retransmission
    cannot fix. After either, the sender is failed
    and every further call raises the same error.
    """

    def __init__(
        self,
        flow: int,
        *,
        policy: str = "selective",
        window_frames: int = DEFAULT_WINDOW_FRAMES,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        span_frames: int | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        rto_initial: float = DEFAULT_RTO_INITIAL,
        rto_min: float = DEFAULT_RTO_MIN,
        rto_max: float = DEFAULT_RTO_MAX,
        granularity: float = DEFAULT_GRANULARITY,
        packet_threshold: int = PACKET_THRESHOLD,
        first_psn: int = 0,
        peer: str = "peer",
        operation: str = "stream",
        cc: CongestionControl | None = None,
        give_up_s: float = 0.0,
        rto_jitter: float = 0.0,
        rng: random.Random | None = None,
        ceiling_srtts: float = 0.0,
    ) -> None:
        gate = CcGate(cc, flow) if cc is not None else None
        if not 1 <= window_frames < _HALF:
            raise ValueError(f"window_frames must be in [1, 2**31), got {window_frames}")
        if window_bytes < 1:
            raise ValueError(f"window_bytes must be >= 1, got {window_bytes}")
        span = window_frames if span_frames is None else span_frames
        if not window_frames <= span < _HALF:
            raise ValueError(
                f"span_frames must be in [window_frames, 2**31) = [{window_frames}, 2**31), "
                f"got {span_frames}"
            )
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if not 0.0 <= give_up_s < math.inf:
            raise ValueError(f"give_up_s must be a finite time >= 0, got {give_up_s}")
        if not 0 < rto_min <= rto_max or not math.isfinite(rto_max):
            raise ValueError(f"need 0 < rto_min <= rto_max < inf, got {rto_min}, {rto_max}")
        if not rto_min <= rto_initial <= rto_max:
            raise ValueError(
                f"rto_initial {rto_initial} must lie in [rto_min, rto_max] = [{rto_min}, {rto_max}]"
            )
        if packet_threshold < 1:
            raise ValueError(f"packet_threshold must be >= 1, got {packet_threshold}")
        if not 0 <= first_psn <= PSN_MASK:
            raise ValueError(f"first_psn must be a 32-bit PSN, got {first_psn}")
        self.flow = flow
        self.peer = peer
        self.operation = operation
        self.policy: RetransmitPolicy = get_policy(policy)()
        self.window_frames = window_frames
        self.window_bytes = window_bytes
        self.span_frames = span
        self.max_retries = max_retries
        self.give_up_s = give_up_s
        self.rto_min = rto_min
        self.rto_max = rto_max
        self.granularity = granularity
        self.packet_threshold = packet_threshold

        self._una = first_psn  # oldest PSN not cumulatively acknowledged
        self._nxt = first_psn  # next PSN to assign
        # PSN -> frame, in PSN order (dict order = insertion order; we only
        # append at the end and pop from the front).
        self._flight: dict[int, _Flight[H]] = {}
        self._span_bytes = 0
        self._unacked = 0  # frames in flight not (selectively) acknowledged: the pipe
        self._tail_deadline: float | None = None  # early retransmit's reordering wait
        self._queue: deque[tuple[H, int]] = deque()
        self._tx_seq = 0
        self._acked_out: list[H] = []
        self.error: ReliabilityError | None = None

        self._rtt = RttEstimator(rto_initial, rto_min, rto_max, granularity,
                                 jitter=rto_jitter, rng=rng, ceiling_srtts=ceiling_srtts)

        self.cc = cc
        self._gate = gate  # the policy's window, pacer and echoes (fabric.core.congestion)
        self._rtx: deque[int] = deque()  # lost frames waiting for the window, oldest first

        self._sent = 0
        self._retransmitted = 0
        self._spurious = 0
        self._lost_declared = 0
        self._timeouts = 0
        self._acked = 0
        self._acks = 0
        self._acks_stale = 0
        self._acks_invalid = 0
        self._nacks = 0
        self._nacks_ignored = 0

    # -- public API ---------------------------------------------------------

    @property
    def done(self) -> bool:
        """True when every frame given to :meth:`send` has been acknowledged."""
        return not self._queue and not self._flight

    @property
    def rto(self) -> float:
        """The current retransmission timeout (backed off after expiries)."""
        return self._rtt.rto

    @property
    def next_psn(self) -> int:
        """The PSN the next new frame will get."""
        return self._nxt

    def send(self, handle: H, size: int, now: float) -> list[Transmit[H]]:
        """Queue one frame; return the frames the window lets out now."""
        self._check_alive()
        if size < 0:
            raise ValueError(f"frame size must be >= 0, got {size}")
        self._queue.append((handle, size))
        return self._pump(now)

    def send_many(self, frames: Iterable[tuple[H, int]], now: float) -> list[Transmit[H]]:
        """Queue several ``(handle, size)`` frames as one burst.

        Unlike repeated :meth:`send`, only the burst's last frame (or the one
        that fills the window) asks for an immediate ACK.
        """
        self._check_alive()
        for handle, size in frames:
            if size < 0:
                raise ValueError(f"frame size must be >= 0, got {size}")
            self._queue.append((handle, size))
        return self._pump(now)

    def handle_ack(self, cum_psn: int, sack: int, now: float,
                   ecn: bool = False) -> list[Transmit[H]]:
        """Process an ACK: cumulative PSN and 64-bit SACK bitmap (bit i = cum_psn+1+i);
        ``ecn``: the ACK echoes a congestion mark (its ``Flag.ECN``)."""
        self._check_alive()
        self._acks += 1
        span = len(self._flight)
        # Distance from the highest PSN we know was received (una - 1).
        d = psn_diff(cum_psn, psn_add(self._una, -1))
        if d > span:  # acknowledges PSNs never sent: a corrupted or foreign ACK
            self._acks_invalid += 1
            return []
        newly: list[_Flight[H]] = []
        if d < 0:
            # An older ACK overtaken by a newer one; its SACK bits still count
            # (receivers never renege on buffered frames).
            self._acks_stale += 1
        else:
            for k in range(d):
                f = self._flight[psn_add(self._una, k)]
                if not f.acked:
                    f.acked = True
                    newly.append(f)
        bits = sack & _SACK_MASK
        while bits:
            low = bits & -bits
            bits ^= low
            psn = psn_add(cum_psn, low.bit_length())  # bit i -> cum + 1 + i
            if 0 <= psn_diff(psn, self._una) < span:
                f = self._flight[psn]
                if not f.acked:
                    f.acked = True
                    newly.append(f)
        gate = self._gate
        if gate is not None:
            gate.tick(now)
        if newly:
            self._on_newly_acked(newly, now, ecn)
        elif ecn and gate is not None:
            gate.echo(now)
        lost = self._detect_by_threshold(now)
        out = self._retransmit(lost, now, timeout=False) if lost else []
        out.extend(self._pump(now))
        return out

    def handle_nack(self, psn: int, code: NackCode | int, now: float) -> list[Transmit[H]]:
        """Process a NACK for ``psn``.

        Codes a retransmission can fix (OUT_OF_WINDOW, the gap NACK; BAD_CHECKSUM;
        MALFORMED) declare the frame lost. NO_RESOURCE leaves the frame to the
        RTO (resending at once would meet the same shortage). Others raise
        :class:`PeerRefused`. A NACK for a frame retransmitted less than one
        minimum RTT ago is about an older copy and is ignored.
        """
        self._check_alive()
        self._nacks += 1
        try:
            code = NackCode(code)
        except ValueError:
            code = NackCode.MALFORMED
        if code in _FATAL_NACKS:
            raise self._fail(
                PeerRefused(
                    peer=self.peer, flow=self.flow, psn=psn, operation=self.operation, code=code
                )
            )
        f = self._flight.get(psn)
        if f is None or f.acked or f.waiting or code is NackCode.NO_RESOURCE:
            self._nacks_ignored += 1
            return []
        # A NACK sent after the latest copy arrived cannot come back before a
        # round trip of the *current* path: the smoothed RTT, not the minimum
        # (under a full window, queueing makes the RTT many times the minimum,
        # and the receiver repeats its gap NACK meanwhile; answering each one
        # would resend the frame several times per round trip and exhaust its
        # retry limit on a healthy link).
        guard = self._rtt.srtt if self._rtt.srtt is not None else self._rtt.min_rtt
        # (a TRIMMED NACK is about the copy a switch cut: each copy gets its own)
        if f.retransmissions and code is not NackCode.TRIMMED and (
                guard is None or now - f.last_sent < guard):
            self._nacks_ignored += 1
            return []
        return self._retransmit([psn], now, timeout=False, trimmed=code is NackCode.TRIMMED)

    def grant(self, nbytes: int, now: float) -> list[Transmit[H]]:
        """The receiver granted ``nbytes`` more (a receiver-driven policy's CREDIT):
        send what it lets out. Without such a policy a grant changes nothing."""
        self._check_alive()
        gate = self._gate
        if gate is None or not gate.cc.receiver_driven or nbytes <= 0:
            return []
        gate.cc.on_credit(nbytes, now)
        return self._pump(now)

    def get_timer(self) -> float | None:
        """Absolute time of the next timer, or None when nothing is unacknowledged.

        The RTO: each unacknowledged frame expires ``rto`` after its latest
        transmission, the earliest such deadline. Earlier, at a stream's tail,
        the end of the reordering wait of early retransmit.
        """
        if self.error is not None:
            return None
        due = self._rto_deadline()
        pace = self._gate.pace_wait if self._gate is not None else None
        for t in (self._tail_deadline, pace if self._queue or self._rtx else None):
            if t is not None and (due is None or t < due):
                due = t
        return due

    def handle_timer(self, now: float) -> list[Transmit[H]]:
        """Fire what is due: early retransmit at the tail, else the RTO (retransmit
        what the policy says, double the RTO)."""
        self._check_alive()
        out: list[Transmit[H]] = []
        if self._tail_deadline is not None and now >= self._tail_deadline:
            lost = self._detect_by_threshold(now)
            out = self._retransmit(lost, now, timeout=False) if lost else []
        deadline = self._rto_deadline()
        if deadline is None or now < deadline:
            if self._gate is not None:  # the pacer's time
                out.extend(self._pump(now))
            return out
        rto = self._rtt.rto
        expired = [f.psn for f in self._flight.values()
                   if not f.acked and not f.waiting and f.last_sent + rto <= now]
        self._timeouts += 1
        # RFC 6298 §5.5: back off the timer (RTO = RTO * 2), bounded by rto_max.
        # The backed-off value stays until a valid RTT sample (Karn, §5.7).
        self._rtt.backoff()
        out.extend(self._retransmit(expired, now, timeout=True))
        out.extend(self._pump(now))
        return out

    def _rto_deadline(self) -> float | None:
        oldest: float | None = None
        for f in self._flight.values():
            if not f.acked and not f.waiting and (oldest is None or f.last_sent < oldest):
                oldest = f.last_sent
        return None if oldest is None else oldest + self._rtt.rto

    def pop_acked(self) -> list[H]:
        """Handles acknowledged since the last call, in the order ACKs covered them."""
        out, self._acked_out = self._acked_out, []
        return out

    def statistics(self) -> SenderStats:
        """A snapshot of the counters and the RTT estimator."""
        return SenderStats(
            sent=self._sent,
            retransmitted=self._retransmitted,
            spurious_retransmits=self._spurious,
            lost_declared=self._lost_declared,
            timeouts=self._timeouts,
            acked=self._acked,
            acks_received=self._acks,
            acks_stale=self._acks_stale,
            acks_invalid=self._acks_invalid,
            nacks_received=self._nacks,
            nacks_ignored=self._nacks_ignored,
            srtt=self._rtt.srtt,
            rttvar=self._rtt.rttvar,
            rto=self._rtt.rto,
            min_rtt=self._rtt.min_rtt,
            inflight=self._unacked,
            queued=len(self._queue),
            ecn_echoes=self._gate.echoes if self._gate is not None else 0,
            cwnd_bytes=self._gate.cwnd if self._gate is not None else math.inf,
        )

    # -- internals ----------------------------------------------------------

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error

    def _fail(self, err: ReliabilityError) -> ReliabilityError:
        self.error = err
        return err

    def _pump(self, now: float) -> list[Transmit[H]]:
        out: list[Transmit[H]] = []
        gate = self._gate
        if gate is not None:
            gate.begin(now)
            if self._rtx and not self._resend_waiting(gate, now, out):
                gate.end()
                return out  # new frames wait behind the resends
        while self._queue and not self._window_full():
            handle, size = self._queue[0]
            if self._flight and self._span_bytes + size > self.window_bytes:
                break
            if gate is not None:
                if not gate.allows(size, now):
                    break  # the pacer's timer, or an ACK, lets it go
                gate.sent(size, now)
            self._queue.popleft()
            psn = self._nxt
            self._nxt = psn_add(psn, 1)
            self._tx_seq += 1
            self._flight[psn] = _Flight(psn, handle, size, now, now, self._tx_seq)
            self._span_bytes += size
            self._unacked += 1
            self._sent += 1
            out.append(Transmit(psn, handle, size, retransmit=False))
        if out and (not self._queue or self._window_full()):
            last = out[-1]
            out[-1] = Transmit(last.psn, last.handle, last.size, last.retransmit, ack_req=True)
        if gate is not None:
            gate.end()
        return out

    def _resend_waiting(self, gate: CcGate, now: float, out: list[Transmit[H]]) -> bool:
        """Resend the lost frames the policy's window and pacer let out now, oldest
        first, into ``out``; True when none is left waiting."""
        rtx = self._rtx
        while rtx:
            g = self._flight.get(rtx[0])
            if g is None or g.acked or not g.waiting:
                rtx.popleft()  # acknowledged after all (a late ACK)
                continue
            if not gate.allows(g.size, now):
                return False
            rtx.popleft()
            g.waiting = False
            gate.sent(g.size, now)
            g.in_pipe = True
            out.append(self._resend(g, now))
        return True

    def _resend(self, g: _Flight[H], now: float) -> Transmit[H]:
        g.retransmissions += 1
        g.last_sent = now
        self._tx_seq += 1
        g.tx_seq = self._tx_seq
        self._retransmitted += 1
        return Transmit(g.psn, g.handle, g.size, retransmit=True, ack_req=True)

    def _window_full(self) -> bool:
        return self._unacked >= self.window_frames or len(self._flight) >= self.span_frames

    def _on_newly_acked(self, newly: list[_Flight[H]], now: float, ecn: bool = False) -> None:
        # Karn's rule (RFC 6298 §3): only never-retransmitted frames give RTT
        # samples. Take the most recently sent one: its sample holds the least
        # queueing behind frames the same ACK covers.
        sample: _Flight[H] | None = None
        for f in newly:
            if f.retransmissions == 0 and (sample is None or f.tx_seq > sample.tx_seq):
                sample = f
            elif (
                f.retransmissions
                and self._rtt.min_rtt is not None
                and now - f.last_sent < SPURIOUS_RTT_FRACTION * self._rtt.min_rtt
            ):
                # Acked faster than any round trip we ever measured: the ACK
                # answers an earlier copy, so the last retransmission was spurious.
                self._spurious += 1
        if sample is not None:
            self._rtt.sample(now - sample.last_sent)
        gate = self._gate
        if gate is not None:
            acked = 0
            for f in newly:
                if f.in_pipe:
                    f.in_pipe = False
                    acked += f.size
            # the policy's delay signal: the newest frame's round trip (Karn's
            # sample when there is one: a resent frame's time is ambiguous)
            last = sample if sample is not None else max(newly, key=lambda f: f.tx_seq)
            gate.acked(acked, ecn, now - last.last_sent, now)
        self._acked += len(newly)
        self._unacked -= len(newly)
        self._acked_out.extend(f.handle for f in newly)
        while self._flight:
            first = self._flight.get(self._una)
            if first is None or not first.acked:
                break
            del self._flight[self._una]
            self._span_bytes -= first.size
            self._una = psn_add(self._una, 1)

    def _detect_by_threshold(self, now: float) -> list[int]:
        """PSNs with at least ``packet_threshold`` frames sent after them acknowledged.

        "Sent after" compares the order of *latest transmissions* (like RACK,
        RFC 8985), so a retransmitted frame is not declared lost again by the
        same ACKs that declared it lost the first time. With nothing left to
        send, fewer suffice (early retransmit, RFC 5827: no more frames will
        come to reach 3): every frame sent after it acknowledged, and a round
        trip plus RACK's reordering window (RFC 8985 §6.2: min RTT / 4) since
        it was sent, so a frame merely overtaken is not resent. That wait is a
        timer (``get_timer``).
        """
        self._tail_deadline = None
        if self._unacked == len(self._flight):  # nothing acknowledged past a hole
            return []
        tail = not self._queue
        wait = self._tail_wait() if tail else None
        lost: list[int] = []
        acked_after = sent_after = 0
        for f in sorted(self._flight.values(), key=lambda f: f.tx_seq, reverse=True):
            if f.waiting:
                continue  # not on the wire: already declared lost
            if f.acked:
                acked_after += 1
            elif acked_after >= self.packet_threshold:
                lost.append(f.psn)
            elif wait is not None and acked_after and acked_after == sent_after:
                due = f.last_sent + wait
                if now >= due:
                    lost.append(f.psn)
                elif self._tail_deadline is None or due < self._tail_deadline:
                    self._tail_deadline = due
            sent_after += 1
        lost.sort(key=lambda psn: psn_diff(psn, self._una))
        return lost

    def _tail_wait(self) -> float | None:
        rtt = self._rtt
        if rtt.min_rtt is None:
            return None
        return (rtt.srtt if rtt.srtt is not None else rtt.min_rtt) + rtt.min_rtt / 4

    def _retransmit(self, lost: list[int], now: float, *, timeout: bool,
                    trimmed: bool = False) -> list[Transmit[H]]:
        if not lost:
            return []
        self._lost_declared += len(lost)
        for psn in lost:
            f = self._flight[psn]
            if f.losses >= self.max_retries and now - f.first_sent >= self.give_up_s:
                # The retry limit counts the times *this* frame was lost, so a
                # frame resent only as go-back-N collateral does not exhaust it;
                # with a short RTO ceiling, give_up_s keeps a stall of the peer's
                # host from exhausting it in a second.
                raise self._fail(
                    RetryLimitExceeded(
                        peer=self.peer,
                        flow=self.flow,
                        psn=psn,
                        operation=self.operation,
                        retransmissions=f.retransmissions,
                        elapsed=now - f.first_sent,
                    )
                )
            f.losses += 1
            if self._gate is not None and f.in_pipe:
                f.in_pipe = False
                self._gate.lost(f.size, now, timeout=timeout)
        view = [
            FlightInfo(f.psn, f.acked, f.retransmissions, f.last_sent)
            for f in self._flight.values()
        ]
        chosen = self.policy.on_timeout(lost, view) if timeout else self.policy.on_loss(lost, view)
        out: list[Transmit[H]] = []
        seen: set[int] = set()
        declared = set(lost)
        for psn in chosen:
            if psn in seen:
                continue
            seen.add(psn)
            g = self._flight.get(psn)
            if g is None or g.acked:
                raise ValueError(
                    f"retransmit policy {self.policy.name!r} chose PSN {psn}, "
                    "which is not in flight or already acknowledged"
                )
            if self._gate is not None:
                if not g.waiting:  # the policy's window decides when it goes
                    if g.in_pipe:  # (go-back-N's collateral: still counted in flight)
                        g.in_pipe = False
                        self._gate.inflight -= g.size
                    if not (timeout or trimmed) or psn not in declared:
                        # a receiver grants a trimmed frame again, and a policy
                        # hears of a timeout; for any other resend, credit is reused
                        self._gate.reclaim(g.size)
                    g.waiting = True
                    self._rtx.append(psn)
                continue
            out.append(self._resend(g, now))
        if self._gate is not None:
            return self._pump(now)
        return out


# ---------------------------------------------------------------------------
# receiver
# ---------------------------------------------------------------------------


class Receiver(Generic[H]):
    """Reliable receiver for one flow: exactly-once delivery, ACK/SACK/NACK feedback.

    ``window`` PSNs from the next expected one are accepted; state is bounded by
    it (at most ``window - 1`` buffered frames and a ``window``-bit bitmap).
    With a policy whose ``receiver_buffers`` is False (``gbn``) frames after a
    gap are discarded. ``ordered=False`` delivers each frame on its first
    arrival (exactly once, any order), e.g. WRITEs to distinct offsets.

    ACK coalescing: an ACK goes out at once on ACK_REQ, on any out-of-order,
    duplicate or out-of-window frame, and when a frame fills a gap (RFC 5681
    §4.2); otherwise after ``ack_every`` in-order frames or ``max_ack_delay``
    after the first unacknowledged one (the timer). A gap NACK for the missing
    PSN is added when ``packet_threshold`` frames after it are buffered (at
    once for gbn), at most once per gap per ``nack_interval``.
    """

    def __init__(
        self,
        flow: int,
        *,
        policy: str = "selective",
        ordered: bool = True,
        window: int = DEFAULT_WINDOW_FRAMES,
        ack_every: int = DEFAULT_ACK_EVERY,
        max_ack_delay: float = DEFAULT_MAX_ACK_DELAY,
        nack_interval: float = DEFAULT_NACK_INTERVAL,
        packet_threshold: int = PACKET_THRESHOLD,
        first_psn: int = 0,
    ) -> None:
        if not 1 <= window < _HALF:
            raise ValueError(f"window must be in [1, 2**31), got {window}")
        if ack_every < 1:
            raise ValueError(f"ack_every must be >= 1, got {ack_every}")
        if max_ack_delay < 0 or nack_interval < 0:
            raise ValueError("max_ack_delay and nack_interval must be >= 0")
        if packet_threshold < 1:
            raise ValueError(f"packet_threshold must be >= 1, got {packet_threshold}")
        if not 0 <= first_psn <= PSN_MASK:
            raise ValueError(f"first_psn must be a 32-bit PSN, got {first_psn}")
        self.flow = flow
        self.buffers = get_policy(policy).receiver_buffers
        self.ordered = ordered
        self.window = window
        self.ack_every = ack_every
        self.max_ack_delay = max_ack_delay
        self.nack_interval = nack_interval
        self.packet_threshold = packet_threshold

        self._nxt = first_psn  # next PSN expected in order
        self._bits = 0  # bit i: PSN nxt+i received (bit 0 is never set)
        self._held: dict[int, H] = {}  # ordered mode: buffered out-of-order frames
        self._pending = 0  # frames since the last ACK
        self._ack_deadline: float | None = None
        self._nack_psn: int | None = None
        self._nack_at = -math.inf
        self._ce = False  # a frame since the last ACK arrived congestion experienced
        self._ce_frames = 0

        self._received = 0
        self._delivered = 0
        self._duplicates = 0
        self._dup_retx = 0
        self._out_of_window = 0
        self._discarded = 0
        self._acks_sent = 0
        self._nacks_sent = 0
        self._max_buffered = 0

    @property
    def cum_psn(self) -> int:
        """Every PSN up to and including this one has been received."""
        return psn_add(self._nxt, -1)

    def handle_frame(
        self, psn: int, handle: H, now: float, *, flags: Flag | int = 0
    ) -> tuple[list[Delivered[H]], Ack | None]:
        """Take one data frame; return what to deliver and the feedback to send (if any)."""
        self._received += 1
        delivered: list[Delivered[H]] = []
        bits: int = int(flags)  # int masks: a Flag operator goes through the enum
        immediate = bits & _F_ACK_REQ != 0
        if bits & _F_ECN:
            self._ce = True
            self._ce_frames += 1
        want_nack = False
        counts = True  # counts towards ack_every
        d = psn_diff(psn, self._nxt)
        if d < 0 or (0 < d < self.window and (self._bits >> d) & 1):
            self._duplicates += 1
            if bits & _F_RETX:
                self._dup_retx += 1
            immediate = True  # our ACK may have been lost: repeat it now
        elif d >= self.window:
            self._out_of_window += 1
            immediate = True
        elif d == 0:
            delivered.append(Delivered(psn, handle))
            filled_gap = self._bits != 0
            self._advance(delivered)
            immediate = immediate or filled_gap
        elif not self.buffers:
            # go-back-N: drop what follows a gap; NACK the missing PSN
            # (like a RoCE PSN-sequence-error NAK) and stay quiet otherwise.
            self._discarded += 1
            counts = False
            want_nack = True
        else:
            self._bits |= 1 << d
            if self.ordered:
                self._held[psn] = handle
                self._max_buffered = max(self._max_buffered, len(self._held))
            else:
                delivered.append(Delivered(psn, handle))
            immediate = True  # a gap: the sender's SACK loss detection needs it
            want_nack = self._bits.bit_count() >= self.packet_threshold
        self._delivered += len(delivered)
        nack: int | None = None
        if want_nack and (self._nack_psn != self._nxt or now - self._nack_at >= self.nack_interval):
            nack = self._nxt
            self._nack_psn, self._nack_at = nack, now
            self._nacks_sent += 1
        if counts:
            self._pending += 1
        if immediate or nack is not None or self._pending >= self.ack_every:
            return delivered, self._make_ack(nack)
        if self._pending and self._ack_deadline is None:
            self._ack_deadline = now + self.max_ack_delay
        return delivered, None

    def get_timer(self) -> float | None:
        """Deadline of the delayed ACK, or None."""
        return self._ack_deadline

    def handle_timer(self, now: float) -> Ack | None:
        """Send the delayed ACK if it is due."""
        if self._ack_deadline is None or now < self._ack_deadline:
            return None
        return self._make_ack(None)

    def make_ack(self) -> Ack:
        """The current ACK, on demand (e.g. to answer a probe)."""
        return self._make_ack(None)

    def statistics(self) -> ReceiverStats:
        """A snapshot of the counters."""
        return ReceiverStats(
            received=self._received,
            delivered=self._delivered,
            duplicates=self._duplicates,
            duplicate_retransmits=self._dup_retx,
            out_of_window=self._out_of_window,
            discarded_out_of_order=self._discarded,
            acks_sent=self._acks_sent,
            nacks_sent=self._nacks_sent,
            buffered=self._bits.bit_count(),
            max_buffered=self._max_buffered,
            ce_frames=self._ce_frames,
        )

    def _advance(self, delivered: list[Delivered[H]]) -> None:
        """The expected frame arrived: move on over every buffered frame after it."""
        self._nxt = psn_add(self._nxt, 1)
        self._bits >>= 1
        while self._bits & 1:
            if self.ordered:
                delivered.append(Delivered(self._nxt, self._held.pop(self._nxt)))
            self._nxt = psn_add(self._nxt, 1)
            self._bits >>= 1

    def _make_ack(self, nack: int | None) -> Ack:
        self._pending = 0
        self._ack_deadline = None
        self._acks_sent += 1
        ce, self._ce = self._ce, False
        return Ack(self.cum_psn, self._bits & _SACK_MASK, nack, ecn=ce)
