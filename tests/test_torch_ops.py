"""Every operation of the semfab backend, element by element, on a group of each
path, under `semfab launch` (tests/torch_ops_job.py is the job)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.torch_jobs import leftovers, run_job

pytest.importorskip("torch")


def test_every_operation_on_every_path(tmp_path: Path) -> None:
    res = run_job([sys.executable, "-m", "fabric", "launch", "--workers", "2", "--run",
                   "tests/torch_ops_job.py:main"], tmp_path, timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    results = {ln.split(":", 1)[0]: ast.literal_eval(ln.split(":", 1)[1].strip())
               for ln in res.stdout.splitlines() if ln.startswith(("w0:", "w1:"))}
    assert sorted(results) == ["w0", "w1"], res.stdout
    for who, got in results.items():
        assert got["wrong"] == {}, (who, got["wrong"])
        frames = got["reduce_frames"]
        # reductions ran in the switch on the in-network paths, not on host-ring
        assert all(frames[k] > 0 for k in ("ina", "ina-mem", "fixed", "pairs")), frames
        assert frames["host-ring"] == 0, frames
    assert leftovers(tmp_path) == []
