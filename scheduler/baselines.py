"""Baseline policies behind the same interface: least-loaded, round-robin and random."""

from __future__ import annotations

import random

from dualpath.core.messages import ReadPath
from dualpath.scheduler.policy import EngineState, PathChoice, Policy, take_decode


def fifo(queue, engines, pulling, pick, take) -> list[tuple[str, EngineState]]:
    """Walk ``queue`` in order; ``pick(request, engines)`` chooses among all engines (None: nothing fits). Stops at
    the first request whose choice is not a pulling engine: it waits for that engine's own pull."""
    out = []
    for r in queue:
        e = pick(r, engines)
        if e is None or e.engine_id not in pulling:
            break
        take(e, r)
        out.append((r, e))
    return out


def _fits(r, engines):
    return [e for e in engines if e.free_tokens >= r.reserve_tokens]


class LeastLoadedPolicy(Policy):
    """Least tokens for both roles (decode: among engines with room); the shorter read queue for the path."""

    name = "least-loaded"

    def assign_decode(self, queue, engines, pulling):
        def pick(r, es):
            fits = _fits(r, es)
            return min(fits, key=lambda e: (e.tok, e.engine_id)) if fits else None

        return [(r.request_id, e.engine_id) for r, e in fifo(queue, engines, pulling, pick, take_decode)]

    def assign_prefill(self, queue, engines, pulling, nodes, pe_nodes, block_size):
        out = []

        def take(e, r):
            out.append(self.place_prefill(r, e, nodes, pe_nodes[e.engine_id], block_size))

        fifo(queue, engines, pulling, lambda r, es: min(es, key=lambda e: (e.tok, e.engine_id)) if es else None, take)
        return out


class RoundRobinPolicy(Policy):
    """Engines and decode groups in turn (skipping decode engines without room); paths alternate."""

    name = "round-robin"

    def __init__(self):
        self._next: dict[str, int] = {}

    def _in_turn(self, kind: str, ids: list[str], ok) -> str | None:
        order = sorted(ids)
        start = self._next.get(kind, 0)
        for i in range(len(order)):
            candidate = order[(start + i) % len(order)]
            if ok(candidate):
                return candidate
        return None

    def _advance(self, kind: str, ids: list[str], chosen: str) -> None:
        order = sorted(ids)
        self._next[kind] = (order.index(chosen) + 1) % len(order)

    def route_decode_group(self, r, groups):
        g = self._in_turn("group", list(groups), lambda g: True)
        if g is not None:
            self._advance("group", list(groups), g)
        return g

    def _picker(self, kind: str, pulling: set[str], ok):
        def pick(r, es):
            by_id = {e.engine_id: e for e in es}
            eid = self._in_turn(kind, list(by_id), lambda i: ok(r, by_id[i]))
            if eid is not None and eid in pulling:
                self._advance(kind, list(by_id), eid)
            return by_id.get(eid)

        return pick

    def assign_decode(self, queue, engines, pulling):
        pick = self._picker("decode", pulling, lambda r, e: e.free_tokens >= r.reserve_tokens)
        return [(r.request_id, e.engine_id) for r, e in fifo(queue, engines, pulling, pick, take_decode)]

    def assign_prefill(self, queue, engines, pulling, nodes, pe_nodes, block_size):
        out = []
        fifo(
            queue,
            engines,
            pulling,
            self._picker("prefill", pulling, lambda r, e: True),
            lambda e, r: out.append(self.place_prefill(r, e, nodes, pe_nodes[e.engine_id], block_size)),
        )
        return out

    def dualpath_path(self, r, pe_node, de_node):
        self._next["path"] = self._next.get("path", 0) ^ 1
        return PathChoice(ReadPath.PE if self._next["path"] else ReadPath.DE)


class RandomPolicy(Policy):
    """Uniformly random engines, decode groups and paths (seeded). A request's draw is kept until its engine
    pulls, so waiting does not re-roll it."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._drawn: dict[tuple[str, str], str] = {}

    def route_decode_group(self, r, groups):
        return self.rng.choice(sorted(groups)) if groups else None

    def _picker(self, kind: str, ok):
        def pick(r, es):
            fits = sorted((e for e in es if ok(r, e)), key=lambda e: e.engine_id)
            if not fits:
                return None
            key = (kind, r.request_id)
            eid = self._drawn.get(key)
            if eid not in {e.engine_id for e in fits}:
                eid = self._drawn[key] = self.rng.choice(fits).engine_id
            return next(e for e in fits if e.engine_id == eid)

        return pick

    def assign_decode(self, queue, engines, pulling):
        out = fifo(
            queue, engines, pulling, self._picker("decode", lambda r, e: e.free_tokens >= r.reserve_tokens), take_decode
        )
        for r, _ in out:
            self._drawn.pop(("decode", r.request_id), None)
        return [(r.request_id, e.engine_id) for r, e in out]

    def assign_prefill(self, queue, engines, pulling, nodes, pe_nodes, block_size):
        out = []
        fifo(
            queue,
            engines,
            pulling,
            self._picker("prefill", lambda r, e: True),
            lambda e, r: out.append(self.place_prefill(r, e, nodes, pe_nodes[e.engine_id], block_size)),
        )
        for d in out:
            self._drawn.pop(("prefill", d.request_id), None)
        return out

    def dualpath_path(self, r, pe_node, de_node):
        return PathChoice(self.rng.choice([ReadPath.PE, ReadPath.DE]))
