"""The one request pipeline every generation endpoint runs (chat, completions, the Responses API, SGLang's
``/generate``):

1. the caller is identified (``dualpath.serving.auth``) and the body parsed into the request that prompts and
   sampling are built from (``GenerationCall.read``: each API's own reading);
2. on the worker threads, its prompts become token ids and each prompt's ``SamplingParams`` is built and checked
   (``prepared``), before anything is submitted;
3. every prompt is submitted and each choice becomes a generation (``Generations.start``, which takes the
   admission slots);
4. the reply is streamed (``GenerationCall.stream``) or gathered whole (``GenerationCall.answer``).

What differs between APIs is only how a body is read and how the reply is shaped; an ``ApiError`` anywhere is the
response (its ``param`` in the API's own names) and every answer counts in ``http_requests_total``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.core.errors import RequestError
from dualpath.core.sampling_params import SamplingParams
from dualpath.core.sessions import SessionHint, parse_session
from dualpath.serving.bounded import off_loop
from dualpath.serving.choices import ApiError, Generation, Prompt
from dualpath.serving.json_bodies import error_body, parse
from dualpath.serving.protocol import ChatRequest, CompletionRequest
from dualpath.serving.streaming import ChunkStream, sse


@dataclass
class Job:
    """One generation request once submitted: what its reply is made of."""

    req: Any  # the chat or completions request its prompts and sampling were built from
    kind: str  # "chat" or "completions": how its prompts were built and its choices are shaped
    prompts: list[Prompt]
    samplings: list[SamplingParams]  # each prompt's, as submitted
    gens: list[Generation]  # one per choice, prompt after prompt (a prompt's choices together)
    label: str  # the HTTP request's id (``dualpath.serving.request_ids``)
    started: float  # perf_counter when it was submitted
    agent: SessionHint | None = None  # the agent session it is a turn of

    @property
    def rid(self) -> str:
        """The response's id: vLLM's, from the request's id."""
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.label}"


class GenerationCall(ABC):
    """One request of one API through the pipeline; made per request, so it may keep what it read. ``run`` calls
    ``read`` once, then ``stream`` or ``answer`` once; an implementation never submits or admits work itself."""

    endpoint = ""  # the ``http_requests_total`` label
    kind = "chat"

    @abstractmethod
    async def read(self, body: bytes, owner: str):
        """The request prompts and sampling are built from (a ``RequestError`` is the 400)."""

    def streams(self, req) -> bool:
        return req.stream

    def rids(self, n_prompts: int) -> list[str] | None:
        """Each prompt's name for ``/abort_request`` (None: the request's id)."""
        return None

    @abstractmethod
    def stream(self, job: Job):
        """The streamed body (an async iterator of text); it closes ``job``'s generations when it ends."""

    @abstractmethod
    async def answer(self, job: Job, got: tuple[list, list, list, list]) -> Any:
        """The JSON body from every choice gathered (``Generations.gather``)."""

    def param(self, name: str | None) -> str | None:
        """An error's ``param`` as this API names the field."""
        return name


class OpenAICall(GenerationCall):
    """A chat or completions request (``kind``), answered in OpenAI's shapes."""

    def __init__(self, front, kind: str):
        self.front, self.kind, self.endpoint = front, kind, kind

    async def read(self, body: bytes, owner: str):
        req = parse(ChatRequest if self.kind == "chat" else CompletionRequest, body)
        self.front.models.check(req.model)
        return req

    def stream(self, job: Job):
        return sse(ChunkStream(self.front, job).run())

    async def answer(self, job: Job, got) -> dict:
        return self.front.replies.body(job, got)


def prepared(front, req, kind: str) -> tuple[list[Prompt], list[SamplingParams]]:
    """The request's prompts and each one's sampling parameters (on a worker thread: it tokenizes and compiles)."""
    prompts = front.prompts.prompts(req, kind)
    return prompts, [front.samplings.sampling(req, kind, p) for p in prompts]


async def run(front, request, call: GenerationCall) -> Response:
    """``call``'s request through the pipeline (the module's docstring), answered."""
    status = 200
    try:
        owner = front.auth.caller(request).owner
        body = await request.body()
        try:
            req = await call.read(body, owner)
            agent = session_of(req, request.headers.get("x-session-id"))
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None
        prompts, samplings = await off_loop(prepared, front, req, call.kind)
        started, label = time.perf_counter(), request.state.request_id
        gens = await front.generations.start(req, prompts, samplings, call.rids(len(prompts)), label, owner, agent)
        job = Job(req, call.kind, prompts, samplings, gens, label, started, agent)
        if call.streams(req):
            return StreamingResponse(call.stream(job), media_type="text/event-stream")
        got = await front.generations.gather(request, gens)
        if got is None:
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
        answer = await call.answer(job, got)
        front.generations.end_turn(job, got[3][0])
        return JSONResponse(answer)
    except ApiError as e:
        status = e.status
        e.param = call.param(e.param)
        return e.response()
    finally:
        front.metrics.count(call.endpoint, status)


def session_of(req, header: str | None) -> SessionHint | None:
    """The agent session a request names: its ``dualpath.session`` field and/or the ``X-Session-Id`` header."""
    ext = getattr(req, "dualpath", None)
    return parse_session(ext.session if ext is not None else None, header)


def generation_router(front, path: str, call: Callable[[], GenerationCall]) -> APIRouter:
    """The router of one generation endpoint: ``POST path``, each request through the pipeline as a new ``call()``."""
    r = APIRouter()

    @r.post(path)
    async def generate(request: Request):
        return await run(front, request, call())

    return r
