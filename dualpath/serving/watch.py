"""What an operator watches while a frontend serves: one access-log line per HTTP request (``AccessLog``; off with
``--disable-log-requests``, vLLM's flag) and, every ``STATS_INTERVAL_S`` while busy, a line of throughput, requests,
KV cache use and cache hits by read path (``StatsLine``, as vLLM's "Avg prompt throughput" line; off with
``--disable-log-stats``). Both go through ``logging``: ``dualpath.access`` and ``dualpath.stats``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from dualpath.core.errors import DualPathError
from dualpath.core.metrics import sample_values

access_log = logging.getLogger("dualpath.access")
stats_log = logging.getLogger("dualpath.stats")
STATS_INTERVAL_S = 10.0
QUIET_PATHS = frozenset({"/metrics", "/health", "/live", "/ping", "/load", "/version"})  # probes: logged at DEBUG
NO_HIT_PATHS = frozenset({"", "none"})  # read paths of requests that loaded nothing stored

# The access record of the HTTP request being served. A ContextVar is per-request state, not shared state: the
# middleware sets it before the app runs, and the tasks the request starts (a stream's body, its choices' drains)
# copy the context, so they all reach the same record and no other request's.
_current: ContextVar[Access | None] = ContextVar("dualpath_access", default=None)


@dataclass
class Access:
    """What one HTTP request generated, filled in as its choices finish (``note``)."""

    started: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    read_path: str = ""
    first_token_at: float | None = None  # perf_counter of the first token of any choice
    choices: int = 0

    def note(self, prompt_tokens: int, outcome, first: float | None) -> None:
        """A choice's end: its ``Outcome``; ``prompt_tokens`` is 0 for a prompt's later choices (it ran once)."""
        self.choices += 1
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += outcome.completion_tokens
        if prompt_tokens:
            self.cached_tokens += outcome.cached_tokens
            self.read_path = self.read_path or outcome.path
        if first is not None:
            self.first_token_at = first if self.first_token_at is None else min(self.first_token_at, first)


def current_access() -> Access | None:
    """The record of the request being served (None outside one, or with the access log off)."""
    return _current.get()


class AccessLog:
    """ASGI middleware: one ``dualpath.access`` line per HTTP request once its response has ended (a stream's last
    chunk sent): method, path, status, latency and, for generations, TTFT, prompt/generated/cached tokens and the
    read path. Inside ``RequestIds``, so it names the request's id. Pure ASGI: streams pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record, status = Access(), [500]  # 500 unless a response starts (an exception escapes the app)
        token = _current.set(record)

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _current.reset(token)
            level = logging.DEBUG if scope.get("path") in QUIET_PATHS else logging.INFO
            if access_log.isEnabledFor(level):
                access_log.log(level, "%s", access_line(scope, status[0], record, time.perf_counter()))


def access_line(scope, status: int, a: Access, now: float) -> str:
    client = scope.get("client")
    parts = [f'"{scope.get("method", "")} {scope.get("path", "")}" {status} latency={now - a.started:.3f}s']
    if a.choices:
        if a.first_token_at is not None:
            parts.append(f"ttft={a.first_token_at - a.started:.3f}s")
        parts.append(
            f"prompt_tokens={a.prompt_tokens} generated_tokens={a.generated_tokens} "
            f"cached_tokens={a.cached_tokens} read_path={a.read_path or 'none'}"
        )
    if client:
        parts.append(f"client={client[0]}:{client[1]}")
    rid = scope.get("state", {}).get("request_id")
    if rid:
        parts.append(f"request_id={rid}")
    return " ".join(parts)


# --- the periodic stats line ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Counts:
    """A frontend's cumulative token counts at one moment (its Prometheus counters) and its requests in flight."""

    prompt: float = 0.0
    generated: float = 0.0
    cached: tuple[tuple[str, float], ...] = ()  # prompt tokens loaded from storage, by read path
    in_flight: int = 0


