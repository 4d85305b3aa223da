"""SwitchCore: a switch as a sans-IO state machine, a forwarding core plus the
in-network services registered with it.

One object per switch. A driver feeds it the frames that arrived on its ports
and sends what it returns; it never touches a socket or a clock::

    outputs = core.handle(port, header, payload, now)   # [(port, header, payload)]
    deadline = core.get_timer()                          # or None
    outputs = core.handle_timer(now)
    core.statistics()                                    # frozen SwitchStats

A *port* is the identity of the link a frame arrived on (the neighbour's node
name as bytes). The port is the sender's identity: a frame from an attached
node must carry that node's id as ``src``, or it is refused (PERMISSION).

The core itself decodes, checks the sender, offers each frame to the services
(by opcode or flag), forwards what none takes by route (fewest hops; header
and payload pass through untouched), answers link-up hellos and ``stats``,
and keeps the counters. The services, one module each:

* :mod:`~switchd.core.multicast` -- groups and Flag.MCAST replication;
* :mod:`~switchd.core.combine` -- MoE combine sums per token;
* :mod:`~switchd.core.aggregation` -- in-network aggregation, tree included,
  on the engine of :mod:`~switchd.core.engine`;
* :mod:`~switchd.core.jobs` -- job registration and release, within the
  tenants' quotas (:mod:`~switchd.core.tenants`);
* :mod:`~switchd.core.regions` -- memory-plane regions and doorbells;
* :mod:`~switchd.core.barriers` -- barriers.

More are added with ``SwitchCore(..., services=[factory, ...])``. Every frame
is handled under a guard: whatever a peer sends is counted and NACKed where it
can be; the switch goes on. Two worlds drive it: ``switchd.daemon`` (ZeroMQ,
real time) and ``fabric.sim`` (a discrete-event loop in virtual time).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Flag, FrameError, NackCode, Op
from fabric.core.memory import AccessError
from fabric.core.topology import Topology
from switchd.core.aggregation import Aggregation
from switchd.core.barriers import Barriers
from switchd.core.combine import Combine
from switchd.core.context import Counters, Output, SwitchContext
from switchd.core.engine import AggregationEngine
from switchd.core.events import EngineStats
from switchd.core.jobs import JobPhase, Jobs, JobTable
from switchd.core.multicast import Multicast
from switchd.core.regions import MemoryPlane, Regions
from switchd.core.service import Service
from switchd.core.tenants import TenantLedger

__all__ = ["HELLO_INTERVAL_S", "ServiceFactory", "SwitchCore", "SwitchStats"]

#: Interval of the link-up hello to a neighbour switch that has not answered.
HELLO_INTERVAL_S: Final = 0.1
#: Control messages the core answers itself.
_CORE_CTRL: Final = ("hello", "welcome", "stats")
_F_CRC: Final = int(Flag.CRC)

#: Makes a service for a switch (a Service subclass is one).
ServiceFactory = Callable[[SwitchContext], Service]


@dataclass(frozen=True)
class SwitchStats:
    """A snapshot of one switch's counters (``semfab stats`` shows these)."""

    switch: str
    frames_in: int
    bytes_in: int
    forwarded: int
    reduce_frames: int
    results_sent: int
    missing_asked: int
    ctrl_frames: int
    malformed: int
    unauthorised: int
    nacks_sent: int
    nacks_received: int
    unroutable: int
    payload_copies: int
    mem_stores: int
    mcast_frames: int
    mcast_copies: int
    jobs_refused: int
    trimmed_forwarded: int
    regions: int
    nack_codes: dict[str, int]
    engine: EngineStats
    #: per tenant: jobs, slots and slot memory in use here, jobs refused by its quota
    tenants: dict[str, dict[str, int]]
    #: each service's own statistics, by its name
    services: dict[str, Any]


