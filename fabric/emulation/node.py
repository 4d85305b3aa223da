"""A fabric node process: a worker (stands in for a GPU) or a host node.

Started by the launcher (``python -m fabric.emulation.node``) or by any other launcher
(Slurm ``srun``, ``mpirun``, ssh) as ``semfab node --name NAME --topology FILE``.
It attaches to its switch, reports ready on the control socket, then runs the
tasks it is sent (workers) or serves host-staged traffic (hosts) until told to
shut down or its launcher disappears.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from fabric.core import control
from fabric.core import frame as fr
from fabric.core.frame import Flag, FrameError, Op
from fabric.core.hostnode import HostAggregator
from fabric.core.topology import Node, Topology, TopologyError, load
from fabric.emulation import transport
from fabric.emulation.endpoint import Endpoint
from fabric.emulation.launcher import NODE_ENV
from fabric.errors import FabricTimeout, UsageError, check_seconds

log = logging.getLogger("semfab.node")

_loaded_files: dict[str, Any] = {}


def resolve_function(module: str, name: str, file: str | None) -> Callable[..., Any]:
    """Find a task function by module (or script file) and qualified name."""
    if file:
        mod = _loaded_files.get(file)
        if mod is None:
            spec = importlib.util.spec_from_file_location("semfab_user_script", file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {file}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules.setdefault("semfab_user_script", mod)
            spec.loader.exec_module(mod)
            _loaded_files[file] = mod
    else:
        mod = importlib.import_module(module)
    obj: Any = mod
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `semfab node` and `python -m fabric.emulation.node`."""
    p.add_argument("--name", required=True, help="this node's name in the topology")
    p.add_argument("--topology", required=True, help="the topology TOML file")
    p.add_argument("--sock-dir", required=True,
                   help="folder of the ipc:// sockets (same on every node of one host)")
    p.add_argument("--ctl", help="the launcher's control address (omit when run standalone)")
    p.add_argument("--run-id", default="run", help="names shared-memory regions of this run")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds any wait on a peer may take before failing")
    p.add_argument("--crc", action="store_true",
                   help="put a CRC32C on data frames (use where links corrupt)")


def check_arguments(args: argparse.Namespace) -> tuple[Topology, Node]:
    """The topology and this node, or UsageError saying which flag is wrong."""
    check_seconds("--timeout", args.timeout)
    try:
        topo = load(args.topology)
        node = topo.node(args.name)
        if node.kind == "switch":
            raise UsageError(f"{args.name!r} is a switch; start it with `semfab switchd`")
        if topo.transport == "ipc":
            if not Path(args.sock_dir).is_dir():
                raise UsageError(f"--sock-dir {args.sock_dir}: no such folder; give the "
                                 "folder the switch daemons were started with")
            topo.endpoint_address(topo.switch_of(args.name), args.sock_dir)
    except TopologyError as exc:
        raise UsageError(str(exc)) from None
    return topo, node


def run(args: argparse.Namespace) -> int:
    """Process entry: serve until shutdown."""
    topo, node = check_arguments(args)
    # the launcher, read before we say ready: one that dies after our ready must
    # not be missed (it may die before the loop below starts)
    parent = os.getppid()
    # a task's file that calls launch() at import time is refused there
    os.environ[NODE_ENV] = args.name
    ctx = transport.context()
    ctl = transport.dealer(ctx, args.ctl, args.name) if args.ctl else None
    ep = Endpoint(topo, args.name, args.sock_dir, run_id=args.run_id, timeout_s=args.timeout,
                  ctx=ctx, hello=ctl is None)
    ep.crc = args.crc
    if ctl is not None and not _hello(ep, ctl, args.timeout):
        ep.close()
        ctl.close(0)
        ctx.term()
        return 1
    stop = False
    busy = False  # running a task: SIGTERM ends it where it is

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True
        if busy:  # (the launcher stops a node whose task nobody waits for)
            raise SystemExit(1)

    signal.signal(signal.SIGTERM, on_term)
    if ctl is not None:
        ctl.send(control.pack("ready", name=args.name, pid=os.getpid()))
    log.info("%s (id %d, %s) ready", args.name, node.id, node.kind)
    aggregator = HostAggregator() if node.kind == "host" else None
    poller = zmq.Poller()
    if ctl is not None:
        poller.register(ctl, zmq.POLLIN)
    # a worker between tasks still reads its socket: a neighbour may be resending
    # the end of a collective we finished (answered through the endpoint's rule)
    poller.register(ep.sock, zmq.POLLIN)
    # a placed run's coordinator pings; silence this long ends the node
    silence = getattr(args, "ctl_timeout", None)
    boss = control.Supervision(silence, time.monotonic())
    code = 0
    try:
        while not stop:
            events = dict(poller.poll(1000))
            if ctl is not None and os.getppid() != parent:
                log.warning("launcher went away; exiting")
                code = 1
                break
            if boss.lost(time.monotonic()):
                log.error("%s: nothing from the coordinator for %gs (its host or the link "
                          "to it is gone); exiting", args.name, silence)
                code = 1
                break
            if aggregator is not None and ep.sock in events:
                _serve_host(ep, aggregator)
            elif ep.sock in events:
                ep.drain_idle()
            while ctl is not None and ctl.poll(0):
                msg = control.parse(ctl.recv())
                boss.heard(time.monotonic())
                if msg["t"] == "shutdown":
                    if msg.get("error"):
                        log.error("%s: the run was aborted: %s", args.name, msg["error"])
                        code = 1
                    stop = True
                    break
                if msg["t"] == "run":
                    busy = True
                    try:
                        answer = _run_task(ep, msg)
                    finally:
                        busy = False
                    ctl.send(answer)
                    boss.heard(time.monotonic())  # pings queued while the task ran
                elif msg["t"] == "ping":
                    ctl.send(control.pack("pong", name=args.name))
    finally:
        ep.close()
        if ctl is not None:
            ctl.close(0)
        ctx.term()
    return code


