"""Attention over (cached KV + new tokens) for a batch of sequences of varying lengths: the torch reference, and
the choice of kernels by device.

Sequence i contributes ``new_lens[i]`` query tokens (packed along dim 0 of ``q``) that attend causally to all
of its cached tokens and to its own new tokens up to and including their own position. Cached parts may be
empty. Cached KV arrives as *rows* (one row per token, ``[.., kv_elems]``, the Layer Block layout) either as a
list of per-sequence tensors or as a ``PagedKV`` view of a paged cache; a ``RowLayout`` says where each KV head's
key and value lie in a row (and splits rows into K ``[.., Hk, D]`` and V ``[.., Hk, Dv]`` views), so GQA/MHA and
MLA's shared latent use the same code.

The cache may hold KV in a narrower dtype than q (8-bit floats): cached rows are read back in q's dtype, and new
rows attend as the cache holds them (``dualpath.kernels.kv_move.as_cached``), so a token's output does not depend on
whether its keys were computed in this forward or earlier.

Backends: ``torch`` (this module; CPU, and the reference everywhere) and ``triton`` (``dualpath.kernels.triton_attention``,
reading the paged cache in place; CUDA). ``choose_backend("auto", device)`` picks triton on CUDA when it is
installed; ``torch`` forces the reference for debugging.
"""

from __future__ import annotations

from dataclasses import dataclass
import importlib.util
from typing import Sequence, Union

import torch
import torch.nn.functional as F

from dualpath.core.config import KERNEL_BACKENDS
from dualpath.core.errors import ConfigError
from dualpath.kernels.kv_move import as_cached, gather_tokens
from dualpath.kernels.sparse_attention import IndexQuery, listed

# Sparse prefill over more than this many times topk tokens gathers each query's chosen rows (attention then costs
# topk per query); below, it masks the dense scores (each gathered row is a copy). On CPU, 16 query heads, topk
# 2,048: masking is 2.2x faster at 4K tokens, even at 16K, and gathering 2x faster at 32K (bench/sparse_attention.py)
_GATHER_FROM = 8
_GATHER_ELEMS = 1 << 26  # rows gathered per chunk of queries, at most


def choose_backend(name: str, device: torch.device | str) -> str:
    """The kernels an engine on ``device`` runs: ``auto`` is triton on CUDA (when installed), else torch."""
    if name not in KERNEL_BACKENDS:
        raise ConfigError(f"kernels must be one of {KERNEL_BACKENDS}, got {name!r}")
    if name == "auto":
        cuda = torch.device(device).type == "cuda"
        return "triton" if cuda and importlib.util.find_spec("triton") is not None else "torch"
    return name


def check_cache_dtype(backend: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """Refuse an 8-bit float cache the kernels cannot read: Triton has e4m3 only from compute capability 8.9
    (Ada, Hopper); on older GPUs the torch reference (``--kernels torch``) reads it."""
    device = torch.device(device)
    if (
        backend == "triton"
        and dtype.itemsize == 1
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ConfigError(
            f"an fp8 KV cache on the Triton kernels needs a GPU of compute capability 8.9 or newer "
            f"({torch.cuda.get_device_name(device)} is "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}): use --kernels torch, "
            "or --kv-cache-dtype auto"
        )


@dataclass(frozen=True)
class RowLayout:
    """Where KV head h's key (``k_dim`` wide at ``h × k_dim``) and value (``v_dim`` wide at ``v_offset + h ×
    v_dim``) lie in a cached row. Calling it splits rows into K ``[.., Hk, D]`` and V ``[.., Hk, Dv]`` views."""

    num_kv_heads: int
    k_dim: int
    v_offset: int
    v_dim: int

    def __call__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.num_kv_heads
        k = rows[..., : h * self.k_dim].view(rows.shape[:-1] + (h, self.k_dim))
        v = rows[..., self.v_offset : self.v_offset + h * self.v_dim].view(rows.shape[:-1] + (h, self.v_dim))
        return k, v


@dataclass(frozen=True)
class PagedKV:
    """Cached rows read in place from one paged cache layer ``[num_blocks, block_size, kv_elems]``: sequence i's
    rows are the first ``lens[i]`` token slots of the blocks ``block_tables[i]`` (padded with any valid id).
    ``lens`` is a list, or a device tensor where no host work may depend on it (a CUDA graph's decode step)."""

    cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks], long
    lens: Sequence[int] | torch.Tensor

    def on_host(self) -> "PagedKV":
        """The same view with ``lens`` as a list (the torch reference indexes with them)."""
        if isinstance(self.lens, torch.Tensor):
            return PagedKV(self.cache, self.block_tables, self.lens.tolist())
        return self

    def rows(self, i: int) -> torch.Tensor:
        return gather_tokens(self.cache, self.block_tables[i], self.lens[i])

    def padded(self) -> torch.Tensor:
        """All sequences' rows in one gather: ``[B, max_blocks × block_size, kv_elems]``."""
        b, m = self.block_tables.shape
        return self.cache[self.block_tables].reshape(b, m * self.cache.shape[1], self.cache.shape[-1])


