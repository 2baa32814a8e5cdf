"""A small Prometheus registry: counters, gauges and histograms with labels, rendered in the text exposition
format (version 0.0.4). Each server owns one ``Registry``; nothing here is global."""
from __future__ import annotations

import math
import threading
from typing import Iterable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str, labels: Iterable[str] = ()):
        self.name, self.help, self.label_names = name, help_, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(str(labels[n]) for n in self.label_names)
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels) -> float:
        return self.values.get(tuple(str(labels[n]) for n in self.label_names), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = list(self.values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        key = tuple(str(labels[n]) for n in self.label_names)
        with self._lock:
            self.values[key] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_: str, labels: Iterable[str] = (), buckets=LATENCY_BUCKETS):
        super().__init__(name, help_, labels)
        self.buckets = tuple(buckets) + (math.inf,)
        self.series: dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]

    def observe(self, value: float, **labels) -> None:
        key = tuple(str(labels[n]) for n in self.label_names)
        with self._lock:
            s = self.series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            for i, b in enumerate(self.buckets):
                if value <= b:
                    s[i] += 1
            s[-2] += value
            s[-1] += 1

    def render(self) -> list[str]:
        lines = self.header()
        with self._lock:
            items = [(k, list(v)) for k, v in self.series.items()]
        for key, s in items:
            for b, c in zip(self.buckets, s):
                le = 'le="' + _num(b) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {c}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(s[-2])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {s[-1]}")
        return lines


class Registry:
    def __init__(self, prefix: str = "dualpath_"):
        self.prefix = prefix
        self.metrics: list[_Metric] = []

    def _add(self, m):
        self.metrics.append(m)
        return m

    def counter(self, name, help_, labels=()) -> Counter:
        return self._add(Counter(self.prefix + name, help_, labels))

    def gauge(self, name, help_, labels=()) -> Gauge:
        return self._add(Gauge(self.prefix + name, help_, labels))

    def histogram(self, name, help_, labels=(), buckets=LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(self.prefix + name, help_, labels, buckets))

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
