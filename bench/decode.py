"""`semfab bench decode`: a sharded model's decode loop on the fabric, timed per part.

Runs :func:`fabric.core.decode_workload.sharded_decode` on launched processes
(or ``--sim``: in virtual time) for each (EP degree, oversubscription, MoE
variant) and prints a row per point as it finishes: the inter-token latency
(ITL: the time of a decode step, p50 and p99 over steps and ranks) and its
parts (compute charged from the cost model, the TP allreduces, the EP dispatch
and combine, the pipeline hand-offs, and what is left: this rank's own work).

``--model tiny`` computes for real and checks every token against the
unsharded model (a wrong token fails the run); larger presets run
timing-only: real sizes, no payload, uniform routing. ``--layers N`` runs N of
the model's layers and extrapolates the per-layer parts to all of them (said
in the row's note), so EP 8-256 fit in a simulation on this machine.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from bench import report
from fabric.errors import UsageError, check_seconds

PARTS = ("compute", "tp", "dispatch", "combine", "pp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab bench decode`."""
    p.add_argument("--model", default="tiny",
                   help="preset (tiny, mixtral-8x7b, deepseek-v3): tiny computes and checks "
                   "its tokens; the others run timing-only")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--ep", default="2", help="expert-parallel degrees, comma-separated")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--variants", default="flat,in-network",
                   help="MoE dispatch/combine: flat, hierarchical, in-network")
    p.add_argument("--path", default="ina", help="the TP allreduces' path")
    p.add_argument("--batch", type=int, default=4, help="sequences per attention replica")
    p.add_argument("--prompt-len", type=int, default=3,
                   help="prompt tokens: tiny draws 1..N per sequence and feeds them a token a "
                   "step; timing-only presets prefill N per sequence in the first step")
    p.add_argument("--tokens", type=int, default=8, help="new tokens per sequence (steps)")
    p.add_argument("--context", type=int, default=1024,
                   help="tokens already cached, for the compute the cost model charges")
    p.add_argument("--gpu", default="h100",
                   help="GPU figures the compute is charged from (h100, h200; none: no "
                   "compute charged)")
    p.add_argument("--layers", type=int, default=None,
                   help="timing-only: run this many layers and extrapolate to the model's")
    p.add_argument("--topology", metavar="FILE",
                   help="run on this fabric (e.g. `semfab topo gen --cluster`); its workers "
                   "must be tp x ep x pp")
    p.add_argument("--per-leaf", type=int, default=8,
                   help="ranks below each leaf switch (one leaf: a star)")
    p.add_argument("--oversubscription", default="1",
                   help="leaf down:up bandwidth ratios, comma-separated")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="rank-leaf link rate (default: 400 simulated, 2 emulated)")
    p.add_argument("--latency-us", type=float, default=None,
                   help="latency of every link (default: 1 simulated, 50 emulated)")
    p.add_argument("--mtu", type=int, default=None,
                   help="every link's MTU (default 256 KiB; streams cut frames to it, at "
                   "most 64 KiB)")
    from bench.sweep import add_queue_arguments

    add_queue_arguments(p)
    p.add_argument("--checkpoint", default="0", metavar="BYTES",
                   help="checkpoint bursts beside the decode, comma-separated (e.g. 0,64M): "
                   "as many ranks again, interleaved with the decoding ones on every leaf, "
                   "each exchanging BYTES with a rank across the fabric as decoding starts")
    p.add_argument("--slo-ms", type=float, default=None,
                   help="ITL objective: report the share of decode steps (after the longest "
                   "prompt) within it")
    p.add_argument("--sim", action="store_true", help="simulate in virtual time")
    p.add_argument("--both", action="store_true",
                   help="emulate, then simulate each point as this emulator (its switches' "
                   "and nodes' service times, measured first as `semfab sim calibrate` "
                   "does); 'vs sim' compares the ITLs")
    p.add_argument("--calibration", metavar="FILE",
                   help="service times from `semfab sim calibrate --json FILE` for the "
                   "simulated rows (--sim, or --both instead of measuring them)")
    p.add_argument("--seed", type=int, default=0, help="prompts, sampling and routing seed")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    p.add_argument("--json", metavar="PATH", help="write rows and settings as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--plot", metavar="PNG", help="ITL and its parts against EP, per variant")
    p.add_argument("--run-dir", help="where process logs go (emulation)")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the process logs of a clean run (removed by default)")
    from fabric.sim.cli import add_executor_arguments

    add_executor_arguments(p)


