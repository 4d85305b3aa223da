"""The interface of an in-network service: one job of a switch, one module.

A switch is a small forwarding core (:class:`switchd.core.switch.SwitchCore`)
and the services registered with it, as a Click router is a graph of small
elements. A service says which frames it takes (by opcode, or by a flag such
as multicast, then :meth:`Service.claims`) and which control messages it
answers; it keeps its own state, timers and statistics, and sends through the
switch's :class:`~switchd.core.context.SwitchContext`. docs/ARCHITECTURE.md
("Adding an in-network service") walks through writing one.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from fabric.core import frame as fr
from fabric.core.frame import Flag, Op
from switchd.core.context import SwitchContext

__all__ = ["Service"]


@mypyc_attr(allow_interpreted_subclasses=True)  # users add their own services
class Service:
    """One in-network function of a switch; subclass it.

    Class attributes declare what reaches it:

    * ``ops``: opcodes of frames it may take; :meth:`claims` decides per frame
      (frames to other nodes included: a service may act on passing traffic);
    * ``flag``: a frame flag that brings any opcode to it (Flag.MCAST);
    * ``ctrl_types``: control messages addressed to the switch it answers.

    Frames no service takes are forwarded by route (or, addressed to the
    switch, refused as UNSUPPORTED). Whatever a service raises while handling
    a frame is counted as malformed and NACKed: the switch goes on.
    """

    # class-level (ClassVar): compiled code then reads a subclass's own values
    #: the name its statistics appear under
    name: ClassVar[str] = "service"
    ops: ClassVar[tuple[Op, ...]] = ()
    flag: ClassVar[Flag] = Flag.NONE
    ctrl_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: SwitchContext) -> None:
        self.ctx = ctx

    def claims(self, f: fr.Frame, port: bytes, speaker: int | None) -> bool:
        """True to take frame ``f`` (``speaker``: the attached node behind
        ``port``, None for a switch port). Default: frames addressed to the switch."""
        return f.dst == self.ctx.id

    def handle(self, f: fr.Frame, port: bytes, header: Any, payload: Any, now: float) -> None:
        """Act on a frame it claimed; send through ``self.ctx``."""
        raise NotImplementedError(f"{type(self).__name__} claims frames it does not handle")

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        """Answer control message ``msg`` (its type is one of ``ctrl_types``)."""
        raise NotImplementedError(f"{type(self).__name__} declares control types it ignores")

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` next has work, or None."""
        return None

    def handle_timer(self, now: float) -> None:
        """Its timer is due: act (send through ``self.ctx``)."""

    def statistics(self) -> Any:
        """A frozen snapshot of its own state (a frozen dataclass or plain data),
        or None when it has nothing beyond the switch's counters."""
        return None
