"""`semfab bench tokens`: the token delivery chain strategy by strategy, or any server.

**Our own chain** (the default). One fabric is launched (a star: one worker
by default, host0, and host1 when ``host-staged`` is measured); every
strategy (transport x detok mode x where detokenization happens) runs on it
in turn as a serving chain, and each load level is measured against it.

**Any OpenAI-compatible server** (``--base-url URL --model M``): no fabric is
launched; the benchmark is a pure client of ``POST {URL}/v1/completions``
(or ``/v1/chat/completions``) with ``"stream": true``, as ``vllm bench
serve`` is, and reports what a client can see.

Load: a closed loop of ``--concurrency`` open streaming requests, or an open
loop at ``--request-rate`` requests per second with gamma-distributed gaps
(``--burstiness``; 1 is a Poisson process), capped by ``--concurrency`` when
it is given; ``--num-prompts`` requests per level from ``--dataset``
(``corpus``, ``sonnet`` or ``random``, with ``--input-len`` and
``--output-len``).

Reported per strategy and level (see :mod:`fabric.serving.metrics` for the
definitions): TTFT, TPOT, ITL and E2EL with mean, median and the
``--metric-percentiles`` of ``--percentile-metrics`` (``vllm bench serve``
conventions); request, input, output and total token throughput; goodput
under ``--slo``; and for our own chain the per-token time in each layer
(generation, transport, interpretation, presentation), semantic distance per
token (copies, encodes, process crossings, switch hops, counted by the code
as it ran), the three factors of effective experience, and correctness:
tokens lost, texts that differ from the full decode of the generated ids.

``--json`` writes every number, every setting and the per-request arrays
with the environment; ``--trace`` a Chrome Trace Event file (open it in the
Perfetto UI) with a flow arrow per token; ``--plot`` the ITL distribution.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import report
from bench.step_split import STEP_PARTS, step_split
from fabric.errors import PeerFailed, UsageError

log = logging.getLogger("semfab.bench.tokens")

BASELINE = ("direct", "immediate", "host")
DEFAULT_CONCURRENCY = "1,8,32"
#: Flags that set up our own chain: refused beside --base-url.
CHAIN_FLAGS = ("transport", "detok", "detok_at", "detokenizer", "batch_tokens", "batch_ms",
               "step_ms", "prefill_ms", "workers", "backend", "trace", "run_dir", "keep_runs",
               "tp", "ep", "pp", "moe", "tp_path")

#: Slowest open loop, in requests per second (one request every 1000 s).
MIN_RATE = 1e-3
#: Longest prompt the benchmark builds, in tokens (the corpus dataset holds less;
#: a longer one would be cut short without a word).
MAX_INPUT_LEN = 32768
#: Default requests per level of an open loop: this many seconds of arrivals...
OPEN_LOOP_SECONDS = 5.0
#: ...and at most this many.
OPEN_LOOP_MAX_PROMPTS = 1000


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `semfab bench tokens`."""
    from fabric.serving.dataset import DATASETS

    g = p.add_argument_group("load (vllm bench serve flags)")
    g.add_argument("--base-url", metavar="URL",
                   help="measure this OpenAI-compatible server (e.g. http://127.0.0.1:8000) "
                   "instead of our own chain; nothing is launched")
    g.add_argument("--model", help="our own chain: semfab-toy (default) or a model preset "
                   "that runs here, sharded by --tp/--ep/--pp (tiny). With --base-url: the "
                   "model name to ask for (default: with --base-url the "
                   "server's first model, else semfab-toy)")
    g.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                   help="which OpenAI endpoint the client streams from")
    g.add_argument("--concurrency", "--max-concurrency", default=DEFAULT_CONCURRENCY,
                   help="open streaming requests (closed loop), comma-separated levels; "
                   "with --request-rate, a cap on open requests (none unless given)")
    g.add_argument("--request-rate", default="inf",
                   help="requests per second, open loop (comma-separated to sweep); "
                   "inf: no pacing")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps between requests: 1 is a "
                   "Poisson process, < 1 burstier, > 1 more regular")
    g.add_argument("--num-prompts", type=int, default=0,
                   help="requests per level (0: the concurrency, at least 2; with "
                   f"--request-rate, {OPEN_LOOP_SECONDS:g} s of arrivals, at most "
                   f"{OPEN_LOOP_MAX_PROMPTS})")
    g.add_argument("--dataset", "--dataset-name", default="corpus", choices=DATASETS,
                   help="prompts: lines of the tokenizer's corpus, Shakespeare's sonnets, "
                   "or random words")
    g.add_argument("--input-len", "--random-input-len", type=int, default=None,
                   help="prompt tokens, as semfab's tokenizer counts them (default: one "
                   "corpus line; 64 for sonnet, 32 for random)")
    g.add_argument("--tokens", "--output-len", "--random-output-len", dest="tokens", type=int,
                   default=256, help="output tokens per request (max_tokens)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM, SGLang), so every request runs to max_tokens")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature sent with each request (default: the server's)")
    g.add_argument("--seed", type=int, default=0,
                   help="prompts, arrival times and the toy model's weights")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics whose percentiles are shown: ttft, tpot, itl, e2el")
    g.add_argument("--metric-percentiles", default="99",
                   help="percentiles shown, comma-separated (e.g. 50,90,99)")
    g.add_argument("--slo", default="ttft:200ms,tpot:50ms",
                   help="service level objectives (ttft, tpot, itl, e2el) for goodput; itl "
                   "defaults to tpot and sets the timeliness factor")
    g.add_argument("--repeat", type=int, default=1,
                   help="run every level this many times, round-robin; samples are pooled")
    c = p.add_argument_group("our own chain (not with --base-url)")
    c.add_argument("--transport", default="direct,host-staged",
                   help="transports to compare: direct, host-staged")
    c.add_argument("--detok", default="immediate,batched",
                   help="detokenization modes to compare: immediate, batched")
    c.add_argument("--detok-at", default="host",
                   help="where text is made: host, client (comma-separated to compare)")
    c.add_argument("--detokenizer", default="hf", choices=("hf", "table"),
                   help="incremental detokenizer: tokenizers' DecodeStream, or a byte table")
    c.add_argument("--batch-tokens", type=int, default=8,
                   help="batched detok: flush every K tokens ...")
    c.add_argument("--batch-ms", type=float, default=20.0, help="... or after T ms")
    c.add_argument("--step-ms", type=float, default=None,
                   help="decode step time of the toy decoder (default 10); with a model "
                   "preset, the least a step takes (default 0)")
    c.add_argument("--prefill-ms", type=float, default=None,
                   help="time of a step that admits new requests (toy decoder: 20)")
    c.add_argument("--workers", type=int, default=None,
                   help="generator workers (GPUs); default 1, or one group of tp x ep x pp "
                   "with --model; a multiple of that makes data-parallel generators "
                   "(emulated or --sim)")
    c.add_argument("--tp", type=int, default=1,
                   help="--model tiny: tensor-parallel degree (TP allreduces per layer)")
    c.add_argument("--ep", type=int, default=1,
                   help="--model tiny: expert-parallel degree (MoE dispatch and combine)")
    c.add_argument("--pp", type=int, default=1, help="--model tiny: pipeline stages")
    c.add_argument("--moe", default="flat", choices=("flat", "hierarchical", "in-network"),
                   help="MoE dispatch and combine variant")
    c.add_argument("--tp-path", default="ina", choices=("ina", "ina-mem", "host-ps", "host-ring"),
                   help="path of the TP allreduces")
    c.add_argument("--backend", default="auto",
                   help="kernel backend of the toy decoder, and of a --model's attention")
    c.add_argument("--trace", metavar="PATH",
                   help="write a Chrome Trace Event file (open it in the Perfetto UI)")
    c.add_argument("--trace-requests", type=int, default=2,
                   help="requests traced per strategy and level")
    c.add_argument("--run-dir", help="folder for the fabric's logs (default: runs/<stamp>, "
                   "removed after a successful run)")
    c.add_argument("--keep-runs", action="store_true",
                   help="keep the fabric's run folder after a successful run")
    from bench import serve_sim

    serve_sim.add_arguments(p.add_argument_group(
        "in simulation (--sim: a model preset on a simulated fabric, to 1024 GPUs)"))
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH",
                   help="write every result, setting and per-request array as JSON")
    o.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    o.add_argument("--plot", metavar="PATH", help="PNG of the ITL distribution per level")


