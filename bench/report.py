"""Reporting helpers shared by every semfab benchmark.

Everything a benchmark needs to turn timings into the nccl-tests style output
the project promises (DESIGN.md section 7): size parsing and sweeps, the bus
bandwidth rule, latency percentiles, one result row type for allreduce, a
Markdown table with the nccl-tests footer, JSON with the environment, a PNG
plot and a progress bar that stays out of the way when output is redirected.

This module is cheap to import: matplotlib, rich, zmq and mpi4py are imported
only inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Container, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np

__all__ = [
    "AllreduceRow",
    "CollectiveRow",
    "GB",
    "busbw_factor",
    "dtype_itemsize",
    "environment",
    "failures",
    "format_allreduce_table",
    "format_footer",
    "format_side_by_side",
    "format_size",
    "format_text_header",
    "format_text_row",
    "latency_stats",
    "markdown_table",
    "merge_runs",
    "parse_size",
    "plot_busbw",
    "progress",
    "size_range",
    "write_json",
    "write_markdown",
]

#: nccl-tests (and this project) count bandwidth in decimal gigabytes.
GB = 1e9

_REPO_ROOT = Path(__file__).resolve().parent.parent

# Distribution names whose versions every result file records.  Values are
# distribution names for importlib.metadata (not import names).
_VERSIONED = {
    "semfab": "semfab",
    "numpy": "numpy",
    "numba": "numba",
    "pyzmq": "pyzmq",
    "msgpack": "msgpack",
    "ml_dtypes": "ml_dtypes",
    "torch": "torch",
    "mpi4py": "mpi4py",
}


# --------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    """Installed version of a distribution, or None; never imports it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux) or platform as fallback."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _libzmq_version() -> str | None:
    """Version of the libzmq that pyzmq links (pyzmq itself is cheap to import)."""
    if importlib.util.find_spec("zmq") is None:
        return None
    try:
        import zmq

        return str(zmq.zmq_version())
    except Exception:  # a broken install must not break a benchmark report
        return None


@functools.lru_cache(maxsize=1)
def _mpi_library_version() -> str | None:
    """First line of MPI_Get_library_version() as mpi4py sees it.

    Importing ``mpi4py.MPI`` normally calls MPI_Init, which must not happen in
    a benchmark parent process (it can start a singleton runtime). So unless
    the caller already imported it, ask a short-lived interpreter that sets
    ``mpi4py.rc.initialize = False`` (the call is legal before MPI_Init).
    """
    if importlib.util.find_spec("mpi4py") is None:
        return None
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None:
        try:
            return str(mod.Get_library_version()).strip("\x00 \n").splitlines()[0]
        except Exception:
            return None
    code = (
        "import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
        "from mpi4py import MPI\n"
        "print(MPI.Get_library_version().strip('\\x00 \\n').splitlines()[0])"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip("\x00 \n")  # Open MPI pads the string with a NUL
    return line or None


def _git_info(root: Path) -> dict[str, Any]:
    """Commit and dirty flag of the repository at ``root``, empty when unknown."""
    if not (root / ".git").exists():
        return {}
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        if head.returncode != 0:
            return {}
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    info: dict[str, Any] = {"git_commit": head.stdout.strip()}
    if status.returncode == 0:
        info["git_dirty"] = bool(status.stdout.strip())
    return info


def _build() -> str:
    from fabric.info import build

    return build()


def environment() -> dict[str, Any]:
    """Describe the machine and software a result was measured with.

    Cheap: packages are looked up through their metadata, except pyzmq (to
    get the libzmq version) and mpi4py (asked in a subprocess, see
    :func:`_mpi_library_version`). torch is never imported here.
    """
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "build": _build(),
    }
    versions: dict[str, str | None] = {
        key: _dist_version(dist) for key, dist in _VERSIONED.items()
    }
    versions["libzmq"] = _libzmq_version() if versions["pyzmq"] else None
    versions["mpi_library"] = _mpi_library_version() if versions["mpi4py"] else None
    # Absent packages are left out rather than listed as null: shorter JSON,
    # and "not there" is still unambiguous.
    env["versions"] = {k: v for k, v in versions.items() if v is not None}
    env.update(_git_info(_REPO_ROOT))
    return env


