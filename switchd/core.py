"""SwitchCore: everything a switch decides, as a sans-IO state machine.

One object per switch. A driver feeds it the frames that arrived on its ports
and sends what it returns; it never touches a socket or a clock::

    outputs = core.handle(port, header, payload, now)   # [(port, header, payload)]
    deadline = core.get_timer()                          # or None
    outputs = core.handle_timer(now)
    core.statistics()                                    # frozen SwitchStats

A *port* is the identity of the link a frame arrived on (the neighbour's node
name as bytes). The port is the sender's identity: a frame from an attached
node must carry that node's id as ``src``, or it is refused (PERMISSION).

What it decides:

* forwarding by route (fewest hops; header and payload pass through untouched);
* in-network aggregation with :class:`~switchd.aggregation.AggregationEngine`,
  including tree aggregation (a switch below the root sums its subtree and
  sends one partial up; the parent's RESULT comes down and is kept for
  retransmissions);
* the memory plane, through an injected :class:`MemoryPlane` (shared memory
  in emulation, arrays or nothing at all in simulation);
* barriers, regions and their keys, control messages, NACKs, counters;
* switch-to-switch link-up (hello until welcomed), the only timer it owns.

Every frame is handled under a guard: whatever a peer sends is counted and
NACKed where it can be; the switch goes on.

Two worlds drive it: ``switchd.daemon`` (ZeroMQ, real time) and
``fabric.sim`` (a discrete-event loop in virtual time).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Flag, FrameError, NackCode, Op
from fabric.core.memory import AccessError, RegionInfo, RegionTable
from fabric.core.reliability import PSN_MASK, unwrap_psn
from fabric.core.topology import Topology
from kernels.dtypes import DTYPES, byte_view
from switchd.aggregation import (
    AggOp,
    AggregationEngine,
    Completed,
    EngineStats,
    Granted,
    JobSpec,
    Rejected,
    ResendResult,
)

__all__ = ["JobPhase", "MemoryPlane", "Output", "SwitchCore", "SwitchStats", "unwrap_psn"]

#: What :meth:`SwitchCore.handle` returns: frames to send, by port.
Output = tuple[bytes, Any, Any]

#: Interval of the link-up hello to a neighbour switch that has not answered.
HELLO_INTERVAL_S = 0.1
#: Finished barrier ids kept to answer late retries of the barrier.
BARRIERS_KEPT = 1024
#: Chunks a switch checks behind a member's newest one for a lost contribution.
MISSING_SCAN = 64
#: A chunk missing at most this many members checks whether they already sent
#: later chunks (then theirs was lost).
MISSING_FEW = 2
#: Times one contribution is asked for (each ask with another proof).
MISSING_ASKS = 4
#: MISSING requests remembered (so each lost contribution is asked for once).
ASKED_KEPT = 65536
#: Multicast group ids the tree root hands out (0 is every worker, built in). A
#: group's jobs take ids ``gid << GROUP_JOB_BITS | n`` (fabric.core.programs.Group).
MAX_GROUPS = 255
GROUP_JOB_BITS = 8
#: In-network MoE combine: REDUCE frames on this flow, addressed to a token's home,
#: are summed by the first switch (the contributors' leaf); see _on_combine.
COMBINE_FLOW = 24
#: Finished per-token combine sums a switch keeps for the home to ask again.
COMBINE_KEPT = 65536
#: A node's doorbell file ends in this and its node id (fabric.emulation.doorbell).
DOORBELL_SUFFIX = "-bell-"


class MemoryPlane(Protocol):
    """Where memory-plane regions live, injected into the core.

    Emulation maps shared-memory files and runs the fused kernel; simulation
    keeps arrays (or nothing, for a timing-only model).
    """

    def prepare(self, backend: str) -> None:
        """Get ready to reduce with kernel ``backend``; ValueError if it cannot."""

    def attach(self, key: int, path: str, size: int) -> None:
        """Make region ``key`` usable; raise OSError or ValueError if it cannot be."""

    def detach(self, key: int) -> None:
        """Forget region ``key`` (unknown keys are ignored)."""

    def reduce(self, dtype: np.dtype[Any], op: str, refs: list[tuple[int, int]],
               count: int) -> None:
        """Load ``count`` elements at each ``(key, byte offset)``, reduce, store into all."""


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
    regions: int
    nack_codes: dict[str, int]
    engine: EngineStats
    #: per tenant: jobs, slots and slot memory in use here, jobs refused by its quota
    tenants: dict[str, dict[str, int]]


@dataclass
class _Counters:
    frames_in: int = 0
    bytes_in: int = 0
    forwarded: int = 0
    reduce_frames: int = 0
    results_sent: int = 0
    missing_asked: int = 0  # MISSING NACKs: a member asked for one lost contribution
    ctrl_frames: int = 0
    malformed: int = 0
    unauthorised: int = 0
    nacks_sent: int = 0
    nacks_received: int = 0
    unroutable: int = 0
    # semantic distance of what the switch does to payloads: one per
    # contribution copied or reduced into slot memory (frame plane), one per
    # result stored into a member's region (memory plane)
    payload_copies: int = 0
    mem_stores: int = 0
    mcast_frames: int = 0  # Flag.MCAST frames in, and the copies sent for them
    mcast_copies: int = 0
    jobs_refused: int = 0
    nack_codes: dict[str, int] = field(default_factory=dict)


class SwitchCore:
    """The protocol logic of one switch of ``topo`` (see the module doc)."""

    def __init__(self, topo: Topology, name: str, *, memory_budget: int = 256 * 2**20,
                 memory: MemoryPlane | None = None,
                 extra_stats: Callable[[], dict[str, Any]] | None = None,
                 attach_doorbell: Callable[[bytes, str], None] | None = None) -> None:
        self.topo = topo
        # the driver's hook that maps a worker's shared-memory doorbell for its port
        # (emulation on one host); None: every frame keeps to the sockets
        self._attach_doorbell = attach_doorbell
        self._extra_stats = extra_stats  # the driver's own counters, for stats replies
        self.name = name
        self.node = topo.node(name)
        self.id = self.node.id
        self.memory = memory
        self.engine = AggregationEngine(memory_budget)
        self.regions = RegionTable()
        self.counters = _Counters()
        self._attached = set(topo.attached(name))
        # port of each attached node, and the node id each node port speaks for
        self._ident: dict[int, bytes] = {}
        self._port_node: dict[bytes, int] = {}
        for n in topo.nodes:
            if n.name in self._attached:
                self._ident[n.id] = n.name.encode()
                if not n.is_switch:
                    self._port_node[n.name.encode()] = n.id
        self._attached_ids = set(self._port_node.values())
        self._worker_ids = frozenset(w.id for w in topo.workers)
        self._switch_ports: set[bytes] = set()
        for link in topo.links_of(name):
            other = topo.node(link.other(name))
            if other.is_switch:
                self._switch_ports.add(other.name.encode())
                self._ident[other.id] = other.name.encode()
        self._next_hop = _next_hops(topo, name, self._attached)
        # link-up: we say hello to lower-id neighbour switches until welcomed and
        # wait for the hello of every higher-id one
        self._lower = {s for s in self._switch_ports if topo.node(s.decode()).id < self.id}
        self._higher = self._switch_ports - self._lower
        self._linked: set[bytes] = set()
        self._hellos: set[bytes] = set()
        self._hello_due = 0.0
        # aggregation tree: workers below this switch and below each child switch
        tree = topo.aggregation_tree()
        self._in_tree = name in tree
        self._parent_name = tree.get(name)
        self._below: set[int] = set()
        self._child_below: dict[int, set[int]] = {}
        if self._in_tree:
            self._below = {topo.node(w).id for w in topo.subtree_workers(name)}
            for c in topo.tree_children(name):
                self._child_below[topo.node(c).id] = {
                    topo.node(w).id for w in topo.subtree_workers(c)}
        self._jobs: dict[int, JobSpec] = {}
        self._phase: dict[int, JobPhase] = {}
        self._job_members: dict[int, frozenset[int]] = {}  # every member, whole tree
        self._job_last: dict[int, int] = {}
        # per job: every chunk below ``_done_below`` has had its results sent, and
        # the chunks above it that have too; RESULT frames carry a mark (offset,
        # per member: _mark_for) so a member whose result is missing can tell
        # "lost" from "not complete yet"
        self._done_below: dict[int, int] = {}
        self._done_above: dict[int, set[int]] = {}
        self._refs: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._job_parent: dict[int, int] = {}
        self._awaiting: set[tuple[int, int]] = set()
        self._up_pending: dict[int, dict[int, bytes]] = {}
        # loss detection at the switch: per (job, member) the highest chunk seen, and
        # the (job, chunk, member) already asked to resend
        self._high: dict[tuple[int, int], int] = {}
        self._asked: set[tuple[int, int, int, int]] = set()
        self._asked_n: dict[tuple[int, int, int], int] = {}
        # multicast groups (Flag.MCAST frames name one as dst): gid -> member ids; the
        # tree root allocates gids by (members, nth creation); others learn them as
        # the root's answers pass down
        self._groups: dict[int, tuple[int, ...]] = {
            0: tuple(sorted(w.id for w in topo.workers))}
        self._group_ids: dict[tuple[tuple[int, ...], int], int] = {}
        self._group_wait: dict[tuple[tuple[int, ...], int], dict[int, bytes]] = {}
        # jobs whose chunk results go to one owner (reduce, reduce_scatter): the
        # others get a header-only completion; owner of each awaited tree partial
        self._owned: set[int] = set()
        # which creation of its group a job belongs to: a late release from a closed
        # group must not free the same job id registered anew by a newer group
        self._job_tag: dict[int, int] = {}
        # tenants: what each uses here (quotas from the topology), and each job's share
        self._tenant_use: dict[str, dict[str, int]] = {}
        self._job_share: dict[int, tuple[str, int, int]] = {}
        self._await_owner: dict[tuple[int, int], int] = {}
        # in-network combine: (home, msg, stream, token) -> running sum and who is in;
        # finished sums are kept (bounded) for a home that lost one
        self._combine: dict[tuple[int, int, int, int], _CombineSum] = {}
        self._combine_done: OrderedDict[tuple[int, int, int, int], _CombineSum] = OrderedDict()
        self._barriers: dict[int, dict[int, bytes]] = {}
        self._barriers_done: deque[int] = deque(maxlen=BARRIERS_KEPT)
        self._ctrl_crc = False
        self._out: list[Output] = []

    # ------------------------------------------------------------------ API
    @property
    def ready(self) -> bool:
        """True once every switch-to-switch link is up (nodes may start then)."""
        return self._linked >= self._lower and self._higher <= self._hellos

    def job_phase(self, job: int) -> JobPhase | None:
        """Where ``job`` is in its lifecycle at this switch (None: never seen)."""
        return self._phase.get(job)

    def handle(self, port: bytes, header: Any, payload: Any, now: float) -> list[Output]:
        """One frame arrived on ``port`` (header buffer, payload buffer or None)."""
        out = self._out = []
        try:
            self._process(port, header, payload)
        except Exception as exc:  # the guard: no frame may stop the switch
            self.counters.malformed += 1
            code = exc.code if isinstance(exc, (FrameError, AccessError)) else NackCode.MALFORMED
            try:
                _op, _fl, src, job, psn, _k, _o, _l = fr.peek(header)
            except FrameError:
                src, job, psn = 0, 0, 0
            self._nack(port, src, job, psn, 0, code, f"refused: {type(exc).__name__}: {exc}")
        return out

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` next has work (link-up hellos), or None."""
        return None if self._linked >= self._lower else self._hello_due

    def handle_timer(self, now: float) -> list[Output]:
        """Say hello again to neighbour switches that have not welcomed us."""
        out = self._out = []
        if now >= self._hello_due and not self._linked >= self._lower:
            self._hello_due = now + HELLO_INTERVAL_S
            for peer in sorted(self._lower - self._linked):
                out.append((peer, fr.encode(Op.CTRL, src=self.id, dst=self.topo.node(
                    peer.decode()).id, payload=control.pack("hello", name=self.name)), None))
        return out

    def statistics(self) -> SwitchStats:
        """A frozen snapshot of the counters."""
        c = asdict(self.counters)
        c["nack_codes"] = dict(self.counters.nack_codes)
        tenants = {t: dict(u) for t, u in self._tenant_use.items()}
        return SwitchStats(switch=self.name, regions=len(self.regions),
                           engine=self.engine.statistics(), tenants=tenants, **c)

    # ------------------------------------------------------------------ sending
    def _send(self, port: bytes, header: Any, payload: Any = None) -> None:
        self._out.append((port, header, payload))

    def _nack(self, port: bytes, f_src: int, job: int, psn: int, msg: int, code: NackCode,
              why: str) -> None:
        c = self.counters
        c.nacks_sent += 1
        c.nack_codes[code.name] = c.nack_codes.get(code.name, 0) + 1
        self._send(port, fr.encode_nack(src=self.id, dst=f_src, flow=0, psn=psn, code=code,
                                        job=job, msg=msg))

    def _ctrl(self, port: bytes, dst: int, t: str, **fields: Any) -> None:
        # CRC whenever the fabric checks (a requester asked with one)
        self._send(port, fr.encode(Op.CTRL, src=self.id, dst=dst, crc=self._ctrl_crc,
                                   payload=control.pack(t, **fields)))

    # ------------------------------------------------------------------ dispatch
    def _process(self, port: bytes, header: Any, payload: Any) -> None:
        c = self.counters
        c.frames_in += 1
        c.bytes_in += len(header) + (memoryview(payload).nbytes if payload is not None else 0)
        try:
            f = fr.decode(header, payload)
        except FrameError as exc:
            c.malformed += 1
            try:
                _op, _fl, src, job, psn, _k, _o, _l = fr.peek(header)
            except FrameError:
                src, job, psn = 0, 0, 0
            self._nack(port, src, job, psn, 0, exc.code, str(exc))
            return
        speaker = self._port_node.get(port)
        if speaker is not None and f.src != speaker:
            # the port is the sender's identity: no node speaks for another
            c.unauthorised += 1
            self._nack(port, speaker, f.job, f.psn, f.msg, NackCode.PERMISSION,
                       f"frame from port {port.decode(errors='replace')} claims src {f.src}")
            return
        if speaker is None and port not in self._switch_ports:
            # not a link of ours: a monitor (`semfab stats`) may read counters, nothing else
            if f.op is Op.CTRL and f.dst == self.id and control.parse(f.payload).get("t") \
                    == "stats":
                self._on_ctrl(f, port, {"t": "stats"})
            else:
                c.unauthorised += 1
            return
        if f.flags & Flag.MCAST:
            self._multicast(f, port, header, payload)
        elif f.op is Op.REDUCE and f.flow == COMBINE_FLOW and f.key and speaker is not None:
            self._on_combine(f, port)
        elif f.op is Op.NACK and f.flow == COMBINE_FLOW and f.dst == self.id:
            self._resend_combine(f, port)
        elif f.dst != self.id:
            self._forward(f, port, header, payload)
        elif f.op is Op.REDUCE:
            c.reduce_frames += 1
            self._on_reduce(f, port)
        elif f.op is Op.RESULT:
            self._on_parent_result(f, port)
        elif f.op is Op.CTRL:
            c.ctrl_frames += 1
            self._ctrl_crc = self._ctrl_crc or bool(f.flags & Flag.CRC)
            try:
                self._on_ctrl(f, port, control.parse(f.payload))
            except (FrameError, AccessError) as exc:
                c.malformed += 1
                self._nack(port, f.src, f.job, f.psn, f.msg, exc.code, str(exc))
        elif f.op in (Op.NACK, Op.ACK):
            # never answer a NACK with a NACK (two switches would ping-pong);
            # a tree switch recovers through its members' retransmissions
            c.nacks_received += 1
            if f.op is Op.NACK and f.offset == NackCode.MISSING:
                self._resend_partial(f)
        else:
            self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.UNSUPPORTED,
                       f"switch does not serve {f.op.name}")

    def _forward(self, f: fr.Frame, port: bytes, header: Any, payload: Any) -> None:
        dst_port = self._next_hop.get(f.dst)
        if dst_port is None:
            self.counters.unroutable += 1
            self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.PERMISSION,
                       f"no node with id {f.dst}")
            return
        self.counters.forwarded += 1
        # header and payload buffers pass through unchanged (payload zero-copy)
        self._send(dst_port, bytes(header), payload)

    def _multicast(self, f: fr.Frame, port: bytes, header: Any, payload: Any) -> None:
        """Replicate a Flag.MCAST frame (dst = group id) to every port that leads to
        a member, except the one it came on: in a tree each switch serves the
        members on its side, so every member gets one copy, the sender none."""
        members = self._groups.get(f.dst)
        if members is None:
            self.counters.unroutable += 1
            self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.UNKNOWN_JOB,
                       f"no multicast group {f.dst}")
            return
        if f.src not in members:
            self.counters.unauthorised += 1
            self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.PERMISSION,
                       f"node {f.src} is not in multicast group {f.dst}")
            return
        self.counters.mcast_frames += 1
        ports: list[bytes] = []
        mask = f.key  # a member mask (bit i: the i-th member by id); 0: every member
        for i, m in enumerate(members):
            out = self._next_hop.get(m)
            if mask and not mask >> i & 1:
                continue
            if m != f.src and out is not None and out != port and out not in ports:
                ports.append(out)
        head = bytes(header)
        for out in ports:  # one header, one payload buffer: zero-copy replicas
            self._send(out, head, payload)
        self.counters.mcast_copies += len(ports)
        self.counters.forwarded += len(ports)

    def _on_combine(self, f: fr.Frame, port: bytes) -> None:
        """Partials of tokens of one home from one rank (MoE combine, in the network):
        ``offset`` tokens (int32 ids, then one vector each), ``key`` contributions
        expected below this switch for each. A token whose contributions are all in
        goes on to its home (``dst``), those completed by one frame in one frame;
        the sender gets one ACK per frame."""
        home, n = f.dst, f.offset
        if home not in self._worker_ids:
            raise FrameError(NackCode.MALFORMED, f"combine for node {home}: not a worker")
        if f.dtype not in _FLOAT_CODES or not 0 < f.key <= len(self._attached_ids) or n <= 0:
            raise FrameError(NackCode.MALFORMED,
                             f"combine frame: dtype {f.dtype}, {f.key} contributions, {n} tokens")
        dt = DTYPES[fr.DTYPE_NAMES[f.dtype]]
        vec_bytes, rest = divmod(f.length - 4 * n, n)
        if f.length <= 4 * n or rest or vec_bytes % dt.itemsize:
            raise FrameError(NackCode.MALFORMED, f"combine frame of {f.length} B for {n} tokens")
        raw = np.frombuffer(f.payload, np.uint8)
        tokens = raw[:4 * n].view(np.int32)
        vecs = raw[4 * n:].view(dt).reshape(n, -1)
        done_now: list[tuple[int, _CombineSum]] = []
        for t, v in zip(tokens.tolist(), vecs, strict=True):
            k = (home, f.msg, f.job, t)
            if k in self._combine_done:
                continue  # a resent frame: this token is summed already
            acc = self._combine.get(k)
            if acc is None:
                acc = self._combine[k] = _CombineSum(np.zeros(v.size, np.float32), set(), f.key,
                                                     f.dtype)
            if v.size != acc.total.size or f.key != acc.expected or f.dtype != acc.dtype:
                raise FrameError(NackCode.MALFORMED, f"combine of token {t}: contributions "
                                 "of different sizes or counts")
            if f.src not in acc.seen:
                acc.seen.add(f.src)
                acc.total += v
                self.counters.payload_copies += 1
            if len(acc.seen) >= acc.expected:
                del self._combine[k]
                acc.result = acc.total.astype(dt)
                self._combine_done[k] = acc
                done_now.append((t, acc))
        while len(self._combine_done) > COMBINE_KEPT:
            self._combine_done.popitem(last=False)
        self._send(self._ident[f.src], fr.encode_header(  # key: the tokens' home
            Op.ACK, src=self.id, dst=f.src, flow=COMBINE_FLOW + 1, job=f.job, psn=f.psn,
            key=home, msg=f.msg))
        if done_now:
            self._send_combine(home, f.msg, f.job, done_now)

    def _send_combine(self, home: int, msg: int, stream: int,
                      items: list[tuple[int, _CombineSum]]) -> None:
        """Finished sums of tokens of ``home``, in one frame."""
        ids = np.array([t for t, _ in items], np.int32)
        vecs = [acc.result for _, acc in items if acc.result is not None]
        body = np.concatenate([ids.view(np.uint8), *(byte_view(v) for v in vecs)])
        self.counters.results_sent += 1
        self._send(self._next_hop[home], fr.encode_header(
            Op.REDUCE, src=self.id, dst=home, flow=COMBINE_FLOW, job=stream, psn=int(ids[0]),
            offset=len(items), msg=msg, dtype=items[0][1].dtype, payload=body,
            crc=self._ctrl_crc), body)

    def _resend_combine(self, f: fr.Frame, port: bytes) -> None:
        """A home lost our sum of one token (it asks by NACK): send it again."""
        acc = self._combine_done.get((f.src, f.msg, f.job, f.psn))
        if acc is not None:
            self._send_combine(f.src, f.msg, f.job, [(f.psn, acc)])

    # ------------------------------------------------------------------ aggregation
    def _on_reduce(self, f: fr.Frame, port: bytes) -> None:
        spec = self._jobs.get(f.job)
        if spec is None:
            code = NackCode.NO_RESOURCE if self._phase.get(f.job) is JobPhase.REFUSED \
                else NackCode.UNKNOWN_JOB
            self._nack(port, f.src, f.job, f.psn, f.msg, code,
                       f"job {f.job} is not registered")
            return
        if fr.DTYPE_NAMES[f.dtype] != spec.dtype:
            self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.MALFORMED,
                       f"frame dtype {fr.DTYPE_NAMES[f.dtype]} but job {f.job} is {spec.dtype}")
            return
        if f.job in self._owned and f.key not in self._job_members.get(f.job, ()):
            self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.MALFORMED,
                       f"job {f.job} delivers to an owner: key {f.key} is not a member")
            return
        chunk = unwrap_psn(f.psn, self._job_last.get(f.job, 0))
        pending: dict[int, tuple[int, int]] | None = None
        had_ref = False
        if spec.referenced:
            if not f.referenced:
                self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.MALFORMED,
                           "memory-plane job needs REF frames")
                return
            try:
                info = self.regions.check(f.key, f.offset, f.length, f.src)
            except AccessError as exc:
                self._nack(port, f.src, f.job, f.psn, f.msg, exc.code, str(exc))
                return
            if info.owner != f.src:
                self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.PERMISSION,
                           f"node {f.src} contributes from region {f.key:#x} of node "
                           f"{info.owner}")
                return
            pending = self._refs.setdefault((f.job, chunk), {})
            had_ref = f.src in pending
            pending[f.src] = (f.key, f.offset)
            data = None
        else:
            if f.referenced:
                self._nack(port, f.src, f.job, f.psn, f.msg, NackCode.MALFORMED,
                           "frame-plane job needs inline payloads")
                return
            data = np.frombuffer(f.payload, dtype=DTYPES[spec.dtype])
        events = self.engine.contribute(f.job, chunk, f.src, data, length=f.elements)
        completed = False
        for ev in events:
            if isinstance(ev, Completed):
                completed = True
                self._job_last[f.job] = max(self._job_last.get(f.job, 0), ev.chunk)
                if spec.referenced:
                    self._reduce_regions(spec, ev.chunk, f.elements)
                if f.job in self._job_parent:  # a partial: up first, results come down
                    self._awaiting.add((f.job, ev.chunk))
                    if f.job in self._owned:
                        self._await_owner[(f.job, ev.chunk)] = f.key
                    self._send_up(spec, ev.chunk, ev.result, f, retx=False)
                else:
                    self._mark_done(f.job, ev.chunk)
                    self._send_results(spec, ev.chunk, ev.recipients, ev.result, f)
            elif isinstance(ev, ResendResult):
                if (f.job, ev.chunk) in self._awaiting:
                    # we only hold our partial: ask the parent again instead
                    self._send_up(spec, ev.chunk, ev.result, f, retx=True)
                else:
                    self._send_results(spec, ev.chunk, (ev.member,), ev.result, f)
            elif isinstance(ev, Rejected):
                self._nack(port, f.src, f.job, f.psn, f.msg, NackCode[ev.code], ev.reason)
            # DuplicateIgnored, Stale: counted by the engine; nothing to send
        counted = completed or not events
        if counted:
            self._ask_missing(f, port, chunk)
        if pending is not None and not counted and not had_ref:
            # refused, stale or answered from the kept result: forget the address
            pending.pop(f.src, None)
            if not pending:
                self._refs.pop((f.job, chunk), None)
        if data is not None and counted:
            self.counters.payload_copies += 1

    def _ask_missing(self, f: fr.Frame, port: bytes, chunk: int) -> None:
        """A member's chunk ``chunk`` came, skipping chunks still waiting for it: those
        were lost on its link. Ask that member alone, once per chunk (the others'
        contributions are in: they need not resend, as they would on a timeout)."""
        key = (f.job, f.src)
        high = self._high.get(key)
        self._high[key] = chunk if high is None else max(high, chunk)
        if high is not None and chunk > high:
            # every chunk below this one still waiting for this member (from the
            # oldest incomplete one): lost on its link, or not sent yet (its slot's
            # result came late; the member then ignores the ask, see
            # fabric.core.programs.InaAllreduce). A chunk asked before is asked again
            # with this newer proof (the ask or the resend may be lost too), a few
            # times at most.
            lo = max(self._done_below.get(f.job, 0), chunk - MISSING_SCAN)
            for c in range(lo, chunk):
                if self.engine.pending(f.job, c, f.src):
                    self._ask(f.job, c, f.src, f.msg, chunk)
        # this chunk now waits only for members that already sent later chunks:
        # their contribution to it was lost
        out = self.engine.missing(f.job, chunk)
        if 0 < len(out) <= MISSING_FEW:
            for m in out:
                proof = self._high.get((f.job, m), -1)
                if proof > chunk:
                    self._ask(f.job, chunk, m, f.msg, proof)

    def _ask(self, job: int, chunk: int, member: int, msg: int, proof: int) -> None:
        """NACK MISSING to ``member`` for ``chunk``; ``proof`` is a later chunk of its
        that arrived (the member resends only if it sent ``chunk`` before ``proof``)."""
        # the member ignores an ask about a chunk it sent after the proof: a later
        # proof may ask again (a few times)
        ask = (job, chunk, member, proof)
        port = self._ident.get(member)
        times = self._asked_n.get((job, chunk, member), 0)
        if ask in self._asked or port is None or times >= MISSING_ASKS:
            return
        self._asked.add(ask)
        self._asked_n[(job, chunk, member)] = times + 1
        if len(self._asked) > ASKED_KEPT:  # old asks: their chunks are long complete
            self._asked.clear()
            self._asked_n.clear()
        self.counters.missing_asked += 1
        c = self.counters
        c.nacks_sent += 1
        c.nack_codes["MISSING"] = c.nack_codes.get("MISSING", 0) + 1
        self._send(port, fr.encode_nack(src=self.id, dst=member, flow=0, psn=chunk & PSN_MASK,
                                        code=NackCode.MISSING, job=job, msg=msg,
                                        key=proof & PSN_MASK))

    def _reduce_regions(self, spec: JobSpec, chunk: int, count: int) -> None:
        """Memory plane: ld_reduce from every member's region, st into every one."""
        refs = self._refs.pop((spec.job, chunk))
        assert self.memory is not None  # a referenced job is refused without one
        self.memory.reduce(DTYPES[spec.dtype], spec.op.value,
                           [refs[m] for m in spec.members], count)
        self.counters.mem_stores += len(refs)
        self.counters.payload_copies += len(refs)

    def _mark_done(self, job: int, chunk: int) -> None:
        """Chunk ``chunk`` of ``job`` is complete here: its results go out now."""
        low = self._done_below.get(job, 0)
        if chunk < low:
            return
        above = self._done_above.setdefault(job, set())
        above.add(chunk)
        while low in above:
            above.discard(low)
            low += 1
        self._done_below[job] = low

    def _mark_for(self, spec: JobSpec, member: int) -> int:
        """The completion mark a RESULT to ``member`` carries: every chunk below it is
        complete, or still lacks ``member``'s contribution (which was then lost, or
        is on its way). Either way a missing result below it calls for a resend,
        and one above it waits for another member. Per member, it passes the
        chunks that wait only for others, which a mark common to all cannot."""
        job = spec.job
        low = self._done_below.get(job, 0)
        top = min(self._job_last.get(job, -1) + 1, low + 2 * spec.slots)  # chunks held
        if low >= top:
            return low
        above = self._done_above.get(job, ())
        engine, awaiting = self.engine, self._awaiting
        for c in range(low, top):
            # member's contribution is in and the chunk waits for others: for
            # another member here, or (complete here) for the parent's result
            if c not in above and ((job, c) in awaiting or engine.contributed(job, c, member)):
                return c
        return top

    def _send_results(self, spec: JobSpec, chunk: int, recipients: tuple[int, ...],
                      result: np.ndarray | None, f: fr.Frame) -> None:
        crc = bool(f.flags & Flag.CRC)  # answer in kind: a sender that checks gets checked
        owner = f.key if spec.job in self._owned else None
        for member in recipients:
            port = self._ident[member]
            done = self._mark_for(spec, member) & PSN_MASK
            if owner is not None and member != owner and owner not in \
                    self._child_below.get(member, ()):
                # not the owner's side: a header-only completion (self-clocks its window)
                self._send(port, fr.encode_header(
                    Op.RESULT, src=self.id, dst=member, job=spec.job, psn=chunk & PSN_MASK,
                    dtype=f.dtype, msg=f.msg, key=owner, offset=done, crc=crc))
                self.counters.results_sent += 1
                continue
            if result is None:
                header = fr.encode_header(Op.RESULT, src=self.id, dst=member, job=spec.job,
                                          psn=chunk & PSN_MASK, dtype=f.dtype, msg=f.msg,
                                          flags=Flag.REF, length=f.length, offset=done,
                                          crc=crc)
                self._send(port, header)
            else:
                body = byte_view(result)
                header = fr.encode_header(Op.RESULT, src=self.id, dst=member, job=spec.job,
                                          psn=chunk & PSN_MASK, dtype=f.dtype, msg=f.msg,
                                          payload=body, key=owner or 0, offset=done, crc=crc)
                self._send(port, header, body)
            self.counters.results_sent += 1

    def _on_parent_result(self, f: fr.Frame, port: bytes) -> None:
        """The final result of a chunk we sent up as a partial: keep it, pass it down."""
        spec = self._jobs.get(f.job)
        parent = self._job_parent.get(f.job)
        if spec is None or parent is None or f.src != parent:
            # only our parent switch sends us results
            self.counters.unauthorised += 1
            return
        chunk = unwrap_psn(f.psn, self._job_last.get(f.job, 0))
        if (f.job, chunk) not in self._awaiting:
            return  # a late copy: the chunk's result was already passed down
        data = np.frombuffer(f.payload, dtype=DTYPES[spec.dtype])
        owned = f.job in self._owned
        if owned and f.key != self._await_owner.get((f.job, chunk)):
            self.counters.malformed += 1
            return
        if owned and f.length == 0:
            pass  # the owner is elsewhere: completions only (our partial stays kept)
        elif not self.engine.install_result(f.job, chunk, data):
            self.counters.malformed += 1
            return
        self._awaiting.discard((f.job, chunk))
        self._await_owner.pop((f.job, chunk), None)
        self._mark_done(f.job, chunk)
        self._send_results(spec, chunk, spec.members, data, f)

    def _resend_partial(self, f: fr.Frame) -> None:
        """Our parent lost our partial of a chunk: send it again (we keep it)."""
        spec = self._jobs.get(f.job)
        if spec is None or self._job_parent.get(f.job) != f.src:
            return
        chunk = unwrap_psn(f.psn, self._job_last.get(f.job, 0))
        partial = self.engine.kept_result(f.job, chunk)
        if (f.job, chunk) in self._awaiting and partial is not None:
            flags = Flag.CRC if self._ctrl_crc else Flag.NONE  # checked where the fabric checks
            self._send_up(spec, chunk, partial, f._replace(dtype=fr.dtype_from_name(
                spec.dtype), flags=flags, key=self._await_owner.get((f.job, chunk), 0)),
                retx=True)

    def _send_up(self, spec: JobSpec, chunk: int, partial: np.ndarray | None,
                 f: fr.Frame, retx: bool) -> None:
        """Our subtree's partial sum of ``chunk``, as our contribution to the parent."""
        parent = self._job_parent[spec.job]
        assert partial is not None
        body = byte_view(partial)
        header = fr.encode_header(Op.REDUCE, src=self.id, dst=parent, job=spec.job,
                                  psn=chunk & PSN_MASK, dtype=f.dtype, msg=f.msg,
                                  key=f.key if spec.job in self._owned else 0,
                                  payload=body, flags=Flag.RETX if retx else Flag.NONE,
                                  crc=bool(f.flags & Flag.CRC))
        self._send(self._next_hop[parent], header, body)

    # ------------------------------------------------------------------ control
    def _on_ctrl(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == "hello":
            if port in self._switch_ports:
                self._hellos.add(port)
            self._ctrl(port, f.src, "welcome", switch=self.name, id=self.id)
        elif t == "welcome":  # a lower neighbour answered our uplink hello
            if port in self._lower:
                self._linked.add(port)
        elif t == "job_reply":  # our parent, about a tree job
            self._on_job_reply(f, msg)
        elif t == "job":
            self._register_job(f, port, msg)
        elif t == "release":
            tag = msg.get("tag")
            self._release_job(f, port, control.need(msg, "job", int),
                              tag if isinstance(tag, int) else None)
        elif t == "region":
            self._register_region(f, port, msg)
        elif t == "unregister":
            key = control.need(msg, "key", int)
            if key in self.regions:
                if self.regions.get(key).owner != f.src:
                    raise AccessError(NackCode.PERMISSION,
                                      f"node {f.src} may not unregister region {key:#x}")
                if any(key == k for refs in self._refs.values() for k, _ in refs.values()):
                    raise AccessError(NackCode.PERMISSION,
                                      f"region {key:#x} is named by a chunk in progress")
                self.regions.remove(key)
                if self.memory is not None:
                    self.memory.detach(key)
            # idempotent: an unknown key is already gone
            self._ctrl(port, f.src, "region_reply", key=key, ok=True, reason="")
        elif t == "doorbell":
            self._on_doorbell(f, port, msg)
        elif t == "barrier":
            self._on_barrier(f, port, msg)
        elif t == "group":
            self._on_group(f, port, msg)
        elif t == "group_reply":
            self._on_group_reply(f, msg)
        elif t == "group_release":
            self._on_group_release(f, port, msg)
        elif t == "stats":
            stats = _plain(self.statistics())
            if self._extra_stats is not None:
                stats.update(self._extra_stats())
            self._ctrl(port, f.src, "stats", **stats)
        else:
            raise FrameError(NackCode.MALFORMED, f"unknown control message type {t!r}")

    def _same_host(self, node_id: int) -> bool:
        """True when node ``node_id`` runs on this switch's host (the topology's
        placement): only then is its shared memory mappable here."""
        topo = self.topo
        return topo.host_address(topo.by_id(node_id).name) == topo.host_address(self.name)

    def _on_doorbell(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        """A worker on our host offers a shared-memory doorbell for its descriptors."""
        path = control.need(msg, "path", str)
        reason = ""
        if self._attach_doorbell is None:
            reason = f"switch {self.name} has no doorbells (it is not on a shared host)"
        elif port in self._switch_ports or self._port_node.get(port) != f.src:
            reason = "doorbells are for the nodes attached to this switch"
        elif not self._same_host(f.src):
            reason = f"node {f.src} runs on another host than switch {self.name}"
        elif not path.endswith(f"{DOORBELL_SUFFIX}{f.src}"):
            # a node names its own doorbell only, never another node's
            reason = f"node {f.src}'s doorbell file must end in {DOORBELL_SUFFIX}{f.src}"
        else:
            try:
                self._attach_doorbell(port, path)
            except (OSError, ValueError) as exc:
                reason = str(exc)
        self._ctrl(port, f.src, "doorbell_reply", ok=not reason, reason=reason)

    def _on_barrier(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        # idempotent: a resent arrival counts once; a finished barrier answers again
        bid = control.need(msg, "id", int)
        n = control.need(msg, "n", int)
        if not 1 <= n <= len(self.topo.nodes):
            raise FrameError(NackCode.MALFORMED, f"barrier of {n} nodes")
        group = self._groups.get(bid >> 32) if bid >> 32 else None
        if group is not None and f.src not in group:
            # a communicator's barrier counts its members only (no other tenant's)
            raise AccessError(NackCode.PERMISSION,
                              f"node {f.src} is not in group {bid >> 32} of barrier {bid:#x}")
        if bid in self._barriers_done:
            self._ctrl(port, f.src, "barrier_done", id=bid)
            return
        waiting = self._barriers.setdefault(bid, {})
        waiting[f.src] = port  # by node: several may arrive over one switch link
        if len(waiting) >= n:
            for src, who in self._barriers.pop(bid).items():
                self._ctrl(who, src, "barrier_done", id=bid)
            self._barriers_done.append(bid)

    def _group_key(self, f: fr.Frame, port: bytes,
                   msg: dict[str, Any]) -> tuple[tuple[int, ...], int]:
        members = control.need(msg, "members", list)
        nth = control.need(msg, "nth", int)
        workers = {w.id for w in self.topo.workers}
        if not members or any(not isinstance(m, int) or m not in workers for m in members) \
                or len(set(members)) != len(members) or nth < 0:
            raise FrameError(NackCode.MALFORMED, "group members must be distinct worker ids")
        if port not in self._switch_ports and f.src not in members:
            raise AccessError(NackCode.PERMISSION, f"node {f.src} is not in the group it names")
        return tuple(sorted(members)), nth

    def _on_group(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        """A member creates a multicast group (idempotent): the tree root allocates its
        id for (members, nth); other switches ask their parent and learn the answer."""
        key = self._group_key(f, port, msg)
        gid = self._group_ids.get(key)
        if gid is None and self._parent_name is None:
            used = set(self._groups)
            gid = next((g for g in range(1, MAX_GROUPS + 1) if g not in used), None)
            if gid is None:
                self._ctrl(port, f.src, "group_reply", members=list(key[0]), nth=key[1],
                           gid=-1, reason=f"all {MAX_GROUPS} multicast groups are in use; "
                           "close communicators you no longer need")
                return
            self._group_ids[key] = gid
            self._groups[gid] = key[0]
        if gid is not None:
            self._ctrl(port, f.src, "group_reply", members=list(key[0]), nth=key[1], gid=gid,
                       reason="")
            return
        # ask the parent on every retry (our request or its answer may be lost)
        self._group_wait.setdefault(key, {})[f.src] = port
        assert self._parent_name is not None
        parent = self.topo.node(self._parent_name).id
        self._ctrl(self._next_hop[parent], parent, "group", members=list(key[0]), nth=key[1])

    def _on_group_reply(self, f: fr.Frame, msg: dict[str, Any]) -> None:
        parent = self._parent_name
        if parent is None or f.src != self.topo.node(parent).id:
            self.counters.unauthorised += 1  # only our parent allocates for us
            return
        key = (tuple(sorted(control.need(msg, "members", list))), control.need(msg, "nth", int))
        gid = control.need(msg, "gid", int)
        if 0 < gid <= MAX_GROUPS:
            self._group_ids[key] = gid
            self._groups[gid] = key[0]
        for src, who in self._group_wait.pop(key, {}).items():
            self._ctrl(who, src, "group_reply", members=list(key[0]), nth=key[1], gid=gid,
                       reason=str(msg.get("reason", "")))

    def _on_group_release(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        """A member closed its communicator: forget the group (idempotent; a release
        naming an older group with the same id is ignored)."""
        key = self._group_key(f, port, msg)
        gid = self._group_ids.pop(key, None)
        if gid is not None and self._groups.get(gid) == key[0]:
            del self._groups[gid]
        if self._parent_name is not None and gid is not None:
            parent = self.topo.node(self._parent_name).id
            self._ctrl(self._next_hop[parent], parent, "group_release", members=list(key[0]),
                       nth=key[1])
        if port not in self._switch_ports:
            self._ctrl(port, f.src, "group_released", members=list(key[0]), nth=key[1])

    def _transition(self, job: int, event: str) -> JobPhase:
        new = JOB_TRANSITIONS.get((self._phase.get(job), event))
        if new is None:
            raise FrameError(NackCode.MALFORMED,
                             f"job {job}: cannot {event} while {self._phase.get(job)}")
        self._phase[job] = new
        return new

    def _register_job(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
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
            raise FrameError(NackCode.MALFORMED, f"bad job spec: {exc}") from None
        workers = {w.id for w in self.topo.workers}
        if any(not isinstance(m, int) or m not in workers for m in spec.members):
            raise FrameError(NackCode.MALFORMED, f"job {spec.job}: members must be worker ids")
        from_child = port in self._switch_ports
        if not from_child and f.src not in spec.members:
            raise AccessError(NackCode.PERMISSION,
                              f"node {f.src} is not a member of job {spec.job}")
        known = self._job_members.get(spec.job)
        if known is not None and known != frozenset(spec.members) \
                and self._phase.get(spec.job) is not JobPhase.RELEASED:
            raise AccessError(NackCode.PERMISSION,
                              f"job {spec.job} is registered with other members")
        # Tree aggregation: this switch sums its attached members and the partial
        # sums of its child switches; with members outside its subtree it sends
        # its own partial up to its parent and passes the parent's result down.
        local = [m for m in spec.members if m in self._attached_ids]
        children = [c for c, below in self._child_below.items()
                    if any(m in below for m in spec.members)]
        outside = [m for m in spec.members if m not in self._below]
        parent = self._parent_name if outside else None
        if (spec.referenced and (children or outside)) or (outside and parent is None):
            self.counters.jobs_refused += 1
            self._transition(spec.job, "refuse")
            why = ("the memory plane aggregates on one switch" if spec.referenced
                   else f"members {outside[:8]} are not below {self.name}")
            self._ctrl(port, f.src, "job_reply", job=spec.job, granted=False,
                       reason=f"{why}; run it on a single-switch fabric")
            return
        if spec.referenced and self.memory is None:
            self.counters.jobs_refused += 1
            self._transition(spec.job, "refuse")
            self._ctrl(port, f.src, "job_reply", job=spec.job, granted=False,
                       reason=f"switch {self.name} has no memory plane")
            return
        if spec.referenced:
            assert self.memory is not None
            try:
                self.memory.prepare(str(msg.get("backend", "numba-cpu")))
            except ValueError as exc:
                self.counters.jobs_refused += 1
                self._transition(spec.job, "refuse")
                self._ctrl(port, f.src, "job_reply", job=spec.job, granted=False,
                           reason=str(exc))
                return
        mine = JobSpec(spec.job, tuple(local + children), spec.dtype, spec.op, spec.slots,
                       spec.slot_elems, spec.referenced)
        over = self._over_quota(mine, spec.members)
        if over is not None:
            self.counters.jobs_refused += 1
            self._transition(spec.job, "refuse")
            self._ctrl(port, f.src, "job_reply", job=spec.job, granted=False, reason=over)
            return
        reply = self.engine.register(mine)
        if not isinstance(reply, Granted):
            self.counters.jobs_refused += 1
            self._transition(spec.job, "refuse")
            self._ctrl(port, f.src, "job_reply", job=spec.job, granted=False,
                       reason=reply.reason)
            return
        self._charge(mine, spec.members)
        self._jobs[spec.job] = mine
        self._job_members[spec.job] = frozenset(spec.members)
        tag = msg.get("tag", 0)
        self._job_tag[spec.job] = tag if isinstance(tag, int) else 0
        if deliver == "owner":
            self._owned.add(spec.job)
        else:
            self._owned.discard(spec.job)
        self._job_last.setdefault(spec.job, 0)
        if parent is None:
            self._transition(spec.job, "grant")
            self._ctrl(port, f.src, "job_reply", job=spec.job, granted=True, reason="")
            return
        # answer once the parent granted its part of the tree
        parent_id = self.topo.node(parent).id
        self._job_parent[spec.job] = parent_id
        if self._phase.get(spec.job) is JobPhase.GRANTED:
            self._ctrl(port, f.src, "job_reply", job=spec.job, granted=True, reason="")
            return
        self._transition(spec.job, "ask_parent")
        waiting = self._up_pending.setdefault(spec.job, {})
        # ask the parent on every (re)try of a member: our request or its answer may
        # have been lost, and the parent answers a repeated request again
        fields = {k: v for k, v in msg.items() if k != "t"}
        self._ctrl(self._next_hop[parent_id], parent_id, "job", **fields)
        waiting[f.src] = port

    def _on_job_reply(self, f: fr.Frame, msg: dict[str, Any]) -> None:
        """The parent answered our part of a tree job: answer whoever waited."""
        job = control.need(msg, "job", int)
        if self._job_parent.get(job) != f.src or job not in self._up_pending:
            self.counters.unauthorised += 1  # only our parent answers, once
            return
        granted = bool(msg.get("granted"))
        reason = str(msg.get("reason", ""))
        if granted:
            self._transition(job, "parent_grant")
        else:
            self._transition(job, "parent_refuse")
            self.engine.release(job)
            self._uncharge(job)
            self._jobs.pop(job, None)
            self._job_parent.pop(job, None)
            reason = f"parent switch refused: {reason}"
        for src, who in self._up_pending.pop(job, {}).items():
            self._ctrl(who, src, "job_reply", job=job, granted=granted, reason=reason)

    def _over_quota(self, spec: JobSpec, members: tuple[int, ...]) -> str | None:
        """Why the members' tenant may not have this job here, or None."""
        tenants = sorted({self.topo.tenant_of(m) for m in members})
        if len(tenants) > 1:
            return f"a job's members must share one tenant, not {', '.join(tenants)}"
        tenant = tenants[0]
        if spec.job in self._job_share:
            return None  # registered already: an idempotent retry
        quota = self.topo.tenants.get(tenant)
        if quota is None:
            return None
        use = self._tenant_use.get(tenant, {})
        slots = use.get("slots", 0) + spec.slots
        nbytes = use.get("memory_bytes", 0) + _slot_bytes(spec)
        why = None
        if quota.slots is not None and slots > quota.slots:
            why = f"{slots} slots > its quota of {quota.slots}"
        elif quota.memory_bytes is not None and nbytes > quota.memory_bytes:
            why = f"{nbytes} B of slot memory > its quota of {quota.memory_bytes} B"
        if why is None:
            return None
        u = self._tenant_use.setdefault(tenant, _no_use())
        u["refused"] += 1
        return f"tenant {tenant!r} at {self.name}: {why}"

    def _charge(self, spec: JobSpec, members: tuple[int, ...]) -> None:
        if spec.job in self._job_share:
            return
        tenant = self.topo.tenant_of(members[0])
        share = (tenant, spec.slots, _slot_bytes(spec))
        self._job_share[spec.job] = share
        u = self._tenant_use.setdefault(tenant, _no_use())
        u["jobs"] += 1
        u["slots"] += share[1]
        u["memory_bytes"] += share[2]

    def _uncharge(self, job: int) -> None:
        share = self._job_share.pop(job, None)
        if share is not None:
            u = self._tenant_use[share[0]]
            u["jobs"] -= 1
            u["slots"] -= share[1]
            u["memory_bytes"] -= share[2]

    def _release_job(self, f: fr.Frame, port: bytes, job: int, tag: int | None) -> None:
        """A member (or our child switch) is done with ``job``: free its slots."""
        members = self._job_members.get(job)
        if members is None or self._phase.get(job) is JobPhase.RELEASED \
                or (tag is not None and tag != self._job_tag.get(job, 0)):
            self._ctrl(port, f.src, "release_reply", job=job)  # idempotent
            return
        if f.src not in members and port not in self._switch_ports:
            raise AccessError(NackCode.PERMISSION, f"node {f.src} is not a member of job {job}")
        self._transition(job, "release")
        self.engine.release(job)
        self._uncharge(job)
        self._jobs.pop(job, None)
        self._refs = {k: v for k, v in self._refs.items() if k[0] != job}
        self._awaiting = {k for k in self._awaiting if k[0] != job}
        self._await_owner = {k: v for k, v in self._await_owner.items() if k[0] != job}
        self._owned.discard(job)
        self._high = {k: v for k, v in self._high.items() if k[0] != job}
        self._done_below.pop(job, None)
        self._done_above.pop(job, None)
        self._up_pending.pop(job, None)
        parent = self._job_parent.pop(job, None)
        if parent is not None:  # the rest of the tree frees its part too
            self._ctrl(self._next_hop[parent], parent, "release", job=job,
                       tag=self._job_tag.get(job, 0))
        self._ctrl(port, f.src, "release_reply", job=job)

    def _register_region(self, f: fr.Frame, port: bytes, msg: dict[str, Any]) -> None:
        key = control.need(msg, "key", int)
        size = control.need(msg, "size", int)
        path = control.need(msg, "path", str)
        if size <= 0:
            self._ctrl(port, f.src, "region_reply", key=key, ok=False,
                       reason=f"region size {size} must be positive")
            return
        if self.memory is None:
            self._ctrl(port, f.src, "region_reply", key=key, ok=False,
                       reason=f"switch {self.name} has no memory plane")
            return
        if not self._same_host(f.src):
            self._ctrl(port, f.src, "region_reply", key=key, ok=False,
                       reason=f"node {f.src} runs on another host than switch {self.name}: "
                              "its memory is not mappable here (the frame plane serves it)")
            return
        existed = key in self.regions
        try:
            self.regions.add(RegionInfo(key=key, owner=f.src, size=size, path=path))
            self.memory.detach(key)
            self.memory.attach(key, path, size)
        except (AccessError, OSError, ValueError) as exc:
            # never remove a region we did not just add (it may be another owner's)
            if not existed and key in self.regions and self.regions.get(key).owner == f.src:
                self.regions.remove(key)
            self._ctrl(port, f.src, "region_reply", key=key, ok=False, reason=str(exc))
            return
        self._ctrl(port, f.src, "region_reply", key=key, ok=True, reason="")


def _slot_bytes(spec: JobSpec) -> int:
    """Slot memory a job reserves (the engine's formula: 2 versions per slot)."""
    return 0 if spec.referenced else spec.slots * 2 * spec.slot_elems * DTYPES[spec.dtype].itemsize


def _no_use() -> dict[str, int]:
    return {"jobs": 0, "slots": 0, "memory_bytes": 0, "refused": 0}


@dataclass
class _CombineSum:
    """One token's partial sum at one switch (in-network MoE combine)."""

    total: np.ndarray  # float32
    seen: set[int]
    expected: int
    dtype: int
    result: np.ndarray | None = None


_FLOAT_CODES = frozenset({fr.DType.F32, fr.DType.F16, fr.DType.BF16})


def _next_hops(topo: Topology, name: str, attached: set[str]) -> dict[int, bytes]:
    """Node id -> the port a frame for it leaves on (fewest hops, lowest id on ties)."""
    hops: dict[int, bytes] = {}
    for n in topo.nodes:
        if n.name == name:
            continue
        if n.name in attached:
            hops[n.id] = n.name.encode()
        else:
            path = topo.route(name, n.name)
            if len(path) > 1:
                hops[n.id] = path[1].encode()
    return hops


def _plain(stats: SwitchStats) -> dict[str, Any]:
    """Statistics as plain data for a control message."""
    return asdict(stats)
