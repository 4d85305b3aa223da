"""`semfab bench <collective>`: the collective set, every path and the peers, nccl-tests style.

``all_gather``, ``reduce_scatter``, ``broadcast``, ``reduce``, ``alltoall``
and ``sendrecv`` (rank r sends to r+1 and receives from r-1, both at once),
each on every path the fabric has for it
(:data:`fabric.core.collective_programs.COLLECTIVES`; sendrecv: ``host-p2p``
streams) and through gloo and MPI in the same run, on the same sizes and
process counts.

The sweep is `semfab bench allreduce`'s (:mod:`bench.sweep`): the parameter
header first, one fixed-width row per size as soon as it is done, one fabric
per worker count, ``--repeat`` medians with their spread, one side-by-side
table per worker count, the footer, ``--json``/``--markdown``/``--plot``.
Sizes, counts and bandwidths follow nccl-tests (:mod:`bench.nccl`): the
``size`` column is the larger buffer, ``count`` the per-rank count, algbw =
size / time, busbw = algbw x (n-1)/n for all_gather, reduce_scatter and
alltoall, x 1 for broadcast, reduce and sendrecv.

One timing loop, :func:`collective_workload`, runs in both worlds: on a
launched fabric (each operation the endpoint's blocking call) and, with
``--sim``, in the simulator's virtual time. Per size: ``warmup`` untimed
iterations, then ``iters`` timed ones, each after a barrier; each rank times
its own call; an iteration's time is the maximum over ranks (p50, p99); inputs
are fresh every iteration and every element of every rank's output of the last
iteration is compared exactly with the NumPy reference (``#wrong``). Then
``iters`` more run back to back with no barrier between them: ``time`` is their
total over ``iters`` (the slowest rank's), nccl-tests' ``time``.

Semantic-distance counters (copies, encodes, crossings, hops per chunk) are
the node's own (``ep.sem(path)``) where the path keeps them: the in-network
reductions (``reduce`` and ``reduce_scatter`` on ``ina``). The stream paths
(host-p2p, host-ring, multicast) keep none, and their rows show none.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Generator
from typing import Any

import numpy as np

from bench import nccl, report, sweep
from fabric.errors import UsageError

log = logging.getLogger("semfab.bench.collectives")

KINDS = nccl.KINDS
HELP = {
    "all_gather": "all_gather on every path (ina multicast, host-p2p, host-ring) and the "
                  "peers (gloo, MPI), nccl-tests style",
    "reduce_scatter": "reduce_scatter on every path (ina, host-p2p, host-ring) and the peers "
                      "(gloo, MPI), nccl-tests style",
    "broadcast": "broadcast on every path (ina multicast, host-p2p) and the peers (gloo, "
                 "MPI), nccl-tests style",
    "reduce": "reduce to a root on every path (ina, host-p2p) and the peers (gloo, MPI), "
              "nccl-tests style",
    "alltoall": "alltoall (host-p2p) and the peers (gloo, MPI), nccl-tests style",
    "sendrecv": "sendrecv around the ring (rank r to r+1, from r-1, at once; host-p2p) and "
                "the peers (gloo, MPI), nccl-tests style",
}
#: The simulator's rows say so.
SIM_NOTE = "simulated (virtual time)"


def our_paths(kind: str) -> tuple[str, ...]:
    """The fabric's paths of ``kind`` (sendrecv: streams between workers, host-p2p)."""
    from fabric.core.collective_programs import COLLECTIVES

    return ("host-p2p",) if kind == "sendrecv" else COLLECTIVES[kind]


def all_paths(kind: str) -> tuple[str, ...]:
    """``--paths`` choices of ``kind``: ours, then the peers."""
    return (*our_paths(kind), *sweep.PEERS)


# --------------------------------------------------------------------------
# The timing loop (both worlds)
# --------------------------------------------------------------------------


#: The collectives NCCL defines an in-place form of (nccl-tests' in-place half).
INPLACE = ("all_gather", "reduce_scatter", "broadcast", "reduce")


