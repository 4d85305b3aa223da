"""Errors shared across semfab, typed by who is at fault."""

from __future__ import annotations


class SemfabError(Exception):
    """Base class of semfab's own errors."""


class UsageError(SemfabError):
    """The user gave a bad argument or file; the CLI prints one line and exits 2."""


class FabricTimeout(SemfabError):
    """A wait on a peer ran out; the message names the peer and the operation."""


class PeerFailed(SemfabError):
    """A peer (switch, worker, host) died or refused an operation."""
