"""Registered memory regions and their keys (pure: no I/O).

A region is a named span of bytes a node exposes to the fabric, like an RDMA
memory region: it gets a key (the rkey), a size and the set of nodes allowed
to use it. Every memory-semantic operation is checked here first; a refusal
is an :class:`AccessError` carrying the NACK code to send back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fabric.core.frame import NackCode


class AccessError(Exception):
    """A memory operation was refused; ``code`` is the NACK code."""

    def __init__(self, code: NackCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RegionInfo:
    """What the fabric knows of one region."""

    key: int
    owner: int  # node id that registered it
    size: int  # bytes
    path: str  # where the bytes live (a shared-memory file on this host)
    allowed: frozenset[int] = field(default_factory=frozenset)  # empty = anyone


class RegionTable:
    """Keys to regions, with the access rule of DESIGN.md §1.4."""

    def __init__(self) -> None:
        self._regions: dict[int, RegionInfo] = {}

    def add(self, info: RegionInfo) -> None:
        """Register a region; a key already in use by another owner is refused."""
        if not 0 < info.key <= 0xFFFF_FFFF:
            raise AccessError(NackCode.BAD_KEY, f"region key {info.key} is not a nonzero u32")
        old = self._regions.get(info.key)
        if old is not None and old.owner != info.owner:
            raise AccessError(
                NackCode.PERMISSION,
                f"region key {info.key:#x} already belongs to node {old.owner}",
            )
        self._regions[info.key] = info

    def remove(self, key: int) -> None:
        """Forget a region (unknown keys are ignored)."""
        self._regions.pop(key, None)

    def get(self, key: int) -> RegionInfo:
        """The region for ``key`` or AccessError(BAD_KEY)."""
        try:
            return self._regions[key]
        except KeyError:
            raise AccessError(NackCode.BAD_KEY, f"unknown region key {key:#x}") from None

    def check(self, key: int, offset: int, length: int, requester: int) -> RegionInfo:
        """Validate an access of ``length`` bytes at ``offset``; return the region."""
        info = self.get(key)
        if info.allowed and requester not in info.allowed and requester != info.owner:
            raise AccessError(
                NackCode.PERMISSION,
                f"node {requester} may not use region {key:#x} of node {info.owner}",
            )
        if offset < 0 or length < 0 or offset + length > info.size:
            raise AccessError(
                NackCode.PERMISSION,
                f"access [{offset}, {offset + length}) is outside region {key:#x} "
                f"of {info.size} B",
            )
        return info

    def __len__(self) -> int:
        return len(self._regions)

    def __contains__(self, key: object) -> bool:
        return key in self._regions
