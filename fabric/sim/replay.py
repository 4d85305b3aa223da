"""Play a recorded training step (:func:`fabric.torch.record`) in simulation at
any number of ranks::

    semfab sim replay step.json --workers 64,256 [--topology F] [--json out.json]

Every rank runs the recorded operations in order, timing-only, on a leaf/spine
fabric (or the topology file), keeping the recorded compute gaps between them
(``--no-compute`` drops them). How sizes scale from the recorded group size W
to the new one W' (the data-parallel degree; groups smaller than the recorded
world keep their size and are tiled over the ranks):

* allreduce, broadcast, reduce, gather, scatter: the same per-rank count;
* all_gather, reduce_scatter (FSDP's shards): the same whole tensor, so each
  rank's shard shrinks to ceil(count x W / W');
* alltoall(v) (expert parallelism): the same count sent per rank, spread
  evenly over the W' ranks (the recorded unevenness is not kept).

The table gives, per operation kind, how many ran, the bytes each rank gave
them, and their share of the simulated step.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from fabric.core.collective_programs import COLLECTIVES
from fabric.errors import UsageError

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "load_trace", "replay", "scaled_ops", "run"]

#: What fabric.torch.record() writes, and this module reads.
TRACE_FORMAT = "semfab-torch-trace"
TRACE_VERSION = 1

_SHARDED = ("all_gather", "reduce_scatter")
_KINDS = ("allreduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall",
          "alltoallv", "gather", "scatter", "barrier")
#: Dtype sizes of the registry's names (a trace names the fabric's dtypes).
_ITEM = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace written by ``fabric.torch.record()``; UsageError saying what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"trace {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UsageError(f"trace {path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
        raise UsageError(f"trace {path}: not a trace written by fabric.torch.record()")
    ops = doc.get("ops")
    world = doc.get("world")
    if not isinstance(ops, list) or not isinstance(world, int) or world < 1 or not all(
            isinstance(o, dict) and isinstance(o.get("kind"), str)
            and isinstance(o.get("count"), int) for o in ops):
        raise UsageError(f"trace {path}: malformed (needs world and a list of ops with kind "
                         "and count)")
    return doc


def scaled_ops(doc: dict[str, Any], workers: int) -> list[dict[str, Any]]:
    """The trace's operations at ``workers`` ranks (see the module doc): each with
    ``count`` (this rank's input elements), ``size`` (its group's size) and
    ``block`` (None: every rank; else its group's size, tiled)."""
    world = int(doc["world"])
    out = []
    for op in doc["ops"]:
        kind = op["kind"]
        if kind not in _KINDS:
            raise UsageError(f"trace operation {kind!r} cannot be replayed")
        group = op.get("group") or list(range(world))
        recorded = len(group)
        whole = recorded == world
        size = workers if whole else recorded
        if not whole and workers % recorded:
            raise UsageError(f"a group of {recorded} ranks cannot tile {workers} workers; "
                             f"give a multiple of {recorded}")
        count = int(op["count"])
        new: dict[str, Any] = {"kind": kind, "dtype": op.get("dtype", "float32"),
                               "path": op.get("path"), "op": op.get("op", "sum"),
                               "root": min(int(op.get("root", 0)), size - 1),
                               "size": size, "block": None if whole else recorded,
                               "gap_s": float(op.get("gap_s", 0.0))}
        if kind == "all_gather":
            new["count"] = max(math.ceil(count * recorded / size), 1)
        elif kind == "reduce_scatter":
            new["count"] = size * max(math.ceil(count / size), 1)
        elif kind in ("alltoall", "alltoallv"):
            per = count // size
            new.update(kind="alltoallv", count=per * size, counts=[per] * size)
        else:
            new["count"] = count
        if new["dtype"] not in _ITEM:
            new["dtype"] = "float32"
        out.append(new)
    return out


def _workload(ctx: Any, ops: list[dict[str, Any]], compute: bool,
              path: str | None) -> Generator[Any, Any, list[tuple[str, float]]]:
    groups: dict[int, Any] = {}
    timings: list[tuple[str, float]] = []
    for op in ops:
        group = None
        if op["block"] is not None:
            k = op["block"]
            if k not in groups:
                base = ctx.rank - ctx.rank % k
                groups[k] = yield ctx.group(range(base, base + k))
            group = groups[k]
        if compute and op["gap_s"] > 0:
            yield ctx.compute(op["gap_s"])
        t0 = yield ctx.clock()
        kind = op["kind"]
        if kind == "barrier":
            yield ctx.barrier(group)
        elif kind == "allreduce":
            p = path or op["path"] or "ina"
            yield ctx.allreduce(None, op=op["op"], path=p, count=op["count"],
                                dtype=op["dtype"], group=group)
        else:
            p = path if path in ("ina", "host-ring") else None
            if p not in COLLECTIVES[kind]:
                p = op["path"] if op["path"] in COLLECTIVES[kind] else None
            yield ctx.collective(kind, None, path=p, op=op["op"], root=op["root"],
                                 group=group, count=op["count"], dtype=op["dtype"],
                                 send_counts=op.get("counts"), recv_counts=op.get("counts"))
        t1 = yield ctx.clock()
        timings.append((kind, t1 - t0))
    return timings


def _topology(workers: int, args: argparse.Namespace) -> Any:
    from fabric.core.topology import TopologyError, leaf_spine, load, star

    if args.topology:
        try:
            topo = load(args.topology)
        except (OSError, TopologyError) as exc:
            raise UsageError(f"--topology {args.topology}: {exc}") from None
        if len(topo.workers) != workers:
            raise UsageError(f"--topology {args.topology} has {len(topo.workers)} workers, "
                             f"not {workers}")
        return topo
    if workers <= args.per_leaf:
        return star(workers, bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us)
    if workers % args.per_leaf:
        raise UsageError(f"--workers {workers} is not a multiple of --per-leaf {args.per_leaf}")
    return leaf_spine(workers // args.per_leaf, args.per_leaf,
                      leaf_bandwidth_gbps=args.bandwidth_gbps,
                      leaf_latency_us=args.latency_us, spine_latency_us=args.latency_us)


def replay(doc: dict[str, Any], workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One simulated step of trace ``doc`` at ``workers`` ranks: its row."""
    from fabric.sim import Simulation

    ops = scaled_ops(doc, workers)
    wall = time.monotonic()
    res = Simulation(_topology(workers, args)).run(_workload, ops, args.compute, args.path)
    timings: list[tuple[str, float]] = res.results[0]
    kinds: dict[str, dict[str, float]] = {}
    for op, (kind, seconds) in zip(ops, timings, strict=True):
        row = kinds.setdefault(kind, {"calls": 0, "bytes_per_rank": 0, "seconds": 0.0})
        row["calls"] += 1
        row["bytes_per_rank"] += op["count"] * _ITEM[op["dtype"]]
        row["seconds"] += seconds
    compute = sum(op["gap_s"] for op in ops) if args.compute else 0.0
    return {"workers": workers, "step_s": res.end_s, "compute_s": compute,
            "ops": len(ops), "by_kind": kinds, "sim_wall_s": time.monotonic() - wall,
            "events": res.events}


def _table(doc: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# replay of a {doc['world']}-rank trace ({len(doc['ops'])} operations), "
             "simulated",
             f"{'workers':>8} {'kind':>15} {'calls':>6} {'MB/rank':>9} {'time (ms)':>10} "
             f"{'share':>6}"]
    for row in rows:
        step = row["step_s"]
        for kind, k in sorted(row["by_kind"].items()):
            lines.append(f"{row['workers']:>8} {kind:>15} {int(k['calls']):>6} "
                         f"{k['bytes_per_rank'] / 1e6:>9.3f} {k['seconds'] * 1e3:>10.3f} "
                         f"{k['seconds'] / step if step else 0:>6.1%}")
        lines.append(f"{row['workers']:>8} {'step':>15} {row['ops']:>6} {'':>9} "
                     f"{step * 1e3:>10.3f}   (compute {row['compute_s'] * 1e3:.3f} ms; "
                     f"simulated in {row['sim_wall_s']:.1f} s)")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the replay."""
    p.add_argument("trace", help="a trace written by fabric.torch.record()")
    p.add_argument("--workers", required=True,
                   help="ranks to replay at, comma-separated (e.g. 64,1024)")
    p.add_argument("--topology", help="a topology file (default: star up to --per-leaf "
                   "workers, else leaf/spine)")
    p.add_argument("--per-leaf", type=int, default=32, help="workers per leaf switch")
    p.add_argument("--bandwidth-gbps", type=float, default=100.0, help="link bandwidth")
    p.add_argument("--latency-us", type=float, default=1.0, help="latency per link")
    p.add_argument("--path", choices=("ina", "host-ring", "host-ps", "ina-mem"),
                   help="run every operation on this path (default: as recorded)")
    p.add_argument("--no-compute", dest="compute", action="store_false",
                   help="drop the recorded compute gaps between operations")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Replay the trace at each worker count; print the table."""
    try:
        counts = [int(w) for w in str(args.workers).split(",")]
    except ValueError:
        raise UsageError(f"--workers {args.workers}: give numbers, e.g. 64,1024") from None
    if not counts or min(counts) < 2:
        raise UsageError("--workers: each count must be at least 2")
    if args.per_leaf < 1 or not args.bandwidth_gbps > 0 or args.latency_us < 0:
        raise UsageError("--per-leaf, --bandwidth-gbps and --latency-us must be positive")
    doc = load_trace(args.trace)
    if args.json:  # before the simulation: a long run must not fail at its end
        from fabric.emulation.launch_cli import check_output_file

        check_output_file("--json", args.json)
    rows = [replay(doc, w, args) for w in counts]
    print(_table(doc, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"trace": str(args.trace), "recorded_world": doc["world"], "rows": rows}, indent=2))
    return 0
