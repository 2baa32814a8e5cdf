"""Rotary position embeddings: plain, Llama-3 frequency scaling, and YaRN as DeepSeek-V3 uses it."""

from __future__ import annotations

import math

import torch

from dualpath.core.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _base_inv_freq(rope: RopeConfig) -> torch.Tensor:
    dim = rope.rotary_dim
    return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(rope: RopeConfig) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope)
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if rope.attention_factor is not None:
        attn = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn = yarn_mscale(factor)
    return inv_freq, attn


def rope_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``rotary_dim / 2``) and the factor that scales cos and sin."""
    if rope.kind == "default":
        return _base_inv_freq(rope), 1.0
    if rope.kind == "linear":
        return _base_inv_freq(rope) / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3_inv_freq(rope), 1.0
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope)
    raise ValueError(f"unknown rope kind {rope.kind!r}")


def softmax_scale_factor(rope: RopeConfig) -> float:
    """Extra factor on the attention softmax scale: YaRN's ``mscale_all_dim`` squared (DeepSeek-V3), else 1."""
    if rope.kind == "yarn" and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return 1.0


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[T, rotary_dim / 2]`` for integer ``positions``."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * attention_factor).to(dtype), (freqs.sin() * attention_factor).to(dtype)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    backend: str = "torch",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the first ``2 × cos.shape[-1]`` dims of ``x`` (``[T, heads, dim]``), into ``out`` when given (a view
    with unit column stride, e.g. the rope part of MLA's KV row).

    Non-interleaved (GPT-NeoX / Llama) pairs dim i with i + d/2. Interleaved (DeepSeek) pairs 2i with 2i + 1 and
    writes the result de-interleaved (evens then odds), exactly as Hugging Face's DeepSeek-V3 does, so queries
    and cached keys always share one layout. ``backend`` "triton": one kernel (``dualpath.kernels.triton_elementwise``).
    """
    if backend == "triton":
        from dualpath.kernels.triton_elementwise import apply_rope as fused

        return fused(x, cos, sin, interleaved, out)
    y = _rotate(x, cos, sin, interleaved)
    return y if out is None else out.copy_(y)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused QKV projection ``[T, (Hq + 2 Hk) * D]`` -> (queries ``[T, Hq, D]`` and the layer's KV row
    ``[T, 2 Hk D]`` = [keys | values]), queries and keys rotated (not interleaved). ``backend`` "triton": one
    kernel (``dualpath.kernels.triton_elementwise``) instead of the views, rotations and concatenation."""
    if backend == "triton":
        from dualpath.kernels.triton_elementwise import rope_qkv as fused

        return fused(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    t, q_cols, k_cols = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = apply_rope(qkv[:, :q_cols].view(t, num_heads, head_dim), cos, sin)
    k = apply_rope(qkv[:, q_cols : q_cols + k_cols].view(t, num_kv_heads, head_dim), cos, sin)
    return q, torch.cat([k.reshape(t, k_cols), qkv[:, q_cols + k_cols :]], dim=1)
