"""The ``semfab`` process group: torch's collectives on the fabric's communicators.

Each method checks its arguments on the caller's thread (a refusal is a
:class:`~fabric.torch.errors.TorchOpError` naming the rank and the operation,
raised at once), stages the tensors as NumPy views, and queues the fabric call
on the process's communication thread (:mod:`fabric.torch.comm`). The Work it
returns resolves to the output tensors.

Ranks given to a method (roots, peers) are group ranks, as torch passes them;
the group's communicator maps them to fabric workers.
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist

from fabric.torch.comm import FabricWork
from fabric.torch.errors import TorchOpError
from fabric.torch.options import Options, path_for
from fabric.torch.runtime import Runtime
from fabric.torch.tensors import (
    Staged,
    check_tensor,
    finish,
    reduce_op,
    stage_in,
    stage_out,
)
from fabric.torch.trace import active as recording

__all__ = ["BACKEND", "SemfabProcessGroup"]

BACKEND = "semfab"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


#: A send or receive waiting to run: kind, its staged tensor, the peer's world
#: rank, and the function that completes its Work.
_P2P = tuple[str, Staged, int, Callable[[Any], None]]


def _fail_parts(fut: torch.futures.Future[Any], batch: list[_P2P]) -> None:
    """A batch that failed, or never ran (an earlier operation broke the thread),
    fails each of its sends and receives with its error."""
    try:
        fut.value()
    except Exception as exc:
        for *_, complete in batch:
            complete(exc)


def _sizes(ts: Sequence[torch.Tensor], op: Any = None) -> tuple[Any, ...]:
    """What every rank must agree on for an operation on ``ts`` (SEMFAB_CHECK)."""
    return (str(getattr(op, "op", op)), *[(t.numel(), str(t.dtype)) for t in ts])


_Method = TypeVar("_Method", bound=Callable[..., FabricWork])


def _collective(method: _Method) -> _Method:
    """A collective of the group: an argument this rank refuses (a wrong size, a
    bad dtype) also ends the operation on the other ranks, which raise the
    fabric's CallAborted naming this rank instead of waiting for it."""

    @functools.wraps(method)
    def refused_everywhere(self: SemfabProcessGroup, *args: Any, **kwargs: Any) -> FabricWork:
        outer = not self._in_collective  # one torch operation, one abandoned call
        self._in_collective = True
        try:
            return method(self, *args, **kwargs)
        except TorchOpError as exc:
            if outer and not self._closed:
                self._abandon(exc)
            raise
        finally:
            if outer:
                self._in_collective = False

    return cast(_Method, refused_everywhere)


def _opt(opts: Any, name: str, default: Any) -> Any:
    return getattr(opts, name, default) if opts is not None else default


