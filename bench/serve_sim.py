"""`semfab bench tokens --sim`: a sharded model serving requests, in virtual time.

The decode loop of `semfab serve --model` (:func:`fabric.core.serve_workload.served_decode`:
the leader's plans, continuous batching, every rank's TP allreduces, MoE
dispatch and combine and stage hand-offs) runs in the simulator on the
topology given (e.g. `semfab topo gen --cluster ...`, to 1024 GPUs), timing-only:
real sizes, compute charged from the cost model (``--gpu``). A fabric of several
layouts' worth of workers (``--workers``, or the topology's) runs that many
generators side by side, data parallel, the requests dealt to them in turn.

After each step the leader posts the step's tokens to host0 (a record of
``RECORD_BYTES`` each) as frames on the fabric's links (``ctx.post``: reliable,
in the background, queued with whatever else those links carry: the
front-end's DCTCP, a checkpoint burst); a token's transport is the time from
its step's end to its post being whole at host0. With ``--frontend-us``, or on
a fabric without host0, that way is a fixed time instead. What follows is
modelled: host0's detokenizer and HTTP server add ``--host-us`` per token
(default: what `semfab bench tokens` measured for those two layers on a 2-core
machine), and the client sends a request the front-end path's latency before
the leader sees it. From those times the rows are the emulated benchmark's:
TTFT, TPOT, ITL, E2EL, goodput, and the step split ``parts_ms`` per token.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from bench import report
from fabric.errors import UsageError

#: host0's per-token cost after the token arrives (detokenizer and HTTP/SSE), in
#: microseconds: the interpretation and presentation layers' means, 0.04 + 0.15 ms,
#: measured by `semfab bench tokens --model tiny --concurrency 1 --transport direct
#: --detok immediate` on this 2-core machine (docs/SERVING.md).
HOST_US_PER_TOKEN = 190.0
#: Bytes of one token record on the front-end (fabric.serving.records).
RECORD_BYTES = 32
#: Prompt tokens when --input-len is not given.
DEFAULT_INPUT_LEN = 128


def add_arguments(g: Any) -> None:
    """The flags `semfab bench tokens --sim` adds (an argument group)."""
    g.add_argument("--sim", action="store_true",
                   help="simulate in virtual time (a model preset, timing-only; the client "
                   "side modelled)")
    g.add_argument("--topology", metavar="FILE",
                   help="--sim: the fabric (e.g. `semfab topo gen --cluster`); its workers "
                   "are the layout's (default: a star of 400 Gb/s, 1 us links)")
    g.add_argument("--gpu", default="h100",
                   help="--sim: GPU figures the compute is charged from (h100, h200; none)")
    g.add_argument("--layers", type=int, default=None,
                   help="--sim: run this many of the model's layers on the fabric and "
                   "charge each step the rest (their share of it)")
    g.add_argument("--frontend-us", type=float, default=None,
                   help="--sim: a fixed time one way between the leader and the client "
                   "instead of the tokens' frames to host0 (default: frames where the "
                   "topology has host0, else 0)")
    g.add_argument("--host-us", type=float, default=HOST_US_PER_TOKEN,
                   help="--sim: host0's detokenizer and HTTP cost per token")
    g.add_argument("--checkpoint", metavar="BYTES", default=None,
                   help="--sim: as decoding starts every rank sends host0 this much (its "
                   "shard of a checkpoint) over the links the tokens take (e.g. 256M)")


def _topology(args: argparse.Namespace, size: int) -> Any:
    """The fabric: the file's, or a star of ``--workers`` (default: one generator)."""
    from fabric.core.topology import TopologyError, loads, star

    if not args.topology:
        return star(args.workers or size, bandwidth_gbps=400.0, latency_us=1.0, hosts=1)
    try:
        with open(args.topology, encoding="utf-8") as fh:
            topo = loads(fh.read(), args.topology)
    except OSError as exc:
        raise UsageError(f"--topology {args.topology}: {exc.strerror}") from None
    except TopologyError as exc:
        raise UsageError(str(exc)) from None
    have = len(topo.workers)
    if args.workers not in (None, have):
        raise UsageError(f"--workers {args.workers}: --topology {args.topology} has {have}; "
                         "leave --workers out to take the file's")
    if have % size:
        raise UsageError(f"--topology {args.topology} has {have} workers; the layout needs "
                         f"{size} (tp x ep x pp) or a multiple (data parallel generators)")
    return topo


