"""The endpoint ("NIC") a worker uses: its socket to the switch, its registered
memory, control requests, and the receive side shared by every collective.

User code gets an :class:`Endpoint` as the first argument of a function run on
every worker (see :mod:`fabric.emulation.launcher`)::

    def work(ep):
        x = ep.alloc(1 << 20, "float32")      # registered "device memory"
        x[:] = ep.rank + 1
        ep.allreduce(x, op="sum", path="ina-mem", out=x)
        return float(x[0])

Every wait has a deadline; running out raises :class:`FabricTimeout` naming
the peer and the operation.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.calls import CallScope, interruptible
from fabric.core.frame import Flag, NackCode, Op
from fabric.core.programs import ABORT_ACK, Chain, Group, InaAllreduce, Tensor, allreduce_program
from fabric.core.semantic import SemanticCounts
from fabric.core.topology import Topology
from fabric.emulation import doorbell as db
from fabric.emulation import transport
from fabric.emulation.frametrace import FrameLog
from fabric.emulation.shm import SharedRegion, region_name
from fabric.errors import FabricTimeout, PeerFailed, SemfabError, UsageError
from kernels.dtypes import DTYPES as _REGISTRY_DTYPES
from kernels.dtypes import OPS as _REGISTRY_OPS

log = logging.getLogger("semfab.endpoint")
_F_ECN = int(Flag.ECN)

#: Allreduce paths, in the order benchmarks show them.
PATHS = ("ina", "ina-mem", "host-ps", "host-ring")
#: From the one registry of dtypes and ops (kernels.dtypes).
OPS = _REGISTRY_OPS
DTYPE_NAMES = tuple(_REGISTRY_DTYPES)
DEFAULT_TIMEOUT_S = 30.0
#: Control message types that answer a request (see :meth:`Endpoint.defer`).
CTRL_REPLIES = frozenset({"welcome", "barrier_done", "job_reply", "region_reply", "stats",
                          "release_reply", "group_reply", "group_released", "doorbell_reply",
                          ABORT_ACK})
# what Endpoint._wait found
_NOTHING, _SOCKET, _RING = 0, 1, 2


def np_dtype(name: str) -> np.dtype[Any]:
    """NumPy dtype for a project dtype name (bfloat16 through ml_dtypes)."""
    from kernels.dtypes import np_dtype as _np_dtype

    return _np_dtype(name)


# dtype -> name of the supported ones: numpy's dtype.name is Python code that
# costs about 10 us, once per collective call
_NAME_OF: dict[np.dtype[Any], str] = {}


def dtype_name(dt: np.dtype[Any]) -> str:
    """Project dtype name of a NumPy dtype; UsageError when unsupported."""
    name = _NAME_OF.get(dt)
    if name is not None:
        return name
    name = dt.name
    if name not in DTYPE_NAMES:
        raise UsageError(f"dtype {dt} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    _NAME_OF[dt] = name
    return name


#: Frames (and payload bytes) a worker keeps for a later operation; beyond
#: either, the oldest is dropped and counted (a flood must not eat memory).
STASH_FRAMES = 4096
#: Largest one-part frame (control message) a node receives.
HEADER_BUF = 1 << 20
STASH_BYTES = 64 * 2**20
#: Arrays whose region :meth:`Endpoint.region_of` remembers.
LOCATIONS_KEPT = 256


class Endpoint:
    """One worker's (or host's) attachment to the fabric: the ZeroMQ driver of
    the node's pure protocol state (:class:`fabric.core.programs.NodeState`) and of
    the collective programs it runs (:meth:`run`)."""

    def __init__(
        self,
        topo: Topology,
        name: str,
        sock_dir: str | Path,
        *,
        run_id: str = "run",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ctx: zmq.Context | None = None,
        hello: bool = True,
    ) -> None:
        from fabric.core.programs import NodeState

        self.topo = topo
        self.name = name
        self.state = st = NodeState(topo, name, timeout_s=timeout_s)
        self.node = st.node
        self.node_id = st.node_id
        self.world = st.world
        self.rank = self.node_id if self.node.kind == "worker" else -1
        self.worker_ids = st.worker_ids
        self.switch_name = st.switch_name
        self.switch_id = st.switch_id
        self.host_id = st.host_id
        # barriers are counted by one switch for the whole fabric: the tree root
        self.root_switch_id = st.root_switch_id
        self.mtu = st.mtu
        self.timeout_s = timeout_s
        self.run_id = run_id
        self._own_ctx = ctx is None
        self.ctx = ctx or transport.context()
        self.sock = transport.dealer(
            self.ctx, topo.endpoint_address(self.switch_name, sock_dir), name
        )
        # recv_into target of a message's first part: a header, or a whole one-part
        # frame (control messages), so it must hold the largest control reply
        self.hdr = bytearray(HEADER_BUF)
        self.stash: deque[fr.Frame] = deque()  # frames that arrived for a later wait
        self._stash_bytes = 0
        # an application's own frames (the serving chain's control messages), kept
        # apart from the stash whenever they come, even during a collective
        self.app_filter: Callable[[fr.Frame], bool] | None = None
        self.inbox: deque[fr.Frame] = deque()
        self.regions: list[tuple[int, int, int, SharedRegion]] = []  # (base, size, key, region)
        # id(array) -> (weak reference to it, its (key, offset)): see region_of
        self._loc_of: dict[int, tuple[weakref.ref[np.ndarray], tuple[int, int]]] = {}
        # the protocol state's tables, under the names user code and benchmarks know
        self.jobs = st.jobs
        self.semantics = st.semantics
        self.fallbacks = st.fallbacks  # reported, never silent
        self.chunk_bytes = st.chunk_bytes
        self.slots = st.slots
        self.rtt = st.rtt
        self.bad_frames = 0
        self.stale_replies = 0
        self.dropped = 0  # unsolicited frames dropped from a full stash
        self.scratch: np.ndarray | None = None  # staging region for ina-mem
        self.fixed_scratch: np.ndarray | None = None  # int32 region for fixed-point ina-mem
        # shared-memory doorbell to the switch, opened with the first region
        self.bell: db.Doorbell | None = None
        self._bell_tried = False
        self._poller: zmq.Poller | None = None
        self._spin_s = db.SPIN_S  # this call's spin budget on the doorbell
        self._scope: CallScope | None = None  # the group call running (fabric.core.calls)
        # the topology's placement: the switch maps our memory only on our host
        self.shares_host = topo.host_address(name) == topo.host_address(self.switch_name)
        # frames recorded for a trace (SEMFAB_FRAME_TRACE only)
        self.frame_log = FrameLog.from_env(name, self.node.kind, self.world)
        if hello:  # (else the caller says hello itself: see :meth:`hello`)
            self.hello()

    # the counters live in the protocol state, which programs update
    @property
    def crc(self) -> bool:
        """CRC32C on data and control frames (turned on where links corrupt)."""
        return self.state.crc

    @crc.setter
    def crc(self, on: bool) -> None:
        self.state.crc = bool(on)

    @property
    def retransmits(self) -> int:
        """Frames this node sent again (timers, NACKs, overtaken chunks)."""
        return self.state.retransmits

    @retransmits.setter
    def retransmits(self, n: int) -> None:
        self.state.retransmits = n

    @property
    def duplicates(self) -> int:
        """Late copies of results this node already had."""
        return self.state.duplicates

    @duplicates.setter
    def duplicates(self, n: int) -> None:
        self.state.duplicates = n

    # ------------------------------------------------------------------ basics
    def sem(self, path: str) -> SemanticCounts:
        """The semantic-distance counters of ``path``."""
        return self.state.sem(path)

    def send_frame(self, header: bytes, payload: Any = None) -> None:
        """Send one frame to the switch (payload zero-copy when large; a memory-plane
        descriptor through the doorbell when there is one)."""
        if self.frame_log is not None:
            self.frame_log.add("tx", header, self.switch_name)
        if payload is None:
            bell = self.bell
            if bell is None or not db.carries(header) or not bell.send(header):
                self.sock.send(header)
            return
        nbytes = memoryview(payload).nbytes
        self.sock.send(header, zmq.SNDMORE)
        self.sock.send(payload, copy=nbytes < transport.ZERO_COPY_MIN)

    def defer(self, f: fr.Frame) -> None:
        """The one demultiplexing rule for frames no running program wants.

        A stale control reply (a retry crossed its answer), a NACK or ACK for
        nobody, or anything beyond the stash's bounds is counted and dropped;
        other frames are kept for a later operation (a peer ahead of us). Frames
        the application's ``app_filter`` claims go to ``inbox`` first.
        """
        if self.app_filter is not None and self.app_filter(f):
            if len(self.inbox) >= STASH_FRAMES:
                self.dropped += 1  # the application stopped reading: keep our bounds
                return
            self.inbox.append(f)
            return
        if f.op is Op.CTRL:
            try:
                if control.parse(f.payload).get("t") in CTRL_REPLIES:
                    self.stale_replies += 1
                    return
            except fr.FrameError:
                self.bad_frames += 1
                return
        elif f.op is Op.NACK or f.op is Op.ACK or f.op is Op.CREDIT:
            self.stale_replies += 1  # feedback for something already finished
            return
        answer = self.state.answer_stale(f)
        if answer:  # a peer retries something we finished: tell it again
            self._send_all(answer)
            return
        self.stash.append(f)
        self._stash_bytes += len(f.payload)
        while len(self.stash) > STASH_FRAMES or self._stash_bytes > STASH_BYTES:
            old = self.stash.popleft()
            self._stash_bytes -= len(old.payload)
            self.dropped += 1

    def wait(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for a frame (socket or doorbell); whether one came.
        :meth:`drain_idle` then takes it."""
        return self._wait(max(timeout_ms, 0)) != _NOTHING

    def drain_idle(self) -> None:
        """Between operations: take what arrived and apply :meth:`defer` to it (late
        retransmissions of finished collectives are answered, the rest kept)."""
        while self.bell is not None and self.bell.pending():
            f = self._ring_frame()
            if f is not None:
                self.defer(f)
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                f = fr.decode(parts[0].buffer, parts[1].buffer if len(parts) > 1 else None)
            except fr.FrameError:
                if not self._trimmed(parts[0].buffer, parts[1].buffer if len(parts) > 1
                                     else None):
                    self.bad_frames += 1
                continue
            self.defer(f)

    # ------------------------------------------------------------------ programs
    def run(self, prog: Any, what: str) -> Any:
        """Run a pure program (fabric.core.programs) over this node's socket; its result.

        Frames it wants go to it, others to :meth:`defer`; its timers fire on
        time; a silence of ``timeout_s`` while it waits raises FabricTimeout
        naming ``what``. A frame-plane allreduce receives each result straight
        into the output with ``recv_into`` (no copy).
        """
        now = time.monotonic()
        self._send_all(prog.start(now))
        stage = self._replay(prog, None)  # frames that came before we asked
        sock, hdr = self.sock, memoryview(self.hdr)
        quiet_until = time.monotonic() + self.timeout_s
        bounce: memoryview | None = None
        while not prog.done:
            timer = prog.get_timer()
            if self.state.aborts and (timer is None or timer > time.monotonic()):
                # (a due timer first: this node's own error comes before a peer's
                # notice about it)
                self._check_abandoned(prog)
            until = quiet_until if timer is None else min(timer, quiet_until)
            wait_s = until - time.monotonic()
            if 0 < wait_s < transport.SHORT_WAIT_S and self.bell is None:
                # (a paced sender's next frame: zmq's poll would round it up to 1 ms)
                got = _SOCKET if transport.nap_until(lambda: transport.has_frame(sock),
                                                     wait_s) else _NOTHING
            else:
                got = self._wait(max(math.ceil(wait_s * 1000), 0))
            if got == _NOTHING:
                now = time.monotonic()
                if timer is not None and now >= timer:
                    self._send_all(prog.handle_timer(now))
                    stage = self._replay(prog, stage)
                elif now >= quiet_until:
                    raise FabricTimeout(
                        f"{self.name}: {what}: nothing within {self.timeout_s:g}s from "
                        f"{prog.waiting_for()} (see the logs in the run folder)")
                continue
            if got == _RING:  # a memory-plane descriptor through the doorbell
                f = self._ring_frame()
                if f is None:
                    continue
            else:
                nh = sock.recv_into(self.hdr)
                more = sock.get(zmq.RCVMORE)
                if nh > len(self.hdr):  # truncated: no control message is this large
                    self.bad_frames += 1
                    if more:
                        sock.recv(copy=False)
                    continue
                if self.frame_log is not None:
                    self.frame_log.add("rx", hdr[:nh], self.switch_name)
                leaf = prog.leaf() if isinstance(prog, Chain) else prog
                if more and isinstance(leaf, InaAllreduce) and leaf.data and leaf.region is None:
                    try:
                        rop, rfl, rsrc, rjob, psn, _k, done, length = fr.peek(hdr[:nh])
                    except fr.FrameError:
                        rop, rfl, rsrc, rjob = Op.NACK, Flag.NONE, -1, -1
                        psn, done, length = 0, 0, 0
                    if rop is Op.RESULT and rjob == leaf.js.job and rsrc == self.switch_id:
                        spot = leaf.landing(psn, length)
                        if spot is None:  # a late copy (we resent), or a bad length
                            sock.recv(copy=False)
                            self.state.duplicates += 1
                            continue
                        i, off = spot
                        assert leaf.t.out is not None
                        target = leaf.t.out.view(np.uint8).data[off: off + length]
                        into = target
                        if self.crc:
                            # a corrupted result must not overwrite the input we may resend
                            if bounce is None or bounce.nbytes < length:
                                bounce = memoryview(bytearray(length))
                            into = bounce[:length]
                        nb = sock.recv_into(into)
                        try:
                            if nb != length:
                                raise fr.FrameError(NackCode.MALFORMED, "truncated RESULT")
                            fr.decode(hdr[:nh], into)  # full validation (CRC, dtype multiple)
                        except fr.FrameError as exc:
                            self.bad_frames += 1  # counted; the chunk's timer resends it
                            log.info("%s: dropped a bad RESULT for chunk %d: %s", self.name, i, exc)
                            continue
                        if into is not target:
                            target[:] = into
                        now = time.monotonic()
                        sends = leaf.landed(i, now, done=done,
                                            marked=int(rfl) & _F_ECN != 0)
                        if isinstance(prog, Chain):
                            sends.extend(prog.poke(now))
                        self._send_all(sends)
                        stage = self._replay(prog, stage)
                        quiet_until = now + self.timeout_s
                        continue
                payload = sock.recv(copy=False).buffer if more else None
                try:
                    f = fr.decode(bytes(hdr[:nh]), payload)
                except fr.FrameError as exc:
                    if not self._trimmed(hdr[:nh], payload):
                        self.bad_frames += 1
                        log.info("%s: dropped a bad frame: %s", self.name, exc)
                    continue
            if prog.wants(f):
                now = time.monotonic()
                self._send_all(prog.handle_frame(f, now))
                stage = self._replay(prog, stage)
                quiet_until = now + self.timeout_s
            else:
                self.defer(f)
        return prog.result

    def _trimmed(self, header: Any, payload: Any) -> bool:
        """If this undecodable frame is a trimmed one (a switch cut its payload), answer
        it (a stream's sender is told to resend at once) and say so."""
        if not fr.is_trimmed(header, payload):
            return False
        try:
            cut = fr.decode_trimmed(header)
        except fr.FrameError:
            return False
        self._send_all(self.state.answer_trimmed(cut, time.monotonic()))
        return True

    def _check_abandoned(self, prog: Any) -> None:
        """Raise the peer's error when a member abandoned the group call running
        (a node's own request to its switch, e.g. a region's registration, first
        runs to its end: it leaves no half-made state behind)."""
        scope = self._scope
        if scope is None or not interruptible(prog):
            return
        told = scope.peer_failed()
        if told is not None:
            raise told

    @contextmanager
    def group_call(self, group: Any) -> Iterator[None]:
        """Run one call of ``group`` (a Communicator, a Group, or None for every
        worker) inside this block: numbered alike on every member; a failure in
        it is told to the peers before it is raised, and a peer's ends it here
        (fabric.core.calls). A call made inside another is part of it."""
        g = _group_of(group)
        if g is None:
            g = self.state.world_group
        if self._scope is not None or not isinstance(g, Group) or self.rank < 0 \
                or g.closed or g.rank < 0:  # (not a call of the group: refused here alone)
            yield
            return
        scope = self._scope = CallScope(self.state, g)
        try:
            told = scope.peer_failed()  # a peer ahead of us abandoned it already
            if told is not None:
                raise told
            yield
        except Exception as exc:  # a wrong argument of any type: the peers wait for us
            self._scope = None
            notify = scope.fail(exc)
            if notify is not None:
                try:
                    self.run(notify, "tell the group's members this call failed")
                except SemfabError as unheard:  # a peer is gone: our own error stands
                    log.warning("%s: %s", self.name, unheard)
            raise
        finally:
            self._scope = None

    def _ring_frame(self) -> fr.Frame | None:
        """The next frame from the doorbell ring (None: nothing, or a bad one, counted)."""
        assert self.bell is not None
        raw = self.bell.recv()
        if raw is None:
            return None
        if self.frame_log is not None:
            self.frame_log.add("rx", raw, self.switch_name)
        try:
            return fr.decode(raw, None)
        except fr.FrameError as exc:
            self.bad_frames += 1
            log.info("%s: dropped a bad doorbell frame: %s", self.name, exc)
            return None

    def _wait(self, wait_ms: int) -> int:
        """What came within ``wait_ms``: a frame on the socket, one in the doorbell
        ring, or nothing. With a doorbell: spin on both (yielding the core), then
        block on the socket and the doorbell's pipe."""
        bell, sock = self.bell, self.sock
        if bell is None:
            return _SOCKET if transport.spin_poll(sock, wait_ms) else _NOTHING

        def ready() -> bool:
            return bell.pending() or transport.has_frame(sock)

        if not db.spin_until(ready, min(self._spin_s, wait_ms / 1000)):
            if not bell.sleep():
                assert self._poller is not None
                self._poller.poll(wait_ms)
            bell.wake()
        if bell.pending():
            return _RING
        return _SOCKET if transport.has_frame(sock) else _NOTHING

    def _open_doorbell(self) -> None:
        """Offer the switch a shared-memory doorbell for memory-plane descriptors;
        without one (refused, or off) they keep to the socket."""
        self._bell_tried = True
        if not db.enabled():
            return
        from switchd.core import DOORBELL_SUFFIX

        try:
            bell = db.Doorbell.create(
                f"semfab-{self.run_id}-{self.name}{DOORBELL_SUFFIX}{self.node_id}")
        except OSError as exc:
            log.info("%s: no doorbell (%s); descriptors go over the socket", self.name, exc)
            return
        reply = self.request("doorbell", "doorbell_reply", path=str(bell.path))
        if not reply.get("ok"):
            log.info("%s: switch refused the doorbell: %s", self.name, reply.get("reason"))
            bell.close()
            return
        self.bell = bell
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(bell.fileno(), zmq.POLLIN)
        log.debug("%s: doorbell open (%s)", self.name, bell.path)

    def _replay(self, prog: Any, stage: Any) -> Any:
        """Hand the stash to ``prog`` when its running step is new (a chain moved on:
        frames of the new step may have come early, during the previous one).
        Returns the step now running."""
        while not prog.done:
            now_stage = prog.leaf() if isinstance(prog, Chain) else prog
            if now_stage is stage or not self.stash:
                return now_stage
            stage = now_stage
            keep: deque[fr.Frame] = deque()
            while self.stash and not prog.done:
                f = self.stash.popleft()
                self._stash_bytes -= len(f.payload)
                if prog.wants(f):
                    self._send_all(prog.handle_frame(f, time.monotonic()))
                else:
                    keep.append(f)
            for f in reversed(keep):
                self.stash.appendleft(f)
                self._stash_bytes += len(f.payload)
        return stage

    def _send_all(self, sends: list[tuple[bytes, Any]]) -> None:
        for header, payload in sends:
            self.send_frame(header, payload)

    def request(self, t: str, reply: str, dst: int | None = None,
                match: Callable[[dict[str, Any]], bool] | None = None,
                **fields: Any) -> dict[str, Any]:
        """Send a control message to the switch (or ``dst``) and wait for its reply.

        Control requests are idempotent, so a lost request or reply is simply
        sent again (with backoff) until the reply comes or ``timeout_s`` ends.
        """
        from fabric.core.programs import Request

        prog = Request(self.state, t, reply, dst=dst, match=match, **fields)
        result: dict[str, Any] = self.run(prog, f"control request {t!r} to node {prog.dst}")
        return result

    def hello(self, timeout_s: float | None = None) -> None:
        """Introduce this node to its switch (FabricTimeout after ``timeout_s``, by
        default the endpoint's): the switch then knows its port."""
        # The DEALER connects asynchronously and frames may be lost: retry.
        prog_timeout, self.timeout_s = self.timeout_s, timeout_s or self.timeout_s
        try:
            from fabric.core.programs import Request

            prog = Request(self.state, "hello", "welcome", name=self.name,
                           timeout_s=self.timeout_s)
            reply = self.run(prog, f"control request 'hello' to node {prog.dst}")
        finally:
            self.timeout_s = prog_timeout
        log.debug("%s: welcomed by %s", self.name, reply.get("switch"))

    # ------------------------------------------------------------------ memory
    def alloc(self, count: int, dtype: str = "float32") -> np.ndarray:
        """A zero-filled array in a new shared region registered with the switch.

        This is the worker's "device memory": the memory plane (``ina-mem``)
        reduces straight into it.
        """
        dt = np_dtype(dtype)
        size = max(int(count) * dt.itemsize, 1)
        if not self.shares_host:
            # the switch is on another host: plain memory, served by the frame plane
            return np.zeros(int(count), dtype=dt)
        if not self._bell_tried:
            self._open_doorbell()
        # unguessable, like an RDMA rkey: knowing one key tells nothing of another
        key = 0
        while not key or any(k == key for _, _, k, _ in self.regions):
            key = secrets.randbits(32)
        region = SharedRegion.create(region_name(self.run_id, self.name, key), size)
        reply = self.request("region", "region_reply", key=key, size=size, run=self.run_id,
                             match=lambda m: m.get("key") == key)
        if not reply.get("ok"):
            region.close()
            raise PeerFailed(f"{self.name}: switch refused region {key:#x}: {reply.get('reason')}")
        arr = region.array(dt, int(count))
        self.regions.append((arr.ctypes.data, size, key, region))
        return arr

    def free(self, x: np.ndarray) -> None:
        """Unregister and release the region :meth:`alloc` returned as ``x``.

        ``x`` (and every view of it) must not be used afterwards.
        """
        if not self.shares_host:
            return  # plain memory (see alloc): nothing registered
        base = x.ctypes.data
        for i, (start, _size, key, region) in enumerate(self.regions):
            if start == base:

                def same_key(m: dict[str, Any], key: int = key) -> bool:
                    return m.get("key") == key

                self.request("unregister", "region_reply", match=same_key, key=key)
                del self.regions[i]
                self._loc_of.clear()  # views of it may outlive it: none may name it
                region.close()
                return
        raise UsageError("free() takes an array returned by alloc()")

    def region_of(self, x: np.ndarray) -> tuple[int, int] | None:
        """``(key, byte offset)`` of ``x`` when it lies in a registered region."""
        # the arrays a loop passes again: while one lives, its id is its own
        # (reading an array's address costs 2-3 us, a memory-plane call's tenth)
        hit = self._loc_of.get(id(x))
        if hit is not None and hit[0]() is x:
            return hit[1]
        ptr = x.ctypes.data
        for base, size, key, _ in self.regions:
            if base <= ptr and ptr + x.nbytes <= base + size:
                if len(self._loc_of) >= LOCATIONS_KEPT:
                    self._loc_of.clear()
                self._loc_of[id(x)] = (weakref.ref(x), (key, ptr - base))
                return key, ptr - base
        return None

    # ------------------------------------------------------------------ collectives
    def barrier(self, group: Any = None) -> None:
        """Wait until every worker (or every member of ``group``) reached this barrier
        (counted by the tree root)."""
        from fabric.core.programs import barrier_program

        with self.group_call(group):
            self.run(barrier_program(self.state, _group_of(group)), "barrier")

    def group(self, ranks: Any) -> Any:
        """A communicator of world ``ranks`` (in its rank order): a
        :class:`fabric.emulation.communicator.Communicator` with its own rank, size, jobs and
        barriers. Every member calls it with the same ranks in the same order;
        ``close()`` it (or use ``with``) to release its switch resources."""
        from fabric.core.collective_programs import group_program
        from fabric.emulation.communicator import Communicator

        g = self.run(group_program(self.state, ranks), f"create group {list(ranks)}")
        return Communicator(self, g)

    def collective(self, kind: str, x: np.ndarray, out: np.ndarray | None = None, *,
                   path: str | None = None, op: str = "sum", root: int = 0,
                   group: Any = None, send_counts: Any = None,
                   recv_counts: Any = None) -> Any:
        """Run collective ``kind`` (see :data:`fabric.core.collective_programs.COLLECTIVES`)
        over every worker (or ``group``); returns its output array."""
        from fabric.core.workload import Collective, program_of

        if self.rank < 0:
            raise UsageError(f"{self.name} is not a worker; only workers join collectives")
        with self.group_call(group):
            op_ = Collective(kind, x, out, path, op, root, _group_of(group),
                             None if send_counts is None else tuple(send_counts),
                             None if recv_counts is None else tuple(recv_counts))
            return self.run(program_of(self.state, op_), f"{kind} {path or 'default path'}")

    def all_gather(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """Every rank's ``x`` (m elements) concatenated in rank order (size * m);
        ``path``: ina (switch multicast), host-p2p or host-ring."""
        return self.collective("all_gather", x, out, **kw)

    def reduce_scatter(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """Reduce ``x`` (size * m) over ranks; returns this rank's segment (m);
        ``path``: ina (reduced in the switch, each segment sent to its owner only),
        host-p2p or host-ring."""
        return self.collective("reduce_scatter", x, out, **kw)

    def broadcast(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """The root's ``x`` on every rank (in place by default); path ina or host-p2p."""
        return self.collective("broadcast", x, out, **kw)

    def reduce(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """Reduce ``x`` over ranks into the root's output (None elsewhere)."""
        return self.collective("reduce", x, out, **kw)

    def alltoall(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """Segment ``k`` of ``x`` (size * m) to rank ``k``; segment ``k`` of the output
        from rank ``k``."""
        return self.collective("alltoall", x, out, **kw)

    def alltoallv(self, x: np.ndarray, send_counts: Any, out: np.ndarray | None,
                  recv_counts: Any, **kw: Any) -> Any:
        """alltoall with per-rank element counts (``out`` sized ``sum(recv_counts)``)."""
        return self.collective("alltoallv", x, out, send_counts=send_counts,
                               recv_counts=recv_counts, **kw)

    def gather(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """Every rank's ``x`` concatenated at the root."""
        return self.collective("gather", x, out, **kw)

    def scatter(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """Segment ``k`` of the root's ``x`` (size * m) to rank ``k`` (every rank passes
        an ``x`` of that size; only the root's is read)."""
        return self.collective("scatter", x, out, **kw)

    def moe_dispatch(self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                     num_experts: int, *, variant: str = "flat", group: Any = None) -> Any:
        """MoE dispatch: each token (a row of ``x``) to the ranks holding its top-k
        experts; returns a :class:`fabric.core.moe.Dispatched` (``variant``: flat or
        hierarchical)."""
        from fabric.core.workload import MoeDispatch, program_of

        with self.group_call(group):
            return self.run(program_of(self.state, MoeDispatch(
                x, topk_idx, topk_weights, num_experts, variant, _group_of(group))),
                f"moe_dispatch {variant}")

    def moe_combine(self, dispatched: Any, partials: np.ndarray, group: Any = None) -> Any:
        """MoE combine: each row's partial (see :func:`fabric.core.moe.expert_partials`) back
        to its token's home; returns (tokens, hidden) summed there."""
        from fabric.core.workload import MoeCombine, program_of

        with self.group_call(group):
            return self.run(program_of(self.state, MoeCombine(dispatched, partials,
                                                              _group_of(group))),
                            f"moe_combine {getattr(dispatched, 'variant', '?')}")

    def send(self, x: np.ndarray, dst: int, *, policy: str = "selective") -> dict[str, Any]:
        """Send ``x``'s bytes reliably to worker ``dst`` (a world rank); the sender's
        statistics. Any number of streams may run between any pairs."""
        from fabric.core.programs import StreamSend

        result: dict[str, Any] = self.run(StreamSend(self.state, dst, x, policy=policy),
                                          f"send to rank {dst}")
        return result

    def recv(self, out: np.ndarray, src: int, *, policy: str = "selective") -> np.ndarray:
        """Receive worker ``src``'s next stream into ``out``; returns ``out``."""
        from fabric.core.programs import StreamRecv

        self.run(StreamRecv(self.state, src, out, policy=policy), f"recv from rank {src}")
        return out

    def sendrecv(self, x: np.ndarray, dst: int, out: np.ndarray, src: int, *,
                 policy: str = "selective") -> np.ndarray:
        """Send to ``dst`` and receive from ``src`` at the same time (both directions of
        one pair may run at once); returns ``out``."""
        from fabric.core.programs import Parallel, StreamRecv, StreamSend

        self.run(Parallel([StreamSend(self.state, dst, x, policy=policy),
                           StreamRecv(self.state, src, out, policy=policy)]),
                 f"sendrecv with ranks {dst}/{src}")
        return out

    def allreduce(self, x: np.ndarray, op: str = "sum", path: str = "ina",
                  out: np.ndarray | None = None, numerics: str = "float",
                  group: Any = None) -> np.ndarray:
        """Allreduce ``x`` over all workers; returns ``out`` (a new array by default).

        ``path``: ``ina`` (frame plane, reduced in the switch), ``ina-mem``
        (memory plane, ``x`` should come from :meth:`alloc`), ``host-ps``
        (staged through the host node), ``host-ring`` (ring through the switch).
        ``numerics="fixed"`` sums float32 as int32 fixed point with a per-block
        scale: bitwise the same result whatever the path or arrival order.
        """
        if self.rank < 0:
            raise UsageError(f"{self.name} is not a worker; only workers join collectives")
        with self.group_call(group):
            return self._allreduce(x, op, path, out, numerics, group)

    def _allreduce(self, x: np.ndarray, op: str, path: str, out: np.ndarray | None,
                   numerics: str, group: Any) -> np.ndarray:
        if path not in PATHS:
            raise UsageError(f"unknown path {path!r}; choose one of {', '.join(PATHS)}")
        if op not in OPS:
            raise UsageError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")
        if x.ndim != 1 or not x.flags.c_contiguous:
            raise UsageError("allreduce takes a 1-D contiguous array (use x.reshape(-1))")
        name = dtype_name(x.dtype)
        if out is None:
            out = np.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
            raise UsageError("out must be a contiguous array of x's shape and dtype")
        if numerics not in ("float", "fixed"):
            raise UsageError(f"numerics must be 'float' or 'fixed', not {numerics!r}")
        if x.size == 0:
            return out
        g = _group_of(group)
        if numerics == "fixed" and op == "sum":
            self._allreduce_fixed(x, out, path, g)
            return out
        what = f"allreduce {path}"
        if path == "ina-mem" and not self.shares_host:
            note = (f"ina-mem: switch {self.switch_name} runs on another host than "
                    f"{self.name} and cannot map its memory; ran on ina (the frame plane)")
            if note not in self.fallbacks:
                self.fallbacks.append(note)
            path, what = "ina", "allreduce ina"
        if path != "ina-mem":
            self.run(allreduce_program(self.state, Tensor(x.size, name, x, out), op, path,
                                       group=g), what)
            return out
        # memory plane: reduced in place in registered memory (an out-of-place call
        # into a registered ``out`` copies x there first), else staged through scratch
        loc = self.region_of(out)
        work = out
        copies = 0  # copies per chunk this call adds around the switch's work
        if loc is not None and out is not x:
            np.copyto(out, x)
            copies = 1
        elif loc is None:
            work = self._scratch_bytes(x.nbytes).view(x.dtype)
            np.copyto(work, x)
            loc = self.region_of(work)
            assert loc is not None
            copies = 2  # staged in, copied out
        t = Tensor(x.size, name, work, work)
        # spin only where the wait is short: a large reduction needs the cores
        self._spin_s = db.SPIN_S if x.nbytes <= db.SPIN_MAX_BYTES else 0.0
        try:
            self.run(allreduce_program(self.state, t, op, path, region=loc, group=g), what)
        finally:
            self._spin_s = db.SPIN_S
        if work is not out:
            np.copyto(out, work)
        if copies and self.sem(path).chunks:
            self.sem(path).copies += copies * -(-x.size // max(self.state.mem_chunk_elems(
                self.state.chunk_elems("ina-mem", x.itemsize), x.size, x.itemsize), 1))
        return out

    def _scratch_bytes(self, nbytes: int) -> np.ndarray:
        """A registered byte region of at least ``nbytes``, reused across calls
        (the memory plane's staging area for tensors outside registered memory)."""
        if self.scratch is None or self.scratch.nbytes < nbytes:
            self.scratch = self.alloc(-(-nbytes // 8), "int64").view(np.uint8)
        return self.scratch[:nbytes]

    def _allreduce_fixed(self, x: np.ndarray, out: np.ndarray, path: str, group: Any) -> None:
        """Sum float32 ``x`` as fixed-point int32 (see :func:`fabric.core.programs.fixed_program`).

        The memory plane's integers must live in a registered region, so that path
        is composed here; every other path runs the pure program.
        """
        from fabric.core.programs import (
            fixed_dequantize,
            fixed_maxima,
            fixed_program,
            fixed_quantize,
        )

        if x.dtype != np.float32:
            raise UsageError("fixed-point numerics take float32 tensors")
        if path != "ina-mem":
            self.run(fixed_program(self.state, Tensor(x.size, "float32", x, out), path, group),
                     f"allreduce {path} (fixed point)")
            return
        maxima = fixed_maxima(x)
        # the scalar agreement travels in-network too (ina: a few bytes are not worth a region)
        self.allreduce(maxima, op="max", path="ina", out=maxima, group=group)
        if self.fixed_scratch is None or self.fixed_scratch.size < x.size:
            self.fixed_scratch = self.alloc(x.size, "int32")
        q = self.fixed_scratch[:x.size]
        size = group.size if group is not None else self.world
        scales = fixed_quantize(x, maxima, size, q)
        self.allreduce(q, op="sum", path=path, out=q, group=group)
        fixed_dequantize(q, scales, out)

    def switch_stats(self) -> dict[str, Any]:
        """The switch's live counters."""
        reply = self.request("stats", "stats")
        reply.pop("t", None)
        return reply

    def close(self) -> None:
        """Close the socket and free owned regions."""
        for _, _, _, region in self.regions:
            region.close()
        self.regions.clear()
        self._loc_of.clear()
        if self.frame_log is not None:
            self.frame_log.dump()
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()


def _group_of(group: Any) -> Any:
    """The pure group of a Communicator (or a Group, or None for every worker)."""
    return getattr(group, "group", group)
