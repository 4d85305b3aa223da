"""Tests of bench.report: arithmetic against hand-computed values, formats, files."""

from __future__ import annotations

import dataclasses
import json
import math
import re
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
    assert set(d) - required == {"count", "redop", "min_us", "max_us", "chunks", "note",
                                 "runs", "time_min_us", "time_max_us", "failed_runs", "avg_us",
                                 "place",
                                 "inplace_time_us", "inplace_algbw_gbps", "inplace_busbw_gbps",
                                 "inplace_wrong", "inplace_p50_us", "inplace_p99_us",
                                 "samples_us", "ok", "status"}
    assert d["hops"] is None and d["wrong"] == -1
    assert d["ok"] is True and d["status"] == "ok" and d["samples_us"] == [10.0]
    json.dumps(d, allow_nan=False)
    # a saved row reads back (unknown keys such as ok/status are derived, not stored)
    back = AllreduceRow.from_dict(json.loads(json.dumps(d)))
    assert back == row


def test_row_status() -> None:
    ok = AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 0)
    wrong = AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 5)
    unchecked = AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], -1)
    missing = AllreduceRow.unavailable("mpi", 2, 4096, "float32", "unavailable: no mpirun")
    broke = AllreduceRow.unavailable("mpi", 2, 4096, "float32", "failed: mpirun exited 1")
    assert [r.status for r in (ok, wrong, unchecked, missing, broke)] == [
        "ok", "failed", "ok", "unavailable", "failed"]
    assert report.failures([ok, wrong, unchecked, missing, broke]) == [wrong, broke]
    assert not wrong.ok and not missing.ok and not wrong.to_dict()["ok"]


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


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table line, without the padding that aligns them."""
    assert line.startswith("|") and line.endswith("|"), line
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def _table_rows(text: str) -> list[list[str]]:
    return [_cells(ln) for ln in text.splitlines() if ln.startswith("|")]


def _aligns(rule: list[str]) -> str:
    """The alignment line beneath a header, one letter a column: R(ight) or L(eft)."""
    assert all(re.fullmatch(r":?-+:?", c) for c in rule), rule
    return "".join("R" if c.endswith(":") and not c.startswith(":") else "L" for c in rule)


HEADER = ["size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
          "p50(us)", "p99(us)", "copies/encodes/crossings/hops"]


def test_table_groups_and_footer() -> None:
    text = format_allreduce_table(_rows())
    assert "### in-network — 2 workers" in text
    assert "### mpi — 2 workers" in text
    rows = _table_rows(text)
    assert rows[0] == HEADER
    assert _aligns(rows[1]) == "RRLLRRRRRRR"  # numbers right-aligned
    # Sizes ascend inside a group whatever the input order.
    innet = [r for r in rows if r[0] in ("4096", "1048576")]
    assert innet[0][:5] == ["4096", "1024", "float32", "sum", "15.00"]
    assert innet[1][:8] == ["1048576", "262144", "float32", "sum", "100.0", "10.49", "10.49", "0"]
    assert innet[0][10] == "1/0/2/2"
    # The unavailable row is shown with its note, dashes elsewhere.
    mpi_row = next(r for r in rows if "mpi4py is not installed" in r[-1])
    assert mpi_row[:8] == ["4096", "1024", "float32", "sum", "—", "—", "—", "—"]
    assert next(r for r in rows if r[-1] == "note") == [*HEADER, "note"]
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
    rows = _table_rows(text)
    assert rows[3][:5] == ["8192", "2048", "float32", "sum", "60.00"]
    assert rows[3][7] == "N/A"  # not checked
    assert rows[3][10] == "—"  # counters unknown


def test_markdown_table_is_aligned_and_a_note_stays_in_its_cell() -> None:
    rows = [AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 0),
            AllreduceRow.unavailable("ina", 2, 1 << 30, "float32", "failed: a | b\nc")]
    text = format_allreduce_table(rows)
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len({len(ln) for ln in lines}) == 1  # padded: the columns line up in plain text
    cells = [_cells(ln) for ln in lines]
    assert {len(c) for c in cells} == {len(HEADER) + 1}
    assert _aligns(cells[1]) == "RRLLRRRRRRRL"  # the note: left
    assert cells[2][-1] == ""  # a row without a note
    assert cells[3][0] == str(1 << 30) and cells[3][-1] == "failed: a \\| b c"


# --------------------------------------------------------------------------
# several runs, plain text rows, side by side, footer
# --------------------------------------------------------------------------


def test_merge_runs_median_spread_and_failures() -> None:
    run = [
        [AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0, 11.0], 0),
         AllreduceRow.from_samples("host-ring", 2, 4096, "float32", "sum", [40.0], 0)],
        [AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [20.0, 21.0], 0),
         AllreduceRow.unavailable("host-ring", 2, 4096, "float32", "failed: timeout")],
        [AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [30.0, 33.0], 2),
         AllreduceRow.from_samples("host-ring", 2, 4096, "float32", "sum", [50.0], 0)],
    ]
    ina, ring = report.merge_runs(run)
    # per-run medians 10.5, 20.5, 31.5: the median over runs and the spread
    assert ina.time_us == 20.5 and (ina.time_min_us, ina.time_max_us) == (10.5, 31.5)
    assert ina.runs == 3 and ina.busbw_gbps == pytest.approx(4096 / 20.5e-6 / 1e9)
    # percentiles over every sample of every run
    assert (ina.min_us, ina.max_us) == (10.0, 33.0) and len(ina.samples_us or []) == 6
    assert ina.wrong == 2 and ina.status == "failed" and ina.failed_runs == 1
    # one failed run makes the merged row failed, with the failure's note kept
    assert ring.status == "failed" and ring.failed_runs == 1 and "timeout" in ring.note
    assert ring.time_us == 45.0 and ring.runs == 3


def test_text_rows_line_up_under_the_header() -> None:
    header = report.format_text_header().splitlines()
    assert len(header) == 2 and all(h.startswith("#") for h in header)
    for word in ("size", "count", "type", "redop", "path", "workers", "time", "algbw",
                 "busbw", "#wrong", "p50", "p99"):
        assert word in header[0]
    ok = AllreduceRow.from_samples("host-ring", 4, 1 << 20, "float32", "sum", [100.0], 0)
    line = report.format_text_row(ok)
    assert not line.startswith("#")
    assert line.split() == ["1048576", "262144", "float32", "sum", "host-ring", "4", "100.0",
                            "10.49", "15.73", "0", "100.0", "100.0", "-", "-", "-", "-"]
    # every number ends under the end of its column title
    title_end = {w: header[0].index(w) + len(w) for w in ("size", "busbw", "p99")}
    assert line.index("1048576") + 7 == title_end["size"]
    assert line.index("15.73") + 5 == title_end["busbw"]
    assert line.rfind("100.0") + 5 == title_end["p99"]
    bad = report.format_text_row(
        AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 3))
    assert "FAILED" in bad
    gone = report.format_text_row(AllreduceRow.unavailable("mpi", 2, 4096, "float32",
                                                           "unavailable: no mpirun"))
    assert gone.split()[6:12] == ["-"] * 6 and gone.endswith("unavailable: no mpirun")


def test_in_place_half_beside_the_out_of_place_one() -> None:
    # nccl-tests prints out-of-place, then in-place: time algbw busbw #wrong each
    header = report.format_text_header().splitlines()[0]
    for word in ("in:time", "in:algbw", "in:busbw", "in:#wrong"):
        assert word in header
    row = AllreduceRow.from_samples("ina", 2, 1 << 20, "float32", "sum", [100.0], 0,
                                    avg_us=50.0)
    report.add_inplace_half(row, [{"times_us": [80.0], "wrong": 0, "avg_us": 40.0},
                                  {"times_us": [90.0], "wrong": 2, "avg_us": 25.0}], True)
    assert (row.inplace_time_us, row.inplace_p50_us, row.inplace_wrong) == (40.0, 90.0, 2)
    assert row.inplace_algbw_gbps == pytest.approx((1 << 20) / 40.0 / 1e3)
    assert row.time_us == 50.0 and row.status == "failed"  # the in-place half was wrong
    cells = report.format_text_row(row).split()
    assert cells[6:16] == ["50.00", "20.97", "20.97", "0", "100.0", "100.0", "40.00", "26.21",
                           "26.21", "2"]
    assert "2 wrong elements (in-place)" in "\n".join(report.format_footer([row]))
    # in-place only (--inplace 1): the out-of-place half shows dashes, never a figure
    only = AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 0)
    only.place = "in"
    assert report.format_text_row(only).split()[6:10] == ["-"] * 4
    merged = report.merge_runs([[row], [dataclasses.replace(row, inplace_time_us=60.0)]])
    assert merged[0].inplace_time_us == 50.0 and merged[0].inplace_wrong == 4


def test_side_by_side_every_path_at_each_size() -> None:
    rows = [
        AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 0),
        AllreduceRow.from_samples("host-ring", 2, 4096, "float32", "sum", [20.0], 0),
        AllreduceRow.from_samples("ina", 2, 8192, "float32", "sum", [10.0], 0),
        AllreduceRow.unavailable("gloo", 2, 4096, "float32", "unavailable: torch"),
        AllreduceRow.from_samples("ina", 4, 4096, "float32", "sum", [30.0], 0),
    ]
    text = report.format_side_by_side(rows, marks={"gloo": "*"})
    assert "# 2 workers, float32 sum" in text and "# 4 workers, float32 sum" in text
    two = text.split("# 4 workers")[0].splitlines()
    assert "ina" in two[1] and "host-ring" in two[1] and "gloo*" in two[1]
    row_4k = next(ln for ln in two if ln.split()[:1] == ["4096"])
    # busbw and time of ina, of host-ring, then dashes for gloo
    assert row_4k.split() == ["4096", "0.41", "10.00", "0.205", "20.00", "-", "-"]
    row_8k = next(ln for ln in two if ln.split()[:1] == ["8192"])
    assert row_8k.split() == ["8192", "0.819", "10.00", "-", "-", "-", "-"]
    avg = next(ln for ln in two if "avg busbw" in ln)
    assert avg.split()[3:] == [f"{(4096 / 10e-6 + 8192 / 10e-6) / 2 / 1e9:.3g}", "0.205", "-"]
    md = report.format_side_by_side(rows, markdown=True)
    md_rows = _table_rows(md.split("#### 4 workers")[0])
    assert md_rows[0] == ["size(B)", "ina busbw(GB/s)", "ina time(us)", "host-ring busbw(GB/s)",
                          "host-ring time(us)", "gloo busbw(GB/s)", "gloo time(us)"]
    assert _aligns(md_rows[1]) == "R" * 7
    assert md_rows[2] == ["4096", "0.41", "10.00", "0.205", "20.00", "-", "-"]
    assert md_rows[-1] == ["avg busbw", f"{(4096 / 10e-6 + 8192 / 10e-6) / 2 / 1e9:.3g}", "",
                           "0.205", "", "-", ""]
    merged = report.format_side_by_side(report.merge_runs([rows, rows]))
    assert "spread" in merged and "10.00..10.00" in merged


def test_footer_names_failures() -> None:
    rows = [
        AllreduceRow.from_samples("ina", 2, 4096, "float32", "sum", [10.0], 0),
        AllreduceRow.from_samples("ina", 2, 8192, "float32", "sum", [10.0], 7),
        AllreduceRow.unavailable("mpi", 2, 4096, "float32", "failed: mpirun exited 1"),
        AllreduceRow.unavailable("gloo", 2, 4096, "float32", "unavailable: torch"),
    ]
    lines = report.format_footer(rows, 1.5)
    assert lines[0] == "# Out of bounds values : FAILED (1 row with wrong elements)"
    assert lines[1].startswith("# Avg bus bandwidth    : ")
    assert "4 rows in 1.5 s: 1 ok, 2 failed, 1 unavailable" in lines[2]
    assert "# FAILED: ina x2 8K float32 sum: 7 wrong elements" in lines
    assert "# FAILED: mpi x2 4K float32 sum: failed: mpirun exited 1" in lines
    good = report.format_footer(rows[:1])
    assert good[0] == "# Out of bounds values : OK" and len(good) == 3


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


def test_plot_has_busbw_and_latency_panels() -> None:
    rows = [AllreduceRow.from_samples(p, w, s, "float32", "sum", [t * w], 0)
            for p in ("ina", "host-ring") for w in (2, 4)
            for s, t in ((4096, 10.0), (1 << 20, 200.0))]
    fig = report.busbw_figure(rows, "allreduce")
    bw, lat = fig.axes
    assert "bus bandwidth" in bw.get_ylabel() and "time" in lat.get_ylabel()
    assert bw.get_xscale() == lat.get_xscale() == "log" and lat.get_yscale() == "log"
    (ina2,) = [ln for ln in lat.get_lines() if ln.get_label() == "ina ×2"]
    assert list(ina2.get_ydata()) == [20.0, 400.0]  # the row's time at each size
    styles = {ln.get_label(): ln.get_linestyle() for ln in lat.get_lines()}
    assert styles["ina ×2"] == styles["host-ring ×2"] != styles["ina ×4"]  # per count
    colours = {ln.get_label(): ln.get_color() for ln in bw.get_lines()}
    assert colours["ina ×2"] == colours["ina ×4"] != colours["host-ring ×2"]  # per path


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