def frontend_s(topo: Any, flag_us: float | None) -> float:
    """One way between the first worker and host0: the flag, else the path's links
    (latency plus one record's serialization each), else 0 (no host0)."""
    if flag_us is not None:
        return flag_us * 1e-6
    names = {n.name for n in topo.hosts}
    if "host0" not in names:
        return 0.0
    total = 0.0
    for link in topo.path_links(topo.workers[0].name, "host0"):
        p = link.params
        total += p.latency_us * 1e-6
        if p.bandwidth_gbps:
            total += RECORD_BYTES * 8 / (p.bandwidth_gbps * 1e9)
    return total


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The simulated run's settings (UsageError on the first bad flag)."""
    from fabric.core.model import GPUS, MODELS, Layout

    if args.model not in MODELS:
        raise UsageError(f"--sim serves a model preset: --model {' or '.join(MODELS)}")
    m = MODELS[args.model]
    Layout(tp=args.tp, ep=args.ep, pp=args.pp).check(m)
    if args.gpu != "none" and args.gpu not in GPUS:
        raise UsageError(f"--gpu {args.gpu!r}: choose {', '.join(GPUS)} or none")
    if args.layers is not None and not 1 <= args.layers <= m.layers:
        raise UsageError(f"--layers {args.layers}: 1..{m.layers}")
    for flag, v in (("--frontend-us", args.frontend_us), ("--host-us", args.host_us)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} {v:g}: give microseconds >= 0")
    ckpt = 0
    if args.checkpoint is not None:
        from bench.report import parse_size

        bad = UsageError(f"--checkpoint {args.checkpoint}: give bytes per rank, e.g. 256M")
        try:
            ckpt = parse_size(args.checkpoint)
        except ValueError:
            raise bad from None
        if ckpt < 1:
            raise bad
    size = args.tp * args.ep * args.pp
    if args.workers is not None and (args.workers < 1 or args.workers % size):
        raise UsageError(f"--workers {args.workers}: give a multiple of tp x ep x pp = {size} "
                         "(one generator per group of that many)")
    topo = _topology(args, size)
    world = len(topo.workers)
    # the tokens go to host0 as frames unless a fixed time is asked for
    as_frames = args.frontend_us is None and any(h.name == "host0" for h in topo.hosts)
    if ckpt and not as_frames:
        raise UsageError("--checkpoint goes to host0 over the links: it needs a topology "
                         "with host0 and no --frontend-us")
    return {"model": m.name, "tp": args.tp, "ep": args.ep, "pp": args.pp, "moe": args.moe,
            "dp": world // size,
            "tp_path": args.tp_path, "gpu": None if args.gpu == "none" else args.gpu,
            "layers": args.layers, "model_layers": m.layers, "world": world,
            "input_len": args.input_len or DEFAULT_INPUT_LEN, "output_len": args.tokens,
            "frontend_s": frontend_s(topo, args.frontend_us), "host_s": args.host_us * 1e-6,
            "tokens_as_frames": as_frames, "checkpoint_bytes": ckpt,
            "topology": args.topology, "seed": args.seed, "topo": topo}


def merged(results: list[Any], posts: dict[str, list[Any]] | None = None,
           topo: Any = None) -> dict[str, Any]:
    """The generators' leaders' results as one: every request in request order, every
    step of every generator; with the simulation's ``posts``, each request's
    ``seen`` (when each of its tokens was whole at host0, on its times' clock)."""
    leads = [r for r in results if r]
    if posts is not None:
        whole = {(a.src, a.post): a.t for a in posts.get("host0", [])}
        for r in leads:
            src = topo.node(r["leader"]).id
            for q in r["requests"]:
                try:
                    q["seen"] = [whole[(src, p)] - r["start"] for p in q["posts"]]
                except KeyError:  # (the run ends only when every post is whole)
                    from fabric.sim import SimulationError

                    raise SimulationError(f"a post of {r['leader']} never reached host0"
                                          ) from None
    requests = sorted((q for r in leads for q in r["requests"]), key=lambda q: q["id"])
    steps = [p for r in leads for p in r["steps"]]
    return {"requests": requests, "steps": steps}


