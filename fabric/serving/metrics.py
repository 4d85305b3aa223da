"""Serving metrics from per-token timestamps (pure: arrays in, numbers out).

Client-side metrics follow ``vllm bench serve``:

* **TTFT**: request sent -> first event with content received;
* **ITL**: gaps between successive content events of one request;
* **TPOT**: ``(E2EL - TTFT) / (output tokens - 1)`` per request;
* **E2EL**: request sent -> last event received;
* **goodput**: requests per second that met every SLO given.

The per-layer breakdown charges each token's time to the four layers of
DESIGN.md section 1.1, from the timestamps taken at each boundary::

    generation     t_gen[u] - t_gen[i-1]     (first token: - request arrival at the host)
    transport      t_arrive[u] - t_gen[u]    (send, switch, relay)
    interpretation t_detok[u] - t_arrive[u]  (batching wait + detokenizer)
    presentation   t_recv[u] - t_detok[u]    (JSON, SSE, socket, client parse)

where ``u`` is the token that completes token ``i``'s characters (``u == i``
unless ``i`` ends mid-character: a split character is only generated when
its last byte is, so the wait is generation's). With detokenization near the
client, interpretation is ``t_client_detok[u] - t_recv[u]`` and presentation
``t_recv[u] - t_arrive[u]``. The three non-generation layers add up to the
latency the delivery chain adds on top of generation.

Effective experience (DESIGN.md section 1.8) is reported as three factors in
[0, 1] and their product: *compute* (the generator kept its step time:
target / actual step duration), *completion* (tokens delivered intact and in
order / tokens generated), *timeliness* (tokens whose delivery came within the
ITL SLO of the previous delivery -- tokens delivered together share their
event's gap -- and the first delivery within the TTFT SLO).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric.serving.detok import completion_index

LAYER_NAMES = ("generation", "transport", "interpretation", "presentation")
_SLO_RE = re.compile(r"^\s*(ttft|tpot|itl|e2el)\s*:\s*([0-9.]+)\s*(ms|s|us)?\s*$", re.I)


@dataclass
class ClientResult:
    """What one request looked like from the client's side."""

    ok: bool = False
    status: int = 0
    error: str | None = None
    response_id: str = ""
    t_send: int = 0
    t_end: int = 0
    t_events: list[int] = field(default_factory=list)  # receive time of data event i
    content: list[bool] = field(default_factory=list)  # event i carried text or ids
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # detok near the client
    t_detok: list[int] = field(default_factory=list)  # per token, client detok
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    parse_ns: int = 0  # time spent decoding events (JSON, SSE)
    input_len: int | None = None  # the prompt's length as the dataset estimated it

    @property
    def input_tokens(self) -> int:
        """Prompt tokens: the server's count (usage) when it gave one, else the estimate."""
        n = (self.usage or {}).get("prompt_tokens")
        return int(n) if isinstance(n, int) else int(self.input_len or 0)

    @property
    def rid(self) -> int | None:
        """The host's request number, from the response id (``cmpl-<session>-<rid>``)."""
        try:
            return int(self.response_id.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            return None

    @property
    def key(self) -> tuple[int, int] | None:
        """``(session, rid)``: unique across the chains of one fabric."""
        try:
            _, session, rid = self.response_id.rsplit("-", 2)
            return int(session, 16), int(rid)
        except ValueError:
            return None

    @property
    def content_times(self) -> list[int]:
        """Receive times of the events that carried content."""
        return [t for t, c in zip(self.t_events, self.content, strict=True) if c]


def pkey(p: float) -> str:
    """The key of percentile ``p`` in a stats dict: ``p99``, ``p99.9``, ``p50``."""
    return f"p{p:g}"


def stats(samples: Iterable[float], percentiles: Sequence[float] = ()) -> dict[str, float]:
    """mean, median (= p50), p90, p99, p99.9, min, max and std of ``samples``,
    plus ``percentiles`` (keys from :func:`pkey`).

    Percentiles interpolate linearly (NumPy's default), as
    ``bench.report.latency_stats`` does. An empty sample gives NaNs.
    """
    arr = np.asarray(list(samples), dtype=np.float64)
    ps = sorted({50.0, 90.0, 99.0, 99.9, *map(float, percentiles)})
    if arr.size == 0:
        nan = float("nan")
        return {k: nan for k in ("mean", "median", *map(pkey, ps), "min", "max", "std")}
    values = np.percentile(arr, ps)
    out = {"mean": float(arr.mean()), "median": float(values[ps.index(50.0)])}
    out.update({pkey(p): float(v) for p, v in zip(ps, values, strict=True)})
    out.update({"min": float(arr.min()), "max": float(arr.max()), "std": float(arr.std())})
    return out


#: The client metrics ``--percentile-metrics`` may name (vllm bench serve's).
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_percentile_metrics(text: str) -> list[str]:
    """``"ttft,itl"`` -> ``["ttft", "itl"]`` (ValueError naming an unknown one)."""
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"unknown metric {', '.join(bad) or '(empty list)'}; choose from "
                         f"{', '.join(PERCENTILE_METRICS)}")
    return list(dict.fromkeys(names))


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; each must be in (0, 100)."""
    out: list[float] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"percentile {part!r} is not a number") from None
        if not 0 < value < 100:
            raise ValueError(f"percentile {part} must be between 0 and 100 (exclusive)")
        out.append(value)
    if not out:
        raise ValueError("no percentile given (e.g. 50,90,99)")
    return sorted(set(out))


def thin_percentiles(counts: Mapping[str, int], percentiles: Sequence[float]) -> list[str]:
    """Warnings for percentiles that rest on a handful of samples.

    Percentile ``p`` of ``n`` samples has ``n * min(p, 100 - p) / 100`` samples
    beyond it; under one, it is an interpolation between the extreme samples
    (p99 of fewer than 100 requests is almost the maximum). ``counts`` maps a
    metric name to its sample count; one line per percentile.
    """
    out = []
    for p in sorted(percentiles):
        tail = min(p, 100.0 - p) / 100.0
        need = int(np.ceil(1.0 / tail - 1e-9))
        thin = [(name, n) for name, n in counts.items() if 0 < n < need]
        if thin:
            which = ", ".join(f"{name.upper()} ({n})" for name, n in thin)
            out.append(f"{pkey(p)} rests on fewer than {need} samples for {which}: "
                       "it is close to the extreme value, not a tail estimate")
    return out


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft:200ms,tpot:50ms"`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _SLO_RE.match(part)
        if not m:
            raise ValueError(f"bad SLO {part!r}: use NAME:VALUE[ms|s|us] with NAME one of "
                             "ttft, tpot, itl, e2el")
        value = float(m.group(2))
        unit = (m.group(3) or "ms").lower()
        out[m.group(1).lower()] = value * {"ms": 1.0, "s": 1000.0, "us": 0.001}[unit]
    return out


@dataclass
class RequestMetrics:
    """One request, from the client's timestamps."""

    ok: bool
    ttft_ms: float
    e2el_ms: float
    tpot_ms: float
    itl_ms: list[float]
    output_tokens: int


