"""`semfab bench core`: what the protocol itself costs per allreduce, in one process.

The switch core (``switchd.core.SwitchCore``, with the shared-memory plane
for ``ina-mem``) and one worker program per member (``fabric.core.programs``) run
in this one process, wired to each other directly: every frame a program
sends goes straight into the core's ``handle``, every frame the core emits
straight into the member's ``handle_frame`` (decoded, as an endpoint does).
No socket, doorbell, scheduler or other process is involved, so the figures
are the price of the protocol code alone: what a change to the frame format,
the aggregation engine or a program adds per call and per frame, measured
without the noise of processes sharing cores.

Per row (path, workers, size): time in the switch core and in the member
programs per call (median and minimum over the timed calls, member time summed
over members: starting the program, decoding and handling each frame that
comes back; building the call's program object is not timed), frames into and
out of the switch per call, and the switch's time per frame it took in. Inputs
are fresh every call (``make_input``, exact values) and every call's result is
checked element by element.

A launched fabric pays this at least once per call on its critical path
(the switch's part, then a member's), plus its drivers' own work (sockets,
doorbells, wait loops) and its processes' turns on the cores.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fabric.core import frame as fr
from fabric.core.programs import NodeState, Program, Request, Tensor, allreduce_program
from fabric.core.topology import star
from fabric.errors import UsageError

#: Paths this benchmark drives: the two in-network ones (the host paths' cost is
#: the hosts' own, measured by `semfab bench allreduce`).
PATHS = ("ina", "ina-mem")


@dataclass(frozen=True)
class CoreRow:
    """One (path, workers, size) measurement; times in µs per call unless named."""

    path: str
    workers: int
    size: int  # bytes per member
    count: int
    dtype: str
    op: str
    calls: int
    frames_in: float  # into the switch, per call
    frames_out: float  # out of the switch, per call
    switch_p50_us: float
    switch_min_us: float
    members_p50_us: float  # summed over the members
    members_min_us: float
    total_p50_us: float
    switch_us_per_frame: float  # median call's switch time / frames in
    wrong: int  # elements differing from the exact result, over every call


class _Wire:
    """A switch core and its members' programs, frames handed over directly."""

    def __init__(self, path: str, workers: int, crc: bool) -> None:
        from switchd.core import SwitchCore
        from switchd.memplane import SharedMemoryPlane

        self.topo = star(workers)
        self.switch = self.topo.switches[0].name
        self.plane = SharedMemoryPlane() if path == "ina-mem" else None
        self.core = SwitchCore(self.topo, self.switch, memory=self.plane)
        self.core.handle_timer(time.monotonic())  # a star's switch has no neighbours
        self.states = {w.name: NodeState(self.topo, w.name, crc=crc) for w in self.topo.workers}
        self.switch_ns = 0
        self.members_ns = 0
        self.frames_in = 0
        self.frames_out = 0
        self.profile: cProfile.Profile | None = None  # on for the timed calls only

    def run(self, progs: dict[str, Program]) -> None:
        """Run the programs to completion, timing the core and the programs apart."""
        if self.profile is None:
            self._run(progs)
            return
        self.profile.enable()
        try:
            self._run(progs)
        finally:
            self.profile.disable()

    def _run(self, progs: dict[str, Program]) -> None:
        clock = time.perf_counter_ns
        queue: deque[tuple[str, Any, Any]] = deque()
        for name, first in progs.items():
            now = time.monotonic()
            t0 = clock()
            sends = first.start(now)
            self.members_ns += clock() - t0
            queue.extend((name, h, p) for h, p in sends)
        core = self.core
        while queue:
            name, header, payload = queue.popleft()
            now = time.monotonic()
            t0 = clock()
            outs = core.handle(name.encode(), header, payload, now)
            self.switch_ns += clock() - t0
            self.frames_in += 1
            for port, h, p in outs:
                self.frames_out += 1
                dst = port.decode()
                prog = progs.get(dst)
                if prog is None:
                    raise RuntimeError(f"the switch sent a frame to {dst}, which runs nothing")
                body = None if p is None else memoryview(np.asarray(p).view(np.uint8).data)
                t0 = clock()
                f = fr.decode(h, body)
                if not prog.wants(f):
                    raise RuntimeError(f"{dst} did not want {f.op.name} job {f.job} psn {f.psn} "
                                       "(nothing is lost or reordered here: a protocol bug)")
                sends = prog.handle_frame(f, now)
                self.members_ns += clock() - t0
                queue.extend((dst, sh, sp) for sh, sp in sends)
        for name, prog in progs.items():
            if not prog.done:
                raise RuntimeError(f"{name}'s program did not finish: it waits for "
                                   f"{prog.waiting_for()}")


