"""Frame logs for traces: what each process sent and received, and when.

Off unless ``SEMFAB_FRAME_TRACE`` names a folder (``semfab bench allreduce
--trace`` sets it for the processes it launches). Then every endpoint and
switch daemon keeps one record per frame (monotonic ns, direction, opcode,
job, PSN, flags, length, the port or node at the other end) and writes them
to ``<folder>/<name>-<pid>.frames.json`` when it closes. The clock is the
host's CLOCK_MONOTONIC, shared by every process of one machine, so the
records of all processes line up. A driver module: the protocol core never
sees it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from fabric.core import frame as fr

__all__ = ["ENV", "MAX_RECORDS", "FrameLog"]

ENV = "SEMFAB_FRAME_TRACE"
#: Records one process keeps (the oldest are dropped beyond it): a few hundred
#: MB of trace at the most.
MAX_RECORDS = 400_000


class FrameLog:
    """One process's frame records (see the module doc)."""

    def __init__(self, folder: Path, name: str, kind: str, world: int) -> None:
        self.folder, self.name, self.kind, self.world = folder, name, kind, world
        # (t_ns, "tx"|"rx", op, job, psn, flags, length, other end)
        self.records: list[tuple[int, str, int, int, int, int, int, str]] = []
        self.dropped = 0

    @classmethod
    def from_env(cls, name: str, kind: str, world: int) -> FrameLog | None:
        """A log when ``SEMFAB_FRAME_TRACE`` is set, else None (the normal case)."""
        folder = os.environ.get(ENV)
        return cls(Path(folder), name, kind, world) if folder else None

    def add(self, direction: str, header: Any, other: str) -> None:
        """Record one frame by its header (a bad header is not recorded)."""
        try:
            op, flags, _src, job, psn, _key, _off, length = fr.peek(header)
        except fr.FrameError:
            return
        if len(self.records) >= MAX_RECORDS:
            self.dropped += 1
            return
        self.records.append((time.monotonic_ns(), direction, int(op), job, psn, int(flags),
                             length, other))

    def dump(self) -> Path | None:
        """Write the records (once, at close); the file's path, or None on failure."""
        path = self.folder / f"{self.name}-{os.getpid()}.frames.json"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"node": self.name, "kind": self.kind,
                                        "world": self.world,
                                        "dropped": self.dropped, "records": self.records}))
        except OSError:
            return None
        return path
