"""Llama family (SmolLM2, Llama 2/3, Mistral within its sliding window), Qwen2/Qwen2.5 (q/k/v bias), Qwen3
(RMSNorm over each query and key head before RoPE) and Qwen3-MoE (Qwen3's attention, softmax-routed experts).

KV row of one token in one layer: ``[K (kv_heads × head_dim) | V (kv_heads × head_dim)]``, K after RoPE.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import nn

from dualpath.config import ModelConfig
from dualpath.errors import CheckpointError
from engines.lora import Target, add_lora
from engines.models.base import CausalLM, ForwardContext, WeightSpec, add_linear, linear, param
from engines.models.moe import MoE, mlp_specs, moe_specs, router_params
from kernels.activation import silu_and_mul
from kernels.attention import CachedRows, gqa_split, varlen_attention
from kernels.norm import add_rms_norm, rms_norm
from kernels.rope import rope_qkv


class LlamaLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_norm = param(c.hidden_size)
        self.qkv_w = param(q + 2 * kv, c.hidden_size)
        self.qkv_b = param(q + 2 * kv) if c.qkv_bias else None
        self.o_w = param(c.hidden_size, q)
        self.o_b = param(c.hidden_size) if c.o_bias else None
        self.q_norm = param(c.head_dim) if c.qk_norm else None
        self.k_norm = param(c.head_dim) if c.qk_norm else None
        self.post_norm = param(c.hidden_size)
        self.moe = MoE(c) if c.is_moe_layer(layer) else None
        dense, inter = self.moe is None, c.intermediate_size
        self.gate_up_w = param(2 * inter, c.hidden_size) if dense else None
        self.gate_up_b = param(2 * inter) if dense and c.mlp_bias else None
        self.down_w = param(c.hidden_size, inter) if dense else None
        self.down_b = param(c.hidden_size) if dense and c.mlp_bias else None


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, kernels: str = "torch"):
        super().__init__(config, kernels)
        if config.hidden_act != "silu":
            raise CheckpointError(f"activation {config.hidden_act!r} is not supported (only silu)")
        self.layers = nn.ModuleList(LlamaLayer(config, i) for i in range(config.num_layers))
        self.scale = config.head_dim ** -0.5
        self.split = gqa_split(config.num_kv_heads, config.head_dim)

    def forward_layer(self, layer: int, hidden: torch.Tensor, ctx: ForwardContext,
                      cached_kv: CachedRows) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.config, self.layers[layer]
        t, backend = hidden.shape[0], self.kernels
        lora = ctx.lora
        x = rms_norm(hidden, w.input_norm, c.rms_norm_eps, backend)
        qkv = add_lora(linear(x, w.qkv_w, w.qkv_b, backend), x, lora, layer, "qkv")
        if c.qk_norm:
            self._norm_heads(qkv, w)
        q, new_kv = rope_qkv(qkv, ctx.cos, ctx.sin, c.num_heads, c.num_kv_heads, c.head_dim, backend)
        attn = varlen_attention(q, new_kv, cached_kv, self.split, ctx.new_lens, self.scale, backend, ctx.cu_new)
        attn = attn.reshape(t, -1)
        o = add_lora(linear(attn, w.o_w, w.o_b, backend), attn, lora, layer, "o")
        x, hidden = add_rms_norm(o, hidden, w.post_norm, c.rms_norm_eps, backend)
        if w.moe is not None:
            return w.moe.add_to(hidden, x, backend), new_kv
        act = silu_and_mul(add_lora(linear(x, w.gate_up_w, w.gate_up_b, backend), x, lora, layer, "gate_up"), backend)
        # ``hidden`` is add_rms_norm's fresh sum, this layer's own: add_linear may write the MLP's output into it
        hidden = add_lora(add_linear(hidden, act, w.down_w, w.down_b, backend), act, lora, layer, "down")
        return hidden, new_kv

    def _norm_heads(self, qkv: torch.Tensor, w: LlamaLayer) -> None:
        """Qwen3's RMSNorm of each query head and each key head, in place in the fused projection ``qkv``."""
        c, t = self.config, qkv.shape[0]
        heads = qkv.view(t, -1, c.head_dim)
        for norm, part in ((w.q_norm, heads[:, :c.num_heads]),
                           (w.k_norm, heads[:, c.num_heads:c.num_heads + c.num_kv_heads])):
            part.copy_(rms_norm(part.reshape(-1, c.head_dim), norm, c.rms_norm_eps, self.kernels).view_as(part))

    def lora_targets(self) -> dict[str, Target]:
        """Attention and dense MLP projections; an MoE model's adapters train attention only (its experts and
        router are no target here)."""
        c = self.config
        h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        attention = {"q_proj": Target("qkv", 0, q, h), "k_proj": Target("qkv", q, q + kv, h),
                     "v_proj": Target("qkv", q + kv, q + 2 * kv, h), "o_proj": Target("o", 0, h, q)}
        if c.moe is not None:
            return attention
        return {**attention, "gate_proj": Target("gate_up", 0, inter, h),
                "up_proj": Target("gate_up", inter, 2 * inter, h), "down_proj": Target("down", 0, h, inter)}

    def float32_params(self) -> Sequence[str]:
        return router_params(self)

    def weight_specs(self) -> Iterator[WeightSpec]:
        yield from super().weight_specs()
        c = self.config
        h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        for i in range(c.num_layers):
            p, a, m = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            yield WeightSpec(p + "input_norm", ((f"model.layers.{i}.input_layernorm.weight", (h,)),))
            yield WeightSpec(p + "post_norm", ((f"model.layers.{i}.post_attention_layernorm.weight", (h,)),))
            yield WeightSpec(p + "qkv_w", ((a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h)),
                                           (a + "v_proj.weight", (kv, h))), "cat", fp8=True)
            if c.qkv_bias:
                yield WeightSpec(p + "qkv_b", ((a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)),
                                               (a + "v_proj.bias", (kv,))), "cat")
            yield WeightSpec(p + "o_w", ((a + "o_proj.weight", (h, q)),), fp8=True)
            if c.o_bias:
                yield WeightSpec(p + "o_b", ((a + "o_proj.bias", (h,)),))
            if c.qk_norm:
                yield WeightSpec(p + "q_norm", ((a + "q_norm.weight", (c.head_dim,)),))
                yield WeightSpec(p + "k_norm", ((a + "k_norm.weight", (c.head_dim,)),))
            if c.is_moe_layer(i):
                yield from moe_specs(c, p + "moe.", m)
                continue
            yield from mlp_specs(p, m, h, inter)
            if c.mlp_bias:
                yield WeightSpec(p + "gate_up_b", ((m + "gate_proj.bias", (inter,)), (m + "up_proj.bias", (inter,))),
                                 "cat")
                yield WeightSpec(p + "down_b", ((m + "down_proj.bias", (h,)),))