def _key_is(key: int) -> Any:
    return lambda m: m.get("key") == key


def measure_row(path: str, workers: int, size: int, dtype: str = "float32", op: str = "sum",
                iters: int = 200, warmup: int = 20, seed: int = 0,
                crc: bool = False, profile: cProfile.Profile | None = None) -> CoreRow:
    """One row: a first call that registers the job, ``warmup`` more untimed calls,
    then ``iters`` timed ones; every call checked. ``profile``: collects the
    timed calls' protocol code (and slows it: its row's times are not the row's)."""
    from fabric.emulation.shm import SharedRegion, region_name
    from kernels.checking import expected_allreduce, make_input
    from kernels.dtypes import np_dtype
    from kernels.reference import count_wrong

    if path not in PATHS:
        raise UsageError(f"unknown path {path!r}; choose {' or '.join(PATHS)}")
    itemsize = np_dtype(dtype).itemsize
    count = max(size // itemsize, 1)
    wire = _Wire(path, workers, crc)
    names = list(wire.states)
    regions: list[SharedRegion] = []
    try:
        bufs: dict[str, np.ndarray] = {}
        outs: dict[str, np.ndarray] = {}
        keys: dict[str, int] = {}
        if path == "ina-mem":  # each member registers one region, as an endpoint's alloc does
            reqs: dict[str, Program] = {}
            run = f"core{os.getpid()}_{time.monotonic_ns()}"
            for name in names:
                key = wire.states[name].node_id << 16 | 1
                r = SharedRegion.create(region_name(run, name, key), count * itemsize)
                regions.append(r)
                keys[name] = key
                bufs[name] = outs[name] = r.array(np_dtype(dtype), count)
                reqs[name] = Request(wire.states[name], "region", "region_reply", key=key,
                                     size=count * itemsize, run=run, match=_key_is(key))
            wire.run(reqs)
            for name, req in reqs.items():
                if not req.result.get("ok"):
                    raise RuntimeError(f"{name}: region refused: {req.result.get('reason')}")
        else:
            for name in names:
                bufs[name] = np.empty(count, np_dtype(dtype))
                outs[name] = np.empty(count, np_dtype(dtype))
        sw_us: list[float] = []
        mem_us: list[float] = []
        frames = (0, 0)
        wrong = 0
        first = 1 + warmup  # call 0 also registers the job: never timed
        for it in range(first + iters):
            for rank, name in enumerate(names):
                np.copyto(bufs[name], make_input(rank, it, count, dtype, seed))
            progs = {
                name: allreduce_program(
                    wire.states[name], Tensor(count, dtype, bufs[name], outs[name]), op, path,
                    region=(keys[name], 0) if path == "ina-mem" else None)
                for name in names}
            if it == first:
                frames = (wire.frames_in, wire.frames_out)
                wire.profile = profile
            s0, m0 = wire.switch_ns, wire.members_ns
            wire.run(progs)
            want = expected_allreduce(workers, it, count, dtype, op, seed)
            wrong += sum(count_wrong(outs[name], want) for name in names)
            if it >= first:
                sw_us.append((wire.switch_ns - s0) / 1e3)
                mem_us.append((wire.members_ns - m0) / 1e3)
        fin = (wire.frames_in - frames[0]) / iters
        fout = (wire.frames_out - frames[1]) / iters
        sw = np.array(sw_us)
        mem = np.array(mem_us)
        sw50 = float(np.median(sw))
        return CoreRow(path, workers, count * itemsize, count, dtype, op, iters, fin, fout,
                       sw50, float(sw.min()), float(np.median(mem)), float(mem.min()),
                       float(np.median(sw + mem)), sw50 / fin if fin else 0.0, int(wrong))
    finally:
        if wire.plane is not None:
            wire.plane.close()
        for r in regions:
            r.close()


_COLUMNS = (("size(B)", 12), ("type", 10), ("path", 8), ("workers", 8), ("frames", 11),
            ("switch", 10), ("sw min", 9), ("members", 10), ("mem min", 9), ("total", 10),
            ("us/frame", 9), ("#wrong", 7))


def format_header() -> str:
    """The fixed-width header (nccl-tests habit: printed before the first row)."""
    top = "".join(f"{n:>{w}}" for n, w in _COLUMNS)
    units = ("", "", "", "", "(in/out)", "(us)", "(us)", "(us)", "(us)", "(us)", "(switch)", "")
    return "#" + top[1:] + "\n#" + "".join(f"{u:>{w}}" for u, (_, w) in
                                           zip(units, _COLUMNS, strict=True))[1:]


def format_row(r: CoreRow) -> str:
    """One fixed-width row, printed when it is done."""
    cells = (str(r.size), r.dtype, r.path, str(r.workers), f"{r.frames_in:g}/{r.frames_out:g}",
             f"{r.switch_p50_us:.1f}", f"{r.switch_min_us:.1f}", f"{r.members_p50_us:.1f}",
             f"{r.members_min_us:.1f}", f"{r.total_p50_us:.1f}", f"{r.switch_us_per_frame:.2f}",
             str(r.wrong))
    return "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))


def profile_lines(prof: cProfile.Profile, calls: int, top: int) -> list[str]:
    """The ``top`` functions by own time in a profile of ``calls`` calls, with their
    share of the protocol's time and how often each call ran them."""
    mine = os.path.abspath(__file__)  # the driver's own loop is not the protocol's
    stats = {k: v for k, v in pstats.Stats(prof).stats.items()  # type: ignore[attr-defined]
             if os.path.abspath(k[0]) != mine}
    total = sum(v[2] for v in stats.values()) or 1.0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in sorted(
            stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = os.path.relpath(file, here) if file.startswith(here) else os.path.basename(file)
        out.append(f"#   {100 * tt / total:5.1f}%  {nc / calls:6.2f}/call  {name} "
                   f"({where}:{line})" if line else f"#   {100 * tt / total:5.1f}%  "
                   f"{nc / calls:6.2f}/call  {name}")
    return out


def format_markdown(rows: list[CoreRow]) -> str:
    """Markdown table of the rows."""
    from bench.report import markdown_table

    head = ["size", "type", "path", "workers", "frames in/out", "switch p50 (µs)",
            "members p50 (µs)", "total p50 (µs)", "switch µs/frame", "wrong"]
    cells = [[str(r.size), r.dtype, r.path, str(r.workers), f"{r.frames_in:g}/{r.frames_out:g}",
              f"{r.switch_p50_us:.1f}", f"{r.members_p50_us:.1f}", f"{r.total_p50_us:.1f}",
              f"{r.switch_us_per_frame:.2f}", str(r.wrong)] for r in rows]
    return "\n".join(markdown_table(head, cells, left=("type", "path")))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """CLI flags for `semfab bench core`."""
    p.add_argument("--paths", default="ina-mem,ina",
                   help=f"comma-separated, of {', '.join(PATHS)} (default: %(default)s)")
    p.add_argument("--workers", default="2",
                   help="comma-separated member counts (default: %(default)s)")
    p.add_argument("-b", "--begin", default="4K", help="smallest size in bytes (default: 4K)")
    p.add_argument("-e", "--end", default="1M", help="largest size in bytes (default: 1M)")
    p.add_argument("-f", "--factor", type=float, default=4.0,
                   help="size multiplier between rows (default: %(default)s)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="element types, comma-separated; nccl-tests' names too (float, half, "
                   "bf16, int, int64) or 'all' (default: float32)")
    p.add_argument("-o", "--op", default="sum", help="sum, max or min (default: sum)")
    p.add_argument("-n", "--iters", type=int, default=200,
                   help="timed calls per row (default: %(default)s)")
    p.add_argument("-w", "--warmup", type=int, default=20,
                   help="untimed calls after the first, which registers the job "
                   "(default: %(default)s)")
    p.add_argument("--crc", action="store_true", help="CRC on every frame, as with corrupt faults")
    p.add_argument("--seed", type=int, default=0, help="input seed (default: 0)")
    p.add_argument("--profile", type=int, metavar="N", default=0,
                   help="after each row, run it again under cProfile and print the N "
                   "functions that took the most of the protocol's own time")
    p.add_argument("--json", metavar="PATH", help="write the rows and settings as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")


def _parse(args: argparse.Namespace) -> tuple[list[str], list[int], list[int], list[str]]:
    from bench import report, sweep

    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    bad = [x for x in paths if x not in PATHS]
    if not paths or bad:
        raise UsageError(f"--paths {args.paths!r}: choose from {', '.join(PATHS)}")
    try:
        workers = [int(x) for x in args.workers.split(",")]
    except ValueError:
        raise UsageError(f"--workers {args.workers!r}: give whole numbers, e.g. 2,4") from None
    if any(w < 2 or w > 64 for w in workers):
        raise UsageError("--workers: each count must be 2..64")
    try:
        sizes = report.size_range(args.begin, args.end, args.factor)
    except ValueError as exc:
        raise UsageError(f"sizes: {exc}") from None
    dtypes = sweep.parse_dtypes(args.dtype)
    if args.op not in ("sum", "max", "min"):
        raise UsageError(f"--op {args.op!r}: choose sum, max or min")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup not negative")
    if args.profile < 0:
        raise UsageError("--profile N: N must not be negative")
    report.check_memory(f"--end {args.end} with {max(workers)} workers",
                        3 * max(sizes) * max(workers))
    from fabric.emulation.launch_cli import check_outputs

    check_outputs(args, ("json", "markdown"))  # before the run, not after it
    return paths, workers, sizes, dtypes


def run(args: argparse.Namespace) -> int:
    """Entry point for `semfab bench core`."""
    from bench import report
    from fabric.info import build

    paths, workers, sizes, dtypes = _parse(args)
    settings = {"paths": paths, "workers": workers, "sizes": sizes, "dtypes": dtypes,
                "op": args.op, "iters": args.iters, "warmup": args.warmup, "crc": args.crc,
                "seed": args.seed, "profile": args.profile, "build": build()}
    print(f"# semfab bench core ({build()} build): switch core and member programs in one "
          f"process, no IPC; "
          f"{','.join(dtypes)} {args.op}, {args.warmup} warm-up + {args.iters} timed calls "
          f"per row, every result checked; crc {'on' if args.crc else 'off'}; seed {args.seed}")
    print(format_header(), flush=True)
    rows: list[CoreRow] = []
    failed: list[str] = []
    t0 = time.monotonic()
    for w, dtype, path, size in itertools.product(workers, dtypes, paths, sizes):
        what = f"{path} {dtype} {w} workers {size} B"
        try:
            row = measure_row(path, w, size, dtype, args.op, args.iters, args.warmup,
                              args.seed, args.crc)
        except (RuntimeError, OSError) as exc:
            failed.append(f"{what}: {exc}")
            print(f"# FAILED {what}: {exc}", flush=True)
            continue
        rows.append(row)
        print(format_row(row), flush=True)
        if row.wrong:
            failed.append(f"{what}: {row.wrong} wrong elements")
        if args.profile:
            prof = cProfile.Profile()
            measure_row(path, w, size, dtype, args.op, args.iters, args.warmup, args.seed,
                        args.crc, profile=prof)
            print(f"# profile of the row again ({args.iters} calls, own time):")
            print("\n".join(profile_lines(prof, args.iters, args.profile)), flush=True)
    ok = sum(1 for r in rows if not r.wrong)
    print(f"# {ok + len(failed)} rows in {time.monotonic() - t0:.1f} s: {ok} ok, "
          f"{len(failed)} failed")
    for f in failed:
        print(f"# failed: {f}")
    if args.json:
        report.write_json(args.json, "core", [asdict(r) for r in rows],
                          {"settings": settings, "failed": failed})
    if args.markdown:
        report.write_markdown(args.markdown, format_markdown(rows) + "\n")
    return 1 if failed else 0
