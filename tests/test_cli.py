"""The `semfab` command line: help, errors (one line, exit 2), launch and stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("info", "bench", "topo", "launch", "switchd", "node", "stats"):
        assert cmd in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "allreduce", "--workers", "0"], "--workers"),
        (["bench", "allreduce", "--paths", "ina,warp"], "unknown path"),
        (["bench", "allreduce", "-b", "4Q"], "sizes"),
        (["bench", "allreduce", "--dtype", "float8"], "--dtype"),
        (["bench", "frames", "--sizes", "abc"], "--sizes"),
        (["launch", "--workers", "2", "--run", "nonsense"], "FILE.py:FUNC"),
        (["launch", "--workers", "2", "--args", "{"], "--args"),
        (["launch", "--topology", "/nonexistent.toml"], "not found"),
        (["switchd", "--topology", "/nonexistent.toml", "--name", "sw0"], "not found"),
        (["stats", "/nonexistent-run-dir"], "fabric.json"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_topo_check_and_gen_pass_their_flags_through(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ls.toml"
    assert main(["topo", "gen", "--leaves", "2", "--per-leaf", "2", "--bandwidth-gbps", "8",
                 "--oversubscription", "2", "-o", str(out)]) == 0
    assert main(["topo", "check", str(out)]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('[[node]]\nname = "w0"\nkind = "worker"\n')
    assert main(["topo", "check", str(bad)]) == 2


def test_frames_bench_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    assert main(["bench", "frames", "--sizes", "0,4096", "-n", "200", "-r", "3",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    formats = {r["format"] for r in data["results"]}
    assert formats == {"semfab", "semfab+crc32c", "msgpack-dict"}
    assert all(r["frames_per_s"] > 0 for r in data["results"])
    assert data["env"]["python"]


@pytest.mark.timeout(120)
def test_launch_runs_a_script_function_on_every_worker(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fabric", "launch", "--workers", "2", "--run-dir",
         str(tmp_path), "--run", f"{EXAMPLES / 'allreduce_paths.py'}:work", "--args", "[999]"],
        capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("w")]
    assert lines == ["w0: {'ina': 0, 'ina-mem': 0, 'host-ps': 0, 'host-ring': 0}",
                     "w1: {'ina': 0, 'ina-mem': 0, 'host-ps': 0, 'host-ring': 0}"]


@pytest.mark.timeout(120)
def test_stats_reads_a_running_fabric(tmp_path: Path) -> None:
    run_dir = tmp_path / "fab"
    env = {**os.environ, "SEMFAB_RUN_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", "launch", "--workers", "1", "--run-dir", str(run_dir),
         "--duration", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "fabric.json").exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.1)
        out = subprocess.run([sys.executable, "-m", "fabric", "stats", str(run_dir), "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats["sw0"]["frames_in"] >= 2  # the hellos of w0 and host0
        assert "engine" in stats["sw0"]
    finally:
        os.killpg(proc.pid, 2)  # Ctrl-C
        proc.wait(30)
    assert proc.returncode in (0, 130)
