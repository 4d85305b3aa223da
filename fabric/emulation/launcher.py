"""Bring a fabric up on this machine, run functions on its workers, tear it down.

    from fabric.emulation.launcher import launch

    def work(ep):
        x = ep.alloc(1000, "float32"); x[:] = ep.rank + 1
        return float(ep.allreduce(x, path="ina")[0])

    if __name__ == "__main__":        # workers import this file to find work()
        with launch(workers=4) as fab:
            print(fab.run(work))      # [10.0, 10.0, 10.0, 10.0]

The launcher starts one process per switch, host and worker, each with its
own log in the run folder, and waits for a real handshake (every switch bound,
every node welcomed by its switch) with a deadline that names whoever did not
come up. If any process dies, the operation in progress fails naming it, and
closing the fabric (also on Ctrl-C, SIGTERM or interpreter exit) leaves no
process and no socket folder behind.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.topology import Topology, load, star
from fabric.emulation import transport
from fabric.emulation.shm import SHM_DIR
from fabric.errors import FabricTimeout, PeerFailed, UsageError, check_seconds

#: Source id of a client outside the fabric (``semfab stats``) asking a switch.
OUTSIDE_ID = 0xFFFF

log = logging.getLogger("semfab.launcher")

#: Set in every node process (to its name): a launch() there is a script that
#: starts a fabric at import time, re-run by each worker that imports it.
NODE_ENV = "SEMFAB_NODE"

#: Most worker processes one launcher starts on this machine, however they are
#: asked for (``--workers``, a topology file, ``semfab serve``).
MAX_WORKERS = 64


def check_workers(count: object, source: str) -> int:
    """``count`` if this machine may launch that many workers, else UsageError
    naming ``source`` (the flag or the topology file that asked)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"{source}: {count!r} workers; give at least 1")
    if count > MAX_WORKERS:
        raise UsageError(f"{source}: {count} workers; one machine launches at most "
                         f"{MAX_WORKERS} (place more over several hosts with `semfab run` "
                         "under mpirun or srun, or simulate them with `semfab sim`)")
    return count


class TaskFailed(PeerFailed):
    """A task raised on a worker; carries the remote traceback."""

    def __init__(self, message: str, tracebacks: dict[str, str]) -> None:
        super().__init__(message)
        self.tracebacks = tracebacks


@dataclass(frozen=True)
class Task:
    """A submitted task: its id, function name and the nodes running it."""

    id: int
    func: str
    nodes: list[str]


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """(module, script file) under which worker processes can import ``fn``."""
    module = fn.__module__
    if module not in ("__main__", "semfab_user_script"):
        return module, None
    file = getattr(sys.modules.get(module), "__file__", None)
    if file is None:
        raise UsageError("functions run on workers must live in a module or a script file, "
                         "not in an interactive session")
    return module, str(Path(file).resolve())


@dataclass(frozen=True)
class FunctionRef:
    """A function argument from a script (``__main__``) as a name the workers can
    import: pickle would look it up in *their* ``__main__`` (fabric.emulation.node) and fail."""

    module: str
    func: str
    file: str | None


def _portable(value: Any) -> Any:
    """``value``, or a FunctionRef when it is a function of a script."""
    if inspect.isfunction(value) and value.__module__ in ("__main__", "semfab_user_script"):
        module, file = _function_ref(value)
        return FunctionRef(module, value.__qualname__, file)
    return value


