"""The switch daemon: the ZeroMQ driver of :class:`switchd.core.SwitchCore`.

One process per switch. A ROUTER socket is bound at the switch's address;
every node attached to it connects a DEALER whose identity is its node name,
and a switch-to-switch link is one socket pair (the higher-id switch connects
a DEALER named after itself to the lower-id switch's ROUTER). This module only
moves bytes and keeps time: every decision (forwarding, aggregation, barriers,
regions, control, NACKs) is the core's.

Link emulation: each link direction has one :class:`fabric.core.link.LinkPipeline`
(faults, shaping, hold queue). The switch drives the node->switch direction of
its node links (nodes send straight into their socket) and the switch->peer
direction of every link, so a switch-to-switch link is emulated once per
direction, by its sender.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq

from fabric.core import control
from fabric.core.congestion.credit import link_grant
from fabric.core.congestion.switchq import switch_queues
from fabric.core.faults import FaultSpec, FaultStats, parse_faults
from fabric.core.link import CreditBack, LinkPipeline, wire_bytes
from fabric.core.semantic import class_traffic
from fabric.core.topology import Topology
from fabric.emulation import doorbell as db
from fabric.emulation import transport
from fabric.emulation.frametrace import FrameLog
from switchd.core import SwitchCore, SwitchStats
from switchd.memplane import SharedMemoryPlane
from switchd.plugins import load_services

__all__ = ["SwitchDaemon"]

log = logging.getLogger("semfab.switchd")

#: Frames drained from one socket per wake-up before polling again.
BATCH = 256
#: A PFC PAUSE from one switch daemon to a neighbour's: this part, then the pause's
#: length in seconds (``<d``). Not a frame (no frame header is this long), so it is
#: told apart by its length first; the link layer's, never the protocol core's.
PAUSE_MAGIC = b"semfab-pfc-pause/1"
_PAUSE_FOR = struct.Struct("<d")
#: A credit return from one switch daemon to a neighbour's, on a credit-controlled
#: link: this part (as long as PAUSE_MAGIC), then how many seconds from now the
#: frames it stands for have left this switch, and their bytes (``<dq``).
CREDIT_MAGIC = b"semfab-link-credit"
_CREDIT_FOR = struct.Struct("<dq")
assert len(CREDIT_MAGIC) == len(PAUSE_MAGIC)


def _sum_faults(pipes: dict[bytes, LinkPipeline]) -> dict[str, int]:
    total: dict[str, int] = {}
    for pipe in pipes.values():
        st = pipe.statistics().faults
        if st is not None:
            for k, v in asdict(st).items():
                total[k] = total.get(k, 0) + v
    return total or {k: 0 for k in FaultStats.__dataclass_fields__}


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
        ctl_silence_s: float | None = None,
        services: Sequence[str] = (),
        run_id: str | None = None,
    ) -> None:
        self.topo = topo
        # the launcher, read as early as we can: one that dies before we serve (and
        # before our ready) must not be missed, or the daemon would outlive it
        self._parent = os.getppid()
        # a placed run's coordinator pings; silence this long ends the daemon
        self.ctl_silence_s = ctl_silence_s
        self.exit_code = 0  # 1: ended by an abort or a lost coordinator
        self.frame_log = FrameLog.from_env(name, "switch", len(topo.workers))  # SEMFAB_FRAME_TRACE
        self.name = name
        self.node = topo.node(name)
        self.address = topo.endpoint_address(name, sock_dir)
        self.memory = SharedMemoryPlane(run_id=run_id)  # maps this run's regions only
        # links that may corrupt: every data frame the switch originates is checked
        corrupting = faults is not None and parse_faults(faults).corrupt > 0
        # memory-plane descriptors of the workers on this host, by port (fabric.emulation.doorbell)
        self._bells: dict[bytes, db.Doorbell] = {}
        self._bells_changed = False
        self._retired: list[db.Doorbell] = []
        self.bell_frames_in = 0
        self.bell_frames_out = 0
        self.core = SwitchCore(topo, name, memory_budget=memory_budget, memory=self.memory,
                               extra_stats=self._driver_stats,
                               attach_doorbell=self._attach_bell if db.enabled() else None,
                               services=load_services(services),
                               rng=random.SystemRandom(),  # incarnation ids: unguessable
                               crc=corrupting)
        self.ctx = transport.context(io_threads)
        self.sock = transport.router(self.ctx, topo.bind_address(name, sock_dir))
        self.ctl = transport.dealer(self.ctx, ctl_addr, name) if ctl_addr else None
        self._dealers: dict[bytes, zmq.Socket] = {}
        for link in topo.links_of(name):
            other = topo.node(link.other(name))
            if other.is_switch and other.id < self.node.id:
                self._dealers[other.name.encode()] = transport.dealer(
                    self.ctx, topo.endpoint_address(other.name, sock_dir), name)
        # one pipeline per link direction we drive (inactive links get none)
        self._ingress: dict[bytes, LinkPipeline] = {}
        self._credit_from: set[bytes] = set()  # neighbour switches whose links need credit
        self._ids = {n.name.encode(): n.id for n in topo.nodes}  # port -> node id
        self._ports = {n.id: n.name.encode() for n in topo.nodes}
        self._switch_ports = {n.name.encode() for n in topo.switches}
        self._egress: dict[bytes, LinkPipeline] = {}
        # this switch's buffers and ECN markers ([congestion]), shared by its egress
        # ports (by network class where a class has its own table)
        mine = {cls: q for (sw, cls), q in switch_queues(topo, seed).items() if sw == name}
        # (a frame from any port may be held in a lossless buffer: it may be paused)
        any_lossless = any(q.lossless for q in mine.values())
        for link in topo.links_of(name):
            queues = mine.get(link.cls)
            peer_name = link.other(name)
            peer = peer_name.encode()
            spec = parse_faults(faults) if faults is not None else (
                FaultSpec(loss=link.params.loss) if link.params.loss else None)
            to_switch = topo.node(peer_name).is_switch
            grant = link_grant(link.params, topo.link_congestion(link).credit)
            out = LinkPipeline(link.params, spec, seed=seed, stream=f"{name}>{peer_name}",
                               queues=queues, port=topo.node(peer_name).id,
                               pausable=any_lossless and to_switch, credit_bytes=grant,
                               frees_on_arrival=not to_switch)
            if out.active:
                self._egress[peer] = out
            if not to_switch:
                inp = LinkPipeline(link.params, spec, seed=seed, stream=f"{peer_name}>{name}",
                                   pausable=any_lossless, credit_bytes=grant)
                if inp.active:
                    self._ingress[peer] = inp
            elif grant:  # the neighbour's link into us: its credit goes back by message
                self._credit_from.add(peer)
        self._pipes = [*self._ingress.items(), *self._egress.items()]
        self._port_class = {link.other(name).encode(): link.cls for link in topo.links_of(name)}
        # SEMFAB_QUEUE_TRACE=1: record each bounded egress queue's depth (monotonic
        # seconds), reported in statistics() as "queue_depth"
        if os.environ.get("SEMFAB_QUEUE_TRACE", "") not in ("", "0"):
            for pipe in self._egress.values():
                if pipe.queues is not None:
                    pipe.depth = []
        self.frames_out = 0
        self.bytes_out = 0
        self.pauses_sent_to_switches = 0
        self.pauses_refused = 0
        self.credits_sent_to_switches = 0
        self.credits_refused = 0
        self.unroutable = 0
        self._ready_sent = False
        self._running = True
        self._started = time.monotonic()

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
        parent = self._parent
        core = self.core
        polled: set[int] = set()  # doorbell pipes registered with the poller
        boss = control.Supervision(self.ctl_silence_s, time.monotonic())
        try:
            while self._running:
                now = time.monotonic()
                if core.get_timer() is not None:
                    self._emit(core.handle_timer(now), now)
                if not self._ready_sent and core.ready:
                    self._ready_sent = True
                    if self.ctl is not None:
                        self.ctl.send(control.pack("ready", name=self.name, pid=os.getpid(),
                                                   address=self.address))
                wait_s = self._release_due() if self._pipes else 1.0
                timer = core.get_timer()
                if timer is not None:
                    wait_s = min(wait_s, max(timer - time.monotonic(), 0.0))
                if self._bells_changed:
                    self._bells_changed = False
                    for old in self._retired:
                        if old.fileno() in polled:
                            poller.unregister(old.fileno())
                            polled.discard(old.fileno())
                        old.close()
                    self._retired.clear()
                    for bell in self._bells.values():
                        poller.register(bell.fileno(), zmq.POLLIN)
                        polled.add(bell.fileno())
                events = self._wait(poller, wait_s)
                if self._bells:
                    self._drain_bells()
                if self.sock in events:
                    self._drain_router()
                for peer, up in self._dealers.items():
                    if up in events:
                        self._drain_dealer(peer, up)
                if self._pipes:
                    self._release_due()
                if self.ctl is not None and self.ctl in events:
                    msg = control.parse(self.ctl.recv())
                    boss.heard(time.monotonic())
                    if msg["t"] == "shutdown":
                        if msg.get("error"):
                            log.error("switch %s: the run was aborted: %s", self.name,
                                      msg["error"])
                            self.exit_code = 1
                        break
                    if msg["t"] == "stats":
                        self.ctl.send(control.pack("stats", **self.statistics()))
                    elif msg["t"] == "ping":
                        self.ctl.send(control.pack("pong", name=self.name))
                if self.ctl is not None and os.getppid() != parent:
                    log.warning("launcher went away; shutting down")
                    self.exit_code = 1
                    break
                if boss.lost(time.monotonic()):
                    log.error("switch %s: nothing from the coordinator for %gs (its host or "
                              "the link to it is gone); shutting down", self.name,
                              self.ctl_silence_s)
                    self.exit_code = 1
                    break
        finally:
            self.close()

    def _wait(self, poller: zmq.Poller, wait_s: float) -> dict[Any, int]:
        """Until a frame is on a socket or a doorbell ring, or ``wait_s`` passed."""
        sock, bells = self.sock, self._bells
        if bells:
            bell_list = list(bells.values())

            def ready() -> bool:
                return (any(b.pending() for b in bell_list)
                        or transport.has_frame(sock))

            # spin on the rings, then block on the sockets and the doorbells' pipes
            if db.spin_until(ready, min(db.SPIN_S, wait_s)):
                return dict(poller.poll(0))
            if db.sleep_all(bell_list):
                db.wake_all(bell_list)
                return dict(poller.poll(0))
            events = dict(poller.poll(math.ceil(wait_s * 1000)))
            db.wake_all(bell_list)
            return events
        elif transport.spin(sock, min(transport.SPIN_S, wait_s)):
            return {sock: zmq.POLLIN}
        if wait_s < transport.SHORT_WAIT_S:  # a departure within the millisecond
            socks = [sock, *self._dealers.values()]
            if transport.nap_until(lambda: any(transport.has_frame(s) for s in socks), wait_s):
                return dict(poller.poll(0))
            return {}
        # whole milliseconds: a held frame leaves <= 1 ms late, but the link's
        # own timeline stays exact, so throughput is not lost
        return dict(poller.poll(math.ceil(wait_s * 1000)))

    def _attach_bell(self, port: bytes, path: str) -> None:
        """The core accepted a worker's doorbell: map it (OSError / ValueError if not)."""
        old = self._bells.get(port)
        if old is not None and str(old.path) == path:
            return  # a retried request: already attached
        bell = db.Doorbell.attach(path)
        self._bells.pop(port, None)
        if old is not None:  # a node that opened a new one: closed once the poller forgets it
            self._retired.append(old)
        self._bells[port] = bell
        self._bells_changed = True
        log.info("switch %s: doorbell of %s attached (%s)", self.name, port.decode(), path)

    def _drain_bells(self) -> None:
        """Hand the frames posted in every doorbell ring to the core, as if each had
        come in on that worker's port (its link's faults and shaping included)."""
        for port, bell in list(self._bells.items()):
            for _ in range(BATCH):
                raw = bell.recv()
                if raw is None:
                    break
                self.bell_frames_in += 1
                self._arrived(port, raw, None)

    def _drain_router(self) -> None:
        """Handle a batch of frames from the ROUTER: one wake-up, many frames."""
        sock = self.sock
        for _ in range(BATCH):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) not in (2, 3):
                log.warning("dropped a message of %d parts", len(parts))
                continue
            self._arrived(parts[0].bytes, parts[1].buffer,
                          parts[2].buffer if len(parts) == 3 else None)

    def _arrived(self, port: bytes, header: Any, payload: Any) -> None:
        """A frame from a node's port (socket or doorbell): through its link's
        ingress pipeline when it has one, else straight to the core."""
        if len(header) == len(PAUSE_MAGIC) and self._link_control(port, header, payload):
            return
        if self.frame_log is not None:
            self.frame_log.add("rx", header, port.decode(errors="replace"))
        now = time.monotonic()
        pipe = self._ingress.get(port)
        if pipe is not None:
            pipe.push((header, payload), now)
            self._deliver(port, pipe, now)
        else:
            back = (port, wire_bytes(header, payload)) if port in self._credit_from else None
            self._emit(self.core.handle(port, header, payload, now), now, None,
                       self._ids.get(port, -1), back)

    def _drain_dealer(self, peer: bytes, up: zmq.Socket) -> None:
        for _ in range(BATCH):
            try:
                parts = up.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            header = parts[0].buffer
            payload = parts[1].buffer if len(parts) > 1 else None
            if len(header) == len(PAUSE_MAGIC) and self._link_control(peer, header, payload):
                continue
            if self.frame_log is not None:
                self.frame_log.add("rx", header, peer.decode(errors="replace"))
            now = time.monotonic()
            back = (peer, wire_bytes(header, payload)) if peer in self._credit_from else None
            self._emit(self.core.handle(peer, header, payload, now), now, None,
                       self._ids.get(peer, -1), back)

    def _deliver(self, port: bytes, pipe: LinkPipeline, now: float) -> None:
        """Hand what arrived over a node->switch link to the core."""
        credit = pipe.credit is not None
        for header, payload in pipe.pop_due(now):
            # over a credit-controlled link, the frame's credit goes back once we are
            # done with it
            back = (pipe, wire_bytes(header, payload)) if credit else None
            self._emit(self.core.handle(port, header, payload, now), now, pipe,
                       self._ids.get(port, -1), back)

    def _emit(self, outputs: list[tuple[bytes, Any, Any]], now: float,
              came_on: LinkPipeline | None = None, came_from: int = -1,
              back: CreditBack | None = None) -> None:
        egress = self._egress
        for port, header, payload in outputs:
            pipe = egress.get(port)
            if pipe is None:
                self._send_now(port, header, payload)
            else:
                pipe.push((header, payload), now, None, came_from, back)
                # a frame's copies and results count once for the port it came on
                came_from = -1
                if back is not None:
                    self._credit_returns(pipe, now)
                req = pipe.take_pause()
                if req is not None:
                    # a lossless port above XOFF: PFC pauses the link the frame came on,
                    # a node's here, a neighbour switch's by a PAUSE to its daemon
                    if came_on is not None:
                        came_on.pause(now, req[1])
                    else:
                        self._send_pause(self._ports.get(req[0], b""), req[1] - now)
                for h, p in pipe.pop_due(now):
                    self._send_now(port, h, p)
            if back is not None:  # its credit goes with the first frame it caused
                if pipe is None:  # sent on an unshaped link: freed now
                    self._credit_freed(back[0], back[1], now, now)
                back = None
        if back is not None:  # consumed here: freed now
            self._credit_freed(back[0], back[1], now, now)

    def _credit_returns(self, pipe: LinkPipeline, now: float) -> None:
        """Hand the credit of frames ``pipe`` has sent on to the links they came on."""
        for token, nbytes, at in pipe.take_credit_returns():
            self._credit_freed(token, nbytes, at, now)

    def _credit_freed(self, token: Any, nbytes: int, at: float, now: float) -> None:
        if isinstance(token, LinkPipeline):  # a node's link, which we drive
            token.credit_freed(at, nbytes)
        elif token in self._switch_ports:  # a neighbour's: its daemon drives it
            self.credits_sent_to_switches += 1
            self._send_now(token, CREDIT_MAGIC, _CREDIT_FOR.pack(max(at - now, 0.0), nbytes))

    def _release_due(self) -> float:
        """Move every frame whose time has come; seconds until the next one."""
        now = time.monotonic()
        for port, pipe in self._ingress.items():
            self._deliver(port, pipe, now)
        for port, pipe in self._egress.items():
            for h, p in pipe.pop_due(now):
                self._send_now(port, h, p)
            if pipe.credit is not None:  # frames that waited for credit, now sent
                self._credit_returns(pipe, now)
        due = [t for _, pipe in self._pipes if (t := pipe.get_timer()) is not None]
        return max(min(due) - time.monotonic(), 0.0) if due else 1.0

    def _send_pause(self, port: bytes, seconds: float) -> None:
        """PFC: ask the neighbour switch on ``port`` to send us nothing for ``seconds``."""
        if port in self._switch_ports and seconds > 0:
            self.pauses_sent_to_switches += 1
            self._send_now(port, PAUSE_MAGIC, _PAUSE_FOR.pack(seconds))

    def _link_control(self, port: bytes, header: Any, payload: Any) -> bool:
        """Whether this message is a neighbour switch's PFC PAUSE or credit return
        (then applied to our link to it). From a node's port it is neither: the
        core refuses it as any malformed frame is (counted, NACKed)."""
        if port not in self._switch_ports:
            return False
        kind = bytes(header)
        if kind == CREDIT_MAGIC:
            self._credited_by(port, payload)
            return True
        if kind != PAUSE_MAGIC:
            return False
        pipe = self._egress.get(port)
        seconds = math.nan
        if payload is not None and memoryview(payload).nbytes == _PAUSE_FOR.size:
            (seconds,) = _PAUSE_FOR.unpack(bytes(payload))
        if not (math.isfinite(seconds) and 0 < seconds < 60):
            self.pauses_refused += 1  # not a length we would send: ignored, counted
        elif pipe is not None:  # (an unshaped link holds nothing back: nothing to pause)
            now = time.monotonic()
            pipe.pause(now, now + seconds)
        return True

    def _credited_by(self, port: bytes, payload: Any) -> None:
        """A neighbour switch freed frames our link sent it: the credit is ours again
        (a malformed return is counted and ignored)."""
        pipe = self._egress.get(port)
        seconds, nbytes = math.nan, 0
        if payload is not None and memoryview(payload).nbytes == _CREDIT_FOR.size:
            seconds, nbytes = _CREDIT_FOR.unpack(bytes(payload))
        if not (math.isfinite(seconds) and 0 <= seconds < 60 and 0 < nbytes < 2**40):
            self.credits_refused += 1
        elif pipe is not None and pipe.credit is not None:
            pipe.credit_freed(time.monotonic() + seconds, nbytes)

    def _send_now(self, port: bytes, header: Any, payload: Any = None) -> None:
        if self.frame_log is not None:
            self.frame_log.add("tx", header, port.decode(errors="replace"))
        nb = memoryview(payload).nbytes if payload is not None else 0
        if payload is None and self._bells:
            bell = self._bells.get(port)
            if bell is not None and db.carries(header) and bell.send(header):
                self.bell_frames_out += 1
                self.frames_out += 1
                self.bytes_out += len(header)
                return
        up = self._dealers.get(port)
        try:
            if up is not None:  # a neighbour switch we reach through our own DEALER
                up.send_multipart([header] if payload is None else [header, payload],
                                  copy=nb < transport.ZERO_COPY_MIN)
            elif payload is None:
                self.sock.send_multipart([port, header])
            else:
                self.sock.send_multipart([port, header, payload],
                                         copy=nb < transport.ZERO_COPY_MIN)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self.unroutable += 1
                log.warning("drop: %s is not connected", port.decode(errors="replace"))
                return
            raise
        self.frames_out += 1
        self.bytes_out += len(header) + nb

    def _stop(self) -> None:
        self._running = False

    def close(self) -> None:
        """Release sockets and mapped regions (and write the frame log, if kept)."""
        if self.frame_log is not None:
            self.frame_log.dump()
        self.memory.close()
        for bell in [*self._bells.values(), *self._retired]:
            bell.close()
        self._bells.clear()
        self._retired.clear()
        self.sock.close(0)
        for up in self._dealers.values():
            up.close(0)
        if self.ctl is not None:
            self.ctl.close(0)
        self.ctx.term()

    # ------------------------------------------------------------------ statistics
    def _driver_stats(self) -> dict[str, Any]:
        lost: dict[str, int] = {}
        for _, pipe in self._pipes:
            for op, n in pipe.statistics().lost_by_op.items():
                lost[op] = lost.get(op, 0) + n
        return {
            "frames_out": self.frames_out,
            "bytes_out": self.bytes_out,
            "socket_unroutable": self.unroutable,
            "reduce_seconds": self.memory.reduce_seconds,
            "doorbells": len(self._bells),
            "doorbell_frames_in": self.bell_frames_in,
            "doorbell_frames_out": self.bell_frames_out,
            "doorbell_full": sum(b.outbox.full for b in self._bells.values()),
            "fault_lost": lost,  # injected losses by opcode
            "held_frames": sum(len(pipe) for _, pipe in self._pipes),
            # frames links with link-level retry sent again, ingress and egress
            "llr_replays": sum(pipe.llr_replays for _, pipe in self._pipes),
            # [congestion] pfc: PAUSEs this switch's ports asked for (to its nodes' links,
            # which it drives, and by message to neighbour switches), and those it took
            "pfc": {"pauses_sent": sum(p.pauses_sent for p in self._egress.values()),
                    "pauses_sent_to_switches": self.pauses_sent_to_switches,
                    "pauses_refused": self.pauses_refused,
                    "pauses": sum(p.pauses for p in self._ingress.values()),
                    "paused_s": sum(p.paused_s for p in self._ingress.values()),
                    "switch_link_pauses": sum(p.pauses for p in self._egress.values()),
                    "switch_link_paused_s": sum(p.paused_s for p in self._egress.values())},
            # credit-controlled links: frames that waited for credit, and the time the
            # links stood idle for it (ingress: our nodes' links; egress: ours)
            "credit": {"stalls": sum(p.credit_stalls for _, p in self._pipes),
                       "stalled_s": sum(p.credit_stalled_s for _, p in self._pipes),
                       "returns_sent_to_switches": self.credits_sent_to_switches,
                       "returns_refused": self.credits_refused},
            # [congestion]: what the egress queues did, per port ("switch>peer")
            "queues": {f"{self.name}>{peer.decode()}": {
                "overflow_drops": st.overflow_drops, "trims": st.trims,
                "ecn_marks": st.ecn_marks, "peak_queue_bytes": st.peak_queue_bytes}
                for peer, pipe in self._egress.items()
                if pipe.queues is not None and (st := pipe.statistics())},
            "queue_depth": {f"{self.name}>{peer.decode()}": pipe.depth
                            for peer, pipe in self._egress.items() if pipe.depth is not None},
            "faults": {"in": _sum_faults(self._ingress), "out": _sum_faults(self._egress)},
            # per network class: bytes, frames and hops of the links it drives
            "classes": self._classes(),
            "uptime_s": time.monotonic() - self._started,
        }

    def _classes(self) -> dict[str, dict[str, int]]:
        """Per network class, what the link directions this switch drives carried:
        each shaped direction is driven by one switch (its ingress from a node,
        its egress to anyone), so a fabric's figures are the sum over its switches."""
        dirs = [(self._port_class[peer], True, pipe.statistics())
                for peer, pipe in self._ingress.items()]
        dirs += [(self._port_class[peer], peer in self._switch_ports, pipe.statistics())
                 for peer, pipe in self._egress.items()]
        per = class_traffic((cls, into, st.bytes, st.frames) for cls, into, st in dirs)
        return {cls: asdict(t) for cls, t in per.items()}

    def statistics(self) -> dict[str, Any]:
        """Core counters, engine statistics and the driver's own, as plain data."""
        stats: SwitchStats = self.core.statistics()
        out = asdict(stats)
        out.update(self._driver_stats())
        return out
