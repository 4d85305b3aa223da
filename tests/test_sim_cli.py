"""The simulator from every command: --sim at any worker count, --workers from
--topology, and sweeps spread over an executor (--jobs, --executor) with the same
rows, in the same order, whatever the executor and the job count.

Small worker counts and sizes: every test runs in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from bench import allreduce, sweep
from fabric.cli import main
from fabric.core.topology import leaf_spine, star
from fabric.sim import cli as simcli

ROW = re.compile(r"^\s+\d+\s+\d+\s+\w+\s+\w+\s+[\w-]+\s+\d+\s")
#: Wall-clock fields: the only ones that may differ between executors.
WALL = ("wall_s", "events_per_s")


def _rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ROW.match(ln)]


def _one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> None:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("semfab: error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in captured.err
    for word in words:
        assert word in err, err


def _topology_file(tmp_path: Path, topo: Any, name: str = "t.toml") -> str:
    path = tmp_path / name
    path.write_text(topo.to_toml())
    return str(path)


# --------------------------------------------------------------------------
# --sim above the emulator's 8 workers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["allreduce", "all_gather"])
def test_sim_takes_more_workers_than_one_machine_launches(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["bench", kind, "--sim", "--workers", "16", "-b", "4K", "-e", "4K", "--paths", "ina",
            "-w", "0", "-n", "1", "--inplace", "0", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "# workers: 16 (simulated ranks)" in text
    rows = json.loads(out.read_text())["results"]
    assert [(r["workers"], r["wrong"], r["ok"]) for r in rows] == [(16, 0, True)]
    # emulation keeps its cap, and says how to go beyond it
    assert main([*argv[:2], *argv[3:]]) == 2
    _one_line_error(capsys, "1..8", "--sim")


def test_moe_sim_runs_in_network_beyond_one_mask_block(
        capsys: pytest.CaptureFixture[str]) -> None:
    """34 ranks: more than a frame's 32-member mask, so in-network dispatch sends a
    frame per block of 32 that a token's targets fall in."""
    base = ["bench", "moe", "--sim", "--leaves", "2", "--per-leaf", "17", "--tokens", "2",
            "--hidden", "8", "--topk", "2", "-w", "0", "-n", "1", "--oversubscription", "1"]
    assert main(base) == 0
    text = re.sub(" +", " ", capsys.readouterr().out)  # the table's cells, unpadded
    assert "left out" not in text
    for v in ("flat", "hierarchical", "in-network"):
        assert f"| 1 | {v} |" in text


# --------------------------------------------------------------------------
# --workers from --topology
# --------------------------------------------------------------------------


def _plan(argv: list[str]) -> sweep.Plan:
    p = argparse.ArgumentParser()
    allreduce.add_arguments(p)
    return sweep.parse_plan(p.parse_args(argv), allreduce.ALL_PATHS)


