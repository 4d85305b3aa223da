"""`semfab bench allreduce`: nccl-tests habits.

The header comes before any row, rows are printed as each size finishes, a
failed row fails the run (footer, exit code, JSON), nccl's dtype and op names
are accepted and its meaningless flags refused, --repeat gives medians and
spread, peer rows say their traffic is not shaped. Most tests drive the bench
with a stand-in fabric (no processes); one launches a real fabric of 2 workers.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from bench import allreduce
from bench.report import AllreduceRow
from fabric.cli import main
from fabric.core.topology import Topology
from fabric.emulation.launcher import TaskFailed

ROW = re.compile(r"^\s+\d+\s+\d+\s+\w+\s+\w+\s+[\w-]+\s+\d+\s")
TINY = ["bench", "allreduce", "--workers", "2", "-b", "4K", "-e", "16K", "--paths",
        "ina,host-ring", "-w", "0", "-n", "2"]


def _rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ROW.match(ln)]


class FakeFabric:
    """Stands in for a launched fabric: answers each per-size task with made-up times,
    and records what had been printed when each task started."""

    def __init__(self, topo: Topology, capsys: pytest.CaptureFixture[str],
                 wrong: dict[int, int] | None = None, fail_call: int | None = None,
                 times: list[float] | None = None) -> None:
        self.topo = topo
        self.capsys = capsys
        self.wrong = wrong or {}
        self.fail_call = fail_call
        self.times = times
        self.out: list[str] = []
        self.calls: list[tuple[str, list[int], str]] = []

    def __enter__(self) -> FakeFabric:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def printed(self) -> str:
        self.out.append(self.capsys.readouterr().out)
        return "".join(self.out)

    def run(self, fn: Any, path: str, sizes: list[int], dtype: str, op: str, warmup: int,
            iters: int, check: bool, seed: int, **kw: Any) -> list[list[dict[str, Any]]]:
        assert fn is allreduce.measure_on_worker
        self.calls.append((path, list(sizes), self.printed()))
        if self.fail_call is not None and len(self.calls) == self.fail_call:
            raise TaskFailed("measure_on_worker failed on w1: FabricTimeout: switch sw0 "
                             "did not answer", {})
        t = self.times[(len(self.calls) - 1) % len(self.times)] if self.times else 10.0
        return [[{"size": s, "times_us": [t] * iters, "wrong": self.wrong.get(s, 0),
                  "chunks": 1, "copies": 1.0, "encodes": 0.0, "crossings": 2.0, "hops": 2.0,
                  "fallbacks": []} for s in sizes] for _ in self.topo.workers]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
         ) -> dict[str, Any]:
    """Replace launch() by a FakeFabric factory; the dict configures and collects them."""
    state: dict[str, Any] = {"fabrics": [], "kw": {}}

    def launch(topology: Topology, **kw: Any) -> FakeFabric:
        fab = FakeFabric(topology, capsys, **state["kw"])
        state["fabrics"].append(fab)
        state["launch_kw"] = kw
        return fab

    monkeypatch.setattr("fabric.emulation.launcher.launch", launch)
    monkeypatch.setattr(allreduce, "_cores", lambda: 64)  # no oversubscription warning
    return state


def _output(fake: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    rest = capsys.readouterr().out
    earlier = "".join("".join(f.out) for f in fake["fabrics"])
    return earlier + rest


# --------------------------------------------------------------------------
# names and refusals (nothing runs)
# --------------------------------------------------------------------------


def test_nccl_dtype_and_op_names_map_to_ours() -> None:
    assert allreduce.parse_dtypes("float") == ["float32"]
    assert allreduce.parse_dtypes("half") == ["float16"]
    assert allreduce.parse_dtypes("bf16") == ["bfloat16"]
    assert allreduce.parse_dtypes("int") == ["int32"]
    assert allreduce.parse_dtypes("int64") == ["int64"]
    assert allreduce.parse_dtypes("float32,bf16,float") == ["float32", "bfloat16"]
    assert allreduce.parse_dtypes("all") == ["float32", "float16", "bfloat16", "int32", "int64"]
    assert allreduce.parse_ops("all") == ["sum", "max", "min"]
    assert allreduce.parse_ops("max") == ["max"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["-o", "prod"], ["--op prod: not supported", "sum, max and min"]),
        (["-o", "avg"], ["--op avg: not supported"]),
        (["-o", "xor"], ["--op 'xor'", "sum, max or min"]),
        (["-d", "double"], ["--dtype double: not supported", "float32 (nccl: float)"]),
        (["-d", "int8"], ["--dtype int8: not supported"]),
        (["-d", "float8"], ["--dtype 'float8': unknown"]),
        (["-g", "2"], ["-g/--ngpus 2", "worker process", "--workers"]),
        (["--ngpus", "1"], ["-g/--ngpus 1", "--workers"]),
        (["-t", "4"], ["-t/--nthreads 4", "not threads", "--workers"]),
        (["--repeat", "0"], ["--repeat 0"]),
        (["--sim", "--repeat", "2"], ["--repeat with --sim", "deterministic"]),
        (["--sim", "-g", "2"], ["-g/--ngpus"]),
        (["--sim", "--paths", "ina,mpi"], ["--sim runs the fabric's paths only", "mpi"]),
        (["--sim", "--trace", "t.json"], ["--trace", "drop --sim"]),
        (["--faults", "loss=2"], ["--faults"]),
    ],
)
def test_refused_with_one_sentence(flags: list[str], words: list[str],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, *flags]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("semfab: error: ") and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err
    assert captured.out == ""  # refused before any header or process


# --------------------------------------------------------------------------
# with a stand-in fabric
# --------------------------------------------------------------------------


def test_header_first_then_rows_as_each_size_finishes(
        fake: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "run.json"
    argv = [*TINY, "-e", "64K", "-d", "float", "--seed", "7", "--json", str(out_json)]
    assert main(argv) == 0
    (fab,) = fake["fabrics"]
    # one task per size and path, each started after the previous size's row was printed
    assert [(p, s) for p, s, _ in fab.calls] == [
        (p, [s]) for p in ("ina", "host-ring") for s in (4096, 16384, 65536)]
    for i, (_p, _s, printed) in enumerate(fab.calls):
        assert len(_rows(printed)) == i, printed
        head = printed.split("\n#        size")[0]
        for word in ("minBytes 4096 maxBytes 65536", "dtype: float32", "redop: sum",
                     "warmup iters: 0", "iters: 2", "seed: 7", "workers: 2",
                     "paths: ina, host-ring", "topology: a star", "links: unshaped",
                     "faults: none"):
            assert word in head, (word, head)
    text = _output(fake, capsys)
    rows = _rows(text)
    assert len(rows) == 6 and rows[0].split()[:6] == ["4096", "1024", "float32", "sum", "ina",
                                                     "2"]
    assert text.index("# minBytes") < text.index(rows[0])
    # then the side-by-side table and the footer
    side = text.index("# 2 workers, float32 sum: busbw and time per path")
    assert side > text.index(rows[-1])
    assert "# Out of bounds values : OK" in text and "# Avg bus bandwidth    : " in text
    assert f"# wrote {out_json}" in text
    doc = json.loads(out_json.read_text())
    assert doc["failed"] == 0 and doc["ok"] is True
    assert all(r["ok"] for r in doc["results"]) and len(doc["results"]) == 6
    s = doc["settings"]
    for key, value in (("warmup", 0), ("iters", 2), ("seed", 7), ("workers", [2]),
                       ("paths", ["ina", "host-ring"]), ("sizes", [4096, 16384, 65536]),
                       ("dtypes", ["float32"]), ("ops", ["sum"]), ("link_gbps", 0.0),
                       ("link_latency_us", 0.0), ("faults", None), ("topology", None),
                       ("repeat", 1)):
        assert s[key] == value, key
    assert s["command"].endswith("semfab bench allreduce -b 4096 -e 65536 -f 4 --workers 2 "
                                 "--paths ina,host-ring -d float32 -o sum -w 0 -n 2 -c 1 --seed 7")
    # the transport knobs in the environment are part of the run: recorded, repeated
    from bench.sweep import TUNING_ENV, command_line

    assert s["env"] == {k: v for k, v in os.environ.items() if k in TUNING_ENV}
    again = command_line({**s, "env": {"SEMFAB_DOORBELLS": "0"}})
    assert again.startswith("SEMFAB_DOORBELLS=0 semfab bench allreduce -b 4096")


def test_a_wrong_row_fails_the_run(fake: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                   tmp_path: Path) -> None:
    fake["kw"] = {"wrong": {16384: 5}}
    out_json = tmp_path / "bad.json"
    assert main([*TINY, "--json", str(out_json)]) == 1
    text = _output(fake, capsys)
    assert "# Out of bounds values : FAILED" in text
    assert "# FAILED: ina x2 16K float32 sum: 10 wrong elements" in text
    assert "FAILED: wrong elements" in next(r for r in _rows(text) if r.split()[0] == "16384")
    doc = json.loads(out_json.read_text())
    assert doc["failed"] == 2 and doc["ok"] is False  # ina and host-ring at 16K
    bad = [r for r in doc["results"] if not r["ok"]]
    assert {(r["path"], r["size_bytes"]) for r in bad} == {("ina", 16384), ("host-ring", 16384)}
    assert all(r["status"] == "failed" for r in bad)


def test_a_task_that_raises_is_a_failed_row(fake: dict[str, Any],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    fake["kw"] = {"fail_call": 2}
    assert main(TINY) == 1
    text = _output(fake, capsys)
    rows = _rows(text)
    assert len(rows) == 4  # every size and path still has its row
    assert "failed: measure_on_worker failed on w1" in rows[1]
    # the fabric is not trusted after a failure: the rest say so instead of hanging
    assert all("not run: the fabric of 2 workers failed earlier" in r for r in rows[2:])
    assert "# 4 rows" in text and "1 ok, 3 failed" in text
    assert len(fake["fabrics"][0].calls) == 2


def test_nccl_all_dtypes_and_ops(fake: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                 tmp_path: Path) -> None:
    out_json = tmp_path / "all.json"
    assert main([*TINY, "-e", "4K", "--paths", "ina", "-d", "all", "-o", "all",
                 "--json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    got = {(r["dtype"], r["redop"]) for r in doc["results"]}
    assert got == {(d, o) for d in ("float32", "float16", "bfloat16", "int32", "int64")
                   for o in ("sum", "max", "min")}
    assert doc["settings"]["command"].count("-d all") == 1
    assert "-o all" in doc["settings"]["command"]
    text = _output(fake, capsys)
    assert "# 2 workers, bfloat16 max: busbw and time per path" in text


def test_peers_say_their_traffic_is_not_shaped(fake: dict[str, Any],
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def peer(name: str, workers: int, sizes: list[int], args: Any, dtype: str | None = None,
             op: str | None = None) -> list[AllreduceRow]:
        return [AllreduceRow.from_samples(name, workers, s, dtype or "float32", op or "sum",
                                          [50.0], 0) for s in sizes]

    monkeypatch.setattr(allreduce, "_run_peer", peer)
    assert main([*TINY, "--paths", "ina,gloo,mpi", "--link-gbps", "0.5"]) == 0
    text = _output(fake, capsys)
    assert "# links: every link of the star: 0.5 Gbit/s" in text
    assert "# note: gloo, mpi traffic is not shaped by the emulator" in text
    peer_rows = [r for r in _rows(text) if r.split()[4] in ("gloo", "mpi")]
    assert len(peer_rows) == 4
    assert all("not shaped: peer traffic uses this host's own transports" in r
               for r in peer_rows)
    ina_rows = [r for r in _rows(text) if r.split()[4] == "ina"]
    # 4 KiB in 10 us is 3.3 Gbit/s of busbw on a 0.5 Gbit/s link: explained, not hidden
    assert all("busbw above the 0.5 Gbit/s link" in r for r in ina_rows)
    assert "gloo*" in text and "# * gloo, mpi: traffic not shaped by the emulator" in text
    assert fake["launch_kw"].get("faults") is None


def test_unshaped_links_no_peer_note(fake: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allreduce, "_run_peer", lambda name, w, sizes, args, d=None, o=None: [
        AllreduceRow.from_samples(name, w, s, "float32", "sum", [50.0], 0) for s in sizes])
    assert main([*TINY, "--paths", "ina,gloo"]) == 0
    assert "not shaped" not in _output(fake, capsys)


def test_repeat_median_and_spread(fake: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                  tmp_path: Path) -> None:
    # ina 4K gets 10, 40, 20 us in the three runs (the calls cycle through the times)
    fake["kw"] = {"times": [10.0, 99.0, 99.0, 99.0, 40.0, 99.0, 99.0, 99.0, 20.0]}
    out_json = tmp_path / "rep.json"
    assert main([*TINY, "--repeat", "3", "--json", str(out_json)]) == 0
    text = _output(fake, capsys)
    assert "# run 2 of 3, 2 workers" in text and "repeat: 3" in text
    assert len(_rows(text)) == 12
    assert "time: median over runs, spread min..max" in text
    assert "10.00..40.00" in text
    doc = json.loads(out_json.read_text())
    ina4k = next(r for r in doc["results"] if r["path"] == "ina" and r["size_bytes"] == 4096)
    assert ina4k["runs"] == 3 and ina4k["time_us"] == 20.0
    assert (ina4k["time_min_us"], ina4k["time_max_us"]) == (10.0, 40.0)
    assert len(doc["per_run"]) == 3 and doc["settings"]["repeat"] == 3
    assert "--repeat 3" in doc["settings"]["command"]


def test_warnings_oversubscribed_and_too_few_samples(
        fake: dict[str, Any], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allreduce, "_cores", lambda: 2)
    assert main(TINY) == 0
    text = _output(fake, capsys)
    assert ("# warning: oversubscribed: 2 workers + 1 switch + 1 host = 4 busy processes "
            "on 2 cores") in text
    assert "# warning: p99 rests on 2 samples per row (fewer than 100)" in text
    monkeypatch.setattr(allreduce, "_cores", lambda: 8)
    fake["fabrics"].clear()
    assert main([*TINY, "-n", "50", "--repeat", "2"]) == 0
    text = _output(fake, capsys)
    assert "oversubscribed" not in text and "p99 rests on" not in text  # 100 samples


def test_faults_reach_the_fabric_and_the_header(fake: dict[str, Any],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "-e", "4K", "--faults", "loss=0.01", "--seed", "3"]) == 0
    assert fake["launch_kw"]["faults"] == "loss=0.01" and fake["launch_kw"]["seed"] == 3
    assert "# faults: loss=0.01" in _output(fake, capsys)


# --------------------------------------------------------------------------
# the simulator behind --sim, and one real fabric
# --------------------------------------------------------------------------


def test_sim_gives_the_same_table_and_files(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # --sim: the emulated bench's header, rows, halves, side by side and JSON, in
    # virtual time (every dtype and op in one file, as in emulation)
    out_json = tmp_path / "sim.json"
    argv = ["bench", "allreduce", "--sim", "--workers", "4", "-b", "4K", "-e", "16K",
            "--paths", "ina,ina-mem,host-ring", "-w", "0", "-n", "2", "-d", "bf16,float",
            "-o", "max", "--json", str(out_json)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "# simulated: virtual time (fabric.sim)" in text
    rows = _rows(text)
    assert len(rows) == 2 * 3 * 2 and all("simulated (virtual time)" in r for r in rows)
    assert rows[0].split()[:6] == ["4096", "2048", "bfloat16", "max", "ina", "4"]
    assert "# 4 workers, bfloat16 max: busbw and time per path" in text
    assert "warning: oversubscribed" not in text  # no processes
    doc = json.loads(out_json.read_text())
    assert doc["ok"] and doc["settings"]["sim"] is True and len(doc["results"]) == 12
    for r in doc["results"]:
        assert r["wrong"] == 0 and r["inplace_wrong"] == 0  # both halves, checked
        assert r["inplace_time_us"] > 0 and r["avg_us"] > 0


def test_real_tiny_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    argv = [*TINY, "-d", "float", "--json", str(out_json), "--markdown", str(out_md),
            "--run-dir", str(tmp_path / "runs")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    rows = _rows(text)
    assert [r.split()[:5] for r in rows] == [
        [str(s), str(s // 4), "float32", "sum", p] for p in ("ina", "host-ring")
        for s in (4096, 16384)]
    assert all(r.split()[9] == "0" for r in rows)  # #wrong, checked
    assert text.index("# minBytes 4096 maxBytes 16384") < text.index(rows[0])
    assert "# 2 workers, float32 sum: busbw and time per path" in text
    assert f"# wrote {out_json}" in text and f"# wrote {out_md}" in text
    doc = json.loads(out_json.read_text())
    assert doc["ok"] and doc["failed"] == 0 and len(doc["results"]) == 4
    assert doc["settings"]["iters"] == 2 and doc["settings"]["workers"] == [2]
    # nccl-tests' time: the back-to-back average, beside the barrier-separated p50
    for r in doc["results"]:
        assert r["avg_us"] is not None and r["avg_us"] > 0 and r["time_us"] == r["avg_us"]
        # both halves, each checked: out-of-place into its own buffer, in place (out is x)
        assert r["place"] == "out" and r["inplace_wrong"] == 0
        assert r["inplace_time_us"] and r["inplace_busbw_gbps"]
        assert r["p50_us"] is not None and len(r["samples_us"]) == 2
    assert "# time: as nccl-tests: -n iterations back to back" in text
    md = out_md.read_text()
    assert "# minBytes 4096" in md
    assert re.search(r"\|\s*size\(B\)\s*\|\s*ina busbw\(GB/s\)\s*\|", md), md


def test_real_run_traces_calls_chunks_switch_and_resends(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    # a lossy link: chunks, the switch's aggregation, resends and NACKs all show
    trace = tmp_path / "t.json"
    argv = ["bench", "allreduce", "--workers", "2", "-b", "256K", "-e", "256K", "--paths",
            "ina,ina-mem", "-w", "0", "-n", "3", "--faults", "loss=0.05", "--seed", "4",
            "--trace", str(trace), "--run-dir", str(tmp_path / "runs")]
    assert main(argv) == 0
    assert f"# wrote {trace}" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"w0", "w1", "w0 chunks", "w1 chunks", "sw0 job 1"} <= tracks
    cats = {e.get("cat") for e in events if e["ph"] == "X"}
    assert {"timed", "back-to-back", "chunk", "aggregation"} <= cats
    # one chunk per call at these chunk sizes: 2 workers x 2 halves x (3 timed + 3 back
    # to back) per path at least; every chunk slice ends at its RESULT, after it starts
    chunks = [e for e in events if e.get("cat") == "chunk"]
    assert len(chunks) >= 2 * 2 * (3 + 3) and all(e["dur"] > 0 for e in chunks)
    assert any(e["ph"] == "i" for e in events)  # 5% loss: something was resent or asked
    from fabric.emulation.frametrace import ENV

    assert ENV not in os.environ  # the processes' logging is off again
