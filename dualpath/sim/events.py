"""The simulator's clock: timed callbacks and transfers over a ``FlowNetwork``, in one event order.

Callbacks run in time order (ties in the order they were scheduled); a transfer's callback runs when its last
byte arrives. Callbacks may schedule more work; nothing runs in the past.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

from dualpath.sim.network import FlowNetwork, Route, rounding


class EventLoop:
    def __init__(self, network: FlowNetwork):
        self.net = network
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._on_done: dict[str, Callable[[], None]] = {}

    @property
    def now(self) -> float:
        return self.net.now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        if t < self.now - 1e-12:
            raise ValueError(f"cannot schedule at {t} before now ({self.now})")
        heapq.heappush(self._timers, (t, next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def transfer(self, flow_id: str, size: float, route: Route, on_done: Callable[[], None]) -> None:
        """Move ``size`` bytes along ``route`` from now; ``on_done`` runs when they have arrived."""
        if size <= 0:
            self.after(0.0, on_done)
            return
        self.net.add(flow_id, size, route)
        self._on_done[flow_id] = on_done

    @property
    def idle(self) -> bool:
        """Nothing left to run: no timer and no transfer in flight."""
        return not self._timers and self.net.next_completion() is None

    def run(self, until: float = float("inf")) -> float:
        """Process events until none are left (or time ``until``); returns the time reached."""
        timers, net, inf, pop = self._timers, self.net, float("inf"), heapq.heappop
        while True:
            timer = timers[0][0] if timers else inf
            flow = net.next_completion()
            t = min(timer, flow[0] if flow else inf)
            if t == inf or t > until:
                if until != inf:  # what finishes within rounding of ``until`` is delivered now
                    for fid in net.advance(until):
                        self._on_done.pop(fid)()
                return self.now
            t = max(net.now, t)
            if flow is None or flow[0] > t + rounding(t):  # no flow is due: only the clock moves
                net.now = t
            else:
                for fid in net.advance(t):
                    self._on_done.pop(fid)()
            horizon = net.now + 1e-12
            while timers and timers[0][0] <= horizon:
                pop(timers)[2]()