def _buffers(kind: str, place: str, fresh: np.ndarray, keep: np.ndarray | None, r: int,
             count: int, root: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(input, output, what to check) of one iteration, ``fresh`` the rank's new input.

    Out of place: the input is ``fresh`` and the output ``keep`` (broadcast and
    reduce keep one too: ``out`` is not ``x``). In place, as NCCL defines it:
    all_gather's input is this rank's slice of the output, reduce_scatter's
    output this rank's slice of the input, broadcast and reduce use one buffer.
    """
    if place == "out":
        return fresh, keep, keep
    if kind == "all_gather":
        assert keep is not None
        mine = keep[r * count:(r + 1) * count]
        np.copyto(mine, fresh)
        return mine, keep, keep
    if kind == "reduce_scatter":
        mine = fresh[r * count:(r + 1) * count]
        return fresh, mine, mine
    if kind == "broadcast":
        return fresh, fresh, fresh
    if kind == "reduce":
        return fresh, (fresh if r == root else None), (fresh if r == root else None)
    raise ValueError(f"{kind} has no in-place form")


def collective_workload(ctx: Any, kind: str, path: str, sizes: list[int], dtype: str, op: str,
                        root: int, warmup: int, iters: int, check: bool, seed: int,
                        data: bool = True, place: str = "out"
                        ) -> Generator[Any, Any, list[dict[str, Any]]]:
    """Time ``kind`` on ``path`` at every size (``sizes`` as swept: see :mod:`bench.nccl`).

    A workload (fabric.core.workload): the same code runs on an emulated worker and
    in the simulator. ``data=False`` is timing-only (simulation), unchecked.
    ``place``: nccl-tests' out-of-place (``"out"``) or in-place (``"in"``,
    :data:`INPLACE` kinds only) half.
    """
    from kernels.dtypes import np_dtype
    from kernels.reference import count_wrong

    item = np_dtype(dtype).itemsize
    W, r = ctx.world, ctx.rank
    results = []
    for size in sizes:
        count = nccl.per_rank_count(kind, size, item, W)
        n_in, n_out = nccl.buffer_counts(kind, count, W, r, root)
        if place == "out" and kind == "broadcast":
            n_out = count  # out of place: the result lands in a buffer of its own
        if place == "out" and kind == "reduce" and r == root:
            n_out = count
        keep = np.empty(n_out, np_dtype(dtype)) if data and n_out else None
        out = keep
        times: list[float] = []
        spans: list[tuple[float, float]] = []  # the timed iterations (--trace)
        last = warmup + iters - 1
        got: np.ndarray | None = None
        for it in range(warmup + iters):
            x = None
            if data:  # fresh every iteration, writable (broadcast lands in it)
                x = np.array(nccl.make_collective_input(kind, r, it, count, W, dtype, seed))
                x, out, got = _buffers(kind, place, x, keep, r, count, root)
            yield ctx.barrier()
            t0 = yield ctx.clock()
            if kind == "sendrecv":
                yield ctx.sendrecv(x, (r + 1) % W, out, (r - 1) % W, nbytes=count * item)
            else:
                yield ctx.collective(kind, x, out, path=path, op=op, root=root, count=n_in,
                                     dtype=dtype)
            t1 = yield ctx.clock()
            if it >= warmup:
                times.append((t1 - t0) * 1e6)
                spans.append((float(t0), float(t1)))
        wrong = 0
        if check and data:
            want = nccl.expected_output(kind, r, last, count, W, dtype, op, root, seed)
            if want is not None:
                assert got is not None
                wrong = count_wrong(got, want)
        # nccl-tests' "time": `iters` calls back to back, no barrier between them,
        # total / iters. The buffers are not refreshed between them (that would
        # time the copies too; in place, each call works on the last one's
        # result), so the exact check, made above, is of the barrier-separated
        # iterations only.
        yield ctx.barrier()
        t0 = yield ctx.clock()
        for _ in range(iters):
            if kind == "sendrecv":
                yield ctx.sendrecv(x, (r + 1) % W, out, (r - 1) % W, nbytes=count * item)
            else:
                yield ctx.collective(kind, x, out, path=path, op=op, root=root, count=n_in,
                                     dtype=dtype)
        t1 = yield ctx.clock()
        avg_us = (t1 - t0) * 1e6 / iters

        results.append({"size": nccl.row_size(kind, count, item, W), "count": count,
                        "times_us": times, "avg_us": avg_us, "wrong": int(wrong),
                        "spans": spans, "b2b": (float(t0), float(t1))})
    return results


def halves(kind: str, places: tuple[str, ...]) -> tuple[str, ...]:
    """The halves of ``places`` that ``kind`` has (no in-place alltoall or sendrecv)."""
    return tuple(p for p in places if p == "out" or kind in INPLACE)


def measure_on_worker(ep: Any, kind: str, path: str, size: int, dtype: str, op: str, root: int,
                      warmup: int, iters: int, check: bool, seed: int,
                      places: tuple[str, ...] = ("out",)) -> dict[str, Any]:
    """Runs on every emulated worker: one size of ``kind`` on ``path``, with this node's
    semantic-distance counters and fallbacks of that size. ``places``: the halves
    (``"out"``, ``"in"``); a second half's figures are under ``"inplace"``."""
    from fabric.emulation.workloads import run_in_emulation

    sem0 = ep.sem(path).copy()
    switch0 = ep.switch_stats()["payload_copies"]
    fallbacks0 = len(ep.fallbacks)
    places = halves(kind, places)
    done = [run_in_emulation(ep, collective_workload, kind, path, [size], dtype, op, root,
                             warmup, iters, check, seed, True, place)[0] for place in places]
    res = done[0]
    res["place"] = places[0]
    if len(done) > 1:
        res["inplace"] = done[1]
    sem = ep.sem(path).minus(sem0)
    ep.barrier()  # every worker's frames are in the switch's counters
    switch_copies = (ep.switch_stats()["payload_copies"] - switch0) / ep.world
    ep.barrier()  # nobody starts the next size before everyone has read them
    res["fallbacks"] = ep.fallbacks[fallbacks0:]
    res["counters"] = None
    if sem.chunks:  # the path keeps counters (in-network reductions): per chunk
        sem.copies += switch_copies
        res["counters"] = {**sem.per_chunk(),
                           "chunks": sem.chunks / max(len(places) * (warmup + 2 * iters), 1)}
    return dict(res)