# --------------------------------------------------------------------------
# Sizes and bandwidth arithmetic
# --------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse a byte count the way nccl-tests' ``-b``/``-e`` flags do.

    Suffixes are binary: ``"4K"`` is 4096, ``"64M"`` is 64 MiB, ``"1G"`` is
    1 GiB; ``"4096"`` is plain bytes. ``KB``/``KiB`` spellings and lower case
    are accepted too. Anything else raises ValueError naming the input.
    """
    if isinstance(text, bool):  # bool is an int subclass; True bytes is a bug
        raise ValueError(f"invalid size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: must not be negative")
        return text
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: expected a whole number of bytes with an optional "
            "binary suffix K, M, G or T (e.g. 4096, 4K, 64M, 1G)"
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_size(nbytes: int) -> str:
    """Short binary label for a byte count: 4096 -> '4K', 3 MiB -> '3M', 1000 -> '1000'."""
    for suffix, unit in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def size_range(begin: int | str, end: int | str, factor: float = 2) -> list[int]:
    """Sizes from ``begin`` to ``end`` inclusive, multiplying by ``factor``.

    Like nccl-tests ``-b begin -e end -f factor``: the sweep stops at the last
    size not above ``end``. Sizes may be given as strings ("4K").
    """
    lo, hi = parse_size(begin), parse_size(end)
    if lo <= 0:
        raise ValueError(f"size_range: begin must be > 0, got {begin!r}")
    if hi < lo:
        raise ValueError(f"size_range: end {end!r} is smaller than begin {begin!r}")
    if not 1 < factor < math.inf:
        raise ValueError(f"size_range: factor must be a finite number > 1, got {factor!r}")
    sizes: list[int] = []
    size = lo
    while size <= hi:
        sizes.append(size)
        nxt = int(size * factor)
        # A float factor close to 1 could round back to the same size forever.
        size = nxt if nxt > size else size + 1
    return sizes


def physical_memory() -> int | None:
    """Bytes of memory this machine has (None where the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(what: str, nbytes: int) -> None:
    """UsageError now when a run would hold more than this machine's memory (it
    would fail with a MemoryError, or swap for hours, after starting)."""
    from fabric.errors import UsageError

    have = physical_memory()
    if have is not None and nbytes > have:
        raise UsageError(f"{what}: needs about {nbytes / (1 << 30):,.0f} GiB, more than this "
                         f"machine's {have / (1 << 30):,.1f} GiB of memory; make it smaller")


_COLLECTIVE_ALIASES = {
    "allreduce": "allreduce",
    "allgather": "allgather",
    "reducescatter": "reducescatter",
    "alltoall": "alltoall",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "sendrecv",
}


def busbw_factor(collective: str, n: int) -> float:
    """Bus bandwidth factor of nccl-tests' PERFORMANCE.md.

    ``busbw = algbw * factor``: allreduce 2(n-1)/n; allgather, reducescatter
    and alltoall (n-1)/n; broadcast, reduce and sendrecv 1 (each collective's
    ``*GetBw`` in nccl-tests' src/*.cu). Names are matched without case, ``_``
    or ``-`` ("all_reduce", "reduce-scatter").
    """
    if n < 1:
        raise ValueError(f"busbw_factor: need at least one rank, got n={n}")
    key = _COLLECTIVE_ALIASES.get(re.sub(r"[_\-\s]", "", collective.lower()))
    if key == "allreduce":
        return 2.0 * (n - 1) / n
    if key in ("allgather", "reducescatter", "alltoall"):
        return (n - 1) / n
    if key in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(
        f"busbw_factor: unknown collective {collective!r}; known: "
        + ", ".join(sorted(set(_COLLECTIVE_ALIASES.values())))
    )


def latency_stats(samples_us: Iterable[float]) -> dict[str, float]:
    """min, p50, p90, p99, p99.9, max and mean of latency samples (microseconds).

    Percentiles use NumPy's default linear interpolation, so they are defined
    for any non-empty sample, also a short one.
    """
    arr = np.asarray(list(samples_us), dtype=np.float64)
    if arr.size == 0:
        raise ValueError("latency_stats: no samples")
    p50, p90, p99, p999 = np.percentile(arr, [50, 90, 99, 99.9], method="linear")
    return {
        "min": float(arr.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "p99.9": float(p999),
        "max": float(arr.max()),
        "mean": float(arr.mean()),
    }


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name, including ml_dtypes names like bfloat16."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        pass
    if importlib.util.find_spec("ml_dtypes") is not None:
        import ml_dtypes

        extra = getattr(ml_dtypes, str(dtype), None)
        if extra is not None:
            return int(np.dtype(extra).itemsize)
    raise ValueError(f"unknown dtype {dtype!r}")


# --------------------------------------------------------------------------
# Result rows
# --------------------------------------------------------------------------


_WANTED = {"int": "an integer", "str": "a string", "float | None": "a number or null",
           "int | None": "an integer or null", "list[float] | None": "a list of numbers or null"}


def _json_fits(value: Any, annotation: str) -> bool:
    """Whether a value read from JSON has the type a row field is annotated with."""
    if value is None:
        return annotation.endswith("| None")
    base = annotation.removesuffix(" | None")
    if isinstance(value, bool):
        return False  # JSON true/false is not a count or a time
    if base == "int":
        return isinstance(value, int)
    if base == "float":
        return isinstance(value, (int, float))
    if base == "str":
        return isinstance(value, str)
    if base == "list[float]":
        return isinstance(value, list) and all(_json_fits(v, "float") for v in value)
    return True


@dataclasses.dataclass
class AllreduceRow:
    """One (path, workers, size) result of an allreduce benchmark.

    A row with ``time_us is None`` did not run; its ``note`` says why
    (``"unavailable: ..."`` when a peer is not installed, anything else, e.g.
    ``"failed: ..."``, when it broke). Semantic-distance counters (copies,
    encodes, crossings, hops) are per chunk and None when the path cannot know
    them (the real-library peers).

    ``samples_us`` are the timed iterations (max over ranks). A row merged from
    ``runs`` > 1 independent runs (:func:`merge_runs`) has ``time_us`` the
    median of the runs' times, ``time_min_us``..``time_max_us`` their spread,
    and the percentiles of every run's samples together.

    ``avg_us`` is nccl-tests' ``time``: ``iters`` iterations run back to back
    (no barrier between them), their total over ``iters`` (the slowest rank's);
    where a bench measured it, ``time_us`` is that average and algbw/busbw
    follow from it, while ``p50_us``/``p99_us`` stay the barrier-separated
    iterations' percentiles. None where only barrier-separated iterations were
    timed (the real-library peers): ``time_us`` is then their median.

    nccl-tests' two halves: ``place`` says which one the main fields hold
    (``"out"``: out-of-place, ``"in"``: in-place, with ``--inplace 1``); the
    ``inplace_*`` fields hold the in-place half when both ran, None (printed
    "-") where it did not or the path has no in-place form. A row is failed
    when either half has wrong elements.
    """

    path: str
    workers: int
    size_bytes: int
    count: int
    dtype: str
    redop: str = "sum"
    time_us: float | None = None
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    wrong: int = -1
    p50_us: float | None = None
    p99_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    copies: int | None = None
    encodes: int | None = None
    crossings: int | None = None
    hops: int | None = None
    chunks: int | None = None
    note: str = ""
    runs: int = 1
    time_min_us: float | None = None
    time_max_us: float | None = None
    failed_runs: int = 0
    avg_us: float | None = None
    place: str = "out"
    inplace_time_us: float | None = None
    inplace_algbw_gbps: float | None = None
    inplace_busbw_gbps: float | None = None
    inplace_wrong: int = -1
    inplace_p50_us: float | None = None
    inplace_p99_us: float | None = None
    samples_us: list[float] | None = dataclasses.field(default=None, repr=False)

    @property
    def ran(self) -> bool:
        """True when the row carries a measurement (False: see ``note``)."""
        return self.time_us is not None

    @property
    def status(self) -> str:
        """``"ok"``, ``"failed"`` (wrong elements, an error, a failed run) or
        ``"unavailable"`` (a peer that is not installed: not a failure)."""
        if self.failed_runs or (self.ran and self.wrong > 0) or self.inplace_wrong > 0:
            return "failed"
        if self.ran:
            return "ok"
        return "unavailable" if self.note.startswith("unavailable") else "failed"

    @property
    def ok(self) -> bool:
        """True when the row ran and nothing in it failed."""
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the fields, then ``ok`` and ``status``."""
        return {**dataclasses.asdict(self), "ok": self.ok, "status": self.status}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """A row from :meth:`to_dict` output (a saved JSON run); unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("path", "workers", "size_bytes") if k not in data]
        if missing:
            raise ValueError(f"a result row lacks {', '.join(missing)}")
        kw = {k: v for k, v in data.items() if k in names}
        kw.setdefault("dtype", "float32")
        kw.setdefault("count", 0)
        for f in dataclasses.fields(cls):
            if f.name in kw and not _json_fits(kw[f.name], str(f.type)):
                raise ValueError(f"{f.name} is {json.dumps(kw[f.name])[:40]}, not "
                                 f"{_WANTED.get(str(f.type), str(f.type))}")
        return cls(**kw)

    @classmethod
    def from_samples(
        cls,
        path: str,
        workers: int,
        size_bytes: int,
        dtype: str,
        redop: str,
        samples_us: Sequence[float],
        wrong: int,
        *,
        copies: int | None = None,
        encodes: int | None = None,
        crossings: int | None = None,
        hops: int | None = None,
        chunks: int | None = None,
        note: str = "",
        collective: str = "allreduce",
        avg_us: float | None = None,
    ) -> Self:
        """Build a row from per-iteration times (already max-over-ranks).

        ``time_us`` is ``avg_us`` when given (nccl-tests' back-to-back
        average), else the median of the samples; algbw = size / time (GB = 1e9);
        busbw = algbw * :func:`busbw_factor`.
        """
        stats = latency_stats(samples_us)
        time_us = stats["p50"] if avg_us is None else float(avg_us)
        algbw = _algbw(size_bytes, time_us)
        return cls(
            path=path,
            workers=workers,
            size_bytes=size_bytes,
            count=size_bytes // dtype_itemsize(dtype),
            dtype=dtype,
            redop=redop,
            time_us=time_us,
            algbw_gbps=algbw,
            busbw_gbps=algbw * busbw_factor(collective, workers),
            wrong=int(wrong),
            p50_us=stats["p50"],
            p99_us=stats["p99"],
            min_us=stats["min"],
            max_us=stats["max"],
            copies=copies,
            encodes=encodes,
            crossings=crossings,
            hops=hops,
            chunks=chunks,
            note=note,
            avg_us=None if avg_us is None else float(avg_us),
            samples_us=[float(v) for v in samples_us],
        )

    @classmethod
    def unavailable(
        cls,
        path: str,
        workers: int,
        size_bytes: int,
        dtype: str,
        note: str,
        redop: str = "sum",
    ) -> Self:
        """A row that records why a path did not run (never a silent skip)."""
        try:
            count = size_bytes // dtype_itemsize(dtype)
        except ValueError:
            count = 0
        return cls(
            path=path, workers=workers, size_bytes=size_bytes, count=count, dtype=dtype,
            redop=redop, note=note,
        )


def add_inplace_half(row: AllreduceRow, per_rank: Sequence[dict[str, Any]] | None,
                     check: bool, collective: str = "allreduce") -> AllreduceRow:
    """Fill the ``inplace_*`` fields of ``row`` from every rank's in-place half
    (``{"times_us", "wrong", "avg_us"}``; max over ranks per iteration, the slowest
    rank's average, wrong elements summed). None: no in-place half."""
    if not per_rank:
        return row
    samples = np.max(np.array([r["times_us"] for r in per_rank]), axis=0).tolist()
    stats = latency_stats(samples)
    avgs = [r.get("avg_us") for r in per_rank]
    t = stats["p50"] if None in avgs else max(float(a) for a in avgs if a is not None)
    algbw = _algbw(row.size_bytes, t)
    row.inplace_time_us = t
    row.inplace_algbw_gbps = algbw
    row.inplace_busbw_gbps = algbw * busbw_factor(collective, row.workers)
    row.inplace_wrong = sum(int(r["wrong"]) for r in per_rank) if check else -1
    row.inplace_p50_us, row.inplace_p99_us = stats["p50"], stats["p99"]
    return row


@dataclasses.dataclass
class CollectiveRow(AllreduceRow):
    """A row of `semfab bench <collective>`: an :class:`AllreduceRow` that also names
    its ``collective`` and ``root`` (-1: none, as nccl-tests prints it).

    ``size_bytes`` and ``count`` follow nccl-tests (see :mod:`bench.nccl`): the
    larger buffer in bytes, and the per-rank count; ``redop`` is ``"none"`` for
    a collective that does not reduce.
    """

    collective: str = "allreduce"
    root: int = -1


def _algbw(size_bytes: int, time_us: float) -> float:
    return size_bytes / time_us / 1e3 if time_us > 0 else math.inf  # B/us -> GB/s


def _row_key(row: AllreduceRow) -> tuple[str, int, str, str, int]:
    return (row.path, row.workers, row.dtype, row.redop, row.size_bytes)


def merge_runs(runs: Sequence[Sequence[AllreduceRow]],
               collective: str = "allreduce") -> list[AllreduceRow]:
    """One row per (path, workers, dtype, op, size) from K independent runs.

    ``time_us`` is the median of the runs' times (each run's own median), with
    ``time_min_us``/``time_max_us`` the spread over runs; algbw and busbw
    follow from that median; p50/p99/min/max are over every run's samples
    together. Wrong elements add up over runs, a run that failed counts in
    ``failed_runs`` (and its note is kept), so a row is failed when any run
    was. Order: first appearance.
    """
    groups: dict[tuple[str, int, str, str, int], list[AllreduceRow]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault(_row_key(r), []).append(r)
    out: list[AllreduceRow] = []
    for group in groups.values():
        first = group[0]
        ran = [r for r in group if r.ran and r.time_us is not None]
        failed = [r for r in group if r.status == "failed"]
        notes: list[str] = []
        for r in group:
            if r.note and r.note not in notes:
                notes.append(r.note)
        if not ran:
            merged = dataclasses.replace(first, runs=len(group), failed_runs=len(failed),
                                         note="; ".join(notes))
            out.append(merged)
            continue
        times = [r.time_us for r in ran if r.time_us is not None]
        median = float(np.median(times))
        samples = [s for r in ran for s in (r.samples_us or [r.time_us or 0.0])]
        stats = latency_stats(samples)
        algbw = _algbw(first.size_bytes, median)
        checked = [r.wrong for r in ran if r.wrong >= 0]
        avgs = [r.avg_us for r in ran if r.avg_us is not None]
        ip = [r for r in ran if r.inplace_time_us is not None]
        ip_kw: dict[str, Any] = {}
        if ip:
            ip_t = float(np.median([r.inplace_time_us for r in ip]))
            ip_bw = _algbw(first.size_bytes, ip_t)
            ip_wrong = [r.inplace_wrong for r in ip if r.inplace_wrong >= 0]
            ip_kw = dict(inplace_time_us=ip_t, inplace_algbw_gbps=ip_bw,
                         inplace_busbw_gbps=ip_bw * busbw_factor(collective, first.workers),
                         inplace_wrong=sum(ip_wrong) if ip_wrong else -1,
                         inplace_p50_us=float(np.median([r.inplace_p50_us or 0.0 for r in ip])),
                         inplace_p99_us=max(r.inplace_p99_us or 0.0 for r in ip))
        out.append(dataclasses.replace(
            ran[0],
            time_us=median,
            algbw_gbps=algbw,
            busbw_gbps=algbw * busbw_factor(collective, first.workers),
            wrong=sum(checked) if checked else -1,
            p50_us=stats["p50"],
            p99_us=stats["p99"],
            min_us=stats["min"],
            max_us=stats["max"],
            note="; ".join(notes),
            runs=len(group),
            time_min_us=min(times),
            time_max_us=max(times),
            failed_runs=len(failed),
            avg_us=float(np.median(avgs)) if avgs else None,
            samples_us=samples,
            **ip_kw,
        ))
    return out


def failures(rows: Iterable[AllreduceRow]) -> list[AllreduceRow]:
    """The rows that failed (wrong elements, an error, a failed run)."""
    return [r for r in rows if r.status == "failed"]


# --------------------------------------------------------------------------
# Markdown table
# --------------------------------------------------------------------------


def _fmt_time(us: float | None) -> str:
    if us is None:
        return "—"
    return f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def _fmt_bw(gbps: float | None) -> str:
    if gbps is None:
        return "—"
    if not math.isfinite(gbps):
        return "inf"
    # nccl-tests prints two decimals; below 1 GB/s three significant digits keep
    # small sizes readable (0.000137, not 0.000).
    return f"{gbps:.2f}" if gbps >= 1 else f"{gbps:.3g}"


def _fmt_counters(row: AllreduceRow) -> str:
    parts = (row.copies, row.encodes, row.crossings, row.hops)
    if all(p is None for p in parts):
        return "—"
    return "/".join("?" if p is None else str(p) for p in parts)


def _fmt_wrong(row: AllreduceRow) -> str:
    if not row.ran:
        return "—"
    return "N/A" if row.wrong < 0 else str(row.wrong)


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]],
                    left: Container[str] = ()) -> list[str]:
    """The lines of a GitHub Markdown (pipe) table of ``rows`` under ``head``.

    Cells are written as given (already formatted: no number is reparsed);
    columns are right-aligned, as numbers are, except those named in ``left``.
    """
    from tabulate import tabulate  # only here: keeps the module cheap to import

    def cell(text: str) -> str:  # a | or a newline would end the cell or the row
        return text.replace("|", "\\|").replace("\n", " ")

    return tabulate([[cell(c) for c in r] for r in rows], [cell(h) for h in head],
                    tablefmt="pipe", disable_numparse=True,
                    colalign=["left" if h in left else "right" for h in head]).splitlines()


