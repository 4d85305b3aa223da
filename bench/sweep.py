"""The nccl-tests style sweep shared by `semfab bench allreduce` and `semfab bench <collective>`.

Everything the benches of the collective set do the same way: the flags
(nccl-tests' ``-b/-e/-f``, ``-w/-n``, ``-d/-o``, ``-c``, ``--repeat``, the
worker counts, topology, link shaping and faults), their checks before any
process starts, the parameter header, rows printed as each size finishes, one
fabric per worker count with every semfab path on it, the peers in the same
run, ``--repeat`` medians with their spread, the side-by-side table per worker
count, the footer, and the JSON/Markdown/PNG files (each announced when
written). A bench supplies only what differs: its name and paths, how one size
is measured on a fabric, and how a peer is run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import report
from fabric.emulation.endpoint import DTYPE_NAMES, OPS
from fabric.errors import FabricTimeout, PeerFailed, UsageError

log = logging.getLogger("semfab.bench.sweep")

#: The real-library peers, also the ``path`` of their rows.
PEERS = ("gloo", "mpi")

#: nccl-tests' dtype names (``-d``) and ours, mapped to ours.
NCCL_DTYPES = {
    "float": "float32", "float32": "float32", "f32": "float32",
    "half": "float16", "float16": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "int": "int32", "int32": "int32",
    "int64": "int64",
}
#: nccl-tests' dtypes the switches do not reduce.
NCCL_UNSUPPORTED_DTYPES = ("int8", "char", "uint8", "uint32", "uint64", "double", "float64",
                           "f64", "fp8_e4m3", "fp8_e5m2", "f8e4m3", "f8e5m2")
#: nccl-tests' ops the switches do not reduce, and why.
NCCL_UNSUPPORTED_OPS = {
    "prod": "the switches and host paths reduce with sum, max and min only",
    "avg": "the switches and host paths reduce with sum, max and min only (an average is a "
           "sum divided by the worker count)",
    "premulsum": "the switches and host paths reduce with sum, max and min only",
}
#: A percentile needs about this many samples before it is a tail, not the maximum.
P99_MIN_SAMPLES = 100

Row = report.AllreduceRow
#: ``measure(fab, path, workers, size, dtype, op, args)``: one row of one size.
Measure = Callable[[Any, str, int, int, str, str, argparse.Namespace], Row]
#: ``run_peer(peer, workers, sizes, args, dtype, op)``: one row per size.
RunPeer = Callable[[str, int, list[int], argparse.Namespace, str, str], list[Row]]


# --------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, all_paths: Sequence[str], *, sim_help: str,
                  op_help: str | None = None, root: bool = False,
                  dtype_help: str | None = None) -> None:
    """The flags of a sweep (nccl-tests style where they overlap).

    ``op_help`` None: the bench does not reduce (``-o`` is accepted only to say
    so). ``root``: a ``-r/--root`` flag (broadcast, reduce).
    """
    p.add_argument("-b", "--begin", default="4K", help="smallest size in bytes (4K, 1M, ...)")
    p.add_argument("-e", "--end", default="64M", help="largest size in bytes")
    p.add_argument("-f", "--factor", type=float, default=4, help="size multiplication factor")
    p.add_argument("--workers", default=None,
                   help="worker counts, comma-separated (default: 2,4; with --topology, the "
                   "file's count); 1..8 launched, any count the simulator holds with --sim")
    p.add_argument("--paths", default=",".join(all_paths),
                   help=f"comma-separated, from: {', '.join(all_paths)}")
    p.add_argument("-d", "--dtype", default="float32",
                   help=dtype_help or "float32 (nccl: float), float16 (half), bfloat16 (bf16), "
                   "int32 (int), int64; comma-separated, or 'all' for every one")
    if op_help is None:
        p.add_argument("-o", "--op", default=None,
                       help="refused: this collective does not reduce (its redop is none)")
    else:
        p.add_argument("-o", "--op", default="sum", help=op_help)
    if root:
        p.add_argument("-r", "--root", type=int, default=0, help="the root rank")
    p.add_argument("-w", "--warmup", type=int, default=3, help="untimed iterations per size")
    p.add_argument("-n", "--iters", type=int, default=10, help="timed iterations per size")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                   help="1: count wrong elements, 0: do not")
    p.add_argument("--inplace", default="both", choices=("0", "1", "both"),
                   help="nccl-tests' halves: 0 out-of-place only, 1 in-place only, both "
                   "(default: out-of-place, then in-place, each size)")
    p.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="K independent runs of the whole sweep: time is the median over runs, "
                   "with the spread (min..max)")
    p.add_argument("--seed", type=int, default=0, help="input (and fault) seed")
    p.add_argument("--topology", help="a topology file (default: a star of --workers)")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="shape every link of the default star to this bandwidth (0: unshaped)")
    p.add_argument("--link-latency-us", type=float, default=0.0,
                   help="one-way latency added on every link of the default star")
    p.add_argument("--faults", metavar="SPEC",
                   help="faults on every link, e.g. 'loss=0.01,reorder=0.05:2' "
                   "(docs/RELIABILITY.md)")
    p.add_argument("--cc", metavar="POLICY",
                   help="streams' congestion-control policy (none, nscc, dcqcn), over the "
                   "topology's [congestion] cc; buffers, ECN and trimming come from that "
                   "table (docs/CONGESTION.md)")
    p.add_argument("--json", metavar="PATH",
                   help="write every row and every setting of the run as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the header and tables as Markdown")
    p.add_argument("--plot", metavar="PATH",
                   help="write busbw and latency (time) against size as PNG, two panels")
    p.add_argument("--run-dir", help="where process logs go (default: ./runs/<stamp>)")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the process logs of a clean run (removed by default)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any single wait may take before the run fails")
    p.add_argument("--sim", action="store_true", help=sim_help)
    from fabric.sim.cli import add_executor_arguments

    add_executor_arguments(p)  # --jobs, --executor: the points of a --sim sweep
    # nccl-tests flags that have no meaning here: accepted only to say why
    p.add_argument("-g", "--ngpus", metavar="N", default=None,
                   help="nccl-tests' GPUs per thread: refused (workers are processes; use "
                   "--workers)")
    p.add_argument("-t", "--nthreads", metavar="N", default=None,
                   help="nccl-tests' threads per process: refused (workers are processes; use "
                   "--workers)")


def places(args: argparse.Namespace) -> tuple[str, ...]:
    """The halves ``--inplace`` asks for, in nccl-tests' order: ``"out"``, ``"in"``."""
    which = str(getattr(args, "inplace", "both"))
    return {"0": ("out",), "1": ("in",)}.get(which, ("out", "in"))


