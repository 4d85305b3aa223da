"""The recorder: every fabric operation a torch program issues, as a trace that
``semfab sim replay`` plays in simulation at any number of ranks.

    with fabric.torch.record("step.json"):
        train_step()                     # every rank runs it; rank 0 writes the file

Each entry is what the fabric ran, in the order it ran (one communication
thread per process runs them in issue order, so the order is the dependency):
the fabric operation (``allreduce``, ``all_gather``, ``reduce_scatter``,
``broadcast``, ``reduce``, ``alltoallv``, ``gather``, ``scatter``, ``barrier``),
this rank's element count and dtype, the group's world ranks, the root, the
reduction, the per-rank counts of an alltoallv, the path, the measured
duration, and the gap since the previous operation ended (the compute between
them, which the replay keeps). Sends and receives are not recorded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fabric.errors import UsageError
from fabric.sim.replay import TRACE_FORMAT as FORMAT
from fabric.sim.replay import TRACE_VERSION as VERSION
from fabric.sim.replay import load_trace as load

__all__ = ["FORMAT", "Recorder", "active", "load", "record"]



class Recorder:
    """The operations of one rank, as they run on its communication thread."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.ops: list[dict[str, Any]] = []
        self._last_end = time.monotonic()

    def proxy(self, target: Any, ranks: tuple[int, ...]) -> Any:
        """``target`` (an endpoint or communicator) recording what is run on it."""
        return _Recording(self, target, ranks)

    def add(self, entry: dict[str, Any], start: float, end: float) -> None:
        """One operation that ran from ``start`` to ``end`` (monotonic seconds)."""
        entry["gap_s"] = max(start - self._last_end, 0.0)
        entry["duration_s"] = end - start
        self._last_end = end
        self.ops.append(entry)

    def document(self) -> dict[str, Any]:
        """The trace as written."""
        return {"format": FORMAT, "version": VERSION, "world": self.world,
                "rank": self.rank, "ops": self.ops}


class _Recording:
    """Forwards allreduce, collective and barrier, recording each call."""

    def __init__(self, rec: Recorder, target: Any, ranks: tuple[int, ...]) -> None:
        self._rec, self._t, self._ranks = rec, target, list(ranks)

    def _run(self, entry: dict[str, Any], fn: Any, *args: Any, **kw: Any) -> Any:
        start = time.monotonic()
        result = fn(*args, **kw)
        self._rec.add({**entry, "group": self._ranks}, start, time.monotonic())
        return result

    def allreduce(self, x: Any, op: str = "sum", path: str = "ina", out: Any = None,
                  numerics: str = "float") -> Any:
        entry = {"kind": "allreduce", "count": int(x.size), "dtype": x.dtype.name, "op": op,
                 "path": path, "numerics": numerics}
        return self._run(entry, self._t.allreduce, x, op=op, path=path, out=out,
                         numerics=numerics)

    def collective(self, kind: str, x: Any, out: Any = None, **kw: Any) -> Any:
        entry: dict[str, Any] = {"kind": kind, "count": int(x.size), "dtype": x.dtype.name,
                                 "path": kw.get("path"), "op": kw.get("op", "sum"),
                                 "root": int(kw.get("root", 0))}
        for key in ("send_counts", "recv_counts"):
            if kw.get(key) is not None:
                entry[key] = [int(c) for c in kw[key]]
        return self._run(entry, self._t.collective, kind, x, out, **kw)

    def barrier(self) -> None:
        self._run({"kind": "barrier", "count": 0, "dtype": "float32"}, self._t.barrier)


_active: Recorder | None = None


def active() -> Recorder | None:
    """The recorder in force, if any."""
    return _active


@contextmanager
def record(path: str | Path) -> Iterator[Recorder]:
    """Record the fabric operations of this block; rank 0 writes ``path`` (JSON)."""
    global _active
    from fabric.torch.runtime import current

    rt = current()
    if rt is None:
        raise UsageError("fabric.torch.record() needs a semfab process group: call "
                         "dist.init_process_group('semfab') first")
    if _active is not None:
        raise UsageError("fabric.torch.record() is already recording")
    out = Path(path)
    rec = Recorder(rt.rank, rt.world)
    rt.comm.call(lambda: None, "start recording")  # what was queued before is not ours
    _active = rec
    try:
        yield rec
        rt.comm.call(lambda: None, "end recording")  # let this block's operations run
    finally:
        _active = None
    if rt.rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rec.document(), indent=1))
