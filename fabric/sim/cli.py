"""`semfab sim ...`: allreduce tables and the scaling study, in virtual time.

* ``semfab sim allreduce`` — the nccl-tests table of ``semfab bench
  allreduce``, simulated (exact results checked element by element);
* ``semfab sim scale`` — completion time, busbw and the fraction of ideal per
  path, worker count and oversubscription ratio on leaf/spine fabrics, with
  timing-only payloads so 1024+ ranks fit in memory.

Rows are printed as they finish; ``--json`` / ``--markdown`` / ``--plot``
write files. Every figure is virtual time and is marked so.

A sweep is a list of points, each one simulation as picklable work (a
top-level function and plain arguments); :func:`run_points` runs them here,
on a local process pool (``--jobs N``) or on MPI ranks (``--executor mpi``)
and hands the results back in the points' order, so the rows and files are
the same whichever. The benches' ``--sim`` (bench.sweep, bench.moe) use it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from bench import report
from fabric.errors import SemfabError, UsageError
from fabric.sim.engine import Simulation, SimulationError, TimingModel

SIM_PATHS = ("ina", "ina-mem", "host-ring", "host-ps")
NOTE = "simulated (virtual time)"


# ---------------------------------------------------------------------- executor
#: Where the points of a sweep run: processes of this machine, or MPI ranks.
EXECUTORS = ("local", "mpi")
#: The most local processes --jobs may ask for (a typo guard, not a limit of the code).
MAX_JOBS = 1024

#: One point of a sweep: a top-level function and its plain (picklable) arguments.
Work = tuple[Callable[..., Any], tuple[Any, ...]]


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    """``--jobs`` and ``--executor``: how the points (simulations) of a sweep are spread."""
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="simulate up to N points at once (default 1: one after another in "
                   "this process; with --executor mpi: as many MPI workers as the launch "
                   "gives). Results, rows and their order do not depend on it")
    p.add_argument("--executor", default="local", choices=EXECUTORS,
                   help="local: a pool of N processes on this machine; mpi: "
                   "mpi4py.futures.MPIPoolExecutor, for runs under mpirun/srun (e.g. "
                   "`mpirun -n 8 python -m mpi4py.futures $(which semfab) sim scale "
                   "--executor mpi`)")


def check_executor(args: argparse.Namespace, sim: bool = True) -> None:
    """Refuse a bad ``--jobs``/``--executor`` in one line, before anything runs.

    ``sim=False`` (emulation): the points share one launched fabric, so only the
    defaults are accepted.
    """
    jobs, executor = getattr(args, "jobs", None), getattr(args, "executor", "local")
    if jobs is not None and not 1 <= jobs <= MAX_JOBS:
        raise UsageError(f"--jobs {jobs}: must be 1..{MAX_JOBS} points at once")
    if executor not in EXECUTORS:
        raise UsageError(f"--executor {executor!r}: choose {' or '.join(EXECUTORS)}")
    if not sim and ((jobs or 1) != 1 or executor != "local"):
        raise UsageError("--jobs/--executor spread simulations; an emulated run measures "
                         "one launched fabric at a time: add --sim or drop them")
    if executor == "mpi":
        _check_mpi()


#: Set in every rank by MPI launchers: Open MPI/PRRTE, MPICH's Hydra, Slurm's srun.
MPI_LAUNCH_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_STEP_ID")
MPI_HOW = "mpirun -n N python -m mpi4py.futures $(which semfab) ... --executor mpi"


def _check_mpi() -> None:
    """``--executor mpi`` can work here: mpi4py is installed and this process was
    started by an MPI launcher (outside one, spawning workers fails or hangs), as the
    one rank that runs the command (``python -m mpi4py.futures`` makes the others
    its workers; without it every rank would run the whole sweep)."""
    import os

    try:
        import mpi4py.futures  # noqa: F401  (used by run_points)
    except ImportError as exc:
        raise UsageError(f"--executor mpi needs mpi4py ({exc}); install the peers extra: "
                         "pip install -e '.[peers]'") from None
    if not any(k in os.environ for k in MPI_LAUNCH_ENV):
        raise UsageError(f"--executor mpi runs under an MPI launcher (mpirun, srun): {MPI_HOW}"
                         " (or use --executor local --jobs N)")
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or "1"
    from mpi4py.futures import _core  # the shared pool `python -m mpi4py.futures` sets up

    if size.isdigit() and int(size) > 1 and getattr(_core, "SharedPool", True) is None:
        raise UsageError(f"--executor mpi: {size} ranks would each run the whole sweep; "
                         f"make rank 0 run it and the others its workers: {MPI_HOW}")


def executor_text(args: argparse.Namespace, points: int) -> str:
    """How a sweep's ``points`` (a simulation or two each) will run, in words, for a header."""
    jobs, executor = getattr(args, "jobs", None), getattr(args, "executor", "local")
    what = f"{points} point{'s' if points != 1 else ''}"
    if executor == "mpi":
        return (f"{what} over MPI workers (mpi4py.futures"
                + (f", at most {jobs}" if jobs else "") + ")")
    n = min(jobs or 1, max(points, 1))
    return f"{what}, " + ("one after another in this process" if n == 1
                          else f"{n} at a time in local processes")


