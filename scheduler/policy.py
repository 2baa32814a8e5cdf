"""Scheduling policy as pure code: plain data in, decisions out. No sockets, no torch, no processes.

A request first gets a decode engine (admission: its prompt and generation must fit in that engine's free device
memory), then a prefill engine, then a read path. Engine groups pull work: a policy sees every engine of the role
(``EngineState`` copies it may update as it assigns) and the ids of the pulling group's engines, and returns
(request, engine) pairs naming only pulling engines.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from dualpath.messages import Mode, ReadPath


@dataclass
class EngineState:
    """One engine's load as the policy sees it (a copy: policies update it as they assign)."""

    engine_id: str
    node_id: str
    group_id: str
    seq: int = 0  # unfinished requests
    tok: int = 0  # their tokens
    free_tokens: int = 0  # KV tokens that fit in free device memory (decode engines)


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    num_tokens: int  # prompt tokens
    num_hit_tokens: int  # leading prompt tokens stored
    reserve_tokens: int  # device memory a decode engine needs: prompt + generation budget

    @property
    def num_miss_tokens(self) -> int:
        return self.num_tokens - self.num_hit_tokens


@dataclass(frozen=True)
class PathChoice:
    path: ReadPath
    pe_blocks: int = -1  # split: leading hit blocks read on the PE side; -1 = the whole read on ``path``


class Policy(ABC):
    """Decides placements. Called by the scheduler service when an engine group pulls work."""

    name = "policy"

    @abstractmethod
    def assign_decode(self, queue: Sequence[QueuedRequest], engines: list[EngineState],
                      pulling: set[str]) -> list[tuple[str, str]]:
        """(request, decode engine) pairs for a FIFO prefix of ``queue``; every pair must fit the engine's free
        memory, and name a pulling engine."""

    @abstractmethod
    def assign_prefill(self, queue: Sequence[QueuedRequest], engines: list[EngineState],
                       pulling: set[str]) -> list[tuple[str, str]]:
        """(request, prefill engine) pairs for a FIFO prefix of ``queue``, naming pulling engines."""

    def choose_path(self, request: QueuedRequest, pe_read_q: int, de_read_q: int, mode: Mode,
                    block_size: int) -> PathChoice:
        """Where the request's hit blocks are read. ``*_read_q``: the two nodes' storage read queues, in tokens."""
        if mode in (Mode.PE, Mode.BASIC):
            return PathChoice(ReadPath.PE)
        if mode is Mode.DE:
            return PathChoice(ReadPath.DE)
        if mode is Mode.SPLIT:
            return split_path(request, pe_read_q, de_read_q, block_size)
        return PathChoice(ReadPath.PE if pe_read_q <= de_read_q else ReadPath.DE)


def split_path(request: QueuedRequest, pe_read_q: int, de_read_q: int, block_size: int) -> PathChoice:
    """Divide the hit blocks so both sides' queues (with their share added) drain at the same time.

    With equal read bandwidth per node, the PE side takes ``(hit + de_q - pe_q) / 2`` tokens, clamped to the hit.
    """
    hit_blocks = request.num_hit_tokens // block_size
    if hit_blocks == 0:
        return PathChoice(ReadPath.PE)
    pe_tokens = (request.num_hit_tokens + de_read_q - pe_read_q) / 2
    pe_blocks = max(0, min(hit_blocks, round(pe_tokens / block_size)))
    if pe_blocks == hit_blocks:
        return PathChoice(ReadPath.PE)
    if pe_blocks == 0:
        return PathChoice(ReadPath.DE)
    return PathChoice(ReadPath.DE, pe_blocks)


def _take(engine: EngineState, request: QueuedRequest, reserve: bool) -> None:
    engine.seq += 1
    engine.tok += request.num_tokens
    if reserve:
        engine.free_tokens -= request.reserve_tokens


def _fifo(queue, engines, pulling, pick, reserve: bool) -> list[tuple[str, str]]:
    """Walk the queue in order; ``pick(request, engines)`` chooses among all engines (None: nothing fits). Stop at
    the first request whose choice is not a pulling engine: it waits for that engine's own pull."""
    out = []
    for r in queue:
        e = pick(r, engines)
        if e is None or e.engine_id not in pulling:
            break
        _take(e, r, reserve)
        out.append((r.request_id, e.engine_id))
    return out


