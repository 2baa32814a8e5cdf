"""What one request or one key may take of the frontend: its body (``BodyGuard``) and its share of the generation
slots (``Admission``).

``BodyGuard`` reads no body beyond ``--max-body-bytes`` on any route: a larger ``Content-Length`` is a 413 before a
byte is read, and a body sent without one (chunked) is counted as it arrives and refused (413) at the first chunk
past the limit, the rest unread. State-changing requests (POST, PUT, PATCH, DELETE) carry JSON
(``Content-Type: application/json``) or nothing at all (no body, no content type and no ``Origin``, as ``curl -X
POST`` sends): anything else is a 415 before the route runs. A web page can send a cross-origin ``text/plain`` or
form POST without asking the server first, never a JSON one (that needs a CORS preflight, which this server does not
grant), so no page another site serves can make this server act.
"""

from __future__ import annotations

import threading
from collections import Counter

from starlette.datastructures import Headers

from dualpath.serving.choices import ApiError

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON = "application/json"


class BodyGuard:
    """ASGI middleware: bodies bounded while read, state-changing requests JSON or empty (the module's
    docstring)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = _refusal(scope["method"], Headers(scope=scope), self.max_bytes)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        await self.app(scope, self._bounded(receive), send)

    def _bounded(self, receive):
        """``receive`` that raises a 413 (to the route reading the body) once more than ``max_bytes`` arrived."""
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _too_large(self.max_bytes)
            return message

        return bounded


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds the server's limit of {limit} bytes (--max-body-bytes)")


def _refusal(method: str, headers: Headers, max_bytes: int) -> ApiError | None:
    """Why a request is refused before its route runs (None: it is not)."""
    length = headers.get("content-length")
    if length is not None and not length.strip().isdigit():
        return ApiError(400, "Content-Length must be a number of bytes")
    if length is not None and int(length) > max_bytes:
        return _too_large(max_bytes)
    if method not in STATE_CHANGING:
        return None
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == JSON:
        return None
    bodiless = int(length or 0) == 0 and "transfer-encoding" not in headers
    if not media and bodiless and "origin" not in headers:
        return None
    return ApiError(
        415, f"a {method} request's body must be JSON (Content-Type: {JSON})", code="unsupported_media_type"
    )


class Admission:
    """Generation slots (each choice of each prompt takes one): at most ``limit`` in flight in all, and at most
    ``per_key`` of them one owner's (the anonymous owner, every client of a server without keys, has only the
    server's limit). ``take`` raises the 429 once full; each slot taken is given back once."""

    def __init__(self, limit: int, per_key: int):
        self.limit, self.per_key = limit, per_key
        self.total, self.by_owner = 0, Counter()
        self._lock = threading.Lock()

    def take(self, owner: str, n: int) -> None:
        with self._lock:
            if self.total + n > self.limit:
                raise ApiError(
                    429,
                    "too many requests in flight; retry shortly",
                    "rate_limit_exceeded",
                    headers={"Retry-After": "1"},
                )
            if owner and self.by_owner[owner] + n > self.per_key:
                raise ApiError(
                    429,
                    f"this API key has {self.by_owner[owner]} generations in flight, and may have "
                    f"{self.per_key} (--max-concurrent-requests-per-key); retry shortly",
                    "rate_limit_exceeded",
                    headers={"Retry-After": "1"},
                )
            self.total += n
            self.by_owner[owner] += n

    def give(self, owner: str, n: int = 1) -> None:
        with self._lock:
            self.total -= n
            self.by_owner[owner] -= n
            if not self.by_owner[owner]:
                del self.by_owner[owner]

    def most(self, owner: str) -> int:
        """The most slots one request of ``owner`` could ever take."""
        return min(self.limit, self.per_key) if owner else self.limit
