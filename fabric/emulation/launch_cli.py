"""`semfab launch` and `semfab stats`, and the checks of the paths a CLI writes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fabric.errors import UsageError, check_seconds, parse_json

#: A client that is not a node of the topology uses this id in frame headers.


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab launch`."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--workers", type=int, help="start the default star with N workers and a host")
    g.add_argument("--topology", help="a topology file (see docs/TOPOLOGY.md)")
    p.add_argument("--run", metavar="FILE.py:FUNC|MODULE:FUNC",
                   help="run FUNC(ep, *args) on every worker, print the results, shut down")
    p.add_argument("--args", default="[]", help="JSON list of extra arguments for FUNC")
    p.add_argument("--run-dir", help="folder for logs (default: ./runs/<stamp>)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds any single wait on a peer may take")
    p.add_argument("--loss", type=float, default=None,
                   help="drop each frame on every link with this probability (seeded)")
    p.add_argument("--faults", metavar="SPEC",
                   help="faults on every link, e.g. 'loss=0.01,reorder=0.05:2,dup=0.001,"
                   "corrupt=1e-4,delay=50us:10us' (docs/RELIABILITY.md)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault injectors")
    p.add_argument("--switch-service", action="append", default=[], metavar="FILE.py:CLASS",
                   help="add an in-network service to every switch (a switchd.core.Service "
                   "subclass, FILE.py:CLASS or MODULE:CLASS); repeatable")
    p.add_argument("--duration", type=float, default=0,
                   help="without --run: stay up this many seconds (0 = until Ctrl-C)")


# ------------------------------------------------ checks of paths a CLI writes
def check_dir(flag: str, path: str | Path) -> Path:
    """Create folder ``path`` (with parents) and check a file can be written in it."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create or write this folder "
                         f"({exc.strerror or exc}); give a folder you can write to") from None
    return p


def check_output_file(flag: str, path: str | Path) -> Path:
    """Check that ``path`` can be written (its folders are created, as the writers
    do), without leaving an empty file behind; a long run must not fail at its end."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    existed = p.exists()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "ab"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write this file ({exc.strerror or exc}); "
                         "give a path in a folder you can write to") from None
    if not existed:
        p.unlink(missing_ok=True)
    return p


def check_outputs(args: argparse.Namespace, files: tuple[str, ...] = ("json", "markdown", "plot"),
                  dirs: tuple[str, ...] = ()) -> None:
    """Check every output a command was given (``args.<name>``, flag ``--<name>``)
    before it runs: files with :func:`check_output_file`, folders with :func:`check_dir`
    (created). An empty path is refused rather than read as "no output"."""
    for name in (*files, *dirs):
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if not str(value).strip():
            raise UsageError(f"{flag}: an empty path; give a file or folder name, or leave "
                             f"{flag} out")
        if name in files:
            check_output_file(flag, value)
        else:
            check_dir(flag, value)


def _split_ref(ref: str, flag: str = "--run") -> tuple[str, str, str | None]:
    """(module, function, script file) of FILE.py:FUNC or MODULE:FUNC, checked as far
    as it can be without running the user's code: the file exists, parses and
    defines FUNC; the module's top-level package can be found."""
    target, sep, func = ref.rpartition(":")
    if not sep or not target or not func:
        raise UsageError(f"{flag} {ref!r}: write FILE.py:FUNC or MODULE:FUNC")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise UsageError(f"{flag}: script {target} not found")
        _check_defines(path, func.split(".")[0], flag)
        return "semfab_user_script", func, str(path.resolve())
    import importlib.machinery

    top = target.split(".")[0]
    # the nodes import it with their working folder (this one) on the path
    if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None \
            and top not in sys.builtin_module_names:
        raise UsageError(f"{flag} {ref!r}: no module {top!r} here (give FILE.py:FUNC for a "
                         "script, or install the module)")
    return target, func, None


def _check_defines(path: Path, name: str, flag: str) -> None:
    """UsageError unless the script at ``path`` parses and may define ``name``."""
    import ast

    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except SyntaxError as exc:
        raise UsageError(f"{flag}: {path} line {exc.lineno}: {exc.msg}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag}: cannot read {path} ({exc})") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return  # a star import may bring it: the worker will tell
                names.add(alias.asname or alias.name.split(".")[0])
    if name not in names:
        raise UsageError(f"{flag}: {path} defines no {name!r}")


