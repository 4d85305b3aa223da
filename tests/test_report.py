"""Tests of bench.report: arithmetic against hand-computed values, formats, files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import report
from bench.report import (
    AllreduceRow,
    busbw_factor,
    format_allreduce_table,
    latency_stats,
    parse_size,
    plot_busbw,
    size_range,
    write_json,
    write_markdown,
)

# --------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("4K", 4096),
        ("4k", 4096),
        ("64M", 64 * 1024 * 1024),
        ("1G", 1024**3),
        ("2T", 2 * 1024**4),
        ("8KB", 8192),
        ("8KiB", 8192),
        (" 16M ", 16 * 1024 * 1024),
        ("0", 0),
        (512, 512),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "K", "4X", "1.5M", "-4K", "4 K B", "M4", -1, True])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)  # type: ignore[arg-type]


def test_size_range_like_nccl_tests() -> None:
    assert size_range("4K", "64K", 2) == [4096, 8192, 16384, 32768, 65536]
    assert size_range(8, 128, 4) == [8, 32, 128]
    # The end is inclusive only when reached exactly; otherwise the sweep stops below it.
    assert size_range(1024, 5000, 2) == [1024, 2048, 4096]
    assert size_range("1M", "1M", 2) == [1 << 20]


@pytest.mark.parametrize(
    ("args", "match"),
    [(("0", "4K", 2), "begin"), (("8K", "4K", 2), "smaller"), (("4K", "8K", 1), "factor")],
)
def test_size_range_rejects(args: tuple[str, str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        size_range(*args)


def test_format_size() -> None:
    assert report.format_size(4096) == "4K"
    assert report.format_size(64 << 20) == "64M"
    assert report.format_size(1000) == "1000"


# --------------------------------------------------------------------------
# bandwidth and latency arithmetic
# --------------------------------------------------------------------------


def test_busbw_factor_rule() -> None:
    assert busbw_factor("allreduce", 2) == 1.0
    assert busbw_factor("allreduce", 4) == 1.5
    assert busbw_factor("allreduce", 8) == 1.75
    assert busbw_factor("allgather", 4) == 0.75
    assert busbw_factor("reducescatter", 4) == 0.75
    assert busbw_factor("reduce_scatter", 2) == 0.5
    assert busbw_factor("alltoall", 8) == 0.875
    assert busbw_factor("broadcast", 16) == 1.0
    assert busbw_factor("reduce", 3) == 1.0
    assert busbw_factor("all-reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("gossip", 4)
    with pytest.raises(ValueError, match="at least one"):
        busbw_factor("allreduce", 0)


def test_latency_stats_hand_computed() -> None:
    # 1..10: linear percentiles are 1 + q/100 * 9.
    stats = latency_stats(range(1, 11))
    assert stats["min"] == 1.0
    assert stats["max"] == 10.0
    assert stats["mean"] == 5.5
    assert stats["p50"] == pytest.approx(5.5)
    assert stats["p90"] == pytest.approx(9.1)
    assert stats["p99"] == pytest.approx(9.91)
    assert stats["p99.9"] == pytest.approx(9.991)
    assert set(stats) == {"min", "p50", "p90", "p99", "p99.9", "max", "mean"}
    single = latency_stats([7.0])
    assert all(v == 7.0 for v in single.values())
    with pytest.raises(ValueError, match="no samples"):
        latency_stats([])


def test_row_from_samples() -> None:
    # 1 MiB in a median of 100 us: algbw = 1048576 / 100e-6 / 1e9 = 10.48576 GB/s;
    # 4 workers: busbw = algbw * 2*3/4.
    row = AllreduceRow.from_samples(
        "host-ring", 4, 1 << 20, "float32", "sum", [90.0, 100.0, 200.0], 0,
        copies=7, encodes=2, crossings=3, hops=12, chunks=16,
    )
    assert row.count == 262144
    assert row.time_us == 100.0
    assert row.algbw_gbps == pytest.approx(10.48576)
    assert row.busbw_gbps == pytest.approx(10.48576 * 1.5)
    assert (row.min_us, row.max_us) == (90.0, 200.0)
    assert row.p50_us == 100.0
    assert row.p99_us == pytest.approx(198.0)
    assert row.ran and row.note == ""


def test_row_dict_has_the_json_keys() -> None:
    row = AllreduceRow.from_samples("gloo", 2, 4096, "float32", "sum", [10.0], -1)
    d = row.to_dict()
    required = {
        "path", "workers", "size_bytes", "dtype", "time_us", "algbw_gbps", "busbw_gbps",
        "wrong", "p50_us", "p99_us", "copies", "encodes", "crossings", "hops",
    }
    assert required <= set(d)
    assert set(d) - required == {"count", "redop", "min_us", "max_us", "chunks", "note"}
    assert d["hops"] is None and d["wrong"] == -1
    json.dumps(d, allow_nan=False)


def test_unavailable_row() -> None:
    row = AllreduceRow.unavailable("mpi", 2, 4096, "float32", "unavailable: no mpirun")
    assert not row.ran
    assert row.count == 1024
    assert row.time_us is None and row.busbw_gbps is None


# --------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------


def _rows() -> list[AllreduceRow]:
    return [
        AllreduceRow.from_samples("in-network", 2, 1 << 20, "float32", "sum", [100.0], 0,
                                  copies=1, encodes=0, crossings=2, hops=2),
        AllreduceRow.from_samples("in-network", 2, 4096, "float32", "sum", [10.0, 20.0], 0,
                                  copies=1, encodes=0, crossings=2, hops=2),
        AllreduceRow.unavailable(
            "mpi", 2, 4096, "float32",
            "unavailable: mpi4py is not installed (pip install 'semfab[peers]')"),
    ]


def test_table_groups_and_footer() -> None:
    text = format_allreduce_table(_rows())
    assert "### in-network — 2 workers" in text
    assert "### mpi — 2 workers" in text
    header = ("| size(B) | count | type | redop | time(us) | algbw(GB/s) | busbw(GB/s) | #wrong "
              "| p50(us) | p99(us) | copies/encodes/crossings/hops |")
    assert header in text
    lines = text.splitlines()
    # Sizes ascend inside a group whatever the input order.
    innet = [ln for ln in lines if ln.startswith("| 4096 |") or ln.startswith("| 1048576 |")]
    assert innet[0].startswith("| 4096 | 1024 | float32 | sum | 15.00 |")
    assert innet[1].startswith("| 1048576 | 262144 | float32 | sum | 100.0 | 10.49 | 10.49 | 0 |")
    assert "| 1/0/2/2 |" in innet[0]
    # The unavailable row is shown with its note, dashes elsewhere.
    mpi_row = next(ln for ln in lines if "mpi4py is not installed" in ln)
    assert mpi_row.startswith("| 4096 | 1024 | float32 | sum | — | — | — | — |")
    assert text.count("# Out of bounds values : OK") == 2
    # Average of the two in-network busbw values: (4096/15e-6 + 1048576/100e-6) / 2 / 1e9.
    avg = (4096 / 15e-6 + 1048576 / 100e-6) / 2 / 1e9
    assert f"# Avg bus bandwidth    : {avg:.4g}" in text
    assert "# Avg bus bandwidth    : N/A (no size ran)" in text
    # Footer lines are inside a text block, so Markdown does not make them headings.
    assert "```text\n# Out of bounds values" in text


def test_table_failed_footer_and_unchecked() -> None:
    rows = [
        AllreduceRow.from_samples("host-ps", 4, 4096, "float32", "sum", [50.0], 3),
        AllreduceRow.from_samples("host-ps", 4, 8192, "float32", "sum", [60.0], -1),
    ]
    text = format_allreduce_table(rows)
    assert "# Out of bounds values : FAILED" in text
    assert "| 8192 | 2048 | float32 | sum | 60.00 |" in text
    assert "| N/A |" in text  # not checked
    assert "| — |" in text  # counters unknown


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------


def test_environment_is_cheap_and_complete() -> None:
    env = report.environment()
    for key in ("date", "hostname", "platform", "cpu", "logical_cores", "python", "versions"):
        assert key in env
    assert env["date"].endswith("+00:00")
    assert "numpy" in env["versions"]
    assert "semfab" in env["versions"]


def test_write_json(tmp_path: Path) -> None:
    rows = _rows()
    out = write_json(tmp_path / "sub" / "r.json", "allreduce",
                     [r.to_dict() for r in rows], extra={"sweep": {"b": "4K"}})
    doc = json.loads(out.read_text())
    assert set(doc) == {"env", "kind", "results", "sweep"}
    assert doc["kind"] == "allreduce"
    assert doc["results"][2]["time_us"] is None
    assert doc["results"][0]["busbw_gbps"] == pytest.approx(rows[0].busbw_gbps)
    with pytest.raises(ValueError, match="reserved"):
        write_json(tmp_path / "x.json", "k", [], extra={"env": 1})


def test_write_json_strict(tmp_path: Path) -> None:
    out = write_json(tmp_path / "n.json", "k", [{"x": math.nan, "y": math.inf}])
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["results"] == [{"x": None, "y": None}]


def test_write_markdown(tmp_path: Path) -> None:
    out = write_markdown(tmp_path / "a" / "t.md", "hello")
    assert out.read_text() == "hello\n"


def test_plot_writes_png(tmp_path: Path) -> None:
    rows = _rows() + [
        AllreduceRow.from_samples("in-network", 4, 4096, "float32", "sum", [30.0], 0),
        AllreduceRow.from_samples("in-network", 4, 1 << 20, "float32", "sum", [300.0], 0),
    ]
    out = plot_busbw(rows, tmp_path / "busbw.png", "allreduce busbw")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_plot_with_nothing_ran(tmp_path: Path) -> None:
    rows = [AllreduceRow.unavailable("gloo", 2, 4096, "float32", "unavailable: torch")]
    out = plot_busbw(rows, tmp_path / "none.png", "nothing")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_progress_silent_without_tty(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with report.progress(3, "sweep") as bar:
        for _ in range(3):
            bar.advance()
        bar.describe("done")
    monkeypatch.setenv("SEMFAB_NO_PROGRESS", "1")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    assert not report._progress_enabled()
    assert capsys.readouterr().out == ""