@dataclass
class Proc:
    """One launched process."""

    name: str
    kind: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 8) -> str:
        """The last lines of its log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def default_run_dir() -> Path:
    """``$SEMFAB_RUN_DIR`` or ``./runs``, plus a fresh time-stamped folder."""
    root = Path(os.environ.get("SEMFAB_RUN_DIR", "runs"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return root / f"{stamp}-{os.getpid()}"


class Fabric:
    """A running fabric of switch, host and worker processes."""

    def __init__(
        self,
        topo: Topology,
        run_dir: str | Path | None = None,
        *,
        timeout_s: float = 30.0,
        start_timeout_s: float = 60.0,
        switch_args: Sequence[str] = (),
        faults: str | None = None,
        seed: int = 0,
        crc: bool | None = None,
        verbose: bool = False,
        remove_run_dir: bool = False,
        switch_services: Sequence[str] = (),
    ) -> None:
        self.topo = topo
        self.run_dir = Path(run_dir) if run_dir else default_run_dir()
        # benchmarks drop the logs of a clean run (their --keep-runs keeps them)
        self.remove_run_dir = remove_run_dir
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        self.start_timeout_s = check_seconds("start_timeout_s", start_timeout_s)
        self.switch_args = list(switch_args)
        self.faults = faults or ""  # the switches inject them (--faults)
        if faults:
            self.switch_args += ["--faults", faults, "--seed", str(seed)]
        # in-network services every switch adds (module:Class or file.py:Class)
        for spec in switch_services:
            if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
                where, _, attr = spec.rpartition(":")
                spec = f"{Path(where).resolve()}:{attr}"  # the daemons' cwd may differ
            self.switch_args += ["--service", spec]
        # CRC on data frames by default wherever frames may be corrupted
        self.crc = crc if crc is not None else bool(faults and "corrupt" in faults)
        self.verbose = verbose
        self.procs: dict[str, Proc] = {}
        self.sock_dir: Path | None = None
        self.run_id = f"{os.getpid():x}{int(time.time() * 1000) & 0xFFFFFF:x}"
        self._task_seq = itertools.count(1)
        self.ctx: zmq.Context | None = None
        self.ctl: zmq.Socket | None = None
        self._ready: set[str] = set()
        self._done: dict[tuple[int, str], dict[str, Any]] = {}
        # tasks each node was given and has not answered: a node busy with one
        # reads no shutdown (close() stops it at once)
        self._busy: dict[str, set[int]] = {}
        self._closed = False

    # ------------------------------------------------------------------ start
    def start(self) -> Fabric:
        """Start every process and wait until all are ready."""
        inside = os.environ.get(NODE_ENV)
        if inside:
            raise UsageError(
                f"launch() was called inside semfab node {inside!r}: the file that defines "
                "the task starts a fabric when it is imported, and every worker imports it; "
                'put the launch() call under `if __name__ == "__main__":`')
        where = "--workers" if self.topo.source == "<star>" else f"topology {self.topo.source}"
        check_workers(len(self.topo.workers), where)
        topo_path = self.run_dir / "topology.toml"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            topo_path.write_text(self.topo.to_toml())
        except OSError as exc:
            raise UsageError(f"run folder {self.run_dir}: cannot create or write it "
                             f"({exc.strerror or exc}); give a folder you can write to") from None
        _sweep_stale_socket_dirs()
        self.sock_dir = transport.socket_dir()
        _track(self)
        try:
            self.ctx = transport.context()
            ctl_addr = f"ipc://{self.sock_dir}/ctl.sock"
            self.ctl = transport.router(self.ctx, ctl_addr)
            for sw in self.topo.switches:
                self._spawn(sw.name, "switch", [
                    sys.executable, "-m", "switchd", "--topology", str(topo_path),
                    "--name", sw.name, "--sock-dir", str(self.sock_dir), "--ctl", ctl_addr,
                    "--run-id", self.run_id, *self.switch_args, *(["-v"] if self.verbose else []),
                ])
            # switches first: their links must be up before nodes send over them
            self._wait_ready()
            for node in [*self.topo.hosts, *self.topo.workers]:
                self._spawn(node.name, node.kind, [
                    sys.executable, "-m", "fabric.emulation.node", "--name", node.name,
                    "--topology", str(topo_path), "--sock-dir", str(self.sock_dir),
                    "--ctl", ctl_addr, "--run-id", self.run_id,
                    "--timeout", str(self.timeout_s), *(["--crc"] if self.crc else []),
                    *(["-v"] if self.verbose else []),
                ])
            self._wait_ready()
            self._write_info()
        except BaseException:
            self.close()
            raise
        log.info("fabric up: %d processes, run folder %s", len(self.procs), self.run_dir)
        return self

    def _write_info(self) -> None:
        """fabric.json in the run folder: how `semfab stats` finds a running fabric
        (whoever launched it: the CLI, a benchmark, user code)."""
        assert self.sock_dir is not None
        info = {"sock_dir": str(self.sock_dir), "pid": os.getpid(),
                "switches": {s.name: {"address": self.topo.endpoint_address(s.name,
                                                                            self.sock_dir),
                                      "id": s.id} for s in self.topo.switches}}
        (self.run_dir / "fabric.json").write_text(json.dumps(info, indent=2))

    def _spawn(self, name: str, kind: str, cmd: list[str]) -> None:
        log_path = self.run_dir / f"{name}.log"
        env = dict(os.environ)
        # Numba's OpenMP threads spin for milliseconds after each parallel
        # kernel; with several emulated nodes sharing the cores that spinning
        # starves the others (measured: ina-mem 16 MiB at 2 workers went from
        # 0.9 to 3.4 GB/s busbw with passive waiting).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env[NODE_ENV] = name
        with open(log_path, "wb") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = Proc(name, kind, popen, log_path)

    def _check_alive(self, doing: str, then: str = "") -> None:
        """PeerFailed naming the process that died, if one did. ``then``: what
        the others reported after it (their errors are its consequences)."""
        dead = self.dead()
        if dead:
            p = dead[0]
            tail = p.log_tail()
            log_says = (f"its log ({p.log_path}) ends with:\n{tail}" if tail
                        else f"its log ({p.log_path}) is empty")
            raise PeerFailed(f"{p.kind} {p.name!r} {_how_it_ended(p.popen.returncode)} while "
                             f"{doing}{then}; {log_says}")

    def dead(self) -> list[Proc]:
        """The processes that have exited, the first to go first (as far as their
        exit can be ordered: a process killed outright before one that gave up)."""
        gone = [p for p in self.procs.values() if p.popen.poll() is not None]
        # a signal's victim is the cause; the others exit of their own accord after it
        return sorted(gone, key=lambda p: 0 if (p.popen.returncode or 0) < 0 else 1)

    def _recv_ctl(self, deadline: float, doing: str) -> tuple[str, dict[str, Any]]:
        assert self.ctl is not None
        while True:
            self._check_alive(doing)
            if time.monotonic() > deadline:
                raise FabricTimeout(f"timed out while {doing}")
            if self.ctl.poll(100):
                ident, raw = self.ctl.recv_multipart()
                return ident.decode(), control.parse(raw)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        want = set(self.procs)
        while self._ready != want:
            missing = sorted(want - self._ready)
            try:
                who, msg = self._recv_ctl(deadline, f"starting the fabric (waiting for "
                                                    f"{', '.join(missing)})")
            except FabricTimeout:
                raise FabricTimeout(
                    f"fabric did not come up within {self.start_timeout_s:g}s: not ready: "
                    f"{', '.join(missing)} (see their logs in {self.run_dir})"
                ) from None
            if msg["t"] == "ready":
                self._ready.add(who)

    def switch_stats(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
        """Every switch's live counters, by name (what ``semfab stats`` shows)."""
        assert self.sock_dir is not None, "the fabric is not started"
        return {sw.name: query_switch(self.topo.endpoint_address(sw.name, self.sock_dir),
                                      sw.id, timeout_s) for sw in self.topo.switches}

    def class_traffic(self, timeout_s: float = 5.0) -> dict[str, dict[str, int]]:
        """Per network class, what the fabric's shaped links carried so far: bytes,
        frames and hops (frames into a switch), summed over the switches that
        drive them (as :attr:`fabric.sim.SimResult.bytes_by_class` and its kin)."""
        out: dict[str, dict[str, int]] = {}
        for st in self.switch_stats(timeout_s).values():
            for cls, t in st.get("classes", {}).items():
                acc = out.setdefault(cls, dict.fromkeys(t, 0))
                for k, v in t.items():
                    acc[k] += v
        return out

    # ------------------------------------------------------------------ tasks
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(ep, *args, **kwargs)`` on every worker; results in rank order."""
        return self.wait(self.submit(fn, *args, **kwargs), timeout_s)

    def submit(self, fn: Callable[..., Any], *args: Any, nodes: Sequence[str] | None = None,
               **kwargs: Any) -> Task:
        """Start ``fn(ep, *args, **kwargs)`` on ``nodes`` (default: every worker) and
        return at once; :meth:`wait` collects the results. Hosts take tasks too."""
        module, file = _function_ref(fn)
        return self.submit_ref(module, fn.__qualname__, file, [_portable(a) for a in args],
                               {k: _portable(v) for k, v in kwargs.items()}, nodes)

    def run_ref(self, module: str, func: str, file: str | None, args: Sequence[Any] = (),
                kwargs: dict[str, Any] | None = None, timeout_s: float | None = None
                ) -> list[Any]:
        """Run a function named by module (or script file) and qualified name."""
        return self.wait(self.submit_ref(module, func, file, args, kwargs), timeout_s)

    def submit_ref(self, module: str, func: str, file: str | None, args: Sequence[Any] = (),
                   kwargs: dict[str, Any] | None = None,
                   nodes: Sequence[str] | None = None) -> Task:
        """Like :meth:`submit` for a function named by module (or file) and name."""
        assert self.ctl is not None, "start() the fabric first"
        names = list(nodes) if nodes is not None else [w.name for w in self.topo.workers]
        unknown = [n for n in names if n not in self.procs or self.procs[n].kind == "switch"]
        if unknown:
            raise UsageError(f"cannot run tasks on {', '.join(unknown)}: not a worker or host")
        task = Task(next(self._task_seq), func, names)
        payload = control.pack("run", task=task.id, module=module, func=func, file=file,
                               args=pickle.dumps((tuple(args), kwargs or {})))
        for name in names:
            self.ctl.send_multipart([name.encode(), payload])
            self._busy.setdefault(name, set()).add(task.id)
        return task

    def wait(self, task: Task, timeout_s: float | None = None) -> list[Any]:
        """Results of ``task`` in the order of its nodes; TaskFailed if any raised."""
        limit = timeout_s if timeout_s is not None else max(self.timeout_s * 4, 120.0)
        deadline = time.monotonic() + limit
        while any((task.id, n) not in self._done for n in task.nodes):
            pending = [n for n in task.nodes if (task.id, n) not in self._done]
            try:
                who, msg = self._recv_ctl(deadline, f"running {task.func} (waiting for "
                                                    f"{', '.join(pending)})")
            except FabricTimeout:
                raise FabricTimeout(f"task {task.func} did not finish within {limit:g}s on "
                                    f"{', '.join(pending)}") from None
            if msg.get("t") == "done":
                self._done[(int(msg["task"]), who)] = msg
                self._busy.get(who, set()).discard(int(msg["task"]))
        msgs = {n: self._done.pop((task.id, n)) for n in task.nodes}
        errors = {n: m["error"] for n, m in msgs.items() if not m["ok"]}
        if errors:
            first = sorted(errors)[0]
            # a process that died is the culprit: the errors of the others are its echo
            self._check_alive(f"running {task.func}",
                              then=f" ({first} then failed: {errors[first]})")
            raise TaskFailed(
                f"{task.func} failed on {', '.join(sorted(errors))}: {errors[first]}",
                {n: msgs[n].get("traceback", "") for n in errors},
            )
        return [pickle.loads(msgs[n]["result"]) for n in task.nodes]

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        """Shut every process down (gracefully, then by force) and clean up."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_processes()
        finally:
            # even if a second Ctrl-C interrupts the graceful part
            for p in self.procs.values():
                if p.popen.poll() is None:
                    _signal_group(p.popen, signal.SIGKILL)
            self._remove_files()
            _untrack(self)

    def _stop_processes(self) -> None:
        if self.ctl is not None:
            for name in list(self.procs):
                try:
                    self.ctl.send_multipart([name.encode(), control.pack("shutdown")],
                                            zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # not connected (never started or already gone)
        # a node still running a task nobody waits for any more (a peer died under
        # it) would read the shutdown only when the task gives up, and one that never
        # said ready may not read it at all: stop those now
        for name, p in self.procs.items():
            if (self._busy.get(name) or name not in self._ready) and p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in self.procs.values():
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.05))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for p in self.procs.values():
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.05))
            except subprocess.TimeoutExpired:
                _signal_group(p.popen, signal.SIGKILL)
                p.popen.wait(5)
        if self.ctl is not None:
            self.ctl.close(0)
        if self.ctx is not None:
            self.ctx.term()

    def _remove_files(self) -> None:
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        for leftover in SHM_DIR.glob(f"semfab-{self.run_id}-*"):
            leftover.unlink(missing_ok=True)

    def _kill_now(self) -> None:
        """On a fatal signal: stop the processes and remove the files, without
        waiting and without touching zmq (the main thread may be inside a call)."""
        self._closed = True
        for p in self.procs.values():
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
        self._remove_files()

    def exit_codes(self) -> dict[str, int | None]:
        """Each process's exit code (None while running)."""
        return {name: p.popen.poll() for name, p in self.procs.items()}

    def __enter__(self) -> Fabric:
        return self if self.ctl is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
        if exc[0] is None and self.remove_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _how_it_ended(code: int | None) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL``."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------ process exit