def combine(kind: str, path: str, workers: int, dtype: str, op: str, root: int,
            per_rank: list[dict[str, Any]], check: bool, note: str = "") -> report.CollectiveRow:
    """Max over ranks per iteration, wrong elements summed over ranks: one row."""
    first = per_rank[0]
    samples = np.max(np.array([r["times_us"] for r in per_rank]), axis=0)
    wrong = sum(int(r["wrong"]) for r in per_rank) if check else -1
    notes = sorted({n for r in per_rank for n in r.get("fallbacks", [])})
    if note:
        notes.insert(0, note)
    c = first.get("counters")
    counters: dict[str, Any] = {}
    if c:
        counters = {k: round(float(c[k]), 2) for k in ("copies", "encodes", "crossings",
                                                        "hops")}
        counters["chunks"] = int(c["chunks"])
    avgs = [r.get("avg_us") for r in per_rank]
    avg = None if None in avgs else max(float(a) for a in avgs if a is not None)
    row = nccl.make_row(kind, path, workers, first["size"], first["count"], dtype, op, root,
                        samples.tolist(), wrong, note="; ".join(notes), avg_us=avg,
                        **counters)
    row.place = first.get("place", "out")
    ip = [r["inplace"] for r in per_rank if "inplace" in r]
    report.add_inplace_half(row, ip or None, check, kind)
    return row


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, kind: str) -> None:
    """Flags of `semfab bench <kind>` (those of `semfab bench allreduce`, plus ``-r`` for
    broadcast and reduce)."""
    reduces = kind in nccl.REDUCING
    sweep.add_arguments(
        p, all_paths(kind), root=kind in nccl.ROOTED,
        op_help=("sum, max or min; comma-separated, or 'all' (nccl's prod and avg are not "
                 "supported)") if reduces else None,
        sim_help=f"simulate in virtual time (same table, marked simulated) instead of "
        f"launching processes; paths {', '.join(our_paths(kind))}")
    p.add_argument("--trace", metavar="PATH",
                   help="write a Chrome Trace Event file (open in ui.perfetto.dev): a track "
                   "per node, a slice per timed iteration of every path")
    p.set_defaults(collective=kind)


def _adder(kind: str) -> Any:
    def add(p: argparse.ArgumentParser) -> None:
        add_arguments(p, kind)

    add.__doc__ = f"Flags of `semfab bench {kind}`."
    return add


add_all_gather_arguments = _adder("all_gather")
add_reduce_scatter_arguments = _adder("reduce_scatter")
add_broadcast_arguments = _adder("broadcast")
add_reduce_arguments = _adder("reduce")
add_alltoall_arguments = _adder("alltoall")
add_sendrecv_arguments = _adder("sendrecv")


