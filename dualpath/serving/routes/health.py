"""Health, probes and metrics: what load balancers, operators and RL frameworks ask a server about itself
(``dualpath.serving.probes``), and Prometheus ``/metrics``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dualpath.core.metrics import CONTENT_TYPE


def router(front) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health():
        return await front.probes.health()

    @r.get("/live")  # liveness: this process answers (a cluster short of engines is /health's 503)
    async def live():
        return {"status": "alive"}

    @r.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's health check)
    async def ping():
        return await front.probes.health()

    @r.get("/health_generate")
    async def health_generate():
        return await front.probes.health_generate()

    @r.get("/version")
    async def version():
        return front.probes.version()

    @r.get("/load")  # vLLM's (--enable-server-load-tracking; always on here): a load balancer's input
    async def load():
        return {"server_load": front.in_flight}

    @r.get("/get_model_info")
    async def model_info(request: Request):
        front.auth.caller(request)
        return await front.probes.model_info()

    @r.get("/get_server_info")
    async def server_info(request: Request):
        front.auth.caller(request)
        return await front.probes.server_info()

    @r.get("/get_weight_version")
    async def weight_version(request: Request):
        front.auth.caller(request)
        return await front.probes.weight_version()

    @r.get("/metrics")
    async def metrics():
        # on a worker thread: collecting the scheduler's series is an RPC
        return Response(await asyncio.to_thread(front.metrics.render), media_type=CONTENT_TYPE)

    return r
