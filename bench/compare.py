"""`semfab compare A.json B.json ...`: saved allreduce runs side by side.

Reads the ``--json`` files of `semfab bench allreduce` (or `semfab sim
allreduce`, or `semfab bench <collective>` of the collective set: all_gather,
reduce_scatter, broadcast, reduce, alltoall, sendrecv; every file of one
comparison of the same collective), e.g. before and after a change, or two
topologies, and prints
one table per (path, workers, dtype, op): at each size the busbw and time of
every run, and the ratio of each run's busbw to the first run's (the
baseline; above 1 is faster). The settings that differ between the runs are
named first, so a comparison of unlike runs does not pass for like.

``--plot PNG``: busbw and time against size (log axes; one colour per path
and worker count, one line style per run) over a ratio-to-baseline panel.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import report
from bench.report import AllreduceRow
from fabric.errors import UsageError, parse_json

#: The kinds of saved run this command reads (the collective set's: bench.nccl.KINDS).
KINDS = ("allreduce", "sim-allreduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
         "alltoall", "sendrecv")
#: Settings not worth naming when they differ.
_QUIET_SETTINGS = ("command", "cores", "topology_text", "json", "markdown", "plot", "run_dir",
                   "verbose", "sub_verbose")

GroupKey = tuple[str, int, str, str]


@dataclasses.dataclass
class SavedRun:
    """One saved run: its label, file, rows and what it was run with."""

    label: str
    path: str
    kind: str
    rows: list[AllreduceRow]
    settings: dict[str, Any]
    env: dict[str, Any]

    def row(self, key: GroupKey, size: int) -> AllreduceRow | None:
        for r in self.rows:
            if (r.path, r.workers, r.dtype, r.redop) == key and r.size_bytes == size:
                return r
        return None

    def describe(self) -> str:
        env = self.env
        bits = [self.kind]
        if env.get("date"):
            bits.append(str(env["date"]))
        if env.get("git_commit"):
            bits.append(f"commit {str(env['git_commit'])[:9]}"
                        + (" (dirty)" if env.get("git_dirty") else ""))
        if env.get("hostname"):
            bits.append(str(env["hostname"]))
        if self.settings.get("repeat", 1) != 1:
            bits.append(f"median of {self.settings['repeat']} runs")
        return ", ".join(bits)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab compare`."""
    p.add_argument("files", nargs="+", metavar="RUN.json",
                   help="saved runs (--json of `semfab bench allreduce`, `semfab sim "
                   "allreduce` or `semfab bench <collective>`, all of one collective); the "
                   "first is the baseline")
    p.add_argument("--labels", help="comma-separated names of the runs (default: A, B, ...)")
    p.add_argument("--plot", metavar="PNG",
                   help="write busbw and time against size, with a ratio-to-baseline panel")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")


def load_run(path: str, label: str) -> SavedRun:
    """Read one saved run; a file that is not one is a UsageError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read it ({exc})") from None
    doc = parse_json(text, path)
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in KINDS:
        raise UsageError(f"{path}: not a saved allreduce run (kind {kind!r}) nor one of "
                         "the collective set; compare reads the --json of `semfab bench "
                         "allreduce`, `semfab sim allreduce` or `semfab bench <collective>` "
                         f"({', '.join(KINDS[2:])})")
    results = doc.get("results")
    if not isinstance(results, list):
        raise UsageError(f"{path}: no \"results\" list")
    rows = []
    for i, item in enumerate(results):
        try:
            if not isinstance(item, dict):
                raise ValueError("not an object")
            rows.append(AllreduceRow.from_dict(item))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{path}: result {i} is not an allreduce row ({exc})") from None
    settings = doc.get("settings") if isinstance(doc.get("settings"), dict) else {}
    env = doc.get("env") if isinstance(doc.get("env"), dict) else {}
    return SavedRun(label, path, str(kind), rows, settings, env)


def collective_of(kind: str) -> str:
    """The collective a saved run measured (``sim-allreduce`` is an allreduce)."""
    return kind.removeprefix("sim-")


def _labels(args: argparse.Namespace) -> list[str]:
    n = len(args.files)
    if args.labels is None:
        return [chr(ord("A") + i) if i < 26 else f"R{i + 1}" for i in range(n)]
    labels = [s.strip() for s in args.labels.split(",")]
    if len(labels) != n or not all(labels) or len(set(labels)) != n:
        raise UsageError(f"--labels: give {n} distinct names, one per file; got {args.labels!r}")
    return labels


def _groups(runs: Sequence[SavedRun]) -> dict[GroupKey, list[int]]:
    """(path, workers, dtype, op) -> sizes, in order of first appearance over the runs."""
    groups: dict[GroupKey, set[int]] = {}
    for run in runs:
        for r in run.rows:
            groups.setdefault((r.path, r.workers, r.dtype, r.redop), set()).add(r.size_bytes)
    return {k: sorted(v) for k, v in groups.items()}


def settings_differences(runs: Sequence[SavedRun]) -> list[str]:
    """``name: A x, B y`` for each setting that is not the same in every run."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.settings if k not in keys and k not in _QUIET_SETTINGS]
    out = []
    for k in keys:
        values = [run.settings.get(k) for run in runs]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"{run.label} {_short(v)}" for run, v in zip(runs, values,
                                                                            strict=True))
            out.append(f"{k}: {shown}")
    texts = [run.settings.get("topology_text") for run in runs]
    if any(t != texts[0] for t in texts[1:]) and not any(o.startswith("topology:") for o in out):
        out.append("topology file contents differ")
    return out


