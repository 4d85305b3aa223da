"""`semfab bench loss`: goodput and retransmissions under injected loss.

For each loss rate (and one reorder-only run), a fabric is launched whose
switch drops frames on every link with that probability (seeded), and each
path runs on it:

* ``p2p``: a bulk WRITE stream from worker 0 to worker 1 through the switch,
  under each retransmit policy (``selective``, ``gbn``);
* ``ina``: the frame-plane in-network allreduce, whose workers resend a chunk's
  contribution when its result is late (per-chunk timers: selective by
  construction, so it runs once, as policy ``selective``).

Reported per row: goodput (median over transfers; with ``--repeat R`` the
fabrics are launched R times in turn, seed + round, and a row pools the
transfers of every round, because one launch's loss-free goodput moves by
±20% on a small host), goodput relative to the
loss-free row of the same path and policy in this run, frames the links
really lost (counted by the switch's injectors), frames retransmitted,
spurious retransmissions, retransmit timers that ran out (RTO expiries: a
stream's timer, or one chunk's on ina; the costly way to recover), p99
completion time and wrong elements.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from bench import report
from fabric.errors import UsageError, check_seconds

PATHS = ("p2p", "ina")
POLICIES = ("selective", "gbn")


#: The frames that carry a path's data (what "frames lost" counts for it).
DATA_OPS = {"p2p": ("WRITE",), "ina": ("REDUCE", "RESULT")}


def _switch_counts(ep: Any, path: str) -> tuple[int, int]:
    """(data frames the links lost, contributions the engine already had)."""
    st = ep.switch_stats()
    lost = sum(st["fault_lost"].get(op, 0) for op in DATA_OPS[path])
    return lost, int(st["engine"]["duplicates"])


def loss_task(ep: Any, path: str, policy: str, size: int, iters: int, seed: int,
              frame_bytes: int) -> dict[str, Any]:
    """Runs on every worker; rank 0 reports for the pair."""
    from fabric.emulation.p2p import stream_recv, stream_send
    from kernels.reference import count_wrong, expected_allreduce, make_tensor

    count = size // 4
    times, retx, spurious, wrong = [], 0, 0, 0
    timeouts0 = ep.state.timeouts
    lost0, dup0 = _switch_counts(ep, path) if ep.rank == 0 else (0, 0)
    x = ep.alloc(count, "float32") if path == "ina" else None
    ep.chunk_bytes["ina"] = frame_bytes
    for it in range(iters):
        if path == "p2p":
            ep.barrier()
            if ep.rank == 0:
                data = make_tensor(0, it, count, "float32", seed)
                st = stream_send(ep, 1, data, policy=policy, frame_bytes=frame_bytes)
                times.append(st["seconds"])
                retx += st["retransmitted"]
                spurious += st["spurious_retransmits"]
            elif ep.rank == 1:
                out = np.empty(count, np.float32)
                stream_recv(ep, 0, out, policy=policy, frame_bytes=frame_bytes)
                wrong += count_wrong(out, make_tensor(0, it, count, "float32", seed))
        else:
            assert x is not None
            np.copyto(x, make_tensor(ep.rank, it, count, "float32", seed))
            r0 = ep.retransmits
            ep.barrier()
            t0 = time.perf_counter()
            ep.allreduce(x, path="ina", out=x)
            times.append(time.perf_counter() - t0)
            retx += ep.retransmits - r0
            wrong += count_wrong(x, expected_allreduce(ep.world, it, count, "float32", "sum",
                                                       seed))
    ep.barrier()
    lost, dups = _switch_counts(ep, path) if ep.rank == 0 else (0, 0)
    if path == "ina" and ep.rank == 0:
        # a resent contribution the switch already had was not needed
        spurious = dups - dup0
    return {"times": times, "retransmitted": retx, "spurious": spurious, "wrong": wrong,
            "lost": lost - lost0, "timeouts": ep.state.timeouts - timeouts0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab bench loss`."""
    p.add_argument("--loss", default="0,0.001,0.01,0.05",
                   help="loss probabilities per frame per link, comma-separated")
    p.add_argument("--policy", default=",".join(POLICIES),
                   help="retransmit policies for p2p (selective, gbn, or a registered one)")
    p.add_argument("--paths", default=",".join(PATHS), help="p2p and/or ina")
    p.add_argument("--reorder", default="0.05:2",
                   help="also run with reordering only (P:K); 'none' to skip")
    p.add_argument("--size", default="4M", help="bytes per transfer")
    p.add_argument("--frame", default="64K", help="frame (chunk) size")
    p.add_argument("-n", "--iters", type=int, default=5, help="transfers per row and round")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds: each launches every scenario's fabric again (seed + round), "
                        "in turn, and a row pools its transfers over all rounds, so the "
                        "loss-free baseline is not one launch's luck")
    p.add_argument("--seed", type=int, default=7, help="fault injection and input seed")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds any wait may take")
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    p.add_argument("--plot", metavar="PATH", help="goodput ratio against loss, PNG")
    p.add_argument("--run-dir", help="where process logs go")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the process logs of a clean run (removed by default)")