class LeastLoadedPolicy(Policy):
    """The simple policy: least tokens for both roles (among decode engines with room), shorter read queue for
    the path."""

    name = "least-loaded"

    def assign_decode(self, queue, engines, pulling):
        def pick(r, es):
            fits = [e for e in es if e.free_tokens >= r.reserve_tokens]
            return min(fits, key=lambda e: (e.tok, e.engine_id)) if fits else None

        return _fifo(queue, engines, pulling, pick, reserve=True)

    def assign_prefill(self, queue, engines, pulling):
        return _fifo(queue, engines, pulling,
                     lambda r, es: min(es, key=lambda e: (e.tok, e.engine_id)) if es else None, reserve=False)


class RoundRobinPolicy(Policy):
    """Baseline: engines in turn (skipping decode engines without room); paths alternate."""

    name = "round-robin"

    def __init__(self):
        self._next = {"decode": 0, "prefill": 0, "path": 0}

    def _peek(self, kind: str, engines: list[EngineState], ok) -> EngineState | None:
        """The next engine in turn that ``ok`` accepts (the turn does not move)."""
        order = sorted(engines, key=lambda e: e.engine_id)
        for i in range(len(order)):
            e = order[(self._next[kind] + i) % len(order)]
            if ok(e):
                return e
        return None

    def _advance(self, kind: str, engines: list[EngineState], chosen: EngineState) -> None:
        order = sorted(e.engine_id for e in engines)
        self._next[kind] = (order.index(chosen.engine_id) + 1) % len(order)

    def _pick(self, kind: str, pulling: set[str], ok):
        def pick(r, es):
            e = self._peek(kind, es, lambda e: ok(r, e))
            if e is not None and e.engine_id in pulling:
                self._advance(kind, es, e)
            return e

        return pick

    def assign_decode(self, queue, engines, pulling):
        return _fifo(queue, engines, pulling,
                     self._pick("decode", pulling, lambda r, e: e.free_tokens >= r.reserve_tokens), reserve=True)

    def assign_prefill(self, queue, engines, pulling):
        return _fifo(queue, engines, pulling, self._pick("prefill", pulling, lambda r, e: True), reserve=False)

    def choose_path(self, request, pe_read_q, de_read_q, mode, block_size):
        if mode is not Mode.DUALPATH:
            return super().choose_path(request, pe_read_q, de_read_q, mode, block_size)
        self._next["path"] ^= 1
        return PathChoice(ReadPath.PE if self._next["path"] else ReadPath.DE)


class RandomPolicy(Policy):
    """Baseline: uniformly random engines and paths (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self._drawn: dict[str, str] = {}

    def _pick(self, ok):
        """Draw once per request and keep the draw until its engine pulls (so waiting does not re-roll)."""
        drawn: dict[str, str] = self._drawn

        def pick(r, es):
            fits = sorted((e for e in es if ok(r, e)), key=lambda e: e.engine_id)
            if not fits:
                return None
            eid = drawn.get(r.request_id)
            if eid not in {e.engine_id for e in fits}:
                eid = drawn[r.request_id] = self.rng.choice(fits).engine_id
            return next(e for e in fits if e.engine_id == eid)

        return pick

    def assign_decode(self, queue, engines, pulling):
        out = _fifo(queue, engines, pulling, self._pick(lambda r, e: e.free_tokens >= r.reserve_tokens), True)
        for rid, _ in out:
            self._drawn.pop(rid, None)
        return out

    def assign_prefill(self, queue, engines, pulling):
        out = _fifo(queue, engines, pulling, self._pick(lambda r, e: True), False)
        for rid, _ in out:
            self._drawn.pop(rid, None)
        return out

    def choose_path(self, request, pe_read_q, de_read_q, mode, block_size):
        if mode is not Mode.DUALPATH:
            return super().choose_path(request, pe_read_q, de_read_q, mode, block_size)
        return PathChoice(self.rng.choice([ReadPath.PE, ReadPath.DE]))


POLICIES = {"least-loaded": LeastLoadedPolicy, "round-robin": RoundRobinPolicy, "random": RandomPolicy}


def make_policy(name: str, **kwargs) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
