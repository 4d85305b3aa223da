"""`semfab sim incast` and `semfab sim permutation`: congestion scenarios in virtual
time, frames at MTU through queued ports (:mod:`fabric.sim.incast`,
:mod:`fabric.sim.permutation`).

Prints one line per run and, with ``--json``, writes every figure and setting.
Bad settings (Kmin above Kmax, a PFC headroom below one MTU, a negative or
absurd buffer, an unknown policy) are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from bench import report
from fabric.core.congestion import CC_POLICIES, CongestionConfigError
from fabric.errors import UsageError

NOTE = "simulated (virtual time)"


def add_incast_parser(sub: Any) -> None:
    """The ``incast`` subcommand of `semfab sim`."""
    p = sub.add_parser(
        "incast", help="N senders to one receiver through one switch: queues, ECN, "
        "trimming, PFC and congestion control, frames at MTU",
        description="Every sender starts at once and sends --size bytes to one receiver "
        "through one switch, in virtual time; defaults are htsim's (100 Gb/s, MTU 4150 B, "
        "12 us base RTT, a buffer of 1 BDP with --trim, 5 BDP without, ECN 0.2-0.8 BDP).")
    p.add_argument("--senders", type=int, required=True, help="how many senders (N -> 1)")
    p.add_argument("--size", required=True,
                   help="bytes each sender sends (plain bytes, or 2M = 2 MiB)")
    p.add_argument("--topology", metavar="FILE",
                   help="take the switch and sender settings of the file's [congestion] table "
                   "and its links' bandwidth (one rate for all); flags given here win")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="every link's bandwidth (default 100)")
    p.add_argument("--mtu", type=int, default=4150,
                   help="bytes of a full frame on the wire, header included")
    p.add_argument("--base-rtt-us", type=float, default=12.0,
                   help="round trip of one frame and its ACK on the idle fabric (sets the "
                   "links' latency)")
    p.add_argument("--cc", default=None,
                   help=f"sender congestion control: {', '.join(sorted(CC_POLICIES))} "
                   "(default nscc)")
    p.add_argument("--buffer", default=None,
                   help="the switch's shared buffer in bytes (default: 1 BDP with --trim, "
                   "5 BDP without, 32 MB with --pfc)")
    p.add_argument("--buffer-alpha", type=float, default=None,
                   help="dynamic threshold: one queue may hold alpha x the free buffer "
                   "(default inf: only the buffer's size)")
    p.add_argument("--trim", action="store_true",
                   help="cut the payload of a frame that does not fit and forward its header "
                   "first (else: tail drop)")
    p.add_argument("--pfc", action="store_true",
                   help="lossless data class: PFC pauses senders (XOFF 1/8 of the free "
                   "buffer, headroom 3 x rate x link delay)")
    p.add_argument("--credit", action="store_true",
                   help="credit-based link flow control, the scale-up way: a link sends only "
                   "into buffer its far end granted (a round trip of credits per link)")
    p.add_argument("--kmin", default=None, help="ECN: no mark at or below (bytes)")
    p.add_argument("--kmax", default=None, help="ECN: every frame marked above (bytes)")
    p.add_argument("--pmax", type=float, default=None,
                   help="ECN: marking probability at Kmax (default 1; dcqcn: 0.01)")
    p.add_argument("--no-ecn", action="store_true", help="switches mark nothing")
    p.add_argument("--seed", type=int, default=0, help="data, marks and spraying")
    p.add_argument("--json", metavar="PATH", help="write the figures and every setting")
    p.add_argument("--plot", metavar="PNG",
                   help="the bottleneck's queue over time (pauses shaded)")
    p.add_argument("--trace", metavar="PATH",
                   help="queue depth and pauses as Perfetto counter tracks (Chrome trace JSON)")
    p.set_defaults(sim_func=run_incast_command)


def add_permutation_parser(sub: Any) -> None:
    """The ``permutation`` subcommand of `semfab sim`."""
    p = sub.add_parser(
        "permutation", help="every host sends to another on a leaf/spine: ECMP or per-frame "
        "spraying, queues, ECN, trimming and congestion control, frames at MTU",
        description="Leaves x per-leaf hosts, each leaf with one uplink to each spine; every "
        "host sends --size bytes to the host a seeded permutation gives it, all at once, in "
        "virtual time. Defaults: 100 Gb/s, 1 us links, MTU 4150 B, a queue per port of 1 BDP "
        "with --trim (5 BDP without), ECN 0.2-0.8 BDP.")
    p.add_argument("--leaves", type=int, required=True, help="leaf switches")
    p.add_argument("--per-leaf", type=int, required=True, help="hosts per leaf")
    p.add_argument("--spines", type=int, required=True, help="spine switches")
    p.add_argument("--oversubscription", type=float, default=1.0,
                   help="a leaf's host bandwidth over its uplink bandwidth (1, 4, 8, ...)")
    p.add_argument("--size", required=True, help="bytes each host sends")
    p.add_argument("--link-gbps", type=float, default=100.0, help="host links' bandwidth")
    p.add_argument("--latency-us", type=float, default=1.0, help="every link's latency")
    p.add_argument("--mtu", type=int, default=4150,
                   help="bytes of a full frame on the wire, header included")
    p.add_argument("--cc", default="nscc",
                   help=f"sender congestion control: {', '.join(sorted(CC_POLICIES))}")
    p.add_argument("--spray", action="store_true",
                   help="leaves spread every frame over the uplinks at random (else ECMP: one "
                   "uplink per flow, by hash)")
    p.add_argument("--trim", action="store_true", help="trim instead of tail drop")
    p.add_argument("--buffer", default=None, help="bytes of queue per port")
    p.add_argument("--no-ecn", action="store_true", help="switches mark nothing")
    p.add_argument("--seed", type=int, default=0, help="permutation, data, marks, spraying")
    p.add_argument("--json", metavar="PATH", help="write the figures and every setting")
    p.add_argument("--plot", metavar="PNG",
                   help="the fullest leaf-spine queues over time (records every such port: "
                   "memory grows with the run)")
    p.add_argument("--trace", metavar="PATH",
                   help="those queues as Perfetto counter tracks (Chrome trace JSON)")
    p.set_defaults(sim_func=run_permutation_command)


def run_permutation_command(args: argparse.Namespace) -> int:
    """`semfab sim permutation`."""
    from fabric.emulation.launch_cli import check_output_file
    from fabric.info import build
    from fabric.sim.permutation import PermutationSettings, run_permutation

    size = _bytes("--size", args.size)
    assert size is not None
    try:
        s = PermutationSettings(
            leaves=args.leaves, per_leaf=args.per_leaf, spines=args.spines, size=size,
            oversubscription=args.oversubscription, link_gbps=args.link_gbps,
            latency_us=args.latency_us, mtu=args.mtu, cc=args.cc, spray=args.spray,
            trim=args.trim, buffer=_bytes("--buffer", args.buffer), ecn=not args.no_ecn,
            seed=args.seed).resolved()
    except CongestionConfigError as exc:
        raise UsageError(str(exc)) from None
    for flag in ("json", "plot", "trace"):
        if getattr(args, flag, None):
            check_output_file(f"--{flag}", getattr(args, flag))
    print(f"# semfab sim permutation ({NOTE}, {build()} build): {s.leaves} leaves x "
          f"{s.per_leaf} hosts, {s.spines} spines, {s.oversubscription:g}:1 "
          f"({s.uplink_gbps:g} Gbit/s uplinks), {report.format_size(s.size)} per host, "
          f"{s.link_gbps:g} Gbit/s, {s.latency_us:g} us links, mtu {s.mtu}, cc {s.cc}, "
          f"{'spray' if s.spray else 'ECMP'}, {'trim' if s.trim else 'tail drop'}, "
          f"{s.buffer} B per port", flush=True)
    record: dict[str, Any] | None = {} if (args.plot or args.trace) else None
    r = run_permutation(s, record)
    _print_figures(r)
    if record is not None:
        _pictures(record, args, f"permutation {s.leaves}x{s.per_leaf}, {s.spines} spines, "
                  f"{'spray' if s.spray else 'ECMP'}, {s.cc}: fullest leaf-spine queues "
                  "(virtual time)")
    if args.json:
        report.write_json(args.json, "sim-permutation", [r], extra={"note": NOTE})
        print(f"# wrote {args.json}")
    return 0 if r["finished"] and r["wrong"] == 0 else 1


def add_pfc_parser(sub: Any) -> None:
    """The ``pfc`` subcommand of `semfab sim`."""
    p = sub.add_parser(
        "pfc", help="PFC's failures: a victim of head-of-line blocking (beside credits and "
        "trimming), a deadlock on a ring",
        description="victim: 8 senders on one switch incast to a host on another, a ninth "
        "sends to an idle host there; its completion time with PFC, with credit-based link "
        "flow control and with trimming. "
        "ring: three switches in a ring under PFC, every flow two hops clockwise; the "
        "watchdog reports the cycle of paused ports (exit 0 when a deadlock was found).")
    p.add_argument("case", choices=("victim", "ring"), help="which experiment")
    p.add_argument("--seed", type=int, default=0, help="data and marks")
    p.add_argument("--json", metavar="PATH", help="write the figures and every setting")
    p.set_defaults(sim_func=run_pfc_command)


def run_pfc_command(args: argparse.Namespace) -> int:
    """`semfab sim pfc victim|ring`."""
    from fabric.emulation.launch_cli import check_output_file
    from fabric.sim.pfc_cases import run_ring, run_victim

    if args.json:
        check_output_file("--json", args.json)
    rows: list[dict[str, Any]] = []
    if args.case == "victim":
        for pfc, credit in ((True, False), (False, True), (False, False)):
            r = run_victim(pfc=pfc, credit=credit, seed=args.seed)
            rows.append(r)
            print(f"{r['mode']:>6}: victim {r['victim_fct_s'] * 1e6:.1f} us = "
                  f"{r['victim_slowdown']:.2f} x alone; incast {r['incast_completion_s'] * 1e6:.1f}"
                  f" us; pauses {r['pauses']} (uplink paused {r['uplink_paused_s'] * 1e6:.1f} us);"
                  f" uplink waited for credits {r['uplink_credit_stalled_s'] * 1e6:.1f} us;"
                  f" trims {r['trims']}; wrong {r['wrong']}  ({NOTE})")
        ok = all(r["finished"] and r["wrong"] == 0 for r in rows)
    else:
        r = run_ring(seed=args.seed)
        rows.append(r)
        if r["deadlock"]:
            print(f"deadlock: {' -> '.join(r['deadlock'])} -> {r['deadlock'][0]} (cycle of "
                  f"paused ports), found at {r['detected_at_s'] * 1e6:.1f} us; "
                  f"{r['delivered_bytes']} B delivered  ({NOTE})")
        else:
            print(f"no deadlock: finished={r['finished']}  ({NOTE})")
        ok = r["deadlock"] is not None
    if args.json:
        report.write_json(args.json, f"sim-pfc-{args.case}", rows, extra={"note": NOTE})
        print(f"# wrote {args.json}")
    return 0 if ok else 1


def _print_figures(r: dict[str, Any]) -> None:
    fct = r["fct_slowdown"]
    state = "" if r["finished"] else "  NOT FINISHED (stalled)"
    print(f"completion {r['completion_s'] * 1e3:.3f} ms = {r['of_ideal']:.3f} x ideal "
          f"({r['ideal_s'] * 1e3:.3f} ms); goodput {r['goodput_gbps']:.2f} Gbit/s; FCT "
          f"slowdown p50/p95/p99 {fct['p50']:.2f}/{fct['p95']:.2f}/{fct['p99']:.2f}; jain "
          f"{r['jain']:.3f}{state}")
    print(f"drops {r['drops']}, trims {r['trims']}, ECN marks {r['ecn_marks']}, pauses "
          f"{r['pauses']} ({r['paused_s'] * 1e6:.1f} us), retransmits {r['retransmits']} "
          f"(timeouts {r['timeouts']}); peak queue {r['peak_queue_bytes']} B; wrong "
          f"{r['wrong']}"
          + (f"; credit stalls {r['credit_stalls']} ({r['credit_stalled_s'] * 1e6:.1f} us)"
             if r.get("credit_stalls") else ""))
    print(f"# {r['events']} events in {r['wall_s']:.2f} s of wall time")


def _bytes(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return report.parse_size(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _from_topology(path: str | None, need_rate: bool) -> tuple[Any, float | None]:
    """A ``--topology`` file's congestion settings and, when ``need_rate``, its one link
    rate (None: no file, or not needed)."""
    from fabric.core.congestion.settings import CongestionSettings

    if path is None:
        return CongestionSettings(), None
    from fabric.core.topology import TopologyError, load

    try:
        topo = load(path)
    except TopologyError as exc:
        raise UsageError(f"--topology: {exc}") from None
    if not need_rate:
        return topo.congestion, None
    rates = sorted({link.params.bandwidth_gbps for link in topo.links})
    if len(rates) != 1 or rates[0] <= 0:
        raise UsageError(f"--topology {path}: the incast takes one shaped link rate; the file's "
                         f"links have {', '.join(f'{r:g}' for r in rates)} Gbit/s (0: "
                         "unshaped); give --link-gbps or make them equal")
    return topo.congestion, rates[0]


def _pick(given: Any, from_file: Any, default: Any) -> Any:
    return given if given is not None else from_file if from_file is not None else default


def settings_from_args(args: argparse.Namespace) -> Any:
    """The checked :class:`~fabric.sim.incast.IncastSettings` of a command line: flags,
    then the ``--topology`` file's settings, then the defaults."""
    from fabric.sim.incast import IncastSettings

    size = _bytes("--size", args.size)
    assert size is not None
    c, file_gbps = _from_topology(getattr(args, "topology", None), args.link_gbps is None)
    s = IncastSettings(
        senders=args.senders, size=size, link_gbps=_pick(args.link_gbps, file_gbps, 100.0),
        mtu=args.mtu, base_rtt_us=args.base_rtt_us, cc=_pick(args.cc, c.cc, "nscc"),
        buffer=_pick(_bytes("--buffer", args.buffer), c.buffer_bytes, None),
        buffer_alpha=_pick(args.buffer_alpha, c.buffer_alpha, math.inf),
        trim=args.trim or c.trim, pfc=args.pfc or c.pfc,
        credit=args.credit or c.credit,
        kmin=_pick(_bytes("--kmin", args.kmin), c.ecn_kmin_bytes, None),
        kmax=_pick(_bytes("--kmax", args.kmax), c.ecn_kmax_bytes, None),
        pmax=_pick(args.pmax, c.ecn_pmax, None), ecn=not args.no_ecn, seed=args.seed)
    try:
        return s.resolved()
    except CongestionConfigError as exc:
        raise UsageError(str(exc)) from None


