"""The aggregation engine's vocabulary: a job's spec, the events the engine
returns, its statistics, and the limits a spec must respect.

The engine itself (:mod:`switchd.core.engine`) turns contributions into these
events; the aggregation service (:mod:`switchd.core.aggregation`) turns them
into RESULT and NACK frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Final, TypeAlias

import numpy as np
from mypy_extensions import mypyc_attr

from fabric.core.records import Record
from kernels.dtypes import DTYPES as _DTYPES

__all__ = [
    "DTYPES",
    "NACK_CODES",
    "AggOp",
    "Completed",
    "DuplicateIgnored",
    "EngineStats",
    "Event",
    "Granted",
    "JobSpec",
    "Overflowed",
    "Refused",
    "Rejected",
    "ResendResult",
    "Stale",
    "fmt_bytes",
    "normalise",
    "spec_error",
]


class AggOp(StrEnum):
    """Reduction operator applied element-wise across members."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


#: Element types the engine reduces: the project's one dtype registry.
DTYPES: Final[dict[str, np.dtype[Any]]] = _DTYPES

#: NACK codes a :class:`Rejected` may carry (names match ``fabric.core.frame.NackCode``).
#: The engine itself emits UNKNOWN_JOB, NO_RESOURCE, PERMISSION, OUT_OF_WINDOW and
#: INVALID (data that is intact but wrong for the job); BAD_KEY is for the
#: region-key checks on the memory plane.
NACK_CODES: Final[frozenset[str]] = frozenset(
    {"BAD_KEY", "PERMISSION", "OUT_OF_WINDOW", "NO_RESOURCE", "INVALID", "UNKNOWN_JOB"}
)

#: Members of one job at one switch (bitmaps are Python ints: no word limit).
MAX_MEMBERS: Final = 4096
MAX_JOB_ID: Final = 0xFFFF
DEFAULT_MAX_SLOTS: Final = 1 << 16


@mypyc_attr(native_class=False)  # checked by spec_error, not by the constructor, in both builds
@dataclass(frozen=True)
class JobSpec:
    """What a job asks of the switch.

    ``members`` are the contributor node ids (workers, or child switches in a
    tree); their order fixes the bitmap bit of each and the order of
    ``Completed.recipients``. ``slots`` is the window S, ``slot_elems`` the
    elements of one chunk (one frame's payload). ``referenced`` selects the
    memory plane: the engine holds no data, only bitmaps.
    """

    job: int
    members: tuple[int, ...]
    dtype: str
    op: AggOp
    slots: int
    slot_elems: int
    referenced: bool = False


# --------------------------------------------------------------------- events
# slots=True: events are created on the hot path, keep them small and fast.


@dataclass(frozen=True, slots=True)
class Granted:
    """Registration accepted: the job owns ``slots`` slots of ``slot_elems`` elements."""

    job: int
    slots: int
    slot_elems: int


@dataclass(frozen=True, slots=True)
class Refused:
    """Registration refused; the job must fall back to the host path (and report it).

    ``slots_free`` is how many slots of the asked shape would fit right now
    (0 when the refusal is not about resources), so a caller may retry smaller.
    """

    job: int
    reason: str
    slots_free: int


class Completed(Record):
    """All members contributed to ``chunk``: send ``result`` to every recipient.

    ``result`` is a read-only view of engine memory, valid until this slot
    version is reused (at chunk ``chunk + 2*slots``); ``None`` when the job is
    referenced (the daemon reduces from shared memory itself).
    """

    __slots__ = ("job", "chunk", "slot", "result", "recipients")
    _fields: ClassVar[tuple[str, ...]] = ("job", "chunk", "slot", "result", "recipients")

    def __init__(self, job: int, chunk: int, slot: int, result: np.ndarray | None,
                 recipients: tuple[int, ...]) -> None:
        self.job = job
        self.chunk = chunk
        self.slot = slot
        self.result = result
        self.recipients = recipients


class ResendResult(Record):
    """A contribution for an already-completed chunk: resend the kept result to ``member``.

    The member lost the RESULT and retransmitted; ``result`` is the kept view
    (``None`` when referenced).
    """

    __slots__ = ("job", "chunk", "member", "result")
    _fields: ClassVar[tuple[str, ...]] = ("job", "chunk", "member", "result")

    def __init__(self, job: int, chunk: int, member: int, result: np.ndarray | None) -> None:
        self.job = job
        self.chunk = chunk
        self.member = member
        self.result = result


