"""Frozen configuration dataclasses, built once (from a checkpoint, CLI flags or YAML) and passed down.

Nothing mutates a config after it is built; derived values are properties. ``ModelConfig.from_hf`` turns a
Hugging Face ``config.json`` into the architecture-neutral description every other module uses.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from dualpath.core.errors import CheckpointError, ConfigError
from dualpath.core.lora import LoraModule

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a cache may hold: the model's dtypes, and 8-bit floats (e4m3, finite: saturates at +-448, no infinities)
KV_DTYPE_BYTES = {**DTYPE_BYTES, "float8_e4m3fn": 1}
# vLLM's --kv-cache-dtype values -> the cache's dtype (auto: the model's)
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
KERNEL_BACKENDS = ("auto", "torch", "triton")  # see dualpath.kernels.attention.choose_backend
QUANTIZATIONS = ("fp8",)  # vLLM's and SGLang's --quantization values served (EngineConfig.quantization)
SCHEDULING_POLICIES = ("fcfs", "priority")  # the order the scheduler's queues keep (SchedulerConfig)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``kind`` is ``default``, ``llama3``, ``yarn`` or ``linear``."""

    kind: str = "default"
    theta: float = 10000.0
    rotary_dim: int = 64
    interleaved: bool = False  # DeepSeek lays rotary pairs out as (x0, x1), (x2, x3), ...
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn; 0 means unset
    mscale_all_dim: float = 0.0  # yarn; 0 means unset
    attention_factor: float | None = None  # yarn; None means derived
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's sparse attention (DSA): a lightning indexer of ``num_heads`` heads scores every earlier token
    against a ``head_dim``-wide key of its own, and each query attends to its ``topk`` best-scoring tokens only."""

    num_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). The cache holds ``kv_lora_rank + qk_rope_head_dim`` per token,
    and with a sparse-attention ``indexer`` (V3.2) the indexer's key after them."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    indexer: IndexerConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def key_width(self) -> int:
        """Elements of the attention's shared key (latent and rope key), the front of a cached row."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts. ``scoring`` "sigmoid": DeepSeek-V3's grouped top-k over sigmoid scores with a
    correction bias; "softmax": Qwen3-MoE's top-k of softmax probabilities (no groups, bias or shared experts).
    Layers below ``first_dense_layers`` and those in ``dense_layers`` keep a dense MLP."""

    num_experts: int
    num_experts_per_tok: int
    num_groups: int
    topk_group: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_dense_layers: int
    scoring: str = "sigmoid"
    dense_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class WeightQuantConfig:
    """Block-scaled FP8 weights, as DeepSeek-V3/V3.2 and Qwen3's FP8 checkpoints ship them (``quant_method: fp8``,
    ``weight_block_size``): a linear weight ``W [N, K]`` is stored as e4m3 values with one float32
    ``weight_scale_inv`` per ``block`` (rows, columns), ``W = q × scale``. Tensors stored without a scale (norms,
    embeddings, routers) are plain. Activations stay in the model's dtype (w8a16: ``dualpath.kernels.fp8``)."""

    block: tuple[int, int] = (128, 128)

    def __post_init__(self):
        if any(b < 16 or b % 16 for b in self.block):
            raise CheckpointError(
                f"FP8 weight_block_size {list(self.block)} is not supported: each side must be a "
                "multiple of 16 (the kernels' smallest tile; checkpoints use 128)"
            )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3" or "deepseek_v32"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    sliding_window: int | None = None  # Mistral's attention window; only contexts within it are served
    quant: WeightQuantConfig | None = None  # FP8 weights (None: every weight in the checkpoint's float dtype)

    @property
    def kv_elems_per_token(self) -> int:
        """Elements of one token's KV in one layer: K and V of every KV head, or MLA's latent plus rope key (and
        the sparse-attention indexer's key)."""
        if self.mla is not None:
            return self.mla.key_width + (self.mla.indexer.head_dim if self.mla.indexer else 0)
        return 2 * self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        m = self.moe
        return m is not None and layer >= m.first_dense_layers and layer not in m.dense_layers

    def context_limit(self, max_model_len: int | None = None) -> int:
        """The longest sequence served: ``max_model_len`` (None or 0: the model's own limit). Beyond a sliding
        window full attention is no longer the model's attention, so a longer limit is a ``ConfigError``."""
        window = self.sliding_window
        limit = max_model_len or min(self.max_position_embeddings, window or self.max_position_embeddings)
        if window is not None and limit > window:
            raise ConfigError(
                f"max_model_len {limit} exceeds the model's sliding window of {window} tokens; "
                f"sliding-window attention is not supported, so at most {window} tokens are served"
            )
        return limit

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face ``config.json`` dict; unknown or unsupported models raise ``CheckpointError``."""
        archs = hf.get("architectures") or []
        known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise CheckpointError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        arch = known[0]
        if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
            raise CheckpointError("sliding-window attention (use_sliding_window=true) is not supported")
        try:
            return _parse_hf(arch, hf)
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r} for {arch}") from None


def _eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope_from_hf(hf: dict, rotary_dim: int, interleaved: bool) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "llama3", "yarn", "linear"):
        raise CheckpointError(f"unsupported rope type {kind!r}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    orig = params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 0))
    factor = params.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / orig if kind == "yarn" and orig else 1.0
    return RopeConfig(
        kind=kind,
        theta=float(theta),
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        factor=float(factor),
        original_max_position=int(orig or 0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _parse_hf(arch: str, hf: dict) -> ModelConfig:
    num_heads = hf["num_attention_heads"]
    mla = moe = None
    if arch in ("deepseek_v3", "deepseek_v32"):
        mla = MLAConfig(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            indexer=_indexer(hf) if arch == "deepseek_v32" else None,
        )
        moe = MoEConfig(
            num_experts=hf["n_routed_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            num_groups=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_shared_experts=hf.get("n_shared_experts") or 0,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_dense_layers=hf.get("first_k_dense_replace") or 0,
            dense_layers=tuple(i for i, t in enumerate(hf.get("mlp_layer_types") or ()) if t == "dense"),
        )
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise CheckpointError("only DeepSeek-V3 routing (sigmoid scores, noaux_tc) is supported")
        head_dim = mla.qk_rope_head_dim
        rope = _rope_from_hf(hf, mla.qk_rope_head_dim, interleaved=bool(hf.get("rope_interleave", True)))
        num_kv_heads = num_heads
    else:
        moe = _qwen3_moe(hf) if arch == "qwen3_moe" else None
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = _rope_from_hf(hf, int(head_dim * hf.get("partial_rotary_factor", 1.0)), interleaved=False)
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
    qwen3 = arch in ("qwen3", "qwen3_moe")
    qkv_bias = arch == "qwen2" or bool(hf.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope=rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=(arch == "llama" or qwen3) and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        mla=mla,
        moe=moe,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
        hidden_act=hf.get("hidden_act", "silu"),
        qk_norm=qwen3,
        sliding_window=hf.get("sliding_window") if hf.get("model_type") == "mistral" else None,
        quant=_quantization(hf.get("quantization_config")),
    )


def _quantization(q: dict | None) -> WeightQuantConfig | None:
    """``quantization_config``: block-scaled FP8 (e4m3, dynamic activations) is served; other formats are refused
    with what they are, before any tensor is read."""
    if not q:
        return None
    method, block = q.get("quant_method", "?"), q.get("weight_block_size")
    if method != "fp8":
        raise CheckpointError(
            f"quantized checkpoints ({method}) are not supported: block-scaled FP8 (quant_method "
            "fp8 with weight_block_size, DeepSeek's and Qwen's FP8 releases) is; or convert the "
            "weights to bfloat16"
        )
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"FP8 checkpoints in fmt {q.get('fmt')!r} with {q.get('activation_scheme')!r} "
            "activation scales are not supported (e4m3 with dynamic activations is)"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"FP8 checkpoints without a weight_block_size of two positive integers (got {block!r}, "
            "per-tensor scales) are not supported; block-scaled ones are"
        )
    return WeightQuantConfig(block=tuple(block))


# a sparse-attention layer's name in config.json: transformers 5.24 writes the first, 5.17 and DeepSeek's and GLM's
# published configs the second
SPARSE_LAYER_TYPES = frozenset({"indexed_attention", "deepseek_sparse_attention"})


def _indexer(hf: dict) -> IndexerConfig:
    """DeepSeek-V3.2's indexer; its queries come from the query latent, so the model must have one."""
    if not hf.get("q_lora_rank"):
        raise CheckpointError("DeepSeek-V3.2's sparse-attention indexer reads the query latent: q_lora_rank is needed")
    if set(hf.get("layer_types") or ()) - SPARSE_LAYER_TYPES:
        raise CheckpointError(
            f"layer types {sorted(set(hf['layer_types']))} are not supported (sparse attention "
            f"in every layer is: {' or '.join(sorted(SPARSE_LAYER_TYPES))})"
        )
    index = IndexerConfig(num_heads=hf["index_n_heads"], head_dim=hf["index_head_dim"], topk=hf["index_topk"])
    if index.head_dim < hf["qk_rope_head_dim"] or min(index.num_heads, index.topk) < 1:
        raise CheckpointError(f"degenerate sparse-attention indexer {index}")
    return index


