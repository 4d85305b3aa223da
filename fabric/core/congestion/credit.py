"""Credit-based link flow control, the scale-up way: a sender spends credits for
the receiver's input buffer and waits when it has none.

Scale-up links (NVLink, UALink, InfiniBand's link layer) are lossless without
PAUSE frames: the receiving end of each link grants its input buffer to the
sending end as credits, one per buffer unit; the sender may put a frame on the
wire only while it holds credits for all of it, and the receiver returns them
as the frame leaves its buffer. Nothing is ever dropped for lack of room, and
nothing is paused after the fact: a link simply stops where its credits end.
What it shares with PFC is head-of-line blocking: frames queued behind a
blocked one wait too, whatever their destination.

:class:`CreditLink` is the sending side of one link (pure: times are passed in).
:func:`link_credit_bytes` sizes a link's credits so that a lone flow never
waits for them: the link's round trip at its rate (a frame out, its credit
back), plus one MTU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabric.core import frame as fr
from fabric.core.congestion.config import CongestionConfigError, check_bytes

if TYPE_CHECKING:
    from fabric.core.topology import LinkParams

__all__ = ["CreditLink", "CreditStats", "link_credit_bytes", "link_grant"]


@dataclass(frozen=True)
class CreditStats:
    """A snapshot of one link's sending side."""

    credits: int  # bytes the sender may still send
    granted: int  # the receiver's buffer for this link
    stalls: int  # times a frame had to wait for credits
    stalled_s: float  # time spent waiting, in all
    returned: int  # bytes of credit returned


class CreditLink:
    """The sending side of one credit-controlled link, holding ``granted_bytes`` of
    the receiver's buffer to begin with."""

    def __init__(self, granted_bytes: int, *, mtu: int) -> None:
        self.granted = check_bytes("link credits", granted_bytes)
        if self.granted < mtu:
            raise CongestionConfigError(
                f"link credits of {self.granted} B cannot cover one frame of {mtu} B; grant "
                "at least one MTU (a link without room for a frame never sends)")
        self.credits = self.granted
        self.stalls = 0
        self.stalled_s = 0.0
        self.returned = 0
        self._waiting_since: float | None = None

    def can_send(self, nbytes: int, now: float) -> bool:
        """Whether a frame of ``nbytes`` may go now; a refusal starts a stall."""
        if nbytes <= self.credits:
            return True
        if self._waiting_since is None:
            self._waiting_since = now
            self.stalls += 1
        return False

    def spend(self, nbytes: int, now: float) -> None:
        """A frame of ``nbytes`` goes out (``can_send`` said it may)."""
        if nbytes > self.credits:
            raise ValueError(f"spend of {nbytes} B with {self.credits} B of credit")
        self.credits -= nbytes
        if self._waiting_since is not None:
            self.stalled_s += now - self._waiting_since
            self._waiting_since = None

    def refill(self, nbytes: int) -> None:
        """The receiver freed ``nbytes`` of its buffer (a credit return arrived)."""
        if self.credits + nbytes > self.granted:
            raise ValueError(f"credit return of {nbytes} B would exceed the {self.granted} B "
                             f"granted ({self.credits} B held)")
        self.credits += nbytes
        self.returned += nbytes

    def stalled(self, now: float) -> float:
        """Time spent waiting for credits up to ``now`` (a wait in progress included)."""
        extra = now - self._waiting_since if self._waiting_since is not None else 0.0
        return self.stalled_s + extra

    def statistics(self, now: float) -> CreditStats:
        return CreditStats(self.credits, self.granted, self.stalls, self.stalled(now),
                           self.returned)


def link_credit_bytes(rate_gbps: float, latency_s: float, mtu: int,
                      control_bytes: int) -> int:
    """Credits that keep a link busy with one flow: a frame's serialisation, the link's
    latency both ways and the credit return's serialisation, at the link's rate,
    rounded up to whole MTUs, plus one MTU."""
    if not (math.isfinite(rate_gbps) and rate_gbps > 0 and latency_s >= 0):
        raise CongestionConfigError(f"link credits for {rate_gbps} Gb/s and {latency_s} s: "
                                    "need a positive rate and a latency >= 0")
    rate = rate_gbps * 1e9 / 8
    round_trip = (mtu + control_bytes) / rate + 2 * latency_s
    return (math.ceil(round_trip * rate / mtu) + 1) * mtu


def link_grant(params: LinkParams, everywhere: bool = False) -> int:
    """The credits the far end of a link grants its sender, in bytes; 0: the link
    is not credit-controlled (``credit`` unset on it and not ``everywhere``, the
    ``[congestion] credit`` of the whole fabric), or unshaped (it never queues,
    so never waits). Sized by :func:`link_credit_bytes` for frames of the
    link's MTU with their header, a credit return being one header."""
    if not (params.credit or everywhere) or not params.shaped:
        return 0
    head = fr.HEADER_SIZE + fr.CRC_SIZE
    return link_credit_bytes(params.bandwidth_gbps, params.latency_us * 1e-6,
                             params.mtu + head, head)