def _ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes whole numbers like 2,4,8; got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{flag}: each value must be at least 1")
    return vals


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    from bench.sweep import parse_moe_variants, parse_ratios
    from fabric.core.model import GPUS, Layout, get_model

    m = get_model(args.model)
    data = m.name == "tiny"
    eps = _ints("--ep", args.ep)
    for ep in eps:
        Layout(tp=args.tp, ep=ep, pp=args.pp).check(m)
    variants = parse_moe_variants(args.variants)
    ratios = parse_ratios(args.oversubscription)
    if args.gpu != "none" and args.gpu not in GPUS:
        raise UsageError(f"--gpu {args.gpu!r}: choose {', '.join(GPUS)} or none")
    if args.layers is not None and (data or not 1 <= args.layers <= m.layers):
        raise UsageError(f"--layers: timing-only presets, 1..{m.layers}" if not data else
                         "--layers: tiny computes every layer; leave it out")
    if args.mtu is not None and not 512 <= args.mtu <= 1 << 24:
        raise UsageError(f"--mtu {args.mtu}: give 512 .. 16 MiB bytes")
    for flag, v in (("--batch", args.batch), ("--tokens", args.tokens),
                    ("--prompt-len", args.prompt_len), ("--per-leaf", args.per_leaf)):
        if v < 1:
            raise UsageError(f"{flag} must be at least 1")
    if args.context < 0 or not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError("--context must be >= 0 and --temperature a number >= 0")
    check_seconds("--timeout", args.timeout)
    if args.slo_ms is not None and not (math.isfinite(args.slo_ms) and args.slo_ms > 0):
        raise UsageError(f"--slo-ms {args.slo_ms:g}: give a positive number of milliseconds")
    bw = args.bandwidth_gbps if args.bandwidth_gbps is not None else (400.0 if args.sim
                                                                     else 2.0)
    lat = args.latency_us if args.latency_us is not None else (1.0 if args.sim else 50.0)
    if not (math.isfinite(bw) and bw > 0 and math.isfinite(lat) and lat >= 0):
        raise UsageError("--bandwidth-gbps must be > 0 and --latency-us >= 0")
    from bench.sweep import lossless_settings, queue_settings

    cc, buffer, trim = queue_settings(args, [*variants, args.path])
    dropped: list[str] = []
    try:
        checkpoints = sorted({report.parse_size(v) for v in args.checkpoint.split(",")
                              if v.strip()})
    except ValueError as exc:
        raise UsageError(f"--checkpoint {args.checkpoint}: {exc}") from None
    if not checkpoints or checkpoints[0] < 0:
        raise UsageError("--checkpoint takes byte counts like 0,64M")
    spread = 2 if checkpoints[-1] > 0 else 1
    worlds = {ep: args.tp * ep * args.pp * spread for ep in eps}
    if spread > 1 and any(w // 2 % 2 for w in worlds.values()):
        raise UsageError("--checkpoint pairs its ranks across the fabric: the layout needs "
                         "an even number of GPUs")
    topo_text = None
    if args.topology:
        from fabric.core.topology import TopologyError, loads

        try:
            with open(args.topology, encoding="utf-8") as fh:
                topo_text = fh.read()
            n = len(loads(topo_text, args.topology).workers)
        except OSError as exc:
            raise UsageError(f"--topology {args.topology}: {exc.strerror}") from None
        except TopologyError as exc:
            raise UsageError(str(exc)) from None
        if spread > 1 and 0 in checkpoints:
            raise UsageError("--topology with --checkpoint: a file has one worker count, so "
                             "give burst sizes only (no 0); run without a burst on its own")
        bad = [w for w in worlds.values() if w != n]
        if bad:
            twice = ", twice with --checkpoint" if spread > 1 else ""
            raise UsageError(f"--topology {args.topology} has {n} workers; the layout needs "
                             f"{bad[0]} (tp x ep x pp{twice})")
        ratios = [1.0]
    for world in worlds.values():  # refused before any row runs
        if topo_text is None and world % min(args.per_leaf, world):
            raise UsageError(f"{world} ranks do not fill leaves of --per-leaf "
                             f"{args.per_leaf}; choose a divisor of {world}")
    if not args.sim and max(worlds.values()) > 8:
        raise UsageError(f"{max(worlds.values())} workers are too many processes to emulate "
                         "here (at most 8); add --sim")
    from fabric.sim.cli import check_executor

    check_executor(args, sim=bool(args.sim))
    if args.both and args.sim:
        raise UsageError("--both emulates and simulates each point; leave out --sim")
    from fabric.emulation.launch_cli import check_output_file

    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag, None):
            check_output_file(f"--{flag}", getattr(args, flag))
    s = {"model": m.name, "data": data, "tp": args.tp, "eps": eps, "pp": args.pp,
            "variants": variants, "path": args.path, "batch": args.batch,
            "prompt_len": args.prompt_len, "tokens": args.tokens, "context": args.context,
            "gpu": None if args.gpu == "none" else args.gpu, "layers": args.layers,
            "model_layers": m.layers, "per_leaf": args.per_leaf, "ratios": ratios,
            "bandwidth_gbps": bw, "latency_us": lat, "seed": args.seed,
            "temperature": args.temperature, "world": "simulation" if args.sim
            else "emulation", "both": bool(args.both), "dropped": dropped, "cc": cc,
            "buffer": buffer, "trim": trim, "pfc": lossless_settings(args)[0],
            "credit": lossless_settings(args)[1], "mtu": args.mtu, "topology": args.topology,
            "slo_ms": args.slo_ms, "checkpoints": checkpoints,
            "topology_text": topo_text, "timing": None, "calibration": args.calibration}
    if args.calibration:
        if not (args.sim or args.both):
            raise UsageError("--calibration times the simulated rows: add --sim or --both")
        import dataclasses

        from fabric.sim import calibrate

        s["timing"] = dataclasses.asdict(calibrate.load(args.calibration))
    from fabric.core.congestion import CongestionConfigError
    from fabric.core.congestion.switchq import switch_queues
    from fabric.core.topology import TopologyError

    for world in set(worlds.values()):  # a bad setting is one line now, not mid-run
        for ratio in ratios:
            try:
                switch_queues(_topology(s, world, ratio))
            except (TopologyError, CongestionConfigError) as exc:
                raise UsageError(str(exc)) from None
    return s


