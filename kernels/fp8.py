"""Block-scaled FP8 weights, the format of DeepSeek-V3's, V3.2's and Qwen3-FP8's checkpoints: e4m3 values and one
float32 scale (the checkpoint's ``weight_scale_inv``) per block of ``block = (bn, bk)`` output × input elements,
so ``W[n, k] = q[n, k] × scale[n // bn, k // bk]``. Edge blocks may be partial (``ceil`` scale shapes).

Weights stay in FP8 in memory and are multiplied as 16-bit (w8a16): each weight is dequantized in float32, rounded
once to the activations' dtype, then multiplied, as transformers does when it dequantizes an FP8 checkpoint. The
torch reference dequantizes the whole weight per call; the Triton kernel (``dualpath.kernels.triton_fp8``) dequantizes
tiles in registers, so a weight-bound decode step reads half of bfloat16's bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dualpath.kernels.kv_move import FP8, FP8_MAX


class Fp8Weight(NamedTuple):
    """A block-scaled FP8 weight: ``q [..., N, K]`` e4m3, ``scale [..., ceil(N/bn), ceil(K/bk)]`` float32 (a
    leading dim stacks experts)."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.q, self.scale, self.block, dtype)

    def expert(self, e: int) -> "Fp8Weight":
        return Fp8Weight(self.q[e], self.scale[e], self.block)


Weight = torch.Tensor | Fp8Weight


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales of a weight of ``shape`` in blocks of ``block``: one per (partial) block of its last two dims."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Each element's scale, ``shape``-sized."""
    n, k = shape[-2:]
    return scale.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]


def dequantize_blocks(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q × scale`` computed in float32 (float64 for a float64 ``dtype``, where it is exact) and rounded once to
    ``dtype``."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(wide) * expand_scale(scale.to(wide), q.shape, block)).to(dtype)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with each block's largest magnitude at e4m3's largest finite value (448); an all-zero block
    gets scale 1. DeepSeek's and transformers' recipe; for ``dualpath quantize`` and tests."""
    w = w.float()
    n, k = w.shape[-2:]
    pad = w.new_zeros(*w.shape[:-2], -(-n // block[0]) * block[0], -(-k // block[1]) * block[1])
    pad[..., :n, :k] = w.abs()
    tiles = pad.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # [..., Nb, bn, Kb, bk]
    amax = tiles.amax(dim=(-3, -1))
    # over a tensor, not a Python number: CUDA torch multiplies by a number divisor's reciprocal, which is not
    # correctly rounded, so the scales (and bytes) would differ from a CPU's and from the kernels'
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (w / expand_scale(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_linear(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    backend: str = "torch",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias``, plus ``residual`` if given (on triton written over it, as ``add_linear`` does). The
    reference rounds the product and then the sum; the kernel rounds once. On triton the rows choose the kernel: a
    decode batch (``dualpath.kernels.triton_fp8.uses_swap_ab``: up to 64 rows) takes the swap-AB w8a16 GEMM, a
    batch of prefill size multiplies FP8 by FP8 (``uses_w8a8``), as DeepSeek's and vLLM's FP8 serving does, and
    the rows between take the w8a16 GEMM."""
    if backend == "triton":
        from dualpath.kernels import triton_fp8 as t

        if t.uses_swap_ab(x):
            return t.w8a16_swap_linear(x, w, bias, residual)
        linear = t.w8a8_linear if t.uses_w8a8(x, w) else t.w8a16_linear
        return linear(x, w, bias, residual)
    out = F.linear(x, w.dequantize(x.dtype), bias)
    return out if residual is None else residual + out


def w8a8_reference(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """What ``w8a8_linear`` computes, in float64 over the values it multiplies: x's rows quantized in groups of the
    weight's K block (``quantize_activations``), times the weight's values, bias and residual added, one rounding
    to x's dtype."""
    out = as_fp8_activations(x.reshape(-1, x.shape[-1]), w.block[1]) @ w.dequantize(torch.float64).t()
    if bias is not None:
        out += bias.double()
    if residual is not None:
        out += residual.reshape(out.shape).double()
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def as_fp8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """Rows ``x [M, K]`` as the w8a8 kernels multiply them: quantized (``quantize_activations``), then dequantized
    exactly, in float64 (an e4m3 value times a float32 scale needs more than float32's mantissa)."""
    q, scale = quantize_activations(x.float(), group)
    return dequantize_blocks(q, scale, (1, group), torch.float64)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, K]`` as e4m3 with one float32 scale per row per ``group`` columns (DeepSeek's 1 x 128
    activation blocks): ``quantize_blocks`` with blocks of one row."""
    return quantize_blocks(x, (1, group))
