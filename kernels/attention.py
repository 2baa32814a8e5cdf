"""Reference attention over (cached KV + new tokens) for a batch of sequences of varying lengths.

Sequence i contributes ``new_lens[i]`` query tokens (packed along dim 0 of ``q``) that attend causally to all
of its cached tokens and to its own new tokens up to and including their own position. Cached parts may be
empty. Cached KV arrives as *rows* (one row per token, ``[.., kv_elems]``, the Layer Block layout) either as a
list of per-sequence tensors or as a ``PagedKV`` view of a paged cache; a ``split`` function turns rows into
K ``[.., Hk, D]`` and V ``[.., Hk, Dv]`` views, so GQA/MHA and MLA's shared latent use the same code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F

from kernels.kv_move import gather_tokens

SplitFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PagedKV:
    """Cached rows read in place from one paged cache layer ``[num_blocks, block_size, kv_elems]``: sequence i's
    rows are the first ``lens[i]`` token slots of the blocks ``block_tables[i]`` (padded with any valid id)."""

    cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks], long
    lens: list[int]

    def rows(self, i: int) -> torch.Tensor:
        return gather_tokens(self.cache, self.block_tables[i], self.lens[i])

    def padded(self) -> torch.Tensor:
        """All sequences' rows in one gather: ``[B, max_blocks × block_size, kv_elems]``."""
        b, m = self.block_tables.shape
        return self.cache[self.block_tables].reshape(b, m * self.cache.shape[1], self.cache.shape[-1])


CachedRows = Union[Sequence[torch.Tensor], PagedKV]


def _rows(cached: CachedRows, i: int) -> torch.Tensor:
    return cached.rows(i) if isinstance(cached, PagedKV) else cached[i]


def _padded_rows(cached: CachedRows, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of every sequence padded to a common length with room for one more token, and the lengths."""
    if isinstance(cached, PagedKV):
        rows = cached.padded()
        lens = torch.tensor(cached.lens, device=rows.device)
        if rows.shape[1] > int(lens.max()):
            return rows, lens
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], 1, rows.shape[2])], 1)
        return rows, lens
    lens = [c.shape[0] for c in cached]
    rows = like.new_zeros(len(cached), max(lens) + 1, like.shape[-1])
    for i, c in enumerate(cached):
        rows[i, : lens[i]] = c
    return rows, torch.tensor(lens, device=like.device)


def _causal_offset_mask(n_new: int, n_cached: int, device) -> torch.Tensor:
    # Query i (at absolute position n_cached + i) may see keys 0 .. n_cached + i.
    return torch.ones(n_new, n_cached + n_new, dtype=torch.bool, device=device).tril(diagonal=n_cached)


def _attend_one(q, k, v, n_cached: int, scale: float) -> torch.Tensor:
    # q [n, Hq, D]; k [L, Hk, D]; v [L, Hk, Dv] -> [n, Hq, Dv]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = qh.shape[1] != kh.shape[1]
    if n_cached == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q.shape[0] > 1, scale=scale, enable_gqa=gqa)
    else:
        mask = _causal_offset_mask(q.shape[0], n_cached, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _decode(q, new_rows, cached: CachedRows, split: SplitFn, scale: float) -> torch.Tensor:
    # One query per sequence: each new row goes in the slot after its sequence's cached rows, then one masked
    # attention over the padded batch.
    rows, lens = _padded_rows(cached, new_rows)
    b = rows.shape[0]
    rows[torch.arange(b, device=rows.device), lens] = new_rows.to(rows.dtype)
    k, v = split(rows)
    mask = torch.arange(rows.shape[1], device=rows.device)[None, :] <= lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[2])
    return out[:, :, 0, :]


def varlen_attention(q: torch.Tensor, new_rows: torch.Tensor, cached: CachedRows, split: SplitFn,
                     new_lens: Sequence[int], scale: float) -> torch.Tensor:
    """Attention for packed new tokens over per-sequence cached rows.

    q ``[T, Hq, D]``; new_rows ``[T, kv_elems]`` (the new tokens' KV rows); ``sum(new_lens) == T``.
    Returns ``[T, Hq, Dv]``.
    """
    if len(new_lens) > 1 and all(n == 1 for n in new_lens):
        return _decode(q, new_rows, cached, split, scale)
    outs, start = [], 0
    for i, n in enumerate(new_lens):
        sl = slice(start, start + n)
        c = _rows(cached, i)
        rows = torch.cat([c, new_rows[sl].to(c.dtype)]) if c.shape[0] else new_rows[sl]
        k, v = split(rows)
        outs.append(_attend_one(q[sl], k, v, c.shape[0], scale))
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def gqa_split(num_kv_heads: int, head_dim: int) -> SplitFn:
    """Rows ``[K heads | V heads]`` -> K and V views ``[.., Hk, D]``."""
    width = num_kv_heads * head_dim

    def split(rows: torch.Tensor):
        shape = rows.shape[:-1] + (num_kv_heads, head_dim)
        return rows[..., :width].view(shape), rows[..., width:].view(shape)

    return split


def mla_split(kv_lora_rank: int) -> SplitFn:
    """Rows ``[latent | rope key]`` -> the single shared key (the whole row) and value (the latent)."""

    def split(rows: torch.Tensor):
        k = rows.unsqueeze(-2)
        return k, k[..., :kv_lora_rank]

    return split


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, new_rows: torch.Tensor, cached: CachedRows,
                  new_lens: Sequence[int], w_uk: torch.Tensor, w_uv: torch.Tensor, kv_lora_rank: int,
                  scale: float) -> torch.Tensor:
    """Multi-head latent attention in absorbed form over the cached latent.

    A row ``[c_kv (kv_lora_rank) | k_pe (rope dim)]`` is the single shared key (queries are
    ``[q_nope · W_UK | q_pe]``) and its latent the shared value, mapped back per head by ``W_UV``.
    q_nope ``[T, H, dn]``, q_pe ``[T, H, dr]``, new_rows ``[T, R + dr]``, w_uk ``[H, dn, R]``, w_uv ``[H, dv, R]``.
    Returns ``[T, H, dv]``.
    """
    q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1)
    out_lat = varlen_attention(q, new_rows, cached, mla_split(kv_lora_rank), new_lens, scale)
    return torch.einsum("thr,hvr->thv", out_lat, w_uv)