def peer_place(peer: str, collective: str) -> str:
    """The half a peer's call is (``"in"`` or ``"out"``): gloo's all_reduce,
    broadcast and reduce work on one tensor, MPI's Bcast on one buffer; the
    other calls take a separate output. The peers time that one form only."""
    if peer == "gloo" and collective in ("allreduce", "broadcast", "reduce"):
        return "in"
    if peer == "mpi" and collective == "broadcast":
        return "in"
    return "out"


def refuse_nccl_only(args: argparse.Namespace) -> None:
    """nccl-tests' ``-g``/``-t`` have no meaning here: refused with the reason."""
    if getattr(args, "ngpus", None) is not None:
        raise UsageError(f"-g/--ngpus {args.ngpus}: there are no GPUs to count here: every rank "
                         "is a worker process of its own; use --workers N for N ranks")
    if getattr(args, "nthreads", None) is not None:
        raise UsageError(f"-t/--nthreads {args.nthreads}: ranks are not threads here: every "
                         "rank is a worker process of its own; use --workers N for N ranks")


def parse_dtypes(text: str, carried_by: str = "the switches reduce") -> list[str]:
    """``-d``: our names or nccl-tests' (float, half, bf16, int, int64), a list, or 'all'."""
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if names == ["all"]:
        return list(DTYPE_NAMES)
    supported = ("float32 (nccl: float), float16 (half), bfloat16 (bf16), int32 (int) and "
                 "int64; -d all runs every one")
    out: list[str] = []
    for name in names:
        if name in NCCL_UNSUPPORTED_DTYPES:
            raise UsageError(f"--dtype {name}: not supported: {carried_by} {supported}")
        if name not in NCCL_DTYPES:
            raise UsageError(f"--dtype {name!r}: unknown; use {supported}")
        if NCCL_DTYPES[name] not in out:
            out.append(NCCL_DTYPES[name])
    if not out:
        raise UsageError(f"--dtype: give one of {supported}")
    return out


def parse_ops(text: str) -> list[str]:
    """``-o``: sum, max, min, a list, or 'all' (nccl's prod/avg refused with the reason)."""
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if names == ["all"]:
        return list(OPS)
    out: list[str] = []
    for name in names:
        if name in NCCL_UNSUPPORTED_OPS:
            raise UsageError(f"--op {name}: not supported: {NCCL_UNSUPPORTED_OPS[name]}; "
                             "use sum, max or min (-o all runs the three)")
        if name not in OPS:
            raise UsageError(f"--op {name!r}: use sum, max or min (-o all runs the three)")
        if name not in out:
            out.append(name)
    if not out:
        raise UsageError("--op: give sum, max, min or all")
    return out


@dataclasses.dataclass
class Plan:
    """What one sweep will run, parsed and checked."""

    sizes: list[int]
    workers: list[int]
    paths: list[str]
    dtypes: list[str]
    ops: list[str]

    @property
    def ours(self) -> list[str]:
        return [p for p in self.paths if p not in PEERS]

    @property
    def peers(self) -> list[str]:
        return [p for p in self.paths if p in PEERS]


def parse_plan(args: argparse.Namespace, all_paths: Sequence[str], *,
               ops: list[str] | None = None,
               carried_by: str = "the switches reduce") -> Plan:
    """The checked plan of a sweep; ``ops`` given (e.g. ``["none"]``) skips ``-o``."""
    refuse_nccl_only(args)
    try:
        sizes = report.size_range(args.begin, args.end, args.factor)
    except ValueError as exc:
        raise UsageError(f"sizes: {exc}") from None
    workers = worker_counts(args)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in all_paths]
    if bad or not paths:
        raise UsageError(f"unknown path(s) {', '.join(bad) or repr(args.paths)}; choose from "
                         f"{', '.join(all_paths)}")
    dtypes = parse_dtypes(args.dtype, carried_by)
    op_list = ops if ops is not None else parse_ops(args.op)
    if args.link_gbps < 0 or args.link_latency_us < 0:
        raise UsageError("--link-gbps and --link-latency-us must be >= 0")
    check_cc(getattr(args, "cc", None), paths)
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0")
    if not 1 <= getattr(args, "repeat", 1) <= 1000:
        raise UsageError(f"--repeat {args.repeat}: must be 1..1000 runs of the sweep")
    for dtype in dtypes:
        item = report.dtype_itemsize(dtype)
        if any(s % item for s in sizes):
            raise UsageError(f"every size must be a multiple of the {dtype} size ({item} B)")
    # every worker's input, output and in-place buffer live on this machine
    report.check_memory(f"--end {args.end} with {max(workers)} workers",
                        3 * max(sizes) * max(workers))
    plan = Plan(sizes, workers, paths, dtypes, op_list)
    check_run_inputs(args, workers, bool(plan.ours))
    from fabric.sim.cli import check_executor

    check_executor(args, sim=bool(getattr(args, "sim", False)))
    return plan


