"""`semfab run`: one process of a fabric placed by mpirun, srun or any launcher.

    mpirun -np 5 --host hostA:3,hostB:2 semfab run --topology T.toml \\
        --workload work.py:main --rendezvous hostA:29400
    srun -N 2 -n 5 semfab run --topology T.toml --workload work.py:main \\
        --rendezvous $(hostname):29400

Every process takes its rank from the launcher (Open MPI, PMIx, MPICH/PMI,
Slurm, torchrun variables) or from --rank/--world, and its node from the
topology's placement ([fabric.host_addresses]: which node runs on which
host). Rank 0 hosts the rendezvous, runs the workload on the workers and
prints the report (results, clock offsets, switch counters). The same
topology and workload run on one machine with `semfab launch`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fabric.errors import UsageError, check_seconds, parse_json

log = logging.getLogger("semfab.run")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab run`."""
    p.add_argument("--topology", required=True,
                   help="the topology file; transport = \"tcp\" and [fabric.host_addresses] "
                   "place its nodes on hosts (docs/TOPOLOGY.md)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", metavar="FILE.py:FUNC|MODULE:FUNC",
                      help="FUNC(ep, *args) runs on every worker (the same function "
                      "`semfab launch --run` takes)")
    what.add_argument("--bench-tokens", metavar="FLAGS", default=None,
                      help="run `semfab bench tokens FLAGS` on the placed fabric instead: "
                      "the generator on the workers, the token host and its HTTP server "
                      "on host0, the client on rank 0; every token stamp on rank 0's "
                      "clock (e.g. --bench-tokens \"--concurrency 1,8 --num-prompts 32\")")
    p.add_argument("--serve-port", type=int, default=8000,
                   help="port of host0's HTTP server for --bench-tokens (on host0's address)")
    p.add_argument("--args", default="[]",
                   help="JSON list (positional) or object (keywords) of FUNC's arguments")
    p.add_argument("--rendezvous", metavar="HOST:PORT",
                   help="where rank 0 listens and every rank joins (default: "
                   "SEMFAB_RENDEZVOUS, or MASTER_ADDR:MASTER_PORT)")
    p.add_argument("--name", default=None,
                   help="play this node instead of the one the placement gives")
    p.add_argument("--rank", type=int, help="this process's rank (default: the launcher's)")
    p.add_argument("--world", type=int, help="number of processes (default: the launcher's)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds any wait on a peer may take; a process silent this long "
                   "ends the run on every host")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="seconds for every rank to join and start")
    p.add_argument("--sock-dir", default=None,
                   help="folder of ipc sockets (one-host topologies; default: "
                   "/tmp/semfab-run-<port>)")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the report here")


def run(args: argparse.Namespace) -> int:
    """One process of a placed run; rank 0 prints the report."""
    from fabric.core.placement import launcher_rank
    from fabric.core.topology import TopologyError, load
    from fabric.emulation.launch_cli import _split_ref, check_dir, check_output_file
    from fabric.emulation.rendezvous import PlacedRun, format_report, rendezvous_of

    check_seconds("--timeout", args.timeout)
    check_seconds("--join-timeout", args.join_timeout)
    if not Path(args.topology).is_file():
        raise UsageError(f"topology file {args.topology} not found")
    try:
        topo = load(args.topology)
    except TopologyError as exc:
        raise UsageError(str(exc)) from None
    if args.name:
        try:
            topo.node(args.name)
        except TopologyError as exc:
            raise UsageError(f"--name: {exc}") from None
    extra: Any = parse_json(args.args, "--args")
    if not isinstance(extra, (list, dict)):
        raise UsageError("--args must be a JSON list or object, e.g. '[1024]'")
    driver = None
    if args.bench_tokens is not None:
        driver = _bench_tokens_driver(args.bench_tokens, topo)
        if not 1 <= args.serve_port <= 65535:
            raise UsageError(f"--serve-port {args.serve_port} is not 1..65535")
        module, func, file = "bench.tokens", "bench-tokens", None
    else:
        module, func, file = _split_ref(args.workload, "--workload")
    if args.rank is not None or args.world is not None:
        if args.rank is None or args.world is None or not 0 <= args.rank < args.world:
            raise UsageError("give --rank R and --world N together, with 0 <= R < N")
        rank, world = args.rank, args.world
    else:
        got = launcher_rank(os.environ)
        if got is None:
            raise UsageError("no launcher rank: start under mpirun or srun, or give --rank and "
                             "--world (on one machine `semfab launch` does it all)")
        rank, world = got
    if args.json and rank == 0:
        check_output_file("--json", args.json)
    if args.sock_dir:
        check_dir("--sock-dir", args.sock_dir)  # on this host, before joining
    placed = PlacedRun(topo, str(Path(args.topology).resolve()), rank, world,
                       rendezvous_of(args.rendezvous, os.environ), (module, func, file),
                       extra if isinstance(extra, list) else [],
                       extra if isinstance(extra, dict) else {}, name=args.name or "",
                       timeout_s=args.timeout, join_timeout_s=args.join_timeout,
                       sock_dir=args.sock_dir or "", driver=driver,
                       serve_port=args.serve_port)
    code, report, error = placed.execute()
    if error:
        print(f"semfab: error: rank {rank}: {error}", file=sys.stderr)
    if report is not None:
        print(format_report(report), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
            print(f"# wrote {args.json}", file=sys.stderr)
    if report is not None and driver is not None and report["results"].get("driver"):
        code = code or 1  # the benchmark's own failure (a failed row)
    return 1 if error and not code else code


def _bench_tokens_driver(flags: str, topo: Any) -> Any:
    """The token benchmark as rank 0's driver; its flags checked here, on every rank."""
    import shlex

    from bench import tokens

    parser = argparse.ArgumentParser(prog="semfab run --bench-tokens", add_help=False,
                                     exit_on_error=False)
    tokens.add_arguments(parser)
    try:
        words = shlex.split(flags)
        ns, extra = parser.parse_known_args(words)
    except (argparse.ArgumentError, ValueError) as exc:
        raise UsageError(f"--bench-tokens: {exc}") from None
    if extra:
        raise UsageError(f"--bench-tokens: unknown flag(s) {' '.join(extra)} "
                         "(see `semfab bench tokens --help`)")
    if ns.base_url:
        raise UsageError("--bench-tokens: --base-url runs a pure client; run it with "
                         "`semfab bench tokens` instead")
    hosts = {n.name for n in topo.hosts}
    if "--transport" not in words and "host1" not in hosts:
        ns.transport = "direct"  # the default pair needs a relay host
    if "host0" not in hosts:
        raise UsageError("--bench-tokens needs a host node named host0 in the topology")
    if "host-staged" in ns.transport.split(",") and "host1" not in hosts:
        raise UsageError("--bench-tokens: --transport host-staged needs a second host node "
                         "host1 (the relay) in the topology")
    if "--workers" in words and ns.workers != len(topo.workers):
        raise UsageError(f"--bench-tokens: --workers {ns.workers}, but the topology has "
                         f"{len(topo.workers)} workers (the topology decides; drop --workers)")
    ns.workers = len(topo.workers)
    tokens.options(ns)  # every other check of `semfab bench tokens`

    def drive(fab: Any) -> int:
        return int(tokens.run(ns, fab=fab))

    return drive
