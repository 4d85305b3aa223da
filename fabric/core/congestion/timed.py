"""A shared buffer whose frames leave at known times: for drivers that shape a
link by computing departures (:class:`fabric.core.link.LinkPipeline`) rather
than by dequeue events.

A frame is charged when it is queued and released when its last byte has left
(``leaves_at``); :meth:`TimedBuffer.advance` releases every frame gone by
``now``, so the pool's occupancy is exact at each admission. Pure: times are
passed in.
"""

from __future__ import annotations

import heapq

from fabric.core.congestion.buffer import Admission, SharedBuffer

__all__ = ["DATA_CLASS", "HEADER_CLASS", "TimedBuffer"]

#: Traffic classes of a port's queue: data, and trimmed headers (served first).
DATA_CLASS, HEADER_CLASS = 0, 1


class TimedBuffer:
    """A :class:`SharedBuffer` plus the departure time of everything it holds."""

    def __init__(self, buffer: SharedBuffer) -> None:
        self.buffer = buffer
        # (time, seq, port, class, bytes)
        self._leaving: list[tuple[float, int, int, int, int]] = []
        self._seq = 0

    def advance(self, now: float) -> None:
        """Release every frame whose last byte left by ``now``."""
        heap = self._leaving
        while heap and heap[0][0] <= now:
            _t, _s, port, tc, nbytes = heapq.heappop(heap)
            self.buffer.release(port, tc, nbytes)

    def queued(self, port: int, now: float) -> int:
        """Data bytes waiting in ``port``'s queue at ``now``."""
        self.advance(now)
        return self.buffer.queue_bytes(port, DATA_CLASS)

    def admit(self, port: int, nbytes: int, now: float, *, trimmable: bool = True
              ) -> Admission:
        """Admit a frame of ``nbytes`` to ``port``'s data queue, trim it (when the
        buffer trims and the frame may be trimmed: its header is charged to the
        header class) or drop it; :meth:`hold` an admitted frame with its departure."""
        self.advance(now)
        trim = self.buffer.trim_bytes and trimmable
        return self.buffer.offer(port, DATA_CLASS, nbytes,
                                 trim_tc=HEADER_CLASS if trim else None)

    def hold(self, port: int, nbytes: int, leaves_at: float, tc: int = DATA_CLASS) -> None:
        """The admitted frame leaves ``port`` at ``leaves_at`` (its last byte on the wire)."""
        self._seq += 1
        heapq.heappush(self._leaving, (leaves_at, self._seq, port, tc, nbytes))
