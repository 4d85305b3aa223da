"""Command line of one switch daemon: `semfab switchd --topology FILE --name sw0`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from fabric.core.topology import TopologyError, load

#: More ZeroMQ I/O threads than cores only adds switching; 64 is already absurd.
MAX_IO_THREADS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab switchd`."""
    p.add_argument("--topology", required=True, help="the topology TOML file")
    p.add_argument("--name", required=True, help="this switch's name in the topology")
    p.add_argument("--sock-dir", default=".",
                   help="folder of the ipc:// sockets (ipc transport)")
    p.add_argument("--ctl", help="the launcher's control address (omit when run standalone)")
    p.add_argument("--memory-mb", type=int, default=256,
                   help="aggregation memory budget in MiB; jobs beyond it are refused")
    p.add_argument("--io-threads", type=int, default=1, help="ZeroMQ I/O threads")
    p.add_argument("--faults", metavar="SPEC",
                   help="inject faults on every link, e.g. 'loss=0.01,reorder=0.05:3,"
                   "corrupt=1e-4' (see docs/RELIABILITY.md); default: each link's `loss`")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault injectors")
    p.add_argument("--run-id", default=None, metavar="ID",
                   help="the run whose workers' memory-plane regions it maps (default: any "
                   "run's, by the registering node's own name and key)")
    p.add_argument("--service", action="append", default=[], metavar="MODULE:CLASS",
                   help="add an in-network service (a switchd.core.Service subclass, "
                   "module:Class or file.py:Class); repeatable")


def run(args: argparse.Namespace) -> int:
    """Start the daemon; returns when it shuts down."""
    from fabric.errors import UsageError
    from switchd.daemon import SwitchDaemon

    if not Path(args.topology).is_file():
        raise UsageError(f"topology file {args.topology} not found")
    try:
        topo = load(args.topology)
        node = topo.node(args.name)
    except (TopologyError, KeyError) as exc:
        raise UsageError(str(exc)) from None
    if node.kind != "switch":
        raise UsageError(f"{args.name!r} is a {node.kind}, not a switch")
    if args.memory_mb < 1:
        raise UsageError("--memory-mb must be at least 1")
    if not 1 <= args.io_threads <= MAX_IO_THREADS:
        raise UsageError(f"--io-threads {args.io_threads}: must be 1..{MAX_IO_THREADS} "
                         "(ZeroMQ I/O threads; 1 is enough below a few GB/s)")
    if topo.transport == "ipc":
        if not Path(args.sock_dir).is_dir():
            raise UsageError(f"--sock-dir {args.sock_dir}: no such folder; create it or give "
                             "an existing one (the same for every process of the fabric)")
        if not os.access(args.sock_dir, os.W_OK | os.X_OK):
            raise UsageError(f"--sock-dir {args.sock_dir}: cannot create sockets in it "
                             "(not writable); give a folder you can write to")
        try:
            topo.bind_address(args.name, args.sock_dir)  # the ipc path length limit
        except TopologyError as exc:
            raise UsageError(str(exc)) from None
    if args.faults is not None:
        from fabric.core.faults import FaultSpecError, parse_faults

        try:
            parse_faults(args.faults)
        except FaultSpecError as exc:
            raise UsageError(f"--faults: {exc}") from None
    from switchd.plugins import load_services

    load_services(args.service)  # a bad name is one line here, not a daemon's traceback
    daemon = SwitchDaemon(topo, args.name, Path(args.sock_dir), ctl_addr=args.ctl,
                          memory_budget=args.memory_mb * 2**20, io_threads=args.io_threads,
                          faults=args.faults, seed=args.seed, services=args.service,
                          run_id=args.run_id)
    daemon.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m switchd`."""
    from fabric.errors import UsageError

    p = argparse.ArgumentParser(prog="semfab switchd", description="Run one switch daemon.")
    add_arguments(p)
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run(args)
    except UsageError as exc:
        print(f"semfab switchd: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