def run_points(works: Sequence[Work], jobs: int | None = None,
               executor: str = "local") -> Iterator[Any]:
    """Run every point and yield its result in the points' order, each as soon as it
    and every earlier one are done (so rows print in order, as they finish).

    One local job runs the points here, one after another. Otherwise they go to
    a pool: ``local`` a ProcessPoolExecutor of ``jobs`` processes (forkserver:
    a parent that runs threads, a progress bar's, is never forked), ``mpi``
    mpi4py's MPIPoolExecutor (``jobs`` None: the workers MPI gives). A point's
    exception is raised here, in its turn; the points not started are cancelled.
    """
    if executor == "local" and (min(jobs or 1, len(works)) <= 1):
        for fn, fargs in works:
            yield fn(*fargs)
        return
    pool: Any
    if executor == "mpi":
        from mpi4py.futures import MPIPoolExecutor

        pool = MPIPoolExecutor(max_workers=jobs) if jobs else MPIPoolExecutor()
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("forkserver")
        # the server imports the points' modules once (when it starts), and every
        # worker forks from it with them loaded
        ctx.set_forkserver_preload(sorted({fn.__module__ for fn, _ in works}))
        pool = ProcessPoolExecutor(max_workers=min(jobs or 1, len(works)), mp_context=ctx)
    import signal
    from concurrent.futures.process import BrokenProcessPool

    try:
        # the pool's processes start in the first submit: with Ctrl-C blocked, which they
        # inherit, so a Ctrl-C to the terminal's group is only this process's to handle
        # (no traceback from a pool process, nor from the forkserver mid-import)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            futures = [pool.submit(fn, *fargs) for fn, fargs in works]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fut in futures:
            try:
                result = fut.result()
            except BrokenProcessPool as exc:
                raise SemfabError(f"a simulation process died ({exc}); out of memory? "
                                  "try fewer --jobs") from None
            yield result
    except BaseException:
        # Ctrl-C or SIGTERM (raised as KeyboardInterrupt), or a failed point: the
        # points still running are not waited for (one may take minutes)
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def topology_text(topo: Any) -> tuple[str, str]:
    """A topology as a point carries it: its TOML text and source (a Topology does not
    pickle; ``loads(t.to_toml()) == t``)."""
    return str(topo.to_toml()), str(topo.source)


@functools.lru_cache(maxsize=8)
def topology_from_text(text: str, source: str) -> Any:
    """The topology of :func:`topology_text`, built once per process for the points
    that share it (a Topology is immutable)."""
    from fabric.core.topology import loads

    return loads(text, source)


