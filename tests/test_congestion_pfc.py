"""PFC's failures in the simulated fabric (fabric/sim/pfc_cases.py): a victim of
head-of-line blocking, and a deadlock on a ring, found as a cycle of paused ports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric.cli import main
from fabric.sim.pfc_cases import run_ring, run_victim


def test_pfc_makes_an_innocent_flow_wait_behind_an_incast_and_trimming_does_not() -> None:
    lossless = run_victim(pfc=True)
    trimmed = run_victim(pfc=False)
    assert lossless["finished"] and trimmed["finished"]
    assert lossless["wrong"] == trimmed["wrong"] == 0
    # with PFC: nothing is lost, the shared link is paused, and the victim waits
    assert lossless["drops"] == lossless["trims"] == 0
    assert lossless["pauses"] > 0 and lossless["uplink_paused_s"] > 0
    assert lossless["victim_slowdown"] > 3.0
    # with trimming: the incast pays (trims), the victim barely notices
    assert trimmed["pauses"] == 0 and trimmed["trims"] > 0
    assert trimmed["victim_slowdown"] < 1.5
    assert lossless["victim_fct_s"] > 3 * trimmed["victim_fct_s"]


def test_a_ring_under_pfc_deadlocks_and_the_cycle_is_reported() -> None:
    r = run_ring()
    assert not r["finished"]
    assert r["deadlock"] == ["s0:0", "s1:1", "s2:1"]  # each switch's clockwise port
    assert r["detected_at_s"] is not None and r["lossless_drops"] == 0
    assert r["delivered_bytes"] < 3 * r["settings"]["size"]


def test_the_same_ring_with_room_to_spare_finishes_without_a_deadlock() -> None:
    r = run_ring(xoff_bytes=10_000_000)  # XOFF above what the flows ever queue
    assert r["finished"] and r["deadlock"] is None and r["pauses"] == 0
    assert r["delivered_bytes"] >= 3 * r["settings"]["size"]


def test_the_command_reports_the_victim_and_the_deadlock(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ring.json"
    assert main(["sim", "pfc", "ring", "--json", str(out)]) == 0
    assert "deadlock: s0:0 -> s1:1 -> s2:1 -> s0:0" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][0]["deadlock"] == ["s0:0", "s1:1", "s2:1"]
    assert main(["sim", "pfc", "victim"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("   pfc: victim") and "credit: victim" in text
    assert "  trim: victim" in text