def _pictures(record: dict[str, Any], args: argparse.Namespace, title: str) -> None:
    """``--plot`` and ``--trace`` of a recorded scenario."""
    from fabric.sim import congestion_plots

    if args.plot:
        congestion_plots.plot_queues(record, args.plot, title)
        print(f"# wrote {args.plot}")
    if args.trace:
        congestion_plots.write_trace(record, args.trace, title)
        print(f"# wrote {args.trace}")


def _loss_mode(s: Any) -> str:
    return ("pfc" if s.pfc else f"credit ({s.link_credits} B per link)" if s.credit
            else "trim" if s.trim else "tail drop")


def run_incast_command(args: argparse.Namespace) -> int:
    """`semfab sim incast`."""
    from fabric.emulation.launch_cli import check_output_file
    from fabric.info import build
    from fabric.sim.incast import run_incast

    s = settings_from_args(args)
    for flag in ("json", "plot", "trace"):
        if getattr(args, flag, None):
            check_output_file(f"--{flag}", getattr(args, flag))
    print(f"# semfab sim incast ({NOTE}, {build()} build): {s.senders} -> 1, "
          f"{report.format_size(s.size)} each, {s.link_gbps:g} Gbit/s, mtu {s.mtu}, base RTT "
          f"{s.base_rtt_us:g} us, cc {s.cc}, buffer {s.buffer} B, "
          + _loss_mode(s)
          + (f", ECN {s.kmin}..{s.kmax} B pmax {s.pmax:g}" if s.ecn else ", no ECN"), flush=True)
    record: dict[str, Any] | None = {} if (args.plot or args.trace) else None
    r = run_incast(s, record)
    _print_figures(r)
    print(f"# bottleneck queue mean {r['mean_queue_bytes']:.0f} B")
    if record is not None:
        _pictures(record, args, f"incast {s.senders} -> 1 of {report.format_size(s.size)}, "
                  f"{s.cc}, {_loss_mode(s)} (virtual time)")
    if args.json:
        report.write_json(args.json, "sim-incast", [r], extra={"note": NOTE})
        print(f"# wrote {args.json}")
    return 0 if r["finished"] and r["wrong"] == 0 else 1
