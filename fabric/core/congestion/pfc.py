"""Priority flow control (IEEE 802.1Qbb) per traffic class: thresholds, pause
state, the watchdog and the detection of a PFC deadlock.

Three parts, each pure (``now`` is passed in):

* :class:`PfcIngress`, on a switch: the bytes each ``(ingress port, class)``
  holds in the shared buffer. Above **XOFF** it asks the upstream sender to
  pause that class, below **XON** to resume. XOFF is fixed, or dynamic:
  ``alpha x free buffer`` (HPCC's ns-3, alpha 1/8). Frames the upstream had
  already sent when it paused land in the **headroom**, reserved above XOFF;
  it must hold at least one MTU, or a paused link would still drop.
* :class:`PauseState`, on the upstream's egress: paused or not per class, how
  many pauses, how long paused in all, and a watchdog (a class paused longer
  than its limit is stuck: the storm or deadlock an 802.1Qbb watchdog breaks).
* :func:`find_pause_cycle`: PFC deadlock is a cycle of paused ports, each
  waiting for the next to drain (Hu et al., "Deadlocks in datacenter networks:
  why do they form, and how to avoid them", HotNets 2016). Given who waits on
  whom, it returns one cycle, so a run reports the deadlock by name rather than
  hanging.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from fabric.core.congestion.config import CongestionConfigError, check_bytes

__all__ = ["PfcEvent", "PfcIngress", "PauseState", "find_pause_cycle"]

Key = tuple[int, int]  # (ingress port, traffic class)
P = TypeVar("P", bound=Hashable)  # a port, however the caller names it


@dataclass(frozen=True)
class PfcEvent:
    """Tell the sender on ingress ``port`` to pause (or resume) class ``tc``."""

    port: int
    tc: int
    pause: bool


class PfcIngress:
    """One switch's ingress accounting and its XOFF/XON decisions."""

    def __init__(self, *, mtu: int, headroom_bytes: int, xoff_bytes: int | None = None,
                 alpha: float | None = None, resume_offset_bytes: int = 0) -> None:
        self.mtu = check_bytes("PFC mtu", mtu, minimum=1)
        self.headroom = check_bytes("PFC headroom", headroom_bytes)
        if self.headroom < self.mtu:
            raise CongestionConfigError(
                f"PFC headroom {self.headroom} B is below one MTU ({self.mtu} B): frames in "
                "flight when a pause takes effect would be dropped; give at least one MTU "
                "(HPCC uses 3 x rate x link delay)")
        if (xoff_bytes is None) == (alpha is None):
            raise CongestionConfigError("PFC: give either a fixed XOFF (bytes) or a dynamic "
                                        "alpha (fraction of the free buffer), not both")
        self.xoff = None if xoff_bytes is None else check_bytes("PFC XOFF", xoff_bytes)
        if alpha is not None and not 0.0 < alpha < math.inf:
            raise CongestionConfigError(f"PFC alpha {alpha!r} must be a positive number")
        self.alpha = alpha
        self.resume_offset = check_bytes("PFC resume offset", resume_offset_bytes)
        self._held: dict[Key, int] = {}
        self._paused: dict[Key, int] = {}  # paused queue -> bytes held when it paused
        self.pauses_sent = 0
        self.headroom_overflows = 0  # frames beyond XOFF + headroom: a lossless violation

    def threshold(self, free_bytes: int) -> float:
        """The XOFF threshold now: fixed, or ``alpha x free_bytes``."""
        if self.xoff is not None:
            return float(self.xoff)
        assert self.alpha is not None
        return self.alpha * free_bytes

    def held(self, port: int, tc: int) -> int:
        """Bytes that came in on ``port`` in class ``tc`` and are still in the buffer."""
        return self._held.get((port, tc), 0)

    def is_paused(self, port: int, tc: int) -> bool:
        """Whether this switch has paused ``(port, tc)``'s sender."""
        return (port, tc) in self._paused

    def on_enqueue(self, port: int, tc: int, nbytes: int, free_bytes: int) -> PfcEvent | None:
        """A frame of ``nbytes`` from ``port`` joined the buffer (``free_bytes`` left).

        A frame beyond the headroom above the level at which the pause went out
        is counted in ``headroom_overflows`` (the caller decides whether to drop it)."""
        key = (port, tc)
        q = self._held.get(key, 0) + nbytes
        self._held[key] = q
        limit = self.threshold(free_bytes)
        at_pause = self._paused.get(key)
        if at_pause is not None:
            # what the sender had in flight when it paused lands in the headroom
            if q > at_pause + self.headroom:
                self.headroom_overflows += 1
            return None
        if q > limit:
            self._paused[key] = q
            self.pauses_sent += 1
            return PfcEvent(port, tc, True)
        return None

    def renew(self, port: int, tc: int) -> None:
        """A new PAUSE goes out for ``(port, tc)`` while still above XON (the last
        one has run out): its headroom counts from what the port holds now."""
        key = (port, tc)
        if key in self._paused:
            self._paused[key] = self._held.get(key, 0)

    def on_dequeue(self, port: int, tc: int, nbytes: int, free_bytes: int) -> PfcEvent | None:
        """A frame of ``nbytes`` that came from ``port`` left the buffer."""
        key = (port, tc)
        held = self._held.get(key, 0)
        if nbytes > held:
            raise ValueError(f"PFC: {nbytes} B leave {port}/{tc}, which holds {held} B")
        q = held - nbytes
        self._held[key] = q
        if key in self._paused and q <= max(self.threshold(free_bytes) - self.resume_offset,
                                            0.0):
            del self._paused[key]
            return PfcEvent(port, tc, False)
        return None


