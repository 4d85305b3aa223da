"""One flow's congestion-control policy as a sender drives it: the window's bytes
in flight, the pacer, the ECN echo and CNP pacing, the policy's lazy timer.

A :class:`CcGate` sits between a sender's own reliability (which frames to send
and resend: :class:`fabric.core.reliability.Sender` for streams, the chunk
windows of the host-staged paths) and its :class:`~.policy.CongestionControl`:

* before a frame goes, :meth:`CcGate.allows` asks the pacer (the policy's rate
  below the line rate spaces frames) and the window (``can_send`` beside the
  bytes in flight); :meth:`CcGate.sent` counts it and schedules the next;
* :meth:`CcGate.acked` and :meth:`CcGate.lost` take bytes out of flight and tell
  the policy (an ACK with its ECN echo and round trip; a NACK or a timeout);
* a policy that wants CNPs gets an echo at most once per DCQCN's CNP interval,
  the pacing a receiver's notification point would apply;
* the policy's own timer is applied when the sender next acts (:meth:`tick`),
  not woken for: a timer every 55 us (DCQCN's) would keep an emulated sender's
  process busy. A policy's ``handle_timer`` therefore counts every period that
  ended by ``now``.

Pure: every time is passed in.
"""

from __future__ import annotations

import math

from fabric.core.congestion.dcqcn import CnpPacer
from fabric.core.congestion.policy import CongestionControl

__all__ = ["CcGate"]


class CcGate:
    """The policy ``cc`` of one flow (``flow`` names it to the CNP pacer)."""

    def __init__(self, cc: CongestionControl, flow: int = 0) -> None:
        self.cc = cc
        self.flow = flow
        self.inflight = 0  # bytes in flight, as the policy's window counts them
        self.echoes = 0  # ACKs that echoed a congestion mark
        #: the pacer: no frame before ``pace_at``; ``pace_wait`` while it holds one
        self.pace_at = -math.inf
        self.pace_wait: float | None = None
        self._paced = False  # the last round stopped at the pacer: the next frame waited
        self._cnp = CnpPacer() if cc.wants_cnp else None

    def tick(self, now: float) -> None:
        """Apply the policy's timer if it is due (lazily: see the module doc)."""
        due = self.cc.get_timer()
        if due is not None and now >= due:
            self.cc.handle_timer(now)

    def begin(self, now: float) -> None:
        """A round of sending starts: the policy's timer, and the pacer forgets its
        last hold (it is set again if it still holds a frame)."""
        self.tick(now)
        self.pace_wait = None

    def end(self) -> None:
        """The round ends; only a frame the pacer held may make up for a late wake."""
        self._paced = self.pace_wait is not None

    def allows(self, nbytes: int, now: float) -> bool:
        """Whether a frame of ``nbytes`` may go now: the pacer's time has come and
        the window admits it (one frame always, when nothing is in flight)."""
        if now < self.pace_at:
            self.pace_wait = self.pace_at
            return False
        return self.cc.can_send(self.inflight, nbytes)

    def sent(self, nbytes: int, now: float) -> None:
        """A frame of ``nbytes`` left (new or resent): count it, pace the next."""
        cc = self.cc
        self.inflight += nbytes
        cc.on_send(nbytes, now)
        rate = cc.rate_bps
        if rate >= cc.path.line_rate_bps:
            self.pace_at = now  # at the line rate the link itself spaces frames
            self._paced = False
            return
        # below it the policy does. A frame that waited for its pacing time and left
        # late (a driver that woke late) gives the next one up to an interval back,
        # so lateness does not add up; one that found the pacer idle starts afresh.
        interval = nbytes * 8 / rate
        base = max(self.pace_at, now - interval) if self._paced else now
        self._paced = False
        self.pace_at = base + interval

    def acked(self, nbytes: int, ecn: bool, rtt_s: float, now: float) -> None:
        """``nbytes`` in flight were acknowledged; ``ecn``: the ACK echoed a mark;
        ``rtt_s``: the newest frame's round trip."""
        self.inflight -= nbytes
        if ecn:
            self._echo(now)
        self.cc.on_ack(nbytes, ecn and self._cnp is None, rtt_s, now)

    def echo(self, now: float) -> None:
        """An ACK that acknowledged nothing new echoed a mark."""
        self._echo(now)

    def lost(self, nbytes: int, now: float, *, timeout: bool) -> None:
        """``nbytes`` in flight were declared lost (by a timeout, or a NACK or the
        packet threshold): out of flight, and the policy hears of it."""
        self.inflight -= nbytes
        if timeout:
            self.cc.on_timeout(nbytes, now)
        else:
            self.cc.on_nack(nbytes, now)

    def reclaim(self, nbytes: int) -> None:
        """A receiver-driven policy's frame of ``nbytes`` goes again though its
        receiver will not grant it again (it never saw it cut: a loss the sender
        found itself, or go-back-N's collateral): the sender reuses its credit."""
        if self.cc.receiver_driven:
            self.cc.credit += nbytes

    @property
    def cwnd(self) -> float:
        return self.cc.cwnd

    def _echo(self, now: float) -> None:
        self.echoes += 1
        cnp = self._cnp
        if cnp is not None and cnp.on_ce(self.flow, now):
            self.cc.on_cnp(now)
