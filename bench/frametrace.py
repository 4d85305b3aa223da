"""The ``--trace`` file of `semfab bench allreduce`: calls, chunks, switches, resends.

Chrome Trace Event JSON (ui.perfetto.dev, chrome://tracing). One process per
worker count; in it, per node:

* ``<worker>``: one slice per timed iteration (path, size, half) and per
  back-to-back loop, as the worker timed it;
* ``<worker> chunks``: one slice per chunk of an in-network allreduce (ina,
  ina-mem), from the worker's first REDUCE of it to its RESULT, with the
  number of copies sent;
* ``<worker> resends``: an instant per frame sent again (RETX flag) and per
  NACK received;
* ``<switch> job <J>``: one slice per chunk the switch aggregated, from its
  first contribution to its last result, with the contributions counted;
  ``<switch> NACKs``: an instant per NACK it sent (a MISSING ask names the
  member it asks).

The frames come from the processes' own logs (:mod:`fabric.emulation.frametrace`, on
while the bench runs with ``--trace``); every process of one host reads the
same monotonic clock, so the tracks line up.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.collectives import Tracer
from fabric.core.frame import Flag, Op

__all__ = ["FrameTracer"]

_REDUCE, _RESULT, _NACK = int(Op.REDUCE), int(Op.RESULT), int(Op.NACK)
_RETX = int(Flag.RETX)


class FrameTracer(Tracer):
    """:class:`bench.collectives.Tracer`'s call slices plus the frames of every node."""

    def __init__(self, kind: str, folder: Path) -> None:
        super().__init__(kind)
        self.folder = folder
        self.chunk_slices = 0

    def _logs(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.folder.glob("*.frames.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def write(self, path: str) -> None:
        """Write the trace: call slices, then every node's frames."""
        from fabric.serving.trace import TraceBuilder

        logs = self._logs()
        tb = TraceBuilder()
        starts = [int(s[5] * 1e9) for s in self.slices]
        starts += [log["records"][0][0] for log in logs if log["records"]]
        tb.t0 = min(starts, default=0)
        for pid, pname, node, name, cat, t0, t1, meta in sorted(
                self.slices, key=lambda s: (s[0], s[2], s[5])):
            tb.process(pid, pname, sort=pid)
            tb.slice(pid, node, name, int(t0 * 1e9), int(t1 * 1e9), cat, meta)
        for log in sorted(logs, key=lambda g: (g["world"], g["node"])):
            pid = int(log["world"])
            tb.process(pid, f"{self.kind}, {pid} workers", sort=pid)
            if log.get("kind") == "switch":
                self._switch(tb, pid, log)
            else:
                self._worker(tb, pid, log)
        tb.write(path)

    def _worker(self, tb: Any, pid: int, log: dict[str, Any]) -> None:
        node = log["node"]
        first: dict[tuple[int, int], int] = {}
        copies: dict[tuple[int, int], int] = defaultdict(int)
        chunks: list[tuple[int, int, int, int]] = []  # (start, end, job, psn)
        for t, way, op, job, psn, flags, _length, _other in log["records"]:
            if way == "tx" and op == _REDUCE:
                first.setdefault((job, psn), t)
                copies[(job, psn)] += 1
            elif way == "rx" and op == _RESULT and (job, psn) in first:
                chunks.append((first.pop((job, psn)), t, job, psn))
            if (way == "tx" and flags & _RETX) or (way == "rx" and op == _NACK):
                what = "NACK in" if way == "rx" else f"{Op(op).name} resent"
                self._instant(tb, pid, f"{node} resends", f"{what} psn {psn}", t,
                              {"job": job, "psn": psn})
        for start, end, job, psn in sorted(chunks):
            tb.slice(pid, f"{node} chunks", f"chunk {psn}", start, end, "chunk",
                     {"job": job, "psn": psn, "copies sent": copies[(job, psn)]})
            self.chunk_slices += 1

    def _switch(self, tb: Any, pid: int, log: dict[str, Any]) -> None:
        node = log["node"]
        span: dict[tuple[int, int], list[int]] = {}  # (job, psn) -> [first in, last out, n in]
        for t, way, op, job, psn, _flags, _length, other in log["records"]:
            if way == "rx" and op == _REDUCE:
                s = span.setdefault((job, psn), [t, t, 0])
                s[2] += 1
            elif way == "tx" and op == _RESULT and (job, psn) in span:
                span[(job, psn)][1] = t
            elif way == "tx" and op == _NACK:
                self._instant(tb, pid, f"{node} NACKs", f"NACK to {other} psn {psn}", t,
                              {"job": job, "psn": psn, "to": other})
        for (job, psn), (start, end, n) in sorted(span.items(), key=lambda kv: kv[1][0]):
            tb.slice(pid, f"{node} job {job}", f"chunk {psn}", start, end, "aggregation",
                     {"job": job, "psn": psn, "contributions": n})
            self.chunk_slices += 1

    @staticmethod
    def _instant(tb: Any, pid: int, track: str, name: str, t_ns: int,
                 args: dict[str, Any]) -> None:
        tb.events.append({"ph": "i", "s": "t", "name": name, "cat": "frame", "pid": pid,
                          "tid": tb.thread(pid, track), "ts": tb._us(t_ns), "args": args})