def _arrivals(level: Any, burstiness: float, seed: int, i: int) -> list[float] | None:
    """Open loop: seconds from the start (gamma gaps, Poisson at burstiness 1)."""
    if not math.isfinite(level.rate):
        return None
    rng = np.random.default_rng([seed, i])
    gaps = rng.gamma(burstiness, 1.0 / (level.rate * burstiness), level.num_prompts)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def clients(res: dict[str, Any], s: dict[str, Any]) -> tuple[list[Any], int, int]:
    """The client's view of the leader's request times (ns): ClientResults and the
    level's window."""
    from fabric.serving.metrics import ClientResult

    fe, host = s["frontend_s"], s["host_s"]
    out = []
    for i, q in enumerate(res["requests"]):
        sent = q["arrival"] - fe
        seen = [t + host for t in q["seen"]] if "seen" in q else \
            [t + fe + host for t in q["tokens"]]
        out.append(ClientResult(
            ok=True, status=200, response_id=f"sim-{i}", t_send=int(sent * 1e9),
            t_end=int(seen[-1] * 1e9), t_events=[int(t * 1e9) for t in seen],
            content=[True] * len(seen), finish_reason="length",
            usage={"prompt_tokens": s["input_len"], "completion_tokens": len(seen)},
            input_len=s["input_len"]))
    t0 = min(c.t_send for c in out)
    t1 = max(c.t_end for c in out)
    return out, t0, t1


def level_row(res: dict[str, Any], s: dict[str, Any], level: Any, opts: Any,
              wall: float) -> dict[str, Any]:
    """One level's row: client metrics, the step split, the experience factors."""
    from bench.step_split import STEP_PARTS, step_split
    from fabric.serving.metrics import client_summary

    cl, t0, t1 = clients(res, s)
    row, _per = client_summary(cl, t0, t1, opts.slo, opts.percentiles)
    split = step_split(res["steps"], [([], -math.inf, math.inf)], opts.percentiles)
    keep = ("mean", "p50", "p99")
    row["parts_ms"] = {k: {q: split[k][q] for q in keep} for k in STEP_PARTS} \
        if split else {}
    if split:
        way = [(b - a) * 1e3 for q in res["requests"] if "seen" in q
               for a, b in zip(q["tokens"], q["seen"], strict=True)]
        row["parts_ms"]["transport"] = {
            "mean": float(np.mean(way)), "p50": float(np.percentile(way, 50)),
            "p99": float(np.percentile(way, 99))} if way else \
            {q: s["frontend_s"] * 1e3 for q in keep}
        row["parts_ms"]["interpretation+presentation"] = {q: s["host_s"] * 1e3 for q in keep}
        itl = row["itl_ms"]["mean"]
        row["step_over_itl"] = sum(split[k]["mean"] for k in STEP_PARTS) / itl \
            if itl and math.isfinite(itl) else float("nan")
        row["collectives"] = split["collectives"]
        compute = sum(p.get("compute", 0.0) for p in res["steps"])
        total = sum(p["step"] for p in res["steps"])
        itl_slo = opts.slo.get("itl", opts.slo.get("tpot"))
        gaps = [(b - a) * 1e3 for q in res["requests"] for a, b in
                zip(q["tokens"], q["tokens"][1:], strict=False)]
        timely = float(np.mean([g <= itl_slo for g in gaps])) if gaps and itl_slo else \
            float("nan")
        row["experience"] = {"compute": compute / total if total else float("nan"),
                             "completion": split["collectives"]["completion_rate"],
                             "timeliness": timely}
        e = row["experience"]
        e["product"] = e["compute"] * e["completion"] * e["timeliness"]
    row.update({"world": "simulation", "model": s["model"], "tp": s["tp"], "ep": s["ep"],
                "pp": s["pp"], "dp": s["dp"], "moe": s["moe"], "tp_path": s["tp_path"],
                "gpu": s["gpu"], "layers": s["layers"], "gpus": s["world"], **level.fields(),
                "input_len": s["input_len"], "output_len": s["output_len"],
                "frontend_us": s["frontend_s"] * 1e6, "host_us": s["host_s"] * 1e6,
                "tokens_as_frames": s["tokens_as_frames"],
                "checkpoint_bytes": s["checkpoint_bytes"],
                "wall_s": wall, "strategy": "simulated", "load": level.label})
    return row


