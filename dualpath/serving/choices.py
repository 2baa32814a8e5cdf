"""A request's choices on their way to the HTTP response: one pump per submitted request routes its token events
to each choice's queue (``Fanout``), each choice is a generation the frontend iterates and can always close
(``Generation``), a response merges them as they come (``merge``) or drains each (``drain``), and ``best_of``
keeps the best of them (``best``). The items a generation yields: ``(text delta, token ids, logprob)`` per token,
``PromptLogprobs`` when the prompt's arrive, then its ``Outcome``."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from dualpath.serving.json_bodies import error_body


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.type, self.param, self.code), self.status, headers=self.headers)


@dataclass
class Outcome:
    """What a finished generation reports for the response and the usage."""

    finish_reason: str = "stop"
    completion_tokens: int = 0
    cached_tokens: int = 0
    path: str = ""
    storage_bytes: int = 0
    prompt_logprobs: list | None = None  # TokenLogprob fields of prompt tokens 1.., when asked
    reasoning_tokens: int = 0  # a reasoning model's tokens before its answer (set where the reply is split)
    tool_calls: bool = False  # the reply was parsed into tool calls (set where the reply is split)
    token_ids: list[int] | None = None  # an agent session's turn: choice 0's tokens (what its next turn repeats)


async def merge(gens: list):
    """``(index, item)`` from every generation as items arrive, each generation in its own order, until every one
    has yielded its ``Outcome``. A generation's error is raised here (the others are closed by the caller)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
                if isinstance(item, Outcome):
                    return
            await queue.put((i, ApiError(500, "generation ended without a result", "server_error")))
        except Exception as e:  # noqa: BLE001 - handed to the consumer (a cancellation is not: it ends the pump)
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            left -= isinstance(item, Outcome)
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # no generation is mid-step when the caller closes it


@dataclass(frozen=True)
class PromptLogprobs:
    """What a choice's generation yields when its prompt's logprobs arrive (before its first token)."""

    lps: list


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids, and its text when the client sent text (echo repeats it)."""

    ids: list[int]
    text: str | None


class Fanout:
    """One request's token events, routed by choice to a queue each (a pump thread reads the decode engine's
    stream). Each choice lets go of it once (``release``); the request is cancelled when the last one does, if any
    let go early (a stop string, an error, a client gone): only the engines' own finishes need no cancel."""

    def __init__(self, handle, n: int, loop: asyncio.AbstractEventLoop):
        self.handle, self.queues = handle, [asyncio.Queue() for _ in range(n)]
        self._open, self._early, self._lock = n, False, threading.Lock()
        threading.Thread(target=self._pump, args=(loop,), daemon=True, name=f"http-{handle.request_id}").start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            for ev in self.handle.events():
                if not _deliver(loop, self.queues[ev.index], ev):
                    return  # the server's loop has closed: nobody is left to read
        except BaseException as e:  # noqa: BLE001 - delivered to every choice's coroutine
            for q in self.queues:
                _deliver(loop, q, e)
        for q in self.queues:
            _deliver(loop, q, None)

    def release(self, early: bool) -> None:
        with self._lock:
            self._open -= 1
            self._early = self._early or early
            cancel = self._open == 0 and self._early
        if cancel:
            self.handle.cancel()


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> bool:
    """Put ``item`` on ``queue`` from a pump thread; False once the loop has closed (a server stopped mid-stream)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


class Generation:
    """One choice's generation (``Generations._generate``) whose ``aclose`` always ends it: it lets go of the request
    and frees its admission slot even where iteration never began (an async generator's own cleanup runs only once
    it has started)."""

    def __init__(self, gen, fan: Fanout, done):
        self._gen, self._fan, self._done = gen, fan, done
        self._started = self._closed = False

    @property
    def handle(self):
        """The request it is a choice of (``dualpath.client.RequestHandle``)."""
        return self._fan.handle

    def __aiter__(self):
        return self

    def __anext__(self):
        self._started = True
        return self._gen.__anext__()

    async def aclose(self) -> None:
        if self._started:
            await self._gen.aclose()
        elif not self._closed:
            self._fan.release(early=True)
            self._done()
        self._closed = True


def best(n: int, k: int, *per_choice: list) -> tuple[list, ...]:
    """Of each prompt's ``k`` sampled choices the ``n`` whose tokens have the highest mean logprob (``best_of``,
    OpenAI's rule), best first; ``per_choice``: texts, logprobs, outcomes, in choice order."""
    if k == n:
        return per_choice
    lps = per_choice[1]
    keep = []
    for start in range(0, len(lps), k):
        mean = [sum(x["logprob"] for x in lps[i]) / max(1, len(lps[i])) for i in range(start, start + k)]
        keep += [start + j for j in sorted(range(k), key=lambda j: -mean[j])[:n]]
    return tuple([xs[i] for i in keep] for xs in per_choice)


async def drain(gen, text: list, lps: list, ids: list):
    async for item in gen:
        if isinstance(item, Outcome):
            return item
        if isinstance(item, PromptLogprobs):
            continue
        delta, tokens, lp = item
        text.append(delta)
        ids.extend(tokens)
        if lp:
            lps.append(lp)
    raise ApiError(500, "generation ended without a result", "server_error")
