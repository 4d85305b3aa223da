"""`semfab bench core`: rows checked against the exact result, settings, bad flags
(no timing is asserted)."""

from __future__ import annotations

import json
import re

import pytest

from bench import core
from fabric.cli import main
from fabric.info import build


@pytest.mark.parametrize("path", core.PATHS)
@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
def test_a_row_reduces_exactly_and_counts_its_frames(path: str, dtype: str) -> None:
    from kernels.dtypes import np_dtype

    # an odd element count
    row = core.measure_row(path, 3, np_dtype(dtype).itemsize * 1001, dtype=dtype, iters=4,
                           warmup=1, seed=7)
    assert row.wrong == 0
    assert row.count == 1001 and row.workers == 3 and row.calls == 4
    # one descriptor or data frame per member and chunk, one result back to each
    assert row.frames_in == row.frames_out and row.frames_in % 3 == 0
    assert 0 < row.switch_min_us <= row.switch_p50_us
    assert 0 < row.members_min_us <= row.members_p50_us
    assert row.total_p50_us > 0


def test_a_larger_call_is_cut_into_chunks_on_the_frame_plane() -> None:
    small = core.measure_row("ina", 2, 4096, iters=2, warmup=0)
    large = core.measure_row("ina", 2, (1 << 20) + 12, iters=2, warmup=0)  # a short last chunk
    assert small.frames_in == 2
    assert large.frames_in > small.frames_in and large.wrong == 0


def test_max_and_crc_are_exact_too() -> None:
    row = core.measure_row("ina-mem", 2, 4096, op="max", iters=3, warmup=0, crc=True)
    assert row.wrong == 0 and row.op == "max"


def test_the_cli_prints_rows_and_writes_every_setting(tmp_path, capsys) -> None:
    out, md = tmp_path / "c.json", tmp_path / "c.md"
    assert main(["bench", "core", "--paths", "ina-mem,ina", "-b", "4K", "-e", "16K", "-n", "3",
                 "-w", "1", "--json", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["path"], r["size"]) for r in doc["results"]] == [
        ("ina-mem", 4096), ("ina-mem", 16384), ("ina", 4096), ("ina", 16384)]
    assert doc["settings"] == {"paths": ["ina-mem", "ina"], "workers": [2],
                               "sizes": [4096, 16384], "dtypes": ["float32"], "op": "sum",
                               "iters": 3, "warmup": 1, "crc": False, "seed": 0,
                               "profile": 0, "build": build()}
    assert doc["failed"] == []
    assert re.sub(" +", " ", md.read_text()).startswith("| size | type | path |")
    text = capsys.readouterr().out
    assert "4 rows in" in text and "4 ok, 0 failed" in text


def test_nccl_dtype_names_and_lists_give_a_row_each(tmp_path) -> None:
    out = tmp_path / "d.json"
    assert main(["bench", "core", "--paths", "ina", "-b", "4K", "-e", "4K", "-n", "2", "-w", "0",
                 "-d", "float,bf16,int", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16", "int32"]
    assert all(r["wrong"] == 0 for r in rows)


def test_profile_names_the_protocol_functions_not_the_driver(capsys) -> None:
    assert main(["bench", "core", "--paths", "ina-mem", "-b", "4K", "-e", "4K", "-n", "5",
                 "-w", "1", "--profile", "4"]) == 0
    text = capsys.readouterr().out
    assert "# profile of the row again (5 calls, own time):" in text
    lines = [x for x in text.splitlines() if "/call" in x]
    assert len(lines) == 4
    assert not any("bench/core.py" in x for x in lines)
    assert any("switchd/" in x or "fabric/" in x for x in lines)


@pytest.mark.parametrize("flags", [["--profile", "-1"], ["--paths", "host-ring"],
                                   ["--workers", "1"], ["--workers", "two"],
                                   ["-b", "1M", "-e", "4K"], ["-d", "float128"],
                                   ["-o", "prod"], ["-n", "0"]])
def test_bad_flags_exit_2_with_one_line(flags, capsys) -> None:
    assert main(["bench", "core", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("semfab")