# ---------------------------------------------------------------------- workload
def allreduce_workload(ctx: Any, path: str, sizes: list[int], dtype: str, op: str,
                       warmup: int, iters: int, check: bool, seed: int,
                       data: bool = True) -> Generator[Any, Any, list[dict[str, Any]]]:
    """Time ``path`` at every size (the same loop in both worlds; see fabric.core.workload)."""
    from kernels.checking import expected_allreduce, make_input
    from kernels.dtypes import np_dtype
    from kernels.reference import count_wrong

    item = np_dtype(dtype).itemsize
    results = []
    for size in sizes:
        count = size // item
        times = []
        last = warmup + iters - 1
        y = None
        for it in range(warmup + iters):
            x = make_input(ctx.rank, it, count, dtype, seed) if data else None
            yield ctx.barrier()
            t0 = yield ctx.clock()
            y = yield ctx.allreduce(x, op=op, path=path, count=count, dtype=dtype)
            t1 = yield ctx.clock()
            if it >= warmup:
                times.append((t1 - t0) * 1e6)
        wrong = count_wrong(y, expected_allreduce(ctx.world, last, count, dtype, op, seed)) \
            if check and data else 0
        results.append({"size": size, "times_us": times, "wrong": wrong})
    return results


def simulate_rows(topo: Any, path: str, sizes: list[int], dtype: str, op: str, warmup: int,
                  iters: int, check: bool, seed: int, *, data: bool = True,
                  timing: TimingModel | None = None, faults: str | None = None,
                  timeout_s: float = 60.0) -> list[report.AllreduceRow]:
    """One simulated run of every size on ``path``; nccl-style rows."""
    sim = Simulation(topo, seed=seed, timing=timing, faults=faults, timeout_s=timeout_s,
                     crc=bool(faults and "corrupt" in faults))
    res = sim.run(allreduce_workload, path, sizes, dtype, op, warmup, iters, check, seed, data)
    w = len(topo.workers)
    rows = []
    per_rank = res.results
    sem = next(iter(res.nodes.values())).sem(path)
    chunks = max(sem.chunks, 1)
    for i, size in enumerate(sizes):
        samples = [max(r[i]["times_us"][k] for r in per_rank) for k in range(iters)]
        wrong = sum(r[i]["wrong"] for r in per_rank) if check and data else -1
        counters: dict[str, Any] = {k: round(getattr(sem, k) / chunks, 2)
                                    for k in ("copies", "encodes", "crossings", "hops")}
        rows.append(report.AllreduceRow.from_samples(
            path, w, size, dtype, op, samples, wrong, **counters,
            note=NOTE + (f"; {res.retransmits} retransmissions" if res.retransmits else "")))
    return rows


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Subcommands of `semfab sim`."""
    sub = p.add_subparsers(dest="sim_command", metavar="SIM")
    a = sub.add_parser("allreduce", help="nccl-tests table of allreduce, simulated",
                       description="The table of `semfab bench allreduce`, in virtual time.")
    add_allreduce_arguments(a)
    a.set_defaults(sim_func=run_allreduce)
    s = sub.add_parser("scale", help="scaling study: workers x oversubscription x path",
                       description="Completion time, busbw and fraction of ideal on leaf/spine "
                       "fabrics (timing-only payloads).")
    s.add_argument("--workers", default="8,64,256,1024", help="worker counts, comma-separated")
    s.add_argument("--oversubscription", default="1,2,4",
                   help="leaf down:up bandwidth ratios, comma-separated")
    s.add_argument("--paths", default="ina,host-ring", help=f"from {', '.join(SIM_PATHS)}")
    s.add_argument("--size", default="64M", help="bytes per worker (64M, 1G, ...)")
    s.add_argument("--per-leaf", type=int, default=32,
                   help="workers per leaf switch (fewer when there are too few workers for "
                   "two leaves)")
    s.add_argument("--link-gbps", type=float, default=100.0, help="worker link bandwidth")
    s.add_argument("--latency-us", type=float, default=1.0, help="one-way latency per link")
    s.add_argument("--mtu", type=int, default=256 * 1024, help="bytes per frame")
    s.add_argument("--cut-through", type=int, default=4096, metavar="BYTES",
                   help="switches forward packets of this size as they arrive, as hardware "
                   "does (0: store and forward whole frames, as the emulator does)")
    _add_outputs(s)
    add_executor_arguments(s)
    s.set_defaults(sim_func=run_scale)
    c = sub.add_parser("calibrate", help="measure this machine's emulator (per-frame and "
                       "per-byte costs) for --calibration",
                       description="Launch stars of 2 and 4 workers and fit the switch's and "
                       "a node's service times (see fabric.sim.calibrate).")
    c.add_argument("--iters", type=int, default=20, help="timed repetitions per measurement")
    c.add_argument("--json", metavar="PATH", help="write the fit (for --calibration)")

    def _calibrate(args: argparse.Namespace) -> int:
        from fabric.sim import calibrate

        return calibrate.run(args)

    c.set_defaults(sim_func=_calibrate)
    from fabric.sim.congestion_cli import (
        add_incast_parser,
        add_permutation_parser,
        add_pfc_parser,
    )

    add_incast_parser(sub)
    add_permutation_parser(sub)
    add_pfc_parser(sub)
    r = sub.add_parser("replay", help="play a recorded PyTorch step (fabric.torch.record) at "
                       "any number of ranks",
                       description="Play a training step recorded with fabric.torch.record() "
                       "at each worker count, timing-only, and print the time per kind of "
                       "operation (see fabric.sim.replay for how sizes scale).")
    from fabric.sim import replay

    replay.add_arguments(r)
    r.set_defaults(sim_func=replay.run)
    p.set_defaults(sim_func=None)


def add_allreduce_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab sim allreduce` (those of `semfab bench allreduce`)."""
    p.add_argument("-b", "--begin", default="4K", help="smallest size in bytes")
    p.add_argument("-e", "--end", default="16M", help="largest size in bytes")
    p.add_argument("-f", "--factor", type=float, default=4, help="size multiplication factor")
    p.add_argument("--workers", default=None,
                   help="worker counts, comma-separated (default: 2,4; with --topology, "
                   "the file's count)")
    p.add_argument("--paths", default=",".join(SIM_PATHS), help=f"from {', '.join(SIM_PATHS)}")
    p.add_argument("-d", "--dtype", default="float32", help="float32, float16, bfloat16, "
                   "int32 or int64")
    p.add_argument("-o", "--op", default="sum", help="sum, max or min")
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed iterations per size")
    p.add_argument("-n", "--iters", type=int, default=3, help="timed iterations per size")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                   help="1: count wrong elements, 0: do not")
    p.add_argument("--seed", type=int, default=0, help="input and fault seed")
    p.add_argument("--topology", help="a topology file (default: a star of --workers)")
    p.add_argument("--link-gbps", type=float, default=100.0,
                   help="bandwidth of every link of the default star")
    p.add_argument("--link-latency-us", type=float, default=1.0,
                   help="one-way latency of every link of the default star")
    p.add_argument("--faults", help='faults on every link, e.g. "loss=0.01"')
    p.add_argument("--timing-only", action="store_true",
                   help="no tensor data (no check): for sizes x workers beyond memory")
    p.add_argument("--switch-frame-us", type=float, default=0.0,
                   help="service time per frame in a switch (0: ideal hardware)")
    p.add_argument("--node-frame-us", type=float, default=0.0,
                   help="service time per frame in a node")
    p.add_argument("--cut-through", type=int, default=0, metavar="BYTES",
                   help="switches forward packets of this size as they arrive (0: store "
                   "and forward whole frames, as the emulator does)")
    p.add_argument("--calibration", metavar="FILE",
                   help="service times measured by `semfab sim calibrate --json FILE` "
                   "(simulate this emulator rather than ideal switches)")
    _add_outputs(p)
    add_executor_arguments(p)