# Fabrics started and not closed yet. A launcher that exits without close()
# (no `with`, an uncaught exception) closes them at exit; one killed by SIGTERM
# or SIGHUP while nobody handles those stops them and removes their files first.
_live: list[Fabric] = []
_FATAL_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_installed: set[int] = set()


def _track(fab: Fabric) -> None:
    _live.append(fab)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    for sig in _FATAL_SIGNALS:
        # only where the default (die at once) is in force: a program that
        # handles the signal itself (the CLI unwinds on SIGTERM) keeps its handler
        if sig not in _installed and signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _on_fatal_signal)
            _installed.add(sig)


def _untrack(fab: Fabric) -> None:
    if fab in _live:
        _live.remove(fab)
    if _live or threading.current_thread() is not threading.main_thread():
        return
    for sig in list(_installed):
        if signal.getsignal(sig) is _on_fatal_signal:
            signal.signal(sig, signal.SIG_DFL)
        _installed.discard(sig)


@atexit.register
def _close_all() -> None:
    for fab in list(_live):
        fab.close()


def _on_fatal_signal(signum: int, _frame: object) -> None:
    for fab in list(_live):
        fab._kill_now()
    _live.clear()
    # die of the same signal, as without the handler
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_SOCK_DIR_RE = re.compile(r"semfab-(\d+)-")
_STALE_AFTER_S = 60.0


