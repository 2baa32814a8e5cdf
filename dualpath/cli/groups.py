"""Option groups several commands share: an engine's model and kernels, parallelism, the network's priority classes,
the KV cache and the KV store, scheduling, and a single-host cluster's (``serve``, ``rollout``, ``run-batch``:
``CLUSTER``). A default that is a config's comes from its dataclass (``dualpath.core.config``): the flag and the
config cannot differ."""

from __future__ import annotations

from dualpath.cli.options import Options, kv_events, lora_module, opt, options, share, size, size_or_auto, speculative
from dualpath.core.config import (
    DTYPE_BYTES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    EngineProcessConfig,
    ParallelConfig,
    QosConfig,
    SchedulerConfig,
    StorageConfig,
    TransportConfig,
)

MODES = ("dualpath", "pe", "de", "basic", "split")  # the scheduler's read-path modes
DEVICE_HELP = (
    "cpu; cuda (engine i on cuda:i; at --tensor-parallel-size N on cuda:i*N .. cuda:i*N+N-1, prefill engines first); "
    "or cuda:K, every engine on that one GPU, sharing it (at tensor-parallel size 1; each decode engine's part: "
    "--gpu-memory-utilization or --cache-bytes)"
)
POLICIES = ("dualpath", "least-loaded", "round-robin", "random")  # scheduler.policies
TRANSPORTS = ("local", "shm", "ucx", "nixl", "verbs")  # dualpath.traffic.transport
TRANSPORT_HELP = (
    "how engines send each other KV: shm (shared memory, one host), ucx, nixl or verbs (RDMA, across hosts), "
    "local (one process, tests)"
)
PARALLEL_DOCS = "; see docs/parallelism.md"
MAX_MODEL_LEN_HELP = "the longest sequence served, prompt and reply (0: the model's own limit)"


def lora_modules_opt():
    """``--lora-modules``, declared once for the groups that take it."""
    return opt(
        (),
        "LoRA adapters (PEFT directories) to serve beside the base model: a request names one as its model "
        "(vLLM's flag)",
        type=lora_module,
        nargs="+",
        metavar="NAME=PATH",
    )


@options
class LoraOptions(Options):
    GROUP = "model and kernels"

    lora_modules: tuple = lora_modules_opt()


@options
class ModelOptions(Options):
    """How an engine holds and runs the model (``EngineConfig``)."""

    GROUP = "model and kernels"

    dtype: str = opt(EngineConfig.dtype, "the model's dtype", choices=list(DTYPE_BYTES))
    kv_cache_dtype: str = opt(
        EngineConfig.kv_cache_dtype,
        "the KV cache's dtype, in memory, transfers and storage (auto: the model's; fp8: e4m3, half of bfloat16's "
        "bytes)",
        choices=list(KV_CACHE_DTYPES),
    )
    quantization: str | None = opt(
        EngineConfig.quantization,
        "quantize a plain checkpoint's linear weights as they load (fp8: block-scaled e4m3 in blocks of 128 x 128, "
        "half of bfloat16's bytes; a checkpoint already in FP8 loads as stored)",
        flags=("--quantization", "-q"),
        choices=list(QUANTIZATIONS),
        default_text="none, the weights as stored",
    )
    kernels: str = opt(
        EngineConfig.kernels,
        "attention and KV-move kernels: auto (triton on CUDA, torch on CPU), torch (the reference)",
        choices=KERNEL_BACKENDS,
    )
    enforce_eager: bool = opt(
        EngineConfig.enforce_eager,
        "run decode steps eagerly (by default they replay CUDA graphs on CUDA with triton kernels)",
    )
    speculative_config: str = opt(
        "",
        'speculative decoding by prompt lookup, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (outputs are unchanged)',
        type=speculative,
        default_text="off",
    )
    lora_modules: tuple = lora_modules_opt()


