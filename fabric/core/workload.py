"""Workloads written once, run in both worlds.

A workload is a generator function that takes a context (rank, world) and
*yields* the operations it wants done, receiving each one's result::

    def work(ctx, count=1 << 20):
        x = np.full(count, ctx.rank + 1, np.float32)
        y = yield ctx.allreduce(x, path="ina")
        yield ctx.barrier()
        t = yield ctx.clock()          # seconds: virtual in simulation, real in emulation
        return float(y[0])

:func:`fabric.emulation.workloads.run_in_emulation` runs it on a launched fabric's
worker (each operation is the endpoint's blocking call);
``fabric.sim.Simulation.run`` runs the same function in virtual time.
Because the workload only yields, it never blocks the simulator.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fabric.errors import UsageError

__all__ = ["Allreduce", "Barrier", "Clock", "CloseGroup", "Collective", "Compute", "Context",
           "Control", "Counters",
           "MakeGroup", "MoeCombine", "MoeDispatch", "Operation", "Post", "Recv", "Send",
           "Together",
           "check_workload",
           "start_workload",
           "program_of", "stream_program"]


@dataclass(frozen=True)
class Allreduce:
    """Allreduce ``x`` (or, timing-only, ``count`` elements of ``dtype``)."""

    x: np.ndarray | None
    op: str = "sum"
    path: str = "ina"
    out: np.ndarray | None = None
    numerics: str = "float"
    count: int = 0
    dtype: str = "float32"
    group: Any = None


@dataclass(frozen=True)
class Collective:
    """One collective of the nccl-tests set (``kind``: all_gather, reduce_scatter,
    broadcast, reduce, alltoall, alltoallv, gather, scatter); see
    :func:`fabric.core.collective_programs.collective_program` for shapes and paths."""

    kind: str
    x: np.ndarray | None
    out: np.ndarray | None = None
    path: str | None = None
    op: str = "sum"
    root: int = 0
    group: Any = None
    send_counts: tuple[int, ...] | None = None
    recv_counts: tuple[int, ...] | None = None
    count: int = 0
    dtype: str = "float32"


@dataclass(frozen=True)
class MoeDispatch:
    """MoE dispatch (see :func:`fabric.core.moe.moe_dispatch_program`); yields a
    :class:`fabric.core.moe.Dispatched`."""

    x: np.ndarray | None
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    num_experts: int
    variant: str = "flat"
    group: Any = None
    hidden: int = 0
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class MoeCombine:
    """MoE combine of one partial per dispatched row; yields (tokens, hidden)."""

    dispatched: Any
    partials: np.ndarray | None
    group: Any = None


@dataclass(frozen=True)
class MakeGroup:
    """Create a communicator of these world ranks (every member yields it)."""

    ranks: tuple[object, ...]  # as given: group_program checks them


@dataclass(frozen=True)
class CloseGroup:
    """Close a communicator: its jobs are released at the switches."""

    group: Any


@dataclass(frozen=True)
class Send:
    """Send ``x``'s bytes (or, timing-only, ``nbytes``) to worker ``dst`` as a
    reliable WRITE stream under retransmit ``policy``."""

    dst: int
    x: np.ndarray | None
    nbytes: int = 0
    policy: str = "selective"


@dataclass(frozen=True)
class Recv:
    """Receive a stream from worker ``src`` into ``out`` (or ``nbytes``, timing-only)."""

    src: int
    out: np.ndarray | None
    nbytes: int = 0
    policy: str = "selective"


@dataclass(frozen=True)
class Together:
    """Run several sends and receives at once (``sendrecv``); yields their results."""

    ops: tuple[Send | Recv, ...]


@dataclass(frozen=True)
class Post:
    """Hand ``nbytes`` to node ``node`` (a host: ``"host0"``) in the background:
    yields the post's number at once; the frames go reliably while the workload
    goes on, and the receiver logs when each post was whole (simulation:
    ``SimResult.posts``). Posts on one ``channel`` go in order, others beside."""

    node: str
    nbytes: int
    channel: int = 0


@dataclass(frozen=True)
class Barrier:
    """Wait until every worker (or every member of ``group``) reached this barrier."""

    group: Any = None


@dataclass(frozen=True)
class Compute:
    """Stand for ``seconds`` of local work (simulation advances its clock)."""

    seconds: float


@dataclass(frozen=True)
class Clock:
    """Yields the current time in seconds (virtual in simulation)."""


@dataclass(frozen=True)
class Counters:
    """Yields this worker's resend counters so far: ``{"retransmits": n, "timeouts":
    n}`` (frames, chunks or rows sent again, and retransmit timers that ran out)."""


@dataclass(frozen=True)
class Control:
    """A control request to this worker's switch, answered by one of its services
    (an added one included, see docs/ARCHITECTURE.md); yields the reply's fields.
    Resent until answered: the service must answer a repeat alike."""

    t: str
    reply: str
    fields: tuple[tuple[str, Any], ...] = ()


Operation = (Allreduce | Collective | MoeDispatch | MoeCombine | MakeGroup | CloseGroup | Send
             | Recv | Together | Post | Barrier | Compute | Clock | Counters | Control)


class Context:
    """What a workload sees of its worker: rank, world, and operation builders."""

    def __init__(self, rank: int, world: int, name: str) -> None:
        self.rank, self.world, self.name = rank, world, name

    def allreduce(self, x: np.ndarray | None = None, op: str = "sum", path: str = "ina",
                  out: np.ndarray | None = None, numerics: str = "float", *,
                  count: int = 0, dtype: str = "float32", group: Any = None) -> Allreduce:
        """An allreduce; ``x=None`` with ``count``/``dtype`` is timing-only (simulation)."""
        return Allreduce(x, op, path, out, numerics, count, dtype, group)

    def moe_dispatch(self, x: np.ndarray | None, topk_idx: np.ndarray,
                     topk_weights: np.ndarray, num_experts: int, *, variant: str = "flat",
                     group: Any = None, hidden: int = 0,
                     dtype: str = "bfloat16") -> MoeDispatch:
        """Send each token to the ranks of its top-k experts (``x=None``: timing-only)."""
        return MoeDispatch(x, topk_idx, topk_weights, num_experts, variant, group, hidden,
                           dtype)

    def moe_combine(self, dispatched: Any, partials: np.ndarray | None,
                    group: Any = None) -> MoeCombine:
        """Return each row's expert output to its token's home, summed there."""
        return MoeCombine(dispatched, partials, group)

    def group(self, ranks: Any) -> MakeGroup:
        """A new communicator of world ``ranks``; yields the group to pass as ``group=``."""
        try:
            given = tuple(ranks)
        except TypeError:
            raise UsageError(f"group ranks must be a list of world ranks, not "
                             f"{type(ranks).__name__}") from None
        return MakeGroup(given)  # checked when it runs (group_program), one place

    def close_group(self, group: Any) -> CloseGroup:
        """Close a communicator (its in-network jobs are released)."""
        return CloseGroup(group)

    def collective(self, kind: str, x: np.ndarray | None, out: np.ndarray | None = None, *,
                   path: str | None = None, op: str = "sum", root: int = 0, group: Any = None,
                   send_counts: Any = None, recv_counts: Any = None, count: int = 0,
                   dtype: str = "float32") -> Collective:
        """Any collective by name (see :class:`Collective`)."""
        return Collective(kind, x, out, path, op, root, group,
                          None if send_counts is None else tuple(send_counts),
                          None if recv_counts is None else tuple(recv_counts), count, dtype)

    def all_gather(self, x: np.ndarray | None, out: np.ndarray | None = None,
                   **kw: Any) -> Collective:
        """Every rank's ``x`` (m elements), concatenated in rank order (size * m)."""
        return self.collective("all_gather", x, out, **kw)

    def reduce_scatter(self, x: np.ndarray | None, out: np.ndarray | None = None,
                       **kw: Any) -> Collective:
        """Reduce ``x`` (size * m) over ranks; this rank gets segment ``rank`` (m)."""
        return self.collective("reduce_scatter", x, out, **kw)

    def broadcast(self, x: np.ndarray | None, out: np.ndarray | None = None,
                  **kw: Any) -> Collective:
        """The root's ``x`` to every rank (``out`` defaults to ``x``)."""
        return self.collective("broadcast", x, out, **kw)

    def reduce(self, x: np.ndarray | None, out: np.ndarray | None = None,
               **kw: Any) -> Collective:
        """Reduce ``x`` over ranks into the root's ``out``."""
        return self.collective("reduce", x, out, **kw)

    def alltoall(self, x: np.ndarray | None, out: np.ndarray | None = None,
                 **kw: Any) -> Collective:
        """Segment ``k`` of ``x`` (size * m) to rank ``k``; ``out`` segment ``k`` from it."""
        return self.collective("alltoall", x, out, **kw)

    def alltoallv(self, x: np.ndarray | None, send_counts: Any, out: np.ndarray | None,
                  recv_counts: Any, **kw: Any) -> Collective:
        """alltoall with per-rank element counts."""
        return self.collective("alltoallv", x, out, send_counts=send_counts,
                               recv_counts=recv_counts, **kw)

    def send(self, x: np.ndarray | None, dst: int, *, nbytes: int = 0,
             policy: str = "selective") -> Send:
        """A reliable stream of ``x``'s bytes to worker ``dst``."""
        return Send(dst, x, nbytes, policy)

    def recv(self, out: np.ndarray | None, src: int, *, nbytes: int = 0,
             policy: str = "selective") -> Recv:
        """Receive worker ``src``'s stream into ``out``."""
        return Recv(src, out, nbytes, policy)

    def sendrecv(self, x: np.ndarray | None, dst: int, out: np.ndarray | None, src: int, *,
                 nbytes: int = 0, policy: str = "selective") -> Together:
        """Send to ``dst`` and receive from ``src`` at the same time."""
        return Together((Send(dst, x, nbytes, policy), Recv(src, out, nbytes, policy)))

    def post(self, node: str, nbytes: int, *, channel: int = 0) -> Post:
        """``nbytes`` to node ``node`` in the background (timing-only, simulation);
        yields the post's number without waiting for its delivery. Posts on one
        ``channel`` arrive in order; other channels go beside them."""
        return Post(node, nbytes, channel)

    def barrier(self, group: Any = None) -> Barrier:
        """A barrier over every worker (or the members of ``group``)."""
        return Barrier(group)

    def compute(self, seconds: float) -> Compute:
        """``seconds`` of local work."""
        return Compute(seconds)

    def clock(self) -> Clock:
        """The current time."""
        return Clock()

    def counters(self) -> Counters:
        """This worker's resend counters so far (see :class:`Counters`)."""
        return Counters()

    def control(self, t: str, reply: str, **fields: Any) -> Control:
        """Control message ``t`` to this worker's switch; yields its ``reply``."""
        return Control(t, reply, tuple(sorted(fields.items())))


