"""Prometheus metrics for ``GET /metrics`` of ``semfab serve`` (no I/O, no clock).

Counters, gauges and histograms, each with optional labels, kept per server in
its own :class:`prometheus_client.CollectorRegistry` and rendered by
:func:`prometheus_client.generate_latest` (``# HELP``, ``# TYPE``, escaping,
histograms as cumulative ``_bucket{le=...}`` series with ``_sum`` and
``_count``). Values are observed in seconds, as Prometheus names them.

Each metric is a custom collector rather than a prometheus_client ``Counter``
or ``Histogram``: most values are read from the host's own counters when
scraped (``fn``), the host observes a chunk's tokens at once (``count``), and
the library's metrics would add a ``_created`` series (a clock read) to each.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

#: The exposition format's content type (what :func:`generate_latest` writes).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
#: Bucket bounds (seconds) for per-token layer times: 20 µs to 10 s.
LAYER_BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Bucket bounds (seconds) for request latencies (TTFT, end to end): 1 ms to 5 min.
REQUEST_BUCKETS = (1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                   60.0, 120.0, 300.0)
_M = TypeVar("_M", bound="_Metric")


class _Metric:
    """A collector of one metric family (see :class:`prometheus_client.registry.Collector`)."""

    kind: Callable[..., Any]  # the prometheus_client metric family of this kind

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _key(self, labels: Sequence[str]) -> tuple[str, ...]:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        return tuple(str(v) for v in labels)

    def family(self) -> Any:
        """The metric family, without samples."""
        return self.kind(self.name, self.help, labels=self.labelnames)

    def describe(self) -> list[Metric]:
        """The family without samples: the registry refuses a name twice without reading values."""
        return [self.family()]

    def collect(self) -> Iterator[Metric]:
        """The family with its samples (called by the registry on each render)."""
        raise NotImplementedError


class Counter(_Metric):
    """A monotonically increasing count; its name ends in ``_total``.

    Counted with :meth:`inc`, or read when rendered from ``fn``: a number, or
    (with labels) a mapping of label values to numbers.
    """

    kind = CounterMetricFamily

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                 fn: Callable[[], float | Mapping[tuple[str, ...], float]] | None = None
                 ) -> None:
        # prometheus_client names a counter's samples <family>_total whatever it is given
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total, not {name}")
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

    def collect(self) -> Iterator[Metric]:
        values: Mapping[tuple[str, ...], float] = self.values
        if self.fn is not None:
            got = self.fn()
            values = got if isinstance(got, Mapping) else {(): float(got)}
        fam = self.family()
        for key, value in sorted(values.items()):
            fam.add_metric(key, value)
        yield fam


class Gauge(_Metric):
    """A value read when the metrics are rendered (``fn``) or set."""

    kind = GaugeMetricFamily

    def __init__(self, name: str, help_text: str, fn: Callable[[], float] | None = None
                 ) -> None:
        super().__init__(name, help_text)
        self.fn = fn
        self.value = 0.0

    def set(self, value: float) -> None:
        """Set the value (when there is no ``fn``)."""
        self.value = float(value)

    def collect(self) -> Iterator[Metric]:
        fam = self.family()
        fam.add_metric((), self.fn() if self.fn is not None else self.value)
        yield fam


class Histogram(_Metric):
    """Counts of observations per bucket (upper bounds ``buckets``), sum and count."""

    kind = HistogramMetricFamily

    def __init__(self, name: str, help_text: str, buckets: Iterable[float],
                 labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        if not self.bounds or not all(math.isfinite(b) for b in self.bounds):
            raise ValueError("histogram buckets must be finite and non-empty (+Inf is added)")
        # le label values, written the way prometheus_client's own histograms write them
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
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

    def collect(self) -> Iterator[Metric]:
        fam = self.family()
        for key, s in sorted(self.series.items()):
            fam.add_metric(key, list(zip(self._les, accumulate(s[:-1]), strict=True)), s[-1])
        yield fam


class Registry:
    """The metrics of one server (its own registry, not prometheus_client's global one)."""

    def __init__(self) -> None:
        self.collectors = CollectorRegistry()

    def add(self, metric: _M) -> _M:
        """Register ``metric`` and return it (:class:`ValueError` for a name taken)."""
        self.collectors.register(metric)
        return metric

    def render(self) -> str:
        """The whole exposition text, metrics in registration order (ends with a newline)."""
        return generate_latest(self.collectors).decode()