def _groups(rows: Iterable[AllreduceRow]) -> dict[tuple[str, int], list[AllreduceRow]]:
    """Rows keyed by (path, workers), in order of first appearance."""
    groups: dict[tuple[str, int], list[AllreduceRow]] = {}
    for row in rows:
        groups.setdefault((row.path, row.workers), []).append(row)
    return groups


def format_allreduce_table(rows: Iterable[AllreduceRow]) -> str:
    """Markdown tables in the nccl-tests spirit, one per (path, workers).

    Each table lists the sizes in increasing order; a row that did not run
    shows dashes and its note. Under each table, in a text block so that the
    ``#`` lines are not read as Markdown headings, come the nccl-tests footer
    lines ``# Out of bounds values : OK|FAILED`` and ``# Avg bus bandwidth``.
    """
    header = [
        "size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
        "#wrong", "p50(us)", "p99(us)", "copies/encodes/crossings/hops",
    ]
    out: list[str] = []
    for (path, workers), group in _groups(rows).items():
        group = sorted(group, key=lambda r: r.size_bytes)
        with_note = any(r.note for r in group)
        cols = header + (["note"] if with_note else [])
        out.append(f"### {path} — {workers} worker{'s' if workers != 1 else ''}")
        out.append("")
        cells = [[
            str(r.size_bytes), str(r.count), r.dtype, r.redop, _fmt_time(r.time_us),
            _fmt_bw(r.algbw_gbps), _fmt_bw(r.busbw_gbps), _fmt_wrong(r),
            _fmt_time(r.p50_us), _fmt_time(r.p99_us), _fmt_counters(r),
        ] + ([r.note] if with_note else []) for r in group]
        out += markdown_table(cols, cells, left=("type", "redop", "note"))
        ran = [r for r in group if r.ran and r.busbw_gbps is not None]
        failed = any(r.wrong > 0 for r in group)
        avg = (
            f"{sum(r.busbw_gbps for r in ran if r.busbw_gbps is not None) / len(ran):.4g}"
            if ran else "N/A (no size ran)"
        )
        out.append("")
        out.append("```text")
        out.append(f"# Out of bounds values : {'FAILED' if failed else 'OK'}")
        out.append(f"# Avg bus bandwidth    : {avg}")
        out.append("```")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