def _prompts(s: dict[str, Any], ep: int) -> list[list[int]]:
    n = s["batch"] * ep
    if not s["data"]:
        return [[1] * s["prompt_len"]] * n
    rng = np.random.default_rng([s["seed"], ep])
    return [rng.integers(0, 512, size=int(rng.integers(1, s["prompt_len"] + 1))).tolist()
            for _ in range(n)]


def _topology(s: dict[str, Any], world: int, ratio: float) -> Any:
    """The fabric of a point."""
    from fabric.core.congestion.settings import CongestionSettings
    from fabric.core.topology import leaf_spine, loads, star

    cong = CongestionSettings(buffer_bytes=s.get("buffer"), trim=s.get("trim", False),
                              cc=s.get("cc"), pfc=s.get("pfc", False),
                              credit=s.get("credit", False))
    if s.get("topology_text"):  # the file's own links; flags add congestion settings
        topo = loads(s["topology_text"], s["topology"])
        return topo if cong.is_default else topo.with_congestion(cong)
    per = min(s["per_leaf"], world)
    if world % per:
        raise UsageError(f"{world} ranks do not fill leaves of --per-leaf {per}")
    lat = s["latency_us"]
    mtu: dict[str, Any] = {"mtu": s["mtu"]} if s.get("mtu") else {}
    if world == per:
        topo = star(world, bandwidth_gbps=s["bandwidth_gbps"], latency_us=lat, hosts=0, **mtu)
    else:
        topo = leaf_spine(world // per, per, oversubscription=ratio,
                          leaf_bandwidth_gbps=s["bandwidth_gbps"], leaf_latency_us=lat,
                          spine_latency_us=lat, hosts=0, **mtu)
    return topo.with_congestion(cong)


