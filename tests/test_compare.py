"""`semfab compare`: saved allreduce runs side by side (table, ratios, settings, plot)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import report
from bench.report import AllreduceRow
from fabric.cli import main


def _save(path: Path, times: dict[tuple[str, int], float], **settings: object) -> str:
    rows = [AllreduceRow.from_samples(p, 2, s, "float32", "sum", [t], 0)
            for (p, s), t in times.items()]
    rows.append(AllreduceRow.unavailable("mpi", 2, 4096, "float32", "unavailable: no mpirun"))
    base = {"iters": 10, "warmup": 3, "link_gbps": 0.0, "workers": [2], "command": "x"}
    report.write_json(path, "allreduce", [r.to_dict() for r in rows],
                      extra={"settings": {**base, **settings}})
    return str(path)


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[str, str]:
    a = _save(tmp_path / "before.json", {("ina", 4096): 10.0, ("ina", 65536): 100.0,
                                         ("host-ring", 4096): 20.0})
    b = _save(tmp_path / "after.json", {("ina", 4096): 5.0, ("ina", 65536): 200.0,
                                        ("host-ring", 4096): 20.0, ("host-ring", 65536): 50.0},
              link_gbps=0.5, command="y")
    return a, b


def test_table_of_two_runs(two_runs: tuple[str, str], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    a, b = two_runs
    png, md = tmp_path / "cmp.png", tmp_path / "cmp.md"
    assert main(["compare", a, b, "--plot", str(png), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert f"#   A = {a}: allreduce" in out and f"#   B = {b}: allreduce" in out
    # what differs is named (the command line is not worth naming)
    assert "# settings that differ: link_gbps: A 0, B 0.5" in out
    ina = out.split("# ina, 2 workers, float32 sum")[1].split("\n\n")[0].splitlines()
    assert ina[1].split() == ["#", "size(B)", "busbw", "A", "busbw", "B", "time", "A", "time",
                              "B", "B/A"]
    row4k = next(ln.split() for ln in ina if ln.split()[:1] == ["4096"])
    # 4 KiB in 10 us (A) and 5 us (B): busbw 0.41 and 0.819 GB/s, B twice as fast
    assert row4k == ["4096", "0.41", "0.819", "10.00", "5.00", "2.00"]
    row64k = next(ln.split() for ln in ina if ln.split()[:1] == ["65536"])
    assert row64k[-1] == "0.50"
    ring = out.split("# host-ring, 2 workers")[1].split("\n\n")[0]
    row = next(ln.split() for ln in ring.splitlines() if ln.split()[:1] == ["65536"])
    assert row == ["65536", "-", "1.31", "-", "50.00", "-"]  # only B has it
    mpi = out.split("# mpi, 2 workers")[1]
    assert next(ln.split() for ln in mpi.splitlines() if ln.split()[:1] == ["4096"]) == \
        ["4096", "-", "-", "-", "-", "-"]
    assert f"# wrote {md}" in out and f"# wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    text = re.sub(" +", " ", md.read_text())  # the table's cells, without their padding
    assert "| size(B) | busbw(GB/s) A | busbw(GB/s) B | time(us) A | time(us) B | B/A |" in text
    assert "| 4096 | 0.41 | 0.819 | 10.00 | 5.00 | 2.00 |" in text


def test_labels_and_failed_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _save(tmp_path / "a.json", {("ina", 4096): 10.0})
    path = tmp_path / "b.json"
    bad = AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 4)
    report.write_json(path, "allreduce", [bad.to_dict()])
    assert main(["compare", a, str(path), "--labels", "main,patch"]) == 0
    out = capsys.readouterr().out
    assert "patch/main" in out and "0.41!" in out and "# !: the row failed" in out


@pytest.mark.parametrize(
    ("files", "extra", "words"),
    [
        (["a"], [], "at least two saved runs"),
        (["a", "missing"], [], "missing.json: no such file"),
        (["a", "notjson"], [], "notjson.json: not JSON"),
        (["a", "loss"], [], "not a saved allreduce run (kind 'loss')"),
        (["a", "a"], ["--labels", "x"], "--labels: give 2 distinct names"),
    ],
)
def test_bad_inputs_one_line(files: list[str], extra: list[str], words: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "a.json", {("ina", 4096): 10.0})
    (tmp_path / "notjson.json").write_text("{nope")
    (tmp_path / "loss.json").write_text(json.dumps({"kind": "loss", "results": []}))
    argv = ["compare", *[str(tmp_path / f"{f}.json") for f in files], *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("semfab: error: ") and len(err.splitlines()) == 1
    assert words in err