def request_metrics(cr: ClientResult, output_tokens: int | None = None) -> RequestMetrics:
    """TTFT, E2EL, TPOT and ITLs of one request (vllm bench serve definitions)."""
    times = np.asarray(cr.content_times, dtype=np.int64)
    n = output_tokens if output_tokens is not None else (
        (cr.usage or {}).get("completion_tokens", len(times)))
    if not cr.ok or times.size == 0:
        return RequestMetrics(False, float("nan"), float("nan"), float("nan"), [], int(n))
    ttft = (times[0] - cr.t_send) / 1e6
    last = max(cr.t_events) if cr.t_events else times[-1]
    e2el = (last - cr.t_send) / 1e6
    tpot = (e2el - ttft) / (n - 1) if n > 1 else float("nan")
    itl = (np.diff(times) / 1e6).tolist()
    return RequestMetrics(True, float(ttft), float(e2el), float(tpot), itl, int(n))


@dataclass
class TokenLayers:
    """Per-token layer times (ms) of one request, and its delivery gaps."""

    generation: np.ndarray
    transport: np.ndarray
    interpretation: np.ndarray
    presentation: np.ndarray
    delivered: np.ndarray  # ns: when each token became readable at the client
    held: int  # tokens that ended mid-character


def token_layers(tl: Mapping[str, Any], cr: ClientResult, table: Sequence[bytes]
                 ) -> TokenLayers | None:
    """The layer breakdown of one request (None if nothing was delivered)."""
    n = int(tl["received"])
    if n == 0 or not cr.t_events:
        return None
    ids = np.asarray(tl["token"][:n]).tolist()
    u = np.asarray(completion_index(table, ids), dtype=np.int64)
    t_gen = np.asarray(tl["t_gen"][:n], dtype=np.int64)
    t_arr = np.asarray(tl["t_arrive"][:n], dtype=np.int64)
    chunk = np.asarray(tl["chunk"][:n], dtype=np.int64)
    events = np.asarray(cr.t_events, dtype=np.int64)
    if chunk.max(initial=0) >= events.size:
        return None  # the client did not see every event (it went away)
    t_recv = events[chunk]
    prev = np.concatenate([[int(tl["t_req"])], t_gen[:-1]])
    gen = t_gen[u] - prev
    transport = t_arr[u] - t_gen[u]
    if tl.get("client_detok"):
        if len(cr.t_detok) < n:
            return None
        t_cd = np.asarray(cr.t_detok[:n], dtype=np.int64)
        interp = t_cd[u] - t_recv[u]
        pres = t_recv[u] - t_arr[u]
        delivered = t_cd
    else:
        t_detok = np.asarray(tl["t_detok"][:n], dtype=np.int64)
        interp = t_detok[u] - t_arr[u]
        pres = t_recv[u] - t_detok[u]
        delivered = t_recv
    return TokenLayers(gen / 1e6, transport / 1e6, interp / 1e6, pres / 1e6, delivered,
                       int((u != np.arange(n)).sum()))


