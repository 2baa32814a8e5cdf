"""Prometheus metrics on ``prometheus_client``. Each server owns one ``Metrics``: its own ``CollectorRegistry``, never
the library's global ``REGISTRY`` (two servers in one process, as the tests run them, keep their numbers apart).
Every series is named ``PREFIX`` + name; ``docs/metrics.md`` lists them all."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "dualpath_"
# what generate_latest writes for names like ours (no UTF-8 escaping needed), and what every Prometheus reads
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """A server's registry. Counters are named with their ``_total`` (prometheus_client exposes ``name_total`` and
    ``name_created`` for them either way)."""

    def __init__(self):
        # auto_describe off: a collector registered without ``describe`` is not collected at registration (the
        # frontend's scheduler collector makes an RPC per collection)
        self.registry = CollectorRegistry(auto_describe=False)

    def counter(self, name: str, help_: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(PREFIX + name, help_, tuple(labels), registry=self.registry)

    def gauge(self, name: str, help_: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(PREFIX + name, help_, tuple(labels), registry=self.registry)

    def histogram(self, name: str, help_: str, labels: Iterable[str] = (), buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(PREFIX + name, help_, tuple(labels), registry=self.registry, buckets=buckets)

    def register(self, collector: Collector) -> None:
        """A collector whose series are read at each scrape (``dualpath.scheduler.metrics.StatsCollector``)."""
        self.registry.register(collector)

    def render(self) -> bytes:
        """Every series, in the text exposition format (``CONTENT_TYPE``); runs each collector's ``collect``."""
        return generate_latest(self.registry)


def counter_family(name: str, help_: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    """A counter a collector reports from numbers kept elsewhere (``add_metric(label values, value)``)."""
    return CounterMetricFamily(PREFIX + name, help_, labels=tuple(labels))


def gauge_family(name: str, help_: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_, labels=tuple(labels))


def sample_values(metric, suffix: str = "_total") -> dict[tuple[tuple[str, str], ...], float]:
    """A metric's current values by label set (sorted (name, value) pairs), from its samples named ``*suffix``:
    how the process reads its own counters back (the stats line) without collecting the whole registry."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith(suffix)
    }
