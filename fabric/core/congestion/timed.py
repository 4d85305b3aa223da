"""A shared buffer whose frames leave at known times: for drivers that shape a
link by computing departures (:class:`fabric.core.link.LinkPipeline`) rather
than by dequeue events.

A frame is charged when it is queued and released when its last byte has left
(``leaves_at``); :meth:`TimedBuffer.advance` releases every frame gone by
``now``, so the pool's occupancy is exact at each admission. A frame whose
port is paused before it began leaves later (:meth:`TimedBuffer.postpone`).

A lossless buffer (PFC) also counts the bytes each ingress port holds
(:class:`~fabric.core.congestion.pfc.PfcIngress`): above XOFF, the frames that
port holds are known to leave at known times, so the time they drain to XON is
known too, and that is how long the port's sender is paused
(:meth:`TimedBuffer.pause_until`). Pure: times are passed in.
"""

from __future__ import annotations

import heapq

from fabric.core.congestion.buffer import Admission, SharedBuffer
from fabric.core.congestion.pfc import PfcIngress

__all__ = ["DATA_CLASS", "HEADER_CLASS", "TimedBuffer"]

#: Traffic classes of a port's queue: data, and trimmed headers (served first).
DATA_CLASS, HEADER_CLASS = 0, 1


class TimedBuffer:
    """A :class:`SharedBuffer` plus the departure time of everything it holds; with
    ``pfc``, its ingress accounting."""

    def __init__(self, buffer: SharedBuffer, pfc: PfcIngress | None = None) -> None:
        self.buffer = buffer
        self.pfc = pfc
        # (time, seq, port, class, bytes, ingress port or -1)
        self._leaving: list[tuple[float, int, int, int, int, int]] = []
        self._seq = 0
        self._moved: set[int] = set()  # entries postponed: a later one stands for each
        # seq -> port, class, bytes, ingress: what postpone needs (kept with PFC only)
        self._entries: dict[int, tuple[int, int, int, int]] = {}
        # ingress -> seq -> (time, bytes) of the frames it holds (with PFC only): a
        # pause's end reads one port's frames, not the whole buffer's
        self._of_ingress: dict[int, dict[int, tuple[float, int]]] = {}
        self._pause_end: dict[int, float] = {}  # ingress -> when its last PAUSE runs out

    def advance(self, now: float) -> None:
        """Release every frame whose last byte left by ``now``."""
        heap = self._leaving
        while heap and heap[0][0] <= now:
            _t, seq, port, tc, nbytes, ingress = heapq.heappop(heap)
            if self._moved and seq in self._moved:
                self._moved.discard(seq)
                continue
            self.buffer.release(port, tc, nbytes)
            if self.pfc is not None:
                del self._entries[seq]
                if ingress >= 0:
                    del self._of_ingress[ingress][seq]
                    self.pfc.on_dequeue(ingress, DATA_CLASS, nbytes, self.buffer.free)

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

    def admit_lossless(self, port: int, nbytes: int, now: float) -> Admission:
        """Admit a frame of a lossless class: always (beyond the shared pool it is in
        the headroom PFC keeps for frames on their way when a pause goes out)."""
        self.advance(now)
        return self.buffer.admit_lossless(port, DATA_CLASS, nbytes)

    def hold(self, port: int, nbytes: int, leaves_at: float, tc: int = DATA_CLASS,
             ingress: int = -1) -> int:
        """The admitted frame leaves ``port`` at ``leaves_at`` (its last byte on the
        wire); it came in on ``ingress`` (-1: not counted by ingress). A handle for
        :meth:`postpone`."""
        self._seq += 1
        heapq.heappush(self._leaving, (leaves_at, self._seq, port, tc, nbytes, ingress))
        if self.pfc is not None:
            self._entries[self._seq] = (port, tc, nbytes, ingress)
            if ingress >= 0:
                self._of_ingress.setdefault(ingress, {})[self._seq] = (leaves_at, nbytes)
                self.pfc.on_enqueue(ingress, DATA_CLASS, nbytes, self.buffer.free)
        return self._seq

    def postpone(self, hold: int, leaves_at: float) -> int:
        """A frame held (``hold``: what :meth:`hold` returned) leaves later, at
        ``leaves_at`` (its port was paused before it began); its new handle. Only
        with PFC, which is what pauses ports."""
        port, tc, nbytes, ingress = self._entries.pop(hold)
        self._moved.add(hold)
        self._seq += 1
        heapq.heappush(self._leaving, (leaves_at, self._seq, port, tc, nbytes, ingress))
        self._entries[self._seq] = (port, tc, nbytes, ingress)
        if ingress >= 0:
            held = self._of_ingress[ingress]
            del held[hold]
            held[self._seq] = (leaves_at, nbytes)
        return self._seq

    def pause_until(self, ingress: int, now: float) -> float | None:
        """With PFC: when ``ingress`` holds more than XOFF, the time the frames it
        holds will have drained to XON (its sender is paused until then); else
        None. XON is XOFF less the resume offset, at the free buffer of now."""
        pfc = self.pfc
        if pfc is None or not pfc.is_paused(ingress, DATA_CLASS):
            return None
        held = pfc.held(ingress, DATA_CLASS)
        xon = max(pfc.threshold(self.buffer.free) - pfc.resume_offset, 0.0)
        if held <= xon:
            return None
        mine = self._of_ingress.get(ingress, {})
        for t, _seq, nbytes in sorted([(t, seq, n) for seq, (t, n) in mine.items()]):
            held -= nbytes
            if held <= xon:
                if now >= self._pause_end.get(ingress, -1.0):
                    # the last PAUSE ran out above XON (the free buffer shrank
                    # meanwhile): this is a new one, with its own headroom
                    pfc.renew(ingress, DATA_CLASS)
                until = max(t, now)
                self._pause_end[ingress] = max(until, self._pause_end.get(ingress, until))
                return until
        return None