def delivery_gaps(delivered: np.ndarray) -> np.ndarray:
    """Per token, ns since the previous *delivery* (0 for the first delivery).

    Tokens that reach the reader together (one event) share that event's gap:
    eight tokens shown after a 30 ms wait all waited 30 ms.
    """
    times, inverse = np.unique(np.asarray(delivered, dtype=np.int64), return_inverse=True)
    gaps = np.concatenate([[0], np.diff(times)])
    return np.asarray(gaps[inverse], dtype=np.int64)


def client_summary(clients: Sequence[ClientResult], t_start: int, t_end: int,
                   slo: Mapping[str, float], percentiles: Sequence[float] = (99.0,),
                   output_tokens: Sequence[int | None] | None = None
                   ) -> tuple[dict[str, Any], list[RequestMetrics]]:
    """The client's view of one load level, as ``vllm bench serve`` reports it.

    Throughputs divide by the level's wall time ``t_end - t_start`` (ns) and
    count completed requests only; ``output_tokens`` (per client, None: the
    usage the server sent, else the content events) overrides the output
    lengths. Returns the row's fields (stats of TTFT, TPOT, ITL and E2EL in
    ms, vllm's flat ``mean_ttft_ms``-style keys, goodput, per-request arrays)
    and each request's metrics.
    """
    outs = list(output_tokens) if output_tokens is not None else [None] * len(clients)
    per_req = [request_metrics(cr, n) for cr, n in zip(clients, outs, strict=True)]
    pairs = [(cr, r) for cr, r in zip(clients, per_req, strict=True) if r.ok]
    ok = [r for _, r in pairs]
    duration_s = max((t_end - t_start) / 1e9, 1e-9)
    n_in = sum(cr.input_tokens for cr, _ in pairs)
    n_out = sum(r.output_tokens for r in ok)
    met = [r for r in ok if _meets(r, slo)]
    samples = {"ttft": [r.ttft_ms for r in ok],
               "tpot": [r.tpot_ms for r in ok if np.isfinite(r.tpot_ms)],
               "itl": [x for r in ok for x in r.itl_ms],
               "e2el": [r.e2el_ms for r in ok]}
    row: dict[str, Any] = {
        "requests": len(clients), "completed": len(ok), "failed": len(clients) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "input_tokens_from": ("server" if pairs and all(
            isinstance((cr.usage or {}).get("prompt_tokens"), int) for cr, _ in pairs)
            else "estimate"),
        "request_throughput": len(ok) / duration_s,
        "input_throughput_tok_s": n_in / duration_s,
        "output_throughput_tok_s": n_out / duration_s,
        "total_throughput_tok_s": (n_in + n_out) / duration_s,
    }
    for name, values in samples.items():
        row[f"{name}_ms"] = stats(values, percentiles)
    for name in PERCENTILE_METRICS:  # vllm's own key names, for tools that read its JSON
        st = row[f"{name}_ms"]
        row[f"mean_{name}_ms"] = st["mean"]
        row[f"median_{name}_ms"] = st["median"]
        row[f"std_{name}_ms"] = st["std"]
        for p in percentiles:
            row[f"p{p:g}_{name}_ms"] = st[pkey(p)]
    row.update({
        "goodput_req_s": len(met) / duration_s if slo else None,
        "slo_ms": dict(slo),
        "slo_attainment": len(met) / len(clients) if clients and slo else None,
        "sample_counts": {k: len(v) for k, v in samples.items()},
        "per_request": {
            "start_ms": [(cr.t_send - t_start) / 1e6 for cr in clients],
            "ttft_ms": [r.ttft_ms for r in per_req],
            "tpot_ms": [r.tpot_ms for r in per_req],
            "itl_ms": [r.itl_ms for r in per_req],
            "e2el_ms": [r.e2el_ms for r in per_req],
            "input_lens": [cr.input_tokens for cr in clients],
            "output_lens": [r.output_tokens for r in per_req],
            "ok": [r.ok for r in per_req],
            "errors": [None if r.ok else _error_text(cr)
                       for cr, r in zip(clients, per_req, strict=True)],
        },
    })
    return row, per_req


