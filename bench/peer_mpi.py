"""One rank of the MPI peer: mpi4py ``Comm.Allreduce`` (and the collective set) on NumPy buffers.

Started by :func:`bench.peers.run_mpi` as::

    mpirun -np N [--oversubscribe --bind-to none --allow-run-as-root] \\
        python -m bench.peer_mpi --world N --sizes 4096,65536 --result /tmp/.../result.jsonl

``mpirun`` is the one beside the running Python when there is one (what
``pip install 'semfab[peers]'`` puts in a venv, matching the Open MPI that
mpi4py loads), else the first on PATH. As root, the launcher also gets
``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``.

Uses the upper-case, buffer-interface call (no pickling), out of place: the
input array is the send buffer, a receive buffer allocated once per size is
the output. The timing loop is :func:`bench.peers.worker_loop`.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.peers import run_rank, worker_parser


class MpiComm:
    """:class:`bench.peers.PeerComm` over ``MPI.COMM_WORLD``."""

    def __init__(self, op: str) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.world = self._comm.Get_size()
        self._op = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        # One receive buffer per (count, dtype), reused by every iteration of a
        # size so its pages are already mapped when timing starts.
        self._recv: dict[tuple[int, str], np.ndarray] = {}

    def barrier(self) -> None:
        self._comm.Barrier()

    def prepare(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.ascontiguousarray(x)
        key = (x.size, x.dtype.str)
        recv = self._recv.get(key)
        if recv is None:
            self._recv.clear()  # keep only the current size alive
            recv = self._recv[key] = np.empty_like(x)
        return x, recv

    def prepare_collective(self, kind: str, x: np.ndarray, out: np.ndarray | None,
                           root: int) -> tuple[Callable[[], None], np.ndarray | None]:
        """The collective set through mpi4py's buffer calls: Allgather,
        Reduce_scatter_block, Bcast, Reduce, Alltoall, Sendrecv. bfloat16 (no MPI
        datatype) moves as 16-bit integers where nothing is reduced (exact bits)."""
        c, r, w = self._comm, self.rank, self.world
        xs, os_ = x, out
        if x.dtype.name == "bfloat16":
            xs = x.view(np.uint16)
            os_ = out.view(np.uint16) if out is not None else None
        if kind == "all_gather":
            return (lambda: c.Allgather(xs, os_)), out
        if kind == "reduce_scatter":
            return (lambda: c.Reduce_scatter_block(xs, os_, op=self._op)), out
        if kind == "broadcast":
            return (lambda: c.Bcast(xs, root=root)), x  # in place
        if kind == "reduce":
            recv = os_ if r == root else None
            return (lambda: c.Reduce(xs, recv, op=self._op, root=root)), \
                (out if r == root else None)
        if kind == "alltoall":
            return (lambda: c.Alltoall(xs, os_)), out
        if kind == "sendrecv":
            return (lambda: c.Sendrecv(xs, dest=(r + 1) % w, recvbuf=os_,
                                       source=(r - 1) % w)), out
        raise ValueError(f"unknown collective {kind!r}")

    def allreduce(self, handle: tuple[np.ndarray, np.ndarray]) -> None:
        self._comm.Allreduce(handle[0], handle[1], op=self._op)

    def result(self, handle: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        return handle[1]

    def gather_times(self, times_ns: list[int]) -> list[list[int]] | None:
        gathered: Any = self._comm.gather(times_ns, root=0)
        return list(gathered) if self.rank == 0 else None

    def sum_int(self, value: int) -> int:
        return int(self._comm.allreduce(value, op=self._mpi.SUM))


def main(argv: list[str] | None = None) -> int:
    """Run the shared sweep on this rank; abort the whole job on any error."""
    args = worker_parser("python -m bench.peer_mpi").parse_args(argv)
    from mpi4py import MPI

    try:
        run_rank(MpiComm(args.op), args)
    except BaseException:
        # Without Abort the other ranks would wait in a collective until the
        # parent's timeout; Abort makes mpirun end them all at once.
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