def _qwen3_moe(hf: dict) -> MoEConfig | None:
    """Qwen3-MoE's experts: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (None: no experts)."""
    layers, step, dense = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1, hf.get("mlp_only_layers") or ()
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # Qwen's name, or transformers 5's
    if not experts:
        return None
    return MoEConfig(
        num_experts=experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        num_groups=1,
        topk_group=1,
        moe_intermediate_size=hf["moe_intermediate_size"],
        num_shared_experts=0,
        routed_scaling_factor=1.0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        first_dense_layers=0,
        scoring="softmax",
        dense_layers=tuple(i for i in range(layers) if i in dense or (i + 1) % step),
    )


@dataclass(frozen=True)
class CacheConfig:
    """KV block geometry choices and how much device memory the paged cache takes: ``num_device_blocks`` blocks,
    else ``device_memory_bytes``, else (both 0) on CUDA ``gpu_memory_utilization`` of the device less what the
    engine holds and its activations need (vLLM's rule; ``dualpath.engines.memory``), on a CPU 1 GiB."""

    block_size: int = 64
    num_device_blocks: int = 0
    device_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if min(self.num_device_blocks, self.device_memory_bytes) < 0:
            raise ConfigError("num_device_blocks and device_memory_bytes must not be negative")


@dataclass(frozen=True)
class StorageConfig:
    """Where Full Blocks are stored and how reads are paced.

    ``root`` None means the user cache directory. ``capacity_bytes`` bounds what is kept (least recently used
    blocks are evicted past it; 0 = the disk is the bound); the stored blocks are recounted from the directory at
    most every ``rescan_s`` (other processes write there too). ``read_bandwidth_bps`` caps this node's storage
    reads with a token bucket, to emulate a storage NIC in benchmarks (0 = no cap).
    """

    backend: str = "fs"
    root: str | None = None
    capacity_bytes: int = 0
    io_threads: int = 0  # 0: twice the CPU count
    read_bandwidth_bps: float = 0.0
    fsync: bool = False
    rescan_s: float = 5.0


