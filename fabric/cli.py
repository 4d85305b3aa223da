"""The `semfab` command line.

Each subcommand lives in the module that owns the work; this file only builds
the parser and maps errors to exit codes: a bad argument or file prints one
line ``semfab: error: ...`` and exits 2, a failed run prints one such line and
exits 1, Ctrl-C exits 130. ``-v``/``-vv`` (INFO/DEBUG logs) are accepted
before or after the subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from fabric.errors import SemfabError, UsageError
from fabric.info import semfab_version

DESCRIPTION = """\
semfab: an in-network aggregation and custom interconnect emulator.

Launch a fabric of worker processes and switch daemons on this machine (or
many), run collectives and token streams through emulated switches, and
benchmark in-network reduction against host-staged paths and real libraries.
"""

EPILOG = """\
quick start:
  semfab bench                      quick default allreduce comparison (2 and 4 workers)
  semfab bench allreduce -b 4K -e 64M -f 4 --workers 2,4 --json out.json --plot out.png
  semfab bench all_gather -b 64K -e 4M --workers 2,4   also reduce_scatter, broadcast,
                                    reduce, alltoall, sendrecv (docs/BENCHMARKS.md)
  semfab launch --workers 4 --run examples/allreduce_paths.py:work
  semfab bench loss --loss 0,0.01,0.05 --policy selective,gbn
  semfab serve                      OpenAI-compatible token stream over the fabric
  semfab bench tokens --concurrency 1,8 --transport direct,host-staged
  semfab model --model deepseek-v3 --ep 32   a sharded decode step's compute and bytes
  semfab bench decode --tp 2 --ep 2         that decode loop on the fabric, timed per part
  semfab info                       kernel backends, GPU, library versions
  semfab bench frames --json f.json frame codec cost beside msgpack
  semfab topo check FILE.toml       validate a topology file

docs: README.md, docs/DESIGN.md, docs/ARCHITECTURE.md, docs/PROTOCOL.md,
      docs/TOPOLOGY.md, docs/AGGREGATION.md, docs/RELIABILITY.md, docs/SERVING.md,
      docs/PEERS.md, docs/BENCHMARKS.md, docs/MODELS.md
"""

log = logging.getLogger("semfab.cli")

# Help texts that already say their default, in the words of the option.
_STATES_DEFAULT = re.compile(r"\(default\b|\bdefault:", re.IGNORECASE)


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default once: not when its help states it, nor when there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            _STATES_DEFAULT.search(text)
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or isinstance(action, argparse._CountAction)
        ):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument the way every semfab command does: one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    """Import a subcommand's module only when it runs, so `--help` stays fast."""

    def call(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), func)(args))

    return call


