"""Bandwidth sharing for the cluster simulator: transfers ("flows") cross links and share them max-min fairly.

A flow has a size in bytes and a route: the links it crosses, each with a factor (bytes on that link per byte
moved: 2 where a copy crosses one link twice). Rates follow progressive filling: every unfinished flow's rate rises
together until some link it crosses is full, then that link's flows are frozen, and so on; so a flow's rate is
set by its most contended link, and no link carries more than its capacity. Rates change only when a flow starts
or ends, so completion times are exact piecewise-linear solutions, not time steps.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

Route = tuple[tuple[str, float], ...]  # (link name, bytes on the link per byte moved)


def rounding(t: float) -> float:
    """How close to time ``t`` a completion counts as due at ``t`` (float error in rates and sizes)."""
    return 1e-12 * max(1.0, t)


@dataclass(slots=True)  # attribute access is most of the network's time
class Flow:
    id: str
    size: float
    remaining: float  # as of ``since``
    route: Route
    rate: float = 0.0
    since: float = 0.0
    bottleneck: str = ""  # a full link on which no flow is faster: what holds its rate
    version: int = 0  # completion-heap entries of older versions are stale
    done_at: float = 0.0  # completion time at the current rate: its heap entry is (done_at, version, id)
    factor: dict[str, float] = field(default_factory=dict)  # link -> bytes on it per byte moved (read only)


class FlowNetwork:
    """Links with capacities (bytes/s); flows added and finished as simulated time advances.

    Progress is settled lazily: a flow's bytes are brought up to date only when its rate changes or when asked,
    so timer events in between cost nothing here, however many flows are in flight.

    Rates are the exact max-min fair shares: every flow has a bottleneck, a full link on which no flow is
    faster. A change re-fills only the flows it can affect: a set S seeded with the new flow (or the flows held by
    the links an ending flow crossed) is filled progressively over what the other flows leave of each link, then
    grown by every outside flow whose bottleneck link's load changed or now carries a faster S flow, or that is
    faster than an S flow on that flow's new bottleneck, until none is: then every flow has a valid bottleneck
    and the allocation is the max-min one. In storage-bound clusters S stays about one node's reads, where filling
    everything cost O(flows x route x log links) per change.
    """

    def __init__(self, capacity: dict[str, float]):
        self.capacity = capacity
        self.now = 0.0
        self.flows: dict[str, Flow] = {}
        self._carried: dict[str, float] = {}  # bytes finished flows moved over each link
        self._on_link: dict[str, dict[str, Flow]] = {}  # link -> its flows
        self._load: dict[str, float] = {}  # link -> Σ rate x factor of its flows
        self._heap: list[tuple[float, int, str]] = []  # (completion time, version, flow id)
        self._held: dict[str, dict[str, Flow]] = {}  # link -> the flows it is the bottleneck of
        self.refilled = 0  # flows re-filled, over all changes (for tests and tuning)
        self._routes: dict[Route, tuple[str, dict[str, float]]] = {}  # checked routes: (tightest link, factors)

    @property
    def carried(self) -> dict[str, float]:
        """Bytes each link has carried so far (a flow's bytes are added to its links when it ends: settling every
        rate change on every link of the route cost more than the rest of a change)."""
        out = dict(self._carried)
        for f in self.flows.values():
            moved = f.size - self.remaining_total((f.id,))
            for link, factor in f.route:
                out[link] = out.get(link, 0.0) + moved * factor
        return out

    def remaining(self, flow_id: str) -> float:
        if flow_id not in self.flows:
            raise KeyError(f"flow {flow_id} is not in flight")
        return self.remaining_total((flow_id,))

    def remaining_total(self, flow_ids) -> float:
        """Bytes still to move, summed over those of ``flow_ids`` in flight (the others have arrived)."""
        flows, now = self.flows, self.now
        return sum(max(0.0, f.remaining - f.rate * (now - f.since)) for f in map(flows.get, flow_ids) if f is not None)

    def add(self, flow_id: str, size: float, route: Route) -> None:
        """Start moving ``size`` bytes along ``route`` at the current time (call ``advance`` first)."""
        if flow_id in self.flows:
            raise ValueError(f"flow {flow_id} already in flight")
        tightest, factor = self._routes.get(route) or self._check(flow_id, route)
        f = self.flows[flow_id] = Flow(flow_id, float(size), float(size), route, since=self.now, factor=factor)
        on_link, held = self._on_link, self._held
        for link, _ in route:
            on_link[link][flow_id] = f
        self._hold(f, tightest)
        # links of the route that hold flows other than this one (it is held by ``tightest`` for now)
        holding = [link for link, _ in route if len(held[link]) > (link == tightest)]
        if not holding:  # it is the only flow held on its route: it takes the room its tightest link leaves
            self._alone(f)
        elif not (len(holding) == 1 and self._uniform(holding[0], f)):
            self._refill({f.id: f})

    def _check(self, flow_id: str, route: Route) -> tuple[str, dict[str, float]]:
        """A new route's tightest link and factors, once its links are known to exist."""
        unknown = [link for link, _ in route if link not in self.capacity]
        if unknown or not route:
            raise ValueError(f"flow {flow_id}: unknown links {unknown}" if unknown else f"flow {flow_id}: no route")
        for link, _ in route:
            self._on_link.setdefault(link, {})
            self._held.setdefault(link, {})
            self._load.setdefault(link, 0.0)
        info = self._routes[route] = (min(route, key=lambda lf: self.capacity[lf[0]] / lf[1])[0], dict(route))
        return info

    def _alone(self, f: Flow) -> None:
        """Rates for a new flow no link of whose route holds another flow: its fill; the others keep theirs
        (what ``_refill`` finds, without its search) unless a faster flow shares its new bottleneck."""
        ((rate, link),) = self._fill({f.id: f}).values()
        if any(g.rate > rate * (1 + 1e-9) for g in self._on_link[link].values() if g is not f):
            self._refill({f.id: f})
            return
        self.refilled += 1
        self._set_rate(f, rate)
        self._hold(f, link)

    def next_completion(self) -> tuple[float, str] | None:
        """(time, flow id) of the flow that finishes first at the current rates, or None when idle."""
        heap, flows = self._heap, self.flows
        if len(heap) > 4 * len(flows) + 256:  # mostly stale entries (every rate change adds one): drop them at
            heap[:] = [(f.done_at, f.version, f.id) for f in flows.values()]  # once, not one O(log n) pop each
            heapq.heapify(heap)
        while heap:
            t, version, fid = heap[0]
            f = flows.get(fid)
            if f is not None and f.version == version:
                return t, fid
            heapq.heappop(heap)
        return None

    def advance(self, to: float) -> list[str]:
        """Move time to ``to`` (not past the next completion); return the flows that finished, removed."""
        if to < self.now - 1e-12:
            raise ValueError(f"time runs forward: {to} < {self.now}")
        self.now = max(self.now, to)
        eps = rounding(self.now)
        done: list[Flow] = []
        flows, due = self.flows, self.now + eps
        while (nxt := self.next_completion()) is not None and nxt[0] <= due:
            done.append(flows[heapq.heappop(self._heap)[2]])
        carried, load, on_link, held = self._carried, self._load, self._on_link, self._held
        for f in done:  # due now: whatever rounding left of them arrives too
            fid, size, rate = f.id, f.size, f.rate
            for link, factor in f.route:
                carried[link] = carried.get(link, 0.0) + size * factor
                load[link] -= rate * factor
                del on_link[link][fid]
            del held[f.bottleneck][fid]
            del flows[fid]
        if done:  # the links they crossed have room now: the flows those links hold may speed up
            links = {link for f in done for link, _ in f.route if held.get(link)}
            if links and not (len(links) == 1 and self._uniform(links.pop())):
                self._refill({g.id: g for f in done for link, _ in f.route for g in self._held.get(link, {}).values()})
        return [f.id for f in done]

    def utilization(self) -> dict[str, float]:
        """Each link's current load over its capacity."""
        load: dict[str, float] = {}
        for f in self.flows.values():
            for link, factor in f.route:
                load[link] = load.get(link, 0.0) + f.rate * factor
        return {link: v / self.capacity[link] for link, v in load.items()}

    def _set_rate(self, f: Flow, rate: float) -> None:
        """Settle the flow's bytes at its old rate up to now, then move it (and its links' load) to ``rate``."""
        now = self.now
        moved = min(f.remaining, f.rate * (now - f.since))
        if moved > 0:
            f.remaining -= moved
        f.since = now
        load, change = self._load, rate - f.rate
        for link, factor in f.route:
            load[link] += change * factor  # every route's links have entries (``_check``)
        f.rate, f.version, f.done_at = rate, f.version + 1, now + f.remaining / rate
        heapq.heappush(self._heap, (f.done_at, f.version, f.id))

    def _hold(self, f: Flow, link: str) -> None:
        if f.bottleneck:
            del self._held[f.bottleneck][f.id]
        f.bottleneck = link
        self._held.setdefault(link, {})[f.id] = f

    def _uniform(self, link: str, new: Flow | None = None) -> bool:
        """The common change, in one pass: the flows ``link`` holds (and ``new``) take one new common rate that
        fills the link again, every other flow keeping its rate. That is the max-min allocation when no other flow
        on the link is faster, no other link the group crosses overflows, and none that holds flows loses load
        (its flows could then speed up): else nothing is changed and False says to re-fill. (A storage system
        shared by every node's reads holds them all: re-filling them costs O(flows x route) per change.)"""
        holds = self._held.get(link)
        group = list(holds.values()) if holds else []
        if new is not None and new.bottleneck != link:
            group.append(new)
        cap = self.capacity[link]
        # sum() over lists, not generators: the same additions in the same order, less overhead
        weight = sum([f.factor[link] for f in group])
        others = self._load.get(link, 0.0) - sum([f.rate * f.factor[link] for f in group])
        rate = (cap - others) / weight if weight > 0 else 0.0
        if rate <= 0:
            return False
        on_link = self._on_link[link]
        if len(on_link) > len(group):  # (a storage client's link carries only the reads it holds)
            # the group is the flows ``link`` holds (bottleneck == link) and ``new``
            faster = rate * (1 + 1e-9)
            for g in on_link.values():
                if g.rate > faster and g.bottleneck != link and g is not new:
                    return False
        if not self._others_fit(group, link, rate):
            return False
        self.refilled += len(group)
        for f in group:
            self._set_rate(f, rate)
            if f.bottleneck != link:
                self._hold(f, link)
        return True

    def _others_fit(self, group: list[Flow], link: str, rate: float) -> bool:
        """Whether moving ``group`` to ``rate`` overflows no other link it crosses and takes load off none that
        holds flows (``_uniform``'s conditions)."""
        delta: dict[str, float] = {}
        get = delta.get
        for f in group:
            change = rate - f.rate
            for other, factor in f.route:
                if other != link:
                    delta[other] = get(other, 0.0) + change * factor
        load, held, caps = self._load, self._held, self.capacity
        for other, d in delta.items():
            c = caps[other]
            if (d > 0 and load[other] + d > c * (1 + 1e-9)) or (d < -1e-9 * c and held[other]):
                return False
        return True

    def _refill(self, seed: dict[str, Flow]) -> None:
        """Max-min rates again after a change, re-filling the seed flows and whatever they turn out to affect."""
        group = dict(seed)
        while group:
            rates = self._fill(group)
            grow: dict[str, Flow] = {}
            changed: dict[str, float] = {}
            fastest: dict[str, float] = {}
            for fid, (rate, _) in rates.items():
                for link, factor in group[fid].route:
                    changed[link] = changed.get(link, 0.0) + (rate - group[fid].rate) * factor
                    fastest[link] = max(fastest.get(link, 0.0), rate)
            for link, delta in changed.items():  # an outside flow held by a link whose load moved, or held where
                moved = abs(delta) > 1e-9 * self.capacity[link]  # one of ours is now faster than it
                grow.update(
                    (g.id, g)
                    for g in self._held.get(link, {}).values()
                    if g.id not in group and (moved or fastest[link] > g.rate * (1 + 1e-9))
                )
            for fid, (rate, link) in rates.items():  # an outside flow faster than ours where ours is held
                grow.update(
                    (g.id, g) for g in self._on_link[link].values() if g.id not in group and g.rate > rate * (1 + 1e-9)
                )
            if not grow:
                self.refilled += len(group)
                for fid, (rate, link) in rates.items():
                    self._set_rate(group[fid], rate)
                    self._hold(group[fid], link)
                return
            group.update(grow)

    def _fill(self, group: dict[str, Flow]) -> dict[str, tuple[float, str]]:
        """Progressive filling of ``group``'s flows over what the other flows' current rates leave of each link:
        all unfrozen flows share one rising rate; a link fills when its frozen load plus that rate times its
        unfrozen weight reaches its capacity, which freezes its flows at the rate. A heap of fill levels, updated
        only for the links of newly frozen flows: O(flows x route x log links). Returns each flow's rate and the
        link that froze it (its bottleneck)."""
        if len(group) == 1:  # the common case (a read starting where no other flow is held): the tightest link
            (f,) = group.values()
            if len(f.factor) == len(f.route):  # each link once: the loop below gives exactly this
                cap, load = self.capacity, self._load
                level, link = min(
                    (max(cap[link] - load.get(link, 0.0) + f.rate * factor, 0.0) / factor, link)
                    for link, factor in f.route
                )
                return {f.id: (max(level, 1e-300), link)}
        users: dict[str, list[Flow]] = {}
        weight: dict[str, float] = {}
        room: dict[str, float] = {}
        for f in group.values():
            for link, factor in f.route:
                users.setdefault(link, []).append(f)
                weight[link] = weight.get(link, 0.0) + factor
                if link not in room:
                    room[link] = self.capacity[link] - self._load.get(link, 0.0)
                room[link] += f.rate * factor
        heap = [(max(room[link], 0.0) / w, link) for link, w in weight.items()]  # float slop: room >= 0
        heapq.heapify(heap)
        rate: dict[str, tuple[float, str]] = {}
        while heap:
            level, link = heapq.heappop(heap)
            if weight[link] <= 1e-12:
                continue
            current = max(room[link], 0.0) / weight[link]
            if current > level * (1 + 1e-12) + 1e-300:  # a stale entry: this link fills later now
                heapq.heappush(heap, (current, link))
                continue
            level = max(level, 1e-300)
            for f in users[link]:
                if f.id in rate:  # frozen already (through another link)
                    continue
                rate[f.id] = (level, link)
                for other, factor in f.route:
                    room[other] -= level * factor
                    weight[other] -= factor
                    if weight[other] > 1e-12:
                        heapq.heappush(heap, (max(room[other], 0.0) / weight[other], other))
        return rate
