"""Llama family (SmolLM2, Llama 2/3, Mistral within its sliding window), Qwen2/Qwen2.5 (q/k/v bias), Qwen3
(RMSNorm over each query and key head before RoPE) and Qwen3-MoE (Qwen3's attention, softmax-routed experts).

KV row of one token in one layer: ``[K (kv_heads × head_dim) | V (kv_heads × head_dim)]``, K after RoPE.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import nn

from dataclasses import dataclass

from dualpath.core.config import ModelConfig
from dualpath.core.errors import CheckpointError
from dualpath.core.geometry import HeadShard
from dualpath.engines.lora import Target, add_lora
from dualpath.engines.models.base import CausalLM, ForwardContext, WeightSpec, add_linear, linear, param
from dualpath.engines.models.loader import Cut
from dualpath.engines.models.moe import MoE, mlp_specs, moe_specs, router_params
from dualpath.kernels.activation import silu_and_mul
from dualpath.kernels.attention import CachedRows, gqa_split, varlen_attention
from dualpath.kernels.norm import add_rms_norm, rms_norm
from dualpath.kernels.rope import rope_qkv
from dualpath.engines.comm import TPShard


class LlamaLayer(nn.Module):
    """One layer's weights; under tensor parallelism this rank's part (``Heads``): its query heads, its KV heads
    (column-parallel ``qkv_w``), the matching columns of ``o_w`` (row-parallel) and its slice of the MLP."""

    def __init__(self, c: ModelConfig, layer: int, heads: "Heads", shard: TPShard):
        super().__init__()
        q, kv = heads.num_q * c.head_dim, heads.kv.num_local * c.head_dim
        self.input_norm = param(c.hidden_size)
        self.qkv_w = param(q + 2 * kv, c.hidden_size)
        self.qkv_b = param(q + 2 * kv) if c.qkv_bias else None
        self.o_w = param(c.hidden_size, q)
        self.o_b = param(c.hidden_size) if c.o_bias else None
        self.q_norm = param(c.head_dim) if c.qk_norm else None
        self.k_norm = param(c.head_dim) if c.qk_norm else None
        self.post_norm = param(c.hidden_size)
        self.moe = MoE(c, shard) if c.is_moe_layer(layer) else None
        dense, inter = self.moe is None, heads.inter[1] - heads.inter[0]
        self.gate_up_w = param(2 * inter, c.hidden_size) if dense else None
        self.gate_up_b = param(2 * inter) if dense and c.mlp_bias else None
        self.down_w = param(c.hidden_size, inter) if dense else None
        self.down_b = param(c.hidden_size) if dense and c.mlp_bias else None


@dataclass(frozen=True)
class Heads:
    """What tensor-parallel rank ``shard`` holds of each layer: query heads ``[q_first, q_first + num_q)``, the KV
    heads of ``kv`` (replicated when there are fewer than ranks) and rows ``inter`` of the dense MLP."""

    num_q: int
    q_first: int
    kv: HeadShard
    inter: tuple[int, int]

    @classmethod
    def of(cls, c: ModelConfig, shard: TPShard) -> "Heads":
        q0, q1 = shard.split(c.num_heads, "the number of attention heads")
        inter = shard.split(c.intermediate_size, "intermediate_size")
        return cls(q1 - q0, q0, HeadShard(c.num_kv_heads, c.head_dim, shard.rank, shard.size), inter)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, kernels: str = "torch", shard: TPShard = TPShard()):
        super().__init__(config, kernels, shard)
        if config.hidden_act != "silu":
            raise CheckpointError(f"activation {config.hidden_act!r} is not supported (only silu)")
        self.heads = Heads.of(config, shard)
        self.layers = nn.ModuleList(LlamaLayer(config, i, self.heads, shard) for i in range(config.num_layers))
        self.scale = config.head_dim**-0.5
        self.split = gqa_split(self.heads.kv.num_local, config.head_dim)

    @property
    def kv_shard(self) -> HeadShard:
        return self.heads.kv

    def forward_layer(
        self, layer: int, hidden: torch.Tensor, ctx: ForwardContext, cached_kv: CachedRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w, h = self.config, self.layers[layer], self.heads
        t, backend, tp = hidden.shape[0], self.kernels, self.shard.size > 1
        lora = ctx.lora
        x = rms_norm(hidden, w.input_norm, c.rms_norm_eps, backend)
        qkv = add_lora(linear(x, w.qkv_w, w.qkv_b, backend), x, lora, layer, "qkv")
        if c.qk_norm:
            self._norm_heads(qkv, w)
        q, new_kv = rope_qkv(qkv, ctx.cos, ctx.sin, h.num_q, h.kv.num_local, c.head_dim, backend)
        attn = varlen_attention(q, new_kv, cached_kv, self.split, ctx.new_lens, self.scale, backend, ctx.cu_new)
        attn = attn.reshape(t, -1)
        # row-parallel: each rank's heads give a partial sum; the bias joins once, after the reduction
        o = add_lora(linear(attn, w.o_w, None if tp else w.o_b, backend), attn, lora, layer, "o")
        if tp:
            o = self.reduce(o) if w.o_b is None else self.reduce(o) + w.o_b
        x, hidden = add_rms_norm(o, hidden, w.post_norm, c.rms_norm_eps, backend)
        if w.moe is not None:
            return w.moe.add_to(hidden, x, backend), new_kv
        act = silu_and_mul(add_lora(linear(x, w.gate_up_w, w.gate_up_b, backend), x, lora, layer, "gate_up"), backend)
        if tp:
            down = self.reduce(add_lora(linear(act, w.down_w, None, backend), act, lora, layer, "down"))
            return hidden + down if w.down_b is None else hidden + down + w.down_b, new_kv
        # ``hidden`` is add_rms_norm's fresh sum, this layer's own: add_linear may write the MLP's output into it
        hidden = add_lora(add_linear(hidden, act, w.down_w, w.down_b, backend), act, lora, layer, "down")
        return hidden, new_kv

    def _norm_heads(self, qkv: torch.Tensor, w: LlamaLayer) -> None:
        """Qwen3's RMSNorm of each query head and each key head, in place in the fused projection ``qkv``."""
        c, t, nq, nkv = self.config, qkv.shape[0], self.heads.num_q, self.heads.kv.num_local
        heads = qkv.view(t, -1, c.head_dim)
        for norm, part in ((w.q_norm, heads[:, :nq]), (w.k_norm, heads[:, nq : nq + nkv])):
            part.copy_(rms_norm(part.reshape(-1, c.head_dim), norm, c.rms_norm_eps, self.kernels).view_as(part))

    def lora_targets(self) -> dict[str, Target]:
        """Attention and dense MLP projections, each cut as its base layer (``dualpath.engines.lora``); an MoE model's
        adapters train attention only (its experts and router are no target here)."""
        c, h, hd = self.config, self.config.hidden_size, self.config.head_dim
        q, kv, inter = c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size
        tp, heads = self.shard.size > 1, self.heads
        q_rows = (heads.q_first * hd, (heads.q_first + heads.num_q) * hd) if tp else None
        kv_rows = (heads.kv.first * hd, (heads.kv.first + heads.kv.num_local) * hd) if tp else None
        nq, nkv = heads.num_q * hd, heads.kv.num_local * hd
        attention = {
            "q_proj": Target("qkv", 0, h, q, rows=q_rows),
            "k_proj": Target("qkv", nq, h, kv, rows=kv_rows),
            "v_proj": Target("qkv", nq + nkv, h, kv, rows=kv_rows),
            "o_proj": Target("o", 0, q, h, cols=q_rows),
        }
        if c.moe is not None:
            return attention
        mine = heads.inter if tp else None
        local = heads.inter[1] - heads.inter[0]
        return {
            **attention,
            "gate_proj": Target("gate_up", 0, h, inter, rows=mine),
            "up_proj": Target("gate_up", local, h, inter, rows=mine),
            "down_proj": Target("down", 0, inter, h, cols=mine),
        }

    def float32_params(self) -> Sequence[str]:
        return router_params(self)

    def weight_specs(self) -> Iterator[WeightSpec]:
        yield from super().weight_specs()
        c, hd = self.config, self.config.head_dim
        h, q, kv, inter = c.hidden_size, c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size
        qkv_cuts, o_cuts, up_cuts, down_cuts = self._cuts()
        for i in range(c.num_layers):
            p, a, m = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            yield WeightSpec(p + "input_norm", ((f"model.layers.{i}.input_layernorm.weight", (h,)),))
            yield WeightSpec(p + "post_norm", ((f"model.layers.{i}.post_attention_layernorm.weight", (h,)),))
            yield WeightSpec(
                p + "qkv_w",
                ((a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h)), (a + "v_proj.weight", (kv, h))),
                "cat",
                fp8=True,
                cuts=qkv_cuts,
            )
            if c.qkv_bias:
                yield WeightSpec(
                    p + "qkv_b",
                    ((a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)), (a + "v_proj.bias", (kv,))),
                    "cat",
                    cuts=qkv_cuts,
                )
            yield WeightSpec(p + "o_w", ((a + "o_proj.weight", (h, q)),), fp8=True, cuts=o_cuts)
            if c.o_bias:
                yield WeightSpec(p + "o_b", ((a + "o_proj.bias", (h,)),))
            if c.qk_norm:
                yield WeightSpec(p + "q_norm", ((a + "q_norm.weight", (c.head_dim,)),))
                yield WeightSpec(p + "k_norm", ((a + "k_norm.weight", (c.head_dim,)),))
            if c.is_moe_layer(i):
                yield from moe_specs(c, p + "moe.", m, self.layers[i].moe.part)
                continue
            yield from mlp_specs(p, m, h, inter, up_cuts, down_cuts)
            if c.mlp_bias:
                yield WeightSpec(
                    p + "gate_up_b",
                    ((m + "gate_proj.bias", (inter,)), (m + "up_proj.bias", (inter,))),
                    "cat",
                    cuts=up_cuts,
                )
                yield WeightSpec(p + "down_b", ((m + "down_proj.bias", (h,)),))

    def _cuts(self) -> tuple[tuple[Cut, ...], ...]:
        """This rank's parts of the checkpoint's projections: q/k/v rows (its heads), o_proj columns, gate/up rows
        and down_proj columns (its MLP slice); all empty at TP 1."""
        if self.shard.size == 1:
            return (), (), (), ()
        hd, h = self.config.head_dim, self.heads
        q = Cut(0, h.q_first * hd, (h.q_first + h.num_q) * hd)
        kv = Cut(0, h.kv.first * hd, (h.kv.first + h.kv.num_local) * hd)
        inter = Cut(0, *h.inter)
        return (q, kv, kv), (Cut(1, q.start, q.stop),), (inter, inter), (Cut(1, *h.inter),)
