"""DeepSeek-V3.2's sparse attention (DSA) on CUDA: the lightning indexer's scores, its choice, and MLA over the chosen
tokens, all on the device, so a decode step past ``index_topk`` tokens is a CUDA graph like any other.
``dualpath.kernels.attention.varlen_attention`` dispatches here for the triton backend; tests run it on CPU under
``TRITON_INTERPRET=1`` against the torch reference (``dualpath.kernels.sparse_attention``) and float64.

Every new token is a query row ``r`` of sequence ``b``: it sees ``b``'s cached tokens (paged) and ``b``'s new tokens up
to itself (rows of ``new_rows``). ``_index_score_kernel`` scores every key a row sees, ``Σ_h w_h · relu(scale ·
q_h · k)`` in float32, reading the indexer key columns where the row lies; the choice is the reference's (the
``topk`` best, ties at the cut to the earliest tokens: ``_top``, ``listed``) on the device; ``_sparse_split_kernel``
attends to a row's chosen positions, looking each one up (block table, or its new row), in splits that
``_decode_reduce_kernel`` folds as it folds a decode step's. A prefill's rows are scored a chunk at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import triton
import triton.language as tl

from dualpath.kernels.sparse_attention import IndexQuery, _top, listed
from dualpath.kernels.triton_attention import (
    LOG2E,
    _chunk,
    _common,
    _device_lens,
    _dot,
    _head_block,
    _joined,
    _load_kv,
    _load_q,
    _online_softmax,
    _pad,
    _scores,
    _store_split,
    decode_splits,
    exact_products,
    head_blocking,
    new_starts,
    reduce_splits,
    split_outputs,
)

if TYPE_CHECKING:  # (types only: the torch reference dispatches to this module at run time)
    from dualpath.kernels.attention import RowLayout

_CHOICE_ELEMS = 1 << 24  # scores per chunk of query rows: the choice's sort holds 8 bytes for each


@triton.jit
def _key_rows(
    pos, ok, n_cached, start, table_row, cache_ptr, new_ptr, stride_cb, stride_cs, stride_nt, BLOCK_SIZE: tl.constexpr
):
    """The rows of key positions ``pos`` of one sequence: pointers into the cache (through its block table) and
    into its new rows (``start``: its first in ``new_rows``), and which positions each holds. Two sets, loaded
    apart and added: a cache of 8-bit floats and new rows of the queries' dtype are pointers of two types."""
    in_cache = ok & (pos < n_cached)
    blk = tl.load(table_row + pos // BLOCK_SIZE, mask=in_cache, other=0).to(tl.int64)
    cached = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs
    return cached, in_cache, new_ptr + (start + pos - n_cached).to(tl.int64) * stride_nt, ok & (pos >= n_cached)


@triton.jit
def _query_row(r, seq_ptr, cached_lens_ptr, cu_new_ptr):
    """Query row ``r``'s sequence, its cached length, where its new rows start, and how many keys the row sees."""
    b = tl.load(seq_ptr + r)
    n_cached, start = tl.load(cached_lens_ptr + b), tl.load(cu_new_ptr + b)
    return b, n_cached, start, n_cached + (r - start) + 1


@triton.jit
def _index_score_kernel(
    q_ptr,
    w_ptr,
    new_ptr,
    cache_ptr,
    tables_ptr,
    cached_lens_ptr,
    cu_new_ptr,
    seq_ptr,
    out_ptr,
    row0,
    n_keys,
    scale,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_nt,
    stride_cb,
    stride_cs,
    stride_tb,
    stride_ot,
    KEY_OFF: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program: query row ``row0 + program_id(0)``, BLOCK_L key positions: their scores into the output row,
    -inf where the row does not see them (the row is ``n_keys`` wide)."""
    r, lb = row0 + tl.program_id(0), tl.program_id(1)
    b, n_cached, start, seen = _query_row(r, seq_ptr, cached_lens_ptr, cu_new_ptr)
    pos = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    out = out_ptr + tl.program_id(0).to(tl.int64) * stride_ot + pos
    if lb * BLOCK_L >= seen:
        tl.store(out, tl.full([BLOCK_L], float("-inf"), tl.float32), mask=pos < n_keys)
        return
    ok = pos < seen
    offs_d, offs_h = tl.arange(0, D_PAD), tl.arange(0, H_PAD)
    cached, in_cache, new, is_new = _key_rows(
        pos,
        ok,
        n_cached,
        start,
        tables_ptr + b * stride_tb,
        cache_ptr,
        new_ptr,
        stride_cb,
        stride_cs,
        stride_nt,
        BLOCK_SIZE,
    )
    dt = q_ptr.dtype.element_ty
    col, d_ok = KEY_OFF + offs_d, offs_d < D
    keys = tl.load(cached[:, None] + col[None, :], mask=in_cache[:, None] & d_ok[None, :], other=0.0).to(dt) + tl.load(
        new[:, None] + col[None, :], mask=is_new[:, None] & d_ok[None, :], other=0.0
    ).to(dt)
    q = tl.load(
        q_ptr + r.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=(offs_h < H)[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    w = tl.load(w_ptr + r.to(tl.int64) * stride_wt + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
    s = tl.maximum(_dot(q, tl.trans(keys), IEEE) * scale, 0.0)  # [H, BLOCK_L]
    tl.store(out, tl.where(ok, tl.sum(s * w[:, None], 0), float("-inf")), mask=pos < n_keys)


@triton.jit
def _sparse_split_kernel(
    q_ptr,
    new_ptr,
    cache_ptr,
    tables_ptr,
    cached_lens_ptr,
    cu_new_ptr,
    seq_ptr,
    pick_ptr,
    totals_ptr,
    part_ptr,
    lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_nt,
    stride_cb,
    stride_cs,
    stride_tb,
    stride_pr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    G_BLOCK: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB_PAD: tl.constexpr,
    HAS_B: tl.constexpr,
    DV: tl.constexpr,
    V_OFF: tl.constexpr,
    DV_PAD: tl.constexpr,
    V_IS_KA: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program: one query row, ``G_BLOCK`` query heads of one KV head, split ``sp`` of the row's chosen key
    positions (its first ``totals[r]`` picks). Writes the partial output and its log-sum-exp, as the decode kernel
    does."""
    hg, r, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    total = tl.load(totals_ptr + r)
    chunk = _chunk(total, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    lo = sp * chunk
    if lo >= total:
        return
    dt = q_ptr.dtype.element_ty
    b, n_cached, start, _ = _query_row(r, seq_ptr, cached_lens_ptr, cu_new_ptr)
    kh, heads, g_ok = _head_block(hg, GROUP, G_BLOCK, HEAD_BLOCKS)
    offs_a, offs_b = tl.arange(0, DA), DA + tl.arange(0, DB_PAD)
    offs_v, offs_n = tl.arange(0, DV_PAD), tl.arange(0, BLOCK_N)
    qa, qb = _load_q(q_ptr + r * stride_qb + heads[:, None] * stride_qh, g_ok, offs_a, offs_b, D, HAS_B)
    m_i = tl.full([G_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([G_BLOCK], tl.float32)
    acc = tl.zeros([G_BLOCK, DV_PAD], tl.float32)
    col_a, col_b, col_v = kh * D + offs_a, kh * D + offs_b, V_OFF + kh * DV + offs_v
    mask_a, mask_b, mask_v = offs_a < D, offs_b < D, offs_v < DV
    table_row, pick_row = tables_ptr + b * stride_tb, pick_ptr + r.to(tl.int64) * stride_pr
    hi = tl.minimum(lo + chunk, total)
    for n0 in range(lo, hi, BLOCK_N):
        ok = n0 + offs_n < hi
        pos = tl.load(pick_row + n0 + offs_n, mask=ok, other=0)
        cached, in_cache, new, is_new = _key_rows(
            pos, ok, n_cached, start, table_row, cache_ptr, new_ptr, stride_cb, stride_cs, stride_nt, BLOCK_SIZE
        )
        ka, kb, v = _load_kv(cached, in_cache, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt)
        na, nb, nv = _load_kv(new, is_new, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt)
        ka, kb, v = _joined(ka, kb, v, na, nb, nv, HAS_B, V_IS_KA)
        s = tl.where(ok[None, :], _scores(qa, qb, ka, kb, qk_scale, HAS_B, IEEE), float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, True, IEEE)
    _store_split(
        part_ptr + r * stride_pb + sp * stride_ps,
        lse_ptr + r * stride_lb + sp,
        heads,
        g_ok,
        offs_v,
        mask_v,
        m_i,
        l_i,
        acc,
        stride_ph,
        stride_lh,
    )


class QueryRows:
    """Where the batch's query rows (its new tokens, packed) stand, on the device: each row's sequence, the
    sequences' cached lengths and where their new rows start, and how many keys each row sees."""

    def __init__(self, cached_lens: torch.Tensor, cu_new: torch.Tensor, num_rows: int):
        rows = torch.arange(num_rows, dtype=cu_new.dtype, device=cu_new.device)
        seq = torch.searchsorted(cu_new[1:], rows, right=True)
        self.cached_lens, self.cu_new, self.seq = cached_lens, cu_new, seq.to(torch.int32)
        self.seen = cached_lens[seq] + (rows - cu_new[seq]) + 1


def index_scores(
    index: IndexQuery,
    rows: QueryRows,
    new_rows: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    n_keys: int,
    row0: int = 0,
    num_rows: int | None = None,
    block_l: int = 64,
) -> torch.Tensor:
    """Query rows ``row0`` onwards (``num_rows``, default all): the indexer's score of every key position below
    ``n_keys``, ``[num_rows, n_keys]`` float32, -inf where a row does not see the key."""
    num_rows = rows.seq.shape[0] - row0 if num_rows is None else num_rows
    t, h, d = index.q.shape
    out = torch.empty(num_rows, n_keys, dtype=torch.float32, device=index.q.device)
    q = index.q.contiguous()
    w = index.weights.contiguous()
    _index_score_kernel[(num_rows, triton.cdiv(n_keys, block_l))](
        q,
        w,
        new_rows,
        cache,
        block_tables,
        rows.cached_lens,
        rows.cu_new,
        rows.seq,
        out,
        row0,
        n_keys,
        index.scale,
        q.stride(0),
        q.stride(1),
        w.stride(0),
        new_rows.stride(0),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        KEY_OFF=index.key_offset,
        D=d,
        D_PAD=_pad(d),
        H=h,
        H_PAD=_pad(h),
        BLOCK_SIZE=cache.shape[1],
        BLOCK_L=block_l,
        IEEE=exact_products(q.dtype),
    )
    return out


def choose(
    index: IndexQuery,
    rows: QueryRows,
    new_rows: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    n_keys: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's chosen key positions, ascending, ``[T, K]`` int32 (``K = min(topk, n_keys)``), and how many
    of them are real (``min(seen, K)``: a row seeing fewer keys chose them all)."""
    t, k = rows.seq.shape[0], min(index.topk, n_keys)
    picks = torch.empty(t, k, dtype=torch.int32, device=new_rows.device)
    step = max(1, _CHOICE_ELEMS // n_keys)
    for r0 in range(0, t, step):
        n = min(step, t - r0)
        scores = index_scores(index, rows, new_rows, cache, block_tables, n_keys, r0, n)
        picks[r0 : r0 + n] = listed(_top(scores, k), k)[0]
    return picks, torch.clamp(rows.seen, max=k).to(torch.int32)


def sparse_attention(
    q: torch.Tensor,
    new_rows: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: Sequence[int] | torch.Tensor,
    new_lens: Sequence[int],
    layout: RowLayout,
    scale: float,
    index: IndexQuery,
    cu_new: torch.Tensor | None = None,
    min_chunk: int = 256,
    block_n: int = 32,
    head_block: int = 16,
    **launch,
) -> torch.Tensor:
    """Each new token of ``q [T, Hq, D]`` attends to the tokens the indexer chooses for it among its sequence's
    cached tokens (paged) and its own new rows up to itself. Returns ``[T, Hq, Dv]``. With ``cached_lens`` and
    ``cu_new`` on the device nothing here waits for the host's view of them (a decode step is graph-safe); a
    prefill's rows are scored in chunks."""
    t, hq, _ = q.shape
    dev = q.device
    out = q.new_empty(t, hq, layout.v_dim)
    if t == 0:
        return out
    rows = QueryRows(_device_lens(cached_lens, dev), new_starts(new_lens, cu_new, dev), t)
    n_keys = block_tables.shape[1] * cache.shape[1] + max(new_lens)  # past any row's last key
    q, new_rows = q.contiguous(), new_rows.contiguous()
    picks, totals = choose(index, rows, new_rows, cache, block_tables, n_keys)
    group = hq // layout.num_kv_heads
    g_block, head_blocks = head_blocking(group, head_block)
    splits = decode_splits(t * layout.num_kv_heads * head_blocks, dev)
    part, lse = split_outputs(t, hq, splits, layout.v_dim, dev)
    common = _common(cache, layout, q, launch)
    chunking = dict(NUM_SPLITS=splits, MIN_CHUNK=min_chunk, BLOCK_N=block_n)
    _sparse_split_kernel[(layout.num_kv_heads * head_blocks, t, splits)](
        q,
        new_rows,
        cache,
        block_tables,
        rows.cached_lens,
        rows.cu_new,
        rows.seq,
        picks,
        totals,
        part,
        lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        new_rows.stride(0),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        picks.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        G_BLOCK=g_block,
        HEAD_BLOCKS=head_blocks,
        **chunking,
        **common,
    )
    return reduce_splits(part, lse, totals, 0, out, chunking, common["DV_PAD"])