def _parse(args: argparse.Namespace) -> tuple[list[float], list[str], list[str], int, int]:
    from fabric.core.reliability import POLICIES as registered

    try:
        losses = [float(v) for v in args.loss.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--loss takes probabilities like 0,0.01; got {args.loss!r}") from None
    if not losses or any(not 0 <= v < 1 for v in losses):
        raise UsageError("--loss: each probability must be in [0, 1)")
    policies = [v.strip() for v in args.policy.split(",") if v.strip()]
    bad = [v for v in policies if v not in registered]
    if bad:
        raise UsageError(f"unknown policy {', '.join(bad)}; registered: {', '.join(registered)}")
    paths = [v.strip() for v in args.paths.split(",") if v.strip()]
    if not paths or any(v not in PATHS for v in paths):
        raise UsageError(f"--paths: choose from {', '.join(PATHS)}")
    try:
        size, frame = report.parse_size(args.size), report.parse_size(args.frame)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if size % 4 or size < 4 or frame < 256:
        raise UsageError("--size must be a positive multiple of 4 and --frame at least 256")
    report.check_memory(f"--size {args.size}", 2 * 4 * size)  # two workers' buffers
    if args.iters < 1:
        raise UsageError("--iters must be at least 1")
    if args.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    check_seconds("--timeout", args.timeout)
    if args.reorder and args.reorder != "none":
        from fabric.core.faults import FaultSpecError, parse_faults

        try:
            parse_faults(f"reorder={args.reorder}")
        except FaultSpecError as exc:
            raise UsageError(f"--reorder {args.reorder}: {exc}; or 'none' to skip") from None
    from fabric.emulation.launch_cli import check_outputs

    check_outputs(args, dirs=("run_dir",))  # before any fabric starts
    return losses, policies, paths, size, frame


def run(args: argparse.Namespace) -> int:
    """Entry point of `semfab bench loss`."""
    from fabric.core.topology import star
    from fabric.emulation.launcher import launch

    losses, policies, paths, size, frame = _parse(args)
    scenarios: list[tuple[str, float, str | None]] = [
        (f"loss={p}", p, f"loss={p}" if p > 0 else None) for p in losses]
    if args.reorder and args.reorder != "none":
        scenarios.append((f"reorder={args.reorder}", 0.0, f"reorder={args.reorder}"))
    combos = [(path, pol) for path in paths
              for pol in (policies if path == "p2p" else ["selective"])]
    # (scenario, path, policy) -> per-transfer times and counters, pooled over rounds
    pooled: dict[tuple[str, str, str], dict[str, Any]] = {}
    topo = star(2, mtu=max(frame, 256))
    with report.progress(args.repeat * len(scenarios) * len(combos), "loss") as bar:
        for rnd in range(args.repeat):
            for label, _p, faults in scenarios:
                kw: dict[str, Any] = dict(timeout_s=args.timeout, faults=faults,
                                          seed=args.seed + rnd,
                                          remove_run_dir=not (args.run_dir or args.keep_runs))
                if args.run_dir:
                    kw["run_dir"] = f"{args.run_dir}/{label.replace(':', '_')}.{rnd}"
                with launch(topology=topo, **kw) as fab:
                    for path, pol in combos:
                        bar.describe(f"{label} {path} {pol}"
                                     + (f" (round {rnd + 1}/{args.repeat})"
                                        if args.repeat > 1 else ""))
                        per = fab.run(loss_task, path, pol, size, args.iters, args.seed + rnd,
                                      frame)
                        acc = pooled.setdefault((label, path, pol), {
                            "times": [], "lost": 0, "retransmitted": 0, "spurious": 0,
                            "rto_expiries": 0, "wrong": 0})
                        # a transfer's time is its slowest rank's
                        acc["times"] += np.max([r["times"] for r in per if r["times"]],
                                               axis=0).tolist()
                        acc["lost"] += per[0]["lost"]
                        acc["retransmitted"] += sum(r["retransmitted"] for r in per)
                        acc["spurious"] += sum(r["spurious"] for r in per)
                        acc["rto_expiries"] += sum(r["timeouts"] for r in per)
                        acc["wrong"] += sum(r["wrong"] for r in per)
                        bar.advance()
    results: list[dict[str, Any]] = []
    base: dict[tuple[str, str], float] = {}
    for label, p, faults in scenarios:
        for path, pol in combos:
            acc = pooled[(label, path, pol)]
            times = np.asarray(acc.pop("times"))
            goodput = size / float(np.median(times)) / 1e9
            if faults is None:
                base[(path, pol)] = goodput
            ref = base.get((path, pol))
            results.append({
                "path": path, "policy": pol, "loss": p, "faults": faults or "none",
                "goodput_gbps": goodput, "goodput_ratio": goodput / ref if ref else None,
                "transfers": int(times.size), **acc,
                "p99_ms": float(np.percentile(times, 99)) * 1e3,
            })
    table = format_table(results)
    print(table)
    if args.json:
        settings = {"loss": losses, "policies": policies, "paths": paths, "size": size,
                    "frame": frame, "iters": args.iters, "repeat": args.repeat,
                    "seed": args.seed, "reorder": args.reorder, "timeout_s": args.timeout}
        report.write_json(args.json, "loss", results, extra={"settings": settings})
    if args.markdown:
        report.write_markdown(args.markdown, table + "\n")
    if args.plot:
        plot(results, args.plot)
    return 1 if any(r["wrong"] for r in results) else 0


def format_table(results: list[dict[str, Any]]) -> str:
    """Markdown table, one row per (faults, path, policy)."""
    head = ["faults", "path", "policy", "goodput (GB/s)", "vs loss-free", "lost",
            "retransmitted", "retx/lost", "spurious", "RTO expiries", "p99 (ms)", "#wrong"]
    cells = []
    for r in results:
        ratio = f"{r['goodput_ratio']:.3f}" if r["goodput_ratio"] is not None else "—"
        per_lost = f"{r['retransmitted'] / r['lost']:.2f}" if r["lost"] else "—"
        cells.append([str(r["faults"]), str(r["path"]), str(r["policy"]),
                      f"{r['goodput_gbps']:.3f}", ratio, str(r["lost"]), str(r["retransmitted"]),
                      per_lost, str(r["spurious"]), str(r["rto_expiries"]), f"{r['p99_ms']:.1f}",
                      str(r["wrong"])])
    return "\n".join(report.markdown_table(head, cells, left=("faults", "path", "policy")))


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Goodput ratio against loss, one line per (path, policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted({(r["path"], r["policy"]) for r in results})
    for key in keys:
        pts = sorted((r["loss"], r["goodput_ratio"]) for r in results
                     if (r["path"], r["policy"]) == key and r["faults"].startswith("loss")
                     and r["goodput_ratio"] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(key))
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlabel("loss probability per frame per link")
    ax.set_ylabel("goodput / loss-free goodput")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