@dataclass(frozen=True)
class Level:
    """One load level: pacing and a cap on open requests."""

    rate: float  # requests per second; inf: no pacing
    concurrency: int | None  # open requests at most; None: no cap
    num_prompts: int

    @property
    def label(self) -> str:
        """``c=8``, ``20/s``, or ``20/s c=8``."""
        parts = []
        if math.isfinite(self.rate):
            parts.append(f"{self.rate:g}/s")
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        return " ".join(parts) or "all at once"

    def fields(self) -> dict[str, Any]:
        """The level's settings as row fields (rate ``"inf"`` as vllm writes it)."""
        return {"concurrency": self.concurrency,
                "request_rate": self.rate if math.isfinite(self.rate) else "inf",
                "num_prompts": self.num_prompts, "load": self.label}


@dataclass
class Options:
    """Checked command-line options."""

    levels: list[Level]
    tokens: int
    strategies: list[tuple[str, str, str]]
    slo: dict[str, float]
    args: argparse.Namespace
    transports: list[str] = field(default_factory=list)
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    metrics: list[str] = field(default_factory=list)
    base_url: str | None = None
    model: str | None = None


def _defaults() -> dict[str, Any]:
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return vars(p.parse_args([]))


def _rates(text: str) -> list[float]:
    out = []
    for part in _csv(text):
        try:
            rate = float(part)
        except ValueError:
            raise UsageError(f"--request-rate takes numbers or inf, got {part!r}") from None
        if not rate >= MIN_RATE:  # NaN too; slower would look like a hang
            raise UsageError(f"--request-rate {part}: must be at least {MIN_RATE:g} "
                             "requests per second (inf: no pacing)")
        out.append(rate)
    if not out:
        raise UsageError("--request-rate needs a rate (e.g. 20, or inf)")
    return out


