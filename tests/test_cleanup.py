"""What a fabric leaves behind when it ends, cleanly or because a process was
killed, and whom its error blames: the local launcher (`semfab launch`, the
library) and placed runs (`semfab run`, one process per node). Every test kills
only processes it started itself, by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.core.topology import star
from fabric.emulation import leftovers
from fabric.emulation.shm import SHM_DIR
from fabric.emulation.transport import free_tcp_port
from fabric.errors import PeerFailed
from tests.processes import kill_groups

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

WORKLOAD = """\
import os, time
from pathlib import Path

def ok(ep):
    x = ep.alloc(1000, "float32")
    x[:] = ep.rank + 1
    return float(ep.allreduce(x, path="ina-mem")[0])

def park(ep, folder):
    # one allreduce over shared memory (regions and doorbells exist), then the
    # pid for the test and a loop of allreduces that a dead peer stops
    x = ep.alloc(1000, "float32")
    x[:] = 1
    ep.allreduce(x, path="ina-mem")
    Path(folder, f"{ep.name}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ep.allreduce(x, path="ina-mem")
        time.sleep(0.01)
    return 0
"""


def _gone(pid: int) -> bool:
    return leftovers.pid_gone(pid)


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    kill_groups(procs)


def _placed(tmp_path: Path, spawned: list[subprocess.Popen[str]], func: str,
            args: str = "[]") -> tuple[list[subprocess.Popen[str]], int]:
    """sw0, host0, w0 and w1 as four `semfab run` processes on this host, each named
    (so the test knows which PID plays what); rank 0 (host0) coordinates."""
    (tmp_path / "work.py").write_text(WORKLOAD)
    (tmp_path / "s2.toml").write_text(star(2).to_toml())
    port = free_tcp_port()
    names = ["host0", "sw0", "w0", "w1"]
    procs = []
    for rank, name in enumerate(names):
        cmd = [sys.executable, "-m", "fabric", "run", "--topology", "s2.toml", "--workload",
               f"work.py:{func}", "--args", args, "--rendezvous", f"127.0.0.1:{port}",
               "--rank", str(rank), "--world", "4", "--name", name, "--timeout", "5",
               "--join-timeout", "40", *(["--json", "report.json"] if rank == 0 else [])]
        p = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        spawned.append(p)
        procs.append(p)
    return procs, port


def _run_files(run_id: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"semfab-{run_id}-*"))


def _wait_file(path: Path, procs: list[subprocess.Popen[str]], limit: float = 60) -> str:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
    time.sleep(0.05)
    return path.read_text()


@pytest.mark.timeout(120)
def test_a_placed_run_leaves_no_socket_folder_nor_shared_memory(
        tmp_path: Path, spawned: list[subprocess.Popen[str]]) -> None:
    procs, port = _placed(tmp_path, spawned, "ok")
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["results"] == {"w0": 3.0, "w1": 3.0}
    assert not Path(f"/tmp/semfab-run-{port}").exists()
    assert _run_files(report["run_id"]) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["w1", "sw0"])
def test_a_placed_rank_killed_is_named_and_its_files_removed(
        victim: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]) -> None:
    procs, port = _placed(tmp_path, spawned, "park", json.dumps([str(tmp_path)]))
    by_name = dict(zip(["host0", "sw0", "w0", "w1"], procs, strict=True))
    pid = int(_wait_file(tmp_path / "w1.pid", procs))
    assert pid == by_name["w1"].pid
    run_ids = {p.name.split("-")[1] for p in SHM_DIR.glob("semfab-p*-w1-*")}
    assert len(run_ids) == 1, run_ids  # this run's regions and doorbells exist
    run_id = run_ids.pop()
    os.kill(by_name[victim].pid, signal.SIGKILL)  # a process this test started
    outs = {name: p.communicate(timeout=100) for name, p in by_name.items()}
    err0 = outs["host0"][1]
    kind = "worker" if victim == "w1" else "switch"
    assert f"{kind} '{victim}' (rank {list(by_name).index(victim)}" in err0, err0
    assert f"died: its process {by_name[victim].pid} is gone" in err0, err0
    assert all(by_name[n].returncode != 0 for n in by_name), outs
    # the survivors removed what the dead one left
    assert _run_files(run_id) == []
    assert not Path(f"/tmp/semfab-run-{port}").exists()


def test_the_last_process_out_removes_the_folder_and_the_dead_ones_traces(
        tmp_path: Path) -> None:
    folder = tmp_path / "socks"
    run_id = f"rA{os.getpid()}"
    dead = subprocess.Popen(["true"])
    dead.wait()
    shm = SHM_DIR / f"semfab-{run_id}-w1-1"
    try:
        # w0 and w2 are this process under two names; w1 died without leaving
        leftovers.arrive(folder, "w0", run_id)
        leftovers.arrive(folder, "w2", run_id)
        (folder / "w1.pid").write_text(f"{dead.pid} {run_id}\n")
        (folder / "w1.sock").touch()
        shm.touch()
        (folder / "sw0.sock").touch()  # a bound ipc socket's file, left by ZeroMQ
        nodes = ["sw0", "w0", "w1", "w2"]
        leftovers.leave(folder, "w0", run_id, nodes, remove_folder=True)
        assert not (folder / "w1.pid").exists() and not (folder / "w1.sock").exists()
        assert shm.exists()  # w2 of the run still lives here
        assert sorted(p.name for p in folder.iterdir()) == ["sw0.sock", "w2.pid"]
        leftovers.leave(folder, "w2", run_id, nodes, remove_folder=True)
        assert not shm.exists()
        assert not folder.exists()  # the last one out
        # a folder the user gave is kept, emptied of the run's traces
        leftovers.arrive(folder, "w0", run_id)
        (folder / "keep.txt").touch()
        leftovers.leave(folder, "w0", run_id, nodes, remove_folder=False)
        assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]
    finally:
        shm.unlink(missing_ok=True)


def test_a_new_run_sweeps_what_a_killed_one_left(tmp_path: Path) -> None:
    folder = tmp_path / "socks"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    run_id = f"rK{os.getpid()}"
    (folder / "sw0.pid").write_text(f"{dead.pid} {run_id}\n")
    (folder / "sw0.sock").touch()
    shm = SHM_DIR / f"semfab-{run_id}-w0-1"
    shm.touch()
    # the temporary folder of a coordinator killed here (semfab run --bench-tokens)
    driver_dir = Path(tempfile.mkdtemp(prefix=f"semfab-{run_id}-"))
    (driver_dir / "fabric.json").write_text("{}")
    try:
        leftovers.arrive(folder, "w0", "rNew")
        assert not shm.exists() and not (folder / "sw0.sock").exists()
        assert not driver_dir.exists()
        assert sorted(p.name for p in folder.iterdir()) == ["w0.pid"]
    finally:
        shm.unlink(missing_ok=True)


# ------------------------------------------------------------ the local launcher
TASKS = """\
import os, time

def loop(ep):
    x = ep.alloc(1000, "float32")
    x[:] = 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ep.allreduce(x, path="ina")
        time.sleep(0.01)
    return 0

def answer_then_fail(ep):
    if ep.rank == 1:
        return os.getpid()
    time.sleep(1.0)
    raise RuntimeError("w0 gave up")

def noop(ep):
    return 0
"""


@pytest.fixture
def tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    (tmp_path / "cleanup_tasks.py").write_text(textwrap.dedent(TASKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{ROOT}")
    import importlib

    return importlib.import_module("cleanup_tasks")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("victim", "kind"), [("w1", "worker"), ("sw0", "switch")])
def test_the_launcher_names_the_process_killed(victim: str, kind: str, tmp_path: Path,
                                               tasks: object) -> None:
    from fabric.emulation.launcher import launch

    with launch(workers=2, timeout_s=5, run_dir=tmp_path / "run") as fab:
        task = fab.submit(tasks.loop)  # type: ignore[attr-defined]
        time.sleep(1.0)
        os.kill(fab.procs[victim].popen.pid, signal.SIGKILL)  # our own child
        with pytest.raises(PeerFailed, match=f"{kind} '{victim}' was killed by SIGKILL "
                                             "while running loop"):
            fab.wait(task, timeout_s=60)


@pytest.mark.timeout(120)
def test_a_dead_process_is_blamed_before_the_errors_that_follow(tmp_path: Path,
                                                                tasks: object) -> None:
    """Every node has answered (w0 with an error) when w1 is found dead: the
    death is named first, w0's error after it."""
    from fabric.emulation.launcher import launch

    with launch(workers=2, timeout_s=5, run_dir=tmp_path / "run") as fab:
        task = fab.submit(tasks.answer_then_fail)  # type: ignore[attr-defined]
        # a second task queued behind it on w0: waiting for it takes in both answers
        fab.wait(fab.submit(tasks.noop, nodes=["w0"]))  # type: ignore[attr-defined]
        victim = fab.procs["w1"].popen
        os.kill(victim.pid, signal.SIGKILL)  # our own child
        victim.wait(10)
        with pytest.raises(PeerFailed) as err:
            fab.wait(task, timeout_s=60)
    text = str(err.value)
    assert text.startswith("worker 'w1' was killed by SIGKILL while running "
                           "answer_then_fail (w0 then failed: RuntimeError: w0 gave up"), text


@pytest.mark.timeout(120)
def test_a_launcher_killed_outright_leaves_a_folder_the_next_one_removes(
        tmp_path: Path, spawned: list[subprocess.Popen[str]]) -> None:
    from fabric.emulation.launcher import _sweep_stale_socket_dirs

    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent("""\
        import json, os, time
        from fabric.emulation.launcher import launch

        fab = launch(workers=1, run_dir="run", timeout_s=20)
        info = {"sock_dir": str(fab.sock_dir),
                "pids": [p.popen.pid for p in fab.procs.values()]}
        with open("info.tmp", "w") as f:
            json.dump(info, f)
        os.replace("info.tmp", "info.json")
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    spawned.append(proc)
    info = json.loads(_wait_file(tmp_path / "info.json", [proc]))
    sock_dir = Path(info["sock_dir"])
    proc.send_signal(signal.SIGKILL)  # no handler runs: the folder stays
    proc.wait(30)
    deadline = time.monotonic() + 30  # its nodes notice the launcher is gone and exit
    while not all(_gone(p) for p in info["pids"]):
        assert time.monotonic() < deadline, "the nodes outlived their launcher"
        time.sleep(0.2)
    assert sock_dir.is_dir()
    assert sock_dir in _sweep_stale_socket_dirs()  # what the next launch() does first
    assert not sock_dir.exists()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_semfab_serve_ended_by_a_signal_leaves_nothing(
        sig: int, tmp_path: Path, spawned: list[subprocess.Popen[str]]) -> None:
    """SIGTERM (a scheduler, `kill`) or SIGHUP (the terminal closed) to the
    command alone: its fabric's processes, socket folder and shared memory go."""
    run_dir = tmp_path / "run"
    env = {**ENV, "SEMFAB_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", "serve", "--backend", "numpy", "--run-dir",
         str(run_dir)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    spawned.append(proc)
    assert proc.stdout is not None
    seen = ""
    while "base URL:" not in seen:
        line = proc.stdout.readline()
        assert line, seen
        seen += line
    info = json.loads((run_dir / "fabric.json").read_text())
    sock_dir = Path(info["sock_dir"])
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pids = [int(ln.split()[0]) for ln in ps.splitlines() if str(run_dir) in ln]
    assert sock_dir.is_dir() and pids
    shm_prefix = f"semfab-{proc.pid:x}"
    assert list(SHM_DIR.glob(shm_prefix + "*"))  # the token ring and doorbells
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert not sock_dir.exists()
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, "nodes outlived their launcher"
        time.sleep(0.2)
    assert not list(SHM_DIR.glob(shm_prefix + "*"))
