"""Block-scaled FP8 checkpoint weights in the models (``dualpath.core.config.WeightQuantConfig``): which parameters stay
FP8, how their tensors and scales are checked and read, and the module that holds one where the model's parameter
stood.

A source tensor is FP8 when the checkpoint has its ``<name>_scale_inv``. A parameter stays FP8 when the model reads
it as a linear weight (``WeightSpec.fp8``) and every source is FP8 and joins the others at scale-block edges; any
other FP8 source is dequantized at load into the model's dtype (e.g. DeepSeek's ``kv_b_proj``, which attention
absorbs). A checkpoint quantized at load (``Checkpoint.quantize_at_load``) holds every such parameter in FP8: its
plain sources are joined, then quantized, so no join needs to meet a block edge.
"""

from __future__ import annotations

import torch
from torch import nn

from dualpath.engines.models.loader import Checkpoint
from dualpath.kernels.fp8 import FP8, Fp8Weight, Weight, dequantize_blocks, scale_shape

SCALE_SUFFIX = "_scale_inv"  # DeepSeek's and Qwen's name for a weight's block scales, beside the weight


class Fp8Param(nn.Module):
    """A linear weight held as block-scaled FP8 where the model's parameter stood (``CausalLM.load_checkpoint``
    puts it there): e4m3 ``q [..., N, K]`` and float32 ``scale``. Layers hand it on as they hand a weight; the
    kernels read it through ``as_weight``."""

    def __init__(self, shape: tuple[int, ...], block: tuple[int, int]):
        super().__init__()
        self.q = nn.Parameter(torch.empty(*shape, device="meta", dtype=FP8), requires_grad=False)
        self.scale = nn.Parameter(
            torch.empty(*scale_shape(shape, block), device="meta", dtype=torch.float32), requires_grad=False
        )
        self.block = block

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.q, self.scale, self.block)


def as_weight(w: torch.Tensor | Fp8Param) -> Weight:
    """What the kernels take: the tensor, or the FP8 weight's ``Fp8Weight``."""
    return w.weight if isinstance(w, Fp8Param) else w


def scaled(ckpt: Checkpoint, name: str) -> bool:
    return name + SCALE_SUFFIX in ckpt.tensor_files


def source_problems(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> list[str]:
    """What is wrong with source tensor ``name`` (of the expected ``shape``) as FP8: scales the config does not
    announce or of the wrong shape, a scale on a tensor that is not e4m3, e4m3 values without a scale."""
    quant, is_fp8 = ckpt.config.quant, ckpt.tensor_dtype(name) == "F8_E4M3"
    if not scaled(ckpt, name):
        return [f"tensor {name} is FP8 without a {name}{SCALE_SUFFIX}"] if is_fp8 else []
    if quant is None or ckpt.quantize_at_load:
        return [f"tensor {name} has a {SCALE_SUFFIX} but config.json has no quantization_config"]
    if not is_fp8:
        return [f"tensor {name} has a {SCALE_SUFFIX} but is stored as {ckpt.tensor_dtype(name)}, not F8_E4M3"]
    want, got = scale_shape(shape, quant.block), ckpt.tensor_shape(name + SCALE_SUFFIX)
    if got != want:
        return [
            f"tensor {name}{SCALE_SUFFIX} has shape {list(got)}, expected {list(want)} (blocks of {list(quant.block)})"
        ]
    return []


def stays_fp8(spec, ckpt: Checkpoint) -> bool:
    """Whether ``spec``'s parameter can be held FP8: read as a linear weight (``spec.fp8``), and quantized at load
    or stored so (``joins_stored_fp8``)."""
    if ckpt.config.quant is None or not spec.fp8:
        return False
    return ckpt.quantize_at_load or joins_stored_fp8(spec, ckpt)


def joins_stored_fp8(spec, ckpt: Checkpoint) -> bool:
    """Whether ``spec``'s FP8 sources can be joined as they are stored: every source FP8, and where sources are
    joined (a concatenation, or a stack's items) each part but the last ends on a scale-block edge, so the joined
    scales are the joined weight's."""
    if not all(scaled(ckpt, n) for n, _ in spec.sources):
        return False
    per, block = spec.per_item if spec.op == "stack" else len(spec.sources), ckpt.config.quant.block
    return all(shape[0] % block[0] == 0 for i, (_, shape) in enumerate(spec.sources) if (i + 1) % per)


def read_plain(ckpt: Checkpoint, name: str, read) -> torch.Tensor:
    """Source ``name`` as an unquantized tensor (FP8 ones dequantized in float32), through ``read(name)``."""
    t = read(name)
    return dequantize_blocks(t, read(name + SCALE_SUFFIX), ckpt.config.quant.block) if scaled(ckpt, name) else t
