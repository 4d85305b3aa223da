"""`semfab bench frames`: what the frame codec costs, beside msgpack.

For each payload size the same fields are (a) encoded as a semfab header and
decoded back, with and without CRC32C, and (b) packed as a msgpack map with the
payload as a bin field and unpacked back — the "here is a message, please parse
it" way. Reported: frames/s for encode+decode (median of repetitions, all in
one run so the ratio is meaningful) and header overhead as a share of the
bytes on the wire.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgpack

from fabric.core import frame as fr
from fabric.errors import UsageError

DEFAULT_SIZES = (0, 256, 4096, 65536)


@dataclass(frozen=True)
class FrameBenchRow:
    """One (format, payload size) measurement."""

    format: str
    payload_bytes: int
    wire_bytes: int
    overhead_pct: float
    frames_per_s: float
    ns_per_frame: float


def _fields(payload: bytes) -> dict[str, object]:
    return dict(
        src=3, dst=17, job=2, flow=5, psn=123456, key=0xA1B2C3D4, offset=65536, msg=77,
        dtype=fr.DType.F32 if len(payload) % 4 == 0 else fr.DType.RAW, payload=payload,
    )


def _time_loop(fn: Callable[[], object], iters: int, reps: int) -> float:
    """Median seconds per call over ``reps`` runs of ``iters`` calls."""
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per_call.append((time.perf_counter() - t0) / iters)
    return statistics.median(per_call)


def measure(
    sizes: tuple[int, ...] = DEFAULT_SIZES, iters: int = 20000, reps: int = 5
) -> list[FrameBenchRow]:
    """Measure every format at every size; returns rows in a stable order."""
    rows: list[FrameBenchRow] = []
    for size in sizes:
        payload = bytes((i * 7) & 0xFF for i in range(size))
        fields = _fields(payload)
        for crc in (False, True):
            # Two-part form, as on ZeroMQ: the payload is never copied.
            def semfab_rt(fields: dict[str, object] = fields, crc: bool = crc) -> object:
                header = fr.encode_header(fr.Op.REDUCE, crc=crc, **fields)  # type: ignore[arg-type]
                return fr.decode(header, fields["payload"])

            header = fr.encode_header(fr.Op.REDUCE, crc=crc, **fields)  # type: ignore[arg-type]
            wire = len(header) + size
            sec = _time_loop(semfab_rt, iters, reps)
            rows.append(
                FrameBenchRow(
                    "semfab+crc32c" if crc else "semfab", size, wire,
                    100.0 * len(header) / wire, 1.0 / sec, sec * 1e9,
                )
            )
        mp_fields = {k: (int(v) if isinstance(v, int) else v) for k, v in fields.items()}
        mp_fields["op"] = int(fr.Op.REDUCE)
        mp_fields["flags"] = 0

        def msgpack_rt(mp_fields: dict[str, object] = mp_fields) -> object:
            return msgpack.unpackb(msgpack.packb(mp_fields))

        packed = msgpack.packb(mp_fields)
        sec = _time_loop(msgpack_rt, iters, reps)
        rows.append(
            FrameBenchRow(
                "msgpack-dict", size, len(packed),
                100.0 * (len(packed) - size) / len(packed), 1.0 / sec, sec * 1e9,
            )
        )
    return rows


def format_table(rows: list[FrameBenchRow]) -> str:
    """Markdown table; the ratio column compares each format with msgpack at that size."""
    from bench.report import markdown_table

    by_size = {r.payload_bytes: r for r in rows if r.format == "msgpack-dict"}
    head = ["format", "payload (B)", "wire (B)", "header overhead", "encode+decode (frames/s)",
            "ns/frame", "vs msgpack"]
    cells = [[r.format, str(r.payload_bytes), str(r.wire_bytes), f"{r.overhead_pct:.2f}%",
              f"{r.frames_per_s:,.0f}", f"{r.ns_per_frame:,.0f}",
              f"{r.frames_per_s / by_size[r.payload_bytes].frames_per_s:.2f}x"] for r in rows]
    return "\n".join(markdown_table(head, cells, left=("format",)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """CLI flags for `semfab bench frames`."""
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="payload sizes in bytes, comma-separated (default: %(default)s)")
    p.add_argument("-n", "--iters", type=int, default=20000,
                   help="encode+decode calls per repetition (default: %(default)s)")
    p.add_argument("-r", "--reps", type=int, default=5,
                   help="repetitions; the median is reported (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")


def run(args: argparse.Namespace) -> int:
    """Entry point for `semfab bench frames`."""
    from bench import report

    try:
        sizes = tuple(report.parse_size(s) for s in args.sizes.split(",") if s.strip())
    except ValueError as exc:
        raise UsageError(f"--sizes: {exc}") from None
    if args.iters < 1 or args.reps < 1:
        raise UsageError("--iters and --reps must be at least 1")
    if sizes and max(sizes) > fr.MAX_PAYLOAD:
        raise UsageError(f"--sizes: a frame carries at most {fr.MAX_PAYLOAD} bytes")
    if sizes:
        report.check_memory("--sizes", 4 * max(sizes))  # payload, frame and two decodes
    from fabric.emulation.launch_cli import check_outputs

    check_outputs(args, ("json", "markdown"))  # before the run, not after it
    rows = measure(sizes, args.iters, args.reps)
    table = format_table(rows)
    print(table)
    if args.json:
        report.write_json(args.json, "frames", [asdict(r) for r in rows])
    if args.markdown:
        report.write_markdown(args.markdown, table + "\n")
    return 0