def _levels(args: argparse.Namespace, conc: list[int]) -> list[Level]:
    rates = _rates(args.request_rate)
    conc_given = args.concurrency != DEFAULT_CONCURRENCY
    caps: list[int | None] = list(conc)
    if any(math.isfinite(r) for r in rates) and not conc_given:
        caps = [None]  # an open loop: arrivals decide how many are open
    out = []
    for rate, cap in itertools.product(rates, caps):
        n = args.num_prompts
        if not n:
            if math.isfinite(rate):
                n = min(OPEN_LOOP_MAX_PROMPTS, max(2, math.ceil(rate * OPEN_LOOP_SECONDS)))
            else:
                n = cap or 16
            n = max(n, cap or 0, 2)
        out.append(Level(rate, cap, n))
    return out


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from a URL with or without ``/v1`` (UsageError if not HTTP)."""
    how = "give an http:// or https:// URL, e.g. http://127.0.0.1:8000"
    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 -- raises on a port out of range or not a number
    except ValueError as exc:  # e.g. an unclosed [IPv6 address
        raise UsageError(f"--base-url {url!r}: {exc}; {how}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--base-url {url!r}: {how}")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def options(args: argparse.Namespace) -> Options:
    """Validate the flags (UsageError on the first bad one)."""
    from fabric.serving.config import DETOK_AT, DETOK_MODES, TRANSPORTS
    from fabric.serving.metrics import parse_percentile_metrics, parse_percentiles, parse_slo

    try:
        conc = [int(c) for c in _csv(args.concurrency)]
    except ValueError:
        raise UsageError(f"--concurrency takes integers, got {args.concurrency!r}") from None
    if not conc or min(conc) < 1:
        raise UsageError("--concurrency needs levels >= 1")
    base_url = normalize_base_url(args.base_url) if args.base_url else None
    if base_url:
        defaults = _defaults()
        changed = [f"--{k.replace('_', '-')}" for k in CHAIN_FLAGS
                   if getattr(args, k, defaults[k]) != defaults[k]]
        if changed:
            raise UsageError(f"{', '.join(changed)} set up semfab's own chain; with "
                             "--base-url the benchmark is only a client of that server")
    transports, detoks, ats = _csv(args.transport), _csv(args.detok), _csv(args.detok_at)
    for name, got, valid in (("--transport", transports, TRANSPORTS),
                             ("--detok", detoks, DETOK_MODES), ("--detok-at", ats, DETOK_AT)):
        bad = [g for g in got if g not in valid]
        if bad or not got:
            raise UsageError(f"{name}: unknown {', '.join(bad) or 'empty list'}; "
                             f"choose from {', '.join(valid)}")
    if args.tokens < 2:
        raise UsageError("--tokens must be >= 2 (TPOT needs two tokens)")
    if args.trace_requests < 0:
        raise UsageError(f"--trace-requests {args.trace_requests}: must be 0 or more")
    if args.input_len is not None and not 1 <= args.input_len <= MAX_INPUT_LEN:
        raise UsageError(f"--input-len {args.input_len}: must be 1..{MAX_INPUT_LEN} tokens")
    held = 0  # sequences our chain's generators hold at once
    if args.sim and base_url:
        raise UsageError("--sim simulates semfab's own chain; leave out --base-url")
    if args.sim:
        from bench import serve_sim

        serve_sim.check(args)
    elif not base_url:  # semfab's own chain: its settings, checked before it starts
        from fabric.serving.config import DEFAULT_MODEL, ServeConfig

        cfg = ServeConfig(detokenizer=args.detokenizer, batch_tokens=args.batch_tokens,
                          batch_ms=args.batch_ms, backend=args.backend,
                          model=args.model or DEFAULT_MODEL, tp=args.tp, ep=args.ep, pp=args.pp,
                          moe=args.moe, tp_path=args.tp_path)
        # resolved here, so the JSON records what ran: a model's steps take what its
        # arithmetic and traffic take; the toy decoder's are set
        if args.step_ms is None:
            args.step_ms = 0.0 if cfg.runs_model else cfg.step_ms
        if args.prefill_ms is None:
            args.prefill_ms = 0.0 if cfg.runs_model else cfg.prefill_ms
        if args.workers is None:
            args.workers = cfg.group_size
        cfg.step_ms, cfg.prefill_ms = args.step_ms, args.prefill_ms
        cfg.check()
        if args.workers % cfg.group_size:
            raise UsageError(f"--workers {args.workers} does not split into groups of tp "
                             f"{cfg.tp} x ep {cfg.ep} x pp {cfg.pp}; use a multiple of "
                             f"{cfg.group_size}")
        # a generator holds max_batch sequences (a model's: per attention replica)
        held = 64 * (args.workers // cfg.group_size) * (cfg.ep if cfg.runs_model else 1)
        if args.tokens > cfg.max_tokens_limit:
            raise UsageError(f"--tokens {args.tokens}: semfab's server takes at most "
                             f"{cfg.max_tokens_limit} output tokens per request")
    if (args.workers is not None and args.workers < 1) or args.repeat < 1 or \
            args.num_prompts < 0:
        raise UsageError("--workers and --repeat must be >= 1, --num-prompts >= 0")
    if not (math.isfinite(args.burstiness) and args.burstiness > 0):
        raise UsageError(f"--burstiness {args.burstiness:g}: must be > 0 (1: Poisson)")
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        raise UsageError(f"--temperature {args.temperature:g}: must be in 0..2")
    levels = _levels(args, conc)
    caps = [lv.concurrency for lv in levels if lv.concurrency is not None]
    if not base_url and not args.sim and caps and max(caps) > held:
        raise UsageError(f"concurrency {max(caps)} exceeds the batch of {args.workers} "
                         f"worker(s) ({held} sequences); add --workers")
    try:
        slo = parse_slo(args.slo)
        percentiles = parse_percentiles(args.metric_percentiles)
        metrics = parse_percentile_metrics(args.percentile_metrics)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    strategies = list(itertools.product(transports, detoks, ats))
    return Options(levels, args.tokens, strategies, slo, args, transports, percentiles,
                   metrics, base_url, args.model)


def _request_body(opts: Options, model: str, tokens: int) -> dict[str, Any]:
    a = opts.args
    body: dict[str, Any] = {"model": model, "max_tokens": tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if a.temperature is not None:
        body["temperature"] = a.temperature
    if a.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _level(base: str, endpoint: str, body: dict[str, Any], prompts: list[Any],
                 level: Level, seed: int, burstiness: float,
                 detok_factory: Any = None) -> tuple[list[Any], int, int]:
    """Send ``prompts`` at the level's pace (at most its cap open at once)."""
    import aiohttp

    from fabric.serving.client import now_ns, stream_request
    from fabric.serving.dataset import arrival_times

    path = _path(endpoint)
    offsets = arrival_times(len(prompts), level.rate, burstiness, seed)
    cap = level.concurrency
    sem = asyncio.Semaphore(cap) if cap else None
    conn = aiohttp.TCPConnector(limit=cap or 0)  # 0: no limit
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one(prompt: Any, offset: float) -> Any:
            req = dict(body)
            if endpoint == "chat":
                req["messages"] = [{"role": "user", "content": prompt.text}]
            else:
                req["prompt"] = prompt.text
            wait = start + offset - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            async with sem if sem is not None else contextlib.nullcontext():
                cr = await stream_request(session, base + path, req,
                                          detokenizer=detok_factory)
            cr.input_len = prompt.input_len
            return cr

        start = loop.time()
        t0 = now_ns()
        results = await asyncio.gather(*(one(p, float(o))
                                         for p, o in zip(prompts, offsets, strict=True)))
        t1 = now_ns()
    return list(results), t0, t1


