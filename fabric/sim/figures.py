"""Figures of the congestion scenarios (fabric/sim/incast.py, permutation.py):
fairness, percentiles, completion-time slowdowns and the byte-by-byte check."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["count_wrong", "jain", "percentile", "slowdowns", "steady_jain"]


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one has everything."""
    if not xs:
        return 1.0
    s, q = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * q) if q > 0 else 1.0


def percentile(xs: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank)."""
    ys = sorted(xs)
    if not ys:
        return 0.0
    k = max(math.ceil(p / 100 * len(ys)) - 1, 0)
    return ys[min(k, len(ys) - 1)]


def slowdowns(fcts: Sequence[float], alone: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99 of each flow's completion time over its time alone on the fabric."""
    slow = [f / a for f, a in zip(fcts, alone, strict=True)]
    return {"p50": percentile(slow, 50), "p95": percentile(slow, 95),
            "p99": percentile(slow, 99)}


def steady_jain(samples: Sequence[tuple[float, Sequence[int]]]) -> float:
    """Jain's index of what each flow delivered in the second half of the sampled
    time (the share the flows converged to, not how they started)."""
    if len(samples) < 3:
        return 1.0
    end_t, end = samples[-1]
    mid = min(samples, key=lambda smp: abs(smp[0] - end_t / 2))[1]
    return jain([float(b - a) for a, b in zip(mid, end, strict=True)])


def count_wrong(pairs: Sequence[tuple[Any, Any]]) -> int:
    """Over ``(sender flow, receiver flow)`` pairs: bytes received that differ from
    what was sent, plus bytes never received."""
    wrong = 0
    for f, rx in pairs:
        missing = sum(min(rx.chunk, rx.size - k * rx.chunk) for k in range(rx.nframes)
                      if not rx.got[k])
        wrong += int(np.count_nonzero(rx.out != f.data)) if missing == 0 else missing
    return wrong
