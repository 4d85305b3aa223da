"""`semfab bench wakeup`: how soon a doorbell's sleeping reader runs after a ring.

A writer process posts a descriptor to a shared-memory doorbell every
``--period-ms``, ringing its reader, which sleeps in ``poll`` between frames,
and then goes on working for ``--work-us`` (as the token generator goes on to
its next step). Reported per row: how long after the post the reader was
running again (p50/p90/p99), with and without ``handoff`` (the writer gives up
the rest of its time slice after ringing), with both processes free to run
anywhere and with both on one CPU.

What it shows: the scheduler often wakes the reader on the writer's own CPU;
without a handoff it then waits until the writer's work is done or its slice
ends. The figures are the host's (its scheduler, its wake-up cost), so run it
where the fabric runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fabric.core import frame as fr
from fabric.core.frame import Flag, Op
from fabric.emulation import doorbell as db
from fabric.errors import UsageError, check_number

#: A reader that has not answered within this many seconds failed the row.
READER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WakeupRow:
    """One (handoff, placement) measurement."""

    handoff: bool
    placement: str  # "free" or "cpu N" (writer and reader pinned there)
    rings: int  # posts that found the reader asleep (the others are not counted)
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _descriptor(i: int) -> bytes:
    return fr.encode_header(Op.WRITE, src=1, dst=0, job=1, psn=i & 0xFFFF_FFFF, key=1,
                            offset=0, length=32, flags=Flag.REF)


def _reader(path: str, sent: Any, woke: Any, n: int, work_s: float, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    bell = db.Doorbell.attach(path)
    try:
        for i in range(n):
            while bell.recv() is None:
                if not bell.sleep():  # nothing came: block until rung
                    select.select([bell.fileno()], [], [], READER_TIMEOUT_S)
                bell.wake()
            woke[i] = time.perf_counter_ns()
            _busy(work_s)
    finally:
        bell.close()


def measure_row(handoff: bool, cpu: int | None, n: int, period_s: float, work_s: float,
                reader_work_s: float) -> WakeupRow:
    """One row: ``n`` posts, each followed by ``work_s`` of the writer's own work."""
    ctx = mp.get_context("fork")
    sent = ctx.RawArray("q", n)
    woke = ctx.RawArray("q", n)
    bell = db.Doorbell.create(f"semfab-wakeup-{os.getpid()}-{time.monotonic_ns()}")
    before = os.sched_getaffinity(0)
    proc = ctx.Process(target=_reader, args=(str(bell.path), sent, woke, n, reader_work_s, cpu),
                       daemon=True)
    rung = np.zeros(n, dtype=bool)
    try:
        proc.start()
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        deadline = time.monotonic() + READER_TIMEOUT_S
        while not bell.outbox.reader_sleeping():  # the reader attached and sleeps
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the reader process did not start")
            time.sleep(0.01)
        for i in range(n):
            time.sleep(period_s)
            rings = bell.rings
            sent[i] = time.perf_counter_ns()
            if not bell.send(_descriptor(i), handoff=handoff):
                raise RuntimeError("the doorbell ring is full: the reader stopped reading")
            rung[i] = bell.rings != rings
            _busy(work_s)
        proc.join(READER_TIMEOUT_S)
        if proc.exitcode != 0:
            raise RuntimeError(f"the reader process failed (exit code {proc.exitcode})")
    finally:
        os.sched_setaffinity(0, before)
        if proc.is_alive():
            proc.kill()
            proc.join()
        bell.close()
    lat = (np.frombuffer(woke, dtype=np.int64) - np.frombuffer(sent, dtype=np.int64))[rung] / 1e3
    if lat.size == 0:
        raise RuntimeError("no post found the reader asleep: lengthen --period-ms")
    p50, p90, p99 = np.percentile(lat, [50, 90, 99])
    return WakeupRow(handoff, "free" if cpu is None else f"cpu {cpu}", int(lat.size),
                     float(p50), float(p90), float(p99), float(lat.max()))


def format_table(rows: list[WakeupRow]) -> str:
    """Markdown table of the rows."""
    from bench.report import markdown_table

    head = ["handoff", "placement", "rings", "p50 (µs)", "p90 (µs)", "p99 (µs)", "max (µs)"]
    cells = [["on" if r.handoff else "off", r.placement, str(r.rings), f"{r.p50_us:.0f}",
              f"{r.p90_us:.0f}", f"{r.p99_us:.0f}", f"{r.max_us:.0f}"] for r in rows]
    return "\n".join(markdown_table(head, cells, left=("handoff", "placement")))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """CLI flags for `semfab bench wakeup`."""
    p.add_argument("-n", "--rings", type=int, default=300,
                   help="posts per row (default: %(default)s)")
    p.add_argument("--period-ms", type=float, default=5.0,
                   help="time between posts; the reader sleeps in between (default: "
                   "%(default)s)")
    p.add_argument("--work-us", type=float, default=1000.0,
                   help="the writer's own work after each post (default: %(default)s)")
    p.add_argument("--reader-work-us", type=float, default=300.0,
                   help="the reader's work per frame (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the rows and settings as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")


def run(args: argparse.Namespace) -> int:
    """Entry point for `semfab bench wakeup`."""
    from bench import report
    from fabric.emulation.launch_cli import check_outputs

    if args.rings < 1:
        raise UsageError("--rings must be at least 1")
    # a post a second at the slowest: beyond that the row is a long sleep, not a measure
    check_number("--period-ms", args.period_ms, above=0, most=1000)
    check_number("--work-us", args.work_us, least=0, most=1e6)
    check_number("--reader-work-us", args.reader_work_us, least=0, most=1e6)
    check_outputs(args, ("json", "markdown"))
    if args.work_us / 1e3 + 0.1 >= args.period_ms or args.reader_work_us / 1e3 >= args.period_ms:
        raise UsageError("--period-ms must leave the reader time to fall asleep: make it "
                         "longer than --work-us and --reader-work-us")
    if not db.available():
        raise UsageError("doorbells need x86-64 memory ordering; this CPU has none")
    cpu = min(os.sched_getaffinity(0))
    settings = {"rings": args.rings, "period_ms": args.period_ms, "work_us": args.work_us,
                "reader_work_us": args.reader_work_us, "pinned_cpu": cpu}
    print(f"# semfab bench wakeup: {args.rings} posts per row, one every {args.period_ms} ms; "
          f"writer works {args.work_us:.0f} µs after each, reader {args.reader_work_us:.0f} µs")
    rows = []
    for pin in (None, cpu):
        for handoff in (False, True):
            row = measure_row(handoff, pin, args.rings, args.period_ms / 1e3,
                              args.work_us / 1e6, args.reader_work_us / 1e6)
            rows.append(row)
            print(f"# handoff {'on ' if handoff else 'off'} {row.placement:>6}: p50 "
                  f"{row.p50_us:.0f} µs, p99 {row.p99_us:.0f} µs", flush=True)
    table = format_table(rows)
    print(table)
    if args.json:
        report.write_json(args.json, "wakeup", [asdict(r) for r in rows], {"settings": settings})
    if args.markdown:
        report.write_markdown(args.markdown, table + "\n")
    return 0