@dataclass
class StrategyRun:
    """Everything one strategy produced (over every repetition)."""

    key: tuple[str, str, str]
    levels: dict[Level, list[tuple[list[Any], int, int]]] = field(default_factory=dict)
    timelines: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    generated: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    steps: list[np.ndarray] = field(default_factory=list)
    sem: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    detok_samples: list[np.ndarray] = field(default_factory=list)
    counters: list[dict[str, Any]] = field(default_factory=list)
    bells: bool = False  # direct's WRITEs went through doorbells (ServeConfig.bells)
    parts: list[dict[str, float]] = field(default_factory=list)  # sharded: leaders' steps

    @property
    def label(self) -> str:
        """``direct+immediate``, ``host-staged+batched@client``, or ``server``."""
        t, d, at = self.key
        if not d:
            return t
        return f"{t}+{d}" + ("" if at == "host" else "@client")


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


def _level_seed(seed: int, i: int, rep: int) -> int:
    return seed * 7919 + i * 31 + rep


def _run_levels(run: StrategyRun, opts: Options, base: str, model: str, tokenizer: Any,
                bar: Any, rep: int, factory: Any = None,
                on_level: Any = None) -> list[list[Any]]:
    """Every load level once against ``base``; the clients of each level."""
    from fabric.serving import eventloop
    from fabric.serving.dataset import make_prompts

    a = opts.args
    out = []
    body = _request_body(opts, model, opts.tokens)
    for i, level in enumerate(opts.levels):
        bar.describe(f"{run.label} {level.label}" + (f" rep {rep + 1}" if a.repeat > 1 else ""))
        seed = _level_seed(a.seed, i, rep)
        prompts = make_prompts(a.dataset, level.num_prompts, seed, tokenizer, a.input_len)
        clients, t0, t1 = eventloop.run(_level(base, a.endpoint, body, prompts, level, seed,
                                             a.burstiness, factory))
        run.levels.setdefault(level, []).append((clients, t0, t1))
        out.append(clients)
        bar.advance()
        if on_level is not None:
            on_level(level)
    return out


def _loop_name() -> str:
    from fabric.serving import eventloop

    return eventloop.loop_name()


def _warm_up(opts: Options, base: str, model: str, tokenizer: Any,
             factory: Any = None) -> list[Any]:
    """One short request (connection setup, first-call costs); raises if it fails."""
    from fabric.serving import eventloop
    from fabric.serving.dataset import make_prompts

    a = opts.args
    prompts = make_prompts(a.dataset, 1, a.seed + 999, tokenizer, a.input_len)
    clients, _, _ = eventloop.run(_level(base, a.endpoint, _request_body(opts, model, 8),
                                       prompts, Level(math.inf, 1, 1), 0, 1.0, factory))
    cr = clients[0]
    if not cr.ok:
        raise PeerFailed(f"the first request to {base} failed: "
                         f"{(cr.error or f'HTTP {cr.status}').strip()[:300]}")
    return list(clients)


def _run_strategy(fab: Any, run: StrategyRun, opts: Options, assets_dir: str,
                  tokenizer: Any, table: list[bytes], bar: Any, rep: int) -> None:
    from fabric.serving.config import DEFAULT_MODEL, ServeConfig
    from fabric.serving.detok import make_detokenizer
    from fabric.serving.runner import ServingChain

    a = opts.args
    transport, detok, at = run.key
    cfg = ServeConfig(transport=transport, detok=detok, detok_at=at,
                      detokenizer=a.detokenizer, batch_tokens=a.batch_tokens,
                      batch_ms=a.batch_ms, step_ms=a.step_ms, prefill_ms=a.prefill_ms,
                      backend=a.backend, seed=a.seed, record=True, assets_dir=assets_dir,
                      max_batch=64, model=opts.model or DEFAULT_MODEL, tp=a.tp, ep=a.ep,
                      pp=a.pp, moe=a.moe, tp_path=a.tp_path)
    factory = (lambda: make_detokenizer(a.detokenizer, tokenizer, table)) if at == "client" \
        else None
    chain = ServingChain(cfg, fabric=fab, timeout_s=30.0).start()
    run.bells = chain.cfg.bells
    client_sem: dict[str, dict[str, float]] = {}
    try:
        # the warm-up's tokens count in the semantic-distance totals like every other's
        _count_client(client_sem, _warm_up(opts, chain.url, cfg.model, tokenizer, factory), at)
        for clients in _run_levels(run, opts, chain.url, cfg.model, tokenizer, bar, rep,
                                   factory):
            _count_client(client_sem, clients, at)
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
        if w.get("role", {}).get("leader"):  # a sharded model: its leader's step split
            run.parts.extend(w["parts"])
        _add_sem(run.sem.setdefault("worker", {}), "transport", w["sem"])
    if "relay" in results:
        _add_sem(run.sem.setdefault("relay", {}), "transport", results["relay"]["sem"])
    for layer, counts in client_sem.items():
        _add_sem(run.sem.setdefault("client", {}), layer, counts)


