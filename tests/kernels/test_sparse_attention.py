"""DeepSeek-V3.2's sparse attention: the indexer's choice of tokens against a float64 brute force, attention over
the chosen tokens, and what the model refuses. (The model against transformers: test_models_parity.py.)"""

import json
from dataclasses import replace

import pytest
import torch

from dualpath.core.config import ModelConfig
from dualpath.core.errors import CheckpointError
from dualpath.engines.models import ForwardBatch, load_model
from dualpath.kernels import attention, sparse_attention
from dualpath.kernels.attention import PagedKV, mla_attention
from dualpath.kernels.sparse_attention import IndexQuery

H, D, OFF, WIDTH, BS = 3, 8, 5, 5 + 8 + 2, 4  # indexer heads, key width, where keys start in a row, row width
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton path's tests (the interpreter on CPU)


def check_choice(chosen, q, w, keys, n_cached, topk, scale):
    """Per query, in float64: it chose ``topk`` of the keys it sees (all, if it sees no more), and none it passed
    over scores higher than one it chose. (Ties are common: a key every head scores below zero scores 0.)"""
    q, w, keys = q.double(), w.double(), keys.double()
    for j in range(q.shape[0]):
        seen = n_cached + j + 1
        score = (w[j, :, None] * torch.relu(q[j] @ keys[:seen].T * scale)).sum(0)
        mine = chosen[j, :seen]
        assert int(mine.sum()) == min(topk, seen) and not chosen[j, seen:].any()
        if seen > topk:
            assert score[mine].min() >= score[~mine].max() - 1e-9


