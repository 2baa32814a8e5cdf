"""Feed-forward blocks shared by architectures: the dense gated MLP and the mixture of experts (DeepSeek-V3's
routing or Qwen3-MoE's, ``MoEConfig.scoring``), with the checkpoint tensors each is built from."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from dualpath.config import ModelConfig
from engines.models.base import WeightSpec, add_linear, linear, param
from engines.models.fp8 import as_weight
from kernels.activation import silu_and_mul
from kernels.moe import grouped_topk, routed_experts, softmax_topk


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_w = param(2 * inter, hidden)
        self.down_w = param(hidden, inter)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
        """``residual + mlp(x)`` (``add_linear``: on the fused path the sum is the down projection's epilogue,
        written over ``residual``, which the caller owns)."""
        act = silu_and_mul(linear(x, self.gate_up_w, None, backend), backend)
        return add_linear(residual, act, self.down_w, None, backend)


class MoE(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        e = c.moe
        self.config = e
        # routers stay float32 (``float32_params``): a rounded logit can flip which experts run
        self.router_w = param(e.num_experts, c.hidden_size, dtype=torch.float32)
        self.router_bias = param(e.num_experts, dtype=torch.float32) if e.scoring == "sigmoid" else None
        # routed experts stacked, so a fused kernel can index them by expert id: [E, 2I, H] (gate | up), [E, H, I]
        self.experts_gate_up = param(e.num_experts, 2 * e.moe_intermediate_size, c.hidden_size)
        self.experts_down = param(e.num_experts, c.hidden_size, e.moe_intermediate_size)
        self.shared = DenseMLP(c.hidden_size, e.moe_intermediate_size * e.num_shared_experts) \
            if e.num_shared_experts else None

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
        """``residual + moe(x)``: the routed experts' weighted sum, plus the shared experts."""
        e, logits = self.config, linear(x.float(), self.router_w)
        if e.scoring == "sigmoid":
            weights, ids = grouped_topk(logits, self.router_bias, e.num_groups, e.topk_group, e.num_experts_per_tok,
                                        e.norm_topk_prob, e.routed_scaling_factor)
        else:
            weights, ids = softmax_topk(logits, e.num_experts_per_tok, e.norm_topk_prob)
        out = routed_experts(x, weights, ids, as_weight(self.experts_gate_up), as_weight(self.experts_down),
                             backend)  # a fresh sum
        out = self.shared.add_to(out, x, backend) if self.shared is not None else out
        return residual + out


def moe_specs(c: ModelConfig, p: str, src: str) -> Iterator[WeightSpec]:
    """An MoE block ``p`` from the checkpoint's ``src`` (``model.layers.{i}.mlp.``): router ``gate``, experts
    ``experts.{j}.{gate,up,down}_proj``, DeepSeek's correction bias and shared experts."""
    e, h, inter = c.moe, c.hidden_size, c.moe.moe_intermediate_size
    yield WeightSpec(p + "router_w", ((src + "gate.weight", (e.num_experts, h)),))
    if e.scoring == "sigmoid":
        yield WeightSpec(p + "router_bias", ((src + "gate.e_score_correction_bias", (e.num_experts,)),))
    ex = range(e.num_experts)
    yield WeightSpec(p + "experts_gate_up", tuple((f"{src}experts.{j}.{w}_proj.weight", (inter, h))
                                                  for j in ex for w in ("gate", "up")), "stack", per_item=2, fp8=True)
    yield WeightSpec(p + "experts_down", tuple((f"{src}experts.{j}.down_proj.weight", (h, inter)) for j in ex),
                     "stack", fp8=True)
    if e.num_shared_experts:
        yield from mlp_specs(p + "shared.", src + "shared_experts.", h, inter * e.num_shared_experts)


def mlp_specs(p: str, src: str, hidden: int, inter: int, up_cuts: tuple = (),
              down_cuts: tuple = ()) -> Iterator[WeightSpec]:
    """A dense MLP's weights; ``up_cuts`` / ``down_cuts``: a tensor-parallel rank's rows of gate and up, columns of
    down (``WeightSpec.cuts``)."""
    yield WeightSpec(p + "gate_up_w", ((src + "gate_proj.weight", (inter, hidden)),
                                       (src + "up_proj.weight", (inter, hidden))), "cat", fp8=True, cuts=up_cuts)
    yield WeightSpec(p + "down_w", ((src + "down_proj.weight", (hidden, inter)),), fp8=True, cuts=down_cuts)


def router_params(model: nn.Module) -> list[str]:
    """The float32 parameters of ``model``'s MoE blocks (``CausalLM.float32_params``)."""
    return [n for n, _ in model.named_parameters() if n.endswith(("router_w", "router_bias"))]