# --------------------------------------------------------------------------
# Plain text, nccl-tests layout (printed as rows finish)
# --------------------------------------------------------------------------

# (title, unit, width); numbers right-aligned, the note last and free.
_TEXT_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("size", "(B)", 12),
    ("count", "(elements)", 12),
    ("type", "", 9),
    ("redop", "", 6),
    ("path", "", 12),
    ("workers", "", 8),
    ("time", "(us)", 11),
    ("algbw", "(GB/s)", 9),
    ("busbw", "(GB/s)", 9),
    ("#wrong", "", 7),
    ("p50", "(us)", 11),
    ("p99", "(us)", 11),
    ("in:time", "(us)", 11),
    ("in:algbw", "(GB/s)", 9),
    ("in:busbw", "(GB/s)", 9),
    ("in:#wrong", "", 10),
)


#: nccl-tests' root column (broadcast, reduce), after the redop.
_ROOT_COLUMN = ("root", "", 6)


def _text_columns(root: bool) -> tuple[tuple[str, str, int], ...]:
    if not root:
        return _TEXT_COLUMNS
    return (*_TEXT_COLUMNS[:4], _ROOT_COLUMN, *_TEXT_COLUMNS[4:])


def _cells_line(cells: Sequence[str], first: str = " ", root: bool = False) -> str:
    parts = []
    for (title, _unit, width), cell in zip(_text_columns(root), cells, strict=True):
        # the path is a name: left-aligned, like nccl-tests' type and redop are not
        parts.append("  " + cell.ljust(width - 2) if title == "path" else cell.rjust(width))
    return first + "".join(parts)


