"""Agent sessions: what a request may say about the conversation it belongs to, and the bounds on it.

A session is a conversation whose turns re-send the whole context. Naming it lets the scheduler keep the next turn
on the same engines (affinity), read the session's stored KV into that engine's DRAM buffer while the agent's tool
runs (prefetch), and keep that KV stored for ``ttl_s`` against eviction. A session is keyed by its id *and* the
request's cache salt and adapter (``session_key``): one tenant's id never names another tenant's session, as a block
hash never names another tenant's KV.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from dualpath.core.errors import RequestError

MAX_ID_CHARS = 256
MAX_GAP_S = 24 * 3600.0  # a hint of the time to the next turn: at most a day (beyond, a prefetch would expire)
MAX_TTL_S = 7 * 24 * 3600.0  # how long a session's KV may be kept stored: at most a week (bounded by a quota too)


@dataclass(frozen=True)
class SessionHint:
    """A request's session: ``id`` (the client's, e.g. an agent's trajectory id), ``next_turn_in_s`` (the client's
    estimate of the time from this reply to its next turn: the tool's run time; None: learn it) and ``ttl_s``
    (keep this session's KV stored that long after its last turn; None: the store's usual eviction)."""

    id: str
    next_turn_in_s: float | None = None
    ttl_s: float | None = None

    def checked(self, where: str = "dualpath.session") -> "SessionHint":
        """This hint, or a ``RequestError`` naming the field (``where``: the field's path in the request)."""
        if not isinstance(self.id, str) or not self.id or len(self.id) > MAX_ID_CHARS or not self.id.isprintable():
            raise RequestError(f"a session id is 1 to {MAX_ID_CHARS} printable characters", field=f"{where}.id")
        _check_seconds(self.next_turn_in_s, MAX_GAP_S, f"{where}.next_turn_in_s")
        _check_seconds(self.ttl_s, MAX_TTL_S, f"{where}.ttl_s")
        return self


def _check_seconds(value, limit: float, field: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{field} must be a number of seconds", field=field)
    if not 0 <= value <= limit:
        raise RequestError(f"{field} must be between 0 and {limit:g} seconds, got {value:g}", field=field)


def parse_session(body, header_id: str | None = None, where: str = "dualpath.session") -> SessionHint | None:
    """The session of a request: the body's ``{"id", "next_turn_in_s", "ttl_s"}`` object (``body``: None when
    absent) and/or the ``X-Session-Id`` header's id. Both naming different ids is an error."""
    if body is None:
        return SessionHint(header_id).checked("X-Session-Id") if header_id is not None else None
    if not isinstance(body, dict):
        raise RequestError(f"{where} must be an object", field=where)
    unknown = set(body) - {"id", "next_turn_in_s", "ttl_s"}
    if unknown:
        raise RequestError(f"{where} has unknown fields {sorted(unknown)}", field=where)
    sid = body.get("id", header_id)
    if header_id is not None and sid != header_id:
        raise RequestError(f"{where}.id and the X-Session-Id header name different sessions", field=f"{where}.id")
    return SessionHint(sid, body.get("next_turn_in_s"), body.get("ttl_s")).checked(where)


def session_key(session_id: str, salt: str = "", adapter: str = "") -> str:
    """The scheduler's name for a session: its id within its tenant (cache salt) and adapter."""
    h = hashlib.blake2b(digest_size=16)
    for part in (salt or "", adapter or "", session_id):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little") + data)
    return h.hexdigest()
