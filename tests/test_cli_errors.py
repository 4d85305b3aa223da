"""Bad CLI input gets one line (`semfab: error: ...`) and exit 2, never a traceback;
a launcher leaves no socket folder behind however it ends; a script that
launches at import time is refused instead of fork-bombing."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric.cli import main
from fabric.core.topology import star
from fabric.errors import UsageError, check_seconds
from tests.processes import kill_groups

ROOT = Path(__file__).resolve().parent.parent
STAR4 = str(ROOT / "examples" / "topologies" / "star4.toml")
BENCH = ["bench", "allreduce", "--workers", "1", "--paths", "ina", "-b", "4K", "-e", "4K",
         "-n", "1", "-w", "0"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

GOOD_TOPO = """\
[[node]]
name = "w0"
kind = "worker"
[[node]]
name = "sw0"
kind = "switch"
[[link]]
a = "w0"
b = "sw0"
class = "scaleup"
"""


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


def _files(tmp_path: Path) -> dict[str, str]:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[node]\nname = 1\n")
    invalid = tmp_path / "invalid.toml"
    invalid.write_text('[[node]]\nname = "w0"\nkind = "worker"\n')  # no switch
    plain = tmp_path / "plain-file"
    plain.write_text("x")
    fake_run = tmp_path / "fake-run"
    fake_run.mkdir()
    # a switch nobody serves: without the timeout check, stats would wait on it
    (fake_run / "fabric.json").write_text(json.dumps(
        {"sock_dir": str(tmp_path), "pid": 1,
         "switches": {"sw0": {"address": f"ipc://{tmp_path}/none.sock", "id": 1}}}))
    broken_run = tmp_path / "broken-run"
    broken_run.mkdir()
    (broken_run / "fabric.json").write_text("{not json")
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 3000 + "]" * 3000 + "\n")
    # saved runs for `semfab compare`: a good one, and files a careless user gives it
    row = {"path": "ina", "workers": 2, "size_bytes": 4096, "count": 1024, "dtype": "float32",
           "time_us": 10.0, "busbw_gbps": 0.8}
    runs = {"run_good": row, "run_typo_workers": {**row, "workers": "2"},
            "run_typo_size": {**row, "size_bytes": [4096]},
            "run_typo_bw": {**row, "busbw_gbps": "fast"},
            "run_null_path": {**row, "path": None}, "run_bool_wrong": {**row, "wrong": True}}
    out = {}
    for key, r in runs.items():
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({"kind": "allreduce", "results": [r]}))
        out[key] = str(path)
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"kind": "allreduce", "results": ' + "[" * 100_000 + "]" * 100_000
                         + "}")
    deep_run = tmp_path / "deep-run"
    deep_run.mkdir()
    (deep_run / "fabric.json").write_text("[" * 100_000)
    for key, sw in (("odd_address_run", {"address": "nonsense", "id": 1}),
                    ("odd_id_run", {"address": f"ipc://{tmp_path}/none.sock", "id": 1 << 20})):
        (tmp_path / key).mkdir()
        (tmp_path / key / "fabric.json").write_text(json.dumps(
            {"sock_dir": str(tmp_path), "pid": os.getpid(), "switches": {"sw0": sw}}))
    calibration = tmp_path / "calibration-negative.json"
    calibration.write_text(json.dumps({"timing": {"switch_frame_s": -1e-6, "switch_byte_s": 0,
                                                  "node_frame_s": 0, "node_byte_s": 0}}))
    script = tmp_path / "script.py"
    script.write_text("import os\n\ndef f(ep):\n    return ep.rank\n")
    bad_script = tmp_path / "bad_script.py"
    bad_script.write_text("def f(ep)\n    return 1\n")
    huge_int = tmp_path / "huge-int.json"
    huge_int.write_text('{"kind": "allreduce", "results": [], "x": ' + "9" * 5000 + "}")
    return {**out, "bad": str(bad), "invalid": str(invalid), "under_file": f"{plain}/sub",
            "deep": str(deep), "deep_json": str(deep_json), "huge_int": str(huge_int),
            "deep_run": str(deep_run), "calibration_negative": str(calibration),
            "odd_address_run": str(tmp_path / "odd_address_run"),
            "odd_id_run": str(tmp_path / "odd_id_run"),
            "script": str(script), "bad_script": str(bad_script),
            "fake_run": str(fake_run), "broken_run": str(broken_run),
            "missing": str(tmp_path / "missing.toml"), "tmp": str(tmp_path)}


CASES = [
    (["topo", "gen", "--leaves", "100000", "--per-leaf", "100000", "-o", "/tmp/never.toml"],
     "at most 65535 nodes"),  # hung building ten billion nodes
    (["bench", "allreduce", "--faults", "delay=1e308us", "--workers", "2"],
     "delay_us must be a time in 0..3.6e+09 us"),  # the switch died of an OverflowError
    # found as a careless user would (a traceback each, before)
    (["bench", "moe", "--latency-us", "-5"], "--latency-us -5: must be a number >= 0"),
    (["bench", "moe", "--sim", "--leaves", "1", "--per-leaf", "2", "--json", "/proc/x/y.json"],
     "--json /proc/x/y.json"),
    (["serve", "--step-ms", "nan"], "--step-ms nan: must be a finite number"),
    (["serve", "--batch-ms", "1e300"],
     "--batch-ms 1e+300: must be a finite number > 0 and <= 60000"),
    (["serve", "--prefill-ms", "-1"], "--prefill-ms -1: must be a finite number >= 0"),
    (["topo", "check", "{deep}"], "nested too deeply"),
    # saved runs that are not what compare reads (a traceback each, before)
    (["compare", "{run_good}", "{deep_json}"], "deep.json: JSON nested too deeply"),
    (["compare", "{huge_int}", "{run_good}"], "huge-int.json: not usable JSON"),
    (["compare", "{run_good}", "{run_typo_workers}"], 'workers is "2", not an integer'),
    (["compare", "{run_good}", "{run_typo_size}"], "size_bytes is [4096], not an integer"),
    (["compare", "{run_good}", "{run_typo_bw}"], 'busbw_gbps is "fast", not a number or null'),
    (["compare", "{run_good}", "{run_null_path}"], "path is null, not a string"),
    (["compare", "{run_good}", "{run_bool_wrong}"], "wrong is true, not an integer"),
    # more workers than one machine launches: one limit, one message, however asked
    (["launch", "--topology", "{star70}"], "star70.toml: 70 workers; one machine launches "
                                           "at most 64"),
    (["launch", "--workers", "70"], "--workers: 70 workers; one machine launches at most 64"),
    (["launch", "--workers", "0"], "--workers: 0 workers; give at least 1"),
    (["serve", "--workers", "70"], "--workers: 70 workers; one machine launches at most 64"),
    (["serve", "--workers", "0"], "--workers: 0 workers; give at least 1"),
    (["bench", "tokens", "--workers", "70", "--max-concurrency", "1"],
     "--workers: 70 workers; one machine launches at most 64"),
    ([*BENCH[:2], "--topology", "{star70}"], "star70.toml has 70 workers; this benchmark runs "
                                             "1..8 launched on one machine"),
    # found probing every flag as a careless user would: refused before anything runs
    (["bench", "frames", "--json", "/proc/x/y.json"], "--json /proc/x/y.json: cannot write"),
    (["bench", "frames", "--markdown", "/proc/x/y.md"], "--markdown /proc/x/y.md"),
    (["bench", "core", "--json", "/proc/x/y.json"], "--json /proc/x/y.json: cannot write"),
    (["bench", "wakeup", "--markdown", "/proc/x/y.md"], "--markdown /proc/x/y.md"),
    (["bench", "wakeup", "--period-ms", "inf"], "--period-ms inf: must be a finite number"),
    (["bench", "wakeup", "--work-us", "nan"], "--work-us nan: must be a finite number"),
    (["bench", "loss", "--json", "/proc/x/y.json"], "--json /proc/x/y.json: cannot write"),
    (["bench", "loss", "--run-dir", "/proc/x/y"], "--run-dir /proc/x/y"),
    (["bench", "loss", "--timeout", "0"], "--timeout 0: must be a number of seconds"),
    (["bench", "loss", "--reorder", "0"], "--reorder 0: bad fault spec"),
    (["bench", "moe", "--sim", "--timeout", "0"], "--timeout 0: must be a number of seconds"),
    (["bench", "moe", "--sim", "--cc", "eqds"], "--cc eqds: the receiver grants credit"),
    (["bench", "moe", "--sim", "--trim"], "--trim cuts frames a full buffer has no room for"),
    (["bench", "moe", "--sim", "--pfc", "--buffer", "1M", "--trim"], "never trimmed"),
    (["bench", "moe", "--sim", "--buffer", "1000"], "cannot hold one frame"),
    ([*BENCH, "--cc", "reno"], "--cc reno: unknown policy"),
    ([*BENCH, "--factor", "inf"], "factor must be a finite number > 1, got inf"),
    ([*BENCH, "--check", "2"], "-c/--check: invalid choice: 2"),
    (["sim", "allreduce", "--check", "-1"], "-c/--check: invalid choice: -1"),
    ([*BENCH, "--json", ""], "--json: an empty path"),
    ([*BENCH, "--run-dir", " "], "--run-dir: an empty path"),
    (["serve", "--backend", "bogus"], "unknown backend 'bogus'"),
    (["serve", "--temperature", "nan"], "temperature nan must be in 0..2"),
    (["bench", "tokens", "--backend", "-1"], "unknown backend '-1'"),
    (["bench", "tokens", "--step-ms", "nan"], "--step-ms nan: must be a finite number"),
    (["bench", "tokens", "--random-output-len", "99999"], "at most 4096 output tokens"),
    (["bench", "tokens", "--random-input-len", "99999999999"], "must be 1..32768 tokens"),
    (["launch", "--workers", "1", "--args", "[" * 100_000], "--args: JSON nested too deeply"),
    (["launch", "--workers", "1", "--args", "[1,"], "--args: not JSON"),
    (["run", "--topology", "{good}", "--workload", "x.py:f", "--rank", "0", "--world", "1",
      "--args", "[" * 100_000], "--args: JSON nested too deeply"),
    (["stats", "{deep_run}"], "is not a fabric.json written by `semfab launch`"),
    (["stats", "{odd_address_run}"], "is not a fabric.json written by `semfab launch`"),
    (["stats", "{odd_id_run}"], "is not a fabric.json written by `semfab launch`"),
    (["sim", "allreduce", "--workers", "2", "--calibration", "{deep_json}"],
     "deep.json: JSON nested too deeply"),
    (["sim", "allreduce", "--workers", "2", "--calibration", "{calibration_negative}"],
     "switch_frame_s must be from 0 to 1 s"),
    # sizes no machine holds: refused now, not a MemoryError after the launch
    ([*BENCH[:-8], "-b", "64T", "-e", "64T", "-n", "1", "-w", "0"],
     "--end 64T with 1 workers: needs about"),
    ([*BENCH[:-8], "-b", "64T", "-e", "64T", "--sim"], "more than this machine's"),
    (["bench", "core", "-b", "64T", "-e", "64T"], "--end 64T with 2 workers: needs about"),
    (["bench", "frames", "--sizes", "5G"], "--sizes: a frame carries at most 4294967295"),
    (["bench", "loss", "--size", "64T"], "--size 64T: needs about"),
    (["bench", "moe", "--sim", "--tokens", "1000000000", "--hidden", "1000000"],
     "--tokens 1000000000 x --hidden 1000000: needs about"),
    (["bench", "tokens", "--trace-requests", "-1"], "--trace-requests -1: must be 0 or more"),
    # a task that cannot be found: refused before the fabric starts, not by every worker
    (["launch", "--workers", "1", "--run", "semfab_no_such_module:f"],
     "no module 'semfab_no_such_module' here"),
    (["launch", "--workers", "1", "--run", "{script}:nosuch"], "script.py defines no 'nosuch'"),
    (["launch", "--workers", "1", "--run", "{bad_script}:f"], "bad_script.py line 1: "),
    (["run", "--topology", "{good}", "--workload", "{script}:g", "--rank", "0", "--world", "1"],
     "--workload: {script} defines no 'g'"),
    (["bench", "tokens", "--base-url", "http://[::1"], "--base-url 'http://[::1': Invalid IPv6"),
    (["bench", "tokens", "--base-url", "http://127.0.0.1:99999"], "Port out of range"),
    (["bench", "tokens", "--base-url", "http://:8000"], "give an http:// or https:// URL"),
    (["bench", "tokens", "--request-rate", "1e-300"], "must be at least 0.001 requests per"),
    (["run", "--topology", "{good}", "--workload", "{script}:f", "--rank", "0", "--world", "1",
      "--rendezvous", "[::1"], "--rendezvous '[::1': give HOST:PORT"),
    (["run", "--topology", "{good}", "--workload", "{script}:f", "--rank", "0", "--world", "1",
      "--rendezvous", "127.0.0.1:29400", "--sock-dir", "/proc/x"], "--sock-dir /proc/x"),
    # unwritable outputs, refused before any process starts
    (["launch", "--workers", "1", "--run-dir", "/proc/x/y"], "--run-dir /proc/x/y"),
    (["launch", "--workers", "1", "--run-dir", "{under_file}"], "--run-dir"),
    ([*BENCH, "--run-dir", "/proc/x/y"], "--run-dir /proc/x/y"),
    ([*BENCH, "--json", "/proc/x/y.json"], "--json /proc/x/y.json"),
    ([*BENCH, "--json", "{under_file}.json"], "--json"),
    ([*BENCH, "--json", "{tmp}"], "is a folder"),
    ([*BENCH, "--markdown", "/proc/x/y.md"], "--markdown"),
    ([*BENCH, "--plot", "/proc/x/y.png"], "--plot"),
    # topology files for the benchmark
    ([*BENCH, "--topology", "{missing}"], "cannot read the file"),
    ([*BENCH, "--topology", "{bad}"], "TOML syntax error"),
    ([*BENCH, "--topology", "{invalid}"], "invalid.toml"),
    ([*BENCH, "--topology", STAR4], "has 4 workers"),
    ([*BENCH, "--link-gbps", "1e-300"], "bandwidth_gbps"),
    ([*BENCH, "--link-latency-us", "1e308"], "latency_us"),
    # switch daemon
    (["switchd", "--topology", STAR4, "--name", "sw0", "--io-threads", "-1"], "--io-threads"),
    (["switchd", "--topology", STAR4, "--name", "sw0", "--io-threads", "0"], "--io-threads"),
    (["switchd", "--topology", STAR4, "--name", "sw0", "--sock-dir", "{tmp}/nope"],
     "--sock-dir"),
    (["switchd", "--topology", STAR4, "--name", "nope"], "'nope' is not in the topology"),
    (["switchd", "--topology", STAR4, "--name", "sw0", "--faults", "loss=1"], "below 1"),
    # node
    (["node", "--topology", "{missing}", "--name", "w0", "--sock-dir", "{tmp}"],
     "cannot read the file"),
    (["node", "--topology", "{bad}", "--name", "w0", "--sock-dir", "{tmp}"], "TOML"),
    (["node", "--topology", STAR4, "--name", "w9", "--sock-dir", "{tmp}"],
     "'w9' is not in the topology"),
    (["node", "--topology", STAR4, "--name", "sw0", "--sock-dir", "{tmp}"], "semfab switchd"),
    (["node", "--topology", STAR4, "--name", "w0", "--sock-dir", "{tmp}/nope"], "--sock-dir"),
    (["node", "--topology", STAR4, "--name", "w0", "--sock-dir", "{tmp}", "--timeout", "0"],
     "--timeout"),
    # timeouts: a positive finite number of seconds
    (["launch", "--workers", "1", "--timeout", "0"], "--timeout 0"),
    (["launch", "--workers", "1", "--timeout", "-5"], "--timeout -5"),
    (["launch", "--workers", "1", "--timeout", "nan"], "--timeout nan"),
    (["launch", "--workers", "1", "--timeout", "inf"], "--timeout inf"),
    (["launch", "--workers", "1", "--timeout", "1e-9"], "--timeout 1e-09: must be a number of "
                                                        "seconds from 0.001 to 1000000"),
    (["launch", "--workers", "1", "--duration", "1e-9"], "--duration 1e-09: must be 0 or"),
    (["stats", "{fake_run}", "--timeout", "0.0001"], "--timeout 0.0001"),
    (["run", "--topology", "{good}", "--workload", "x.py:f", "--rank", "0", "--world", "1",
      "--join-timeout", "1e-5"], "--join-timeout 1e-05"),
    (["node", "--topology", STAR4, "--name", "w0", "--sock-dir", "{tmp}", "--timeout", "1e-4"],
     "--timeout 0.0001"),
    (["launch", "--workers", "1", "--duration", "-1"], "--duration"),
    ([*BENCH, "--timeout", "0"], "--timeout"),
    (["stats", "{fake_run}", "--timeout", "-1"], "--timeout -1"),
    (["stats", "{fake_run}", "--timeout", "nan"], "--timeout nan"),
    (["stats", "{fake_run}", "--timeout", "0"], "--timeout 0"),
    (["stats", "{broken_run}"], "not a fabric.json"),
    # a link that drops everything can never deliver
    (["launch", "--workers", "1", "--faults", "loss=1"], "loss must be below 1"),
    (["launch", "--workers", "1", "--faults", "loss=100%"], "loss must be below 1"),
    (["launch", "--workers", "1", "--faults", "ge=0.1:0.5:1:1"], "loses every frame"),
    # topology checks with absurd values
    (["topo", "check", "{absurd_bw_low}"], "between 1e-06 and 1e+06 Gbit/s"),
    (["topo", "check", "{absurd_bw_high}"], "between 1e-06 and 1e+06 Gbit/s"),
    (["topo", "check", "{absurd_latency}"], "at most 10 s"),
    (["topo", "check", "{absurd_name}"], "at most 64"),
    # a placed token benchmark: its flags are checked on every rank before joining
    (["run", "--topology", "{hosted}", "--bench-tokens", "--bogus 1", "--rank", "0",
      "--world", "1"], "--bench-tokens: unknown flag(s) --bogus 1"),
    (["run", "--topology", "{good}", "--bench-tokens", "", "--rank", "0", "--world", "1"],
     "needs a host node named host0"),
    (["run", "--topology", "{hosted}", "--bench-tokens", "--transport host-staged",
      "--rank", "0", "--world", "1"], "needs a second host node host1"),
    (["run", "--topology", "{hosted}", "--bench-tokens", "--workers 2", "--rank", "0",
      "--world", "1"], "the topology has 1 workers"),
    (["run", "--topology", "{hosted}", "--bench-tokens", "", "--serve-port", "0",
      "--rank", "0", "--world", "1"], "--serve-port 0"),
]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    out = _files(tmp_path)
    for key, text in {
        "absurd_bw_low": GOOD_TOPO + "bandwidth_gbps = 1e-300\n",
        "absurd_bw_high": GOOD_TOPO + "bandwidth_gbps = 1e300\n",
        "absurd_latency": GOOD_TOPO + "latency_us = 1e308\n",
        "absurd_name": GOOD_TOPO.replace('"w0"', '"' + "w" * 300 + '"'),
        "good": GOOD_TOPO,
        "star70": star(70).to_toml(),
        "hosted": star(1, hosts=1, transport="tcp").to_toml(),
    }.items():
        path = tmp_path / f"{key}.toml"
        path.write_text(text)
        out[key] = str(path)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "message"), CASES)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, files: dict[str, str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(**files) for a in argv]
    assert main(argv) == 2
    cap = capsys.readouterr()
    line = _one_line_error(cap.err)
    assert line.startswith("semfab: error: "), line
    assert message.format(**files) in line, line


def test_validation_runs_before_anything_is_created(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "runs"
    # a good --run-dir with a bad --json: nothing is launched, no log folder appears
    assert main([*BENCH, "--run-dir", str(run_dir), "--json", "/proc/x/y.json"]) == 2
    assert not run_dir.exists()
    # a writable --json is checked without leaving an empty file behind
    out = tmp_path / "sub" / "r.json"
    assert main([*BENCH, "--json", str(out), "--timeout", "-1"]) == 2
    assert not out.exists()
    capsys.readouterr()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("module", "argv", "prog"), [
    ("switchd", ["--topology", STAR4, "--name", "sw0", "--io-threads", "-1"], "semfab switchd"),
    ("switchd", ["--topology", STAR4, "--name", "sw0", "--sock-dir", "/nonexistent/dir"],
     "semfab switchd"),
    ("fabric.emulation.node",
     ["--topology", "/nonexistent.toml", "--name", "w0", "--sock-dir", "/tmp"], "semfab node"),
    ("fabric.emulation.node", ["--topology", STAR4, "--name", "zz", "--sock-dir", "/tmp"],
     "semfab node"),
])
def test_process_entry_points_give_one_line(module: str, argv: list[str], prog: str) -> None:
    """`python -m switchd` / `python -m fabric.emulation.node`, as srun or mpirun start them."""
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                          text=True, timeout=50, env=ENV, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert _one_line_error(proc.stderr).startswith(f"{prog}: error: ")


@pytest.mark.timeout(60)
def test_stats_with_a_bad_timeout_does_not_hang(files: dict[str, str]) -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fabric", "stats", files["fake_run"],
                           "--timeout", "-1"], capture_output=True, text=True, timeout=50,
                          env=ENV, cwd=ROOT)
    assert proc.returncode == 2
    assert "--timeout" in _one_line_error(proc.stderr)
    assert time.monotonic() - t0 < 30


def test_check_seconds() -> None:
    assert check_seconds("--timeout", 0.5) == 0.5
    assert check_seconds("--duration", 0, allow_zero=True) == 0
    assert check_seconds("--timeout", 0.001) == 0.001
    for bad in (0, -5, math.nan, math.inf, -math.inf, 1e7, True, 1e-9, 0.0009, "30"):
        with pytest.raises(UsageError, match="--timeout"):
            check_seconds("--timeout", bad)


def test_launch_refuses_a_zero_timeout_before_starting() -> None:
    from fabric.emulation.launcher import launch

    for bad in (0, -1, math.nan):
        with pytest.raises(UsageError, match="timeout_s"):
            launch(workers=1, timeout_s=bad)


def test_launch_refuses_too_many_workers_before_starting(tmp_path: Path) -> None:
    from fabric.emulation.launcher import MAX_WORKERS, launch

    for kw in ({"workers": MAX_WORKERS + 1}, {"topology": star(MAX_WORKERS + 1)}):
        with pytest.raises(UsageError, match=f"at most {MAX_WORKERS}"):
            launch(**kw, run_dir=tmp_path / "run")  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_launch_inside_a_node_is_refused(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    from fabric.emulation.launcher import NODE_ENV, launch

    monkeypatch.setenv(NODE_ENV, "w0")
    with pytest.raises(UsageError, match='if __name__ == "__main__":'):
        launch(workers=1, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything is created


# ------------------------------------------------------------ multi-process
@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; their process groups are killed at teardown."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    kill_groups(procs)


def _start_script(spawned: list[subprocess.Popen[str]], tmp_path: Path, body: str,
                  args: list[str] | None = None) -> subprocess.Popen[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    proc = subprocess.Popen([sys.executable, str(script), *(args or [])], cwd=tmp_path,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    spawned.append(proc)
    return proc


def _wait_for(path: Path, proc: subprocess.Popen[str], limit: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while not path.exists():
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"exited {proc.returncode}: {err}")
        assert time.monotonic() < deadline, "fabric did not come up"
        time.sleep(0.1)
    time.sleep(0.1)  # the file is written in one call, but let it land
    return json.loads(path.read_text())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped by its (dead) parent counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _all_gone(pids: list[int], limit: float = 15.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


LIBRARY_LAUNCHER = """\
    import json, sys, time
    from fabric.emulation.launcher import launch

    fab = launch(workers=1, run_dir="run", timeout_s=20)
    info = {"sock_dir": str(fab.sock_dir), "pids": [p.popen.pid for p in fab.procs.values()]}
    with open("info.json.tmp", "w") as f:
        json.dump(info, f)
    import os
    os.replace("info.json.tmp", "info.json")
    if sys.argv[1] == "exit":
        sys.exit(0)  # no close(): the fabric is closed at interpreter exit
    time.sleep(60)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_library_launcher_cleans_up(how: str, tmp_path: Path,
                                    spawned: list[subprocess.Popen[str]]) -> None:
    proc = _start_script(spawned, tmp_path, LIBRARY_LAUNCHER, [how])
    info = _wait_for(tmp_path / "info.json", proc)
    sock_dir = Path(info["sock_dir"])
    if how == "sigterm":
        assert sock_dir.is_dir()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM  # still dies of the signal
    else:
        assert proc.wait(30) == 0
    assert not sock_dir.exists()
    assert _all_gone([int(p) for p in info["pids"]])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_launcher_cleans_up_on_signals(sig: int, tmp_path: Path,
                                           spawned: list[subprocess.Popen[str]]) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", "launch", "--workers", "1", "--run-dir", str(run_dir),
         "--duration", "60"], env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    spawned.append(proc)
    info = _wait_for(run_dir / "fabric.json", proc)
    sock_dir = Path(info["sock_dir"])
    assert sock_dir.is_dir()
    proc.send_signal(sig)
    assert proc.wait(30) == 130
    assert not sock_dir.exists()