def _short(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        text = ",".join(str(x) for x in v)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _bw(row: AllreduceRow | None) -> str:
    if row is None or not row.ran or row.busbw_gbps is None:
        return "-"
    return report._fmt_bw(row.busbw_gbps) + ("!" if row.status == "failed" else "")


def _time(row: AllreduceRow | None) -> str:
    if row is None or not row.ran:
        return "-"
    return report._fmt_time(row.time_us)


def _ratio(row: AllreduceRow | None, base: AllreduceRow | None) -> str:
    if (row is None or base is None or not row.ran or not base.ran or not row.busbw_gbps
            or not base.busbw_gbps or not math.isfinite(row.busbw_gbps)
            or not math.isfinite(base.busbw_gbps)):
        return "-"
    return f"{row.busbw_gbps / base.busbw_gbps:.2f}"


def format_compare(runs: Sequence[SavedRun], markdown: bool = False) -> str:
    """The header (runs, settings that differ) and one table per (path, workers, dtype, op)."""
    base = runs[0]
    out = [f"# semfab compare: {len(runs)} saved {collective_of(base.kind)} runs, baseline "
           f"{base.label}; ratio: a run's busbw over {base.label}'s at the same size (above 1: "
           "faster)"]
    for run in runs:
        out.append(f"#   {run.label} = {run.path}: {run.describe()}")
    diffs = settings_differences(runs)
    out.append("# settings that differ: " + ("; ".join(diffs) if diffs else "none"))
    if markdown:
        out = ["```text", *out, "```", ""]
    failed_any = False
    for key, sizes in _groups(runs).items():
        path, workers, dtype, op = key
        what = dtype if op == "none" else f"{dtype} {op}"  # a collective that copies
        title = f"{path}, {workers} worker{'s' if workers != 1 else ''}, {what}"
        cols = ([f"busbw {r.label}" for r in runs] + [f"time {r.label}" for r in runs]
                + [f"{r.label}/{base.label}" for r in runs[1:]])
        lines = []
        for size in sizes:
            rows = [run.row(key, size) for run in runs]
            failed_any |= any(r is not None and r.status == "failed" for r in rows)
            lines.append([str(size)] + [_bw(r) for r in rows] + [_time(r) for r in rows]
                         + [_ratio(r, rows[0]) for r in rows[1:]])
        if markdown:
            out.append(f"### {title}")
            out.append("")
            head = ["size(B)"] + [c.replace("busbw", "busbw(GB/s)").replace("time", "time(us)")
                                  for c in cols]
            out += report.markdown_table(head, lines)
            out.append("")
            continue
        widths = [11] + [max(10, len(c) + 2) for c in cols]
        out.append("")
        out.append(f"# {title}: busbw (GB/s), time (us)")
        out.append("#" + "".join(f"{c:>{w}s}" for c, w in zip(["size(B)", *cols], widths,
                                                                 strict=True))[1:])
        for line in lines:
            out.append("".join(f"{c:>{w}s}" for c, w in zip(line, widths, strict=True)))
    if failed_any:
        out.append("")
        out.append("# !: the row failed in that run (wrong elements or an error; see its file)")
    return "\n".join(out).rstrip("\n") + "\n"


def plot_compare(runs: Sequence[SavedRun], path: str | Path) -> Path:
    """busbw and time against size (log-log), one line style per run, over ratio panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(12, 7.5), dpi=110)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1.4], hspace=0.08, wspace=0.22)
    ax_bw = fig.add_subplot(grid[0, 0])
    ax_t = fig.add_subplot(grid[0, 1])
    ax_rbw = fig.add_subplot(grid[1, 0], sharex=ax_bw)
    ax_rt = fig.add_subplot(grid[1, 1], sharex=ax_t)
    styles: list[Any] = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    colours = [f"C{i}" for i in range(10)]
    groups = _groups(runs)
    worker_counts = sorted({k[1] for k in groups})
    plotted = 0
    for gi, (key, sizes) in enumerate(groups.items()):
        colour = colours[gi % len(colours)]
        marker = markers[worker_counts.index(key[1]) % len(markers)]
        base_rows = [runs[0].row(key, s) for s in sizes]
        for ri, run in enumerate(runs):
            style = styles[ri % len(styles)]
            pts = [(s, r) for s in sizes if (r := run.row(key, s)) is not None and r.ran
                   and r.busbw_gbps and math.isfinite(r.busbw_gbps) and r.time_us]
            if not pts:
                continue
            xs = [s for s, _ in pts]
            kw: dict[str, Any] = dict(color=colour, linestyle=style, marker=marker,
                                      markersize=4)
            ax_bw.plot(xs, [r.busbw_gbps or 0.0 for _, r in pts], **kw)
            ax_t.plot(xs, [r.time_us or 0.0 for _, r in pts], **kw)
            plotted += 1
            if ri == 0:
                continue
            ratio_x, ratio_bw, ratio_t = [], [], []
            for s, base in zip(sizes, base_rows, strict=True):
                r = run.row(key, s)
                if (r is None or base is None or not r.ran or not base.ran or not r.busbw_gbps
                        or not base.busbw_gbps or not r.time_us or not base.time_us):
                    continue
                ratio_x.append(s)
                ratio_bw.append(r.busbw_gbps / base.busbw_gbps)
                ratio_t.append(r.time_us / base.time_us)
            ax_rbw.plot(ratio_x, ratio_bw, **kw)
            ax_rt.plot(ratio_x, ratio_t, **kw)
    size_fmt = FuncFormatter(lambda x, _pos: report.format_size(int(round(x))))
    for ax in (ax_bw, ax_t, ax_rbw, ax_rt):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    for ax in (ax_bw, ax_t):
        if plotted:
            ax.set_yscale("log")
        ax.tick_params(labelbottom=False)
    for ax in (ax_rbw, ax_rt):
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.xaxis.set_major_formatter(size_fmt)
        ax.set_xlabel("message size (bytes)")
    base_label = runs[0].label
    ax_bw.set_ylabel("bus bandwidth (GB/s, GB = 1e9)")
    ax_t.set_ylabel("time (us)")
    ax_rbw.set_ylabel(f"busbw / {base_label}\n(above 1: faster)")
    ax_rt.set_ylabel(f"time / {base_label}\n(below 1: faster)")
    ax_bw.set_title("busbw against size")
    ax_t.set_title("time against size")
    series = [Line2D([], [], color=colours[i % len(colours)],
                     marker=markers[worker_counts.index(k[1]) % len(markers)],
                     label=f"{k[0]} x{k[1]} {k[2]} {k[3]}")
              for i, k in enumerate(groups)]
    run_lines = [Line2D([], [], color="black", linestyle=styles[i % len(styles)],
                        label=f"{r.label}: {Path(r.path).name}") for i, r in enumerate(runs)]
    if plotted:
        ax_bw.legend(handles=series, loc="best", fontsize="x-small", title="path x workers")
        ax_t.legend(handles=run_lines, loc="best", fontsize="x-small", title="run")
    else:
        ax_bw.text(0.5, 0.5, "no row ran", ha="center", va="center", transform=ax_bw.transAxes)
    fig.suptitle("semfab compare: " + " vs ".join(r.label for r in runs))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of `semfab compare`."""
    from fabric.emulation.launch_cli import check_output_file

    if len(args.files) < 2:
        raise UsageError("compare needs at least two saved runs (the first is the baseline)")
    labels = _labels(args)
    for flag in ("plot", "markdown"):
        if getattr(args, flag):
            check_output_file(f"--{flag}", getattr(args, flag))
    runs = [load_run(f, label) for f, label in zip(args.files, labels, strict=True)]
    kinds = {r.label: collective_of(r.kind) for r in runs}
    if len(set(kinds.values())) > 1:
        raise UsageError("compare runs of one collective at a time; got "
                         + ", ".join(f"{label} {kind}" for label, kind in kinds.items()))
    print(format_compare(runs), end="", flush=True)
    if args.markdown:
        report.write_markdown(args.markdown, format_compare(runs, markdown=True))
        print(f"# wrote {args.markdown}")
    if args.plot:
        plot_compare(runs, args.plot)
        print(f"# wrote {args.plot}")
    return 0