#: Most workers launched as processes on one machine (emulation); --sim takes up to
#: SIM_MAX_WORKERS, as `semfab sim` does (memory, not the code, is the limit there).
EMULATED_MAX_WORKERS = 8
SIM_MAX_WORKERS = 65536


def worker_counts(args: argparse.Namespace) -> list[int]:
    """``--workers``, checked: 1..8 launched, 1..65536 simulated. Omitted: the
    ``--topology`` file's count (2,4 without one); given, the file must agree
    (a UsageError of one line says so)."""
    from fabric.core.topology import TopologyError, load

    sim = bool(getattr(args, "sim", False))
    have = None
    if args.topology:
        try:
            have = len(load(args.topology).workers)
        except TopologyError as exc:
            raise UsageError(str(exc)) from None
    if args.workers is None:
        workers = [have] if have is not None else [2, 4]
    else:
        try:
            workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
        except ValueError:
            raise UsageError(f"--workers must be integers like 2,4; got {args.workers!r}"
                             ) from None
        if not workers:
            raise UsageError(f"--workers must be integers like 2,4; got {args.workers!r}")
    top = SIM_MAX_WORKERS if sim else EMULATED_MAX_WORKERS
    if any(not 1 <= w <= top for w in workers):
        if args.workers is None:  # the count came from the file
            raise UsageError(f"--topology {args.topology} has {have} workers; this benchmark "
                             f"runs 1..{top} {'simulated' if sim else 'launched on one machine'}"
                             + ("" if sim else " (add --sim for more)"))
        if sim:
            raise UsageError(f"--workers: each count must be 1..{top} in the simulator")
        raise UsageError(f"--workers: each count must be 1..{top} launched on one machine "
                         "(add --sim for more: the simulator runs 1024+ workers)")
    if have is not None and args.workers is not None and any(w != have for w in workers):
        raise UsageError(f"--topology {args.topology} has {have} workers but --workers asks "
                         f"for {args.workers}; pass --workers {have} or leave --workers out")
    return workers


def check_run_inputs(args: argparse.Namespace, workers: list[int], fabric: bool) -> None:
    """Files, folders and links, checked before any process starts (not after a long run)."""
    from fabric.core.topology import TopologyError, load, star
    from fabric.emulation.launch_cli import check_outputs
    from fabric.errors import check_seconds

    check_seconds("--timeout", args.timeout)
    try:
        if args.topology:
            have = len(load(args.topology).workers)
            if fabric and any(w != have for w in workers):  # worker_counts says so first
                raise UsageError(f"--topology {args.topology} has {have} workers but "
                                 f"--workers asks for {','.join(map(str, workers))}")
        else:
            star(1, bandwidth_gbps=args.link_gbps, latency_us=args.link_latency_us)
    except TopologyError as exc:
        raise UsageError(str(exc).replace("<star>: ", "--link-gbps/--link-latency-us: ")) from None
    if getattr(args, "faults", None):
        from fabric.core.faults import FaultSpecError, parse_faults

        try:
            parse_faults(args.faults)
        except FaultSpecError as exc:
            raise UsageError(f"--faults: {exc}") from None
    check_outputs(args, ("json", "markdown", "plot", "trace"), ("run_dir",))


# --------------------------------------------------------------------------
# Topology, links and the machine, as the header tells them
# --------------------------------------------------------------------------


def topology(args: argparse.Namespace, workers: int) -> Any:
    """The topology of ``workers``: the file, or the default star with the link flags;
    ``--cc`` over its ``[congestion] cc``."""
    from fabric.core.topology import load, star

    if args.topology:
        topo = load(args.topology)
    else:
        topo = star(workers, bandwidth_gbps=args.link_gbps, latency_us=args.link_latency_us)
    cc = getattr(args, "cc", None)
    if cc:
        topo = topo.with_congestion(dataclasses.replace(topo.congestion, cc=cc))
    return topo


def queue_figures(results: list[Any]) -> dict[str, Any]:
    """What the switches' queues did over simulations (``SimResult``s): drops, trims,
    ECN marks and the fullest egress queue, and what credit-controlled links waited;
    empty without ``[congestion]`` buffers or credit waits."""
    peaks: dict[str, int] = {}
    for r in results:
        for port, b in r.queue_peaks.items():
            peaks[port] = max(peaks.get(port, 0), b)
    stalls = sum(r.credit_stalls for r in results)
    if not peaks and not stalls:
        return {}
    out: dict[str, Any] = {
        "overflow_drops": sum(r.overflow_drops for r in results),
        "trims": sum(r.trims for r in results),
        "ecn_marks": sum(r.ecn_marks for r in results),
        "pauses": sum(r.pauses for r in results),
        "paused_s": sum(r.paused_s for r in results),
        "credit_stalls": stalls,
        "credit_stalled_s": sum(r.credit_stalled_s for r in results)}
    if peaks:
        port = max(peaks, key=lambda k: peaks[k])
        out["peak_queue"] = [port, peaks[port]]
    return out


