"""Feed-forward blocks shared by architectures: the dense gated MLP and the mixture of experts (DeepSeek-V3's
routing or Qwen3-MoE's, ``MoEConfig.scoring``), with the checkpoint tensors each is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from dualpath.core.config import ModelConfig
from dualpath.engines.models.base import WeightSpec, add_linear, linear, param
from dualpath.engines.models.fp8 import as_weight
from dualpath.engines.models.loader import Cut
from dualpath.engines.comm import TPShard
from dualpath.engines.experts import ExpertMap, make_dispatch
from dualpath.kernels.activation import silu_and_mul
from dualpath.kernels.moe import grouped_topk, routed_experts, softmax_topk


class DenseMLP(nn.Module):
    """A gated MLP; under tensor parallelism this rank's slice of its intermediate rows (``inter`` is the slice's
    size), its output a partial sum all-reduced in ``add_to``."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_w = param(2 * inter, hidden)
        self.down_w = param(hidden, inter)
        self.comm = None  # set by ``connect`` at tensor-parallel size > 1

    def connect(self, comm, dispatch: str) -> None:
        self.comm = comm

    def partial(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        """This rank's part of ``mlp(x)`` (all of it at TP 1), a fresh tensor."""
        return linear(silu_and_mul(linear(x, self.gate_up_w, None, backend), backend), self.down_w, None, backend)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
        """``residual + mlp(x)`` (``add_linear``: on the fused path the sum is the down projection's epilogue,
        written over ``residual``, which the caller owns)."""
        if self.comm is not None:
            return residual + self.comm.all_reduce(self.partial(x, backend))
        act = silu_and_mul(linear(x, self.gate_up_w, None, backend), backend)
        return add_linear(residual, act, self.down_w, None, backend)


@dataclass(frozen=True)
class MoEPart:
    """What one rank holds of an MoE block: routed experts ``experts`` (all of them but under expert parallelism),
    rows ``inter`` of each one's intermediate (all of them but under tensor parallelism without expert
    parallelism), and rows ``shared`` of the shared experts' intermediate (split under any parallelism)."""

    experts: ExpertMap
    inter: tuple[int, int]
    shared: tuple[int, int]

    @classmethod
    def of(cls, c: ModelConfig, shard: TPShard) -> "MoEPart":
        e = c.moe
        whole = (0, e.moe_intermediate_size)
        if shard.dp_size > 1:  # data-parallel attention (one rank per engine): the group's engines split the experts
            return cls(
                ExpertMap(e.num_experts, shard.dp_rank, shard.dp_size),
                whole,
                (0, e.moe_intermediate_size * e.num_shared_experts),
            )
        experts = (
            ExpertMap(e.num_experts, shard.rank, shard.size) if shard.expert_parallel else ExpertMap(e.num_experts)
        )
        inter = whole if shard.expert_parallel else shard.split(e.moe_intermediate_size, "moe_intermediate_size")
        shared = shard.split(e.moe_intermediate_size * e.num_shared_experts, "the shared experts' intermediate size")
        return cls(experts, inter, shared)


class MoE(nn.Module):
    def __init__(self, c: ModelConfig, shard: TPShard = TPShard()):
        super().__init__()
        e = c.moe
        self.config, self.part = e, MoEPart.of(c, shard)
        n, inter = self.part.experts.per_rank, self.part.inter[1] - self.part.inter[0]
        # routers stay float32 (``float32_params``): a rounded logit can flip which experts run
        self.router_w = param(e.num_experts, c.hidden_size, dtype=torch.float32)
        self.router_bias = param(e.num_experts, dtype=torch.float32) if e.scoring == "sigmoid" else None
        # routed experts stacked, so a fused kernel can index them by expert id: [E, 2I, H] (gate | up), [E, H, I]
        self.experts_gate_up = param(n, 2 * inter, c.hidden_size)
        self.experts_down = param(n, c.hidden_size, inter)
        self.shared = (
            DenseMLP(c.hidden_size, self.part.shared[1] - self.part.shared[0]) if e.num_shared_experts else None
        )
        self.comm, self.dispatch = None, None  # ``connect``: at tensor-parallel size > 1

    def connect(self, comm, dispatch: str) -> None:
        """Reduce over ``comm``'s ranks; under expert parallelism, reach the experts by ``dispatch``."""
        self.comm = comm
        if self.part.experts.size > 1:
            self.dispatch = make_dispatch(dispatch, comm, self.part.experts, replicated=True)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
        """``residual + moe(x)``: the routed experts' weighted sum, plus the shared experts."""
        e, logits = self.config, linear(x.float(), self.router_w)
        if e.scoring == "sigmoid":
            weights, ids = grouped_topk(
                logits,
                self.router_bias,
                e.num_groups,
                e.topk_group,
                e.num_experts_per_tok,
                e.norm_topk_prob,
                e.routed_scaling_factor,
            )
        else:
            weights, ids = softmax_topk(logits, e.num_experts_per_tok, e.norm_topk_prob)
        if self.dispatch is not None:  # whole experts on each rank: the pairs travel to them
            shared = self.shared.partial(x, backend) if self.shared is not None else None
            if self.dispatch.replicated:  # (a sliced shared expert's part rides in the dispatch's reduction)
                return residual + self.dispatch.routed(x, weights, ids, self._compute(backend), shared)
            out = self.dispatch.routed(x, weights, ids, self._compute(backend))
            return residual + (out if shared is None else out.add_(shared))
        out = routed_experts(
            x, weights, ids, as_weight(self.experts_gate_up), as_weight(self.experts_down), backend
        )  # a fresh sum
        if self.comm is None:
            out = self.shared.add_to(out, x, backend) if self.shared is not None else out
            return residual + out
        if self.shared is not None:  # each rank's slice of every expert: one reduction for routed and shared
            out.add_(self.shared.partial(x, backend))
        return residual + self.comm.all_reduce(out)

    def _compute(self, backend: str):
        """This rank's experts on (token, expert) pairs: ``weight × expert(x)`` per pair (``experts.Compute``)."""
        gate_up, down = as_weight(self.experts_gate_up), as_weight(self.experts_down)
        return lambda xs, local, w: routed_experts(xs, w[:, None], local[:, None], gate_up, down, backend)

    def idle(self, backend: str, dtype: torch.dtype) -> None:
        """This layer's dispatch without tokens of this engine's own (data-parallel attention: another engine runs
        a forward, and this one's experts serve its tokens)."""
        k, h = self.config.num_experts_per_tok, self.router_w.shape[1]
        x = self.router_w.new_empty(0, h, dtype=dtype)
        self.dispatch.routed(
            x,
            self.router_w.new_empty(0, k),
            torch.empty(0, k, dtype=torch.long, device=x.device),
            self._compute(backend),
        )


def moe_specs(c: ModelConfig, p: str, src: str, part: MoEPart | None = None) -> Iterator[WeightSpec]:
    """An MoE block ``p`` from the checkpoint's ``src`` (``model.layers.{i}.mlp.``): router ``gate``, experts
    ``experts.{j}.{gate,up,down}_proj``, DeepSeek's correction bias and shared experts; ``part``: what this rank
    reads of them (None: all)."""
    e, h, inter = c.moe, c.hidden_size, c.moe.moe_intermediate_size
    part = part or MoEPart.of(c, TPShard())
    yield WeightSpec(p + "router_w", ((src + "gate.weight", (e.num_experts, h)),))
    if e.scoring == "sigmoid":
        yield WeightSpec(p + "router_bias", ((src + "gate.e_score_correction_bias", (e.num_experts,)),))
    ex = range(part.experts.first, part.experts.first + part.experts.per_rank)
    cut = part.inter != (0, inter)
    yield WeightSpec(
        p + "experts_gate_up",
        tuple((f"{src}experts.{j}.{w}_proj.weight", (inter, h)) for j in ex for w in ("gate", "up")),
        "stack",
        per_item=2,
        fp8=True,
        cuts=(Cut(0, *part.inter),) * 2 * len(ex) if cut else (),
    )
    yield WeightSpec(
        p + "experts_down",
        tuple((f"{src}experts.{j}.down_proj.weight", (h, inter)) for j in ex),
        "stack",
        fp8=True,
        cuts=(Cut(1, *part.inter),) * len(ex) if cut else (),
    )
    if e.num_shared_experts:
        shared, whole = part.shared, inter * e.num_shared_experts
        split = shared != (0, whole)
        yield from mlp_specs(
            p + "shared.",
            src + "shared_experts.",
            h,
            whole,
            (Cut(0, *shared),) * 2 if split else (),
            (Cut(1, *shared),) if split else (),
        )


def mlp_specs(
    p: str, src: str, hidden: int, inter: int, up_cuts: tuple = (), down_cuts: tuple = ()
) -> Iterator[WeightSpec]:
    """A dense MLP's weights; ``up_cuts`` / ``down_cuts``: a tensor-parallel rank's rows of gate and up, columns of
    down (``WeightSpec.cuts``)."""
    yield WeightSpec(
        p + "gate_up_w",
        ((src + "gate_proj.weight", (inter, hidden)), (src + "up_proj.weight", (inter, hidden))),
        "cat",
        fp8=True,
        cuts=up_cuts,
    )
    yield WeightSpec(p + "down_w", ((src + "down_proj.weight", (hidden, inter)),), fp8=True, cuts=down_cuts)


def router_params(model: nn.Module) -> list[str]:
    """The float32 parameters of ``model``'s MoE blocks (``CausalLM.float32_params``)."""
    return [n for n, _ in model.named_parameters() if n.endswith(("router_w", "router_bias"))]
