"""``dualpath serve``: a scheduler, x prefill and y decode engines, and the OpenAI-compatible frontend on this host,
ready when it says so, stopped together on Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from pathlib import Path

from dualpath.processes import write_ready

log = logging.getLogger(__name__)


def responses_beside(kv_store: str | None) -> str:
    """The stored responses' directory beside a KV store (its block files live under fingerprint directories)."""
    from dualpath.core.paths import default_kv_store

    return str(Path(kv_store or default_kv_store()) / "responses")


def store_capacity(args) -> int:
    """``--storage-capacity`` in bytes (``auto``: from the KV store's disk, now)."""
    from dualpath.core.paths import auto_store_capacity, default_kv_store

    if args.storage_capacity != "auto":
        return args.storage_capacity
    return auto_store_capacity(args.kv_store or default_kv_store())


def model_name(model_dir: str) -> str:
    return Path(model_dir).resolve().name


def listed(given) -> tuple:
    """A repeatable option's values (a YAML config may give one as a string)."""
    return tuple([given] if isinstance(given, str) else given or ())


def served_names(args, model_dir: str) -> tuple[str, ...]:
    """``--served-model-name``'s names (one or more), else the directory's."""
    return listed(getattr(args, "served_model_name", None)) or (model_name(model_dir),)


def frontend_server(frontend_app, host: str, port: int, drain_s: float):
    """A uvicorn server on a socket we bound (so port 0 works and the real port is known before it starts); once
    told to exit it accepts nothing new and lets requests in flight finish, for up to ``drain_s`` seconds."""
    import uvicorn

    sock = socket.create_server((host, port), reuse_port=False)
    server = uvicorn.Server(
        uvicorn.Config(frontend_app, log_level="warning", lifespan="off", timeout_graceful_shutdown=drain_s)
    )
    return server, sock


async def _run(server, sock, on_ready, stop_event: asyncio.Event, in_flight=lambda: 0) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        on_ready()
    await stop_event.wait()
    if in_flight():
        print(
            f"stopping: {in_flight()} request(s) in flight may finish for up to "
            f"{server.config.timeout_graceful_shutdown:g} s (--drain-timeout); new ones are refused",
            flush=True,
        )
    server.should_exit = True
    await task
    for connection in list(server.server_state.connections):  # cut at the drain's end: the clients see it now
        transport = getattr(connection, "transport", None)
        if transport is not None:
            transport.close()
    await asyncio.sleep(0)  # let the closes run before the loop stops


def run_frontend(
    frontend, host: str, port: int, drain_s: float, on_ready=lambda port: None, stop: asyncio.Event | None = None
):
    """Serve ``frontend.app`` until SIGINT/SIGTERM (or ``stop``), then drain (``frontend_server``); ``on_ready(port)``
    once it accepts. The stats line (``dualpath.serving.watch``) is logged every 10 s while busy, unless disabled."""
    from dualpath.serving.watch import log_stats, stats_line

    server, sock = frontend_server(frontend.app, host, port, drain_s)
    actual = sock.getsockname()[1]

    async def main():
        stop_event = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_event.set)
        stats = asyncio.create_task(log_stats(stats_line(frontend))) if frontend.cfg.log_stats else None
        try:
            await _run(server, sock, lambda: on_ready(actual), stop_event, lambda: frontend.in_flight)
        finally:
            if stats is not None:
                stats.cancel()

    asyncio.run(main())


def lora_modules(args) -> tuple:
    """``--lora-modules`` (a YAML config gives them as ``name=path`` strings)."""
    from dualpath.core.lora import LoraModule

    given = getattr(args, "lora_modules", ()) or ()
    return tuple(m if isinstance(m, LoraModule) else LoraModule.parse(m) for m in given)


