"""DeepSeek-V3 and V3.2: multi-head latent attention over a cached latent, and MoE with dense first layers.

KV row of one token in one layer: ``[c_kv (kv_lora_rank), after kv_a_layernorm | k_pe (rope dim), after RoPE]``,
and for V3.2 then ``[indexer key (index head dim), after its LayerNorm and RoPE]``. Attention runs in absorbed form
(queries mapped into the latent space), so the latent is never expanded.

V3.2's sparse attention (DSA): a lightning indexer picks the ``index_topk`` earlier tokens each query attends to
(``dualpath.kernels.sparse_attention``). Its keys ride in the KV row, so they are stored, loaded and sent with the rest of
the KV. A batch in which no query sees more than ``index_topk`` tokens attends densely (exactly the same result);
past that, the choice and the attention run on the device (``dualpath.kernels.triton_sparse`` on the Triton kernels), so
V3.2's decode steps are CUDA graphs as V3's are.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dualpath.core.config import ModelConfig
from dualpath.core.errors import CheckpointError
from dualpath.core.geometry import HeadShard
from dualpath.engines.comm import TPShard
from dualpath.engines.models.loader import Cut
from dualpath.engines.models.base import CausalLM, ForwardContext, WeightSpec, linear, param
from dualpath.engines.models.moe import DenseMLP, MoE, mlp_specs, moe_specs, router_params
from dualpath.kernels.attention import CachedRows, mla_attention
from dualpath.kernels.norm import add_rms_norm, rms_norm
from dualpath.kernels.rope import apply_rope, softmax_scale_factor
from dualpath.kernels.sparse_attention import IndexQuery

_INDEXER_NORM_EPS = 1e-6  # the indexer key's LayerNorm (fixed in DeepSeek's code, not in config.json)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: queries from the query latent, one shared key, per-head weights."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        m, h = c.mla, c.hidden_size
        i = m.indexer
        self.q_w = param(i.num_heads * i.head_dim, m.q_lora_rank)
        self.k_w = param(i.head_dim, h)
        self.k_norm_w = param(i.head_dim)
        self.k_norm_b = param(i.head_dim)
        self.weights_w = param(i.num_heads, h)


class MLAttention(nn.Module):
    """One layer's attention weights; under tensor parallelism this rank's ``nh`` heads of the query and KV
    up-projections and its columns of ``o_w`` (row-parallel); the latent's down-projection (and V3.2's indexer) are
    whole on every rank, which all compute the same latent."""

    def __init__(self, c: ModelConfig, nh: int):
        super().__init__()
        m, h = c.mla, c.hidden_size
        if m.q_lora_rank:
            self.q_a_w = param(m.q_lora_rank, h)
            self.q_a_norm = param(m.q_lora_rank)
            self.q_b_w = param(nh * m.qk_head_dim, m.q_lora_rank)
        else:
            self.q_w = param(nh * m.qk_head_dim, h)
        self.kv_a_w = param(m.kv_lora_rank + m.qk_rope_head_dim, h)
        self.kv_a_norm = param(m.kv_lora_rank)
        self.kv_b_w = param(nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        self.o_w = param(h, nh * m.v_head_dim)
        if m.indexer:
            self.indexer = Indexer(c)


class DeepseekV3Layer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, shard: TPShard):
        super().__init__()
        self.input_norm = param(c.hidden_size)
        self.post_norm = param(c.hidden_size)
        self.attn = MLAttention(c, c.num_heads // shard.size)
        inter = shard.split(c.intermediate_size, "intermediate_size")
        self.mlp = MoE(c, shard) if c.is_moe_layer(layer) else DenseMLP(c.hidden_size, inter[1] - inter[0])


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, kernels: str = "torch", shard: TPShard = TPShard()):
        super().__init__(config, kernels, shard)
        m = config.mla
        if config.moe.num_experts % config.moe.num_groups:
            raise CheckpointError(f"n_routed_experts {config.moe.num_experts} not divisible by n_group")
        # tensor parallelism splits the attention heads; the latent (the whole KV row) is every rank's
        self.heads = shard.split(config.num_heads, "the number of attention heads")
        self.layers = nn.ModuleList(DeepseekV3Layer(config, i, shard) for i in range(config.num_layers))
        self.scale = m.qk_head_dim**-0.5 * softmax_scale_factor(config.rope)

    @property
    def kv_shard(self) -> HeadShard | None:
        if self.shard.size == 1:
            return None
        return HeadShard.replicated(self.config.kv_elems_per_token, self.shard.rank, self.shard.size)

    def _attention(self, w: MLAttention, x: torch.Tensor, ctx: ForwardContext, cached_kv: CachedRows):
        c, m = self.config, self.config.mla
        t, nh = x.shape[0], self.heads[1] - self.heads[0]
        if m.q_lora_rank:
            q_lat = rms_norm(linear(x, w.q_a_w, None, self.kernels), w.q_a_norm, c.rms_norm_eps, self.kernels)
            q = linear(q_lat, w.q_b_w, None, self.kernels)
        else:
            q = linear(x, w.q_w, None, self.kernels)
        q = q.view(t, nh, m.qk_head_dim)
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        ckv, r, dr = linear(x, w.kv_a_w, None, self.kernels), m.kv_lora_rank, m.qk_rope_head_dim
        # the KV row [normed latent | rotated k_pe | indexer key], each part written in place
        new_kv = ckv.new_empty(t, c.kv_elems_per_token)
        rms_norm(ckv[:, :r], w.kv_a_norm, c.rms_norm_eps, self.kernels, out=new_kv[:, :r])
        apply_rope(
            ckv[:, r:].view(t, 1, dr),
            ctx.cos,
            ctx.sin,
            c.rope.interleaved,
            self.kernels,
            out=new_kv[:, r : m.key_width].view(t, 1, dr),
        )
        q_pe = apply_rope(q_pe, ctx.cos, ctx.sin, c.rope.interleaved, self.kernels)
        index = self._index(w.indexer, x, q_lat, ctx, new_kv) if m.indexer else None
        w_kv_b = w.kv_b_w.view(nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        out = mla_attention(
            q_nope,
            q_pe,
            new_kv,
            cached_kv,
            ctx.new_lens,
            w_kv_b[:, : m.qk_nope_head_dim],
            w_kv_b[:, m.qk_nope_head_dim :],
            m.kv_lora_rank,
            self.scale,
            self.kernels,
            ctx.cu_new,
            index,
        )
        return self.reduce(linear(out.reshape(t, -1), w.o_w, None, self.kernels)), new_kv

    def _index(
        self, w: Indexer, x: torch.Tensor, q_lat: torch.Tensor, ctx: ForwardContext, new_kv: torch.Tensor
    ) -> IndexQuery | None:
        """Write the new tokens' indexer keys into their KV rows; return the indexer's queries (None: no query
        sees more than topk tokens, so each attends to all it sees). The indexer rotates the first rope dims of
        its queries and key unpaired (not interleaved)."""
        m, t = self.config.mla, x.shape[0]
        i = m.indexer
        key = new_kv[:, m.key_width :]
        k = F.layer_norm(linear(x, w.k_w, None, self.kernels), (i.head_dim,), w.k_norm_w, w.k_norm_b, _INDEXER_NORM_EPS)
        apply_rope(k.view(t, 1, i.head_dim), ctx.cos, ctx.sin, False, self.kernels, out=key.view(t, 1, i.head_dim))
        if ctx.max_seen is not None and ctx.max_seen <= i.topk:
            return None
        q = linear(q_lat, w.q_w, None, self.kernels).view(t, i.num_heads, i.head_dim)
        q = apply_rope(q, ctx.cos, ctx.sin, False, self.kernels)
        weights = linear(x, w.weights_w, None, self.kernels).float() * i.num_heads**-0.5
        return IndexQuery(q, weights, m.key_width, i.topk, i.head_dim**-0.5)

    def forward_layer(
        self, layer: int, hidden: torch.Tensor, ctx: ForwardContext, cached_kv: CachedRows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.config, self.layers[layer]
        attn, new_kv = self._attention(
            w.attn, rms_norm(hidden, w.input_norm, c.rms_norm_eps, self.kernels), ctx, cached_kv
        )
        x, hidden = add_rms_norm(attn, hidden, w.post_norm, c.rms_norm_eps, self.kernels)
        # ``hidden`` is add_rms_norm's fresh sum, this layer's own: the dense MLP may write its output into it
        return w.mlp.add_to(hidden, x, self.kernels), new_kv

    def float32_params(self) -> Sequence[str]:
        return router_params(self)

    def weight_specs(self) -> Iterator[WeightSpec]:
        yield from super().weight_specs()
        c, m = self.config, self.config.mla
        h, nh = c.hidden_size, c.num_heads
        q, kv_b, o, up, down = self._cuts()
        for i in range(c.num_layers):
            p, src = f"layers.{i}.", f"model.layers.{i}."
            a, sa = p + "attn.", src + "self_attn."
            yield WeightSpec(p + "input_norm", ((src + "input_layernorm.weight", (h,)),))
            yield WeightSpec(p + "post_norm", ((src + "post_attention_layernorm.weight", (h,)),))
            if m.q_lora_rank:
                yield WeightSpec(a + "q_a_w", ((sa + "q_a_proj.weight", (m.q_lora_rank, h)),), fp8=True)
                yield WeightSpec(a + "q_a_norm", ((sa + "q_a_layernorm.weight", (m.q_lora_rank,)),))
                yield WeightSpec(
                    a + "q_b_w", ((sa + "q_b_proj.weight", (nh * m.qk_head_dim, m.q_lora_rank)),), fp8=True, cuts=q
                )
            else:
                yield WeightSpec(a + "q_w", ((sa + "q_proj.weight", (nh * m.qk_head_dim, h)),), fp8=True, cuts=q)
            yield WeightSpec(
                a + "kv_a_w", ((sa + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h)),), fp8=True
            )
            yield WeightSpec(a + "kv_a_norm", ((sa + "kv_a_layernorm.weight", (m.kv_lora_rank,)),))
            yield WeightSpec(
                a + "kv_b_w",
                ((sa + "kv_b_proj.weight", (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),),
                cuts=kv_b,
            )
            yield WeightSpec(a + "o_w", ((sa + "o_proj.weight", (h, nh * m.v_head_dim)),), fp8=True, cuts=o)
            if m.indexer:
                yield from _indexer_specs(m, h, a + "indexer.", sa + "indexer.")
            if c.is_moe_layer(i):
                yield from moe_specs(c, p + "mlp.", src + "mlp.", self.layers[i].mlp.part)
            else:
                yield from mlp_specs(p + "mlp.", src + "mlp.", h, c.intermediate_size, up, down)

    def _cuts(self) -> tuple[tuple[Cut, ...], ...]:
        """This rank's rows of the query and KV up-projections (its heads), columns of ``o_proj``, rows of the dense
        MLP's gate and up and columns of its down; all empty at TP 1."""
        if self.shard.size == 1:
            return (), (), (), (), ()
        m, (h0, h1) = self.config.mla, self.heads
        inter = Cut(0, *self.shard.split(self.config.intermediate_size, "intermediate_size"))
        return (
            (Cut(0, h0 * m.qk_head_dim, h1 * m.qk_head_dim),),
            (Cut(0, h0 * (m.qk_nope_head_dim + m.v_head_dim), h1 * (m.qk_nope_head_dim + m.v_head_dim)),),
            (Cut(1, h0 * m.v_head_dim, h1 * m.v_head_dim),),
            (inter, inter),
            (Cut(1, inter.start, inter.stop),),
        )


def _indexer_specs(m, h: int, p: str, src: str) -> Iterator[WeightSpec]:
    i = m.indexer
    yield WeightSpec(p + "q_w", ((src + "wq_b.weight", (i.num_heads * i.head_dim, m.q_lora_rank)),), fp8=True)
    yield WeightSpec(p + "k_w", ((src + "wk.weight", (i.head_dim, h)),), fp8=True)
    yield WeightSpec(p + "k_norm_w", ((src + "k_norm.weight", (i.head_dim,)),))
    yield WeightSpec(p + "k_norm_b", ((src + "k_norm.bias", (i.head_dim,)),))
    yield WeightSpec(p + "weights_w", ((src + "weights_proj.weight", (i.num_heads, h)),), fp8=True)
