"""The OpenAI-compatible HTTP frontend (FastAPI): its configuration (``FrontendConfig``) and ``Frontend``, the state
its routers share, whose ``app`` serves them (``dualpath.serving.app``: one router per API family under
``dualpath.serving.routes``).

A request is tokenized here (chat template from the checkpoint: ``dualpath.serving.prompts``), its sampling built
and checked (``dualpath.serving.sampling``), submitted to the scheduler through one shared ``ClusterClient`` session
and its tokens stream back from the decode engine (``dualpath.serving.generation``); text is detokenized
incrementally, stop strings are matched here (where the text is cut; a choice ends at its first match, as it does on
the decode engine, and the request is cancelled once none runs), tool calls are parsed from chat replies here
(``dualpath.serving.tools``), and a client that disconnects cancels its request. Every generation endpoint runs the
one pipeline of ``dualpath.serving.pipeline``. Errors use OpenAI's JSON error format. Who may call what (keys,
owners, the admin routes, the directories weights load from): ``dualpath.serving.auth``; what one request or key may
take (its body, its generation slots): ``dualpath.serving.guard``; tokenizing and chat rendering, bounded and off the
event loop: ``dualpath.serving.bounded``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dualpath.client import ClusterClient
from dualpath.core.lora import LoraModule
from dualpath.core.sampling_params import model_defaults
from dualpath.core.tokenizer import Tokenizer, load_tokenizer
from dualpath.serving.app import build_app
from dualpath.serving.auth import ADMIN, LORA, Auth, allowed_dirs, is_loopback
from dualpath.serving.bounded import Recent
from dualpath.serving.control import Control
from dualpath.serving.generation import Generations
from dualpath.serving.guard import Admission
from dualpath.serving.http_metrics import HttpMetrics
from dualpath.serving.logprob_forms import LogprobForms
from dualpath.serving.probes import Probes
from dualpath.serving.prompts import Prompts
from dualpath.serving.reasoning import knows_thinking
from dualpath.serving.replies import Replies
from dualpath.serving.response_store import DirectoryResponses, MemoryResponses
from dualpath.serving.sampling import Samplings
from dualpath.serving.served_models import ServedModels
from dualpath.serving.splitting import Splitting
from dualpath.serving.tools import tool_markup

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
    """One served model's HTTP frontend: what its routers share, built here, and ``app``. The parts hold this object
    and read its attributes as they run (a test may replace ``cfg``). ``client`` and ``tokenizer`` are injectable
    (test doubles)."""

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
        if self.defaults:
            log.info(
                "sampling defaults from the model's generation config (--generation-config vllm: none): %s",
                self.defaults,
            )
        self.models = ServedModels(self)
        self._guards(cfg)
        self.kept = Recent(COMPILED_KEPT)  # grammars known to compile, request chat templates compiled
        self.metrics = HttpMetrics(self.client, lambda: self.in_flight)
        kept = (cfg.max_stored_responses, cfg.max_stored_response_bytes)
        self.responses = DirectoryResponses(cfg.responses_dir, *kept) if cfg.responses_dir else MemoryResponses(*kept)
        self._pipeline_parts()
        self.probes = Probes(self)  # /health and the like
        self.control = Control(self)  # /pause and /resume
        self.last_token_at = 0.0  # perf_counter of the last token any generation received (/health_generate)
        self.app = build_app(self)

    def _guards(self, cfg: FrontendConfig) -> None:
        """Who may call (keys, the admin gate), how much they may run at once, and where weights may load from."""
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

    def _pipeline_parts(self) -> None:
        """The stages every generation endpoint shares (``dualpath.serving.pipeline``), each reading this object."""
        self.prompts = Prompts(self)  # request -> token ids
        self.splits = Splitting(self)  # a chat reply's thinking and tool calls
        self.samplings = Samplings(self)  # request and prompt -> SamplingParams
        self.generations = Generations(self)  # submit, one generation per choice, gather
        self.logprobs = LogprobForms(self.tokenizer)  # logprobs in each API's form
        self.replies = Replies(self)  # finished choices -> response bodies

    @property
    def in_flight(self) -> int:
        """Generations (choices) in flight through this frontend."""
        return self.admission.total