GUARDLESS = """\
    from fabric.emulation.launcher import launch

    def work(ep):
        return ep.rank

    # no `if __name__ == "__main__":` guard: every worker that imports this
    # file to find work() would start a fabric of its own
    with launch(workers=1, run_dir="run", timeout_s=20) as fab:
        print(fab.run(work))
"""


@pytest.mark.timeout(120)
def test_a_script_without_main_guard_is_refused(tmp_path: Path,
                                                spawned: list[subprocess.Popen[str]]) -> None:
    proc = _start_script(spawned, tmp_path, GUARDLESS)
    _out, err = proc.communicate(timeout=100)
    assert proc.returncode != 0
    assert 'put the launch() call under `if __name__ == "__main__":`' in err
    # one fabric only: the worker refused to start a second one
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "fabric.json", "host0.log", "sw0.log", "topology.toml", "w0.log"]


def test_stale_socket_folders_of_dead_launchers_are_swept(tmp_path: Path) -> None:
    from fabric.emulation.launcher import _sweep_stale_socket_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    old = time.time() - 3600
    stale = tmp_path / f"semfab-{dead.pid}-abc"
    stale.mkdir()
    (stale / "sw0.sock").touch()
    os.utime(stale, (old, old))
    young = tmp_path / f"semfab-{dead.pid}-young"  # may be a launcher binding right now
    young.mkdir()
    alive = tmp_path / f"semfab-{os.getpid()}-xyz"
    alive.mkdir()
    os.utime(alive, (old, old))
    # a dead pid whose socket still answers: a launcher in another pid namespace
    answering = tmp_path / f"semfab-{dead.pid}-ns"
    answering.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(answering / "ctl.sock"))
    listener.listen(1)
    try:
        removed = _sweep_stale_socket_dirs(tmp_path)
    finally:
        listener.close()
    assert removed == [stale]
    assert not stale.exists() and young.exists() and alive.exists() and answering.exists()


