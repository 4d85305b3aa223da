"""A sharded model's generation step split per token (shared by `semfab bench
tokens` and its ``--sim``): its own work and each of its waits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["STEP_PARTS", "step_split"]

#: A sharded model's step, split (ms per token): its own work and its waits.
STEP_PARTS = ("compute", "tp", "dispatch", "combine", "pp", "plan", "emit")


def step_split(parts: list[dict[str, float]], reps: Sequence[tuple[list[Any], float, float]],
               percentiles: list[float]) -> dict[str, Any] | None:
    """A sharded model's steps inside a level's windows, split into STEP_PARTS, per
    token as ITL counts them: each step once for every token it gave that is not its
    sequence's first (a first token is TTFT's)."""
    from fabric.serving.metrics import stats

    win = [p for p in parts if any(t0 <= p["t"] <= t1 for _c, t0, t1 in reps)]
    if not win:
        return None
    weight = np.array([int(p["rows"] - p.get("first", 0.0)) for p in win])
    out: dict[str, Any] = {}
    for k in (*STEP_PARTS, "step"):
        per_step = np.array([p.get(k, 0.0) * 1e3 for p in win])
        out[k] = stats(np.repeat(per_step, weight).tolist(), percentiles)
    ops = sum(p.get("ops", 0.0) for p in win)
    resent = sum(p.get("resent", 0.0) for p in win)
    out["collectives"] = {"ops": ops, "resent": resent,
                          "completion_rate": 1 - resent / ops if ops else float("nan")}
    return out
