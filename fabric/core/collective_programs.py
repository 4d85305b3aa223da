"""The collective set beyond allreduce, and communicators: pure programs.

Every collective of the nccl-tests set is a program over one node's
:class:`~fabric.core.programs.NodeState`, run by either driver (emulation:
``Endpoint.run``; simulation: ``fabric.sim``). Paths:

``ina``
    the switch helps: ``broadcast`` and ``all_gather`` are multicast streams
    (one frame with ``Flag.MCAST`` to a group; each switch replicates it to
    the ports that lead to members, so a frame crosses each link once), and
    ``reduce`` / ``reduce_scatter`` are in-network aggregation jobs whose
    chunk results go to their owner only (the others get a 32-byte
    completion that clocks their window).
``host-p2p``
    direct reliable WRITE streams between the workers, through the switches.
``host-ring``
    ring steps of streams to the right neighbour (``all_gather``,
    ``reduce_scatter``).

Shapes follow NCCL: ``all_gather`` takes ``m`` elements and returns
``size * m``; ``reduce_scatter`` takes ``size * m`` and returns the ``m`` of
this rank's segment; ``alltoall`` takes and returns ``size * m`` (segment
``k`` goes to rank ``k``); ``alltoallv`` takes per-rank element counts.

A group (communicator) is created by every member with the same ranks in the
same order (:func:`group_program`); the tree root hands out its id, so its
jobs, message ids and barriers never mix with another group's.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, Final

import numpy as np

from fabric.core import frame as fr
from fabric.core.frame import Flag, Op
from fabric.core.programs import (
    COLL_FLOW,
    STREAM_WINDOW,
    Chain,
    Group,
    InaAllreduce,
    JobState,
    NodeState,
    Parallel,
    Program,
    Request,
    Send,
    StreamRecv,
    StreamSend,
    Tensor,
    _job_program,
    _zero_bytes,
    barrier_program,
)
from fabric.core.timers import Deadlines
from fabric.errors import PeerFailed, UsageError
from kernels.dtypes import UFUNCS, byte_view, np_dtype

_F_MCAST: Final = int(Flag.MCAST)
_F_LAST: Final = int(Flag.LAST)

__all__ = [
    "COLLECTIVES",
    "COLL_FLOW",
    "InaReduce",
    "McastSend",
    "collective_program",
    "close_group_program",
    "group_program",
    "segment_bounds",
    "stream_id",
]

#: Paths of each collective, the first being the default.
COLLECTIVES: dict[str, tuple[str, ...]] = {
    "all_gather": ("ina", "host-p2p", "host-ring"),
    "reduce_scatter": ("ina", "host-p2p", "host-ring"),
    "broadcast": ("ina", "host-p2p"),
    "reduce": ("ina", "host-p2p"),
    "alltoall": ("host-p2p",),
    "alltoallv": ("host-p2p",),
    "gather": ("host-p2p",),
    "scatter": ("host-p2p",),
}


def segment_bounds(counts: Sequence[int]) -> list[int]:
    """Element offsets of consecutive segments of ``counts`` elements."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def stream_id(msg: int, slot: int) -> int:
    """Stream id of stream ``slot`` of collective ``msg`` (with src, flow and msg,
    it names one stream)."""
    return ((msg & 0xFF) << 8 | (slot & 0xFF)) & 0xFFFF