def _pooled(reps: list[tuple[list[Any], int, int]]) -> tuple[list[Any], int, int]:
    """The clients of every repetition, and one window as long as all of theirs."""
    clients = [cr for r in reps for cr in r[0]]
    t_start = min(r[1] for r in reps)
    return clients, t_start, t_start + sum(r[2] - r[1] for r in reps)


def _common_fields(opts: Options, level: Level) -> dict[str, Any]:
    a = opts.args
    return {**level.fields(), "burstiness": a.burstiness, "dataset": a.dataset,
            "input_len": a.input_len, "output_len": opts.tokens, "endpoint": a.endpoint,
            "seed": a.seed}


def _warnings(row: dict[str, Any], opts: Options) -> list[str]:
    from fabric.serving.metrics import thin_percentiles

    counts = {m: row["sample_counts"][m] for m in opts.metrics}
    return thin_percentiles(counts, opts.percentiles)


def _rows(runs: list[StrategyRun], opts: Options, tokenizer: Any,
          table: list[bytes]) -> list[dict[str, Any]]:
    from fabric.serving.metrics import LevelInput, level_row, semantic_per_token, stats

    rows = []
    for run in runs:
        transport, detok, at = run.key
        steps = np.concatenate(run.steps) if run.steps else np.zeros((0, 5), np.int64)
        tokens = sum(len(v) for v in run.generated.values())
        sem = semantic_per_token(run.sem, tokens)
        ds = np.concatenate(run.detok_samples) if run.detok_samples else np.zeros((0, 2))
        per_token_us = (ds[:, 0] / np.maximum(ds[:, 1], 1) / 1e3).tolist() if ds.size else []
        for level in opts.levels:
            reps = run.levels.get(level, [])
            if not reps:
                continue
            clients, t_start, t_end = _pooled(reps)
            keys = {cr.key for cr in clients}
            li = LevelInput(transport, detok, at, level.concurrency, clients, t_start, t_end,
                            {k: run.timelines[k] for k in keys if k in run.timelines},
                            {k: run.generated[k] for k in keys if k in run.generated},
                            _steps_in(steps, reps),
                            extra={**_common_fields(opts, level),
                                   "workers": opts.args.workers, "tokens": opts.tokens,
                                   "step_ms": opts.args.step_ms,
                                   "detokenizer": opts.args.detokenizer,
                                   "doorbells": run.bells,
                                   "event_loop": _loop_name(),
                                   "semantic_per_token": sem,
                                   "detok_us_per_token": stats(per_token_us)
                                   if per_token_us else None,
                                   "repeat": len(reps)})
            row = level_row(li, tokenizer, table, opts.slo, opts.percentiles)
            split = step_split(run.parts, reps, opts.percentiles)
            if split is not None:
                _add_split(row, split)
            row["warnings"] = _warnings(row, opts)
            rows.append(row)
    return rows


def _add_split(row: dict[str, Any], split: dict[str, Any]) -> None:
    """``parts_ms``: the step's parts, then the layers after generation (latency each
    token gains on its way to the client); ``step_over_itl``: how much of the mean ITL
    the step's parts explain."""
    keep = ("mean", "p50", "p99")
    parts = {k: {q: split[k][q] for q in keep} for k in STEP_PARTS}
    for k in ("transport", "interpretation", "presentation"):
        parts[k] = {q: row["layers_ms"][k][q] for q in keep}
    row["parts_ms"] = parts
    row["step_ms_per_token"] = {q: split["step"][q] for q in keep}
    itl = row.get("itl_ms", {}).get("mean")
    total = sum(split[k]["mean"] for k in STEP_PARTS)
    row["step_over_itl"] = total / itl if itl else float("nan")
    row["collectives"] = split["collectives"]
    row["experience"]["completion_collectives"] = split["collectives"]["completion_rate"]


def _external_row(run: StrategyRun, opts: Options, level: Level, model: str
                  ) -> dict[str, Any]:
    from fabric.serving.metrics import client_summary

    clients, t_start, t_end = _pooled(run.levels[level])
    row, _ = client_summary(clients, t_start, t_end, opts.slo, opts.percentiles)
    row = {"strategy": "server", "base_url": opts.base_url, "model": model,
           **_common_fields(opts, level), **row, "repeat": len(run.levels[level])}
    row["warnings"] = _warnings(row, opts)
    return row


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


# ---------------------------------------------------------------------- tables
def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


_TITLES = {"ttft": ("Time to First Token", "TTFT"),
           "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"),
           "e2el": ("End-to-end Latency", "E2EL")}


