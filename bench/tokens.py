"""`semfab bench tokens`: the token delivery chain, strategy by strategy, in one run.

One fabric is launched (a star: one worker by default, host0, and host1 when
``host-staged`` is measured); every strategy (transport x detok mode x where
detokenization happens) runs on it in turn as a serving chain. For each
concurrency level a closed-loop client keeps ``concurrency`` streaming
requests open over the OpenAI-compatible endpoint, ``--num-prompts`` in all,
each asking for exactly ``--tokens`` tokens.

Reported per strategy and level (see :mod:`fabric.serving.metrics` for the
definitions): TTFT, TPOT, ITL and E2EL with mean, median, p90, p99 and p99.9
(``vllm bench serve`` conventions); goodput under ``--slo``; the per-token
time in each layer (generation, transport, interpretation, presentation);
semantic distance per token (copies, encodes, process crossings, switch hops,
counted by the code as it ran); the three factors of effective experience;
and correctness: tokens lost, texts that differ from the full decode of the
generated ids.

``--json`` writes every number with the environment; ``--trace`` a Chrome
Trace Event file (open it in the Perfetto UI) with a flow arrow per token;
``--plot`` the ITL distribution per strategy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import report
from fabric.errors import UsageError

log = logging.getLogger("semfab.bench.tokens")

BASELINE = ("direct", "immediate", "host")


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab bench tokens`."""
    p.add_argument("--concurrency", default="1,8,32",
                   help="concurrency levels (open streaming requests), comma-separated")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="requests per level (0: the concurrency, at least 2)")
    p.add_argument("--transport", default="direct,host-staged",
                   help="transports to compare: direct, host-staged")
    p.add_argument("--detok", default="immediate,batched",
                   help="detokenization modes to compare: immediate, batched")
    p.add_argument("--detok-at", default="host",
                   help="where text is made: host, client (comma-separated to compare)")
    p.add_argument("--detokenizer", default="hf", choices=("hf", "table"),
                   help="incremental detokenizer: tokenizers' DecodeStream, or a byte table")
    p.add_argument("--batch-tokens", type=int, default=8,
                   help="batched detok: flush every K tokens ...")
    p.add_argument("--batch-ms", type=float, default=20.0, help="... or after T ms")
    p.add_argument("--step-ms", type=float, default=10.0,
                   help="decode step time of the stand-in model")
    p.add_argument("--prefill-ms", type=float, default=20.0,
                   help="time of a step that admits new requests (prefill)")
    p.add_argument("--workers", type=int, default=1, help="generator workers (GPUs)")
    p.add_argument("--backend", default="auto", help="kernel backend of the toy decoder")
    p.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                   help="which OpenAI endpoint the client streams from")
    p.add_argument("--slo", default="ttft:200ms,tpot:50ms",
                   help="service level objectives (ttft, tpot, itl, e2el); itl defaults to "
                   "tpot and sets the timeliness factor")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every strategy this many times, round-robin; samples are pooled")
    p.add_argument("--seed", type=int, default=0, help="prompt choice and toy model seed")
    p.add_argument("--json", metavar="PATH", help="write every result as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--trace", metavar="PATH",
                   help="write a Chrome Trace Event file (open it in the Perfetto UI)")
    p.add_argument("--trace-requests", type=int, default=2,
                   help="requests traced per strategy and level")
    p.add_argument("--plot", metavar="PATH", help="PNG of the ITL distribution per strategy")
    p.add_argument("--run-dir", help="folder for the fabric's logs (default: runs/<stamp>)")


@dataclass
class Options:
    """Checked command-line options."""

    concurrency: list[int]
    tokens: int
    num_prompts: int
    strategies: list[tuple[str, str, str]]
    slo: dict[str, float]
    args: argparse.Namespace
    transports: list[str] = field(default_factory=list)


