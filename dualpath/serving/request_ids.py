"""Request ids: every HTTP request's id, the client's ``X-Request-Id`` when usable (vLLM's and OpenAI's header) or a
new one. It names the completion (``chatcmpl-<id>``), begins the request's ids at the scheduler and engines (their
logs name it) and is what ``/abort_request``'s ``rid`` matches for the OpenAI endpoints."""

from __future__ import annotations

import uuid

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def usable_request_id(value: str) -> bool:
    """A client's ``X-Request-Id`` is taken when it is short and plain (it goes into logs and response ids)."""
    return 0 < len(value) <= 128 and set(value) <= REQUEST_ID_CHARS


class RequestIds:
    """ASGI middleware: every HTTP request's id, the client's ``X-Request-Id`` when usable (vLLM's and OpenAI's
    header) or a new one, in ``request.state.request_id`` and the response's ``X-Request-Id``. Pure ASGI, so
    streamed responses and disconnects pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == REQUEST_ID_HEADER.encode()), "")
        rid = given if usable_request_id(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())],
                }
            await send(message)

        await self.app(scope, receive, send_with_id)