# ---------------------------------------------------------------------- groups
def group_program(st: NodeState, ranks: object) -> Program:
    """Create a communicator of world ``ranks`` (a sequence of ints, in group-rank
    order); its result is the :class:`~fabric.core.programs.Group`. Every member
    calls it with the same ranks; the group is usable once every member's switch
    knows it (a group barrier)."""
    # ``object``, checked here: the compiled build would raise TypeError on a
    # wrongly typed element before any check of ours could name the mistake
    try:
        given: list[object] = list(ranks)  # type: ignore[call-overload]
    except TypeError:
        raise UsageError(f"{st.name}: group ranks must be a list of world ranks, "
                         f"not {type(ranks).__name__}") from None
    if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in given):
        raise UsageError(f"{st.name}: group ranks {given!r} must be integers (world ranks "
                         f"0..{st.world - 1})")
    rk = tuple(int(r) for r in given)  # type: ignore[call-overload]
    if not rk or len(set(rk)) != len(rk) or any(not 0 <= r < st.world for r in rk):
        raise UsageError(f"{st.name}: group ranks {given} must be distinct world ranks "
                         f"in 0..{st.world - 1}")
    if st.rank not in rk:
        raise UsageError(f"{st.name}: rank {st.rank} creates group {list(rk)} it is not in; "
                         "only members create a group")
    ids = tuple(st.worker_ids[r] for r in rk)
    key = tuple(sorted(ids))
    nth = st.groups_made.get(key, 0)
    st.groups_made[key] = nth + 1
    members = list(key)

    def steps() -> Generator[Program, Any, Group]:
        # the rank order goes too: members that disagree on it fail, told why
        reply = yield Request(st, "group", "group_reply", members=members, nth=nth, waits=True,
                              order=list(ids), match=lambda m: m.get("nth") == nth
                              and m.get("members") == members)
        gid = int(reply.get("gid", -1))
        if gid <= 0:
            raise PeerFailed(f"{st.name}: group {list(rk)} refused: {reply.get('reason')}")
        inc = reply.get("inc", 0)
        g = Group(gid, rk, ids, rk.index(st.rank), nth, inc if isinstance(inc, int) else 0)
        yield barrier_program(st, g)  # every member registered: every switch knows it
        return g

    return Chain(steps())


def close_group_program(st: NodeState, g: Group) -> Program:
    """Close a communicator: wait for every member, release its in-network jobs
    (their switch memory is free again), forget the multicast group."""
    g.check_open("close")
    members = sorted(g.ids)

    def steps() -> Generator[Program, Any, None]:
        yield barrier_program(st, g)
        for js in [*g.jobs.values(), *g.dropped]:
            if js.granted:
                yield Request(st, "release", "release_reply", job=js.job, tag=g.tag,
                              match=_job_is(js.job))
        g.jobs.clear()
        g.dropped.clear()
        yield Request(st, "group_release", "group_released", members=members, nth=g.nth,
                      match=lambda m: m.get("nth") == g.nth and m.get("members") == members)
        g.closed = True

    return Chain(steps())


def _job_is(job: int) -> Any:
    """A reply matcher: the reply names ``job``."""
    return lambda m: m.get("job") == job


