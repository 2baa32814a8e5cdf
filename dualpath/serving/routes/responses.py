"""OpenAI's Responses API: ``POST /v1/responses`` (the shared pipeline, answered as a chat:
``dualpath.serving.responses``), and a stored response's ``GET``, ``GET .../input_items`` and ``DELETE``. Stored
responses are their owner's alone (``dualpath.serving.auth``): another owner's is as absent as one never stored."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dualpath.serving.auth import ANONYMOUS
from dualpath.serving.bounded import off_loop
from dualpath.serving.choices import ApiError
from dualpath.serving.pipeline import GenerationCall, Job, generation_router
from dualpath.serving.json_bodies import parse
from dualpath.serving.protocol import ChatRequest
from dualpath.serving.response_events import event_stream
from dualpath.serving.response_items import input_items, item_page
from dualpath.serving.responses import (
    ResponseCall,
    ResponsesRequest,
    exchange_starts,
    remap_param,
    to_chat,
    without_exchanges,
)
from dualpath.serving.streaming import ChunkStream


class StoredResponses:
    """The frontend's stored responses (``Frontend.responses``: a directory, maybe on a network filesystem, or
    memory), read and written off the event loop."""

    def __init__(self, front):
        self.front = front

    async def get(self, rid: str, owner: str) -> tuple[dict, list[dict], list[dict]]:
        """The stored response ``rid`` (its conversation and input items too) if ``owner``'s, else a 404."""
        entry = await asyncio.to_thread(self.front.responses.get, rid, owner)
        if entry is None:
            whose = "" if owner == ANONYMOUS else ", each for the API key that stored it"
            raise ApiError(
                404,
                f"no stored response with id {rid!r} (kept: the last {self.front.cfg.max_stored_responses} "
                f"with store true{whose})",
                code="not_found",
            )
        return entry

    async def history(self, previous: str | None, owner: str) -> list[dict]:
        """The conversation a ``previous_response_id`` of ``owner``'s ended (none without one)."""
        if previous is None:
            return []
        try:
            return (await self.get(previous, owner))[1]
        except ApiError as e:
            raise ApiError(400, str(e), param="previous_response_id", code="previous_response_not_found") from None

    async def keep(self, call: ResponseCall, response: dict, owner: str) -> dict:
        """``response``, stored first if its request asked (``store``)."""
        if call.req.store:
            await asyncio.to_thread(
                self.front.responses.put, response, call.conversation(response), input_items(call.req.input), owner
            )
        return response

    async def delete(self, rid: str, owner: str) -> None:
        if not await asyncio.to_thread(self.front.responses.delete, rid, owner):
            await self.get(rid, owner)  # the 404


class ResponsesCall(GenerationCall):
    """A ``/v1/responses`` request: the chat it asks for is what the pipeline runs; the chat's answer becomes the
    response (events when streamed), kept when ``store``. Errors name the Responses API's fields."""

    endpoint, kind = "responses", "chat"

    def __init__(self, front, stored: StoredResponses):
        self.front, self.stored = front, stored
        self.call: ResponseCall | None = None
        self.owner = ANONYMOUS

    async def read(self, body: bytes, owner: str) -> ChatRequest:
        req = parse(ResponsesRequest, body)
        self.front.models.check(req.model)
        history = await self.stored.history(req.previous_response_id, owner)
        self.owner = owner
        self.call = ResponseCall(req, self.front.models.reply_name(req.model), history, self.front.defaults)
        return await off_loop(self._fitted, self.call)  # renders the chat a few times

    def _fitted(self, call: ResponseCall) -> ChatRequest:
        """The chat a Responses call asks for; with ``truncation: "auto"``, without as few of its earliest
        exchanges as make it fit the context with room for ``max_output_tokens`` (at least one token). The cut moves
        by whole exchanges, so the next turns mostly cut at the same place and their prefixes still hit the KV
        store."""
        chat = to_chat(call.req, call.history)
        if call.req.truncation != "auto":
            return chat
        room = self.front.cfg.max_model_len - (call.req.max_output_tokens or 1)
        fits = lambda c: len(self.front.prompts.chat_ids(c)) <= room  # noqa: E731
        if fits(chat):
            return chat
        starts = exchange_starts(chat)
        lo, hi = 0, len(starts)  # the fewest exchanges to drop lies in starts[lo:hi], or none fits
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(without_exchanges(chat, starts[mid])):
                hi = mid
            else:
                lo = mid + 1
        return without_exchanges(chat, starts[lo]) if lo < len(starts) else chat  # none fits: the usual 400

    async def _keep(self, call: ResponseCall, response: dict) -> dict:
        return await self.stored.keep(call, response, self.owner)

    def stream(self, job: Job):
        chunks = ChunkStream(self.front, job).run()
        return event_stream(self.call, chunks, self.front.client.block_size(), self._keep)

    async def answer(self, job: Job, got) -> dict:
        chat = self.front.replies.body(job, got)
        return await self._keep(self.call, self.call.from_chat(chat, self.front.client.block_size()))

    def param(self, name: str | None) -> str | None:
        return remap_param(name) if self.call is not None else name  # before the call is read: already its names


def router(front) -> APIRouter:
    stored = StoredResponses(front)
    r = generation_router(front, "/v1/responses", lambda: ResponsesCall(front, stored))

    @r.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request):
        return JSONResponse((await stored.get(rid, front.auth.caller(request).owner))[0])

    @r.get("/v1/responses/{rid}/input_items")
    async def response_input_items(
        rid: str,
        request: Request,
        limit: int = 20,
        order: str = "desc",
        after: str | None = None,
        before: str | None = None,
    ):
        entry = await stored.get(rid, front.auth.caller(request).owner)
        return JSONResponse(item_page(entry[2], limit, order, after, before))

    @r.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request):
        await stored.delete(rid, front.auth.caller(request).owner)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    return r
