"""In-network multicast: groups of workers, and frames replicated to them.

A frame with Flag.MCAST names a group id as ``dst``; each switch sends one
copy to every port that leads to a member on its side (never back where it
came from), so every member gets one copy and the sender none. Group 0 is
every worker. The tree root hands out the other ids for (members, nth
creation), each with a random *incarnation* id that the members carry in
what they send to group state (barriers, the host-staged aggregator): a peer
outside the group cannot guess it, and a group made again with the same
members gets a new one, so nothing of an earlier incarnation is inherited. A
switch below the root asks its parent and learns both as the answer passes
down. Each tenant holds at most its quota of group ids (topology
``[tenants.<name>] groups``; without one, an even share when the fabric has
several tenants), so no tenant can take every id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Flag, FrameError, NackCode
from fabric.core.memory import AccessError
from switchd.core.context import SwitchContext
from switchd.core.service import Service

__all__ = ["MAX_GROUPS", "Multicast", "MulticastStats"]

#: Multicast group ids the tree root hands out (0 is every worker, built in). A
#: group's jobs take ids ``gid << GROUP_JOB_BITS | n`` (fabric.core.programs.Group).
MAX_GROUPS: Final = 255
#: Groups that failed as they were made, remembered to answer members' retries.
FAILED_KEPT: Final = 1024

GroupKey = tuple[tuple[int, ...], int]


@dataclass(frozen=True)
class MulticastStats:
    """Groups known at this switch (group 0, every worker, included), groups each
    tenant holds (counted at the tree root) and creations refused there."""

    groups: int
    by_tenant: dict[str, int]
    refused: int


class Multicast(Service):
    """Flag.MCAST frames, and the ``group`` / ``group_release`` control messages."""

    name: ClassVar[str] = "multicast"
    flag: ClassVar[Flag] = Flag.MCAST
    ctrl_types: ClassVar[tuple[str, ...]] = ("group", "group_reply", "group_release")

    def __init__(self, ctx: SwitchContext) -> None:
        super().__init__(ctx)
        #: gid -> member ids, in id order
        self.groups: dict[int, tuple[int, ...]] = {
            0: tuple(sorted(w.id for w in ctx.topo.workers))}
        #: gid -> its incarnation id (0 for group 0, which lives as long as the fabric)
        self.incarnations: dict[int, int] = {0: 0}
        #: called with a gid when its group is released (its state is wiped)
        self.on_release: list[Callable[[int], None]] = []
        #: called with (gid, incarnation, why) when a group fails as it is made (its
        #: members disagree on the rank order): whoever waits on it is told why
        self.on_fail: list[Callable[[int, int, str], None]] = []
        # the rank order of each group, as its first member gave it; groups that
        # failed as they were made, and why (a retry gets the same answer)
        self._order: dict[GroupKey, tuple[int, ...]] = {}
        self._failed: OrderedDict[GroupKey, str] = OrderedDict()
        self._ids: dict[GroupKey, int] = {}
        self._wait: dict[GroupKey, dict[int, bytes]] = {}
        self._tenant_groups: dict[str, int] = {}
        self._refused = 0
        topo = ctx.topo
        tenants = {topo.tenant_of(w.id) for w in topo.workers}
        self._even_share = MAX_GROUPS // max(len(tenants), 1)

    def claims(self, f: fr.Frame, port: bytes, speaker: int | None) -> bool:
        return True

    def handle(self, f: fr.Frame, port: bytes, header: Any, payload: Any, now: float) -> None:
        """Replicate to every port that leads to a member, except the one it came on."""
        ctx, c = self.ctx, self.ctx.counters
        members = self.groups.get(f.dst)
        if members is None:
            c.unroutable += 1
            ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.UNKNOWN_JOB,
                     f"no multicast group {f.dst}")
            return
        if f.src not in members:
            c.unauthorised += 1
            ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.PERMISSION,
                     f"node {f.src} is not in multicast group {f.dst}")
            return
        c.mcast_frames += 1
        ports: list[bytes] = []
        # a member mask: bit i is member (32 x offset + i) by id, offset naming a block
        # of 32 (groups of any size); 0: every member
        mask = f.key
        chosen: Sequence[int] = members
        if mask:
            picked: list[int] = []
            base = f.offset * fr.MASK_BITS
            for i in range(fr.MASK_BITS):
                if mask >> i & 1 and base + i < len(members):
                    picked.append(members[base + i])
            chosen = picked
        for m in chosen:
            out = ctx.next_hop.get(m)
            if m != f.src and out is not None and out != port and out not in ports:
                ports.append(out)
        head = bytes(header)
        for out in ports:  # one header, one payload buffer: zero-copy replicas
            ctx.send(out, head, payload)
        c.mcast_copies += len(ports)
        c.forwarded += len(ports)

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        t = msg["t"]
        if t == "group":
            self._on_group(f, port, msg)
        elif t == "group_reply":
            self._on_reply(f, msg)
        else:
            self._on_release(f, port, msg)

    def statistics(self) -> MulticastStats:
        return MulticastStats(groups=len(self.groups), by_tenant=dict(self._tenant_groups),
                              refused=self._refused)

    def _key(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> GroupKey:
        members = control.need(msg, "members", list)
        nth = control.need(msg, "nth", int)
        workers = self.ctx.worker_ids
        if not members or any(not isinstance(m, int) or m not in workers for m in members) \
                or len(set(members)) != len(members) or nth < 0:
            raise FrameError(NackCode.INVALID, "group members must be distinct worker ids")
        if port not in self.ctx.switch_ports and f.src not in members:
            raise AccessError(NackCode.PERMISSION, f"node {f.src} is not in the group it names")
        return tuple(sorted(members)), nth

    def _on_group(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        """A member creates a multicast group (idempotent): the tree root allocates its
        id for (members, nth); other switches ask their parent and learn the answer."""
        ctx = self.ctx
        key = self._key(f, port, msg)
        order = self._order_of(msg, key)
        known = self._order.setdefault(key, order) if order is not None else None
        gid = self._ids.get(key)
        failed = self._failed.get(key)
        if failed is not None:
            ctx.ctrl(port, f.src, "group_reply", members=list(key[0]), nth=key[1], gid=-1,
                     reason=failed)
            return
        if known is not None and known != order:
            # members gave the ranks in different orders: their group ranks would
            # disagree, so the group fails for every member, naming both orders
            conflict = (f"members passed the ranks of group {list(key[0])} in different "
                        f"orders (node ids {list(known)} and {list(order or ())}); every "
                        "member must pass the same ranks in the same order")
            if ctx.parent_name is not None:
                gid = None  # the root decides (and tells whoever waits there)
            else:
                self._fail(key, conflict)
                self._refused += 1
                ctx.ctrl(port, f.src, "group_reply", members=list(key[0]), nth=key[1],
                         gid=-1, reason=conflict)
                return
        elif gid is None and ctx.parent_name is None:
            tenant, why = self._over_quota(key[0])
            used = set(self.groups)
            gid = next((g for g in range(1, MAX_GROUPS + 1) if g not in used), None)
            if gid is None:
                why = (f"all {MAX_GROUPS} multicast groups are in use; "
                       "close communicators you no longer need")
            if why is not None or gid is None:
                self._refused += 1
                ctx.ctrl(port, f.src, "group_reply", members=list(key[0]), nth=key[1],
                         gid=-1, reason=why)
                return
            self._ids[key] = gid
            self.groups[gid] = key[0]
            self.incarnations[gid] = ctx.incarnation()
            self._tenant_groups[tenant] = self._tenant_groups.get(tenant, 0) + 1
        if gid is not None:
            ctx.ctrl(port, f.src, "group_reply", members=list(key[0]), nth=key[1], gid=gid,
                     inc=self.incarnations[gid], reason="")
            return
        # ask the parent on every retry (our request or its answer may be lost)
        self._wait.setdefault(key, {})[f.src] = port
        parent = ctx.parent_id()
        extra = {} if order is None else {"order": list(order)}
        ctx.ctrl(ctx.next_hop[parent], parent, "group", members=list(key[0]), nth=key[1],
                 **extra)

    @staticmethod
    def _order_of(msg: dict[str, Any], key: GroupKey) -> tuple[int, ...] | None:
        """The rank order a request gives (node ids, group rank 0 first), if any."""
        order = msg.get("order")
        if order is None:
            return None
        if not isinstance(order, list) or sorted(o for o in order if isinstance(o, int)) \
                != list(key[0]) or len(order) != len(key[0]):
            raise FrameError(NackCode.INVALID, "a group's order must list its members once")
        return tuple(order)

    def _fail(self, key: GroupKey, why: str) -> None:
        """Group ``key`` cannot be: free its id, tell whoever waits on it."""
        self._failed[key] = why
        while len(self._failed) > FAILED_KEPT:
            self._failed.popitem(last=False)
        gid = self._ids.pop(key, None)
        if gid is None or self.groups.get(gid) != key[0]:
            return
        inc = self.incarnations.pop(gid, 0)
        del self.groups[gid]
        tenant = self.ctx.topo.tenant_of(key[0][0])
        self._tenant_groups[tenant] = self._tenant_groups.get(tenant, 1) - 1
        for tell in self.on_fail:  # first: the waiters learn why, then their state goes
            tell(gid, inc, why)
        for wipe in self.on_release:
            wipe(gid)

    def _over_quota(self, members: tuple[int, ...]) -> tuple[str, str | None]:
        """The members' tenant, and why it may not make one more group here (or None)."""
        topo = self.ctx.topo
        tenants = sorted({topo.tenant_of(m) for m in members})
        if len(tenants) > 1:
            return tenants[0], f"a group's members must share one tenant, not {', '.join(tenants)}"
        tenant = tenants[0]
        quota = topo.tenants.get(tenant)
        limit = quota.groups if quota is not None and quota.groups is not None \
            else self._even_share
        held = self._tenant_groups.get(tenant, 0)
        if held >= limit:
            return tenant, (f"tenant {tenant!r} holds {held} groups, its quota of {limit} "
                            "(topology [tenants] groups); close communicators it no longer needs")
        return tenant, None

    def _on_reply(self, f: fr.Frame, msg: dict[str, Any]) -> None:
        ctx = self.ctx
        if ctx.parent_name is None or f.src != ctx.parent_id():
            ctx.counters.unauthorised += 1  # only our parent allocates for us
            return
        key = (tuple(sorted(control.need(msg, "members", list))), control.need(msg, "nth", int))
        gid = control.need(msg, "gid", int)
        inc = msg.get("inc", 0)
        if gid <= 0:
            self._order.pop(key, None)  # refused: a retry may give another order
        if 0 < gid <= MAX_GROUPS:
            self._ids[key] = gid
            self.groups[gid] = key[0]
            self.incarnations[gid] = inc if isinstance(inc, int) else 0
        for src, who in self._wait.pop(key, {}).items():
            ctx.ctrl(who, src, "group_reply", members=list(key[0]), nth=key[1], gid=gid,
                     inc=inc, reason=str(msg.get("reason", "")))

    def _on_release(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        """A member closed its communicator: forget the group (idempotent; a release
        naming an older group with the same id is ignored)."""
        ctx = self.ctx
        key = self._key(f, port, msg)
        gid = self._ids.pop(key, None)
        self._order.pop(key, None)
        if gid is not None and self.groups.get(gid) == key[0]:
            del self.groups[gid]
            self.incarnations.pop(gid, None)
            if ctx.parent_name is None:
                tenant = ctx.topo.tenant_of(key[0][0])
                self._tenant_groups[tenant] = self._tenant_groups.get(tenant, 1) - 1
            for wipe in self.on_release:
                wipe(gid)
        if ctx.parent_name is not None and gid is not None:
            parent = ctx.parent_id()
            ctx.ctrl(ctx.next_hop[parent], parent, "group_release", members=list(key[0]),
                     nth=key[1])
        if port not in ctx.switch_ports:
            ctx.ctrl(port, f.src, "group_released", members=list(key[0]), nth=key[1])