def options(args: argparse.Namespace) -> Options:
    """Validate the flags (UsageError on the first bad one)."""
    from fabric.serving.config import DETOK_AT, DETOK_MODES, TRANSPORTS
    from fabric.serving.metrics import parse_slo

    try:
        conc = [int(c) for c in _csv(args.concurrency)]
    except ValueError:
        raise UsageError(f"--concurrency takes integers, got {args.concurrency!r}") from None
    if not conc or min(conc) < 1:
        raise UsageError("--concurrency needs levels >= 1")
    transports, detoks, ats = _csv(args.transport), _csv(args.detok), _csv(args.detok_at)
    for name, got, valid in (("--transport", transports, TRANSPORTS),
                             ("--detok", detoks, DETOK_MODES), ("--detok-at", ats, DETOK_AT)):
        bad = [g for g in got if g not in valid]
        if bad or not got:
            raise UsageError(f"{name}: unknown {', '.join(bad) or 'empty list'}; "
                             f"choose from {', '.join(valid)}")
    if args.tokens < 2:
        raise UsageError("--tokens must be >= 2 (TPOT needs two tokens)")
    if args.workers < 1 or args.repeat < 1 or args.num_prompts < 0:
        raise UsageError("--workers and --repeat must be >= 1, --num-prompts >= 0")
    if max(conc) > 64 * args.workers:
        raise UsageError(f"concurrency {max(conc)} exceeds the batch of {args.workers} "
                         "worker(s) (64 each); add --workers")
    try:
        slo = parse_slo(args.slo)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    strategies = list(itertools.product(transports, detoks, ats))
    return Options(conc, args.tokens, args.num_prompts, strategies, slo, args, transports)