def test_rendezvous_addresses() -> None:
    from fabric.emulation.rendezvous import parse_rendezvous, rendezvous_of

    assert parse_rendezvous("node-a:29400") == ("node-a", 29400)
    assert parse_rendezvous("[fe80::1]:5") == ("fe80::1", 5)
    assert rendezvous_of(None, {"MASTER_ADDR": "::1", "MASTER_PORT": "7"}) == ("::1", 7)
    for bad in ("::1:29400", "[::1", "[::1:29400", "a]:3", "[x]:3", "h:0", "h:65536", "h:"):
        with pytest.raises(UsageError, match="--rendezvous"):
            parse_rendezvous(bad)


def test_a_calibration_file_is_read_back(tmp_path: Path) -> None:
    from fabric.sim.calibrate import load

    costs = {"switch_frame_s": 2e-6, "switch_byte_s": 3e-10, "node_frame_s": 4e-6,
             "node_byte_s": 0.0}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"timing": costs, "measured": []}))
    model = load(str(path))
    assert {k: getattr(model, k) for k in costs} == costs
    for bad in ([], {"timing": []}, {"timing": {**costs, "node_frame_s": "x"}},
                {"timing": {**costs, "node_byte_s": math.inf}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(UsageError, match="--calibration"):
            load(str(path))


def _sim_pool(spawned: list[subprocess.Popen[str]], workers: str) -> tuple[
        subprocess.Popen[str], str]:
    """`semfab sim scale` on a pool of two processes, once its first row is out
    (the pool is up; the next points run)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", "sim", "scale", "--workers", workers, "--paths",
         "ina", "--oversubscription", "1,2", "--jobs", "2"], env=ENV, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    spawned.append(proc)
    assert proc.stdout is not None
    seen = ""
    first = f"\n{workers.split(',')[0]:>8} "
    while first not in seen:
        line = proc.stdout.readline()
        assert line, seen
        seen += line
    return proc, seen


@pytest.mark.timeout(180)
def test_ctrl_c_on_a_simulation_pool_is_one_line(spawned: list[subprocess.Popen[str]]) -> None:
    """Ctrl-C reaches the terminal's whole process group, the pool's processes too:
    the command says `interrupted` once, with no traceback from any of them."""
    proc, seen = _sim_pool(spawned, "64,1024")  # interrupted while 1024-worker points run
    os.killpg(proc.pid, signal.SIGINT)
    out = seen + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.strip().splitlines()[-1] == "semfab: interrupted", out


@pytest.mark.timeout(180)
def test_sigterm_to_a_simulation_does_not_wait_for_its_running_points(
        spawned: list[subprocess.Popen[str]]) -> None:
    """SIGTERM (a scheduler, `timeout`) reaches only the command: it ends the pool's
    processes rather than waiting for points that run for minutes (a 4096-worker
    point takes over four here)."""
    proc, seen = _sim_pool(spawned, "64,4096")
    proc.send_signal(signal.SIGTERM)
    out = seen + proc.communicate(timeout=90)[0]  # far below one 4096-worker point
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
