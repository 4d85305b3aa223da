"""The emulation driver of workloads (see :mod:`fabric.core.workload`).

``fab.run(run_in_emulation, work, *args)`` runs the generator workload
``work`` on every worker of a launched fabric: each operation it yields is the
endpoint's blocking call, and its result is sent back into the workload.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

from fabric.core.workload import (
    Allreduce,
    Barrier,
    Clock,
    CloseGroup,
    Collective,
    Compute,
    Context,
    Control,
    Counters,
    MakeGroup,
    MoeCombine,
    MoeDispatch,
    Post,
    Recv,
    Send,
    Together,
    check_workload,
    program_of,
    start_workload,
    stream_program,
)
from fabric.errors import SemfabError, UsageError

__all__ = ["drive", "perform", "run_in_emulation"]


def run_in_emulation(ep: Any, fn: Callable[..., Generator[Any, Any, Any]], *args: Any,
                     **kwargs: Any) -> Any:
    """Run a workload on an emulated worker's endpoint; returns its return value."""
    check_workload(fn)
    return drive(ep, start_workload(fn, Context(ep.rank, ep.world, ep.name), *args, **kwargs))


def drive(ep: Any, gen: Generator[Any, Any, Any]) -> Any:
    """Perform every operation ``gen`` yields on ``ep`` (a semfab error is raised
    where it waits, which may catch it); returns what ``gen`` returns."""
    value: Any = None
    error: SemfabError | None = None
    while True:
        try:
            if error is not None:  # raised where the workload waits: it may catch it
                thrown, error = error, None
                op = gen.throw(thrown)
            else:
                op = gen.send(value)
        except StopIteration as stop:
            return stop.value
        try:
            value = perform(ep, op)
        except SemfabError as exc:
            value, error = None, exc


def perform(ep: Any, op: Any) -> Any:
    """Do one operation a workload yielded, on ``ep``; returns what it gives back."""
    if isinstance(op, Allreduce):
        with ep.group_call(op.group):  # a refusal here ends the call on every member
            if op.x is None:
                raise UsageError("timing-only allreduce (x=None) runs in simulation only")
            return ep.allreduce(op.x, op=op.op, path=op.path, out=op.out,
                                numerics=op.numerics, group=op.group)
    if isinstance(op, (Collective, MoeDispatch, MoeCombine)):
        with ep.group_call(op.group):
            if isinstance(op, (Collective, MoeDispatch)) and op.x is None:
                raise UsageError(f"timing-only {type(op).__name__} (x=None) runs in "
                                 "simulation only")
            return ep.run(program_of(ep.state, op), type(op).__name__)
    if isinstance(op, (MakeGroup, CloseGroup, Control)):
        return ep.run(program_of(ep.state, op), type(op).__name__)
    if isinstance(op, (Send, Recv, Together)):
        parts = op.ops if isinstance(op, Together) else (op,)
        if any((o.x if isinstance(o, Send) else o.out) is None for o in parts):
            raise UsageError("timing-only streams (no array) run in simulation only")
        return ep.run(stream_program(ep.state, op), f"{type(op).__name__.lower()}")
    if isinstance(op, Post):
        raise UsageError("ctx.post (background posts to a node) runs in simulation only; "
                         "launched, `semfab serve` sends each step's tokens to host0 itself")
    if isinstance(op, Barrier):
        ep.barrier(op.group)
        return None
    if isinstance(op, Compute):
        time.sleep(op.seconds)
        return None
    if isinstance(op, Clock):
        return time.monotonic()
    if isinstance(op, Counters):
        return {"retransmits": ep.state.retransmits, "timeouts": ep.state.timeouts}
    raise UsageError(f"a workload yielded {op!r}, not an operation of its context")
