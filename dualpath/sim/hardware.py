"""Hardware and model presets for cluster modelling, with the calibration choices written down.

Bandwidths are bytes per second and per direction unless named otherwise; DRAM bandwidth is the total a node's
memory system sustains (reads plus writes), the paper's M.
"""
from __future__ import annotations

from dataclasses import dataclass

GBPS = 1e9 / 8  # one gigabit per second, in bytes per second


@dataclass(frozen=True)
class Hardware:
    """One node type: ``gpus`` devices, each paired with one compute NIC; one storage NIC per node."""

    gpus: int = 8
    cnic_bps: float = 400 * GBPS  # per GPU, per direction (the paper's B)
    snic_bps: float = 400 * GBPS  # per node (s·B)
    dram_bps: float = 500e9  # per node, reads + writes (M)

    @property
    def storage_ratio(self) -> float:
        """The paper's s: a node's storage bandwidth in units of one compute NIC."""
        return self.snic_bps / self.cnic_bps

    def __post_init__(self):
        if self.gpus < 1 or min(self.cnic_bps, self.snic_bps, self.dram_bps) <= 0:
            raise ValueError(f"hardware needs >= 1 GPU and positive bandwidths: {self}")


# The paper's node (§6): 8 Hopper GPUs, 8 x 400 Gbps compute NICs, one 400 Gbps storage NIC, ~500 GB/s DRAM.
PAPER_NODE = Hardware()


@dataclass(frozen=True)
class ModelPreset:
    """What the link model needs of a model: KV bytes per token, all layers. (Compute per token and layer counts
    join when the engine models do.)"""

    name: str
    kv_bytes_per_token: int


# Calibration: KV bytes as the paper states them (660B: ~40 KB/token in FP8, estimated; Qwen2.5-32B FP16:
# 64 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 256 KiB). The 27B model's KV is estimated from its
# shape (30 layers, an MLA latent of 576 values in BF16).
MODELS = {
    "ds660b": ModelPreset("DeepSeek 660B", 40 * 1024),
    "ds27b": ModelPreset("DeepSeek 27B", 30 * 576 * 2),
    "qwen32b": ModelPreset("Qwen2.5-32B", 64 * 8 * 128 * 2 * 2),
}