@dataclass
class LevelInput:
    """Everything measured for one strategy at one concurrency."""

    transport: str
    detok: str
    detok_at: str
    concurrency: int | None  # None: an open loop with no cap
    clients: list[ClientResult]
    t_start: int
    t_end: int
    timelines: Mapping[tuple[int, int], Mapping[str, Any]]  # host timelines by (session, rid)
    generated: Mapping[tuple[int, int], Sequence[int]]  # worker ids by (session, rid)
    steps: np.ndarray  # worker step log rows (t_gen, target, actual, rows, prefill)
    extra: dict[str, Any] = field(default_factory=dict)


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids)))


def level_row(li: LevelInput, tokenizer: Any, table: Sequence[bytes],
              slo: Mapping[str, float], percentiles: Sequence[float] = (99.0,)
              ) -> dict[str, Any]:
    """One result row: client metrics, layers, correctness and experience."""
    layers: dict[str, list[np.ndarray]] = {k: [] for k in LAYER_NAMES}
    gaps_ok = 0
    gaps_all = 0
    lost = mismatches = held = intact_tokens = generated_tokens = 0
    itl_slo = slo.get("itl", slo.get("tpot"))
    outs: list[int | None] = []
    for cr in li.clients:
        key = cr.key
        tl = li.timelines.get(key) if key is not None else None
        outs.append(int(tl["received"]) if tl is not None else None)
    client, per_req = client_summary(li.clients, li.t_start, li.t_end, slo, percentiles, outs)
    for cr, rm in zip(li.clients, per_req, strict=True):
        key = cr.key
        tl = li.timelines.get(key) if key is not None else None
        gen_ids = li.generated.get(key, []) if key is not None else []
        generated_tokens += len(gen_ids)
        if not rm.ok:
            lost += len(gen_ids)
            continue
        received = int(tl["received"]) if tl is not None else 0
        lost += max(0, len(gen_ids) - received)
        want = _decode(tokenizer, gen_ids)
        text_ok = cr.text == want
        if tl is not None:
            got_ids = np.asarray(tl["token"][:received]).tolist()
            text_ok = text_ok and got_ids == list(gen_ids)
        if not text_ok:
            mismatches += 1
        else:
            intact_tokens += len(gen_ids)
        if tl is None:
            continue
        tls = token_layers(tl, cr, table)
        if tls is None:
            continue
        held += tls.held
        for k in LAYER_NAMES:
            layers[k].append(getattr(tls, k))
        gap = delivery_gaps(tls.delivered)
        first = gap == 0  # tokens of the first delivery: judged by the TTFT SLO
        ttft_slo = slo.get("ttft")
        if itl_slo is not None:
            gaps_ok += int(((gap <= itl_slo * 1e6) & ~first).sum())
        if ttft_slo is None or rm.ttft_ms <= ttft_slo:
            gaps_ok += int(first.sum())
        gaps_all += gap.size
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in layers.items()}
    added = cat["transport"] + cat["interpretation"] + cat["presentation"]
    steps = li.steps
    if steps.size:
        win = steps[(steps[:, 0] >= li.t_start) & (steps[:, 0] <= li.t_end) & (steps[:, 4] == 0)]
    else:
        win = steps
    compute = float(win[:, 1].sum() / win[:, 2].sum()) if win.size and win[:, 2].sum() else \
        float("nan")
    completion = intact_tokens / generated_tokens if generated_tokens else float("nan")
    timeliness = gaps_ok / gaps_all if gaps_all and itl_slo is not None else float("nan")
    row: dict[str, Any] = {
        "transport": li.transport, "detok": li.detok, "detok_at": li.detok_at,
        "strategy": _label(li), "concurrency": li.concurrency,
        **client,
        "layers_ms": {k: stats(v.tolist(), percentiles) for k, v in cat.items()},
        "added_ms": stats(added.tolist(), percentiles),
        "tokens_generated": generated_tokens,
        "lost_tokens": lost,
        "text_mismatches": mismatches,
        "utf8_held_tokens": held,
        "experience": {"compute": compute, "completion": completion, "timeliness": timeliness,
                       "product": compute * completion * timeliness},
        **li.extra,
    }
    return row


