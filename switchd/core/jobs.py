"""In-network jobs at a switch: registration, the tree's agreement, release.

A job (``job`` control message: members, dtype, op, slots) is granted slots
by the aggregation engine, within its tenant's quota, or refused with a
reason (the members then fall back to a host path and say so). In a tree, a
switch grants its part (its attached members and child switches) and asks its
parent for the rest; it answers its members once the parent did. Only a
member, or a child switch, releases a job. The life of a job is one
transition table, :data:`JOB_TRANSITIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import FrameError, NackCode
from fabric.core.memory import AccessError
from switchd.core.context import SwitchContext
from switchd.core.engine import AggregationEngine
from switchd.core.events import AggOp, Granted, JobSpec
from switchd.core.regions import Regions
from switchd.core.service import Service
from switchd.core.tenants import TenantLedger

__all__ = ["JOB_TRANSITIONS", "JobPhase", "JobTable", "Jobs"]


class JobPhase(Enum):
    """A job's life at one switch."""

    WAITING_PARENT = "waiting for parent"
    GRANTED = "granted"
    REFUSED = "refused"
    RELEASED = "released"


#: The job lifecycle, one table: (phase or None for a new job, event) -> phase.
JOB_TRANSITIONS: dict[tuple[JobPhase | None, str], JobPhase] = {
    (None, "grant"): JobPhase.GRANTED,  # a root (or single) switch granted it
    (None, "ask_parent"): JobPhase.WAITING_PARENT,  # granted here, parent must agree
    (None, "refuse"): JobPhase.REFUSED,
    (JobPhase.WAITING_PARENT, "parent_grant"): JobPhase.GRANTED,
    (JobPhase.WAITING_PARENT, "parent_refuse"): JobPhase.REFUSED,
    (JobPhase.WAITING_PARENT, "release"): JobPhase.RELEASED,
    (JobPhase.GRANTED, "release"): JobPhase.RELEASED,
    (JobPhase.REFUSED, "release"): JobPhase.RELEASED,
    (JobPhase.RELEASED, "grant"): JobPhase.GRANTED,  # the id is registered anew
    (JobPhase.RELEASED, "ask_parent"): JobPhase.WAITING_PARENT,
    (JobPhase.RELEASED, "refuse"): JobPhase.REFUSED,
    (JobPhase.REFUSED, "grant"): JobPhase.GRANTED,  # a retry once memory is free
    (JobPhase.REFUSED, "ask_parent"): JobPhase.WAITING_PARENT,
    (JobPhase.REFUSED, "refuse"): JobPhase.REFUSED,
    (JobPhase.GRANTED, "grant"): JobPhase.GRANTED,  # idempotent re-registration
    (JobPhase.WAITING_PARENT, "ask_parent"): JobPhase.WAITING_PARENT,
}


class JobTable:
    """The jobs a switch knows, shared by the job and aggregation services."""

    def __init__(self) -> None:
        #: this switch's part of each granted job (its members: attached workers
        #: and child switches)
        self.specs: dict[int, JobSpec] = {}
        self.phase: dict[int, JobPhase] = {}
        #: every member of each job, whole tree
        self.members: dict[int, frozenset[int]] = {}
        #: the parent switch a job's partials go up to
        self.parent: dict[int, int] = {}
        #: jobs whose chunk results go to one owner (reduce, reduce_scatter): the
        #: others get a header-only completion
        self.owned: set[int] = set()
        #: which creation of its group a job belongs to: a late release from a closed
        #: group must not free the same job id registered anew by a newer group
        self.tag: dict[int, int] = {}
        #: the newest chunk completed of each job (chunk numbers run job-wide; a
        #: frame's 32-bit PSN is unwrapped near it)
        self.last: dict[int, int] = {}

    def transition(self, job: int, event: str) -> JobPhase:
        """Move ``job`` by ``event`` (JOB_TRANSITIONS); INVALID if it may not."""
        new = JOB_TRANSITIONS.get((self.phase.get(job), event))
        if new is None:
            raise FrameError(NackCode.INVALID,
                             f"job {job}: cannot {event} while {self.phase.get(job)}")
        self.phase[job] = new
        return new