def _kwargs(s: dict[str, Any], variant: str, ckpt: int = 0) -> dict[str, Any]:
    return {"pp": s["pp"], "temperature": s["temperature"], "seed": s["seed"],
            "variant": variant, "path": s["path"], "data": s["data"], "gpu": s["gpu"],
            "context": s["context"], "layers": s["layers"],
            "payloads": s["world"] == "emulation", "background_bytes": ckpt}


def sim_point(s: dict[str, Any], ep: int, ratio: float, variant: str,
              timeout_s: float, ckpt: int = 0) -> dict[str, Any]:
    """One simulated point (plain settings in, a plain row out); with
    ``s["timing"]``, the emulator's service times on its switches and nodes."""
    from fabric.core.decode_workload import sharded_decode
    from fabric.sim import Simulation, TimingModel

    world = s["tp"] * ep * s["pp"] * (2 if ckpt else 1)
    t0 = time.monotonic()
    kw = {**_kwargs(s, variant, ckpt), "payloads": False}
    timing = TimingModel(**s["timing"]) if s.get("timing") else None
    res = Simulation(_topology(s, world, ratio), seed=s["seed"], timing=timing,
                     timeout_s=timeout_s).run(sharded_decode, s["model"], s["tp"], ep,
                                              _prompts(s, ep), s["tokens"], **kw)
    row = _row(s, ep, ratio, variant, res.results, time.monotonic() - t0, ckpt)
    row["world"] = "simulation"
    _class_figures(row, s, ep, len(res.results[0]["steps"]), {
        cls: {"bytes": res.bytes_by_class[cls], "frames": res.frames_by_class.get(cls, 0),
              "hops": res.hops_by_class.get(cls, 0)} for cls in res.bytes_by_class})
    if timing is not None:
        row["note"] = (row["note"] + "; " if row["note"] else "") + "as this emulator " + \
            _timing_text(s["timing"])
    return row


def _timing_text(t: dict[str, float]) -> str:
    return (f"(switch {t['switch_frame_s'] * 1e6:.0f} us/frame + {t['switch_byte_s'] * 1e9:.2f} "
            f"ns/B, node {t['node_frame_s'] * 1e6:.0f} us/frame)")


def _class_figures(row: dict[str, Any], s: dict[str, Any], ep: int, steps: int,
                   per: dict[str, dict[str, int]]) -> None:
    """Add a run's traffic per network class to its row (either world): MB per step
    and semantic distance per token (frames handed from node to node on the
    class's links, a process crossing when launched, and of those the switch
    traversals); with --layers, extrapolated as the per-layer parts are."""
    scale = s["model_layers"] / s["layers"] if s["layers"] else 1.0
    steps = max(steps, 1)
    toks = steps * s["batch"] * ep  # a token per sequence per step
    row["mb_per_step_by_class"] = {cls: t["bytes"] / steps * scale / 1e6
                                   for cls, t in sorted(per.items())}
    row["semantic_per_token_by_class"] = {
        cls: {"crossings": t["frames"] * scale / toks, "hops": t["hops"] * scale / toks}
        for cls, t in sorted(per.items())}