def frontend_counts(front) -> Counts:
    """``front``'s (a ``Frontend``) counts, read back from its own counters (one source of truth with /metrics)."""
    m = front.metrics
    cached = {dict(k).get("path", ""): v for k, v in sample_values(m.cached).items()}
    return Counts(
        sum(sample_values(m.prompt).values()),
        sum(sample_values(m.completion).values()),
        tuple(sorted(cached.items())),
        front.in_flight,
    )


def scheduler_stats(client) -> dict | None:
    """The scheduler's stats (a blocking RPC); None when it does not answer."""
    try:
        return client.stats()
    except DualPathError as e:
        stats_log.debug("the scheduler did not answer for stats: %s", e)
        return None


class StatsLine:
    """The line for each interval: ``tick()`` gives it for the time since the last tick, or None when the interval
    was idle (no token counted, no request in flight). ``counts`` and ``stats`` are read at each tick (``stats`` only
    when busy: it is an RPC); ``clock`` is injectable for tests."""

    def __init__(
        self,
        counts: Callable[[], Counts],
        stats: Callable[[], dict | None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.counts, self.stats, self.clock = counts, stats, clock
        self._at, self._last = clock(), counts()

    def tick(self) -> str | None:
        now, counts = self.clock(), self.counts()
        then, last, self._at, self._last = self._at, self._last, now, counts
        prompt, generated = counts.prompt - last.prompt, counts.generated - last.generated
        if not prompt and not generated and not counts.in_flight:
            return None
        seconds = max(now - then, 1e-9)
        parts = [
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s",
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s",
        ]
        parts += _cluster_parts(self.stats())
        if prompt:
            parts.append(_hit_rate(dict(counts.cached), dict(last.cached), prompt))
        return ", ".join(parts)


def stats_line(front, clock: Callable[[], float] = time.monotonic) -> StatsLine:
    """The stats line of a ``Frontend``: its counters, its scheduler's stats."""
    return StatsLine(lambda: frontend_counts(front), lambda: scheduler_stats(front.client), clock)


def _cluster_parts(stats: dict | None) -> list[str]:
    """Requests running and waiting at the scheduler, and the decode engines' KV cache use (vLLM's "GPU KV cache
    usage": their device caches together)."""
    if stats is None:
        return ["the scheduler did not answer"]
    waiting = sum(stats.get(q, 0) for q in ("global_queue", "decode_queue", "prefill_queue"))
    parts = [f"Running: {max(stats.get('in_flight', 0) - waiting, 0)} reqs", f"Waiting: {waiting} reqs"]
    decode = [e for e in stats.get("engines", {}).values() if e.get("role") == "decode" and e.get("capacity_tokens")]
    if decode:
        total = sum(e["capacity_tokens"] for e in decode)
        used = total - sum(e.get("free_tokens", 0) for e in decode)
        parts.append(f"KV cache usage: {100 * used / total:.1f}%")
    return parts


def _hit_rate(cached: dict[str, float], before: dict[str, float], prompt: float) -> str:
    """The interval's prompt tokens loaded from storage, all told and by read path, as shares of its prompt tokens."""
    hits = {p: v - before.get(p, 0.0) for p, v in cached.items() if p not in NO_HIT_PATHS}
    hits = {p: v for p, v in hits.items() if v}
    text = f"Prefix cache hit rate: {100 * sum(hits.values()) / prompt:.1f}%"
    if hits:
        text += " (" + ", ".join(f"{p} {100 * v / prompt:.1f}%" for p, v in sorted(hits.items())) + ")"
    return text


async def log_stats(line: StatsLine, interval_s: float = STATS_INTERVAL_S) -> None:
    """Every ``interval_s``, ``line``'s line when there is one (until cancelled)."""
    while True:
        await asyncio.sleep(interval_s)
        text = await asyncio.to_thread(line.tick)  # (asks the scheduler: off the event loop)
        if text:
            stats_log.info("%s", text)
