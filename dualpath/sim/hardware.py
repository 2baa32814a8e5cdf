"""Hardware and model presets for cluster modelling, with the calibration choices written down.

Bandwidths are bytes per second and per direction unless named otherwise; DRAM bandwidth is the total a node's
memory system sustains (reads plus writes), the paper's M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dualpath.core.errors import ConfigError
from dualpath.engines.batcher import CostModel

GBPS = 1e9 / 8  # one gigabit per second, in bytes per second


@dataclass(frozen=True)
class Hardware:
    """One node type: ``gpus`` devices, each paired with one compute NIC; one storage NIC per node.

    ``storage_read_bps`` is what one node's storage client actually reads (file system and SSDs included), at
    most the SNIC's line rate; 0 means the line rate. The §4.2 link formulas use the line rate."""

    gpus: int = 8
    cnic_bps: float = 400 * GBPS  # per GPU, per direction (the paper's B)
    snic_bps: float = 400 * GBPS  # per node (s·B)
    dram_bps: float = 500e9  # per node, reads + writes (M)
    storage_read_bps: float = 0.0
    hbm_bytes: float = 80 * 2**30  # per GPU: the paper's Hopper GPUs, H800s of 80 GiB HBM3

    @property
    def storage_ratio(self) -> float:
        """The paper's s: a node's storage bandwidth in units of one compute NIC."""
        return self.snic_bps / self.cnic_bps

    @property
    def read_bps(self) -> float:
        """A node's effective storage read bandwidth."""
        return min(self.snic_bps, self.storage_read_bps) if self.storage_read_bps > 0 else self.snic_bps

    def __post_init__(self):
        if (
            self.gpus < 1
            or min(self.cnic_bps, self.snic_bps, self.dram_bps, self.hbm_bytes) <= 0
            or self.storage_read_bps < 0
        ):
            raise ValueError(f"hardware needs >= 1 GPU and positive bandwidths: {self}")


# The paper's node (§6): 8 Hopper GPUs, 8 x 400 Gbps compute NICs, one 400 Gbps storage NIC, ~500 GB/s DRAM.
PAPER_NODE = Hardware()

# Calibration of the storage read rate: Basic is storage-bound through its prefill nodes' SNICs only. The paper's
# DS 660B 2P4D 64K Basic runs (1,024 / 2,048 / 4,096 agents: 5,365 / 10,052 / 19,309 s) move ~1.32 GB of stored KV
# per turn (32.3K hit tokens x 40 KiB) x 92.5 turns per agent (Table 2: total / (append + gen); its 157 is the
# per-turn average, see dualpath/rollout/tracegen.py): ~13 GB/s per node on average; fitted by simulating the
# 1,024-agent run (Basic 5,365 s) it is 14.6 GB/s per node, 29% of the 400 Gbps line (3FS, no DRAM cache, 64-token
# blocks). With it DualPath simulates at 2,976 s (the paper: 2,917) with no cap on the storage system as a whole:
# an earlier aggregate cap (fitted when traces ran 157 turns per agent) is gone.
PAPER_STORAGE_READ_BPS = 14.6e9
PAPER_CLUSTER_NODE = Hardware(storage_read_bps=PAPER_STORAGE_READ_BPS)