def _add_outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write results and every setting as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot")


def run(args: argparse.Namespace) -> int:
    """Entry of `semfab sim`."""
    if args.sim_func is None:
        raise UsageError("say what to simulate: `semfab sim allreduce`, `sim scale`, "
                         "`sim incast` or `sim permutation` (see `semfab sim --help`)")
    return int(args.sim_func(args))


def _ints(text: str, flag: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes integers like 2,4; got {text!r}") from None
    if not vals or any(not lo <= v <= hi for v in vals):
        raise UsageError(f"{flag}: each value must be {lo}..{hi}; got {text!r}")
    return vals


def _paths(text: str) -> list[str]:
    paths = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in paths if p not in SIM_PATHS]
    if bad or not paths:
        raise UsageError(f"unknown path(s) {', '.join(bad) or text!r}; the simulator runs "
                         f"{', '.join(SIM_PATHS)} (the peers gloo and MPI are emulation only)")
    return paths


def _positive(flag: str, value: float, zero_ok: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise UsageError(f"{flag} must be a {'non-negative' if zero_ok else 'positive'} "
                         f"finite number; got {value}")
    return value


def allreduce_point(topo_text: str, topo_source: str, path: str, sizes: list[int], dtype: str,
                    op: str, warmup: int, iters: int, check: bool, seed: int, data: bool,
                    timing: dict[str, Any], faults: str | None) -> list[report.AllreduceRow]:
    """One point of `semfab sim allreduce` (picklable work): every size of ``path`` on the
    topology of :func:`topology_text`, in one simulation; a failure is a failed row per size."""
    topo = topology_from_text(topo_text, topo_source)
    try:
        return simulate_rows(topo, path, sizes, dtype, op, warmup, iters, check, seed,
                             data=data, timing=TimingModel(**timing), faults=faults)
    except SimulationError as exc:
        return [report.AllreduceRow.unavailable(path, len(topo.workers), s, dtype,
                                                f"FAILED: {exc}") for s in sizes]


def _sim_workers(args: argparse.Namespace, lo: int, hi: int) -> tuple[list[int], Any]:
    """The worker counts and the ``--topology`` file's topology (None without one):
    ``--workers`` omitted takes the file's count; given, it must agree with it."""
    from fabric.core.topology import TopologyError, load

    topo = None
    if args.topology:
        try:
            topo = load(args.topology)
        except (TopologyError, OSError) as exc:
            raise UsageError(f"--topology: {exc}") from None
    if args.workers is None:
        return ([len(topo.workers)] if topo is not None else [2, 4]), topo
    workers = _ints(args.workers, "--workers", lo, hi)
    if topo is not None and any(w != len(topo.workers) for w in workers):
        raise UsageError(f"--topology {args.topology} has {len(topo.workers)} workers but "
                         f"--workers asks for {args.workers}; pass --workers "
                         f"{len(topo.workers)} or leave --workers out")
    return workers, topo


def run_allreduce(args: argparse.Namespace) -> int:
    """`semfab sim allreduce`: a simulation per worker count and path, rows as they finish."""
    from fabric.core.topology import star
    from fabric.emulation.launch_cli import check_output_file

    try:
        sizes = report.size_range(args.begin, args.end, args.factor)
    except ValueError as exc:
        raise UsageError(f"sizes: {exc}") from None
    workers, file_topo = _sim_workers(args, 1, 65536)
    paths = _paths(args.paths)
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0")
    if args.dtype not in ("float32", "float16", "bfloat16", "int32", "int64"):
        raise UsageError(f"--dtype {args.dtype!r}: use float32, float16, bfloat16, int32, int64")
    if args.op not in ("sum", "max", "min"):
        raise UsageError(f"--op {args.op!r}: use sum, max or min")
    item = report.dtype_itemsize(args.dtype)
    if any(s % item for s in sizes):
        raise UsageError(f"every size must be a multiple of the {args.dtype} size ({item} B)")
    _positive("--link-gbps", args.link_gbps, zero_ok=True)
    _positive("--link-latency-us", args.link_latency_us, zero_ok=True)
    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag):
            check_output_file(f"--{flag}", getattr(args, flag))
    if not 0 <= args.cut_through <= 1 << 24:
        raise UsageError("--cut-through must be 0 (store and forward) .. 16 MiB")
    timing = TimingModel(switch_frame_s=_positive("--switch-frame-us", args.switch_frame_us,
                                                  True) / 1e6,
                         node_frame_s=_positive("--node-frame-us", args.node_frame_us,
                                                True) / 1e6,
                         cut_through_bytes=args.cut_through)
    if getattr(args, "calibration", None):
        from fabric.sim import calibrate

        timing = dataclasses.replace(calibrate.load(args.calibration),
                                     cut_through_bytes=args.cut_through)
    if args.faults:
        from fabric.core.faults import FaultSpecError, parse_faults

        try:
            parse_faults(args.faults)
        except FaultSpecError as exc:
            raise UsageError(f"--faults: {exc}") from None
    check_executor(args)
    works: list[Work] = []
    for w in workers:
        topo = file_topo if file_topo is not None else star(
            w, bandwidth_gbps=args.link_gbps, latency_us=args.link_latency_us)
        text, source = topology_text(topo)
        works += [(allreduce_point, (text, source, path, sizes, args.dtype, args.op,
                                     args.warmup, args.iters, bool(args.check), args.seed,
                                     not args.timing_only, dataclasses.asdict(timing),
                                     args.faults)) for path in paths]
    rows: list[report.AllreduceRow] = []
    t_start = time.monotonic()
    print(f"# semfab sim allreduce (virtual time): sizes {report.format_size(sizes[0])}.."
          f"{report.format_size(sizes[-1])} x{args.factor:g}, dtype {args.dtype}, op {args.op}, "
          f"warmup {args.warmup}, iters {args.iters}, seed {args.seed}, faults "
          f"{args.faults or 'none'}, {'timing-only' if args.timing_only else 'with data'}, "
          + (f"cut-through {args.cut_through} B" if args.cut_through else "store and forward"))
    print(f"# {executor_text(args, len(works))}", flush=True)
    for new in run_points(works, args.jobs, args.executor):
        for r in new:
            print(f"  {r.path:9s} x{r.workers:<5d} {report.format_size(r.size_bytes):>7s} "
                  f"{_us(r.time_us):>12s} us  busbw {_gb(r.busbw_gbps):>8s} GB/s  "
                  f"wrong {r.wrong}", flush=True)
        rows += new
    table = report.format_allreduce_table(rows)
    print(table)
    print(f"\n# {len(rows)} rows, simulated in {time.monotonic() - t_start:.1f} s of wall time")
    failed = [r for r in rows if not r.ran or r.wrong > 0]
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    if args.json:
        report.write_json(args.json, "sim-allreduce", [r.to_dict() for r in rows],
                          extra={"settings": settings})
        print(f"# wrote {args.json}")
    if args.markdown:
        report.write_markdown(args.markdown, table + "\n")
        print(f"# wrote {args.markdown}")
    if args.plot:
        report.plot_busbw(rows, args.plot, "allreduce busbw (simulated, virtual time)")
        print(f"# wrote {args.plot}")
    if failed:
        print(f"# {len(failed)} rows FAILED or wrong")
        return 1
    return 0


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