@options
class TensorParallelOptions(Options):
    """One engine on several devices (``ParallelConfig``)."""

    GROUP = "parallelism"

    tensor_parallel_size: int = opt(
        ParallelConfig.tensor_parallel_size,
        "split each engine's model across N ranks, one process per device (cuda:k .. cuda:k+N-1 from its device; "
        "on a CPU N processes): heads, MLP and vocabulary sharded (vLLM's flag; dense Llama, Mistral, Qwen2, Qwen3, "
        "Qwen3-MoE and DeepSeek-V3/V3.2 models" + PARALLEL_DOCS + ")",
        flags=("--tensor-parallel-size", "-tp"),
        metavar="N",
    )


@options
class ExpertParallelOptions(TensorParallelOptions):
    enable_expert_parallel: bool = opt(
        ParallelConfig.enable_expert_parallel,
        "MoE models: give each rank whole routed experts (E/N each) instead of a slice of every expert; tokens "
        "reach them by --moe-dispatch (vLLM's flag)",
    )
    moe_dispatch: str = opt(
        ParallelConfig.moe_dispatch,
        "with --enable-expert-parallel: how tokens reach their experts' ranks (all_to_all: each token-expert pair "
        "crosses once each way; all_gather: every rank sees every token)",
        choices=("all_to_all", "all_gather"),
    )


def _tp_master_port(more: str = ""):
    return opt(
        ParallelConfig.master_port,
        "where a tensor-parallel engine's ranks meet (rank 0's TCP store on this host; 0: any free port)" + more,
        metavar="PORT",
    )


def _data_parallel_size(groups: str):
    return opt(
        ParallelConfig.data_parallel_size,
        "MoE models: data-parallel attention, engines in groups of D that each attend over their own requests and "
        f"hold E/D of the routed experts, exchanging tokens in every MoE layer ({groups}){PARALLEL_DOCS}",
        flags=("--data-parallel-size", "-dp"),
        metavar="D",
    )


@options
class ParallelOptions(ExpertParallelOptions):
    tp_master_port: int = _tp_master_port()
    data_parallel_size: int = _data_parallel_size("with --data-parallel-rank and --data-parallel-master")
    tp_join_timeout: float = opt(
        ParallelConfig.join_timeout_s,
        "seconds a tensor-parallel engine's ranks have to start and meet before it fails",
        metavar="S",
    )


@options
class EngineParallelOptions(ParallelOptions):
    data_parallel_rank: int = opt(
        ParallelConfig.data_parallel_rank, "this engine's place in its data-parallel group", metavar="R"
    )
    data_parallel_master: str = opt(
        ParallelConfig.data_parallel_master,
        "where the group's engines meet (its rank 0 hosts the rendezvous)",
        metavar="HOST:PORT",
        default_text="none, at --data-parallel-size 1",
    )


@options
class ClusterParallelOptions(ParallelOptions):
    """Every engine of a cluster on this host: one tensor-parallel size for all, or one per role."""

    tp_master_port: int = _tp_master_port(
        "; one port per engine from this one up (with --engine-port-range: from the range)"
    )
    data_parallel_size: int = _data_parallel_size("each role's engines in consecutive groups")
    prefill_tensor_parallel_size: int = opt(
        0, "the prefill engines' own tensor-parallel size (0: --tensor-parallel-size)", metavar="N"
    )
    decode_tensor_parallel_size: int = opt(
        0, "the decode engines' own tensor-parallel size (0: --tensor-parallel-size)", metavar="N"
    )


@options
class QosOptions(Options):
    """The priority classes on the wire (``QosConfig``; ``dualpath.args.qos_config`` builds it)."""

    GROUP = "network priority classes (KV low, collectives high; deploy/qos/README.md)"

    kv_service_level: int = opt(
        QosConfig.kv_service_level,
        "InfiniBand service level of KV queue pairs (the subnet manager maps it to a low-priority virtual lane)",
        metavar="SL",
    )
    kv_dscp: int | None = opt(
        None,
        "DSCP of KV traffic: RoCE traffic class and the KV transports' TCP sockets' IP_TOS are DSCP << 2",
        metavar="DSCP",
        default_text=f"{QosConfig.kv_dscp}, AF11",
    )
    kv_traffic_class: int | None = opt(
        None,
        "the same as a traffic class byte (DSCP << 2, ECN bits 0): --kv-traffic-class 40 is --kv-dscp 10",
        metavar="TC",
        default_text="--kv-dscp's",
    )
    collective_service_level: int = opt(
        QosConfig.collective_service_level,
        "InfiniBand service level of the collectives among an engine's ranks (NCCL_IB_SL)",
        metavar="SL",
    )
    collective_dscp: int = opt(
        QosConfig.collective_dscp,
        "DSCP of the collectives (NCCL_IB_TC = DSCP << 2 on RoCE; the default is AF31)",
        metavar="DSCP",
    )