def _sweep_stale_socket_dirs(root: Path = Path("/tmp")) -> list[Path]:
    """Remove socket folders of launchers that died without cleaning up (SIGKILL).

    A folder is named after its launcher's pid (transport.socket_dir). It is a
    leftover when that pid is gone and its control socket refuses connections
    (or, never bound, the folder is over a minute old): a live launcher in
    another pid namespace sharing /tmp still answers on its socket.
    """
    removed: list[Path] = []
    try:
        candidates = list(root.glob("semfab-*-*"))
    except OSError:
        return removed
    for d in candidates:
        m = _SOCK_DIR_RE.match(d.name)
        if not m or d.is_symlink() or not d.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or the pid was reused): keep
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # another user's, or not a pid
        if _socket_answers(d / "ctl.sock"):
            continue
        try:
            if not (d / "ctl.sock").exists() and time.time() - d.stat().st_mtime < _STALE_AFTER_S:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _socket_answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.2)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def launch(workers: int | None = None, topology: str | Path | Topology | None = None,
           **kwargs: Any) -> Fabric:
    """Start a fabric: ``workers=N`` builds the default star, or pass a topology."""
    if topology is None:
        if workers is None:
            raise UsageError("give workers=N or a topology")
        topo = star(check_workers(workers, "workers"))
    elif isinstance(topology, Topology):
        topo = topology
    else:
        topo = load(topology)
    return Fabric(topo, **kwargs).start()


def query_switch(address: str, switch_id: int, timeout_s: float) -> dict[str, Any]:
    """Ask one switch for its counters."""
    ctx = transport.context()
    sock = transport.dealer(ctx, address, f"stats-{os.getpid()}")
    try:
        sock.send(fr.encode(fr.Op.CTRL, src=OUTSIDE_ID, dst=switch_id,
                            payload=control.pack("stats")))
        if not sock.poll(int(timeout_s * 1000)):
            raise FabricTimeout(f"switch at {address} did not answer within {timeout_s:g}s")
        parts = sock.recv_multipart()
        f = fr.decode(parts[0], parts[1] if len(parts) > 1 else None)
        msg = control.parse(f.payload)
        msg.pop("t", None)
        return msg
    finally:
        sock.close(0)
        ctx.term()
