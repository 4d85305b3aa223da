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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric.serving.detok import completion_index

LAYER_NAMES = ("generation", "transport", "interpretation", "presentation")
StatsFn = Callable[[Iterable[float]], dict[str, float]]
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


def stats(samples: Iterable[float]) -> dict[str, float]:
    """mean, median (= p50), p90, p99, p99.9, min, max and std of ``samples``.

    Percentiles interpolate linearly (NumPy's default), as
    ``bench.report.latency_stats`` does. An empty sample gives NaNs.
    """
    arr = np.asarray(list(samples), dtype=np.float64)
    if arr.size == 0:
        nan = float("nan")
        return {k: nan for k in ("mean", "median", "p50", "p90", "p99", "p99.9", "min",
                                 "max", "std")}
    p50, p90, p99, p999 = np.percentile(arr, [50, 90, 99, 99.9])
    return {"mean": float(arr.mean()), "median": float(p50), "p50": float(p50),
            "p90": float(p90), "p99": float(p99), "p99.9": float(p999),
            "min": float(arr.min()), "max": float(arr.max()), "std": float(arr.std())}


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


@dataclass
class LevelInput:
    """Everything measured for one strategy at one concurrency."""

    transport: str
    detok: str
    detok_at: str
    concurrency: int
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
              slo: Mapping[str, float], stats_fn: StatsFn = stats) -> dict[str, Any]:
    """One result row: client metrics, layers, correctness and experience."""
    per_req = []
    layers: dict[str, list[np.ndarray]] = {k: [] for k in LAYER_NAMES}
    gaps_ok = 0
    gaps_all = 0
    lost = mismatches = failed = held = intact_tokens = generated_tokens = 0
    itl_slo = slo.get("itl", slo.get("tpot"))
    for cr in li.clients:
        key = cr.key
        tl = li.timelines.get(key) if key is not None else None
        gen_ids = li.generated.get(key, []) if key is not None else []
        generated_tokens += len(gen_ids)
        n_out = int(tl["received"]) if tl is not None else None
        rm = request_metrics(cr, n_out)
        per_req.append(rm)
        if not rm.ok:
            failed += 1
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
    ok = [r for r in per_req if r.ok]
    duration_s = max((li.t_end - li.t_start) / 1e9, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    met = [r for r in ok if _meets(r, slo)]
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
        "requests": len(li.clients), "completed": len(ok), "failed": failed,
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput_tok_s": out_tokens / duration_s,
        "ttft_ms": stats_fn([r.ttft_ms for r in ok]) if ok else stats([]),
        "tpot_ms": stats_fn([r.tpot_ms for r in ok if np.isfinite(r.tpot_ms)])
        if any(np.isfinite(r.tpot_ms) for r in ok) else stats([]),
        "itl_ms": stats_fn([x for r in ok for x in r.itl_ms])
        if any(r.itl_ms for r in ok) else stats([]),
        "e2el_ms": stats_fn([r.e2el_ms for r in ok]) if ok else stats([]),
        "goodput_req_s": len(met) / duration_s if slo else None,
        "slo_ms": dict(slo),
        "slo_attainment": len(met) / len(li.clients) if li.clients and slo else None,
        "layers_ms": {k: stats_fn(v.tolist()) if v.size else stats([]) for k, v in cat.items()},
        "added_ms": stats_fn(added.tolist()) if added.size else stats([]),
        "tokens_generated": generated_tokens,
        "lost_tokens": lost,
        "text_mismatches": mismatches,
        "utf8_held_tokens": held,
        "experience": {"compute": compute, "completion": completion, "timeliness": timeliness,
                       "product": compute * completion * timeliness},
        **li.extra,
    }
    return row


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