def _row(s: dict[str, Any], ep: int, ratio: float, variant: str, per: list[dict[str, Any]],
         wall: float, ckpt: int = 0) -> dict[str, Any]:
    """ITL and its parts from every decoding rank's steps; tokens checked (tiny)."""
    burst = [p["background_s"] for p in per if "background_s" in p]
    per = [p for p in per if "steps" in p]  # the decoding ranks
    scale = s["model_layers"] / s["layers"] if s["layers"] else 1.0
    every = [st for p in per for st in p["steps"]]
    # ITL and its parts over the decode steps (prefill steps give the TTFT)
    steps = [st for st in every if not st.get("prefill")] or every

    def full(st: dict[str, float], key: str) -> float:
        """A part (or the step) with the per-layer share extrapolated to every layer."""
        v = st.get(key, 0.0)
        fixed = st.get("head", 0.0) * (key in ("compute", "step")) \
            + st.get("pp", 0.0) * (key in ("pp", "step"))
        return (v - fixed) * scale + fixed

    def stats(v: np.ndarray) -> dict[str, float]:
        return {"mean": float(np.mean(v)), "p50": float(np.percentile(v, 50)),
                "p99": float(np.percentile(v, 99))}

    itl = np.array([full(st, "step") for st in steps]) * 1e3
    per_part = {k: np.array([full(st, k) for st in steps]) * 1e3 for k in PARTS}
    # what the parts leave of each step: this rank's own work
    per_part["other"] = itl - sum(per_part.values())
    parts = {k: stats(v) for k, v in per_part.items()}
    # time to first token: tiny feeds a prompt a token a step, so a sequence's first
    # new token ends step len(prompt) - 1 of its replica (first stage, TP rank 0); a
    # timing-only preset's first step is the whole prompts' prefill
    prompts = _prompts(s, ep)
    ttft = []
    for p in per:
        if p["stage"] == 0 and p["tp_rank"] == 0:
            ends = np.cumsum([full(st, "step") for st in p["steps"]]) * 1e3
            ttft += [float(ends[len(prompts[q]) - 1 if s["data"] else 0])
                     for q in range(p["replica"], len(prompts), ep)]
    gpus = s["tp"] * ep * s["pp"]
    decode = itl
    wrong = None
    if s["data"]:
        from fabric.core.decoder import TinyWeights, generate_reference
        from fabric.core.model import get_model

        got: dict[int, list[int]] = {}
        wrong = 0
        for p in per:
            for q, toks in p["tokens"].items():
                if got.setdefault(int(q), toks) != toks:
                    wrong += 1  # two TP ranks of a replica disagree
        want = generate_reference(TinyWeights(get_model("tiny")), _prompts(s, ep), s["tokens"],
                                  s["temperature"], s["seed"])
        wrong += sum(got.get(i) != w for i, w in enumerate(want))
    note = f"{s['layers']} of {s['model_layers']} layers run, x{scale:g}" if s["layers"] \
        else ""
    return {"world": s["world"], "ep": ep, "tp": s["tp"], "pp": s["pp"],
            "gpus": s["tp"] * ep * s["pp"],
            "ratio": ratio, "variant": variant, "checkpoint_bytes": ckpt,
            "checkpoint_ms": max(burst) * 1e3 if burst else None, "itl_ms": stats(itl),
            "parts_ms": parts, "ttft_ms": stats(np.array(ttft)),
            # the three factors: compute throughput (every sequence gains a token a
            # step), and delivery timeliness (decode steps within the ITL objective)
            "tokens_per_s_per_gpu": len(prompts) / (float(np.mean(itl)) / 1e3) / gpus,
            # communication completion: the share of network operations (per rank)
            # that finished without a resend or a timeout
            "completion_rate": 1.0 - sum(st.get("resent", 0.0) for st in steps)
            / max(sum(st.get("ops", 0.0) for st in steps), 1.0),
            "within_slo": (float(np.mean(decode <= s["slo_ms"])) if s["slo_ms"] and decode.size
                           else None),
            "steps": len(steps), "wall_s": wall,
            "wrong_sequences": wrong, "note": note}