def recovery_note(retransmits: int, replays: int) -> str:
    """The resends of simulations, in words, for a row's note: end to end, and by
    links with link-level retry ("" when none)."""
    out = f"; {retransmits} retransmissions" if retransmits else ""
    return out + (f"; {replays} link replays (link-level retry)" if replays else "")


def queue_note(q: dict[str, Any]) -> str:
    """:func:`queue_figures` in words, for a row's note ("" without buffers)."""
    if not q:
        return ""
    credit = (f"; credit: {q['credit_stalls']} frames waited for it, links idle "
              f"{q['credit_stalled_s'] * 1e3:.2f} ms in all" if q.get("credit_stalls") else "")
    if "peak_queue" not in q:
        return credit
    port, peak = q["peak_queue"]
    pfc = (f", {q['pauses']} PFC pauses ({q['paused_s'] * 1e3:.2f} ms of links paused)"
           if q.get("pauses") else "")
    return (f"; queues: {q['overflow_drops']} drops, {q['trims']} trims, {q['ecn_marks']} "
            f"ECN marks{pfc}, fullest {port} at {peak} B{credit}")


def congestion_text(topo: Any) -> str:
    """The topology's ``[congestion]`` settings, in words, for the header."""
    table = topo.congestion.to_table()
    if not table:
        return "none (queues never fill; streams keep the reliability window alone)"
    return ", ".join(f"{k} {v}" for k, v in table.items())


def parse_ratios(text: str) -> list[float]:
    """``--oversubscription``: leaf down:up ratios like ``1,2,4`` (each 1..64)."""
    try:
        ratios = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--oversubscription takes numbers like 1,2,4; got {text!r}") from None
    if not ratios or any(not 1 <= r <= 64 for r in ratios):
        raise UsageError("--oversubscription: each ratio must be between 1 and 64")
    return ratios


def parse_moe_variants(text: str) -> list[str]:
    """``--variants``: MoE dispatch/combine variants, comma-separated."""
    from fabric.core.moe import MOE_VARIANTS

    variants = [v.strip() for v in text.split(",") if v.strip()]
    if not variants or any(v not in MOE_VARIANTS for v in variants):
        raise UsageError(f"--variants: choose from {', '.join(MOE_VARIANTS)}")
    return variants


def add_queue_arguments(p: argparse.ArgumentParser) -> None:
    """``--cc``, ``--buffer`` and ``--trim``: the switches' queues and the streams'
    policy of a bench that builds its own fabric (read by :func:`queue_settings`)."""
    p.add_argument("--cc", metavar="POLICY",
                   help="streams' congestion-control policy (none, nscc, dcqcn; default: "
                   "none at all)")
    p.add_argument("--buffer", metavar="BYTES",
                   help="each switch's shared buffer (default: unbounded queues)")
    p.add_argument("--trim", action="store_true",
                   help="with --buffer: cut a frame that does not fit to its header")
    p.add_argument("--pfc", action="store_true",
                   help="with --buffer: a lossless buffer, PFC pauses senders instead of "
                   "dropping")
    p.add_argument("--credit", action="store_true",
                   help="credit-based flow control on every link: links wait for credit "
                   "instead of queueing past it (lossless, no buffer needed)")


def lossless_settings(args: argparse.Namespace) -> tuple[bool, bool]:
    """(pfc, credit) of :func:`add_queue_arguments`' flags (checked by
    :func:`queue_settings`)."""
    return bool(getattr(args, "pfc", False)), bool(getattr(args, "credit", False))


def queue_settings(args: argparse.Namespace, paths: Sequence[str]
                   ) -> tuple[str | None, int | None, bool]:
    """(cc, buffer bytes, trim) of :func:`add_queue_arguments`' flags, checked for
    the ``paths`` (MoE variants) run (one UsageError line for a bad one;
    :func:`lossless_settings` has PFC and credit)."""
    check_cc(args.cc, paths)
    pfc, credit = lossless_settings(args)
    if credit and (pfc or args.trim):
        raise UsageError("--credit with --pfc or --trim: credit-based links are lossless by "
                         "themselves; choose one")
    if pfc and args.trim:
        raise UsageError("--pfc with --trim: a lossless class is never trimmed; choose one")
    if pfc and args.buffer is None:
        raise UsageError("--pfc pauses senders when a buffer fills: give --buffer")
    if args.buffer is None:
        if args.trim:
            raise UsageError("--trim cuts frames a full buffer has no room for: give --buffer")
        return args.cc, None, False
    try:
        n = report.parse_size(args.buffer)
    except ValueError as exc:
        raise UsageError(f"--buffer {args.buffer}: {exc}") from None
    if n < 1:
        raise UsageError(f"--buffer {args.buffer}: must be a positive number of bytes")
    return args.cc, n, bool(args.trim)


#: Paths and MoE variants whose every sender is a stream, whose receivers grant
#: credit: the ones a receiver-driven policy (eqds) can govern.
CREDIT_PATHS = frozenset({"host-p2p", "flat", "hierarchical", *PEERS})