def paged(rows: list[torch.Tensor]) -> PagedKV:
    """The rows in a paged cache, blocks in reverse order so that a table is not the identity."""
    cache, tables, top = torch.randn(40, BS, WIDTH), [], 39
    for r in rows:
        blocks = list(range(top, top - (r.shape[0] // BS + 1), -1))
        top -= len(blocks)
        flat = cache[blocks].reshape(-1, WIDTH)
        flat[: r.shape[0]] = r
        cache[blocks] = flat.view(-1, BS, WIDTH)
        tables.append(blocks)
    width = max(map(len, tables))
    return PagedKV(cache, torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables]), [r.shape[0] for r in rows])


@pytest.mark.parametrize("score_elems", [1 << 26, 64])  # 64: queries are scored a few at a time
def test_the_chosen_tokens_are_the_best_scoring_ones(monkeypatch, score_elems):
    """Prefill rows (within topk, beyond it, one token over a cached part) and a padded decode batch."""
    monkeypatch.setattr(sparse_attention, "_SCORE_ELEMS", score_elems)
    topk, scale = 6, D**-0.5
    lens = [(0, 3), (0, 11), (9, 1), (2, 5), (30, 4)]  # (cached, new)
    rows = [torch.randn(c + n, WIDTH) for c, n in lens]
    q, w = torch.randn(sum(n for _, n in lens), H, D), torch.randn(sum(n for _, n in lens), H)
    index, start = IndexQuery(q, w, OFF, topk, scale), 0
    for (c, n), r in zip(lens, rows):
        sl = slice(start, start + n)
        check_choice(index.choose(r, c, sl), q[sl], w[sl], r[:, OFF : OFF + D], c, topk, scale)
        start += n
    seen = torch.tensor([3, 0, 9, 20, 5])  # decode: sequence b sees rows 0 .. seen[b]
    padded = torch.randn(5, 21, WIDTH)
    dq, dw = torch.randn(5, H, D), torch.randn(5, H)
    idx, real = IndexQuery(dq, dw, OFF, topk, scale).choose_decode(padded, seen)
    assert idx.shape == real.shape == (5, topk)
    for b in range(5):
        chosen = torch.zeros(1, 21, dtype=torch.bool)
        chosen[0, idx[b][real[b]]] = True
        assert int(real[b].sum()) == len(set(idx[b][real[b]].tolist()))  # no row twice
        check_choice(chosen, dq[b : b + 1], dw[b : b + 1], padded[b, :, OFF : OFF + D], int(seen[b]), topk, scale)


def test_ties_at_the_cut_go_to_the_earliest_tokens():
    """A query whose every score is 0 (its hidden state, hence its queries, all zero) keeps the first topk tokens,
    whatever the row's length: so chunked and whole prefills choose alike."""
    index = IndexQuery(torch.zeros(2, H, D), torch.randn(2, H), OFF, 4, 1.0)
    rows = torch.randn(20, WIDTH)
    for n_cached in (10, 18):
        chosen = index.choose(rows[: n_cached + 2], n_cached, slice(0, 2))
        assert chosen[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    idx, real = index.choose_decode(rows[None].expand(2, -1, -1), torch.tensor([19, 7]))
    assert idx.tolist() == [[0, 1, 2, 3]] * 2 and real.all()


@pytest.mark.parametrize("form, gather", [("rows", False), ("paged", False), ("rows", True), ("paged", True)])
def test_sparse_attention_against_float64(monkeypatch, form, gather):
    """MLA over rows ``[latent | rope key | indexer key]``, prefill rows and a decode batch, from row lists or a
    paged cache: each query attends to exactly the tokens the indexer chose (the indexer key columns are not
    attended over), within 1e-4 of float64. A prefill masks the dense scores, or (``gather``, as past 8 x topk
    tokens) gathers each query's chosen rows, here one query at a time."""
    if gather:
        monkeypatch.setattr(attention, "_GATHER_FROM", 1)
        monkeypatch.setattr(attention, "_GATHER_ELEMS", 50)
    h, dn, dv, r = 3, 8, 6, 5  # the latent is r = OFF - 2 wide, the rope key 2
    dr = OFF - r
    w_kv_b = torch.randn(h, dn + dv, r) * 0.3
    for lens in ([(6, 3), (9, 1), (0, 12)], [(9, 1), (0, 1), (20, 1), (3, 1)]):  # prefill; a decode batch
        cached = [torch.randn(c, WIDTH) for c, _ in lens]
        new_lens = [n for _, n in lens]
        t = sum(new_lens)
        new, q_nope, q_pe = torch.randn(t, WIDTH), torch.randn(t, h, dn), torch.randn(t, h, dr)
        index = IndexQuery(torch.randn(t, H, D), torch.randn(t, H), OFF, 6, D**-0.5)
        out = mla_attention(
            q_nope,
            q_pe,
            new,
            paged(cached) if form == "paged" else cached,
            new_lens,
            w_kv_b[:, :dn],
            w_kv_b[:, dn:],
            r,
            0.2,
            index=index,
        )
        start = 0
        for i, (c, n) in enumerate(lens):
            sl = slice(start, start + n)
            rows = torch.cat([cached[i], new[sl]])
            chosen = index.choose(rows, c, sl)
            lat = rows.double()[:, :OFF]
            keys = torch.cat(
                [torch.einsum("lr,hdr->lhd", lat[:, :r], w_kv_b[:, :dn].double()), lat[:, None, r:].expand(-1, h, -1)],
                -1,
            )
            vals = torch.einsum("lr,hdr->lhd", lat[:, :r], w_kv_b[:, dn:].double())
            q = torch.cat([q_nope[sl], q_pe[sl]], -1).double()
            s = torch.einsum("qhd,khd->hqk", q, keys) * 0.2
            ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~chosen, float("-inf")).softmax(-1), vals)
            assert (out[sl].double() - ref).abs().max() < 1e-4, (lens, i)
            start += n