def _parse(args: argparse.Namespace, kind: str) -> sweep.Plan:
    sweep.refuse_nccl_only(args)
    reduces = kind in nccl.REDUCING
    if not reduces and args.op is not None:
        raise UsageError(f"-o/--op {args.op}: {kind} does not reduce (its redop is none); "
                         "-o is for reduce_scatter and reduce")
    if args.sim:
        peers = [p for p in str(args.paths).split(",") if p.strip() in sweep.PEERS]
        if peers and args.paths != ",".join(all_paths(kind)):
            raise UsageError(f"--sim runs the fabric's paths only ({', '.join(our_paths(kind))})"
                             f"; {', '.join(peers)} run in emulation (drop --sim)")
        if getattr(args, "repeat", 1) != 1:
            raise UsageError("--repeat with --sim: virtual time is deterministic (the same "
                             "seed gives the same times), so one run says it all; drop "
                             "--repeat")
        if args.paths == ",".join(all_paths(kind)):  # the default: every path it simulates
            args.paths = ",".join(our_paths(kind))
    carried = "the switches reduce" if reduces else "the fabric carries"
    plan = sweep.parse_plan(args, all_paths(kind), ops=None if reduces else ["none"],
                            carried_by=carried)
    if str(getattr(args, "inplace", "both")) == "1" and kind not in INPLACE:
        raise UsageError(f"--inplace 1: {kind} has no in-place form (NCCL defines one for "
                         f"{', '.join(INPLACE)}); use --inplace 0 or both")
    if kind == "sendrecv" and min(plan.workers) < 2:
        raise UsageError("sendrecv needs at least 2 workers (rank r sends to r+1 and "
                         "receives from r-1)")
    if kind in nccl.ROOTED and not 0 <= args.root < min(plan.workers):
        raise UsageError(f"-r/--root {args.root}: must be a rank of every run, 0.."
                         f"{min(plan.workers) - 1}")
    for dtype in plan.dtypes:
        item = report.dtype_itemsize(dtype)
        for w in plan.workers:
            if nccl.per_rank_count(kind, plan.sizes[0], item, w) == 0:
                need = max(16, item) * w
                raise UsageError(f"-b {plan.sizes[0]}: too small for {kind} of {w} workers in "
                                 f"{dtype}: each rank's part is rounded down to 16 B as "
                                 f"nccl-tests does; give at least -b {need}")
    return plan


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def _above_link(row: report.AllreduceRow, rate: float) -> str:
    return (f"busbw above the {rate:g} Gbit/s link (algbw "
            f"{(row.algbw_gbps or 0.0) * 8:.3g} Gbit/s)")


class Tracer:
    """The ``--trace`` file: Chrome Trace Event JSON (ui.perfetto.dev, chrome://tracing).

    One process per worker count, one track per node (worker) in it, one slice
    per timed (barrier-separated) iteration of every path, size and half, from
    the start to the end of that node's call as the node's own clock measured
    them, and one slice for each back-to-back loop. Emulation: every worker's
    clock is the host's monotonic clock, so the tracks line up. Simulation:
    virtual time, each measurement (its own simulation, starting at 0) placed
    after the one before.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        # (pid, pid name, node, name, cat, start s, end s, args)
        self.slices: list[tuple[int, str, str, str, str, float, float, dict[str, Any]]] = []
        self._virtual_end = 0.0

    def add(self, workers: int, nodes: list[str], path: str, size: int,
            per_rank: list[dict[str, Any]], virtual: bool = False) -> None:
        """Every rank's spans of one measurement (both halves where there are two)."""
        halves: list[tuple[str, list[dict[str, Any]]]] = []
        if per_rank:
            halves.append((per_rank[0].get("place", "out"), per_rank))
            if "inplace" in per_rank[0]:
                halves.append(("in", [r["inplace"] for r in per_rank]))
        shift = 0.0
        if virtual:  # each simulation starts its clock at 0: after the last one
            starts = [t for _, rs in halves for r in rs for t, _e in r.get("spans", [])]
            shift = self._virtual_end - min(starts, default=0.0)
        pname = f"{self.kind}, {workers} workers"
        label = f"{path} {report.format_size(size)}"
        for place, rs in halves:
            half = "in-place" if place == "in" else "out-of-place"
            for rank, r in enumerate(rs):
                node = nodes[rank] if rank < len(nodes) else f"rank {rank}"
                meta = {"path": path, "size": size, "half": half, "rank": rank}
                for k, (t0, t1) in enumerate(r.get("spans", [])):
                    self.slices.append((workers, pname, node, f"{label} {half} #{k}", "timed",
                                        t0 + shift, t1 + shift, {**meta, "iteration": k}))
                if r.get("b2b"):
                    t0, t1 = r["b2b"]
                    n = len(r.get("spans", []))
                    self.slices.append((workers, pname, node,
                                        f"{label} {half} back-to-back x{n}", "back-to-back",
                                        t0 + shift, t1 + shift, meta))
        if virtual and self.slices:
            self._virtual_end = max(e for *_x, e, _a in self.slices) + 1e-6

    def write(self, path: str) -> None:
        """Write the trace (an empty one when nothing ran)."""
        from fabric.serving.trace import TraceBuilder

        tb = TraceBuilder()
        tb.t0 = min((int(s[5] * 1e9) for s in self.slices), default=0)
        for pid, pname, node, name, cat, t0, t1, meta in sorted(
                self.slices, key=lambda s: (s[0], s[2], s[5])):
            tb.process(pid, pname, sort=pid)
            tb.slice(pid, node, name, int(t0 * 1e9), int(t1 * 1e9), cat, meta)
        tb.write(path)


