"""The host task: token NIC, detokenizer and OpenAI-compatible HTTP server in one loop.

:func:`serve` runs on the host node ``host0`` for the life of the chain. One
asyncio loop owns three jobs:

* **transport (receive side)**: the host's fabric socket is watched by the
  loop. ``direct`` frames are WRITEs into the token ring: the header is read
  into a fixed buffer, the region key and bounds are checked, and the payload
  is received straight into the ring slot (one copy, no parsing); the records
  are then read in place. ``host-staged`` frames carry msgpack messages from
  the relay, which are decoded.
* **interpretation**: each token is fed to its sequence's incremental
  detokenizer, at once (``immediate``) or when its batch is due (``batched``);
  or, with ``detok_at=client``, its id is passed on untouched.
* **presentation**: each HTTP request has a stream; its handler formats the
  new text as OpenAI chunks and writes them as server-sent events.

Every token gets a timestamp at each layer boundary (generated, left the
device, relay in/out, arrived, detokenized, written), kept when
``cfg.record`` is set and returned with the task's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import FrameError, Op
from fabric.core.memory import AccessError, RegionInfo, RegionTable
from fabric.core.semantic import SemanticCounts
from fabric.emulation import doorbell as db
from fabric.emulation import transport
from fabric.serving import api, prom
from fabric.serving import records as rec
from fabric.serving.clock import now_ns
from fabric.serving.config import ServeConfig
from fabric.serving.detok import BatchPolicy, Detokenizer, byte_table, make_detokenizer

log = logging.getLogger("semfab.serving.host")

LAYERS = ("transport", "interpretation", "presentation")
#: Receive buffer of header parts and one-part frames (control messages).
HDR_BUF = 64 * 1024
#: Missing token frames: asked for again every REASK_S, MISSING_ASKS times at
#: most (a NACK or its answer may be lost too); at most MAX_ASKED from one gap.
REASK_S = 0.05
MISSING_ASKS = 8
MAX_ASKED = 1024
#: A request with no token after this long is sent to its generator again (the
#: ADD may have been lost; the generator ignores a request id it already has).
ADD_RESEND_S = 0.5
#: How long shutdown sends STOP again to a generator or relay that did not answer.
STOP_WAIT_S = 2.0
#: CONFIG is sent again this often to a generator that has not answered READY.
CONFIG_RESEND_S = 0.5
#: Detokenizer call timings kept (most recent).
MAX_DETOK_SAMPLES = 200_000
#: Timelines kept at most (oldest dropped) so a long `semfab serve --record` stays bounded.
MAX_TIMELINES = 20_000
#: Timeline columns (int64 ns, 0 = did not happen; ``chunk`` is the SSE event index).
COLUMNS = ("token", "t_gen", "t_sent", "t_ri", "t_ro", "t_arrive", "t_detok", "t_write",
           "chunk")
#: One timeline row per token: the first six are set together when it arrives.
TIMELINE_DTYPE = np.dtype([(c, "<i8") for c in COLUMNS])


@dataclass
class Event:
    """Something a stream's handler must send: text (or ids) for some tokens, or the end."""

    text: str
    first: int  # tokens [first, last) are delivered by this event
    last: int
    ids: list[int] | None = None  # detok near the client: the ids themselves
    finish: str | None = None
    error: api.ApiError | None = None
    t_made: int = 0  # ns: when its text (or ids) was ready for presentation


@dataclass
class Stream:
    """One request in flight."""

    rid: int
    worker: int  # node id of its generator
    req: api.GenRequest
    prompt_tokens: int
    response_id: str
    created: int
    detok: Detokenizer | None  # None: detokenized near the client
    policy: BatchPolicy
    t_req: int
    events: deque[Event] = field(default_factory=deque)
    waiter: asyncio.Future[None] | None = None
    received: int = 0  # tokens arrived
    unsent: int = 0  # first token not yet covered by an event
    pending: list[int] = field(default_factory=list)  # batched: ids waiting for a flush
    pending_arrive: list[int] = field(default_factory=list)  # their arrival times
    pending_since: int = 0
    last_gen: int = 0  # ns: when its previous token was generated
    first_write: int = 0  # ns: when its first token went to the client
    timer: asyncio.TimerHandle | None = None
    done: bool = False  # the generator will send nothing more
    delivered: bool = False  # the whole response reached the client's socket
    tl: np.ndarray | None = None  # timeline rows, TIMELINE_DTYPE (cfg.record)
    ids: list[int] = field(default_factory=list)
    # tokens that came before an earlier one of this stream (its frame was lost
    # and is being resent): index -> the token's fields, handed on in order
    early: dict[int, tuple[int, int, int, int, int, int, int]] = field(default_factory=dict)
    add: dict[str, Any] = field(default_factory=dict)  # the ADD, to send again if lost
    add_sent: int = 0  # ns: when the ADD went (last)

    sink: Callable[[Event], bool] | None = None  # writes an event at once (fast path)
    last_activity: int = 0  # ns: the last event handed to the client

    def push(self, ev: Event) -> None:
        """Queue ``ev`` for the handler (or write it now through the sink)."""
        if self.sink is not None and not self.events and ev.error is None and self.sink(ev):
            return
        self.events.append(ev)
        self.wake()

    def wake(self) -> None:
        """Wake the handler if it waits."""
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