class _MemberEvent(Record):
    """An event about one member's contribution to one chunk, with nothing to send."""

    __slots__ = ("job", "chunk", "member")
    _fields: ClassVar[tuple[str, ...]] = ("job", "chunk", "member")

    def __init__(self, job: int, chunk: int, member: int) -> None:
        self.job = job
        self.chunk = chunk
        self.member = member


class DuplicateIgnored(_MemberEvent):
    """A retransmission already in the bitmap of an incomplete chunk; nothing to send."""

    __slots__ = ()


class Stale(_MemberEvent):
    """A late duplicate for a chunk whose slot version was already reused; nothing to send."""

    __slots__ = ()


class Rejected(Record):
    """A contribution refused with a NACK ``code``; no slot state was changed."""

    __slots__ = ("job", "chunk", "member", "code", "reason")
    _fields: ClassVar[tuple[str, ...]] = ("job", "chunk", "member", "code", "reason")

    def __init__(self, job: int, chunk: int, member: int, code: str, reason: str) -> None:
        self.job = job
        self.chunk = chunk
        self.member = member
        self.code = code
        self.reason = reason


class Overflowed(Record):
    """A contribution would make ``chunk``'s integer sum wrap: the chunk ends
    without a result and every one of ``recipients`` is told (a member that
    sends to it later is told again). Its slot is free for the next chunks."""

    __slots__ = ("job", "chunk", "recipients", "reason")
    _fields: ClassVar[tuple[str, ...]] = ("job", "chunk", "recipients", "reason")

    def __init__(self, job: int, chunk: int, recipients: tuple[int, ...], reason: str) -> None:
        self.job = job
        self.chunk = chunk
        self.recipients = recipients
        self.reason = reason


Event: TypeAlias = (
    Granted | Refused | Completed | ResendResult | DuplicateIgnored | Stale | Rejected
    | Overflowed
)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters and resource use of an :class:`AggregationEngine`.

    Every ``contribute`` call lands in exactly one of ``contributions``
    (counted into a slot), ``duplicates``, ``resends``, ``stale`` or
    ``rejected``. ``completions`` counts chunks completed.
    """

    jobs: int
    slots_total: int
    slots_in_use: int
    bytes_reserved: int
    budget_bytes: int
    contributions: int
    completions: int
    duplicates: int
    resends: int
    stale: int
    rejected: int


def spec_error(spec: JobSpec) -> str | None:
    """Why a spec is unusable, or None."""
    # the fields as given (a caller's list of members, a plain "sum"), read without
    # the declared types: compiled code would check those on every attribute read
    given: dict[str, Any] = vars(spec)
    job, members, op = given["job"], given["members"], given["op"]
    if not isinstance(job, int) or not 0 <= job <= MAX_JOB_ID:
        return f"job id {job!r} is not a u16"
    if not 1 <= len(members) <= MAX_MEMBERS:
        return f"{len(members)} members; 1..{MAX_MEMBERS} allowed"
    if any(not isinstance(m, int) or m < 0 for m in members):
        return f"members must be non-negative node ids, got {members!r}"
    if len(set(members)) != len(members):
        return f"duplicate members in {members!r}"
    if given["dtype"] not in DTYPES:
        return f"dtype {given['dtype']!r} not one of {sorted(DTYPES)}"
    if op not in tuple(AggOp):
        return f"op {op!r} not one of {[o.value for o in AggOp]}"
    for name in ("slots", "slot_elems"):
        if not isinstance(given[name], int) or given[name] < 1:
            return f"{name} must be >= 1, got {given[name]!r}"
    return None


def normalise(spec: JobSpec) -> JobSpec:
    """The spec with its declared types: a list of members or a plain "sum" string
    must compare equal on re-register."""
    given: dict[str, Any] = vars(spec)
    return JobSpec(job=given["job"], members=tuple(given["members"]), dtype=given["dtype"],
                   op=AggOp(given["op"]), slots=given["slots"],
                   slot_elems=given["slot_elems"], referenced=bool(given["referenced"]))


def fmt_bytes(n: int) -> str:
    """``n`` bytes for a refusal's reason: ``4194304 B (4.0 MiB)``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} B ({n / size:.1f} {unit})"
    return f"{n} B"
