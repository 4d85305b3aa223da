"""Collective programs: the node side of every collective, sans-IO.

A program is a small state machine over one node's protocol state
(:class:`NodeState`). It never touches a socket or a clock; a driver runs it:

    sends = prog.start(now)              # [(header, payload)] to the node's switch
    if prog.wants(frame): sends = prog.handle_frame(frame, now)
    prog.get_timer() / prog.handle_timer(now)
    prog.done, prog.result

The simulator (:mod:`fabric.sim`) drives these programs in virtual time. Each
program exists in two data modes: with arrays (``data=True``: exact results,
element by element) and timing-only (``data=False``: the same frames, but
every payload is a view of one shared zero buffer and results are not kept,
so a 1024-rank 64 MiB run needs no 64 GiB of memory).

Errors are those of the emulated paths: :class:`~fabric.errors.FabricTimeout`
when a peer stays silent past ``timeout_s``, :class:`~fabric.errors.PeerFailed`
when it refuses.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import msgpack
import numpy as np
from mypy_extensions import mypyc_attr

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.congestion import CC_POLICIES, CcPath, CongestionControl, make_cc
from fabric.core.congestion.eqds import CreditPacer, unsolicited_bytes
from fabric.core.congestion.gate import CcGate
from fabric.core.congestion.settings import CongestionSettings
from fabric.core.frame import Flag, NackCode, Op
from fabric.core.reliability import PACKET_THRESHOLD, PSN_MASK, SACK_BITS, Sender, get_policy
from fabric.core.semantic import SemanticCounts
from fabric.core.timers import ChunkTimers, Deadlines, RttEstimator
from fabric.core.topology import Topology
from fabric.errors import FabricTimeout, PeerFailed, SumOverflowError, UsageError
from kernels.dtypes import UFUNCS, byte_view, np_dtype
from kernels.reference import first_wrap

__all__ = [
    "CTRL_RETRY_MIN_S",
    "CTRL_RETRY_S",
    "Chain",
    "HostPsAllreduce",
    "HostRingAllreduce",
    "InaAllreduce",
    "JobState",
    "NodeState",
    "Program",
    "Request",
    "allreduce_program",
    "barrier_program",
]

Send = tuple[bytes, Any]

#: Flow ids that tell a host-staged message's kind apart at the receiver.
HOST_PS_FLOW: Final = 2
RING_FLOW: Final = 3
#: Finished streams a node remembers to ACK late retransmissions (far fewer
#: than the 65536 stream ids of a pair, so an id is forgotten before reuse).
STREAMS_KEPT: Final = 4096
#: Default bytes of one chunk per path (one frame on the frame plane).
DEFAULT_CHUNK_BYTES: Final = {"ina": 256 * 1024, "ina-mem": 4 * 1024 * 1024,
                       "host-ps": 256 * 1024, "host-ring": 256 * 1024}
#: Default window (chunks in flight) per path.
DEFAULT_SLOTS: Final = {"ina": 8, "ina-mem": 4, "host-ps": 8}
#: Memory plane: split a tensor into at least this many chunks (pipelining),
#: but never below this chunk size: on an unshaped host every chunk costs
#: wake-ups (measured, 2 workers: 1 MiB in one chunk 0.85 ms, in four 1.65 ms);
#: on shaped links chunks must be small enough to pipeline over the wire.
MEM_MIN_CHUNKS: Final = 8
MEM_MIN_CHUNK_BYTES: Final = 4 * 1024 * 1024
MEM_MIN_CHUNK_BYTES_SHAPED: Final = 256 * 1024
#: First resend interval of a control request before any round trip to that node
#: was measured; after that, the RTO of the measured control round trips
#: (RFC 6298, the project's one estimator), never below CTRL_RETRY_MIN_S (the
#: streams' floor: a shared host's scheduling jitter). Doubles per resend up to
#: CTRL_RETRY_MAX_S.
CTRL_RETRY_S: Final = 0.05
CTRL_RETRY_MIN_S: Final = 0.005
CTRL_RETRY_MAX_S: Final = 1.0
#: Floor of the aggregation retransmit timeout (seconds).
AGG_RTO_MIN_S: Final = 0.02
#: NACK codes that mean "send it again now": damaged on the way (undecodable, or
#: a CRC mismatch), or lost (the switch saw later chunks of ours and asks for this
#: one). Other transient refusals (fabric.core.frame.TRANSIENT_NACKS) wait for the
#: chunk's timer; permanent ones end the call naming the code.
RESEND_CODES: Final = frozenset({NackCode.BAD_CHECKSUM, NackCode.MALFORMED, NackCode.MISSING})


@dataclass
class JobState:
    """A registered aggregation job as one worker sees it."""

    job: int
    slots: int
    slot_elems: int
    granted: bool
    reason: str
    next_chunk: int = 0


#: Bits of a job id below its group id (a group's jobs: ``gid << 8 | n``, n >= 1;
#: switchd.core.GROUP_JOB_BITS) and of a collective message id below it.
GROUP_JOB_BITS: Final = 8
GROUP_MSG_BITS: Final = 24
#: Message (and barrier) ids one group call owns: call ``c`` of a group numbers
#: its messages from ``c * CALL_MSGS``, so a call one member abandoned before it
#: sent anything leaves every member's next call on the same ids. The most any
#: call uses is 3 (a fixed-point allreduce, or a collective whose in-network job
#: was refused); a program built outside a call spills into the next block.
CALL_MSGS: Final = 16
#: Job ids skipped after an abandoned call: the members that reached it may have
#: registered up to this many (one per path, dtype and op the call uses), the
#: member that failed none; every member moves past them alike.
CALL_JOBS: Final = 4
#: Recent calls whose job numbering a member remembers (a notice about an older
#: call than this is too late to realign for; it cannot happen: a member is at
#: most a call or two ahead of another).
CALLS_KEPT: Final = 256


@dataclass
class Group:
    """A communicator as one member sees it: its ranks, and its own job ids,
    message ids and barriers (several groups may be active at once).

    ``gid`` 0 is every worker (built into every switch); other ids are handed
    out by the tree root when the members create the group.
    """

    gid: int
    ranks: tuple[int, ...]  # world ranks of the members, in group-rank order
    ids: tuple[int, ...]  # their node ids
    rank: int  # this node's rank in the group (-1: not a member)
    nth: int = 0  # which creation of this member set (members agree on it)
    #: this incarnation's id, drawn at random by the tree root when the group was
    #: made (0: group 0): barriers and host-staged chunks carry it, so no state of
    #: another incarnation, or another group, is ever taken for this one's
    inc: int = 0
    jobs: dict[tuple[str, ...], JobState] = field(default_factory=dict)
    closed: bool = False

    def __post_init__(self) -> None:
        self._jobs_made = 0
        # message ids start where the incarnation says: a group made again with the
        # same id names its streams apart from the last one's (whose receivers may
        # still remember them as finished)
        self._msg_base = 1 + (self.inc & ((1 << GROUP_MSG_BITS) - 2))
        self._msg_block = 0  # the block of CALL_MSGS ids in use (one per call)
        self._msg_k = 0
        #: group calls begun (collectives, allreduces, MoE, barriers): every member
        #: counts alike, so (gid, inc, calls) names one call on every member
        self.calls = 0
        self._jobs_at_call = 0
        #: jobs of abandoned calls, released when the communicator closes
        self.dropped: list[JobState] = []
        #: job ids made before each recent call began, and the calls this member
        #: realigned after (fabric.core.calls)
        self.jobs_before: dict[int, int] = {}
        self.realigned: set[int] = set()
        # calls of this group that notices say a member abandoned and this member
        # has not realigned for, as of NodeState.abort_gen ``notice_gen``
        self.noticed: list[int] = []
        self.notice_gen = 0

    @property
    def size(self) -> int:
        """Members in the group."""
        return len(self.ranks)

    def next_job(self) -> int:
        """A new job id of this group (members call in the same order: same ids)."""
        self._jobs_made += 1
        n = self._jobs_made
        if n >= 1 << GROUP_JOB_BITS:
            raise UsageError(f"group {self.gid}: more than {(1 << GROUP_JOB_BITS) - 1} "
                             "in-network jobs; close the communicator and make a new one")
        return self.gid << GROUP_JOB_BITS | n

    def _next_local(self) -> int:
        k = self._msg_k
        if k >= CALL_MSGS:  # more than a call's share: take the next block
            self._msg_block += 1
            k = 0
        self._msg_k = k + 1
        return self._msg_base + self._msg_block * CALL_MSGS + k

    def next_msg(self) -> int:
        """A new collective message id (unique among the node's groups)."""
        return (self.gid << GROUP_MSG_BITS | (self._next_local() & 0xFFFFFF)) & PSN_MASK

    def next_barrier(self) -> int:
        """A new barrier id (the group id above 32 bits, as the switch reads it)."""
        return self.gid << 32 | (self._next_local() & 0xFFFFFFFF)

    def begin_call(self) -> int:
        """Number a new group call (every member calls it once per call, before it
        checks its arguments); its message and barrier ids start a new block."""
        self.calls += 1
        self._msg_block += 1
        self._msg_k = 0
        self._jobs_at_call = self._jobs_made
        self.jobs_before[self.calls] = self._jobs_made
        self.jobs_before.pop(self.calls - CALLS_KEPT, None)
        self.realigned.discard(self.calls - CALLS_KEPT)
        return self.calls

    def abandon(self) -> None:
        """The running call ended without its collective on some member: forget the
        group's in-network jobs (their slots may hold partial sums; they are
        released at close) and skip the job ids the call may have registered."""
        self._forget_jobs()
        self._jobs_made = max(self._jobs_made, self._jobs_at_call + CALL_JOBS)
        self.realigned.add(self.calls)
        self.notice_gen = -1  # what is left to realign for changed

    def abandon_late(self, call: int) -> None:
        """Earlier call ``call``, which this member finished, ended on the others
        (they realigned then): number jobs as they do, from that call on. The
        running call is abandoned next (:meth:`abandon`)."""
        self._forget_jobs()
        before = self.jobs_before.get(call, self._jobs_at_call)
        self._jobs_made = self._jobs_at_call = before + CALL_JOBS
        self.realigned.add(call)
        self.notice_gen = -1

    def _forget_jobs(self) -> None:
        self.dropped.extend(js for js in self.jobs.values() if js.granted)
        self.jobs.clear()

    @property
    def tag(self) -> int:
        """This incarnation of the group, the same on every member (a release from
        a closed group never frees a job id a newer group registered again)."""
        return self.inc

    def check_open(self, what: str) -> None:
        """UsageError when the group was closed or this node is not in it."""
        if self.closed:
            raise UsageError(f"{what} on a closed communicator (group {self.gid})")
        if self.rank < 0:
            raise UsageError(f"{what}: this node is not a member of group {self.gid}")


@dataclass
class NodeState:
    """One node's protocol state: ids, sequence numbers, jobs, counters."""

    topo: Topology
    name: str
    timeout_s: float = 30.0
    crc: bool = False
    chunk_bytes: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    #: The driver guarantees no frame is lost (a simulation without faults): the
    #: ring then sends no step ACKs, which only loss recovery needs.
    lossless: bool = False

    def __post_init__(self) -> None:
        topo = self.topo
        self.node = topo.node(self.name)
        self.node_id = self.node.id
        workers = topo.workers
        self.world = len(workers)
        self.worker_ids = tuple(w.id for w in workers)
        self.rank = self.worker_ids.index(self.node_id) if self.node.kind == "worker" else -1
        self.switch_name = topo.switch_of(self.name)
        self.switch_id = topo.node(self.switch_name).id
        self.host_id = topo.hosts[0].id if topo.hosts else None
        self.root_switch_id = topo.node(topo.tree_root()).id
        # one frame size for every member: the smallest MTU among the links a
        # collective crosses (workers' and switches'), from the topology alone; a
        # member's own link would let members that differ chunk differently
        hosts = {h.name for h in topo.hosts}
        mtus = [lk.params.mtu for lk in topo.links if lk.a not in hosts and lk.b not in hosts]
        self.mtu = min(mtus, default=256 * 1024)
        host_link = topo.link_between(topo.hosts[0].name, topo.switch_of(topo.hosts[0].name)) \
            if topo.hosts else None
        #: the frame size of the host-staged paths (their route includes the host's link)
        self.host_mtu = min(self.mtu, host_link.params.mtu) if host_link is not None \
            else self.mtu
        # any shaped worker link: every member agrees on memory-plane chunking from it
        self.fabric_shaped = any(
            (lk := topo.link_between(w.name, topo.switch_of(w.name))) is not None
            and (lk.params.shaped or lk.params.latency_us > 0) for w in workers)
        self.rtt = self._new_estimator("ina", AGG_RTO_MIN_S)
        self._ctrl_rtt: dict[int, RttEstimator] = {}
        self.world_group = Group(0, tuple(range(self.world)), self.worker_ids, self.rank)
        self.jobs = self.world_group.jobs
        self.groups_made: dict[tuple[int, ...], int] = {}  # nth creation of a member set
        # request ids start anywhere: a refusal of some other frame cannot guess ours
        self.ctrl_seq = itertools.count(random.getrandbits(32))
        self.semantics: dict[str, SemanticCounts] = {}
        self.fallbacks: list[str] = []
        self.retransmits = 0
        self.timeouts = 0  # retransmit timers that ran out (a chunk's, a stream's RTO)
        self.duplicates = 0
        self.bad_frames = 0  # frames a program refused (damaged or forged)
        self._route_cost: dict[int, tuple[int, int]] = {}
        self._wire_rates: dict[int, tuple[float, float, float]] = {}
        # ring collectives finished here, by (left neighbour, msg): late retransmissions
        # of their frames are acknowledged again (answer_stale)
        self.ring_done: OrderedDict[tuple[int, int], None] = OrderedDict()
        # streams received in full, by (src, flow, stream id, msg): their last PSN
        self.streams_done: OrderedDict[tuple[int, int, int, int], int] = OrderedDict()
        # group calls a member abandoned, by (gid, incarnation, call, its node
        # id): (its group rank, why); a call finds its entry when it starts or,
        # running, through its timer (fabric.core.calls)
        self.aborts: OrderedDict[tuple[int, int, int, int], tuple[int, str]] = OrderedDict()
        self.abort_notices = 0  # notices taken (a member abandoned a call)
        self.abort_gen = 0  # changes with every new notice (a cheap "anything new?")
        # the last stream id of each (direction, peer): both ends count alike
        self.stream_ids: dict[tuple[str, int], int] = {}
        # round-trip estimators programs keep across calls, by role (ring, host, moe...)
        self.estimators: dict[str, RttEstimator] = {}
        self._bottleneck: dict[int | None, float | None] = {}
        self.trims_received = 0  # frames that came trimmed (a switch cut their payload)
        self._cc_paths: dict[tuple[int, int, int, int], CcPath | None] = {}
        # receiver-driven congestion control: the streams granted, and the pacer
        self._pacer: CreditPacer | None = None
        self._credit_ids: dict[tuple[int, int, int, int], int] = {}
        self._credit_keys: dict[int, tuple[int, int, int, int]] = {}
        self._credit_next = 0
        self._credit_opened: set[tuple[int, int, int, int]] = set()

    def estimator(self, role: str, rto_min: float) -> RttEstimator:
        """The round-trip estimator of ``role``: later calls start from what earlier
        ones measured."""
        est = self.estimators.get(role)
        if est is None:
            est = self.estimators[role] = self._new_estimator(role, rto_min)
        return est

    def overflow_drops(self, dst: int | None = None) -> bool:
        """Whether the switches' buffers drop (or trim) what does not fit: bounded
        (``[congestion] buffer_bytes``) and not lossless (``pfc``, which pauses
        senders instead, or ``credit`` on every link, which holds them back), on
        the way to node ``dst`` (None: on any way, by any network class's
        settings). Only then are the retransmit timers cut short: behind a
        lossless queue a frame is late, not lost, and a short timer would only
        send it again."""
        if dst is not None:
            return _drops(self.path_congestion(dst))
        cong = self.topo.congestion
        return any(_drops(c) for c in cong.every_class())

    def path_congestion(self, dst: int) -> CongestionSettings:
        """The congestion settings of this node's traffic to node ``dst`` (its
        route's outermost network class's)."""
        return self.topo.path_congestion(self.name, self.topo.by_id(dst).name)

    def _new_estimator(self, role: str, rto_min: float) -> RttEstimator:
        """An estimator with the fabric's defaults; its backoff stops at ``[congestion]
        rto_max_us`` when given, else, where switch buffers are bounded, at
        STREAM_BOUNDED_RTO_FLOORS floors; a short ceiling is never under
        BOUNDED_RTO_SRTTS smoothed RTTs. Behind bounded buffers each backoff is
        jittered by a generator seeded by this node and ``role`` (as
        :meth:`stream_sender`)."""
        from fabric.core.reliability import DEFAULT_RTO_INITIAL, RTO_JITTER

        cong = self.topo.congestion
        bounded = self.overflow_drops()
        if not bounded and cong.rto_max_us is None:
            return RttEstimator(rto_min=rto_min)
        ceiling = cong.rto_max_us * 1e-6 if cong.rto_max_us is not None \
            else STREAM_BOUNDED_RTO_FLOORS * rto_min
        rto_min = min(rto_min, ceiling)
        return RttEstimator(min(DEFAULT_RTO_INITIAL, ceiling), rto_min, ceiling,
                            jitter=RTO_JITTER if bounded else 0.0,
                            rng=random.Random(f"{self.name}/{role}") if bounded else None,
                            ceiling_srtts=BOUNDED_RTO_SRTTS)

    def ctrl_rtt(self, dst: int) -> RttEstimator:
        """The round trip of control requests to node ``dst``: their resend timer."""
        est = self._ctrl_rtt.get(dst)
        if est is None:
            est = self._ctrl_rtt[dst] = RttEstimator(CTRL_RETRY_S, CTRL_RETRY_MIN_S,
                                                     CTRL_RETRY_MAX_S)
        return est

    def sem(self, path: str) -> SemanticCounts:
        """The semantic-distance counters of ``path``."""
        sem = self.semantics.get(path)
        if sem is None:
            sem = self.semantics[path] = SemanticCounts()
        return sem

    def answer_stale(self, f: fr.Frame) -> list[Send]:
        """What to answer a frame no running program wants (both drivers ask).

        A retransmitted ring frame of a collective this node already finished
        means the left neighbour lost our step ACK: acknowledge it again, or
        it would resend until its timeout.
        """
        if f.op is Op.CTRL:
            return self._take_abort(f)
        if f.op is Op.WRITE and f.flow == RING_FLOW:
            if (f.src, f.msg) in self.ring_done:
                return [(fr.encode_header(Op.ACK, src=self.node_id, dst=f.src, flow=RING_FLOW,
                                          psn=f.psn >> 16, msg=f.msg, crc=self.crc), None)]
        elif f.op is Op.WRITE:
            # a stream we received in full: its sender lost our last ACK
            last = self.streams_done.get((f.src, f.flow, f.job, f.msg))
            if last is not None and (last < 0 or f.psn <= last):
                # last < 0: a stream of single-frame ACKs (masked multicast rows)
                psn = f.psn if last < 0 else last
                return [(fr.encode_header(Op.ACK, src=self.node_id, dst=f.src, flow=f.flow + 1,
                                          job=f.job, psn=psn, msg=f.msg, crc=self.crc), None)]
        return []

    def _take_abort(self, f: fr.Frame) -> list[Send]:
        """A member's notice that it abandoned a group call: remember it, and answer
        (the sender resends until we do). Other control frames get no answer."""
        try:
            m = control.parse(f.payload)
            if m.get("t") != ABORT:
                return []
            gid, inc = control.need(m, "gid", int), control.need(m, "inc", int)
            call = control.need(m, "call", int)
            rank = control.need(m, "rank", int)
            why = control.need(m, "why", str)
        except fr.FrameError:
            self.bad_frames += 1
            return []
        # keyed by sender too: a notice from outside the group (which the call
        # ignores) never hides a member's
        key = (gid, inc, call, f.src)
        if key not in self.aborts:
            self.abort_notices += 1
            self.abort_gen += 1
            self.aborts[key] = (rank, why[:ABORT_WHY_MAX])
            while len(self.aborts) > ABORTS_KEPT:
                self.aborts.popitem(last=False)
        return [(fr.encode(Op.CTRL, src=self.node_id, dst=f.src, msg=f.msg, crc=self.crc,
                           payload=control.pack(ABORT_ACK, gid=gid, call=call)), None)]

    def stream_done(self, src: int, flow: int, sid: int, msg: int, last_psn: int) -> None:
        """Remember a stream received in full, to ACK its late retransmissions."""
        done = self.streams_done
        done[(src, flow, sid, msg)] = last_psn
        while len(done) > STREAMS_KEPT:
            done.popitem(last=False)

    def chunk_elems(self, path: str, itemsize: int) -> int:
        """Elements of one chunk on ``path`` (one frame on the frame plane)."""
        nbytes = self.chunk_bytes.get(path, DEFAULT_CHUNK_BYTES[path])
        if path == "host-ps":
            nbytes = min(nbytes, self.host_mtu)
        elif path != "ina-mem":
            nbytes = min(nbytes, self.mtu)  # one chunk = one frame on the frame plane
        return max(nbytes // itemsize, 1)

    def mem_chunk_elems(self, slot_elems: int, count: int, itemsize: int) -> int:
        """Memory-plane chunk of a ``count``-element tensor: the same on every member
        (it follows from the topology, never from this node's own link). Where
        switch buffers are bounded, a chunk is cut to the links' MTU, as a real
        fabric carries it: one frame of a whole chunk could outgrow a buffer and
        never be admitted."""
        floor = MEM_MIN_CHUNK_BYTES_SHAPED if self.fabric_shaped else MEM_MIN_CHUNK_BYTES
        elems = min(slot_elems, max(floor // itemsize, -(-count // MEM_MIN_CHUNKS)))
        if self.buffers_bounded:
            elems = min(elems, max(self.mtu // itemsize, 1))
        return elems

    @property
    def buffers_bounded(self) -> bool:
        """Whether any switch buffer is bounded (``buffer_bytes``, in any class)."""
        return any(c.buffer_bytes is not None for c in self.topo.congestion.every_class())

    def stream_rto(self, window_bytes: int, dst: int | None = None
                   ) -> tuple[float, float, float]:
        """(first RTO, RTO floor, RTO ceiling) of a stream to node ``dst``, from the
        slowest link on its path.

        On a slow (or oversubscribed) path a burst of windows from a few concurrent
        streams queues longer than the fabric's defaults (0.1 s first, 5 ms
        floor): every frame would be resent spuriously, and Karn's rule would
        leave the estimator without samples. The first RTO covers
        STREAMS_IN_FLIGHT windows at the bottleneck rate, the floor one window.

        The ceiling bounds the backoff: ``[congestion] rto_max_us`` when given;
        else STREAM_RTO_MAX_S, or where switch buffers are bounded (``[congestion]
        buffer_bytes``) STREAM_BOUNDED_RTO_FLOORS floors: behind a full queue a
        frame can be lost again and again, and each loss waits for the backed-off
        RTO.
        """
        from fabric.core.reliability import DEFAULT_RTO_INITIAL, DEFAULT_RTO_MIN

        gbps = self._bottleneck_gbps(dst)
        wire = 0.0 if gbps is None else window_bytes * 8 / (gbps * 1e9)
        floor = max(DEFAULT_RTO_MIN, wire)
        cong = self.topo.congestion if dst is None else self.path_congestion(dst)
        ceiling = STREAM_RTO_MAX_S
        if cong.rto_max_us is not None:
            ceiling = cong.rto_max_us * 1e-6
        elif self.overflow_drops(dst):
            ceiling = min(STREAM_BOUNDED_RTO_FLOORS * floor, STREAM_RTO_MAX_S)
        floor = min(floor, ceiling)
        first = min(max(DEFAULT_RTO_INITIAL, STREAMS_IN_FLIGHT * wire), ceiling)
        return first, floor, ceiling

    def stream_sender(self, flow: int, dst: int, *, policy: str, window_frames: int,
                      frame_bytes: int, operation: str, key: int,
                      span_frames: int | None = None) -> Sender[int]:
        """A stream's :class:`~fabric.core.reliability.Sender` to node ``dst``: its
        timers (:meth:`stream_rto`), retry limit and congestion policy.

        Where switch buffers are bounded, its backoff is jittered (RTO_JITTER, from
        a generator seeded by the two ends, the flow and ``key``, so a simulation
        repeats). Under a ceiling shorter than STREAM_RTO_MAX_S it gives up only
        after STREAM_GIVE_UP_S as well as STREAM_MAX_RETRIES losses, and the
        ceiling is never under BOUNDED_RTO_SRTTS smoothed RTTs."""
        from fabric.core.reliability import RTO_JITTER, Sender

        first, floor, ceiling = self.stream_rto(window_frames * frame_bytes, dst)
        bounded = self.overflow_drops(dst)
        short = ceiling < STREAM_RTO_MAX_S
        peer = self.topo.by_id(dst).name
        return Sender(
            flow, policy=policy, window_frames=window_frames, span_frames=span_frames,
            max_retries=STREAM_MAX_RETRIES, rto_initial=first, rto_min=floor,
            rto_max=ceiling, peer=peer, operation=operation,
            cc=self.stream_cc(dst, frame_bytes),
            give_up_s=STREAM_GIVE_UP_S if short else 0.0,
            rto_jitter=RTO_JITTER if bounded else 0.0,
            rng=random.Random(f"{self.name}/{peer}/{flow}/{key}") if bounded else None,
            ceiling_srtts=BOUNDED_RTO_SRTTS if short else 0.0)

    @property
    def stream_frame_bytes(self) -> int:
        """Payload bytes of one stream frame: STREAM_FRAME_BYTES, or the fabric's
        smallest MTU when that is less (both ends of a stream agree on it)."""
        return min(STREAM_FRAME_BYTES, self.mtu)

    def stream_cc(self, dst: int, frame_bytes: int, reply_bytes: int = 0
                  ) -> CongestionControl | None:
        """A new instance of the topology's ``[congestion] cc`` policy for a stream to
        node ``dst`` (None: no policy named, or this node's link is unshaped, so
        there is no line rate to start from); its path is :meth:`cc_path`'s."""
        name = self.path_congestion(dst).cc
        if name is None:
            return None
        path = self.cc_path(self.node_id, dst, frame_bytes, reply_bytes)
        return None if path is None else make_cc(name, path)

    def cc_path(self, src: int, dst: int, frame_bytes: int, reply_bytes: int = 0
                ) -> CcPath | None:
        """What a policy knows of the path from node ``src`` to node ``dst`` (a
        receiver asks it of its senders' paths): the sender's line rate, and the
        round trip of one frame and its ACK (or a reply of ``reply_bytes`` of
        payload, as an in-network result is) on an idle fabric: ``[congestion]
        base_rtt_us``, or from the links (each latency both ways and both
        serialisations, store and forward). None where the sender's link is
        unshaped."""
        key = (src, dst, frame_bytes, reply_bytes)
        if key not in self._cc_paths:
            near, far = self.topo.by_id(src).name, self.topo.by_id(dst).name
            hops = [near, *self.topo.route(near, far), far]
            links = [lk for a, b in zip(hops, hops[1:], strict=False)
                     if (lk := self.topo.link_between(a, b)) is not None]
            path = None
            cong = self.topo.path_congestion(near, far)
            if links and links[0].params.shaped:
                wire = frame_bytes + fr.HEADER_SIZE + (fr.CRC_SIZE if self.crc else 0)
                ack = reply_bytes + fr.HEADER_SIZE + (fr.CRC_SIZE if self.crc else 0)
                rtt = sum(2 * lk.params.latency_us * 1e-6
                          + lk.params.serialization_us(wire + ack) * 1e-6 for lk in links)
                if cong.base_rtt_us is not None:
                    rtt = cong.base_rtt_us * 1e-6
                path = CcPath(link_gbps=links[0].params.bandwidth_gbps, base_rtt_s=rtt,
                              mtu=wire, trimming=cong.trim)
            self._cc_paths[key] = path
        return self._cc_paths[key]

    def congestion_gate(self, dst: int, frame_bytes: int, flow: int = 0,
                        reply_bytes: int = 0) -> CcGate | None:
        """The topology's policy for a flow of frames of ``frame_bytes`` to ``dst``, as
        a chunk window drives it, each answered by ``reply_bytes`` (None: as
        :meth:`stream_cc`). A receiver-driven policy is refused: only a stream's
        receiver grants credit."""
        cc = self.stream_cc(dst, frame_bytes, reply_bytes)
        if cc is not None and cc.receiver_driven:
            raise UsageError(f"[congestion] cc {cc.name!r}: the receiver grants credit, and "
                             "only streams' receivers do (p2p, host-p2p collectives, flat "
                             "and hierarchical MoE); the host-staged and in-network paths "
                             "take nscc, dcqcn or none")
        return CcGate(cc, flow) if cc is not None else None

    # ------------------------------------------------------------------ credit
    # A receiver-driven policy (``eqds``): each stream's sender sends its first
    # unsolicited bytes, then what this node grants. One pacer per node grants
    # every stream coming in, an MTU at a time, round robin, at this node's link
    # rate, so its last hop holds no more than those first bytes.
    def credit_open(self, src: int, flow: int, sid: int, msg: int, nbytes: int,
                    frame_bytes: int, now: float) -> list[Send]:
        """A stream of ``nbytes`` from node ``src`` showed up (its first frame, so its
        sender is there to take credit): grant what it sends beyond its unsolicited
        bytes. Nothing without a receiver-driven policy."""
        key = (src, flow, sid, msg)
        if key in self._credit_opened or not self.grants_credit(src):
            return []
        path = self.cc_path(src, self.node_id, frame_bytes)
        if path is None:
            return []
        self._credit_opened.add(key)
        return self._credit_request(self._credit_id(key), nbytes - unsolicited_bytes(path),
                                    now)

    def credit_close(self, src: int, flow: int, sid: int, msg: int) -> None:
        """The stream has every byte: it needs no more credit."""
        key = (src, flow, sid, msg)
        self._credit_opened.discard(key)
        cid = self._credit_ids.pop(key, None)
        if cid is not None:
            del self._credit_keys[cid]
            if self._pacer is not None:
                self._pacer.forget(cid)

    def credit_timer(self) -> float | None:
        """When the pacer grants next (programs receiving streams wake for it)."""
        return self._pacer.get_timer() if self._pacer is not None else None

    def credit_grants(self, now: float) -> list[Send]:
        """The grants due now, as CREDIT frames."""
        if self._pacer is None:
            return []
        return [self._credit_frame(cid, n) for cid, n in self._pacer.handle_timer(now)]

    def grants_credit(self, src: int) -> bool:
        """Whether streams from node ``src`` run a receiver-driven policy (``cc``), so
        this node grants them credit."""
        name = self.topo.path_congestion(self.topo.by_id(src).name, self.name).cc
        return name is not None and name in CC_POLICIES and CC_POLICIES[name].receiver_driven

    def _credit_trimmed(self, f: fr.Frame, now: float) -> list[Send]:
        """A stream frame came trimmed: grant it again. Its header is also how a
        stream whose first frames were all cut makes itself known: without that
        grant its sender would wait for ever (nothing of it came whole)."""
        key = (f.src, f.flow, f.job, f.msg)
        if key in self.streams_done:
            return []  # a late copy of a stream this node has whole
        return self._credit_request(self._credit_id(key), f.length, now)

    def _credit_id(self, key: tuple[int, int, int, int]) -> int:
        cid = self._credit_ids.get(key)
        if cid is None:
            cid = self._credit_next = self._credit_next + 1
            self._credit_ids[key] = cid
            self._credit_keys[cid] = key
        return cid

    def _credit_request(self, cid: int, nbytes: int, now: float) -> list[Send]:
        if nbytes <= 0:
            return []
        if self._pacer is None:
            link = self.topo.link_between(self.name, self.switch_name)
            if link is None or not link.params.shaped:
                return [self._credit_frame(cid, nbytes)]  # nothing to pace by: all at once
            self._pacer = CreditPacer(link.params.bandwidth_gbps, self.stream_frame_bytes)
        self._pacer.request(cid, nbytes, now)
        return []

    def _credit_frame(self, cid: int, nbytes: int) -> Send:
        src, flow, sid, msg = self._credit_keys[cid]
        return (fr.encode_header(Op.CREDIT, src=self.node_id, dst=src, flow=flow + 1, job=sid,
                                 offset=nbytes, msg=msg, crc=self.crc), None)

    def answer_trimmed(self, f: fr.Frame, now: float) -> list[Send]:
        """A trimmed frame came (:func:`fabric.core.frame.is_trimmed`): for a stream's
        data (P2P_FLOW and collective streams), a post's or a masked multicast row
        (MoE dispatch), all answered on their flow + 1, a TRIMMED NACK, so its sender
        resends at once (a stream under a receiver-driven policy once this node
        grants it again); a combine sum (in-network MoE), a TRIMMED NACK on its flow
        to the switch that summed it, which kept it; other flows' are dropped like a
        lost frame (their senders' timers resend them)."""
        self.trims_received += 1
        if f.op is Op.REDUCE and f.flow == fr.COMBINE_FLOW:
            return [(fr.encode_nack(src=self.node_id, dst=f.src, flow=f.flow, psn=f.psn,
                                    code=NackCode.TRIMMED, job=f.job, msg=f.msg,
                                    crc=self.crc), None)]
        if f.op is not Op.WRITE or (f.flow not in fr.STREAM_FLOWS
                                    and f.flow != fr.MASKED_FLOW and f.flow != fr.POST_FLOW):
            return []
        out: list[Send] = [(fr.encode_nack(src=self.node_id, dst=f.src, flow=f.flow + 1,
                                           psn=f.psn, code=NackCode.TRIMMED, job=f.job,
                                           msg=f.msg, crc=self.crc), None)]
        if f.flow in fr.STREAM_FLOWS and self.grants_credit(f.src):
            out += self._credit_trimmed(f, now)  # its sender resends it on credit
        return out

    def _bottleneck_gbps(self, dst: int | None) -> float | None:
        """The lowest shaped bandwidth on the path to ``dst`` (None: none shaped)."""
        cache = self._bottleneck
        if dst in cache:
            return cache[dst]
        hops = [self.name, self.switch_name]
        if dst is not None:
            far = self.topo.by_id(dst).name
            hops = [self.name, *self.topo.route(self.name, far), far]
        rates = [lk.params.bandwidth_gbps for a, b in zip(hops, hops[1:], strict=False)
                 if (lk := self.topo.link_between(a, b)) is not None and lk.params.shaped]
        cache[dst] = min(rates) if rates else None
        return cache[dst]

    def route_cost(self, dst: int) -> tuple[int, int]:
        """(hops, crossings) of one payload sent from this node to node ``dst``."""
        cost = self._route_cost.get(dst)
        if cost is None:
            switches = len(self.topo.route(self.name, self.topo.by_id(dst).name))
            cost = self._route_cost[dst] = (switches, switches + 1)
        return cost

    def wire_s(self, dst: int, nbytes: int, ahead: int = 0, fan_in: int = 1) -> float:
        """Known wire time of a frame of ``nbytes`` to node ``dst`` and an answer as
        large back, behind ``ahead`` frames as large queued on our own link, with
        ``fan_in`` such frames (every member's) sharing the link into ``dst``: the
        part of a round trip that the link rates fix (0 on unshaped links). A
        retransmit timer waits this long beside its RTO (ChunkTimers.sent)."""
        rates = self._wire_rates.get(dst)
        if rates is None:
            links = self.topo.path_links(self.name, self.topo.by_id(dst).name)
            # microseconds per byte, one way: every link but the last, the last
            # (into dst; a switch as dst has none of its own), and our uplink
            per = [lk.params.serialization_us(1) for lk in links]
            last = per.pop() if per and not self.topo.by_id(dst).is_switch else 0.0
            rates = self._wire_rates[dst] = (sum(per), last, per[0] if per else last)
        path, last, own = rates
        # the link into dst carries every member's frames, those queued ahead too
        return nbytes * (2 * path + ahead * own + 2 * (ahead + 1) * fan_in * last) * 1e-6


def _nack_code(f: fr.Frame) -> NackCode | None:
    """A NACK's code, or None for a code this end does not know."""
    try:
        return f.nack_code
    except ValueError:
        return None


@mypyc_attr(allow_interpreted_subclasses=True)  # drivers and users write programs
class Program:
    """Base of every program (see the module doc)."""

    done = False
    result: Any = None

    def start(self, now: float) -> list[Send]:
        """Begin; what to send first."""
        return []

    def wants(self, f: fr.Frame) -> bool:
        """True for frames this program consumes (the demultiplexing rule)."""
        return False

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        """A frame it wants arrived."""
        return []

    def get_timer(self) -> float | None:
        """Its next deadline, or None."""
        return None

    def handle_timer(self, now: float) -> list[Send]:
        """Its deadline passed."""
        return []

    def waiting_for(self) -> str:
        """Whom it waits for, for a timeout's message."""
        return "its peers"

    def source(self) -> int | None:
        """The one node whose frames it may want (None: any node's); lets
        :class:`Parallel` offer a frame to the programs of its sender only."""
        return None


# ---------------------------------------------------------------------- control
#: The control message a member sends each peer when it abandons a group call,
#: and the peer's answer (fabric.core.calls).
ABORT: Final = "abort"
ABORT_ACK: Final = "abort_ack"
#: Abandoned calls a node remembers (the oldest are forgotten first), and the
#: longest reason kept from a notice.
ABORTS_KEPT: Final = 1024
ABORT_WHY_MAX: Final = 400


class Request(Program):
    """A control request to a switch, resent with backoff until its reply comes.

    Control requests are idempotent, so a lost request or reply costs only a
    resend, after the RTO of this node's control round trips to ``dst``
    (:meth:`NodeState.ctrl_rtt`); ``timeout_s`` after the first send it fails
    naming the peer. ``waits``: the answer waits for other nodes (a barrier,
    a group), so its time is no round trip and gives no RTT sample.
    """

    def __init__(self, st: NodeState, t: str, reply: str, *, dst: int | None = None,
                 match: Callable[[dict[str, Any]], bool] | None = None, waits: bool = False,
                 timeout_s: float | None = None, **fields: Any) -> None:
        self.st, self.t, self.reply, self.match = st, t, reply, match
        self.dst = st.switch_id if dst is None else dst
        self.waits = waits
        self.timeout_s = st.timeout_s if timeout_s is None else timeout_s
        # a request id in ``msg``: a refusal names it, so a stray NACK (a reply to
        # some other, perhaps hostile, frame) is never taken for ours
        self.id = next(st.ctrl_seq) & PSN_MASK or next(st.ctrl_seq) & PSN_MASK
        self.frame = fr.encode(Op.CTRL, src=st.node_id, dst=self.dst, msg=self.id,
                               payload=control.pack(t, **fields), crc=st.crc)
        self._rtt = st.ctrl_rtt(self.dst)
        self._retry = self._rtt.rto
        self._sent_at = 0.0
        self._resent = False
        self._due = 0.0
        self._give_up = 0.0

    def start(self, now: float) -> list[Send]:
        self._give_up = now + self.timeout_s
        self._sent_at = now
        self._due = now + self._retry
        return [(self.frame, None)]

    def wants(self, f: fr.Frame) -> bool:
        if f.op is Op.NACK:
            return f.src == self.dst and f.msg == self.id and f.job == 0
        if f.op is not Op.CTRL or f.src != self.dst:
            return False  # only the node we asked answers (a forged reply is not taken)
        if f.msg and f.msg != self.id:
            return False  # the answer to another (earlier, resent) request of ours
        try:
            m = control.parse(f.payload)
        except fr.FrameError:
            return False
        return m.get("t") == self.reply and (self.match is None or self.match(m))

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        if f.op is Op.NACK:
            code = _nack_code(f)
            if code in (NackCode.BAD_CHECKSUM, NackCode.MALFORMED):
                return []  # damaged on the way: the timer sends it again
            raise PeerFailed(f"{self.st.name}: node {self.dst} refused control request "
                             f"{self.t!r}: {code.name if code is not None else f.offset}")
        self.done = True
        self.result = control.parse(f.payload)
        error = self.result.get("error")
        if isinstance(error, str) and error:  # an answer that says why it cannot be
            raise PeerFailed(f"{self.st.name}: {self.t} failed: {error}")
        if not self._resent and not self.waits:  # Karn: one send, one round trip
            self._rtt.sample(now - self._sent_at)
        return []

    def get_timer(self) -> float | None:
        return None if self.done else self._due

    def waiting_for(self) -> str:
        return f"node {self.dst} ({self.st.topo.by_id(self.dst).name})"

    def handle_timer(self, now: float) -> list[Send]:
        if self.done or now < self._due:
            return []
        if now >= self._give_up:
            raise FabricTimeout(f"{self.st.name}: control request {self.t!r} to node "
                                f"{self.dst}: no answer within {self.timeout_s:g}s")
        self._retry = min(self._retry * 2, CTRL_RETRY_MAX_S)
        self._due = min(now + self._retry, self._give_up)
        self._resent = True
        return [(self.frame, None)]


class Chain(Program):
    """A program made of programs: ``steps`` is a generator that yields each
    sub-program and receives its result (``x = yield Request(...)``)."""

    def __init__(self, steps: Generator[Program, Any, Any]) -> None:
        self.steps = steps
        self.current: Program | None = None

    def _advance(self, value: Any, now: float) -> list[Send]:
        out: list[Send] = []
        while True:
            try:
                self.current = self.steps.send(value)
            except StopIteration as stop:
                self.current = None
                self.done = True
                self.result = stop.value
                return out
            out.extend(self.current.start(now))
            if not self.current.done:
                return out
            value = self.current.result

    def start(self, now: float) -> list[Send]:
        return self._advance(None, now)

    def leaf(self) -> Program | None:
        """The innermost program running now."""
        cur = self.current
        while isinstance(cur, Chain):
            cur = cur.current
        return cur

    def poke(self, now: float) -> list[Send]:
        """Move on if the running step finished outside :meth:`handle_frame`
        (a driver fed it directly, e.g. a result received in place)."""
        cur = self.current
        if isinstance(cur, Chain):
            out = cur.poke(now)
            if cur.done:
                out.extend(self._advance(cur.result, now))
            return out
        if cur is not None and cur.done:
            return self._advance(cur.result, now)
        return []

    def wants(self, f: fr.Frame) -> bool:
        return self.current is not None and self.current.wants(f)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        assert self.current is not None
        out = self.current.handle_frame(f, now)
        if self.current.done:
            out.extend(self._advance(self.current.result, now))
        return out

    def get_timer(self) -> float | None:
        return None if self.current is None else self.current.get_timer()

    def waiting_for(self) -> str:
        return "its peers" if self.current is None else self.current.waiting_for()

    def handle_timer(self, now: float) -> list[Send]:
        assert self.current is not None
        out = self.current.handle_timer(now)
        if self.current.done:
            out.extend(self._advance(self.current.result, now))
        return out


def barrier_program(st: NodeState, group: Group | None = None) -> Program:
    """Wait until every member of ``group`` (default: every worker) reached this
    barrier (counted by the tree root)."""
    if group is not None:
        group.check_open("barrier")  # a closed communicator has no barrier
    g = group or st.world_group
    bid = g.next_barrier()
    return Request(st, "barrier", "barrier_done", dst=st.root_switch_id, waits=True,
                   match=lambda m: m.get("id") == bid, id=bid, n=g.size, inc=g.inc)


# ---------------------------------------------------------------------- tensors
_ZEROS: dict[tuple[str, int], np.ndarray] = {}


def zeros(dtype: str, n: int) -> np.ndarray:
    """A shared read-only zero payload of ``n`` elements (timing-only mode)."""
    z = _ZEROS.get((dtype, n))
    if z is None:
        z = _ZEROS[(dtype, n)] = np.zeros(n, np_dtype(dtype))
        z.flags.writeable = False
    return z


@dataclass
class Tensor:
    """What a collective reduces: real elements, or (timing-only) just a size."""

    count: int
    dtype: str
    x: np.ndarray | None = None
    out: np.ndarray | None = None

    @property
    def itemsize(self) -> int:
        return np_dtype(self.dtype).itemsize


def _job_key(path: str, dtype: str, op: str, deliver: str = "all") -> tuple[str, str, str, str]:
    """What a job is registered for: calls that agree on it share the job."""
    return path, dtype, op, deliver


def _job_program(st: NodeState, path: str, t: Tensor, op: str, referenced: bool,
                 group: Group | None = None,
                 deliver: str = "all") -> Generator[Program, Any, JobState]:
    g = group or st.world_group
    key = _job_key(path, t.dtype, op, deliver)
    js = g.jobs.get(key)
    if js is not None:
        return js
    # Members call collectives in the same order, so the same job id comes out.
    job = g.next_job()
    slots = st.slots.get(path, DEFAULT_SLOTS[path])
    elems = st.chunk_elems(path, t.itemsize)
    reply = yield Request(st, "job", "job_reply", job=job, members=list(g.ids),
                          dtype=t.dtype, op=op, slots=slots, slot_elems=elems,
                          referenced=referenced, deliver=deliver, tag=g.tag,
                          match=lambda m: m.get("job") == job)
    js = JobState(job, slots, elems, bool(reply.get("granted")), str(reply.get("reason", "")))
    if not js.granted:
        st.fallbacks.append(f"{path} job {job} refused by switch ({js.reason}); falling back "
                            f"to {'host-ps' if st.host_id is not None else 'host-ring'}")
    g.jobs[key] = js
    return js


class InaAllreduce(Program):
    """Frame-plane in-network allreduce: each chunk sent once, its result received once.

    Windows are self-clocked (SwitchML): chunk ``i + S`` goes out when chunk
    ``i``'s result came back. A chunk without a result by its RFC 6298 timer
    (or overtaken by three later results) is sent again; the switch's bitmaps
    make the copy count once.

    With a congestion-control policy (``[congestion] cc``) a chunk whose slot is
    free also waits for the policy's window and pacer; its result is its ACK,
    marked when the chunk met congestion on the way up (any member's
    contribution, which the switches carry on) or down.
    """

    def __init__(self, st: NodeState, t: Tensor, op: str, js: JobState, *,
                 data: bool = True, region: tuple[int, int] | None = None,
                 group: Group | None = None) -> None:
        self.st, self.t, self.js, self.data = st, t, js, data
        # memory plane: frames name (key, offset) in a registered region, no payload
        self.region = region
        self.label = "ina" if region is None else "ina-mem"
        self.E, self.S, self.n = js.slot_elems, js.slots, t.count
        self.item = item = t.itemsize
        if region is not None:
            self.E = st.mem_chunk_elems(js.slot_elems, t.count, item)
        self.nch = self._layout()
        self.base = js.next_chunk
        js.next_chunk += self.nch
        self.members = (group or st.world_group).size
        self.msg = (group or st.world_group).next_msg()
        self.code = fr.dtype_from_name(t.dtype)
        # A lost contribution is asked for by the switch (MISSING) as soon as a later
        # chunk of ours shows the gap. Three results of chunks sent after one of ours
        # overtaking it say it is lost (its result, or our contribution) when the
        # switch's mark to us is above it: below that mark every chunk is complete or
        # lacks our contribution, above it a chunk waits for another member (whom the
        # switch asks). The RTO is the backstop.
        self.timers = ChunkTimers(st.rtt, st.timeout_s)
        self.got = bytearray(self.nch)
        # send order (one count over every transmission) of each chunk's first copy
        # and of its latest one
        self.first_sent = [0] * self.nch
        self.last_sent = [0] * self.nch
        self._sends = 0
        self.left = self.nch
        self.overflow = ""  # the first chunk whose sum would wrap (OVERFLOW)
        self.flags = Flag.CRC if st.crc else Flag.NONE
        # the header's flag bits as ints, first copy and resend (Flag arithmetic
        # costs a microsecond a frame)
        extra = int(self.flags) | (int(Flag.REF) if region is not None else 0)
        self._bits = (extra, extra | int(Flag.RETX))
        self.result = t.out
        # the topology's congestion control ([congestion] cc): chunks whose slot is
        # free wait in ``ready`` for its window and pacer (None: none, as before)
        self.wire = fr.HEADER_SIZE + self.E * self.item
        self.gate = st.congestion_gate(st.root_switch_id, self.E * self.item, js.job,
                                       reply_bytes=self.E * self.item)
        # A chunk completes only when every member sent it, so members whose windows
        # are full of different chunks would wait on each other for ever: the ready
        # chunks go lowest first (a heap), and the lowest goes even through a full
        # window when it is below every chunk this member has in flight (so the
        # lowest chunk not yet complete anywhere always goes)
        self.ready: list[int] = []
        self.flying: set[int] = set()  # chunks sent whose result has not come
        self.sent_at: dict[int, float] = {}

    def _layout(self) -> int:
        """How many chunks (subclasses lay chunks out otherwise)."""
        return -(-self.n // self.E)

    def _span(self, i: int) -> tuple[int, int]:
        """Chunk ``i``'s first element in the input, and its element count."""
        lo = i * self.E
        return lo, min(self.n - lo, self.E)

    def _dest(self, i: int) -> int | None:
        """Where chunk ``i``'s result lands in ``out`` (element), or None: not ours."""
        return i * self.E

    def _owner(self, i: int) -> int:
        """The REDUCE frame's ``key``: 0 (results to all), or the owner's node id."""
        return 0

    def _frame(self, i: int, retx: bool) -> Send:
        st, E = self.st, self.E
        self._sends += 1
        if not self.first_sent[i]:
            self.first_sent[i] = self._sends
        self.last_sent[i] = self._sends
        flags = self._bits[retx]
        psn = (self.base + i) & PSN_MASK
        if self.region is not None:
            key, off = self.region
            count = min(self.n - i * E, E)
            return (fr.encode_header(Op.REDUCE, src=st.node_id, dst=st.switch_id,
                                     job=self.js.job, psn=psn, dtype=self.code, msg=self.msg,
                                     key=key, offset=off + i * E * self.item,
                                     flags=flags, length=count * self.item,
                                     crc=st.crc), None)
        lo, count = self._span(i)
        if self.data:
            assert self.t.x is not None
            seg = self.t.x[lo: lo + count]
        else:
            seg = zeros(self.t.dtype, count)
        seg = byte_view(seg)
        return (fr.encode_header(Op.REDUCE, src=st.node_id, dst=st.switch_id,
                                 job=self.js.job, psn=psn, dtype=self.code, msg=self.msg,
                                 key=self._owner(i), payload=seg, flags=flags,
                                 crc=st.crc), seg)

    def start(self, now: float) -> list[Send]:
        if self.nch == 0:
            self.done = True
        if self.gate is not None:
            self.ready.extend(range(min(self.S, self.nch)))  # (sorted: a heap)
            return self._pump(now)
        out = []
        for i in range(min(self.S, self.nch)):
            out.append(self._frame(i, False))
            self.timers.sent(i, now, self._allowance())
        return out

    def _pump(self, now: float) -> list[Send]:
        """First sends of the chunks whose slots are free, as far as the policy's
        window and pacer let them go now."""
        gate = self.gate
        assert gate is not None
        out: list[Send] = []
        gate.begin(now)
        ready = self.ready
        while ready:
            i = ready[0]
            if not gate.allows(self.wire, now) and (
                    now < gate.pace_at or (self.flying and i > min(self.flying))):
                break
            heapq.heappop(ready)
            self.flying.add(i)
            gate.sent(self.wire, now)
            self.sent_at[i] = now
            out.append(self._frame(i, False))
            self.timers.sent(i, now, self._allowance())
        gate.end()
        return out

    def _resent(self, chunks: list[int], now: float, *, timeout: bool) -> list[Send]:
        """Chunks sent again: the policy hears of each loss (and counts the copy)."""
        gate = self.gate
        if gate is not None:
            for i in chunks:
                gate.lost(self.wire, now, timeout=timeout)
                gate.sent(self.wire, now)
                self.sent_at.pop(i, None)  # Karn: no round trip from a resent chunk
        return [self._frame(i, True) for i in chunks]

    def wants(self, f: fr.Frame) -> bool:
        # results and refusals come from our switch only
        return (f.job == self.js.job and f.src == self.st.switch_id
                and (f.op is Op.RESULT or f.op is Op.NACK))

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        i = (f.psn - self.base) & PSN_MASK
        if f.op is Op.NACK:
            code = _nack_code(f)
            if code in RESEND_CODES:
                # only a chunk we did send: one the window has not opened yet must
                # wait for its slot's result (self-clocking), whatever the switch saw
                if code is NackCode.MISSING and not self._lost_before(i, f.key):
                    return []  # sent after the switch looked (or never): not lost
                if i < self.nch and not self.got[i] and self.timers.outstanding(i):
                    self.timers.resent(i, now)  # counted there
                    return self._resent([i], now, timeout=False)
                return []
            if code is NackCode.OVERFLOW:
                # the chunk's sum would wrap: it is over for every member; the call
                # runs to its end (the others need our other chunks) and then fails
                if i >= self.nch or self.got[i]:
                    return []
                self.overflow = self.overflow or f"chunk {i}"
                return self.landed(i, now)
            if code in fr.TRANSIENT_NACKS:
                return []  # late or no room yet: the chunk's timer sends it again
            raise PeerFailed(f"{self.st.name}: switch refused chunk {f.psn} of job {f.job}: "
                             f"{code.name if code is not None else f.offset}")
        if i >= self.nch or self.got[i]:  # a late copy of a result we already have
            self.st.duplicates += 1
            return []
        _lo, count = self._span(i)
        dest = self._dest(i)
        want = count * self.item if dest is not None else 0  # others: a completion only
        if f.length != want:
            raise PeerFailed(f"{self.st.name}: RESULT for chunk {i} has {f.length} B, "
                             f"expected {want} B")
        if self.data and self.region is None and dest is not None:
            assert self.t.out is not None
            self.t.out[dest: dest + count] = np.frombuffer(f.payload, dtype=self.t.out.dtype)
        return self.landed(i, now, done=f.offset, marked=f.has(Flag.ECN))

    def _lost_before(self, i: int, proof_psn: int) -> bool:
        """Chunk ``i``'s latest copy was sent before the chunk whose arrival proves it
        lost (one link delivers in order, so ``i`` should have arrived first). A copy
        sent after the proof is still on its way: the ask is stale, not a loss."""
        p = (proof_psn - self.base) & PSN_MASK
        return (i < self.nch and p < self.nch and 0 < self.last_sent[i]
                and 0 < self.first_sent[p] and self.last_sent[i] < self.first_sent[p])

    def landing(self, psn: int, length: int) -> tuple[int, int] | None:
        """Where chunk ``psn``'s result belongs in ``out``: ``(chunk, byte offset)``, or
        None when it is not awaited (a late copy) or has the wrong length. For
        drivers that receive a result in place, then call :meth:`landed`."""
        i = (psn - self.base) & PSN_MASK
        if i >= self.nch or self.got[i] or self.region is not None or not self.data:
            return None
        _lo, count = self._span(i)
        dest = self._dest(i)
        if length != count * self.item or dest is None:
            return None
        return i, dest * self.item

    def landed(self, i: int, now: float, done: int | None = None,
               marked: bool = False) -> list[Send]:
        """Chunk ``i``'s result is in ``out``: resend what it overtook, slide the window.

        ``done``: the switch's mark on that RESULT (every chunk below it complete,
        or lacking our contribution). An overtaken chunk below the mark lost its
        result or our contribution: resend it; one above waits for another
        member, whom the switch asks alone (resending ours would be spurious), so
        only its timer may resend it. ``marked``: the RESULT came congestion
        experienced (for the policy, when there is one).
        """
        self.got[i] = 1
        self.left -= 1
        below = None
        if done is not None:
            below = (done - self.base) & PSN_MASK
            if below > self.nch:  # not of this call: assume nothing
                below = 0
        gate = self.gate
        if gate is not None:
            self.flying.discard(i)
            # the round trip includes the switch's wait for the other members
            sent = self.sent_at.pop(i, None)
            gate.acked(self.wire, marked, now - sent if sent is not None else 0.0, now)
            out = self._resent(self.timers.acked(i, now, below)[1], now, timeout=False)
            if i + self.S < self.nch:
                heapq.heappush(self.ready, i + self.S)
            out.extend(self._pump(now))
        else:
            out = [self._frame(lost, True) for lost in self.timers.acked(i, now, below)[1]]
            if i + self.S < self.nch:
                out.append(self._frame(i + self.S, False))
                self.timers.sent(i + self.S, now, self._allowance())
        if self.left == 0:
            self.done = True
            self.st.retransmits += self.timers.retransmits
            self.st.timeouts += self.timers.expiries
            if self.overflow:
                raise SumOverflowError(
                    f"{self.st.name}: {self.label} allreduce of {self.t.dtype}: the sum of "
                    f"{self.overflow} (and perhaps others) would wrap; scale the inputs to "
                    f"leave headroom for {self.members} members")
            sem = self.st.sem(self.label)
            sem.chunks += self.nch
            sem.hops += self.nch
            if self.region is None:  # the memory plane's loads/stores: the switch counts
                sem.copies += self.nch  # receive into the output
                sem.crossings += 2 * self.nch
        return out

    def _allowance(self) -> float:
        """Wire time of a chunk sent now to the tree's top and back, behind the
        chunks still in flight (shaped links only; see ChunkTimers.sent)."""
        return self.st.wire_s(self.st.root_switch_id, fr.HEADER_SIZE + self.E * self.item,
                              len(self.timers))

    def get_timer(self) -> float | None:
        if self.done:
            return None
        due = self.timers.next_deadline()
        pace = self.gate.pace_wait if self.gate is not None and self.ready else None
        if pace is not None and (due is None or pace < due):
            return pace
        return due

    def waiting_for(self) -> str:
        return (f"switch {self.st.switch_name!r}, which completes a chunk only when every "
                "member contributed (is every worker alive?)")

    def handle_timer(self, now: float) -> list[Send]:
        resend, dead = self.timers.expired(now)
        if dead:
            raise FabricTimeout(
                f"{self.st.name}: allreduce {self.label} job {self.js.job}: no result for chunk "
                f"{dead[0]} within {self.st.timeout_s:g}s ({self.timers.retransmits} "
                f"retransmissions) from {self.waiting_for()}")
        if self.gate is not None:
            return self._resent(resend, now, timeout=True) + self._pump(now)  # (the pacer's)
        return [self._frame(i, True) for i in resend]


class HostRingAllreduce(Program):
    """Ring reduce-scatter + all-gather between workers through the switches.

    Each step sends this rank's segment to the right neighbour, one frame per
    chunk, and combines (or copies) what comes from the left.
    """

    def __init__(self, st: NodeState, t: Tensor, op: str, *, data: bool = True,
                 label: str = "host-ring", group: Group | None = None) -> None:
        self.st, self.t, self.data, self.label = st, t, data, label
        g = group or st.world_group
        W, r, n = g.size, g.rank, t.count
        self.W, self.r, self.n = W, r, n
        self.E = st.chunk_elems("host-ring", t.itemsize)
        self.bounds = [(n * k) // W for k in range(W + 1)]
        self.right = g.ids[(r + 1) % W]
        self.left_id = g.ids[(r - 1) % W]
        self.msg = g.next_msg()
        self.reduce = UFUNCS[op]
        self.code = fr.dtype_from_name(t.dtype)
        self.staged = np.array(t.x, copy=True) if data and t.x is not None else None
        self.step = 0
        self.expect = 0  # frames of this step still to come from the left
        self.early: dict[int, fr.Frame] = {}  # frames of later steps, by psn
        self.result = t.out
        self.hops, self.crossings = st.route_cost(self.right)
        # loss recovery: the frames of each step stay kept until the right neighbour
        # ACKs the step; a step without its ACK by the RTO is sent again
        self.unacked: dict[int, list[Send]] = {}
        self.sent_at: dict[int, float] = {}
        self.resent: set[int] = set()
        self.rtt: RttEstimator = st.estimator("ring", AGG_RTO_MIN_S)
        self.deadline: float | None = None
        self.received_all = False
        self.now = 0.0
        # integer sums never wrap silently: a segment whose sum would wrap is marked
        # (key=1 on its frames) by the rank that sees it, and the mark travels with
        # the segment round the ring, so every rank learns it and raises at the end
        self.check_wrap = op == "sum" and np_dtype(t.dtype).kind == "i"
        self.wrapped: set[int] = set()
        # Frame ACKs (key 1): where a policy runs ([congestion] cc) or switches drop
        # what does not fit, the right neighbour ACKs each frame as it arrives. A
        # policy's window is clocked by them (a step's frames go as its window and
        # pacer let them); a timeout resends only the frames not ACKed (resending
        # a whole step into a full queue would lose the same frames every time).
        # The step's ACK still ends the step. Each side works out the other's.
        frame_bytes = self.E * np_dtype(t.dtype).itemsize
        self.gate = st.congestion_gate(self.right, frame_bytes, RING_FLOW)
        left, right = st.topo.by_id(self.left_id).name, st.topo.by_id(self.right).name
        from_left = st.topo.path_congestion(left, st.name)  # what the left one runs
        self.acks_frames = _drops(from_left) or (
            from_left.cc is not None and st.cc_path(self.left_id, st.node_id, frame_bytes)
            is not None)
        self.frame_acked = (self.gate is not None
                            or _drops(st.topo.path_congestion(st.name, right)))
        self.waiting: deque[Send] = deque()  # frames the window holds, in order
        # frames sent and not yet ACKed, oldest first: psn -> (bytes in the window,
        # sent at, resent, send order)
        self.flying: dict[int, tuple[int, float, bool, int]] = {}
        self.again: set[int] = set()  # frames sent more than once (Karn: no RTT from them)
        self.sent_count = 0

    def _segment(self, k: int) -> tuple[int, int]:
        return self.bounds[k], self.bounds[k + 1]

    def _ks(self, step: int) -> tuple[int, int, bool]:
        W, r = self.W, self.r
        if step < W - 1:
            return (r - step) % W, (r - step - 1) % W, True
        s = step - (W - 1)
        return (r + 1 - s) % W, (r - s) % W, False

    def _sends(self, step: int) -> list[Send]:
        send_k, _recv_k, _ = self._ks(step)
        lo, hi = self._segment(send_k)
        out: list[Send] = []
        st, E = self.st, self.E
        sem = st.sem(self.label)
        for j in range(-(-(hi - lo) // E)):
            a, b = lo + j * E, min(hi, lo + (j + 1) * E)
            psn = (step << 16) | j
            if self.data:
                assert self.staged is not None
                part = self.staged[a:b]
            else:
                part = zeros(self.t.dtype, b - a)
            part = byte_view(part)
            out.append((fr.encode_header(Op.WRITE, src=st.node_id, dst=self.right,
                                         flow=RING_FLOW, psn=psn, msg=self.msg,
                                         key=int(send_k in self.wrapped), dtype=self.code,
                                         payload=part, crc=st.crc), part))
            sem.hops += self.hops
            sem.crossings += self.crossings
        if not st.lossless and out:
            # an empty step (a segment of no elements: fewer elements than ranks)
            # sends nothing, so nothing waits for its ACK: a lost one would never
            # be asked for again
            self.unacked[step] = out
            self.sent_at[step] = self.now
            if self.deadline is None:
                self.deadline = self.now + self.rtt.rto
        if self.gate is not None:
            self.waiting.extend(out)
            return self._pump(self.now)
        if self.frame_acked:
            for header, part in out:
                self._flying(header, part, self.now)
        return out

    def _flying(self, header: bytes, part: Any, now: float) -> None:
        """Frame ``header`` left now: the newest in flight."""
        size = memoryview(part).nbytes if part is not None else 0
        psn = fr.peek(header)[4]
        if self.flying.pop(psn, None) is not None:  # (a resend goes to the end)
            self.again.add(psn)
        self.sent_count += 1
        self.flying[psn] = (size, now, psn in self.again, self.sent_count)

    def _pump(self, now: float) -> list[Send]:
        """The waiting frames the policy's window and pacer let out now."""
        gate = self.gate
        assert gate is not None
        out: list[Send] = []
        gate.begin(now)
        while self.waiting:
            header, part = self.waiting[0]
            size = memoryview(part).nbytes if part is not None else 0
            if not gate.allows(size, now):
                break
            self.waiting.popleft()
            gate.sent(size, now)
            self._flying(header, part, now)
            out.append((header, part))
        gate.end()
        return out

    def _keep_before_overwrite(self, k: int) -> None:
        """Segment ``k`` is about to change: unacknowledged frames that view it get
        their own copy first (a resend must carry what was sent)."""
        for step, frames in self.unacked.items():
            if self._ks(step)[0] == k and frames and frames[0][1] is not None \
                    and np.shares_memory(frames[0][1], self.staged):
                self.unacked[step] = [(h, np.array(p, copy=True)) for h, p in frames]

    def _begin_step(self) -> list[Send]:
        _s, recv_k, _ = self._ks(self.step)
        lo, hi = self._segment(recv_k)
        self.expect = -(-(hi - lo) // self.E)
        self.seen = bytearray(self.expect)
        return self._sends(self.step)

    def start(self, now: float) -> list[Send]:
        nch = -(-self.n // self.E)
        self.st.sem(self.label).copies += nch
        if self.W == 1 or self.n == 0:
            if self.data and self.t.out is not None and self.t.x is not None:
                np.copyto(self.t.out, self.t.x)
            self.done = True
            return []
        self.now = now
        out = self._begin_step()
        while self.expect == 0 and not self.received_all:  # empty segments (tiny tensors)
            out.extend(self._step_ack(self.step))
            out.extend(self._finish_step())
        return out

    def wants(self, f: fr.Frame) -> bool:
        return f.flow == RING_FLOW and f.msg == self.msg and (
            (f.op is Op.WRITE and f.src == self.left_id)
            or (f.op is Op.ACK and f.src == self.right))

    def get_timer(self) -> float | None:
        if self.done:
            return None
        pace = self.gate.pace_wait if self.gate is not None and self.waiting else None
        if pace is not None and (self.deadline is None or pace < self.deadline):
            return pace
        return self.deadline

    def handle_timer(self, now: float) -> list[Send]:
        self.now = now
        if self.deadline is None or now < self.deadline:
            if self.gate is None or not self.waiting:
                return []
            out = self._pump(now)
            self._maybe_done()
            return out
        first = min(self.sent_at.values(), default=now)
        if now - first >= self.st.timeout_s:
            raise FabricTimeout(
                f"{self.st.name}: allreduce {self.label}: no ACK of ring step "
                f"{min(self.unacked)} within {self.st.timeout_s:g}s from "
                f"worker {self.st.topo.by_id(self.right).name} (its right neighbour)")
        out = [fr_ for step in sorted(self.unacked) for fr_ in self.unacked[step]]
        if self.frame_acked:  # a frame no longer in flight was ACKed (or waits to go)
            out = [(h, p) for h, p in out if fr.peek(h)[4] in self.flying]
        self.resent.update(self.unacked)
        self.st.retransmits += len(out)
        self.st.timeouts += 1
        self.rtt.backoff()
        self.deadline = now + self.rtt.rto
        if self.gate is not None:
            # what is still in flight is lost: out of the window, and the frames the
            # right neighbour has not ACKed go again as the window lets them
            for h, _p in out:
                psn = fr.peek(h)[4]
                got = self.flying.pop(psn, None)
                if got is not None:
                    self.gate.lost(got[0], now, timeout=True)
                self.again.add(psn)
            queued = {fr.peek(h)[4] for h, _p in self.waiting}
            self.waiting.extendleft(reversed([(h, p) for h, p in out
                                              if fr.peek(h)[4] not in queued]))
            return self._pump(now)
        if self.frame_acked:
            for header, part in out:
                self._flying(header, part, now)
        return out

    def _acked(self, step: int, now: float) -> None:
        if self.flying:
            # the whole step is in: frames whose own ACK was lost leave the window
            for psn in [p for p in self.flying if p >> 16 == step]:
                size = self.flying.pop(psn)[0]
                if self.gate is not None:
                    self.gate.acked(size, False, 0.0, now)
        if self.unacked.pop(step, None) is None:
            return
        sent = self.sent_at.pop(step)
        if step not in self.resent:  # Karn: no sample from a resent step
            self.rtt.sample(now - sent)
        self.deadline = None if not self.unacked else now + self.rtt.rto
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.received_all and not self.unacked and not self.waiting and not self.done:
            self.done = True
            nch = -(-self.n // self.E)
            sem = self.st.sem(self.label)
            sem.copies += nch
            sem.chunks += nch
            if self.data and self.t.out is not None:
                assert self.staged is not None
                np.copyto(self.t.out, self.staged)
            done = self.st.ring_done
            done[(self.left_id, self.msg)] = None
            while len(done) > 1024:
                done.popitem(last=False)
            if self.wrapped:
                raise SumOverflowError(
                    f"{self.st.name}: {self.label} allreduce of {self.t.dtype}: the sum of "
                    f"segment(s) {sorted(self.wrapped)} would wrap; scale the inputs to "
                    f"leave headroom for {self.W} members")

    def waiting_for(self) -> str:
        return (f"worker {self.st.topo.by_id(self.left_id).name} (ring step {self.step}, "
                "its left neighbour)")

    def _step_ack(self, step: int) -> list[Send]:
        if self.st.lossless:
            return []
        return [self._ack_frame(step)]

    def _ack_frame(self, step: int) -> Send:
        return (fr.encode_header(Op.ACK, src=self.st.node_id, dst=self.left_id, flow=RING_FLOW,
                                 psn=step, msg=self.msg, crc=self.st.crc), None)

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        self.now = now
        if f.op is Op.ACK:
            if f.key == 1:  # one frame arrived (a policy's window)
                return self._frame_acked(f, now)
            self._acked(f.psn, now)
            if self.gate is None or not self.waiting:
                return []
            pumped = self._pump(now)
            self._maybe_done()
            return pumped
        if f.psn >> 16 < self.step or self.received_all:
            # a resent frame of a step we have: our ACK was lost, say it again
            return self._step_ack(f.psn >> 16)
        # frames of later steps wait here (the left neighbour is ahead of us)
        self.early.setdefault(f.psn, f)
        out: list[Send] = []
        if self.acks_frames:  # this frame is in (with its congestion mark)
            out.append((fr.encode_header(Op.ACK, src=self.st.node_id, dst=self.left_id,
                                         flow=RING_FLOW, psn=f.psn, key=1, msg=self.msg,
                                         crc=self.st.crc,
                                         flags=Flag.ECN if f.has(Flag.ECN) else Flag.NONE),
                        None))
        while not self.received_all:
            ready = [p for p in self.early if p >> 16 == self.step]
            for psn in ready:
                self._take(self.early.pop(psn))
            if self.expect:
                return out
            out.extend(self._step_ack(self.step))
            out.extend(self._finish_step())
        return out

    def _frame_acked(self, f: fr.Frame, now: float) -> list[Send]:
        """One frame arrived at the right neighbour: out of the window (with its
        round trip and congestion mark), the timer restarts (the path moves), and
        frames sent PACKET_THRESHOLD before it and still not ACKed are lost."""
        if not self.frame_acked:
            return []
        got = self.flying.pop(f.psn, None)
        if got is None:
            return []
        size, sent, resent, order = got
        if self.unacked:
            self.deadline = now + self.rtt.rto  # RFC 6298 5.3: data was acknowledged
        if self.gate is not None:
            # Karn: a resent frame gives no round trip
            self.gate.acked(size, f.has(Flag.ECN), 0.0 if resent else now - sent, now)
        lost: list[int] = []
        for psn, entry in self.flying.items():
            if entry[3] > order - PACKET_THRESHOLD:
                break
            lost.append(psn)
        out: list[Send] = []
        for psn in reversed(lost):
            lost_size = self.flying.pop(psn)[0]
            frames = self.unacked.get(psn >> 16)
            if frames is None or (psn & 0xFFFF) >= len(frames):
                continue
            self.again.add(psn)
            self.resent.add(psn >> 16)  # Karn: the step's ACK gives no round trip
            self.st.retransmits += 1
            if self.gate is not None:  # first in line, as the window lets it
                self.gate.lost(lost_size, now, timeout=False)
                self.waiting.appendleft(frames[psn & 0xFFFF])
            else:
                out.insert(0, frames[psn & 0xFFFF])
        if self.gate is None:
            for header, part in out:
                self._flying(header, part, now)
            return out
        out = self._pump(now)
        self._maybe_done()  # (the last frames may have waited for the window)
        return out

    def _take(self, f: fr.Frame) -> None:
        j = f.psn & 0xFFFF
        if j >= len(self.seen) or self.seen[j]:
            return
        self.seen[j] = 1
        _s, recv_k, combine = self._ks(self.step)
        if self.data:
            assert self.staged is not None
            if self.unacked:
                self._keep_before_overwrite(recv_k)
            lo, hi = self._segment(recv_k)
            a, b = lo + j * self.E, min(hi, lo + (j + 1) * self.E)
            if f.length != (b - a) * self.staged.itemsize:
                # not the frame we wait for (damaged or forged): its sender resends
                # the step when our ACK does not come
                self.st.bad_frames += 1
                return
            incoming = np.frombuffer(f.payload, dtype=self.staged.dtype)
            target = self.staged[a:b]
            if f.key & 1:
                self.wrapped.add(recv_k)
            if combine:
                if self.check_wrap and recv_k not in self.wrapped \
                        and first_wrap(target, incoming) is not None:
                    self.wrapped.add(recv_k)
                self.reduce(target, incoming, out=target)
            else:
                np.copyto(target, incoming)
        self.st.sem(self.label).copies += 1
        self.expect -= 1

    def _finish_step(self) -> list[Send]:
        """This step's segment is complete: begin the next (or finish once the right
        neighbour has ACKed every step we sent)."""
        self.step += 1
        if self.step == 2 * (self.W - 1):
            self.received_all = True
            self._maybe_done()
            return []
        return self._begin_step()


class HostPsAllreduce(Program):
    """Host-staged parameter server: msgpack chunks to the host node, replies back."""

    def __init__(self, st: NodeState, t: Tensor, op: str, *, label: str = "host-ps",
                 group: Group | None = None) -> None:
        if st.host_id is None:
            raise UsageError("host-ps needs a host node in the topology (kind = \"host\")")
        if t.x is None:
            raise UsageError("host-ps runs with data only (its messages are msgpack maps)")
        self.st, self.t, self.op, self.label = st, t, op, label
        self.E = st.chunk_elems("host-ps", t.itemsize) // 2  # room for the msgpack envelope
        self.S = st.slots.get("host-ps", DEFAULT_SLOTS["host-ps"])
        self.nch = -(-t.count // self.E)
        self.group = g = group or st.world_group
        self.msg = g.next_msg()
        self.staged = np.array(t.x, copy=True)
        self.got = bytearray(self.nch)
        self.left = self.nch
        self.overflow = ""  # why a chunk's integer sum would wrap (the host says)
        self.hops, self.crossings = st.route_cost(st.host_id)
        self.result = t.out
        # a lost message or reply is sent again: the host answers a chunk it already
        # completed from its kept replies (fabric.core.hostnode), so a resend counts once
        rtt = st.estimator("host", AGG_RTO_MIN_S)
        self.timers = ChunkTimers(rtt, st.timeout_s)
        # the topology's congestion control ([congestion] cc), over the slots: a chunk
        # goes when a slot is free and the policy's window and pacer let it; the host's
        # reply is its ACK, echoing a mark its message carried (fabric.core.hostnode)
        self.wire = fr.HEADER_SIZE + self.E * t.itemsize
        self.gate = st.congestion_gate(st.host_id, self.wire, HOST_PS_FLOW)
        self.next = 0  # the next chunk sent for the first time
        self.sent_at: dict[int, float] = {}

    def _frame(self, i: int) -> Send:
        st, E = self.st, self.E
        body = msgpack.packb({"seq": self.msg, "inc": self.group.inc, "chunk": i,
                              "members": list(self.group.ids),
                              "op": self.op, "dtype": self.t.dtype,
                              "data": byte_view(self.staged[i * E:(i + 1) * E]).data})
        sem = st.sem(self.label)
        sem.encodes += 1
        sem.copies += 1
        sem.hops += self.hops
        sem.crossings += self.crossings
        assert st.host_id is not None
        return (fr.encode_header(Op.WRITE, src=st.node_id, dst=st.host_id, flow=HOST_PS_FLOW,
                                 psn=i, msg=self.msg, payload=body, crc=st.crc), body)

    def start(self, now: float) -> list[Send]:
        self.st.sem(self.label).copies += self.nch
        if self.nch == 0:
            self.done = True
        return self._pump(now)

    def _pump(self, now: float) -> list[Send]:
        """First sends of the chunks the slots (and the policy) let out now."""
        out: list[Send] = []
        gate = self.gate
        if gate is not None:
            gate.begin(now)
        while self.next < self.nch and len(self.timers) < self.S:
            i = self.next
            if gate is not None:
                if not gate.allows(self.wire, now):
                    break
                gate.sent(self.wire, now)
            self.next += 1
            self.timers.sent(i, now, self._allowance())
            self.sent_at[i] = now
            out.append(self._frame(i))
        if gate is not None:
            gate.end()
        return out

    def _resends(self, chunks: list[int], now: float, *, timeout: bool) -> list[Send]:
        gate = self.gate
        if gate is not None:
            for _ in chunks:  # lost, and sent again at once (the chunk timers pace these)
                gate.lost(self.wire, now, timeout=timeout)
                gate.sent(self.wire, now)
        return [self._frame(i) for i in chunks]

    def _allowance(self) -> float:
        """Wire time of a chunk sent now to the host and back (see ChunkTimers.sent)."""
        assert self.st.host_id is not None
        return self.st.wire_s(self.st.host_id, fr.HEADER_SIZE + self.E * self.t.itemsize,
                              len(self.timers), fan_in=len(self.group.ids))

    def get_timer(self) -> float | None:
        if self.done:
            return None
        due = self.timers.next_deadline()
        pace = self.gate.pace_wait if self.gate is not None else None
        if pace is not None and self.next < self.nch and (due is None or pace < due):
            return pace
        return due

    def handle_timer(self, now: float) -> list[Send]:
        resend, dead = self.timers.expired(now)
        if dead:
            raise FabricTimeout(
                f"{self.st.name}: allreduce host-ps: no reply for chunk {dead[0]} within "
                f"{self.st.timeout_s:g}s ({self.timers.retransmits} retransmissions) from "
                f"{self.waiting_for()}")
        self.st.retransmits += len(resend)
        self.st.timeouts += len(resend)
        out = self._resends(resend, now, timeout=True)
        if self.gate is not None:
            out.extend(self._pump(now))  # the pacer's time
        return out

    def wants(self, f: fr.Frame) -> bool:
        return (f.op is Op.WRITE and f.flow == HOST_PS_FLOW and f.msg == self.msg
                and f.src == self.st.host_id)

    def waiting_for(self) -> str:
        assert self.st.host_id is not None
        return (f"host {self.st.topo.by_id(self.st.host_id).name}, which replies when "
                "every member's chunk is in (is every worker alive?)")

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        try:
            reply = msgpack.unpackb(f.payload)
            i = int(reply["chunk"])
            data = np.frombuffer(reply["data"], dtype=self.staged.dtype)
        except Exception:  # damaged on the way: the chunk's timer sends it again
            return []
        sem = self.st.sem(self.label)
        sem.encodes += 1
        sem.copies += 1
        if not 0 <= i < self.nch or self.got[i]:
            self.st.duplicates += 1
            return []
        E = self.E
        if data.size != min(self.t.count - i * E, E):
            return []
        self.got[i] = 1
        self.left -= 1
        _, fast = self.timers.acked(i, now)
        if self.gate is not None:
            # a mark on our message (the host echoes it) or on the reply itself
            ecn = f.has(Flag.ECN) or self.st.node_id in reply.get("ce", ())
            # the round trip without the host's wait for the other members
            held = next((float(h) for m, h in reply.get("held", ()) if m == self.st.node_id),
                        0.0)
            rtt = max(now - self.sent_at.pop(i, now) - held, 0.0)
            self.gate.acked(self.wire, ecn, rtt, now)
        out = self._resends(fast, now, timeout=False)
        self.st.retransmits += len(fast)
        assert self.t.out is not None
        wrapped = reply.get("overflow")
        if wrapped:
            self.overflow = self.overflow or str(wrapped)
        else:
            np.copyto(self.t.out[i * E:(i + 1) * E], data)
        sem.copies += 1 + float(reply["h_copies"])
        sem.encodes += float(reply["h_encodes"])
        sem.hops += self.hops
        sem.crossings += self.crossings
        if self.left == 0:
            self.done = True
            sem.copies += self.nch
            sem.chunks += self.nch
            if self.overflow:
                raise SumOverflowError(f"{self.st.name}: host-ps allreduce: {self.overflow}; "
                                       f"scale the inputs to leave headroom for "
                                       f"{len(self.group.ids)} members")
            return []
        out.extend(self._pump(now))
        return out


def allreduce_program(st: NodeState, t: Tensor, op: str = "sum", path: str = "ina", *,
                      data: bool = True, region: tuple[int, int] | None = None,
                      group: Group | None = None) -> Program:
    """The program of one allreduce on ``path`` (ina, ina-mem, host-ring, host-ps).

    ``ina-mem`` needs ``region``: the (key, byte offset) of the tensor in a
    registered region, reduced in place by the switch. An in-network job the
    switch refuses falls back to host-ps (or host-ring without a host node),
    and the fallback is recorded in ``st.fallbacks``.
    """
    if path not in ("ina", "ina-mem", "host-ring", "host-ps"):
        raise UsageError(f"unknown path {path!r}; choose ina, ina-mem, host-ring or host-ps")
    if path == "ina-mem" and region is None:
        raise UsageError("ina-mem reduces a registered region: give its (key, offset)")
    if op not in UFUNCS:
        raise UsageError(f"unknown op {op!r}; choose one of {', '.join(UFUNCS)}")
    out = t.out
    if out is not None and (out.ndim != 1 or out.size != t.count or not out.flags.c_contiguous
                            or out.dtype != np_dtype(t.dtype) or not out.flags.writeable):
        raise UsageError(f"{st.name}: allreduce out must be a writable contiguous 1-D "
                         f"{t.dtype} array of {t.count} elements, like x; got {out.dtype} "
                         f"shape {out.shape}")

    g = group or st.world_group
    g.check_open(f"allreduce {path}")
    if path in ("ina", "ina-mem"):
        # the job is already granted (every call after the first): no chain to run
        js = g.jobs.get(_job_key(path, t.dtype, op))
        if js is not None and js.granted:
            return InaAllreduce(st, t, op, js, data=data, group=g,
                                region=region if path == "ina-mem" else None)

    def steps() -> Generator[Program, Any, Any]:
        if path in ("ina", "ina-mem"):
            js = yield from _job_program(st, path, t, op, referenced=path == "ina-mem",
                                         group=g)
            if js.granted:
                return (yield InaAllreduce(st, t, op, js, data=data, group=g,
                                           region=region if path == "ina-mem" else None))
        if path == "host-ps" or (path != "host-ring" and st.host_id is not None and data):
            return (yield HostPsAllreduce(st, t, op, label=path, group=g))
        return (yield HostRingAllreduce(st, t, op, data=data, label=path, group=g))

    return Chain(steps())


# ---------------------------------------------------------------------- fixed point
#: Elements per fixed-point scale block (SwitchML scales each packet's worth;
#: one scale per block keeps the extra max-allreduce small).
FIXED_BLOCK: Final = 16384


def fixed_maxima(x: np.ndarray) -> np.ndarray:
    """The largest magnitude of each FIXED_BLOCK block of float32 ``x``."""
    n = x.size
    nblk = -(-n // FIXED_BLOCK)
    pad = np.zeros(nblk * FIXED_BLOCK, np.float32)
    pad[:n] = np.abs(x)
    return pad.reshape(nblk, FIXED_BLOCK).max(axis=1)


def fixed_quantize(x: np.ndarray, maxima: np.ndarray, world: int, q: np.ndarray) -> list[float]:
    """Quantise ``x`` into int32 ``q`` block by block; the scales used."""
    from kernels.reference import choose_scale, quantize

    scales = [choose_scale(float(m), world, 32) for m in maxima]
    for b, scale in enumerate(scales):
        lo, hi = b * FIXED_BLOCK, min(x.size, (b + 1) * FIXED_BLOCK)
        q[lo:hi] = quantize(x[lo:hi], scale, "int32")
    return scales


def fixed_dequantize(q: np.ndarray, scales: list[float], out: np.ndarray) -> None:
    """Scale the summed integers back into float32 ``out``."""
    from kernels.reference import dequantize

    for b, scale in enumerate(scales):
        lo, hi = b * FIXED_BLOCK, min(q.size, (b + 1) * FIXED_BLOCK)
        out[lo:hi] = dequantize(q[lo:hi], scale)


def fixed_program(st: NodeState, t: Tensor, path: str, group: Group | None = None) -> Program:
    """Sum float32 as fixed-point int32 with a per-block scale (frame-plane and host
    paths): agree on each block's maximum (a max allreduce), quantise so that
    ``world`` values cannot overflow, sum the integers, scale back. Integer sums
    do not depend on arrival order: bitwise the same result on every path and run."""
    if t.x is None or t.out is None or t.x.dtype != np.float32:
        raise UsageError("fixed-point numerics take float32 tensors")
    x, out = t.x, t.out

    def steps() -> Generator[Program, Any, Any]:
        maxima = fixed_maxima(x)
        yield allreduce_program(st, Tensor(maxima.size, "float32", maxima, maxima), "max", path,
                                group=group)
        q = np.empty(x.size, np.int32)
        scales = fixed_quantize(x, maxima, (group or st.world_group).size, q)
        yield allreduce_program(st, Tensor(q.size, "int32", q, q), "sum", path, group=group)
        fixed_dequantize(q, scales, out)
        return out

    return Chain(steps())


def _drops(cong: CongestionSettings) -> bool:
    """Whether switches with settings ``cong`` drop or trim what does not fit."""
    return cong.buffer_bytes is not None and not cong.pfc and not cong.credit


# ---------------------------------------------------------------------- p2p streams
#: Flows of streams: point-to-point data travels on P2P_FLOW, collective streams'
#: on COLL_FLOW, and their ACK/NACK back on the flow + 1, so A -> B and B -> A
#: streams never take each other's frames (other flows: 2 host-ps, 3 ring). Both
#: are the frame codec's STREAM_FLOWS, the flows a switch trims rather than drops.
#: A receiver is done when it has every byte; a retransmission after that (its
#: last ACK was lost) is acknowledged by NodeState.answer_stale.
P2P_FLOW, COLL_FLOW = fr.STREAM_FLOWS
#: Retransmissions of one frame before a stream fails, and the RTO ceiling: a
#: fabric's round trip is milliseconds, and go-back-N under heavy loss needs
#: many rounds for a tail frame.
STREAM_MAX_RETRIES: Final = 64
STREAM_RTO_MAX_S: Final = 1.0
#: Where switch buffers are bounded, the RTO ceiling in RTO floors (a floor is
#: one window at the path's bottleneck rate): a frame lost behind a full queue
#: may be lost again, and a 1 s ceiling made each such loss cost up to a second
#: (docs/CONGESTION.md "Timeouts behind a full queue").
STREAM_BOUNDED_RTO_FLOORS: Final = 2
#: ... but never below this many smoothed round trips (a ceiling under the path's
#: true round trip would resend every frame; fabric.core.reliability.RttEstimator).
BOUNDED_RTO_SRTTS: Final = 2.0
#: With a ceiling below STREAM_RTO_MAX_S, a stream also needs this long since a
#: frame's first transmission before it gives up on it, so a stalled host (an
#: emulator's scheduling) does not exhaust the retries in a second.
STREAM_GIVE_UP_S: Final = 10.0
#: Windows a node may have queued on its link at once (a collective runs one
#: stream per peer), for the first RTO on a slow link.
STREAMS_IN_FLIGHT: Final = 4
#: Frames in flight per stream (a deeper window only queues in the sockets).
STREAM_WINDOW: Final = 16
#: PSNs a stream's frames may span, a hole included: the SACK bitmap's width, so
#: the receiver can report every frame of the span. Wider than the window, new
#: frames keep going past a lost one, and their ACKs reveal a lost resend
#: (measured in docs/RELIABILITY.md "In the emulator").
STREAM_SPAN: Final = SACK_BITS
STREAM_FRAME_BYTES: Final = 64 * 1024
_F_LAST: Final = int(Flag.LAST)


def stream_span(policy: str, window_frames: int) -> int:
    """PSN span of a stream under ``policy``: STREAM_SPAN when its receiver keeps
    frames past a hole (selective repeat); else the window, since go-back-N
    discards them and resends from the hole, so frames sent past it are waste."""
    return max(STREAM_SPAN, window_frames) if get_policy(policy).receiver_buffers \
        else window_frames


def _zero_bytes(n: int) -> np.ndarray:
    """A shared read-only zero payload of ``n`` bytes (timing-only streams)."""
    z = _ZEROS.get(("bytes", n))
    if z is None:
        z = _ZEROS[("bytes", n)] = np.zeros(n, np.uint8)
        z.flags.writeable = False
    return z


def _stream_id(st: NodeState, direction: str, peer: int) -> int:
    """The next stream id of this direction with ``peer``; both ends count alike."""
    streams = st.stream_ids
    sid = streams.get((direction, peer), 0) + 1
    streams[(direction, peer)] = sid
    return sid & 0xFFFF


class StreamSend(Program):
    """Send bytes reliably to another worker as WRITEs (selective repeat or go-back-N
    by name), under the pure :class:`fabric.core.reliability.Sender`."""

    def __init__(self, st: NodeState, dst_rank: int, data: np.ndarray | None, nbytes: int = 0,
                 *, policy: str = "selective", frame_bytes: int | None = None,
                 window_frames: int = STREAM_WINDOW, sid: int | None = None,
                 flow: int = P2P_FLOW, msg: int = 0) -> None:
        if not 0 <= dst_rank < st.world or dst_rank == st.rank:
            raise UsageError(f"{st.name}: send to rank {dst_rank}: not another worker's rank "
                             f"(0..{st.world - 1}, not {st.rank})")
        self.st = st
        self.buf = byte_view(data) if data is not None else None
        self.nbytes = self.buf.nbytes if self.buf is not None else nbytes
        self.dst = st.worker_ids[dst_rank]
        # collectives name their streams (sid, flow, msg); user streams are counted
        self.sid = _stream_id(st, "to", self.dst) if sid is None else sid & 0xFFFF
        self.flow, self.msg = flow, msg
        self.fb = frame_bytes = frame_bytes or st.stream_frame_bytes
        self.nframes = max(-(-self.nbytes // frame_bytes), 1)
        self.peer = st.topo.by_id(self.dst).name
        self.sender: Sender[int] = st.stream_sender(
            P2P_FLOW, self.dst, policy=policy, window_frames=window_frames,
            span_frames=stream_span(policy, window_frames), frame_bytes=frame_bytes,
            operation="WRITE stream", key=(flow << 32) | (self.sid << 16) | msg)
        self.t0 = 0.0

    def _put(self, transmits: list[Any]) -> list[Send]:
        out: list[Send] = []
        st = self.st
        for t in transmits:
            off = t.handle * self.fb
            n = min(self.fb, self.nbytes - off)
            part = self.buf[off: off + n] if self.buf is not None else _zero_bytes(n)
            # LAST marks the stream's end: a receiver expecting another size says so
            flags = int(t.flags) | (_F_LAST if off + n == self.nbytes else 0)
            out.append((fr.encode_header(Op.WRITE, src=st.node_id, dst=self.dst, flow=self.flow,
                                         job=self.sid, psn=t.psn, offset=off, flags=flags,
                                         msg=self.msg, payload=part, crc=st.crc), part))
        return out

    def _check_done(self, now: float, out: list[Send]) -> list[Send]:
        if self.sender.done and not self.done:
            self.done = True
            stats = {**asdict(self.sender.statistics()), "seconds": now - self.t0}
            self.result = stats
            self.st.retransmits += stats["retransmitted"]
            self.st.timeouts += stats["timeouts"]
        return out

    def start(self, now: float) -> list[Send]:
        self.t0 = now
        frames = ((i, min(self.fb, self.nbytes - i * self.fb)) for i in range(self.nframes))
        return self._put(self.sender.send_many(frames, now))

    def source(self) -> int | None:
        return self.dst  # its ACKs and NACKs

    def wants(self, f: fr.Frame) -> bool:
        return (f.flow == self.flow + 1 and f.src == self.dst and f.job == self.sid
                and f.msg == self.msg and (f.op is Op.ACK or f.op is Op.NACK
                                           or f.op is Op.CREDIT))

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        if f.op is Op.ACK:
            out = self._put(self.sender.handle_ack(f.psn, f.sack, now,
                                                   f.has(Flag.ECN)))
        elif f.op is Op.CREDIT:  # the receiver grants more (a receiver-driven policy)
            out = self._put(self.sender.grant(f.offset, now))
        else:
            out = self._put(self.sender.handle_nack(f.psn, f.offset, now))
        return self._check_done(now, out)

    def get_timer(self) -> float | None:
        return None if self.done else self.sender.get_timer()

    def handle_timer(self, now: float) -> list[Send]:
        return self._check_done(now, self._put(self.sender.handle_timer(now)))

    def waiting_for(self) -> str:
        return f"worker {self.peer} (ACKs of WRITE stream {self.sid})"


class StreamRecv(Program):
    """Receive a stream from another worker into ``out`` (each slice stored at its
    offset on first arrival), answering with ACK + SACK and gap NACKs."""

    def __init__(self, st: NodeState, src_rank: int, out: np.ndarray | None, nbytes: int = 0,
                 *, policy: str = "selective", frame_bytes: int | None = None,
                 window_frames: int = STREAM_WINDOW, sid: int | None = None,
                 flow: int = P2P_FLOW, msg: int = 0) -> None:
        from fabric.core.reliability import Receiver

        if not 0 <= src_rank < st.world or src_rank == st.rank:
            raise UsageError(f"{st.name}: receive from rank {src_rank}: not another worker's "
                             f"rank (0..{st.world - 1}, not {st.rank})")
        self.st = st
        self.buf = byte_view(out) if out is not None else None
        self.nbytes = self.buf.nbytes if self.buf is not None else nbytes
        self.src = st.worker_ids[src_rank]
        self.sid = _stream_id(st, "from", self.src) if sid is None else sid & 0xFFFF
        self.flow, self.msg = flow, msg
        self.fb = frame_bytes = frame_bytes or st.stream_frame_bytes
        self.nframes = max(-(-self.nbytes // frame_bytes), 1)
        self.receiver: Receiver[int] = Receiver(P2P_FLOW, policy=policy, ordered=False,
                                                window=stream_span(policy, window_frames))
        self.got = bytearray(self.nframes)
        self.count = 0
        self.last_heard = 0.0
        self.error: PeerFailed | None = None
        self.result = out
        self.opened = False  # its first frame came (receiver-driven credit flows)

    def start(self, now: float) -> list[Send]:
        self.last_heard = now
        return []

    def source(self) -> int | None:
        return self.src

    def wants(self, f: fr.Frame) -> bool:
        return (f.op is Op.WRITE and f.flow == self.flow and f.src == self.src
                and f.job == self.sid and f.msg == self.msg)

    def _acks(self, ack: Any) -> list[Send]:
        if ack is None:
            return []
        return [(h, None) for h in ack.frames(src=self.st.node_id, dst=self.src,
                                              flow=self.flow + 1, job=self.sid, msg=self.msg,
                                              crc=self.st.crc)]

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        self.last_heard = now
        index = f.offset // self.fb
        end = f.offset + f.length
        if end > self.nbytes or (f.has(Flag.LAST) and end != self.nbytes):
            # the sender's stream has another size than this receive: refuse it (the
            # sender fails at once) and fail here, naming both ends
            peer = self.st.topo.by_id(self.src).name
            self.error = PeerFailed(
                f"{self.st.name}: {peer} sends {end if f.has(Flag.LAST) else f'> {end - 1}'} "
                f"bytes, but this receive expects {self.nbytes} (sizes disagree between the "
                "two ranks)")
            return [(fr.encode_nack(src=self.st.node_id, dst=self.src, flow=self.flow + 1,
                                    psn=f.psn, code=NackCode.PERMISSION, job=self.sid,
                                    msg=self.msg), None)]
        if index >= self.nframes or f.offset % self.fb:
            return []  # not ours (or damaged): never write outside the buffer
        grants: list[Send] = []
        if not self.opened:  # its sender is there: credit for what it sends beyond its
            self.opened = True  # first bytes (a receiver-driven policy)
            grants = self.st.credit_open(self.src, self.flow, self.sid, self.msg,
                                         self.nbytes, self.fb, now)
        delivered, ack = self.receiver.handle_frame(f.psn, index, now, flags=f.flags)
        for d in delivered:
            if not self.got[d.handle]:
                self.got[d.handle] = 1
                self.count += 1
                if self.buf is not None:
                    self.buf[f.offset: f.offset + f.length] = np.frombuffer(f.payload, np.uint8)
        if self.count == self.nframes:
            # done at once: the last ACK goes now, and a retransmission that shows it
            # was lost is answered by NodeState.answer_stale
            self.done = True
            self.st.stream_done(self.src, self.flow, self.sid, self.msg,
                                self.receiver.cum_psn)
            self.st.credit_close(self.src, self.flow, self.sid, self.msg)
            return grants + self._acks(self.receiver.make_ack())
        return grants + self._acks(ack)

    def get_timer(self) -> float | None:
        if self.done:
            return None
        if self.error is not None:
            return self.last_heard  # fail from the driver's timer call, after the NACK
        t = self.receiver.get_timer()
        end = self.last_heard + self.st.timeout_s
        due = end if t is None else min(t, end)
        # (the node's credit pacer, for any stream: one whose first frames were all
        # cut is known by their headers alone)
        credit = self.st.credit_timer()
        return due if credit is None else min(due, credit)

    def handle_timer(self, now: float) -> list[Send]:
        if self.error is not None:
            raise self.error
        # the same sum as get_timer's (a difference may round below the interval)
        if now >= self.last_heard + self.st.timeout_s:
            raise FabricTimeout(
                f"{self.st.name}: WRITE stream {self.sid} from "
                f"{self.st.topo.by_id(self.src).name}: nothing for {self.st.timeout_s:g}s "
                f"({self.count}/{self.nframes} frames)")
        return self.st.credit_grants(now) + self._acks(self.receiver.handle_timer(now))

    def waiting_for(self) -> str:
        return f"worker {self.st.topo.by_id(self.src).name} (WRITE stream {self.sid})"


class Parallel(Program):
    """Several programs at once (e.g. a send and a receive): each frame goes to the
    first that wants it; done when all are; results in order.

    A frame is offered to the programs of its sender (:meth:`Program.source`)
    and to those that take any sender's, in order; the next deadline is kept
    per program (:class:`fabric.core.timers.Deadlines`): with a thousand
    receivers, neither costs a pass over all of them per frame.
    """

    def __init__(self, progs: list[Program]) -> None:
        self.progs = progs
        self._left = len(progs)
        self._by_source: dict[int, list[int]] = {}
        self._any: list[int] = []
        for i, p in enumerate(progs):
            src = p.source()
            if src is None:
                self._any.append(i)
            else:
                self._by_source.setdefault(src, []).append(i)
        self._timers = Deadlines()

    def _note(self, i: int) -> None:
        """Program ``i`` ran a step: its deadline, and whether it is done."""
        p = self.progs[i]
        if p.done:
            if self._timers.set_done(i):
                self._left -= 1
        else:
            self._timers.set(i, p.get_timer())

    def _finish(self) -> None:
        if not self._left and not self.done:
            self.done = True
            self.result = [p.result for p in self.progs]

    def _candidates(self, f: fr.Frame) -> list[int]:
        mine = self._by_source.get(f.src)
        if mine is None:
            return self._any
        return sorted(mine + self._any) if self._any else mine

    def start(self, now: float) -> list[Send]:
        out: list[Send] = []
        for i, p in enumerate(self.progs):
            out.extend(p.start(now))
            self._note(i)
        self._finish()
        return out

    def wants(self, f: fr.Frame) -> bool:
        progs = self.progs
        return any(not progs[i].done and progs[i].wants(f) for i in self._candidates(f))

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        for i in self._candidates(f):
            p = self.progs[i]
            if not p.done and p.wants(f):
                out = p.handle_frame(f, now)
                self._note(i)
                if p.done:
                    self._finish()
                return out
        return []

    def get_timer(self) -> float | None:
        return self._timers.earliest()

    def handle_timer(self, now: float) -> list[Send]:
        out: list[Send] = []
        for i in self._timers.take_due(now):
            p = self.progs[i]
            if not p.done:
                out.extend(p.handle_timer(now))
            self._note(i)
        self._finish()
        return out

    def waiting_for(self) -> str:
        return "; ".join(p.waiting_for() for p in self.progs if not p.done) or "nobody"