@dataclass
class HostCounters:
    """Live counters (``GET /semfab/stats``)."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    rejected: int = 0
    tokens: int = 0
    frames: int = 0
    stray_tokens: int = 0  # for a sequence the host no longer has (aborted)
    duplicate_tokens: int = 0
    gap_tokens: int = 0  # a token index skipped: tokens lost for good
    early_tokens: int = 0  # came before an earlier token of their stream: held
    reordered_frames: int = 0
    lost_frames: int = 0  # found missing (a later frame, or an idle probe, showed it)
    recovered_frames: int = 0  # missing ones that came after a NACK
    unrecovered_frames: int = 0  # asked for MISSING_ASKS times in vain
    resent_adds: int = 0  # requests sent again: no token came for them
    refused_frames: int = 0
    bell_frames: int = 0  # WRITEs whose header came through a doorbell (cfg.bells)
    nacks: int = 0
    detok_ns: int = 0  # time spent inside the detokenizer
    detok_calls: int = 0
    detok_inconsistent: int = 0


class HostMetrics:
    """The host's Prometheus metrics, served on ``GET /metrics``.

    Per-token layer times are observed as tokens pass (generation: since the
    sequence's previous token, or the request's arrival for the first;
    transport: generated -> arrived at the host; interpretation: arrived ->
    the detokenizer call that took it; presentation: text ready -> written to
    the client's socket); the counters are read from :class:`HostCounters`.
    """

    def __init__(self, host: TokenHost) -> None:
        c = host.counters
        r = self.registry = prom.Registry()
        self.layer = r.add(prom.Histogram(
            "semfab_layer_latency_seconds", "Per-token time spent in each layer of the chain",
            prom.LAYER_BUCKETS, ("layer",)))
        self.ttft = r.add(prom.Histogram(
            "semfab_time_to_first_token_seconds",
            "Request arrival to its first token written to the client", prom.REQUEST_BUCKETS))
        self.e2e = r.add(prom.Histogram(
            "semfab_e2e_request_latency_seconds",
            "Request arrival to the end of its response (completed requests)",
            prom.REQUEST_BUCKETS))
        r.add(prom.Counter(
            "semfab_requests_total", "Requests ended, by outcome", ("outcome",),
            fn=lambda: {("completed",): c.completed, ("aborted",): c.aborted,
                        ("rejected",): c.rejected}))
        r.add(prom.Gauge("semfab_requests_running", "Requests in flight",
                         fn=lambda: len(host.streams)))
        self.prompt_tokens = r.add(prom.Counter("semfab_prompt_tokens_total",
                                                "Prompt tokens of admitted requests"))
        r.add(prom.Counter("semfab_generation_tokens_total",
                           "Tokens that arrived at the host", fn=lambda: c.tokens))
        r.add(prom.Counter("semfab_token_frames_total", "Token frames received",
                           fn=lambda: c.frames))
        r.add(prom.Counter(
            "semfab_token_path_errors_total",
            "Trouble on the token path, by kind (nothing is retransmitted)", ("kind",),
            fn=lambda: {(k,): getattr(c, k) for k in (
                "lost_frames", "reordered_frames", "refused_frames", "gap_tokens",
                "duplicate_tokens", "stray_tokens", "nacks")}))
        r.add(prom.Counter("semfab_detokenizer_seconds_total",
                           "Time spent inside the detokenizer", fn=lambda: c.detok_ns / 1e9))
        self._pending: list[tuple[str, float]] = []

    def later(self, layer: str, ns: int) -> None:
        """Observe a layer time once the frame in hand is handled (kept off its path)."""
        self._pending.append((layer, ns / 1e9))

    def flush(self) -> None:
        """Observe what :meth:`later` kept."""
        obs = self.layer.observe
        for layer, seconds in self._pending:
            obs(seconds, layer)
        self._pending.clear()

    def render(self) -> str:
        """The exposition text."""
        self.flush()
        return self.registry.render()


class TokenHost:
    """The host's side of the chain (see the module docstring)."""

    def __init__(self, ep: Any, cfg: ServeConfig) -> None:
        from fabric.serving.assets import CorpusWalk, load_tokenizer, local_assets

        self.ep = ep
        self.cfg = cfg
        self.loop = asyncio.get_running_loop()
        self.tokenizer = load_tokenizer(local_assets(cfg.assets_dir))
        self.table = byte_table(self.tokenizer) if cfg.detokenizer == "table" else None
        self.vocab = self.tokenizer.get_vocab_size()
        self.walk = CorpusWalk.load(local_assets(cfg.assets_dir))
        self.policy = BatchPolicy.of(cfg.detok, cfg.batch_tokens, cfg.batch_ms)
        self.models = (cfg.model,)
        self.created = int(time.time())
        self.workers = [w.id for w in ep.topo.workers]
        self.worker_names = {w.id: w.name for w in ep.topo.workers}
        self.load = dict.fromkeys(self.workers, 0)
        self.dead: dict[int, str] = {}
        self.followers: set[int] = set()  # ranks of a sharded generator that take no requests
        self.group_of: dict[int, int] = {}  # worker -> its generator group's leader
        self.streams: dict[int, Stream] = {}
        self.rids = itertools.count(1)
        self.counters = HostCounters()
        self.metrics = HostMetrics(self)
        self.sem = {layer: SemanticCounts() for layer in LAYERS}
        self.timelines: dict[int, dict[str, Any]] = {}
        # (ns, tokens) of recent detokenizer calls: the interpretation cost itself
        self.detok_samples: deque[tuple[int, int]] = deque(maxlen=MAX_DETOK_SAMPLES)
        self.closing = False
        self.stopped: asyncio.Future[None] = self.loop.create_future()
        self.relay_id = ep.topo.node(cfg.relay).id if cfg.transport == "host-staged" else 0
        self._ready_workers: set[int] = set()
        self._relay_ready = False
        # header parts (and small one-part frames: control messages) land here
        self._hdr = bytearray(HDR_BUF)
        self._held: list[tuple[Stream, Event]] | None = None  # events of the frame in hand
        self._psn: dict[int, int] = {}  # next frame (or message) number per sender
        # frames found missing, (sender, psn) -> (ns asked, times asked)
        self._missing: dict[tuple[int, int], tuple[int, int]] = {}
        self._reask: asyncio.TimerHandle | None = None
        self._drain_due = False  # a drain is scheduled (after a send)
        self._stopped: set[int] = set()  # generators (and the relay) that took STOP
        self._job = cfg.session & 0xFFFF
        self.ring: np.ndarray | None = None
        self.ring_key = 0
        self.regions = RegionTable()
        self._ring_bounds: dict[int, tuple[int, int]] = {}
        self.ring_path = ""  # cfg.bells: the ring's file, for generators on this host
        self._bells: dict[int, db.Doorbell] = {}  # worker -> its doorbell to us

    # ------------------------------------------------------------------ start
    async def start(self, timeout_s: float = 120.0) -> None:
        """Token ring, socket watch, worker configuration, relay handshake."""
        cfg = self.cfg
        size = len(self.workers) * cfg.ring_slots * rec.RECORD_SIZE
        if cfg.transport == "direct":
            ring = self.ep.alloc(size // 8, "int64")  # registered "host memory"
            found = self.ep.region_of(ring)
            # with the switch on another host alloc gives plain memory: the key is
            # then ours alone (every WRITE is checked against self.regions anyway)
            self.ring_key = found[0] if found is not None else secrets.randbits(32) | 1
            if found is not None and cfg.bells:  # generators on this host may map it
                self.ring_path = next(str(r.path) for _b, _s, k, r in self.ep.regions
                                      if k == self.ring_key)
            self.ring = ring.view(np.uint8)
            self.regions.add(RegionInfo(self.ring_key, self.ep.node_id, size, "token-ring",
                                        frozenset(self.workers)))
        sock = self.ep.sock
        self.loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        for i, w in enumerate(self.workers):
            base = i * cfg.ring_slots * rec.RECORD_SIZE
            self._ring_bounds[w] = (base, base + cfg.ring_slots * rec.RECORD_SIZE)
            self._send_config(i, w)
        deadline = time.monotonic() + timeout_s
        configured = time.monotonic()
        while len(self._ready_workers) < len(self.workers) or (
                self.relay_id and not self._relay_ready):
            if time.monotonic() - configured > CONFIG_RESEND_S:  # a lost CONFIG or READY
                configured = time.monotonic()
                for i, w in enumerate(self.workers):
                    if w not in self._ready_workers:
                        self._send_config(i, w)
            if time.monotonic() > deadline:
                missing = [self.worker_names[w] for w in self.workers
                           if w not in self._ready_workers]
                if self.relay_id and not self._relay_ready:
                    missing.append(cfg.relay)
                raise TimeoutError(f"host0: not ready within {timeout_s:g}s: "
                                   f"no answer from {', '.join(missing)}")
            if self.relay_id and not self._relay_ready:
                self._send_ctrl(self.relay_id, rec.PING)
            await asyncio.sleep(0.05)
            self._drain()

    def _send(self, frame: bytes) -> None:
        """Send one frame on the fabric socket, then drain it soon.

        A send makes libzmq take in its pending commands, the signal of a
        frame that just arrived among them: the socket's file descriptor then
        stays unreadable although a frame waits, and the event loop would not
        call ``_drain`` again. So every send, from a timer or a request
        handler as well as from ``_drain`` itself, is followed by a drain.
        """
        self.ep.send_frame(frame)
        if not self._drain_due:
            self._drain_due = True
            self.loop.call_soon(self._drain)

    def _send_ctrl(self, dst: int, t: str, **fields: Any) -> None:
        self._send(fr.encode(Op.CTRL, src=self.ep.node_id, dst=dst,
                             payload=control.pack(t, session=self.cfg.session, **fields)))

    def _send_config(self, i: int, worker: int) -> None:
        """CONFIG for the ``i``-th generator: its part of the token ring."""
        cfg = self.cfg
        self._send_ctrl(worker, rec.CONFIG, ring_key=self.ring_key,
                        ring_base=i * cfg.ring_slots * rec.RECORD_SIZE,
                        ring_slots=cfg.ring_slots, relay_id=self.relay_id,
                        ring_path=self.ring_path)

    # ------------------------------------------------------------------ fabric receive
    def _drain(self) -> None:
        """Handle every frame waiting on the fabric socket (edge-triggered FD)."""
        self._drain_due = False
        sock = self.ep.sock
        try:
            while transport.has_frame(sock):
                self._recv_one(sock)
        except zmq.ZMQError as exc:  # the socket is closing
            log.debug("fabric socket: %s", exc)

    def _recv_one(self, sock: zmq.Socket) -> None:
        t_arrive = now_ns()
        hdr = self._hdr
        nb = sock.recv_into(hdr, flags=zmq.NOBLOCK)
        more = sock.getsockopt(zmq.RCVMORE)
        if nb > len(hdr):
            if more:
                sock.recv_into(bytearray(), flags=zmq.NOBLOCK)
            self.counters.refused_frames += 1
            log.warning("host0: refused a %d B one-part frame (limit %d B)", nb, len(hdr))
            return
        try:
            op, _flags, src, job, psn, key, offset, length = fr.peek(memoryview(hdr)[:nb])
            if op is Op.WRITE and key and key == self.ring_key and more:
                self._on_ring_write(sock, src, job, psn, offset, length, t_arrive)
                return
            payload = sock.recv(zmq.NOBLOCK, copy=False).buffer if more else None
            f = fr.decode(bytes(memoryview(hdr)[:nb]), payload)
        except (FrameError, AccessError) as exc:
            self.counters.refused_frames += 1
            log.warning("host0: refused a frame: %s", exc)
            return
        self.counters.frames += 1
        if f.op is Op.WRITE and f.flow == rec.STAGED_FLOW:
            self._on_staged(f, t_arrive)
        elif f.op is Op.CTRL:
            self._on_ctrl(f)
        elif f.op is Op.NACK:
            self.counters.nacks += 1
            log.warning("host0: NACK %s from node %d", f.nack_code.name, f.src)

    def _on_ring_write(self, sock: zmq.Socket, src: int, job: int, psn: int, offset: int,
                       length: int, t_arrive: int) -> None:
        """direct: receive the payload straight into the ring, then read the records."""
        assert self.ring is not None
        try:
            self.regions.check(self.ring_key, offset, length, src)
            lo, hi = self._ring_bounds.get(src, (0, 0))
            if not lo <= offset <= offset + length <= hi or length % rec.RECORD_SIZE:
                raise AccessError(fr.NackCode.PERMISSION,
                                  f"node {src} wrote [{offset}, {offset + length}) outside its "
                                  f"part of the token ring")
        except AccessError as exc:
            sock.recv_into(bytearray(), flags=zmq.NOBLOCK)  # discard the payload
            self.counters.refused_frames += 1
            self._send(fr.encode_nack(src=self.ep.node_id, dst=src, flow=rec.TOKEN_FLOW,
                                      psn=psn, code=exc.code))
            log.warning("host0: refused a token write: %s", exc)
            return
        view = self.ring[offset: offset + length]
        got = sock.recv_into(view.data, flags=zmq.NOBLOCK)  # the one copy: wire -> ring slot
        if got != length or job != self._job:
            self.counters.refused_frames += 1
            return
        n = length // rec.RECORD_SIZE
        s = self.sem["transport"]
        s.copies += n
        s.crossings += n  # switch -> host
        self._take_records(src, psn, view, t_arrive)

    def _take_records(self, src: int, psn: int, view: np.ndarray, t_arrive: int) -> None:
        """Frame ``psn`` of ``src`` put these records in its part of the ring."""
        self.counters.frames += 1
        self._check_psn(src, psn)
        self.sem["transport"].chunks += len(view) // rec.RECORD_SIZE
        # r = (rid, index, token, flags, pad, t_gen, t_sent), read in place
        self._held = []
        try:
            for r in rec.iter_records(memoryview(view.data)):
                self._on_token(r[0], r[1], r[2], r[3], r[5], r[6], 0, 0, t_arrive)
        finally:
            self._release_held()

    # ------------------------------------------------------------------ doorbells
    def _attach_bell(self, worker: int, path: str) -> None:
        """A generator on this host writes into the ring itself and posts each WRITE's
        header to its doorbell: watch the doorbell's pipe."""
        try:
            bell = db.Doorbell.attach(path)
        except (OSError, ValueError) as exc:  # its frames keep to the socket
            log.warning("host0: doorbell of node %d not attached: %s", worker, exc)
            return
        self._bells[worker] = bell
        self.loop.add_reader(bell.fileno(), self._drain_bell, worker)
        log.info("host0: doorbell of node %d attached (%s)", worker, path)
        # what it posted before we looked, then the sleeping word up: we block in
        # the event loop, so the writer rings the pipe
        self._drain_bell(worker)

    def _drain_bell(self, worker: int) -> None:
        """The doorbell rang: take every descriptor, then block again."""
        bell = self._bells.get(worker)
        if bell is None:
            return
        bell.wake()
        while True:
            header = bell.recv()
            while header is not None:
                self._on_bell_write(worker, header, now_ns())
                header = bell.recv()
            if not bell.sleep():  # nothing came while we looked: block
                return
            bell.wake()

    def _on_bell_write(self, worker: int, header: bytes, t_arrive: int) -> None:
        """direct through a doorbell: the records are already in the ring."""
        assert self.ring is not None
        try:
            op, flags, src, job, psn, key, offset, length = fr.peek(header)
            lo, hi = self._ring_bounds.get(worker, (0, 0))
            if (op is not Op.WRITE or not flags & fr.Flag.REF or src != worker
                    or key != self.ring_key or job != self._job
                    or not lo <= offset <= offset + length <= hi
                    or length % rec.RECORD_SIZE):
                raise FrameError(fr.NackCode.PERMISSION, f"doorbell of node {worker}: not a "
                                 "WRITE into its part of the token ring")
        except FrameError as exc:
            self.counters.refused_frames += 1
            log.warning("host0: refused a doorbell descriptor: %s", exc)
            return
        self.counters.bell_frames += 1
        self._take_records(worker, psn, self.ring[offset: offset + length], t_arrive)

    def _close_bells(self) -> None:
        for bell in self._bells.values():
            with contextlib.suppress(Exception):
                self.loop.remove_reader(bell.fileno())
            bell.close()
        self._bells.clear()

    def _check_psn(self, src: int, psn: int) -> None:
        """Frame ``psn`` of sender ``src`` (``| 0x10000``: its host-staged messages)
        arrived: a jump ahead means the frames between were lost, so ask for them;
        one behind is a resent (or late) copy."""
        want = self._psn.get(src, 0)
        if psn != want & 0xFFFF_FFFF:
            if (psn - want) & 0xFFFF_FFFF < 0x8000_0000:
                self._ask(src, want, psn)
            else:
                if self._missing.pop((src, psn), None) is not None:
                    self.counters.recovered_frames += 1
                else:
                    self.counters.reordered_frames += 1
                return
        self._psn[src] = psn + 1

    def _ask(self, src: int, lo: int, hi: int) -> None:
        """Frames ``lo..hi-1`` of ``src`` are missing: NACK each to its generator."""
        now = now_ns()
        for psn in range(lo, min(hi, lo + MAX_ASKED)):
            key = (src, psn & 0xFFFF_FFFF)
            if key not in self._missing:
                self.counters.lost_frames += 1
                self._missing[key] = (now, 1)
                self._nack(*key)
        self._psn[src] = hi
        self._arm_reask()

    def _nack(self, src: int, psn: int) -> None:
        flow = rec.STAGED_FLOW if src & 0x10000 else rec.TOKEN_FLOW
        self._send(fr.encode_nack(src=self.ep.node_id, dst=src & 0xFFFF, flow=flow,
                                  psn=psn, code=fr.NackCode.MISSING))

    def _arm_reask(self) -> None:
        if self._reask is None and (self._missing or self._unstarted()):
            self._reask = self.loop.call_later(REASK_S, self._on_reask)

    def _unstarted(self) -> list[Stream]:
        return [st for st in self.streams.values()
                if not st.received and not st.done and not st.early and st.add]

    def _on_reask(self) -> None:
        """Ask again for frames still missing; send again requests that never began."""
        self._reask = None
        now = now_ns()
        for key, (t, tries) in list(self._missing.items()):
            if now - t < REASK_S * 1e9:
                continue
            if tries >= MISSING_ASKS:
                del self._missing[key]
                self.counters.unrecovered_frames += 1
                log.warning("host0: token frame %d of node %d lost for good", key[1],
                            key[0] & 0xFFFF)
                continue
            self._missing[key] = (now, tries + 1)
            self._nack(*key)
        for st in self._unstarted():
            if now - st.add_sent >= ADD_RESEND_S * 1e9 and st.worker not in self.dead:
                st.add_sent = now
                self.counters.resent_adds += 1
                self._send_ctrl(st.worker, rec.ADD, **st.add)
        self._arm_reask()

    def _on_staged(self, f: fr.Frame, t_arrive: int) -> None:
        try:
            msg = rec.unpack_staged(f.payload)
        except FrameError as exc:
            self.counters.refused_frames += 1
            log.warning("host0: refused a staged message: %s", exc)
            return
        if msg["s"] != self.cfg.session:
            return
        rows = msg["r"]
        n = len(rows)
        s = self.sem["transport"]
        s.chunks += n
        s.crossings += n  # switch -> host
        s.encodes += n  # unpack
        s.copies += n  # unpack copies the records out of the message
        self._check_psn(int(msg.get("w", f.src)) | 0x10000, int(msg["q"]))
        ri, ro = int(msg.get("ri", 0)), int(msg.get("ro", 0))
        self._held = []
        try:
            for r in rows:
                self._on_token(r[0], r[1], r[2], r[3], r[4], r[5], ri, ro, t_arrive)
        finally:
            self._release_held()

    def _on_ctrl(self, f: fr.Frame) -> None:
        try:
            msg = control.parse(f.payload)
        except FrameError as exc:
            log.warning("host0: bad control message: %s", exc)
            return
        if msg.get("session") != self.cfg.session:
            return
        t = msg["t"]
        if t == rec.READY:
            self._ready_workers.add(f.src)
            # a sharded model's group is one generator: its leader takes the requests
            if not msg.get("admits", True):
                self.followers.add(f.src)
            self.group_of[f.src] = int(msg.get("group", f.src))
            if msg.get("bell") and f.src in self._ring_bounds and f.src not in self._bells:
                self._attach_bell(f.src, str(msg["bell"]))
        elif t == rec.PONG:
            self._relay_ready = True
        elif t == rec.STOPPED:
            self._stopped.add(f.src)
        elif t == rec.FAIL:
            self._worker_failed(f.src, str(msg.get("error", "unknown error")))
        elif t == rec.SENT:  # an idle generator's next frame number: is anything missing?
            src = f.src | (0x10000 if msg.get("staged") else 0)
            psn = int(msg.get("psn", 0)) & 0xFFFF_FFFF
            want = self._psn.get(src, 0)
            if psn != want and (psn - want) & 0xFFFF_FFFF < 0x8000_0000:
                self._ask(src, want, psn)

    def _worker_failed(self, worker: int, error: str) -> None:
        name = self.worker_names.get(worker, str(worker))
        self.dead[worker] = error
        log.error("host0: generator %s failed: %s", name, error)
        leader = self.group_of.get(worker, worker)  # a rank of a group fails the group
        self.dead.setdefault(leader, error)
        for st in list(self.streams.values()):
            if st.worker == leader and not st.done:
                self._fail(st, api.ApiError(500, f"generator {name} failed: {error}",
                                            type_="server_error", code="generator_failed"))

    # ------------------------------------------------------------------ interpretation
    def _on_token(self, rid: int, idx: int, tok: int, flags: int, t_gen: int, t_sent: int,
                  t_ri: int, t_ro: int, t_arrive: int) -> None:
        st = self.streams.get(rid)
        if st is None or st.done:
            self.counters.stray_tokens += 1
            return
        if idx != st.received:
            if idx < st.received or idx in st.early:
                self.counters.duplicate_tokens += 1  # a resent frame overtaken by its copy
                return
            # an earlier token's frame is missing and being asked for: hold this one
            self.counters.early_tokens += 1
            st.early[idx] = (tok, flags, t_gen, t_sent, t_ri, t_ro, t_arrive)
            return
        self._take_token(st, idx, tok, flags, t_gen, t_sent, t_ri, t_ro, t_arrive)
        while st.received in st.early and not st.done:
            i = st.received
            self._take_token(st, i, *st.early.pop(i))

    def _take_token(self, st: Stream, idx: int, tok: int, flags: int, t_gen: int, t_sent: int,
                    t_ri: int, t_ro: int, t_arrive: int) -> None:
        """Interpret token ``idx`` of ``st``, the next one in order."""
        self.counters.tokens += 1
        st.ids.append(tok)
        m = self.metrics
        m.later("generation", t_gen - (st.last_gen or st.t_req))
        m.later("transport", t_arrive - t_gen)
        st.last_gen = t_gen
        tl = st.tl
        if tl is not None and idx < tl.size:
            tl[idx] = (tok, t_gen, t_sent, t_ri, t_ro, t_arrive, 0, 0, 0)
        st.received = idx + 1
        last = bool(flags & rec.LAST) or st.received >= st.req.max_tokens
        st.pending.append(tok)
        st.pending_arrive.append(t_arrive)
        if len(st.pending) == 1:
            st.pending_since = t_arrive
        if self.policy.due(len(st.pending), st.pending_since, t_arrive, last):
            self._flush(st, last)
        elif st.timer is None:
            when = self.policy.deadline(st.pending_since)
            if when is not None:
                st.timer = self.loop.call_later(max(when - now_ns(), 0) / 1e9,
                                                self._on_timer, st)

    def _hand_over(self, st: Stream, ev: Event) -> None:
        """Give ``ev`` to presentation; inside a frame, after every token is interpreted.

        A frame carries one token for each of many streams: detokenizing them
        all before writing any keeps the interpretation layer's time its own
        (the writes are presentation's).
        """
        if self._held is not None:
            self._held.append((st, ev))
        else:
            st.push(ev)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        for st, ev in held or ():
            st.push(ev)
        self.metrics.flush()

    def _on_timer(self, st: Stream) -> None:
        st.timer = None
        if st.pending and not st.done:
            self._flush(st, False)
        self.metrics.flush()

    def _flush(self, st: Stream, last: bool) -> None:
        """Detokenize the pending ids and hand the new text to the stream's handler.

        Near the client, the ids themselves are handed over (same batching).
        """
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        ids = st.pending
        arrived = st.pending_arrive
        st.pending = []
        st.pending_arrive = []
        d = st.detok
        if d is None:
            self._hand_over(st, Event("", st.unsent, st.received, ids=ids,
                          finish="length" if last else None, t_made=now_ns()))
            st.unsent = st.received
            if last:
                self._finished(st)
            return
        r0 = d.released
        t0 = now_ns()
        text = d.feed(ids)
        if last:
            text += d.finish()
            if getattr(d, "consistent", True) is False:
                self.counters.detok_inconsistent += 1
        t1 = now_ns()
        self.counters.detok_ns += t1 - t0
        self.counters.detok_calls += 1
        self.detok_samples.append((t1 - t0, len(ids)))
        s = self.sem["interpretation"]
        s.chunks += len(ids)
        s.encodes += len(ids)  # ids -> UTF-8 text
        r1 = d.released
        if st.tl is not None and r1 > r0:
            st.tl["t_detok"][r0:r1] = t1
        for t in arrived:
            self.metrics.later("interpretation", t1 - t)
        if text or last:
            self._hand_over(st, Event(text, st.unsent, r1 if not last else st.received,
                          finish="length" if last else None, t_made=t1))
            st.unsent = r1 if not last else st.received
        if last:
            self._finished(st)

    def _finished(self, st: Stream) -> None:
        st.done = True
        self.load[st.worker] = max(0, self.load[st.worker] - 1)

    def _fail(self, st: Stream, err: api.ApiError) -> None:
        if not st.done:
            self._finished(st)
        st.push(Event("", st.unsent, st.unsent, error=err))

    # ------------------------------------------------------------------ requests
    def open(self, req: api.GenRequest) -> Stream:
        """Admit a request: choose a generator, send it the sequence, return its stream."""
        if self.closing:
            raise api.ApiError(503, "The server is shutting down", type_="server_error",
                               code="shutting_down")
        if len(self.streams) >= self.cfg.max_queue:
            self.counters.rejected += 1
            raise api.ApiError(429, f"Too many requests in flight ({self.cfg.max_queue})",
                               type_="rate_limit_error", code="rate_limit_exceeded")
        alive = [w for w in self.workers if w not in self.dead and w not in self.followers]
        if not alive:
            raise api.ApiError(503, "No generator is running", type_="server_error")
        t_req = now_ns()
        if req.prompt_ids is not None:
            prompt_ids = req.prompt_ids
            if max(prompt_ids) >= self.vocab:
                raise api.ApiError(400, f"prompt token ids must be below {self.vocab}",
                                   "prompt")
        else:
            prompt_ids = self.tokenizer.encode(req.prompt or "").ids
        worker = min(alive, key=lambda w: self.load[w])
        rid = next(self.rids)
        to_client = req.detokenize is False or (self.cfg.detok_at == "client"
                                                and req.detokenize is not True)
        detok = None if to_client else make_detokenizer(self.cfg.detokenizer, self.tokenizer,
                                                        self.table)
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        st = Stream(rid, worker, req, len(prompt_ids), f"{prefix}-{self.cfg.session:x}-{rid}",
                    int(time.time()), detok, self.policy, t_req)
        if self.cfg.record:
            st.tl = np.zeros(req.max_tokens, TIMELINE_DTYPE)
        self.streams[rid] = st
        self.load[worker] += 1
        self.counters.requests += 1
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        toy = [int(t) % self.cfg.input_vocab for t in prompt_ids[-256:]] or [0]
        temperature = self.cfg.temperature if req.temperature is None else req.temperature
        seed = req.seed if temperature > 0 else None  # greedy: a seed changes nothing
        st.add = dict(rid=rid, prompt=toy, max_tokens=req.max_tokens, temperature=temperature,
                      seed=seed, start=self.walk.start_for(prompt_ids, seed))
        st.add_sent = now_ns()
        self._send_ctrl(worker, rec.ADD, **st.add)
        self._arm_reask()
        return st

    def close_stream(self, st: Stream, completed: bool) -> None:
        """The handler is done with ``st``: keep its timeline, free the generator's row."""
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        if not completed and not st.done:
            if st.worker not in self.dead:
                self._send_ctrl(st.worker, rec.ABORT, rid=st.rid)
            self._finished(st)
        if completed:
            self.counters.completed += 1
            self.metrics.e2e.observe((now_ns() - st.t_req) / 1e9)
        else:
            self.counters.aborted += 1
        self.streams.pop(st.rid, None)
        if st.tl is not None:
            if len(self.timelines) >= MAX_TIMELINES:
                self.timelines.pop(next(iter(self.timelines)))
            self.timelines[st.rid] = {
                "rid": st.rid, "id": st.response_id, "worker": self.worker_names[st.worker],
                "kind": st.req.kind, "completed": completed, "t_req": st.t_req,
                "received": st.received, "prompt_tokens": st.prompt_tokens,
                "client_detok": st.detok is None,
                **{c: st.tl[c][: st.received].copy() for c in COLUMNS},
            }

    async def next_events(self, st: Stream, timeout_s: float) -> list[Event]:
        """Wait for the stream's next queued events (or a wake-up: maybe none).

        Fails the stream when nothing at all happened for ``timeout_s``
        (events written by the fast path count as activity).
        """
        while not st.events:
            st.waiter = self.loop.create_future()
            try:
                await asyncio.wait_for(st.waiter, timeout_s)
                break
            except TimeoutError:
                idle = (now_ns() - max(st.last_activity, st.t_req)) / 1e9
                if idle >= timeout_s:
                    self._fail(st, api.ApiError(504, f"no token within {timeout_s:g}s",
                                                type_="server_error", code="timeout"))
            finally:
                st.waiter = None
        out = list(st.events)
        st.events.clear()
        return out

    def stamp_written(self, st: Stream, ev: Event, chunk: int, t: int) -> None:
        """Presentation bookkeeping once an event's bytes are handed to the socket."""
        n = ev.last - ev.first
        s = self.sem["presentation"]
        s.chunks += n
        s.encodes += n  # the text (or ids) JSON-encoded into the chunk
        s.copies += n  # the chunk string encoded to bytes
        s.crossings += n  # host -> client process
        st.last_activity = t
        if n > 0:
            m = self.metrics
            if ev.t_made:
                m.layer.observe((t - ev.t_made) / 1e9, "presentation", count=n)
            if not st.first_write:
                st.first_write = t
                m.ttft.observe((t - st.t_req) / 1e9)
        if st.tl is not None and n > 0:
            st.tl["t_write"][ev.first: ev.last] = t
            st.tl["chunk"][ev.first: ev.last] = chunk

    # ------------------------------------------------------------------ stop
    def request_stop(self) -> None:
        """Ask :func:`serve` to shut down (idempotent; safe from signal handlers)."""
        if not self.stopped.done():
            self.stopped.set_result(None)

    async def shutdown(self) -> None:
        """Fail open streams, stop the generators and the relay."""
        self.closing = True
        for st in list(self.streams.values()):
            self._fail(st, api.ApiError(503, "The server is shutting down",
                                        type_="server_error", code="shutting_down"))
        # control frames may be lost on a faulty link: STOP until each one says STOPPED
        peers = [w for w in self.workers if w not in self.dead]
        if self.relay_id:
            peers.append(self.relay_id)
        deadline = time.monotonic() + STOP_WAIT_S
        while True:
            waiting = [p for p in peers if p not in self._stopped]
            if not waiting or time.monotonic() > deadline:
                break
            for p in waiting:
                self._send_ctrl(p, rec.STOP)
            await asyncio.sleep(0.1)
            self._drain()

    def stats(self) -> dict[str, Any]:
        """Counters for ``GET /semfab/stats`` and the task result."""
        c = self.counters.__dict__.copy()
        c["open_streams"] = len(self.streams)
        c["load"] = {self.worker_names[w]: n for w, n in self.load.items()}
        c["dead"] = {self.worker_names[w]: e for w, e in self.dead.items()}
        c["strategy"] = self.cfg.label()
        c["detok_us_per_call"] = (c["detok_ns"] / c["detok_calls"] / 1e3
                                  if c["detok_calls"] else None)
        return c

    def result(self) -> dict[str, Any]:
        """The task's result."""
        return {"node": self.ep.name, "counters": self.stats(),
                "sem": {k: v.__dict__.copy() for k, v in self.sem.items()},
                "timelines": self.timelines,
                "detok_samples": np.array(self.detok_samples, dtype=np.int64).reshape(-1, 2)}
