"""Barriers in the switch: the ``barrier`` control message.

Idempotent: a resent arrival counts once, and a finished barrier answers
again (the answer may have been lost). A communicator's barrier (its id's
high bits name the multicast group) counts that group's members only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import FrameError, NackCode
from fabric.core.memory import AccessError
from switchd.core.context import SwitchContext
from switchd.core.multicast import Multicast
from switchd.core.service import Service

__all__ = ["BARRIERS_KEPT", "BarrierStats", "Barriers"]

#: Finished barrier ids kept to answer late retries of the barrier.
BARRIERS_KEPT = 1024


@dataclass(frozen=True)
class BarrierStats:
    """Barriers waiting here, and finished ones kept for late retries."""

    waiting: int
    done_kept: int


class Barriers(Service):
    """Counts arrivals per barrier id; answers every arrival once all are in."""

    name: ClassVar[str] = "barriers"
    ctrl_types: ClassVar[tuple[str, ...]] = ("barrier",)

    def __init__(self, ctx: SwitchContext, multicast: Multicast) -> None:
        super().__init__(ctx)
        self._multicast = multicast
        self._waiting: dict[int, dict[int, bytes]] = {}
        self._done: deque[int] = deque(maxlen=BARRIERS_KEPT)

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        ctx = self.ctx
        bid = control.need(msg, "id", int)
        n = control.need(msg, "n", int)
        if not 1 <= n <= len(ctx.topo.nodes):
            raise FrameError(NackCode.MALFORMED, f"barrier of {n} nodes")
        group = self._multicast.groups.get(bid >> 32) if bid >> 32 else None
        if group is not None and f.src not in group:
            # a communicator's barrier counts its members only (no other tenant's)
            raise AccessError(NackCode.PERMISSION,
                              f"node {f.src} is not in group {bid >> 32} of barrier {bid:#x}")
        if bid in self._done:
            ctx.ctrl(port, f.src, "barrier_done", id=bid)
            return
        waiting = self._waiting.setdefault(bid, {})
        waiting[f.src] = port  # by node: several may arrive over one switch link
        if len(waiting) >= n:
            for src, who in self._waiting.pop(bid).items():
                ctx.ctrl(who, src, "barrier_done", id=bid)
            self._done.append(bid)

    def statistics(self) -> BarrierStats:
        return BarrierStats(waiting=len(self._waiting), done_kept=len(self._done))