KV_EVENT_ENCODINGS = ("array", "map")  # KVEventsConfig.encoding


@dataclass(frozen=True)
class KVEventsConfig:
    """KV events (``dualpath.engines.kv_events``): the blocks an engine stores and removes, published over ZeroMQ as
    vLLM's ``--kv-events-config`` publishes its prefix cache's, for KV-aware routers (llm-d, Dynamo). vLLM's fields
    with vLLM's defaults; then ours: ``medium``, the tier events name (the store: "DISK"); ``encoding``, each event
    as a positional array ("array": vLLM before its PR #42892, which every consumer decodes) or a tagged map ("map":
    vLLM since); ``port_offset``, added to the port of each endpoint this engine binds (its index on the host, as
    vLLM adds the data-parallel rank), so engines of one host do not collide. Off unless ``enable_kv_cache_events``."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled (vLLM's)
    endpoint: str = "tcp://*:5557"  # bound if it has a wildcard ("*", "::") or is ipc:// or inproc://, else connected
    replay_endpoint: str | None = None  # a ROUTER socket answering replay requests (None: none)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # events waiting for the publisher thread; past it new ones are dropped (counted)
    topic: str = ""
    medium: str | None = "DISK"
    encoding: str = "array"
    port_offset: int = 0

    def __post_init__(self):
        for name in ("endpoint", "topic", "encoding"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"kv events: {name} must be a string, got {getattr(self, name)!r}")
        for name in ("replay_endpoint", "medium", "publisher"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"kv events: {name} must be a string or null, got {getattr(self, name)!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size", "port_offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"kv events: {name} must be a whole number >= 0, got {value!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                f"kv events: enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher not in (None, "zmq", "null"):
            raise ConfigError(f"kv events: publisher must be zmq or null, got {self.publisher!r}")
        if self.encoding not in KV_EVENT_ENCODINGS:
            raise ConfigError(
                f"kv events: encoding must be one of {', '.join(KV_EVENT_ENCODINGS)}, got {self.encoding!r}"
            )
        if self.max_queue_size < 1:
            raise ConfigError("kv events: max_queue_size must be at least 1 (the queue is bounded)")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"kv events: {ep!r} is not a ZeroMQ endpoint (tcp://, ipc:// or inproc://)")

    @classmethod
    def parse(cls, text: str | dict | None, port_offset: int | None = None) -> "KVEventsConfig":
        """vLLM's ``--kv-events-config`` JSON (or its dict; ""/None: off), ``port_offset`` given apart (the flag)."""
        if not text:
            given: dict = {}
        elif isinstance(text, dict):
            given = dict(text)
        else:
            try:
                given = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"kv events config is not JSON: {e}") from None
            if not isinstance(given, dict):
                raise ConfigError(f"kv events config must be a JSON object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"kv events config: unknown key(s) {unknown}; known: {sorted(known)}")
        if port_offset is not None:
            given["port_offset"] = port_offset
        return cls(**given)

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @staticmethod
    def binds(endpoint: str) -> bool:
        """Whether the publisher binds ``endpoint`` (vLLM's rule) rather than connecting to a subscriber that binds."""
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

    def offset(self, endpoint: str | None, bound: bool = True) -> str | None:
        """``endpoint`` moved by ``port_offset``: a TCP port plus it, an ipc:// or inproc:// name suffixed ``_N``. An
        endpoint that is connected to (a central subscriber's) is the same for every engine: left as it is."""
        if endpoint is None or not self.port_offset or not bound:
            return endpoint
        if endpoint.startswith("tcp://"):
            base, _, port = endpoint.rpartition(":")
            return f"{base}:{int(port) + self.port_offset}" if port.isdigit() else endpoint  # (":*": any port)
        return f"{endpoint}_{self.port_offset}"

    @property
    def publish_endpoint(self) -> str:
        return self.offset(self.endpoint, self.binds(self.endpoint))

    @property
    def replay_endpoint_bound(self) -> str | None:
        return self.offset(self.replay_endpoint)  # (a ROUTER socket: always bound)


@dataclass(frozen=True)
class QosConfig:
    """The priority classes of an engine's traffic on the wire, one place for all of them (paper §5: model
    collectives on a high-priority lane, KV on a low-priority one that takes what is idle).

    - InfiniBand: a service level per queue pair, which the subnet manager maps to a virtual lane
      (``deploy/qos/opensm-qos.conf``): ``kv_service_level`` on the KV transports' queue pairs,
      ``collective_service_level`` on NCCL's (``NCCL_IB_SL``).
    - RoCE: the traffic class of each queue pair's route header, DSCP << 2, which the NICs and switches map to a
      priority and a queue (``deploy/qos/roce-kv-traffic-class.sh``): ``kv_traffic_class`` on KV queue pairs,
      ``collective_traffic_class`` on NCCL's (``NCCL_IB_TC``).
    - TCP: the same byte as each socket's ``IP_TOS``: the KV transports mark their sockets with
      ``kv_traffic_class`` (``dualpath.traffic.qos``). Collective sockets (NCCL's socket transport, gloo) have no TOS
      option; a host rule marks them (``deploy/qos/README.md``).

    Defaults follow the paper's lanes and the RoCE script: KV on SL 2 and DSCP 10 (AF11), collectives on SL 0 and
    DSCP 26 (AF31). A class of 0 is the fabric's default (unmarked); ``off()`` leaves everything there. KV and the
    collectives on one non-zero class is refused: the fabric could not tell them apart.
    """

    kv_service_level: int = 2
    kv_dscp: int = 10
    collective_service_level: int = 0
    collective_dscp: int = 26

    def __post_init__(self):
        for name in ("kv_service_level", "collective_service_level"):
            if not 0 <= getattr(self, name) <= 15:
                raise ConfigError(f"{name} must be an InfiniBand service level in [0, 15], got {getattr(self, name)}")
        for name in ("kv_dscp", "collective_dscp"):
            if not 0 <= getattr(self, name) <= 63:
                raise ConfigError(f"{name} must be a DSCP in [0, 63], got {getattr(self, name)}")
        for what, kv, coll in (
            ("service level", self.kv_service_level, self.collective_service_level),
            ("DSCP", self.kv_dscp, self.collective_dscp),
        ):
            if kv == coll != 0:
                raise ConfigError(
                    f"KV traffic and the collectives on one {what} ({kv}): the fabric cannot give "
                    "them different priorities; pick another for one of them (0 for both: no QoS)"
                )

    @classmethod
    def off(cls) -> "QosConfig":
        """Every class the fabric's default: no priorities."""
        return cls(kv_service_level=0, kv_dscp=0, collective_service_level=0, collective_dscp=0)

    @property
    def kv_traffic_class(self) -> int:
        """The RoCE traffic class / IP TOS byte of KV traffic (DSCP << 2; ECN bits 0)."""
        return self.kv_dscp << 2

    @property
    def collective_traffic_class(self) -> int:
        """The RoCE traffic class / IP TOS byte of the collectives (``NCCL_IB_TC``)."""
        return self.collective_dscp << 2

    def transport_fields(self) -> dict[str, int]:
        """``TransportConfig``'s KV classes: ``TransportConfig(name=..., **qos.transport_fields())``."""
        return {"kv_service_level": self.kv_service_level, "kv_traffic_class": self.kv_traffic_class}

    def collective_env(self) -> dict[str, str]:
        """The environment an engine's rank processes start with so NCCL's queue pairs take the collectives'
        classes (rank 0 sets it on itself before it starts the others, which inherit it)."""
        return {"NCCL_IB_SL": str(self.collective_service_level), "NCCL_IB_TC": str(self.collective_traffic_class)}


@dataclass(frozen=True)
class TransportConfig:
    """KV transfers between engines.

    Low-priority (KV) segments are cut into ``chunk_bytes`` pieces that yield to high-priority work between
    pieces. ``kv_service_level`` / ``kv_traffic_class`` put KV traffic on the fabric's low-priority lane
    (InfiniBand SL mapped to a low-priority VL by the subnet manager; RoCE traffic class, DSCP << 2, which is also
    the ``IP_TOS`` of the transports' TCP sockets; 0: unmarked). Engines take both from their ``QosConfig``.
    """

    name: str = "shm"
    host: str = "127.0.0.1"
    listen_port: int = 0  # transports that listen (ucx): this port and the next, one per priority class (0: any)
    chunk_bytes: int = 1 << 20
    op_timeout_s: float = 30.0
    kv_service_level: int = QosConfig.kv_service_level
    kv_traffic_class: int = QosConfig.kv_dscp << 2
    device_name: str | None = None  # RDMA device for `verbs`, e.g. mlx5_0
    gid_index: int = 0

    def __post_init__(self):
        if self.chunk_bytes < 4096:
            raise ConfigError(f"chunk_bytes must be at least 4096, got {self.chunk_bytes}")
        if not 0 <= self.kv_service_level <= 15:
            raise ConfigError(f"kv_service_level must be in [0, 15], got {self.kv_service_level}")
        if not 0 <= self.kv_traffic_class <= 255:
            raise ConfigError(f"kv_traffic_class must be a byte (DSCP << 2), got {self.kv_traffic_class}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's ``ngram`` method). Each decode step proposes up to
    ``num_tokens`` tokens per sequence, those that followed the latest earlier occurrence of its last ``max_n``
    (down to ``min_n``) tokens, and one forward scores them all. Every token is still drawn as plain decoding draws
    it (the argmax, or the request's own generator) and a proposal is kept only while it equals the drawn token,
    so the output is exactly plain decoding's, seeded sampling included. ``num_tokens`` 0: off."""

    num_tokens: int = 0
    min_n: int = 2
    max_n: int = 4

    def __post_init__(self):
        if self.num_tokens < 0 or not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"speculative decoding needs num_tokens >= 0 and 1 <= min_n <= max_n, got {self}")

    @classmethod
    def parse(cls, text: str | dict | None) -> "SpeculativeConfig":
        """vLLM's ``--speculative-config`` JSON: ``{"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": n, "prompt_lookup_min": m}`` (None or "" for off)."""
        if not text:
            return cls()
        try:
            d = dict(json.loads(text) if isinstance(text, str) else text)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"speculative config: not a JSON object ({e})") from None
        if d.pop("method", "ngram") != "ngram":
            raise ConfigError('speculative config: only the "ngram" method (prompt lookup) is supported')
        unknown = sorted(set(d) - {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"})
        if unknown or "num_speculative_tokens" not in d:
            raise ConfigError(
                f"speculative config: give num_speculative_tokens (and optionally prompt_lookup_max, "
                f"prompt_lookup_min){'; unknown: ' + ', '.join(unknown) if unknown else ''}"
            )
        try:
            max_n = int(d.get("prompt_lookup_max", cls.max_n))
            return cls(int(d["num_speculative_tokens"]), int(d.get("prompt_lookup_min", min(cls.min_n, max_n))), max_n)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"speculative config: {e}") from None


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spans devices: ``tensor_parallel_size`` ranks (vLLM's and SGLang's ``-tp``), one process each
    on consecutive devices from the engine's (``cuda:k`` .. ``cuda:k+N-1``; CPU engines: N processes). Rank 0
    speaks for the engine; the others follow its steps (``dualpath.engines.parallel``). The ranks meet at a TCP store on
    ``master_port`` of this host (0: a free one) within ``join_timeout_s``; a collective that waits longer than
    ``collective_timeout_s`` (a rank hung) takes the engine down rather than hang it. MoE models:
    ``enable_expert_parallel`` (vLLM's flag) gives each rank whole routed experts, which tokens reach by
    ``moe_dispatch`` (``dualpath.engines.experts.DISPATCHES``); without it each rank holds a slice of every expert.

    Data-parallel attention (``data_parallel_size`` D > 1, MoE models, one rank per engine): D engines, each with
    its own requests, KV cache and attention weights, hold E/D routed experts each and exchange tokens in every
    MoE layer (``dualpath.engines.parallel.dp``); engine ``data_parallel_rank`` of the group meets the others at
    ``data_parallel_master`` (host:port, hosted by rank 0)."""

    tensor_parallel_size: int = 1
    master_port: int = 0
    join_timeout_s: float = 60.0
    collective_timeout_s: float = 120.0
    enable_expert_parallel: bool = False
    moe_dispatch: str = "all_to_all"
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_master: str = ""

    def __post_init__(self):
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ConfigError(f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"master_port must be a TCP port (0 for any), got {self.master_port}")
        if min(self.join_timeout_s, self.collective_timeout_s) <= 0:
            raise ConfigError("join_timeout_s and collective_timeout_s must be positive")
        if self.moe_dispatch not in ("all_to_all", "all_gather"):  # dualpath.engines.experts.DISPATCHES
            raise ConfigError(f"moe_dispatch must be all_to_all or all_gather, got {self.moe_dispatch!r}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size <= 64:
            raise ConfigError(
                f"data-parallel rank {self.data_parallel_rank} of {self.data_parallel_size}: the size "
                "must be in [1, 64] and the rank below it"
            )
        if self.data_parallel_size > 1:
            host, _, port = self.data_parallel_master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"data_parallel_master must be host:port (rank 0's rendezvous), got {self.data_parallel_master!r}"
                )
            if self.tensor_parallel_size > 1:
                raise ConfigError(
                    "data-parallel attention runs one rank per engine: --tensor-parallel-size 1 with "
                    "--data-parallel-size > 1"
                )

    def rank_device(self, device: str, rank: int) -> str:
        """Rank ``rank``'s device: the engine's ``cuda:k`` shifted by the rank; a CPU engine's ranks are all on
        ``cpu``."""
        if not device.startswith("cuda"):
            return device
        return f"cuda:{int(device.partition(':')[2] or 0) + rank}"


@dataclass(frozen=True)
class EngineConfig:
    """One engine's runtime choices. ``dtype`` is the model's dtype; ``kv_cache_dtype`` (vLLM's values) the KV
    cache's, in device memory, DRAM buffers, transfers and storage alike: ``auto`` the model's, ``fp8`` e4m3
    (half of bfloat16's bytes; values saturate at +-448, scale 1, as vLLM's default). ``quantization`` (vLLM's
    ``--quantization fp8``): a checkpoint's plain linear weights are quantized as they load, to block-scaled FP8
    in DeepSeek's blocks of 128 x 128 (``weight_quant``); None, or a checkpoint already in FP8, loads as stored."""

    device: str = "cpu"
    dtype: str = "float32"
    kernels: str = "auto"  # auto: triton kernels on CUDA, the torch reference on CPU; torch forces the reference
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (they are captured on CUDA with triton)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    cache: CacheConfig = field(default_factory=CacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora_modules: tuple[LoraModule, ...] = ()  # LoRA adapters loaded at start (requests name them by identity)
    quantization: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {self.quantization!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.kernels not in KERNEL_BACKENDS:
            raise ConfigError(f"kernels must be one of {KERNEL_BACKENDS}, got {self.kernels!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dtype(self) -> str:
        """The KV cache's torch dtype name."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def weight_quant(self) -> WeightQuantConfig | None:
        """What plain checkpoint weights are quantized to at load (``dualpath.engines.models.open_checkpoint``)."""
        return WeightQuantConfig() if self.quantization == "fp8" else None


@dataclass(frozen=True)
class SchedulerConfig:
    """The central scheduler. ``mode`` picks read paths (dualpath, pe, de, basic, split); ``policy`` places
    requests; an engine silent for ``heartbeat_timeout_s`` is declared dead and its requests re-queued.
    ``scheduling_policy`` orders its queues: "fcfs" by arrival (a request with a priority is refused, as vLLM
    refuses it: clients cannot jump the queue unless the operator lets them), "priority" by
    ``SamplingParams.priority`` (lower first; arrival order within one; strict, so a steady stream of urgent
    requests can keep others waiting), and a request no decode engine has room for preempts less urgent replies
    (``SchedulerCore._preempt_for``) unless ``priority_preemption`` is off (SGLang's
    ``--disable-priority-preemption``)."""

    host: str = "0.0.0.0"
    port: int = 0
    kv_store: str | None = None
    mode: str = "dualpath"
    policy: str = "dualpath"
    heartbeat_timeout_s: float = 10.0
    # the longest a request waits while a role has no engine alive (restarting) before it fails as unavailable;
    # 0: requests are refused while a role has none
    engine_wait_timeout_s: float = 60.0
    max_queued_requests: int = 4096
    max_attempts: int = 3
    max_assignments_per_pull: int = 256  # bounds a pull's reply (assignments carry their prompts)
    http_port: int = -1  # /health and /metrics (-1: none, 0: any free port)
    recompute_slow_hits: bool = True  # recompute a stored prefix when loading it would take longer
    scheduling_policy: str = "fcfs"  # "priority": queues order requests by SamplingParams.priority (vLLM's flag)
    priority_preemption: bool = True  # under "priority": a request no decode engine has room for preempts
    session_prefetch: bool = True  # read a waiting agent session's KV into a buffer before its next turn
    session_affinity: bool = True  # a session's turn prefers its last decode engine where the balance rules allow
    session_pin_quota_tokens: int = 1 << 20  # the most KV tokens one tenant's sessions may pin (ttl_s) in the store
    # the share of an authenticated member's block hashes the scheduler recomputes and compares (1.0: every
    # prompt's, as on an open plane, where every prompt is hashed here; a mismatch makes it 1.0 for good)
    verify_block_hashes: float = 1 / 64

    def __post_init__(self):
        if not 0 <= self.verify_block_hashes <= 1:
            raise ConfigError(f"verify_block_hashes must be between 0 and 1, got {self.verify_block_hashes}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )


@dataclass(frozen=True)
class EngineProcessConfig:
    """One engine process: its role, where it reports, and the sizes of what it holds.

    ``buffer_bytes`` is the DRAM buffer (Full Block slots); decode engines size their paged device cache from
    ``engine.cache``; prefill engines hold ``workspace_tokens`` of KV per layer slot (two slots: the layer computing
    and the next one arriving). ``prefill_kv_budget_bytes`` is the device memory a prefill batch's resident KV may
    take (0: no budget, each layer slot holds ``workspace_tokens``): a layerwise batch keeps two layers of its KV
    resident, a basic (non-layerwise) one all of them, so the budget bounds a basic batch ~``num_layers / 2`` times
    harder (the paper's §2 reason for layerwise prefill). ``compute_quota_s`` bounds a prefill batch's predicted time; ``cost_model`` gives
    the prediction's coefficients ``(fixed, per_token, attention)`` instead of profiling at start. ``qos`` gives the
    priority classes on the wire: ``transport`` carries its KV classes (``QosConfig.transport_fields``), the engine
    process hands the collectives' to its ranks (``QosConfig.collective_env``).
    """

    role: str
    model: str
    scheduler: str
    engine_id: str = ""
    node_id: str = ""
    group_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    qos: QosConfig = field(default_factory=QosConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # published stores and removals (routers)
    buffer_bytes: int = 256 << 20
    workspace_tokens: int = 16384
    prefill_kv_budget_bytes: int = 0
    compute_quota_s: float = 0.3
    pull_interval_s: float = 0.02
    cost_model: tuple[float, float, float] | None = None
    max_model_len: int = 0
    torch_threads: int = 0  # 0: torch's default
    alpha_tokens: int = 0  # tokens this node reads in 3 s, pinned (0: probed at start, then measured live)
    beta_tokens: int = 0  # prefill: tokens the device prefills in 5 s (0: from the cost model)
    prefetch_share: float = 0.5  # the most of the buffer sessions' prefetched KV may hold (0: take no prefetch orders)

    def __post_init__(self):
        if not 0 <= self.prefetch_share <= 1:
            raise ConfigError(f"prefetch_share must be between 0 and 1, got {self.prefetch_share}")
        if self.prefill_kv_budget_bytes < 0:
            raise ConfigError(f"prefill_kv_budget_bytes must be >= 0, got {self.prefill_kv_budget_bytes}")
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"role must be prefill or decode, got {self.role!r}")
        kv = {k: getattr(self.transport, k) for k in self.qos.transport_fields()}
        if kv != self.qos.transport_fields():
            raise ConfigError(
                f"the transport's KV classes {kv} are not the QoS config's "
                f"{self.qos.transport_fields()}: build both from one QosConfig"
            )
