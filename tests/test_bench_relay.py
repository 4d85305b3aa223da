"""`semfab bench relay`: the ZeroMQ relay floor is exact, cleans up, and refuses
bad flags in one line."""

from __future__ import annotations

import json

import pytest

from bench.relay import measure_row
from fabric.cli import main


def test_three_workers_get_the_exact_sum_in_rank_order() -> None:
    # an odd size, three members: the float32 sum must be added in rank order
    row = measure_row(4 * 1001, workers=3, iters=3, warmup=1, seed=5)
    assert row.wrong == 0 and row.count == 1001 and row.workers == 3
    assert 0 < row.min_us <= row.time_us <= row.p99_us
    assert row.busbw_gbps > 0


def test_the_command_prints_rows_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "relay.json"
    assert main(["bench", "relay", "--workers", "2", "-b", "8K", "-e", "32K", "-f", "4",
                 "-n", "2", "-w", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8192" in text and "32768" in text and "2 ok, 0 failed" in text
    data = json.loads(out.read_text())
    assert [r["size"] for r in data["rows"]] == [8192, 32768]
    assert all(r["wrong"] == 0 for r in data["rows"])
    assert data["settings"]["workers"] == 2


@pytest.mark.parametrize("flags", [["--workers", "0"], ["--workers", "9"], ["-n", "0"],
                                   ["-b", "64K", "-e", "4K"], ["-f", "1"]])
def test_bad_flags_get_one_line_and_exit_2(flags, capsys) -> None:
    assert main(["bench", "relay", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("semfab"), err
