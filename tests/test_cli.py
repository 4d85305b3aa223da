"""The `semfab` command line: help, version, -v, errors (one line, exit 2), launch and stats."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from fabric import cli, info
from fabric.cli import build_parser, main
from fabric.errors import SemfabError

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
    assert err.startswith("semfab: error: ")


@pytest.mark.parametrize(
    ("argv", "message", "see"),
    [
        (["bench", "allreduce", "--nope"], "unrecognized arguments: --nope",
         "semfab bench allreduce --help"),
        (["bench", "allreduce", "-n", "x"], "argument -n/--iters: invalid int value: 'x'",
         "semfab bench allreduce --help"),
        (["frobnicate"], "invalid choice: 'frobnicate'", "semfab --help"),
        (["launch", "--run-dir", "/tmp"], "one of the arguments --workers --topology is required",
         "semfab launch --help"),
        (["--bogus"], "unrecognized arguments: --bogus", "semfab --help"),
    ],
)
def test_argparse_errors_have_the_same_style(argv: list[str], message: str, see: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # argparse's own errors (usage block, "semfab bench allreduce: error:") are
    # reworded into semfab's one line, and return 2 rather than raising SystemExit.
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("semfab: error: ") and len(err.splitlines()) == 1, err
    assert message in err and f"(see '{see}')" in err
    assert "usage:" not in captured.err and captured.out == ""


def test_a_failed_run_says_error_and_exits_1(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def fails(args: argparse.Namespace) -> int:
        raise SemfabError("switch sw0 did not answer")

    monkeypatch.setattr(cli, "_default_bench", fails)
    assert main(["bench"]) == 1
    assert capsys.readouterr().err.strip() == "semfab: error: switch sw0 did not answer"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"semfab {metadata.version('semfab')}"


def test_version_without_an_installed_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(info.metadata, "version", missing)
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    want = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    assert want is not None
    assert info.semfab_version() == want.group(1)


@pytest.fixture
def log_level(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The level main() configures logging with (pytest owns the real root logger)."""
    levels: list[int] = []

    def record(**kwargs: Any) -> None:
        levels.append(kwargs["level"])

    monkeypatch.setattr(cli.logging, "basicConfig", record)
    yield levels


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (["-v", "bench", "allreduce"], logging.INFO),
        (["bench", "allreduce", "-v"], logging.INFO),
        (["bench", "allreduce", "-vv"], logging.DEBUG),
        (["bench", "-v", "allreduce"], logging.INFO),
        (["-v", "bench", "allreduce", "-v"], logging.DEBUG),
        (["bench", "allreduce"], logging.WARNING),
    ],
)
def test_verbose_before_or_after_the_subcommand(flags: list[str], level: int,
                                                log_level: list[int]) -> None:
    # --workers 0 stops the run right after logging is set up: nothing launches.
    assert main([*flags, "--workers", "0"]) == 2
    assert log_level == [level]


def test_verbose_after_the_subcommand_gives_progress_logs() -> None:
    proc = subprocess.run([sys.executable, "-m", "fabric", "info", "-v"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"semfab\.cli INFO semfab info: done in [0-9.]+ s \(exit 0\)",
                     proc.stderr), proc.stderr
    assert "DEBUG" not in proc.stderr


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_help_shows_each_default_once() -> None:
    for parser in _all_parsers(build_parser()):
        text = " ".join(parser.format_help().split())  # undo line wrapping
        assert not re.search(r"\(default[^()]*\)\s*\(default", text), parser.prog
        assert "(default: None)" not in text, parser.prog
        assert "(default: False)" not in text, parser.prog


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


def test_stats_finds_a_fabric_launched_from_python(tmp_path) -> None:
    """Any fabric (a benchmark's, user code's) writes fabric.json, so `semfab stats
    <run folder>` reads its counters, not only `semfab launch`'s."""
    import subprocess
    import sys

    from fabric.emulation.launcher import launch

    with launch(workers=2, run_dir=tmp_path, timeout_s=20):
        out = subprocess.run([sys.executable, "-m", "fabric", "stats", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "sw0: up" in out.stdout
