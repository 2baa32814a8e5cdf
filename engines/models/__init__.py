"""Model registry: architecture name -> class, and ``load_model`` for a checkpoint directory."""
from __future__ import annotations

import os

import torch

from engines.models.base import CausalLM, ForwardBatch, ForwardContext
from engines.models.deepseek_v3 import DeepseekV3ForCausalLM
from engines.models.llama import LlamaForCausalLM
from engines.models.loader import Checkpoint, open_checkpoint
from kernels.attention import choose_backend

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
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


__all__ = ["CausalLM", "Checkpoint", "ForwardBatch", "ForwardContext", "load_model", "open_checkpoint"]
