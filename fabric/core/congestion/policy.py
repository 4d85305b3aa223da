"""Sender congestion control as pluggable policies, registered by name.

The way :mod:`fabric.core.reliability` takes retransmit policies, a sender takes
a :class:`CongestionControl`: the transport tells it what happened (ACKs with
their ECN echo and RTT, NACKs of trimmed or lost frames, timeouts, CNPs,
credits) and asks it what it may do (:meth:`~CongestionControl.can_send`, the
pacing rate). One instance serves one flow; it may keep any state. Built-ins:
``none`` (a fixed window, for comparison), ``dcqcn``, ``nscc``, ``eqds``; add
your own with :func:`register_cc` and ``--cc NAME``.

Pure: every method that depends on time takes ``now``; timers are absolute
deadlines from :meth:`~CongestionControl.get_timer`, fired by the driver with
:meth:`~CongestionControl.handle_timer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from fabric.core.congestion.config import CongestionConfigError, bdp_bytes

__all__ = ["CcPath", "CongestionControl", "FixedWindow", "CC_POLICIES", "register_cc",
           "get_cc", "make_cc"]

#: The window of ``none``, in BDPs: htsim's largest NSCC window (1.5 BDP), held fixed.
FIXED_WINDOW_BDP = 1.5


@dataclass(frozen=True)
class CcPath:
    """What a policy knows of its path when the flow starts."""

    link_gbps: float  # the sender's line rate
    base_rtt_s: float  # unloaded round trip of one MTU frame and its ACK
    mtu: int  # bytes of a full frame on the wire
    trimming: bool = False  # the fabric trims rather than drops

    @property
    def bdp(self) -> int:
        """Bytes in flight at line rate over one base RTT."""
        return bdp_bytes(self.link_gbps, self.base_rtt_s)

    @property
    def line_rate_bps(self) -> float:
        return self.link_gbps * 1e9


@mypyc_attr(allow_interpreted_subclasses=True)  # users write their own policies
class CongestionControl:
    """How much one flow may send, and how fast.

    ``cwnd`` caps the bytes in flight (``inf``: no window); ``rate_bps`` paces
    frames (the line rate: no pacing). A receiver-driven policy
    (``receiver_driven``) sends only what it was granted (:meth:`on_credit`);
    a policy with ``wants_cnp`` gets congestion notification packets from the
    receiver instead of per-ACK ECN echoes.
    """

    name: ClassVar[str] = ""
    receiver_driven: ClassVar[bool] = False
    wants_cnp: ClassVar[bool] = False

    def __init__(self, path: CcPath, now: float = 0.0) -> None:
        self.path = path
        self.cwnd: float = math.inf
        self.rate_bps: float = path.line_rate_bps
        self.credit = 0  # receiver-driven: bytes granted and not yet used

    def can_send(self, inflight: int, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` may leave with ``inflight`` unacknowledged.

        One frame may always be in flight, whatever the window, so a flow never stalls."""
        if self.receiver_driven and self.credit < nbytes:
            return False
        return inflight == 0 or inflight + nbytes <= self.cwnd

    def on_send(self, nbytes: int, now: float) -> None:
        """A frame of ``nbytes`` left (credits are spent here)."""
        if self.receiver_driven:
            self.credit -= nbytes

    def on_ack(self, acked: int, ecn: bool, rtt_s: float, now: float) -> None:
        """``acked`` new bytes were acknowledged; ``ecn``: the frame carried CE; ``rtt_s``
        its round trip (send to ACK)."""

    def on_nack(self, nbytes: int, now: float) -> None:
        """A frame of ``nbytes`` was trimmed (or reported lost) and will be sent again."""

    def on_timeout(self, nbytes: int, now: float) -> None:
        """A frame of ``nbytes`` was resent after its retransmission timer expired."""
        self.on_nack(nbytes, now)

    def on_cnp(self, now: float) -> None:
        """A congestion notification packet arrived (``wants_cnp`` policies)."""

    def on_credit(self, nbytes: int, now: float) -> None:
        """The receiver granted ``nbytes`` more (``receiver_driven`` policies)."""
        self.credit += nbytes

    def get_timer(self) -> float | None:
        """The policy's next deadline, or None."""
        return None

    def handle_timer(self, now: float) -> None:
        """Its deadline came."""

    def statistics(self) -> dict[str, Any]:
        """Plain data describing the policy's state."""
        return {"cwnd": self.cwnd, "rate_bps": self.rate_bps}


class FixedWindow(CongestionControl):
    """``none``: a fixed window of 1.5 BDP at line rate; reacts to nothing (the
    baseline htsim calls constant)."""

    name = "none"

    def __init__(self, path: CcPath, now: float = 0.0) -> None:
        super().__init__(path, now)
        self.cwnd = max(FIXED_WINDOW_BDP * path.bdp, float(path.mtu))


#: Policy name -> class. Add one with :func:`register_cc`.
CC_POLICIES: dict[str, type[CongestionControl]] = {}


def register_cc(name: str, cls: type[CongestionControl], *,
                replace: bool = False) -> type[CongestionControl]:
    """Make ``cls`` available as ``--cc NAME``."""
    if not isinstance(cls, type) or not issubclass(cls, CongestionControl):
        raise TypeError(f"congestion control {name!r}: {cls!r} is not a CongestionControl")
    if not name or not name.replace("-", "_").isidentifier():
        raise ValueError(f"congestion control name {name!r} must be a word like 'nscc'")
    if name in CC_POLICIES and not replace and CC_POLICIES[name] is not cls:
        raise ValueError(f"congestion control {name!r} is already registered; pass replace=True")
    CC_POLICIES[name] = cls
    return cls


def get_cc(name: str) -> type[CongestionControl]:
    """The class registered as ``name``; a one-line error naming the valid ones."""
    cls = CC_POLICIES.get(name)
    if cls is None:
        raise CongestionConfigError(f"unknown congestion control {name!r}; choose "
                                    f"{', '.join(sorted(CC_POLICIES))}")
    return cls


def make_cc(name: str, path: CcPath, now: float = 0.0) -> CongestionControl:
    """A new instance of policy ``name`` for one flow."""
    return get_cc(name)(path, now)


register_cc("none", FixedWindow)