def run(args: argparse.Namespace) -> int:
    """Start the fabric, run the function or wait, and shut everything down."""
    from fabric.core.topology import TopologyError, load
    from fabric.emulation.launcher import check_workers, launch

    extra = parse_json(args.args, "--args")
    if not isinstance(extra, list):
        raise UsageError("--args must be a JSON list, e.g. '[1024, \"ina\"]'")
    ref = _split_ref(args.run) if args.run else None
    check_seconds("--timeout", args.timeout)
    check_seconds("--duration", args.duration, allow_zero=True)
    topology: Any = None
    if args.topology:
        if not Path(args.topology).is_file():
            raise UsageError(f"topology file {args.topology} not found")
        try:
            topology = load(args.topology)
        except TopologyError as exc:
            raise UsageError(str(exc)) from None
        check_workers(len(topology.workers), f"topology {args.topology}")
    else:
        check_workers(args.workers, "--workers")
    faults = args.faults
    if args.loss is not None:
        if not 0 <= args.loss < 1:
            raise UsageError("--loss must be in [0, 1)")
        faults = f"loss={args.loss}" + (f",{faults}" if faults else "")
    if faults:
        from fabric.core.faults import FaultSpecError, parse_faults

        try:
            parse_faults(faults)
        except FaultSpecError as exc:
            raise UsageError(f"--faults: {exc}") from None
    if args.switch_service:
        from switchd.plugins import load_services

        load_services(args.switch_service)  # a bad name: one line now, not a dead switch
    kw: dict[str, Any] = dict(timeout_s=args.timeout, faults=faults, seed=args.seed,
                              switch_services=args.switch_service)
    if args.run_dir:
        # before any process starts: a bad folder is a usage error, not a traceback
        kw["run_dir"] = check_dir("--run-dir", args.run_dir)
    t0 = time.monotonic()
    try:
        fab = launch(workers=args.workers, topology=topology, **kw)
    except TopologyError as exc:
        raise UsageError(str(exc)) from None
    with fab:
        print(f"fabric up in {time.monotonic() - t0:.1f}s: {len(fab.procs)} processes "
              f"({', '.join(fab.procs)}); logs in {fab.run_dir}", file=sys.stderr)
        if ref is not None:
            module, func, file = ref
            results = fab.run_ref(module, func, file, extra)
            for w, res in zip(fab.topo.workers, results, strict=True):
                print(f"{w.name}: {res!r}")
            return 0
        _status_loop(fab, args.duration)
    return 0


def _status_loop(fab: Any, duration: float) -> None:
    """A live status line until Ctrl-C (or ``duration``); fails when a process dies."""
    start = time.monotonic()
    end = start + duration if duration > 0 else float("inf")
    tty = sys.stderr.isatty()
    print("fabric running; `semfab stats` shows its counters; Ctrl-C stops it",
          file=sys.stderr)
    while time.monotonic() < end:
        fab._check_alive("running")
        codes = fab.exit_codes()
        alive = sum(1 for c in codes.values() if c is None)
        line = f"up {time.monotonic() - start:.0f}s  processes alive {alive}/{len(codes)}"
        if tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        time.sleep(1.0)
    if tty:
        print(file=sys.stderr)


# ---------------------------------------------------------------------- stats
def add_stats_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab stats`."""
    p.add_argument("run_dir", nargs="?",
                   help="the fabric's run folder (default: the newest under ./runs)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each switch")


def run_stats(args: argparse.Namespace) -> int:
    """Print each switch's live counters (of the newest running fabric by default)."""
    from fabric.emulation.launcher import query_switch


    def running(info_path: Path) -> bool:
        """True while the launcher that wrote ``info_path`` is alive and its sockets exist."""
        try:
            info = parse_json(info_path.read_bytes(), str(info_path))
            pid = int(info["pid"])
            sock_dir = Path(str(info["sock_dir"]))
        except (OSError, ValueError, KeyError, TypeError, UsageError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        return sock_dir.is_dir()

    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        root = Path(os.environ.get("SEMFAB_RUN_DIR", "runs"))
        live = sorted((c for c in root.glob("*/fabric.json") if running(c)),
                      key=lambda p: p.stat().st_mtime if p.exists() else 0.0)
        if not live:
            raise UsageError(f"no fabric is running (none under {root}/ has a live launcher); "
                             "start one with `semfab launch --workers 4`, `semfab serve` or a "
                             "benchmark, or give its run folder")
        run_dir = live[-1].parent
    check_seconds("--timeout", args.timeout)
    info_path = run_dir / "fabric.json"
    if not info_path.is_file():
        raise UsageError(f"{run_dir} has no fabric.json: is it a `semfab launch` run folder?")
    try:
        info = parse_json(info_path.read_bytes(), str(info_path))
        switches = {name: (str(sw["address"]), int(sw["id"]))
                    for name, sw in info["switches"].items()}
        for address, switch_id in switches.values():  # what query_switch can use
            if not address.startswith(("ipc://", "tcp://")) or not 0 <= switch_id <= 0xFFFF:
                raise ValueError(address)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UsageError):
        raise UsageError(f"{info_path} is not a fabric.json written by `semfab launch`; "
                         "give the run folder of a running fabric") from None
    if not running(info_path):
        raise UsageError(f"no fabric is running in {run_dir}: its launcher (pid "
                         f"{info.get('pid')}) has exited or closed it")
    out = {name: query_switch(address, switch_id, args.timeout)
           for name, (address, switch_id) in switches.items()}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for name, st in out.items():
        eng = st.get("engine", {})
        print(f"{name}: up {st['uptime_s']:.0f}s  frames in {st['frames_in']} out "
              f"{st['frames_out']}  bytes in {st['bytes_in']} out {st['bytes_out']}")
        print(f"  forwarded {st['forwarded']}  reduce frames {st['reduce_frames']}  results "
              f"{st['results_sent']}  malformed {st['malformed']}  NACKs {st['nacks_sent']} "
              f"{st['nack_codes'] or ''}  unroutable {st['unroutable']}")
        print(f"  aggregation: jobs {eng.get('jobs')}  slots {eng.get('slots_in_use')}/"
              f"{eng.get('slots_total')}  completions {eng.get('completions')}  duplicates "
              f"{eng.get('duplicates')}  refused jobs {st['jobs_refused']}  regions "
              f"{st['regions']}")
        for tenant, use in sorted((st.get("tenants") or {}).items()):
            print(f"  tenant {tenant}: jobs {use['jobs']}  slots {use['slots']}  slot memory "
                  f"{use['memory_bytes']} B  refused {use['refused']}")
    return 0