#: Seconds of one hello to the switch before the node looks for a shutdown.
HELLO_SLICE_S = 0.5


def _hello(ep: Endpoint, ctl: zmq.Socket, timeout_s: float) -> bool:
    """Say hello to the switch, in slices: between them, a shutdown from the
    launcher (another node could not start) ends the wait at once. False when
    stopped; FabricTimeout when the switch never answered within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            ep.hello(timeout_s=max(min(HELLO_SLICE_S, left), 0.01))
            return True
        except FabricTimeout:
            if time.monotonic() >= deadline:
                raise FabricTimeout(f"{ep.name}: control request 'hello' to its switch "
                                    f"{ep.switch_name}: no answer within {timeout_s:g}s "
                                    "(see the logs in the run folder)") from None
        while ctl.poll(0):
            msg = control.parse(ctl.recv())
            if msg["t"] == "shutdown":
                log.error("%s: the run was stopped before this node started: %s", ep.name,
                          msg.get("error") or "no reason given")
                return False
            if msg["t"] == "ping":
                ctl.send(control.pack("pong", name=ep.name))


def _resolved(value: Any) -> Any:
    from fabric.emulation.launcher import FunctionRef

    if isinstance(value, FunctionRef):
        return resolve_function(value.module, value.func, value.file)
    return value


def _run_task(ep: Endpoint, msg: dict[str, Any]) -> bytes:
    task = msg.get("task")
    try:
        fn = resolve_function(msg["module"], msg["func"], msg.get("file"))
        args, kwargs = pickle.loads(msg["args"])
        args = [_resolved(a) for a in args]  # functions of the launching script
        kwargs = {k: _resolved(v) for k, v in kwargs.items()}
        result = fn(ep, *args, **kwargs)
        return control.pack("done", task=task, ok=True, result=pickle.dumps(result))
    except Exception as exc:  # reported to the launcher with the traceback
        log.exception("task %s failed", task)
        return control.pack("done", task=task, ok=False,
                            error=f"{type(exc).__name__}: {exc}",
                            traceback=traceback.format_exc())


def _serve_host(ep: Endpoint, aggregator: HostAggregator) -> None:
    """Handle every frame waiting on the host's data socket."""
    from fabric.core.programs import HOST_PS_FLOW

    while True:
        try:
            parts = ep.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        try:
            f = fr.decode(parts[0].buffer, parts[1].buffer if len(parts) > 1 else None)
            if f.op is Op.WRITE and f.flow == HOST_PS_FLOW:
                for dst, body in aggregator.on_message(f.src, f.payload,
                                                       bool(f.flags & Flag.ECN),
                                                       time.monotonic()):
                    ep.send_frame(fr.encode_header(Op.WRITE, src=ep.node_id, dst=dst,
                                             flow=HOST_PS_FLOW, psn=f.psn, msg=f.msg,
                                             payload=body, crc=bool(f.flags & Flag.CRC)), body)
            elif f.op is Op.CTRL and control.parse(f.payload).get("t") == "stats":
                ep.send_frame(fr.encode(Op.CTRL, src=ep.node_id, dst=f.src, payload=control.pack(
                    "stats", **aggregator.stats.__dict__)))
        except FrameError as exc:
            log.warning("refused a frame: %s", exc)
        except Exception as exc:  # the guard: no frame may stop the host node
            log.warning("refused a frame (%s: %s)", type(exc).__name__, exc)


def main(argv: list[str] | None = None) -> int:
    """`python -m fabric.emulation.node ...`."""
    p = argparse.ArgumentParser(prog="semfab node", description=__doc__)
    add_arguments(p)
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run(args)
    except UsageError as exc:
        print(f"semfab node: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
