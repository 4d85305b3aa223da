"""`semfab bench allreduce`: every path and the real peers, side by side in one run.

For each worker count, one fabric is launched and every semfab path runs on it
over the same sizes; gloo and MPI run on the same sizes and process counts in
the same run. Timing (also used by the peers, see docs/PEERS.md): per size,
``warmup`` untimed iterations, then ``iters`` timed ones, each after a
barrier; each rank times its own call; an iteration's time is the maximum over
ranks; the row reports the median (time), p50, p99, min and max.

Inputs come from ``kernels.reference.make_tensor(rank, iteration, ...)``: a
fresh tensor every iteration whose exact allreduce result is known, so
``-c 1`` counts wrong elements exactly.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import numpy as np

from bench import report
from fabric.endpoint import PATHS
from fabric.errors import UsageError

log = logging.getLogger("semfab.bench.allreduce")

PEERS = ("gloo", "mpi")
ALL_PATHS = (*PATHS, *PEERS)
#: The quick default (`semfab bench`): under two minutes on a 2-core machine.
QUICK = dict(begin="4K", end="16M", factor=4, workers="2",
             paths=",".join(ALL_PATHS), warmup=2, iters=5)


def measure_on_worker(ep: Any, path: str, sizes: list[int], dtype: str, op: str, warmup: int,
                      iters: int, check: bool, seed: int) -> list[dict[str, Any]]:
    """Runs on every worker: time ``path`` at every size. Returns one dict per size."""
    from kernels.dtypes import np_dtype
    from kernels.reference import count_wrong, expected_allreduce, make_tensor

    item = np_dtype(dtype).itemsize
    buf = ep.alloc(max(sizes) // item, dtype)  # registered memory, reused for every size
    results = []
    for size in sizes:
        count = size // item
        x = buf[:count]
        sem0 = ep.sem(path).copy()
        fallbacks0 = len(ep.fallbacks)
        times: list[float] = []
        wrong = 0
        for it in range(warmup + iters):
            np.copyto(x, make_tensor(ep.rank, it, count, dtype, seed))
            ep.barrier()
            t0 = time.perf_counter_ns()
            ep.allreduce(x, op=op, path=path, out=x)
            t1 = time.perf_counter_ns()
            if it >= warmup:
                times.append((t1 - t0) / 1e3)
            if check:
                wrong += count_wrong(x, expected_allreduce(ep.world, it, count, dtype, op, seed))
        sem = ep.sem(path).minus(sem0)
        results.append({"size": size, "times_us": times, "wrong": wrong,
                        "chunks": sem.chunks / max(warmup + iters, 1), **sem.per_chunk(),
                        "fallbacks": ep.fallbacks[fallbacks0:]})
    return results


def combine(path: str, workers: int, dtype: str, op: str, per_rank: list[list[dict[str, Any]]],
            check: bool) -> list[report.AllreduceRow]:
    """Max over ranks per iteration, then the row statistics."""
    rows = []
    for i, first in enumerate(per_rank[0]):
        samples = np.max(np.array([r[i]["times_us"] for r in per_rank]), axis=0)
        wrong = sum(r[i]["wrong"] for r in per_rank) if check else -1
        notes = sorted({n for r in per_rank for n in r[i]["fallbacks"]})
        rows.append(report.AllreduceRow.from_samples(
            path, workers, first["size"], dtype, op, samples.tolist(), wrong,
            copies=first["copies"], encodes=first["encodes"], crossings=first["crossings"],
            hops=first["hops"], chunks=int(first["chunks"]), note="; ".join(notes),
        ))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab bench allreduce` (nccl-tests style where they overlap)."""
    p.add_argument("-b", "--begin", default="4K", help="smallest size in bytes (4K, 1M, ...)")
    p.add_argument("-e", "--end", default="64M", help="largest size in bytes")
    p.add_argument("-f", "--factor", type=float, default=4, help="size multiplication factor")
    p.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
    p.add_argument("--paths", default=",".join(ALL_PATHS),
                   help=f"comma-separated, from: {', '.join(ALL_PATHS)}")
    p.add_argument("-d", "--dtype", default="float32",
                   help="float32, float16, bfloat16, int32 or int64")
    p.add_argument("-o", "--op", default="sum", help="sum, max or min")
    p.add_argument("-w", "--warmup", type=int, default=3, help="untimed iterations per size")
    p.add_argument("-n", "--iters", type=int, default=10, help="timed iterations per size")
    p.add_argument("-c", "--check", type=int, default=1, help="1: count wrong elements")
    p.add_argument("--seed", type=int, default=0, help="input seed")
    p.add_argument("--topology", help="a topology file (default: a star of --workers)")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="shape every link of the default star to this bandwidth (0: unshaped)")
    p.add_argument("--link-latency-us", type=float, default=0.0,
                   help="one-way latency added on every link of the default star")
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--plot", metavar="PATH", help="write busbw against size as PNG")
    p.add_argument("--run-dir", help="where process logs go (default: ./runs/<stamp>)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any single wait may take before the run fails")