# ---------------------------------------------------------------------- multicast
class McastSend(Program):
    """A reliable stream from this member to every other member of ``group``, sent
    once with ``Flag.MCAST`` (the switches replicate it).

    Each receiver is an ordinary :class:`~fabric.core.programs.StreamRecv`. The sender
    keeps one :class:`fabric.core.reliability.Sender` per receiver, all fed the same
    frames: a frame goes out (multicast, once) when every receiver's window has
    let it out, and a loss one receiver reports is repaired for it alone (unicast).
    """

    def __init__(self, st: NodeState, group: Group, data: np.ndarray | None, nbytes: int = 0,
                 *, sid: int, msg: int, policy: str = "selective",
                 frame_bytes: int | None = None,
                 window_frames: int = STREAM_WINDOW) -> None:
        from fabric.core.reliability import Sender

        self.st, self.g = st, group
        self.buf = byte_view(data) if data is not None else None
        self.nbytes = self.buf.nbytes if self.buf is not None else nbytes
        self.sid, self.msg = sid & 0xFFFF, msg
        self.fb = frame_bytes = frame_bytes or st.stream_frame_bytes
        self.nframes = max(-(-self.nbytes // frame_bytes), 1)
        self.receivers = [d for d in group.ids if d != st.node_id]
        self.senders: dict[int, Sender[int]] = {}
        for d in self.receivers:
            self.senders[d] = st.stream_sender(
                COLL_FLOW, d, policy=policy, window_frames=window_frames,
                frame_bytes=frame_bytes, operation="multicast stream",
                key=(self.sid << 32) | msg)
        self.released: dict[int, int] = {}  # psn -> receivers whose window let it out
        self.retransmits = 0
        self.t0 = 0.0
        # each receiver's next deadline, and how many are still to finish (no pass
        # over every receiver per frame: see fabric.core.timers.Deadlines)
        self._timers = Deadlines()
        self._left = len(self.senders)

    def _frame(self, psn: int, handle: int, flags: Flag, dst: int, mcast: bool) -> Send:
        off = handle * self.fb
        n = min(self.fb, self.nbytes - off)
        part = self.buf[off: off + n] if self.buf is not None else _zero_bytes(n)
        bits = int(flags)  # int masks: a Flag operator goes through the enum
        if mcast:
            bits |= _F_MCAST
        if off + n == self.nbytes:
            bits |= _F_LAST
        return (fr.encode_header(Op.WRITE, src=self.st.node_id, dst=dst, flow=COLL_FLOW,
                                 job=self.sid, psn=psn, offset=off, flags=bits, msg=self.msg,
                                 payload=part, crc=self.st.crc), part)

    def _put(self, dst: int, transmits: list[Any]) -> list[Send]:
        out: list[Send] = []
        need = len(self.receivers)
        for t in transmits:
            if t.retransmit:  # repaired for this receiver alone
                self.retransmits += 1
                out.append(self._frame(t.psn, t.handle, t.flags, dst, False))
                continue
            n = self.released.get(t.psn, 0) + 1
            if n < need:
                self.released[t.psn] = n
                continue
            self.released.pop(t.psn, None)
            out.append(self._frame(t.psn, t.handle, t.flags, self.g.gid, True))
        return out

    def _note(self, d: int) -> None:
        s = self.senders[d]
        if s.done:
            if self._timers.set_done(d):
                self._left -= 1
        else:
            self._timers.set(d, s.get_timer())

    def _check_done(self, now: float, out: list[Send]) -> list[Send]:
        if not self.done and not self._left:
            self.done = True
            self.st.retransmits += self.retransmits
            self.st.timeouts += sum(s.statistics().timeouts for s in self.senders.values())
            self.result = {"seconds": now - self.t0, "retransmitted": self.retransmits,
                           "frames": self.nframes}
        return out

    def start(self, now: float) -> list[Send]:
        self.t0 = now
        out: list[Send] = []
        for d, s in self.senders.items():
            frames = ((i, min(self.fb, self.nbytes - i * self.fb)) for i in range(self.nframes))
            out.extend(self._put(d, s.send_many(frames, now)))
            self._note(d)
        return self._check_done(now, out)

    def wants(self, f: fr.Frame) -> bool:
        return (f.flow == COLL_FLOW + 1 and f.job == self.sid and f.msg == self.msg
                and f.src in self.senders and (f.op is Op.ACK or f.op is Op.NACK
                                               or f.op is Op.CREDIT))

    def handle_frame(self, f: fr.Frame, now: float) -> list[Send]:
        s = self.senders[f.src]
        if s.done:
            return []
        if f.op is Op.ACK:
            sends = s.handle_ack(f.psn, f.sack, now, f.has(Flag.ECN))
        elif f.op is Op.CREDIT:  # this receiver grants more (a receiver-driven policy)
            sends = s.grant(f.offset, now)
        else:
            sends = s.handle_nack(f.psn, f.offset, now)
        out = self._put(f.src, sends)
        self._note(f.src)
        return self._check_done(now, out)

    def get_timer(self) -> float | None:
        return None if self.done else self._timers.earliest()

    def handle_timer(self, now: float) -> list[Send]:
        out: list[Send] = []
        for d in self._timers.take_due(now):
            s = self.senders[d]
            if not s.done:
                out.extend(self._put(d, s.handle_timer(now)))
            self._note(d)
        return self._check_done(now, out)

    def waiting_for(self) -> str:
        late = [s.peer for s in self.senders.values() if not s.done]
        return f"ACKs of multicast stream {self.sid} from {', '.join(late) or 'nobody'}"


# ---------------------------------------------------------------------- reduce to owners
class InaReduce(InaAllreduce):
    """In-network reduce to owners (``reduce``, ``reduce_scatter``): the tensor is cut
    into segments, one per owner; no chunk straddles two. Every member sends every
    chunk; the switch sends each chunk's result to its owner only (frame ``key``)."""

    def __init__(self, st: NodeState, t: Tensor, op: str, js: JobState,
                 segments: Sequence[tuple[int, int, int]], *, data: bool = True,
                 group: Group | None = None) -> None:
        self.segments = [(lo, hi, owner) for lo, hi, owner in segments if hi > lo]
        super().__init__(st, t, op, js, data=data, group=group)

    def _layout(self) -> int:
        me = self.st.node_id
        self.spans: list[tuple[int, int, int, int | None]] = []
        for lo, hi, owner in self.segments:
            for a in range(lo, hi, self.E):
                self.spans.append((a, min(self.E, hi - a), owner, a - lo if owner == me else None))
        return len(self.spans)

    def _span(self, i: int) -> tuple[int, int]:
        lo, count, _owner, _dest = self.spans[i]
        return lo, count

    def _dest(self, i: int) -> int | None:
        return self.spans[i][3]

    def _owner(self, i: int) -> int:
        return self.spans[i][2]


# ---------------------------------------------------------------------- helpers
def _recv_stream(st: NodeState, g: Group, k: int, out: np.ndarray | None, nbytes: int,
                 msg: int, slot: int) -> StreamRecv:
    return StreamRecv(st, g.ranks[k], out, nbytes, sid=stream_id(msg, slot), flow=COLL_FLOW,
                      msg=msg)


def _send_stream(st: NodeState, g: Group, k: int, x: np.ndarray | None, nbytes: int,
                 msg: int, slot: int) -> StreamSend:
    return StreamSend(st, g.ranks[k], x, nbytes, sid=stream_id(msg, slot), flow=COLL_FLOW, msg=msg)


class _Done(Program):
    """A program with nothing to do (a collective of one member)."""

    def __init__(self, result: Any = None) -> None:
        self.done = True
        self.result = result


def _seg(a: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    return None if a is None else a[lo:hi]


def _reduce_in_order(parts: list[np.ndarray], op: str, out: np.ndarray) -> None:
    """``out`` = parts[0] op parts[1] op ... in rank order (the same on every run)."""
    np.copyto(out, parts[0])
    for p in parts[1:]:
        UFUNCS[op](out, p, out=out)


# ---------------------------------------------------------------------- the collective set
def collective_program(st: NodeState, kind: str, x: np.ndarray | None,
                       out: np.ndarray | None, *, path: str | None = None, op: str = "sum",
                       root: int = 0, group: Group | None = None,
                       send_counts: Sequence[int] | None = None,
                       recv_counts: Sequence[int] | None = None, count: int = 0,
                       dtype: str = "float32") -> Program:
    """The program of one collective ``kind`` (see :data:`COLLECTIVES`).

    ``x``/``out`` are 1-D arrays (``out`` is filled and returned); with
    ``x=None`` the run is timing-only (simulation): ``count`` elements of
    ``dtype`` are this rank's input size (NCCL's count for each collective).
    ``root`` is a group rank (broadcast, reduce, gather, scatter).
    """
    g = group or st.world_group
    if kind not in COLLECTIVES:
        raise UsageError(f"unknown collective {kind!r}; choose one of {', '.join(COLLECTIVES)}")
    paths = COLLECTIVES[kind]
    path = path or paths[0]
    if path not in paths:
        raise UsageError(f"{kind} has no path {path!r}; choose one of {', '.join(paths)}")
    g.check_open(kind)
    if op not in UFUNCS:
        raise UsageError(f"unknown op {op!r}; choose one of {', '.join(UFUNCS)}")
    W, r = g.size, g.rank
    if not 0 <= root < W:
        raise UsageError(f"{st.name}: {kind} root {root} is not a rank of the group "
                         f"(0..{W - 1})")
    data = x is not None
    if data:
        assert x is not None
        if x.ndim != 1 or not x.flags.c_contiguous:
            raise UsageError(f"{kind} takes a 1-D contiguous array (use x.reshape(-1))")
        from kernels.dtypes import dtype_name

        dtype, count = dtype_name(x.dtype), x.size
    item = np_dtype(dtype).itemsize
    msg = g.next_msg()
    args = (st, g, x, out, W, r, msg, item)
    if kind in ("alltoall", "alltoallv"):
        if kind == "alltoall":
            if count % W:
                raise UsageError(f"alltoall of {count} elements over {W} ranks: the count "
                                 "must be a multiple of the group size")
            sc = rc = [count // W] * W
        else:
            if send_counts is None or recv_counts is None or len(send_counts) != W \
                    or len(recv_counts) != W or min(*send_counts, *recv_counts) < 0:
                raise UsageError(f"alltoallv needs send_counts and recv_counts of {W} "
                                 "non-negative element counts")
            sc, rc = list(send_counts), list(recv_counts)
            if sum(sc) != count:
                raise UsageError(f"alltoallv: send_counts sum to {sum(sc)}, x has {count}")
        return _alltoall(*args, sc, rc)
    if kind == "all_gather":
        return _all_gather(*args, count, path)
    if kind == "reduce_scatter":
        if count % W:
            raise UsageError(f"reduce_scatter of {count} elements over {W} ranks: the count "
                             "must be a multiple of the group size")
        return _reduce_scatter(*args, count, path, op, dtype)
    if kind == "broadcast":
        return _broadcast(*args, count, path, root)
    if kind == "reduce":
        return _reduce(*args, count, path, op, dtype, root)
    if kind == "gather":
        return _gather(*args, count, root)
    return _scatter(*args, count, root)


def _need_out(out: np.ndarray | None, x: np.ndarray | None, n: int, kind: str) -> None:
    if x is None:
        return
    if out is None or out.size != n or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise UsageError(f"{kind}: out must be a contiguous {x.dtype} array of {n} elements")


def _alltoall(st: NodeState, g: Group, x: np.ndarray | None, out: np.ndarray | None, W: int,
              r: int, msg: int, item: int, sc: list[int], rc: list[int]) -> Program:
    _need_out(out, x, sum(rc), "alltoall")
    if x is not None and out is not None and np.shares_memory(x, out):
        # in place (or overlapping): what is still to be sent would be overwritten
        # by what arrives first, so send from a copy
        x = x.copy()
    sb, rb = segment_bounds(sc), segment_bounds(rc)
    progs: list[Program] = []
    for k in range(W):
        if k == r:
            continue
        if sc[k]:
            progs.append(_send_stream(st, g, k, _seg(x, sb[k], sb[k + 1]), sc[k] * item, msg, 0))
        if rc[k]:
            progs.append(_recv_stream(st, g, k, _seg(out, rb[k], rb[k + 1]), rc[k] * item,
                                      msg, 0))
    if x is not None and out is not None:
        if sc[r] != rc[r]:
            raise UsageError(f"{st.name}: alltoallv sends {sc[r]} elements to itself but "
                             f"receives {rc[r]}")
        out[rb[r]:rb[r + 1]] = x[sb[r]:sb[r + 1]]
    return _finish(Parallel(progs), out)


def _finish(prog: Program, result: Any) -> Program:
    """Run ``prog``; the collective's result is ``result`` (the output array)."""

    def steps() -> Generator[Program, Any, Any]:
        yield prog
        return result

    return Chain(steps())


def _all_gather(st: NodeState, g: Group, x: np.ndarray | None, out: np.ndarray | None, W: int,
                r: int, msg: int, item: int, m: int, path: str) -> Program:
    _need_out(out, x, W * m, "all_gather")
    if x is not None and out is not None:
        out[r * m:(r + 1) * m] = x
    if W == 1 or m == 0:
        return _Done(out)
    if path == "host-ring":
        right, left = (r + 1) % W, (r - 1) % W

        def steps() -> Generator[Program, Any, Any]:
            for s in range(W - 1):
                ks, kr = (r - s) % W, (r - s - 1) % W
                yield Parallel([
                    _send_stream(st, g, right, _seg(out, ks * m, (ks + 1) * m), m * item, msg, s),
                    _recv_stream(st, g, left, _seg(out, kr * m, (kr + 1) * m), m * item, msg, s)])
            return out

        return Chain(steps())
    progs: list[Program] = []
    if path == "ina":
        progs.append(McastSend(st, g, x, m * item, sid=stream_id(msg, 0), msg=msg))
    for k in range(W):
        if k == r:
            continue
        if path == "host-p2p":
            progs.append(_send_stream(st, g, k, x, m * item, msg, 0))
        progs.append(_recv_stream(st, g, k, _seg(out, k * m, (k + 1) * m), m * item, msg, 0))
    return _finish(Parallel(progs), out)


def _broadcast(st: NodeState, g: Group, x: np.ndarray | None, out: np.ndarray | None, W: int,
               r: int, msg: int, item: int, n: int, path: str, root: int) -> Program:
    _need_out(out, x, n, "broadcast")
    if r == root and x is not None and out is not None and out is not x:
        np.copyto(out, x)
    if W == 1 or n == 0:
        return _Done(out)
    if r != root:
        return _finish(_recv_stream(st, g, root, out, n * item, msg, 0), out)
    if path == "ina":
        return _finish(McastSend(st, g, x, n * item, sid=stream_id(msg, 0), msg=msg), out)
    return _finish(Parallel([_send_stream(st, g, k, x, n * item, msg, 0)
                             for k in range(W) if k != root]), out)


def _reduce_scatter(st: NodeState, g: Group, x: np.ndarray | None, out: np.ndarray | None,
                    W: int, r: int, msg: int, item: int, n: int, path: str, op: str,
                    dtype: str) -> Program:
    m = n // W
    _need_out(out, x, m, "reduce_scatter")
    if W == 1 or m == 0:
        if x is not None and out is not None:
            np.copyto(out, x)
        return _Done(out)
    if path == "ina":
        segs = [(k * m, (k + 1) * m, g.ids[k]) for k in range(W)]
        return _ina_reduce(st, g, Tensor(n, dtype, x, out), op, segs, "reduce_scatter")
    if path == "host-p2p":
        bufs: list[np.ndarray | None] = [np.empty(m, x.dtype) if x is not None else None
                                         for _ in range(W)]
        progs: list[Program] = []
        for k in range(W):
            if k == r:
                continue
            progs.append(_send_stream(st, g, k, _seg(x, k * m, (k + 1) * m), m * item, msg, 0))
            progs.append(_recv_stream(st, g, k, bufs[k], m * item, msg, 0))

        def steps() -> Generator[Program, Any, Any]:
            yield Parallel(progs)
            if x is not None and out is not None:
                own = x[r * m:(r + 1) * m]
                # in place, ``out`` is this very segment: keep it before summing into it
                bufs[r] = own.copy() if np.shares_memory(own, out) else own
                _reduce_in_order([b for b in bufs if b is not None], op, out)
            return out

        return Chain(steps())
    # ring: step s sends the running sum of segment (r - s - 1) to the right and adds
    # this rank's part to what comes from the left; after W - 1 steps segment r is done
    right, left = (r + 1) % W, (r - 1) % W

    def ring() -> Generator[Program, Any, Any]:
        acc = None if x is None else np.array(x[((r - 1) % W) * m:((r - 1) % W + 1) * m])
        for s in range(W - 1):
            kr = (r - s - 2) % W
            inc = None if x is None else np.empty(m, x.dtype)
            yield Parallel([_send_stream(st, g, right, acc, m * item, msg, s),
                            _recv_stream(st, g, left, inc, m * item, msg, s)])
            if x is not None and inc is not None:
                UFUNCS[op](inc, x[kr * m:(kr + 1) * m], out=inc)
                acc = inc
        if out is not None and acc is not None:
            np.copyto(out, acc)
        return out

    return Chain(ring())


def _ina_reduce(st: NodeState, g: Group, t: Tensor, op: str,
                segs: list[tuple[int, int, int]], kind: str) -> Program:
    """An owner-delivered aggregation job, or host-p2p when the switch refuses it."""

    def steps() -> Generator[Program, Any, Any]:
        js = yield from _job_program(st, "ina", t, op, referenced=False, group=g,
                                     deliver="owner")
        if js.granted:
            yield InaReduce(st, t, op, js, segs, data=t.x is not None, group=g)
            return t.out
        st.fallbacks.append(f"{kind}: in-network job refused ({js.reason}); host-p2p instead")
        root = next((k for k, nid in enumerate(g.ids) if nid == segs[0][2]), 0)
        if kind == "reduce":
            prog = _reduce(st, g, t.x, t.out, g.size, g.rank, g.next_msg(), t.itemsize,
                           t.count, "host-p2p", op, t.dtype, root)
        else:
            prog = _reduce_scatter(st, g, t.x, t.out, g.size, g.rank, g.next_msg(),
                                   t.itemsize, t.count, "host-p2p", op, t.dtype)
        return (yield prog)

    return Chain(steps())


def _reduce(st: NodeState, g: Group, x: np.ndarray | None, out: np.ndarray | None, W: int,
            r: int, msg: int, item: int, n: int, path: str, op: str, dtype: str,
            root: int) -> Program:
    if r == root:
        _need_out(out, x, n, "reduce")
    if W == 1 or n == 0:
        if x is not None and out is not None:
            np.copyto(out, x)
        return _Done(out if r == root else None)
    if path == "ina":
        t = Tensor(n, dtype, x, out if r == root else None)
        return _ina_reduce(st, g, t, op, [(0, n, g.ids[root])], "reduce")
    if r != root:
        return _finish(_send_stream(st, g, root, x, n * item, msg, 0), None)
    bufs = [np.empty(n, x.dtype) if x is not None and k != r else None for k in range(W)]
    recv = Parallel([_recv_stream(st, g, k, bufs[k], n * item, msg, 0)
                     for k in range(W) if k != r])

    def steps() -> Generator[Program, Any, Any]:
        yield recv
        if x is not None and out is not None:
            bufs[r] = x.copy() if np.shares_memory(x, out) else x  # in place: keep ours
            _reduce_in_order([b for b in bufs if b is not None], op, out)
        return out

    return Chain(steps())


def _gather(st: NodeState, g: Group, x: np.ndarray | None, out: np.ndarray | None, W: int,
            r: int, msg: int, item: int, m: int, root: int) -> Program:
    if r != root:
        return _finish(_send_stream(st, g, root, x, m * item, msg, 0), None) if W > 1 \
            else _Done(None)
    _need_out(out, x, W * m, "gather")
    if x is not None and out is not None:
        out[r * m:(r + 1) * m] = x
    return _finish(Parallel([_recv_stream(st, g, k, _seg(out, k * m, (k + 1) * m), m * item,
                                          msg, 0) for k in range(W) if k != r]), out)


def _scatter(st: NodeState, g: Group, x: np.ndarray | None, out: np.ndarray | None, W: int,
             r: int, msg: int, item: int, n: int, root: int) -> Program:
    """``x`` (at the root) holds ``size * m`` elements; every rank gets its ``m``."""
    if n % W:
        raise UsageError(f"scatter of {n} elements over {W} ranks: the count must be a "
                         "multiple of the group size")
    m = n // W
    if x is not None and out is None:
        raise UsageError("scatter: give out (m elements)")
    if r != root:
        return _finish(_recv_stream(st, g, root, out, m * item, msg, 0), out)
    if x is not None and out is not None:
        out[:] = x[r * m:(r + 1) * m]
    return _finish(Parallel([_send_stream(st, g, k, _seg(x, k * m, (k + 1) * m), m * item,
                                          msg, 0) for k in range(W) if k != r]), out)