def result_block(row: dict[str, Any], opts: Options) -> str:
    """One level as ``vllm bench serve`` prints its result (the same lines and layout)."""
    from fabric.serving.metrics import pkey

    def line(name: str, value: Any, digits: int = 2) -> str:
        shown = value if isinstance(value, int | str) or value is None else \
            _f(value, digits)
        return f"{name:<40} {shown!s:<10}".rstrip()

    rate = row["request_rate"]
    out = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
           line("Successful requests:", row["completed"]),
           line("Failed requests:", row["failed"]),
           line("Maximum request concurrency:", row["concurrency"]),
           line("Request rate configured (RPS):", rate if rate == "inf" else float(rate)),
           line("Benchmark duration (s):", row["duration_s"]),
           line("Total input tokens:", row["total_input_tokens"]),
           line("Total generated tokens:", row["total_output_tokens"]),
           line("Request throughput (req/s):", row["request_throughput"]),
           ]
    if row.get("goodput_req_s") is not None:
        out.append(line("Request goodput (req/s):", row["goodput_req_s"]))
    out += [line("Input token throughput (tok/s):", row["input_throughput_tok_s"]),
            line("Output token throughput (tok/s):", row["output_throughput_tok_s"]),
            line("Total Token throughput (tok/s):", row["total_throughput_tok_s"])]
    for m in opts.metrics:
        title, short = _TITLES[m]
        st = row[f"{m}_ms"]
        out.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        out.append(line(f"Mean {short} (ms):", st["mean"]))
        out.append(line(f"Median {short} (ms):", st["median"]))
        for p in opts.percentiles:
            out.append(line(f"P{p:g} {short} (ms):", st[pkey(p)]))
    out.append("=" * 50)
    out += [f"warning: {w}" for w in row.get("warnings", [])]
    return "\n".join(out)


def _client_table(rows: list[dict[str, Any]], opts: Options, own: bool) -> list[str]:
    from fabric.serving.metrics import pkey

    ps = [p for p in opts.percentiles if p != 50]
    cols = ["strategy", "load", "req/s", "in tok/s", "out tok/s"]
    for m in opts.metrics:
        short = _TITLES[m][1]
        cols += [f"{short} p50"] + [f"{short} {pkey(p)}" for p in ps]
    cols.append("goodput")
    if own:
        cols += ["lost", "mismatched"]
    else:
        cols.append("failed")
    table = []
    for r in rows:
        cells = [r["strategy"], r["load"], _f(r["request_throughput"]),
                 _f(r["input_throughput_tok_s"], 0), _f(r["output_throughput_tok_s"], 0)]
        for m in opts.metrics:
            st = r[f"{m}_ms"]
            cells += [_f(st["median"])] + [_f(st[pkey(p)]) for p in ps]
        cells.append(_f(r["goodput_req_s"]))
        cells += [str(r["lost_tokens"]), str(r["text_mismatches"])] if own else \
            [str(r["failed"])]
        table.append(cells)
    return report.markdown_table(cols, table, left=cols)


def _warning_lines(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, list[str]] = {}
    for r in rows:
        for w in r.get("warnings", []):
            seen.setdefault(w, []).append(f"{r['strategy']} {r['load']}")
    return [f"warning: {w} ({'; '.join(who) if len(who) < 4 else f'{len(who)} rows'})"
            for w, who in seen.items()]


def _slo_text(opts: Options) -> str:
    return ", ".join(f"{k} <= {v:g} ms" for k, v in opts.slo.items()) or "none"


def tables(rows: list[dict[str, Any]], opts: Options) -> str:
    """The Markdown report of our own chain."""
    out = []
    itl_slo = opts.slo.get("itl", opts.slo.get("tpot"))
    out.append(f"### Client metrics (ms; vllm bench serve conventions; SLO: {_slo_text(opts)})"
               "\n")
    out += _client_table(rows, opts, own=True)
    warnings = _warning_lines(rows)
    if warnings:
        out += [""] + warnings
    base = {r["load"]: r for r in rows
            if (r["transport"], r["detok"], r["detok_at"]) == BASELINE}
    out.append("\n### Time per token in each layer (ms, p50 / p99); "
               "Δ p99 against direct+immediate at the same load\n")
    head = ["strategy", "load", "generation", "transport", "interpretation", "presentation",
            "added p50 / p99", "Δ transport", "Δ interp.", "Δ present."]
    table = []
    for r in rows:
        L = r["layers_ms"]
        b = base.get(r["load"])

        def d(layer: str, r: dict[str, Any] = r, b: dict[str, Any] | None = b) -> str:
            if b is None or b is r:
                return "-"
            return f"{r['layers_ms'][layer]['p99'] - b['layers_ms'][layer]['p99']:+.3f}"

        table.append(
            [r["strategy"], r["load"]]
            + [f"{_f(L[k]['p50'], 3)} / {_f(L[k]['p99'], 3)}"
               for k in ("generation", "transport", "interpretation", "presentation")]
            + [f"{_f(r['added_ms']['p50'], 3)} / {_f(r['added_ms']['p99'], 3)}",
               d("transport"), d("interpretation"), d("presentation")])
    out += report.markdown_table(head, table, left=head)
    out.append("\n### Semantic distance per token (copies / encodes / process crossings / "
               "switch hops), counted as the code ran\n")
    head = ["strategy", "transport", "interpretation", "presentation", "total",
            "detok µs/token p50"]
    table = []
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
        table.append([r["strategy"], c("transport"), c("interpretation"), c("presentation"),
                      c("total"), _f(dt["p50"] if dt else None)])
    out += report.markdown_table(head, table, left=head)
    split = [r for r in rows if "parts_ms" in r]
    if split:
        out.append("\n### The model's step, split (ms per token, mean / p99; sharded over "
                   "the fabric); step parts over mean ITL\n")
        head = ["strategy", "load", *STEP_PARTS, "parts / ITL", "collectives resent"]
        table = []
        for r in split:
            P = r["parts_ms"]
            coll = r["collectives"]
            table.append([r["strategy"], r["load"]]
                         + [f"{_f(P[k]['mean'], 3)} / {_f(P[k]['p99'], 3)}" for k in STEP_PARTS]
                         + [_f(r["step_over_itl"], 3),
                            f"{coll['resent']:.0f} of {coll['ops']:.0f}"])
        out += report.markdown_table(head, table, left=head)
    itl_text = f"{itl_slo:g} ms" if itl_slo is not None else "no SLO"
    out.append(f"\n### Effective experience = compute × completion × timeliness "
               f"(timeliness: ITL <= {itl_text})\n")
    head = ["strategy", "load", "compute", "completion", "timeliness", "product",
            "UTF-8 held tokens"]
    table = []
    for r in rows:
        e = r["experience"]
        table.append([r["strategy"], r["load"], _f(e["compute"], 3), _f(e["completion"], 3),
                      _f(e["timeliness"], 3), _f(e["product"], 3), str(r["utf8_held_tokens"])])
    out += report.markdown_table(head, table, left=head)
    return "\n".join(out) + "\n"