def run(opts: Any) -> int:
    """`semfab bench tokens --sim`: each level simulated, a row printed as it finishes."""
    from bench.step_split import STEP_PARTS
    from fabric.core.serve_workload import served_decode
    from fabric.sim import Simulation

    a = opts.args
    s = check(a)
    where = f"topology {a.topology}" if a.topology else "a star of 400 Gb/s, 1 us links"
    gens = f"{s['dp']} generators of " if s["dp"] > 1 else ""
    print(f"# semfab bench tokens --sim: {s['model']} as {gens}tp {s['tp']} x ep {s['ep']} x "
          f"pp {s['pp']} = {s['world']} GPUs (moe {s['moe']}, tp allreduce {s['tp_path']}, "
          f"gpu {s['gpu'] or 'none'}"
          + (f", {s['layers']} of {s['model_layers']} layers run" if s["layers"] else "")
          + f") on {where}")
    way = "tokens to host0 as frames on the links" if s["tokens_as_frames"] else \
        f"tokens {s['frontend_s'] * 1e6:.1f} us one way (fixed)"
    print(f"# input-len {s['input_len']}  output-len {s['output_len']}  {way}  requests "
          f"{s['frontend_s'] * 1e6:.1f} us one way  host {s['host_s'] * 1e6:.0f} us/token "
          f"(modelled)  seed {s['seed']}"
          + (f"  checkpoint {s['checkpoint_bytes']} B per rank to host0"
             if s["checkpoint_bytes"] else ""), flush=True)
    rows = []
    head = ["load", "req/s", "out tok/s", "TTFT p50", "ITL p50", "ITL p99", "goodput",
            *STEP_PARTS, "parts / ITL", "wall s"]
    print("| " + " | ".join(head) + " |", flush=True)
    for i, level in enumerate(opts.levels):
        n = level.num_prompts
        if level.concurrency is not None and math.isfinite(level.rate):
            raise UsageError("--sim: give a request rate (open loop) or a concurrency "
                             "(closed loop) per level, not both")
        t0 = time.monotonic()
        sim = Simulation(s["topo"], seed=s["seed"], timeout_s=3600.0).run(
            served_decode, s["model"], s["tp"], s["ep"], [s["input_len"]] * n,
            [s["output_len"]] * n, pp=s["pp"],
            arrivals=_arrivals(level, a.burstiness, s["seed"], i),
            concurrency=level.concurrency or 0, gpu=s["gpu"], variant=s["moe"],
            path=s["tp_path"], layers=s["layers"], seed=s["seed"],
            frontend_s=s["frontend_s"], record_bytes=RECORD_BYTES,
            post_to="host0" if s["tokens_as_frames"] else None,
            checkpoint_bytes=s["checkpoint_bytes"])
        res = merged(sim.results, sim.posts if s["tokens_as_frames"] else None, s["topo"])
        row = level_row(res, s, level, opts, time.monotonic() - t0)
        # bytes on each network class per token delivered (with --layers: scaled to
        # the model's layers, as the step's time is; not the front-end's, whose
        # frames, the tokens to host0, go once a step)
        scale = s["model_layers"] / s["layers"] if s["layers"] else 1.0
        toks = max(row["total_output_tokens"], 1)

        def per_token(cls: str, n: int, scale: float = scale, toks: int = toks) -> float:
            return n * (1.0 if cls == "frontend" else scale) / toks

        row["kb_per_token_by_class"] = {cls: per_token(cls, b) / 1e3
                                        for cls, b in sorted(sim.bytes_by_class.items())}
        # semantic distance per network class: frames handed from node to node on
        # its links (process crossings, launched) and switch traversals, per token
        row["semantic_per_token_by_class"] = {
            cls: {"crossings": per_token(cls, sim.frames_by_class.get(cls, 0)),
                  "hops": per_token(cls, sim.hops_by_class.get(cls, 0))}
            for cls in sorted(sim.frames_by_class)}
        rows.append(row)
        P = row["parts_ms"]
        print("| " + " | ".join([
            level.label, f"{row['request_throughput']:.2f}",
            f"{row['output_throughput_tok_s']:.0f}", f"{row['ttft_ms']['median']:.3f}",
            f"{row['itl_ms']['median']:.3f}", f"{row['itl_ms']['p99']:.3f}",
            f"{row['goodput_req_s']:.2f}" if row.get("goodput_req_s") is not None else "-",
            *[f"{P[k]['mean']:.3f}" for k in STEP_PARTS],
            f"{row['step_over_itl']:.3f}", f"{row['wall_s']:.1f}"]) + " |", flush=True)
    params = {k: v for k, v in s.items() if k != "topo"}
    params.update({"levels": [lv.fields() for lv in opts.levels], "slo_ms": opts.slo,
                   "percentiles": opts.percentiles, "burstiness": a.burstiness})
    if a.json:
        report.write_json(a.json, "tokens-sim", rows, extra={"params": params})
        print(f"wrote {a.json}")
    if a.markdown:
        table = [[r["load"], f"{r['itl_ms']['median']:.3f}", f"{r['itl_ms']['p99']:.3f}",
                  f"{r['ttft_ms']['median']:.3f}"] for r in rows]
        report.write_markdown(a.markdown, "\n".join(report.markdown_table(
            ["load", "ITL p50 (ms)", "ITL p99", "TTFT p50"], table)) + "\n")
        print(f"wrote {a.markdown}")
    return 0