def consecutive_tables(first_blocks: Sequence[int], num_blocks: Sequence[int], device) -> torch.Tensor:
    """Block tables of sequences stored in consecutive blocks (sequence i in ``first_blocks[i]`` onwards). Rows are
    padded by repeating their last block, and a sequence with no blocks gets block 0: every id stays valid."""
    width = max(max(num_blocks, default=0), 1)
    rows = [[f + min(j, n - 1) if n else 0 for j in range(width)] for f, n in zip(first_blocks, num_blocks)]
    return torch.tensor(rows, dtype=torch.long, device=device)


CachedRows = Union[Sequence[torch.Tensor], PagedKV]


def _rows(cached: CachedRows, i: int) -> torch.Tensor:
    return cached.rows(i) if isinstance(cached, PagedKV) else cached[i]


def _cache_dtype(cached: CachedRows, new_rows: torch.Tensor) -> torch.dtype:
    if isinstance(cached, PagedKV):
        return cached.cache.dtype
    return cached[0].dtype if len(cached) else new_rows.dtype


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


def _attend_one(q, k, v, n_cached: int, scale: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    # q [n, Hq, D]; k [L, Hk, D]; v [L, Hk, Dv] -> [n, Hq, Dv]; ``allowed`` [n, L]: the keys each query sees
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = qh.shape[1] != kh.shape[1]
    if n_cached == 0 and allowed is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q.shape[0] > 1, scale=scale, enable_gqa=gqa)
    else:
        mask = _causal_offset_mask(q.shape[0], n_cached, q.device) if allowed is None else allowed
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _decode(
    q, new_rows, cached: CachedRows, split: RowLayout, scale: float, index: IndexQuery | None = None
) -> torch.Tensor:
    # One query per sequence: each new row goes in the slot after its sequence's cached rows, then one masked
    # attention over the padded batch (sparse: over the rows the indexer chose, gathered).
    rows, lens = _padded_rows(cached, new_rows)
    rows = rows.to(q.dtype)
    b = rows.shape[0]
    rows[torch.arange(b, device=rows.device), lens] = new_rows.to(q.dtype)
    if index is not None and rows.shape[1] > index.topk:
        idx, mask = index.choose_decode(rows, lens)
        rows = rows.gather(1, idx[..., None].expand(-1, -1, rows.shape[-1]))
    else:
        mask = torch.arange(rows.shape[1], device=rows.device)[None, :] <= lens[:, None]
    return _attend_each(q, rows, mask, split, scale)


