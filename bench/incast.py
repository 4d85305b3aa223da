"""`semfab bench incast`: N senders into one receiver on real processes, beside the
same run in virtual time.

Every sender streams ``--size`` bytes to the receiver at once, through one
emulated switch whose port to the receiver is the bottleneck: links shaped to
``--link-gbps``, a shared buffer, ECN marks and trimming as the ``[congestion]``
table sets them, and each stream's sender under a congestion-control policy
(``--cc``, comma-separated: one pair of rows each). Both worlds run one workload
(:func:`incast_work`) on the same protocol core: the reliable sender with its
policy, the switch's queue in the link pipeline. Every byte the receiver gets
is checked against what was sent.

The base round trip. The emulator's software (a Python switch, Python nodes)
adds to every round trip; the first launch measures it (one frame and its ACK,
the fastest of ``PROBES``). Both worlds' policies then start from that round
trip (``[congestion] base_rtt_us``) and the simulated links carry the
software's share as latency (a quarter per link direction: a round trip
crosses two links each way), so the two worlds model one fabric. The ECN
thresholds and the default buffer are htsim's, from that round trip's BDP.

Figures per row, as ``semfab sim incast``'s: ``completion_s`` (median over the
timed iterations: the receiver's time from its barrier to its last byte),
``ideal_s`` (every byte back to back at the bottleneck, plus the first frame's
way there), ``fct_slowdown`` (each flow's time over its time alone),
``goodput_gbps``, ``jain``, ``drops``, ``trims``, ``ecn_marks``, ``pauses``
and ``paused_s`` (0: these queues have no PFC), ``credit_stalls`` and
``credit_stalled_s`` (``--credit``: frames that waited for credit, and the time
links stood idle for it), ``retransmits``, ``wrong``;
emulation rows add ``vs_sim`` (their completion over the simulated one).

``--packet-level`` adds a third row per policy: the same incast in the packet-level
model of ``semfab sim incast`` (a queue per port and class, an ACK per frame,
control frames free of the buffer), with the same links, base round trip,
buffer, marks and policy; its ``vs_sim`` measures what the protocol paths'
link pipelines (departures computed at enqueue, coalesced ACKs) cost in
accuracy against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Generator
from typing import Any

import numpy as np

from bench import report
from fabric.errors import SemfabError, UsageError, check_seconds

#: Senders the emulator takes here: each is a process, beside the receiver and
#: the switch, on a 2-core machine (more belong to `semfab sim incast`).
MAX_EMULATED_SENDERS = 5
#: One-frame round trips the probe times; the fastest is the base RTT.
PROBES = 20
#: How far apart the worlds may be (|emulated / simulated - 1|) before the run
#: says so: the agreement the two drivers of one core are held to.
AGREEMENT = 0.15


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab bench incast`."""
    p.add_argument("--senders", type=int, default=4, metavar="N",
                   help=f"senders into the one receiver (1..{MAX_EMULATED_SENDERS})")
    p.add_argument("--size", default="1M", metavar="BYTES",
                   help="bytes each sender streams (K/M suffixes)")
    p.add_argument("--link-gbps", type=float, default=0.5, metavar="G",
                   help="every link's rate (shaped; the receiver's is the bottleneck)")
    p.add_argument("--latency-us", type=float, default=50.0, metavar="US",
                   help="every link's latency")
    p.add_argument("--mtu", type=int, default=16384, metavar="BYTES",
                   help="frame payload bytes (streams cut their frames to it)")
    p.add_argument("--cc", default="none,nscc,dcqcn", metavar="POLICIES",
                   help="sender policies, comma-separated (none, nscc, dcqcn, eqds or a "
                   "registered one): a pair of rows each")
    p.add_argument("--buffer", default=None, metavar="BYTES",
                   help="the switch's shared buffer in bytes (default: htsim's 5 BDP, 1 BDP "
                   "with --trim)")
    p.add_argument("--trim", action="store_true",
                   help="cut a frame that does not fit to its header instead of dropping it")
    p.add_argument("--kmin", type=int, default=None, metavar="BYTES",
                   help="ECN marking from this queue (default 0.2 BDP)")
    p.add_argument("--kmax", type=int, default=None, metavar="BYTES",
                   help="... every frame above this (default 0.8 BDP)")
    p.add_argument("--pmax", type=float, default=None, metavar="P",
                   help="marking probability at Kmax (default 1)")
    p.add_argument("--pfc", action="store_true",
                   help="a lossless buffer: PFC pauses the senders' links instead of dropping "
                   "(XOFF at 1/8 of the free buffer; not with --trim)")
    p.add_argument("--credit", action="store_true",
                   help="credit-based flow control on every link (the scale-up way): a link "
                   "sends only into buffer its far end granted, so nothing queues past it "
                   "or drops (not with --trim or --pfc)")
    p.add_argument("--spray", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed iterations")
    p.add_argument("-n", "--iters", type=int, default=3, help="timed iterations")
    p.add_argument("--no-sim", action="store_true", help="emulate only (no simulated rows)")
    p.add_argument("--packet-level", action="store_true",
                   help="also a row from the packet-level model of `semfab sim incast` (per-"
                   "frame queues, an ACK per frame) with the same settings: what the "
                   "protocol paths' coarser link pipelines cost in accuracy")
    p.add_argument("--seed", type=int, default=1, help="data and marking seed")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument("--json", metavar="PATH", help="write rows and settings as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--plot", metavar="PNG",
                   help="draw the bottleneck queue over the last timed iteration, both worlds, "
                   "one PNG per policy (NAME-POLICY.png)")
    p.add_argument("--trace", metavar="JSON",
                   help="write those queues as Perfetto counter tracks (ui.perfetto.dev)")
    p.add_argument("--run-dir", help="where process logs go")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the process logs of a clean run (removed by default)")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything one run depends on (reported with its rows)."""

    senders: int
    size: int
    link_gbps: float
    latency_us: float
    mtu: int
    policies: tuple[str, ...]
    buffer: int | None
    trim: bool
    kmin: int | None
    kmax: int | None
    pmax: float | None
    warmup: int
    iters: int
    seed: int
    sim: bool
    packet_level: bool = False
    pfc: bool = False
    credit: bool = False


def settings_from(args: argparse.Namespace) -> Settings:
    """The flags, checked (a :class:`UsageError`, one line, for a bad one)."""
    from fabric.core.congestion import CC_POLICIES
    from fabric.core.topology import LinkParams, TopologyError
    from fabric.emulation.launch_cli import check_output_file

    if args.pfc and args.trim:
        raise UsageError("--pfc with --trim: a lossless class is never trimmed; choose one")
    if args.credit and (args.pfc or args.trim):
        raise UsageError("--credit with --pfc or --trim: credit-based links are lossless by "
                         "themselves; choose one")
    if args.spray:
        raise UsageError("--spray: an incast crosses one switch, so there is no second path "
                         "to spray over; try `semfab sim permutation --spray`")
    if not 1 <= args.senders <= MAX_EMULATED_SENDERS:
        raise UsageError(f"--senders {args.senders}: must be 1..{MAX_EMULATED_SENDERS} here "
                         "(each is a process); `semfab sim incast` takes thousands")
    size = _bytes("--size", args.size, 1)
    try:
        LinkParams(latency_us=args.latency_us, bandwidth_gbps=args.link_gbps, mtu=args.mtu)
    except TopologyError as exc:
        raise UsageError(str(exc).replace("LinkParams: ", "")) from None
    if not args.link_gbps > 0:
        raise UsageError(f"--link-gbps {args.link_gbps:g}: must be positive (the links are "
                         "shaped)")
    policies = tuple(p.strip() for p in args.cc.split(",") if p.strip())
    if not policies:
        raise UsageError("--cc: name at least one policy (none, nscc, dcqcn, eqds)")
    for name in policies:
        if name not in CC_POLICIES:
            raise UsageError(f"--cc {name}: unknown policy; choose "
                             f"{', '.join(sorted(CC_POLICIES))}")
    if args.kmin is not None and args.kmax is not None and args.kmin > args.kmax:
        raise UsageError(f"--kmin {args.kmin} is above --kmax {args.kmax}; Kmin must be <= "
                         "Kmax")
    for flag, v in (("--kmin", args.kmin), ("--kmax", args.kmax)):
        if v is not None and v < 0:
            raise UsageError(f"{flag} {v}: must be >= 0 bytes")
    if args.pmax is not None and not 0 < args.pmax <= 1:
        raise UsageError(f"--pmax {args.pmax:g}: must be in (0, 1]")
    buffer = _bytes("--buffer", args.buffer, args.mtu + 64) if args.buffer is not None else None
    for flag, v in (("--warmup", args.warmup), ("--iters", args.iters)):
        if v < (1 if flag == "--iters" else 0):
            raise UsageError(f"{flag} {v}: must be at least {1 if flag == '--iters' else 0}")
    check_seconds("--timeout", args.timeout)
    for flag in ("json", "markdown", "plot", "trace"):
        if getattr(args, flag, None):
            check_output_file(f"--{flag}", getattr(args, flag))
    return Settings(args.senders, size, float(args.link_gbps), float(args.latency_us), args.mtu,
                    policies, buffer, args.trim, args.kmin, args.kmax, args.pmax, args.warmup,
                    args.iters, args.seed, not args.no_sim, args.packet_level, args.pfc,
                    args.credit)


def _bytes(flag: str, text: str, minimum: int) -> int:
    try:
        n = report.parse_size(text)
    except ValueError as exc:
        raise UsageError(f"{flag} {text}: {exc}") from None
    if n < minimum:
        raise UsageError(f"{flag} {text}: must be at least {minimum} bytes")
    if n > 1 << 34:
        raise UsageError(f"{flag} {text}: more than 16 GiB; give a size this machine holds")
    return n


# ---------------------------------------------------------------------- workloads
def flow_data(seed: int, iteration: int, sender: int, size: int) -> np.ndarray:
    """What ``sender`` streams in ``iteration``: fresh random bytes."""
    return np.frombuffer(np.random.default_rng((seed, iteration, sender)).bytes(size), np.uint8)


def incast_work(ctx: Any, senders: int, size: int, iterations: int, seed: int
                ) -> Generator[Any, Any, list[dict[str, Any]]]:
    """Ranks ``0..senders-1`` each stream ``size`` bytes to rank ``senders`` at once,
    ``iterations`` times; per iteration, each rank's time from its barrier to the
    end of its part, and (receiver) the bytes that differ from what was sent."""
    from fabric.core.workload import Together

    out: list[dict[str, Any]] = []
    for it in range(iterations):
        yield ctx.barrier()
        t0 = yield ctx.clock()
        if ctx.rank == senders:
            bufs = [np.empty(size, np.uint8) for _ in range(senders)]
            yield Together(tuple(ctx.recv(bufs[i], i) for i in range(senders)))
            t1 = yield ctx.clock()
            wrong = sum(int(np.count_nonzero(bufs[i] != flow_data(seed, it, i, size)))
                        for i in range(senders))
            out.append({"seconds": t1 - t0, "t0": t0, "wrong": wrong})
        elif ctx.rank < senders:
            r = yield ctx.send(flow_data(seed, it, ctx.rank, size), senders)
            t1 = yield ctx.clock()
            out.append({"seconds": t1 - t0, "retransmits": int(r["retransmitted"]),
                        "timeouts": int(r["timeouts"]), "ecn_echoes": int(r["ecn_echoes"])})
    return out


def probe_work(ctx: Any, receiver: int, nbytes: int, n: int
               ) -> Generator[Any, Any, list[float]]:
    """Rank 0 streams one frame of ``nbytes`` to ``receiver`` ``n`` times; the round
    trips (first send to its ACK)."""
    times: list[float] = []
    for _ in range(n):
        yield ctx.barrier()
        if ctx.rank == 0:
            r = yield ctx.send(np.ones(nbytes, np.uint8), receiver)
            times.append(float(r["seconds"]))
        elif ctx.rank == receiver:
            yield ctx.recv(np.empty(nbytes, np.uint8), 0)
    return times


# ---------------------------------------------------------------------- fabrics
def _star(s: Settings, extra_latency_us: float = 0.0) -> Any:
    from fabric.core.topology import star

    return star(s.senders + 1, bandwidth_gbps=s.link_gbps,
                latency_us=s.latency_us + extra_latency_us, mtu=s.mtu, hosts=0)


def links_rtt_s(s: Settings) -> float:
    """One frame and its ACK across the two links, both ways, store and forward."""
    from fabric.core import frame as fr

    wire = s.mtu + 2 * fr.HEADER_SIZE  # the frame, and the ACK's header
    return 2 * (2 * s.latency_us * 1e-6 + wire * 8 / (s.link_gbps * 1e9))


def congestion(s: Settings, cc: str, base_rtt_s: float) -> Any:
    """The ``[congestion]`` table of one policy's runs (htsim's thresholds and buffer
    from the BDP at ``base_rtt_s``, where the flags leave them)."""
    from fabric.core.congestion.config import (
        HTSIM_ECN_KMAX_BDP,
        HTSIM_ECN_KMIN_BDP,
        HTSIM_QUEUE_BDP_DROP,
        HTSIM_QUEUE_BDP_TRIM,
        bdp_bytes,
    )
    from fabric.core.congestion.settings import CongestionSettings

    bdp = bdp_bytes(s.link_gbps, base_rtt_s)
    buffer = s.buffer if s.buffer is not None else int(
        (HTSIM_QUEUE_BDP_TRIM if s.trim else HTSIM_QUEUE_BDP_DROP) * bdp)
    buffer = max(buffer, s.mtu + 64)  # one frame and its header at least
    kmin = s.kmin if s.kmin is not None else int(HTSIM_ECN_KMIN_BDP * bdp)
    kmax = s.kmax if s.kmax is not None else max(int(HTSIM_ECN_KMAX_BDP * bdp), kmin)
    return CongestionSettings(buffer_bytes=buffer, trim=s.trim, ecn_kmin_bytes=kmin,
                              ecn_kmax_bytes=kmax, ecn_pmax=s.pmax if s.pmax else 1.0,
                              cc=cc, base_rtt_us=base_rtt_s * 1e6, pfc=s.pfc, credit=s.credit)


def ideal_s(s: Settings) -> tuple[float, float]:
    """(every flow's frames back to back at the bottleneck plus the first frame's way
    there, one flow's time alone)."""
    from fabric.core import frame as fr

    rate = s.link_gbps * 1e9
    frames = max(-(-s.size // s.mtu), 1)
    wire = s.size + frames * fr.HEADER_SIZE
    first = 2 * s.latency_us * 1e-6 + (min(s.mtu, s.size) + fr.HEADER_SIZE) * 8 / rate
    return s.senders * wire * 8 / rate + first, wire * 8 / rate + first


def _last_window(s: Settings, per: list[list[dict[str, Any]]],
                 series: list[tuple[float, int]] | None) -> list[tuple[float, int]]:
    """The bottleneck queue over the last timed iteration, from its start (seconds)."""
    last = per[s.senders][-1]
    t0, t1 = last["t0"], last["t0"] + last["seconds"]
    return [(t - t0, b) for t, b in series or () if t0 <= t <= t1]


def _row(s: Settings, world: str, cc: str, per: list[list[dict[str, Any]]],
         counters: dict[str, Any]) -> dict[str, Any]:
    from fabric.sim.figures import jain, slowdowns

    timed = range(s.warmup, s.warmup + s.iters)
    rx = per[s.senders]
    done = [rx[i]["seconds"] for i in timed]
    ideal, alone = ideal_s(s)
    fcts = [per[k][i]["seconds"] for k in range(s.senders) for i in timed]
    completion = statistics.median(done)
    return {
        "world": world, "cc": cc, "completion_s": completion, "completions_s": done,
        "ideal_s": ideal, "of_ideal": completion / ideal,
        "fct_slowdown": slowdowns(fcts, [alone] * len(fcts)),
        "goodput_gbps": s.senders * s.size * 8 / completion / 1e9,
        "jain": statistics.median(jain([s.size / per[k][i]["seconds"]
                                        for k in range(s.senders)]) for i in timed),
        "drops": counters.get("overflow_drops", 0), "trims": counters.get("trims", 0),
        "ecn_marks": counters.get("ecn_marks", 0), "pauses": counters.get("pauses", 0),
        "paused_s": counters.get("paused_s", 0.0),
        "credit_stalls": counters.get("credit_stalls", 0),
        "credit_stalled_s": counters.get("credit_stalled_s", 0.0),
        "retransmits": sum(per[k][i]["retransmits"] for k in range(s.senders) for i in timed),
        "timeouts": sum(per[k][i]["timeouts"] for k in range(s.senders) for i in timed),
        "wrong": sum(rx[i]["wrong"] for i in timed),
        "peak_queue_bytes": counters.get("peak_queue_bytes", 0), "samples": s.iters,
    }


def _queue_counters(stats: dict[str, Any], port: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sw in stats.values():
        if not isinstance(sw, dict):
            continue
        credit = sw.get("credit") or {}
        out["credit_stalls"] = out.get("credit_stalls", 0) + int(credit.get("stalls", 0))
        out["credit_stalled_s"] = out.get("credit_stalled_s", 0.0) + float(
            credit.get("stalled_s", 0.0))
        q = (sw.get("queues") or {}).get(port)
        if q is not None:
            out.update({k: int(v) for k, v in q.items()})
            pfc = sw.get("pfc") or {}
            out.update(pauses=int(pfc.get("pauses", 0)),
                       paused_s=float(pfc.get("paused_s", 0.0)))
    return out


def _emulate(s: Settings, cc: str, base_rtt_s: float, args: argparse.Namespace,
             record: dict[str, Any] | None = None) -> dict[str, Any]:
    import os

    from fabric.emulation.launcher import launch
    from fabric.emulation.workloads import run_in_emulation

    topo = _star(s).with_congestion(congestion(s, cc, base_rtt_s))
    kw: dict[str, Any] = {"timeout_s": args.timeout, "seed": s.seed,
                          "remove_run_dir": not (args.run_dir or args.keep_runs)}
    if args.run_dir:
        kw["run_dir"] = f"{args.run_dir}/{cc}"
    port = f"sw0>w{s.senders}"
    before = os.environ.get("SEMFAB_QUEUE_TRACE")
    if record is not None:  # the switch daemon records its queues (they inherit this)
        os.environ["SEMFAB_QUEUE_TRACE"] = "1"
    try:
        with launch(topology=topo, **kw) as fab:
            per = fab.run(run_in_emulation, incast_work, s.senders, s.size,
                          s.warmup + s.iters, s.seed)
            stats = fab.switch_stats()
    finally:
        if record is not None:
            if before is None:
                os.environ.pop("SEMFAB_QUEUE_TRACE", None)
            else:
                os.environ["SEMFAB_QUEUE_TRACE"] = before
    if record is not None:
        depth = next((sw["queue_depth"][port] for sw in stats.values()
                      if isinstance(sw, dict) and port in (sw.get("queue_depth") or {})), None)
        record[f"{cc} emulation {port}"] = _last_window(s, per, depth)
    return _row(s, "emulation", cc, per, _queue_counters(stats, port))


def _simulate(s: Settings, cc: str, base_rtt_s: float, timeout_s: float,
              record: dict[str, Any] | None = None) -> dict[str, Any]:
    from fabric.sim import Simulation

    # the emulator's software share of the round trip, as latency on each link direction
    extra_us = max(base_rtt_s - links_rtt_s(s), 0.0) / 4 * 1e6
    topo = _star(s, extra_us).with_congestion(congestion(s, cc, base_rtt_s))
    sim = Simulation(topo, seed=s.seed, timeout_s=timeout_s)
    hot = sim.pipes[("sw0", f"w{s.senders}")]
    if record is not None:
        hot.depth = []
    res = sim.run(incast_work, s.senders, s.size, s.warmup + s.iters, s.seed)
    port = f"sw0>w{s.senders}"
    if record is not None:
        record[f"{cc} simulation {port}"] = _last_window(s, res.results, hot.depth)
    counters = {"overflow_drops": res.overflow_drops, "trims": res.trims,
                "ecn_marks": res.ecn_marks, "peak_queue_bytes": res.queue_peaks.get(port, 0),
                "pauses": res.pauses, "paused_s": res.paused_s,
                "credit_stalls": res.credit_stalls, "credit_stalled_s": res.credit_stalled_s}
    return _row(s, "simulation", cc, res.results, counters)


def _packet_settings(s: Settings, cc: str, base_rtt_s: float) -> Any:
    """The packet-level model's settings for these flags (UsageError, one line, for
    what it refuses: a PFC buffer without room for its headroom)."""
    from fabric.core import frame as fr
    from fabric.core.congestion.config import CongestionConfigError
    from fabric.sim.incast import IncastSettings

    c = congestion(s, cc, base_rtt_s)
    settings = IncastSettings(
        senders=s.senders, size=s.size, link_gbps=s.link_gbps, mtu=s.mtu + fr.HEADER_SIZE,
        base_rtt_us=base_rtt_s * 1e6, cc=cc, buffer=c.buffer_bytes, trim=s.trim, pfc=s.pfc,
        credit=s.credit,
        kmin=c.ecn_kmin_bytes, kmax=c.ecn_kmax_bytes, pmax=c.ecn_pmax, seed=s.seed)
    try:
        settings.resolved()
    except CongestionConfigError as exc:
        raise UsageError(f"--packet-level: {exc}") from None
    return settings


def _packet_level(s: Settings, cc: str, base_rtt_s: float) -> dict[str, Any]:
    """The same incast in the packet-level model (fabric.sim.incast), with the same
    links, base round trip, buffer, marking and policy (one run: its flows once)."""
    from fabric.sim.incast import run_incast

    r = run_incast(_packet_settings(s, cc, base_rtt_s))
    ideal, _alone = ideal_s(s)
    return {
        "world": "packet-level", "cc": cc, "completion_s": r["completion_s"],
        "completions_s": [r["completion_s"]], "ideal_s": ideal,
        "of_ideal": r["completion_s"] / ideal, "fct_slowdown": r["fct_slowdown"],
        "goodput_gbps": r["goodput_gbps"], "jain": r["jain"], "drops": r["drops"],
        "trims": r["trims"], "ecn_marks": r["ecn_marks"], "pauses": r["pauses"],
        "paused_s": r["paused_s"], "credit_stalls": r.get("credit_stalls", 0),
        "credit_stalled_s": r.get("credit_stalled_s", 0.0), "retransmits": r["retransmits"],
        "timeouts": r["timeouts"], "wrong": r["wrong"],
        "peak_queue_bytes": r["peak_queue_bytes"], "samples": 1,
        "finished": r["finished"]}


def probe_base_rtt(s: Settings, args: argparse.Namespace) -> float:
    """The emulator's unloaded round trip of one frame and its ACK (seconds)."""
    from fabric.emulation.launcher import launch
    from fabric.emulation.workloads import run_in_emulation

    kw: dict[str, Any] = {"timeout_s": args.timeout, "seed": s.seed,
                          "remove_run_dir": not (args.run_dir or args.keep_runs)}
    if args.run_dir:
        kw["run_dir"] = f"{args.run_dir}/probe"
    with launch(topology=_star(s), **kw) as fab:
        per = fab.run(run_in_emulation, probe_work, s.senders, min(s.mtu, s.size), PROBES)
    return min(per[0])


# ---------------------------------------------------------------------- output
_COLS = (("world", 13), ("cc", 7), ("done ms", 9), ("x ideal", 8), ("p99 fct", 8),
         ("Gb/s", 7), ("jain", 6), ("drops", 6), ("trims", 6), ("marks", 6), ("rtx", 5),
         ("vs sim", 7), ("#wrong", 7))


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    if "error" in r:
        return (r["world"], r["cc"], "FAILED", *[""] * 9, r["error"][:60])
    vs = f"{r['vs_sim']:.3f}" if r.get("vs_sim") is not None else ""
    return (r["world"], r["cc"], f"{r['completion_s'] * 1e3:.2f}", f"{r['of_ideal']:.3f}",
            f"{r['fct_slowdown']['p99']:.2f}", f"{r['goodput_gbps']:.3f}", f"{r['jain']:.3f}",
            str(r["drops"]), str(r["trims"]), str(r["ecn_marks"]), str(r["retransmits"]), vs,
            str(r["wrong"]))


def _print_row(r: dict[str, Any]) -> None:
    print(" " + "".join(f"{c:>{w}}" for c, (_n, w) in zip(_cells(r), _COLS, strict=True)),
          flush=True)


def _header(s: Settings, base_rtt_s: float | None) -> str:
    ideal, _alone = ideal_s(s)
    overflow = "trimming" if s.trim else "PFC (lossless)" if s.pfc else \
        "credit-based links (lossless)" if s.credit else "tail drop"
    text = (f"# semfab bench incast: {s.senders} -> 1 of {report.format_size(s.size)} each; "
            f"links {s.link_gbps:g} Gb/s, {s.latency_us:g} us, mtu {s.mtu}; "
            f"{overflow}; ideal {ideal * 1e3:.2f} ms; "
            f"warmup {s.warmup}, iters {s.iters}, seed {s.seed}")
    if base_rtt_s is not None:
        text += (f"\n# base RTT: {links_rtt_s(s) * 1e6:.0f} us of links, "
                 f"{base_rtt_s * 1e6:.0f} us measured on the emulator (its software adds "
                 f"{max(base_rtt_s - links_rtt_s(s), 0) * 1e6:.0f} us; the simulated links "
                 "carry that as latency)")
    return text


def _pictures(s: Settings, queues: dict[str, Any], args: argparse.Namespace) -> None:
    """The bottleneck queue of each policy's last timed iteration, both worlds."""
    from pathlib import Path

    from fabric.sim import congestion_plots

    what = f"incast {s.senders} -> 1 of {report.format_size(s.size)}"
    if args.plot:
        base = Path(args.plot)
        for cc in s.policies:
            mine = {k: v for k, v in queues.items() if k.split()[0] == cc}
            out = base.with_name(f"{base.stem}-{cc}{base.suffix or '.png'}")
            congestion_plots.plot_queues({"queues": mine}, out, f"{what}, {cc}: the "
                                         "bottleneck queue, last timed iteration",
                                         xlabel="time from the receiver's start (us; "
                                         "emulation: wall clock)")
            print(f"# wrote {out}")
    if args.trace:
        congestion_plots.write_trace({"queues": queues}, args.trace, f"semfab bench {what}")
        print(f"# wrote {args.trace}")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per (policy, world)."""
    head = [name for name, _w in _COLS]
    return "\n".join(report.markdown_table(head, [_cells(r) for r in rows],
                                           left=("world", "cc")))


def run(args: argparse.Namespace) -> int:
    """Entry point of `semfab bench incast`."""
    s = settings_from(args)
    t_start = time.monotonic()
    print(_header(s, None), flush=True)
    try:
        base_rtt = max(probe_base_rtt(s, args), links_rtt_s(s))
    except SemfabError as exc:
        print(f"semfab bench incast: the base-RTT probe failed: {exc}", file=sys.stderr)
        return 1
    print(_header(s, base_rtt).split("\n")[1], flush=True)
    if s.packet_level:  # its own rules on buffers (PFC headroom): before any run
        _packet_settings(s, s.policies[0], base_rtt)
    print("#" + "".join(f"{name:>{w}}" for name, w in _COLS)[1:], flush=True)
    rows: list[dict[str, Any]] = []
    queues: dict[str, Any] | None = {} if (args.plot or args.trace) else None
    for cc in s.policies:
        sim_row: dict[str, Any] | None = None
        if s.sim:
            try:
                sim_row = _simulate(s, cc, base_rtt, args.timeout, queues)
            except SemfabError as exc:
                sim_row = {"world": "simulation", "cc": cc, "error": f"{type(exc).__name__}: "
                           f"{exc}"}
        try:
            emu = _emulate(s, cc, base_rtt, args, queues)
            if sim_row is not None and "error" not in sim_row:
                emu["vs_sim"] = emu["completion_s"] / sim_row["completion_s"]
        except SemfabError as exc:
            emu = {"world": "emulation", "cc": cc, "error": f"{type(exc).__name__}: {exc}"}
        packet: dict[str, Any] | None = None
        if s.packet_level:
            try:
                packet = _packet_level(s, cc, base_rtt)
                if sim_row is not None and "error" not in sim_row:
                    packet["vs_sim"] = packet["completion_s"] / sim_row["completion_s"]
                if not packet.pop("finished"):
                    packet = {"world": "packet-level", "cc": cc, "error": "did not finish"}
            except SemfabError as exc:
                packet = {"world": "packet-level", "cc": cc,
                          "error": f"{type(exc).__name__}: {exc}"}
        for r in (emu, sim_row, packet):
            if r is not None:
                rows.append(r)
                _print_row(r)
    table = format_table(rows)
    print("\n" + table)
    failed = [r for r in rows if "error" in r]
    wrong = sum(r.get("wrong", 0) for r in rows)
    apart = [r for r in rows if r.get("vs_sim") is not None
             and abs(r["vs_sim"] - 1) > AGREEMENT]
    print(f"# {len(rows)} rows in {time.monotonic() - t_start:.1f} s; "
          + (f"{len(failed)} FAILED; " if failed else "")
          + (f"{wrong} WRONG bytes" if wrong else "every byte exact")
          + (f"; emulation and simulation more than {AGREEMENT:.0%} apart for "
             f"{', '.join(r['cc'] for r in apart)}" if apart else
             (f"; emulation within {AGREEMENT:.0%} of simulation for every policy"
              if s.sim and not failed else "")))
    if s.iters < 3:
        print(f"# note: {s.iters} timed iteration(s) per row; medians of fewer than 3 are "
              "noisy", file=sys.stderr)
    settings = {**dataclasses.asdict(s), "base_rtt_s": base_rtt,
                "links_rtt_s": links_rtt_s(s), "agreement": AGREEMENT}
    if args.json:
        path = report.write_json(args.json, "incast", rows, extra={"settings": settings})
        print(f"# wrote {path}")
    if args.markdown:
        path = report.write_markdown(args.markdown, _header(s, base_rtt) + "\n\n" + table + "\n")
        print(f"# wrote {path}")
    if queues is not None:
        _pictures(s, queues, args)
    return 1 if failed or wrong else 0