@dataclass(frozen=True)
class EngineModel:
    """A GPU's timing: prefill by the engines' cost model (per request on one GPU of a prefill node), decode steps
    (all running requests of one decode GPU advance one token), and the KV tokens a decode GPU holds.

    ``tp_comm`` prices tensor parallelism (``with_tp``): the time a ring all-reduce of the activations takes, at
    the ring's limit, as a fraction of one GPU's compute time for the same tokens. A ring all-reduce over t ranks
    moves 2(t-1)/t of the tensor per rank while each rank computes 1/t of the work, both per token, so an engine
    of t GPUs takes ``(1 + tp_comm x (t - 1)) / t`` of one GPU's time: speed-up ``tp_speedup(t)``. The default,
    0.05, is Llama-70B-like prefill on NVLink Hopper (~2.6 MB of all-reduce per token against ~0.35 ms of one
    GPU's compute: ~0.04), rounded up for decode's latency-bound small all-reduces; it gives 1.9x at TP 2, 3.5x
    at TP 4 and 5.9x at TP 8. It does not touch TP 1: ``with_tp(1)`` is the model itself."""

    prefill: CostModel
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_token_s: float  # per cached token attended, per step
    decode_kv_tokens: int
    num_layers: int
    tp_comm: float = 0.05

    def __post_init__(self):
        if self.tp_comm < 0:
            raise ConfigError(f"tp_comm must be >= 0, got {self.tp_comm}")

    def decode_step(self, batch: int, context_tokens: int) -> float:
        return self.decode_fixed_s + self.decode_per_seq_s * batch + self.decode_per_token_s * context_tokens

    def tp_speedup(self, tp: int) -> float:
        """How many times one GPU's compute an engine of ``tp`` GPUs has (exactly 1 at TP 1)."""
        return tp / (1 + self.tp_comm * (tp - 1))

    def with_tp(self, tp: int) -> EngineModel:
        """One engine of ``tp`` GPUs as one engine of the simulator: ``tp`` x the KV tokens (each rank's HBM holds
        its heads' part of every token), every timing divided by ``tp_speedup(tp)`` (all of an engine's work is
        split among its ranks: weights, heads, KV reads). Apply once, to a one-GPU model."""
        if tp == 1:
            return self  # TP 1 results stay bit-for-bit what they were
        f = 1 / self.tp_speedup(tp)
        p = self.prefill
        return replace(
            self,
            prefill=CostModel(p.fixed * f, p.per_token * f, p.attention * f),
            decode_fixed_s=self.decode_fixed_s * f,
            decode_per_seq_s=self.decode_per_seq_s * f,
            decode_per_token_s=self.decode_per_token_s * f,
            decode_kv_tokens=self.decode_kv_tokens * tp,
        )


def engines_per_node(hw: Hardware, tp: int, role: str) -> int:
    """How many engines of ``tp`` GPUs a node of ``role`` runs: all its GPUs, an engine's ranks on one node."""
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"{role} tensor-parallel size must be a whole number of GPUs >= 1, got {tp!r}")
    if hw.gpus % tp:
        raise ConfigError(
            f"{role} tensor-parallel size {tp} does not divide the node's {hw.gpus} GPUs (--gpus): an "
            f"engine's ranks are GPUs of one node, and every GPU of a node runs one"
        )
    return hw.gpus // tp


@dataclass(frozen=True)
class PrefillWeights:
    """What a prefill GPU's HBM holds besides KV: the routed experts, spread over every prefill GPU of the
    deployment by expert parallelism, the rest of the weights (attention, shared experts, dense layers, embeddings)
    on every GPU, and a reserve for activations, communication buffers and the CUDA context."""

    routed_bytes: float
    replicated_bytes: float
    reserve_bytes: float

    def kv_budget_bytes(self, hw: Hardware, prefill_gpus: int) -> float:
        """A prefill GPU's HBM left for resident KV when its deployment spans ``prefill_gpus`` GPUs (EP size); inf
        where the weights would not fit at all (a toy layout, as small test clusters are: no bound is modelled)."""
        free = hw.hbm_bytes - self.replicated_bytes - self.routed_bytes / prefill_gpus - self.reserve_bytes
        return free if free > 0 else math.inf


@dataclass(frozen=True)
class ModelPreset:
    """What the cluster model needs of a model: KV bytes per token (all layers), its engines' timings on the
    paper's GPU (None: give them explicitly), and what its weights leave of a prefill GPU's HBM (None: KV is not
    bounded by HBM)."""

    name: str
    kv_bytes_per_token: int
    engine: EngineModel | None = None
    prefill_weights: PrefillWeights | None = None


