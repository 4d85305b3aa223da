"""``eqds``: receiver-driven credit, in the spirit of EQDS and UET's RCCC.

EQDS (Olteanu et al., "An edge-queued datagram service for all datacenter
traffic", NSDI 2022) moves the queue from the network to the sender's edge: a
sender sends its first BDP unsolicited, then only what the receiver grants.
The receiver's :class:`CreditPacer` hands out credit one MTU at a time,
round robin over the flows that still want bytes, paced at the rate of its own
link, so the last hop never holds more than the first BDP of each flow. A
trimmed frame's header tells the receiver what to grant again.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from fabric.core.congestion.config import CongestionConfigError
from fabric.core.congestion.policy import CcPath, CongestionControl, register_cc

__all__ = ["CreditPacer", "Eqds", "unsolicited_bytes"]

#: Bytes a flow sends before its first credit, in BDPs.
UNSOLICITED_BDP = 1.0
#: Credits are paced at this fraction of the receiver's link rate (a little
#: under, so the unsolicited bytes drain).
CREDIT_RATE_FRACTION = 0.98


def unsolicited_bytes(path: CcPath) -> int:
    """What a flow on ``path`` sends before its first credit: UNSOLICITED_BDP of the
    path, at least one frame. Its receiver grants the rest of what the flow sends
    (both ends work it out from the same path)."""
    return max(int(UNSOLICITED_BDP * path.bdp), path.mtu)


class Eqds(CongestionControl):
    """The sender: unsolicited first BDP, then credit only."""

    name = "eqds"
    receiver_driven = True

    def __init__(self, path: CcPath, now: float = 0.0) -> None:
        super().__init__(path, now)
        self.credit = unsolicited_bytes(path)
        self.unsolicited = self.credit
        self.granted = 0

    def on_credit(self, nbytes: int, now: float) -> None:
        self.credit += nbytes
        self.granted += nbytes

    def on_timeout(self, nbytes: int, now: float) -> None:
        # the frame vanished whole: the receiver never saw it, so it will not grant
        # it again; the credit it used is the sender's to reuse
        self.credit += nbytes

    def statistics(self) -> dict[str, Any]:
        return {"credit": self.credit, "granted": self.granted,
                "unsolicited": self.unsolicited}


class CreditPacer:
    """The receiver: grants credit to flows with demand, round robin, at its link rate."""

    def __init__(self, link_gbps: float, mtu: int) -> None:
        if not link_gbps > 0:
            raise CongestionConfigError(f"credit pacer: link rate {link_gbps!r} Gb/s must be "
                                        "positive")
        self.mtu = mtu
        self.interval = mtu * 8 / (link_gbps * 1e9 * CREDIT_RATE_FRACTION)
        self._demand: dict[int, int] = {}
        self._ring: deque[int] = deque()
        self._next: float | None = None
        self._free_at = 0.0  # when the last grant's bytes will have come in
        self.granted = 0

    def request(self, flow: int, nbytes: int, now: float) -> None:
        """``flow`` wants ``nbytes`` more than it was granted (its backlog, or a
        trimmed frame to resend)."""
        if nbytes <= 0:
            return
        had = self._demand.get(flow, 0)
        self._demand[flow] = had + nbytes
        if had == 0:
            self._ring.append(flow)
        if self._next is None:
            self._next = max(now, self._free_at)

    def forget(self, flow: int) -> None:
        """``flow`` needs no more credit (its receiver has every byte)."""
        if self._demand.pop(flow, None) is not None:
            self._ring.remove(flow)
            if not self._ring:
                self._next = None

    def demand(self, flow: int) -> int:
        """Bytes ``flow`` still waits to be granted."""
        return self._demand.get(flow, 0)

    def get_timer(self) -> float | None:
        """When the next credit goes out, or None (nobody wants any)."""
        return self._next

    def handle_timer(self, now: float) -> list[tuple[int, int]]:
        """Grant one credit: ``[(flow, bytes)]``, or nothing when it is not time."""
        if self._next is None or now < self._next:
            return []
        if not self._ring:
            self._next = None
            return []
        flow = self._ring.popleft()
        want = self._demand[flow]
        grant = min(want, self.mtu)
        if want > grant:
            self._demand[flow] = want - grant
            self._ring.append(flow)
        else:
            del self._demand[flow]
        self.granted += grant
        # a grant that went late (a driver that woke late) takes up to one interval
        # back from the next, so lateness does not add up to a slower link
        start = max(self._next, now - self.interval)
        self._free_at = start + self.interval * grant / self.mtu
        self._next = self._free_at if self._ring else None
        return [(flow, grant)]


register_cc("eqds", Eqds)
