"""nccl-tests' conventions for the collective set: counts, sizes, bandwidth, checks.

One place that says, for each collective `semfab bench <collective>` runs
(and its peers run the same way), how a swept size becomes buffers, what the
``size`` and ``count`` columns show, the bus bandwidth factor, the inputs and
the exact expected output of every rank.

Sizes follow nccl-tests (src/common.cu ``setupArgs`` and each collective's
``*GetCollByteCount`` in src/all_gather.cu, reduce_scatter.cu, alltoall.cu,
broadcast.cu, reduce.cu, sendrecv.cu): a swept size ``S`` gives ``S / itemsize``
elements; all_gather, reduce_scatter and alltoall split them over the ranks
(the per-rank ``count`` is ``(S / itemsize) / nranks`` rounded down to a
multiple of 16 bytes), broadcast, reduce and sendrecv take them whole. The
``size`` column is the larger of the send and receive buffer
(``max(sendBytes, expectedBytes)``), the ``count`` column the per-rank count
NCCL is called with (``nbytes / wordSize``).

Bandwidth follows each collective's ``*GetBw`` in those files: ``algbw`` =
``count * typesize * nranks / time`` for all_gather, reduce_scatter and
alltoall, ``count * typesize / time`` for broadcast, reduce and sendrecv, so in
every case ``algbw = size / time``; ``busbw = algbw * factor`` with factor
``(n-1)/n`` for all_gather, reduce_scatter and alltoall and 1 for broadcast,
reduce and sendrecv (:func:`bench.report.busbw_factor`).

Inputs are ``kernels.checking.make_input(rank, iteration, ...)``: random,
never zero, fresh every iteration, and exactly summable in any order, so every
element of the last iteration's output is compared exactly (``#wrong``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.report import CollectiveRow

__all__ = [
    "KINDS",
    "REDUCING",
    "ROOTED",
    "buffer_counts",
    "expected_output",
    "make_collective_input",
    "make_row",
    "per_rank_count",
    "row_size",
    "unavailable_row",
]

#: The collectives of `semfab bench <collective>`, in the order of the help.
KINDS = ("all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv")
#: Collectives that reduce (they take ``-o``); the others print redop ``none``.
REDUCING = ("reduce_scatter", "reduce")
#: Collectives with a root (``-r``).
ROOTED = ("broadcast", "reduce")
#: Collectives whose swept size is split over the ranks.
SPLIT = ("all_gather", "reduce_scatter", "alltoall")


def per_rank_count(kind: str, size_bytes: int, itemsize: int, nranks: int) -> int:
    """NCCL's count for a swept size (nccl-tests' ``paramcount``)."""
    count = size_bytes // itemsize
    if kind in SPLIT:
        align = max(16 // itemsize, 1)  # nccl-tests: & ~(16/eltSize - 1)
        return (count // nranks) // align * align
    return count


def row_size(kind: str, count: int, itemsize: int, nranks: int) -> int:
    """The ``size`` column: bytes of the larger buffer (nccl-tests'
    ``max(sendBytes, expectedBytes)``) for per-rank ``count``."""
    return count * itemsize * (nranks if kind in SPLIT else 1)


def buffer_counts(kind: str, count: int, nranks: int, rank: int = 0,
                  root: int = 0) -> tuple[int, int]:
    """Elements of (input, output) on ``rank`` for per-rank ``count``; an output of
    0 means none (reduce off the root; broadcast is in place on the input)."""
    if kind == "all_gather":
        return count, count * nranks
    if kind in ("reduce_scatter",):
        return count * nranks, count
    if kind == "alltoall":
        return count * nranks, count * nranks
    if kind == "broadcast":
        return count, 0
    if kind == "reduce":
        return count, count if rank == root else 0
    if kind == "sendrecv":
        return count, count
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")


def make_collective_input(kind: str, rank: int, step: int, count: int, nranks: int,
                          dtype: str, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input at iteration ``step`` (fresh, never zero)."""
    from kernels.checking import make_input

    n_in, _ = buffer_counts(kind, count, nranks, rank)
    return make_input(rank, step, n_in, dtype, seed)


def expected_output(kind: str, rank: int, step: int, count: int, nranks: int, dtype: str,
                    op: str = "sum", root: int = 0, seed: int = 0) -> np.ndarray | None:
    """The exact output of ``rank`` at iteration ``step`` from every rank's
    :func:`make_collective_input` (NumPy, from the definition); None where the rank
    has no output (reduce off the root)."""
    from kernels.checking import expected_allreduce, make_input

    m = count
    if kind == "all_gather":
        return np.concatenate([make_input(k, step, m, dtype, seed) for k in range(nranks)])
    if kind == "reduce_scatter":
        full = expected_allreduce(nranks, step, m * nranks, dtype, op, seed)
        return np.ascontiguousarray(full[rank * m:(rank + 1) * m])
    if kind == "alltoall":
        return np.concatenate([make_input(k, step, m * nranks, dtype, seed)[rank * m:
                                                                            (rank + 1) * m]
                               for k in range(nranks)])
    if kind == "broadcast":
        return make_input(root, step, m, dtype, seed)
    if kind == "reduce":
        return expected_allreduce(nranks, step, m, dtype, op, seed) if rank == root else None
    if kind == "sendrecv":
        return make_input((rank - 1) % nranks, step, m, dtype, seed)
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")


def make_row(kind: str, path: str, workers: int, size_bytes: int, count: int, dtype: str,
             op: str, root: int, samples_us: list[float], wrong: int, *, note: str = "",
             avg_us: float | None = None, **counters: Any) -> CollectiveRow:
    """A measured row of ``kind``: ``size_bytes``/``count`` as :func:`row_size` and
    :func:`per_rank_count` give them; redop ``none`` for a collective that does not
    reduce; root -1 where it has none (as nccl-tests prints them)."""
    row = CollectiveRow.from_samples(
        path, workers, size_bytes, dtype, op if kind in REDUCING else "none", samples_us,
        wrong, note=note, collective=kind, avg_us=avg_us, **counters)
    row.count = count
    row.collective = kind
    row.root = root if kind in ROOTED else -1
    return row


def unavailable_row(kind: str, path: str, workers: int, swept_size: int, dtype: str, op: str,
                    root: int, note: str) -> CollectiveRow:
    """A row of ``kind`` that did not run (``note`` says why) at swept size ``swept_size``."""
    from bench.report import dtype_itemsize

    item = dtype_itemsize(dtype)
    count = per_rank_count(kind, swept_size, item, workers)
    row = CollectiveRow.unavailable(path, workers, row_size(kind, count, item, workers), dtype,
                                    note, op if kind in REDUCING else "none")
    row.count = count
    row.collective = kind
    row.root = root if kind in ROOTED else -1
    return row
