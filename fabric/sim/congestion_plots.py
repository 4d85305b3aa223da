"""Pictures of a congestion run: a PNG of queue depth over time per hot port, and a
Chrome/Perfetto trace with queue depths and pauses as counter tracks.

Both read the ``record`` :func:`fabric.sim.incast.run_incast` fills: ``queues``
(``{port: [(t, bytes), ...]}``) and ``pauses`` (``{port: [(t, paused), ...]}``).
Times are virtual seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["plot_queues", "write_trace"]

#: Points kept per series: a long run changes its queue millions of times.
MAX_POINTS = 20_000


def _thin(series: list[tuple[float, Any]], limit: int = MAX_POINTS) -> list[tuple[float, Any]]:
    """At most about ``limit`` points, the last one kept."""
    if len(series) <= limit:
        return series
    step = -(-len(series) // limit)
    return series[::step] + [series[-1]]


def _paused_spans(pauses: dict[str, list[tuple[float, bool]]]) -> list[tuple[float, float]]:
    """The times at least one port was paused, as merged ``(start, end)`` spans."""
    edges = sorted((t, 1 if p else -1) for log in pauses.values() for t, p in log)
    spans, depth, start = [], 0, 0.0
    for t, d in edges:
        if depth == 0 and d > 0:
            start = t
        depth = max(depth + d, 0)
        if depth == 0 and d < 0:
            spans.append((start, t))
    if depth > 0 and edges:
        spans.append((start, edges[-1][0]))
    return spans


def plot_queues(record: dict[str, Any], path: str | Path, title: str,
                xlabel: str = "virtual time (us)") -> Path:
    """PNG: each recorded port's data queue (kB) against time (us); paused spans shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, series in record.get("queues", {}).items():
        pts = _thin(series)
        if pts:
            ax.step([t * 1e6 for t, _ in pts], [b / 1e3 for _, b in pts], where="post",
                    label=f"queue {name}")
    spans = _paused_spans(record.get("pauses", {}))
    for k, (a, b) in enumerate(spans):
        ax.axvspan(a * 1e6, b * 1e6, alpha=0.15, color="red",
                   label="some port paused (PFC)" if k == 0 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("data queue (kB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if record.get("queues") or spans:
        ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_trace(record: dict[str, Any], path: str | Path, name: str) -> Path:
    """Chrome Trace Event JSON: one counter track per queue (bytes) and per paused
    port (1 while paused), open in ui.perfetto.dev."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": name}}]
    for port, series in record.get("queues", {}).items():
        events += [{"ph": "C", "name": f"queue {port} (bytes)", "pid": 1, "ts": t * 1e6,
                    "args": {"bytes": b}} for t, b in _thin(series)]
    for port, log in record.get("pauses", {}).items():
        events += [{"ph": "C", "name": f"paused {port}", "pid": 1, "ts": t * 1e6,
                    "args": {"paused": int(p)}} for t, p in _thin(log)]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}) + "\n")
    return out
