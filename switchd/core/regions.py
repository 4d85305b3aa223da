"""The memory plane's regions and doorbells at a switch.

A worker on the switch's host registers its "device memory" as a region
(``region``: key, size and its run id); only the owner unregisters it, and
never while a chunk in progress names it. The regions are mapped by an
injected :class:`MemoryPlane` (shared memory in emulation, arrays or nothing
in simulation) by *handle*: (run, owner, key), the owner being the node the
request came from. No free path crosses the wire, so a worker can name only
memory the fabric made for it: never another node's region, never any other
file on the host. A worker may also offer a shared-memory doorbell for its
memory-plane descriptors (``doorbell``), which the driver maps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Protocol

import numpy as np

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import NackCode
from fabric.core.memory import AccessError, RegionInfo, RegionTable
from switchd.core.context import SwitchContext
from switchd.core.service import Service

__all__ = ["DOORBELL_SUFFIX", "MemoryPlane", "RegionStats", "Regions"]

#: A node's doorbell file ends in this and its node id (fabric.emulation.doorbell).
DOORBELL_SUFFIX: Final = "-bell-"


@dataclass(frozen=True)
class RegionStats:
    """Regions mapped here, and how many each tenant holds."""

    regions: int
    by_tenant: dict[str, int]


class MemoryPlane(Protocol):
    """Where memory-plane regions live, injected into the switch.

    Emulation maps shared-memory files and runs the fused kernel; simulation
    keeps arrays (or nothing, for a timing-only model).
    """

    def prepare(self, backend: str) -> None:
        """Get ready to reduce with kernel ``backend``; ValueError if it cannot."""

    def attach(self, key: int, owner: str, run: str, size: int) -> None:
        """Map region ``key`` of node ``owner`` in run ``run`` (the memory the fabric
        made for it; nothing else); raise OSError or ValueError if it cannot be."""

    def detach(self, key: int) -> None:
        """Forget region ``key`` (unknown keys are ignored)."""

    def reduce(self, dtype: np.dtype[Any], op: str, refs: list[tuple[int, int]],
               count: int) -> str | None:
        """Load ``count`` elements at each ``(key, byte offset)``, reduce, store into all;
        an integer sum that would wrap stores nothing and returns why
        (``kernels.reference.sum_wrap``)."""


class Regions(Service):
    """``region``, ``unregister`` and ``doorbell`` control messages."""

    name: ClassVar[str] = "regions"
    ctrl_types: ClassVar[tuple[str, ...]] = ("region", "unregister", "doorbell")

    def __init__(self, ctx: SwitchContext, memory: MemoryPlane | None,
                 attach_doorbell: Callable[[bytes, str], None] | None) -> None:
        super().__init__(ctx)
        self.memory = memory
        self.table = RegionTable()
        # the driver's hook that maps a worker's shared-memory doorbell for its port
        # (emulation on one host); None: every frame keeps to the sockets
        self._attach_doorbell = attach_doorbell
        #: services that may name a region in work in progress (no unregistering then)
        self.users: list[Callable[[int], bool]] = []
        # regions each tenant holds here (its quota: topology [tenants] regions)
        self._tenant_regions: dict[str, int] = {}

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        t = msg["t"]
        if t == "region":
            self._register(f, port, msg)
        elif t == "unregister":
            self._unregister(f, port, msg)
        else:
            self._on_doorbell(f, port, msg)

    def _register(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        ctx = self.ctx
        key = control.need(msg, "key", int)
        size = control.need(msg, "size", int)
        run = control.need(msg, "run", str)
        if "path" in msg:
            ctx.ctrl(port, f.src, "region_reply", key=key, ok=False,
                     reason="a region is named by its run and key, not a path: the switch "
                            "maps only memory the fabric made for the registering node")
            return
        if size <= 0:
            ctx.ctrl(port, f.src, "region_reply", key=key, ok=False,
                     reason=f"region size {size} must be positive")
            return
        if self.memory is None:
            ctx.ctrl(port, f.src, "region_reply", key=key, ok=False,
                     reason=f"switch {ctx.name} has no memory plane")
            return
        if not ctx.same_host(f.src):
            ctx.ctrl(port, f.src, "region_reply", key=key, ok=False,
                     reason=f"node {f.src} runs on another host than switch {ctx.name}: "
                            "its memory is not mappable here (the frame plane serves it)")
            return
        existed = key in self.table
        tenant = ctx.topo.tenant_of(f.src)
        quota = ctx.topo.tenants.get(tenant)
        held = self._tenant_regions.get(tenant, 0)
        if not existed and quota is not None and quota.regions is not None \
                and held >= quota.regions:
            ctx.ctrl(port, f.src, "region_reply", key=key, ok=False,
                     reason=f"tenant {tenant!r} at {ctx.name} holds {held} regions, its quota "
                            f"of {quota.regions} (topology [tenants] regions); free one first")
            return
        try:
            owner = ctx.topo.by_id(f.src).name
            self.table.add(RegionInfo(key=key, owner=f.src, size=size, path=f"{run}/{owner}"))
            self.memory.detach(key)
            self.memory.attach(key, owner, run, size)
        except (AccessError, OSError, ValueError) as exc:
            # never remove a region we did not just add (it may be another owner's)
            if not existed and key in self.table and self.table.get(key).owner == f.src:
                self.table.remove(key)
            ctx.ctrl(port, f.src, "region_reply", key=key, ok=False, reason=str(exc))
            return
        if not existed:
            self._tenant_regions[tenant] = held + 1
        ctx.ctrl(port, f.src, "region_reply", key=key, ok=True, reason="")

    def statistics(self) -> RegionStats:
        return RegionStats(regions=len(self.table), by_tenant=dict(self._tenant_regions))

    def _unregister(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        key = control.need(msg, "key", int)
        if key in self.table:
            if self.table.get(key).owner != f.src:
                raise AccessError(NackCode.PERMISSION,
                                  f"node {f.src} may not unregister region {key:#x}")
            if any(uses(key) for uses in self.users):
                raise AccessError(NackCode.PERMISSION,
                                  f"region {key:#x} is named by a chunk in progress")
            self.table.remove(key)
            tenant = self.ctx.topo.tenant_of(f.src)
            self._tenant_regions[tenant] = self._tenant_regions.get(tenant, 1) - 1
            if self.memory is not None:
                self.memory.detach(key)
        # idempotent: an unknown key is already gone
        self.ctx.ctrl(port, f.src, "region_reply", key=key, ok=True, reason="")

    def _on_doorbell(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        """A worker on our host offers a shared-memory doorbell for its descriptors."""
        ctx = self.ctx
        path = control.need(msg, "path", str)
        reason = ""
        if self._attach_doorbell is None:
            reason = f"switch {ctx.name} has no doorbells (it is not on a shared host)"
        elif port in ctx.switch_ports or ctx.port_node.get(port) != f.src:
            reason = "doorbells are for the nodes attached to this switch"
        elif not ctx.same_host(f.src):
            reason = f"node {f.src} runs on another host than switch {ctx.name}"
        elif not path.endswith(f"{DOORBELL_SUFFIX}{f.src}"):
            # a node names its own doorbell only, never another node's
            reason = f"node {f.src}'s doorbell file must end in {DOORBELL_SUFFIX}{f.src}"
        else:
            try:
                self._attach_doorbell(port, path)
            except (OSError, ValueError) as exc:
                reason = str(exc)
        ctx.ctrl(port, f.src, "doorbell_reply", ok=not reason, reason=reason)
