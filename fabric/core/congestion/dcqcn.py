"""``dcqcn``: rate-based control from congestion notification packets (RoCEv2).

DCQCN (Zhu et al., "Congestion control for large-scale RDMA deployments",
SIGCOMM 2015) in three parts: the switch marks CE (RED, :mod:`.ecn`); the
receiver (notification point, :class:`CnpPacer`) answers a flow's marked frames
with at most one CNP per 50 us; the sender (reaction point, :class:`Dcqcn`)
keeps a current rate ``Rc``, a target ``Rt`` and a congestion estimate ``alpha``:

* on a CNP: ``Rt = Rc; Rc = Rc (1 - alpha/2); alpha = (1-g) alpha + g``;
* every 55 us without a CNP: ``alpha = (1-g) alpha``;
* recovery, counted by a 55 us timer and a byte counter: for the first F = 5
  events fast recovery ``Rc = (Rt + Rc)/2``; then additive increase
  (``Rt += R_AI``); when both counters pass F, hyper increase (``Rt += i R_HAI``).

The constants are the paper's (g = 1/256, 55 us timers, F = 5, R_AI 40 Mb/s at
40 Gb/s, scaled with the line rate here, CNP every 50 us); the byte counter is
10 MB as there, and R_HAI is 10 x R_AI.
"""

from __future__ import annotations

from typing import Any

from fabric.core.congestion.policy import CcPath, CongestionControl, register_cc

__all__ = ["CnpPacer", "Dcqcn"]

#: alpha's EWMA gain.
G = 1.0 / 256
#: alpha decays, and the rate recovers, on these periods (seconds).
ALPHA_TIMER_S = 55e-6
INCREASE_TIMER_S = 55e-6
#: Bytes sent per byte-counter event.
BYTE_COUNTER = 10 * 1000 * 1000
#: Fast-recovery steps before additive increase.
FAST_RECOVERY_STEPS = 5
#: Additive and hyper increase steps (bit/s) at the paper's 40 Gb/s; scaled with
#: the line rate (the same fraction of it per step).
RATE_AI_BPS = 40e6
RATE_HAI_BPS = 400e6
REFERENCE_LINE_BPS = 40e9
#: The rate never falls below this fraction of the line rate.
MIN_RATE_FRACTION = 1e-3
#: The receiver sends at most one CNP per flow per this period (seconds).
CNP_INTERVAL_S = 50e-6
#: The switches' RED profile DCQCN was tuned with (the paper's section 5):
#: Kmin 5 KB, Kmax 200 KB, Pmax 1%.
ECN_KMIN = 5 * 1000
ECN_KMAX = 200 * 1000
ECN_PMAX = 0.01


class CnpPacer:
    """The receiver side: whether a CE-marked frame of a flow should cause a CNP now."""

    def __init__(self, interval_s: float = CNP_INTERVAL_S) -> None:
        self.interval = interval_s
        self._last: dict[int, float] = {}
        self.sent = 0

    def on_ce(self, flow: int, now: float) -> bool:
        """A marked frame of ``flow`` arrived: True if a CNP should go back now."""
        last = self._last.get(flow)
        if last is not None and now - last < self.interval:
            return False
        self._last[flow] = now
        self.sent += 1
        return True


class Dcqcn(CongestionControl):
    """The reaction point: a paced rate cut by CNPs, recovered by timer and bytes."""

    name = "dcqcn"
    wants_cnp = True

    def __init__(self, path: CcPath, now: float = 0.0) -> None:
        super().__init__(path, now)
        self.line = path.line_rate_bps
        self.rate_bps = self.line
        self.target = self.line
        self.alpha = 1.0
        self.min_rate = self.line * MIN_RATE_FRACTION
        self.rate_ai = RATE_AI_BPS * self.line / REFERENCE_LINE_BPS
        self.rate_hai = RATE_HAI_BPS * self.line / REFERENCE_LINE_BPS
        self._alpha_at: float | None = None
        self._increase_at: float | None = None
        self._t_count = 0
        self._b_count = 0
        self._bytes = 0
        self.cnps = 0

    def on_cnp(self, now: float) -> None:
        self.cnps += 1
        self.target = self.rate_bps
        self.rate_bps = max(self.rate_bps * (1.0 - self.alpha / 2), self.min_rate)
        self.alpha = (1.0 - G) * self.alpha + G
        self._t_count = self._b_count = self._bytes = 0
        self._alpha_at = now + ALPHA_TIMER_S
        self._increase_at = now + INCREASE_TIMER_S

    def on_send(self, nbytes: int, now: float) -> None:
        if self._increase_at is None:
            return  # at line rate: nothing to recover
        self._bytes += nbytes
        if self._bytes >= BYTE_COUNTER:
            self._bytes -= BYTE_COUNTER
            self._b_count += 1
            self._increase()

    def get_timer(self) -> float | None:
        a, i = self._alpha_at, self._increase_at
        if a is None:
            return i
        return a if i is None or a < i else i

    def handle_timer(self, now: float) -> None:
        # every period that ended by ``now`` counts: a driver that wakes late (an
        # emulator's process) must not slow the recovery the periods stand for
        while self._alpha_at is not None and self._alpha_at <= now:
            self.alpha *= 1.0 - G
            self._alpha_at = self._alpha_at + ALPHA_TIMER_S if self.alpha > 1e-4 else None
        while self._increase_at is not None and self._increase_at <= now:
            self._t_count += 1
            self._increase()
            self._increase_at = (None if self.rate_bps >= self.line
                                 else self._increase_at + INCREASE_TIMER_S)

    def statistics(self) -> dict[str, Any]:
        return {"rate_bps": self.rate_bps, "target_bps": self.target, "alpha": self.alpha,
                "cnps": self.cnps}

    def _increase(self) -> None:
        t, b = self._t_count, self._b_count
        if max(t, b) < FAST_RECOVERY_STEPS:
            pass  # fast recovery: towards the target, which stays
        elif min(t, b) > FAST_RECOVERY_STEPS:
            self.target += (min(t, b) - FAST_RECOVERY_STEPS) * self.rate_hai
        else:
            self.target += self.rate_ai
        if self.target > self.line:
            self.target = self.line
        self.rate_bps = (self.target + self.rate_bps) / 2
        if self.line - self.rate_bps < 1e-6 * self.line:
            self.rate_bps = self.line


register_cc("dcqcn", Dcqcn)
