"""The OpenAI-compatible HTTP frontend (FastAPI): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` (``dualpath.serving.responses``: a chat underneath), vLLM's ``/tokenize`` and ``/detokenize``,
SGLang's native endpoints (``dualpath.serving.native``), ``/health`` and the other self-reports
(``dualpath.serving.probes``) and Prometheus ``/metrics`` (its own series, and the scheduler's, engines' and KV
cache's: ``dualpath.scheduler.metrics``, pulled at each scrape); an access-log line per request (``dualpath.serving.watch``).

A request is tokenized here (chat template from the checkpoint), submitted to the scheduler through one shared
``ClusterClient`` session, and its tokens stream back from the decode engine; text is detokenized incrementally, stop
strings are matched here (where the text is cut; a choice ends at its first match, as it does on the decode engine,
and the request is cancelled once none runs), tool calls are parsed from chat replies here
(``dualpath.serving.tools``), and a client that disconnects cancels its request. Errors use OpenAI's JSON error
format. Who may call what (keys, owners, the admin routes, the directories weights load from):
``dualpath.serving.auth``; what one request or key may take (its body, its generation slots):
``dualpath.serving.guard``; tokenizing and chat rendering, bounded and off the event loop: ``dualpath.serving.bounded``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dualpath.client import ClusterClient, OverloadedError
from dualpath.core.errors import CheckpointError, DualPathError, RequestError
from dualpath.core.lora import LoraModule, adapter_digest, adapter_table, read_adapter_config
from dualpath.core.metrics import CONTENT_TYPE, Metrics
from dualpath.core.sampling_params import SamplingParams, model_defaults
from dualpath.core import structured
from dualpath.core.structured import choice_pattern
from dualpath.serving.choices import ApiError, Fanout, Generation, Outcome, Prompt, PromptLogprobs, best, drain, merge
from dualpath.serving.auth import ADMIN, ANONYMOUS, LORA, Auth, allowed_dirs, confined, is_loopback, owned_label
from dualpath.serving.bounded import CHARS_PER_TOKEN, RenderTimeout, off_loop, within
from dualpath.serving.native import NativeApi
from dualpath.serving.control import PAUSE_WAIT_S, Control
from dualpath.serving.guard import Admission, BodyGuard
from dualpath.serving.probes import Probes, ask_scheduler
from dualpath.serving.request_ids import RequestIds
from dualpath.serving.protocol import (
    AbortRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    PauseGenerationRequest,
    TokenizeRequest,
    UnloadLoraRequest,
    UpdateWeightsRequest,
    error_body,
    parse,
)
from dualpath.serving.reasoning import ReasoningSplitter, knows_thinking, prompt_opens_thinking
from dualpath.serving.response_store import DirectoryResponses, MemoryResponses
from dualpath.serving.responses import (
    ResponseCall,
    ResponsesRequest,
    event_stream,
    exchange_starts,
    input_items,
    item_page,
    remap_param,
    to_chat,
    without_exchanges,
)
from dualpath.serving.tools import ToolCallSplitter, structural_shape, tool_markup
from dualpath.serving.watch import AccessLog, current_access, scheduler_stats
from dualpath.core.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, load_tokenizer, stop_cut
from dualpath.scheduler.metrics import StatsCollector

log = logging.getLogger(__name__)
COMPILED_KEPT = 256  # schemas, patterns and request chat templates a frontend remembers as compiling


@dataclass(frozen=True)
class FrontendConfig:
    model_name: str
    model_dir: str
    scheduler: str
    max_model_len: int
    api_key: str | None = None  # an inference key (``dualpath.serving.auth``); none here or in api_keys: no key needed
    max_body_bytes: int = 16 << 20  # on every route, enforced while the body is read (``dualpath.serving.guard``)
    max_concurrent_requests: int = 512
    default_max_tokens: int = 1024
    max_stored_responses: int = 1024  # /v1/responses kept for GET and previous_response_id
    max_stored_response_bytes: int = 256 << 20  # and their bytes, all together (the oldest go first)
    responses_dir: str | None = None  # where they are kept (shared by every frontend); None: this process's memory
    reasoning_parser: str = "auto"  # "think": split <think> blocks from chat replies; "auto": if the template has them
    chat_template: str | None = None  # renders chats instead of the checkpoint's template (--chat-template)
    tool_call_parser: str = "auto"  # the tool-call markup (dualpath.serving.tools.TOOL_PARSERS); auto: the template's
    migration_limit: int = 3  # times a reply may move off decode engines that die while generating it (0: fail)
    health_generate_timeout_s: float = 20.0  # /health_generate's wait for a token (SGLang's default)
    model_aliases: tuple[str, ...] = ()  # other names requests may give the model (responses name model_name)
    trust_request_chat_template: bool = False  # render a chat request's own chat_template (vLLM's flag)
    generation_config: str = "auto"  # sampling defaults: the model's generation_config.json, "vllm" none, or a dir
    lora_modules: tuple[LoraModule, ...] = ()  # LoRA adapters requests may name as their model (the engines' too)
    api_keys: tuple[str, ...] = ()  # more inference keys (--api-key repeated, --api-key-file)
    admin_api_key: str | None = None  # what the admin routes need (distinct from every inference key)
    enable_admin_api: bool = False  # weight updates, adapters, flushes, pauses, server-wide aborts (else a 403)
    runtime_lora_updating: bool = False  # the adapter routes alone (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    bind_host: str = ""  # the address the server listens on: loopback alone lets admin routes go without an admin key
    allowed_model_dirs: tuple[str, ...] = ()  # where weights and adapters load from (none: beside model and adapters)
    max_concurrent_requests_per_key: int = 0  # 0: half the server's once two or more keys are set, else all of it
    render_timeout_s: float = 5.0  # a chat template's rendering is cut (a 400) after this long
    skip_tokenizer_init: bool = False  # no tokenizer (vLLM's flag): token-id prompts only, replies as token ids
    log_requests: bool = False  # an access-log line per request (dualpath.serving.watch): on in serve and frontend
    # (off there with --disable-log-requests), off in-process (run-batch's progress bar, tests)
    log_stats: bool = True  # the stats line every 10 s while busy (--disable-log-stats)


class Frontend:
    def __init__(self, cfg: FrontendConfig, client: ClusterClient | None = None, tokenizer: Tokenizer | None = None):
        self.cfg = cfg
        self.client = client or ClusterClient(cfg.scheduler, migration_limit=cfg.migration_limit)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model_dir, cfg.skip_tokenizer_init)
        if cfg.chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(cfg.chat_template)
        self.tool_markup = tool_markup(self.tokenizer.chat_template, cfg.tool_call_parser)
        self.reasons = cfg.reasoning_parser == "think" or (
            cfg.reasoning_parser == "auto" and knows_thinking(self.tokenizer.chat_template)
        )
        self.defaults = model_defaults(cfg.generation_config, cfg.model_dir)  # for the fields a request leaves out
        self.adapters = adapter_table(cfg.lora_modules, (cfg.model_name, *cfg.model_aliases))  # name -> identity
        self.adapter_dirs = {m.name: m.path for m in cfg.lora_modules}  # name -> PEFT directory (``/v1/models``)
        if self.defaults:
            log.info(
                "sampling defaults from the model's generation config (--generation-config vllm: none): %s",
                self.defaults,
            )
        self.created = int(time.time())
        self.auth = Auth(
            (cfg.api_key, *cfg.api_keys),
            cfg.admin_api_key,
            {ADMIN, LORA} if cfg.enable_admin_api else {LORA} if cfg.runtime_lora_updating else (),
            is_loopback(cfg.bind_host),
        )
        self.admission = Admission(
            cfg.max_concurrent_requests,
            cfg.max_concurrent_requests_per_key
            or (cfg.max_concurrent_requests // 2 if self.auth.inference_keys > 1 else cfg.max_concurrent_requests),
        )
        self.model_dirs = allowed_dirs(cfg.allowed_model_dirs, cfg.model_dir, (m.path for m in cfg.lora_modules))
        self._lock = threading.Lock()
        self._compiled: OrderedDict = OrderedDict()  # grammars known to compile, request templates (``_kept``)
        m = self.metrics = Metrics()
        self.m_requests = m.counter(
            "http_requests_total", "HTTP requests by endpoint and status", ["endpoint", "status"]
        )
        self.m_prompt = m.counter("prompt_tokens_total", "Prompt tokens of finished requests")
        self.m_lora = m.counter("lora_requests_total", "Generation requests by the LoRA adapter they name", ["adapter"])
        self.m_completion = m.counter("completion_tokens_total", "Generated tokens")
        self.m_cached = m.counter(
            "cached_tokens_total", "Prompt tokens whose KV came from storage, by read path", ["path"]
        )
        self.m_kv_bytes = m.counter(
            "kv_bytes_loaded_total", "KV bytes read from storage for requests, by read path", ["path"]
        )
        self.m_ttft = m.histogram("time_to_first_token_seconds", "Time to first token")
        self.m_tpot = m.histogram(
            "time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
        )
        self.m_e2e = m.histogram(
            "e2e_request_latency_seconds",
            "Time from a choice's arrival to its last token",
            buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
        )
        self.m_finished = m.counter(
            "requests_finished_total", "Choices generated to their end, by why they ended", ["finish_reason"]
        )
        self.m_inflight = m.gauge("requests_in_flight", "Requests being generated")
        self.m_cancelled = m.counter("requests_cancelled_total", "Requests cancelled because the client left")
        self.m_aborted = m.counter("requests_aborted_total", "Requests ended by /abort_request")
        self.m_migrations = m.counter(
            "request_migrations_total", "Replies moved to other decode engines after theirs died while generating them"
        )
        self.client.on_migration = lambda _rid: self.m_migrations.inc()
        self.m_inflight.set_function(lambda: self.in_flight)  # read at each scrape
        m.register(StatsCollector(partial(scheduler_stats, self.client)))  # the scheduler's, engines' and KV's series
        kept = (cfg.max_stored_responses, cfg.max_stored_response_bytes)
        self.responses = DirectoryResponses(cfg.responses_dir, *kept) if cfg.responses_dir else MemoryResponses(*kept)
        self.native = NativeApi(self)  # SGLang's /generate
        self.probes = Probes(self)  # /health and the like
        self.control = Control(self)  # /pause and /resume
        self.last_token_at = 0.0  # perf_counter of the last token any generation received (/health_generate)
        self.app = self._build()

    # --- app ------------------------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="DualPath", docs_url=None, redoc_url=None)
        app.add_middleware(BodyGuard, max_bytes=self.cfg.max_body_bytes)
        if self.cfg.log_requests:  # inside RequestIds: its line names the request's id
            app.add_middleware(AccessLog)
        app.add_middleware(RequestIds)  # the outer one: a body refused by the guard still answers with an id

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException):
            return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, None), exc.status_code)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def query_error(request: Request, exc: RequestValidationError):  # a query parameter of a GET
            where = next(iter(exc.errors()), {})
            name = str(where.get("loc", ("", ""))[-1])
            return JSONResponse(
                error_body(f"{name}: {where.get('msg', 'invalid')}", "invalid_request_error", name, None), 400
            )

        @app.get("/health")
        async def health():
            return await self.probes.health()

        @app.get("/live")  # liveness: this process answers (a cluster short of engines is /health's 503)
        async def live():
            return {"status": "alive"}

        @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's health check)
        async def ping():
            return await self.probes.health()

        @app.get("/health_generate")
        async def health_generate():
            return await self.probes.health_generate()

        @app.get("/version")
        async def version():
            return self.probes.version()

        @app.get("/load")  # vLLM's (--enable-server-load-tracking; always on here): a load balancer's input
        async def load():
            return {"server_load": self.in_flight}

        @app.get("/get_model_info")
        async def model_info(request: Request):
            self.auth.caller(request)
            return await self.probes.model_info()

        @app.get("/get_server_info")
        async def server_info(request: Request):
            self.auth.caller(request)
            return await self.probes.server_info()

        @app.get("/metrics")
        async def metrics():
            # on a worker thread: collecting the scheduler's series is an RPC
            return Response(await asyncio.to_thread(self.metrics.render), media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models(request: Request):
            self.auth.caller(request)
            return {
                "object": "list",
                "data": [self._model_card(n) for n in (self.cfg.model_name, *self.cfg.model_aliases, *self.adapters)],
            }

        @app.get("/v1/models/{name:path}")  # OpenAI's retrieve; a name may hold slashes ("Qwen/Qwen2.5-7B")
        async def model(name: str, request: Request):
            self.auth.caller(request)
            self._check_model(name)
            return self._model_card(name)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._endpoint(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._endpoint(request, "completions")

        @app.post("/v1/responses")
        async def responses(request: Request):
            return await self._endpoint(request, "responses")

        @app.get("/v1/responses/{rid}")
        async def get_response(rid: str, request: Request):
            return JSONResponse((await self._stored(rid, self.auth.caller(request).owner))[0])

        @app.get("/v1/responses/{rid}/input_items")
        async def response_input_items(
            rid: str,
            request: Request,
            limit: int = 20,
            order: str = "desc",
            after: str | None = None,
            before: str | None = None,
        ):
            entry = await self._stored(rid, self.auth.caller(request).owner)
            return JSONResponse(item_page(entry[2], limit, order, after, before))

        @app.delete("/v1/responses/{rid}")
        async def delete_response(rid: str, request: Request):
            owner = self.auth.caller(request).owner
            if not await asyncio.to_thread(self.responses.delete, rid, owner):
                await self._stored(rid, owner)  # the 404
            return JSONResponse({"id": rid, "object": "response", "deleted": True})

        @app.post("/tokenize")
        async def tokenize(request: Request):
            return await self._utility(request, "tokenize", TokenizeRequest, self._tokenize)

        @app.post("/detokenize")
        async def detokenize(request: Request):
            return await self._utility(request, "detokenize", DetokenizeRequest, self._detokenize)

        @app.post("/generate")
        async def generate(request: Request):
            return await self.native.generate(request)

        @app.post("/abort_request")  # by rid: the caller's own requests (an admin's: anyone's); abort_all: admin
        async def abort_request(request: Request):
            return await self._utility(request, "abort_request", AbortRequest, partial(self._abort, request=request))

        # the admin routes (``dualpath.serving.auth``): off unless enabled, then only for the admin key
        @app.post("/update_weights_from_disk")
        async def update_weights(request: Request):
            return await self._utility(request, "update_weights", UpdateWeightsRequest, self._update_weights, ADMIN)

        for prefix in ("/v1", ""):  # vLLM's paths, and SGLang's
            app.post(f"{prefix}/load_lora_adapter")(
                self._adapter_endpoint("load_lora_adapter", LoadLoraRequest, self._load_adapter)
            )
            app.post(f"{prefix}/unload_lora_adapter")(
                self._adapter_endpoint("unload_lora_adapter", UnloadLoraRequest, self._unload_adapter)
            )

        @app.post("/pause")  # vLLM's
        async def pause(
            request: Request,
            mode: str = "abort",
            wait_for_inflight_requests: bool = False,
            clear_cache: bool = True,
            timeout: float = PAUSE_WAIT_S,
        ):  # clear_cache: nothing to clear
            return await self._control(
                request, "pause", self.control.pause(mode, wait_for_inflight_requests, timeout), ADMIN
            )

        @app.post("/resume")
        async def resume(request: Request):
            return await self._control(request, "resume", self.control.resume(), ADMIN)

        @app.get("/is_paused")
        async def is_paused(request: Request):
            return await self._control(request, "is_paused", self.control.is_paused())

        @app.post("/pause_generation")  # SGLang's
        async def pause_generation(request: Request):
            return await self._utility(
                request, "pause_generation", PauseGenerationRequest, self.control.pause_generation, ADMIN
            )

        @app.post("/continue_generation")
        async def continue_generation(request: Request):
            return await self._control(request, "continue_generation", self.control.resume(), ADMIN)

        @app.post("/flush_cache")  # SGLang's (older releases took a GET: here no GET changes anything)
        async def flush_cache(request: Request):
            return await self._control(request, "flush_cache", self.control.flush_cache(), ADMIN)

        @app.post("/reset_prefix_cache")  # vLLM's
        async def reset_prefix_cache(request: Request):
            return await self._control(request, "reset_prefix_cache", self.control.flush_cache(), ADMIN)

        @app.get("/get_weight_version")
        async def weight_version(request: Request):
            self.auth.caller(request)
            return await self.probes.weight_version()

        return app

    async def _control(self, request: Request, name: str, answer, admin: str | None = None) -> JSONResponse:
        """A request that is not a generation, once its caller is checked (an admin route's, of group ``admin``,
        at the admin gate): ``answer`` is the coroutine that gives its JSON body or its response (closed unrun when
        the caller is refused); counted in ``http_requests_total``."""
        status = 200
        try:
            self.auth.admin(request, admin) if admin else self.auth.caller(request)
            out = await answer
            if isinstance(out, JSONResponse):
                status = out.status_code
                return out
            return JSONResponse(out)
        except ApiError as e:
            status = e.status
            return e.response()
        finally:
            answer.close()  # a no-op once awaited
            self.m_requests.labels(endpoint=name, status=status).inc()

    async def _utility(self, request: Request, name: str, model_cls, answer, admin: str | None = None) -> JSONResponse:
        """One with a body (vLLM's /tokenize and /detokenize, SGLang's weight update): ``answer(req)`` gives a JSON
        body, or (awaited) a response. The body is read once the caller passed (``_control``)."""

        async def parsed_and_answered():
            try:
                req = parse(model_cls, await request.body() or b"{}")  # no body: every field's default
            except RequestError as e:
                raise ApiError(400, str(e), param=e.field) from None
            if getattr(req, "model", None) is not None:
                self._check_model(req.model)
            out = answer(req)
            return await out if inspect.isawaitable(out) else out

        return await self._control(request, name, parsed_and_answered(), admin)

    async def _tokenize(self, req: TokenizeRequest) -> dict:
        def tokenized() -> list[int]:
            try:
                if req.messages is not None:
                    return self._chat_ids(req)
                return self._encode(req.prompt, "prompt", req.add_special_tokens)
            except RequestError as e:
                raise ApiError(400, str(e), param=e.field) from None

        ids = await off_loop(tokenized)
        return {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids}

    async def _detokenize(self, req: DetokenizeRequest) -> dict:
        if not self.tokenizer.takes_text:  # (its empty text would read as an answer)
            raise ApiError(400, self.tokenizer.refusal("/detokenize"), param="tokens")
        if len(req.tokens) > self.cfg.max_model_len:
            raise ApiError(400, f"tokens: at most the model's context of {self.cfg.max_model_len}", param="tokens")
        ids = self._known_ids(req.tokens, "tokens")
        return {"prompt": await off_loop(self.tokenizer.decode, ids)}

    async def _update_weights(self, req: UpdateWeightsRequest) -> JSONResponse:
        """SGLang's ``/update_weights_from_disk``: every engine loads the checkpoint's weights (the scheduler pauses
        admission and drains first) from under the allowed directories. 200 when all did; 400 when none could (the
        old weights stay); 500 when some could not (they left the cluster, which serves the new weights on the
        others)."""
        path = confined(req.model_path, self.model_dirs, "model_path")
        try:
            reply = await asyncio.to_thread(
                self.client.update_weights, path, req.weight_version or "", req.timeout, req.abort_all_requests
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

    def _adapter_endpoint(self, name: str, model_cls, answer):
        async def endpoint(request: Request):
            return await self._utility(request, name, model_cls, answer, LORA)

        return endpoint

    async def _load_adapter(self, req: LoadLoraRequest) -> JSONResponse:
        """Every engine loads the adapter (and every engine that joins later) from under the allowed directories;
        then requests may name it. 400 for an adapter that cannot be served or a name in use, 500 when an engine
        could not load it."""
        if req.lora_name in self.adapters or req.lora_name in (self.cfg.model_name, *self.cfg.model_aliases):
            raise ApiError(400, f"the model name {req.lora_name!r} is in use; unload it first", param="lora_name")
        path = confined(req.lora_path, self.model_dirs, "lora_path")
        try:
            await asyncio.to_thread(read_adapter_config, path)
            digest = await asyncio.to_thread(adapter_digest, path)
        except CheckpointError as e:
            raise ApiError(400, str(e), param="lora_path") from None
        try:
            reply = await asyncio.to_thread(self.client.load_adapter, path)
        except DualPathError as e:
            raise ApiError(503, f"the scheduler did not answer: {e}") from None
        if not reply.ok or reply.digest != digest:
            raise ApiError(500, reply.error or f"the engines read other bytes of {path} than this frontend")
        self.adapters[req.lora_name], self.adapter_dirs[req.lora_name] = digest, req.lora_path
        log.info("serving LoRA adapter %s (%s) on %d engines", req.lora_name, path, reply.engines)
        return JSONResponse(
            {"success": True, "message": f"Success: LoRA adapter '{req.lora_name}' added successfully."}
        )

    def _unload_adapter(self, req: UnloadLoraRequest) -> JSONResponse:
        """Requests may no longer name the adapter (those running under it finish); the engines keep its weights
        until they stop, so a request already queued under it still runs."""
        if req.lora_name not in self.adapters:
            raise ApiError(
                404, f"the LoRA adapter {req.lora_name!r} cannot be found", param="lora_name", code="model_not_found"
            )
        del self.adapters[req.lora_name], self.adapter_dirs[req.lora_name]
        return JSONResponse(
            {"success": True, "message": f"Success: LoRA adapter '{req.lora_name}' removed successfully."}
        )

    def _model_card(self, name: str) -> dict:
        card = {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "dualpath",
            "root": self.cfg.model_dir,  # vLLM's: what each served name is
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
        }  # which clients size prompts by
        if name in self.adapter_dirs:  # vLLM's card of a LoRA adapter: its directory, and the model it adapts
            card.update(root=self.adapter_dirs[name], parent=self.cfg.model_name)
        return card

    def _check_model(self, name: str) -> None:
        if name != self.cfg.model_name and name not in self.cfg.model_aliases and name not in self.adapters:
            names = " or ".join(repr(n) for n in (self.cfg.model_name, *self.cfg.model_aliases, *self.adapters))
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {names}",
                param="model",
                code="model_not_found",
            )

    def _reply_model(self, req) -> str:
        """The ``model`` a reply names: the adapter asked for (as vLLM names it), else the first served name."""
        return req.model if req.model in self.adapters else self.cfg.model_name

    async def _endpoint(self, request: Request, kind: str):
        """Chat and completions requests, and the Responses API's (``kind`` "responses": answered as a chat)."""
        status, call = 200, None
        try:
            owner = self.auth.caller(request).owner
            body = await request.body()
            try:
                req = parse(
                    {"chat": ChatRequest, "completions": CompletionRequest, "responses": ResponsesRequest}[kind], body
                )
                self._check_model(req.model)
                if kind == "responses":
                    history = await self._history(req.previous_response_id, owner)
                    call = ResponseCall(req, self._reply_model(req), history, self.defaults)
                    req = await off_loop(self._fitted, call)  # renders the chat a few times
            except RequestError as e:
                raise ApiError(400, str(e), param=e.field) from None
            chat_kind = "completions" if kind == "completions" else "chat"
            prompts, samplings = await off_loop(self._prepared, req, chat_kind)
            label = request.state.request_id
            gens = await self._start(req, prompts, samplings, label=label, owner=owner)
            rid = f"{'chatcmpl' if chat_kind == 'chat' else 'cmpl'}-{label}"  # vLLM's ids, from X-Request-Id
            keep = partial(self._respond, owner=owner)
            if req.stream:
                chunks = self._chunks(gens, req, chat_kind, prompts, rid)
                events = (
                    self._sse(chunks) if call is None else event_stream(call, chunks, self.client.block_size(), keep)
                )
                return StreamingResponse(events, media_type="text/event-stream")
            answer = await self._collect(request, gens, req, chat_kind, prompts, rid)
            if answer is None:
                return JSONResponse(error_body("client disconnected", "invalid_request_error"), 499)
            if call is not None:
                answer = await keep(call, call.from_chat(answer, self.client.block_size()))
            return JSONResponse(answer)
        except ApiError as e:
            status = e.status
            if call is not None:
                e.param = remap_param(e.param)
            return e.response()
        finally:
            self.m_requests.labels(endpoint=kind, status=status).inc()

    async def _stored(self, rid: str, owner: str) -> tuple[dict, list[dict], list[dict]]:
        """The stored response ``rid`` if ``owner``'s: another owner's is as absent (404) as one never stored."""
        entry = await asyncio.to_thread(self.responses.get, rid, owner)  # a file, maybe on a network filesystem
        if entry is None:
            whose = "" if owner == ANONYMOUS else ", each for the API key that stored it"
            raise ApiError(
                404,
                f"no stored response with id {rid!r} (kept: the last {self.cfg.max_stored_responses} "
                f"with store true{whose})",
                code="not_found",
            )
        return entry

    def _fitted(self, call: ResponseCall) -> ChatRequest:
        """The chat a Responses call asks for; with ``truncation: "auto"``, without as few of its earliest exchanges
        as make it fit the context with room for ``max_output_tokens`` (at least one token). The cut moves by whole
        exchanges, so the next turns mostly cut at the same place and their prefixes still hit the KV store."""
        chat = to_chat(call.req, call.history)
        if call.req.truncation != "auto":
            return chat
        room = self.cfg.max_model_len - (call.req.max_output_tokens or 1)
        fits = lambda c: len(self._chat_ids(c)) <= room  # noqa: E731
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

    async def _history(self, previous: str | None, owner: str) -> list[dict]:
        """The conversation a ``previous_response_id`` of ``owner``'s ended (none without one)."""
        if previous is None:
            return []
        try:
            return (await self._stored(previous, owner))[1]
        except ApiError as e:
            raise ApiError(400, str(e), param="previous_response_id", code="previous_response_not_found") from None

    async def _respond(self, call: ResponseCall, response: dict, owner: str) -> dict:
        if call.req.store:
            await asyncio.to_thread(
                self.responses.put, response, call.conversation(response), input_items(call.req.input), owner
            )
        return response

    async def _start(
        self,
        req,
        prompts: list[Prompt],
        samplings: list[SamplingParams],
        rids: list[str] | None = None,
        label: str = "",
        owner: str = ANONYMOUS,
    ) -> list:
        """Submit each prompt (its ``n`` choices are sampled from one prefill, choice i with seed + i when seeded);
        one generator per choice (``_generate``), prompt after prompt. Admission counts every choice, the server's
        and ``owner``'s. ``rids``: each prompt's name for ``/abort_request`` (SGLang's ``rid``; default: ``label``),
        in ``owner``'s namespace. ``label``: the HTTP request's id, which begins each prompt's id at the scheduler
        and engines (their logs name it; a random suffix keeps ids unique when clients reuse theirs)."""
        k = req.samples()
        total = k * len(prompts)
        if total > self.admission.most(owner):
            raise ApiError(
                400,
                f"{len(prompts)} prompt(s) x {k} choices exceed the "
                f"{self.admission.most(owner)} concurrent generations one request may have",
                param="prompt" if len(prompts) > 1 else "n",
            )
        self.admission.take(owner, total)
        done = partial(self.admission.give, owner)
        if req.model in self.adapters:
            self.m_lora.labels(adapter=req.model).inc()
        mode = (req.dualpath.mode or "") if req.dualpath else ""
        gens, loop = [], asyncio.get_running_loop()
        try:
            for j, (p, sampling) in enumerate(zip(prompts, samplings)):
                sid = f"{label}-{uuid.uuid4().hex[:8]}" if label else None
                name = owned_label(owner, (rids[j] if rids else "") or label)
                handle = await asyncio.to_thread(self.client.start, p.ids, sampling, sid, mode, name)
                fan = Fanout(handle, k, loop)
                gens += [Generation(self._generate(fan, i, p.ids, sampling, done), fan, done) for i in range(k)]
        except BaseException as e:
            for g in gens:  # the prompts already submitted are cancelled
                await g.aclose()
            if total > len(gens):
                done(total - len(gens))
            if isinstance(e, DualPathError):  # the scheduler is unreachable or refused the submission
                raise ApiError(
                    503, f"the request could not be submitted: {e}", "server_error", headers={"Retry-After": "1"}
                ) from None
            raise
        return gens

    @property
    def in_flight(self) -> int:
        """Generations (choices) in flight through this frontend."""
        return self.admission.total

    async def _abort(self, req: AbortRequest, request: Request) -> dict:
        """SGLang's ``/abort_request``: the requests named ``rid`` (``/generate``'s rid, or another endpoint's
        X-Request-Id), or all (``abort_all``), end where they are, whichever frontend they came through (the
        scheduler ends them); each choice answers with what it generated so far and finish reason ``abort`` (an RL
        trainer's partial rollouts at a weight update). A rid names the caller's own requests (an admin's: every
        key's); none in flight is a 404, as another key's are. ``abort_all`` is an admin route."""
        if not req.rid and not req.abort_all:
            raise ApiError(400, "give the rid of the request(s) to abort, or abort_all", param="rid")
        if req.abort_all:
            self.auth.admin(request)
            n = await ask_scheduler(self.client.abort, "", True)
        else:
            owners = self.auth.owners() if self.auth.is_admin(request) else (self.auth.caller(request).owner,)
            n = 0
            for owner in owners:
                n += await ask_scheduler(self.client.abort, owned_label(owner, req.rid), False)
            if not n:
                raise ApiError(404, f"no request named {req.rid!r} is in flight", param="rid", code="not_found")
        self.m_aborted.inc(n)
        return {"aborted": n}

    # --- request -> tokens and sampling (on the worker threads: ``dualpath.serving.bounded``) -----------------
    def _prepared(self, req, kind: str) -> tuple[list[Prompt], list[SamplingParams]]:
        """The request's prompts and each one's sampling parameters."""
        prompts = self._prompts(req, kind)
        return prompts, [self._sampling(req, kind, p) for p in prompts]

    def _prompts(self, req, kind: str) -> list[Prompt]:
        """The request's prompts as token ids (a chat's one, rendered; a completion's one or batch)."""
        try:
            if kind == "chat":
                return [Prompt(self._truncated(req, self._chat_ids(req)), None)]
            out = []
            for p in req.prompts():
                ids = self._prompt_ids(req, p)
                kept = self._truncated(req, ids)  # echo repeats a text prompt as sent, unless it was cut
                out.append(Prompt(kept, p if isinstance(p, str) and len(kept) == len(ids) else None))
            return out
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None

    def _prompt_ids(self, req: CompletionRequest, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, "prompt", req.add_special_tokens)
        return self._known_ids(prompt, "prompt")

    def _encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids, if it is no longer than a prompt of the model's context can be (a longer one is
        refused before it is tokenized)."""
        most = CHARS_PER_TOKEN * self.cfg.max_model_len
        if len(text) > most:
            raise RequestError(
                f"{field}: {len(text)} characters, more than the {most} a prompt of the model's "
                f"context of {self.cfg.max_model_len} tokens may have ({CHARS_PER_TOKEN} a token)",
                field=field,
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _truncated(self, req, ids: list[int]) -> list[int]:
        keep = req.truncate_prompt_tokens
        return ids[-(self.cfg.max_model_len if keep == -1 else keep) :] if keep else ids

    def _chat_ids(self, req: ChatRequest | TokenizeRequest) -> list[int]:
        """The chat rendered (within ``render_timeout_s``) and tokenized (``_encode``'s bound), as
        ``Tokenizer.apply_chat_template`` does: the template writes the special tokens."""
        own = getattr(req, "chat_template", None)
        renderer = self._renderer(own)
        variables = {
            **self._effort(req, renderer),
            **req.render_options(),
            **self._documents(req, renderer),
            **self._tools(req),
        }  # chat_template_kwargs may set reasoning_effort too (vLLM's way for some)
        field = "chat_template" if own is not None else "messages"
        try:
            text = within(
                self.cfg.render_timeout_s, renderer.render_chat, [m.for_template() for m in req.messages], **variables
            )
        except RenderTimeout:
            raise RequestError(
                f"{field}: the chat template's rendering ran past {self.cfg.render_timeout_s:g} s", field=field
            ) from None
        return self._encode(text, field, False)

    @staticmethod
    def _effort(req, renderer: Tokenizer) -> dict:
        """OpenAI's ``reasoning_effort`` as the template's variable of that name (gpt-oss's, say); refused, as OpenAI
        refuses it for models that do not reason, where the template never reads it."""
        effort = getattr(req, "reasoning_effort", None)
        if effort is None:
            return {}
        if "reasoning_effort" not in (renderer.chat_template or ""):
            raise RequestError("this model's chat template takes no reasoning_effort", field="reasoning_effort")
        return {"reasoning_effort": effort}

    @staticmethod
    def _documents(req, renderer: Tokenizer) -> dict:
        """The template's ``documents`` variable (vLLM's, for RAG templates such as Command R's); refused where the
        template would drop them unread."""
        docs = getattr(req, "documents", None)
        if not docs:
            return {}
        if "documents" not in (renderer.chat_template or ""):
            raise RequestError(
                "this model's chat template does not read documents; put them in a message", field="documents"
            )
        return {"documents": docs}

    def _renderer(self, template: str | None) -> Tokenizer:
        """The tokenizer that renders a chat: the server's, or with a request's own template (vLLM's
        ``--trust-request-chat-template``: a template runs in a Jinja sandbox, but can still spend the server's CPU).
        The COMPILED_KEPT most recent templates stay compiled."""
        if template is None:
            return self.tokenizer
        if not self.cfg.trust_request_chat_template:
            raise RequestError(
                "a request's own chat_template is rendered only with --trust-request-chat-template",
                field="chat_template",
            )
        try:
            return self._kept(("template", template), lambda: self.tokenizer.with_chat_template(template))
        except CheckpointError as e:
            raise RequestError(str(e), field="chat_template") from None

    def _known_ids(self, ids, field: str) -> list[int]:
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"{field}: token ids must be in [0, {vocab})", param=field)
        return list(ids)

    def _bad_word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's reading of ``bad_words``: each word's tokens both as text begins with it and after a space (the two
        often differ: byte-level BPE folds the space into the word's first token)."""
        encode = self.tokenizer.encode
        return tuple(
            ids
            for w in words
            for text in (w.lstrip(), " " + w.lstrip())
            if (ids := tuple(encode(text, add_special_tokens=False)))
        )

    def _known_bias(self, pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        self._known_ids([t for t, _ in pairs], "logit_bias")
        return pairs

    def _tools(self, req: ChatRequest | TokenizeRequest) -> dict:
        """The chat template's ``tools`` argument: the request's tools when the model may call them."""
        if not req.calls_tools():
            return {}
        if self.tool_markup is None:
            raise ApiError(
                400,
                "this model's chat template does not render tools, so its answers cannot be parsed "
                "for tool calls; send no tools, or tool_choice 'none'",
                param="tools",
            )
        return {"tools": [t.model_dump(exclude_none=True) for t in req.tools]}

    def _splitter(self, req, kind: str) -> ToolCallSplitter | None:
        """The tool-call parser of a chat request that offers tools (None otherwise)."""
        if kind != "chat" or not req.calls_tools():
            return None
        params = {t.function.name: t.function.parameters or {} for t in req.tools}
        return ToolCallSplitter(self.tool_markup.for_tools(params), req.tool_names(), req.parallel_tool_calls)

    def _thinking(self, kind: str, prompt: Prompt) -> str:
        """How a reasoning model's chat reply starts: "open" inside the think block its prompt opened, "optional"
        with a block it may open itself; "" for other models' replies (``SamplingParams.json_thinking``)."""
        if kind != "chat" or not self.reasons:
            return ""
        tail = self.tokenizer.decode(prompt.ids[-16:], skip_special_tokens=False)  # the generation prompt
        return "open" if prompt_opens_thinking(tail) else "optional"

    def _reasoner(self, kind: str, prompt: Prompt) -> ReasoningSplitter | None:
        """The splitter of a reasoning model's chat reply into thinking and answer (None for other models). A
        constrained reply (JSON output, a forced call) is constrained only after the thinking, so it splits too."""
        thinking = self._thinking(kind, prompt)
        return ReasoningSplitter(thinking == "open") if thinking else None

    def _sampling(self, req, kind: str, prompt: Prompt) -> SamplingParams:
        n_prompt = len(prompt.ids)
        room = self.cfg.max_model_len - n_prompt
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {n_prompt} tokens; the model's context is {self.cfg.max_model_len}",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        wanted = req.max_new() if kind == "chat" else req.max_tokens
        if wanted is not None and wanted > room:
            raise ApiError(
                400,
                f"prompt ({n_prompt} tokens) plus max_tokens ({wanted}) exceeds the model's context "
                f"of {self.cfg.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = wanted or min(room, self.defaults.get("max_tokens", self.cfg.default_max_tokens))
        fields = req.sampling_fields()
        fields.update({k: v for k, v in self.defaults.items() if k in fields and k not in req.model_fields_set})
        if kind == "chat":
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:  # best_of ranks its candidates by their tokens' logprobs
            logprobs = req.logprobs if req.logprobs is not None or req.samples() == req.n else 0
        try:
            self._needs_no_text(req, fields)
            return SamplingParams(
                max_tokens=max_tokens,
                logprobs=logprobs,
                **fields,
                stop_token_ids=self._known_ids(req.stop_token_ids or (), "stop_token_ids"),
                logit_bias=self._known_bias(req.bias_pairs()),
                allowed_token_ids=self._known_ids(req.allowed_token_ids or (), "allowed_token_ids"),
                bad_words=self._bad_word_ids(req.bad_words or ()),
                adapter=self.adapters.get(req.model, ""),
                **self._structured(req, kind, self._thinking(kind, prompt)),
            )
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None

    def _needs_no_text(self, req, fields: dict) -> None:
        """Without a tokenizer (``--skip-tokenizer-init``) what needs text is refused (a RequestError), never
        silently ignored: stop strings, bad words, structured output."""
        if not self.tokenizer.takes_text:
            self.tokenizer.check_sampling(fields.get("stop"), req.structured() is not None)
            if req.bad_words:
                self.tokenizer.refuse("bad_words", "bad_words")

    def _structured(self, req, kind: str, thinking: str) -> dict:
        """The sampling fields of a JSON-mode, schema, regex, choice or grammar request, checked here (so an unsupported
        schema, pattern or checkpoint is a 400, not a failed generation): the engines need a tokenizer whose tokens'
        bytes are known.
        A reasoning model thinks first (``thinking``), constrained only after."""
        asked = req.structured()
        if asked is None:
            call = (self._forced_call(req) or self._strict_calls(req)) if kind == "chat" else {}
            return {**call, "json_thinking": thinking} if call else {}
        field, mode, what = asked
        if kind == "chat" and req.calls_tools() and mode != "structural_tag":  # a structural tag may hold the calls
            raise ApiError(
                400,
                f"{field} ({mode}) with tools is not supported: a tool call's markup is not what "
                "it constrains; send one or the other (or tool_choice 'none')",
                param=field,
            )
        try:
            self.tokenizer.token_bytes
            if mode == "json_object":
                return {"json_object": True, "json_thinking": thinking}
            if mode in ("regex", "choice"):
                pattern = what if mode == "regex" else choice_pattern(what)
                self._compiles("regex", pattern)
                return {"regex": pattern, "json_thinking": thinking}
            if mode == "grammar":
                self._compiles("grammar", what)
                return {"grammar": what, "json_thinking": thinking}
            if mode == "structural_tag":
                shape = structural_shape(*what)
                self._compiles("schema", shape.schema)
                return {**shape.sampling(trigger=True), "json_thinking": thinking}
            self._compiles("schema", what)
            return {"json_schema": json.dumps(what), "json_thinking": thinking}
        except (CheckpointError, RequestError) as e:
            raise ApiError(400, str(e), param=field) from None

    def _compiles(self, kind: str, what) -> None:
        """Compile what the engines will compile (its errors are the request's: a 400, not a failed generation).
        Agents send the same few schemas and patterns again and again: what compiled lately is not compiled again."""
        constraint = (
            structured.Constraint("json", json.dumps(what)) if kind == "schema" else structured.Constraint(kind, what)
        )

        def compiles() -> bool:  # kept as known to compile, not the compiled grammar (the engines compile their own)
            structured.check(constraint)
            return True

        self._kept((kind, what if kind != "schema" else json.dumps(what, sort_keys=True)), compiles)

    def _kept(self, key, make):
        """``make()``'s value for ``key``, made again only once it left the COMPILED_KEPT most recent keys (what
        ``make`` raises is raised, nothing kept)."""
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        value = make()
        with self._lock:
            self._compiled[key] = value
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return value

    def _forced_call(self, req: ChatRequest) -> dict:
        """Sampling fields that make the reply one call to a tool (``tool_choice`` "required" or named): the
        template's call markup around a JSON object whose schema is the function's name and parameters."""
        functions = req.forced_functions()
        if not functions:
            return {}
        if self.tool_markup is None:
            return {}  # _tools refuses the request (no markup to write the call in)
        try:
            shape = self.tool_markup.forced(functions)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None
        try:
            self.tokenizer.token_bytes
            self._compiles("schema", shape.schema)
        except (CheckpointError, RequestError) as e:
            raise ApiError(
                400, f"tool_choice {'required' if req.tool_choice == 'required' else 'named'}: {e}", param="tools"
            ) from None
        return shape.sampling()

    def _strict_calls(self, req: ChatRequest) -> dict:
        """Sampling fields that hold the calls a reply makes under ``tool_choice`` "auto" to the tools' schemas
        where a tool is ``strict`` (OpenAI's strict function calling): the text stays free, each call it begins is
        constrained (a tool that is not strict takes any object). Where the markup cannot recognise a call as it
        begins (Llama 3's, DeepSeek's) nothing is constrained: the calls are parsed as ever."""
        if not req.calls_tools() or req.forced_functions() or self.tool_markup is None:
            return {}
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
        if not any(f.get("strict") for f in functions):
            return {}
        shape = self.tool_markup.triggered(
            [f if f.get("strict") else {**f, "parameters": {"type": "object"}} for f in functions]
        )
        if shape is None:
            return {}
        try:
            self.tokenizer.token_bytes
            self._compiles("schema", shape.schema)
        except (CheckpointError, RequestError) as e:
            raise ApiError(400, f"strict tools: {e}", param="tools") from None
        return shape.sampling(trigger=True)

    # --- generation -----------------------------------------------------------------------------------------
    async def _generate(
        self, fan: Fanout, index: int, prompt: list[int], sampling: SamplingParams, done
    ) -> AsyncIterator[Any]:
        """Choice ``index``: yields ``(text delta, token ids, logprobs)`` per token, then the ``Outcome``. Closing
        it before its end lets go of the request (cancelled once no choice wants it); ``done()`` gives back its
        admission slot."""
        events = fan.queues[index]
        detok = IncrementalDetokenizer(self.tokenizer, prompt, sampling.skip_special_tokens)
        stops, hold = sampling.stop, max((len(s) for s in sampling.stop), default=1) - 1
        text, emitted, outcome, finished = "", 0, Outcome(), False
        start, first, last = time.perf_counter(), None, None
        try:
            while True:
                ev = await events.get()
                if ev is None:
                    break
                if isinstance(ev, BaseException):
                    if isinstance(ev, OverloadedError):
                        raise ApiError(503, str(ev), "server_error", headers={"Retry-After": "1"})
                    if isinstance(ev, RequestError):
                        raise ApiError(400, str(ev), param=ev.field)
                    raise ApiError(500, f"generation failed: {ev}", "server_error")
                lp = None
                if ev.token_id >= 0:
                    now = self.last_token_at = time.perf_counter()
                    first, last = first or now, now
                    outcome.completion_tokens += 1
                    text += detok.add(ev.token_id)
                    lp = ev.logprob
                if ev.prompt_logprobs is not None:  # on a choice's first event
                    outcome.prompt_logprobs = ev.prompt_logprobs
                    yield PromptLogprobs(ev.prompt_logprobs)
                if ev.finish_reason:
                    text += detok.flush()
                # min_tokens: stop strings do not end the reply before that many tokens
                cut = _find_stop(text, stops, emitted) if outcome.completion_tokens >= sampling.min_tokens else -1
                if cut >= 0:  # a stop string: emit what precedes it (and it, if asked), then cancel the rest
                    yield (
                        text[emitted : stop_cut(text, stops, cut, sampling.include_stop_str_in_output)],
                        [ev.token_id],
                        lp,
                    )
                    outcome.finish_reason, finished = "stop", True
                    fan.release(early=True)
                    break
                safe = len(text) if ev.finish_reason else max(emitted, len(text) - hold)
                if ev.token_id >= 0 or safe > emitted:
                    yield text[emitted:safe], [ev.token_id] if ev.token_id >= 0 else [], lp
                    emitted = safe
                if ev.finish_reason:
                    outcome.finish_reason = ev.finish_reason if ev.finish_reason in ("length", "abort") else "stop"
                    outcome.cached_tokens, outcome.path = ev.num_cached_tokens, ev.path
                    outcome.storage_bytes = ev.storage_bytes
                    finished = True
                    fan.release(early=False)
                    break
            if not finished:
                raise ApiError(500, "generation ended without a finish reason", "server_error")
            self._observe(outcome, len(prompt) if index == 0 else 0, start, first, last)  # the prompt ran once
            yield outcome
        finally:
            if not finished:
                fan.release(early=True)
                self.m_cancelled.inc()
            done()

    def _observe(self, o: Outcome, n_prompt: int, start: float, first, last) -> None:
        self.m_prompt.inc(n_prompt)
        self.m_completion.inc(o.completion_tokens)
        self.m_cached.labels(path=o.path or "none").inc(o.cached_tokens)
        self.m_kv_bytes.labels(path=o.path or "none").inc(o.storage_bytes)
        self.m_finished.labels(finish_reason=o.finish_reason or "unknown").inc()
        if (access := current_access()) is not None:
            access.note(n_prompt, o, first)
        self.m_e2e.observe((last if last is not None else time.perf_counter()) - start)
        if first is not None:
            self.m_ttft.observe(first - start)
            if o.completion_tokens > 1:
                self.m_tpot.observe((last - first) / (o.completion_tokens - 1))

    # --- responses ------------------------------------------------------------------------------------------
    def _usage(self, req, prompts: list[Prompt], outcomes: list[Outcome]) -> dict:
        """Each prompt counted once, every sampled choice's completion tokens (``best_of``'s unreturned ones too);
        the cache hit and KV bytes loaded of each prompt (once for its choices: ``outcomes`` are in choice order, a
        prompt's together), the read path of the first."""
        firsts = outcomes[:: req.samples()]
        n_prompt, done = sum(len(p.ids) for p in prompts), sum(o.completion_tokens for o in outcomes)
        cached = sum(o.cached_tokens for o in firsts)
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": done,
            "total_tokens": n_prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if thinking := sum(o.reasoning_tokens for o in outcomes):
            usage["completion_tokens_details"] = {"reasoning_tokens": thinking}
        if req.dualpath and req.dualpath.usage:
            usage["dualpath"] = {
                "read_path": firsts[0].path,
                "kv_bytes_loaded": sum(o.storage_bytes for o in firsts),
                "cached_tokens": cached,
            }
        return usage

    def _token_name(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs name it: its text, or (vLLM's ``return_tokens_as_token_ids``) ``token_id:N``, which
        names tokens whose text is not whole UTF-8 and tokens that share a text."""
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id], skip_special_tokens=False)

    @cached_property
    def _raw_tokens(self) -> tuple[bytes | None, ...] | None:
        """Each token's own bytes (once, ~0.5 s for a 49K vocabulary); None where the tokenizer's are not known."""
        try:
            return self.tokenizer.token_bytes
        except CheckpointError:
            return None

    def _chat_logprobs(self, lps: list, as_ids: bool = False) -> dict:
        def entry(tid, lp):
            # OpenAI's ``bytes`` are the token's own, so a character split across tokens joins whole again (each
            # part's text alone is a replacement character); the text's for special tokens or unknown tokenizers
            text, raw = self.tokenizer.decode([tid], skip_special_tokens=False), self._raw_tokens
            own = raw[tid] if raw is not None and tid < len(raw) else None
            return {
                "token": f"token_id:{tid}" if as_ids else text,
                "logprob": lp,
                "bytes": list(own if own is not None else text.encode()),
            }

        content = [
            {**entry(lp["token_id"], lp["logprob"]), "top_logprobs": [entry(t, v) for t, v in lp["top"]]}
            for lp in lps
            if lp
        ]
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, lps: list, offset0: int = 0, as_ids: bool = False) -> tuple[dict, int]:
        """The legacy form, and where the tokens' text ends; ``text_offset``: each token's place in the choice's
        text, from ``offset0`` (where the tokens' text begins: after an echoed prompt, or after a stream's earlier
        chunks)."""
        tokens, token_lps, tops, offsets, pos = [], [], [], [], offset0
        for lp in lps:
            if not lp:
                continue
            tokens.append(self._token_name(lp["token_id"], as_ids))
            token_lps.append(lp["logprob"])
            tops.append({self._token_name(t, as_ids): v for t, v in lp["top"]})
            offsets.append(pos)
            pos += len(self.tokenizer.decode([lp["token_id"]], skip_special_tokens=False))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, pos

    async def _collect(
        self, request: Request, gens: list, req, kind: str, prompts: list[Prompt], rid: str
    ) -> dict | None:
        """The whole response's body (``rid`` its id) once every choice is done; None if the client left first (its
        request is cancelled)."""
        got = await self.gather(request, gens)
        if got is None:
            return None
        texts, lps, ids, outcomes = got
        every = outcomes  # usage counts best_of's unreturned candidates too
        texts, lps, outcomes, ids = best(req.n, req.samples(), texts, lps, outcomes, ids)
        created = int(time.time())
        choices = [
            self._choice(req, kind, i, t, lp, o, prompts[i // req.n])
            for i, (t, lp, o) in enumerate(zip(texts, lps, outcomes))
        ]
        body = {
            "id": rid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": self._reply_model(req),
            "choices": choices,
            "usage": self._usage(req, prompts, every),
        }
        if req.return_token_ids:  # vLLM's places: a chat's prompt at the top, a completion's in each choice
            for i, c in enumerate(choices):
                c["token_ids"] = ids[i]
                if kind != "chat":
                    c["prompt_token_ids"] = prompts[i // req.n].ids
            if kind == "chat":
                body["prompt_token_ids"] = prompts[0].ids
        if kind == "chat" and req.prompt_logprobs is not None:  # vLLM's place for it in a chat response
            body["prompt_logprobs"] = self._prompt_logprobs(
                prompts[0].ids, outcomes[0].prompt_logprobs, req.prompt_logprobs
            )
        return body

    async def gather(self, request: Request, gens: list) -> tuple[list, list, list, list] | None:
        """Every choice's text pieces, logprobs, token ids and ``Outcome`` once all are done; None if the client left
        first (its request is cancelled)."""
        texts, lps, ids = [[] for _ in gens], [[] for _ in gens], [[] for _ in gens]
        consumers = [asyncio.ensure_future(drain(g, *parts)) for g, *parts in zip(gens, texts, lps, ids)]
        while not all(c.done() for c in consumers):  # a client that hangs up cancels its request
            await asyncio.wait(consumers, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((c for c in consumers if c.done() and c.exception() is not None), None)
            gone = failed is None and not all(c.done() for c in consumers) and await request.is_disconnected()
            if failed is not None or gone:
                for c in consumers:
                    c.cancel()
                # a cancelled drain ends inside its generation, whose cleanup then runs; only after that can a
                # generation be closed (closing one still mid-step raises)
                await asyncio.gather(*consumers, return_exceptions=True)
                for g in gens:
                    await g.aclose()
                if failed is not None:
                    raise failed.exception()
                return None
        outcomes = [c.result() for c in consumers]
        for g in gens:
            await g.aclose()
        return texts, lps, ids, outcomes

    def _prompt_logprobs(self, prompt: list[int], lps: list | None, k: int) -> list:
        """vLLM's form: None for the first token, then per token {id: {logprob, rank, decoded_token}} for the token
        itself and its ``k`` most likely alternatives (ranked 1..k)."""
        _check_prompt_logprobs(prompt, lps)

        def entry(t, v, rank):
            return {"logprob": v, "rank": rank, "decoded_token": self.tokenizer.decode([t], skip_special_tokens=False)}

        out = [None]
        for lp in lps:
            d = {str(t): entry(t, v, r + 1) for r, (t, v) in enumerate(lp["top"][:k])}
            d[str(lp["token_id"])] = entry(lp["token_id"], lp["logprob"], lp["rank"])
            out.append(d)
        return out

    def _choice(
        self, req, kind: str, index: int, pieces: list[str], lps: list, outcome: Outcome, prompt: Prompt
    ) -> dict:
        """One finished choice of a non-streamed response (``pieces``: its text, a piece per token)."""
        content = "".join(pieces)
        want_lps = (kind == "chat" and req.logprobs) or (kind == "completions" and req.logprobs is not None)
        if kind != "chat":
            return self._completion_choice(req, index, content, lps if want_lps else None, outcome, prompt)
        message, finish = {"role": "assistant", "content": content, "refusal": None}, outcome.finish_reason
        reasoner = self._reasoner(kind, prompt)
        if reasoner is not None:
            split = [reasoner.feed(piece) for piece in pieces] + [reasoner.finish()]
            thought, content = "".join(r for r, _ in split), "".join(a for _, a in split)
            message["content"], message["reasoning_content"] = content, thought or None
            outcome.reasoning_tokens = reasoner.tokens
        splitter = self._splitter(req, kind)
        if splitter is not None:
            content = splitter.feed(content) + splitter.finish()
            if splitter.calls:
                message.update(content=content if content.strip() else None, tool_calls=splitter.calls)
                finish = "tool_calls" if splitter.whole else finish
        return {
            "index": index,
            "message": message,
            "finish_reason": finish,
            "logprobs": self._chat_logprobs(lps, req.return_tokens_as_token_ids) if want_lps else None,
        }

    def _completion_choice(
        self, req, index: int, content: str, lps: list | None, outcome: Outcome, prompt: Prompt
    ) -> dict:
        """A completions choice; with ``echo`` the prompt's text comes first (and, with logprobs, its tokens: the
        first without a logprob, as OpenAI's legacy form has it)."""
        choice = {"index": index, "text": content, "finish_reason": outcome.finish_reason, "logprobs": None}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt.ids, outcome.prompt_logprobs, req.prompt_logprobs)
        if not req.echo:
            choice["logprobs"] = (
                self._completion_logprobs(lps, as_ids=req.return_tokens_as_token_ids)[0] if lps is not None else None
            )
            return choice
        head, body = self._echoed(req, prompt, outcome.prompt_logprobs)
        choice["text"] = head + content
        if lps is not None:
            tail, _ = self._completion_logprobs(lps, offset0=len(head), as_ids=req.return_tokens_as_token_ids)
            choice["logprobs"] = {key: body[key] + tail[key] for key in body}
        return choice

    def _echoed(self, req, prompt: Prompt, prompt_lps: list | None) -> tuple[str, dict | None]:
        """``echo``'s head: the prompt's text and, with ``logprobs``, its tokens' logprobs in the legacy form (the
        first token without one)."""
        head = prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.ids)
        if req.logprobs is None:
            return head, None
        _check_prompt_logprobs(prompt.ids, prompt_lps)
        first = {"token_id": prompt.ids[0], "logprob": None, "top": ()}
        body, _ = self._completion_logprobs(
            [first] + [{**lp, "top": lp["top"][: req.logprobs]} for lp in prompt_lps],
            as_ids=req.return_tokens_as_token_ids,
        )
        body["top_logprobs"][0] = None
        return head, body

    async def _sse(self, chunks):
        """Server-sent events of the chunks, an error in OpenAI's form if one ends them early, then ``[DONE]``."""
        try:
            async for body in chunks:
                yield f"data: {json.dumps(body)}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(error_body(str(e), e.type, e.param, e.code))}\n\n"
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    async def _chunks(self, gens: list, req, kind: str, prompts: list[Prompt], rid: str):
        """Chunk bodies of every choice (``rid`` the response's id), interleaved as their tokens come (each chunk
        names its choice); usage, when asked, once at the end. A generation's error is raised (``ApiError``)."""
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        want_lps = (kind == "chat" and req.logprobs) or (kind == "completions" and req.logprobs is not None)

        opts = req.stream_options
        running = opts is not None and opts.include_usage and opts.continuous_usage_stats
        n_prompt, generated = sum(len(p.ids) for p in prompts), [0]  # completion tokens so far, every choice's

        def chunk(choice: dict | None, usage: dict | None = None) -> dict:
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self._reply_model(req),
                "choices": [choice] if choice else [],
            }
            if usage is None and running and choice:  # vLLM's continuous_usage_stats: the request's so far
                usage = {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": generated[0],
                    "total_tokens": n_prompt + generated[0],
                }
            if usage is not None:
                body["usage"] = usage
            return body

        pending: list[list[int]] = [[] for _ in gens]  # token ids not yet sent (their text may be held back)
        told = set()  # completions: choices whose prompt_token_ids went out
        offsets = [0] * len(gens)  # completions' logprobs: where the next token's text begins in its choice's text
        as_ids = req.return_tokens_as_token_ids

        def choice(i: int, delta_text: str, lps: list, finish=None, thought: str = "", calls=()) -> dict:
            if kind == "chat":
                delta = {"reasoning_content": thought} if thought else {}
                if delta_text or (finish is None and not thought and not calls):
                    delta["content"] = delta_text
                if calls:
                    delta["tool_calls"] = calls
                out = {
                    "index": i,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": self._chat_logprobs(lps, as_ids) if want_lps and lps else None,
                }
            else:
                out = {"index": i, "text": delta_text, "finish_reason": finish, "logprobs": None}
                if want_lps and lps:
                    out["logprobs"], offsets[i] = self._completion_logprobs(lps, offsets[i], as_ids)
            if req.return_token_ids:  # every choice's ids, in order, across its chunks
                out["token_ids"], pending[i] = pending[i], []
                if kind != "chat" and i not in told:
                    out["prompt_token_ids"] = prompts[i // req.n].ids
                    told.add(i)
            return out

        splitters = [self._splitter(req, kind) for _ in gens]
        reasoners = [self._reasoner(kind, prompts[i // req.n]) for i in range(len(gens))]
        outcomes: dict[int, Outcome] = {}
        try:
            if kind == "chat":
                for i in range(len(gens)):
                    first = chunk(
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                            "logprobs": None,
                        }
                    )
                    if req.return_token_ids and i == 0:
                        first["prompt_token_ids"] = prompts[0].ids
                    yield first
            elif req.echo and req.logprobs is None:  # the prompt's text first (with logprobs: once they come)
                for i in range(len(gens)):
                    head = self._echoed(req, prompts[i // req.n], None)[0]
                    offsets[i] = len(head)
                    yield chunk(choice(i, head, []))
            async for i, item in merge(gens):
                splitter = splitters[i]
                if isinstance(item, PromptLogprobs):
                    if kind != "chat" and req.echo and req.logprobs is not None:
                        head, body = self._echoed(req, prompts[i // req.n], item.lps)
                        offsets[i] = len(head)
                        yield chunk({"index": i, "text": head, "finish_reason": None, "logprobs": body})
                    continue
                if isinstance(item, Outcome):
                    outcomes[i] = item
                    finish = item.finish_reason
                    if reasoners[i] is not None:
                        thought, tail = reasoners[i].finish()
                        item.reasoning_tokens = reasoners[i].tokens
                        tail = splitter.feed(tail) if splitter is not None else tail
                        if thought or tail:
                            yield chunk(choice(i, tail, [], thought=thought))
                    if splitter is not None:
                        tail = splitter.finish()
                        if calls := splitter.call_deltas():
                            yield chunk(choice(i, "", [], calls=calls))
                        if tail:  # the held text that is not calls: after them
                            yield chunk(choice(i, tail, []))
                        if splitter.calls and splitter.whole:
                            finish = "tool_calls"
                    yield chunk(choice(i, "", [], finish))
                    continue
                delta, tokens, lp = item
                pending[i] += tokens
                generated[0] += len(tokens)
                thought = ""
                if reasoners[i] is not None:
                    thought, delta = reasoners[i].feed(delta)
                calls = []
                if splitter is not None:
                    delta, calls = splitter.feed(delta), splitter.call_deltas()
                if delta or thought or lp or calls or (tokens and req.return_token_ids):
                    yield chunk(choice(i, delta, [lp] if lp else [], thought=thought, calls=calls))
            if req.stream_options and req.stream_options.include_usage:
                yield chunk(None, self._usage(req, prompts, [outcomes[i] for i in range(len(gens))]))
        finally:
            for g in gens:
                await g.aclose()


def _check_prompt_logprobs(prompt: list[int], lps: list | None) -> None:
    if lps is None or len(lps) != len(prompt) - 1:
        raise ApiError(500, "the engines returned no prompt logprobs for the whole prompt", "server_error")


def _find_stop(text: str, stops, start: int) -> int:
    """Where the first stop string begins, searching from where one could still begin given that ``start``
    characters were emitted; -1 if none."""
    if not stops:
        return -1
    longest = max(len(s) for s in stops)
    return find_stop(text, stops, max(0, start - longest + 1))
