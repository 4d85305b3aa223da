"""Tests of bench.peers: availability strings, rows that say why, and real runs.

The real runs (gloo, MPI) need torch, or mpirun + mpi4py; without them they
skip and say what to install. Every test checks that no process it started
outlives it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import peers
from bench.peers import (
    MPI4PY_MISSING,
    MPIRUN_MISSING,
    REFERENCE_MISSING,
    TORCH_MISSING,
    peer_status,
    run_gloo,
    run_mpi,
)

SIZES = [4096, 65536]


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Record every process bench.peers starts; afterwards assert none is left."""
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    class RecordingPopen(real_popen):  # type: ignore[misc,valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(peers.subprocess, "Popen", RecordingPopen)
    yield started
    for proc in started:
        assert proc.returncode is not None, f"pid {proc.pid} was not reaped"
        assert peers._session_members(proc.pid) == [], f"session {proc.pid} left processes"


def _status(gloo: str | None, mpi: str | None) -> dict[str, str | None]:
    return {"gloo": gloo, "mpi": mpi}


# --------------------------------------------------------------------------
# status and rows without running anything
# --------------------------------------------------------------------------


def test_peer_status_shape() -> None:
    status = peer_status()
    assert set(status) == {"gloo", "mpi"}
    for reason in status.values():
        assert reason is None or (isinstance(reason, str) and reason)


def test_peer_status_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "_has_module", lambda name: False)
    status = peer_status()
    assert status["gloo"] == "torch is not installed (pip install 'semfab[peers]')"
    assert status["gloo"] == TORCH_MISSING
    assert status["mpi"] == MPI4PY_MISSING

    monkeypatch.setattr(peers, "_has_module", lambda name: True)
    monkeypatch.setattr(peers, "_find_mpirun", lambda: None)
    status = peer_status()
    assert status["gloo"] is None
    assert status["mpi"] == MPIRUN_MISSING
    assert status["mpi"].startswith("mpirun not found: pip install 'semfab[peers]'")
    assert "apt-get" not in status["mpi"]

    monkeypatch.setattr(peers, "_has_module", lambda name: name != "kernels.reference")
    monkeypatch.setattr(peers, "_find_mpirun", lambda: "/usr/bin/mpirun")
    assert peer_status() == _status(REFERENCE_MISSING, REFERENCE_MISSING)


def _fake_exe(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return exe


def test_mpirun_beside_the_interpreter_comes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A venv with Open MPI's wheel has mpirun next to its python; it must win
    # over one on PATH, whose MPI may not be the one mpi4py loads.
    venv_bin, path_bin = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    mine = _fake_exe(venv_bin, "mpirun")
    _fake_exe(path_bin, "mpirun")
    monkeypatch.setattr(peers.sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(path_bin))
    assert peers._find_mpirun() == str(mine)
    mine.unlink()
    assert peers._find_mpirun() == str(path_bin / "mpirun")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert peers._find_mpirun() is None


@pytest.mark.parametrize("root", [True, False])
def test_running_as_root_is_allowed_explicitly(
    monkeypatch: pytest.MonkeyPatch, root: bool
) -> None:
    monkeypatch.setattr(peers, "_is_root", lambda: root)
    monkeypatch.setattr(peers, "_mpi_flavour", lambda mpirun: "openmpi")
    cmd = peers._mpi_launch("/x/mpirun", 2)
    assert cmd[:3] == ["/x/mpirun", "-np", "2"]
    assert ("--allow-run-as-root" in cmd) is root
    env = peers._mpi_env({"A": "1"})
    assert env["A"] == "1"
    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        assert (env.get(var) == "1") is root


@pytest.mark.parametrize("runner", [run_gloo, run_mpi])
def test_missing_peer_gives_rows_with_note(
    monkeypatch: pytest.MonkeyPatch, launched: list[subprocess.Popen[bytes]], runner: object
) -> None:
    monkeypatch.setattr(peers, "peer_status", lambda: _status(TORCH_MISSING, MPIRUN_MISSING))
    rows = runner(2, ["4K", "64K"])  # type: ignore[operator]
    assert [r.size_bytes for r in rows] == SIZES
    reason = TORCH_MISSING if runner is run_gloo else MPIRUN_MISSING
    for row in rows:
        assert not row.ran
        assert row.note == f"unavailable: {reason}"
        assert row.path == ("gloo" if runner is run_gloo else "mpi")
        assert row.workers == 2
        assert row.hops is None
    assert launched == []


def test_peer_ranks_sleep_when_idle_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # spinning OpenMP threads of the input generator made gloo's 4 KiB call 10x slower
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert peers._child_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert peers._child_env()["OMP_WAIT_POLICY"] == "ACTIVE"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="workers"):
        run_gloo(0, SIZES)
    with pytest.raises(ValueError, match="iters"):
        run_mpi(2, SIZES, iters=0)
    with pytest.raises(ValueError, match="smaller than one"):
        run_gloo(2, [2])
    with pytest.raises(ValueError, match="unknown op"):
        run_gloo(2, SIZES, op="avg")
    assert run_mpi(2, []) == []


# --------------------------------------------------------------------------
# real runs
# --------------------------------------------------------------------------


def _skip_unless(peer: str) -> None:
    reason = peer_status()[peer]
    if reason is not None:
        pytest.skip(f"{peer} peer unavailable: {reason}")


def _assert_measured(rows: list, path: str, workers: int) -> None:
    assert [r.size_bytes for r in rows] == SIZES
    for row in rows:
        assert row.ran, row.note
        assert row.path == path and row.workers == workers
        assert row.wrong == 0
        assert row.time_us is not None and row.time_us > 0
        assert row.busbw_gbps is not None and row.busbw_gbps > 0
        assert row.min_us is not None and row.max_us is not None
        assert row.min_us <= row.time_us <= row.max_us
        assert row.count == row.size_bytes // 4


def test_gloo_two_workers(launched: list[subprocess.Popen[bytes]]) -> None:
    _skip_unless("gloo")
    rows = run_gloo(2, SIZES, warmup=1, iters=3, check=True, timeout_s=60)
    _assert_measured(rows, "gloo", 2)
    assert len(launched) == 2


def test_mpi_two_workers(launched: list[subprocess.Popen[bytes]]) -> None:
    _skip_unless("mpi")
    rows = run_mpi(2, SIZES, warmup=1, iters=3, check=True, timeout_s=60)
    _assert_measured(rows, "mpi", 2)
    # One mpirun (besides `mpirun --version`); its ranks are checked through its session.
    assert sum("bench.peer_mpi" in list(proc.args) for proc in launched) == 1  # type: ignore[arg-type]


def test_timeout_gives_failed_rows_and_no_leftovers(
    launched: list[subprocess.Popen[bytes]],
) -> None:
    _skip_unless("gloo")
    # Importing torch alone takes longer than this, so the run must time out.
    rows = run_gloo(2, SIZES, warmup=1, iters=3, timeout_s=0.3)
    assert len(launched) == 2
    for row in rows:
        assert not row.ran
        assert row.note.startswith("failed: gloo with 2 workers: timed out after 0.3 s")


def test_rank_error_comes_back_as_note(launched: list[subprocess.Popen[bytes]]) -> None:
    _skip_unless("mpi")
    # MPI has no bfloat16 datatype: the ranks fail, abort, and the row says so.
    rows = run_mpi(2, [4096], dtype="bfloat16", warmup=0, iters=1, timeout_s=60)
    (row,) = rows
    assert not row.ran
    assert row.note.startswith("failed: mpi with 2 workers: mpirun exited with code")
