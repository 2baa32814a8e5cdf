"""DeepSeek-V3.2's sparse attention (DSA): the lightning indexer's choice of the tokens each query attends to.

Every token has an indexer key (``head_dim`` values stored after MLA's latent and rope key in its cached row). A
query token's indexer heads score each key it may see causally,

    score(q, k) = Σ_h weight_h(q) · relu(scale · q_h · k),

and the query attends to its ``topk`` best-scoring keys only (all of them while it sees no more than ``topk``).
Scores are float32 (as transformers computes them; float64 for float64 inputs). This is the torch reference; it
runs on any device, with the cached rows' lengths on the host.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.attention import CachedRows, PagedKV, cache_dtype, causal_offset_mask, cached_rows
from kernels.kv_move import as_cached

_SCORE_ELEMS = 1 << 26  # query rows are scored in chunks of at most this many float32 scores (256 MiB)


def cached_lens(cached: CachedRows) -> list[int]:
    """Each sequence's number of cached rows, on the host."""
    if isinstance(cached, PagedKV):
        return list(cached.on_host().lens)
    return [c.shape[0] for c in cached]


def needs_selection(cached: CachedRows, new_lens: Sequence[int], topk: int, max_seen: int | None = None) -> bool:
    """Whether any query sees more than ``topk`` tokens: otherwise every query attends to all it sees, and dense
    causal attention is exactly the sparse one. ``max_seen`` (the most tokens a query sees, when the caller knows
    it) saves reading the cached lengths from the device."""
    if max_seen is not None:
        return max_seen > topk
    return any(c + n > topk for c, n in zip(cached_lens(cached), new_lens))


def select_tokens(q: torch.Tensor, weights: torch.Tensor, new_keys: torch.Tensor, cached: CachedRows,
                  key_offset: int, new_lens: Sequence[int], topk: int, scale: float) -> list[torch.Tensor]:
    """The keys each new token attends to: per sequence a bool mask ``[n_i, C_i + n_i]`` over its cached then its
    new tokens, true at the token's ``topk`` best-scoring causal keys.

    q ``[T, H, D]`` (the indexer's queries, packed like ``new_lens``), weights ``[T, H]`` (each head's weight per
    query), new_keys ``[T, D]``; cached indexer keys are the ``D`` columns of cached rows from ``key_offset``. New
    keys are scored as the cache holds them (``as_cached``), so a choice does not depend on which keys are new.
    """
    new_keys = as_cached(new_keys, cache_dtype(cached, new_keys))
    if isinstance(cached, PagedKV):
        cached = cached.on_host()
    d, acc, masks, start = q.shape[-1], torch.promote_types(q.dtype, torch.float32), [], 0
    for i, n in enumerate(new_lens):
        sl = slice(start, start + n)
        old = cached_rows(cached, i)[:, key_offset: key_offset + d]
        keys = torch.cat([old.to(acc), new_keys[sl].to(acc)])
        masks.append(_select_one(q[sl].to(acc), weights[sl].to(acc), keys, old.shape[0], topk, scale))
        start += n
    return masks


def _select_one(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_cached: int, topk: int,
                scale: float) -> torch.Tensor:
    n, h = q.shape[:2]
    causal = causal_offset_mask(n, n_cached, q.device)
    if keys.shape[0] <= topk:
        return causal
    rows = max(1, _SCORE_ELEMS // (h * keys.shape[0]))
    picked = torch.zeros_like(causal)
    for r in range(0, n, rows):
        scores = torch.relu(torch.einsum("nhd,ld->nhl", q[r:r + rows], keys) * scale)
        score = torch.einsum("nh,nhl->nl", w[r:r + rows], scores).masked_fill(~causal[r:r + rows], float("-inf"))
        picked[r:r + rows] = _top(score, topk)
    return picked & causal  # a query seeing fewer than topk keys also "picked" some it may not see


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest scores of each row, ties at the cut going to the earliest tokens. ``topk`` alone breaks
    ties as it likes (differently for rows of other lengths), and ties are common (a key every head scores below
    zero scores exactly 0): without a rule, a chunked prefill would choose other tokens than a whole one."""
    kth = score.topk(k, dim=-1).values[:, -1:]
    above, tied = score > kth, score == kth
    return above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
