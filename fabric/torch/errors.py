"""The backend's typed errors: each names the torch rank and the operation."""

from __future__ import annotations

from fabric.errors import SemfabError, UsageError

__all__ = ["TorchCommError", "TorchOpError"]


class TorchOpError(UsageError):
    """An operation the backend refuses before it starts (an unsupported op, dtype
    or device; sizes that do not fit)."""

    def __init__(self, rank: int, op: str, reason: str) -> None:
        super().__init__(f"semfab rank {rank}: {op}: {reason}")
        self.rank = rank
        self.op = op


class TorchCommError(SemfabError):
    """An operation that failed on the fabric (a timeout, a dead or disagreeing peer)."""

    def __init__(self, rank: int, op: str, reason: str) -> None:
        super().__init__(f"semfab rank {rank}: {op}: {reason}")
        self.rank = rank
        self.op = op
