"""Triton kernels for attention over a paged KV cache plus new tokens: varlen causal prefill and split-sequence
decode, for GQA/MHA rows and MLA's shared latent alike. CUDA devices use them (``dualpath.kernels.attention`` dispatches);
tests run them on CPU under ``TRITON_INTERPRET=1`` against a float64 reference.

Every kernel reads KV where it lies: cached tokens of sequence b are token slots of the blocks
``block_tables[b]`` of one cache layer ``[num_blocks, block_size, kv_elems]``; the batch's new tokens are rows of
``new_rows [T, kv_elems]``. A ``RowLayout`` says where in a row a KV head's key and value start, so the same kernels
serve ``[K heads | V heads]`` rows and MLA's ``[latent | rope key]`` rows (one shared head, value = the latent).
Softmax is computed online in float32; inputs stay in q's dtype (bfloat16 products accumulate in float32): a cache
in 8-bit floats is widened to it as its tiles load.
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import TYPE_CHECKING, Sequence

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # (types only: the torch reference dispatches to this module at run time)
    from dualpath.kernels.attention import RowLayout


LOG2E = 1.4426950408889634  # the kernels exponentiate in base 2: scores are scaled by scale * log2(e)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``IEEE``: multiply in float32 exactly (float32 inputs: not TF32, the reference is float64; and in Triton's
    interpreter, whose bfloat16 dot is wrong). Otherwise natively, accumulating in float32."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_kv(
    row,
    ok,
    col_a,
    col_b,
    col_v,
    mask_a,
    mask_b,
    mask_v,
    HAS_B: tl.constexpr,
    V_IS_KA: tl.constexpr,
    dtype,
    MASKED: tl.constexpr = True,
):
    """A tile of keys and values at row pointers ``row [N]``, in ``dtype`` (the queries': an 8-bit cache is
    widened as it is read): the key's first ``DA`` columns ``ka``, the rest ``kb`` (``ka`` again, unused, without a
    rest: a jit function returns no None) and the values ``v`` (``ka`` itself when the value is the key's leading
    part, as MLA's latent is: loaded once). Rows where ``ok`` is false load zeros; ``MASKED`` false: every row is
    valid (a whole tile), only the padded columns are masked."""
    ka = _load_tile(row, col_a, ok, mask_a, MASKED, dtype)
    kb = ka
    if HAS_B:
        kb = _load_tile(row, col_b, ok, mask_b, MASKED, dtype)
    if V_IS_KA:
        v = ka
    else:
        v = _load_tile(row, col_v, ok, mask_v, MASKED, dtype)
    return ka, kb, v


@triton.jit
def _load_tile(row, col, ok, col_ok, MASKED: tl.constexpr, dtype):
    ptrs = row[:, None] + col[None, :]
    if MASKED:
        return tl.load(ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0).to(dtype)
    else:  # the column mask alone (broadcast over rows): constant along each row's vectors, so loads stay wide
        return tl.load(ptrs, mask=col_ok[None, :], other=0.0).to(dtype)


@triton.jit
def _load_q(q_row, ok, offs_a, offs_b, D: tl.constexpr, HAS_B: tl.constexpr):
    """Query rows ``q_row [M, 1]`` split like the keys: the first ``DA`` columns and the rest (``qa`` again,
    unused, without a rest)."""
    qa = tl.load(q_row + offs_a[None, :], mask=ok[:, None] & (offs_a[None, :] < D), other=0.0)
    qb = qa
    if HAS_B:
        qb = tl.load(q_row + offs_b[None, :], mask=ok[:, None] & (offs_b[None, :] < D), other=0.0)
    return qa, qb


@triton.jit
def _scores(qa, qb, ka, kb, scale, HAS_B: tl.constexpr, IEEE: tl.constexpr):
    s = _dot(qa, tl.trans(ka), IEEE)
    if HAS_B:
        s += _dot(qb, tl.trans(kb), IEEE)
    return s * scale


@triton.jit
def _prefill_kernel(
    q_ptr,
    new_ptr,
    cache_ptr,
    tables_ptr,
    cached_lens_ptr,
    cu_new_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_nt,
    stride_cb,
    stride_cs,
    stride_tb,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DA: tl.constexpr,
    DB_PAD: tl.constexpr,
    HAS_B: tl.constexpr,
    DV: tl.constexpr,
    V_OFF: tl.constexpr,
    DV_PAD: tl.constexpr,
    V_IS_KA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program: one sequence, one KV head, BLOCK_M rows of (new token, query head of the group) pairs — the
    group's heads share every K/V tile loaded (GQA packing). Keys: the cached tokens, then the sequence's own new
    tokens up to each query's position."""
    mb, b, kh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dt = q_ptr.dtype.element_ty
    start, end = tl.load(cu_new_ptr + b), tl.load(cu_new_ptr + b + 1)
    n_new, n_cached = end - start, tl.load(cached_lens_ptr + b)
    if mb * BLOCK_M // GROUP >= n_new:
        return
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    tok, head = rows // GROUP, kh * GROUP + rows % GROUP
    offs_a, offs_b = tl.arange(0, DA), DA + tl.arange(0, DB_PAD)
    offs_v, offs_n = tl.arange(0, DV_PAD), tl.arange(0, BLOCK_N)
    m_ok = tok < n_new
    q_row = q_ptr + (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    qa, qb = _load_q(q_row, m_ok, offs_a, offs_b, D, HAS_B)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    col_a, col_b, col_v = kh * D + offs_a, kh * D + offs_b, V_OFF + kh * DV + offs_v
    mask_a, mask_b, mask_v = offs_a < D, offs_b < D, offs_v < DV
    table_row = tables_ptr + b * stride_tb
    whole = n_cached - n_cached % BLOCK_N
    for n0 in range(0, whole, BLOCK_N):  # whole tiles of cached keys: every query sees all of them, no masks
        row = _cached_rows(
            table_row, cache_ptr, n0, offs_n, offs_n < BLOCK_N, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N
        )
        ka, kb, v = _load_kv(row, None, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt, False)
        m_i, l_i, acc = _online_softmax(_scores(qa, qb, ka, kb, qk_scale, HAS_B, IEEE), v, m_i, l_i, acc, False, IEEE)
    for n0 in range(whole, n_cached, BLOCK_N):  # the last, partial tile
        ok = n0 + offs_n < n_cached
        row = _cached_rows(table_row, cache_ptr, n0, offs_n, ok, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N)
        ka, kb, v = _load_kv(row, ok, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt)
        s = tl.where(ok[None, :], _scores(qa, qb, ka, kb, qk_scale, HAS_B, IEEE), float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, True, IEEE)
    first = mb * BLOCK_M // GROUP  # the program's first token: its own new keys before it are seen by every row
    seen = first - first % BLOCK_N
    for n0 in range(0, seen, BLOCK_N):
        row = new_ptr + (start + n0 + offs_n).to(tl.int64) * stride_nt
        ka, kb, v = _load_kv(row, None, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt, False)
        m_i, l_i, acc = _online_softmax(_scores(qa, qb, ka, kb, qk_scale, HAS_B, IEEE), v, m_i, l_i, acc, False, IEEE)
    for n0 in range(seen, ((mb + 1) * BLOCK_M - 1) // GROUP + 1, BLOCK_N):  # the diagonal: causal masks
        pos = n0 + offs_n
        ok = pos < n_new
        row = new_ptr + (start + pos).to(tl.int64) * stride_nt
        ka, kb, v = _load_kv(row, ok, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt)
        s = _scores(qa, qb, ka, kb, qk_scale, HAS_B, IEEE)
        s = tl.where(ok[None, :] & (pos[None, :] <= tok[:, None]), s, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, True, IEEE)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_v[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & mask_v[None, :],
    )


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Fold a tile of scores ``s [M, N]`` (already times ``scale * log2(e)``: base-2 exponentials, one multiply-add
    and one ``ex2`` per score) and values ``v [N, DV]`` into the running max, sum and output. ``MASKED``: rows whose
    keys are all masked so far keep m = -inf and contribute nothing (an unmasked tile has no -inf score)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _cached_rows(
    table_row, cache_ptr, n0, offs_n, ok, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Pointers to the cached rows of key positions ``n0 + offs_n`` of one sequence (its block table row
    ``table_row``). A tile inside one block (tiles start at multiples of ``BLOCK_N``, which divides the block size)
    reads one table entry; otherwise each row looks its block up (``ok``: positions that exist)."""
    if BLOCK_SIZE % BLOCK_N == 0:
        blk = tl.load(table_row + n0 // BLOCK_SIZE).to(tl.int64)
        return cache_ptr + blk * stride_cb + (n0 % BLOCK_SIZE + offs_n) * stride_cs
    else:
        pos = n0 + offs_n
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        return cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs


@triton.jit
def _chunk(total, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a sequence of ``total`` keys: an equal share of ``NUM_SPLITS`` splits, at least
    ``MIN_CHUNK`` (short sequences use fewer splits, whose partial outputs cost more than they save), a whole
    number of ``BLOCK_N`` tiles. Known only on the device, so one grid serves every length (a CUDA graph's)."""
    share = tl.maximum((total + NUM_SPLITS - 1) // NUM_SPLITS, MIN_CHUNK)
    return (share + BLOCK_N - 1) // BLOCK_N * BLOCK_N


@triton.jit
def _decode_split_kernel(
    q_ptr,
    new_ptr,
    cache_ptr,
    tables_ptr,
    cached_lens_ptr,
    part_ptr,
    lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_nb,
    stride_cb,
    stride_cs,
    stride_tb,
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
    F16_MMA: tl.constexpr,
):
    """One program: one sequence, ``G_BLOCK`` query heads of one KV head (all of a GQA group; MLA's 128 heads
    in blocks, whose programs run side by side and share the tiles through L2), and split ``sp`` of the sequence's
    keys (``_chunk``): whole tiles of cached keys without masks, then the split's partial tile; key n_cached (the
    last) is the sequence's new token, read from ``new_rows`` by the split that ends the sequence alone and folded
    in as one key (a dot of vectors), so no tile of the loop carries it. ``F16_MMA`` (an e4m3 cache under bfloat16
    queries): the products are float16, to which e4m3 widens in one conversion per pair (bfloat16 costs one more
    per element). Writes the partial output and its log-sum-exp; a split past the sequence's end writes nothing
    (the reduce never reads it)."""
    hg, b, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if F16_MMA:  # e4m3 -> float16: one conversion per pair, exact; bfloat16 queries too in 2^-14..65504
        dt = tl.float16
    else:
        dt = q_ptr.dtype.element_ty
    n_cached = tl.load(cached_lens_ptr + b)
    total = n_cached + 1
    chunk = _chunk(total, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    lo = sp * chunk
    if lo >= total:
        return
    kh, heads, g_ok = _head_block(hg, GROUP, G_BLOCK, HEAD_BLOCKS)
    offs_a, offs_b = tl.arange(0, DA), DA + tl.arange(0, DB_PAD)
    offs_v, offs_n = tl.arange(0, DV_PAD), tl.arange(0, BLOCK_N)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    qa, qb = _load_q(q_row, g_ok, offs_a, offs_b, D, HAS_B)
    qa, qb = qa.to(dt), qb.to(dt)
    m_i = tl.full([G_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([G_BLOCK], tl.float32)
    acc = tl.zeros([G_BLOCK, DV_PAD], tl.float32)
    col_a, col_b, col_v = kh * D + offs_a, kh * D + offs_b, V_OFF + kh * DV + offs_v
    mask_a, mask_b, mask_v = offs_a < D, offs_b < D, offs_v < DV
    table_row = tables_ptr + b * stride_tb
    hi = tl.minimum(lo + chunk, total)
    hi_cached = tl.minimum(hi, n_cached)  # the split's cached keys are [lo, hi_cached); lo <= n_cached
    whole = lo + (hi_cached - lo) // BLOCK_N * BLOCK_N
    for n0 in range(lo, whole, BLOCK_N):  # whole tiles: no row masks, no -inf scores
        row = _cached_rows(
            table_row, cache_ptr, n0, offs_n, offs_n < BLOCK_N, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N
        )
        ka, kb, v = _load_kv(row, None, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt, False)
        m_i, l_i, acc = _online_softmax(_scores(qa, qb, ka, kb, qk_scale, HAS_B, IEEE), v, m_i, l_i, acc, False, IEEE)
    for n0 in range(whole, hi_cached, BLOCK_N):  # the split's last, partial tile (at most one)
        ok = n0 + offs_n < hi_cached
        row = _cached_rows(table_row, cache_ptr, n0, offs_n, ok, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N)
        ka, kb, v = _load_kv(row, ok, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt)
        s = tl.where(ok[None, :], _scores(qa, qb, ka, kb, qk_scale, HAS_B, IEEE), float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, True, IEEE)
    if hi == total:  # the split that ends the sequence: its new token, key n_cached, read from new_rows
        new_row = new_ptr + b.to(tl.int64) * stride_nb
        ka, kb, v = _new_kv(new_row, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B, V_IS_KA, dt)
        m_i, l_i, acc = _one_key(qa, qb, ka, kb, v, qk_scale, m_i, l_i, acc, HAS_B, dt)
    _store_split(
        part_ptr + b * stride_pb + sp * stride_ps,
        lse_ptr + b * stride_lb + sp,
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


@triton.jit
def _new_kv(new_row, col_a, col_b, col_v, mask_a, mask_b, mask_v, HAS_B: tl.constexpr, V_IS_KA: tl.constexpr, dt):
    """A sequence's new key and value, vectors in ``dt`` (as ``_load_kv`` reads a cached row)."""
    ka = tl.load(new_row + col_a, mask=mask_a, other=0.0).to(dt)
    kb = ka
    if HAS_B:
        kb = tl.load(new_row + col_b, mask=mask_b, other=0.0).to(dt)
    if V_IS_KA:
        v = ka
    else:
        v = tl.load(new_row + col_v, mask=mask_v, other=0.0).to(dt)
    return ka, kb, v


@triton.jit
def _one_key(qa, qb, ka, kb, v, scale, m_i, l_i, acc, HAS_B: tl.constexpr, dt):
    """``_online_softmax`` of one key: its score per query row as a float32 sum of exact products (a dot's), its
    weight rounded to ``dt`` as a tile's is before the value product. Rows that saw no key yet (m = -inf) take
    it whole."""
    s = tl.sum(qa.to(tl.float32) * ka.to(tl.float32)[None, :], 1)
    if HAS_B:
        s += tl.sum(qb.to(tl.float32) * kb.to(tl.float32)[None, :], 1)
    s = s * scale
    m_new = tl.maximum(m_i, s)
    p = tl.exp2(s - m_new)
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + p.to(dt).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
    return m_new, l_i * alpha + p, acc


@triton.jit
def _head_block(hg, GROUP: tl.constexpr, G_BLOCK: tl.constexpr, HEAD_BLOCKS: tl.constexpr):
    """A split program's KV head, its query heads (``G_BLOCK`` of the group, from block ``hg``) and which exist."""
    kh = hg // HEAD_BLOCKS
    offs_g = (hg % HEAD_BLOCKS) * G_BLOCK + tl.arange(0, G_BLOCK)
    return kh, kh * GROUP + offs_g, offs_g < GROUP


@triton.jit
def _joined(ka, kb, v, na, nb, nv, HAS_B: tl.constexpr, V_IS_KA: tl.constexpr):
    """Two tiles of keys and values loaded under disjoint row masks (cached rows, new rows), as one."""
    ka += na
    if HAS_B:
        kb += nb
    if V_IS_KA:
        v = ka
    else:
        v += nv
    return ka, kb, v


@triton.jit
def _store_split(part_row, lse_row, heads, g_ok, offs_v, mask_v, m_i, l_i, acc, stride_ph, stride_lh):
    """A split's partial output (normalized by its own sum) and its base-2 log-sum-exp, -inf where it saw no key."""
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # base 2, as the scores
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(part_row + heads[:, None] * stride_ph + offs_v[None, :], out, mask=g_ok[:, None] & mask_v[None, :])
    tl.store(lse_row + heads * stride_lh, lse, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_ptr,
    lse_ptr,
    totals_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    S_BLOCK: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    TOTAL_PLUS: tl.constexpr,
):
    """One program per (query, head): the splits that hold its keys (``totals[b] + TOTAL_PLUS`` of them: a decode
    step's cached lengths plus its new token, or the sparse kernels' key counts), weighted by 2^(lse - max) (the
    splits' log-sum-exps are base 2, as their scores). Splits past the query's keys are never read, so a grid sized
    for the longest possible sequence (a CUDA graph's) costs the reduce nothing; split 0 always holds a key, so the
    max is finite."""
    b, h = tl.program_id(0), tl.program_id(1)
    total = tl.load(totals_ptr + b) + TOTAL_PLUS
    chunk = _chunk(total, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    n_splits = (total + chunk - 1) // chunk
    offs_s, offs_v = tl.arange(0, S_BLOCK), tl.arange(0, DV_PAD)
    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    m_s = tl.full([S_BLOCK], float("-inf"), tl.float32)
    for s0 in range(0, n_splits, S_BLOCK):
        m_s = tl.maximum(m_s, tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < n_splits, other=float("-inf")))
    m = tl.max(m_s, 0)
    w_s = tl.zeros([S_BLOCK], tl.float32)
    acc = tl.zeros([DV_PAD], tl.float32)
    for s0 in range(0, n_splits, S_BLOCK):
        ok = s0 + offs_s < n_splits
        w = tl.exp2(tl.load(lse_row + s0 + offs_s, mask=ok, other=float("-inf")) - m)
        part = tl.load(
            part_ptr + b * stride_pb + h * stride_ph + (s0 + offs_s)[:, None] * stride_ps + offs_v[None, :],
            mask=ok[:, None] & (offs_v[None, :] < DV),
            other=0.0,
        )
        acc += tl.sum(part * w[:, None], 0)
        w_s += w
    out = acc / tl.sum(w_s, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_v, out.to(out_ptr.dtype.element_ty), mask=offs_v < DV)


def exact_products(dtype: torch.dtype) -> bool:
    """``_dot``'s ``IEEE`` switch: float32 inputs (the reference is float64, so no TF32), and everything under
    Triton's interpreter (its bfloat16 dot is wrong)."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _prefill_tiles(layout: RowLayout, dtype: torch.dtype, launch: dict) -> tuple[int, int]:
    """Default (block_m, block_n): 64 x 64 with two pipeline stages for heads of at most 128 columns in a 2-byte
    dtype (the H200 sweep's best at 32/8 x 128, bench/results/gpu); 32 x 32 for MLA's 576-wide keys and float32,
    whose larger tiles would not fit shared memory and registers."""
    if _pad(layout.k_dim) <= 128 and _pad(layout.v_dim) <= 128 and dtype.itemsize == 2:
        launch.setdefault("num_stages", 2)
        return 64, 64
    return 32, 32


def _pad(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _device_lens(cached_lens: Sequence[int] | torch.Tensor, dev: torch.device) -> torch.Tensor:
    if isinstance(cached_lens, torch.Tensor):
        return cached_lens.to(torch.int32)
    return torch.as_tensor(list(cached_lens), dtype=torch.int32, device=dev)


def _common(cache: torch.Tensor, layout: RowLayout, q: torch.Tensor, launch: dict) -> dict:
    """Constexprs every attention kernel takes. A key of D columns is multiplied in two tiles, the largest power
    of two ``DA`` <= D and the rest (MLA's 576 = 512 + 64, not one 1024-wide tile); a value that is the key's
    leading ``DA`` columns (MLA's latent) is not loaded twice. Wide values get 8 warps (``launch`` may say)."""
    d = layout.k_dim
    da = 1 << (d.bit_length() - 1) if d >= 16 else 16
    dv_pad = _pad(layout.v_dim)
    launch.setdefault("num_warps", 8 if dv_pad >= 256 else 4)
    return dict(
        BLOCK_SIZE=cache.shape[1],
        D=d,
        DA=da,
        DB_PAD=_pad(d - da),
        HAS_B=d > da,
        DV=layout.v_dim,
        V_OFF=layout.v_offset,
        DV_PAD=dv_pad,
        V_IS_KA=layout.num_kv_heads == 1 and layout.v_offset == 0 and layout.v_dim == da,
        IEEE=exact_products(q.dtype),
        **launch,
    )


def prefill_attention(
    q: torch.Tensor,
    new_rows: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: Sequence[int] | torch.Tensor,
    new_lens: Sequence[int],
    layout: RowLayout,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    cu_new: torch.Tensor | None = None,
    **launch,
) -> torch.Tensor:
    """Causal attention of packed new tokens ``q [T, Hq, D]`` over each sequence's cached tokens (paged) and its
    own new rows. Returns ``[T, Hq, Dv]`` in q's dtype (into ``out`` if given). ``launch``: Triton launch options
    (``num_warps``, ``num_stages``). ``cached_lens`` as a device tensor and ``cu_new`` (the new lengths' prefix
    sums, int32 on q's device) spare the host-to-device copies a layer loop should not make."""
    t, hq, _ = q.shape
    dev = q.device
    out = q.new_empty(t, hq, layout.v_dim) if out is None else out
    if t == 0:
        return out
    cu = new_starts(new_lens, cu_new, dev)
    lens = _device_lens(cached_lens, dev)
    q, new_rows = q.contiguous(), new_rows.contiguous()
    group = hq // layout.num_kv_heads
    if block_m is None or block_n is None:
        block_m, block_n = _prefill_tiles(layout, q.dtype, launch)
    grid = (triton.cdiv(max(new_lens) * group, block_m), len(new_lens), layout.num_kv_heads)
    _prefill_kernel[grid](
        q,
        new_rows,
        cache,
        block_tables,
        lens,
        cu,
        out,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        new_rows.stride(0),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **_common(cache, layout, q, launch),
    )
    return out


def decode_attention(
    q: torch.Tensor,
    new_rows: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    cached_lens: Sequence[int] | torch.Tensor,
    layout: RowLayout,
    scale: float,
    num_splits: int | None = None,
    min_chunk: int = 256,
    block_n: int | None = None,
    head_block: int = 16,
    out: torch.Tensor | None = None,
    **launch,
) -> torch.Tensor:
    """One new token per sequence, ``q [B, Hq, D]``, over its cached tokens (paged) and itself. Each sequence's
    keys are cut into up to ``num_splits`` pieces of at least ``min_chunk`` keys, run in parallel, then reduced; a
    program takes up to ``head_block`` query heads of one KV head. Returns ``[B, Hq, Dv]``.

    The grid does not depend on the lengths (a split's range is worked out on the device), so with
    ``cached_lens`` as a device tensor (int32) the call has no host work that depends on them, as a CUDA graph
    needs. ``num_splits`` None: enough programs for ~32 per streaming multiprocessor, at most 64 splits;
    ``block_n`` None: ``decode_tile``."""
    b, hq, _ = q.shape
    dev = q.device
    out = q.new_empty(b, hq, layout.v_dim) if out is None else out
    if b == 0:
        return out
    lens = _device_lens(cached_lens, dev)
    group = hq // layout.num_kv_heads
    g_block, head_blocks = head_blocking(group, head_block)
    splits = num_splits or decode_splits(b * layout.num_kv_heads * head_blocks, dev)
    part, lse = split_outputs(b, hq, splits, layout.v_dim, dev)
    q, new_rows = q.contiguous(), new_rows.contiguous()
    common = _common(cache, layout, q, launch)
    block_n = block_n or decode_tile(cache, layout)
    chunking = dict(NUM_SPLITS=splits, MIN_CHUNK=min_chunk, BLOCK_N=block_n)
    _decode_split_kernel[(layout.num_kv_heads * head_blocks, b, splits)](
        q,
        new_rows,
        cache,
        block_tables,
        lens,
        part,
        lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        new_rows.stride(0),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        G_BLOCK=g_block,
        HEAD_BLOCKS=head_blocks,
        F16_MMA=cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        **chunking,
        **common,
    )
    return reduce_splits(part, lse, lens, 1, out, chunking, common["DV_PAD"])


def decode_tile(cache: torch.Tensor, layout: RowLayout) -> int:
    """Keys per decode tile: 64 over an 8-bit cache with heads up to 128 wide (a tile of the bytes of bfloat16's
    32, half the loop's trips: its conversions make it issue-bound, not memory-bound), else 32 (the H200 sweep's
    best over bfloat16; MLA's 512-wide latent in 64-key tiles would spill registers)."""
    return 64 if cache.element_size() == 1 and _pad(layout.k_dim) <= 128 and _pad(layout.v_dim) <= 128 else 32


def new_starts(new_lens: Sequence[int], cu_new: torch.Tensor | None, dev: torch.device) -> torch.Tensor:
    """Where each sequence's new tokens start in the batch, and their end (int32 on the device): ``cu_new`` as
    given (no copy), else from ``new_lens``."""
    if cu_new is not None:
        return cu_new
    return torch.tensor([0, *itertools.accumulate(new_lens)], dtype=torch.int32, device=dev)


def head_blocking(group: int, head_block: int) -> tuple[int, int]:
    """Query heads per split program (up to ``head_block``, at least 16: a dot's rows) and programs per group."""
    g_block = min(_pad(group), max(16, head_block))
    return g_block, triton.cdiv(group, g_block)


def decode_splits(programs_per_split: int, dev: torch.device) -> int:
    """Splits of every query's keys for ~32 programs per streaming multiprocessor, at most 64."""
    return min(64, triton.next_power_of_2(triton.cdiv(32 * _multiprocessors(dev), programs_per_split)))


def split_outputs(rows: int, heads: int, splits: int, dv: int, dev: torch.device):
    """Each split's partial output and base-2 log-sum-exp, float32."""
    return (
        torch.empty(rows, heads, splits, dv, dtype=torch.float32, device=dev),
        torch.empty(rows, heads, splits, dtype=torch.float32, device=dev),
    )


def reduce_splits(part, lse, totals, total_plus: int, out, chunking: dict, dv_pad: int) -> torch.Tensor:
    """``_decode_reduce_kernel`` over ``split_outputs``: query b's ``totals[b] + total_plus`` keys were cut by
    ``chunking``."""
    _decode_reduce_kernel[(out.shape[0], out.shape[1])](
        part,
        lse,
        totals,
        out,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        **chunking,
        S_BLOCK=min(16, triton.next_power_of_2(part.shape[2])),
        DV=out.shape[2],
        DV_PAD=dv_pad,
        TOTAL_PLUS=total_plus,
        num_warps=4,
    )
    return out


@functools.lru_cache(maxsize=None)
def _multiprocessors(dev: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H100/H200's 132 elsewhere, so CPU runs size like one)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 132
