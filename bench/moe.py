"""`semfab bench moe`: MoE dispatch and combine, flat, hierarchical and in the
network, on a star or a leaf/spine fabric at several oversubscription ratios.

DeepEP-like parameters scaled to this machine (tokens per rank, hidden size,
top-k, experts; bf16 or fp32 payloads; uniform or skewed expert load). Per
(ratio, variant) a row: dispatch and combine time (median over iterations,
the slowest rank of each), bytes the spine switches carried per iteration
(their own counters), the load imbalance (rows received, max over mean), the
slowdown against ratio 1 and, for uniform routing, the model
``max(1, r * (1 - 1/L))``. In emulation every iteration's output is checked
element by element (identity experts: combine(dispatch(x)) is the weighted sum
of x); ``--sim`` runs the same programs in virtual time (timing-only payloads),
where 64-1024 ranks fit.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import numpy as np

from bench import report
from fabric.errors import UsageError, check_seconds

DTYPES = ("bfloat16", "float32")
DEFAULT_VARIANTS = "flat,hierarchical,in-network"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab bench moe`."""
    p.add_argument("--leaves", type=int, default=2, help="leaf switches (1: a star)")
    p.add_argument("--per-leaf", type=int, default=2, help="ranks below each leaf")
    p.add_argument("--oversubscription", default="1,2,4",
                   help="leaf down:up bandwidth ratios, comma-separated (leaf/spine only)")
    p.add_argument("--bandwidth-gbps", type=float, default=2.0,
                   help="rank-leaf link rate (shaped; the spine links follow the ratio)")
    p.add_argument("--latency-us", type=float, default=0.0, help="latency of every link")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (elements)")
    p.add_argument("--topk", type=int, default=4, help="experts per token")
    p.add_argument("--experts", type=int, default=0,
                   help="experts in all (default: 4 per rank)")
    p.add_argument("-d", "--dtype", default="bfloat16", choices=DTYPES,
                   help="payload dtype of dispatch and combine")
    p.add_argument("--routing", default="uniform",
                   help="expert load: uniform, zipf:S or lognormal:SIGMA")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="flat, hierarchical and/or in-network")
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed iterations")
    p.add_argument("-n", "--iters", type=int, default=3, help="timed iterations")
    p.add_argument("--sim", action="store_true",
                   help="simulate in virtual time instead of launching processes")
    from bench.sweep import add_queue_arguments

    add_queue_arguments(p)
    p.add_argument("--seed", type=int, default=7, help="routing and input seed")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument("--json", metavar="PATH", help="write rows and settings as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--run-dir", help="where process logs go (emulation)")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the process logs of a clean run (removed by default)")
    from fabric.sim.cli import add_executor_arguments

    add_executor_arguments(p)  # --jobs, --executor: the (ratio, variant) points of --sim


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    from bench.sweep import parse_moe_variants, parse_ratios
    from fabric.core.moe import parse_routing

    for flag, value in (("--latency-us", args.latency_us), ("--bandwidth-gbps",
                                                            args.bandwidth_gbps)):
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{flag} {value:g}: must be a number >= 0")
    check_seconds("--timeout", args.timeout)
    if args.leaves < 1 or args.per_leaf < 1:
        raise UsageError("--leaves and --per-leaf must be at least 1")
    ranks = args.leaves * args.per_leaf
    if ranks < 2:
        raise UsageError("need at least 2 ranks (--leaves x --per-leaf)")
    if not args.sim and ranks + args.leaves + (args.leaves > 1) > 16:
        raise UsageError(f"{ranks} ranks and their switches are too many processes to "
                         "emulate here; add --sim")
    ratios = parse_ratios(args.oversubscription)
    if args.leaves == 1:
        ratios = [1.0]
    if args.bandwidth_gbps <= 0 and ratios != [1.0]:
        raise UsageError("oversubscription needs shaped links: give --bandwidth-gbps > 0")
    variants = parse_moe_variants(args.variants)
    dropped: list[str] = []
    experts = args.experts or 4 * ranks
    if experts % ranks:
        raise UsageError(f"--experts {experts} must be a multiple of the {ranks} ranks")
    if not 0 < args.topk <= experts or args.tokens < 1 or args.hidden < 1:
        raise UsageError("--topk must be in 1..experts, --tokens and --hidden at least 1")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0")
    # every rank builds every rank's tokens (for the reference) and receives its top-k
    report.check_memory(f"--tokens {args.tokens} x --hidden {args.hidden}",
                        args.tokens * args.hidden * 4 * ranks * (ranks + 2 * args.topk))
    parse_routing(args.routing)
    from fabric.sim.cli import check_executor

    check_executor(args, sim=bool(args.sim))
    from fabric.emulation.launch_cli import check_output_file

    for flag in ("json", "markdown"):  # a long run must not fail at its end
        if getattr(args, flag, None):
            check_output_file(f"--{flag}", getattr(args, flag))
    from bench.sweep import lossless_settings, queue_settings

    cc, buffer, trim = queue_settings(args, variants)
    settings = {"leaves": args.leaves, "per_leaf": args.per_leaf, "ranks": ranks,
            "ratios": ratios, "variants": variants, "experts": experts, "topk": args.topk,
            "tokens": args.tokens, "hidden": args.hidden, "dtype": args.dtype,
            "routing": args.routing, "bandwidth_gbps": args.bandwidth_gbps,
            "latency_us": args.latency_us, "warmup": args.warmup, "iters": args.iters,
            "seed": args.seed, "world": "simulation" if args.sim else "emulation",
            "dropped": dropped, "cc": cc, "buffer": buffer, "trim": trim,
            "pfc": lossless_settings(args)[0], "credit": lossless_settings(args)[1]}
    from fabric.core.congestion import CongestionConfigError
    from fabric.core.congestion.switchq import switch_queues
    from fabric.core.topology import TopologyError

    for ratio in ratios:  # a bad link figure is one line now, not a traceback mid-run
        try:
            switch_queues(_topology(settings, ratio))
        except (TopologyError, CongestionConfigError) as exc:
            raise UsageError(str(exc)) from None
    return settings


