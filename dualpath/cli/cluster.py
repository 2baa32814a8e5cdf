"""The processes of a multi-host cluster: ``dualpath scheduler``, ``engine`` (one engine; ``engine_config`` turns
its options into an ``EngineProcessConfig``) and ``node`` (one node's engines of a role)."""

from __future__ import annotations

import argparse

from dualpath.args import qos_config, resolve_model
from dualpath.cli.groups import (
    TRANSPORT_HELP,
    TRANSPORTS,
    CacheOptions,
    EngineKVEventsOptions,
    EngineParallelOptions,
    EngineStorageOptions,
    ModelOptions,
    QosOptions,
    SchedulingOptions,
    TensorParallelOptions,
)
from dualpath.cli.options import Options, opt, options
from dualpath.core.config import (
    CacheConfig,
    EngineConfig,
    EngineProcessConfig,
    KVEventsConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StorageConfig,
    TransportConfig,
)

ROLES = ["prefill", "decode"]


@options
class SchedulerOptions(Options):
    host: str = opt(SchedulerConfig.host, "the address the scheduler's gRPC server binds")
    port: int = opt(50051, "the scheduler's gRPC port (0: any free port)")
    kv_store: str | None = opt(
        SchedulerConfig.kv_store,
        "the KV store directory engines use (to rebuild the block index)",
        default_text="none: the index starts empty",
    )
    heartbeat_timeout: float = opt(
        SchedulerConfig.heartbeat_timeout_s,
        "seconds without a load report before an engine counts as gone and its requests move",
    )
    max_queued: int = opt(SchedulerConfig.max_queued_requests, "requests waiting at once; past it new ones are refused")
    http_port: int = opt(SchedulerConfig.http_port, "serve /health and /metrics here (0: any port; -1: off)")
    verify_block_hashes: float = opt(
        SchedulerConfig.verify_block_hashes,
        "the share of cluster members' prompt block hashes recomputed to check them (1: every prompt hashed "
        "here; without a cluster token every prompt is)",
    )
    ready_file: str | None = opt(None, hidden=True)


@options
class EngineOptions(Options):
    role: str = opt(help="what the engine does", choices=ROLES)
    model: str | None = opt(None, "checkpoint directory", default_text="SmolLM2-135M-Instruct")
    scheduler: str = opt(help="scheduler host:port")
    device: str = opt(EngineConfig.device, "cpu, or cuda:k (its ranks on cuda:k .. cuda:k+N-1)")
    engine_id: str = opt(EngineProcessConfig.engine_id, "this engine's id", default_text="ROLE-HOST-PID")
    node_id: str = opt(
        EngineProcessConfig.node_id, "engines on one node share its storage NIC", default_text="a node of its own"
    )
    group_id: str = opt(EngineProcessConfig.group_id, "engine group", default_text="a group of its own")
    host: str = opt(EngineProcessConfig.host, "address peers reach this engine at")
    port: int = opt(EngineProcessConfig.port, "control (gRPC) port (0: any free port)")
    transport: str = opt(TransportConfig.name, TRANSPORT_HELP, choices=TRANSPORTS)
    transport_port: int = opt(
        TransportConfig.listen_port,
        "the transport's listeners (ucx: this port and the next, one per priority class; 0: any)",
    )
    rdma_device: str | None = opt(
        TransportConfig.device_name,
        "the RDMA device of --transport verbs, e.g. mlx5_0",
        default_text="the first one found",
    )
    max_num_seqs: int = opt(EngineConfig.max_num_seqs, "a decode engine's sequences in one batch")
    compute_quota_ms: float = opt(
        EngineProcessConfig.compute_quota_s * 1000, "the predicted compute time a prefill batch may take, ms"
    )
    cost_model: str | None = opt(
        None, "fixed,per_token,attention seconds (skips profiling)", default_text="profiled at start"
    )
    pull_interval: float = opt(
        EngineProcessConfig.pull_interval_s, "seconds between an engine group's pulls of work from the scheduler"
    )
    max_model_len: int = opt(
        EngineProcessConfig.max_model_len, "the longest sequence served (0: the model's own limit)"
    )
    torch_threads: int = opt(EngineProcessConfig.torch_threads, "torch threads (0: torch's default)")
    alpha_tokens: int = opt(
        EngineProcessConfig.alpha_tokens,
        "tokens this node reads in 3 s, pinned (0: probed at start, then measured as reads drain)",
    )
    beta_tokens: int = opt(
        EngineProcessConfig.beta_tokens, "tokens this device prefills in 5 s (0: from the cost model)"
    )
    ready_file: str | None = opt(None, hidden=True)


