"""`semfab bench relay`: the floor of a switch-in-the-middle design on this host.

Each of N worker processes sends its whole buffer to one relay process over
ZeroMQ (ipc), the relay sums the N buffers with NumPy and sends the sum back
to every worker, which copies it into its output. Nothing else: no frames,
chunks, windows, retransmission or job state. The emulator's frame plane
(`ina`) moves the same bytes the same way (every byte through the switch
process and back, one reduction there), so this is what that design could
reach with pyzmq on this machine; `semfab bench core` gives the protocol's own
share of an `ina` call, and the difference between the two is the frame
plane's drivers (chunking, copies into and out of frames, per-frame wake-ups).

Per size: ``warmup`` untimed iterations, then ``iters`` timed ones. The relay
answers only when all N have sent, so iterations are in step; an iteration's
time is the maximum over workers of each one's send-to-result time, and the
row reports the median. busbw follows nccl-tests for allreduce
(``size / time * 2 (N - 1) / N``). Inputs are fresh every iteration
(``kernels.checking.make_input``) and every result is checked element by
element against the exact sum.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.report import markdown_table, parse_size
from fabric.errors import UsageError

#: How long a whole row may take before its processes are stopped.
ROW_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RelayRow:
    """One size: times in µs per iteration (the maximum over workers)."""

    size: int  # bytes per worker
    count: int
    workers: int
    iters: int
    time_us: float  # median
    min_us: float
    p99_us: float
    busbw_gbps: float
    wrong: int  # elements of the last iteration's results differing from the exact sum


def _relay(path: str, n: int, count: int, rounds: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 5000  # the last round's results must leave before the socket closes
    sock.bind(f"ipc://{path}")
    acc = np.empty(count, np.float32)
    try:
        for _ in range(rounds):
            idents: list[bytes] = [b""] * n
            parts: list[Any] = [None] * n
            for _ in range(n):
                ident, rank, part = sock.recv_multipart(copy=False)
                r = int.from_bytes(rank.bytes, "little")
                idents[r], parts[r] = ident.bytes, part
            # in rank order, so the float sum is the one the workers check against
            np.copyto(acc, np.frombuffer(parts[0].buffer, np.float32))
            for part in parts[1:]:
                np.add(acc, np.frombuffer(part.buffer, np.float32), out=acc)
            for who in idents:
                # copy=True: the next round overwrites acc while zero-copy sends may
                # still be in flight
                sock.send_multipart([who, acc.data])
    finally:
        sock.close()
        ctx.term()


def _worker(path: str, rank: int, n: int, count: int, warmup: int, iters: int, seed: int,
            out_q: Any) -> None:
    import zmq

    from kernels.checking import make_input

    try:  # one thread for the input generator: its idle OpenMP threads would spin
        import numba  # on the cores the relay needs (3.9 ms against 0.3 ms at 64 KiB)

        numba.set_num_threads(1)
    except (ImportError, ValueError):
        pass
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"ipc://{path}")
    buf = np.empty(count, np.float32)
    out = np.empty(count, np.float32)
    tag = rank.to_bytes(2, "little")
    times: list[float] = []
    try:
        for it in range(warmup + iters):
            np.copyto(buf, make_input(rank, it, count, "float32", seed))
            t0 = time.perf_counter_ns()
            sock.send_multipart([tag, buf.data], copy=False)
            got = sock.recv(copy=False)
            np.copyto(out, np.frombuffer(got.buffer, np.float32))
            dt = (time.perf_counter_ns() - t0) / 1e3
            if it >= warmup:
                times.append(dt)
        # the last iteration's result, element by element (as nccl-tests checks):
        # the float32 sum in rank order, as the relay adds
        last = warmup + iters - 1
        exact = make_input(0, last, count, "float32", seed).copy()
        for r in range(1, n):
            exact += make_input(r, last, count, "float32", seed)
        out_q.put((rank, times, int(np.count_nonzero(out != exact))))
    finally:
        sock.close()
        ctx.term()


def measure_row(size: int, workers: int = 2, iters: int = 20, warmup: int = 5,
                seed: int = 0) -> RelayRow:
    """One size: launch the relay and ``workers`` processes, time, check, clean up."""
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    count = max(size // 4, 1)
    mpc = mp.get_context("spawn")  # fork is unsafe once numba's OpenMP pool has started
    with tempfile.TemporaryDirectory(prefix="semfab-relay-") as tmp:
        path = os.path.join(tmp, "relay")
        out_q = mpc.Queue()
        procs = [mpc.Process(target=_relay, args=(path, workers, count, warmup + iters),
                             daemon=True)]
        procs += [mpc.Process(target=_worker, args=(path, r, workers, count, warmup, iters,
                                                    seed, out_q), daemon=True)
                  for r in range(workers)]
        for p in procs:
            p.start()
        try:
            results = [out_q.get(timeout=ROW_TIMEOUT_S) for _ in range(workers)]
        except Exception as exc:
            raise RuntimeError(f"relay row of {size} B did not finish in {ROW_TIMEOUT_S:.0f} s "
                               f"({type(exc).__name__})") from None
        finally:
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5.0)
    per_iter = np.max(np.array([t for _, t, _ in sorted(results)]), axis=0)
    med = float(np.median(per_iter))
    nbytes = count * 4
    busbw = nbytes / (med * 1e-6) * (2 * (workers - 1) / workers) / 1e9 if workers > 1 else 0.0
    return RelayRow(nbytes, count, workers, iters, med, float(per_iter.min()),
                    float(np.percentile(per_iter, 99)), busbw, sum(w for _, _, w in results))


def _sizes(begin: int, end: int, factor: float) -> list[int]:
    if begin < 4 or end < begin or factor <= 1:
        raise UsageError("need 4 <= --begin <= --end and --factor > 1")
    out, s = [], float(begin)
    while s <= end:
        out.append(int(s) // 4 * 4)
        s *= factor
    return out


def format_row(r: RelayRow) -> str:
    """One fixed-width row, printed when it is done."""
    return (f"{r.size:>12} {r.workers:>8} {r.time_us:>11.1f} {r.min_us:>10.1f} "
            f"{r.p99_us:>10.1f} {r.busbw_gbps:>9.3f} {r.wrong:>7}")


HEADER = (f"#{'size(B)':>11} {'workers':>8} {'time(us)':>11} {'min(us)':>10} {'p99(us)':>10} "
          f"{'busbw':>9} {'#wrong':>7}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options."""
    p.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    p.add_argument("-b", "--begin", type=parse_size, default=parse_size("1M"),
                   help="smallest size in bytes per worker (default: 1M)")
    p.add_argument("-e", "--end", type=parse_size, default=parse_size("16M"),
                   help="largest size in bytes (default: 16M)")
    p.add_argument("-f", "--factor", type=float, default=4.0,
                   help="size multiplier between rows (default: 4)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default: 20)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations (default: 5)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write the rows and settings as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")