# ---------------------------------------------------------------------- scale
def scale_topology(workers: int, per_leaf: int, ratio: float, gbps: float, latency_us: float,
                   mtu: int) -> Any:
    """Leaf/spine of ``workers`` (at least two leaves) at ``ratio`` oversubscription."""
    from fabric.core.topology import leaf_spine

    k = min(per_leaf, max(workers // 2, 1))
    if workers % k:
        raise UsageError(f"--workers {workers} is not a multiple of {k} workers per leaf")
    return leaf_spine(workers // k, k, oversubscription=ratio, leaf_bandwidth_gbps=gbps,
                      hosts=0, leaf_latency_us=latency_us, spine_latency_us=latency_us, mtu=mtu)


def ideal_time_s(path: str, workers: int, size: int, gbps: float) -> float:
    """Bandwidth-only time on a non-blocking fabric: in-network sends and receives
    the tensor once per worker; a ring moves 2(n-1)/n of it each way."""
    factor = 1.0 if path == "ina" else 2 * (workers - 1) / workers
    return factor * size * 8 / (gbps * 1e9)


def _scale_workload(ctx: Any, path: str, count: int) -> Generator[Any, Any, float]:
    t0 = yield ctx.clock()
    yield ctx.allreduce(None, path=path, count=count, dtype="float32")
    t1 = yield ctx.clock()
    return float(t1 - t0)


def scale_point(workers: int, per_leaf: int, ratio: float, gbps: float, latency_us: float,
                mtu: int, cut_through: int, path: str, size: int) -> dict[str, Any]:
    """One point of `semfab sim scale` (picklable work: plain arguments in, a plain row
    out): an allreduce of ``size`` bytes per worker on ``path``, timing-only payloads.
    ``wall_s`` and ``events_per_s`` are this process's wall clock, the rest is virtual
    time and the same wherever and whenever it runs."""
    topo = scale_topology(workers, per_leaf, ratio, gbps, latency_us, mtu)
    t0 = time.monotonic()
    sim = Simulation(topo, timeout_s=3600.0, timing=TimingModel(cut_through_bytes=cut_through))
    res = sim.run(_scale_workload, path, size // 4)
    wall = time.monotonic() - t0
    t = max(res.results)
    ideal = ideal_time_s(path, workers, size, gbps)
    busbw = size / t / 1e9 * 2 * (workers - 1) / workers
    return {"workers": workers, "oversubscription": ratio, "path": path,
            "leaves": len(topo.switches) - 1, "time_s": t, "busbw_gbps": busbw,
            "ideal_s": ideal, "fraction_of_ideal": ideal / t, "events": res.events,
            "frames": res.frames, "wall_s": wall,
            "events_per_s": res.events / wall if wall > 0 else 0.0}


def run_scale(args: argparse.Namespace) -> int:
    """`semfab sim scale`."""
    from fabric.emulation.launch_cli import check_output_file

    workers = _ints(args.workers, "--workers", 2, 65536)
    try:
        ratios = [float(r) for r in str(args.oversubscription).split(",") if r.strip()]
    except ValueError:
        raise UsageError(f"--oversubscription takes numbers like 1,2,4; got "
                         f"{args.oversubscription!r}") from None
    if not ratios or any(not (1 <= r <= 64) or not math.isfinite(r) for r in ratios):
        raise UsageError("--oversubscription: each ratio must be between 1 and 64")
    paths = [p for p in _paths(args.paths)]
    if "host-ps" in paths:
        raise UsageError("sim scale compares ina and host-ring (host-ps needs data payloads)")
    try:
        size = report.parse_size(args.size)
    except ValueError as exc:
        raise UsageError(f"--size: {exc}") from None
    if size < 4 or size % 4:
        raise UsageError("--size must be a positive multiple of 4 bytes (float32)")
    if args.per_leaf < 1:
        raise UsageError("--per-leaf must be at least 1")
    for w in workers:  # before any row, not in the middle of the sweep
        k = min(args.per_leaf, max(w // 2, 1))
        if w % k:
            raise UsageError(f"--workers {w} is not a multiple of {k} workers per leaf")
    _positive("--link-gbps", args.link_gbps)
    _positive("--latency-us", args.latency_us, zero_ok=True)
    if not 64 <= args.mtu <= 1 << 24:
        raise UsageError("--mtu must be 64 B .. 16 MiB")
    if not 0 <= args.cut_through <= 1 << 24:
        raise UsageError("--cut-through must be 0 (store and forward) .. 16 MiB")
    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag):
            check_output_file(f"--{flag}", getattr(args, flag))
    check_executor(args)
    from fabric.info import build

    # the points in the order their rows print: workers, then ratio, then path
    points = [(w, args.per_leaf, ratio, args.link_gbps, args.latency_us, args.mtu,
               args.cut_through, path, size) for w in workers for ratio in ratios
              for path in paths]
    print(f"# semfab sim scale (virtual time, {build()} build): "
          f"{report.format_size(size)} float32 per worker, "
          f"{args.link_gbps:g} Gbit/s worker links, {args.latency_us:g} us per link, "
          f"mtu {args.mtu}, " + (f"cut-through {args.cut_through} B packets" if args.cut_through
                                   else "store and forward") + ", timing-only payloads")
    print(f"# {executor_text(args, len(points))}; wall(s) is each simulation's own")
    header = (f"{'workers':>8s} {'ratio':>5s} {'path':>9s} {'time(ms)':>10s} {'busbw':>8s} "
              f"{'ideal(ms)':>10s} {'of ideal':>8s} {'events':>9s} {'wall(s)':>8s}")
    print(header, flush=True)
    rows: list[dict[str, Any]] = []
    for row in run_points([(scale_point, pt) for pt in points], args.jobs, args.executor):
        rows.append(row)
        print(f"{row['workers']:>8d} {row['oversubscription']:>5g} {row['path']:>9s} "
              f"{row['time_s'] * 1e3:>10.3f} {row['busbw_gbps']:>8.2f} "
              f"{row['ideal_s'] * 1e3:>10.3f} {row['fraction_of_ideal']:>8.2f} "
              f"{row['events']:>9d} {row['wall_s']:>8.1f}", flush=True)
    ratio_lines = []
    for w in workers:
        for ratio in ratios:
            got = {r["path"]: r["time_s"] for r in rows
                   if r["workers"] == w and r["oversubscription"] == ratio}
            if "ina" in got and "host-ring" in got:
                ratio_lines.append(f"# {w} workers {ratio:g}:1: host-ring / ina = "
                                   f"{got['host-ring'] / got['ina']:.3f} "
                                   f"(bandwidth bound 2(n-1)/n = {2 * (w - 1) / w:.3f})")
    print("\n".join(ratio_lines))
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    if args.json:
        report.write_json(args.json, "sim-scale", rows, extra={"settings": settings})
        print(f"# wrote {args.json}")
    if args.markdown:
        head = ["workers", "ratio", "path", "time (ms)", "busbw (GB/s)", "ideal (ms)",
                "of ideal"]
        lines = report.markdown_table(head, [
            [str(r["workers"]), f"{r['oversubscription']:g}:1", str(r["path"]),
             f"{r['time_s'] * 1e3:.3f}", f"{r['busbw_gbps']:.2f}", f"{r['ideal_s'] * 1e3:.3f}",
             f"{r['fraction_of_ideal']:.2f}"] for r in rows], left=("path",))
        report.write_markdown(args.markdown, "\n".join(lines + ratio_lines) + "\n")
        print(f"# wrote {args.markdown}")
    if args.plot:
        _plot_scale(rows, args.plot)
        print(f"# wrote {args.plot}")
    return 0


def _plot_scale(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    for (p, ratio) in sorted({(r["path"], r["oversubscription"]) for r in rows}):
        pts = sorted((r["workers"], r["fraction_of_ideal"]) for r in rows
                     if r["path"] == p and r["oversubscription"] == ratio)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                linestyle=styles[sorted({r["oversubscription"] for r in rows}).index(ratio) % 4],
                label=f"{p} {ratio:g}:1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("fraction of ideal (bandwidth-bound) time")
    ax.set_title("allreduce scaling on leaf/spine (simulated, virtual time)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
