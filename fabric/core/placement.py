"""Placing a fabric on processes another launcher started (mpirun, srun).

Pure: which launcher rank a process has (from the environment it is given),
which node of the topology each process plays (from the topology's host
addresses and the addresses local to each process), and the clock offset
between two hosts from one request/reply exchange (NTP's on-wire
calculation, RFC 5905 section 8). The driver is :mod:`fabric.emulation.rendezvous`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fabric.core.topology import Node, Topology
from fabric.errors import UsageError

__all__ = ["RANK_VARIABLES", "ClockSample", "Member", "PlacementError", "assign",
           "best_offset", "clock_sample", "launcher_rank", "start_order"]

#: (rank, size) environment variables, in the order they are looked at: Open MPI,
#: PMIx (Open MPI 5, prterun), MPICH/Hydra and Intel MPI (PMI), Slurm's srun,
#: and torchrun's.
RANK_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("RANK", "WORLD_SIZE"),
)


class PlacementError(UsageError):
    """The processes and the topology do not fit together (the user's to fix)."""


def launcher_rank(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(rank, size)`` the launcher gave this process, or None when none did."""
    for rank_var, size_var in RANK_VARIABLES:
        rank, size = env.get(rank_var), env.get(size_var)
        if rank is None or size is None:
            continue
        try:
            r, n = int(rank), int(size)
        except ValueError:
            raise PlacementError(f"{rank_var}={rank!r} / {size_var}={size!r} are not "
                                 "integers") from None
        if not 0 <= r < n:
            raise PlacementError(f"{rank_var}={r} is not in 0..{size_var}-1={n - 1}")
        return r, n
    return None


@dataclass(frozen=True)
class Member:
    """One process that joined the rendezvous."""

    rank: int
    hostname: str
    #: which of the topology's host addresses this process can bind (is on)
    local: frozenset[str]
    #: the node it asked to play (``--name``), or "" to be given one
    name: str = ""


def start_order(topo: Topology) -> list[Node]:
    """Nodes in the order they start and are handed out: switches (their links come
    up first), then hosts, then workers, each by id."""
    rank = {"switch": 0, "host": 1, "worker": 2}
    return sorted(topo.nodes, key=lambda n: (rank[n.kind], n.id))


def assign(topo: Topology, members: Sequence[Member]) -> dict[int, str]:
    """The node each process plays, by launcher rank.

    A process that named its node gets it; the others get, in rank order, the
    first free node (in :func:`start_order`) whose host address is local to
    them. Raises :class:`PlacementError` saying what to change when the counts
    or the hosts do not fit.
    """
    n = len(topo.nodes)
    if len(members) != n:
        raise PlacementError(
            f"{len(members)} processes joined, but the topology has {n} nodes "
            f"({len(topo.switches)} switches, {len(topo.hosts)} hosts, "
            f"{len(topo.workers)} workers): start exactly {n} (mpirun -np {n}, srun -n {n})")
    out: dict[int, str] = {}
    taken: set[str] = set()
    for m in sorted(members, key=lambda m: m.rank):
        if not m.name:
            continue
        try:
            topo.node(m.name)
        except Exception:
            raise PlacementError(f"rank {m.rank} asked for node {m.name!r}, which is not in "
                                 "the topology") from None
        if m.name in taken:
            raise PlacementError(f"two processes asked to be node {m.name!r}")
        if topo.host_address(m.name) not in m.local:
            raise PlacementError(
                f"rank {m.rank} on {m.hostname} asked for node {m.name!r}, whose host address "
                f"{topo.host_address(m.name)} is not on that host")
        out[m.rank] = m.name
        taken.add(m.name)
    free = [node for node in start_order(topo) if node.name not in taken]
    for m in sorted(members, key=lambda m: m.rank):
        if m.rank in out:
            continue
        pick = next((node for node in free if topo.host_address(node.name) in m.local), None)
        if pick is None:
            wanted = sorted({topo.host_address(node.name) for node in free})
            raise PlacementError(
                f"rank {m.rank} runs on {m.hostname}, where no node is left to play: the "
                f"free nodes are placed on {', '.join(wanted)} ([fabric.host_addresses]); "
                "start the processes on those hosts (mpirun --host, srun --nodelist)")
        free.remove(pick)
        out[m.rank] = pick.name
    return out


@dataclass(frozen=True)
class ClockSample:
    """One exchange: offset of the remote clock from ours, and its error bound."""

    offset_s: float  # remote minus local
    error_s: float  # |true offset - offset_s| <= error_s (half the round trip)
    rtt_s: float


def clock_sample(t0: float, t1: float, t2: float, t3: float) -> ClockSample:
    """NTP's on-wire calculation: we sent at ``t0``, the peer received at ``t1``
    and answered at ``t2`` (its clock), we received at ``t3`` (ours)."""
    rtt = max((t3 - t0) - (t2 - t1), 0.0)
    return ClockSample(((t1 - t0) + (t2 - t3)) / 2, rtt / 2, rtt)


def best_offset(samples: Sequence[ClockSample]) -> ClockSample:
    """The sample with the shortest round trip: the tightest bound (NTP's filter)."""
    if not samples:
        raise ValueError("no clock samples")
    return min(samples, key=lambda s: s.rtt_s)