def cluster_spec(args):
    """The single-host cluster the command-line options describe (``serve``, ``rollout``, ``run-batch``), and the
    model directory and context limit; its tensor parallelism checked against the checkpoint (``ConfigError``
    before any process starts)."""
    from dualpath.args import qos_config, resolve_model
    from dualpath.launcher import ClusterSpec, RestartPolicy, check_parallelism, parse_port_range
    from dualpath.engines.models import open_checkpoint

    model_dir = resolve_model(args.model)
    model_config = open_checkpoint(model_dir).config
    max_len = model_config.context_limit(args.max_model_len)
    tp = getattr(args, "tensor_parallel_size", 1)
    sizes = {role: getattr(args, f"{role}_tensor_parallel_size", 0) or tp for role in ("prefill", "decode")}
    ranks = args.prefill * sizes["prefill"] + args.decode * sizes["decode"]  # processes sharing the cores
    threads = args.torch_threads or (max(1, (os.cpu_count() or 1) // ranks) if args.device == "cpu" else 0)
    if args.engine_port_range and getattr(args, "tp_master_port", 0):
        from dualpath.core.errors import ConfigError

        raise ConfigError(
            "--tp-master-port and --engine-port-range: give one (with a range, each tensor-parallel "
            "engine's rendezvous port comes from it)"
        )
    spec = ClusterSpec(
        model=model_dir,
        num_prefill=args.prefill,
        num_decode=args.decode,
        mode=args.mode,
        policy=args.policy,
        load_every_hit=args.load_every_hit,
        scheduling_policy=args.scheduling_policy,
        priority_preemption=not args.disable_priority_preemption,
        session_prefetch=not args.disable_session_prefetch,
        session_affinity=not args.disable_session_affinity,
        transport=args.transport,
        qos=qos_config(args),
        kv_store=args.kv_store,
        device=args.device,
        dtype=args.dtype,
        kernels=args.kernels,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config,
        kv_events_config=getattr(args, "kv_events_config", ""),
        lora_modules=lora_modules(args),
        tensor_parallel_size=tp,
        prefill_tensor_parallel_size=sizes["prefill"],
        decode_tensor_parallel_size=sizes["decode"],
        tp_master_port=getattr(args, "tp_master_port", 0),
        tp_join_timeout_s=getattr(args, "tp_join_timeout", 60.0),
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        moe_dispatch=getattr(args, "moe_dispatch", "all_to_all"),
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        block_size=args.block_size,
        buffer_bytes=args.buffer_bytes,
        cache_bytes=args.cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        workspace_tokens=args.workspace_tokens,
        prefill_kv_budget_bytes=args.prefill_kv_budget,
        storage_read_bps=args.storage_read_bps,
        storage_capacity=store_capacity(args),
        compute_quota_ms=args.compute_quota_ms,
        max_model_len=max_len,
        torch_threads=threads,
        host="127.0.0.1",
        scheduler_port=args.scheduler_port,
        scheduler_http_port=args.scheduler_http_port,
        engine_wait_timeout_s=args.engine_wait_timeout,
        restart=RestartPolicy(max_restarts=args.max_restarts),
        engine_ports=parse_port_range(args.engine_port_range) if args.engine_port_range else None,
        log_level=args.log_level.upper(),
    )
    check_parallelism(spec, model_config)
    return spec, model_dir, max_len


def cluster_from_args(args):
    """The single-host cluster the command-line options describe (``cluster_spec``), started."""
    from dualpath.launcher import LocalCluster
    from dualpath.core.paths import default_kv_store

    spec, model_dir, max_len = cluster_spec(args)
    cap = f"{spec.storage_capacity / 1e9:.1f} GB" if spec.storage_capacity else "no cap"
    tp = {spec.tp(role) for role in ("prefill", "decode")}
    tp_text = "" if tp == {1} else f", tensor-parallel size {spec.tp('prefill')} prefill / {spec.tp('decode')} decode"
    print(
        f"starting {args.prefill} prefill and {args.decode} decode engine(s) of {model_name(model_dir)} on "
        f"{args.device}{tp_text} (logs in the run directory below; KV store {spec.kv_store or default_kv_store()}, "
        f"{cap}: --storage-capacity)",
        flush=True,
    )
    cluster = LocalCluster(spec, run_dir=args.run_dir, report=lambda line: print(line, flush=True))
    print(f"run directory: {cluster.run_dir}", flush=True)
    cluster.start(timeout=args.start_timeout)
    print(
        f"the internal plane takes the token in {cluster.token_file}: DUALPATH_CLUSTER_TOKEN_FILE="
        f"{cluster.token_file} dualpath status --scheduler {cluster.scheduler_address}",
        flush=True,
    )
    return cluster, model_dir, max_len


def frontend_options(args) -> dict:
    """The frontend's chat and client settings from the command line (a template file read now: a bad one fails
    before any engine starts)."""
    from dualpath.core.lora import read_adapter_config
    from dualpath.core.sampling_params import model_defaults
    from dualpath.core.tokenizer import load_chat_template

    if args.generation_config not in ("auto", "vllm"):
        model_defaults(args.generation_config, "")  # a directory without a usable one fails here
    for m in lora_modules(args):  # so does an adapter whose config cannot be served
        read_adapter_config(m.path)
    return dict(
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
        trust_request_chat_template=args.trust_request_chat_template,
        migration_limit=args.migration_limit,
        generation_config=args.generation_config,
        lora_modules=lora_modules(args),
    )


def inference_keys(args) -> tuple[str, ...]:
    """Every inference key: ``--api-key`` (repeatable), the lines of
    ``--api-key-file`` (blank ones and ``#`` comments skipped; a file with none is an error, never an open server)
    and ``DUALPATH_API_KEY``."""
    from dualpath.core.errors import ConfigError

    keys = list(listed(getattr(args, "api_key", None)))
    if getattr(args, "api_key_file", None):
        try:
            lines = [line.strip() for line in Path(args.api_key_file).read_text().splitlines()]
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror or e}") from None
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ConfigError(f"--api-key-file {args.api_key_file} holds no key")
        keys += from_file
    return tuple(dict.fromkeys(k for k in (*keys, os.environ.get("DUALPATH_API_KEY")) if k))


def _env_on(name: str) -> bool:
    """vLLM's reading of its boolean environment variables."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


def http_options(args) -> dict:
    """The HTTP server's keys, admin routes and limits from the command line and the environment (serve and
    frontend); keys that cannot be used together fail here, before any engine starts."""
    from dualpath.serving.auth import checked_keys, is_loopback

    admin_key = args.admin_api_key or os.environ.get("DUALPATH_ADMIN_API_KEY") or None
    enable_admin = args.enable_admin_api or _env_on("VLLM_SERVER_DEV_MODE")
    if enable_admin and not admin_key and not is_loopback(args.host):
        log.warning(
            "--enable-admin-api without an admin key on --host %s: the admin routes refuse every request "
            "(set DUALPATH_ADMIN_API_KEY, or bind 127.0.0.1)",
            args.host,
        )
    return dict(
        api_keys=checked_keys(inference_keys(args), admin_key),
        admin_api_key=admin_key,
        enable_admin_api=enable_admin,
        runtime_lora_updating=_env_on("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
        bind_host=args.host,
        allowed_model_dirs=listed(args.allowed_model_dirs),
        max_body_bytes=args.max_body_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        default_max_tokens=args.default_max_tokens,
        max_stored_responses=args.max_stored_responses,
        max_stored_response_bytes=args.max_stored_response_bytes,
        render_timeout_s=args.render_timeout,
        health_generate_timeout_s=args.health_generate_timeout,
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
    )


def serve(args) -> int:
    from dualpath.runs import announce, this_run, withdraw
    from dualpath.serving.openai_api import Frontend, FrontendConfig

    options, http = frontend_options(args), http_options(args)
    cluster, model_dir, max_len = cluster_from_args(args)
    announced = []  # this run's record, which `dualpath status` finds (dualpath.runs), while it serves
    try:
        names = served_names(args, model_dir)
        frontend = Frontend(
            FrontendConfig(
                names[0],
                model_dir,
                cluster.scheduler_address,
                max_len,
                model_aliases=names[1:],
                responses_dir=args.responses_dir or responses_beside(args.kv_store),
                skip_tokenizer_init=args.skip_tokenizer_init,
                **http,
                **options,
            )
        )

        def ready(port: int) -> None:
            url = f"http://{args.host if args.host != '0.0.0.0' else '127.0.0.1'}:{port}/v1"
            metrics = f"; scheduler metrics at {cluster.scheduler_http}/metrics" if cluster.scheduler_http else ""
            print(
                f"DualPath is serving {frontend.cfg.model_name} at {url} (metrics of every part at "
                f"{url[:-3]}/metrics{metrics})",
                flush=True,
            )
            announced.append(
                announce(
                    this_run(
                        cluster.scheduler_address, cluster.run_dir, cluster.token_file, url, frontend.cfg.model_name
                    )
                )
            )
            write_ready(args.ready_file, f"{port}\n")  # atomically: a reader never sees it empty

        run_frontend(frontend, args.host, args.port, args.drain_timeout, ready)
    finally:
        print("stopping", flush=True)
        withdraw(announced[0] if announced else None)
        cluster.stop()
    return 0


def frontend_main(args) -> int:
    from dualpath.args import resolve_model
    from dualpath.serving.openai_api import Frontend, FrontendConfig
    from dualpath.engines.models import open_checkpoint

    model_dir = resolve_model(args.model)
    max_len = open_checkpoint(model_dir).config.context_limit(args.max_model_len)
    names = served_names(args, model_dir)
    frontend = Frontend(
        FrontendConfig(
            names[0],
            model_dir,
            args.scheduler,
            max_len,
            model_aliases=names[1:],
            responses_dir=args.responses_dir,
            skip_tokenizer_init=args.skip_tokenizer_init,
            **http_options(args),
            **frontend_options(args),
        )
    )

    def ready(port: int) -> None:
        print(f"frontend for {frontend.cfg.model_name} at http://{args.host}:{port}/v1", flush=True)
        write_ready(args.ready_file, f"{port}\n")

    run_frontend(frontend, args.host, args.port, args.drain_timeout, ready)
    return 0
