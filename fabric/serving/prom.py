"""Prometheus metrics in the text exposition format (pure: no I/O, no clock).

A minimal registry for ``GET /metrics`` of ``semfab serve``: counters,
gauges and histograms, each with optional labels, rendered as the text
format every Prometheus scraper reads (``# HELP``, ``# TYPE``, samples;
histograms as cumulative ``_bucket{le=...}`` series with ``_sum`` and
``_count``). Values are observed in seconds, as Prometheus names them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

#: The exposition format's content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Bucket bounds (seconds) for per-token layer times: 20 µs to 10 s.
LAYER_BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Bucket bounds (seconds) for request latencies (TTFT, end to end): 1 ms to 5 min.
REQUEST_BUCKETS = (1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                   60.0, 120.0, 300.0)
_M = TypeVar("_M", bound="_Metric")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _key(self, labels: Sequence[str]) -> tuple[str, ...]:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        return tuple(str(v) for v in labels)

    def header(self) -> list[str]:
        text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {text}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A monotonically increasing count (``_total`` by convention).

    Counted with :meth:`inc`, or read when rendered from ``fn``: a number, or
    (with labels) a mapping of label values to numbers.
    """

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                 fn: Callable[[], float | Mapping[tuple[str, ...], float]] | None = None
                 ) -> None:
        super().__init__(name, help_text, labelnames)
        self.fn = fn
        self.values: dict[tuple[str, ...], float] = {}
        if not self.labelnames:
            self.values[()] = 0.0

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        """Add ``amount`` (>= 0) to the series of ``labels``."""
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        values: Mapping[tuple[str, ...], float] = self.values
        if self.fn is not None:
            got = self.fn()
            values = got if isinstance(got, Mapping) else {(): float(got)}
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}"
                                for k, v in sorted(values.items())]


class Gauge(_Metric):
    """A value read when the metrics are rendered (``fn``) or set."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, fn: Callable[[], float] | None = None
                 ) -> None:
        super().__init__(name, help_text)
        self.fn = fn
        self.value = 0.0

    def set(self, value: float) -> None:
        """Set the value (when there is no ``fn``)."""
        self.value = float(value)

    def render(self) -> list[str]:
        value = self.fn() if self.fn is not None else self.value
        return self.header() + [f"{self.name} {_num(value)}"]


class Histogram(_Metric):
    """Counts of observations per bucket (upper bounds ``buckets``), sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float],
                 labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        if not self.bounds or any(math.isinf(b) or math.isnan(b) for b in self.bounds):
            raise ValueError("histogram buckets must be finite and non-empty (+Inf is added)")
        self.series: dict[tuple[str, ...], list[float]] = {}  # per bucket, then +Inf, sum

    def observe(self, value: float, *labels: str, count: int = 1) -> None:
        """Record ``count`` observations of ``value`` in the series of ``labels``."""
        key = self._key(labels)
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0.0] * (len(self.bounds) + 2)
        s[bisect_left(self.bounds, value)] += count  # le: value <= bound
        s[-1] += value * count

    def count(self, *labels: str) -> int:
        """Observations of the series of ``labels``."""
        s = self.series.get(self._key(labels))
        return int(sum(s[:-1])) if s else 0

    def render(self) -> list[str]:
        out = self.header()
        for key, s in sorted(self.series.items()):
            acc = 0.0
            for bound, n in zip((*self.bounds, math.inf), s[:-1], strict=True):
                acc += n
                le = 'le="' + _num(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {_num(acc)}")
            lab = _labels(self.labelnames, key)
            out.append(f"{self.name}_sum{lab} {_num(s[-1])}")
            out.append(f"{self.name}_count{lab} {_num(acc)}")
        return out


class Registry:
    """The metrics of one server, rendered in registration order."""

    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _M) -> _M:
        """Register ``metric`` and return it."""
        if any(m.name == metric.name for m in self.metrics):
            raise ValueError(f"metric {metric.name} is registered twice")
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        """The whole exposition text (ends with a newline)."""
        lines: list[str] = []
        for m in self.metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"