def _topology(s: dict[str, Any], ratio: float) -> Any:
    from fabric.core.congestion.settings import CongestionSettings
    from fabric.core.topology import leaf_spine, star

    if s["leaves"] == 1:
        topo = star(s["ranks"], bandwidth_gbps=s["bandwidth_gbps"], latency_us=s["latency_us"],
                    hosts=0)
    else:
        topo = leaf_spine(s["leaves"], s["per_leaf"], oversubscription=ratio,
                          leaf_bandwidth_gbps=s["bandwidth_gbps"],
                          leaf_latency_us=s["latency_us"], spine_latency_us=s["latency_us"],
                          hosts=0)
    return topo.with_congestion(CongestionSettings(
        buffer_bytes=s.get("buffer"), trim=s.get("trim", False), cc=s.get("cc"),
        pfc=s.get("pfc", False), credit=s.get("credit", False)))


def moe_task(ep: Any, variant: str, s: dict[str, Any]) -> dict[str, Any]:
    """On every emulated rank: warm-up and timed dispatch + combine, each output
    checked against NumPy; returns times, rows received and wrong elements."""
    from fabric.core.moe import expert_partials, make_inputs, moe_reference

    T, H, K, E = s["tokens"], s["hidden"], s["topk"], s["experts"]
    ins = [make_inputs(r, T, H, K, E, s["dtype"], s["seed"], s["routing"])
           for r in range(ep.world)]
    want = moe_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)
    x, idx, w = ins[ep.rank]
    times: list[tuple[float, float]] = []
    rows = wrong = 0
    for it in range(s["warmup"] + s["iters"]):
        ep.barrier()
        t0 = time.perf_counter()
        d = ep.moe_dispatch(x, idx, w, E, variant=variant)
        t1 = time.perf_counter()
        parts = expert_partials(d, ep.rank, ep.world)
        t2 = time.perf_counter()
        y = ep.moe_combine(d, parts)
        t3 = time.perf_counter()
        wrong += int(np.count_nonzero(y != want[ep.rank]))
        rows = int(d.src.shape[0])
        if it >= s["warmup"]:
            times.append((t1 - t0, t3 - t2))
    return {"times": times, "rows": rows, "wrong": wrong}


