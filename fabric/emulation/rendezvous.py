"""`semfab run`: one process of a fabric placed by another launcher.

``mpirun -np N semfab run --topology T --workload F.py:FUNC`` (or ``srun``)
starts N copies of this. Each takes its launcher rank from the environment
(:func:`fabric.core.placement.launcher_rank`) and joins a rendezvous, as torchrun
does: rank 0 binds it (``--rendezvous HOST:PORT``, or MASTER_ADDR and
MASTER_PORT) and coordinates; every process (rank 0 included) says which of
the topology's host addresses are its own, is told which node to play
(:func:`fabric.core.placement.assign`), measures its clock's offset from rank 0's
(NTP's exchange over the same socket), then runs that node: a switch daemon,
a host, or a worker. The coordinator then runs the workload on the workers,
gathers their results, the switches' counters and the clock offsets into one
report, and shuts every process down.

Liveness: the coordinator pings every process each second; a switch or an
idle node silent for ``--timeout`` ends the run on every host with an error
naming it, and a process that hears nothing from the coordinator for that
long exits by itself, so no process is left behind anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq

from fabric.core import control
from fabric.core.placement import (
    ClockSample,
    Member,
    PlacementError,
    assign,
    best_offset,
    clock_sample,
)
from fabric.core.topology import Topology
from fabric.emulation import leftovers, transport
from fabric.errors import FabricTimeout, PeerFailed, UsageError

__all__ = ["CLOCK_ROUNDS", "Coordinator", "PlacedFabric", "PlacedRun", "local_addresses",
           "parse_rendezvous", "rendezvous_of"]

log = logging.getLogger("semfab.run")

#: A join is sent again this often until the rendezvous answers (it may start later).
JOIN_RETRY_S = 0.5
#: The coordinator pings every process this often.
PING_S = 1.0
#: After an error while nodes start, the coordinator says "shutdown" for this
#: long, every SHUTDOWN_EVERY_S, so that nodes still starting hear it too.
SHUTDOWN_LINGER_S = 3.0
SHUTDOWN_EVERY_S = 0.25
#: Clock exchanges per process; the one with the shortest round trip is kept.
CLOCK_ROUNDS = 8
#: What a process reports of its clocks: wall-clock offset from rank 0 (ours minus
#: rank 0's), its error bound and round trip; the same offset and bound for the
#: monotonic clock (per-layer latencies across hosts are differences of it).
CLOCK_FIELDS = ("offset_s", "error_s", "rtt_s", "mono_offset_s", "mono_error_s")
#: Identity prefix of a process's join socket (node names cannot hold a colon,
#: so it never meets a node's own control socket).
JOIN = "join:"
#: Switch counters the report keeps (the same names `semfab stats` shows).
REPORT_COUNTERS = ("frames_in", "bytes_in", "reduce_frames", "results_sent", "forwarded",
                   "mcast_frames", "nacks_sent", "malformed", "unauthorised")


def parse_rendezvous(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``; UsageError if not."""
    host, sep, port = text.rpartition(":")
    # an IPv6 address is bracketed whole ([::1]:29400), a name or IPv4 never
    v6 = host.startswith("[") and host.endswith("]") and ":" in host
    if (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536
            or ("[" in host or "]" in host or ":" in host) and not v6):
        raise UsageError(f"--rendezvous {text!r}: give HOST:PORT, e.g. 198.18.0.1:29400 "
                         "([v6]:PORT for IPv6)")
    return host[1:-1] if v6 else host, int(port)


def rendezvous_of(arg: str | None, env: Mapping[str, str]) -> tuple[str, int]:
    """The rendezvous from ``--rendezvous``, SEMFAB_RENDEZVOUS, or torchrun's
    MASTER_ADDR and MASTER_PORT; UsageError saying how to give one."""
    text = arg or env.get("SEMFAB_RENDEZVOUS")
    if not text and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        addr = env["MASTER_ADDR"]
        if ":" in addr and not addr.startswith("["):
            addr = f"[{addr}]"  # torchrun's IPv6 address, unbracketed
        text = f"{addr}:{env['MASTER_PORT']}"
    if not text:
        raise UsageError("no rendezvous: give --rendezvous HOST:PORT (rank 0's host and a "
                         "free port), or set MASTER_ADDR and MASTER_PORT")
    return parse_rendezvous(text)


