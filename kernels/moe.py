"""DeepSeek-V3 mixture-of-experts routing and the routed-expert forward."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def grouped_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, num_groups: int, topk_group: int,
                 top_k: int, norm_topk_prob: bool, routed_scaling_factor: float):
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


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   experts: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight × expert(x)``; only experts that were chosen run."""
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.where(ids == expert)
        y = experts[expert](x[token_idx]) * weights[token_idx, slot, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out