def run(args: argparse.Namespace) -> int:
    """Run every size; a row that failed or was wrong makes the run fail (exit 1)."""
    if not 1 <= args.workers <= 8:
        raise UsageError("--workers must be 1..8 (processes on this machine)")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0")
    sizes = _sizes(args.begin, args.end, args.factor)
    print(f"# semfab bench relay: {args.workers} workers through one ZeroMQ relay process "
          f"(ipc), float32 sum, {args.warmup} warm-up + {args.iters} timed iterations; "
          "no protocol: the floor of the frame plane's design", flush=True)
    print(HEADER, flush=True)
    rows: list[RelayRow] = []
    failed = 0
    for size in sizes:
        try:
            row = measure_row(size, args.workers, args.iters, args.warmup, args.seed)
        except RuntimeError as exc:
            print(f"# {size} B: failed: {exc}", flush=True)
            failed += 1
            continue
        rows.append(row)
        failed += row.wrong > 0
        print(format_row(row), flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(markdown_table(
                ["size (B)", "workers", "time (µs)", "min (µs)", "p99 (µs)", "busbw (GB/s)",
                 "wrong"],
                [[str(r.size), str(r.workers), f"{r.time_us:.1f}", f"{r.min_us:.1f}",
                  f"{r.p99_us:.1f}", f"{r.busbw_gbps:.3f}", str(r.wrong)] for r in rows]))
                    + "\n")
    print(f"# {len(sizes)} rows: {len(rows) - sum(r.wrong > 0 for r in rows)} ok, {failed} failed",
          flush=True)
    return 1 if failed else 0