def local_addresses(topo: Topology) -> frozenset[str]:
    """The topology's host addresses this process is on: those it can bind."""
    mine = set()
    for addr in {topo.host_address(n.name) for n in topo.nodes}:
        try:
            infos = socket.getaddrinfo(addr, None, type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, kind, proto, _, sockaddr in infos:
            try:
                with socket.socket(family, kind, proto) as s:
                    s.bind((sockaddr[0], 0))
            except OSError:
                continue
            mine.add(addr)
            break
    return frozenset(mine)


def _now() -> float:
    return time.time()  # wall clock: the one hosts keep in step (NTP)


def _mono() -> float:
    return time.monotonic()  # the clock the fabric's processes stamp frames and tokens with


# --------------------------------------------------------------------------- coordinator


@dataclass
class _Proc:
    rank: int
    hostname: str
    name: str = ""
    kind: str = ""
    pid: int = 0
    ready: bool = False
    busy: bool = False  # a worker running the workload (it answers pings afterwards)
    heard: float = 0.0
    clock: dict[str, float] = field(default_factory=dict)


class Coordinator(threading.Thread):
    """Rank 0's second job: the rendezvous and the run's supervisor (a thread
    beside the node rank 0 plays itself)."""

    def __init__(self, topo: Topology, port: int, world: int, *, workload: tuple[str, str,
                 str | None], args: list[Any], kwargs: dict[str, Any], timeout_s: float,
                 join_timeout_s: float, bind_host: str = "*",
                 driver: Callable[[PlacedFabric], Any] | None = None,
                 serve_port: int = 0) -> None:
        super().__init__(name="semfab-coordinator", daemon=True)
        self.topo, self.world = topo, world
        self.workload, self.args, self.kwargs = workload, args, kwargs
        self.driver = driver
        self.serve_port = serve_port
        self._done: dict[tuple[int, str], dict[str, Any]] = {}
        self._task_seq = 1  # task 1 is the workload's
        self._next_ping = 0.0
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s
        self.run_id = f"p{os.getpid():x}{int(time.time() * 1000) & 0xFFFFFF:x}"
        self.ctx = zmq.Context()
        self.sock = transport.router(self.ctx, f"tcp://{bind_host}:{port}")
        self.report: dict[str, Any] | None = None
        self.error: str | None = None
        self._procs: dict[int, _Proc] = {}
        self._by_name: dict[str, _Proc] = {}

    # -- plumbing
    def _send(self, ident: str, t: str, **fields: Any) -> None:
        try:
            self.sock.send_multipart([ident.encode(), control.pack(t, **fields)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # that peer is gone: its own silence check ends it

    def _recv(self, timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        if not self.sock.poll(max(int(timeout_s * 1000), 0)):
            return None
        ident, raw = self.sock.recv_multipart()
        who = ident.decode(errors="replace")
        try:
            msg = control.parse(raw)
        except Exception:
            log.warning("coordinator: dropped a bad message from %s", who)
            return None
        proc = self._by_name.get(who) or (self._procs.get(int(who[len(JOIN):]))
                                          if who.startswith(JOIN) and who[len(JOIN):].isdigit()
                                          else None)
        if proc is not None:
            proc.heard = time.monotonic()
        if msg.get("t") == "clock":  # answered at once, whatever phase we are in
            t1, m1 = _now(), _mono()
            self._send(who, "clock_reply", t0=msg.get("t0"), t1=t1, t2=_now(), m1=m1,
                       m2=_mono())
            return None
        if msg.get("t") == "clock_result" and proc is not None:
            proc.clock = {k: float(msg.get(k, 0.0)) for k in CLOCK_FIELDS}
            return None
        return who, msg

    def _who(self, proc: _Proc) -> str:
        return f"{proc.kind} {proc.name!r} (rank {proc.rank} on {proc.hostname})"

    def _check_gone(self, then: str = "") -> None:
        """PeerFailed naming a process of this host that died (killed, crashed): the
        culprit, before the timeouts of its peers are taken for the cause. Processes
        on other hosts are judged by their silence instead."""
        here = socket.gethostname()
        for p in self._procs.values():
            if p.hostname == here and leftovers.pid_gone(p.pid):
                what = f"{self._who(p)}" if p.name else f"rank {p.rank} on {p.hostname}"
                raise PeerFailed(f"{what} died: its process {p.pid} is gone{then}")

    # -- phases
    def run(self) -> None:
        try:
            self.report = self._serve()
        except (UsageError, PeerFailed, FabricTimeout) as exc:
            self.error = str(exc)
        except Exception as exc:  # reported, never a silent hang of the other hosts
            log.exception("coordinator failed")
            self.error = f"coordinator: {type(exc).__name__}: {exc}"
        finally:
            self._shutdown(self.error)

    def _serve(self) -> dict[str, Any]:
        t_start = time.monotonic()
        self._join()
        placement = assign(self.topo, [Member(p.rank, p.hostname, frozenset(p.local), p.want)
                                       for p in self._joins.values()])
        for rank, name in placement.items():
            proc = self._procs[rank]
            proc.name, proc.kind = name, self.topo.node(name).kind
            self._by_name[name] = proc
            self._send(f"{JOIN}{rank}", "assign", name=name, run_id=self.run_id)
        self._wait_ready()
        log.info("coordinator: all %d nodes ready", self.world)
        t_run = time.monotonic()
        results = self._run_workload() if self.driver is None else self._run_driver()
        wall = time.monotonic() - t_run
        switches = self._switch_counters()
        return {
            "topology": self.topo.name, "world": self.world, "run_id": self.run_id,
            "workload": {"module": self.workload[0], "func": self.workload[1],
                         "file": self.workload[2], "args": self.args, "kwargs": self.kwargs},
            "start_s": round(t_run - t_start, 3), "wall_s": round(wall, 4),
            "processes": [{"rank": p.rank, "node": p.name, "kind": p.kind, "host": p.hostname,
                           "address": self.topo.host_address(p.name), "pid": p.pid, **p.clock}
                          for p in sorted(self._procs.values(), key=lambda p: p.rank)],
            "results": results, "switches": switches,
        }

    def _join(self) -> None:
        self._joins: dict[int, Any] = {}
        deadline = time.monotonic() + self.join_timeout_s
        while len(self._joins) < self.world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(self._joins))
                raise FabricTimeout(
                    f"rendezvous: ranks {', '.join(map(str, missing[:16]))} did not join within "
                    f"{self.join_timeout_s:g}s (started? can they reach this port?)")
            got = self._recv(0.1)
            if got is None or got[1].get("t") != "join":
                continue
            who, msg = got
            rank, world = int(msg.get("rank", -1)), int(msg.get("world", -1))
            if world != self.world:
                raise PlacementError(f"rank {rank} was started with {world} processes, "
                                     f"rank 0 with {self.world}: start all with one -np")
            if rank in self._joins and self._joins[rank].pid != int(msg.get("pid", 0)):
                raise PlacementError(f"two processes say they are rank {rank}")
            j = _Join(rank, str(msg.get("hostname", "?")), list(msg.get("local", [])),
                      str(msg.get("name", "")), int(msg.get("pid", 0)))
            self._joins[rank] = j
            self._procs[rank] = _Proc(rank, j.hostname, pid=j.pid, heard=time.monotonic())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.join_timeout_s
        while not all(p.ready for p in self._procs.values()):
            if time.monotonic() > deadline:
                late = [self._who(p) for p in self._procs.values() if not p.ready]
                raise FabricTimeout(f"not ready within {self.join_timeout_s:g}s: "
                                    f"{', '.join(late[:8])} (see its output)")
            got = self._recv(0.1)
            if got is None:
                self._check_gone(" before its node was ready")
                continue
            who, msg = got
            if msg.get("t") == "ready" and who in self._by_name:
                self._by_name[who].ready = True
            elif msg.get("t") == "failed":  # a process could not start its node
                proc = self._procs.get(int(msg.get("rank", -1)))
                raise PeerFailed(f"{self._who(proc) if proc else who} could not start: "
                                 f"{msg.get('error')}")

    def _run_workload(self) -> dict[str, Any]:
        module, func, file = self.workload
        workers = [w.name for w in self.topo.workers]
        task = self.submit(workers, module, func, file, self.args, self.kwargs)
        done = self.collect(task, workers)
        return {name: _plain(pickle.loads(done[name]["result"])) for name in workers}

    def _run_driver(self) -> dict[str, Any]:
        assert self.driver is not None
        fab = PlacedFabric(self)
        try:
            out = self.driver(fab)
        finally:
            fab.close()
            busy = [p.name for p in self._procs.values() if p.busy]
            if busy:  # a driver that failed half-way: its tasks end with the run
                log.warning("coordinator: tasks still running on %s", ", ".join(busy))
        return {"driver": _plain(out)}

    def submit(self, names: list[str], module: str, func: str, file: str | None,
               args: Any, kwargs: dict[str, Any]) -> int:
        """Start ``func(ep, *args, **kwargs)`` on the nodes ``names``; its task id."""
        task = self._task_seq
        self._task_seq += 1
        msg = {"task": task, "module": module, "func": func, "file": file,
               "args": pickle.dumps((tuple(args), kwargs))}
        for name in names:
            self._by_name[name].busy = True
            self._send(name, "run", **msg)
        return task

    def collect(self, task: int, names: list[str],
                timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Every node's "done" of ``task``; PeerFailed when one failed (after the
        others' word, or ``--timeout`` of silence), FabricTimeout after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed_at: float | None = None
        while True:
            done = {n: self._done[(task, n)] for n in names if (task, n) in self._done}
            if len(done) == len(names):
                break
            now = time.monotonic()
            if failed_at is None and any(not m.get("ok") for m in done.values()):
                failed_at = now
            if failed_at is not None:
                self._check_gone(f"; the workload then failed ({_first_error(done)})")
            if failed_at is not None and now - failed_at > self.timeout_s:
                silent = [self._who(self._by_name[n]) for n in names if n not in done]
                raise PeerFailed(f"the workload failed ({_first_error(done)}); no word since "
                                 f"from {', '.join(silent[:8])}")
            if deadline is not None and now >= deadline:
                pending = [n for n in names if n not in done]
                raise FabricTimeout(f"task {task} not finished on {', '.join(pending)}")
            self._pump(0.1 if deadline is None else min(0.1, max(deadline - now, 0.0)))
        for n in names:
            del self._done[(task, n)]
        errors = {n: m for n, m in done.items() if not m.get("ok")}
        if errors:
            raise PeerFailed(f"the workload failed on {', '.join(sorted(errors))}: "
                             f"{_first_error(done)}")
        return done

    def _pump(self, timeout_s: float) -> None:
        """One turn of the supervision loop: ping idle processes, end the run on one
        silent too long, take one message (a task's "done")."""
        now = time.monotonic()
        if now >= self._next_ping:
            self._next_ping = now + PING_S
            self._check_gone()
            for p in self._procs.values():
                if not p.busy:
                    self._send(p.name, "ping")
        for p in self._procs.values():
            if not p.busy and now - p.heard > self.timeout_s:
                raise PeerFailed(f"{self._who(p)} stopped answering for {self.timeout_s:g}s "
                                 "(its host or the link to it is gone)")
        got = self._recv(timeout_s)
        if got is None:
            return
        who, msg = got
        if msg.get("t") == "done" and who in self._by_name:
            self._done[(int(msg.get("task", 0)), who)] = msg
            self._by_name[who].busy = False

    def _switch_counters(self) -> dict[str, dict[str, Any]]:
        names = [s.name for s in self.topo.switches]
        for n in names:
            self._send(n, "stats")
        out: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 5.0
        while len(out) < len(names) and time.monotonic() < deadline:
            got = self._recv(0.1)
            if got is not None and got[1].get("t") == "stats" and got[0] in names:
                out[got[0]] = {k: got[1].get(k) for k in REPORT_COUNTERS}
        return out

    def _shutdown(self, error: str | None) -> None:
        fields = {"error": error} if error else {}
        # after an error while nodes were starting, said again for a while: a node
        # still starting connects its control socket late, and a ROUTER drops what
        # it sends to one not yet there
        starting = not all(p.ready for p in self._procs.values())
        rounds = round(SHUTDOWN_LINGER_S / SHUTDOWN_EVERY_S) if error and starting else 1
        for _ in range(rounds):
            for p in self._procs.values():
                if p.name:
                    self._send(p.name, "shutdown", **fields)
                self._send(f"{JOIN}{p.rank}", "shutdown", **fields)  # not started a node yet
            time.sleep(SHUTDOWN_EVERY_S)  # (and let the messages leave before closing)
        self.sock.close(0)
        self.ctx.term()


class PlacedFabric:
    """What a driver run by the coordinator (`semfab run --bench-tokens`) sees: the
    placed fabric as :class:`fabric.emulation.launcher.Fabric` offers it (``submit``,
    ``wait``, ``topo``, ``run_dir``), its tasks sent to the nodes on other hosts.

    No file is shared between hosts, so ``shared_files`` is False: the serving
    chain then learns that its HTTP server is up by asking it, at
    ``serve_address`` (host0's address in the placement, ``serve_port``).
    """

    shared_files = False

    def __init__(self, coordinator: Coordinator, serve_port: int = 0) -> None:
        import tempfile

        self._c = coordinator
        self.topo = coordinator.topo
        self.timeout_s = coordinator.timeout_s
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"semfab-{coordinator.run_id}-"))
        self.serve_port = serve_port or coordinator.serve_port

    @property
    def serve_address(self) -> tuple[str, int]:
        """Where host0's HTTP server listens: its host's address, a fixed port."""
        return self.topo.host_address("host0"), self.serve_port

    def submit(self, fn: Callable[..., Any], *args: Any, nodes: list[str] | None = None,
               **kwargs: Any) -> Any:
        """Start ``fn(ep, *args, **kwargs)`` on ``nodes`` (default: every worker)."""
        from fabric.emulation.launcher import Task, _function_ref, _portable

        module, file = _function_ref(fn)
        names = list(nodes) if nodes is not None else [w.name for w in self.topo.workers]
        unknown = [n for n in names if n not in self._c._by_name
                   or self.topo.node(n).kind == "switch"]
        if unknown:
            raise UsageError(f"cannot run tasks on {', '.join(unknown)}: not a worker or host")
        tid = self._c.submit(names, module, fn.__qualname__, file,
                             [_portable(a) for a in args],
                             {k: _portable(v) for k, v in kwargs.items()})
        return Task(tid, fn.__qualname__, names)

    def wait(self, task: Any, timeout_s: float | None = None) -> list[Any]:
        """Results of ``task`` in the order of its nodes (FabricTimeout after
        ``timeout_s``; PeerFailed when a node's task raised)."""
        done = self._c.collect(task.id, task.nodes, timeout_s)
        return [pickle.loads(done[n]["result"]) for n in task.nodes]

    def close(self) -> None:
        """The run's end closes the processes; this removes the local folder."""
        import shutil

        shutil.rmtree(self.run_dir, ignore_errors=True)


@dataclass
class _Join:
    rank: int
    hostname: str
    local: list[str]
    want: str
    pid: int


def _first_error(done: Mapping[str, Mapping[str, Any]]) -> str:
    for name in sorted(done):
        if not done[name].get("ok"):
            return f"{name}: {done[name].get('error')}"
    return "?"


def _plain(value: Any) -> Any:
    """A result as JSON can hold it (arrays as lists, other objects as their repr)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        if hasattr(value, "tolist"):
            return value.tolist()
        if isinstance(value, Mapping):
            return {str(k): _plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_plain(v) for v in value]
        return repr(value)


# --------------------------------------------------------------------------- one process


@dataclass
class PlacedRun:
    """What one `semfab run` process was given."""

    topo: Topology
    topology_path: str
    rank: int
    world: int
    rendezvous: tuple[str, int]
    workload: tuple[str, str, str | None]
    args: list[Any]
    kwargs: dict[str, Any]
    name: str = ""
    timeout_s: float = 30.0
    join_timeout_s: float = 60.0
    sock_dir: str = ""
    #: rank 0 runs this instead of the workload (`semfab run --bench-tokens`)
    driver: Callable[[PlacedFabric], Any] | None = None
    serve_port: int = 0

    def execute(self) -> tuple[int, dict[str, Any] | None, str | None]:
        """Run this process's part; ``(exit code, report (rank 0), error)``."""
        coordinator = None
        host, port = self.rendezvous
        if self.rank == 0:
            try:
                coordinator = Coordinator(
                    self.topo, port, self.world, workload=self.workload, args=self.args,
                    kwargs=self.kwargs, timeout_s=self.timeout_s,
                    join_timeout_s=self.join_timeout_s, driver=self.driver,
                    serve_port=self.serve_port)
            except zmq.ZMQError as exc:
                raise UsageError(f"--rendezvous {host}:{port}: cannot listen there "
                                 f"({exc}); pick a free port") from None
            coordinator.start()
        code, error = self._play(f"tcp://{host}:{port}")
        if coordinator is None:
            return code, None, error
        coordinator.join(self.timeout_s * 4 + self.join_timeout_s)
        if coordinator.error:
            return 1, coordinator.report, coordinator.error
        return code, coordinator.report, error

    def _play(self, addr: str) -> tuple[int, str | None]:
        ctx = zmq.Context()
        sock = transport.dealer(ctx, addr, f"{JOIN}{self.rank}")
        try:
            assigned = self._join(sock)
            if assigned.get("t") == "shutdown":
                return 1, str(assigned.get("error") or "the run was stopped before it began")
            self._sync_clock(sock)
        finally:
            sock.close(0)
            ctx.term()
        name, run_id = str(assigned["name"]), str(assigned["run_id"])
        node = self.topo.node(name)
        sock_dir = self.sock_dir or f"/tmp/semfab-run-{self.rendezvous[1]}"
        try:
            leftovers.arrive(Path(sock_dir), name, run_id)
            return self._role(addr, node.kind, name, run_id, sock_dir)
        except (OSError, zmq.ZMQError, UsageError) as exc:
            # say so at once (the others would wait for this node's "ready" in vain)
            error = f"{node.kind} {name}: {type(exc).__name__}: {exc}"
            ctx = zmq.Context()
            # an identity of its own: the closed join socket's may still be known to
            # the coordinator's ROUTER, which then drops a newcomer with the same name
            sock = transport.dealer(ctx, addr, f"fail:{self.rank}")
            sock.send(control.pack("failed", rank=self.rank, error=error))
            time.sleep(0.2)  # let it leave before the socket closes
            sock.close(0)
            ctx.term()
            return 1, error
        finally:
            # the last process out of this host removes the folder and the run's memory
            leftovers.leave(Path(sock_dir), name, run_id, [n.name for n in self.topo.nodes],
                            remove_folder=not self.sock_dir)

    def _role(self, addr: str, kind: str, name: str, run_id: str,
              sock_dir: str) -> tuple[int, str | None]:
        log.info("rank %d plays %s %s", self.rank, kind, name)
        if kind == "switch":
            from switchd.daemon import SwitchDaemon

            daemon = SwitchDaemon(self.topo, name, Path(sock_dir), ctl_addr=addr,
                                  ctl_silence_s=self.timeout_s)
            daemon.serve()
            return daemon.exit_code, None
        import argparse

        from fabric.emulation import node as node_main

        ns = argparse.Namespace(name=name, topology=self.topology_path, sock_dir=sock_dir,
                                ctl=addr, run_id=run_id, timeout=self.timeout_s, crc=False,
                                ctl_timeout=self.timeout_s)
        return node_main.run(ns), None

    def _join(self, sock: zmq.Socket) -> dict[str, Any]:
        join = control.pack("join", rank=self.rank, world=self.world,
                            hostname=socket.gethostname(),
                            local=sorted(local_addresses(self.topo)), name=self.name,
                            pid=os.getpid())
        # rank 0 waits a little longer: its coordinator's verdict (who did not
        # join) is the better error
        deadline = time.monotonic() + self.join_timeout_s + (5.0 if self.rank == 0 else 0.0)
        while time.monotonic() < deadline:
            sock.send(join)
            if sock.poll(int(JOIN_RETRY_S * 1000)):
                msg = control.parse(sock.recv())
                if msg.get("t") in ("assign", "shutdown"):
                    return msg
        host, port = self.rendezvous
        raise FabricTimeout(f"rank {self.rank}: no rendezvous at {host}:{port} within "
                            f"{self.join_timeout_s:g}s (is rank 0 running there? is the port "
                            "reachable from this host?)")

    def _sync_clock(self, sock: zmq.Socket) -> None:
        """NTP's exchange with rank 0, for the wall clock and the monotonic one (the
        clock frames and tokens are stamped with); the shortest round trip of each."""
        wall: list[ClockSample] = []
        mono: list[ClockSample] = []
        for _ in range(CLOCK_ROUNDS):
            t0, m0 = _now(), _mono()
            sock.send(control.pack("clock", t0=t0))
            if not sock.poll(int(self.timeout_s * 1000)):
                break
            msg = control.parse(sock.recv())
            t3, m3 = _now(), _mono()
            if msg.get("t") != "clock_reply" or msg.get("t0") != t0:
                continue
            # rank 0's clock is the reference: report ours minus its (the sample's negation)
            for out, a, b, c, d in ((wall, t0, msg["t1"], msg["t2"], t3),
                                    (mono, m0, msg["m1"], msg["m2"], m3)):
                s = clock_sample(a, float(b), float(c), d)
                out.append(ClockSample(-s.offset_s, s.error_s, s.rtt_s))
        if wall:
            w, m = best_offset(wall), best_offset(mono)
            sock.send(control.pack("clock_result", **asdict(w), mono_offset_s=m.offset_s,
                                   mono_error_s=m.error_s))
            # token stamps taken in this process go on rank 0's timeline
            from fabric.serving import clock

            clock.set_offset_ns(round(m.offset_s * 1e9))


def format_report(report: Mapping[str, Any]) -> str:
    """The report rank 0 prints: who ran where, clock offsets, results, counters."""
    lines = [f"# semfab run: {report['topology']}, {report['world']} processes, workload "
             f"{report['workload']['func']} in {report['wall_s'] * 1e3:.1f} ms "
             f"(start {report['start_s']:.2f} s)",
             "#  rank  node        kind    host              address          "
             "wall offset (us)  +/- (us)  monotonic offset (us)  +/- (us)"]
    for p in report["processes"]:
        cells = []
        for off_key, err_key, width in (("offset_s", "error_s", 16), ("mono_offset_s",
                                                                      "mono_error_s", 21)):
            off, err = p.get(off_key), p.get(err_key)
            cells.append(f"{off * 1e6:>{width}.1f}  {err * 1e6:>8.1f}" if off is not None
                         else f"{'-':>{width}}  {'-':>8}")
        lines.append(f"  {p['rank']:>5}  {p['node']:<10}  {p['kind']:<6}  {p['host'][:16]:<16}  "
                     f"{p['address']:<15}  " + "  ".join(cells))
    lines.append("# results")
    for name, value in report["results"].items():
        text = json.dumps(value)
        lines.append(f"  {name:<10}  {text if len(text) < 100 else text[:97] + '...'}")
    lines.append("# switch counters")
    for name, c in report["switches"].items():
        lines.append(f"  {name:<10}  " + "  ".join(f"{k}={c.get(k)}" for k in REPORT_COUNTERS))
    return "\n".join(lines)