@options
class CacheOptions(Options):
    """KV blocks, buffers and the decode engines' paged cache (``CacheConfig``, ``EngineProcessConfig``)."""

    GROUP = "KV cache and buffers"

    block_size: int = opt(
        CacheConfig.block_size,
        "tokens per KV block, a power of two: the unit of the paged cache, of transfers and of the KV store",
    )
    buffer_bytes: int = opt(EngineProcessConfig.buffer_bytes, "each engine's DRAM buffer of whole KV blocks, in bytes")
    cache_bytes: int = opt(
        CacheConfig.device_memory_bytes,
        "the decode engines' paged KV cache (40G, 512MiB, bytes; 0: on CUDA --gpu-memory-utilization of the device "
        "less the weights and activations, on a CPU 1 GiB)",
        type=size,
    )
    gpu_memory_utilization: float = opt(
        CacheConfig.gpu_memory_utilization,
        "the share of each decode engine's GPU its weights, activations and KV cache may take, when --cache-bytes "
        "is 0 (vLLM's option)",
        type=share,
    )
    workspace_tokens: int = opt(
        EngineProcessConfig.workspace_tokens,
        "a prefill engine's KV tokens per layer slot (two slots: the layer computing and the next one arriving)",
    )
    prefill_kv_budget: int = opt(
        EngineProcessConfig.prefill_kv_budget_bytes,
        "the device memory a prefill batch's resident KV may take (40G, 512MiB, bytes; 0: no budget): layerwise "
        "prefill keeps two layers of it resident, basic all layers, so a basic batch holds ~layers/2 times fewer "
        "tokens",
        type=size,
    )


@options
class StorageOptions(Options):
    """Where KV blocks are stored and how fast they are read (``StorageConfig``)."""

    GROUP = "KV store"

    kv_store: str | None = opt(StorageConfig.root, "KV store directory", default_text="under the user cache")
    storage_capacity: int = opt(
        StorageConfig.capacity_bytes,
        "bytes kept (20G, 512MiB, ...) before the least recently used blocks are evicted (0: no cap)",
        type=size,
    )
    storage_read_bps: float = opt(
        StorageConfig.read_bandwidth_bps, "cap each node's storage reads, bytes/s (0: no cap)"
    )


@options
class EngineStorageOptions(StorageOptions):
    storage_backend: str = opt(
        StorageConfig.backend, "fs (any POSIX mount, 3FS FUSE included) or hf3fs (3FS USRBIO)", choices=["fs", "hf3fs"]
    )


@options
class ClusterStorageOptions(StorageOptions):
    storage_capacity: int | str = opt(
        "auto",
        "KV store cap (20G, 512MiB, bytes; least recently used blocks evicted past it): 0 for none, auto for half "
        "the disk's free space plus what the store holds",
        type=size_or_auto,
    )


@options
class KVEventsOptions(Options):
    """The blocks engines store and remove, published for KV-aware routers (``KVEventsConfig``)."""

    GROUP = "KV events (KV-aware routers: llm-d, Dynamo; docs/kv-events.md)"

    kv_events_config: str = opt(
        "",
        "publish the blocks each engine stores and removes as vLLM does, ZeroMQ and MessagePack, vLLM's JSON: "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv@HOST@MODEL"}\' (each engine of a '
        "host on a port of its own)",
        type=kv_events,
        metavar="JSON",
        default_text="off",
    )


@options
class EngineKVEventsOptions(KVEventsOptions):
    kv_events_port_offset: int | None = opt(
        None,
        "added to the ports the KV events endpoints bind (this engine's index on its host; dualpath serve and node "
        "give it)",
        metavar="N",
        default_text="the engine's --data-parallel-rank, as vLLM",
    )


