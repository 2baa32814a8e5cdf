"""The scheduler's HTTP side: ``/health`` and Prometheus ``/metrics``, served from the scheduler's event loop."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from dualpath.metrics import CONTENT_TYPE, Registry
from scheduler.core import SchedulerCore

_COUNTERS = ("submitted", "finished", "failed", "retried", "rejected", "hit_tokens", "recomputed_hit_tokens",
             "prompt_tokens", "kv_load_failures", "kv_corrupt_removed", "cache_flushes", "preempted",
             "rpc_refused")


def render(stats: dict) -> str:
    """Prometheus text of one stats snapshot (built fresh each scrape: the core owns the numbers)."""
    r = Registry()
    for name in _COUNTERS:
        r.counter(f"scheduler_{name}_total", f"Requests/tokens: {name.replace('_', ' ')}").inc(stats.get(name, 0))
    paths = r.counter("scheduler_read_path_total", "Requests by read path", ["path"])
    for p in ("pe", "de", "split"):
        paths.inc(stats.get(f"path_{p}", 0), path=p)
    q = r.gauge("scheduler_queue_length", "Requests waiting", ["queue"])
    for name in ("global_queue", "decode_queue", "prefill_queue", "in_flight"):
        q.set(stats.get(name, 0), queue=name)
    waiting = r.gauge("scheduler_waiting_by_priority", "Requests in the scheduler's queues by priority (lower runs "
                      "first under --scheduling-policy priority)", ["priority"])
    for priority, n in sorted(stats.get("waiting_by_priority", {}).items(), key=lambda kv: int(kv[0])):
        waiting.set(n, priority=priority)
    r.gauge("scheduler_engines_alive", "Engines reporting").set(stats.get("engines_alive", 0))
    paused = r.gauge("scheduler_generation_paused", "1 while no request is handed to engines, by why: a weight "
                     "update, or /pause (until /resume)", ["why"])
    paused.set(int(stats.get("paused", False)), why="weight_update")
    paused.set(int(stats.get("held", False)), why="pause")
    r.gauge("scheduler_index_blocks", "Blocks in the stored-KV index").set(stats.get("index_blocks", 0))
    rq = r.gauge("node_read_queue_tokens", "Storage read queue per node, in tokens", ["node"])
    for node, v in stats.get("node_read_q_tokens", {}).items():
        rq.set(v, node=node)
    rate = r.gauge("node_storage_read_tokens_per_second", "How fast the node's storage read queue drains, in tokens "
                   "(alpha / 3 s): as measured while reads were queued lately, else its engines' start-up probe",
                   ["node"])
    live = r.gauge("node_storage_read_rate_measured", "1 if the node's read rate is measured live, 0 if probed",
                   ["node"])
    for node, v in stats.get("node_alpha_tokens", {}).items():
        rate.set(v / 3, node=node)
        live.set(int(stats.get("node_alpha_measured", {}).get(node, False)), node=node)
    rb = r.counter("node_storage_read_bytes_total", "Storage bytes read per node", ["node"])
    for node, v in stats.get("storage_read_bytes", {}).items():
        rb.inc(v, node=node)
    tb = r.counter("engine_kv_bytes_total", "KV bytes moved by each engine, by path and class",
                   ["engine", "path", "class"])
    for engine, traffic in stats.get("traffic_bytes", {}).items():
        for key, v in traffic.items():
            path, _, klass = key.partition(":")
            tb.inc(v, engine=engine, path=path, **{"class": klass})
    _engine_gauges(r, stats.get("engines", {}))
    drafted = r.counter("engine_spec_decode_draft_tokens_total", "Speculative tokens a decode engine proposed",
                        ["engine"])
    kept = r.counter("engine_spec_decode_accepted_tokens_total", "Speculative tokens the model's own draws kept",
                     ["engine"])
    for engine, counts in stats.get("speculative", {}).items():
        drafted.inc(counts.get("drafted", 0), engine=engine)
        kept.inc(counts.get("accepted", 0), engine=engine)
    r.gauge("storage_read_balance", "Storage reads max/avg across nodes (sliding window)").set(
        stats.get("storage_read_max_over_avg", 1.0))
    pb = r.gauge("prefill_time_balance", "Prefill time max/avg across the engines of a group (sliding window)",
                 ["group"])
    for group, v in stats.get("prefill_busy_max_over_avg", {}).items():
        pb.set(v, group=group)
    dp = r.gauge("dp_attention_balance", "Data-parallel attention: forward time outside the MoE exchanges, max/avg "
                 "across the engines of a group (recent steps where all computed; the paper's 1.06)", ["group"])
    for e in stats.get("engines", {}).values():
        if e.get("dp_balance"):  # (each engine of a group reports the group's value)
            dp.set(e["dp_balance"], group=e.get("group", ""))
    return r.render()


def _engine_gauges(r: Registry, engines: dict) -> None:
    """Each live engine's KV cache use and requests (vLLM's ``kv_cache_usage_perc``, ``num_requests_running``),
    and each node's KV store: stored bytes and the cap (what its engines last reported; 0 cap: none)."""
    usage = r.gauge("engine_kv_cache_usage", "Share of the engine's KV capacity in use (decode: device cache; "
                    "prefill: workspace)", ["engine", "role"])
    running = r.gauge("engine_requests", "Requests the engine holds", ["engine", "role"])
    rate = r.gauge("engine_prefill_tokens_per_second", "A prefill engine's prefill rate, measured on its recent "
                   "prompts (what the scheduler weighs loading a stored prefix against)", ["engine"])
    used = r.gauge("storage_used_bytes", "KV bytes stored in the node's KV store", ["node"])
    cap = r.gauge("storage_capacity_bytes", "The node's KV store cap (0: none)", ["node"])
    stores: dict[str, tuple[int, int]] = {}
    for eid, e in sorted(engines.items()):
        total = e.get("capacity_tokens") or 0
        usage.set(1 - e.get("free_tokens", 0) / total if total else 0.0, engine=eid, role=e.get("role", ""))
        running.set(e.get("requests", 0), engine=eid, role=e.get("role", ""))
        if e.get("measured_beta"):
            rate.set(e["measured_beta"] / 5, engine=eid)
        seen = stores.get(e.get("node", ""), (0, 0))
        stores[e.get("node", "")] = (max(seen[0], e.get("storage_used_bytes", 0)),
                                     max(seen[1], e.get("storage_capacity_bytes", 0)))
    for node, (u, c) in stores.items():
        used.set(u, node=node)
        cap.set(c, node=node)


def build_app(core: SchedulerCore) -> FastAPI:
    app = FastAPI(title="DualPath scheduler", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health():
        """Readiness: 200 while an engine of each role is alive; else 503 naming what is missing."""
        if core.ready():
            return JSONResponse({"status": "ok"}, 200)
        return JSONResponse({"status": "unavailable", "missing": core.missing()}, 503)

    @app.get("/live")
    async def live():
        """Liveness: the scheduler answers (missing engines are not its fault: a restart would not bring them)."""
        return JSONResponse({"status": "alive"}, 200)

    @app.get("/metrics")
    async def metrics():
        return Response(render(core.stats()), media_type=CONTENT_TYPE)

    return app
