"""The endpoint ("NIC") a worker uses: its socket to the switch, its registered
memory, control requests, and the receive side shared by every collective.

User code gets an :class:`Endpoint` as the first argument of a function run on
every worker (see :mod:`fabric.launcher`)::

    def work(ep):
        x = ep.alloc(1 << 20, "float32")      # registered "device memory"
        x[:] = ep.rank + 1
        ep.allreduce(x, op="sum", path="ina-mem", out=x)
        return float(x[0])

Every wait has a deadline; running out raises :class:`FabricTimeout` naming
the peer and the operation.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from fabric import control, transport
from fabric import frame as fr
from fabric.errors import FabricTimeout, PeerFailed, UsageError
from fabric.frame import NackCode, Op
from fabric.semantic import SemanticCounts
from fabric.shm import SharedRegion
from fabric.timers import RttEstimator
from fabric.topology import Topology

log = logging.getLogger("semfab.endpoint")

#: Allreduce paths, in the order benchmarks show them.
PATHS = ("ina", "ina-mem", "host-ps", "host-ring")
OPS = ("sum", "max", "min")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "int32", "int64")
DEFAULT_TIMEOUT_S = 30.0
#: Control message types that answer a request (see :meth:`Endpoint.defer`).
CTRL_REPLIES = frozenset({"welcome", "barrier_done", "job_reply", "region_reply", "stats"})
#: Floor of the aggregation retransmit timeout (seconds).
AGG_RTO_MIN_S = 0.02
#: First resend interval of a control request (doubles up to 1 s).
CTRL_RETRY_S = 0.05


def np_dtype(name: str) -> np.dtype[Any]:
    """NumPy dtype for a project dtype name (bfloat16 through ml_dtypes)."""
    from kernels.dtypes import np_dtype as _np_dtype

    return _np_dtype(name)


def dtype_name(dt: np.dtype[Any]) -> str:
    """Project dtype name of a NumPy dtype; UsageError when unsupported."""
    name = "bfloat16" if dt.name == "bfloat16" else dt.name
    if name not in DTYPE_NAMES:
        raise UsageError(f"dtype {dt} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    return name


class Endpoint:
    """One worker's (or host's) attachment to the fabric."""

    def __init__(
        self,
        topo: Topology,
        name: str,
        sock_dir: str | Path,
        *,
        run_id: str = "run",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.topo = topo
        self.name = name
        self.node = topo.node(name)
        self.node_id = self.node.id
        workers = topo.workers
        self.world = len(workers)
        self.rank = self.node_id if self.node.kind == "worker" else -1
        self.worker_ids = tuple(w.id for w in workers)
        self.switch_name = topo.switch_of(name)
        self.switch_id = topo.node(self.switch_name).id
        self.host_id = topo.hosts[0].id if topo.hosts else None
        # barriers are counted by one switch for the whole fabric: the tree root
        self.root_switch_id = topo.node(topo.tree_root()).id
        link = topo.link_between(name, self.switch_name)
        self.mtu = link.params.mtu if link is not None else 256 * 1024
        self.link_shaped = link is not None and (link.params.shaped or link.params.latency_us > 0)
        self.timeout_s = timeout_s
        self.run_id = run_id
        self._own_ctx = ctx is None
        self.ctx = ctx or transport.context()
        self.sock = transport.dealer(
            self.ctx, topo.endpoint_address(self.switch_name, sock_dir), name
        )
        self.hdr = bytearray(64)  # recv_into target for header parts
        self.stash: deque[fr.Frame] = deque()  # frames that arrived for a later wait
        self.regions: list[tuple[int, int, int, SharedRegion]] = []  # (base, size, key, region)
        self._region_seq = itertools.count(1)
        self._barrier_seq = itertools.count(1)
        self.jobs: dict[tuple[str, str, str], Any] = {}
        self.job_seq = itertools.count(1)
        self.coll_seq = itertools.count(1)
        self.semantics: dict[str, SemanticCounts] = {}
        self.fallbacks: list[str] = []  # reported, never silent
        # aggregation retransmit timeout (RFC 6298); the floor keeps Python's
        # scheduling stalls on a shared host from looking like loss
        self.rtt = RttEstimator(rto_min=AGG_RTO_MIN_S)
        self.crc = False  # CRC32C on data frames (turned on where links corrupt)
        self.retransmits = 0
        self.duplicates = 0
        self.bad_frames = 0
        self.stale_replies = 0
        self.streams: dict[int, int] = {}  # p2p stream ids per peer (fabric.p2p)
        self.chunk_bytes: dict[str, int] = {}
        self.slots: dict[str, int] = {}
        self.scratch: np.ndarray | None = None  # staging region for ina-mem
        self.fixed_scratch: np.ndarray | None = None  # int32 region for fixed-point ina-mem
        self._hello()

    # ------------------------------------------------------------------ basics
    def deadline(self) -> float:
        """Monotonic deadline of a wait that starts now."""
        return time.monotonic() + self.timeout_s

    def sem(self, path: str) -> SemanticCounts:
        """The semantic-distance counters of ``path``."""
        return self.semantics.setdefault(path, SemanticCounts())

    def send(self, header: bytes, payload: Any = None) -> None:
        """Send one frame to the switch (payload zero-copy when large)."""
        if payload is None:
            self.sock.send(header)
            return
        nbytes = memoryview(payload).nbytes
        self.sock.send(header, zmq.SNDMORE)
        self.sock.send(payload, copy=nbytes < transport.ZERO_COPY_MIN)

    def poll(self, deadline: float, what: str) -> None:
        """Wait until a frame can be read, or raise FabricTimeout naming ``what``."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self.sock.poll(int(remaining * 1000) + 1):
            raise FabricTimeout(
                f"{self.name}: {what}: no answer from switch {self.switch_name!r} "
                f"within {self.timeout_s:g}s (is it running? see its log in the run folder)"
            )

    def recv_frame(self, deadline: float, what: str) -> fr.Frame:
        """Receive the next whole frame (payload kept in the zmq buffer, no copy)."""
        self.poll(deadline, what)
        parts = self.sock.recv_multipart(copy=False)
        payload = parts[1].buffer if len(parts) > 1 else None
        return fr.decode(parts[0].buffer, payload)

    def wait_for(self, match: Callable[[fr.Frame], bool], what: str,
                 deadline: float | None = None) -> fr.Frame:
        """The first frame satisfying ``match``; others are stashed for later waits.

        A NACK addressed to this wait's operation raises PeerFailed.
        """
        for i, f in enumerate(self.stash):
            if match(f):
                del self.stash[i]
                return f
        deadline = deadline or self.deadline()
        while True:
            f = self.recv_frame(deadline, what)
            if match(f):
                return f
            if f.op is Op.NACK:
                raise PeerFailed(f"{self.name}: {what}: node {f.src} refused frame {f.psn} of "
                                 f"job {f.job}: {f.nack_code.name}")
            self.defer(f)

    def defer(self, f: fr.Frame) -> None:
        """Keep a frame for a later wait, unless it is a stale control reply.

        Control replies are awaited only by :meth:`request`, one at a time, which
        takes its own before anything is deferred; a reply that reaches here
        answers a request already answered (a retry crossed the reply), so
        keeping it would only grow the stash.
        """
        if f.op is Op.CTRL:
            try:
                if control.parse(f.payload).get("t") in CTRL_REPLIES:
                    self.stale_replies += 1
                    return
            except fr.FrameError:
                self.bad_frames += 1
                return
        self.stash.append(f)

    def request(self, t: str, reply: str, dst: int | None = None,
                match: Callable[[dict[str, Any]], bool] | None = None,
                **fields: Any) -> dict[str, Any]:
        """Send a control message to the switch (or ``dst``) and wait for its reply.

        Control requests are idempotent, so a lost request or reply is simply
        sent again (with backoff) until the reply comes or ``timeout_s`` ends.
        """
        dst = self.switch_id if dst is None else dst
        frame = fr.encode(Op.CTRL, src=self.node_id, dst=dst, payload=control.pack(t, **fields),
                          crc=self.crc)

        def is_answer(f: fr.Frame) -> bool:
            if f.op is Op.NACK:
                return f.src == dst and f.psn == 0 and f.job == 0
            if f.op is not Op.CTRL:
                return False
            m = control.parse(f.payload)
            return m.get("t") == reply and (match is None or match(m))

        deadline = self.deadline()
        retry = CTRL_RETRY_S
        while True:
            self.send(frame)
            try:
                f = self.wait_for(is_answer, f"control request {t!r} to node {dst}",
                                  min(deadline, time.monotonic() + retry))
            except FabricTimeout:
                if time.monotonic() >= deadline:
                    raise
                retry = min(retry * 2, 1.0)
                continue
            if f.op is Op.CTRL:
                return control.parse(f.payload)
            if f.nack_code not in (NackCode.BAD_CHECKSUM, NackCode.MALFORMED):
                raise PeerFailed(f"{self.name}: node {dst} refused control request {t!r}: "
                                 f"{f.nack_code.name}")
            # damaged on the way: send it again

    def _hello(self) -> None:
        # The DEALER connects asynchronously and frames may be lost: retry.
        reply = self.request("hello", "welcome", name=self.name)
        log.debug("%s: welcomed by %s", self.name, reply.get("switch"))

    # ------------------------------------------------------------------ memory
    def alloc(self, count: int, dtype: str = "float32") -> np.ndarray:
        """A zero-filled array in a new shared region registered with the switch.

        This is the worker's "device memory": the memory plane (``ina-mem``)
        reduces straight into it.
        """
        dt = np_dtype(dtype)
        size = max(int(count) * dt.itemsize, 1)
        key = (self.node_id << 16) | (next(self._region_seq) & 0xFFFF) | (1 << 31)
        region = SharedRegion.create(f"semfab-{self.run_id}-{self.name}-{key:x}", size)
        reply = self.request("region", "region_reply", key=key, size=size,
                             path=str(region.path), match=lambda m: m.get("key") == key)
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
        base = x.ctypes.data
        for i, (start, _size, key, region) in enumerate(self.regions):
            if start == base:

                def same_key(m: dict[str, Any], key: int = key) -> bool:
                    return m.get("key") == key

                self.request("unregister", "region_reply", match=same_key, key=key)
                del self.regions[i]
                region.close()
                return
        raise UsageError("free() takes an array returned by alloc()")

    def region_of(self, x: np.ndarray) -> tuple[int, int] | None:
        """``(key, byte offset)`` of ``x`` when it lies in a registered region."""
        ptr = x.ctypes.data
        for base, size, key, _ in self.regions:
            if base <= ptr and ptr + x.nbytes <= base + size:
                return key, ptr - base
        return None

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """Wait until every worker reached this barrier (counted by the switch)."""
        bid = next(self._barrier_seq)
        self.request("barrier", "barrier_done", dst=self.root_switch_id,
                     match=lambda m: m.get("id") == bid, id=bid, n=self.world)

    def allreduce(self, x: np.ndarray, op: str = "sum", path: str = "ina",
                  out: np.ndarray | None = None, numerics: str = "float") -> np.ndarray:
        """Allreduce ``x`` over all workers; returns ``out`` (a new array by default).

        ``path``: ``ina`` (frame plane, reduced in the switch), ``ina-mem``
        (memory plane, ``x`` should come from :meth:`alloc`), ``host-ps``
        (staged through the host node), ``host-ring`` (ring through the switch).
        ``numerics="fixed"`` sums float32 as int32 fixed point with a per-block
        scale: bitwise the same result whatever the path or arrival order.
        """
        from fabric import collectives

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
        if self.rank < 0:
            raise UsageError(f"{self.name} is not a worker; only workers join collectives")
        if numerics not in ("float", "fixed"):
            raise UsageError(f"numerics must be 'float' or 'fixed', not {numerics!r}")
        if x.size == 0:
            return out
        if numerics == "fixed" and op == "sum":
            collectives.allreduce_fixed(self, x, out, path)
            return out
        runner = {
            "ina": collectives.allreduce_ina,
            "ina-mem": collectives.allreduce_ina_mem,
            "host-ps": collectives.allreduce_host_ps,
            "host-ring": collectives.allreduce_host_ring,
        }[path]
        runner(self, x, out, op, name)
        return out

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
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()
