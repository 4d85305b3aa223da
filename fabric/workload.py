"""Workloads written once, run in both worlds.

A workload is a generator function that takes a context (rank, world) and
*yields* the operations it wants done, receiving each one's result::

    def work(ctx, count=1 << 20):
        x = np.full(count, ctx.rank + 1, np.float32)
        y = yield ctx.allreduce(x, path="ina")
        yield ctx.barrier()
        t = yield ctx.clock()          # seconds: virtual in simulation, real in emulation
        return float(y[0])

:func:`fabric.emulation.run_in_emulation` runs it on a launched fabric's
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

__all__ = ["Allreduce", "Barrier", "Clock", "Compute", "Context", "Operation", "Recv", "Send",
           "Together", "check_workload", "stream_program"]


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
class Barrier:
    """Wait until every worker reached this barrier."""


@dataclass(frozen=True)
class Compute:
    """Stand for ``seconds`` of local work (simulation advances its clock)."""

    seconds: float


@dataclass(frozen=True)
class Clock:
    """Yields the current time in seconds (virtual in simulation)."""


Operation = Allreduce | Send | Recv | Together | Barrier | Compute | Clock


class Context:
    """What a workload sees of its worker: rank, world, and operation builders."""

    def __init__(self, rank: int, world: int, name: str) -> None:
        self.rank, self.world, self.name = rank, world, name

    def allreduce(self, x: np.ndarray | None = None, op: str = "sum", path: str = "ina",
                  out: np.ndarray | None = None, numerics: str = "float", *,
                  count: int = 0, dtype: str = "float32") -> Allreduce:
        """An allreduce; ``x=None`` with ``count``/``dtype`` is timing-only (simulation)."""
        return Allreduce(x, op, path, out, numerics, count, dtype)

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

    def barrier(self) -> Barrier:
        """A barrier over every worker."""
        return Barrier()

    def compute(self, seconds: float) -> Compute:
        """``seconds`` of local work."""
        return Compute(seconds)

    def clock(self) -> Clock:
        """The current time."""
        return Clock()


def check_workload(fn: Callable[..., Any]) -> None:
    """UsageError unless ``fn`` is a generator function (it must yield, never block)."""
    if not inspect.isgeneratorfunction(fn):
        name = getattr(fn, "__qualname__", repr(fn))
        raise UsageError(f"workload {name} must be a generator function that yields its "
                         "operations (y = yield ctx.allreduce(x)); it cannot block")


def stream_program(st: Any, op: Send | Recv | Together) -> Any:
    """The program of a stream operation over node state ``st`` (both worlds)."""
    from fabric.programs import Parallel, StreamRecv, StreamSend

    if isinstance(op, Together):
        return Parallel([stream_program(st, o) for o in op.ops])
    if isinstance(op, Send):
        if op.x is None and op.nbytes <= 0:
            raise UsageError("a timing-only send needs nbytes > 0")
        return StreamSend(st, op.dst, op.x, op.nbytes, policy=op.policy)
    if op.out is None and op.nbytes <= 0:
        raise UsageError("a timing-only receive needs nbytes > 0")
    return StreamRecv(st, op.src, op.out, op.nbytes, policy=op.policy)
