"""One rank of the gloo peer: ``torch.distributed`` collectives of CPU tensors.

Started by :func:`bench.peers.run_gloo`, one process per rank::

    python -m bench.peer_gloo --rank R --init tcp://127.0.0.1:PORT --world N \\
        --sizes 4096,65536 --result /tmp/.../result.jsonl

The timing loop is :func:`bench.peers.worker_loop` (allreduce) or
:func:`bench.peers.collective_loop` (``--collective``), shared with the MPI peer.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.peers import run_rank, worker_parser


class GlooComm:
    """:class:`bench.peers.PeerComm` over an initialised gloo process group."""

    def __init__(self, op: str) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._op = {
            "sum": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }[op]

    def barrier(self) -> None:
        self._dist.barrier()

    def prepare(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        # torch.from_numpy shares memory, so the in-place allreduce leaves the
        # result in the NumPy array too; no copy inside or outside the timing.
        if not x.flags.writeable or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x).copy()
        if x.dtype.name == "bfloat16":
            # torch cannot wrap ml_dtypes' bfloat16 directly: share the bits.
            tensor = self._torch.from_numpy(x.view(np.int16)).view(self._torch.bfloat16)
        else:
            tensor = self._torch.from_numpy(x)
        return x, tensor

    def _tensor(self, x: np.ndarray) -> Any:
        return self.prepare(x)[1]

    def prepare_collective(self, kind: str, x: np.ndarray, out: np.ndarray | None,
                           root: int) -> tuple[Callable[[], None], np.ndarray | None]:
        """The collective set through torch.distributed: all_gather_into_tensor,
        reduce_scatter_tensor, broadcast, reduce, all_to_all_single, isend + irecv."""
        dist, t = self._dist, self._tensor(x)
        o = self._tensor(out) if out is not None else None
        r, w = self.rank, self.world
        if kind == "all_gather":
            return (lambda: dist.all_gather_into_tensor(o, t)), out
        if kind == "reduce_scatter":
            return (lambda: dist.reduce_scatter_tensor(o, t, op=self._op)), out
        if kind == "broadcast":
            return (lambda: dist.broadcast(t, src=root)), x  # in place
        if kind == "reduce":
            return (lambda: dist.reduce(t, dst=root, op=self._op)), (x if r == root else None)
        if kind == "alltoall":
            return (lambda: dist.all_to_all_single(o, t)), out
        if kind == "sendrecv":
            def sendrecv() -> None:
                for req in (dist.isend(t, (r + 1) % w), dist.irecv(o, (r - 1) % w)):
                    req.wait()

            return sendrecv, out
        raise ValueError(f"unknown collective {kind!r}")

    def allreduce(self, handle: tuple[np.ndarray, Any]) -> None:
        self._dist.all_reduce(handle[1], op=self._op)

    def result(self, handle: tuple[np.ndarray, Any]) -> np.ndarray:
        return handle[0]

    def gather_times(self, times_ns: list[int]) -> list[list[int]] | None:
        mine = self._torch.tensor(times_ns, dtype=self._torch.int64)
        everyone = [self._torch.zeros_like(mine) for _ in range(self.world)]
        self._dist.all_gather(everyone, mine)
        return [t.tolist() for t in everyone] if self.rank == 0 else None

    def sum_int(self, value: int) -> int:
        t = self._torch.tensor([value], dtype=self._torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM)
        return int(t.item())


def main(argv: list[str] | None = None) -> int:
    """Join the gloo group, run the shared sweep, leave the group."""
    parser = worker_parser("python -m bench.peer_gloo")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init", required=True, help="tcp://HOST:PORT rendezvous")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        print("this torch build has no gloo backend", file=sys.stderr)
        return 3
    dist.init_process_group(
        backend="gloo",
        init_method=args.init,
        rank=args.rank,
        world_size=args.world,
        # Bounds every collective too, so a dead peer ends in an error, not a hang.
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        run_rank(GlooComm(args.op), args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
