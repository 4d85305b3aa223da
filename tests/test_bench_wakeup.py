"""`semfab bench wakeup`: rows, settings and bad flags (no timing is asserted)."""

from __future__ import annotations

import json
import re

import pytest

from bench import wakeup
from fabric.cli import main
from fabric.emulation import doorbell as db

pytestmark = pytest.mark.skipif(not db.available(), reason="doorbells need x86-64 ordering")


def test_a_row_counts_rings_and_orders_its_percentiles() -> None:
    row = wakeup.measure_row(True, None, 12, 0.003, 0.0005, 0.0002)
    assert 1 <= row.rings <= 12  # only posts that found the reader asleep count
    assert 0 < row.p50_us <= row.p90_us <= row.p99_us <= row.max_us
    assert row.placement == "free"


def test_the_cli_writes_four_rows_and_every_setting(tmp_path, capsys) -> None:
    out = tmp_path / "w.json"
    md = tmp_path / "w.md"
    assert main(["bench", "wakeup", "-n", "8", "--period-ms", "3", "--work-us", "500",
                 "--reader-work-us", "100", "--json", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [(r["handoff"], r["placement"].split()[0]) for r in rows] == [
        (False, "free"), (True, "free"), (False, "cpu"), (True, "cpu")]
    assert all(1 <= r["rings"] <= 8 for r in rows)
    assert doc["settings"] == {"rings": 8, "period_ms": 3.0, "work_us": 500.0,
                               "reader_work_us": 100.0, "pinned_cpu": doc["settings"]["pinned_cpu"]}
    assert md.read_text().startswith("| handoff ")
    assert "| on | free |" in re.sub(" +", " ", capsys.readouterr().out)  # cells unpadded


@pytest.mark.parametrize("flags", [["-n", "0"], ["--period-ms", "0"], ["--work-us", "-1"],
                                   ["--period-ms", "1", "--work-us", "1000"]])
def test_bad_flags_exit_2_with_one_line(flags, capsys) -> None:
    assert main(["bench", "wakeup", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("semfab")
