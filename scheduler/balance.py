"""Balance over sliding windows: storage-read bytes across nodes and prefill attention time across the prefill
engines of a group, each as max/avg (1.0 is perfect balance). The paper reports 1.18 for storage reads with its
scheduler (1.53 with round-robin) and 1.06 for attention time. Also a node's storage read rate, from the intervals
its engines had blocks waiting to be read."""

from __future__ import annotations

import threading
import time
from collections import deque


class WindowedSums:
    """Per-key sums of the increments added in the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._events: deque[tuple[float, str, float]] = deque()
        self._sums: dict[str, float] = {}
        self._keys: set[str] = set()
        self._lock = threading.Lock()

    def add(self, key: str, amount: float) -> None:
        with self._lock:
            self._keys.add(key)
            if amount:
                self._events.append((self.clock(), key, amount))
                self._sums[key] = self._sums.get(key, 0.0) + amount
            self._expire()

    def track(self, key: str) -> None:
        """Count ``key`` in the average even while it has no increments."""
        with self._lock:
            self._keys.add(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._keys.discard(key)

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        while self._events and self._events[0][0] < horizon:
            _, key, amount = self._events.popleft()
            self._sums[key] -= amount

    def sum(self, key: str) -> float:
        with self._lock:
            self._expire()
            return max(0.0, self._sums.get(key, 0.0))

    def sums(self, keys: set[str] | None = None) -> dict[str, float]:
        with self._lock:
            self._expire()
            return {k: max(0.0, self._sums.get(k, 0.0)) for k in (keys if keys is not None else self._keys)}


def max_over_avg(values) -> float:
    """max/avg of the values (1.0 for none or all zero)."""
    values = list(values)
    if not values:
        return 1.0
    avg = sum(values) / len(values)
    return max(values) / avg if avg > 0 else 1.0


MIN_DRAIN_S = 1.0  # seconds of a node's last ten with blocks waiting before their rate replaces the start-up probe


def drain_rate(intervals) -> tuple[float, float]:
    """(tokens read, seconds) over the ``[start, end, tokens]`` drain intervals of a node's engines
    (``ReadAccounting.drain_intervals``): the seconds are those of their union, when at least one engine of the
    node had blocks waiting to be read. Engines of one node share the disk or NIC, so reads that overlap count
    their time once, and ``tokens / seconds`` is the node's rate, not a sum of shares nor one engine's share."""
    tokens, busy, end = 0.0, 0.0, float("-inf")
    for start, stop, read in sorted(intervals):
        tokens += read
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return tokens, busy


def measured_alpha(intervals, min_drain_s: float = MIN_DRAIN_S) -> int:
    """Tokens the node reads in 3 s (the paper's alpha), as it read lately while blocks waited, or 0 (not
    measured) when they waited for under ``min_drain_s``: a few short waits measure too little to go by."""
    tokens, busy = drain_rate(intervals)
    return int(3 * tokens / busy) if busy >= min_drain_s and tokens > 0 else 0
