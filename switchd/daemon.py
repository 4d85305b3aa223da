"""The switch daemon: a thin ZeroMQ loop around the pure protocol objects.

One process per switch. A ROUTER socket is bound at the switch's address;
every node attached to it connects a DEALER whose identity is its node name.
Per frame the loop does one of three things:

* ``REDUCE`` addressed to this switch: hand it to the aggregation engine and
  turn the engine's events into RESULT / NACK frames (frame plane: the result
  travels back in the frame; memory plane: the switch loads, reduces and
  stores straight into the members' registered regions and sends a 32-byte
  RESULT that carries no data);
* ``CTRL`` addressed to this switch: hello, job and region registration,
  barriers, statistics;
* anything else: forward to the destination node unchanged (header and payload
  buffers are passed through, never re-encoded).

Malformed or unauthorised frames are counted and answered with a NACK; the
loop keeps running.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from fabric import control, transport
from fabric import frame as fr
from fabric.faults import FaultInjector, FaultSpec, parse_faults
from fabric.frame import Flag, FrameError, NackCode, Op
from fabric.memory import AccessError, RegionInfo, RegionTable
from fabric.shm import SharedRegion
from fabric.topology import Topology
from switchd.aggregation import (
    DTYPES,
    AggOp,
    AggregationEngine,
    Completed,
    DuplicateIgnored,
    Granted,
    JobSpec,
    Rejected,
    ResendResult,
    Stale,
)
from switchd.shaper import LinkShaper

log = logging.getLogger("semfab.switchd")

PSN_MASK = 0xFFFF_FFFF


@dataclass
class SwitchCounters:
    """Live counters a running switch reports to `semfab stats`."""

    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    forwarded: int = 0
    reduce_frames: int = 0
    results_sent: int = 0
    ctrl_frames: int = 0
    malformed: int = 0
    nacks_sent: int = 0
    nacks_received: int = 0
    unroutable: int = 0
    # semantic distance, as the switch really handles payloads
    # semantic distance of what the switch does to payloads: one per contribution
    # copied or reduced into slot memory (frame plane), one per result stored
    # into a member's region (memory plane)
    payload_copies: int = 0
    mem_stores: int = 0  # memory-plane chunk stores into member regions
    reduce_seconds: float = 0.0
    jobs_refused: int = 0
    nack_codes: dict[str, int] = field(default_factory=dict)
    fault_lost: dict[str, int] = field(default_factory=dict)  # injected losses by opcode


def unwrap_psn(psn: int, last: int) -> int:
    """The unbounded chunk number nearest ``last`` whose low 32 bits are ``psn``."""
    cand = (last & ~PSN_MASK) | psn
    if cand - last > 1 << 31:
        cand -= 1 << 32
    elif last - cand > 1 << 31:
        cand += 1 << 32
    return max(cand, 0)


def _sum_fault_stats(injectors: dict[bytes, FaultInjector]) -> dict[str, int]:
    total: dict[str, int] = {}
    for inj in injectors.values():
        for k, v in asdict(inj.statistics()).items():
            total[k] = total.get(k, 0) + v
    return total


def _join(header: Any, payload: Any) -> bytes:
    """One contiguous copy of a message (only where faults must see its bytes)."""
    return bytes(header) + (bytes(payload) if payload is not None else b"")


def _split(blob: bytes, head_len: int) -> tuple[bytes, memoryview | None]:
    """Back into the two-part form the receivers expect."""
    view = memoryview(blob)
    if len(blob) <= head_len:
        return blob, None
    return bytes(view[:head_len]), view[head_len:]


def _crc_len(blob: bytes) -> int:
    return fr.CRC_SIZE if len(blob) > 2 and blob[2] & Flag.CRC else 0


def _wire_bytes(header: Any, size: int) -> int:
    """Bytes a frame puts on its link: a referenced (memory-plane) frame also
    moves the ``length`` bytes it names, loaded or stored over that link."""
    try:
        _op, flags, _s, _j, _p, _k, _o, length = fr.peek(header)
    except FrameError:
        return size
    return size + length if flags & Flag.REF else size


class SwitchDaemon:
    """One switch. ``serve()`` runs until a shutdown message or SIGTERM."""

    def __init__(
        self,
        topo: Topology,
        name: str,
        sock_dir: Path,
        ctl_addr: str | None = None,
        memory_budget: int = 256 * 2**20,
        io_threads: int = 1,
        faults: str | None = None,
        seed: int = 0,
    ) -> None:
        self.topo = topo
        self.name = name
        self.node = topo.node(name)
        self.address = topo.endpoint_address(name, sock_dir)
        self.ctx = transport.context(io_threads)
        self.sock = transport.router(self.ctx, topo.bind_address(name, sock_dir))
        self.ctl = transport.dealer(self.ctx, ctl_addr, name) if ctl_addr else None
        self.engine = AggregationEngine(memory_budget)
        self.regions = RegionTable()
        self._mapped: dict[int, SharedRegion] = {}
        self._ident: dict[int, bytes] = {n.id: n.name.encode() for n in topo.nodes}
        # Switch-to-switch links: the higher-id end connects a DEALER (named after
        # itself) to the lower-id end's ROUTER, so each link is one socket pair.
        self._attached = {n for n in topo.attached(name)}
        self._dealers: dict[bytes, zmq.Socket] = {}
        for link in topo.links_of(name):
            other = topo.node(link.other(name))
            if other.is_switch and other.id < self.node.id:
                self._dealers[other.name.encode()] = transport.dealer(
                    self.ctx, topo.endpoint_address(other.name, sock_dir), name)
        self._higher = {s.encode() for s in (link.other(name) for link in topo.links_of(name))
                        if topo.node(s).is_switch and topo.node(s).id > self.node.id}
        self._linked: set[bytes] = set()  # lower neighbours that welcomed us
        self._hellos: set[bytes] = set()  # peers that said hello on our ROUTER
        self._hello_at = -1.0
        self._ready_sent = False
        self._next_hop: dict[int, bytes] = {}
        for n in topo.nodes:
            if n.name == name:
                continue
            if n.name in self._attached:
                self._next_hop[n.id] = n.name.encode()
            else:
                path = topo.route(name, n.name)
                if len(path) > 1:
                    self._next_hop[n.id] = path[1].encode()
        self.counters = SwitchCounters()
        self._jobs: dict[int, JobSpec] = {}
        self._job_last: dict[int, int] = {}
        # memory plane: per (job, chunk) the (key, offset) each member named
        self._refs: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        # tree aggregation: parent switch per job, chunks sent up and awaiting the
        # parent's result, registrations waiting for the parent's grant
        self._job_parent: dict[int, int] = {}
        self._awaiting: set[tuple[int, int]] = set()
        self._up_pending: dict[int, dict[int, bytes]] = {}
        self._up_granted: dict[int, bool] = {}
        self._barriers: dict[int, dict[int, bytes]] = {}
        self._barriers_done: deque[int] = deque(maxlen=1024)
        self._kernel: Any = None
        # link emulation: per attached node, the node->switch and switch->node directions
        self._ingress: dict[bytes, LinkShaper] = {}
        self._egress: dict[bytes, LinkShaper] = {}
        for link in topo.links_of(name):
            peer = link.other(name).encode()
            if link.params.shaped or link.params.latency_us > 0:
                self._ingress[peer] = LinkShaper(link.params)
                self._egress[peer] = LinkShaper(link.params)
        # fault injection per link direction (seeded): from the link's `loss`, or
        # every link's spec overridden by --faults
        self._faults_in: dict[bytes, FaultInjector] = {}
        self._faults_out: dict[bytes, FaultInjector] = {}
        for link in topo.links_of(name):
            peer_name = link.other(name)
            spec = parse_faults(faults) if faults is not None else (
                FaultSpec(loss=link.params.loss) if link.params.loss else None)
            if spec is not None and not spec.clean:
                peer = peer_name.encode()
                self._faults_in[peer] = FaultInjector(spec, seed, stream=f"{peer_name}>{name}")
                self._faults_out[peer] = FaultInjector(spec, seed, stream=f"{name}>{peer_name}")
        self._tokens: dict[bytes, tuple[Any, Any]] = {}  # fault tokens -> messages
        self._token_seq = itertools.count()
        # held frames: (due, seq, kind, item); kind 0 ingress ready, 1 egress ready,
        # 2 ingress past faults (to shape), 3 egress past faults (to shape)
        self._held: list[tuple[float, int, int, Any]] = []
        self._held_seq = itertools.count()
        self._ctrl_crc = False
        self._running = True
        self._started = time.monotonic()

    # ------------------------------------------------------------------ sending
    def _send(self, ident: bytes, header: Any, payload: Any = None) -> None:
        """Send to a node over its link: faults, then shaping, then the socket."""
        now = time.monotonic()
        inj = self._faults_out.get(ident)
        if inj is not None:
            for at, head, body in self._inject(inj, header, payload, now):
                self._hold(max(at, now), 3, (ident, head, body))
            return
        self._shape_out(ident, header, payload, now)

    def _shape_out(self, ident: bytes, header: Any, payload: Any, now: float) -> None:
        shaper = self._egress.get(ident)
        if shaper is not None:
            size = len(header) + (memoryview(payload).nbytes if payload is not None else 0)
            self._hold(shaper.schedule(_wire_bytes(header, size), now), 1,
                       (ident, header, payload))
            return
        self._send_now(ident, header, payload)

    def _send_now(self, ident: bytes, header: Any, payload: Any = None) -> None:
        up = self._dealers.get(ident)
        if up is not None:  # a neighbour switch we reach through our own DEALER
            nb = memoryview(payload).nbytes if payload is not None else 0
            parts = [header] if payload is None else [header, payload]
            up.send_multipart(parts, copy=nb < transport.ZERO_COPY_MIN)
            self.counters.frames_out += 1
            self.counters.bytes_out += len(header) + nb
            return
        try:
            if payload is None:
                self.sock.send_multipart([ident, header])
                nbytes = len(header)
            else:
                nb = memoryview(payload).nbytes
                self.sock.send_multipart(
                    [ident, header, payload], copy=nb < transport.ZERO_COPY_MIN
                )
                nbytes = len(header) + nb
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self.counters.unroutable += 1
                log.warning("drop: %s is not connected", ident.decode(errors="replace"))
                return
            raise
        self.counters.frames_out += 1
        self.counters.bytes_out += nbytes

    def _nack(self, ident: bytes, f_src: int, job: int, psn: int, msg: int, code: NackCode,
              why: str) -> None:
        self.counters.nacks_sent += 1
        self.counters.nack_codes[code.name] = self.counters.nack_codes.get(code.name, 0) + 1
        log.info("NACK %s to %s: %s", code.name, ident.decode(errors="replace"), why)
        self._send(ident, fr.encode_nack(src=self.node.id, dst=f_src, flow=0, psn=psn, code=code,
                                         job=job, msg=msg))

    def _ctrl(self, ident: bytes, dst: int, t: str, **fields: Any) -> None:
        # CRC whenever the fabric checks (the requester asked with one)
        self._send(ident, fr.encode(Op.CTRL, src=self.node.id, dst=dst, crc=self._ctrl_crc,
                                    payload=control.pack(t, **fields)))

    # ------------------------------------------------------------------ main loop
    def serve(self) -> None:
        """Run the event loop until shutdown."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for up in self._dealers.values():
            poller.register(up, zmq.POLLIN)
        if self.ctl is not None:
            poller.register(self.ctl, zmq.POLLIN)
        log.info("switch %s (id %d) serving at %s", self.name, self.node.id, self.address)
        parent = os.getppid()
        try:
            while self._running:
                if not self._ready_sent:
                    self._link_up()
                busy = self._held or self._faults_in
                wait_s = self._release_due() if busy else 1.0
                # whole milliseconds: a held frame leaves <= 1 ms late, but the link's
                # own timeline stays exact, so throughput is not lost
                # optionally spin before blocking (transport.SPIN_S, off by default)
                if transport.spin(self.sock, min(transport.SPIN_S, wait_s)):
                    events: dict[Any, int] = {self.sock: zmq.POLLIN}
                else:
                    events = dict(poller.poll(math.ceil(wait_s * 1000)))
                if self.sock in events:
                    # drain a batch before polling again: one wake-up, many frames
                    for _ in range(256):
                        try:
                            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frame(parts)
                if self._held or self._faults_in:
                    self._release_due()
                for peer, up in self._dealers.items():
                    if up in events:
                        for _ in range(256):
                            try:
                                parts = up.recv_multipart(zmq.NOBLOCK, copy=False)
                            except zmq.Again:
                                break
                            self._ingress_msg(peer, parts[0].buffer,
                                              parts[1] if len(parts) > 1 else None,
                                              time.monotonic())
                if self.ctl is not None and self.ctl in events:
                    msg = control.parse(self.ctl.recv())
                    if msg["t"] == "shutdown":
                        break
                    if msg["t"] == "stats":
                        self.ctl.send(control.pack("stats", **self.statistics()))
                if self.ctl is not None and os.getppid() != parent:
                    log.warning("launcher went away; shutting down")
                    break
        finally:
            self.close()

    def _link_up(self) -> None:
        """Switch-to-switch links first: say hello up every DEALER until welcomed,
        wait for every higher neighbour's hello, then report ready (a frame sent
        over a ROUTER before its peer is connected would be dropped)."""
        now = time.monotonic()
        if now - self._hello_at >= 0.1:
            self._hello_at = now
            for peer, up in self._dealers.items():
                if peer not in self._linked:
                    up.send(fr.encode(Op.CTRL, src=self.node.id, dst=self.topo.node(
                        peer.decode()).id, payload=control.pack("hello", name=self.name)))
        if self._linked >= set(self._dealers) and self._higher <= self._hellos:
            self._ready_sent = True
            if self.ctl is not None:
                self.ctl.send(control.pack("ready", name=self.name, pid=os.getpid(),
                                           address=self.address))

    def _stop(self) -> None:
        self._running = False

    def close(self) -> None:
        """Release sockets and mapped regions."""
        for region in self._mapped.values():
            region.close()
        self._mapped.clear()
        self.sock.close(0)
        for up in self._dealers.values():
            up.close(0)
        if self.ctl is not None:
            self.ctl.close(0)
        self.ctx.term()

    # ------------------------------------------------------------------ dispatch
    def _on_frame(self, parts: list[zmq.Frame]) -> None:
        ident = parts[0].bytes
        if len(parts) not in (2, 3):
            self.counters.malformed += 1
            log.warning("malformed message of %d parts from %r", len(parts), ident)
            return
        payload = parts[2] if len(parts) == 3 else None
        self._ingress_msg(ident, parts[1].buffer, payload, time.monotonic())

    def _ingress_msg(self, ident: bytes, header: Any, payload: Any, now: float) -> None:
        """The node->switch link: faults, then serialisation and latency."""
        inj = self._faults_in.get(ident)
        if inj is not None:
            for at, head, body in self._inject(inj, header, payload, now):
                self._hold(max(at, now), 2, (ident, head, body))
            return
        shaper = self._ingress.get(ident)
        if shaper is not None:
            size = len(header) + (len(payload) if payload is not None else 0)
            due = shaper.schedule(_wire_bytes(header, size), now)
            self._hold(due, 0, (ident, header, payload))
            return
        self._process(ident, header, payload)

    def _inject(self, inj: FaultInjector, header: Any, payload: Any,
                now: float) -> list[tuple[float, Any, Any]]:
        """Pass one message through a link's fault injector; what arrives, and when.

        Without corruption the injector only needs to decide, not to see bytes:
        it gets an 8-byte token that stands for the message, so a 4 MiB payload
        is not copied per link (the copy would slow the faulty run and skew its
        comparison with a clean one)."""
        lost_before = inj.statistics().lost
        if inj.spec.corrupt:
            out = self._resolve(inj.apply(_join(header, payload), now))
        else:
            token = next(self._token_seq).to_bytes(8, "little")
            self._tokens[token] = (header, payload)
            out = self._resolve(inj.apply(token, now))
        if inj.statistics().lost != lost_before:
            self._count_lost(header)
            if not inj.spec.corrupt:
                self._tokens.pop(token, None)
        return out

    def _resolve(self, arrivals: list[tuple[float, bytes]]) -> list[tuple[float, Any, Any]]:
        """Injector arrivals back into messages (tokens or corrupted copies).

        All copies of one frame come out of the injector in the same call, so a
        token is forgotten once that call's arrivals are resolved."""
        out, done = [], set()
        for at, blob in arrivals:
            if len(blob) == 8 and blob in self._tokens:
                head, body = self._tokens[blob]
                done.add(blob)
            else:
                head, body = _split(blob, fr.HEADER_SIZE + _crc_len(blob))
            out.append((at, head, body))
        for token in done:
            del self._tokens[token]
        return out

    def _count_lost(self, header: Any) -> None:
        """Frames the injectors dropped, by opcode (ground truth for `semfab bench loss`)."""
        try:
            name = fr.peek(header)[0].name
        except FrameError:
            name = "MALFORMED"
        lost = self.counters.fault_lost
        lost[name] = lost.get(name, 0) + 1

    def _hold(self, due: float, kind: int, item: Any) -> None:
        heapq.heappush(self._held, (due, next(self._held_seq), kind, item))

    def _release_due(self) -> float:
        """Act on every held frame whose time has come; seconds until the next one."""
        now = time.monotonic()
        for kind, injectors in ((2, self._faults_in), (3, self._faults_out)):
            for ident, inj in injectors.items():
                # reordered frames whose hold ran out
                for at, head, body in self._resolve(inj.poll(now)):
                    self._hold(at, kind, (ident, head, body))
        while self._held:
            due, _, kind, item = self._held[0]
            now = time.monotonic()
            if due > now:
                return min(due - now, self._fault_wait(now))
            heapq.heappop(self._held)
            if kind == 0:
                self._process(*item)
            elif kind == 1:
                self._send_now(*item)
            elif kind == 2:  # past the faults: now the link's shaping
                ident, head, body = item
                shaper = self._ingress.get(ident)
                if shaper is not None:
                    size = len(head) + (len(body) if body is not None else 0)
                    self._hold(shaper.schedule(_wire_bytes(head, size), now), 0, item)
                else:
                    self._process(*item)
            else:
                ident, head, body = item
                self._shape_out(ident, head, body, now)
        return self._fault_wait(time.monotonic())

    def _fault_wait(self, now: float) -> float:
        deadlines = [d for inj in (*self._faults_in.values(), *self._faults_out.values())
                     if (d := inj.next_deadline()) is not None]
        return max(min(deadlines) - now, 0.0) if deadlines else 1.0

    def _process(self, ident: bytes, header: Any, payload: Any) -> None:
        c = self.counters
        c.frames_in += 1
        body = payload.buffer if isinstance(payload, zmq.Frame) else payload
        c.bytes_in += len(header) + (len(body) if body is not None else 0)
        try:
            # two parts: header + payload; one part: a contiguous frame
            f = fr.decode(header, body)
        except FrameError as exc:
            c.malformed += 1
            try:
                _op, _fl, src, job, psn, _k, _o, _l = fr.peek(header)
            except FrameError:
                src, job, psn = 0, 0, 0
            self._nack(ident, src, job, psn, 0, exc.code, str(exc))
            return
        if f.dst != self.node.id or f.flags & Flag.MCAST:
            self._forward(f, ident, header, payload)
        elif f.op is Op.REDUCE:
            c.reduce_frames += 1
            self._on_reduce(f, ident)
        elif f.op is Op.RESULT:
            self._on_parent_result(f)
        elif f.op is Op.CTRL:
            c.ctrl_frames += 1
            self._ctrl_crc = self._ctrl_crc or bool(f.flags & Flag.CRC)
            try:
                self._on_ctrl(f, ident, control.parse(f.payload))
            except FrameError as exc:
                c.malformed += 1
                self._nack(ident, f.src, f.job, f.psn, f.msg, exc.code, str(exc))
        elif f.op in (Op.NACK, Op.ACK):
            # never answer a NACK with a NACK (two switches would ping-pong);
            # a tree switch recovers through its members' retransmissions
            c.nacks_received += 1
        else:
            self._nack(ident, f.src, f.job, f.psn, f.msg, NackCode.UNSUPPORTED,
                       f"switch does not serve {f.op.name}")

    def _forward(self, f: fr.Frame, ident: bytes, header: Any, payload: Any) -> None:
        dst_ident = self._next_hop.get(f.dst)
        if dst_ident is None:
            self.counters.unroutable += 1
            self._nack(ident, f.src, f.job, f.psn, f.msg, NackCode.PERMISSION,
                       f"no node with id {f.dst}")
            return
        self.counters.forwarded += 1
        # header and payload buffers pass through unchanged (payload zero-copy)
        self._send(dst_ident, bytes(header), payload)

    # ------------------------------------------------------------------ aggregation
    def _on_reduce(self, f: fr.Frame, ident: bytes) -> None:
        spec = self._jobs.get(f.job)
        if spec is None:
            self._nack(ident, f.src, f.job, f.psn, f.msg, NackCode.UNKNOWN_JOB,
                       f"job {f.job} is not registered")
            return
        chunk = unwrap_psn(f.psn, self._job_last.get(f.job, 0))
        pending: dict[int, tuple[int, int]] | None = None
        had_ref = False
        if spec.referenced:
            if not f.referenced:
                self._nack(ident, f.src, f.job, f.psn, f.msg, NackCode.MALFORMED,
                           "memory-plane job needs REF frames")
                return
            try:
                self.regions.check(f.key, f.offset, f.length, f.src)
            except AccessError as exc:
                self._nack(ident, f.src, f.job, f.psn, f.msg, exc.code, str(exc))
                return
            pending = self._refs.setdefault((f.job, chunk), {})
            had_ref = f.src in pending
            pending[f.src] = (f.key, f.offset)
            data = None
        else:
            if f.referenced:
                self._nack(ident, f.src, f.job, f.psn, f.msg, NackCode.MALFORMED,
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
                    self._send_up(spec, ev.chunk, ev.result, f, retx=False)
                else:
                    self._send_results(spec, ev.chunk, ev.recipients, ev.result, f)
            elif isinstance(ev, ResendResult):
                if (f.job, ev.chunk) in self._awaiting:
                    # we only hold our partial: ask the parent again instead
                    self._send_up(spec, ev.chunk, ev.result, f, retx=True)
                else:
                    self._send_results(spec, ev.chunk, (ev.member,), ev.result, f)
            elif isinstance(ev, Rejected):
                self._nack(ident, f.src, f.job, f.psn, f.msg, NackCode[ev.code], ev.reason)
            elif isinstance(ev, (DuplicateIgnored, Stale)):
                pass  # counted by the engine; nothing to send
        counted = completed or not events
        if pending is not None and not counted and not had_ref:
            # refused, stale or answered from the kept result: forget the address
            pending.pop(f.src, None)
            if not pending:
                self._refs.pop((f.job, chunk), None)
        if data is not None and counted:
            self.counters.payload_copies += 1

    def _reduce_regions(self, spec: JobSpec, chunk: int, count: int) -> None:
        """Memory plane: ld_reduce from every member's region, st into every one."""
        refs = self._refs.pop((spec.job, chunk))
        dt = DTYPES[spec.dtype]
        arrays = []
        for member in spec.members:
            key, offset = refs[member]
            region = self._mapped[key]
            arrays.append(region.array(dt, count, offset))
        t0 = time.perf_counter()
        self._kernel.multicast_reduce(arrays, arrays, spec.op.value)
        self.counters.reduce_seconds += time.perf_counter() - t0
        self.counters.mem_stores += len(arrays)
        self.counters.payload_copies += len(arrays)

    def _send_results(self, spec: JobSpec, chunk: int, recipients: tuple[int, ...],
                      result: np.ndarray | None, f: fr.Frame) -> None:
        dtype = f.dtype
        crc = bool(f.flags & Flag.CRC)  # answer in kind: a sender that checks gets checked
        for member in recipients:
            ident = self._ident[member]
            if result is None:
                header = fr.encode_header(Op.RESULT, src=self.node.id, dst=member, job=spec.job,
                                          psn=chunk & PSN_MASK, dtype=dtype, msg=f.msg,
                                          flags=Flag.REF, length=f.length, crc=crc)
                self._send(ident, header)
            else:
                header = fr.encode_header(Op.RESULT, src=self.node.id, dst=member, job=spec.job,
                                          psn=chunk & PSN_MASK, dtype=dtype, msg=f.msg,
                                          payload=result, crc=crc)
                self._send(ident, header, result)
            self.counters.results_sent += 1

    # ------------------------------------------------------------------ control
    def _on_ctrl(self, f: fr.Frame, ident: bytes, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == "hello":
            self._ident[f.src] = ident
            self._hellos.add(ident)
            self._ctrl(ident, f.src, "welcome", switch=self.name, id=self.node.id)
        elif t == "welcome":  # a lower neighbour answered our uplink hello
            self._linked.add(ident)
        elif t == "job_reply":  # our parent, about a tree job
            self._on_job_reply(msg)
        elif t == "job":
            self._register_job(f, ident, msg)
        elif t == "release":
            job = control.need(msg, "job", int)
            self.engine.release(job)
            self._jobs.pop(job, None)
        elif t == "region":
            self._register_region(f, ident, msg)
        elif t == "unregister":
            key = control.need(msg, "key", int)
            if key in self.regions and self.regions.get(key).owner == f.src:
                self.regions.remove(key)
                mapped = self._mapped.pop(key, None)
                if mapped is not None:
                    mapped.close()
            # idempotent: an unknown key is already gone
            self._ctrl(ident, f.src, "region_reply", key=key, ok=True, reason="")
        elif t == "barrier":
            # idempotent: a resent arrival counts once; a finished barrier answers again
            bid = control.need(msg, "id", int)
            n = control.need(msg, "n", int)
            if bid in self._barriers_done:
                self._ctrl(ident, f.src, "barrier_done", id=bid)
                return
            waiting = self._barriers.setdefault(bid, {})
            waiting[f.src] = ident  # by node: several may arrive over one switch link
            if len(waiting) >= n:
                for src, who in self._barriers.pop(bid).items():
                    self._ctrl(who, src, "barrier_done", id=bid)
                self._barriers_done.append(bid)
        elif t == "stats":
            self._ctrl(ident, f.src, "stats", **self.statistics())
        else:
            raise FrameError(NackCode.MALFORMED, f"unknown control message type {t!r}")

    def _register_job(self, f: fr.Frame, ident: bytes, msg: dict[str, Any]) -> None:
        try:
            spec = JobSpec(
                job=control.need(msg, "job", int),
                members=tuple(control.need(msg, "members", list)),
                dtype=control.need(msg, "dtype", str),
                op=AggOp(control.need(msg, "op", str)),
                slots=control.need(msg, "slots", int),
                slot_elems=control.need(msg, "slot_elems", int),
                referenced=bool(msg.get("referenced", False)),
            )
        except ValueError as exc:
            raise FrameError(NackCode.MALFORMED, f"bad job spec: {exc}") from None
        # Tree aggregation: this switch sums its attached members and the partial
        # sums of its child switches; with members outside its subtree it sends
        # its own partial up to its parent and passes the parent's result down.
        below = {self.topo.node(w).id for w in self.topo.subtree_workers(self.name)} \
            if self.name in self.topo.aggregation_tree() else set()
        local = [m for m in spec.members if self.topo.by_id(m).name in self._attached]
        children = [self.topo.node(c).id for c in self.topo.tree_children(self.name)
                    if any(self.topo.node(w).id in spec.members
                           for w in self.topo.subtree_workers(c))]
        outside = [m for m in spec.members if m not in below]
        parent = self.topo.aggregation_tree().get(self.name) if outside else None
        if (spec.referenced and (children or outside)) or (outside and parent is None):
            self.counters.jobs_refused += 1
            why = ("the memory plane aggregates on one switch" if spec.referenced
                   else f"members {outside} are not below {self.name}")
            self._ctrl(ident, f.src, "job_reply", job=spec.job, granted=False,
                       reason=f"{why}; run it on a single-switch fabric")
            return
        if spec.referenced and self._kernel is None:
            from kernels.backends import get_backend

            self._kernel = get_backend(msg.get("backend", "numba-cpu"))
        mine = JobSpec(spec.job, tuple(local + children), spec.dtype, spec.op, spec.slots,
                       spec.slot_elems, spec.referenced)
        reply = self.engine.register(mine)
        if not isinstance(reply, Granted):
            self.counters.jobs_refused += 1
            log.warning("job %d refused: %s", spec.job, reply.reason)
            self._ctrl(ident, f.src, "job_reply", job=spec.job, granted=False,
                       reason=reply.reason)
            return
        self._jobs[spec.job] = mine
        self._job_last.setdefault(spec.job, 0)
        if parent is None:
            self._ctrl(ident, f.src, "job_reply", job=spec.job, granted=True, reason="")
            return
        # answer once the parent granted its part of the tree
        parent_id = self.topo.node(parent).id
        self._job_parent[spec.job] = parent_id
        if self._up_granted.get(spec.job):
            self._ctrl(ident, f.src, "job_reply", job=spec.job, granted=True, reason="")
            return
        waiting = self._up_pending.setdefault(spec.job, {})
        if not waiting:
            fields = {k: v for k, v in msg.items() if k != "t"}
            self._ctrl(self._next_hop[parent_id], parent_id, "job", **fields)
        waiting[f.src] = ident

    def _on_job_reply(self, msg: dict[str, Any]) -> None:
        """The parent answered our part of a tree job: answer whoever waited."""
        job = control.need(msg, "job", int)
        granted = bool(msg.get("granted"))
        reason = str(msg.get("reason", ""))
        if granted:
            self._up_granted[job] = True
        else:
            self.engine.release(job)
            self._jobs.pop(job, None)
            self._job_parent.pop(job, None)
            reason = f"parent switch refused: {reason}"
        for src, who in self._up_pending.pop(job, {}).items():
            self._ctrl(who, src, "job_reply", job=job, granted=granted, reason=reason)

    def _on_parent_result(self, f: fr.Frame) -> None:
        """The final result of a chunk we sent up as a partial: keep it, pass it down."""
        spec = self._jobs.get(f.job)
        if spec is None or self._job_parent.get(f.job) is None:
            self.counters.malformed += 1
            return
        chunk = unwrap_psn(f.psn, self._job_last.get(f.job, 0))
        if (f.job, chunk) not in self._awaiting:
            return  # a late copy: the chunk's result was already passed down
        data = np.frombuffer(f.payload, dtype=DTYPES[spec.dtype])
        if not self.engine.install_result(f.job, chunk, data):
            self.counters.malformed += 1
            return
        self._awaiting.discard((f.job, chunk))
        self._send_results(spec, chunk, spec.members, data, f)

    def _send_up(self, spec: JobSpec, chunk: int, partial: np.ndarray | None,
                 f: fr.Frame, retx: bool) -> None:
        """Our subtree's partial sum of ``chunk``, as our contribution to the parent."""
        parent = self._job_parent[spec.job]
        assert partial is not None
        header = fr.encode_header(Op.REDUCE, src=self.node.id, dst=parent, job=spec.job,
                                  psn=chunk & PSN_MASK, dtype=f.dtype, msg=f.msg,
                                  payload=partial, flags=Flag.RETX if retx else Flag.NONE,
                                  crc=bool(f.flags & Flag.CRC))
        self._send(self._next_hop[parent], header, partial)

    def _register_region(self, f: fr.Frame, ident: bytes, msg: dict[str, Any]) -> None:
        key = control.need(msg, "key", int)
        size = control.need(msg, "size", int)
        path = control.need(msg, "path", str)
        try:
            self.regions.add(RegionInfo(key=key, owner=f.src, size=size, path=path))
            old = self._mapped.pop(key, None)
            if old is not None:
                old.close()
            self._mapped[key] = SharedRegion.attach(path, size)
        except (AccessError, OSError, ValueError) as exc:
            self.regions.remove(key)
            self._ctrl(ident, f.src, "region_reply", key=key, ok=False, reason=str(exc))
            return
        self._ctrl(ident, f.src, "region_reply", key=key, ok=True, reason="")

    def statistics(self) -> dict[str, Any]:
        """Counters and engine statistics as plain data."""
        stats = asdict(self.counters)
        stats["engine"] = asdict(self.engine.statistics())
        stats["switch"] = self.name
        stats["regions"] = len(self.regions)
        stats["held_frames"] = len(self._held)  # in link emulation (shaping, faults)
        stats["faults"] = {
            direction: _sum_fault_stats(injectors)
            for direction, injectors in (("in", self._faults_in), ("out", self._faults_out))
        }
        stats["uptime_s"] = time.monotonic() - self._started
        return stats