def run(args: argparse.Namespace) -> int:
    """Entry point of `semfab bench decode`."""
    s = _settings(args)
    print(_header(s), flush=True)
    if s["both"] and s["timing"] is None:
        # the simulated rows simulate this emulator: its service times first
        from fabric.sim import calibrate

        print("# --both: measuring this emulator's service times (as `semfab sim "
              "calibrate`) ...", flush=True)
        s["timing"] = calibrate.measure()["timing"]
    if s["timing"] is not None:
        print("# simulated rows as this emulator " + _timing_text(s["timing"]), flush=True)
    print(_table_head(), flush=True)
    points = [(ep, ratio, v, ck) for ep in s["eps"] for ratio in s["ratios"]
              for ck in s["checkpoints"] for v in s["variants"]]
    results: list[dict[str, Any]] = []
    t_start = time.monotonic()
    if args.sim:
        from fabric.sim.cli import run_points

        works = [(sim_point, (s, ep, ratio, v, args.timeout, ck))
                 for ep, ratio, v, ck in points]
        for row in run_points(works, args.jobs, args.executor):
            results.append(row)
            _print_row(row)
    else:
        from fabric.core.decode_workload import sharded_decode
        from fabric.emulation.launcher import launch
        from fabric.emulation.workloads import run_in_emulation

        for ep, ratio, ck in dict.fromkeys((p[0], p[1], p[3]) for p in points):
            world = s["tp"] * ep * s["pp"] * (2 if ck else 1)
            kw: dict[str, Any] = {"timeout_s": args.timeout, "seed": s["seed"],
                                  "remove_run_dir": not (args.run_dir or args.keep_runs)}
            if args.run_dir:
                kw["run_dir"] = f"{args.run_dir}/ep{ep}-r{ratio:g}-c{ck}"
            with launch(topology=_topology(s, world, ratio), **kw) as fab:
                for ep_, ratio_, v, ck_ in points:
                    if (ep_, ratio_, ck_) != (ep, ratio, ck):
                        continue
                    t0 = time.monotonic()
                    before = fab.class_traffic()
                    per = fab.run(run_in_emulation, sharded_decode, s["model"], s["tp"], ep,
                                  _prompts(s, ep), s["tokens"], **_kwargs(s, v, ck))
                    row = _row(s, ep, ratio, v, per, time.monotonic() - t0, ck)
                    after = fab.class_traffic()
                    _class_figures(row, s, ep, len(per[0]["steps"]), {
                        cls: {k: n - before.get(cls, {}).get(k, 0) for k, n in t.items()}
                        for cls, t in after.items()})
                    results.append(row)
                    _print_row(row)
                    if s["both"]:
                        sim = sim_point(s, ep, ratio, v, args.timeout, ck)
                        row["vs_sim"] = row["itl_ms"]["p50"] / sim["itl_ms"]["p50"]
                        results.append(sim)
                        _print_row(sim)
    table = format_table(results)
    print("\n" + table)
    wrong = sum(r["wrong_sequences"] or 0 for r in results)
    checked = "every token exact" if s["data"] and not wrong else (
        f"{wrong} sequences WRONG" if wrong else "timing-only: no token check")
    print(f"# {len(results)} rows in {time.monotonic() - t_start:.1f} s; {checked}")
    if s["both"]:
        ratios = [r["vs_sim"] for r in results if "vs_sim" in r]
        off = [v for v in ratios if not 1 / 1.15 <= v <= 1.15]
        print("# emulated ITL p50 over simulated: " + ", ".join(f"{v:.3f}" for v in ratios)
              + ("; all within 15%" if not off else f"; {len(off)} beyond 15%"))
    if args.json:
        path = report.write_json(args.json, "decode", results, extra={"settings": s})
        print(f"# wrote {path}")
    if args.markdown:
        path = report.write_markdown(args.markdown, _header(s) + "\n\n" + table + "\n")
        print(f"# wrote {path}")
    if args.plot:
        print(f"# wrote {plot(results, args.plot, _header(s)[2:])}")
    return 1 if wrong else 0


def _header(s: dict[str, Any]) -> str:
    return (f"# semfab bench decode ({s['world']}): {s['model']}"
            f"{'' if s['data'] else ' (timing-only)'}, tp {s['tp']} x ep "
            f"{','.join(map(str, s['eps']))} x pp {s['pp']}; {s['batch']} sequences per "
            f"replica, {s['tokens']} new tokens, context {s['context']}; compute "
            f"{'charged as ' + s['gpu'] if s['gpu'] else 'not charged'}; TP path {s['path']}; "
            + (f"fabric {s['topology']}; " if s.get("topology") else
               f"links {s['bandwidth_gbps']:g} Gb/s, {s['latency_us']:g} us, {s['per_leaf']} "
               f"ranks per leaf, oversubscription {','.join(f'{r:g}' for r in s['ratios'])}; ")
            + f"seed {s['seed']}"
            + (f"; congestion: cc {s['cc'] or '(none)'}, buffer {s['buffer'] or 'unbounded'}"
               f"{', trimming' if s['trim'] else ''}{', PFC' if s.get('pfc') else ''}"
               f"{', credit-based links' if s.get('credit') else ''}"
               if s["cc"] or s["buffer"] or s.get("credit") else "")
            + (f"; left out: {', '.join(s['dropped'])}" if s["dropped"] else ""))


