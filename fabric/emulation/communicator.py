"""Communicators on an emulated worker: a group of workers with its own rank,
size, in-network jobs and barriers (the emulation side of
:class:`fabric.core.programs.Group`)::

    def work(ep):
        tp = ep.group([ep.rank - ep.rank % 2, ep.rank - ep.rank % 2 + 1])  # pairs
        with ep.group(range(ep.world)) as everyone:
            y = tp.allreduce(x, path="ina")
            z = everyone.all_gather(y, path="ina")
        tp.close()

Several communicators may be active at once; closing one releases its jobs at
the switches (a long run never exhausts their memory).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from fabric.core.programs import Group, NodeState

__all__ = ["Communicator", "GroupHost"]


class GroupHost(Protocol):
    """What a communicator needs of its worker's endpoint
    (:class:`fabric.emulation.endpoint.Endpoint` is one)."""

    state: NodeState

    def allreduce(self, x: np.ndarray, op: str = ..., path: str = ...,
                  out: np.ndarray | None = ..., numerics: str = ...,
                  group: Any = ...) -> np.ndarray: ...

    def barrier(self, group: Any = ...) -> None: ...

    def collective(self, kind: str, x: np.ndarray, out: np.ndarray | None = ..., *,
                   path: str | None = ..., op: str = ..., root: int = ...,
                   group: Any = ..., send_counts: Any = ...,
                   recv_counts: Any = ...) -> Any: ...

    def run(self, prog: Any, what: str) -> Any: ...


class Communicator:
    """A group of workers seen from one member (made by :meth:`Endpoint.group`)."""

    def __init__(self, ep: GroupHost, group: Group) -> None:
        self.ep = ep
        self.group = group

    @property
    def rank(self) -> int:
        """This worker's rank in the group."""
        return self.group.rank

    @property
    def size(self) -> int:
        """Members of the group."""
        return self.group.size

    @property
    def ranks(self) -> tuple[int, ...]:
        """The members' world ranks, in group-rank order."""
        return self.group.ranks

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.group.closed

    def __repr__(self) -> str:
        return (f"Communicator(gid={self.group.gid}, rank={self.rank}, size={self.size}, "
                f"ranks={list(self.ranks)}{', closed' if self.closed else ''})")

    def allreduce(self, x: np.ndarray, op: str = "sum", path: str = "ina",
                  out: np.ndarray | None = None, numerics: str = "float") -> np.ndarray:
        """Allreduce over the group's members (paths as :meth:`Endpoint.allreduce`)."""
        return self.ep.allreduce(x, op=op, path=path, out=out, numerics=numerics,
                                 group=self.group)

    def barrier(self) -> None:
        """Wait for every member."""
        self.ep.barrier(self.group)

    def collective(self, kind: str, x: np.ndarray, out: np.ndarray | None = None,
                   **kw: Any) -> Any:
        """Any collective of the set over the group; ``root`` is a group rank."""
        return self.ep.collective(kind, x, out, group=self.group, **kw)

    def all_gather(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """See :meth:`Endpoint.all_gather`."""
        return self.collective("all_gather", x, out, **kw)

    def reduce_scatter(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """See :meth:`Endpoint.reduce_scatter`."""
        return self.collective("reduce_scatter", x, out, **kw)

    def broadcast(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """See :meth:`Endpoint.broadcast`."""
        return self.collective("broadcast", x, out, **kw)

    def reduce(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """See :meth:`Endpoint.reduce`."""
        return self.collective("reduce", x, out, **kw)

    def alltoall(self, x: np.ndarray, out: np.ndarray | None = None, **kw: Any) -> Any:
        """See :meth:`Endpoint.alltoall`."""
        return self.collective("alltoall", x, out, **kw)

    def alltoallv(self, x: np.ndarray, send_counts: Any, out: np.ndarray | None,
                  recv_counts: Any, **kw: Any) -> Any:
        """See :meth:`Endpoint.alltoallv`."""
        return self.collective("alltoallv", x, out, send_counts=send_counts,
                               recv_counts=recv_counts, **kw)

    def close(self) -> None:
        """Wait for every member, release the group's in-network jobs and its
        multicast group at the switches. Idempotent."""
        from fabric.core.collective_programs import close_group_program

        if not self.group.closed:
            self.ep.run(close_group_program(self.ep.state, self.group),
                        f"close group {list(self.ranks)}")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