def check_cc(name: str | None, paths: Sequence[str] = ()) -> None:
    """``--cc``: a registered policy the senders of ``paths`` can run (a UsageError if
    not): a receiver-driven one only where every sender is a stream."""
    from fabric.core.congestion import CC_POLICIES

    if not name:
        return
    cls = CC_POLICIES.get(name)
    if cls is None:
        raise UsageError(f"--cc {name}: unknown policy; choose {', '.join(sorted(CC_POLICIES))}")
    bad = [p for p in paths if p not in CREDIT_PATHS]
    if cls.receiver_driven and bad:
        raise UsageError(f"--cc {name}: the receiver grants credit, and only streams' "
                         f"receivers do ({', '.join(sorted(CREDIT_PATHS - set(PEERS)))}); "
                         f"{', '.join(bad)} take nscc, dcqcn or none")


def worker_link_gbps(topo: Any) -> float | None:
    """The slowest shaped link a worker sits on (Gbit/s), None when unshaped."""
    rates = [link.params.bandwidth_gbps for w in topo.workers for link in topo.links_of(w.name)
             if link.params.shaped]
    return min(rates) if rates else None


def shaped(topo: Any) -> bool:
    """Whether any link of ``topo`` is shaped or delayed."""
    return any(link.params.shaped or link.params.latency_us > 0 for link in topo.links)


def links_text(topo: Any, args: argparse.Namespace) -> str:
    """The links, in words, for the header."""
    if not args.topology:
        if args.link_gbps == 0 and args.link_latency_us == 0:
            return "unshaped (bytes move as fast as the host copies them), no added latency"
        bw = f"{args.link_gbps:g} Gbit/s" if args.link_gbps else "unshaped bandwidth"
        return f"every link of the star: {bw}, +{args.link_latency_us:g} us one way"
    kinds: dict[tuple[float, float, float], int] = {}
    for link in topo.links:
        key = (link.params.bandwidth_gbps, link.params.latency_us, link.params.loss)
        kinds[key] = kinds.get(key, 0) + 1
    parts = []
    for (rate, lat, loss), n in sorted(kinds.items()):
        part = f"{n} at {f'{rate:g} Gbit/s' if rate else 'unshaped'}, +{lat:g} us"
        parts.append(part + (f", loss {loss:g}" if loss else ""))
    return "; ".join(parts)


def cores() -> int:
    """Cores this process may run on (the affinity mask where there is one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy(args: argparse.Namespace, plan: Plan) -> tuple[int, str]:
    """The largest number of processes that spin at once, and how they add up."""
    best, text = 0, ""
    for w in plan.workers:
        if plan.ours:
            topo = topology(args, w)
            n_sw, n_host = len(topo.switches), len(topo.hosts)
            total = len(topo.workers) + n_sw + n_host
            if total > best:
                best = total
                text = (f"{len(topo.workers)} workers + {n_sw} switch{'es' if n_sw != 1 else ''}"
                        f" + {n_host} host{'s' if n_host != 1 else ''} = {total}")
        if plan.peers and w > best:
            best, text = w, f"{w} peer ranks"
    return best, text


# --------------------------------------------------------------------------
# Settings, the command that repeats them, and the header
# --------------------------------------------------------------------------


#: Environment variables that change how the fabric moves data (recorded with a run).
TUNING_ENV = ("SEMFAB_DOORBELLS", "SEMFAB_BELL_SPIN_US", "SEMFAB_SPIN_US", "OMP_WAIT_POLICY",
              "NUMBA_NUM_THREADS")


def settings(args: argparse.Namespace, plan: Plan, name: str, n_cores: int,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every parameter of the run (the JSON's ``"settings"``), and the command that repeats it.

    ``extra`` adds the bench's own settings (for the collectives: the collective
    and its root); :func:`command_line` puts a ``root`` back as ``-r``.
    """
    topo_text = None
    if args.topology:
        try:
            topo_text = Path(args.topology).read_text(encoding="utf-8")
        except OSError:
            topo_text = None
    s: dict[str, Any] = {
        "sizes": plan.sizes, "begin": plan.sizes[0], "end": plan.sizes[-1],
        "factor": args.factor, "dtypes": plan.dtypes, "ops": plan.ops,
        "warmup": args.warmup, "iters": args.iters, "repeat": getattr(args, "repeat", 1),
        "check": int(args.check), "seed": args.seed, "workers": plan.workers,
        "paths": plan.paths, "topology": args.topology, "topology_text": topo_text,
        "link_gbps": args.link_gbps, "link_latency_us": args.link_latency_us,
        "faults": getattr(args, "faults", None), "timeout_s": args.timeout,
        "cc": getattr(args, "cc", None),
        "sim": bool(getattr(args, "sim", False)), "cores": n_cores,
        "inplace": str(getattr(args, "inplace", "both")),
        # how --sim spread its points (the results do not depend on it)
        "jobs": getattr(args, "jobs", None), "executor": getattr(args, "executor", "local"),
        # the transport knobs set in the environment (doorbells, spin budgets)
        "env": {k: v for k, v in sorted(os.environ.items()) if k in TUNING_ENV},
    }
    s.update(extra or {})
    s["command"] = command_line(s, name)
    return s