def test_workers_come_from_the_topology_file(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    six = _topology_file(tmp_path, leaf_spine(2, 3, leaf_bandwidth_gbps=100))
    # emulation: planned without launching anything
    assert _plan(["--topology", six, "--paths", "ina"]).workers == [6]
    assert _plan(["--paths", "ina"]).workers == [2, 4]  # no file: the usual default
    # --sim, past the emulator's cap, and the command line that runs it again
    big = _topology_file(tmp_path, leaf_spine(2, 6, leaf_bandwidth_gbps=100), "big.toml")
    out = tmp_path / "r.json"
    assert main(["bench", "allreduce", "--sim", "--topology", big, "-b", "4K", "-e", "4K",
                 "--paths", "ina", "-w", "0", "-n", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["workers"] for r in doc["results"]] == [12]
    assert doc["settings"]["workers"] == [12] and "--workers 12" in doc["settings"]["command"]
    # semfab sim allreduce: the file's count, once (it used to run the file per count)
    capsys.readouterr()
    assert main(["sim", "allreduce", "--topology", six, "-b", "4K", "-e", "4K",
                 "--paths", "ina", "-w", "0", "-n", "1"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ina ")]
    assert len(lines) == 1 and "x6 " in lines[0]


@pytest.mark.parametrize("argv", [
    ["bench", "allreduce", "--paths", "ina", "-b", "4K", "-e", "4K"],
    ["bench", "allreduce", "--sim", "--paths", "ina", "-b", "4K", "-e", "4K"],
    ["bench", "reduce_scatter", "--sim", "--paths", "ina", "-b", "4K", "-e", "4K"],
    ["sim", "allreduce", "--paths", "ina", "-b", "4K", "-e", "4K"],
], ids=["emulation", "sim", "collective-sim", "sim-allreduce"])
def test_workers_that_disagree_with_the_file_are_one_line(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    six = _topology_file(tmp_path, star(6))
    assert main([*argv, "--topology", six, "--workers", "4"]) == 2
    _one_line_error(capsys, "has 6 workers", "--workers asks for 4", "--workers 6")
    assert capsys.readouterr().out == ""  # before any header


# --------------------------------------------------------------------------
# --jobs and --executor
# --------------------------------------------------------------------------


def _finish(delay: float, index: int) -> tuple[int, int, float]:
    """A point that takes ``delay`` seconds: its index, process and end time."""
    time.sleep(delay)
    return index, os.getpid(), time.time()


def test_points_come_back_in_order_each_as_soon_as_it_can() -> None:
    # the first point is slow, the second quick, the third slow: they come back in
    # order, from other processes, and the second does not wait for the third
    works = [(_finish, (1.0, 0)), (_finish, (0.0, 1)), (_finish, (2.5, 2))]
    got = []
    for index, pid, end in simcli.run_points(works, jobs=2):
        got.append((index, pid, end, time.time()))
    assert [g[0] for g in got] == [0, 1, 2]
    assert all(g[1] != os.getpid() for g in got)
    assert got[1][3] < got[2][2]  # point 1 was handed over before point 2 ended
    # one job: here, one after another
    assert [r[:2] for r in simcli.run_points(works[:2], jobs=1)] == [(0, os.getpid()),
                                                                      (1, os.getpid())]


def _strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in WALL} for r in rows]


def test_sim_scale_rows_do_not_depend_on_jobs(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sim", "scale", "--workers", "4,8", "--oversubscription", "1,2", "--size", "64K",
            "--paths", "ina,host-ring"]
    docs, tables = [], []
    for jobs in ("1", "2"):
        out, md = tmp_path / f"j{jobs}.json", tmp_path / f"j{jobs}.md"
        assert main([*base, "--jobs", jobs, "--json", str(out), "--markdown", str(md)]) == 0
        text = capsys.readouterr().out
        assert ("2 at a time in local processes" in text) == (jobs == "2")
        docs.append(json.loads(out.read_text()))
        # the table rows without their last column, the wall clock
        tables.append([ln.rsplit(None, 1)[0] for ln in text.splitlines()
                       if re.match(r"^\s+\d+\s+\d", ln)])
    assert len(docs[0]["results"]) == 8 and len(tables[0]) == 8
    assert _strip(docs[0]["results"]) == _strip(docs[1]["results"])
    assert tables[0] == tables[1]
    # the Markdown table: path left-aligned, numbers right; cells as the JSON has them
    head, align, *cells = [[c.strip() for c in ln.strip("|").split("|")]
                           for ln in (tmp_path / "j1.md").read_text().splitlines()[:10]]
    assert head == ["workers", "ratio", "path", "time (ms)", "busbw (GB/s)", "ideal (ms)",
                    "of ideal"]
    assert [a.startswith(":") or not a.endswith(":") for a in align] == [
        False, False, True, False, False, False, False]
    r = docs[0]["results"][3]
    assert cells[3] == [str(r["workers"]), f"{r['oversubscription']:g}:1", r["path"],
                        f"{r['time_s'] * 1e3:.3f}", f"{r['busbw_gbps']:.2f}",
                        f"{r['ideal_s'] * 1e3:.3f}", f"{r['fraction_of_ideal']:.2f}"]
    # in the points' order: workers, then ratio, then path
    assert [(r["workers"], r["oversubscription"], r["path"]) for r in docs[1]["results"]] == [
        (w, o, p) for w in (4, 8) for o in (1.0, 2.0) for p in ("ina", "host-ring")]


@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
def test_bench_sim_sweep_rows_do_not_depend_on_jobs(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", kind, "--sim", "--workers", "2,4", "-b", "4K", "-e", "16K",
            "--paths", "ina,host-ring", "-w", "0", "-n", "1"]
    docs, printed = [], []
    for jobs in ("1", "2"):
        out = tmp_path / f"j{jobs}.json"
        assert main([*base, "--jobs", jobs, "--json", str(out)]) == 0
        text = capsys.readouterr().out
        docs.append(json.loads(out.read_text()))
        printed.append(_rows(text))
    assert len(docs[0]["results"]) == 2 * 2 * 2 == len(printed[0])
    assert docs[0]["results"] == docs[1]["results"]
    assert printed[0] == printed[1]
    assert docs[1]["settings"]["jobs"] == 2 and "--jobs 2" in docs[1]["settings"]["command"]
    # the emulated sweep's order: worker count, path, size
    assert [(r["workers"], r["path"]) for r in docs[1]["results"]] == [
        (w, p) for w in (2, 4) for p in ("ina", "host-ring") for _ in range(2)]


@pytest.mark.parametrize(("argv", "words"), [
    (["sim", "scale", "--workers", "4", "--jobs", "0"], ["--jobs 0", "1..1024"]),
    (["sim", "scale", "--workers", "4", "--jobs", "two"], ["--jobs", "invalid int"]),
    (["sim", "scale", "--workers", "4", "--executor", "slurm"], ["--executor", "slurm"]),
    (["sim", "allreduce", "--jobs", "-1"], ["--jobs -1"]),
    (["bench", "allreduce", "--sim", "--jobs", "0"], ["--jobs 0"]),
    (["bench", "all_gather", "--sim", "--executor", "threads"], ["--executor", "threads"]),
    (["bench", "moe", "--sim", "--jobs", "0"], ["--jobs 0"]),
    # emulation measures one launched fabric at a time
    (["bench", "allreduce", "--jobs", "2"], ["--jobs/--executor", "--sim"]),
    (["bench", "moe", "--jobs", "2"], ["--jobs/--executor", "--sim"]),
])
def test_bad_jobs_or_executor_is_one_line(argv: list[str], words: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    _one_line_error(capsys, *words)
    assert capsys.readouterr().out == ""


def test_mpi_outside_a_launcher_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mpi4py")
    for key in simcli.MPI_LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    # spawning MPI workers outside mpirun/srun fails or hangs: refused, with the way
    assert main(["sim", "scale", "--workers", "4", "--executor", "mpi"]) == 2
    _one_line_error(capsys, "mpirun", "python -m mpi4py.futures")
