"""Test helper: end the processes a test started (by PID, their whole group)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable
from typing import Any


def kill_groups(procs: Iterable[subprocess.Popen[Any]]) -> None:
    """SIGKILL the process group of every process still running, and reap it.
    The processes must have been started with ``start_new_session=True``."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