def format_text_header(root: bool = False) -> str:
    """The two ``#`` lines naming the columns of :func:`format_text_row` (``root``:
    with nccl-tests' root column, for broadcast and reduce)."""
    cols = _text_columns(root)
    titles = _cells_line([c[0] for c in cols], "#", root) + "  note"
    units = _cells_line([c[1] for c in cols], "#", root)
    return titles + "\n" + units.rstrip()


def format_text_row(row: AllreduceRow, root: bool = False) -> str:
    """One fixed-width line of a row (nccl-tests layout); a row that did not run
    shows dashes and its note. ``root``: with the root column (the row's ``root``)."""
    dash = "-"
    wrong = _fmt_wrong(row).replace("—", dash)
    main = [_fmt_time(row.time_us).replace("—", dash),
            _fmt_bw(row.algbw_gbps).replace("—", dash),
            _fmt_bw(row.busbw_gbps).replace("—", dash), wrong]
    if row.place == "in":  # --inplace 1: the main fields are the in-place half
        out_half, in_half = [dash] * 4, main
    else:
        out_half = main
        ip_wrong = dash if row.inplace_time_us is None or row.inplace_wrong < 0 \
            else str(row.inplace_wrong)
        in_half = [_fmt_time(row.inplace_time_us).replace("—", dash),
                   _fmt_bw(row.inplace_algbw_gbps).replace("—", dash),
                   _fmt_bw(row.inplace_busbw_gbps).replace("—", dash), ip_wrong]
    cells = [
        str(row.size_bytes), str(row.count), row.dtype, row.redop, row.path, str(row.workers),
        *out_half,
        _fmt_time(row.p50_us).replace("—", dash), _fmt_time(row.p99_us).replace("—", dash),
        *in_half,
    ]
    if root:
        cells.insert(4, str(getattr(row, "root", -1)))
    line = _cells_line(cells, root=root)
    if row.status == "failed" and ((row.ran and row.wrong > 0) or row.inplace_wrong > 0):
        line += "  FAILED: wrong elements"
    if row.note:
        line += "  " + row.note.replace("\n", " ")
    return line


