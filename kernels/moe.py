"""Mixture-of-experts routing (DeepSeek-V3's grouped sigmoid top-k, Qwen3-MoE's softmax top-k) and the
routed-expert forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dualpath.kernels.activation import silu_and_mul
from dualpath.kernels.fp8 import Fp8Weight, Weight, as_fp8_activations


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    num_groups: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
):
    """DeepSeek-V3 routing: sigmoid scores, top groups by the sum of their two best biased scores, then the top-k
    experts inside those groups by biased score; weights are the unbiased scores (normalized if asked), scaled.

    router_logits ``[T, E]`` (float32). Returns ``(weights [T, k], expert_ids [T, k])``.
    """
    t, e = router_logits.shape
    scores = router_logits.sigmoid()
    biased = scores + correction_bias
    group_scores = biased.view(t, num_groups, e // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
    biased = biased.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(biased, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def softmax_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Qwen3-MoE routing: the top-k experts by softmax probability (float32), their probabilities as weights,
    renormalized to sum to one if asked. Returns ``(weights [T, k], expert_ids [T, k])``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k=top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def routed_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: Weight, down: Weight, backend: str = "torch"
) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight × expert(x)``, an expert being ``down(silu(gate(x)) × up(x))``
    with stacked weights ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``, tensors or
    block-scaled FP8 (``dualpath.kernels.fp8``). The torch reference runs only the experts chosen (the host learns which),
    dequantizing those; ``triton`` runs the fused kernels (``dualpath.kernels.triton_moe``), which never ask."""
    if backend == "triton":
        from dualpath.kernels.triton_moe import fused_moe

        return fused_moe(x, weights, ids, gate_up, down)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids.reshape(-1)).tolist():
        token_idx, slot = torch.where(ids == expert)
        y = F.linear(
            silu_and_mul(F.linear(x[token_idx], _expert(gate_up, expert, x.dtype))), _expert(down, expert, x.dtype)
        )
        y = y * weights[token_idx, slot, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out


def _expert(w: Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w.expert(e).dequantize(dtype) if isinstance(w, Fp8Weight) else w[e]


def routed_experts_w8a8(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: Fp8Weight,
    down: Fp8Weight,
    act_dtype: torch.dtype,
) -> torch.Tensor:
    """What the fused kernels compute with FP8 activations (``dualpath.kernels.triton_moe``'s w8a8), in x's dtype (float64
    for a reference): the tokens quantized per row and gate/up K block, each pair's ``silu(gate) × up`` rounded to
    ``act_dtype`` (as the kernels hold it) and quantized per row and down K block, times down, times the pair's
    routing weight."""
    xd = as_fp8_activations(x, gate_up.block[1]).to(x.dtype)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids.reshape(-1)).tolist():
        token_idx, slot = torch.where(ids == expert)
        act = silu_and_mul(F.linear(xd[token_idx], gate_up.expert(expert).dequantize(x.dtype))).to(act_dtype)
        y = F.linear(as_fp8_activations(act, down.block[1]).to(x.dtype), down.expert(expert).dequantize(x.dtype))
        out.index_add_(0, token_idx, y * weights[token_idx, slot, None].to(x.dtype))
    return out
