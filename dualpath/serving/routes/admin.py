"""The operator's routes (``dualpath.serving.auth``: off unless enabled, then only for the admin key): SGLang's
``/update_weights_from_disk``, LoRA adapters loaded and unloaded (vLLM's ``/v1/...`` paths and SGLang's), requests
aborted (``/abort_request``: a caller's own by rid, every one with ``abort_all``), generation paused and resumed and
the KV store flushed (``dualpath.serving.control``)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dualpath.core.errors import CheckpointError, DualPathError
from dualpath.core.lora import adapter_digest, read_adapter_config
from dualpath.serving.auth import ADMIN, LORA, confined, owned_label
from dualpath.serving.choices import ApiError
from dualpath.serving.control import PAUSE_WAIT_S
from dualpath.serving.probes import ask_scheduler
from dualpath.serving.protocol import (
    AbortRequest,
    LoadLoraRequest,
    PauseGenerationRequest,
    UnloadLoraRequest,
    UpdateWeightsRequest,
)
from dualpath.serving.routes.utility import answered, answered_body

log = logging.getLogger(__name__)


class Admin:
    """What the admin routes do, once their caller passed the gate."""

    def __init__(self, front):
        self.front = front

    async def update_weights(self, req: UpdateWeightsRequest) -> JSONResponse:
        """SGLang's ``/update_weights_from_disk``: every engine loads the checkpoint's weights (the scheduler pauses
        admission and drains first) from under the allowed directories. 200 when all did; 400 when none could (the
        old weights stay); 500 when some could not (they left the cluster, which serves the new weights on the
        others)."""
        path = confined(req.model_path, self.front.model_dirs, "model_path")
        try:
            reply = await asyncio.to_thread(
                self.front.client.update_weights, path, req.weight_version or "", req.timeout, req.abort_all_requests
            )
        except DualPathError as e:
            raise ApiError(503, f"the scheduler did not answer the update: {e}") from None
        status = 200 if reply.ok else 500 if reply.fingerprint else 400
        return JSONResponse(
            {
                "success": reply.ok,
                "message": reply.error or "weights updated",
                "weight_version": reply.version,
                "fingerprint": reply.fingerprint,
                "engines": reply.engines,
                "num_aborted_requests": reply.aborted,
                "seconds": round(reply.seconds, 3),
            },
            status,
        )

    async def load_adapter(self, req: LoadLoraRequest) -> JSONResponse:
        """Every engine loads the adapter (and every engine that joins later) from under the allowed directories;
        then requests may name it. 400 for an adapter that cannot be served or a name in use, 500 when an engine
        could not load it."""
        if req.lora_name in self.front.models.names():
            raise ApiError(400, f"the model name {req.lora_name!r} is in use; unload it first", param="lora_name")
        path = confined(req.lora_path, self.front.model_dirs, "lora_path")
        try:
            await asyncio.to_thread(read_adapter_config, path)
            digest = await asyncio.to_thread(adapter_digest, path)
        except CheckpointError as e:
            raise ApiError(400, str(e), param="lora_path") from None
        try:
            reply = await asyncio.to_thread(self.front.client.load_adapter, path)
        except DualPathError as e:
            raise ApiError(503, f"the scheduler did not answer: {e}") from None
        if not reply.ok or reply.digest != digest:
            raise ApiError(500, reply.error or f"the engines read other bytes of {path} than this frontend")
        self.front.models.add(req.lora_name, digest, req.lora_path)
        log.info("serving LoRA adapter %s (%s) on %d engines", req.lora_name, path, reply.engines)
        return JSONResponse(
            {"success": True, "message": f"Success: LoRA adapter '{req.lora_name}' added successfully."}
        )

    def unload_adapter(self, req: UnloadLoraRequest) -> JSONResponse:
        """Requests may no longer name the adapter (those running under it finish); the engines keep its weights
        until they stop, so a request already queued under it still runs."""
        if req.lora_name not in self.front.models.adapters:
            raise ApiError(
                404, f"the LoRA adapter {req.lora_name!r} cannot be found", param="lora_name", code="model_not_found"
            )
        self.front.models.remove(req.lora_name)
        return JSONResponse(
            {"success": True, "message": f"Success: LoRA adapter '{req.lora_name}' removed successfully."}
        )

    async def abort(self, req: AbortRequest, request: Request) -> dict:
        """SGLang's ``/abort_request``: the requests named ``rid`` (``/generate``'s rid, or another endpoint's
        X-Request-Id), or all (``abort_all``), end where they are, whichever frontend they came through (the
        scheduler ends them); each choice answers with what it generated so far and finish reason ``abort`` (an RL
        trainer's partial rollouts at a weight update). A rid names the caller's own requests (an admin's: every
        key's); none in flight is a 404, as another key's are. ``abort_all`` is an admin route."""
        if not req.rid and not req.abort_all:
            raise ApiError(400, "give the rid of the request(s) to abort, or abort_all", param="rid")
        auth, client = self.front.auth, self.front.client
        if req.abort_all:
            auth.admin(request)
            n = await ask_scheduler(client.abort, "", True)
        else:
            owners = auth.owners() if auth.is_admin(request) else (auth.caller(request).owner,)
            n = 0
            for owner in owners:
                n += await ask_scheduler(client.abort, owned_label(owner, req.rid), False)
            if not n:
                raise ApiError(404, f"no request named {req.rid!r} is in flight", param="rid", code="not_found")
        self.front.metrics.aborted.inc(n)
        return {"aborted": n}


def router(front) -> APIRouter:
    r, admin, control = APIRouter(), Admin(front), front.control

    def with_body(name: str, model_cls, answer, group: str | None = ADMIN):
        async def endpoint(request: Request):
            return await answered_body(front, request, name, model_cls, answer, group)

        return endpoint

    def plain(name: str, answer, group: str | None = ADMIN):
        async def endpoint(request: Request):
            return await answered(front, request, name, answer(), group)

        return endpoint

    @r.post("/abort_request")  # by rid: the caller's own requests (an admin's: anyone's); abort_all: admin
    async def abort_request(request: Request):
        abort = lambda req: admin.abort(req, request)  # noqa: E731
        return await answered_body(front, request, "abort_request", AbortRequest, abort)

    r.post("/update_weights_from_disk")(with_body("update_weights", UpdateWeightsRequest, admin.update_weights))
    for prefix in ("/v1", ""):  # vLLM's paths, and SGLang's
        r.post(f"{prefix}/load_lora_adapter")(with_body("load_lora_adapter", LoadLoraRequest, admin.load_adapter, LORA))
        r.post(f"{prefix}/unload_lora_adapter")(
            with_body("unload_lora_adapter", UnloadLoraRequest, admin.unload_adapter, LORA)
        )

    @r.post("/pause")  # vLLM's
    async def pause(
        request: Request,
        mode: str = "abort",
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
        timeout: float = PAUSE_WAIT_S,
    ):  # clear_cache: nothing to clear (stored KV is keyed by the weights' fingerprint)
        return await answered(front, request, "pause", control.pause(mode, wait_for_inflight_requests, timeout), ADMIN)

    r.post("/resume")(plain("resume", control.resume))
    r.get("/is_paused")(plain("is_paused", control.is_paused, None))
    r.post("/pause_generation")(  # SGLang's
        with_body("pause_generation", PauseGenerationRequest, control.pause_generation)
    )
    r.post("/continue_generation")(plain("continue_generation", control.resume))
    # SGLang's (older releases took a GET: here no GET changes anything)
    r.post("/flush_cache")(plain("flush_cache", control.flush_cache))
    r.post("/reset_prefix_cache")(plain("reset_prefix_cache", control.flush_cache))  # vLLM's
    return r