def check_workload(fn: Callable[..., Any]) -> None:
    """UsageError unless ``fn`` is a generator function (it must yield, never block).

    A compiled one (the workloads of ``fabric.core`` in the mypyc build) shows no
    code object to look at: what it returns is checked by :func:`start_workload`."""
    if inspect.isgeneratorfunction(fn) or (callable(fn) and not hasattr(fn, "__code__")
                                           and not inspect.isclass(fn)):
        return
    _not_a_generator(fn)


def start_workload(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a generator (UsageError if what came back is not one)."""
    gen = fn(*args, **kwargs)
    if not (hasattr(gen, "send") and hasattr(gen, "throw")):
        _not_a_generator(fn)
    return gen


def _not_a_generator(fn: Callable[..., Any]) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    raise UsageError(f"workload {name} must be a generator function that yields its "
                     "operations (y = yield ctx.allreduce(x)); it cannot block")


def stream_program(st: Any, op: Send | Recv | Together) -> Any:
    """The program of a stream operation over node state ``st`` (both worlds)."""
    from fabric.core.programs import Parallel, StreamRecv, StreamSend

    if isinstance(op, Together):
        return Parallel([stream_program(st, o) for o in op.ops])
    if isinstance(op, Send):
        if op.x is None and op.nbytes <= 0:
            raise UsageError("a timing-only send needs nbytes > 0")
        return StreamSend(st, op.dst, op.x, op.nbytes, policy=op.policy)
    if op.out is None and op.nbytes <= 0:
        raise UsageError("a timing-only receive needs nbytes > 0")
    return StreamRecv(st, op.src, op.out, op.nbytes, policy=op.policy)


def program_of(st: Any, op: Collective | MakeGroup | CloseGroup | MoeDispatch | MoeCombine
               | Control) -> Any:
    """The program of a collective, MoE, communicator or control operation (both worlds)."""
    from fabric.core.collective_programs import (
        close_group_program,
        collective_program,
        group_program,
    )

    if isinstance(op, Control):
        from fabric.core.programs import Request

        return Request(st, op.t, op.reply, **dict(op.fields))

    if isinstance(op, MoeDispatch):
        from fabric.core.moe import moe_dispatch_program

        return moe_dispatch_program(st, op.x, op.topk_idx, op.topk_weights, op.num_experts,
                                    variant=op.variant, group=op.group, hidden=op.hidden,
                                    dtype=op.dtype)
    if isinstance(op, MoeCombine):
        from fabric.core.moe import moe_combine_program

        return moe_combine_program(st, op.dispatched, op.partials, group=op.group)
    if isinstance(op, MakeGroup):
        return group_program(st, op.ranks)
    if isinstance(op, CloseGroup):
        return close_group_program(st, op.group)
    out = op.out
    if op.x is not None and out is None:
        out = _default_out(op, st)
    return collective_program(st, op.kind, op.x, out, path=op.path, op=op.op, root=op.root,
                              group=op.group, send_counts=op.send_counts,
                              recv_counts=op.recv_counts, count=op.count, dtype=op.dtype)


def _default_out(op: Collective, st: Any) -> np.ndarray | None:
    """The output array NCCL's shapes imply when the caller gave none."""
    assert op.x is not None
    g = op.group or st.world_group
    n, W = op.x.size, g.size
    if op.kind == "broadcast":
        return op.x  # in place
    size = {"all_gather": n * W, "gather": n * W, "reduce_scatter": n // max(W, 1),
            "scatter": n // max(W, 1), "reduce": n, "alltoall": n}.get(op.kind)
    if op.kind == "alltoallv":
        size = sum(op.recv_counts or ())
    if op.kind in ("reduce", "gather") and g.rank != op.root:
        return None
    return np.empty(size or 0, op.x.dtype)
