"""`semfab bench loss` end to end on a tiny transfer: exact data under loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric.cli import main


@pytest.mark.timeout(180)
def test_bench_loss_small(tmp_path: Path) -> None:
    out = tmp_path / "loss.json"
    rc = main(["bench", "loss", "--loss", "0,0.05", "--size", "256K", "--frame", "16K",
               "-n", "1", "--repeat", "2", "--run-dir", str(tmp_path / "runs"),
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["repeat"] == 2 and doc["settings"]["iters"] == 1
    rows = doc["results"]
    # each row pools its transfers over both rounds (two launches per scenario)
    assert all(r["transfers"] == 2 for r in rows)
    keys = {(r["path"], r["policy"], r["faults"]) for r in rows}
    assert ("p2p", "gbn", "loss=0.05") in keys and ("ina", "selective", "reorder=0.05:2") in keys
    assert all(r["wrong"] == 0 for r in rows)
    lossy = [r for r in rows if r["faults"] == "loss=0.05"]
    assert sum(r["lost"] for r in lossy) > 0
    assert all(r["retransmitted"] >= 1 for r in lossy if r["lost"])
    for r in rows:
        assert set(r) >= {"path", "policy", "loss", "goodput_gbps", "goodput_ratio", "lost",
                          "retransmitted", "spurious", "rto_expiries", "p99_ms", "wrong"}
        # an expiry resends at least one frame, so it never outnumbers them
        assert 0 <= r["rto_expiries"] <= r["retransmitted"]


def test_bench_loss_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "loss", "--loss", "2"]) == 2
    assert main(["bench", "loss", "--policy", "tcp-reno"]) == 2
    assert main(["bench", "loss", "--repeat", "0"]) == 2
    assert "unknown policy" in capsys.readouterr().err
