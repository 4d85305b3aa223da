"""``dctcp``: TCP's window with DCTCP's reaction to ECN, the front-end's policy.

A datacenter's front-end network runs TCP over lossy Ethernet with ECN; its
usual congestion control is DCTCP (Alizadeh et al., SIGCOMM 2010; RFC 8257).
The sender keeps TCP's window (RFC 5681: slow start, then one MSS per RTT)
and an estimate ``alpha`` of the fraction of its bytes that met a marked
queue, updated once per window of ACKs:

    alpha <- (1 - g) alpha + g F        (F: marked bytes / ACKed bytes in the window)

and in a window with any mark it cuts once: ``cwnd <- cwnd (1 - alpha / 2)``,
so a path marked now and then loses little and one marked throughout halves,
as TCP would on a loss. A loss (a NACK: trimmed, or a gap) halves the window
(fast recovery, RFC 5681 §3.2); a timeout restarts from one MSS in slow start
(§3.1). The first window is RFC 6928's ten segments.

Constants: g = 1/16 and alpha starting at 1 (RFC 8257 §4.2: the conservative
start, the first marks cut hard), the initial window of 10 MSS (RFC 6928),
the minimum window of 2 MSS after a cut (RFC 5681's ``max(FlightSize/2,
2*SMSS)``). The window is counted in bytes of the path's frames (its MTU is
the MSS). No pacing: TCP is self-clocked.
"""

from __future__ import annotations

import math
from typing import Any

from fabric.core.congestion.policy import CcPath, CongestionControl, register_cc

__all__ = ["Dctcp"]

#: RFC 8257 §4.2: the gain of the marked fraction's moving average, and its start.
ALPHA_GAIN = 1.0 / 16
ALPHA_INITIAL = 1.0
#: RFC 6928: the initial window, in segments.
INITIAL_WINDOW_MSS = 10
#: RFC 5681: a window is never cut below this many segments.
MIN_WINDOW_MSS = 2


class Dctcp(CongestionControl):
    """TCP's window, cut by DCTCP's marked fraction (see the module docstring)."""

    name = "dctcp"

    def __init__(self, path: CcPath, now: float = 0.0) -> None:
        super().__init__(path, now)
        self.mss = float(path.mtu)
        self.cwnd = INITIAL_WINDOW_MSS * self.mss
        self.ssthresh = math.inf
        self.alpha = ALPHA_INITIAL
        self.base_rtt = path.base_rtt_s
        self._acked = 0  # bytes ACKed in the current observation window
        self._marked = 0  # of which echoed a mark
        self._window_end = now + self.base_rtt
        self._rtt = self.base_rtt  # the latest round trip: a window's length
        self.cuts = 0  # windows that ended in a cut for marks
        self.losses = 0

    def on_ack(self, acked: int, ecn: bool, rtt_s: float, now: float) -> None:
        if rtt_s > 0:
            self._rtt = rtt_s
        self._acked += acked
        if ecn:
            self._marked += acked
        elif self.cwnd < self.ssthresh:  # slow start: a segment per segment ACKed
            self.cwnd += acked
        else:  # congestion avoidance: a segment per window
            self.cwnd += self.mss * acked / self.cwnd
        if now >= self._window_end:
            self._end_window(now)

    def on_nack(self, nbytes: int, now: float) -> None:
        self.losses += 1
        self.ssthresh = max(self.cwnd / 2, MIN_WINDOW_MSS * self.mss)
        self.cwnd = self.ssthresh

    def on_timeout(self, nbytes: int, now: float) -> None:
        self.losses += 1
        self.ssthresh = max(self.cwnd / 2, MIN_WINDOW_MSS * self.mss)
        self.cwnd = self.mss

    def statistics(self) -> dict[str, Any]:
        return {"cwnd": self.cwnd, "ssthresh": self.ssthresh, "alpha": self.alpha,
                "cuts": self.cuts, "losses": self.losses}

    def _end_window(self, now: float) -> None:
        """One window of ACKs is in: update alpha, and cut once if any came marked."""
        if self._acked:
            fraction = self._marked / self._acked
            self.alpha += ALPHA_GAIN * (fraction - self.alpha)
            if self._marked:
                self.cwnd = max(self.cwnd * (1 - self.alpha / 2), MIN_WINDOW_MSS * self.mss)
                self.ssthresh = self.cwnd  # leave slow start
                self.cuts += 1
        self._acked = self._marked = 0
        self._window_end = now + max(self._rtt, self.base_rtt)


register_cc("dctcp", Dctcp)
