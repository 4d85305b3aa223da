"""The simulator: the protocol core in virtual time.

One :class:`Simulation` holds, for a topology, one
:class:`~switchd.core.SwitchCore` per switch, one
:class:`~fabric.core.link.LinkPipeline` per link direction, and per node its
:class:`~fabric.core.programs.NodeState` and the program it runs. A heap of events
(link deliveries, timers, workload resumptions) advances a virtual clock. No
sockets, no processes, no wall clock: the same seed gives the same run.

Timing model: the links' bandwidth, latency and MTU from the topology, plus
an optional :class:`TimingModel` of per-frame and per-byte service times at
switches and nodes (each a single server: a frame waits for the previous one).
Zero costs simulate ideal hardware; ``semfab sim calibrate`` measures the
costs of this machine's emulator.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from fabric.core import frame as fr
from fabric.core.calls import GroupCall
from fabric.core.congestion.config import CongestionConfigError
from fabric.core.congestion.credit import link_grant
from fabric.core.congestion.pfc import find_pause_cycle
from fabric.core.congestion.switchq import switch_queues
from fabric.core.faults import FaultSpec, parse_faults
from fabric.core.frame import Flag, FrameError, Op
from fabric.core.hostnode import HostAggregator
from fabric.core.link import CreditBack, LinkPipeline, wire_bytes
from fabric.core.posting import Inbox, Outbox, PostArrival
from fabric.core.programs import (
    HOST_PS_FLOW,
    Chain,
    Group,
    NodeState,
    Program,
    Request,
    Tensor,
    allreduce_program,
    barrier_program,
    fixed_program,
)
from fabric.core.semantic import class_traffic
from fabric.core.topology import Topology
from fabric.core.workload import (
    Allreduce,
    Barrier,
    Clock,
    CloseGroup,
    Collective,
    Compute,
    Context,
    Control,
    Counters,
    MakeGroup,
    MoeCombine,
    MoeDispatch,
    Post,
    Recv,
    Send,
    Together,
    check_workload,
    program_of,
    start_workload,
    stream_program,
)
from fabric.errors import FabricTimeout, SemfabError, UsageError
from kernels.dtypes import UFUNCS
from kernels.reference import sum_wrap
from switchd.core import SwitchCore
from switchd.core.switch import ServiceFactory
from switchd.plugins import load_services

__all__ = ["SimResult", "Simulation", "SimulationError", "TimingModel"]

#: Frames a node keeps for a later program before it drops the oldest.
STASH_LIMIT: Final = 4096

#: Operations of a whole group: numbered alike on every member, and ended on
#: every member when one cannot take part (fabric.core.calls)
_GROUP_CALLS: Final = (Allreduce, Collective, MoeDispatch, MoeCombine, Barrier)


class SimulationError(SemfabError):
    """A simulated workload failed (a node's error) or could never finish."""


@dataclass(frozen=True)
class TimingModel:
    """Service times beyond the links (seconds per frame, seconds per byte)."""

    switch_frame_s: float = 0.0
    switch_byte_s: float = 0.0
    node_frame_s: float = 0.0
    node_byte_s: float = 0.0
    #: 0: store and forward (as the emulator's links); else the packet size of
    #: cut-through switching (hardware: a frame crosses hops in one serialisation)
    cut_through_bytes: int = 0

    @property
    def ideal(self) -> bool:
        return not (self.switch_frame_s or self.switch_byte_s or self.node_frame_s
                    or self.node_byte_s)


@dataclass
class SimResult:
    """What a run returned and what it cost."""

    results: list[Any]  # per worker, in rank order
    end_s: float  # virtual time when the last worker finished
    events: int
    frames: int  # frame deliveries over links
    switch_stats: dict[str, Any] = field(default_factory=dict)
    retransmits: int = 0
    nodes: dict[str, NodeState] = field(default_factory=dict)
    #: frames the switches' buffers ([congestion] buffer_bytes) had no room for
    overflow_drops: int = 0
    #: with buffers: the most bytes each switch egress ("switch>peer") ever queued
    queue_peaks: dict[str, int] = field(default_factory=dict)
    #: frames the switches cut to their header ([congestion] trim), and marked CE
    trims: int = 0
    ecn_marks: int = 0
    #: frames links with link-level retry (``llr``) sent again
    llr_replays: int = 0
    #: PFC (``[congestion] pfc``): PAUSEs the links received, and their time paused
    pauses: int = 0
    paused_s: float = 0.0
    #: credit-controlled links (``credit``): frames that left later than their link
    #: could have sent them, and the time links stood idle for want of credit
    credit_stalls: int = 0
    credit_stalled_s: float = 0.0
    #: bytes the links of each class carried, both directions (shaped links only:
    #: an unshaped link does not count what it passes)
    bytes_by_class: dict[str, int] = field(default_factory=dict)
    #: per network class, what semantic distance counts of it: frames its links
    #: carried (each a hand-over from one node to another: a process crossing on
    #: launched processes), and of those the ones that entered a switch (hops);
    #: shaped links only, as ``bytes_by_class``
    frames_by_class: dict[str, int] = field(default_factory=dict)
    hops_by_class: dict[str, int] = field(default_factory=dict)
    #: posts (``ctx.post``) whole at their receivers, by receiving node: from
    #: which node, the post's number, its bytes and when (the workloads' clock,
    #: ``ctx.clock()``)
    posts: dict[str, list[PostArrival]] = field(default_factory=dict)


class _Node:
    __slots__ = ("state", "ctx", "gen", "prog", "stash", "host", "done", "result", "error",
                 "busy", "timer_at", "uplink", "name", "port", "stage", "outbox", "inbox")

    def __init__(self, state: NodeState) -> None:
        self.state = state
        self.name = state.name
        self.port = state.name.encode()
        self.ctx = Context(state.rank, state.world, state.name)
        self.gen: Generator[Any, Any, Any] | None = None
        self.prog: Program | None = None
        self.stash: deque[fr.Frame] = deque()
        self.host = HostAggregator() if state.node.kind == "host" else None
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.busy = 0.0
        self.timer_at: float | None = None
        self.uplink: LinkPipeline | None = None
        self.stage: Program | None = None  # the step running when the stash was last replayed
        self.outbox: Outbox | None = None  # its posts (ctx.post), made on the first
        self.inbox: Inbox | None = None  # posts it received


class ArrayMemoryPlane:
    """The simulated memory plane: regions are arrays the simulated nodes own
    (``registry``: path -> bytes); without an array (timing-only) a region has
    a size and no bytes, and the reduction only costs the time its frames name."""

    def __init__(self, registry: dict[str, np.ndarray]) -> None:
        self.registry = registry
        self._regions: dict[int, np.ndarray | None] = {}

    def prepare(self, backend: str) -> None:
        """Any backend: the simulator reduces with NumPy."""

    @staticmethod
    def name(run: str, owner: str, key: int) -> str:
        """Where node ``owner``'s region ``key`` lives in ``registry``."""
        return f"{run}:{owner}:{key}"

    def attach(self, key: int, owner: str, run: str, size: int) -> None:
        path = self.name(run, owner, key)
        arr = self.registry.get(path)
        if arr is not None and arr.nbytes < size:
            raise ValueError(f"region {path} has {arr.nbytes} B, asked {size} B")
        if arr is None and run != "sim-timing":
            raise ValueError(f"no simulated region {key} of {owner}")
        self._regions[key] = arr

    def detach(self, key: int) -> None:
        self._regions.pop(key, None)

    def reduce(self, dtype: np.dtype[Any], op: str, refs: list[tuple[int, int]],
               count: int) -> str | None:
        views = []
        for key, offset in refs:
            arr = self._regions[key]
            if arr is None:
                return None  # timing-only
            views.append(arr[offset: offset + count * dtype.itemsize].view(dtype))
        if op == "sum":
            wrap = sum_wrap(views)
            if wrap is not None:
                return wrap
        acc = views[0].copy()
        for v in views[1:]:
            UFUNCS[op](acc, v, out=acc)
        for v in views:
            np.copyto(v, acc)
        return None


# event kinds
_PIPE, _NODE_TIMER, _RESUME, _SWITCH_IN, _SWITCH_TIMER = range(5)


def _running(node: _Node) -> Program | None:
    """The program ``node`` runs now. A function, not ``node.prog`` read where it
    was just assigned: mypy keeps that narrowed across a call that resets it,
    and compiled code then fails its type check (docs/ARCHITECTURE.md)."""
    return node.prog


class Simulation:
    """A fabric of ``topo`` in virtual time (see the module doc)."""

    def __init__(self, topo: Topology, *, seed: int = 0, faults: str | FaultSpec | None = None,
                 timing: TimingModel | None = None, timeout_s: float = 30.0,
                 memory_budget: int = 256 * 2**20, crc: bool = False,
                 services: Sequence[str | ServiceFactory] = ()) -> None:
        self.topo = topo
        self.timing = timing or TimingModel()
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0  # scheduling order: ties in time keep it
        self.events = 0
        self.frames = 0
        self.regions: dict[str, np.ndarray] = {}  # simulated "device memory", by path
        added = load_services(services)  # in-network services of the user's, every switch
        fault_spec = parse_faults(faults) if isinstance(faults, str) else faults
        corrupting = crc or (fault_spec is not None and fault_spec.corrupt > 0)
        self.switches = {s.name: SwitchCore(topo, s.name, memory_budget=memory_budget,
                                            memory=ArrayMemoryPlane(self.regions),
                                            services=added,
                                            rng=random.Random(f"{seed}/{s.name}"),
                                            crc=corrupting)
                         for s in topo.switches}
        self._keys = itertools.count(1)
        # each node's memory-plane region (key, bytes, path), grown as tensors grow
        self._node_regions: dict[str, tuple[int, int, str]] = {}
        self._sw_busy = dict.fromkeys(self.switches, 0.0)
        spec_all = parse_faults(faults) if faults is not None else None
        try:
            queues = switch_queues(topo, seed)
        except CongestionConfigError as exc:
            raise UsageError(str(exc)) from None
        self._queues = queues
        # nothing is lost where no link loses (a link that retries loses nothing)
        clean = spec_all is None or spec_all.clean
        lossless = not queues and all(lk.params.llr or (clean and not lk.params.loss)
                                      for lk in topo.links)
        self.nodes: dict[str, _Node] = {}
        for n in topo.nodes:
            if not n.is_switch:
                self.nodes[n.name] = _Node(NodeState(topo, n.name, timeout_s=timeout_s,
                                                     crc=corrupting, lossless=lossless))
        # one pipeline per link direction: (from, to) -> pipeline
        self.pipes: dict[tuple[str, str], LinkPipeline] = {}
        self._ids = {n.name: n.id for n in topo.nodes}
        # ingress accounting, pauses
        self._pfc = any(q.lossless for q in queues.values())
        self._pipe_at: dict[tuple[str, str], float] = {}
        for link in topo.links:
            a, b = link.endpoints
            spec = spec_all if spec_all is not None else (
                FaultSpec(loss=link.params.loss) if link.params.loss else None)
            for x, y in ((a, b), (b, a)):
                self.pipes[(x, y)] = LinkPipeline(
                    link.params, spec, seed=seed, stream=f"{x}>{y}",
                    cut_through=self.timing.cut_through_bytes,
                    to_switch=topo.node(y).is_switch, queues=queues.get((x, link.cls)),
                    port=topo.node(y).id, pausable=self._pfc,
                    credit_bytes=link_grant(link.params, topo.link_congestion(link).credit),
                    frees_on_arrival=not topo.node(y).is_switch)
        # credit-controlled links into switches: each frame's credit goes back once
        # the switch is done with it
        self._credit = {key for key, p in self.pipes.items()
                        if p.credit is not None and not p.frees_on_arrival}
        self._credit_any = any(p.credit is not None for p in self.pipes.values())
        for node in self.nodes.values():
            node.uplink = self.pipes[(node.name, node.state.switch_name)]
        self._workers = [self.nodes[w.name] for w in topo.workers]

    # ------------------------------------------------------------------ running
    def run(self, workload: Callable[..., Generator[Any, Any, Any]], *args: Any,
            until: float | None = None, **kwargs: Any) -> SimResult:
        """Run ``workload(ctx, *args, **kwargs)`` on every worker to the end."""
        check_workload(workload)
        for sw, core in self.switches.items():
            self._switch_out(sw, core.handle_timer(self.now), self.now)
            self._schedule_switch_timer(sw)
        self._drain(lambda: all(c.ready for c in self.switches.values()), None)
        start = self.now
        for node in self._workers:
            node.gen = start_workload(workload, node.ctx, *args, **kwargs)
            node.done = False
            self._resume(node, None)
        # (a worker whose workload ended may still have posts on the way)
        self._drain(lambda: all(n.done and (n.outbox is None or n.outbox.done)
                                for n in self._workers), until)
        unfinished = [n.name for n in self._workers if not n.done]
        failed = [n for n in self._workers if n.error is not None]
        if unfinished or failed:
            stuck = self._credit_deadlock()
            if stuck:  # what the timeouts (or the standstill) come from
                raise SimulationError(
                    f"credit deadlock at t={self.now:.6f}s: the links {stuck} each wait for "
                    "credit held by frames that wait on the next one's (a cycle of "
                    "credit-controlled links; routes that go round a ring of switches make "
                    "one: route over a tree, or give those links no credit)")
        if unfinished:
            raise SimulationError(
                f"the workload never finished on {', '.join(unfinished[:8])}: nothing left to "
                f"happen at t={self.now:.6f}s (a rank waits for a peer that never sends; do "
                "all ranks yield the same collectives in the same order?)")
        if failed:
            # the cause first: a rank that refused its input makes its peers time out
            first = min(failed, key=lambda n: isinstance(n.error, FabricTimeout))
            raise SimulationError(f"{first.name}: {type(first.error).__name__}: {first.error}")
        end = max((n.busy for n in self._workers), default=self.now)
        stats = {name: c.statistics() for name, c in self.switches.items()}
        by_class = self._by_class()
        return SimResult(
            results=[n.result for n in self._workers], end_s=max(self.now, end) - start,
            events=self.events, frames=self.frames, switch_stats=stats,
            retransmits=sum(n.state.retransmits for n in self._workers),
            nodes={n.name: n.state for n in self._workers},
            overflow_drops=sum(p.overflow_drops for p in self.pipes.values()),
            queue_peaks=self._queue_peaks(),
            trims=sum(p.trims for p in self.pipes.values()),
            ecn_marks=sum(p.ecn_marks for p in self.pipes.values()),
            llr_replays=sum(p.llr_replays for p in self.pipes.values()),
            pauses=sum(p.pauses for p in self.pipes.values()),
            paused_s=sum(p.paused_s for p in self.pipes.values()),
            credit_stalls=sum(p.credit_stalls for p in self.pipes.values()),
            credit_stalled_s=sum(p.credit_stalled_s for p in self.pipes.values()),
            bytes_by_class=by_class[0], frames_by_class=by_class[1],
            hops_by_class=by_class[2],
            posts={n.name: list(n.inbox.arrivals) for n in self.nodes.values()
                   if n.inbox is not None})

    def _credit_deadlock(self) -> str:
        """A cycle of credit-controlled links each of which waits for credit that
        frames waiting on the next one hold, as "a>b, b>c, c>a"; "" when none."""
        waits: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for key, pipe in self.pipes.items():
            for token in pipe.waiting_tokens():
                waits.setdefault(token, []).append(key)
        cycle = find_pause_cycle(waits) if waits else None
        return ", ".join(f"{a}>{b}" for a, b in cycle) if cycle else ""

    def _by_class(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Bytes, frames and switch hops of each network class's links."""
        dirs = []
        for link in self.topo.links:
            for d in (link.endpoints, link.endpoints[::-1]):
                st = self.pipes[d].statistics()
                dirs.append((link.cls, self.topo.node(d[1]).is_switch, st.bytes, st.frames))
        per = class_traffic(dirs)
        return ({c: t.bytes for c, t in per.items()}, {c: t.frames for c, t in per.items()},
                {c: t.hops for c, t in per.items()})

    def _queue_peaks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        seen: set[int] = set()
        for (sw, _cls), q in self._queues.items():
            if id(q) in seen:  # (classes with the same settings share one buffer)
                continue
            seen.add(id(q))
            for key, peak in q.buffer.buffer.statistics().queue_peaks.items():
                port, tc = key.split("/")
                if tc == "0":  # data (trimmed headers have a class of their own)
                    out[f"{sw}>{self.topo.by_id(int(port)).name}"] = peak
        return out

    def _drain(self, finished: Callable[[], bool], until: float | None) -> None:
        heap = self._heap
        while heap and not finished():
            t, _seq, kind, obj = heapq.heappop(heap)
            if until is not None and t > until:
                heapq.heappush(heap, (t, _seq, kind, obj))
                return
            self.now = t
            self.events += 1
            if kind == _PIPE:
                self._on_pipe(obj, t)
            elif kind == _SWITCH_IN:
                sw, port, header, payload, tail, back = obj
                self._switch_out(sw, self.switches[sw].handle(port, header, payload, t), t,
                                 max(tail, t), port.decode(), back)
            elif kind == _NODE_TIMER:
                self._on_node_timer(obj, t)
            elif kind == _RESUME:
                node, value = obj
                self._resume(node, value)
            else:
                core = self.switches[obj]
                self._switch_out(obj, core.handle_timer(t), t)
                self._schedule_switch_timer(obj)

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    # ------------------------------------------------------------------ links
    def _send(self, src: str, dst: str, header: Any, payload: Any, t: float,
              tail: float | None = None, came_from: str | None = None,
              back: CreditBack | None = None) -> None:
        key = (src, dst)
        pipe = self.pipes[key]
        if back is None and (came_from is None or not self._pfc):
            pipe.push((header, payload), t, tail)
        else:
            ingress = self._ids[came_from] if came_from is not None and self._pfc else -1
            pipe.push((header, payload), t, tail, ingress, back)
            if back is not None:
                self._credit_returns(pipe)
            req = pipe.take_pause() if ingress >= 0 else None
            if req is not None and came_from is not None:
                # a lossless port above XOFF: PFC pauses the sender
                up = (came_from, src)
                self.pipes[up].pause(t, req[1])
                self._schedule_pipe(up)
        self._schedule_pipe(key)

    def _credit_returns(self, pipe: LinkPipeline) -> None:
        """Hand the credit of frames ``pipe`` has sent on to the links they came on."""
        if not pipe.returning:
            return
        for key, nbytes, at in pipe.take_credit_returns():
            up = self.pipes[key]
            up.credit_freed(at, nbytes)
            if up.waiting:  # (else the credit counts when its next frame asks)
                self._schedule_pipe(key)

    def _schedule_pipe(self, key: tuple[str, str]) -> None:
        """One pending event per link direction, at its earliest delivery."""
        due = self.pipes[key].get_timer()
        if due is not None:
            at = self._pipe_at.get(key)
            if at is None or due < at:
                self._pipe_at[key] = due
                self._push(due, _PIPE, key)

    def _on_pipe(self, key: tuple[str, str], t: float) -> None:
        if self._pipe_at.get(key) == t:
            del self._pipe_at[key]
        src, dst = key
        pipe = self.pipes[key]
        for (header, payload), tail in pipe.pop_due_timed(t):
            self.frames += 1
            self._arrive(src, dst, header, payload, t, tail)
        if self._credit_any:
            self._credit_returns(pipe)  # frames that waited for credit, now sent
        self._schedule_pipe(key)

    def _arrive(self, src: str, dst: str, header: Any, payload: Any, t: float,
                tail: float) -> None:
        core = self.switches.get(dst)
        if core is not None:
            # over a credit-controlled link, the frame's credit goes back once the
            # switch is done with it
            back = ((src, dst), wire_bytes(header, payload)) \
                if self._credit and (src, dst) in self._credit else None
            tm = self.timing
            if tm.switch_frame_s or tm.switch_byte_s:
                start = max(t, self._sw_busy[dst])
                done = start + tm.switch_frame_s + tm.switch_byte_s * wire_bytes(header, payload)
                self._sw_busy[dst] = done
                self._push(done, _SWITCH_IN, (dst, src.encode(), header, payload, tail, back))
                return
            self._switch_out(dst, core.handle(src.encode(), header, payload, t), t, tail, src,
                             back)
            return
        self._node_frame(self.nodes[dst], header, payload, t)

    def _switch_out(self, sw: str, outputs: list[tuple[bytes, Any, Any]], t: float,
                    tail: float | None = None, came_from: str | None = None,
                    back: CreditBack | None = None) -> None:
        # what a frame causes streams out behind it: its tail bounds theirs
        for port, header, payload in outputs:
            self._send(sw, port.decode(), header, payload, t, tail, came_from, back)
            # a frame's copies (multicast) and results (aggregation) are its bytes
            # in the buffer once, for the port it came in on (PFC's accounting; its
            # credit goes back when the first has left)
            came_from = None
            back = None
        if back is not None:  # consumed here (an aggregation's contribution): freed now
            up = self.pipes[back[0]]
            up.credit_freed(t, back[1])
            if up.waiting:
                self._schedule_pipe(back[0])
        if outputs:
            self._schedule_switch_timer(sw)

    def _schedule_switch_timer(self, sw: str) -> None:
        due = self.switches[sw].get_timer()
        if due is not None:
            self._push(max(due, self.now), _SWITCH_TIMER, sw)

    # ------------------------------------------------------------------ nodes
    def _node_send(self, node: _Node, sends: list[tuple[Any, Any]], t: float) -> None:
        tm = self.timing
        for header, payload in sends:
            if tm.node_frame_s or tm.node_byte_s:
                t = max(t, node.busy) + tm.node_frame_s + tm.node_byte_s * wire_bytes(
                    header, payload)
                node.busy = t
            self._send(node.name, node.state.switch_name, header, payload, t)

    def _node_frame(self, node: _Node, header: Any, payload: Any, t: float) -> None:
        try:
            f = fr.decode(header, None if payload is None else _bytes_view(payload))
        except FrameError:
            if payload is None and fr.is_trimmed(header):  # a switch cut its payload
                try:
                    cut = fr.decode_trimmed(header)
                except FrameError:
                    return
                self._node_send(node, node.state.answer_trimmed(cut, t), t)
                self._schedule_node_timer(node)  # (a credit pacer may have work now)
            return  # a damaged frame: dropped (programs resend)
        tm = self.timing
        if tm.node_frame_s or tm.node_byte_s:
            t = max(t, node.busy) + tm.node_frame_s + tm.node_byte_s * wire_bytes(
                header, payload)
            node.busy = t
        if Inbox.wants(f):  # a post (ctx.post): any node takes it
            if node.inbox is None:
                node.inbox = Inbox(node.state.node_id, node.state.crc)
            self._node_send(node, node.inbox.handle_frame(f, t), t)
            return
        box = node.outbox
        if box is not None and box.wants(f):
            self._outbox_step(node, lambda: box.handle_frame(f, t), t)
            return
        if node.host is not None:
            self._host_frame(node, f, t)
            return
        prog = node.prog
        if prog is not None and prog.wants(f):
            self._step(node, lambda: prog.handle_frame(f, t), t)
        elif (answer := node.state.answer_stale(f)):
            self._node_send(node, answer, t)  # a peer retries something we finished
            self._schedule_node_timer(node)  # or abandoned the call we run: wake it
        elif f.op is not Op.NACK and f.op is not Op.ACK and f.op is not Op.CREDIT:
            node.stash.append(f)  # for a later program (a peer ahead of us)
            if len(node.stash) > STASH_LIMIT:
                node.stash.popleft()

    def _host_frame(self, node: _Node, f: fr.Frame, t: float) -> None:
        assert node.host is not None
        if f.op is not Op.WRITE or f.flow != HOST_PS_FLOW:
            return
        try:
            replies = node.host.on_message(f.src, f.payload, f.has(Flag.ECN), t)
        except FrameError:
            return
        sends = [(fr.encode_header(Op.WRITE, src=node.state.node_id, dst=dst, flow=HOST_PS_FLOW,
                                   psn=f.psn, msg=f.msg, payload=body,
                                   crc=f.has(Flag.CRC)), body)
                 for dst, body in replies]
        self._node_send(node, sends, t)

    def _step(self, node: _Node, action: Callable[[], list[tuple[Any, Any]]], t: float) -> None:
        """Run one program step; send what it says; move on when it is done."""
        try:
            sends = action()
        except SemfabError as exc:  # the workload may catch it (as in emulation)
            node.prog = None
            self._resume(node, None, exc)
            return
        self._node_send(node, sends, t)
        prog = node.prog
        if prog is not None and prog.done:
            node.prog = None
            self._resume(node, prog.result)
        else:
            self._schedule_node_timer(node)
            if prog is not None and node.stash:
                # a chain moved on: frames of its new step may have come early
                stage = prog.leaf() if isinstance(prog, Chain) else prog
                if stage is not node.stage:
                    node.stage = stage
                    self._replay_stash(node, t)

    def _schedule_node_timer(self, node: _Node) -> None:
        due = node.prog.get_timer() if node.prog is not None else None
        if node.outbox is not None:
            d = node.outbox.get_timer()
            if d is not None and (due is None or d < due):
                due = d
        if due is not None and (node.timer_at is None or due < node.timer_at):
            node.timer_at = due
            self._push(max(due, self.now), _NODE_TIMER, node)

    def _on_node_timer(self, node: _Node, t: float) -> None:
        if node.timer_at is not None and node.timer_at <= t:
            node.timer_at = None
        box = node.outbox
        if box is not None and (due := box.get_timer()) is not None and due <= t:
            self._outbox_step(node, lambda: box.handle_timer(t), t)
        prog = node.prog
        if prog is None:
            return
        due = prog.get_timer()
        if due is not None and due <= t:
            self._step(node, lambda: prog.handle_timer(t), t)
        else:
            self._schedule_node_timer(node)

    def _outbox_step(self, node: _Node, action: Callable[[], list[tuple[Any, Any]]],
                     t: float) -> None:
        """Run one step of the node's posts; a post that cannot be delivered fails
        the node (its workload has moved on: there is nowhere to raise it)."""
        try:
            sends = action()
        except SemfabError as exc:
            node.outbox = None
            self._fail(node, exc)
            return
        self._node_send(node, sends, t)
        self._schedule_node_timer(node)

    def _fail(self, node: _Node, exc: BaseException) -> None:
        node.error = exc
        node.prog = None
        node.done = True

    def _resume(self, node: _Node, value: Any, error: SemfabError | None = None) -> None:
        """Give the workload ``value`` (or raise ``error`` where it waits: a workload
        may catch what its operation raised); start the program of what it yields next."""
        assert node.gen is not None
        t = max(self.now, node.busy)
        while True:
            try:
                if error is not None:
                    thrown, error = error, None
                    op = node.gen.throw(thrown)
                else:
                    op = node.gen.send(value)
            except StopIteration as stop:
                node.result = stop.value
                node.done = True
                node.busy = t
                return
            except Exception as exc:  # the user's own code failed
                self._fail(node, exc)
                return
            if isinstance(op, Clock):
                value = t
                continue
            if isinstance(op, Counters):
                value = {"retransmits": node.state.retransmits,
                         "timeouts": node.state.timeouts}
                continue
            if isinstance(op, Post):
                try:
                    value = self._post(node, op, t)
                except SemfabError as refused:
                    error = refused
                continue
            if isinstance(op, Compute):
                node.busy = t + op.seconds
                self._push(node.busy, _RESUME, (node, None))
                return
            try:
                prog = self._program(node, op)
            except SemfabError as refused:  # not ``exc``: see docs/ARCHITECTURE.md (mypyc)
                error = refused
                continue
            node.prog = prog
            self._step(node, lambda p=prog: p.start(t), t)  # type: ignore[misc]
            if _running(node) is prog:  # not finished at once: frames that came early
                self._replay_stash(node, t)
            return

    def _post(self, node: _Node, op: Post, t: float) -> int:
        """Start a post (ctx.post) and return its number: the workload goes on."""
        names = {n.name for n in self.topo.nodes}
        if op.node not in names:
            raise UsageError(f"{node.name}: post to {op.node!r}: no such node")
        if node.outbox is None:
            node.outbox = Outbox(node.state)
        number, sends = node.outbox.post(self._ids[op.node], op.nbytes, t, op.channel)
        self._node_send(node, sends, t)
        self._schedule_node_timer(node)
        return number

    def _replay_stash(self, node: _Node, t: float) -> None:
        prog = node.prog
        if prog is None or not node.stash:
            return
        keep: deque[fr.Frame] = deque()
        while node.stash:
            f = node.stash.popleft()
            if node.prog is prog and prog.wants(f):
                self._step(node, lambda f=f: prog.handle_frame(f, t), t)  # type: ignore[misc]
            else:
                keep.append(f)
        node.stash.extend(keep)
        if node.prog is not prog and node.prog is not None:
            self._replay_stash(node, t)

    def _program(self, node: _Node, op: Any) -> Program:
        if isinstance(op, _GROUP_CALLS):
            g = op.group if op.group is not None else node.state.world_group
            # one member's failure ends it on every member (a closed group, or one
            # this node is not in, has no calls: refused here alone)
            if isinstance(g, Group) and not g.closed and g.rank >= 0:
                return GroupCall(node.state, g, lambda: self._build(node, op))
        return self._build(node, op)

    def _build(self, node: _Node, op: Any) -> Program:
        st = node.state
        if isinstance(op, Allreduce):
            if op.path not in ("ina", "ina-mem", "host-ring", "host-ps"):
                raise UsageError(f"unknown path {op.path!r}; choose ina, ina-mem, host-ring "
                                 "or host-ps")
            if op.path == "ina-mem":
                return self._mem_program(node, op)
            if op.numerics not in ("float", "fixed"):
                raise UsageError(f"numerics must be 'float' or 'fixed', not {op.numerics!r}")
            if op.x is not None:
                x = np.ascontiguousarray(op.x).reshape(-1)
                from kernels.dtypes import dtype_name

                out = op.out if op.out is not None else np.empty_like(x)
                t = Tensor(x.size, dtype_name(x.dtype), x, out)
                if op.numerics == "fixed" and op.op == "sum":
                    return fixed_program(st, t, op.path, op.group)
                return allreduce_program(st, t, op.op, op.path, data=True, group=op.group)
            if op.count <= 0:
                raise UsageError("a timing-only allreduce needs count > 0")
            return allreduce_program(st, Tensor(op.count, op.dtype), op.op, op.path, data=False,
                                     group=op.group)
        if isinstance(op, (Send, Recv, Together)):
            return stream_program(st, op)
        if isinstance(op, (Collective, MakeGroup, CloseGroup, MoeDispatch, MoeCombine,
                               Control)):
            return program_of(st, op)
        if isinstance(op, Barrier):
            return barrier_program(st, op.group)
        raise UsageError(f"a workload yielded {op!r}, not an operation of its context")


    def _mem_program(self, node: _Node, op: Allreduce) -> Program:
        """ina-mem: register the node's region (once), stage the tensor into it, let
        the switch reduce in place, copy the result out."""
        from kernels.dtypes import dtype_name, np_dtype

        st = node.state
        if op.x is not None:
            x = np.ascontiguousarray(op.x).reshape(-1)
            dtype, count = dtype_name(x.dtype), x.size
        else:
            x, dtype, count = None, op.dtype, op.count
        if count <= 0:
            raise UsageError("a timing-only allreduce needs count > 0")
        if op.numerics != "float":
            raise UsageError("fixed-point numerics on ina-mem are emulation only")
        nbytes = count * np_dtype(dtype).itemsize
        out = op.out if op.out is not None else (np.empty_like(x) if x is not None else None)
        if x is not None and out is not None and (out.shape != x.shape or out.dtype != x.dtype):
            raise UsageError(f"{st.name}: allreduce out must be a {x.dtype} array of "
                             f"{x.size} elements, like x; got {out.dtype} shape {out.shape}")

        def steps() -> Generator[Program, Any, Any]:
            reg = self._node_regions.get(node.name)
            if reg is None or reg[1] < nbytes:
                key = next(self._keys)
                run = "sim" if x is not None else "sim-timing"
                path = ArrayMemoryPlane.name(run, node.name, key)
                if x is not None:
                    self.regions[path] = np.zeros(nbytes, np.uint8)
                reply = yield Request(st, "region", "region_reply", key=key, size=nbytes,
                                      run=run, match=lambda m: m.get("key") == key)
                if not reply.get("ok"):
                    raise SimulationError(f"{node.name}: region refused: {reply.get('reason')}")
                reg = (key, nbytes, path)
                self._node_regions[node.name] = reg
            key, _size, path = reg
            work = None
            if x is not None:
                work = self.regions[path][:nbytes].view(x.dtype)
                np.copyto(work, x)
            t = Tensor(count, dtype, work, work)
            yield allreduce_program(st, t, op.op, "ina-mem", data=x is not None,
                                    region=(key, 0), group=op.group)
            if x is not None and out is not None:
                assert work is not None
                np.copyto(out, work)
            return out

        return Chain(steps())


def _bytes_view(payload: Any) -> memoryview:
    if isinstance(payload, np.ndarray):
        payload = payload.view(np.uint8)
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