class Jobs(Service):
    """``job``, ``job_reply`` (from the parent) and ``release`` control messages."""

    name: ClassVar[str] = "jobs"
    ctrl_types: ClassVar[tuple[str, ...]] = ("job", "job_reply", "release")

    def __init__(self, ctx: SwitchContext, table: JobTable, engine: AggregationEngine,
                 regions: Regions, tenants: TenantLedger,
                 forget: Callable[[int], None]) -> None:
        super().__init__(ctx)
        self.table = table
        self.engine = engine
        self.regions = regions
        self.tenants = tenants
        self._forget = forget  # the data path's state of a released job
        #: per job waiting for the parent's grant: who asked, by node
        self._up_pending: dict[int, dict[int, bytes]] = {}

    def on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        t = msg["t"]
        if t == "job":
            self._register(f, port, msg)
        elif t == "job_reply":
            self._on_reply(f, msg)
        else:
            tag = msg.get("tag")
            self._release(f, port, control.need(msg, "job", int),
                          tag if isinstance(tag, int) else None)

    def _refuse(self, f: fr.Frame, port: bytes, job: int, reason: str) -> None:
        self.ctx.counters.jobs_refused += 1
        self.table.transition(job, "refuse")
        self.ctx.ctrl(port, f.src, "job_reply", job=job, granted=False, reason=reason)

    def _register(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        ctx, table = self.ctx, self.table
        try:
            members = control.need(msg, "members", list)
            spec = JobSpec(
                job=control.need(msg, "job", int),
                members=tuple(members),
                dtype=control.need(msg, "dtype", str),
                op=AggOp(control.need(msg, "op", str)),
                slots=control.need(msg, "slots", int),
                slot_elems=control.need(msg, "slot_elems", int),
                referenced=bool(msg.get("referenced", False)),
            )
            deliver = str(msg.get("deliver", "all"))
            if deliver not in ("all", "owner"):
                raise ValueError(f"deliver must be 'all' or 'owner', not {deliver!r}")
            if deliver == "owner" and spec.referenced:
                raise ValueError("owner delivery is a frame-plane mode")
        except ValueError as exc:
            raise FrameError(NackCode.INVALID, f"bad job spec: {exc}") from None
        if any(not isinstance(m, int) or m not in ctx.worker_ids for m in spec.members):
            raise FrameError(NackCode.INVALID, f"job {spec.job}: members must be worker ids")
        from_child = port in ctx.switch_ports
        if not from_child and f.src not in spec.members:
            raise AccessError(NackCode.PERMISSION,
                              f"node {f.src} is not a member of job {spec.job}")
        known = table.members.get(spec.job)
        if known is not None and known != frozenset(spec.members) \
                and table.phase.get(spec.job) is not JobPhase.RELEASED:
            raise AccessError(NackCode.PERMISSION,
                              f"job {spec.job} is registered with other members")
        # Tree aggregation: this switch sums its attached members and the partial
        # sums of its child switches; with members outside its subtree it sends
        # its own partial up to its parent and passes the parent's result down.
        local = [m for m in spec.members if m in ctx.attached_ids]
        children = [c for c, below in ctx.child_below.items()
                    if any(m in below for m in spec.members)]
        outside = [m for m in spec.members if m not in ctx.below]
        parent = ctx.parent_name if outside else None
        if (spec.referenced and (children or outside)) or (outside and parent is None):
            why = ("the memory plane aggregates on one switch" if spec.referenced
                   else f"members {outside[:8]} are not below {ctx.name}")
            self._refuse(f, port, spec.job, f"{why}; run it on a single-switch fabric")
            return
        memory = self.regions.memory
        if spec.referenced and memory is None:
            self._refuse(f, port, spec.job, f"switch {ctx.name} has no memory plane")
            return
        if spec.referenced:
            assert memory is not None
            try:
                memory.prepare(str(msg.get("backend", "numba-cpu")))
            except ValueError as exc:
                self._refuse(f, port, spec.job, str(exc))
                return
        mine = JobSpec(spec.job, tuple(local + children), spec.dtype, spec.op, spec.slots,
                       spec.slot_elems, spec.referenced)
        over = self.tenants.over_quota(mine, spec.members)
        if over is not None:
            self._refuse(f, port, spec.job, over)
            return
        reply = self.engine.register(mine)
        if not isinstance(reply, Granted):
            self._refuse(f, port, spec.job, reply.reason)
            return
        self.tenants.charge(mine, spec.members)
        table.specs[spec.job] = mine
        table.members[spec.job] = frozenset(spec.members)
        tag = msg.get("tag", 0)
        table.tag[spec.job] = tag if isinstance(tag, int) else 0
        if deliver == "owner":
            table.owned.add(spec.job)
        else:
            table.owned.discard(spec.job)
        table.last.setdefault(spec.job, 0)
        if parent is None:
            table.transition(spec.job, "grant")
            ctx.ctrl(port, f.src, "job_reply", job=spec.job, granted=True, reason="")
            return
        # answer once the parent granted its part of the tree
        parent_id = ctx.topo.node(parent).id
        table.parent[spec.job] = parent_id
        if table.phase.get(spec.job) is JobPhase.GRANTED:
            ctx.ctrl(port, f.src, "job_reply", job=spec.job, granted=True, reason="")
            return
        table.transition(spec.job, "ask_parent")
        waiting = self._up_pending.setdefault(spec.job, {})
        # ask the parent on every (re)try of a member: our request or its answer may
        # have been lost, and the parent answers a repeated request again
        fields = {k: v for k, v in msg.items() if k != "t"}
        ctx.ctrl(ctx.next_hop[parent_id], parent_id, "job", **fields)
        waiting[f.src] = port

    def _on_reply(self, f: fr.Frame, msg: dict[str, Any]) -> None:
        """The parent answered our part of a tree job: answer whoever waited."""
        ctx, table = self.ctx, self.table
        job = control.need(msg, "job", int)
        if table.parent.get(job) != f.src or job not in self._up_pending:
            ctx.counters.unauthorised += 1  # only our parent answers, once
            return
        granted = bool(msg.get("granted"))
        reason = str(msg.get("reason", ""))
        if granted:
            table.transition(job, "parent_grant")
        else:
            table.transition(job, "parent_refuse")
            self.engine.release(job)
            self.tenants.uncharge(job)
            table.specs.pop(job, None)
            table.parent.pop(job, None)
            reason = f"parent switch refused: {reason}"
        for src, who in self._up_pending.pop(job, {}).items():
            ctx.ctrl(who, src, "job_reply", job=job, granted=granted, reason=reason)

    def _release(self, f: fr.Frame, port: bytes, job: int, tag: int | None) -> None:
        """A member (or our child switch) is done with ``job``: free its slots."""
        ctx, table = self.ctx, self.table
        members = table.members.get(job)
        if members is None or table.phase.get(job) is JobPhase.RELEASED \
                or (tag is not None and tag != table.tag.get(job, 0)):
            ctx.ctrl(port, f.src, "release_reply", job=job)  # idempotent
            return
        if f.src not in members and port not in ctx.switch_ports:
            raise AccessError(NackCode.PERMISSION, f"node {f.src} is not a member of job {job}")
        table.transition(job, "release")
        self.engine.release(job)
        self.tenants.uncharge(job)
        table.specs.pop(job, None)
        table.owned.discard(job)
        self._forget(job)
        self._up_pending.pop(job, None)
        parent = table.parent.pop(job, None)
        if parent is not None:  # the rest of the tree frees its part too
            ctx.ctrl(ctx.next_hop[parent], parent, "release", job=job,
                     tag=table.tag.get(job, 0))
        ctx.ctrl(port, f.src, "release_reply", job=job)