def _measure(kind: str, root: int, tracer: Tracer | None = None) -> sweep.Measure:
    def measure(fab: Any, path: str, workers: int, size: int, dtype: str, op: str,
                args: argparse.Namespace) -> report.AllreduceRow:
        run_op = "sum" if op == "none" else op  # a collective that does not reduce ignores it
        per_rank = fab.run(measure_on_worker, kind, path, size, dtype, run_op, root,
                           args.warmup, args.iters, bool(args.check), args.seed,
                           places=sweep.places(args))
        if tracer is not None:
            tracer.add(workers, [w.name for w in fab.topo.workers], path, size, per_rank)
        return combine(kind, path, workers, dtype, op, root, per_rank, bool(args.check))

    return measure


def _run_peer(kind: str, root: int) -> sweep.RunPeer:
    def run_peer(peer: str, workers: int, sizes: list[int], args: argparse.Namespace,
                 dtype: str, op: str) -> list[report.AllreduceRow]:
        from bench import peers

        rows: list[report.AllreduceRow] = list(peers.run_peer(
            peer, workers, sizes, dtype, warmup=args.warmup, iters=args.iters,
            check=bool(args.check), op="sum" if op == "none" else op, collective=kind,
            root=root))
        return rows

    return run_peer


def _fix_row(kind: str, root: int) -> Any:
    """A row the sweep made itself (a failure) becomes a row of ``kind``: its size and
    count as nccl-tests shows them."""

    def fix(row: report.AllreduceRow) -> report.AllreduceRow:
        if isinstance(row, report.CollectiveRow):
            return row
        return nccl.unavailable_row(kind, row.path, row.workers, row.size_bytes, row.dtype,
                                    row.redop, root, row.note)

    return fix


def sim_point(topo_text: str, topo_source: str, kind: str, path: str, size: int, dtype: str,
              op: str, root: int, warmup: int, iters: int, check: bool, seed: int,
              faults: str | None, timeout_s: float, places: tuple[str, ...]
              ) -> dict[str, Any]:
    """One point of `semfab bench <kind> --sim` (picklable work: plain arguments in, plain
    data out): a simulation of :func:`collective_workload` per half, each from an idle
    fabric, as after a barrier. Returns every rank's figures per half, the first half's
    counters and the resends; ``{"error": ...}`` when it failed."""
    from fabric.sim.cli import topology_from_text
    from fabric.sim.engine import Simulation, SimulationError

    topo = topology_from_text(topo_text, topo_source)
    per_place, retransmits, replays = [], 0, 0
    runs: list[Any] = []
    sem: dict[str, Any] = {}
    for place in places:
        sim = Simulation(topo, seed=seed, faults=faults, timeout_s=timeout_s,
                         crc=bool(faults and "corrupt" in faults))
        try:
            res = sim.run(collective_workload, kind, path, [size], dtype, op, root, warmup,
                          iters, check, seed, True, place)
        except SimulationError as exc:
            return {"error": str(exc)}
        per_place.append([r[0] for r in res.results])
        retransmits += res.retransmits
        replays += res.llr_replays
        runs.append(res)
        if len(per_place) == 1:
            first = [n.sem(path) for n in res.nodes.values()][0]
            sem = {"chunks": first.chunks, "per_chunk": first.per_chunk()}
    return {"per_place": per_place, "sem": sem, "retransmits": retransmits,
            "llr_replays": replays, "queues": sweep.queue_figures(runs)}