@options
class SchedulingOptions(Options):
    """How the scheduler reads stored KV and places and orders requests (``SchedulerConfig``)."""

    GROUP = "scheduling"

    mode: str = opt(
        SchedulerConfig.mode,
        "the read path of stored KV: dualpath (the side with the shorter read queue), pe (the prefill engine's "
        "storage), de (the decode engine's, then RDMA), basic (the paper's baseline: PE path, no layer overlap), "
        "split (one request's blocks read on both sides)",
        choices=MODES,
    )
    policy: str = opt(
        SchedulerConfig.policy,
        "how requests are placed on engines: dualpath (the paper's scheduler), or a baseline",
        choices=POLICIES,
    )
    load_every_hit: bool = opt(
        not SchedulerConfig.recompute_slow_hits,
        "always load a request's whole stored prefix (the paper's systems), even when recomputing it would end the "
        "prefill sooner (a deep storage read queue, a slow store)",
    )
    scheduling_policy: str = opt(
        SchedulerConfig.scheduling_policy,
        "the scheduler's queue order: fcfs (first come, first served; a request's priority is refused) or "
        "priority (by each request's priority, lower first; vLLM's flag)",
        choices=SCHEDULING_POLICIES,
    )
    disable_priority_preemption: bool = opt(
        not SchedulerConfig.priority_preemption,
        "under --scheduling-policy priority, never end a generating reply to make room for a more urgent request "
        "(SGLang's flag; by default the reply is handed back and continued later)",
    )
    disable_session_prefetch: bool = opt(
        not SchedulerConfig.session_prefetch,
        "never read a waiting agent session's stored KV into an engine's buffer before its next turn (sessions: "
        "the X-Session-Id header or the dualpath.session field)",
    )
    disable_session_affinity: bool = opt(
        not SchedulerConfig.session_affinity,
        "place an agent session's turns by load alone, not preferring the decode engine of its last turn",
    )
    engine_wait_timeout: float = opt(
        SchedulerConfig.engine_wait_timeout_s,
        "seconds a request waits while no engine of a role it needs is alive (restarting) before it fails as "
        "unavailable (503); 0: refuse requests at once while a role has none",
    )


@options
class ClusterOptions(Options):
    """A scheduler and engines on this host (``dualpath.launcher.ClusterSpec``)."""

    GROUP = "the cluster on this host"

    prefill: int = opt(1, "prefill engines")
    decode: int = opt(1, "decode engines")
    device: str = opt("cpu", DEVICE_HELP)
    transport: str = opt(TransportConfig.name, TRANSPORT_HELP, choices=TRANSPORTS)
    compute_quota_ms: float = opt(
        EngineProcessConfig.compute_quota_s * 1000, "the predicted compute time a prefill batch may take, ms"
    )
    torch_threads: int = opt(0, "torch threads per engine (0: the cores shared out)")
    scheduler_port: int = opt(0, "the scheduler's gRPC port (0: any free port)")
    scheduler_http_port: int = opt(0, "the scheduler's /health and /metrics port (0: any free port; -1: off)")
    run_dir: str | None = opt(
        None,
        "where each process logs, NAME.log; an earlier run's logs there move to NAME.log.1 (3 kept)",
        default_text="a new temporary directory",
    )
    start_timeout: float = opt(600.0, "seconds the scheduler and every engine have to become ready")
    max_restarts: int = opt(
        5,
        "times an engine or the scheduler that exits or stops answering health checks is restarted in 10 minutes "
        "(with backoff from 1 s to 30 s); 0: never",
    )
    engine_port_range: str | None = opt(
        None,
        "give every engine its ports from this range, 3 each (control, then the transport's listeners; a "
        "tensor-parallel engine 4, the last its ranks' rendezvous), so a firewall or network policy can name them",
        metavar="LO-HI",
        default_text="any free port",
    )


# what serve, rollout and run-batch start: their options besides their own
CLUSTER = (
    ClusterOptions,
    ModelOptions,
    ClusterParallelOptions,
    QosOptions,
    SchedulingOptions,
    CacheOptions,
    ClusterStorageOptions,
    KVEventsOptions,
)
