"""Barriers in the switch: the ``barrier`` control message.

Idempotent: a resent arrival counts once, and a finished barrier answers
again (the answer may have been lost). A communicator's barrier (its id's
high bits name the multicast group) counts that group's members only, and
only for the group's current incarnation (the ``inc`` the members got when
they made it): a barrier naming a group that does not exist, or an earlier
incarnation of it, is refused (PERMISSION) unless it finished already (a
late retry is answered again). Releasing a group wipes its waiting barriers;
a group that failed as it was made (its members disagreed on the rank order)
answers its barriers with the reason (``error``), so every member raises it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import FrameError, NackCode
from fabric.core.memory import AccessError
from switchd.core.context import SwitchContext
from switchd.core.multicast import Multicast
from switchd.core.service import Service

__all__ = ["BARRIERS_KEPT", "BarrierStats", "Barriers"]

#: Finished barrier ids kept to answer late retries of the barrier.
BARRIERS_KEPT: Final = 1024


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
        self._waiting: dict[tuple[int, int], dict[int, bytes]] = {}
        # the last BARRIERS_KEPT barriers done, oldest first: looked up on every
        # arrival, so a dict (a deque's `in` compared up to 1024 keys each time)
        self._done: OrderedDict[tuple[int, int], None] = OrderedDict()
        # groups that failed as they were made: (gid, incarnation) -> why
        self._failed: OrderedDict[tuple[int, int], str] = OrderedDict()
        multicast.on_release.append(self._wipe)
        multicast.on_fail.append(self._fail)

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        ctx = self.ctx
        bid = control.need(msg, "id", int)
        n = control.need(msg, "n", int)
        if not 1 <= n <= len(ctx.topo.nodes):
            raise FrameError(NackCode.INVALID, f"barrier of {n} nodes")
        inc = msg.get("inc", 0)
        key = (bid, inc if isinstance(inc, int) else -1)
        if key in self._done:
            ctx.ctrl(port, f.src, "barrier_done", id=bid)
            return
        gid = bid >> 32
        why = self._failed.get((gid, key[1])) if gid else None
        if why is not None:
            ctx.ctrl(port, f.src, "barrier_done", id=bid, error=why)
            return
        if gid:
            group = self._multicast.groups.get(gid)
            if group is None or self._multicast.incarnations.get(gid) != key[1]:
                ctx.counters.unauthorised += 1
                raise AccessError(NackCode.PERMISSION, f"barrier {bid:#x}: no group {gid} of "
                                  "that incarnation here (closed, or not the sender's)")
            if f.src not in group:
                # a communicator's barrier counts its members only (no other tenant's)
                ctx.counters.unauthorised += 1
                raise AccessError(NackCode.PERMISSION,
                                  f"node {f.src} is not in group {gid} of barrier {bid:#x}")
            n = len(group)
        waiting = self._waiting.setdefault(key, {})
        waiting[f.src] = port  # by node: several may arrive over one switch link
        if len(waiting) >= n:
            for src, who in self._waiting.pop(key).items():
                ctx.ctrl(who, src, "barrier_done", id=bid)
            self._done[key] = None
            if len(self._done) > BARRIERS_KEPT:
                self._done.popitem(last=False)

    def _wipe(self, gid: int) -> None:
        """Group ``gid`` was released: its waiting barriers end with it."""
        for key in [k for k in self._waiting if k[0] >> 32 == gid]:
            del self._waiting[key]

    def _fail(self, gid: int, inc: int, why: str) -> None:
        """Group ``gid`` failed as it was made: whoever waits, or comes, learns why."""
        self._failed[(gid, inc)] = why
        while len(self._failed) > BARRIERS_KEPT:
            self._failed.popitem(last=False)
        for key in [k for k in self._waiting if k[1] == inc and k[0] >> 32 == gid]:
            for src, who in self._waiting.pop(key).items():
                self.ctx.ctrl(who, src, "barrier_done", id=key[0], error=why)

    def statistics(self) -> BarrierStats:
        return BarrierStats(waiting=len(self._waiting), done_kept=len(self._done))