class SimFabric(sweep.SimStandIn):
    """Stands for a launched fabric under ``--sim``: each size of a path is a point,
    :func:`sim_point`, of the same workload in virtual time."""

    def __init__(self, topo: Any, args: argparse.Namespace, kind: str, root: int,
                 tracer: Tracer | None = None) -> None:
        super().__init__(topo, args)
        self.kind, self.root, self.tracer = kind, root, tracer

    def work(self, path: str, size: int, dtype: str, op: str
             ) -> tuple[Any, tuple[Any, ...]]:
        a = self.args
        run_op = "sum" if op == "none" else op  # a collective that does not reduce ignores it
        return sim_point, (*self.topo_text(), self.kind, path, size, dtype, run_op, self.root,
                           a.warmup, a.iters, bool(a.check), a.seed, a.faults, a.timeout,
                           halves(self.kind, sweep.places(a)))

    def row(self, path: str, size: int, dtype: str, op: str, result: dict[str, Any]
            ) -> report.AllreduceRow:
        kind, root, args = self.kind, self.root, self.args
        w = len(self.topo.workers)
        run_op = "sum" if op == "none" else op
        if "error" in result:
            return _fix_row(kind, root)(report.AllreduceRow.unavailable(
                path, w, size, dtype, f"failed: {result['error']}", run_op))
        places = halves(kind, sweep.places(args))
        per_place = result["per_place"]
        per_rank = per_place[0]
        for k, r in enumerate(per_rank):
            r["place"] = places[0]
            if len(per_place) > 1:
                r["inplace"] = per_place[1][k]
        if self.tracer is not None:
            self.tracer.add(w, [n.name for n in self.topo.workers], path, size, per_rank,
                            virtual=True)
        sem = result["sem"]
        if sem["chunks"]:
            per_rank[0]["counters"] = {**sem["per_chunk"],
                                       "chunks": sem["chunks"] / max(args.warmup
                                                                     + 2 * args.iters, 1)}
        note = (SIM_NOTE + sweep.recovery_note(result["retransmits"],
                                               result.get("llr_replays", 0))
                + sweep.queue_note(result.get("queues", {})))
        return combine(kind, path, w, dtype, run_op, root, per_rank, bool(args.check), note)


def run(args: argparse.Namespace) -> int:
    """Entry point of `semfab bench <collective>` (the kind is ``args.collective``)."""
    kind = args.collective
    if kind not in KINDS:
        raise UsageError(f"unknown collective {kind!r}; choose one of {', '.join(KINDS)}")
    sim = bool(args.sim)
    if sim and not args.topology and args.link_gbps == 0:
        args.link_gbps = 100.0  # an unshaped link costs no virtual time: give it a rate
    plan = _parse(args, kind)
    root = args.root if kind in nccl.ROOTED else 0  # rows of the others show root -1
    n_cores = sweep.cores()
    extra = [f"# collective: {kind}"
             + (f"  root: {root}" if kind in nccl.ROOTED else "")
             + ("  (rank r sends to r+1 and receives from r-1, at once)"
                if kind == "sendrecv" else ""),
             f"# size: {_size_words(kind)}; count: per-rank elements, as nccl-tests prints "
             "them"]
    if sim:
        extra.append("# simulated: virtual time (fabric.sim), no processes; links of the "
                     f"default star at {args.link_gbps:g} Gbit/s unless --topology")
    header = sweep.header_lines(args, plan, kind, n_cores, extra, processes=not sim)
    setts = sweep.settings(args, plan, kind, n_cores, extra={
        "collective": kind, "root": root if kind in nccl.ROOTED else None})
    tracer = Tracer(kind) if getattr(args, "trace", None) else None
    try:
        return sweep.run_sweep(
            args, plan, name=kind, header=header, setts=setts,
            measure=_measure(kind, root, tracer), run_peer=_run_peer(kind, root),
            notes=sweep.row_notes(args, _above_link), collective=kind,
            root=kind in nccl.ROOTED, fix_row=_fix_row(kind, root),
            launch=(lambda a, w: SimFabric(sweep.topology(a, w), a, kind, root, tracer))
            if sim else None)
    finally:
        if tracer is not None:
            tracer.write(args.trace)
            print(f"# wrote {args.trace} ({len(tracer.slices)} slices; open it in "
                  "ui.perfetto.dev)", flush=True)


def _size_words(kind: str) -> str:
    if kind in nccl.SPLIT:
        return ("the whole buffer, every rank's part together (each part rounded down to "
                "16 B); algbw = size / time")
    return "one rank's buffer; algbw = size / time"
