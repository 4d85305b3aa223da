"""Recorded PyTorch steps replayed in simulation (`semfab sim replay`,
fabric.sim.replay): how sizes scale with the rank count, the table, and
refusals of bad input. No torch needed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from fabric.errors import UsageError
from fabric.sim.replay import TRACE_FORMAT as FORMAT
from fabric.sim.replay import load_trace as load
from fabric.sim.replay import replay, scaled_ops


def main(argv: list[str]) -> int:
    """`semfab sim replay ARGV`, its exit code."""
    from fabric.cli import main as cli

    return cli(["sim", "replay", *argv])


def trace(ops: list[dict[str, Any]], world: int = 2) -> dict[str, Any]:
    return {"format": FORMAT, "version": 1, "world": world, "rank": 0, "ops": ops}


FSDP_LIKE = trace([
    {"kind": "all_gather", "count": 1000, "dtype": "float32", "group": [0, 1], "gap_s": 1e-4},
    {"kind": "allreduce", "count": 300, "dtype": "bfloat16", "group": [0, 1], "path": "ina"},
    {"kind": "reduce_scatter", "count": 2000, "dtype": "float32", "group": [0, 1]},
    {"kind": "alltoallv", "count": 96, "dtype": "float32", "group": [0, 1],
     "send_counts": [40, 56], "recv_counts": [40, 60]},
    {"kind": "broadcast", "count": 7, "dtype": "int64", "group": [0, 1], "root": 1},
    {"kind": "barrier", "count": 0, "group": [0, 1]},
])


def test_sizes_scale_as_documented() -> None:
    ops = scaled_ops(FSDP_LIKE, 8)
    ag, ar, rs, a2a, bc, bar = ops
    assert ag["count"] == 250 and ag["size"] == 8  # the whole tensor (2000) kept
    assert ar["count"] == 300 and ar["dtype"] == "bfloat16"
    assert rs["count"] == 2000 and rs["count"] % 8 == 0
    assert a2a["counts"] == [12] * 8 and a2a["count"] == 96  # the per-rank total kept
    assert bc["root"] == 1 and bc["count"] == 7
    assert bar["kind"] == "barrier"
    assert all(op["block"] is None for op in ops)  # world groups scale to every rank


def test_smaller_groups_are_tiled() -> None:
    doc = trace([{"kind": "allreduce", "count": 64, "dtype": "float32", "group": [0, 1]}],
                world=4)
    (op,) = scaled_ops(doc, 8)
    assert op["block"] == 2 and op["size"] == 2
    with pytest.raises(UsageError, match="cannot tile 9 workers"):
        scaled_ops(doc, 9)


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(topology=None, per_leaf=4, bandwidth_gbps=10.0, latency_us=1.0, path=None,
                compute=True)
    base.update(kw)
    return argparse.Namespace(**base)


def test_replay_runs_every_operation_in_simulation() -> None:
    rows = [replay(FSDP_LIKE, w, _args()) for w in (4, 8)]  # a star, then two leaves
    for row in rows:
        kinds = row["by_kind"]
        assert {k: int(v["calls"]) for k, v in kinds.items()} == {
            "all_gather": 1, "allreduce": 1, "reduce_scatter": 1, "alltoallv": 1,
            "broadcast": 1, "barrier": 1}
        assert row["compute_s"] == pytest.approx(1e-4)
        comm = sum(v["seconds"] for v in kinds.values())
        assert 0 < comm and row["step_s"] >= comm + 1e-4 - 1e-9
    # bytes per rank follow the scaling: the all_gather shard halves from 4 to 8 ranks
    assert rows[0]["by_kind"]["all_gather"]["bytes_per_rank"] == 500 * 4
    assert rows[1]["by_kind"]["all_gather"]["bytes_per_rank"] == 250 * 4


def test_cli_table_json_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(FSDP_LIKE))
    out = tmp_path / "rows.json"
    assert main([str(path), "--workers", "4", "--per-leaf", "4", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "all_gather" in table and "step" in table
    assert json.loads(out.read_text())["rows"][0]["workers"] == 4
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main([str(bad), "--workers", "4"]) == 2
    assert "not a trace written by fabric.torch.record()" in capsys.readouterr().err
    assert main([str(path), "--workers", "four"]) == 2
    assert main([str(tmp_path / "missing.json"), "--workers", "4"]) == 2
    with pytest.raises(UsageError):
        load(bad)
