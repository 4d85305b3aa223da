"""Micro-benchmark of ``multicast_reduce`` per backend.

``python -m kernels.microbench --backends numpy numba-cpu --nsrc 2 4 --mib 16``

Bandwidth counts bytes read plus bytes written: ``(nsrc + ndst) * nbytes``
per call, the traffic of a kernel that touches each byte once. One warm-up
call (JIT compile, page faults) is not timed; the median of ``repeats``
timed calls is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np

from .backends import get_backend
from .dtypes import np_dtype


@dataclass(frozen=True)
class MulticastResult:
    """One measurement: median seconds and GB/s (1e9 bytes/s)."""

    backend: str
    nsrc: int
    ndst: int
    nbytes: int
    median_s: float
    gbps: float
    runs: int


def multicast_bandwidth(
    backend: str,
    nsrc: int,
    ndst: int | None = None,
    nbytes: int = 16 << 20,
    dtype: str = "float32",
    op: str = "sum",
    repeats: int = 7,
) -> MulticastResult:
    """Time ``multicast_reduce`` of ``nsrc`` sources of ``nbytes`` into ``ndst`` outputs.

    Outputs are separate arrays (default: one per source, as in an allreduce
    where every participant receives the result), so inputs stay unchanged.
    """
    b = get_backend(backend)
    ndst = nsrc if ndst is None else ndst
    count = nbytes // np_dtype(dtype).itemsize
    srcs = [b.make_tensor(r, 0, count, dtype) for r in range(nsrc)]
    dsts = [b.empty(count, dtype) for _ in range(ndst)]
    b.multicast_reduce(srcs, dsts, op)  # warm-up: compile, first touch
    b.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.multicast_reduce(srcs, dsts, op)
        b.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    moved = (nsrc + ndst) * count * np_dtype(dtype).itemsize
    return MulticastResult(b.name, nsrc, ndst, moved // (nsrc + ndst), med, moved / med / 1e9,
                           repeats)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (prints one line per measurement)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["numpy", "numba-cpu"])
    p.add_argument("--nsrc", nargs="+", type=int, default=[2, 4])
    p.add_argument("--ndst", type=int, default=None, help="default: one per source")
    p.add_argument("--mib", type=float, default=16.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="numba-cpu worker threads")
    args = p.parse_args(argv)
    if args.threads is not None and "numba-cpu" in args.backends:
        from .numba_cpu import NumbaCpuBackend

        backend = get_backend("numba-cpu")
        assert isinstance(backend, NumbaCpuBackend)
        backend.set_threads(args.threads)
    for ns in args.nsrc:
        for name in args.backends:
            r = multicast_bandwidth(
                name, ns, args.ndst, int(args.mib * 2**20), args.dtype, repeats=args.repeats
            )
            threads = f" threads={args.threads}" if args.threads and name == "numba-cpu" else ""
            print(
                f"{r.backend:11s}{threads} nsrc={r.nsrc} ndst={r.ndst} {r.nbytes / 2**20:.0f} MiB "
                f"{args.dtype}: median {r.median_s * 1e3:8.3f} ms  {r.gbps:7.2f} GB/s"
            )


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
