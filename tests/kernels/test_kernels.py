"""Kernels against independent references: transformers' own functions, or a float64 computation."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dualpath.core.config import RopeConfig
from dualpath.kernels.attention import PagedKV, gqa_split, mla_attention, varlen_attention
from dualpath.kernels.kv_move import gather_blocks, gather_tokens, scatter_blocks, write_tokens
from dualpath.kernels.moe import grouped_topk
from dualpath.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq


def _hf_inv_freq(rope_type: str, params: dict, head_dim: int):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": rope_type, **params},
    )
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")


def test_llama3_scaling_matches_transformers():
    params = {
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    ref, _ = _hf_inv_freq("llama3", params, 128)
    ours, attn = rope_inv_freq(
        RopeConfig(kind="llama3", theta=500000.0, rotary_dim=128, factor=8.0, original_max_position=8192)
    )
    assert torch.allclose(ours, ref, rtol=1e-6) and attn == 1.0


@pytest.mark.parametrize("mscale,mscale_all", [(1.0, 1.0), (0.707, 1.0), (0.0, 0.0)])
def test_yarn_matches_transformers(mscale, mscale_all):
    params = {
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    if mscale:
        params.update(mscale=mscale, mscale_all_dim=mscale_all)
    ref, ref_attn = _hf_inv_freq("yarn", params, 64)
    ours, attn = rope_inv_freq(
        RopeConfig(
            kind="yarn",
            theta=10000.0,
            rotary_dim=64,
            factor=40.0,
            original_max_position=4096,
            mscale=mscale,
            mscale_all_dim=mscale_all,
        )
    )
    assert torch.allclose(ours, ref, rtol=1e-6) and math.isclose(attn, ref_attn, rel_tol=1e-9)


def _rope_f64(x, positions, inv_freq, interleaved):
    ang = positions.double()[:, None] * inv_freq.double()[None]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x = x.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, -1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_against_float64(interleaved):
    inv, _ = rope_inv_freq(RopeConfig(rotary_dim=32))
    pos = torch.randint(0, 3000, (7,))
    x = torch.randn(7, 3, 32)
    cos, sin = rope_cos_sin(inv, pos, 1.0, torch.float32)
    # Angles are formed in float32 (as transformers does): at position ~3000 that costs ~4e-4 rad.
    assert torch.allclose(apply_rope(x, cos, sin, interleaved).double(), _rope_f64(x, pos, inv, interleaved), atol=2e-3)
    near = torch.arange(7)
    cos, sin = rope_cos_sin(inv, near, 1.0, torch.float32)
    assert torch.allclose(
        apply_rope(x, cos, sin, interleaved).double(), _rope_f64(x, near, inv, interleaved), atol=1e-5
    )


def _attention_f64(q, k, v, n_cached, scale):
    # q [n, Hq, D], k/v [L, Hk, D]; query i sees keys 0..n_cached+i
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    n, L = q.shape[0], k.shape[0]
    mask = torch.arange(L)[None, :] <= (n_cached + torch.arange(n))[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 70), st.integers(1, 20)), min_size=1, max_size=4),
    st.sampled_from([(4, 4), (4, 2), (6, 1)]),
)
def test_varlen_attention_against_float64(lens, heads):
    hq, hk = heads
    d = 16
    cached_k = [torch.randn(c, hk, d) for c, _ in lens]
    cached_v = [torch.randn(c, hk, d) for c, _ in lens]
    new_lens = [n for _, n in lens]
    t = sum(new_lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    rows = [torch.cat([a.reshape(-1, hk * d), b.reshape(-1, hk * d)], 1) for a, b in zip(cached_k, cached_v)]
    new_rows = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], 1)
    out = varlen_attention(q, new_rows, rows, gqa_split(hk, d), new_lens, 0.25)
    start = 0
    for i, n in enumerate(new_lens):
        sl = slice(start, start + n)
        ref = _attention_f64(
            q[sl], torch.cat([cached_k[i], k[sl]]), torch.cat([cached_v[i], v[sl]]), cached_k[i].shape[0], 0.25
        )
        assert (out[sl].double() - ref).abs().max() < 1e-4
        start += n


def test_batched_decode_and_paged_rows_match_per_sequence():
    ctx, split, bs = [0, 5, 63, 64, 130], gqa_split(2, 8), 16
    rows = [torch.randn(c, 32) for c in ctx]
    q, new_rows = torch.randn(5, 4, 8), torch.randn(5, 32)
    batched = varlen_attention(q, new_rows, rows, split, [1] * 5, 0.3)
    # the same rows laid out in a shuffled paged cache, with room for each sequence's next token
    cache = torch.randn(40, bs, 32)
    free = torch.randperm(40).tolist()
    tables = []
    for r in rows:
        blocks = [free.pop() for _ in range(r.shape[0] // bs + 1)]
        flat = cache[blocks].reshape(-1, 32)
        flat[: r.shape[0]] = r
        cache[blocks] = flat.view(-1, bs, 32)
        tables.append(blocks)
    width = max(map(len, tables))
    paged = PagedKV(cache, torch.tensor([t + [0] * (width - len(t)) for t in tables]), ctx)
    from_paged = varlen_attention(q, new_rows, paged, split, [1] * 5, 0.3)
    for i in range(5):
        one = varlen_attention(q[i : i + 1], new_rows[i : i + 1], [rows[i]], split, [1], 0.3)
        assert torch.allclose(batched[i], one[0], atol=1e-5)
        assert torch.allclose(from_paged[i], one[0], atol=1e-5)
        assert torch.equal(paged.rows(i), rows[i])


def test_mla_absorbed_equals_expanded_attention():
    h, dn, dr, dv, r = 3, 8, 4, 6, 12
    w_kv_b = torch.randn(h, dn + dv, r) * 0.3
    new_lens, cached = [3, 1], [torch.randn(5, r + dr), torch.randn(0, r + dr)]
    latent_new = torch.randn(4, r + dr)
    q_nope, q_pe = torch.randn(4, h, dn), torch.randn(4, h, dr)
    out = mla_attention(q_nope, q_pe, latent_new, cached, new_lens, w_kv_b[:, :dn], w_kv_b[:, dn:], r, 0.2)
    start = 0
    for i, n in enumerate(new_lens):
        lat = torch.cat([cached[i], latent_new[start : start + n]]).double()
        k_nope = torch.einsum("lr,hdr->lhd", lat[:, :r], w_kv_b[:, :dn].double())
        vals = torch.einsum("lr,hdr->lhd", lat[:, :r], w_kv_b[:, dn:].double())
        keys = torch.cat([k_nope, lat[:, None, r:].expand(-1, h, -1)], -1)
        q = torch.cat([q_nope[start : start + n], q_pe[start : start + n]], -1)
        ref = _attention_f64(q, keys, vals, cached[i].shape[0], 0.2)
        assert (out[start : start + n].double() - ref).abs().max() < 1e-4
        start += n


def test_grouped_topk_matches_transformers_router():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.3)
    router.e_score_correction_bias.copy_(torch.randn(16) * 0.2)
    x = torch.randn(50, 32)
    logits, ref_w, ref_ids = router(x)
    w, ids = grouped_topk(logits, router.e_score_correction_bias, 4, 2, 4, True, 2.5)
    order_ref, order = ref_ids.sort(-1), ids.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    assert torch.allclose(ref_w.gather(1, order_ref.indices), w.gather(1, order.indices), atol=1e-6)


def test_paged_gather_write_and_block_moves():
    cache = torch.zeros(10, 4, 3)
    table = torch.tensor([7, 2, 5])
    kv = torch.randn(10, 3)
    pos = torch.arange(10)
    write_tokens(cache, table[pos // 4] * 4 + pos % 4, kv)
    assert torch.equal(gather_tokens(cache, table, 10), kv)
    assert torch.equal(gather_tokens(cache, table, 6), kv[:6])
    blocks = gather_blocks(cache, torch.tensor([2, 7]))
    assert blocks.is_contiguous() and torch.equal(blocks[1], kv[:4])
    other = torch.zeros_like(cache)
    scatter_blocks(other, torch.tensor([0, 9]), blocks)
    assert torch.equal(other[9], kv[:4]) and torch.equal(other[0], cache[2])
