"""`semfab bench <collective>`: the collective set, nccl-tests style.

The arithmetic (nccl-tests' counts, sizes and busbw factors) and the refusals
run no process; a stand-in fabric drives a failed row and --repeat; each
subcommand runs once for real on a fabric of 2 workers at one tiny size; one
run has the peers (skipped, with the reason, where they are not installed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench import collectives, nccl, peers
from bench.report import busbw_factor
from fabric.cli import main
from fabric.core.topology import Topology

ROW = re.compile(r"^\s+\d+\s+\d+\s+\w+\s+\w+\s+")
TINY = ["--workers", "2", "-b", "4K", "-e", "4K", "-w", "0", "-n", "1"]


def _rows(text: str) -> list[list[str]]:
    return [ln.split() for ln in text.splitlines() if ROW.match(ln)]


# --------------------------------------------------------------------------
# arithmetic (nothing runs)
# --------------------------------------------------------------------------


def test_busbw_factors_of_nccl_tests() -> None:
    for n in (1, 2, 3, 4, 8):
        for kind in ("all_gather", "reduce_scatter", "alltoall"):
            assert busbw_factor(kind, n) == pytest.approx((n - 1) / n)
        for kind in ("broadcast", "reduce", "sendrecv"):
            assert busbw_factor(kind, n) == 1.0
    assert busbw_factor("allreduce", 4) == 1.5  # unchanged


def test_sizes_and_counts_as_nccl_tests_prints_them() -> None:
    # all_gather of 64 KiB float32 over 4 ranks: 4096 elements per rank, size the whole buffer
    assert nccl.per_rank_count("all_gather", 65536, 4, 4) == 4096
    assert nccl.row_size("all_gather", 4096, 4, 4) == 65536
    # a part is rounded down to 16 bytes: 4 KiB over 3 ranks is 340 floats each
    assert nccl.per_rank_count("reduce_scatter", 4096, 4, 3) == 340
    assert nccl.row_size("reduce_scatter", 340, 4, 3) == 4080
    assert nccl.per_rank_count("alltoall", 4096, 8, 4) == 128
    for kind in ("broadcast", "reduce", "sendrecv"):
        assert nccl.per_rank_count(kind, 4096, 2, 4) == 2048
        assert nccl.row_size(kind, 2048, 2, 4) == 4096
    assert nccl.buffer_counts("reduce", 10, 4, rank=1, root=0) == (10, 0)
    assert nccl.buffer_counts("reduce_scatter", 10, 4) == (40, 10)


def test_expected_outputs_from_the_inputs() -> None:
    import numpy as np

    W, m = 3, 8
    xs = [nccl.make_collective_input("alltoall", r, 5, m, W, "float32") for r in range(W)]
    assert all(np.all(x != 0) for x in xs)  # never zeros
    for r in range(W):
        want = nccl.expected_output("alltoall", r, 5, m, W, "float32")
        assert want is not None
        assert np.array_equal(want, np.concatenate([x[r * m:(r + 1) * m] for x in xs]))
    rs = nccl.expected_output("reduce_scatter", 2, 1, m, W, "int32", "max")
    ins = [nccl.make_collective_input("reduce_scatter", r, 1, m, W, "int32") for r in range(W)]
    assert rs is not None and np.array_equal(rs, np.max(ins, axis=0)[2 * m:3 * m])
    assert nccl.expected_output("reduce", 1, 0, m, W, "float32", root=0) is None
    sr = nccl.expected_output("sendrecv", 0, 2, m, W, "float32")
    assert sr is not None and np.array_equal(
        sr, nccl.make_collective_input("sendrecv", W - 1, 2, m, W, "float32"))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["all_gather", "-o", "sum"], ["all_gather does not reduce"]),
        (["broadcast", "-r", "2"], ["-r/--root 2", "0..1"]),
        (["sendrecv", "--workers", "1"], ["sendrecv needs at least 2 workers"]),
        (["reduce_scatter", "-o", "prod"], ["--op prod: not supported"]),
        (["alltoall", "--paths", "ina"], ["unknown path(s) ina", "host-p2p, gloo, mpi"]),
        (["all_gather", "-b", "16", "-e", "16"], ["too small", "-b 32"]),
        (["reduce", "-d", "double"], ["--dtype double: not supported"]),
        (["alltoall", "-g", "2"], ["-g/--ngpus 2"]),
        (["sendrecv", "--inplace", "1"], ["--inplace 1: sendrecv has no in-place form"]),
        (["all_gather", "--sim", "--paths", "ina,gloo"], ["--sim runs the fabric's paths"]),
        (["all_gather", "--nope"], ["unrecognized arguments: --nope",
                                    "semfab bench all_gather --help"]),
    ],
)
def test_bad_arguments_one_line_exit_2(argv: list[str], words: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", argv[0], *TINY, *argv[1:]]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("semfab: error: ") and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err
    assert captured.out == ""  # refused before any header or process


def test_mpi_without_bfloat16_reduction_says_so() -> None:
    # no process starts: the row says why (MPI missing here, or no bfloat16 to reduce)
    (row,) = peers.run_peer("mpi", 2, [4096], "bfloat16", warmup=0, iters=1,
                            collective="reduce_scatter")
    assert row.status == "unavailable" and row.note.startswith("unavailable: ")
    assert row.count == 1024 and row.size_bytes == 4096


# --------------------------------------------------------------------------
# with a stand-in fabric: failed rows and --repeat
# --------------------------------------------------------------------------


class FakeFabric:
    """Answers each per-size task with made-up times (and wrong elements at some sizes)."""

    def __init__(self, topo: Topology, wrong: dict[int, int], times: list[float]) -> None:
        self.topo, self.wrong, self.times, self.calls = topo, wrong, times, 0

    def __enter__(self) -> FakeFabric:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(self, fn: Any, kind: str, path: str, size: int, dtype: str, op: str, root: int,
            warmup: int, iters: int, check: bool, seed: int, **kw: Any) -> list[dict[str, Any]]:
        assert fn is collectives.measure_on_worker
        t = self.times[self.calls % len(self.times)]
        self.calls += 1
        w = len(self.topo.workers)
        count = nccl.per_rank_count(kind, size, 4, w)
        return [{"size": nccl.row_size(kind, count, 4, w), "count": count,
                 "times_us": [t] * iters, "wrong": self.wrong.get(size, 0), "fallbacks": [],
                 "counters": None} for _ in range(w)]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"wrong": {}, "times": [10.0]}
    monkeypatch.setattr("fabric.emulation.launcher.launch", lambda topology, **kw: FakeFabric(
        topology, state["wrong"], state["times"]))
    return state


def test_a_wrong_row_fails_the_run_and_is_marked(fake: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fake["wrong"] = {16384: 3}
    out = tmp_path / "bad.json"
    assert main(["bench", "all_gather", *TINY, "-e", "16K", "--paths", "ina,host-ring",
                 "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "# Out of bounds values : FAILED" in text
    assert "# FAILED: ina x2 16K float32 none: 6 wrong elements" in text
    doc = json.loads(out.read_text())
    assert doc["kind"] == "all_gather" and doc["ok"] is False and doc["failed"] == 2
    bad = {(r["path"], r["size_bytes"]) for r in doc["results"] if r["status"] == "failed"}
    assert bad == {("ina", 16384), ("host-ring", 16384)}


def test_repeat_gives_median_and_spread(fake: dict[str, Any], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    fake["times"] = [10.0, 40.0, 20.0]  # one path, one size: run k gets times[k]
    out = tmp_path / "rep.json"
    assert main(["bench", "reduce", *TINY, "--paths", "ina", "--repeat", "3", "-r", "1",
                 "--json", str(out)]) == 0
    assert "10.00..40.00" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    assert (row["runs"], row["time_us"], row["time_min_us"], row["time_max_us"]) == (
        3, 20.0, 10.0, 40.0)
    assert row["root"] == 1 and row["collective"] == "reduce"
    assert row["busbw_gbps"] == pytest.approx(4096 / 20.0 / 1e3)  # factor 1
    assert "-r 1" in doc["settings"]["command"] and "--repeat 3" in doc["settings"]["command"]


# --------------------------------------------------------------------------
# real runs: each subcommand on 2 workers, one tiny size; the peers once
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", collectives.KINDS)
def test_real_tiny_run(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"{kind}.json"
    ours = collectives.our_paths(kind)
    argv = ["bench", kind, *TINY, "--paths", ",".join(ours), "--seed", "3", "--json", str(out),
            "--run-dir", str(tmp_path / "runs")]
    trace = tmp_path / f"{kind}.trace.json"
    argv += ["--trace", str(trace)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.index(f"# semfab bench {kind}") < text.index("#        size")
    assert f"# wrote {out}" in text
    doc = json.loads(out.read_text())
    assert doc["kind"] == kind and doc["ok"] is True and doc["failed"] == 0
    s = doc["settings"]
    for key, value in (("collective", kind), ("workers", [2]), ("sizes", [4096]),
                       ("warmup", 0), ("iters", 1), ("seed", 3), ("paths", list(ours)),
                       ("dtypes", ["float32"]), ("link_gbps", 0.0), ("faults", None)):
        assert s[key] == value, key
    assert s["command"].startswith(f"semfab bench {kind} -b 4096 -e 4096")
    assert [r["path"] for r in doc["results"]] == list(ours)
    split = kind in ("all_gather", "reduce_scatter", "alltoall")
    for r in doc["results"]:
        assert r["status"] == "ok" and r["wrong"] == 0, r
        assert r["size_bytes"] == 4096 and r["count"] == (512 if split else 1024)
        assert r["redop"] == ("sum" if kind in ("reduce", "reduce_scatter") else "none")
        assert r["root"] == (0 if kind in ("broadcast", "reduce") else -1)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * busbw_factor(kind, 2))
        if kind in ("reduce", "reduce_scatter") and r["path"] == "ina":
            assert r["chunks"] and r["hops"] is not None  # the in-network job counts
        else:
            assert r["copies"] is None  # streams keep no counters: none shown
    printed = _rows(text)
    assert [row[4 + (kind in ("broadcast", "reduce"))] for row in printed] == list(ours)
    # a slice per timed iteration and per back-to-back loop, per path, half and node
    halves = 2 if kind in collectives.INPLACE else 1
    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(ours) * halves * 2 * (1 + 1)
    assert f"# wrote {trace}" in text


def test_sim_runs_the_same_collective(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert main(["bench", "reduce_scatter", "--sim", "--workers", "4", "-b", "4K", "-e", "16K",
                 "-w", "0", "-n", "1", "-d", "bf16", "-o", "max", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "# simulated: virtual time" in text and "oversubscribed" not in text
    doc = json.loads(out.read_text())
    assert doc["settings"]["sim"] is True and "--sim" in doc["settings"]["command"]
    assert {r["path"] for r in doc["results"]} == {"ina", "host-p2p", "host-ring"}
    assert all(r["wrong"] == 0 and r["ok"] and "simulated" in r["note"] and
               r["redop"] == "max" for r in doc["results"])


#: (collective, path) whose in-place form gives wrong elements (none: host-p2p's
#: reduce_scatter once summed into ``out`` while ``out`` was its own segment of
#: ``x``; the bench found it).
KNOWN_WRONG_IN_PLACE: set[tuple[str, str]] = set()


@pytest.mark.parametrize("kind", collectives.KINDS)
def test_in_place_halves(kind: str, tmp_path: Path) -> None:
    # nccl-tests' two halves, each checked element by element; "-" (None) for the
    # collectives NCCL has no in-place form of
    out = tmp_path / "ip.json"
    code = main(["bench", kind, "--sim", "--workers", "3", "-b", "4K", "-e", "4K", "-w", "0",
                 "-n", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {r["path"] for r in rows} == set(collectives.our_paths(kind))
    known = []
    for r in rows:
        assert r["place"] == "out" and r["wrong"] == 0, r  # the out-of-place half
        if kind not in collectives.INPLACE:
            assert r["inplace_time_us"] is None and r["inplace_wrong"] == -1
            continue
        assert r["inplace_time_us"] is not None and r["inplace_busbw_gbps"] is not None
        if (kind, r["path"]) in KNOWN_WRONG_IN_PLACE:
            assert r["inplace_wrong"] > 0 and r["status"] == "failed"
            known.append(r["path"])
        else:
            assert r["inplace_wrong"] == 0, r
    assert code == (1 if known else 0)


def test_trace_a_track_per_node_a_slice_per_timed_iteration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    assert main(["bench", "all_gather", "--sim", "--workers", "3", "-b", "4K", "-e", "16K",
                 "-w", "1", "-n", "2", "--paths", "ina,host-ring", "--inplace", "0",
                 "--trace", str(trace)]) == 0
    assert f"# wrote {trace}" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["w0", "w1", "w2"]  # one track per node
    slices = [e for e in events if e["ph"] == "X"]
    timed = [e for e in slices if e["cat"] == "timed"]
    assert len(timed) == 2 * 2 * 3 * 2  # paths x sizes x nodes x -n
    assert len(slices) - len(timed) == 2 * 2 * 3  # one back-to-back loop each
    assert {e["args"]["path"] for e in timed} == {"ina", "host-ring"}
    for e in slices:
        assert e["ts"] >= 0 and e["dur"] > 0 and isinstance(e["pid"], int)
    for key in names:  # the slices of one track follow each other (simulations in a row)
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices
                       if (e["pid"], e["tid"]) == key)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_time_is_the_back_to_back_average(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # nccl-tests' time: -n calls without a barrier between them, total / n; p50 and
    # p99 stay those of the barrier-separated iterations (in virtual time here)
    out = tmp_path / "avg.json"
    assert main(["bench", "all_gather", "--sim", "--workers", "4", "-b", "4K", "-e", "4K",
                 "-w", "0", "-n", "2", "--paths", "host-p2p", "--json", str(out)]) == 0
    assert "back to back (no barrier between them)" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["results"]
    assert row["avg_us"] is not None and row["time_us"] == row["avg_us"]
    assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / row["avg_us"] / 1e3)
    assert row["avg_us"] < row["p50_us"]  # no barrier: the next call starts at once


def test_peers_in_the_same_run_and_compare(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    status = peers.peer_status()
    # one peer keeps the test short: MPI starts in ~6 s here, gloo (importing torch
    # in every rank) in ~16 s; gloo runs only where MPI cannot
    have = [p for p in ("mpi", "gloo") if status[p] is None][:1]
    if not have:
        pytest.skip(f"neither peer can run here: {status}")
    out = tmp_path / "peers.json"
    # the peer alone (the fabric's rows are the tiny runs' above): no fabric to launch
    assert main(["bench", "alltoall", *TINY, "--paths", ",".join(have),
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    by_path = {r["path"]: r for r in doc["results"]}
    for p in have:
        r = by_path[p]
        assert r["status"] == "ok" and r["wrong"] == 0 and r["count"] == 512, r
        assert r["collective"] == "alltoall" and r["copies"] is None
    assert "# 2 workers, float32: busbw and time per path" in text
    # semfab compare reads these files
    assert main(["compare", str(out), str(out)]) == 0
    assert "saved alltoall runs" in capsys.readouterr().out


def test_a_clean_run_removes_its_process_logs_unless_asked(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMFAB_RUN_DIR", str(tmp_path / "runs"))
    base = ["bench", "broadcast", "--workers", "2", "-b", "4K", "-e", "4K", "-w", "0", "-n",
            "1", "--paths", "ina", "--inplace", "0"]
    assert main(base) == 0
    assert not list((tmp_path / "runs").glob("*/sw0.log"))
    assert main([*base, "--keep-runs"]) == 0
    assert list((tmp_path / "runs").glob("*/sw0.log"))


def test_cc_reaches_the_topology_of_a_collective_bench() -> None:
    import argparse

    from bench import sweep

    args = argparse.Namespace(topology=None, link_gbps=2.0, link_latency_us=0.0, cc="dcqcn")
    topo = sweep.topology(args, 3)
    assert topo.congestion.cc == "dcqcn" and len(topo.workers) == 3
    assert "cc dcqcn" in sweep.congestion_text(topo)
    args.cc = None
    assert sweep.topology(args, 3).congestion.cc is None
