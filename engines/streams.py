"""Token streams from a decode engine to submitters.

The decode loop and helper threads produce events (``put``, thread-safe); the RPC event loop consumes them
(``events``, an async iterator per request). Every queue lives on the event loop, so the table needs no lock;
producers only schedule work onto the loop. A stream whose submitter never comes is dropped after a TTL.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from dualpath.core.messages import TokenEvent

STREAM_TTL_S = 120.0  # how long a finished stream waits for a submitter that never came


class StreamHub:
    """Per-request event queues. Callers: the decode engine (``put`` from any thread) and its ``Stream`` RPC
    (``events`` on ``loop``). ``events`` must not be called from any other loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ttl_s: float = STREAM_TTL_S):
        self.loop, self.ttl_s = loop, ttl_s
        self._queues: dict[str, asyncio.Queue] = {}
        self._expiry: dict[str, float] = {}
        self.loop.call_soon_threadsafe(self._expire)

    def put(self, work_id: str, event: TokenEvent) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._put, work_id, event)

    async def events(self, work_id: str) -> AsyncIterator[TokenEvent]:
        """The events of ``work_id`` as they come, through the one that finishes it (its last choice's)."""
        q = self._queue(work_id)
        self._expiry.pop(work_id, None)
        try:
            while True:
                ev = await q.get()
                yield ev
                if ev.finish_reason and ev.final:
                    return
        finally:
            self._queues.pop(work_id, None)

    def open_streams(self) -> int:
        return len(self._queues)

    def _queue(self, work_id: str) -> asyncio.Queue:
        q = self._queues.get(work_id)
        if q is None:
            q = self._queues[work_id] = asyncio.Queue()
        return q

    def _put(self, work_id: str, event: TokenEvent) -> None:
        self._queue(work_id).put_nowait(event)
        if event.finish_reason and event.final:
            self._expiry.setdefault(work_id, time.monotonic() + self.ttl_s)

    def _expire(self) -> None:
        now = time.monotonic()
        for w, t in list(self._expiry.items()):
            if now > t:
                del self._expiry[w]
                self._queues.pop(w, None)
        self.loop.call_later(min(5.0, self.ttl_s), self._expire)
