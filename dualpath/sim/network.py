"""Bandwidth sharing for the cluster simulator: transfers ("flows") cross links and share them max-min fairly.

A flow has a size in bytes and a route: the links it crosses, each with a factor (bytes on that link per byte
moved: 2 where a copy crosses one link twice). Rates follow progressive filling: every unfinished flow's rate rises
together until some link it crosses is full, then that link's flows are frozen, and so on; so a flow's rate is
set by its most contended link, and no link carries more than its capacity. Rates change only when a flow starts
or ends, so completion times are exact piecewise-linear solutions, not time steps.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

Route = tuple[tuple[str, float], ...]  # (link name, bytes on the link per byte moved)


@dataclass
class Flow:
    id: str
    size: float
    remaining: float  # as of ``since``
    route: Route
    rate: float = 0.0
    since: float = 0.0


class FlowNetwork:
    """Links with capacities (bytes/s); flows added and finished as simulated time advances.

    Progress is settled lazily: a flow's bytes are brought up to date only when rates change (a flow starts or
    ends) or when asked, so timer events in between cost nothing here, however many flows are in flight.
    """

    def __init__(self, capacity: dict[str, float]):
        self.capacity = capacity
        self.now = 0.0
        self.flows: dict[str, Flow] = {}
        self._carried: dict[str, float] = {}
        self._next: tuple[float, str] | None = None

    @property
    def carried(self) -> dict[str, float]:
        """Bytes each link has carried so far."""
        self._settle()
        return self._carried

    def remaining(self, flow_id: str) -> float:
        f = self.flows[flow_id]
        return max(0.0, f.remaining - f.rate * (self.now - f.since))

    def add(self, flow_id: str, size: float, route: Route) -> None:
        """Start moving ``size`` bytes along ``route`` at the current time (call ``advance`` first)."""
        if flow_id in self.flows:
            raise ValueError(f"flow {flow_id} already in flight")
        unknown = [link for link, _ in route if link not in self.capacity]
        if unknown or not route:
            raise ValueError(f"flow {flow_id}: unknown links {unknown}" if unknown else f"flow {flow_id}: no route")
        self._settle()
        self.flows[flow_id] = Flow(flow_id, float(size), float(size), route, since=self.now)
        self._share()

    def next_completion(self) -> tuple[float, str] | None:
        """(time, flow id) of the flow that finishes first at the current rates, or None when idle."""
        return self._next

    def advance(self, to: float) -> list[str]:
        """Move time to ``to`` (not past the next completion); return the flows that finished, removed."""
        if to < self.now - 1e-12:
            raise ValueError(f"time runs forward: {to} < {self.now}")
        self.now = max(self.now, to)
        eps = 1e-12 * max(1.0, self.now)
        if self._next is None or self._next[0] > self.now + eps:
            return []
        done = [f for f in self.flows.values() if f.rate > 0 and f.since + f.remaining / f.rate <= self.now + eps]
        self._settle()
        for f in done:  # due now: whatever rounding left of them arrives too
            for link, factor in f.route:
                self._carried[link] = self._carried.get(link, 0.0) + f.remaining * factor
            del self.flows[f.id]
        self._share()
        return [f.id for f in done]

    def _settle(self) -> None:
        """Bring every flow's remaining bytes and every link's carried bytes up to now."""
        for f in self.flows.values():
            moved = min(f.remaining, f.rate * (self.now - f.since))
            if moved > 0:
                f.remaining -= moved
                for link, factor in f.route:
                    self._carried[link] = self._carried.get(link, 0.0) + moved * factor
            f.since = self.now

    def utilization(self) -> dict[str, float]:
        """Each link's current load over its capacity."""
        load: dict[str, float] = {}
        for f in self.flows.values():
            for link, factor in f.route:
                load[link] = load.get(link, 0.0) + f.rate * factor
        return {link: v / self.capacity[link] for link, v in load.items()}

    def _share(self) -> None:
        """New rates for the flows in flight (settled to now), and the next completion at those rates."""
        self._fill()
        self._next = min(((self.now + (f.remaining / f.rate if f.rate > 0 else math.inf), f.id)
                          for f in self.flows.values()), default=None)
        if self._next is not None and math.isinf(self._next[0]):
            self._next = None

    def _fill(self) -> None:
        """Progressive filling: all unfrozen flows share one rising rate; a link fills when its frozen load plus
        that rate times its unfrozen weight reaches capacity, which freezes its flows at the rate. A heap of fill
        levels, updated only for the links of newly frozen flows: O(flows x route x log links) per call, where
        recomputing every link's share per step cost O(links x flows x route)."""
        users: dict[str, list[tuple[Flow, float]]] = {}
        weight: dict[str, float] = {}
        for f in self.flows.values():
            f.rate = 0.0
            for link, factor in f.route:
                users.setdefault(link, []).append((f, factor))
                weight[link] = weight.get(link, 0.0) + factor
        frozen_load = dict.fromkeys(weight, 0.0)
        heap = [(self.capacity[link] / w, link) for link, w in weight.items()]
        heapq.heapify(heap)
        done: set[str] = set()
        while heap:
            level, link = heapq.heappop(heap)
            if link in done or weight[link] <= 1e-12:
                continue
            current = (self.capacity[link] - frozen_load[link]) / weight[link]
            if current > level * (1 + 1e-12) + 1e-300:  # a stale entry: this link fills later now
                heapq.heappush(heap, (current, link))
                continue
            done.add(link)
            for f, _ in users[link]:
                if f.rate:  # frozen already (through another link)
                    continue
                f.rate = max(level, 1e-300)
                for other, factor in f.route:
                    frozen_load[other] += f.rate * factor
                    weight[other] -= factor
                    if other not in done and weight[other] > 1e-12:
                        heapq.heappush(heap, ((self.capacity[other] - frozen_load[other]) / weight[other], other))
