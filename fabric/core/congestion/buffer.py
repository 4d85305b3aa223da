"""A switch's shared packet buffer: admission by dynamic threshold, tail drop, trimming.

One :class:`SharedBuffer` holds every egress queue of one switch, keyed by
``(port, traffic class)``. A frame of ``n`` bytes is admitted to queue ``q`` when
the pool has room and, after it, ``q`` stays within the **dynamic threshold**
``alpha x (free bytes)`` (Choudhury and Hahne, "Dynamic queue length thresholds
for shared-memory packet switches", IEEE/ACM ToN 1998): a busy queue may take
much of an idle buffer, never all of a busy one. ``alpha = inf`` disables the
threshold, so only the pool's size bounds a queue: a buffer per port (as htsim's
queues) is a one-port pool.

A frame that does not fit is dropped at the tail, or, with ``trim_bytes`` set,
**trimmed**: its payload is cut and its header alone is charged, to the class
the caller names (a high-priority class, so the receiver learns of the loss at
once and asks for the frame again: NDP, Handley et al. SIGCOMM 2017; UET). A
header that does not fit either is dropped; ``trim_reserve_bytes`` of the pool
are kept for headers alone (htsim gives them a queue of their own), so a pool
full of data still takes them.

Pure accounting: the caller enqueues, dequeues and calls :meth:`release` when a
frame leaves; nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

from fabric.core.congestion.config import CongestionConfigError, check_bytes

__all__ = ["Admission", "BufferStats", "SharedBuffer"]

Key = tuple[int, int]  # (port, traffic class)


class Admission(IntEnum):
    """What the buffer did with an offered frame."""

    ACCEPT = 0  # the whole frame was queued
    TRIM = 1  # the payload was cut, the header queued
    DROP = 2  # nothing was queued


@dataclass(frozen=True)
class BufferStats:
    """A snapshot of one shared buffer."""

    size: int
    used: int
    peak: int
    accepted: int
    trims: int
    drops: int
    #: peak bytes per ``"port/class"`` queue
    queue_peaks: dict[str, int] = field(default_factory=dict)


class SharedBuffer:
    """Every egress queue of one switch, sharing ``size_bytes`` under dynamic thresholds."""

    def __init__(self, size_bytes: float, *, alpha: float = 1.0, trim_bytes: int = 0,
                 trim_reserve_bytes: int = 0, what: str = "buffer") -> None:
        self.size = check_bytes(what, size_bytes)
        if not (alpha > 0):  # also refuses NaN
            raise CongestionConfigError(
                f"{what}: dynamic-threshold alpha must be positive (inf: no threshold); "
                f"got {alpha!r}")
        self.alpha = float(alpha)
        self.trim_bytes = check_bytes(f"{what} trim", trim_bytes)
        # bytes only trimmed headers may use, so a pool full of data still takes them
        self.trim_reserve = check_bytes(f"{what} trim reserve", trim_reserve_bytes,
                                        maximum=self.size)
        self.used = 0
        self.peak = 0
        self.accepted = 0
        self.trims = 0
        self.drops = 0
        self.headroom_peak = 0
        self._queues: dict[Key, int] = {}
        self._peaks: dict[Key, int] = {}

    @property
    def free(self) -> int:
        """Bytes not held by any queue."""
        return self.size - self.used

    def threshold(self) -> float:
        """The most bytes one queue may hold now: ``alpha x free``."""
        return math.inf if math.isinf(self.alpha) else self.alpha * self.free

    def queue_bytes(self, port: int, tc: int = 0) -> int:
        """Bytes queue ``(port, tc)`` holds now."""
        return self._queues.get((port, tc), 0)

    def fits(self, port: int, tc: int, nbytes: int) -> bool:
        """Whether ``nbytes`` more would be admitted to ``(port, tc)`` now."""
        free = self.size - self.trim_reserve - self.used
        if nbytes > free:
            return False
        if math.isinf(self.alpha):
            return True
        # the threshold as it stands when the frame arrives (Choudhury-Hahne)
        return self._queues.get((port, tc), 0) + nbytes <= self.alpha * free

    def offer(self, port: int, tc: int, nbytes: int, *, trim_tc: int | None = None) -> Admission:
        """Admit a frame of ``nbytes`` to ``(port, tc)``, trim it, or drop it.

        Trimming happens only when the buffer has ``trim_bytes`` and the caller
        names the class its header goes to (``trim_tc``); the header is charged
        there and must fit too."""
        if self.fits(port, tc, nbytes):
            self._charge((port, tc), nbytes)
            self.accepted += 1
            return Admission.ACCEPT
        if self.trim_bytes and trim_tc is not None and self.trim_bytes <= self.size - self.used:
            self._charge((port, trim_tc), self.trim_bytes)
            self.trims += 1
            return Admission.TRIM
        self.drops += 1
        return Admission.DROP

    def offer_lossless(self, port: int, tc: int, nbytes: int) -> Admission:
        """Admit a frame of a lossless class (PFC holds its senders back instead of a
        threshold): only the pool's size bounds it; beyond, it is dropped and counted."""
        if nbytes <= self.size - self.used:
            self._charge((port, tc), nbytes)
            self.accepted += 1
            return Admission.ACCEPT
        self.drops += 1
        return Admission.DROP

    def admit_lossless(self, port: int, tc: int, nbytes: int) -> Admission:
        """Admit a frame of a lossless class whose senders PFC pauses: always; beyond
        the pool it takes the headroom (``headroom_peak``: the most bytes above
        the pool at once)."""
        self._charge((port, tc), nbytes)
        self.accepted += 1
        over = self.used - self.size
        if over > self.headroom_peak:
            self.headroom_peak = over
        return Admission.ACCEPT

    def release(self, port: int, tc: int, nbytes: int) -> None:
        """``nbytes`` of ``(port, tc)`` left the switch."""
        key = (port, tc)
        held = self._queues.get(key, 0)
        if nbytes > held:
            raise ValueError(f"release of {nbytes} B from queue {port}/{tc} that holds {held} B")
        self._queues[key] = held - nbytes
        self.used -= nbytes

    def statistics(self) -> BufferStats:
        """A frozen snapshot."""
        return BufferStats(size=self.size, used=self.used, peak=self.peak,
                           accepted=self.accepted, trims=self.trims, drops=self.drops,
                           queue_peaks={f"{p}/{c}": v for (p, c), v in
                                        sorted(self._peaks.items())})

    def _charge(self, key: Key, nbytes: int) -> None:
        q = self._queues.get(key, 0) + nbytes
        self._queues[key] = q
        if q > self._peaks.get(key, 0):
            self._peaks[key] = q
        self.used += nbytes
        if self.used > self.peak:
            self.peak = self.used