def _error_text(cr: ClientResult) -> str:
    if cr.error:
        return cr.error[:500]
    if cr.status != 200:
        return f"HTTP {cr.status}"
    return "the stream ended without a finish reason"


def _label(li: LevelInput) -> str:
    text = f"{li.transport}+{li.detok}"
    return text if li.detok_at == "host" else f"{text}@client"


def _meets(r: RequestMetrics, slo: Mapping[str, float]) -> bool:
    checks = {"ttft": r.ttft_ms, "tpot": r.tpot_ms, "e2el": r.e2el_ms}
    for name, limit in slo.items():
        value = checks.get(name)
        if value is None:
            continue  # itl is judged per token (timeliness), not per request
        if not np.isfinite(value) or value > limit:
            return False
    return True


def semantic_per_token(parts: Mapping[str, Mapping[str, Mapping[str, float]]],
                       tokens: int) -> dict[str, dict[str, float]]:
    """Sum counters per layer over the chain's processes and divide by ``tokens``.

    ``parts`` maps a process (``worker``, ``relay``, ``host``, ``client``) to
    ``{layer: {"copies", "encodes", "crossings", "hops"}}``.
    """
    keys = ("copies", "encodes", "crossings", "hops")
    out: dict[str, dict[str, float]] = {}
    for layer in ("transport", "interpretation", "presentation"):
        out[layer] = {k: sum(float(p.get(layer, {}).get(k, 0.0)) for p in parts.values())
                      / max(tokens, 1) for k in keys}
    out["total"] = {k: sum(out[layer][k] for layer in ("transport", "interpretation",
                                                        "presentation")) for k in keys}
    return out