def _attend_each(q, rows, mask, split: RowLayout, scale: float) -> torch.Tensor:
    """Query ``b`` (``q [B, Hq, D]``, all its heads) attends to its own rows ``rows[b]`` (``[B, L, W]``) where
    ``mask[b]``. A KV head's query heads are its queries: K and V are not expanded to every query head (for MLA's
    one shared head at 32K tokens that would take gigabytes)."""
    k, v = split(rows)
    b, hq, hk = q.shape[0], q.shape[1], k.shape[2]
    out = F.scaled_dot_product_attention(
        q.reshape(b, hk, hq // hk, q.shape[-1]),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return out.reshape(b, hq, -1)


def _attend_chosen(q, rows, chosen: torch.Tensor, k: int, split: RowLayout, scale: float) -> torch.Tensor:
    """Sparse prefill: each query (``q [n, Hq, D]``) over the at most ``k`` of ``rows`` that ``chosen [n, L]``
    marks, gathered."""
    idx, real = listed(chosen, k)
    step = max(1, _GATHER_ELEMS // (k * rows.shape[-1]))
    return torch.cat(
        [
            _attend_each(q[r : r + step], rows[idx[r : r + step]], real[r : r + step], split, scale)
            for r in range(0, q.shape[0], step)
        ]
    )


def varlen_attention(
    q: torch.Tensor,
    new_rows: torch.Tensor,
    cached: CachedRows,
    split: RowLayout,
    new_lens: Sequence[int],
    scale: float,
    backend: str = "torch",
    cu_new: torch.Tensor | None = None,
    index: IndexQuery | None = None,
) -> torch.Tensor:
    """Attention for packed new tokens over per-sequence cached rows.

    q ``[T, Hq, D]``; new_rows ``[T, kv_elems]`` (the new tokens' KV rows); ``sum(new_lens) == T``.
    Returns ``[T, Hq, Dv]``. ``backend`` is ``choose_backend``'s answer; triton needs ``cached`` paged, and with
    ``cu_new`` (the new lengths' prefix sums, int32 on q's device) and device-side ``cached.lens`` it copies
    nothing between host and device. ``index`` (DeepSeek-V3.2's sparse attention; ``dualpath.kernels.triton_sparse`` on
    triton): each new token attends to the tokens the indexer chooses for it, not to all it sees.
    """
    new_rows = as_cached(new_rows, _cache_dtype(cached, new_rows))
    if backend == "triton":
        return _triton(q, new_rows, cached, split, new_lens, scale, cu_new, index)
    if isinstance(cached, PagedKV):
        cached = cached.on_host()
    if len(new_lens) > 1 and all(n == 1 for n in new_lens):
        return _decode(q, new_rows, cached, split, scale, index)
    outs, start = [], 0
    for i, n in enumerate(new_lens):
        sl = slice(start, start + n)
        c = _rows(cached, i).to(q.dtype)
        rows = torch.cat([c, new_rows[sl].to(q.dtype)]) if c.shape[0] else new_rows[sl]
        allowed = None if index is None else index.choose(rows, c.shape[0], sl)
        if allowed is not None and rows.shape[0] > _GATHER_FROM * index.topk:
            outs.append(_attend_chosen(q[sl], rows, allowed, index.topk, split, scale))
        else:
            k, v = split(rows)
            outs.append(_attend_one(q[sl], k, v, c.shape[0], scale, allowed))
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _triton(
    q,
    new_rows,
    cached: CachedRows,
    layout: RowLayout,
    new_lens: Sequence[int],
    scale: float,
    cu_new,
    index: IndexQuery | None,
):
    from dualpath.kernels import triton_attention as ta

    if not isinstance(cached, PagedKV):
        raise ValueError("the triton kernels read a paged cache: pass cached KV as PagedKV")
    if index is not None:
        from dualpath.kernels.triton_sparse import sparse_attention

        return sparse_attention(
            q, new_rows, cached.cache, cached.block_tables, cached.lens, new_lens, layout, scale, index, cu_new
        )
    if all(n == 1 for n in new_lens):
        return ta.decode_attention(q, new_rows, cached.cache, cached.block_tables, cached.lens, layout, scale)
    return ta.prefill_attention(
        q, new_rows, cached.cache, cached.block_tables, cached.lens, new_lens, layout, scale, cu_new=cu_new
    )


def gqa_split(num_kv_heads: int, head_dim: int) -> RowLayout:
    """Rows ``[K heads | V heads]``."""
    return RowLayout(num_kv_heads, head_dim, num_kv_heads * head_dim, head_dim)


def mla_split(kv_lora_rank: int, key_width: int) -> RowLayout:
    """Rows ``[latent | rope key | ...]``: one shared key (the first ``key_width`` elements) whose value is the
    latent. What follows the key (DeepSeek-V3.2's indexer key) is not attended over."""
    return RowLayout(1, key_width, 0, kv_lora_rank)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    new_rows: torch.Tensor,
    cached: CachedRows,
    new_lens: Sequence[int],
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    backend: str = "torch",
    cu_new: torch.Tensor | None = None,
    index: IndexQuery | None = None,
) -> torch.Tensor:
    """Multi-head latent attention in absorbed form over the cached latent.

    A row ``[c_kv (kv_lora_rank) | k_pe (rope dim) | ...]`` starts with the single shared key (queries are
    ``[q_nope · W_UK | q_pe]``) and its latent is the shared value, mapped back per head by ``W_UV``.
    q_nope ``[T, H, dn]``, q_pe ``[T, H, dr]``, new_rows ``[T, >= R + dr]``, w_uk ``[H, dn, R]``, w_uv
    ``[H, dv, R]``. Returns ``[T, H, dv]``. ``backend``, ``cu_new`` and ``index`` as in ``varlen_attention``.
    """
    q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1)
    out_lat = varlen_attention(
        q, new_rows, cached, mla_split(kv_lora_rank, q.shape[-1]), new_lens, scale, backend, cu_new, index
    )
    return torch.einsum("thr,hvr->thv", out_lat, w_uv)