class SwitchCore:
    """The protocol logic of one switch of ``topo`` (see the module doc)."""

    def __init__(self, topo: Topology, name: str, *, memory_budget: int = 256 * 2**20,
                 memory: MemoryPlane | None = None,
                 extra_stats: Callable[[], dict[str, Any]] | None = None,
                 attach_doorbell: Callable[[bytes, str], None] | None = None,
                 services: Sequence[ServiceFactory] = (),
                 rng: random.Random | None = None, crc: bool = False) -> None:
        self.topo = topo
        self.name = name
        ctx = self.ctx = SwitchContext(topo, name, rng, crc)
        self.id = ctx.id
        self._extra_stats = extra_stats  # the driver's own counters, for stats replies
        self.engine = AggregationEngine(memory_budget)
        self.jobs = JobTable()
        self.tenants = TenantLedger(topo, name)
        self.regions = Regions(ctx, memory, attach_doorbell)
        self.multicast = Multicast(ctx)
        aggregation = Aggregation(ctx, self.jobs, self.engine, self.regions)
        built: list[Service] = [
            self.multicast, Combine(ctx, self.multicast), aggregation,
            Jobs(ctx, self.jobs, self.engine, self.regions, self.tenants, aggregation.forget),
            self.regions, Barriers(ctx, self.multicast)]
        built.extend(make(ctx) for make in services)
        self.services: tuple[Service, ...] = tuple(built)
        self._by_op: dict[Op, list[Service]] = {}
        self._flagged: list[Service] = []
        self._flags = Flag.NONE
        self._ctrl_of: dict[str, Service] = {}
        for svc in self.services:
            for op in svc.ops:
                self._by_op.setdefault(op, []).append(svc)
            if svc.flag:
                self._flagged.append(svc)
                self._flags |= svc.flag
            for t in svc.ctrl_types:
                owner = self._ctrl_of.get(t)
                if owner is not None or t in _CORE_CTRL:
                    raise ValueError(f"control type {t!r} of service {svc.name!r} is taken "
                                     f"by {owner.name if owner else 'the core'}")
                self._ctrl_of[t] = svc
        # link-up: we say hello to lower-id neighbour switches until welcomed and
        # wait for the hello of every higher-id one
        self._lower = {s for s in ctx.switch_ports if topo.node(s.decode()).id < self.id}
        self._higher = ctx.switch_ports - self._lower
        self._linked: set[bytes] = set()
        self._hellos: set[bytes] = set()
        self._hello_due = 0.0

    # ------------------------------------------------------------------ API
    @property
    def memory(self) -> MemoryPlane | None:
        """The memory plane the switch maps regions with (None: it has none)."""
        return self.regions.memory

    @property
    def counters(self) -> Counters:
        """The live counters (statistics() is the frozen snapshot)."""
        return self.ctx.counters

    @property
    def ready(self) -> bool:
        """True once every switch-to-switch link is up (nodes may start then)."""
        return self._linked >= self._lower and self._higher <= self._hellos

    def job_phase(self, job: int) -> JobPhase | None:
        """Where ``job`` is in its lifecycle at this switch (None: never seen)."""
        return self.jobs.phase.get(job)

    def handle(self, port: bytes, header: Any, payload: Any, now: float) -> list[Output]:
        """One frame arrived on ``port`` (header buffer, payload buffer or None)."""
        out = self.ctx.out = []
        try:
            self._process(port, header, payload, now)
        except Exception as exc:  # the guard: no frame may stop the switch
            self.ctx.counters.malformed += 1
            code = exc.code if isinstance(exc, (FrameError, AccessError)) else NackCode.MALFORMED
            try:
                _op, _fl, src, job, psn, _k, _o, _l = fr.peek(header)
            except FrameError:
                src, job, psn = 0, 0, 0
            self.ctx.nack(port, src, job, psn, 0, code, f"refused: {type(exc).__name__}: {exc}")
        return out

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` next has work (link-up hellos, services), or None."""
        due = None if self._linked >= self._lower else self._hello_due
        for svc in self.services:
            t = svc.get_timer()
            if t is not None and (due is None or t < due):
                due = t
        return due

    def handle_timer(self, now: float) -> list[Output]:
        """Say hello again to neighbour switches that have not welcomed us; run the
        services' timers that are due."""
        out = self.ctx.out = []
        if now >= self._hello_due and not self._linked >= self._lower:
            self._hello_due = now + HELLO_INTERVAL_S
            for peer in sorted(self._lower - self._linked):
                out.append((peer, fr.encode(Op.CTRL, src=self.id, dst=self.topo.node(
                    peer.decode()).id, payload=control.pack("hello", name=self.name),
                    crc=True), None))
        for svc in self.services:
            t = svc.get_timer()
            if t is not None and t <= now:
                svc.handle_timer(now)
        return out

    def statistics(self) -> SwitchStats:
        """A frozen snapshot of the counters."""
        c = asdict(self.ctx.counters)
        c["nack_codes"] = dict(self.ctx.counters.nack_codes)
        services = {}
        for svc in self.services:
            s = svc.statistics()
            if s is not None:
                services[svc.name] = s
        return SwitchStats(switch=self.name, regions=len(self.regions.table),
                           engine=self.engine.statistics(), tenants=self.tenants.statistics(),
                           services=services, **c)

    # ------------------------------------------------------------------ dispatch
    def _process(self, port: bytes, header: Any, payload: Any, now: float) -> None:
        ctx = self.ctx
        c = ctx.counters
        c.frames_in += 1
        c.bytes_in += len(header) + (memoryview(payload).nbytes if payload is not None else 0)
        try:
            f = fr.decode(header, payload)
        except FrameError as bad:
            if fr.is_trimmed(header, payload) and self._forward_trimmed(port, header, now):
                return
            c.malformed += 1
            try:
                _op, _fl, src, job, psn, _k, _o, _l = fr.peek(header)
            except FrameError:
                src, job, psn = 0, 0, 0
            ctx.nack(port, src, job, psn, 0, bad.code, str(bad))
            return
        if f.has(_F_CRC) and f.op is not Op.CTRL and f.op is not Op.NACK and f.op is not Op.ACK:
            # the fabric checks: so does every data frame we originate. Not on the
            # control, NACK and ACK frames switches always check (a neighbour's hello
            # would turn it on in every multi-switch fabric)
            ctx.crc = True
        speaker = ctx.port_node.get(port)
        if speaker is not None and f.src != speaker:
            # the port is the sender's identity: no node speaks for another
            c.unauthorised += 1
            ctx.nack(port, speaker, f.job, f.psn, f.msg, NackCode.PERMISSION,
                     f"frame from port {port.decode(errors='replace')} claims src {f.src}")
            return
        if speaker is None and port not in ctx.switch_ports:
            # not a link of ours: a monitor (`semfab stats`) may read counters, nothing else
            if f.op is Op.CTRL and f.dst == self.id and control.parse(f.payload).get("t") \
                    == "stats":
                self._stats_reply(f, port)
            else:
                c.unauthorised += 1
            return
        if f.has(self._flags):
            for svc in self._flagged:
                if f.has(svc.flag) and svc.claims(f, port, speaker):
                    svc.handle(f, port, header, payload, now)
                    return
        for svc in self._by_op.get(f.op, ()):
            if svc.claims(f, port, speaker):
                svc.handle(f, port, header, payload, now)
                return
        if f.dst != self.id:
            self._forward(f, port, header, payload)
        elif f.op is Op.CTRL:
            c.ctrl_frames += 1
            ctx.asking = (f.src, f.msg)
            try:
                self._on_ctrl(f, port, control.parse(f.payload), now)
            except (FrameError, AccessError) as refused:  # one name per type (mypyc #620)
                c.malformed += 1
                ctx.nack(port, f.src, f.job, f.psn, f.msg, refused.code, str(refused))
            finally:
                ctx.asking = (-1, 0)
        elif f.op in (Op.NACK, Op.ACK):
            c.nacks_received += 1  # never answer a NACK with a NACK
        else:
            ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.UNSUPPORTED,
                     f"switch does not serve {f.op.name}")

    def _forward_trimmed(self, port: bytes, header: Any, now: float) -> bool:
        """Pass on a trimmed frame (an upstream switch cut its payload) towards its
        node, whose answer asks its sender for the frame again (a masked multicast
        row: towards the members its mask names, by the multicast service); False
        when it is not one to pass on (for this switch itself, or from a port that
        may not send it)."""
        try:
            f = fr.decode_trimmed(header)
        except FrameError:
            return False
        if f.dst == self.id or port not in self.ctx.switch_ports:
            return False  # only switches trim, so only a switch link brings one
        if f.has(Flag.MCAST):
            if not fr.trimmable(header):
                return False
            for svc in self._flagged:
                if svc.flag & Flag.MCAST:
                    self.ctx.counters.trimmed_forwarded += 1
                    svc.handle(f, port, header, None, now)
                    return True
            return False
        dst_port = self.ctx.next_hop.get(f.dst)
        if dst_port is None:
            return False
        self.ctx.counters.trimmed_forwarded += 1
        self.ctx.send(dst_port, bytes(header), None)
        return True

    def _forward(self, f: fr.Frame, port: bytes, header: Any, payload: Any) -> None:
        ctx = self.ctx
        dst_port = ctx.next_hop.get(f.dst)
        if dst_port is None:
            ctx.counters.unroutable += 1
            ctx.nack(port, f.src, f.job, f.psn, f.msg, NackCode.PERMISSION,
                     f"no node with id {f.dst}")
            return
        ctx.counters.forwarded += 1
        # header and payload buffers pass through unchanged (payload zero-copy)
        ctx.send(dst_port, bytes(header), payload)

    def _on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any], now: float) -> None:
        t = msg["t"]
        svc = self._ctrl_of.get(t)
        if svc is not None:
            svc.on_ctrl(f, port, msg, now)
        elif t == "hello":
            if port in self.ctx.switch_ports:
                self._hellos.add(port)
            self.ctx.ctrl(port, f.src, "welcome", switch=self.name, id=self.id)
        elif t == "welcome":  # a lower neighbour answered our uplink hello
            if port in self._lower:
                self._linked.add(port)
        elif t == "stats":
            self._stats_reply(f, port)
        else:
            raise FrameError(NackCode.UNSUPPORTED, f"unknown control message type {t!r}")

    def _stats_reply(self, f: fr.Frame, port: bytes) -> None:
        stats = asdict(self.statistics())
        if self._extra_stats is not None:
            stats.update(self._extra_stats())
        self.ctx.ctrl(port, f.src, "stats", **stats)
