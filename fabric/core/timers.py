"""Retransmit timers for aggregation windows (pure: ``now`` is passed in).

A worker with chunks outstanding at the switch keeps one timer per chunk. When
a chunk's result does not come back in time, the worker sends its
contribution again (flagged RETX); the switch's contributor bitmap makes the
copy count once and answers a finished chunk with the kept result
(docs/AGGREGATION.md). The timeout is the one RFC 6298 estimator of
fabric.core.reliability (SRTT, RTTVAR, Karn's rule, exponential backoff).
"""

from __future__ import annotations

import heapq

from fabric.core.reliability import PACKET_THRESHOLD, RttEstimator

__all__ = ["ChunkTimers", "Deadlines", "RttEstimator"]


class _Timer:
    # written out, not a dataclass: compiled, a dataclass's generated __init__
    # stays interpreted, and a timer is made for every chunk sent
    __slots__ = ("first_sent", "sent", "deadline", "order", "rto", "allowance", "tries",
                 "overtaken")

    def __init__(self, first_sent: float, sent: float, deadline: float, order: int,
                 rto: float, allowance: float = 0.0) -> None:
        self.first_sent = first_sent
        self.sent = sent
        self.deadline = deadline
        self.order = order  # send order of the latest transmission
        self.rto = rto  # the timeout the deadline was set with
        self.allowance = allowance  # known wire time of the round trip, beside the RTO
        self.tries = 0
        self.overtaken = 0  # results of chunks sent after it that came back first


class ChunkTimers:
    """One timer per outstanding chunk; gives up ``give_up_s`` after a chunk's first send."""

    def __init__(self, rtt: RttEstimator, give_up_s: float,
                 packet_threshold: int = PACKET_THRESHOLD) -> None:
        self.rtt = rtt
        self.give_up_s = give_up_s
        self.packet_threshold = packet_threshold
        self._timers: dict[int, _Timer] = {}
        self._order = 0
        self.retransmits = 0
        self.fast_retransmits = 0
        self.expiries = 0  # chunks whose timer ran out (each then resent)

    def sent(self, chunk: int, now: float, allowance: float = 0.0) -> None:
        """Chunk ``chunk`` was sent for the first time at ``now``.

        ``allowance``: the time its bytes and what is queued ahead of them take on
        shaped links, known from the link rates. It is added to the timeout and
        taken off the RTT sample, so the estimator learns only the rest: one
        estimator then serves chunks of every size (a 256 KiB chunk on a 10 Mbit/s
        link is 210 ms on the wire, a barrier frame microseconds).
        """
        self._order += 1
        rto = self.rtt.rto
        self._timers[chunk] = _Timer(now, now, now + allowance + rto, self._order, rto,
                                     allowance)

    def acked(self, chunk: int, now: float,
              complete_below: int | None = None) -> tuple[bool, list[int]]:
        """Its result arrived: ``(was_outstanding, to_resend_now)``.

        Results come back in completion order, so a chunk overtaken by
        ``packet_threshold`` results of chunks sent after it was lost on the
        way (its contribution or its result): resend it now rather than wait
        for its timer (RFC 9002 §6.1.1 packet threshold, as for frames).
        ``complete_below``: the switch says every chunk below it is complete,
        so only those can have lost their result; a chunk at or above it waits
        for another member's contribution and keeps its timer.
        """
        t = self._timers.pop(chunk, None)
        if t is None:
            return False, []
        if t.tries == 0:
            self.rtt.sample(now - t.sent - t.allowance)
        resend = []
        for other, u in self._timers.items():
            if u.order < t.order:
                u.overtaken += 1
                if u.overtaken >= self.packet_threshold and (
                        complete_below is None or other < complete_below):
                    self._resent(u, now)
                    resend.append(other)
        self.fast_retransmits += len(resend)
        self.retransmits += len(resend)
        return True, resend

    def _resent(self, t: _Timer, now: float, timeout: float | None = None) -> None:
        """Chunk sent again at ``now``; its timer restarts with ``timeout``
        (default: the RTO doubled for each of its copies)."""
        self._order += 1
        t.tries += 1
        t.sent = now
        t.order = self._order
        t.overtaken = 0
        if timeout is None:
            timeout = self.rtt.backed_off(t.tries)
        t.rto = timeout
        t.deadline = now + t.allowance + timeout

    def outstanding(self, chunk: int) -> bool:
        """True when ``chunk`` was sent and its result has not come."""
        return chunk in self._timers

    def resent(self, chunk: int, now: float) -> None:
        """Chunk ``chunk`` was sent again at ``now`` on request (a MISSING NACK): its
        timer restarts, backed off, and no RTT sample is taken from it (Karn)."""
        t = self._timers.get(chunk)
        if t is not None:
            self._resent(t, now)
            self.retransmits += 1

    def next_deadline(self) -> float | None:
        """The earliest deadline, or None when nothing is outstanding."""
        return min((t.deadline for t in self._timers.values()), default=None)

    def expired(self, now: float) -> tuple[list[int], list[int]]:
        """``(to_resend, given_up)``: chunks whose timer ran out at ``now``.

        An expiry backs the estimator off (RFC 6298 §5.5: twice the timeout
        that ran out) and the chunk waits that long again. The longer RTO stays
        for later chunks until one comes back without a resend (Karn's
        algorithm, RFC 6298 §3). Without that, a timeout shorter than the true
        RTT would fire on every chunk for ever: each resend denies the sample
        that would fix it.
        """
        resend, dead = [], []
        for chunk, t in self._timers.items():
            if t.deadline > now:
                continue
            if now - t.first_sent >= self.give_up_s:
                dead.append(chunk)
                continue
            self.rtt.backoff(t.rto)
            self._resent(t, now, self.rtt.rto)
            resend.append(chunk)
        self.retransmits += len(resend)
        self.expiries += len(resend)
        return resend, dead

    def __len__(self) -> int:
        return len(self._timers)