@options
class NodeOptions(Options):
    role: str = opt(help="what the node's engines do", choices=ROLES)
    scheduler: str = opt(help="scheduler host:port")
    engines: int = opt(1, "engines on this node (one per device; at --tensor-parallel-size N one per N devices)")
    device: str = opt(
        "cpu", "cpu, or cuda (engine i on cuda:i; at --tensor-parallel-size N on cuda:i*N .. cuda:i*N+N-1)"
    )
    data_parallel: bool = opt(
        False,
        "MoE models: the node's engines form one data-parallel attention group, each attending over its own "
        "requests and holding 1/--engines of the routed experts (the paper's EP group)",
    )
    node_id: str = opt("", "this node's name", default_text="the host name")
    host: str = opt("127.0.0.1", "address peers reach these engines at")
    base_port: int = opt(0, "engine i listens on BASE_PORT + i (0: any)")
    torch_threads: int = opt(0, "torch threads per engine (0: the cores shared out)")
    run_dir: str | None = opt(None, "engine logs", default_text="a temporary directory")
    start_timeout: float = opt(600.0, "seconds every engine has to become ready")
    ready_file: str | None = opt(None, "written once every engine is ready (readiness probes)", default_text="none")
    alive_file: str | None = opt(
        None,
        "touched every 5 s while every engine runs and answers its health check (liveness probes read its age); an "
        "engine that exits or misses 3 checks in a row stops the node (exit 1)",
        default_text="none",
    )
    engine_args: list = opt(
        help="-- then options for every `dualpath engine`", positional=True, nargs=argparse.REMAINDER
    )


SCHEDULER = (SchedulerOptions, SchedulingOptions)
ENGINE = (
    EngineOptions,
    ModelOptions,
    EngineParallelOptions,
    QosOptions,
    EngineStorageOptions,
    CacheOptions,
    EngineKVEventsOptions,
)
NODE = (NodeOptions, TensorParallelOptions)


def scheduler_config(args: argparse.Namespace):
    """``dualpath scheduler``'s options as its ``SchedulerConfig``."""
    return SchedulerConfig(
        host=args.host,
        port=args.port,
        kv_store=args.kv_store,
        mode=args.mode,
        policy=args.policy,
        heartbeat_timeout_s=args.heartbeat_timeout,
        engine_wait_timeout_s=args.engine_wait_timeout,
        max_queued_requests=args.max_queued,
        http_port=args.http_port,
        recompute_slow_hits=not args.load_every_hit,
        scheduling_policy=args.scheduling_policy,
        priority_preemption=not args.disable_priority_preemption,
        session_prefetch=not args.disable_session_prefetch,
        session_affinity=not args.disable_session_affinity,
        verify_block_hashes=args.verify_block_hashes,
    )


def cmd_scheduler(args: argparse.Namespace) -> int:
    from dualpath.processes import run_scheduler

    run_scheduler(scheduler_config(args), args.ready_file)
    return 0