def _prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts: lines of the shipped text, chosen with ``seed``."""
    from fabric.serving.assets import corpus_text

    lines = [ln.strip() for ln in corpus_text().splitlines() if len(ln.strip()) > 12]
    rng = random.Random(seed)
    return [rng.choice(lines)[:200] for _ in range(n)]


async def _level(url: str, endpoint: str, concurrency: int, prompts: list[str], tokens: int,
                 detok_factory: Any) -> tuple[list[Any], int, int]:
    """Closed loop: ``concurrency`` requests open at a time until ``prompts`` are done."""
    import aiohttp

    from fabric.serving.client import now_ns, stream_request

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one(prompt: str) -> Any:
            body: dict[str, Any] = {"model": "semfab-toy", "max_tokens": tokens,
                                    "stream": True, "stream_options": {"include_usage": True}}
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            async with sem:
                return await stream_request(session, url + path, body,
                                            detokenizer=detok_factory)

        t0 = now_ns()
        results = await asyncio.gather(*(one(p) for p in prompts))
        t1 = now_ns()
    return list(results), t0, t1


@dataclass
class StrategyRun:
    """Everything one strategy produced (over every repetition)."""

    key: tuple[str, str, str]
    levels: dict[int, list[tuple[list[Any], int, int]]] = field(default_factory=dict)
    timelines: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    generated: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    steps: list[np.ndarray] = field(default_factory=list)
    sem: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    detok_samples: list[np.ndarray] = field(default_factory=list)
    counters: list[dict[str, Any]] = field(default_factory=list)


def _add_sem(into: dict[str, dict[str, float]], layer: str, counts: dict[str, float]) -> None:
    d = into.setdefault(layer, {})
    for k in ("copies", "encodes", "crossings", "hops"):
        d[k] = d.get(k, 0.0) + float(counts.get(k, 0.0))


def _count_client(into: dict[str, dict[str, float]], clients: list[Any], at: str) -> None:
    """The client's share of semantic distance: one JSON parse (and copy) per event,
    and one detokenization per token when it detokenizes."""
    events = sum(len(cr.t_events) for cr in clients)
    _add_sem(into, "presentation", {"encodes": events, "copies": events})
    if at == "client":
        _add_sem(into, "interpretation", {"encodes": sum(len(cr.token_ids) for cr in clients)})


def _run_strategy(fab: Any, run: StrategyRun, opts: Options, assets_dir: str,
                  tokenizer: Any, table: list[bytes], bar: Any, rep: int) -> None:
    from fabric.serving.config import ServeConfig
    from fabric.serving.detok import make_detokenizer
    from fabric.serving.runner import ServingChain

    a = opts.args
    transport, detok, at = run.key
    cfg = ServeConfig(transport=transport, detok=detok, detok_at=at,
                      detokenizer=a.detokenizer, batch_tokens=a.batch_tokens,
                      batch_ms=a.batch_ms, step_ms=a.step_ms, prefill_ms=a.prefill_ms,
                      backend=a.backend, seed=a.seed, record=True, assets_dir=assets_dir,
                      max_batch=64)
    factory = (lambda: make_detokenizer(a.detokenizer, tokenizer, table)) if at == "client" \
        else None
    label = cfg.label()
    chain = ServingChain(cfg, fabric=fab, timeout_s=30.0).start()
    client_sem: dict[str, dict[str, float]] = {}
    try:
        # warm-up: one short request (connection setup, first-call costs); its tokens
        # count in the semantic-distance totals like every other request's
        warm, _, _ = asyncio.run(_level(chain.url, a.endpoint, 1, _prompts(1, a.seed + 999),
                                        8, factory))
        _count_client(client_sem, warm, at)
        for c in opts.concurrency:
            bar.describe(f"{label} c={c}" + (f" rep {rep + 1}" if a.repeat > 1 else ""))
            n = opts.num_prompts or max(c, 2)
            prompts = _prompts(n, a.seed * 7919 + c * 31 + rep)
            clients, t0, t1 = asyncio.run(_level(chain.url, a.endpoint, c, prompts,
                                                 opts.tokens, factory))
            run.levels.setdefault(c, []).append((clients, t0, t1))
            _count_client(client_sem, clients, at)
            bar.advance()
    finally:
        results = chain.stop()
    host = results["host"]
    session = chain.cfg.session  # rids restart with every chain: key by (session, rid)
    run.timelines.update({(session, int(r)): tl for r, tl in host["timelines"].items()})
    run.detok_samples.append(host["detok_samples"])
    run.counters.append(host["counters"])
    for layer, counts in host["sem"].items():
        _add_sem(run.sem.setdefault("host", {}), layer, counts)
    for w in results["workers"]:
        run.generated.update({(session, int(k)): list(v) for k, v in w["generated"].items()})
        run.steps.append(w["steps"])
        _add_sem(run.sem.setdefault("worker", {}), "transport", w["sem"])
    if "relay" in results:
        _add_sem(run.sem.setdefault("relay", {}), "transport", results["relay"]["sem"])
    for layer, counts in client_sem.items():
        _add_sem(run.sem.setdefault("client", {}), layer, counts)


def _rows(runs: list[StrategyRun], opts: Options, tokenizer: Any,
          table: list[bytes]) -> list[dict[str, Any]]:
    from fabric.serving.metrics import LevelInput, level_row, semantic_per_token

    rows = []
    for run in runs:
        transport, detok, at = run.key
        steps = np.concatenate(run.steps) if run.steps else np.zeros((0, 5), np.int64)
        tokens = sum(len(v) for v in run.generated.values())
        sem = semantic_per_token(run.sem, tokens)
        ds = np.concatenate(run.detok_samples) if run.detok_samples else np.zeros((0, 2))
        per_token_us = (ds[:, 0] / np.maximum(ds[:, 1], 1) / 1e3).tolist() if ds.size else []
        for c, reps in run.levels.items():
            clients = [cr for r in reps for cr in r[0]]
            t_start = min(r[1] for r in reps)
            duration = sum(r[2] - r[1] for r in reps)
            keys = {cr.key for cr in clients}
            li = LevelInput(transport, detok, at, c, clients, t_start, t_start + duration,
                            {k: run.timelines[k] for k in keys if k in run.timelines},
                            {k: run.generated[k] for k in keys if k in run.generated},
                            _steps_in(steps, reps),
                            extra={"workers": opts.args.workers, "tokens": opts.tokens,
                                   "step_ms": opts.args.step_ms,
                                   "detokenizer": opts.args.detokenizer,
                                   "semantic_per_token": sem,
                                   "detok_us_per_token": report.latency_stats(per_token_us)
                                   if per_token_us else None,
                                   "repeat": len(reps)})
            row = level_row(li, tokenizer, table, opts.slo, stats_fn=_stats)
            rows.append(row)
    return rows


def _steps_in(steps: np.ndarray, reps: list[tuple[list[Any], int, int]]) -> np.ndarray:
    """Worker steps inside the windows of a level, re-based onto one window.

    level_row filters steps by [t_start, t_start + sum of durations]; with
    several repetitions each window is shifted to follow the previous one.
    """
    if not steps.size:
        return steps
    out = []
    offset = 0
    base = min(r[1] for r in reps)
    for _, t0, t1 in sorted(reps, key=lambda r: r[1]):
        win = steps[(steps[:, 0] >= t0) & (steps[:, 0] <= t1)].copy()
        win[:, 0] = win[:, 0] - t0 + base + offset
        out.append(win)
        offset += t1 - t0
    return np.concatenate(out) if out else steps[:0]


def _stats(samples: Any) -> dict[str, float]:
    """bench.report.latency_stats plus the median and std that vllm reports."""
    values = list(samples)
    if not values:
        from fabric.serving.metrics import stats

        return stats([])
    out = report.latency_stats(values)
    out["median"] = out["p50"]
    out["std"] = float(np.std(values))
    return out


# ---------------------------------------------------------------------- tables
def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def tables(rows: list[dict[str, Any]], opts: Options) -> str:
    """The Markdown report."""
    out = []
    itl_slo = opts.slo.get("itl", opts.slo.get("tpot"))
    slo_text = ", ".join(f"{k} <= {v:g} ms" for k, v in opts.slo.items()) or "none"
    out.append(f"### Client metrics (ms; vllm bench serve conventions; SLO: {slo_text})\n")
    out.append("| strategy | conc | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | "
               "TPOT p99 | ITL p50 | ITL p99 | ITL p99.9 | E2EL p50 | E2EL p99 | goodput | "
               "lost | mismatched |")
    out.append("|" + "---|" * 16)
    for r in rows:
        out.append(
            f"| {r['strategy']} | {r['concurrency']} | {_f(r['request_throughput'])} | "
            f"{_f(r['output_throughput_tok_s'], 0)} | {_f(r['ttft_ms']['p50'])} | "
            f"{_f(r['ttft_ms']['p99'])} | {_f(r['tpot_ms']['p50'])} | {_f(r['tpot_ms']['p99'])} | "
            f"{_f(r['itl_ms']['p50'])} | {_f(r['itl_ms']['p99'])} | {_f(r['itl_ms']['p99.9'])} | "
            f"{_f(r['e2el_ms']['p50'])} | {_f(r['e2el_ms']['p99'])} | "
            f"{_f(r['goodput_req_s'])} | {r['lost_tokens']} | {r['text_mismatches']} |")
    base = {r["concurrency"]: r for r in rows
            if (r["transport"], r["detok"], r["detok_at"]) == BASELINE}
    out.append("\n### Time per token in each layer (ms, p50 / p99); "
               "Δ p99 against direct+immediate at the same concurrency\n")
    out.append("| strategy | conc | generation | transport | interpretation | presentation | "
               "added p50 / p99 | Δ transport | Δ interp. | Δ present. |")
    out.append("|" + "---|" * 10)
    for r in rows:
        L = r["layers_ms"]
        b = base.get(r["concurrency"])

        def d(layer: str, r: dict[str, Any] = r, b: dict[str, Any] | None = b) -> str:
            if b is None or b is r:
                return "-"
            return f"{r['layers_ms'][layer]['p99'] - b['layers_ms'][layer]['p99']:+.3f}"

        out.append(
            f"| {r['strategy']} | {r['concurrency']} | "
            + " | ".join(f"{_f(L[k]['p50'], 3)} / {_f(L[k]['p99'], 3)}"
                         for k in ("generation", "transport", "interpretation",
                                   "presentation"))
            + f" | {_f(r['added_ms']['p50'], 3)} / {_f(r['added_ms']['p99'], 3)} | "
            f"{d('transport')} | {d('interpretation')} | {d('presentation')} |")
    out.append("\n### Semantic distance per token (copies / encodes / process crossings / "
               "switch hops), counted as the code ran\n")
    out.append("| strategy | transport | interpretation | presentation | total | "
               "detok µs/token p50 |")
    out.append("|" + "---|" * 6)
    seen = set()
    for r in rows:
        if r["strategy"] in seen:
            continue
        seen.add(r["strategy"])
        sem = r["semantic_per_token"]

        def c(layer: str, sem: dict[str, Any] = sem) -> str:
            s = sem[layer]
            return (f"{s['copies']:.2g} / {s['encodes']:.2g} / {s['crossings']:.2g} / "
                    f"{s['hops']:.2g}")

        dt = r.get("detok_us_per_token")
        out.append(f"| {r['strategy']} | {c('transport')} | {c('interpretation')} | "
                   f"{c('presentation')} | {c('total')} | {_f(dt['p50'] if dt else None)} |")
    itl_text = f"{itl_slo:g} ms" if itl_slo is not None else "no SLO"
    out.append(f"\n### Effective experience = compute × completion × timeliness "
               f"(timeliness: ITL <= {itl_text})\n")
    out.append("| strategy | conc | compute | completion | timeliness | product | "
               "UTF-8 held tokens |")
    out.append("|" + "---|" * 7)
    for r in rows:
        e = r["experience"]
        out.append(f"| {r['strategy']} | {r['concurrency']} | {_f(e['compute'], 3)} | "
                   f"{_f(e['completion'], 3)} | {_f(e['timeliness'], 3)} | "
                   f"{_f(e['product'], 3)} | {r['utf8_held_tokens']} |")
    return "\n".join(out) + "\n"


def plot_itl(runs: list[StrategyRun], path: str | Path, opts: Options) -> Path:
    """ECDF of client ITLs, one line per strategy, one panel per concurrency."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    levels = opts.concurrency
    fig = Figure(figsize=(5.0 * len(levels), 4.0), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(levels), squeeze=False)[0]
    for ax, c in zip(axes, levels, strict=True):
        for run in runs:
            itl = []
            for clients, _, _ in run.levels.get(c, []):
                for cr in clients:
                    t = np.asarray(cr.content_times, dtype=np.float64)
                    itl.extend((np.diff(t) / 1e6).tolist())
            if not itl:
                continue
            xs = np.sort(np.asarray(itl))
            ys = np.arange(1, xs.size + 1) / xs.size
            tr, dm, at = run.key
            ax.plot(np.maximum(xs, 0.1), ys, label=f"{tr}+{dm}" + ("" if at == "host"
                                                                    else "@client"))
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("inter-token latency (ms, log; gaps < 0.1 ms drawn at 0.1)")
        ax.set_ylabel("fraction of gaps ≤ x")
        ax.set_title(f"concurrency {c}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=110)
    return out


def write_trace(runs: list[StrategyRun], path: str | Path, per_level: int) -> Path:
    """Chrome Trace Event JSON of ``per_level`` requests per strategy and level."""
    from fabric.serving.trace import TraceBuilder, add_chain

    chunks: list[tuple[int, str, list[dict[str, Any]], dict[int, Any]]] = []
    for run in runs:
        for c, reps in run.levels.items():
            clients = [cr for cr in reps[0][0][:per_level] if cr.key in run.timelines]
            tls = [run.timelines[k] for k in (cr.key for cr in clients) if k is not None]
            if tls:
                t, dm, at = run.key
                label = f"{t}+{dm}" + ("" if at == "host" else "@client") + f" c={c}"
                chunks.append((min(int(tl["t_req"]) for tl in tls), label, tls,
                               {cr.rid: cr for cr in clients}))
    tb = TraceBuilder()
    for i, (_, label, tls, by_rid) in enumerate(sorted(chunks, key=lambda x: x[0])):
        add_chain(tb, label, 100 * (i + 1), tls, by_rid)
    return tb.write(path)


def run(args: argparse.Namespace) -> int:
    """`semfab bench tokens`."""
    from fabric.serving.assets import ensure_assets, load_tokenizer
    from fabric.serving.detok import byte_table
    from fabric.serving.runner import launch_for

    opts = options(args)
    assets_dir = str(ensure_assets())
    tokenizer = load_tokenizer(assets_dir)
    table = byte_table(tokenizer)
    runs = [StrategyRun(key) for key in opts.strategies]
    started = time.monotonic()
    fab = launch_for(opts.transports, args.workers, run_dir=args.run_dir, timeout_s=30.0)
    try:
        total = len(runs) * len(opts.concurrency) * args.repeat
        with report.progress(total, "tokens") as bar:
            for rep in range(args.repeat):
                for r in runs:
                    _run_strategy(fab, r, opts, assets_dir, tokenizer, table, bar, rep)
    finally:
        fab.close()
    rows = _rows(runs, opts, tokenizer, table)
    text = tables(rows, opts)
    print(text)
    print(f"({len(rows)} rows in {time.monotonic() - started:.0f} s; fabric logs in "
          f"{fab.run_dir})")
    params = {k: v for k, v in vars(args).items() if k != "func"}
    if args.json:
        report.write_json(args.json, "tokens", rows, extra={"params": params})
        print(f"wrote {args.json}")
    if args.markdown:
        report.write_markdown(args.markdown, text)
        print(f"wrote {args.markdown}")
    if args.trace:
        write_trace(runs, args.trace, args.trace_requests)
        print(f"wrote {args.trace} (open it in the Perfetto UI)")
    if args.plot:
        plot_itl(runs, args.plot, opts)
        print(f"wrote {args.plot}")
    bad = sum(r["lost_tokens"] + r["text_mismatches"] + r["failed"] for r in rows)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.tokens ...` (the same flags as `semfab bench tokens`)."""
    p = argparse.ArgumentParser(prog="semfab bench tokens", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        return run(args)
    except UsageError as exc:
        print(f"semfab bench tokens: error: {exc}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
