"""The scheduler's record of agent sessions: where each one's last turn ran, what its next turn will repeat, when
that turn is expected, and the prefetch ordered for it.

A turn ends (its request finished) and, when its submitter says the reply ended in tool calls (``TurnEnd``) or the
request hinted the gap (``next_turn_in_s``), the session waits for its next turn. Its gaps are measured (submit of a
turn minus the end of the one before) and kept per session in a ``GapEstimator`` that leans on every session's gaps
until its own are many (``GapPrior``). From them, and the time the session's KV takes to read, ``prefetch_at`` says
when its prefetch goes out: early enough to be read before the turn comes. The scheduler core asks ``due`` on its
pulls and orders the reads (``SchedulerCore._order_prefetches``).

Plain data and a clock: no engines, no processes, tested on its own. Bounded: at most ``max_sessions`` (the least
recently seen go first) and none idle past its TTL or ``idle_s``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from dualpath.core.sessions import SessionHint
from dualpath.scheduler.policy import Affinity
from dualpath.scheduler.sessions_policy import GapEstimator, GapPrior, hold_time, prefetch_at


@dataclass
class Session:
    key: str
    salt: str
    adapter: str
    gaps: GapEstimator
    # what the next turn starts with (the last prompt, then its reply once told): the packed hashes of its whole
    # blocks, and the packed tokens after them (less than a block: the chain goes on from there)
    hashes: bytes = b""
    tail: bytes = b""
    request_id: str = ""  # the turn in flight, or the last one
    pe: str = ""  # where the last turn ran
    de: str = ""
    ended_at: float | None = None  # the last turn's end; None while a turn runs
    waiting: bool = False  # ended, and its next turn is expected (a tool runs, or a hint says when)
    hint_s: float | None = None  # the client's estimate of the coming gap
    ttl_s: float = 0.0
    seen: float = 0.0
    due: float | None = None  # when its prefetch is to go out
    ordered: tuple[str, int] | None = None  # (engine, blocks) of the prefetch ordered for the coming turn
    ordered_at: float = 0.0


@dataclass
class SessionBook:
    prior: GapPrior = field(default_factory=GapPrior)
    max_sessions: int = 20_000  # (each holds 16 bytes per block of its context: 16 KiB at 64K tokens)
    idle_s: float = 3600.0  # a session not seen this long is forgotten (a later turn starts a new one)
    sessions: OrderedDict[str, Session] = field(default_factory=OrderedDict)  # least recently seen first
    by_request: dict[str, str] = field(default_factory=dict)  # a turn's request id -> its session (bounded too)
    _due: list[tuple[float, str]] = field(default_factory=list)  # heap; stale entries skipped
    gone: list[Session] = field(default_factory=list)  # forgotten since the last ``expire`` (their pins go)

    # --- turns ----------------------------------------------------------------------------------------------
    def begin_turn(
        self,
        key: str,
        hint: SessionHint,
        request_id: str,
        tail: bytes,
        hashes: bytes,
        salt: str,
        adapter: str,
        now: float,
    ) -> Affinity:
        """A turn of session ``key`` arrives: its gap is measured, and it may prefer the last turn's engines."""
        s = self.sessions.get(key)
        if s is None:
            s = self.sessions[key] = Session(key, salt, adapter, GapEstimator(self.prior))
            self._bound(now)
        elif s.ended_at is not None and s.waiting:
            s.gaps.observe(now - s.ended_at)
        engine, blocks = s.ordered or ("", 0)
        affinity = Affinity(s.pe, s.de, prefetch_engine=engine, prefetch_blocks=blocks)
        self.by_request.pop(s.request_id, None)
        s.request_id, s.tail, s.hashes = request_id, tail, hashes
        s.ended_at, s.waiting, s.due, s.ordered = None, False, None, None
        s.hint_s, s.ttl_s, s.seen = hint.next_turn_in_s, hint.ttl_s or 0.0, now
        self.by_request[request_id] = key
        self.sessions.move_to_end(key)
        return affinity

    def placed(self, request_id: str, pe: str = "", de: str = "") -> None:
        s = self.of_request(request_id)
        if s is not None:
            s.pe, s.de = pe or s.pe, de or s.de

    def finished(self, request_id: str, now: float) -> Session | None:
        """The turn's request finished: the session waits if a hint says when its next turn comes."""
        s = self.of_request(request_id)
        if s is None:
            return None
        s.ended_at = s.ended_at if s.ended_at is not None else now  # (its submitter may have said so first)
        s.seen = now
        s.waiting = s.waiting or s.hint_s is not None
        return s

    def turn_end(
        self, request_id: str, tail: bytes, hashes: bytes, tool_wait: bool, hint_s: float | None, now: float
    ) -> Session | None:
        """Its submitter says what the next turn repeats (block ``hashes``, and the ``tail`` tokens after them)
        and whether a tool now runs. ``None``: an unknown or forgotten turn (nothing to do)."""
        s = self.of_request(request_id)
        if s is None:
            return None
        s.tail, s.hashes = tail, hashes
        if hint_s is not None:
            s.hint_s = hint_s
        if s.ended_at is None:  # the reply streamed to its end before the engine's report came
            s.ended_at = now
        s.waiting = tool_wait or s.hint_s is not None
        s.seen = now
        return s

    def schedule(self, s: Session, load_s: float) -> None:
        """Plan the prefetch of a waiting session whose KV takes ``load_s`` to read."""
        if not s.waiting or s.ended_at is None or not s.hashes:
            return
        s.due = prefetch_at(s.ended_at, s.gaps, load_s, s.hint_s)
        heapq.heappush(self._due, (s.due, s.key))

    def has_due(self) -> bool:
        return bool(self._due)

    def due(self, now: float) -> list[Session]:
        """Waiting sessions whose prefetch is to go out now (each once)."""
        out = []
        while self._due and self._due[0][0] <= now:
            when, key = heapq.heappop(self._due)
            s = self.sessions.get(key)
            if s is not None and s.due == when and s.waiting and s.ordered is None:
                s.due = None
                out.append(s)
        return out

    def ordered(self, s: Session, engine: str, blocks: int, now: float) -> float:
        """The prefetch went to ``engine``; how long it should keep the blocks."""
        s.ordered, s.ordered_at = (engine, blocks), now
        return hold_time(s.gaps, s.hint_s)

    def engine_gone(self, eid: str) -> None:
        for s in self.sessions.values():
            if s.ordered and s.ordered[0] == eid:
                s.ordered = None
            if s.pe == eid:
                s.pe = ""
            if s.de == eid:
                s.de = ""

    # --- bounds ---------------------------------------------------------------------------------------------
    def of_request(self, request_id: str) -> Session | None:
        key = self.by_request.get(request_id)
        return self.sessions.get(key) if key else None

    def expire(self, now: float) -> list[Session]:
        """Forget sessions idle past their TTL and ``idle_s``; them, and those the bound forgot since."""
        for s in [s for s in self.sessions.values() if self._idle(s, now)]:
            self._forget(s.key)
        gone, self.gone = self.gone, []
        return gone

    def _idle(self, s: Session, now: float) -> bool:
        return now - s.seen > max(self.idle_s, s.ttl_s)

    def _bound(self, now: float) -> None:
        while len(self.sessions) > self.max_sessions:
            self._forget(next(iter(self.sessions)))

    def _forget(self, key: str) -> None:
        s = self.sessions.pop(key)
        self.by_request.pop(s.request_id, None)
        self.gone.append(s)

    def stats(self) -> dict:
        return {
            "sessions": len(self.sessions),
            "sessions_waiting": sum(s.waiting for s in self.sessions.values()),
            "gap_prior_median_s": self.prior.median(),
        }