def _sim_work(ctx: Any, variant: str, s: dict[str, Any]) -> Any:
    from fabric.core.moe import make_inputs

    _x, idx, w = make_inputs(ctx.rank, s["tokens"], 1, s["topk"], s["experts"], "float32",
                             s["seed"], s["routing"])
    times = []
    rows = 0
    for it in range(s["warmup"] + s["iters"]):
        yield ctx.barrier()
        t0 = yield ctx.clock()
        d = yield ctx.moe_dispatch(None, idx, w, s["experts"], variant=variant,
                                   hidden=s["hidden"], dtype=s["dtype"])
        t1 = yield ctx.clock()
        yield ctx.moe_combine(d, None)
        t2 = yield ctx.clock()
        rows = int(d.src.shape[0])
        if it >= s["warmup"]:
            times.append((t1 - t0, t2 - t1))
    return {"times": times, "rows": rows, "wrong": 0}


def sim_point(s: dict[str, Any], ratio: float, variant: str, timeout_s: float
              ) -> dict[str, Any]:
    """One `--sim` point (picklable work: the plain settings in, a plain row out): the
    dispatch and combine of ``variant`` at ``ratio``, in virtual time."""
    from fabric.sim import Simulation

    res = Simulation(_topology(s, ratio), seed=s["seed"], timeout_s=timeout_s).run(
        _sim_work, variant, s)
    return _row(s, ratio, variant, res.results, _spine_bytes(res.switch_stats))


def _spine_bytes(stats: dict[str, Any]) -> int:
    return sum(int(_get(v, "bytes_in")) for name, v in stats.items() if name.startswith("spine"))


def _get(v: Any, key: str) -> Any:
    return v[key] if isinstance(v, dict) else getattr(v, key)


def _row(s: dict[str, Any], ratio: float, variant: str, per: list[dict[str, Any]],
         spine: int) -> dict[str, Any]:
    disp = [max(p["times"][i][0] for p in per) for i in range(s["iters"])]
    comb = [max(p["times"][i][1] for p in per) for i in range(s["iters"])]
    rows = [p["rows"] for p in per]
    L = s["leaves"]
    return {"ratio": ratio, "variant": variant,
            "dispatch_ms": float(np.median(disp)) * 1e3,
            "combine_ms": float(np.median(comb)) * 1e3,
            "spine_mb": spine / (s["warmup"] + s["iters"]) / 1e6,
            "imbalance": max(rows) / max(float(np.mean(rows)), 1e-9),
            "model": max(1.0, ratio * (1 - 1 / L)) if L > 1 else 1.0,
            "wrong": sum(p["wrong"] for p in per), "samples": s["iters"]}


def run(args: argparse.Namespace) -> int:
    """Entry point of `semfab bench moe`."""
    s = _settings(args)
    print(_header(s), flush=True)
    if args.sim:
        from fabric.sim.cli import executor_text

        print(f"# {executor_text(args, len(s['ratios']) * len(s['variants']))}")
    print(_table_head(), flush=True)
    results: list[dict[str, Any]] = []
    t_start = time.monotonic()
    if args.sim:
        from fabric.sim.cli import run_points

        # a point per (ratio, variant), rows in that order as they finish
        works = [(sim_point, (s, ratio, v, args.timeout)) for ratio in s["ratios"]
                 for v in s["variants"]]
        for row in run_points(works, args.jobs, args.executor):
            results.append(row)
            _print_row(results)
    else:
        for ratio in s["ratios"]:
            topo = _topology(s, ratio)
            from fabric.emulation.launcher import launch

            kw: dict[str, Any] = {"timeout_s": args.timeout, "seed": s["seed"],
                                  "remove_run_dir": not (args.run_dir or args.keep_runs)}
            if args.run_dir:
                kw["run_dir"] = f"{args.run_dir}/r{ratio:g}"
            with launch(topology=topo, **kw) as fab:
                for v in s["variants"]:
                    before = _spine_bytes(fab.switch_stats())
                    per = fab.run(moe_task, v, s)
                    spine = _spine_bytes(fab.switch_stats()) - before
                    results.append(_row(s, ratio, v, per, spine))
                    _print_row(results)
    for r in results:  # slowdown against ratio 1 of the same variant
        base = next((b for b in results if b["variant"] == r["variant"] and b["ratio"] == 1.0),
                    None)
        r["slowdown"] = ((r["dispatch_ms"] + r["combine_ms"])
                         / (base["dispatch_ms"] + base["combine_ms"]) if base else None)
    table = format_table(results, s)
    print("\n" + table)
    wrong = sum(r["wrong"] for r in results)
    print(f"# {len(results)} rows in {time.monotonic() - t_start:.1f} s; "
          f"{'all exact' if not wrong and not args.sim else ''}"
          f"{f'{wrong} WRONG elements' if wrong else ''}"
          f"{'timing-only (simulated): no element check' if args.sim else ''}")
    if s["iters"] < 3:
        print(f"# note: {s['iters']} timed iteration(s) per row; medians of fewer than 3 are "
              "noisy", file=sys.stderr)
    if args.json:
        path = report.write_json(args.json, "moe", results, extra={"settings": s})
        print(f"# wrote {path}")
    if args.markdown:
        path = report.write_markdown(args.markdown, _header(s) + "\n\n" + table + "\n")
        print(f"# wrote {path}")
    return 1 if wrong else 0


