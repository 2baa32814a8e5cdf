"""The scheduler's HTTP side: ``/health`` and Prometheus ``/metrics``, served from the scheduler's event loop."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from dualpath.core.metrics import CONTENT_TYPE, Metrics
from dualpath.scheduler.core import SchedulerCore
from dualpath.scheduler.metrics import StatsCollector


def render(stats: dict) -> str:
    """Prometheus text of one stats snapshot (``dualpath.scheduler.metrics``: the series a frontend's ``/metrics`` holds too)."""
    return registry(lambda: stats).render().decode()


def registry(stats) -> Metrics:
    """The scheduler's registry: its stats, read from ``stats()`` at each scrape (the core owns the numbers)."""
    m = Metrics()
    m.register(StatsCollector(stats))
    return m


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

    metrics = registry(core.stats)

    @app.get("/metrics")
    async def scrape():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
