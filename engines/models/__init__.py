"""Model registry: architecture name -> class, and ``load_model`` for a checkpoint directory."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from dualpath.core.config import ModelConfig, WeightQuantConfig
from dualpath.core.errors import CheckpointError
from dualpath.engines.models.base import CausalLM, ForwardBatch, ForwardContext
from dualpath.engines.models.deepseek_v3 import DeepseekV3ForCausalLM
from dualpath.engines.models.llama import LlamaForCausalLM
from dualpath.engines.models.loader import Checkpoint, open_checkpoint
from dualpath.engines.comm import TPShard
from dualpath.kernels.attention import choose_backend
from dualpath.kernels.fp8 import FP8

log = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV3ForCausalLM,
}


def load_model(
    ckpt: Checkpoint | str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    kernels: str = "auto",
    quantize: WeightQuantConfig | None = None,
    shard: TPShard = TPShard(),
) -> CausalLM:
    """Build the model for a checkpoint on ``device`` in ``dtype`` and load its weights; ``kernels`` as in
    ``dualpath.kernels.attention.choose_backend``; ``quantize`` as in ``open_checkpoint`` (for a directory); ``shard``: the
    tensor-parallel rank whose part of the weights is read (the caller sets ``model.comm`` before a forward)."""
    if not isinstance(ckpt, Checkpoint):
        ckpt = open_checkpoint(ckpt, quantize)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = MODEL_CLASSES[ckpt.config.architecture](ckpt.config, choose_backend(kernels, device), shard)
    model.cast_(dtype)
    start = time.perf_counter()
    model.load_checkpoint(ckpt, device)
    _log_load(model, ckpt, time.perf_counter() - start)
    return model.eval()


def _log_load(model: CausalLM, ckpt: Checkpoint, seconds: float) -> None:
    """What the weights take on the device, and which are FP8 (vLLM's "model weights took ... GiB")."""
    params = list(model.parameters())
    fp8 = sum(p.numel() for p in params if p.dtype == FP8) / sum(p.numel() for p in params)
    log.info(
        "%s: %.1f MiB of weights on %s in %.1f s, %.0f%% of them FP8%s",
        ckpt.path.name,
        sum(p.numel() * p.element_size() for p in params) / 2**20,
        params[0].device,
        seconds,
        100 * fp8,
        " (quantized at load)" if ckpt.quantize_at_load else "",
    )


def open_update(model: CausalLM, model_dir: str | os.PathLike, quantize: WeightQuantConfig | None = None) -> Checkpoint:
    """Open checkpoint ``model_dir`` as new weights for ``model``: the same config in every field (not only the
    shapes: a RoPE scaling or an end token changes what the weights mean; the weights' format: plain weights
    reach a model held in FP8 only through the ``quantize`` it was loaded with) and every tensor present and
    shaped as the model needs, or ``CheckpointError`` naming what differs. Reads headers only."""
    ckpt = open_checkpoint(model_dir, quantize)
    differ = [
        f.name for f in dataclasses.fields(ModelConfig) if getattr(ckpt.config, f.name) != getattr(model.config, f.name)
    ]
    if differ:
        raise CheckpointError(
            f"{ckpt.path}: not new weights for the loaded model (its config differs in "
            f"{', '.join(differ)}); an update keeps the architecture and every shape"
        )
    model.check_checkpoint(ckpt)
    return ckpt


def reload_weights(model: CausalLM, model_dir: str | os.PathLike, quantize: WeightQuantConfig | None = None) -> str:
    """Load the weights of checkpoint ``model_dir`` into ``model`` in place (``CausalLM.reload_weights``, after
    ``open_update``'s checks) and return their sha256."""
    return model.reload_weights(open_update(model, model_dir, quantize))


__all__ = [
    "CausalLM",
    "Checkpoint",
    "ForwardBatch",
    "ForwardContext",
    "load_model",
    "open_checkpoint",
    "open_update",
    "reload_weights",
]
