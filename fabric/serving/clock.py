"""The clock every token timestamp is taken with (a driver helper).

CLOCK_MONOTONIC in nanoseconds, shared by every process of one host, so stamps
taken by the generator, the relay, the host and the client compare directly.
On a fabric placed on several hosts (`semfab run`), each process learns its
clock's offset from rank 0's (an NTP-style exchange at the rendezvous) and
:func:`now_ns` takes it off: every stamp is then on rank 0's timeline, to
within that exchange's error bound, and per-layer latencies stay meaningful
when the generator, the host and the client run on different machines.
"""

from __future__ import annotations

import time

__all__ = ["now_ns", "offset_ns", "set_offset_ns"]

#: This process's monotonic clock minus rank 0's, in integer nanoseconds (set by
#: `semfab run` once the clock exchange is done; 0 on one host).
_offset = 0


def set_offset_ns(offset: int) -> None:
    """This process's clock minus the reference clock, in nanoseconds."""
    global _offset
    _offset = int(offset)


def offset_ns() -> int:
    """The offset :func:`now_ns` takes off (0 on one host)."""
    return _offset


def now_ns() -> int:
    """Now on the run's reference clock (this host's CLOCK_MONOTONIC on one host)."""
    return time.perf_counter_ns() - _offset
