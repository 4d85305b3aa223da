"""``nscc``: a window from ECN and queueing delay, in the spirit of UET's NSCC.

The Ultra Ethernet transport's network-signalled congestion control (and
htsim's model of it) reads two signals per ACK: the CE echo and the delay
``rtt - base_rtt`` against a target queueing delay. Our own formulation:

=====================  ==========================================================
signal                 action
=====================  ==========================================================
no CE, delay < target  proportional increase, larger the further below target,
                       plus the fair increase; a whole window at under 1 us
                       of delay grows the window by half of what is ACKed
no CE, delay >= target fair increase only (the same bytes per RTT for every
                       flow: what makes flows converge to equal shares)
CE, delay >= target    multiplicative decrease, at most once per base RTT, by
                       ``gamma x (avg delay - target) / avg delay`` (at most 1/2)
CE, delay < target     nothing (the mark is from another path's transient)
=====================  ==========================================================

Increases accumulate and are applied once per base RTT (or 8 MTUs ACKed), at
most 8 MTUs at a time, plus a small additive ``eta``. **Quick adapt**: at the
end of each window of ``base_rtt + target``, after a loss (a trimmed frame's
NACK) or an average delay above 4 x target, the window drops at once to what was
ACKed in that window (what the path actually carried), and CE marks are
ignored until the frames then in flight are ACKed. The window stays within
[0.05 MTU, 1.5 BDP]; under one MTU the flow sends one frame at a time, paced at
``cwnd`` per base RTT (so a 1000-to-1 incast need not hold 1000 MTUs in flight).

Constants (htsim's ``initNsccParams``, scaled like it by ``a = BDP / (100 Gb/s
x 12 us)`` and ``b = target / 12 us``): gamma 0.8, delay EWMA gain 0.0125,
quick-adapt trigger 4 x target, eta 0.15 MTU, target 0.75 x base RTT with
trimming (1 x without).
"""

from __future__ import annotations

from typing import Any

from fabric.core.congestion.config import HTSIM_BASE_RTT_S, bdp_bytes
from fabric.core.congestion.policy import CcPath, CongestionControl, register_cc

__all__ = ["Nscc"]

#: The reference path NSCC's constants are scaled from: 100 Gb/s, 12 us.
REFERENCE_BDP = bdp_bytes(100.0, HTSIM_BASE_RTT_S)
#: Largest window, in BDPs.
MAX_WINDOW_BDP = 1.5
#: Target queueing delay as a fraction of the base RTT, with and without trimming.
TARGET_RTT_TRIM = 0.75
TARGET_RTT_DROP = 1.0
#: Multiplicative decrease gain and its floor (at most halve per RTT).
GAMMA = 0.8
MAX_DECREASE = 0.5
#: EWMA gain of the average queueing delay, per ACK.
DELAY_EWMA = 0.0125
#: Quick adapt when the average delay passes this many targets.
QUICK_ADAPT_TARGETS = 4.0
#: Fair increase per RTT of ACKs (MTUs, x a); proportional increase at zero delay (x a x b).
FAIR_MTUS = 4.0
PROPORTIONAL_MTUS = 4.0
#: Additive drift per base RTT (MTUs, x a).
ETA_MTUS = 0.15
#: Increases are applied per base RTT or this many MTUs ACKed, at most this many MTUs.
ADJUST_MTUS = 8
#: Delay below which a window of ACKs counts as an empty path (fast increase).
FAST_INCREASE_DELAY_S = 1e-6
#: Smallest window, in MTUs. Below one MTU the flow is paced at ``cwnd`` per base
#: RTT instead (one frame in flight): with many senders on one port, even one
#: frame each is more than the port's BDP and buffer.
MIN_WINDOW_MTUS = 0.05


