"""The frontend's own Prometheus series, rendered at ``/metrics`` with the scheduler's, engines' and KV cache's
(``dualpath.scheduler.metrics``, collected from the scheduler at each scrape)."""

from __future__ import annotations

import time
from functools import partial

from dualpath.core.metrics import Metrics
from dualpath.scheduler.metrics import StatsCollector
from dualpath.serving.choices import Outcome
from dualpath.serving.watch import current_access, scheduler_stats


class HttpMetrics:
    """The series, and the two things that feed them: ``count`` once per answered request (its endpoint and
    status), ``observe`` once per finished choice. ``client``'s migrations and ``in_flight()`` are read at each
    scrape."""

    def __init__(self, client, in_flight):
        m = self.registry = Metrics()
        self.requests = m.counter("http_requests_total", "HTTP requests by endpoint and status", ["endpoint", "status"])
        self.prompt = m.counter("prompt_tokens_total", "Prompt tokens of finished requests")
        self.lora = m.counter("lora_requests_total", "Generation requests by the LoRA adapter they name", ["adapter"])
        self.completion = m.counter("completion_tokens_total", "Generated tokens")
        self.cached = m.counter(
            "cached_tokens_total", "Prompt tokens whose KV came from storage, by read path", ["path"]
        )
        self.kv_bytes = m.counter(
            "kv_bytes_loaded_total", "KV bytes read from storage for requests, by read path", ["path"]
        )
        self._latencies(m)
        self.finished = m.counter(
            "requests_finished_total", "Choices generated to their end, by why they ended", ["finish_reason"]
        )
        self.in_flight = m.gauge("requests_in_flight", "Requests being generated")
        self.cancelled = m.counter("requests_cancelled_total", "Requests cancelled because the client left")
        self.aborted = m.counter("requests_aborted_total", "Requests ended by /abort_request")
        self.migrations = m.counter(
            "request_migrations_total", "Replies moved to other decode engines after theirs died while generating them"
        )
        client.on_migration = lambda _rid: self.migrations.inc()
        self.in_flight.set_function(in_flight)  # read at each scrape
        m.register(StatsCollector(partial(scheduler_stats, client)))  # the scheduler's, engines' and KV's series

    def _latencies(self, m: Metrics) -> None:
        self.ttft = m.histogram("time_to_first_token_seconds", "Time to first token")
        self.tpot = m.histogram(
            "time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
        )
        self.session_ttft = m.histogram(
            "session_turn_ttft_seconds",
            "Time to first token of agent sessions' turns, by whether the session's KV was prefetched",
            ["prefetched"],
        )
        self.e2e = m.histogram(
            "e2e_request_latency_seconds",
            "Time from a choice's arrival to its last token",
            buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
        )

    def session_turn(self, prefetched: bool, ttft_s: float) -> None:
        """An agent session's turn's first token, by whether its KV was prefetched while its tool ran."""
        self.session_ttft.labels(prefetched="yes" if prefetched else "no").observe(ttft_s)

    def render(self) -> bytes:
        return self.registry.render()

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=status).inc()

    def observe(self, o: Outcome, n_prompt: int, start: float, first: float | None, last: float | None) -> None:
        """A choice's end (``n_prompt`` 0 for a prompt's later choices: the prompt ran once), into the series and the
        request's access-log record."""
        self.prompt.inc(n_prompt)
        self.completion.inc(o.completion_tokens)
        self.cached.labels(path=o.path or "none").inc(o.cached_tokens)
        self.kv_bytes.labels(path=o.path or "none").inc(o.storage_bytes)
        self.finished.labels(finish_reason=o.finish_reason or "unknown").inc()
        if (access := current_access()) is not None:
            access.note(n_prompt, o, first)
        self.e2e.observe((last if last is not None else time.perf_counter()) - start)
        if first is not None:
            self.ttft.observe(first - start)
            if o.completion_tokens > 1:
                self.tpot.observe((last - first) / (o.completion_tokens - 1))
