"""RED-style ECN marking on a queue's length, and the receiver's echo of it.

A frame leaving (or joining) a queue of ``q`` bytes is marked congestion
experienced (``Flag.ECN`` of the frame header) with probability

* 0 up to ``kmin``;
* rising linearly to ``pmax`` at ``kmax`` (RED: Floyd and Jacobson, "Random
  early detection gateways", IEEE/ACM ToN 1993, on the instantaneous length as
  data-centre switches do);
* 1 above ``kmax`` (DCQCN's switch profile: Zhu et al., SIGCOMM 2015).

htsim marks from 0.2 to 0.8 BDP with ``pmax`` 1; HPCC's ns-3 uses 400 KB / 1600 KB
with ``pmax`` 0.2 at 100 Gb/s (:mod:`fabric.core.congestion.config`). The random
draw comes from the ``random.Random`` the caller passes in, so a seed gives the
same marks.
"""

from __future__ import annotations

import random

from fabric.core.congestion.config import CongestionConfigError, check_bytes

__all__ = ["RedMarker"]


class RedMarker:
    """Marks frames by the queue length they see."""

    def __init__(self, kmin: int, kmax: int, pmax: float, rng: random.Random) -> None:
        self.kmin = check_bytes("ECN Kmin", kmin)
        self.kmax = check_bytes("ECN Kmax", kmax)
        if self.kmin > self.kmax:
            raise CongestionConfigError(
                f"ECN Kmin {self.kmin} B is above Kmax {self.kmax} B; Kmin must be <= Kmax")
        if not 0.0 < pmax <= 1.0:
            raise CongestionConfigError(f"ECN Pmax {pmax!r} must be in (0, 1]")
        self.pmax = float(pmax)
        self.rng = rng
        self.seen = 0
        self.marked = 0

    def probability(self, queue_bytes: int) -> float:
        """The chance a frame seeing ``queue_bytes`` is marked."""
        if queue_bytes <= self.kmin:
            return 0.0
        if queue_bytes > self.kmax:
            return 1.0
        return self.pmax * (queue_bytes - self.kmin) / (self.kmax - self.kmin)

    def mark(self, queue_bytes: int) -> bool:
        """Draw: whether this frame is marked (counted in ``marked``)."""
        self.seen += 1
        p = self.probability(queue_bytes)
        hit = p >= 1.0 or (p > 0.0 and self.rng.random() < p)
        if hit:
            self.marked += 1
        return hit