# DeepSeek 660B (V3.2) weights on a prefill GPU, from its configuration (hidden 7,168; 61 layers, the first 3 dense;
# 256 routed experts of intermediate 2,048 and one shared; MLA with q rank 1,536 and kv rank 512; vocabulary
# 129,280), FP8 weights (1 byte a parameter) but BF16 embeddings and output head:
# * routed experts: 58 layers x 256 x 3 x 7,168 x 2,048 = 653.8e9 parameters -> 653.8 GB, spread by EP;
# * on every GPU: attention 61 x 187.0M (q_a 11.0M, q_b 37.7M, kv_a 4.1M, kv_b 16.8M, o 117.4M) = 11.41e9, the
#   sparse-attention indexer 61 x 14.0M = 0.85e9, shared experts 58 x 44.0M = 2.55e9, dense MLPs 3 x 396.4M =
#   1.19e9, routers 0.11e9: 16.1 GB in FP8, + embeddings and head 2 x 0.93e9 in BF16 = 3.7 GB: 19.8 GB;
# * reserve: 6 GB (activations of a ~16K-token batch through a 7,168-wide model and its MoE, ~2.5 GB; DeepEP's
#   dispatch/combine buffers, ~3 GB; the CUDA context, ~0.5 GB). Not fitted: the result does not turn on it (see
#   docs/simulator.md: the bound does not bind below a ~15 GB reserve).
# At the paper's 2P (EP16) that leaves 85.9 - 19.8 - 40.9 - 6 = 19.2 GB a GPU: 469K tokens of all-layer KV
# (~14 turns of the 64K trace's 32.7K-token context), or 28.6M tokens of one layer's.
DS660B_PREFILL_WEIGHTS = PrefillWeights(653.8e9, 19.8e9, 6e9)


# Calibration of the engines (one Hopper GPU each; a "GPU" of the simulator is 1/g of an expert-parallel node):
# * DeepSeek 660B (V3.2; 61 layers; sparse attention, so compute per new token barely grows with context; ~40 KiB
#   of KV per token in FP8, as the paper estimates). Prefill: the paper's DualPath reads ~48 GB/s at 4,096 agents
#   (36.7 turns/s) and is "close to Oracle", so the 16 prefill GPUs are set ~25% faster than that:
#   0.348 s per turn (429 new over ~32.3K cached tokens), 80% per-token work, 20% the lightning indexer's pass
#   over the context (an expert-parallel prefill of a few hundred tokens per request is far from peak FLOPs).
#   Decode: ~25 ms steps (EP decode), HBM after weights holds ~1.2M tokens.
# * DeepSeek 27B (30 layers, MLA latent of 576 values in BF16: 34.6 KB/token). Fitted to the P/D sweep: with
#   DualPath at 1P1D Oracle is 1.85x faster, so one turn takes ~0.17 s on a prefill GPU (2 SNICs at 14.6 GB/s
#   feed ~26 turns/s; 8 GPUs at 0.17 s serve ~48). Decode ~12 ms steps, ~1.7M tokens per GPU.
# * Qwen2.5-32B (dense GQA, 64 layers, 8 KV heads x 128, FP16: 256 KiB/token). Not evaluated offline in the paper:
#   from FLOPs at 45% of the H800's BF16 peak (65 GFLOP per token: 1.44e-4 s; attention 1.31 MFLOP per (new,
#   cached) pair: 2.9e-9 s). Decode: TP8 weight reads ~20 ms per step, KV reads 1e-8 s per token; ~270K tokens.
MODELS = {
    "ds660b": ModelPreset(
        "DeepSeek 660B",
        40 * 1024,
        EngineModel(CostModel(0.0, 6.49e-4, 5.0e-9), 0.025, 1e-4, 5e-9, 1_200_000, 61),
        DS660B_PREFILL_WEIGHTS,
    ),
    "ds27b": ModelPreset(
        "DeepSeek 27B", 30 * 576 * 2, EngineModel(CostModel(0.0, 2.72e-4, 3.63e-9), 0.012, 5e-5, 3e-9, 1_700_000, 30)
    ),
    "qwen32b": ModelPreset(
        "Qwen2.5-32B", 64 * 8 * 128 * 2 * 2, EngineModel(CostModel(0.0, 1.44e-4, 2.9e-9), 0.02, 1e-4, 1e-8, 270_000, 64)
    ),
}
