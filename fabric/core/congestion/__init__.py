"""Queues and congestion: the pure mechanisms, one module each.

* :mod:`.buffer` — a switch's shared buffer: dynamic thresholds, tail drop, trimming;
* :mod:`.ecn` — RED-style ECN marking;
* :mod:`.pfc` — priority flow control: XOFF/XON, headroom, pause time, watchdog,
  deadlock (a cycle of paused ports);
* :mod:`.policy` — sender congestion control as pluggable policies, by name:
  ``none`` (here), ``dcqcn`` (:mod:`.dcqcn`), ``nscc`` (:mod:`.nscc`), ``eqds``
  (:mod:`.eqds`), ``dctcp`` (:mod:`.dctcp`);
* :mod:`.credit` — credit-based link flow control (the scale-up way);
* :mod:`.gate` — one flow's policy as a sender drives it (window, pacer, echoes);
* :mod:`.switchq` — each switch's buffer and ECN marker from a topology's
  ``[congestion]`` table (:mod:`.settings`), for the link pipelines of both worlds;
  :mod:`.timed` — a buffer whose frames leave at computed times;
* :mod:`.config` — the named constants with their sources, and the settings' error.

Like the rest of ``fabric.core``, nothing here reads a clock or does I/O.
"""

from fabric.core.congestion import dcqcn, dctcp, eqds, nscc  # noqa: F401  (register the built-ins)
from fabric.core.congestion.buffer import Admission, BufferStats, SharedBuffer
from fabric.core.congestion.config import CongestionConfigError
from fabric.core.congestion.ecn import RedMarker
from fabric.core.congestion.pfc import PauseState, PfcEvent, PfcIngress, find_pause_cycle
from fabric.core.congestion.policy import (
    CC_POLICIES,
    CcPath,
    CongestionControl,
    get_cc,
    make_cc,
    register_cc,
)

__all__ = [
    "Admission",
    "BufferStats",
    "CC_POLICIES",
    "CcPath",
    "CongestionConfigError",
    "CongestionControl",
    "PauseState",
    "PfcEvent",
    "PfcIngress",
    "RedMarker",
    "SharedBuffer",
    "find_pause_cycle",
    "get_cc",
    "make_cc",
    "register_cc",
]
