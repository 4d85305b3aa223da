"""The event loop of the token chain's asyncio processes (host0, the benchmark client).

uvloop where it is installed (a dependency on Linux and macOS): its loop costs
less per callback and per socket event than asyncio's own, and the chain makes
a few of each per token. Measured in docs/SERVING.md ("Event loop").
``SEMFAB_UVLOOP=0`` runs asyncio's loop instead, for comparisons.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["loop_name", "run"]

T = TypeVar("T")


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` uses in this process."""
    if os.environ.get("SEMFAB_UVLOOP", "1") == "0":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on the loop :func:`loop_name` names."""
    if loop_name() == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)