def external_table(rows: list[dict[str, Any]], opts: Options) -> str:
    """The Markdown table of a --base-url run (one row per level)."""
    out = [f"### {opts.base_url} (model {rows[0]['model'] if rows else '?'}; ms; "
           f"SLO: {_slo_text(opts)})\n"]
    out += _client_table(rows, opts, own=False)
    return "\n".join(out) + "\n"


def plot_itl(runs: list[StrategyRun], path: str | Path, opts: Options) -> Path:
    """ECDF of client ITLs, one line per strategy, one panel per load level."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    levels = opts.levels
    fig = Figure(figsize=(5.0 * len(levels), 4.0), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(levels), squeeze=False)[0]
    for ax, level in zip(axes, levels, strict=True):
        for run in runs:
            itl = []
            for clients, _, _ in run.levels.get(level, []):
                for cr in clients:
                    t = np.asarray(cr.content_times, dtype=np.float64)
                    itl.extend((np.diff(t) / 1e6).tolist())
            if not itl:
                continue
            xs = np.sort(np.asarray(itl))
            ys = np.arange(1, xs.size + 1) / xs.size
            ax.plot(np.maximum(xs, 0.1), ys, label=run.label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("inter-token latency (ms, log; gaps < 0.1 ms drawn at 0.1)")
        ax.set_ylabel("fraction of gaps ≤ x")
        ax.set_title(level.label)
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
        for level, reps in run.levels.items():
            clients = [cr for cr in reps[0][0][:per_level] if cr.key in run.timelines]
            tls = [run.timelines[k] for k in (cr.key for cr in clients) if k is not None]
            if tls:
                chunks.append((min(int(tl["t_req"]) for tl in tls),
                               f"{run.label} {level.label}", tls,
                               {cr.rid: cr for cr in clients}))
    tb = TraceBuilder()
    for i, (_, label, tls, by_rid) in enumerate(sorted(chunks, key=lambda x: x[0])):
        add_chain(tb, label, 100 * (i + 1), tls, by_rid)
    return tb.write(path)


# ---------------------------------------------------------------------- runs
def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse unwritable output files before anything runs."""
    from fabric.emulation.launch_cli import check_dir, check_output_file

    for flag in ("json", "markdown", "plot", "trace"):
        if getattr(args, flag, None):
            check_output_file(f"--{flag}", getattr(args, flag))
    if args.run_dir:
        check_dir("--run-dir", args.run_dir)


def _path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _header(opts: Options, model: str) -> str:
    a = opts.args
    where = (f"{opts.base_url} (client only; no fabric launched)" if opts.base_url
             else f"semfab's own chain, {a.workers} worker(s){_layout(a)}, strategies "
             + ", ".join(StrategyRun(k).label for k in opts.strategies))
    inp = a.input_len if a.input_len is not None else "dataset default"
    burst = f"{a.burstiness:g}" + (" (Poisson)" if a.burstiness == 1 else "")
    return "\n".join([
        f"# semfab bench tokens: {where}",
        f"# model {model}  endpoint {_path(a.endpoint)}  dataset {a.dataset}  input-len {inp}"
        f"  output-len {opts.tokens}  seed {a.seed}"
        + (f"  temperature {a.temperature:g}" if a.temperature is not None else "")
        + ("  ignore-eos" if a.ignore_eos else ""),
        f"# load: {', '.join(f'{lv.label} ({lv.num_prompts} prompts)' for lv in opts.levels)}"
        f"; burstiness {burst}; repeat {a.repeat}; event loop {_loop_name()}",
        f"# percentiles {', '.join(f'{p:g}' for p in opts.percentiles)} of "
        f"{', '.join(opts.metrics)}; SLO {_slo_text(opts)}",
    ])


def _layout(a: argparse.Namespace) -> str:
    """`` as tp 2 x ep 2 x pp 1 (moe flat, tp allreduce ina)`` for a model preset."""
    from fabric.core.model import MODELS

    if a.model not in MODELS:
        return ""
    return (f" as {a.workers // (a.tp * a.ep * a.pp)} generator(s) of tp {a.tp} x ep {a.ep} x "
            f"pp {a.pp} (moe {a.moe}, tp allreduce {a.tp_path})")


def _params(opts: Options, model: str) -> dict[str, Any]:
    """Every setting of the run (a --base-url run leaves out our chain's)."""
    skip = set(CHAIN_FLAGS) | {"trace_requests"} if opts.base_url else set()
    params = {k: v for k, v in vars(opts.args).items() if not callable(v) and k not in skip}
    from bench.sweep import TUNING_ENV

    params["env"] = {k: v for k, v in sorted(os.environ.items()) if k in TUNING_ENV}
    params.update({"model": model, "base_url": opts.base_url,
                   "levels": [lv.fields() for lv in opts.levels],
                   "percentiles": opts.percentiles, "percentile_metrics": opts.metrics,
                   "slo_ms": opts.slo})
    return params


