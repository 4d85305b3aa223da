"""Errors shared across semfab, typed by who is at fault, and the pure checks
every CLI applies to what a user gives it (timeouts, JSON), so each refuses a
bad value the same way: one line naming the flag or file and what to give."""

from __future__ import annotations

import json
import math
from typing import Any


class SemfabError(Exception):
    """Base class of semfab's own errors."""


class UsageError(SemfabError):
    """The user gave a bad argument or file; the CLI prints one line and exits 2."""


class FabricTimeout(SemfabError):
    """A wait on a peer ran out; the message names the peer and the operation."""


class PeerFailed(SemfabError):
    """A peer (switch, worker, host) died or refused an operation."""


class CallAborted(PeerFailed):
    """Another member of the group could not take part in this call and ended it
    (its arguments were wrong, or its data was refused): ``rank`` is its group
    rank, ``why`` its error. No data of the call was kept; the next call on the
    communicator is exact. ``earlier``: the member failed an earlier call that
    this one had finished (its part was exact); the call running here ends too."""

    def __init__(self, message: str, *, rank: int = -1, why: str = "", call: int = 0,
                 earlier: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.why = why
        self.call = call  # the call the member abandoned (the group's count)
        self.earlier = earlier

    def __reduce__(self) -> Any:  # crosses process boundaries (a launched task's error)
        return (_call_aborted, (str(self), self.rank, self.why, self.call, self.earlier))


def _call_aborted(message: str, rank: int, why: str, call: int, earlier: bool) -> CallAborted:
    return CallAborted(message, rank=rank, why=why, call=call, earlier=earlier)


class SumOverflowError(SemfabError, OverflowError):
    """An integer sum would wrap: raised on every member of the collective, which
    ran to its end (the communicator stays usable; the output is not a sum)."""


#: Longest wait a timeout flag may ask for: zmq polls take milliseconds as a C
#: integer, and a wait of more than ~11 days is a typo, not a plan.
MAX_TIMEOUT_S = 1e6
#: Shortest: every wait polls in whole milliseconds, so less is a wait of zero
#: (or a unit mistake, e.g. microseconds given as seconds).
MIN_TIMEOUT_S = 1e-3


def check_seconds(flag: str, value: float, *, allow_zero: bool = False,
                  most: float = MAX_TIMEOUT_S) -> float:
    """``value`` if it is a finite number of seconds in [MIN_TIMEOUT_S, most]
    (or exactly 0 with ``allow_zero``), else UsageError naming ``flag``."""
    number = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
    ok = number and (MIN_TIMEOUT_S <= value <= most or (allow_zero and value == 0))
    if not ok:
        zero = "0 or " if allow_zero else ""
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise UsageError(f"{flag} {shown}: must be {zero}a number of seconds from "
                         f"{MIN_TIMEOUT_S:g} to {most:.0f} (e.g. {flag} 30)")
    return float(value)


def check_number(flag: str, value: float, *, least: float | None = None,
                 above: float | None = None, most: float | None = None) -> float:
    """``value`` if it is a finite number within the bounds (``least`` <= value,
    ``above`` < value, value <= ``most``), else UsageError naming ``flag``."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (least is None or value >= least)
          and (above is None or value > above) and (most is None or value <= most))
    if not ok:
        bounds = [f">= {least:g}" if least is not None else "",
                  f"> {above:g}" if above is not None else "",
                  f"<= {most:g}" if most is not None else ""]
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise UsageError(f"{flag} {shown}: must be a finite number "
                         f"{' and '.join(b for b in bounds if b)}".rstrip())
    return float(value)


def parse_json(text: str | bytes, what: str) -> Any:
    """``text`` parsed as JSON, or UsageError naming ``what`` (a flag or a file).

    Also refuses what the parser itself cannot take: nesting deeper than the
    interpreter's recursion limit, and numbers too long to convert.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what}: not JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno})") from None
    except RecursionError:
        raise UsageError(f"{what}: JSON nested too deeply; give a flatter document") from None
    except (ValueError, UnicodeDecodeError) as exc:  # e.g. a 5000-digit integer, bad UTF-8
        raise UsageError(f"{what}: not usable JSON ({exc})") from None
