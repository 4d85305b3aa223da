"""Errors shared across semfab, typed by who is at fault, and the pure argument
check every CLI uses for its timeouts (so each refuses a bad value the same way)."""

from __future__ import annotations

import math


class SemfabError(Exception):
    """Base class of semfab's own errors."""


class UsageError(SemfabError):
    """The user gave a bad argument or file; the CLI prints one line and exits 2."""


class FabricTimeout(SemfabError):
    """A wait on a peer ran out; the message names the peer and the operation."""


class PeerFailed(SemfabError):
    """A peer (switch, worker, host) died or refused an operation."""


#: Longest wait a timeout flag may ask for: zmq polls take milliseconds as a C
#: integer, and a wait of more than ~11 days is a typo, not a plan.
MAX_TIMEOUT_S = 1e6


def check_seconds(flag: str, value: float, *, allow_zero: bool = False,
                  most: float = MAX_TIMEOUT_S) -> float:
    """``value`` if it is a finite number of seconds in (0, most] ([0, most] with
    ``allow_zero``), else UsageError naming ``flag``."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (0 <= value if allow_zero else 0 < value)
          and value <= most)
    if not ok:
        low = "0 or more" if allow_zero else "a positive number of"
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise UsageError(f"{flag} {shown}: must be {low} seconds, at most {most:.0f} "
                         f"(e.g. {flag} 30)")
    return float(value)