def _server_model(base: str, timeout_s: float = 10.0) -> str:
    """The first model ``GET {base}/v1/models`` lists (UsageError if unreachable)."""
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=timeout_s) as resp:
            data = json.loads(resp.read())
        return str(data["data"][0]["id"])
    except urllib.error.HTTPError as exc:
        raise UsageError(f"--base-url {base}: GET /v1/models answered HTTP {exc.code}; "
                         "give the model with --model") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UsageError(f"--base-url {base}: cannot connect ({reason}); is the server "
                         "running?") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise UsageError(f"--base-url {base}: GET /v1/models listed no model; give the "
                         "model with --model") from None


def _check_reachable(base: str, timeout_s: float = 10.0) -> None:
    parts = urllib.parse.urlsplit(base)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", port), timeout_s).close()
    except OSError as exc:
        raise UsageError(f"--base-url {base}: cannot connect ({exc.strerror or exc}); is "
                         "the server running?") from None


def _finish(rows: list[dict[str, Any]], text: str, opts: Options, model: str,
            runs: list[StrategyRun]) -> None:
    a = opts.args
    if a.json:
        report.write_json(a.json, "tokens", rows, extra={"params": _params(opts, model)})
        print(f"wrote {a.json}")
    if a.markdown:
        report.write_markdown(a.markdown, text)
        print(f"wrote {a.markdown}")
    if a.trace:
        write_trace(runs, a.trace, a.trace_requests)
        print(f"wrote {a.trace} (open it in the Perfetto UI)")
    if a.plot:
        plot_itl(runs, a.plot, opts)
        print(f"wrote {a.plot}")


def run_external(opts: Options) -> int:
    """`semfab bench tokens --base-url URL`: a pure client of any OpenAI-compatible server."""
    from fabric.serving.assets import ensure_assets, load_tokenizer

    a = opts.args
    base = opts.base_url
    assert base is not None
    _check_reachable(base)
    model = opts.model or _server_model(base)
    tokenizer = load_tokenizer(ensure_assets())  # prompt lengths (estimates) only
    print(_header(opts, model), flush=True)
    started = time.monotonic()
    run = StrategyRun(("server", "", ""))
    _warm_up(opts, base, model, tokenizer)
    rows_by: dict[Level, dict[str, Any]] = {}

    def done(level: Level, rep: int) -> None:
        if rep == a.repeat - 1:
            rows_by[level] = _external_row(run, opts, level, model)
            print("\n" + result_block(rows_by[level], opts), flush=True)

    with report.progress(len(opts.levels) * a.repeat, "tokens") as bar:
        for rep in range(a.repeat):
            _run_levels(run, opts, base, model, tokenizer, bar, rep,
                        on_level=lambda lv, rep=rep: done(lv, rep))
    rows = [rows_by[lv] for lv in opts.levels]
    text = external_table(rows, opts)
    if len(rows) > 1:
        print("\n" + text)
    print(f"({len(rows)} level(s) in {time.monotonic() - started:.0f} s)")
    _finish(rows, text, opts, model, [run])
    return 1 if any(r["failed"] for r in rows) else 0


def run(args: argparse.Namespace, fab: Any = None) -> int:
    """`semfab bench tokens`; on ``fab`` when given (a placed fabric: `semfab run
    --bench-tokens`), else on a fabric launched here."""
    from fabric.serving.assets import ensure_assets, load_tokenizer
    from fabric.serving.config import DEFAULT_MODEL
    from fabric.serving.detok import byte_table
    from fabric.serving.runner import launch_for

    opts = options(args)
    _check_outputs(args)
    if opts.base_url:
        return run_external(opts)
    if args.sim:
        from bench import serve_sim

        return serve_sim.run(opts)
    if fab is None:  # launched here: this machine's limit
        from fabric.emulation.launcher import check_workers

        check_workers(args.workers, "--workers")
    assets_dir = str(ensure_assets())
    tokenizer = load_tokenizer(assets_dir)
    table = byte_table(tokenizer)
    runs = [StrategyRun(key) for key in opts.strategies]
    model = opts.model or DEFAULT_MODEL
    print(_header(opts, model), flush=True)
    started = time.monotonic()
    own = fab is None
    if fab is None:
        fab = launch_for(opts.transports, args.workers, run_dir=args.run_dir, timeout_s=30.0)
    code = 1
    kept = True
    try:
        total = len(runs) * len(opts.levels) * args.repeat
        with report.progress(total, "tokens") as bar:
            for rep in range(args.repeat):
                for r in runs:
                    _run_strategy(fab, r, opts, assets_dir, tokenizer, table, bar, rep)
        rows = _rows(runs, opts, tokenizer, table)
        text = tables(rows, opts)
        print(text)
        bad = sum(r["lost_tokens"] + r["text_mismatches"] + r["failed"] for r in rows)
        code = 1 if bad else 0
    finally:
        if own:
            fab.close()
            kept = _clean_run_dir(fab.run_dir, code == 0, args)
    where = ("the logs of each host's processes are on that host" if not own else
             f"fabric logs in {fab.run_dir}" if kept else
             "fabric logs removed after a clean run; --keep-runs keeps them")
    print(f"({len(rows)} rows in {time.monotonic() - started:.0f} s; {where})")
    _finish(rows, text, opts, model, runs)
    return code


def _clean_run_dir(run_dir: Path, ok: bool, args: argparse.Namespace) -> bool:
    """Remove the fabric's run folder after a clean run unless asked to keep it.

    A folder given with --run-dir is the user's and always kept; so is the
    folder of a failed run (its logs say why). True when the folder is kept.
    """
    if not ok or args.run_dir or args.keep_runs:
        return True
    shutil.rmtree(run_dir, ignore_errors=True)
    return False


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.tokens ...` (the same flags as `semfab bench tokens`)."""
    import sys

    p = argparse.ArgumentParser(prog="semfab bench tokens", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        return run(args)
    except UsageError as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 2
    except PeerFailed as exc:
        print(f"semfab: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