def _spread(row: AllreduceRow) -> str:
    if row.runs <= 1 or row.time_min_us is None or row.time_max_us is None:
        return ""
    return f"{_fmt_time(row.time_min_us)}..{_fmt_time(row.time_max_us)}"


def format_side_by_side(rows: Iterable[AllreduceRow], markdown: bool = False,
                        marks: dict[str, str] | None = None) -> str:
    """Every path at each size, side by side: one table per (workers, dtype, op).

    Per path the busbw (GB/s) and the time (us); rows merged from several runs
    add the spread of the time over runs (min..max). ``marks`` puts a marker
    after a path's name (e.g. ``{"gloo": "*"}``, explained by the caller). The
    last line of each table is the average busbw of each path (nccl-tests'
    "Avg bus bandwidth", per path). ``markdown`` gives Markdown tables.
    """
    marks = marks or {}
    tables: dict[tuple[int, str, str], dict[str, dict[int, AllreduceRow]]] = {}
    for r in rows:
        by_path = tables.setdefault((r.workers, r.dtype, r.redop), {})
        by_path.setdefault(r.path, {})[r.size_bytes] = r
    out: list[str] = []
    for (workers, dtype, redop), by_path in tables.items():
        paths = list(by_path)
        sizes = sorted({s for per in by_path.values() for s in per})
        spread = any(r.runs > 1 for per in by_path.values() for r in per.values())
        sub = ["busbw", "time"] + (["spread"] if spread else [])
        unit = {"busbw": "(GB/s)", "time": "(us)", "spread": "(us, runs)"}
        what = dtype if redop == "none" else f"{dtype} {redop}"  # a collective that copies
        title = (f"{workers} worker{'s' if workers != 1 else ''}, {what}: busbw and "
                 "time per path" + (" (time: median over runs, spread min..max)"
                                    if spread else ""))
        table: list[list[str]] = []
        for size in sizes:
            line = [str(size)]
            for path in paths:
                cell = by_path[path].get(size)
                if cell is None or not cell.ran:
                    line += ["-"] * len(sub)
                    continue
                line += [_fmt_bw(cell.busbw_gbps), _fmt_time(cell.time_us)]
                if spread:
                    line.append(_spread(cell) or "-")
            table.append(line)
        avg = ["avg busbw"]
        for path in paths:
            ran = [r.busbw_gbps for r in by_path[path].values()
                   if r.ran and r.busbw_gbps is not None and math.isfinite(r.busbw_gbps)]
            avg += [_fmt_bw(sum(ran) / len(ran)) if ran else "-"] + [""] * (len(sub) - 1)
        if markdown:
            head = ["size(B)"] + [f"{p}{marks.get(p, '')} {c}{unit[c]}" for p in paths
                                  for c in sub]
            out.append(f"#### {title}")
            out.append("")
            out += markdown_table(head, [*table, avg])
            out.append("")
            continue
        widths = {"busbw": 10, "time": 11, "spread": 18}
        group_w = sum(widths[c] for c in sub)
        out.append(f"# {title}")
        out.append("#" + " " * 11 + "".join(
            f"{(p + marks.get(p, '')):>{group_w}s}" for p in paths))
        out.append("#" + f"{'size(B)':>11s}" + "".join(
            f"{c:>{widths[c]}s}" for _ in paths for c in sub))
        out.append("#" + " " * 11 + "".join(
            f"{unit[c]:>{widths[c]}s}" for _ in paths for c in sub))
        for line in table:
            cells = iter(line[1:])
            out.append(" " + f"{line[0]:>11s}" + "".join(
                f"{next(cells):>{widths[c]}s}" for _ in paths for c in sub))
        cells = iter(avg[1:])
        out.append("#" + f"{'avg busbw':>11s}" + "".join(
            f"{next(cells):>{widths[c]}s}" for _ in paths for c in sub).rstrip())
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def format_footer(rows: Sequence[AllreduceRow], elapsed_s: float | None = None) -> list[str]:
    """nccl-tests' closing lines, with every failure named.

    ``# Out of bounds values : OK|FAILED`` (wrong elements anywhere),
    ``# Avg bus bandwidth`` (mean busbw of every row that ran, as nccl-tests
    averages its sizes), then a count of rows, failed and unavailable, and one
    line per failed row saying why.
    """
    ran = [r for r in rows if r.ran and r.busbw_gbps is not None
           and math.isfinite(r.busbw_gbps)]
    wrong = [r for r in rows if (r.ran and r.wrong > 0) or r.inplace_wrong > 0]
    failed = failures(rows)
    unavailable = [r for r in rows if r.status == "unavailable"]
    avg = (f"{sum(r.busbw_gbps or 0.0 for r in ran) / len(ran):.4g}  (GB/s, mean over "
           f"{len(ran)} rows that ran)" if ran else "N/A (no row ran)")
    oob = "OK" if not wrong else f"FAILED ({len(wrong)} row{'s' if len(wrong) != 1 else ''} " \
        "with wrong elements)"
    lines = [f"# Out of bounds values : {oob}", f"# Avg bus bandwidth    : {avg}"]
    took = f" in {elapsed_s:.1f} s" if elapsed_s is not None else ""
    lines.append(f"# {len(rows)} rows{took}: {len(rows) - len(failed) - len(unavailable)} ok, "
                 f"{len(failed)} failed, {len(unavailable)} unavailable")
    for r in failed:
        why = []
        if r.ran and r.wrong > 0:
            half = "in-place" if r.place == "in" else "out-of-place" \
                if r.inplace_time_us is not None else ""
            why.append(f"{r.wrong} wrong elements" + (f" ({half})" if half else ""))
        if r.inplace_wrong > 0:
            why.append(f"{r.inplace_wrong} wrong elements (in-place)")
        if r.failed_runs and r.runs > 1:
            why.append(f"failed in {r.failed_runs} of {r.runs} runs")
        if r.note and not (r.ran and r.wrong > 0 and not r.failed_runs):
            why.append(r.note)
        lines.append(f"# FAILED: {r.path} x{r.workers} {format_size(r.size_bytes)} {r.dtype} "
                     f"{r.redop}: {'; '.join(why) or 'failed'}")
    return lines


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """Turn NaN/inf into None and NumPy scalars/arrays and dataclasses into JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return _jsonable(to_dict() if callable(to_dict) else dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/Infinity
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(
    path: str | Path,
    kind: str,
    results: Sequence[dict[str, Any] | Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``{"env": environment(), "kind": kind, "results": [...]}`` (+ ``extra``).

    ``extra`` keys are added at the top level (e.g. the sweep parameters); they
    may not replace env, kind or results. Rows may be dicts or dataclasses
    (:class:`AllreduceRow`). The output is strict JSON (NaN becomes null).
    """
    doc: dict[str, Any] = {"env": environment(), "kind": kind, "results": list(results)}
    for key, value in (extra or {}).items():
        if key in doc:
            raise ValueError(f"write_json: extra key {key!r} would replace a reserved key")
        doc[key] = value
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_jsonable(doc), indent=2, allow_nan=False)
    out.write_text(text + "\n", encoding="utf-8")
    return out