def _add_lazy_parser(
    sub: argparse._SubParsersAction,
    name: str,
    help_text: str,
    module: str,
    adder: str = "add_arguments",
    runner: str = "run",
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
    getattr(importlib.import_module(module), adder)(p)
    p.set_defaults(func=_lazy(module, runner))
    return p


def build_parser() -> argparse.ArgumentParser:
    """The whole `semfab` parser (also used by the docs and tests)."""
    parser = _Parser(
        prog="semfab", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"semfab {semfab_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="progress logs (-vv: debug); also accepted after the subcommand")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="show kernel backends, GPU and library versions",
                       description="Show the detected kernel backends (available, or why not), "
                       "the GPU if any, and the versions semfab runs with.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_lazy("fabric.info", "run"))

    bench = sub.add_parser("bench", help="run benchmarks (no subcommand: the quick default)",
                           description="Benchmarks. With no subcommand, runs the quick default "
                           "comparison.", formatter_class=_Formatter)
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_lazy_parser(bsub, "frames", "frame codec encode+decode rate and header overhead, "
                     "beside msgpack", "bench.frames")
    _add_lazy_parser(bsub, "allreduce", "allreduce on every path (ina, ina-mem, host-ps, "
                     "host-ring) and the peers (gloo, MPI), nccl-tests style", "bench.allreduce")
    from bench.collectives import HELP as _COLLECTIVE_HELP

    for kind, text in _COLLECTIVE_HELP.items():
        _add_lazy_parser(bsub, kind, text, "bench.collectives", adder=f"add_{kind}_arguments")
    _add_lazy_parser(bsub, "loss", "goodput and retransmissions under injected loss: "
                     "selective repeat vs go-back-N (p2p) and in-network allreduce",
                     "bench.loss")
    _add_lazy_parser(bsub, "tokens", "the token delivery chain, layer by layer: TTFT, TPOT, ITL, "
                     "E2EL, per-layer breakdown, semantic distance per token", "bench.tokens")
    _add_lazy_parser(bsub, "wakeup", "how soon a doorbell's sleeping reader runs after a ring, "
                     "with and without the writer's handoff", "bench.wakeup")
    _add_lazy_parser(bsub, "core", "the protocol's own cost per allreduce: switch core and member "
                     "programs in one process, no IPC", "bench.core")
    _add_lazy_parser(bsub, "relay", "the floor of the frame plane's design: workers' buffers "
                     "summed by one ZeroMQ relay process, no protocol", "bench.relay")
    _add_lazy_parser(bsub, "incast", "N senders into one receiver on real processes, beside "
                     "the same run simulated: queues, ECN, trimming, congestion-control policies "
                     "(--cc)", "bench.incast")
    _add_lazy_parser(bsub, "moe", "MoE dispatch and combine, flat / hierarchical / in-network, "
                     "on a star or leaf/spine at several oversubscription ratios (emulated or "
                     "--sim)",
                     "bench.moe")
    _add_lazy_parser(bsub, "decode", "a sharded model's decode loop (--model, --tp, --ep, "
                     "--pp): inter-token latency and its parts (compute, TP, EP dispatch and "
                     "combine, PP), emulated or --sim", "bench.decode")
    bench.set_defaults(func=_default_bench)
    _add_lazy_parser(sub, "serve", "bring the token chain up: generator workers, the fabric, "
                     "detokenizer and an OpenAI-compatible streaming endpoint",
                     "fabric.serving.cli")

    _add_lazy_parser(sub, "model", "a sharded model's decode step (presets tiny, mixtral-8x7b, "
                     "deepseek-v3; --tp/--ep/--pp/--dp): compute per part and bytes per "
                     "collective", "fabric.serving.model_cli")

    _add_lazy_parser(sub, "launch", "start a fabric (switches, host, workers); run a function "
                     "on every worker or keep it up until Ctrl-C", "fabric.emulation.launch_cli")
    _add_lazy_parser(sub, "sim", "simulate the fabric in virtual time: allreduce tables, "
                     "the scaling study (workers x oversubscription x path)", "fabric.sim.cli")
    _add_lazy_parser(sub, "run", "one process of a fabric placed by mpirun or srun: takes its "
                     "node from the launcher's rank, joins the rendezvous, runs the workload",
                     "fabric.emulation.run_cli")
    _add_lazy_parser(sub, "switchd", "run one switch daemon (for srun/mpirun/ssh placement)",
                     "switchd.cli")
    _add_lazy_parser(sub, "node", "run one worker or host node (for srun/mpirun/ssh placement)",
                     "fabric.emulation.node")
    _add_lazy_parser(sub, "stats", "show the live counters of a running fabric's switches",
                     "fabric.emulation.launch_cli", adder="add_stats_arguments", runner="run_stats")
    _add_lazy_parser(sub, "compare", "saved allreduce runs side by side: busbw, time and the "
                     "ratio to the first, per path, workers and size", "bench.compare")

    topo = sub.add_parser("topo", help="check or generate topology files",
                          description="Topology files (TOML): see docs/TOPOLOGY.md.")
    tsub = topo.add_subparsers(dest="topo_command", metavar="TOPO", required=True)
    p = tsub.add_parser("check", help="validate a topology file and summarise it",
                        add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_passthrough("fabric.core.topology", "check_main"))
    p = tsub.add_parser("gen", help="write a star or leaf/spine topology file", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_passthrough("fabric.core.topology", "gen_main"))
    _add_verbose_after_subcommands(parser)
    return parser


def _add_verbose_after_subcommands(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand its own -v, so `semfab bench allreduce -v` works too.

    Its own dest, left unset unless given: a subparser's namespace is copied
    over the parent's, and would otherwise reset a -v given before it.
    """
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for sub in action.choices.values():
            # add_help=False marks a passthrough whose REMAINDER owns every flag
            if sub.add_help and "-v" not in sub._option_string_actions:
                sub.add_argument("-v", "--verbose", dest="sub_verbose", action="count",
                                 default=argparse.SUPPRESS, help="progress logs (-vv: debug)")
            _add_verbose_after_subcommands(sub)


def _passthrough(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    """Hand the remaining argv to a module that owns its own argparse parser."""

    def call(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), func)(list(args.rest)))

    return call


def _default_bench(args: argparse.Namespace) -> int:
    """`semfab bench` alone: the quick default allreduce comparison on a 2-worker star."""
    from bench import allreduce

    return allreduce.run(allreduce.quick_args())


def _on_sigterm(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "topo" and argv[1] in ("check", "gen"):
        # the topology module owns these parsers (flags included)
        from fabric.core import topology

        return (topology.check_main if argv[1] == "check" else topology.gen_main)(argv[2:])
    # SIGTERM (a job scheduler, `timeout`) unwinds like Ctrl-C, so every
    # launched process and socket folder is cleaned up
    signal.signal(signal.SIGTERM, _on_sigterm)
    parser = build_parser()
    try:
        # Known args first, so an unknown flag is reported against its own subcommand.
        args, extra = parser.parse_known_args(argv)
        command = " ".join(["semfab"] + [
            name for name in (getattr(args, k, None) for k in ("command", "bench_command",
                                                                "topo_command")) if name])
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} "
                             f"(see '{command} --help')")
    except UsageError as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 2
    # Sub-CLIs read args.verbose (e.g. to pass -v on to the processes they start).
    args.verbose += getattr(args, "sub_verbose", 0)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    log.debug("arguments: %s", vars(args))
    log.info("%s: started", command)
    t0 = time.monotonic()
    try:
        code = args.func(args)
    except UsageError as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 2
    except SemfabError as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("semfab: interrupted", file=sys.stderr)
        return 130
    log.info("%s: done in %.1f s (exit %d)", command, time.monotonic() - t0, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