def _parse(args: argparse.Namespace) -> tuple[list[int], list[int], list[str]]:
    try:
        sizes = report.size_range(args.begin, args.end, args.factor)
    except ValueError as exc:
        raise UsageError(f"sizes: {exc}") from None
    try:
        workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    except ValueError:
        raise UsageError(f"--workers must be integers like 2,4; got {args.workers!r}") from None
    if not workers or any(not 1 <= w <= 8 for w in workers):
        raise UsageError("--workers: each count must be 1..8 on one machine")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in ALL_PATHS]
    if bad:
        raise UsageError(f"unknown path(s) {', '.join(bad)}; choose from {', '.join(ALL_PATHS)}")
    if args.dtype not in ("float32", "float16", "bfloat16", "int32", "int64"):
        raise UsageError(f"--dtype {args.dtype!r}: use float32, float16, bfloat16, int32, int64")
    if args.op not in ("sum", "max", "min"):
        raise UsageError(f"--op {args.op!r}: use sum, max or min")
    if args.link_gbps < 0 or args.link_latency_us < 0:
        raise UsageError("--link-gbps and --link-latency-us must be >= 0")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0")
    item = report.dtype_itemsize(args.dtype)
    if any(s % item for s in sizes):
        raise UsageError(f"every size must be a multiple of the {args.dtype} size ({item} B)")
    return sizes, workers, paths


def run(args: argparse.Namespace) -> int:
    """Entry point of `semfab bench allreduce`."""
    from fabric.launcher import launch
    from fabric.topology import load, star

    sizes, worker_counts, paths = _parse(args)
    ours = [p for p in paths if p in PATHS]
    peers = [p for p in paths if p in PEERS]
    rows: list[report.AllreduceRow] = []
    total = len(worker_counts) * len(paths)
    t_start = time.monotonic()
    with report.progress(total, "allreduce") as bar:
        for w in worker_counts:
            if ours:
                topo = load(args.topology) if args.topology else star(
                    w, bandwidth_gbps=args.link_gbps, latency_us=args.link_latency_us)
                kw: dict[str, Any] = dict(timeout_s=args.timeout)
                if args.run_dir:
                    kw["run_dir"] = f"{args.run_dir}/w{w}"
                fab = launch(topology=topo, **kw)
                with fab:
                    if len(fab.topo.workers) != w:
                        raise UsageError(f"--topology has {len(fab.topo.workers)} workers, "
                                         f"--workers asks for {w}")
                    for path in ours:
                        bar.describe(f"{path} x{w}")
                        per_rank = fab.run(measure_on_worker, path, sizes, args.dtype, args.op,
                                           args.warmup, args.iters, bool(args.check), args.seed)
                        rows += combine(path, w, args.dtype, args.op, per_rank,
                                        bool(args.check))
                        bar.advance()
            for peer in peers:
                bar.describe(f"{peer} x{w}")
                rows += _run_peer(peer, w, sizes, args)
                bar.advance()
    table = report.format_allreduce_table(rows)
    print(table)
    print(f"\n# {len(rows)} rows in {time.monotonic() - t_start:.1f} s")
    if args.json:
        report.write_json(args.json, "allreduce", [r.to_dict() for r in rows])
    if args.markdown:
        report.write_markdown(args.markdown, table + "\n")
    if args.plot:
        report.plot_busbw(rows, args.plot, f"allreduce {args.dtype} {args.op}: busbw")
    failed = any(r.ran and r.wrong > 0 for r in rows)
    return 1 if failed else 0


def _run_peer(peer: str, workers: int, sizes: list[int],
              args: argparse.Namespace) -> list[report.AllreduceRow]:
    from bench import peers

    fn = peers.run_gloo if peer == "gloo" else peers.run_mpi
    result: list[report.AllreduceRow] = fn(workers, sizes, dtype=args.dtype,
                                           warmup=args.warmup, iters=args.iters,
                                           check=bool(args.check))
    return result


def quick_args() -> argparse.Namespace:
    """The arguments of the quick default benchmark (`semfab bench`)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    for k, v in QUICK.items():
        setattr(args, k, v)
    return args