class Nscc(CongestionControl):
    """ECN + delay window control (see the module docstring)."""

    name = "nscc"

    def __init__(self, path: CcPath, now: float = 0.0, *,
                 target_qdelay_s: float | None = None) -> None:
        super().__init__(path, now)
        mtu = float(path.mtu)
        self.base_rtt = path.base_rtt_s
        self.target = (target_qdelay_s if target_qdelay_s is not None else
                       (TARGET_RTT_TRIM if path.trimming else TARGET_RTT_DROP) * self.base_rtt)
        a = path.bdp / REFERENCE_BDP
        b = self.target / HTSIM_BASE_RTT_S
        self.maxwnd = max(MAX_WINDOW_BDP * path.bdp, mtu)
        self.min_cwnd = MIN_WINDOW_MTUS * mtu
        self.mtu = mtu
        self.cwnd = self.maxwnd
        self.fair = FAIR_MTUS * mtu * a
        self.prop = PROPORTIONAL_MTUS * mtu * a * b
        self.eta = ETA_MTUS * mtu * a
        self.adjust_bytes = ADJUST_MTUS * mtu
        self.avg_delay = 0.0
        self.inflight = 0
        self._inc = 0.0
        self._acked_since_adjust = 0
        self._last_adjust = now
        self._last_decrease = -1.0
        self._last_eta = now
        self._fast_count = 0.0
        self._qa_end = now + self.base_rtt + self.target
        self._achieved = 0
        self._loss = False
        self._ignore = 0  # bytes to ACK before CE counts again (after quick adapt)
        self.decreases = 0
        self.quick_adapts = 0

    def on_send(self, nbytes: int, now: float) -> None:
        self.inflight += nbytes

    def on_ack(self, acked: int, ecn: bool, rtt_s: float, now: float) -> None:
        self.inflight = max(self.inflight - acked, 0)
        delay = max(rtt_s - self.base_rtt, 0.0)
        self.avg_delay += DELAY_EWMA * (delay - self.avg_delay)
        self._achieved += acked
        if self._ignore > 0:
            self._ignore = max(self._ignore - acked, 0)
            if ecn:
                return
        if self._quick_adapt(now):
            return
        if not ecn:
            if delay < self.target:
                self._increase_below_target(acked, delay)
            else:
                self._fast_count = 0.0
            self._inc += self.fair * acked / self.cwnd
        elif delay >= self.target:
            self._fast_count = 0.0
            if now - self._last_decrease > self.base_rtt and self.avg_delay > self.target:
                cut = GAMMA * (self.avg_delay - self.target) / self.avg_delay
                self.cwnd *= max(1.0 - cut, MAX_DECREASE)
                self._last_decrease = now
                self.decreases += 1
        self._acked_since_adjust += acked
        if self._acked_since_adjust > self.adjust_bytes or now - self._last_adjust > self.base_rtt:
            self.cwnd += min(self._inc, self.adjust_bytes)
            self._inc = 0.0
            self._acked_since_adjust = 0
            self._last_adjust = now
        if now - self._last_eta > self.base_rtt:
            self.cwnd += self.eta
            self._last_eta = now
        self._clamp()

    def on_nack(self, nbytes: int, now: float) -> None:
        self.inflight = max(self.inflight - nbytes, 0)
        # a frame in flight at the quick adapt, answered (trimmed) after it
        self._ignore = max(self._ignore - nbytes, 0)
        # a loss takes the frame's bytes off, never below one MTU: a burst of trims
        # must not leave a flow paced at a crawl (only delay drives it lower)
        self.cwnd = max(self.cwnd - nbytes, min(self.cwnd, self.mtu))
        self._loss = True
        self._clamp()
        if self._ignore == 0:
            self._quick_adapt(now)

    def statistics(self) -> dict[str, Any]:
        return {"cwnd": self.cwnd, "avg_delay_s": self.avg_delay, "decreases": self.decreases,
                "quick_adapts": self.quick_adapts, "target_qdelay_s": self.target}

    # ------------------------------------------------------------------ internals
    def _increase_below_target(self, acked: int, delay: float) -> None:
        if delay < FAST_INCREASE_DELAY_S:
            self._fast_count += acked
            if self._fast_count > self.cwnd:  # a whole window saw an empty path
                self.cwnd += acked * 0.5
                return
        else:
            self._fast_count = 0.0
        self._inc += self.prop * (self.target - delay) / self.target * acked / self.cwnd

    def _quick_adapt(self, now: float) -> bool:
        if now <= self._qa_end:
            return False
        fired = False
        if (self._loss or self.avg_delay > QUICK_ADAPT_TARGETS * self.target) \
                and self._achieved < self.cwnd:
            # never below one MTU here: a flow that got nothing through in the
            # window (others' burst came first) must not be starved by it
            self.cwnd = max(float(self._achieved), min(self.cwnd, self.mtu))
            self._ignore = self.inflight
            self.quick_adapts += 1
            fired = True
        self._loss = False
        self._achieved = 0
        self._qa_end = now + self.base_rtt + self.target
        return fired

    def _clamp(self) -> None:
        if self.cwnd < self.min_cwnd:
            self.cwnd = self.min_cwnd
        elif self.cwnd > self.maxwnd:
            self.cwnd = self.maxwnd
        # under one MTU: one frame at a time, paced to cwnd per base RTT
        self.rate_bps = (self.path.line_rate_bps if self.cwnd >= self.mtu
                         else self.cwnd * 8 / self.base_rtt)


register_cc("nscc", Nscc)