class SemfabProcessGroup(dist.ProcessGroup):
    """A torch process group whose members are fabric workers (see the module doc)."""

    def __init__(self, rt: Runtime, rank: int, size: int, ranks: Sequence[int],
                 comm: Any, options: Options) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (rank, size) exists
        self.rt = rt
        self._rank = rank
        self._size = size
        self.ranks = tuple(ranks)  # world ranks in group-rank order
        self.comm = comm  # a fabric Communicator, or None for the whole world
        self.options = options.resolved()
        self._name = ""
        self._desc = ""
        # sends and receives not queued yet (see _p2p); those of batch_isend_irecv
        self._p2p_lock = threading.Lock()
        self._pending: list[_P2P] = []
        self._batch: list[_P2P] | None = None
        self._closed = False
        self._in_collective = False  # inside a collective method (see _collective)
        self._memory_plane = rt.memory_plane

    # ------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """The backend's name: ``semfab``."""
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        """Torch names every group (DeviceMesh and FSDP2 look groups up by it)."""
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        """The name torch gave this group."""
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        """Torch's description of this group."""
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        """The description torch gave this group."""
        return self._desc

    def __repr__(self) -> str:
        return f"SemfabProcessGroup(rank={self._rank}, size={self._size}, ranks={list(self.ranks)})"

    # ------------------------------------------------------------ plumbing
    @property
    def _target(self) -> Any:
        """The group's fabric side (read on the comm thread: a recording in force
        at run time sees the call)."""
        target = self.comm if self.comm is not None else self.rt.ep
        rec = recording()
        return rec.proxy(target, self.ranks) if rec is not None else target

    def _refuse(self, what: str, reason: str) -> TorchOpError:
        return TorchOpError(self.rt.rank, what, reason)

    def _submit(self, what: str, run: Callable[[], None], result: Any,
                sig: tuple[Any, ...] | None = None) -> FabricWork:
        """Queue ``run``; with checks on (SEMFAB_CHECK=1), the group's ranks first
        agree on ``sig`` (the operation and the sizes that must match)."""
        if self._closed:
            raise self._refuse(what, "the process group was destroyed")
        self._flush_p2p()  # sends and receives issued before this run before it
        if sig is not None and self.options.check:
            desc, inner = f"{what} {sig}", run

            def run() -> None:
                self._agree(desc, what)
                inner()

        return self.rt.comm.submit(run, result, what)

    def _agree(self, desc: str, what: str) -> None:
        """All-gather a checksum of ``desc``; a typed refusal naming the ranks that
        issued something else (the fabric stays usable: only the check ran)."""
        mine = np.array([zlib.crc32(desc.encode())], np.int64)
        seen = np.empty(self._size, np.int64)
        self._target.collective("all_gather", mine, seen, path="ina")
        others = [k for k in range(self._size) if seen[k] != mine[0]]
        if others:
            raise self._refuse(what, f"group ranks {others} issued another operation or other "
                               f"sizes (this rank: {desc})")

    def _abandon(self, exc: TorchOpError) -> None:
        """Queue this rank's end of the operation it refused: one fabric call of the
        group, abandoned at once (the peers are told; fabric.core.calls)."""
        ep, comm = self.rt.ep, self.comm

        def run() -> None:
            with ep.group_call(comm):
                raise exc

        self.rt.comm.submit(run, None, "refused operation")

    def _path(self, kind: str, nbytes: int) -> str:
        return path_for(kind, self.options.path or "ina", nbytes, self._memory_plane)

    def _fixed(self, dtype: torch.dtype, op: str) -> bool:
        return self.options.numerics == "fixed" and op == "sum" and dtype in _FLOATS

    def _allreduce_array(self, x: np.ndarray, dtype: torch.dtype, op: str) -> None:
        """Allreduce ``x`` in place (on the comm thread)."""
        if self._fixed(dtype, op):
            # fixed point takes float32: half types are widened and narrowed back
            wide = x if x.dtype == np.float32 else x.astype(np.float32)
            self._target.allreduce(wide, op="sum", path=self._path("allreduce", x.nbytes),
                                   out=wide, numerics="fixed")
            if wide is not x:
                x[...] = wide.astype(x.dtype)
            return
        self._target.allreduce(x, op=op, path=self._path("allreduce", x.nbytes), out=x)

    def _tensors(self, ts: Any, what: str) -> list[torch.Tensor]:
        if not isinstance(ts, (list, tuple)) or not ts:
            raise self._refuse(what, "expected a non-empty list of tensors")
        return [check_tensor(t, self.rt.rank, what) for t in ts]

    def _one(self, ts: Any, what: str) -> torch.Tensor:
        lst = self._tensors(ts, what)
        if len(lst) != 1:
            raise self._refuse(what, f"takes one tensor per process, got {len(lst)}")
        return lst[0]

    def _root(self, opts: Any, what: str) -> int:
        root = int(_opt(opts, "rootRank", 0))
        if not 0 <= root < self._size:
            raise self._refuse(what, f"root {root} is not a rank of the group "
                               f"(0..{self._size - 1})")
        return root

    # ------------------------------------------------------------ allreduce
    # (torch's stubs list the Python-level overloads of these methods; the C++
    # trampoline calls the (tensors, opts) form, hence the override ignores)
    @_collective
    def allreduce(self, tensors: Any, opts: Any = None) -> FabricWork:  # type: ignore[override]
        """Reduce each tensor over the group, in place (SUM, AVG, MAX, MIN)."""
        what = "allreduce"
        ts = self._tensors(tensors, what)
        ops = [reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), t.dtype, self.rt.rank, what)
               for t in ts]
        staged = [stage_in(t, True, self.rt.rank, what) for t in ts]

        def run() -> None:
            for s, (op, avg) in zip(staged, ops, strict=True):
                if s.array.size:
                    self._allreduce_array(s.array, s.tensor.dtype, op)
                finish(s)
                if avg:
                    s.tensor.detach().div_(self._size)

        return self._submit(what, run, ts, sig=_sizes(ts, ops[0][0]))

    @_collective
    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> FabricWork:
        """Allreduce several tensors as one buffer per dtype."""
        what = "allreduce_coalesced"
        ts = self._tensors(tensors, what)
        ops = {reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), t.dtype, self.rt.rank, what)
               for t in ts}
        (op, avg), = ops
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in ts:
            by_dtype.setdefault(t.dtype, []).append(t)

        def run() -> None:
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                s = stage_in(flat, True, self.rt.rank, what)
                self._allreduce_array(s.array, flat.dtype, op)
                finish(s)
                if avg:
                    flat.div_(self._size)
                offset = 0
                for t in group:
                    n = t.numel()
                    t.detach().copy_(flat[offset:offset + n].view(t.shape))
                    offset += n

        return self._submit(what, run, ts, sig=_sizes(ts, op))

    # ------------------------------------------------------------ broadcast / reduce
    @_collective
    def broadcast(self, tensors: Any, opts: Any = None) -> FabricWork:  # type: ignore[override]
        """The root's tensor on every rank, in place."""
        what = "broadcast"
        t = self._one(tensors, what)
        root = self._root(opts, what)
        s = stage_in(t, False, self.rt.rank, what)

        def run() -> None:
            if s.array.size:
                self._target.collective("broadcast", s.array, s.array, root=root,
                                        path=self._path("broadcast", s.array.nbytes))
            finish(s)

        return self._submit(what, run, [t], sig=(*_sizes([t]), root))

    @_collective
    def reduce(self, tensors: Any, opts: Any = None) -> FabricWork:  # type: ignore[override]
        """Reduce over the group into the root's tensor (others keep theirs)."""
        what = "reduce"
        t = self._one(tensors, what)
        root = self._root(opts, what)
        op, avg = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), t.dtype, self.rt.rank,
                            what)
        s = stage_in(t, True, self.rt.rank, what, copy=True)
        mine = self._rank == root

        def run() -> None:
            if s.array.size:
                if self._fixed(t.dtype, op):
                    self._allreduce_array(s.array, t.dtype, op)  # reproducible sums
                else:
                    out = np.empty_like(s.array)
                    self._target.collective("reduce", s.array, out, op=op, root=root,
                                            path=self._path("reduce", s.array.nbytes))
                    if mine:
                        s.array[...] = out
            if mine:
                finish(s)
                if avg:
                    t.detach().div_(self._size)

        return self._submit(what, run, [t], sig=(*_sizes([t], op), root))

    # ------------------------------------------------------------ gathers
    def _gather_into(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Callable[[], None]:
        """all_gather of ``inp`` into the flat ``out`` (size x numel(inp))."""
        if out.numel() != inp.numel() * self._size or out.dtype != inp.dtype:
            raise self._refuse(what, f"output has {out.numel()} {out.dtype} elements; it needs "
                               f"{self._size} x {inp.numel()} {inp.dtype}")
        # FSDP2's input is a view of its own output: read it before the output is written
        alias = inp.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        x = stage_in(inp, False, self.rt.rank, what, copy=alias)
        o = stage_out(out, self.rt.rank, what)

        def run() -> None:
            if x.array.size:
                self._target.collective("all_gather", x.array, o.array,
                                        path=self._path("all_gather", x.array.nbytes))
            finish(o)

        return run

    @_collective
    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> FabricWork:
        """Every rank's tensor into each rank's list, in rank order."""
        what = "allgather"
        inp = self._one(input_tensors, what)
        if not isinstance(output_tensors, (list, tuple)) or len(output_tensors) != 1:
            raise self._refuse(what, "expected one list of output tensors")
        outs = self._tensors(output_tensors[0], what)
        if len(outs) != self._size:
            raise self._refuse(what, f"{len(outs)} output tensors for a group of {self._size}")
        for o in outs:
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise self._refuse(what, f"output tensor of {o.numel()} {o.dtype} elements for "
                                   f"an input of {inp.numel()} {inp.dtype} (all sizes must "
                                   "be equal)")
        flat = torch.empty(self._size * inp.numel(), dtype=inp.dtype)
        gather = self._gather_into(flat, inp, what)

        def run() -> None:
            gather()
            for k, o in enumerate(outs):
                o.detach().copy_(flat[k * inp.numel():(k + 1) * inp.numel()].view(o.shape))

        return self._submit(what, run, [outs], sig=_sizes([inp]))

    @_collective
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                        opts: Any = None) -> FabricWork:
        """all_gather into one flat tensor (``all_gather_into_tensor``)."""
        what = "all_gather_into_tensor"
        out = check_tensor(output, self.rt.rank, what)
        inp = check_tensor(input, self.rt.rank, what)
        return self._submit(what, self._gather_into(out, inp, what), [out], sig=_sizes([inp]))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> FabricWork:
        """torch's newer name of :meth:`_allgather_base`."""
        return self._allgather_base(output, input, opts)

    @_collective
    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> FabricWork:
        """Several flat all_gathers, run in order as one Work."""
        what = "allgather_into_tensor_coalesced"
        outs, ins = self._tensors(outputs, what), self._tensors(inputs, what)
        if len(outs) != len(ins):
            raise self._refuse(what, f"{len(outs)} outputs for {len(ins)} inputs")
        runs = [self._gather_into(o, i, what) for o, i in zip(outs, ins, strict=True)]

        def run() -> None:
            for r in runs:
                r()

        return self._submit(what, run, outs, sig=_sizes(ins))

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any,
                                    opts: Any = None) -> FabricWork:
        """torch's newer name of :meth:`allgather_into_tensor_coalesced`."""
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists: Any, inputs: Any,
                            opts: Any = None) -> FabricWork:
        """One list all_gather per input tensor, as one Work."""
        what = "allgather_coalesced"
        ins = self._tensors(inputs, what)
        if not isinstance(output_lists, (list, tuple)) or len(output_lists) != len(ins):
            raise self._refuse(what, "expected one output list per input tensor")
        works = [self.allgather([outs], [i], opts) for outs, i in
                 zip(output_lists, ins, strict=True)]
        return works[-1]  # run in order: the last one completes after the others

    @_collective
    def gather(  # type: ignore[override]
            self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> FabricWork:
        """Every rank's tensor into the root's list."""
        what = "gather"
        inp = self._one(input_tensors, what)
        root = self._root(opts, what)
        mine = self._rank == root
        outs: list[torch.Tensor] = []
        if mine:
            if not isinstance(output_tensors, (list, tuple)) or len(output_tensors) != 1:
                raise self._refuse(what, "the root passes one list of output tensors")
            outs = self._tensors(output_tensors[0], what)
            if len(outs) != self._size or any(o.numel() != inp.numel() for o in outs):
                raise self._refuse(what, f"the root needs {self._size} outputs of "
                                   f"{inp.numel()} elements")
        x = stage_in(inp, False, self.rt.rank, what, copy=True)
        flat = torch.empty(self._size * inp.numel(), dtype=inp.dtype)
        o = stage_out(flat, self.rt.rank, what)

        def run() -> None:
            if x.array.size:
                self._target.collective("gather", x.array, o.array, root=root)
            finish(o)
            for k, t in enumerate(outs):
                t.detach().copy_(flat[k * inp.numel():(k + 1) * inp.numel()].view(t.shape))

        return self._submit(what, run, [outs] if mine else [], sig=(*_sizes([inp]), root))

    @_collective
    def scatter(  # type: ignore[override]
            self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> FabricWork:
        """Tensor ``k`` of the root's list to rank ``k``."""
        what = "scatter"
        out = self._one(output_tensors, what)
        root = self._root(opts, what)
        n = out.numel()
        if self._rank == root:
            if not isinstance(input_tensors, (list, tuple)) or len(input_tensors) != 1:
                raise self._refuse(what, "the root passes one list of input tensors")
            ins = self._tensors(input_tensors[0], what)
            if len(ins) != self._size or any(i.numel() != n for i in ins):
                raise self._refuse(what, f"the root needs {self._size} inputs of {n} elements")
            flat = torch.cat([i.detach().reshape(-1) for i in ins])
        else:
            flat = torch.empty(self._size * n, dtype=out.dtype)
        x = stage_in(flat, False, self.rt.rank, what)
        o = stage_out(out, self.rt.rank, what)

        def run() -> None:
            if n:
                self._target.collective("scatter", x.array, o.array, root=root)
            finish(o)

        return self._submit(what, run, [out], sig=(*_sizes([out]), root))

    # ------------------------------------------------------------ reduce_scatter
    def _reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, opts: Any,
                             what: str) -> Callable[[], None]:
        if inp.numel() != out.numel() * self._size or out.dtype != inp.dtype:
            raise self._refuse(what, f"input has {inp.numel()} {inp.dtype} elements; it needs "
                               f"{self._size} x {out.numel()} {out.dtype}")
        op, avg = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), inp.dtype,
                            self.rt.rank, what)
        x = stage_in(inp, True, self.rt.rank, what, copy=True)
        o = stage_out(out, self.rt.rank, what, reduce=True)
        n, r = out.numel(), self._rank

        def run() -> None:
            if n:
                if self._fixed(inp.dtype, op):
                    # reproducible: a fixed-point allreduce, of which this rank keeps its part
                    self._allreduce_array(x.array, inp.dtype, op)
                    o.array[...] = x.array[r * n:(r + 1) * n]
                else:
                    self._target.collective("reduce_scatter", x.array, o.array, op=op,
                                            path=self._path("reduce_scatter", x.array.nbytes))
            finish(o)
            if avg:
                out.detach().div_(self._size)

        return run

    @_collective
    def reduce_scatter(  # type: ignore[override]
            self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> FabricWork:
        """Reduce tensor ``k`` of every rank's list into rank ``k``'s output."""
        what = "reduce_scatter"
        out = self._one(output_tensors, what)
        if not isinstance(input_tensors, (list, tuple)) or len(input_tensors) != 1:
            raise self._refuse(what, "expected one list of input tensors")
        ins = self._tensors(input_tensors[0], what)
        if len(ins) != self._size or any(i.numel() != out.numel() for i in ins):
            raise self._refuse(what, f"needs {self._size} inputs of {out.numel()} elements")
        flat = torch.cat([i.detach().reshape(-1) for i in ins])
        return self._submit(what, self._reduce_scatter_into(out, flat, opts, what), [out],
                            sig=_sizes([out], _opt(opts, "reduceOp", None)))

    @_collective
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                             opts: Any = None) -> FabricWork:
        """reduce_scatter of one flat tensor (``reduce_scatter_tensor``)."""
        what = "reduce_scatter_tensor"
        out = check_tensor(output, self.rt.rank, what)
        inp = check_tensor(input, self.rt.rank, what)
        return self._submit(what, self._reduce_scatter_into(out, inp, opts, what), [out],
                            sig=_sizes([out], _opt(opts, "reduceOp", None)))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> FabricWork:
        """torch's newer name of :meth:`_reduce_scatter_base`."""
        return self._reduce_scatter_base(output, input, opts)

    @_collective
    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> FabricWork:
        """Several flat reduce_scatters, run in order as one Work."""
        what = "reduce_scatter_tensor_coalesced"
        outs, ins = self._tensors(outputs, what), self._tensors(inputs, what)
        if len(outs) != len(ins):
            raise self._refuse(what, f"{len(outs)} outputs for {len(ins)} inputs")
        runs = [self._reduce_scatter_into(o, i, opts, what) for o, i in zip(outs, ins, strict=True)]

        def run() -> None:
            for r in runs:
                r()

        return self._submit(what, run, outs, sig=_sizes(outs, _opt(opts, "reduceOp", None)))

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> FabricWork:
        """torch's newer name of :meth:`reduce_scatter_tensor_coalesced`."""
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    # ------------------------------------------------------------ alltoall
    def _alltoallv(self, out: torch.Tensor, inp: torch.Tensor, send: list[int],
                   recv: list[int], what: str) -> Callable[[], None]:
        x = stage_in(inp, False, self.rt.rank, what, copy=True)
        o = stage_out(out, self.rt.rank, what)

        def run() -> None:
            self._target.collective("alltoallv", x.array, o.array, send_counts=send,
                                    recv_counts=recv)
            finish(o)

        return run

    def _splits(self, t: torch.Tensor, splits: Any, what: str, side: str) -> list[int]:
        """Element counts per rank of dim-0 ``splits`` (empty: even)."""
        rows = t.shape[0] if t.dim() else t.numel()
        per_row = t.numel() // rows if rows else 0
        sp = [int(s) for s in splits] if splits is not None and len(splits) else []
        if not sp:
            if rows % self._size:
                raise self._refuse(what, f"{side} has {rows} rows, not a multiple of the "
                                   f"group size {self._size}; give split sizes")
            sp = [rows // self._size] * self._size
        if len(sp) != self._size or min(sp) < 0 or sum(sp) != rows:
            raise self._refuse(what, f"{side} split sizes {sp} do not cut {rows} rows into "
                               f"{self._size} parts")
        return [s * per_row for s in sp]

    @_collective
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                      output_split_sizes: Any, input_split_sizes: Any,
                      opts: Any = None) -> FabricWork:
        """``all_to_all_single``: rows of ``input`` to each rank by ``input_split_sizes``
        (empty: even), rows of ``output`` from each by ``output_split_sizes``."""
        what = "all_to_all_single"
        out = check_tensor(output, self.rt.rank, what)
        inp = check_tensor(input, self.rt.rank, what)
        if out.dtype != inp.dtype:
            raise self._refuse(what, f"output {out.dtype} and input {inp.dtype} differ")
        send = self._splits(inp, input_split_sizes, what, "input")
        recv = self._splits(out, output_split_sizes, what, "output")
        # per-rank counts differ by design: the fabric's receivers check each stream's size
        return self._submit(what, self._alltoallv(out, inp, send, recv, what), [out],
                            sig=(str(inp.dtype),))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: Any, input_split_sizes: Any,
                          opts: Any = None) -> FabricWork:
        """torch's newer name of :meth:`alltoall_base`."""
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    @_collective
    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> FabricWork:
        """Tensor ``k`` of the input list to rank ``k``; output ``k`` from rank ``k``."""
        what = "alltoall"
        outs, ins = self._tensors(output_tensors, what), self._tensors(input_tensors, what)
        if len(outs) != self._size or len(ins) != self._size:
            raise self._refuse(what, f"needs {self._size} inputs and outputs")
        if len({t.dtype for t in (*outs, *ins)}) != 1:
            raise self._refuse(what, "every tensor must have the same dtype")
        flat_in = torch.cat([i.detach().reshape(-1) for i in ins])
        flat_out = torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype)
        inner = self._alltoallv(flat_out, flat_in, [i.numel() for i in ins],
                                [o.numel() for o in outs], what)

        def run() -> None:
            inner()
            offset = 0
            for o in outs:
                o.detach().copy_(flat_out[offset:offset + o.numel()].view(o.shape))
                offset += o.numel()

        return self._submit(what, run, outs, sig=(str(outs[0].dtype),))

    # ------------------------------------------------------------ point to point
    def _peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self._size or peer == self._rank:
            raise self._refuse(what, f"peer {peer} is not another rank of the group "
                               f"(0..{self._size - 1})")
        return self.ranks[peer]

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> FabricWork:  # noqa: N803
        """Send one tensor to group rank ``dstRank`` (tags are not matched: messages
        between a pair arrive in the order sent)."""
        what = f"send to rank {dstRank}"
        t = self._one(tensors, what)
        s = stage_in(t, False, self.rt.rank, what, copy=True)
        return self._p2p("send", s, self._peer(dstRank, what), what, [t])

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> FabricWork:  # noqa: N803
        """Receive one tensor from group rank ``srcRank``."""
        what = f"recv from rank {srcRank}"
        t = self._one(tensors, what)
        s = stage_out(t, self.rt.rank, what)
        return self._p2p("recv", s, self._peer(srcRank, what), what, [t])

    def recv_anysource(self, tensors: Any, tag: int = 0) -> FabricWork:
        """Refused: fabric streams name their sender."""
        raise self._refuse("recv (any source)", "receiving from any source is not supported; "
                           "name the sender")

    def _p2p(self, kind: str, s: Staged, peer: int, what: str, result: Any) -> FabricWork:
        # sends and receives wait, collected, until someone waits on one of them or
        # the group runs another operation; then they run together, so that two
        # ranks that both isend before they irecv do not wait on each other
        work, complete = self.rt.comm.deferred(result, what)
        with self._p2p_lock:
            if self._batch is not None:  # batch_isend_irecv: end_coalescing runs them
                self._batch.append((kind, s, peer, complete))
                return work
            self._pending.append((kind, s, peer, complete))
        work.before_wait(self._flush_p2p)
        return work

    def _flush_p2p(self) -> None:
        """Queue the collected sends and receives as one operation."""
        with self._p2p_lock:
            batch, self._pending = self._pending, []
        if batch:
            work = self.rt.comm.submit(self._p2p_run(batch), None,
                                       f"{len(batch)} sends and receives")
            work.get_future().add_done_callback(lambda f: _fail_parts(f, batch))

    def _p2p_run(self, batch: list[_P2P]) -> Callable[[], None]:
        from fabric.core.programs import Parallel, Program, StreamRecv, StreamSend

        ep = self.rt.ep

        def run() -> None:
            progs: list[Program] = [StreamSend(ep.state, peer, s.array) if kind == "send"
                                    else StreamRecv(ep.state, peer, s.array)
                                    for kind, s, peer, _ in batch]
            try:
                ep.run(Parallel(progs), f"{len(progs)} sends and receives")
                for kind, s, _, _ in batch:
                    if kind == "recv":
                        finish(s)
            except Exception as exc:
                for *_, complete in batch:
                    complete(exc)
                raise
            for *_, complete in batch:
                complete(None)

        return run

    @property
    def supports_coalescing(self) -> bool:
        """``batch_isend_irecv`` runs its sends and receives together."""
        return True

    def start_coalescing(self, device: Any) -> None:
        """Collect the following sends and receives (``batch_isend_irecv``)."""
        self._flush_p2p()
        with self._p2p_lock:
            self._batch = []

    def end_coalescing(self, device: Any) -> FabricWork:
        """Run the collected sends and receives at once (none waits for another)."""
        with self._p2p_lock:
            batch, self._batch = self._batch or [], None
        run = self._p2p_run(batch) if batch else (lambda: None)
        work = self._submit("batch_isend_irecv", run, [s.tensor for _, s, _, _ in batch])
        work.get_future().add_done_callback(lambda f: _fail_parts(f, batch))
        return work

    # ------------------------------------------------------------ barrier, teardown
    @_collective
    def barrier(self, opts: Any = None) -> FabricWork:
        """Wait for every rank of the group."""
        return self._submit("barrier", self._target.barrier, [], sig=())

    def shutdown(self) -> None:
        """Release the group's fabric resources (the world group: leave the fabric)."""
        if self._closed:
            return
        self._flush_p2p()
        self._closed = True
        if self.comm is not None:
            if self.rt.comm.broken is None and not self.rt.closed:
                self.rt.comm.call(self.comm.close, "destroy group")
        else:
            self.rt.close()

    def abort(self) -> None:
        """As :meth:`shutdown`."""
        self.shutdown()