def write_markdown(path: str | Path, text: str) -> Path:
    """Write Markdown text (ending in a newline), creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return out


# --------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------


#: Line styles per worker count (the first count solid, the next dashed, ...).
LINE_STYLES = ("-", "--", ":", "-.")


def plot_busbw(rows: Iterable[AllreduceRow], path: str | Path, title: str) -> Path:
    """PNG of two panels against size (log2 x axis): bus bandwidth (left) and
    latency, the row's ``time`` (right, log y), one line per (path, workers).

    A path keeps its colour in both panels and a worker count its line style
    (:data:`LINE_STYLES`), so counts stay apart where colours repeat. Rows that
    did not run are not plotted; the (path, workers) groups that had any are
    listed under the plot with their first note, so a missing line is explained
    rather than silently absent. Returns the path; the figure's axes are
    ``busbw`` then ``latency`` (see :func:`busbw_figure`).
    """
    fig = busbw_figure(rows, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def busbw_figure(rows: Iterable[AllreduceRow], title: str) -> Any:
    """The figure :func:`plot_busbw` writes (a matplotlib Figure, Agg canvas)."""
    # The object-oriented API with the Agg canvas never touches pyplot's
    # global backend, so it is safe in any process (headless, threads, tests).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    rows = list(rows)
    fig = Figure(figsize=(13, 5), dpi=110)
    FigureCanvasAgg(fig)
    bw_ax = fig.add_subplot(1, 2, 1)
    lat_ax = fig.add_subplot(1, 2, 2)
    counts = sorted({r.workers for r in rows})
    style = {w: LINE_STYLES[i % len(LINE_STYLES)] for i, w in enumerate(counts)}
    colours: dict[str, str] = {}
    from matplotlib import rcParams

    cycle = [c["color"] for c in rcParams["axes.prop_cycle"]]
    missing: list[str] = []
    plotted = 0
    for (name, workers), group in _groups(rows).items():
        ran = sorted((r for r in group if r.ran and r.busbw_gbps is not None),
                     key=lambda r: r.size_bytes)
        skipped = [r for r in group if not r.ran]
        if skipped:
            note = skipped[0].note or "did not run"
            if len(note) > 90:
                note = note[:87] + "..."
            missing.append(f"{name} ×{workers}: {note}")
        if ran:
            colour = colours.setdefault(name, cycle[len(colours) % len(cycle)])
            kw: dict[str, Any] = dict(marker="o", color=colour, linestyle=style[workers],
                                      label=f"{name} ×{workers}")
            sizes = [r.size_bytes for r in ran]
            bw_ax.plot(sizes, [r.busbw_gbps or 0.0 for r in ran], **kw)
            lat_ax.plot(sizes, [r.time_us or 0.0 for r in ran], **kw)
            plotted += 1
    for ax in (bw_ax, lat_ax):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_size(int(round(x)))))
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    bw_ax.set_ylabel("bus bandwidth (GB/s, GB = 1e9)")
    bw_ax.set_title(title)
    lat_ax.set_ylabel("time (us)")
    lat_ax.set_title("latency: time against size")
    if plotted:
        lat_ax.set_yscale("log")
        bw_ax.legend(loc="best", fontsize="small")
    else:
        for ax in (bw_ax, lat_ax):
            ax.text(0.5, 0.5, "no path ran", ha="center", va="center", transform=ax.transAxes)
    if missing:
        text = "not plotted:\n" + "\n".join(missing)
        fig.text(0.01, 0.01, text, fontsize="x-small", va="bottom", ha="left", wrap=True)
        fig.subplots_adjust(bottom=0.14 + 0.035 * len(missing))
    return fig


# --------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------


class ProgressTask(Protocol):
    """What :func:`progress` yields."""

    def advance(self, steps: float = 1) -> None:
        """Mark ``steps`` units of work done."""

    def describe(self, description: str) -> None:
        """Change the text shown beside the bar."""


class _SilentTask:
    """No-op stand-in used when no bar should be drawn."""

    def advance(self, steps: float = 1) -> None:
        pass

    def describe(self, description: str) -> None:
        pass


class _RichTask:
    """Adapter from a rich Progress task to :class:`ProgressTask`."""

    def __init__(self, bar: Any, task_id: Any) -> None:
        self._bar = bar
        self._task_id = task_id

    def advance(self, steps: float = 1) -> None:
        self._bar.advance(self._task_id, steps)

    def describe(self, description: str) -> None:
        self._bar.update(self._task_id, description=description)


def _progress_enabled() -> bool:
    if os.environ.get("SEMFAB_NO_PROGRESS", "") not in ("", "0"):
        return False
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


@contextlib.contextmanager
def progress(total: float, description: str) -> Iterator[ProgressTask]:
    """A progress bar for ``total`` units of work, as a context manager.

    Silent when stdout is not a terminal (CI logs, redirected JSON) or when
    ``SEMFAB_NO_PROGRESS=1``. The bar is transient: it disappears when done
    so it never interleaves with the tables printed afterwards.
    """
    if not _progress_enabled():
        yield _SilentTask()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        yield _RichTask(bar, bar.add_task(description, total=total))
