"""OpenAI's models: ``/v1/models`` lists every served name (aliases and LoRA adapters too, with vLLM's
``max_model_len``) and ``/v1/models/{model}`` retrieves one (``dualpath.serving.served_models``)."""

from __future__ import annotations

from fastapi import APIRouter, Request


def router(front) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models(request: Request):
        front.auth.caller(request)
        return {"object": "list", "data": [front.models.card(n) for n in front.models.names()]}

    @r.get("/v1/models/{name:path}")  # OpenAI's retrieve; a name may hold slashes ("Qwen/Qwen2.5-7B")
    async def model(name: str, request: Request):
        front.auth.caller(request)
        front.models.check(name)
        return front.models.card(name)

    return r
