"""The scheduler's stats (``SchedulerCore.stats``, the ``Stats`` RPC's reply) as Prometheus series: the scheduler's,
its engines' (from their load reports), the KV cache's and the KV transport's. Read at each scrape, by the scheduler's
own ``/metrics`` and by every frontend's (``StatsCollector``), so one scrape of the API port holds them all."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from dualpath.core.metrics import counter_family, gauge_family

# the core's counters (``SchedulerCore.counters``), each ``dualpath_scheduler_<name>_total``
COUNTERS = {
    "submitted": "Requests submitted",
    "finished": "Requests finished",
    "failed": "Requests failed",
    "retried": "Requests handed to engines again after one failed them",
    "rejected": "Requests refused (overloaded)",
    "hit_tokens": "Prompt tokens whose KV was found stored (the hit, before the read-path choice)",
    "recomputed_hit_tokens": "Stored prompt tokens computed again rather than loaded (loading cost more)",
    "prompt_tokens": "Prompt tokens submitted",
    "kv_load_failures": "Stored KV blocks that could not be loaded (the tokens are computed instead)",
    "kv_corrupt_removed": "Stored KV blocks removed for a bad checksum or header",
    "cache_flushes": "KV store flushes",
    "preempted": "Requests preempted by higher-priority ones",
    "rpc_refused": "Internal RPCs refused for a missing or wrong cluster token (the scheduler's and its engines')",
    "blocks_stored": "KV blocks written to the KV store (engines' reports)",
    "blocks_evicted": "KV blocks evicted from the KV store to stay under its cap (engines' reports)",
    "session_turns": "Requests that named an agent session",
    "session_turns_prefetched": "Agent sessions' turns placed where a prefetch of their KV was read ahead",
    "session_turns_kept_decode": "Agent sessions' turns kept on their last turn's decode engine",
    "prefetch_orders": "Prefetches of waiting agent sessions' KV ordered to engines",
    "prefetch_blocks_ordered": "KV blocks those prefetches named",
    "hashes_verified": "Members' prompt block hashes the scheduler recomputed to check them (a sampled share)",
    "hash_mismatches": "Members' block hashes that differed from their tokens' (then every prompt is hashed)",
}
# the engines' prefetchers summed (``stats()["prefetch"]``), each ``dualpath_prefetch_<name>_total``
PREFETCH = {
    "loaded_bytes": "Agent sessions' KV bytes read into DRAM buffers ahead of their next turns",
    "used_bytes": "Of those, bytes a turn then read from the buffer (each block once)",
    "wasted_bytes": "Of those, bytes freed unused (their turn came elsewhere, late, or not at all)",
    "hit_reads": "KV blocks requests read from prefetched copies instead of storage",
    "skipped": "KV blocks a prefetch did not read (no room, or not stored)",
}
READ_PATHS = ("pe", "de", "split")
QUEUES = ("global_queue", "decode_queue", "prefill_queue", "in_flight")


class StatsCollector:
    """A ``prometheus_client`` collector of ``stats()``: the scheduler's core in its own process, a ``Stats`` RPC in a
    frontend's (None when the scheduler did not answer: then only ``dualpath_scheduler_up`` 0)."""

    def __init__(self, stats: Callable[[], dict | None]):
        self.stats = stats

    def collect(self) -> Iterator:
        stats = self.stats()
        up = gauge_family("scheduler_up", "1 when the scheduler answered this scrape's stats call")
        up.add_metric([], 0 if stats is None else 1)
        yield up
        if stats is None:
            return
        for part in (_scheduler, _sessions, _nodes, _engines, _stores, _transport, _balance):
            yield from part(stats)


def _sessions(stats: dict) -> Iterator:
    prefetch = stats.get("prefetch", {})
    for name, help_ in PREFETCH.items():
        c = counter_family(f"prefetch_{name}_total", help_)
        c.add_metric([], prefetch.get(name, 0))
        yield c
    held = gauge_family("prefetch_held_bytes", "Agent sessions' KV bytes held in DRAM buffers for their next turns")
    held.add_metric([], prefetch.get("held_bytes", 0))
    yield held
    n = gauge_family(
        "sessions", "Agent sessions the scheduler tracks, and those waiting for their next turn", ["state"]
    )
    n.add_metric(["all"], stats.get("sessions", 0))
    n.add_metric(["waiting"], stats.get("sessions_waiting", 0))
    yield n


def _scheduler(stats: dict) -> Iterator:
    for name, help_ in COUNTERS.items():
        c = counter_family(f"scheduler_{name}_total", help_)
        c.add_metric([], stats.get(name, 0))
        yield c
    paths = counter_family(
        "scheduler_read_path_total", "Requests by the read path chosen for their stored KV", ["path"]
    )
    for p in READ_PATHS:
        paths.add_metric([p], stats.get(f"path_{p}", 0))
    q = gauge_family(
        "scheduler_queue_length", "Requests waiting in each scheduler queue, and in flight all told", ["queue"]
    )
    for name in QUEUES:
        q.add_metric([name], stats.get(name, 0))
    waiting = gauge_family(
        "scheduler_waiting_by_priority",
        "Requests in the scheduler's queues by priority (lower runs first under --scheduling-policy priority)",
        ["priority"],
    )
    for priority, n in sorted(stats.get("waiting_by_priority", {}).items(), key=lambda kv: int(kv[0])):
        waiting.add_metric([priority], n)
    alive = gauge_family("scheduler_engines_alive", "Engines reporting")
    alive.add_metric([], stats.get("engines_alive", 0))
    paused = gauge_family(
        "scheduler_generation_paused",
        "1 while no request is handed to engines, by why: a weight update, or /pause (until /resume)",
        ["why"],
    )
    paused.add_metric(["weight_update"], int(stats.get("paused", False)))
    paused.add_metric(["pause"], int(stats.get("held", False)))
    blocks = gauge_family("scheduler_index_blocks", "Blocks in the stored-KV index")
    blocks.add_metric([], stats.get("index_blocks", 0))
    yield from (paths, q, waiting, alive, paused, blocks)