class PauseState:
    """An egress port's pause state per class, as its PFC peer set it."""

    def __init__(self) -> None:
        self._since: dict[int, float] = {}
        self._total: dict[int, float] = {}
        self.pauses = 0

    def pause(self, tc: int, now: float) -> None:
        """A PAUSE for ``tc`` arrived (a repeated one extends nothing)."""
        if tc not in self._since:
            self._since[tc] = now
            self.pauses += 1

    def resume(self, tc: int, now: float) -> None:
        """A resume for ``tc`` arrived."""
        start = self._since.pop(tc, None)
        if start is not None:
            self._total[tc] = self._total.get(tc, 0.0) + (now - start)

    def is_paused(self, tc: int) -> bool:
        """Whether class ``tc`` may not send now."""
        return tc in self._since

    def paused_s(self, now: float, tc: int | None = None) -> float:
        """Seconds paused up to ``now``: of class ``tc``, or of every class."""
        tcs = [tc] if tc is not None else sorted(set(self._since) | set(self._total))
        return sum(self._total.get(c, 0.0) + (now - self._since[c] if c in self._since else 0.0)
                   for c in tcs)

    def stuck(self, now: float, watchdog_s: float) -> list[int]:
        """Classes paused without a break for longer than ``watchdog_s``."""
        return sorted(c for c, t in self._since.items() if now - t > watchdog_s)


def find_pause_cycle(waits: Mapping[P, Iterable[P]]) -> list[P] | None:
    """A cycle in the wait-for graph of paused ports, or None.

    ``waits[a]`` lists the ports ``a`` waits on: ``a`` is paused and the frames
    that would unpause it can only leave through them, themselves paused. The
    cycle comes back as its ports in order, starting from its smallest by
    ``repr`` so the same deadlock is always reported the same way."""
    graph = {k: list(v) for k, v in waits.items()}
    colour: dict[P, int] = {}  # 1: on the DFS path, 2: done
    for root in sorted(graph, key=repr):
        if colour.get(root):
            continue
        path: list[P] = [root]
        iters = [iter(sorted(graph.get(root, ()), key=repr))]
        colour[root] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                iters.pop()
                continue
            c = colour.get(nxt, 0)
            if c == 1:
                cycle = path[path.index(nxt):]
                start = min(range(len(cycle)), key=lambda i: repr(cycle[i]))
                return cycle[start:] + cycle[:start]
            if c == 0:
                colour[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()), key=repr)))
    return None