def command_line(s: dict[str, Any], name: str = "allreduce") -> str:
    """The `semfab bench <name>` command that runs with settings ``s`` again."""
    words = ["semfab", "bench", name, "-b", str(s["begin"]), "-e", str(s["end"]),
             "-f", f"{s['factor']:g}", "--workers", ",".join(map(str, s["workers"])),
             "--paths", ",".join(s["paths"]),
             "-d", "all" if list(s["dtypes"]) == list(DTYPE_NAMES) else ",".join(s["dtypes"])]
    if list(s["ops"]) != ["none"]:
        words += ["-o", "all" if list(s["ops"]) == list(OPS) else ",".join(s["ops"])]
    if s.get("root") is not None:
        words += ["-r", str(s["root"])]
    words += ["-w", str(s["warmup"]), "-n", str(s["iters"]), "-c", str(s["check"]),
              "--seed", str(s["seed"])]
    if s.get("inplace", "both") != "both":
        words += ["--inplace", str(s["inplace"])]
    if s["repeat"] != 1:
        words += ["--repeat", str(s["repeat"])]
    if s["topology"]:
        words += ["--topology", s["topology"]]
    if s["link_gbps"]:
        words += ["--link-gbps", f"{s['link_gbps']:g}"]
    if s["link_latency_us"]:
        words += ["--link-latency-us", f"{s['link_latency_us']:g}"]
    if s["faults"]:
        words += ["--faults", s["faults"]]
    if s.get("cc"):
        words += ["--cc", s["cc"]]
    if s["timeout_s"] != 60.0:
        words += ["--timeout", f"{s['timeout_s']:g}"]
    if s.get("sim"):
        words.append("--sim")
    if s.get("jobs"):
        words += ["--jobs", str(s["jobs"])]
    if s.get("executor", "local") != "local":
        words += ["--executor", str(s["executor"])]
    env = [f"{k}={v}" for k, v in (s.get("env") or {}).items()]
    return " ".join([*map(shlex.quote, env), shlex.join(words)])