class Deadlines:
    """The earliest of many deadlines, each set alone (one per receiver of a
    multicast, one per program running in parallel): a heap whose stale entries
    are dropped as they surface, so a change costs O(log n), not a scan of all
    n (at 1024 ranks that scan, per frame, was most of a simulated all_gather)."""

    def __init__(self) -> None:
        self._at: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []
        self._done: set[int] = set()

    def set(self, key: int, deadline: float | None) -> None:
        """``key``'s deadline is now ``deadline`` (None: it has none)."""
        old = self._at.get(key)
        if deadline == old:
            return
        if deadline is None:
            del self._at[key]
            return
        self._at[key] = deadline
        heapq.heappush(self._heap, (deadline, key))
        if len(self._heap) > 4 * len(self._at) + 64:  # mostly stale: rebuild
            self._heap = [(t, k) for k, t in self._at.items()]
            heapq.heapify(self._heap)

    def set_done(self, key: int) -> bool:
        """``key`` is finished for good: True the first time (a count may drop)."""
        if key in self._done:
            return False
        self._done.add(key)
        self._at.pop(key, None)
        return True

    def earliest(self) -> float | None:
        """The earliest deadline set, or None."""
        h, at = self._heap, self._at
        while h and at.get(h[0][1]) != h[0][0]:
            heapq.heappop(h)
        return h[0][0] if h else None

    def take_due(self, now: float) -> list[int]:
        """The keys whose deadline is ``<= now``, earliest first, forgotten (the
        caller sets them again after handling them)."""
        due: list[int] = []
        h, at = self._heap, self._at
        while h:
            t, k = h[0]
            if at.get(k) != t:
                heapq.heappop(h)
                continue
            if t > now:
                break
            heapq.heappop(h)
            del at[k]
            due.append(k)
        return due
