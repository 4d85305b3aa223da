"""Which fabric path each torch operation takes, and with which numerics.

``SEMFAB_PATH`` (``ina``, ``ina-mem``, ``host-ring`` or ``auto``) and
``SEMFAB_NUMERICS`` (``float`` or ``fixed``) set the defaults of a process;
``Options(path=..., numerics=...)`` passed as ``pg_options`` to
``dist.new_group(backend="semfab", pg_options=...)`` sets them for one group.
A path the fabric does not offer for a collective maps to its nearest one
(:func:`path_for`), so one setting covers every operation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fabric.errors import UsageError, check_seconds

__all__ = ["NUMERICS", "Options", "PATHS", "path_for"]

PATHS = ("ina", "ina-mem", "host-ring", "auto")
NUMERICS = ("float", "fixed")
#: Below this, auto runs an allreduce on the frame plane: a memory-plane call
#: stages small tensors through a registered buffer for little gain.
AUTO_MEM_MIN_BYTES = 256 * 1024
#: Seconds any wait on a peer may take, unless SEMFAB_TIMEOUT or the group's
#: torch timeout (when shorter) says otherwise.
DEFAULT_TIMEOUT_S = 30.0

# path per collective kind and chosen path (the fabric's own collective paths)
_COLLECTIVE_PATHS: dict[str, dict[str, str]] = {
    "all_gather": {"ina": "ina", "ina-mem": "ina", "host-ring": "host-ring", "auto": "ina"},
    "reduce_scatter": {"ina": "ina", "ina-mem": "ina", "host-ring": "host-ring",
                       "auto": "ina"},
    "broadcast": {"ina": "ina", "ina-mem": "ina", "host-ring": "host-p2p", "auto": "ina"},
    "reduce": {"ina": "ina", "ina-mem": "ina", "host-ring": "host-p2p", "auto": "ina"},
}


@dataclass(frozen=True)
class Options:
    """A group's path and numerics (``pg_options`` of ``new_group``); None fields
    take the process defaults."""

    path: str | None = None
    numerics: str | None = None
    #: every rank first agrees on each operation and its sizes (SEMFAB_CHECK=1):
    #: a mismatch is a refusal naming the ranks, at the cost of one small all_gather
    check: bool | None = None

    def __post_init__(self) -> None:
        if self.path is not None and self.path not in PATHS:
            raise UsageError(f"semfab path {self.path!r}: choose one of {', '.join(PATHS)}")
        if self.numerics is not None and self.numerics not in NUMERICS:
            raise UsageError(f"semfab numerics {self.numerics!r}: choose one of "
                             f"{', '.join(NUMERICS)}")

    def resolved(self) -> Options:
        """These options with the environment's defaults filled in."""
        path = self.path or os.environ.get("SEMFAB_PATH", "ina") or "ina"
        numerics = self.numerics or os.environ.get("SEMFAB_NUMERICS", "float") or "float"
        if path not in PATHS:
            raise UsageError(f"SEMFAB_PATH={path}: choose one of {', '.join(PATHS)}")
        if numerics not in NUMERICS:
            raise UsageError(f"SEMFAB_NUMERICS={numerics}: choose one of {', '.join(NUMERICS)}")
        check = self.check
        if check is None:
            check = os.environ.get("SEMFAB_CHECK", "0").lower() in ("1", "true", "yes", "on")
        return Options(path, numerics, check)


def timeout_from_env(torch_timeout_s: float | None) -> float:
    """Seconds a wait may take: SEMFAB_TIMEOUT, else the shorter of the group's
    torch timeout and 30 s (torch's default of 30 minutes hides a hang)."""
    raw = os.environ.get("SEMFAB_TIMEOUT")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"SEMFAB_TIMEOUT={raw}: give seconds, e.g. 30") from None
        return check_seconds("SEMFAB_TIMEOUT", value)
    if torch_timeout_s is not None and torch_timeout_s > 0:
        return min(torch_timeout_s, DEFAULT_TIMEOUT_S)
    return DEFAULT_TIMEOUT_S


def path_for(kind: str, path: str, nbytes: int, memory_plane: bool) -> str:
    """The fabric path of collective ``kind`` (``allreduce`` or a name of
    :data:`fabric.core.collective_programs.COLLECTIVES`) under the chosen ``path``.

    ``memory_plane``: every worker's switch can map its memory (one host)."""
    if kind == "allreduce":
        if path == "auto":
            return "ina-mem" if memory_plane and nbytes >= AUTO_MEM_MIN_BYTES else "ina"
        if path == "ina-mem" and not memory_plane:
            return "ina"  # on every rank: a rank off the switch's host cannot map memory
        return path
    if kind in _COLLECTIVE_PATHS:
        return _COLLECTIVE_PATHS[kind][path]
    return "host-p2p"  # alltoall(v), gather, scatter: the fabric's only path
