"""Model registry: architecture name -> class, and ``load_model`` for a checkpoint directory."""
from __future__ import annotations

import dataclasses
import os

import torch

from dualpath.config import ModelConfig
from dualpath.errors import CheckpointError
from engines.models.base import CausalLM, ForwardBatch, ForwardContext
from engines.models.deepseek_v3 import DeepseekV3ForCausalLM
from engines.models.llama import LlamaForCausalLM
from engines.models.loader import Checkpoint, open_checkpoint
from kernels.attention import choose_backend

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV3ForCausalLM,
}


def load_model(ckpt: Checkpoint | str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | str = torch.float32, kernels: str = "auto") -> CausalLM:
    """Build the model for a checkpoint on ``device`` in ``dtype`` and load its weights; ``kernels`` as in
    ``kernels.attention.choose_backend``."""
    if not isinstance(ckpt, Checkpoint):
        ckpt = open_checkpoint(ckpt)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = MODEL_CLASSES[ckpt.config.architecture](ckpt.config, choose_backend(kernels, device))
    model.cast_(dtype)
    model.load_checkpoint(ckpt, device)
    return model.eval()


def open_update(model: CausalLM, model_dir: str | os.PathLike) -> Checkpoint:
    """Open checkpoint ``model_dir`` as new weights for ``model``: the same config in every field (not only the
    shapes: a RoPE scaling or an end token changes what the weights mean) and every tensor present and shaped as
    the model needs, or ``CheckpointError`` naming what differs. Reads headers only."""
    ckpt = open_checkpoint(model_dir)
    differ = [f.name for f in dataclasses.fields(ModelConfig)
              if getattr(ckpt.config, f.name) != getattr(model.config, f.name)]
    if differ:
        raise CheckpointError(f"{ckpt.path}: not new weights for the loaded model (its config differs in "
                              f"{', '.join(differ)}); an update keeps the architecture and every shape")
    model.check_checkpoint(ckpt)
    return ckpt


def reload_weights(model: CausalLM, model_dir: str | os.PathLike) -> str:
    """Load the weights of checkpoint ``model_dir`` into ``model`` in place (``CausalLM.reload_weights``, after
    ``open_update``'s checks) and return their sha256."""
    return model.reload_weights(open_update(model, model_dir))


__all__ = ["CausalLM", "Checkpoint", "ForwardBatch", "ForwardContext", "load_model", "open_checkpoint",
           "open_update", "reload_weights"]