def header_lines(args: argparse.Namespace, plan: Plan, name: str, n_cores: int,
                 extra: Sequence[str] = (), processes: bool = True) -> list[str]:
    """The parameter header printed before any row (nccl-tests' ``# nThread ...`` lines);
    ``extra`` lines (the bench's own) come after the workers and paths.
    ``processes=False`` (simulation): no warning about busy cores."""
    from fabric.info import build, semfab_version

    sizes = plan.sizes
    repeat = getattr(args, "repeat", 1)
    try:
        loadavg = f", load average {os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        loadavg = ""
    topo0 = topology(args, plan.workers[0])
    if args.topology:
        topo_text = (f"{args.topology} ({topo0.name}: {len(topo0.workers)} workers, "
                     f"{len(topo0.switches)} switches, {len(topo0.hosts)} hosts)")
    else:
        topo_text = (f"a star per worker count ({len(topo0.switches)} switch, "
                     f"{len(topo0.hosts)} host)")
    lines = [
        f"# semfab bench {name} (semfab {semfab_version()}, {build()} build)",
        "#",
        f"# minBytes {sizes[0]} maxBytes {sizes[-1]} step: {args.factor:g}(factor) sizes: "
        f"{len(sizes)} ({' '.join(report.format_size(s) for s in sizes)})",
        f"# dtype: {', '.join(plan.dtypes)}  redop: {', '.join(plan.ops)}  validation: "
        f"{int(args.check)}" + (" (exact, every element of the last iteration)"
                                if args.check else " (not checked)"),
        f"# warmup iters: {args.warmup}  iters: {args.iters}  repeat: {repeat}  "
        f"seed: {args.seed}  timeout: {args.timeout:g} s per wait",
        f"# workers: {', '.join(map(str, plan.workers))} "
        f"({'processes, one per rank' if processes else 'simulated ranks'})  "
        f"paths: {', '.join(plan.paths)}",
        *extra,
        f"# topology: {topo_text}",
        f"# links: {links_text(topo0, args)}",
        f"# faults: {getattr(args, 'faults', None) or 'none'}",
        f"# congestion: {congestion_text(topo0)}",
        "# environment: " + (" ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                      if k in TUNING_ENV) or "defaults"),
        f"# machine: {socket.gethostname()}, {n_cores} cores{loadavg}",
        "# time: as nccl-tests: -n iterations back to back (no barrier between them), "
        "total / iters, the slowest rank's; p50/p99: over -n other iterations, each after "
        "a barrier (max over ranks), whose last is the one checked"
        + ("; with --repeat, the median over runs" if repeat > 1 else ""),
    ]
    half = {"0": "out-of-place only (--inplace 0)", "1": "in-place only (--inplace 1): the "
            "out-of-place columns show -"}.get(str(getattr(args, "inplace", "both")),
                                               "out-of-place, then in-place")
    if not processes:
        from fabric.sim.cli import executor_text

        n_points = (len(plan.workers) * len(plan.dtypes) * len(plan.ops) * len(plan.ours)
                    * len(sizes))
        lines.append(f"# sweep: {executor_text(args, n_points)} (--jobs, --executor); rows "
                     "print in order")
    lines.append(f"# halves: {half}; time algbw busbw #wrong p50 p99: out-of-place; "
                 "in:time in:algbw in:busbw in:#wrong: in-place (p50/p99 of the first half "
                 "run); - where a path has no such form")
    if plan.peers:
        lines.append(f"# time of {', '.join(plan.peers)}: the median of the barrier-separated "
                     "iterations (the peers do not time a back-to-back loop)")
    if plan.peers and shaped(topo0):
        lines.append(f"# note: {', '.join(plan.peers)} traffic is not shaped by the emulator: "
                     "the peers use this host's own transports, outside the emulated links")
    warnings = []
    n_busy, how = busy(args, plan)
    if processes and n_busy > n_cores:
        warnings.append(f"# warning: oversubscribed: {how} busy processes on {n_cores} "
                        "cores: times include waiting for a core; compare paths only within "
                        "one run")
    samples = args.iters * repeat
    if samples < P99_MIN_SAMPLES:
        warnings.append(f"# warning: p99 rests on {samples} samples per row (fewer than "
                        f"{P99_MIN_SAMPLES}): it is close to the maximum, not a tail estimate; "
                        "raise -n or --repeat for a real p99")
    return lines + (["#", *warnings] if warnings else []) + ["#"]


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


class Printer:
    """Prints rows as they finish and keeps them, per run."""

    def __init__(self, repeat: int, notes: Callable[[Row], str], root: bool = False,
                 fix: Callable[[Row], Row] | None = None) -> None:
        self.runs: list[list[Row]] = [[] for _ in range(repeat)]
        self._notes = notes
        self._root = root
        self._fix = fix

    def add(self, rep: int, row: Row) -> None:
        if self._fix is not None:
            row = self._fix(row)
        extra = self._notes(row)
        if extra:
            row.note = f"{row.note}; {extra}" if row.note else extra
        self.runs[rep].append(row)
        print(report.format_text_row(row, root=self._root), flush=True)
        log.info("%s x%d %s %s %s: %s", row.path, row.workers,
                 report.format_size(row.size_bytes), row.dtype, row.redop, row.status)


def row_notes(args: argparse.Namespace, above_link: Callable[[Row, float], str]
              ) -> Callable[[Row], str]:
    """What a row must say about the links: peers are not shaped; busbw over the link
    rate (``above_link(row, rate)`` says why, in the bench's words)."""
    topos: dict[int, Any] = {}

    def notes(row: Row) -> str:
        topo = topos.get(row.workers)
        if topo is None:
            topo = topos[row.workers] = topology(args, row.workers)
        if row.path in PEERS:
            return ("not shaped: peer traffic uses this host's own transports, not the "
                    "emulated links"
                    if shaped(topo) and not row.note.startswith("unavailable") else "")
        rate = worker_link_gbps(topo)
        if rate and row.ran and row.busbw_gbps and row.busbw_gbps * 8 > rate * 1.02:
            return above_link(row, rate)
        return ""

    return notes


def _launch(args: argparse.Namespace, w: int) -> Any:
    """A launched fabric of ``w`` workers with the run's topology, faults and timeout."""
    from fabric.emulation.launcher import launch

    kw: dict[str, Any] = dict(timeout_s=args.timeout, remove_run_dir=not (
        args.run_dir or getattr(args, "keep_runs", False)))
    if args.run_dir:
        kw["run_dir"] = f"{args.run_dir}/w{w}"
    if getattr(args, "faults", None):
        kw.update(faults=args.faults, seed=args.seed)
    return launch(topology=topology(args, w), **kw)


def _run_fabric(args: argparse.Namespace, plan: Plan, w: int, printer: Printer,
                bar: report.ProgressTask, measure: Measure,
                launch: Callable[[argparse.Namespace, int], Any] | None = None) -> None:
    """One fabric of ``w`` workers; every semfab path, size, dtype and op, ``repeat`` times."""
    fab = (launch or _launch)(args, w)
    broken = ""
    with fab:
        if len(fab.topo.workers) != w:
            raise UsageError(f"--topology has {len(fab.topo.workers)} workers, "
                             f"--workers asks for {w}")
        for rep in range(len(printer.runs)):
            if len(printer.runs) > 1:
                print(f"# run {rep + 1} of {len(printer.runs)}, {w} workers", flush=True)
            for dtype in plan.dtypes:
                for op in plan.ops:
                    for path in plan.ours:
                        for size in plan.sizes:
                            bar.describe(f"{path} x{w} {report.format_size(size)}")
                            if broken:
                                row = report.AllreduceRow.unavailable(
                                    path, w, size, dtype, f"failed: not run: {broken}", op)
                            else:
                                try:
                                    row = measure(fab, path, w, size, dtype, op, args)
                                except (PeerFailed, FabricTimeout) as exc:
                                    row = report.AllreduceRow.unavailable(
                                        path, w, size, dtype, f"failed: {exc}", op)
                                    broken = (f"the fabric of {w} workers failed earlier "
                                              f"({path} {report.format_size(size)})")
                            printer.add(rep, row)
                            removing = bool(getattr(fab, "remove_run_dir", False))
                            if removing and report.failures([row]):
                                fab.remove_run_dir = False  # a failed row keeps its logs
                                print(f"# logs of the failed run kept in {fab.run_dir}",
                                      flush=True)
                            bar.advance()


class SimStandIn:
    """Stands for a launched fabric under ``--sim`` (``run_sweep``'s ``launch``): no
    processes. Each bench's subclass says what one point (a size of a path, dtype and
    op) is: :meth:`work`, picklable, runs the simulation wherever the executor puts
    it; :meth:`row` turns what it returned into the row, here, in the points' order."""

    def __init__(self, topo: Any, args: argparse.Namespace) -> None:
        self.topo, self.args = topo, args
        self._topo_text: tuple[str, str] | None = None

    def __enter__(self) -> SimStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def topo_text(self) -> tuple[str, str]:
        """The topology as a point carries it (TOML text and source), written once."""
        from fabric.sim.cli import topology_text

        if self._topo_text is None:
            self._topo_text = topology_text(self.topo)
        return self._topo_text

    def work(self, path: str, size: int, dtype: str, op: str) -> tuple[Callable[..., Any],
                                                                          tuple[Any, ...]]:
        """One point: a top-level function and its plain arguments."""
        raise NotImplementedError

    def row(self, path: str, size: int, dtype: str, op: str, result: Any) -> Row:
        """The row of one point from what :meth:`work` returned."""
        raise NotImplementedError


def _run_sim_points(args: argparse.Namespace, plan: Plan, printer: Printer,
                    bar: report.ProgressTask,
                    launch: Callable[[argparse.Namespace, int], Any]) -> None:
    """``--sim``: every point of every worker count, spread over the executor
    (``--jobs``, ``--executor``); rows print in the emulated sweep's order, each when
    it and every earlier one are done."""
    from fabric.sim.cli import run_points

    points: list[tuple[SimStandIn, str, int, str, str]] = []
    for w in plan.workers:
        fab = launch(args, w)
        if len(fab.topo.workers) != w:
            raise UsageError(f"--topology has {len(fab.topo.workers)} workers, "
                             f"--workers asks for {w}")
        points += [(fab, path, size, dtype, op) for dtype in plan.dtypes for op in plan.ops
                   for path in plan.ours for size in plan.sizes]
    works = [fab.work(path, size, dtype, op) for fab, path, size, dtype, op in points]
    results = run_points(works, getattr(args, "jobs", None), getattr(args, "executor", "local"))
    for (fab, path, size, dtype, op), result in zip(points, results, strict=True):
        bar.describe(f"{path} x{len(fab.topo.workers)} {report.format_size(size)}")
        printer.add(0, fab.row(path, size, dtype, op, result))
        bar.advance()


def run_sweep(args: argparse.Namespace, plan: Plan, *, name: str, header: list[str],
              setts: dict[str, Any], measure: Measure, run_peer: RunPeer,
              notes: Callable[[Row], str], collective: str = "allreduce",
              root: bool = False, fix_row: Callable[[Row], Row] | None = None,
              launch: Callable[[argparse.Namespace, int], Any] | None = None) -> int:
    """Run the sweep of a bench: print, merge, tabulate, write files; the exit code.

    ``fix_row(row)`` (optional) adjusts every row before it is printed (the
    collectives give a peer's failure rows their collective and root).
    ``root``: the rows have a root column (broadcast, reduce). ``launch(args,
    workers)`` gives the fabric of a worker count (default: launched processes);
    under ``--sim`` it gives a :class:`SimStandIn`, and the points of every worker
    count are spread over ``--jobs``/``--executor`` (:func:`_run_sim_points`).
    """
    repeat = getattr(args, "repeat", 1)
    print("\n".join(header), flush=True)
    print(report.format_text_header(root=root), flush=True)
    printer = Printer(repeat, notes, root=root, fix=fix_row)
    combos = len(plan.dtypes) * len(plan.ops)
    total = len(plan.workers) * repeat * combos * len(plan.paths) * len(plan.sizes)
    t_start = time.monotonic()
    simulated = bool(getattr(args, "sim", False)) and launch is not None
    with report.progress(total, name) as bar:
        if plan.ours and simulated:
            assert launch is not None
            # simulations: the points of every worker count at once (no peers under --sim)
            _run_sim_points(args, plan, printer, bar, launch)
        for w in plan.workers:
            if plan.ours and not simulated:
                _run_fabric(args, plan, w, printer, bar, measure, launch)
            for rep in range(repeat if plan.peers else 0):
                if repeat > 1:
                    print(f"# run {rep + 1} of {repeat}, {w} workers: "
                          f"{', '.join(plan.peers)}", flush=True)
                for dtype in plan.dtypes:
                    for op in plan.ops:
                        for peer in plan.peers:
                            bar.describe(f"{peer} x{w}")
                            for row in run_peer(peer, w, plan.sizes, args, dtype, op):
                                row.place = peer_place(peer, collective)
                                printer.add(rep, row)
                            bar.advance(len(plan.sizes))
    elapsed = time.monotonic() - t_start
    rows = report.merge_runs(printer.runs, collective) if repeat > 1 else printer.runs[0]
    shaped_peers = {p: "*" for p in plan.peers if any(
        "not shaped" in r.note for r in rows if r.path == p)}
    side = report.format_side_by_side(rows, marks=shaped_peers)
    print()
    print(side, end="")
    if shaped_peers:
        print(f"# * {', '.join(shaped_peers)}: traffic not shaped by the emulator (own transports)")
    print()
    footer = report.format_footer(rows, elapsed)
    print("\n".join(footer), flush=True)
    failed = report.failures(rows)
    if args.json:
        extra: dict[str, Any] = {
            "settings": setts, "failed": len(failed),
            "unavailable": sum(r.status == "unavailable" for r in rows),
            "ok": not failed, "elapsed_s": elapsed,
        }
        if repeat > 1:
            extra["per_run"] = [[r.to_dict() for r in rs] for rs in printer.runs]
        report.write_json(args.json, name, [r.to_dict() for r in rows], extra=extra)
        print(f"# wrote {args.json}")
    if args.markdown:
        text = (f"## semfab bench {name}\n\n```text\n" + "\n".join(header) + "\n```\n\n"
                "### Side by side\n\n" + report.format_side_by_side(rows, True, shaped_peers)
                + "\n### Every row\n\n" + report.format_allreduce_table(rows)
                + "\n```text\n" + "\n".join(footer) + "\n```\n")
        report.write_markdown(args.markdown, text)
        print(f"# wrote {args.markdown}")
    if args.plot:
        ops = [o for o in plan.ops if o != "none"]
        title = (f"{name} {', '.join(plan.dtypes)}" + (f" {', '.join(ops)}" if ops else "")
                 + ": busbw")
        report.plot_busbw(rows, args.plot, title)
        print(f"# wrote {args.plot}")
    return 1 if failed else 0