def _sparse_case(lens, dtype, bs):
    """MLA rows ``[latent 16 | rope key 16 | indexer key 16]`` of sequences with (cached, new) ``lens``: queries,
    new rows, the cached rows paged into blocks of ``bs`` (shuffled) and as lists, and an indexer keeping 6."""
    from dualpath.kernels.attention import mla_split

    r, dr, d, h = 16, 16, 16, 3
    width, new_lens = r + dr + d, [n for _, n in lens]
    t = sum(new_lens)
    cached = [torch.randn(c, width, device=DEVICE).to(dtype) for c, _ in lens]
    need = [-(-c // bs) for c, _ in lens]
    cache = torch.randn(sum(need) + 2, bs, width, device=DEVICE).to(dtype)
    order, tables = torch.randperm(cache.shape[0]).tolist(), []
    for c, rows, n in zip((c for c, _ in lens), cached, need):
        blocks, order = order[:n], order[n:]
        if c:
            cache.view(-1, width)[torch.tensor([b * bs + i for b in blocks for i in range(bs)][:c])] = rows
        tables.append(blocks + [0] * (max(need) - n))
    index = IndexQuery(
        torch.randn(t, h, d, device=DEVICE).to(dtype), torch.randn(t, h, device=DEVICE), r + dr, 6, d**-0.5
    )
    return (
        torch.randn(t, 4, r + dr, device=DEVICE).to(dtype),
        torch.randn(t, width, device=DEVICE).to(dtype),
        cached,
        PagedKV(cache, torch.tensor(tables, device=DEVICE), [c for c, _ in lens]),
        new_lens,
        mla_split(r, r + dr),
        index,
    )


PREFILL_ROWS = ([(6, 3), (9, 1), (0, 12), (30, 5)], 4)  # prefill rows over cached parts
DECODE_BATCH = ([(9, 1), (0, 1), (20, 1), (3, 1), (70, 1)], 16)
ONE_SEQUENCE = ([(40, 9)], 16)  # its rows scored a few at a time


@pytest.mark.parametrize(
    "dtype, lens, bs",
    [
        (dtype, *case)
        if dtype is torch.float32 or case is not PREFILL_ROWS
        else pytest.param(dtype, *case, marks=pytest.mark.slow)  # (~3.5 s each; the other shapes cover the dtypes)
        for case in (PREFILL_ROWS, DECODE_BATCH, ONE_SEQUENCE)
        for dtype in (torch.float32, torch.bfloat16, "fp8 cache")
    ],
)
def test_the_triton_sparse_path_matches_the_reference(monkeypatch, dtype, lens, bs):
    """``dualpath.kernels.triton_sparse`` (the interpreter here): the indexer's scores, the choice and MLA over the chosen
    rows on the device give the torch reference's output (within 1e-3 for float32, 2e-2 for bfloat16, of its
    magnitude), prefill rows seeing cached and their own new keys, a decode batch, odd block sizes; float32 queries
    over an e4m3 cache (``--kv-cache-dtype fp8``: new rows attend and are scored as the cache holds them)."""
    from dualpath.kernels import triton_sparse

    monkeypatch.setattr(triton_sparse, "_CHOICE_ELEMS", 200)  # a few query rows a chunk
    fp8 = dtype == "fp8 cache"
    dtype = torch.float32 if fp8 else dtype
    q, new, cached, paged_kv, new_lens, split, index = _sparse_case(lens, dtype, bs)
    if fp8:
        cached = [c.to(torch.float8_e4m3fn) for c in cached]
        paged_kv = PagedKV(paged_kv.cache.to(torch.float8_e4m3fn), paged_kv.block_tables, paged_kv.lens)
    ref = attention.varlen_attention(q, new, cached, split, new_lens, 0.2, index=index)
    out = attention.varlen_attention(q, new, paged_kv, split, new_lens, 0.2, backend="triton", index=index)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert not out.isnan().any() and float((out - ref).abs().max() / ref.abs().max()) < tol


def test_the_triton_indexer_scores_against_float64():
    """Every (query row, key position) the row sees scored as in float64; -inf at the positions it does not see,
    up to the row's padded width."""
    from dualpath.kernels.triton_sparse import QueryRows, index_scores

    lens = [(6, 3), (0, 5), (13, 1)]
    q, new, cached, paged_kv, new_lens, split, index = _sparse_case(lens, torch.float32, 4)
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32, device=DEVICE)
    rows = QueryRows(torch.tensor([6, 0, 13], dtype=torch.int32, device=DEVICE), cu, 9)
    scores = index_scores(index, rows, new, paged_kv.cache, paged_kv.block_tables, 20)
    for b, (c, n) in enumerate(lens):
        keys = torch.cat([cached[b], new[cu[b] : cu[b] + n]])[:, 32:].double()
        for j in range(n):
            r, seen = int(cu[b]) + j, c + j + 1
            want = (
                index.weights[r, :, None].double() * torch.relu(index.q[r].double() @ keys[:seen].T * index.scale)
            ).sum(0)
            assert torch.allclose(scores[r, :seen].double(), want, rtol=1e-5, atol=1e-5)
            assert scores[r, seen:].eq(float("-inf")).all()


def test_the_indexer_changes_the_answer_past_topk(tiny_dirs):
    """The parity tests could fail: attending densely (a topk no prompt reaches) moves the logits of tokens
    beyond the 16th by far more than the 1e-4 the sparse model is held to against transformers."""
    model = load_model(tiny_dirs["deepseek_v32"])
    ids = torch.arange(3, 43)
    sparse, _ = model.forward_all(ids, ForwardBatch((0,), (40,)), all_logits=True)
    m = model.config.mla
    model.config = replace(model.config, mla=replace(m, indexer=replace(m.indexer, topk=4096)))
    dense, _ = model.forward_all(ids, ForwardBatch((0,), (40,)), all_logits=True)
    assert torch.allclose(sparse[:16], dense[:16], atol=1e-5)  # no query sees more than 16 tokens there
    assert ((sparse[16:] - dense[16:]).norm() / dense[16:].norm()) > 1e-2


def _config(tiny_dirs, **changes):
    hf = json.loads((tiny_dirs["deepseek_v32"] / "config.json").read_text())
    return {**hf, **changes}


def test_configs_the_indexer_cannot_serve_are_refused(tiny_dirs):
    """...and both names transformers' versions give a sparse-attention layer are one."""
    names = [
        ModelConfig.from_hf(_config(tiny_dirs, layer_types=[t] * 3))
        for t in ("indexed_attention", "deepseek_sparse_attention")
    ]
    assert names[0] == names[1] and names[0].mla.indexer is not None
    with pytest.raises(CheckpointError, match="q_lora_rank"):
        ModelConfig.from_hf(_config(tiny_dirs, q_lora_rank=None))
    with pytest.raises(CheckpointError, match="layer types"):
        ModelConfig.from_hf(_config(tiny_dirs, layer_types=["indexed_attention", "full_attention", "full_attention"]))
    with pytest.raises(CheckpointError, match="index_topk"):
        ModelConfig.from_hf({k: v for k, v in _config(tiny_dirs).items() if k != "index_topk"})


# ~17 s in the Triton interpreter (7 s on the H200, where bench/gpu/run.sh runs it); by default the sparse kernels'
# own tests run, and V3.2's decode step on them reads nothing on the host (test_decode_graphs)
@pytest.mark.slow
def test_the_triton_layer_loop_copies_nothing_and_matches_the_reference(tiny_dirs, monkeypatch):
    """While no query sees more than index_topk (16) tokens, DeepSeek-V3.2 attends densely on the Triton kernels;
    past that the indexer scores, chooses and MLA attends on the device (``dualpath.kernels.triton_sparse``), a chunked
    prefill and a decode step. Either way its layer loop makes no host transfers and the logits are the torch
    backend's."""
    from dualpath.core.geometry import KVGeometry
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.kv_cache import PagedKVCache
    from dualpath.engines.local import ModelRunner
    from dualpath.engines.sequence import Sequence
    from host_transfers import transfers_in_layers

    runs = {}
    for kernels in ("torch", "triton"):
        model = load_model(tiny_dirs["deepseek_v32"], DEVICE, kernels=kernels)
        cache = PagedKVCache(KVGeometry.for_model(model.config, "float32", 16), 32, DEVICE)
        seqs = [Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=2)) for i, n in enumerate((31, 9))]
        for s in seqs:
            cache.reserve(s.seq_id, s.num_tokens + 1)
        runner, inside = ModelRunner(model, cache), transfers_in_layers(monkeypatch, model)
        dense = [runner.forward(seqs, [5, 3]), runner.forward(seqs, [7, 3])]  # 12 and 6 tokens seen
        sparse = [runner.forward(seqs, [18, 1]), runner.forward(seqs, [1, 1])]  # 30, 31 seen: the indexer chooses
        assert not inside or kernels == "torch"
        runs[kernels] = torch.cat([*dense, *sparse])
    assert torch.allclose(runs["triton"], runs["torch"], atol=1e-4, rtol=1e-4)
