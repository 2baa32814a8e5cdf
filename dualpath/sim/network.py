"""Bandwidth sharing for the cluster simulator: transfers ("flows") cross links and share them max-min fairly.

A flow has a size in bytes and a route: the links it crosses, each with a factor (bytes on that link per byte
moved: 2 where a copy crosses one link twice). Rates follow progressive filling: every unfinished flow's rate rises
together until some link it crosses is full, then that link's flows are frozen, and so on; so a flow's rate is
set by its most contended link, and no link carries more than its capacity. Rates change only when a flow starts
or ends, so completion times are exact piecewise-linear solutions, not time steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

Route = tuple[tuple[str, float], ...]  # (link name, bytes on the link per byte moved)


@dataclass
class Flow:
    id: str
    remaining: float
    route: Route
    rate: float = 0.0


@dataclass
class FlowNetwork:
    """Links with capacities (bytes/s); flows added and finished as simulated time advances."""

    capacity: dict[str, float]
    now: float = 0.0
    flows: dict[str, Flow] = field(default_factory=dict)
    carried: dict[str, float] = field(default_factory=dict)  # bytes each link has carried

    def add(self, flow_id: str, size: float, route: Route) -> None:
        """Start moving ``size`` bytes along ``route`` at the current time (call ``advance`` first)."""
        if flow_id in self.flows:
            raise ValueError(f"flow {flow_id} already in flight")
        unknown = [link for link, _ in route if link not in self.capacity]
        if unknown or not route:
            raise ValueError(f"flow {flow_id}: unknown links {unknown}" if unknown else f"flow {flow_id}: no route")
        self.flows[flow_id] = Flow(flow_id, float(size), route)
        self._share()

    def next_completion(self) -> tuple[float, str] | None:
        """(time, flow id) of the flow that finishes first at the current rates, or None when idle."""
        best = None
        for f in self.flows.values():
            t = self.now + (f.remaining / f.rate if f.rate > 0 else math.inf)
            if best is None or t < best[0]:
                best = (t, f.id)
        return best

    def advance(self, to: float) -> list[str]:
        """Move time to ``to`` (not past the next completion); return the flows that finished, removed."""
        dt = to - self.now
        if dt < -1e-12:
            raise ValueError(f"time runs forward: {to} < {self.now}")
        done = []
        for f in self.flows.values():
            moved = min(f.remaining, f.rate * max(dt, 0.0))
            f.remaining -= moved
            for link, factor in f.route:
                self.carried[link] = self.carried.get(link, 0.0) + moved * factor
            if f.remaining <= 1e-9 * max(1.0, moved):
                done.append(f.id)
        self.now = max(self.now, to)
        for fid in done:
            del self.flows[fid]
        if done:
            self._share()
        return done

    def utilization(self) -> dict[str, float]:
        """Each link's current load over its capacity."""
        load: dict[str, float] = {}
        for f in self.flows.values():
            for link, factor in f.route:
                load[link] = load.get(link, 0.0) + f.rate * factor
        return {link: v / self.capacity[link] for link, v in load.items()}

    def _share(self) -> None:
        """Progressive filling: raise all unfrozen rates together; freeze the flows of each link that fills."""
        left = dict(self.capacity)
        active = {fid: f for fid, f in self.flows.items()}
        for f in active.values():
            f.rate = 0.0
        while active:
            weight: dict[str, float] = {}
            for f in active.values():
                for link, factor in f.route:
                    weight[link] = weight.get(link, 0.0) + factor
            link, step = min(((l, left[l] / w) for l, w in weight.items()), key=lambda t: t[1])
            for f in active.values():
                f.rate += step
                for l, factor in f.route:
                    left[l] -= step * factor
            frozen = [fid for fid, f in active.items() if any(l == link or left[l] <= 1e-9 * self.capacity[l]
                                                              for l, _ in f.route)]
            for fid in frozen:
                del active[fid]