_COLS = (("world", 11), ("ep", 4), ("gpus", 5), ("ratio", 6), ("ckpt", 6),
         ("variant", 13), ("itl p50", 9),
         ("p99", 9), ("compute", 9), ("tp", 8), ("dispatch", 9), ("combine", 9),
         ("pp", 7), ("other", 8))


def _table_head() -> str:
    return "#" + "".join(f"{name:>{w}}" for name, w in _COLS) + "  (ms)"


def _cells(r: dict[str, Any]) -> list[str]:
    p = {k: v["mean"] for k, v in r["parts_ms"].items()}
    return [r["world"], str(r["ep"]), str(r["gpus"]), f"{r['ratio']:g}",
            report.format_size(r["checkpoint_bytes"]), r["variant"],
            f"{r['itl_ms']['p50']:.3f}", f"{r['itl_ms']['p99']:.3f}",
            *(f"{p[k]:.3f}" for k in (*PARTS, "other"))]


def _print_row(r: dict[str, Any]) -> None:
    print(" " + "".join(f"{c:>{w}}" for c, (_n, w) in zip(_cells(r), _COLS, strict=True))
          + (f"  {r['note']}" if r["note"] else ""), flush=True)


def format_table(results: list[dict[str, Any]]) -> str:
    """Markdown: a row per point, ITL beside flat's at the same EP and ratio."""
    flat = {(r["world"], r["ep"], r["ratio"], r["checkpoint_bytes"]): r for r in results
            if r["variant"] == "flat"}
    head = ["world", "EP", "GPUs", "ratio", "checkpoint", "variant", "ITL p50 (ms)", "p99",
            "compute", "TP", "dispatch", "combine", "PP", "other", "vs flat", "vs sim", "TTFT p50",
            "tok/s/GPU", "in SLO", "wrong"]
    rows = []
    for r in results:
        f = flat.get((r["world"], r["ep"], r["ratio"], r["checkpoint_bytes"]))
        vs = f"{r['itl_ms']['p50'] / f['itl_ms']['p50']:.2f}x" if f else "-"
        slo = f"{r['within_slo']:.1%}" if r.get("within_slo") is not None else "-"
        rows.append([*_cells(r), vs, f"{r['vs_sim']:.3f}" if "vs_sim" in r else "-",
                     f"{r['ttft_ms']['p50']:.3f}", f"{r['tokens_per_s_per_gpu']:.0f}", slo,
                     "-" if r["wrong_sequences"] is None else str(r["wrong_sequences"])])
    return "\n".join(report.markdown_table(head, rows, left=("world", "variant")))


def plot(results: list[dict[str, Any]], path: str, title: str) -> str:
    """PNG: ITL p50 against EP per (variant, ratio) on the left; the parts of each
    point stacked on the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2)
    keys = sorted({(r["variant"], r["ratio"]) for r in results})
    for v, ratio in keys:
        rows = sorted((r for r in results if (r["variant"], r["ratio"]) == (v, ratio)),
                      key=lambda r: r["ep"])
        ax.plot([r["ep"] for r in rows], [r["itl_ms"]["p50"] for r in rows], marker="o",
                label=f"{v}, {ratio:g}:1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("EP degree")
    ax.set_ylabel("ITL p50 (ms)")
    ax.legend(fontsize=8)
    labels = [f"{r['variant'][:4]} ep{r['ep']} {r['ratio']:g}" for r in results]
    bottom = np.zeros(len(results))
    for k in (*PARTS, "other"):
        vals = np.array([max(r["parts_ms"][k]["mean"], 0.0) for r in results])
        bx.bar(range(len(results)), vals, bottom=bottom, label=k)
        bottom += vals
    bx.set_xticks(range(len(results)), labels, rotation=60, fontsize=7, ha="right")
    bx.set_ylabel("ms per step")
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