def _nodes(stats: dict) -> Iterator:
    rq = gauge_family("node_read_queue_tokens", "Storage read queue per node, in tokens", ["node"])
    for node, v in stats.get("node_read_q_tokens", {}).items():
        rq.add_metric([node], v)
    rate = gauge_family(
        "node_storage_read_tokens_per_second",
        "How fast the node's storage read queue drains, in "
        "tokens (alpha / 3 s): as measured while reads were queued lately, else its engines' start-up "
        "probe",
        ["node"],
    )
    live = gauge_family(
        "node_storage_read_rate_measured", "1 if the node's read rate is measured live, 0 if probed", ["node"]
    )
    for node, v in stats.get("node_alpha_tokens", {}).items():
        rate.add_metric([node], v / 3)
        live.add_metric([node], int(stats.get("node_alpha_measured", {}).get(node, False)))
    rb = counter_family("node_storage_read_bytes_total", "Storage bytes read per node", ["node"])
    for node, v in stats.get("storage_read_bytes", {}).items():
        rb.add_metric([node], v)
    yield from (rq, rate, live, rb)


def _engines(stats: dict) -> Iterator:
    """Each live engine's KV cache use and requests (vLLM's ``kv_cache_usage_perc``, ``num_requests_running``), its
    prefill rate, and its speculative decoding's draft and kept tokens."""
    usage = gauge_family(
        "engine_kv_cache_usage",
        "Share of the engine's KV capacity in use (decode: device cache; prefill: workspace)",
        ["engine", "role"],
    )
    capacity = gauge_family(
        "engine_kv_cache_tokens",
        "The engine's KV capacity in tokens (decode: device cache; prefill: workspace)",
        ["engine", "role"],
    )
    running = gauge_family("engine_requests", "Requests the engine holds", ["engine", "role"])
    rate = gauge_family(
        "engine_prefill_tokens_per_second",
        "A prefill engine's prefill rate, measured on its recent "
        "prompts (what the scheduler weighs loading a stored prefix against)",
        ["engine"],
    )
    for eid, e in sorted(stats.get("engines", {}).items()):
        role, total = e.get("role", ""), e.get("capacity_tokens") or 0
        usage.add_metric([eid, role], 1 - e.get("free_tokens", 0) / total if total else 0.0)
        capacity.add_metric([eid, role], total)
        running.add_metric([eid, role], e.get("requests", 0))
        if e.get("measured_beta"):
            rate.add_metric([eid], e["measured_beta"] / 5)
    drafted = counter_family(
        "engine_spec_decode_draft_tokens_total", "Speculative tokens a decode engine proposed", ["engine"]
    )
    kept = counter_family(
        "engine_spec_decode_accepted_tokens_total", "Speculative tokens the model's own draws kept", ["engine"]
    )
    for engine, counts in stats.get("speculative", {}).items():
        drafted.add_metric([engine], counts.get("drafted", 0))
        kept.add_metric([engine], counts.get("accepted", 0))
    yield from (usage, capacity, running, rate, drafted, kept)


def _stores(stats: dict) -> Iterator:
    """Each node's KV store: stored bytes and the cap (what its engines last reported; 0 cap: none)."""
    used = gauge_family("storage_used_bytes", "KV bytes stored in the node's KV store", ["node"])
    cap = gauge_family("storage_capacity_bytes", "The node's KV store cap (0: none)", ["node"])
    stores: dict[str, tuple[int, int]] = {}
    for e in stats.get("engines", {}).values():
        seen = stores.get(e.get("node", ""), (0, 0))
        stores[e.get("node", "")] = (
            max(seen[0], e.get("storage_used_bytes", 0)),
            max(seen[1], e.get("storage_capacity_bytes", 0)),
        )
    for node, (u, c) in stores.items():
        used.add_metric([node], u)
        cap.add_metric([node], c)
    yield from (used, cap)


def _transport(stats: dict) -> Iterator:
    """KV bytes each engine moved, by path (``storage_read``, ``pe_to_de``, ...) and priority class."""
    tb = counter_family(
        "engine_kv_bytes_total", "KV bytes moved by each engine, by path and class", ["engine", "path", "class"]
    )
    for engine, traffic in stats.get("traffic_bytes", {}).items():
        for key, v in traffic.items():
            path, _, klass = key.partition(":")
            tb.add_metric([engine, path, klass], v)
    yield tb


def _balance(stats: dict) -> Iterator:
    reads = gauge_family("storage_read_balance", "Storage reads max/avg across nodes (sliding window)")
    reads.add_metric([], stats.get("storage_read_max_over_avg", 1.0))
    pb = gauge_family(
        "prefill_time_balance", "Prefill time max/avg across the engines of a group (sliding window)", ["group"]
    )
    for group, v in stats.get("prefill_busy_max_over_avg", {}).items():
        pb.add_metric([group], v)
    dp = gauge_family(
        "dp_attention_balance",
        "Data-parallel attention: forward time outside the MoE exchanges, "
        "max/avg across the engines of a group (recent steps where all computed; the paper's 1.06)",
        ["group"],
    )
    groups = {e.get("group", ""): e["dp_balance"] for e in stats.get("engines", {}).values() if e.get("dp_balance")}
    for group, v in groups.items():  # (each engine of a group reports the group's value: one sample per group)
        dp.add_metric([group], v)
    yield from (reads, pb, dp)