def _header(s: dict[str, Any]) -> str:
    topo = (f"star of {s['ranks']}" if s["leaves"] == 1
            else f"{s['leaves']} leaves x {s['per_leaf']} ranks, 1 spine")
    return (f"# semfab bench moe ({s['world']}): {topo}; {s['tokens']} tokens/rank, hidden "
            f"{s['hidden']} {s['dtype']}, top-{s['topk']} of {s['experts']} experts, routing "
            f"{s['routing']}; links {s['bandwidth_gbps']:g} Gb/s, {s['latency_us']:g} us; "
            f"oversubscription {','.join(f'{r:g}' for r in s['ratios'])}; warmup "
            f"{s['warmup']}, iters {s['iters']}, seed {s['seed']}"
            + (f"; left out: {', '.join(s['dropped'])}" if s.get("dropped") else "")
            + (f"; congestion: cc {s['cc'] or '(none)'}, buffer "
               f"{s['buffer'] or 'unbounded'}{', trimming' if s['trim'] else ''}"
               f"{', PFC' if s.get('pfc') else ''}"
               f"{', credit-based links' if s.get('credit') else ''}"
               if s.get("cc") or s.get("buffer") or s.get("credit") else ""))


_COLS = (("ratio", 6), ("variant", 13), ("dispatch ms", 12), ("combine ms", 11),
         ("spine MB/it", 12), ("imbalance", 10), ("#wrong", 7))


def _table_head() -> str:
    return "#" + "".join(f"{name:>{w}}" for name, w in _COLS)


def _print_row(results: list[dict[str, Any]]) -> None:
    r = results[-1]
    cells = (f"{r['ratio']:g}", r["variant"], f"{r['dispatch_ms']:.3f}", f"{r['combine_ms']:.3f}",
             f"{r['spine_mb']:.3f}", f"{r['imbalance']:.2f}", str(r["wrong"]))
    print(" " + "".join(f"{c:>{w}}" for c, (_n, w) in zip(cells, _COLS, strict=True)),
          flush=True)


def format_table(results: list[dict[str, Any]], s: dict[str, Any]) -> str:
    """Markdown: one row per (ratio, variant), with the spine saving and the model."""
    flat = {r["ratio"]: r for r in results if r["variant"] == "flat"}
    head = ["ratio", "variant", "dispatch (ms)", "combine (ms)", "spine MB/iter", "vs flat",
            "imbalance", "slowdown", "model", "#wrong"]
    cells = []
    for r in results:
        f = flat.get(r["ratio"])
        saving = (f"{r['spine_mb'] / f['spine_mb']:.2f}x" if f and f["spine_mb"] else "—")
        slow = f"{r['slowdown']:.2f}" if r.get("slowdown") is not None else "—"
        model = f"{r['model']:.2f}" if s["routing"] == "uniform" else "(uniform only)"
        cells.append([f"{r['ratio']:g}", str(r["variant"]), f"{r['dispatch_ms']:.3f}",
                      f"{r['combine_ms']:.3f}", f"{r['spine_mb']:.3f}", saving,
                      f"{r['imbalance']:.2f}", slow, model, str(r["wrong"])])
    return "\n".join(report.markdown_table(head, cells, left=("variant",)))