def engine_config(args: argparse.Namespace):
    """``dualpath engine``'s options as its ``EngineProcessConfig``."""

    cost = tuple(float(x) for x in args.cost_model.split(",")) if args.cost_model else None
    qos = qos_config(args)
    return EngineProcessConfig(
        role=args.role,
        model=resolve_model(args.model),
        scheduler=args.scheduler,
        engine_id=args.engine_id,
        node_id=args.node_id,
        group_id=args.group_id,
        host=args.host,
        port=args.port,
        engine=EngineConfig(
            device=args.device,
            dtype=args.dtype,
            kernels=args.kernels,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            enforce_eager=args.enforce_eager,
            max_num_seqs=args.max_num_seqs,
            speculative=SpeculativeConfig.parse(args.speculative_config),
            lora_modules=tuple(args.lora_modules),
            cache=CacheConfig(
                block_size=args.block_size,
                device_memory_bytes=args.cache_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=args.tensor_parallel_size,
                master_port=args.tp_master_port,
                join_timeout_s=args.tp_join_timeout,
                enable_expert_parallel=args.enable_expert_parallel,
                moe_dispatch=args.moe_dispatch,
                data_parallel_size=args.data_parallel_size,
                data_parallel_rank=args.data_parallel_rank,
                data_parallel_master=args.data_parallel_master,
            ),
        ),
        transport=TransportConfig(
            name=args.transport,
            host=args.host,
            listen_port=args.transport_port,
            **qos.transport_fields(),
            device_name=args.rdma_device,
        ),
        qos=qos,
        storage=StorageConfig(
            backend=args.storage_backend,
            root=args.kv_store,
            capacity_bytes=args.storage_capacity,
            read_bandwidth_bps=args.storage_read_bps,
        ),
        kv_events=KVEventsConfig.parse(
            args.kv_events_config,
            args.data_parallel_rank if args.kv_events_port_offset is None else args.kv_events_port_offset,
        ),
        buffer_bytes=args.buffer_bytes,
        workspace_tokens=args.workspace_tokens,
        prefill_kv_budget_bytes=args.prefill_kv_budget,
        compute_quota_s=args.compute_quota_ms / 1000,
        pull_interval_s=args.pull_interval,
        cost_model=cost,
        max_model_len=args.max_model_len,
        torch_threads=args.torch_threads,
        alpha_tokens=args.alpha_tokens,
        beta_tokens=args.beta_tokens,
    )


def cmd_engine(args: argparse.Namespace) -> int:
    from dualpath.processes import run_engine

    run_engine(engine_config(args), args.ready_file)
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """One node's engines of one role against a running scheduler; SIGTERM stops them all."""
    import contextlib
    import os
    import signal
    import sys

    from dualpath.launcher import NodeEngines, NodeSpec

    extra = args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    node = NodeEngines(
        NodeSpec(
            args.role,
            args.scheduler,
            args.engines,
            args.device,
            args.node_id,
            args.host,
            args.base_port,
            args.torch_threads,
            tuple(extra),
            args.log_level,
            _node_tp(args.tensor_parallel_size, extra),
            args.data_parallel,
        ),
        args.run_dir,
    )
    signal.signal(signal.SIGTERM, lambda *_: node.stop())
    node.start(args.start_timeout)
    print(
        f"{args.engines} {args.role} engines ready on {args.node_id or 'this host'} (logs: {node.run_dir})",
        file=sys.stderr,
        flush=True,
    )
    if args.ready_file:  # a readiness probe's file; gone again once the node stops
        from dualpath.processes import write_ready

        write_ready(args.ready_file, "ready\n")
    try:
        return node.wait(args.alive_file)
    finally:
        if args.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.ready_file)


def _node_tp(given: int, engine_args: list[str]) -> int:
    """``dualpath node``'s tensor-parallel size: its own flag, else one among the engines' options after ``--`` (so
    its engines' devices step by it either way)."""
    if given != 1:
        return given
    for k, a in enumerate(engine_args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if a == flag and k + 1 < len(engine_args):
                return int(engine_args[k + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return 1
