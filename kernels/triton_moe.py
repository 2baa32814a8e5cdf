"""Fused MoE for CUDA: a batch's routed experts in two Triton kernels, without the host learning which experts
were chosen, so a DeepSeek-V3 decode step can be captured as a CUDA graph. ``dualpath.kernels.moe.routed_experts``
dispatches here for the triton backend; tests run it on CPU under ``TRITON_INTERPRET=1`` against float64.

The (token, expert) pairs are sorted by expert on the device and each expert's run padded to whole blocks of
``block_m`` rows, within a bound known from shapes alone (``T × k + E × (block_m - 1)`` rows), so every row block
belongs to one expert (or none, past the used rows). Kernel 1 computes ``silu(x @ gate^T) × (x @ up^T)`` for a
row block and a column block of the expert's intermediate size; kernel 2 multiplies by ``down^T`` and the pair's
routing weight into the pair's own output row; a token's k rows are then summed (in float32). Block-scaled FP8
experts (``dualpath.kernels.fp8``) are dequantized tile by tile as ``dualpath.kernels.triton_fp8`` does; for a batch of prefill size
(``uses_w8a8``) the tokens and the intermediate activations are quantized too, per row and K block, and both kernels
multiply FP8 by FP8 (``dualpath.kernels.triton_fp8.w8a8_linear``'s recipe).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dualpath.kernels.fp8 import Fp8Weight, Weight
from dualpath.kernels.triton_attention import _dot, exact_products
from dualpath.kernels.triton_fp8 import fp8_tile, native_fp8, quantize_activations, uses_w8a8, weight_bytes


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert: ``pair_of_row`` (a pair index ``token × k + slot``, or ``T × k`` for padding) and
    ``expert_of_block`` (-1 for blocks past the used rows). Device work only, of sizes fixed by the shapes."""
    n, dev = ids.numel(), ids.device
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    rows = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    pair_of_row = torch.full((rows,), n, dtype=torch.int32, device=dev)
    pair_of_row[(padded_ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    first_rows = torch.arange(0, rows, block_m, device=dev)
    expert_of_block = torch.searchsorted(padded_ends, first_rows, right=True)  # the run a block starts in
    return pair_of_row, torch.where(expert_of_block < num_experts, expert_of_block, -1).to(torch.int32)


@triton.jit
def _row_block(expert_ptr, pair_ptr, n_pairs, BLOCK_M: tl.constexpr):
    """This program's row block: its expert (-1: past the used rows), rows, pairs and which rows hold one."""
    mb = tl.program_id(0)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    return tl.load(expert_ptr + mb), rows, pair, pair < n_pairs


@triton.jit
def _expert_tile(
    w_e,
    s_e,
    rows,
    kk,
    k0,
    mask,
    stride_wn,
    stride_sn,
    dtype,
    QN: tl.constexpr,
    QK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """The expert's weight rows ``rows`` at columns ``kk``, transposed (``[BLOCK_K, rows]``); block-scaled FP8
    ones (``HAS_SCALE``) dequantized to ``dtype`` (``fp8_tile``: a K tile lies in one scale block)."""
    ptrs = w_e + rows[None, :] * stride_wn + kk[:, None]
    if HAS_SCALE:
        w = fp8_tile(
            ptrs, mask, tl.load(s_e + (rows // QN).to(tl.int64) * stride_sn + k0 // QK)[None, :], dtype, NATIVE
        )
    else:
        w = tl.load(ptrs, mask=mask, other=0.0)
    return w


@triton.jit
def _scaled_dot(
    x,
    xs_ptr,
    xs_rows,
    k0,
    row_ok,
    w_e,
    s_e,
    rows,
    kk,
    mask,
    stride_xs,
    stride_wn,
    stride_sn,
    QN: tl.constexpr,
    QK: tl.constexpr,
):
    """FP8 rows ``x`` times the expert's FP8 weight rows ``rows`` at columns ``kk`` (a K tile in one scale block),
    exact in float32, scaled by each row's and each weight row's block scale (w8a8)."""
    w = tl.load(w_e + rows[None, :] * stride_wn + kk[:, None], mask=mask, other=0.0)
    xs = tl.load(xs_ptr + xs_rows * stride_xs + k0 // QK, mask=row_ok, other=0.0)
    ws = tl.load(s_e + (rows // QN).to(tl.int64) * stride_sn + k0 // QK)
    return tl.dot(x, w, out_dtype=tl.float32) * xs[:, None] * ws[None, :]


@triton.jit
def _moe_up_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    pair_ptr,
    expert_ptr,
    act_ptr,
    n_pairs,
    H,
    I,
    stride_xt,
    stride_xs,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ar,
    K_TOP: tl.constexpr,
    QN: tl.constexpr,
    QK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NATIVE: tl.constexpr,
    W8A8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program: a row block (one expert's pairs) by BLOCK_N intermediate columns: silu(gate) × up, in
    ``act_ptr``'s dtype. ``W8A8``: x is the tokens in e4m3 with their block scales at ``xs_ptr``."""
    e, rows, pair, ok = _row_block(expert_ptr, pair_ptr, n_pairs, BLOCK_M)
    if e < 0:
        return
    nb = tl.program_id(1)
    tok = (pair // K_TOP).to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    gate_rows, up_rows = tl.where(col_ok, cols, 0), tl.where(col_ok, I + cols, 0)  # in range: their scales load
    w_e, s_e = w_ptr + e.to(tl.int64) * stride_we, s_ptr + e.to(tl.int64) * stride_se
    dtype = act_ptr.dtype.element_ty
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < H
        x = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if W8A8:
            gate += _scaled_dot(
                x, xs_ptr, tok, k0, ok, w_e, s_e, gate_rows, kk, w_mask, stride_xs, stride_wn, stride_sn, QN, QK
            )
            up += _scaled_dot(
                x, xs_ptr, tok, k0, ok, w_e, s_e, up_rows, kk, w_mask, stride_xs, stride_wn, stride_sn, QN, QK
            )
        else:
            wg = _expert_tile(
                w_e, s_e, gate_rows, kk, k0, w_mask, stride_wn, stride_sn, dtype, QN, QK, HAS_SCALE, NATIVE
            )
            wu = _expert_tile(w_e, s_e, up_rows, kk, k0, w_mask, stride_wn, stride_sn, dtype, QN, QK, HAS_SCALE, NATIVE)
            gate += _dot(x, wg, IEEE)
            up += _dot(x, wu, IEEE)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        act_ptr + rows[:, None] * stride_ar + cols[None, :],
        act.to(act_ptr.dtype.element_ty),
        mask=ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _moe_down_kernel(
    act_ptr,
    as_ptr,
    w_ptr,
    s_ptr,
    pair_ptr,
    expert_ptr,
    route_ptr,
    out_ptr,
    n_pairs,
    H,
    I,
    stride_ar,
    stride_as,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_or,
    QN: tl.constexpr,
    QK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NATIVE: tl.constexpr,
    W8A8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program: a row block by BLOCK_N hidden columns: (act @ down^T) × the pair's routing weight, into the
    pair's output row. ``W8A8``: act is in e4m3 with its block scales at ``as_ptr``."""
    e, rows, pair, ok = _row_block(expert_ptr, pair_ptr, n_pairs, BLOCK_M)
    if e < 0:
        return
    nb = tl.program_id(1)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w_rows = tl.where(col_ok, cols, 0)
    w_e, s_e = w_ptr + e.to(tl.int64) * stride_we, s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < I
        a = tl.load(act_ptr + rows[:, None] * stride_ar + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if W8A8:
            acc += _scaled_dot(
                a, as_ptr, rows, k0, ok, w_e, s_e, w_rows, kk, w_mask, stride_as, stride_wn, stride_sn, QN, QK
            )
        else:
            wd = _expert_tile(
                w_e,
                s_e,
                w_rows,
                kk,
                k0,
                w_mask,
                stride_wn,
                stride_sn,
                act_ptr.dtype.element_ty,
                QN,
                QK,
                HAS_SCALE,
                NATIVE,
            )
            acc += _dot(a, wd, IEEE)
    acc *= tl.load(route_ptr + pair, mask=ok, other=0.0)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_or + cols[None, :], acc, mask=ok[:, None] & col_ok[None, :])


def _operand(w: Weight, native: bool) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]:
    """(weights as the kernels read them, scales or None, scale block) of stacked experts."""
    if isinstance(w, Fp8Weight):
        return weight_bytes(w, native).contiguous(), w.scale.float().contiguous(), w.block
    return w.contiguous(), None, (1, 1)


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: Weight,
    down: Weight,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    native: bool | None = None,
    w8a8: bool | None = None,
    **launch,
) -> torch.Tensor:
    """``sum_j weights[t, j] × expert_{ids[t, j]}(x[t])`` for x ``[T, H]``, ``weights``/``ids`` ``[T, k]``,
    ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``, each a tensor or block-scaled FP8
    (``dualpath.kernels.fp8``; an FP8 ``gate_up``'s gate/up boundary on a scale block's edge). Returns ``[T, H]`` in x's
    dtype. ``block_m`` None: rows per block by the pairs per expert (16 for decode batches, up to 64); ``native``
    as in ``dualpath.kernels.triton_fp8.w8a16_linear``; ``w8a8`` None: FP8 experts multiply FP8 tokens where
    ``uses_w8a8`` says a batch is of prefill size (``dualpath.kernels.moe.w8a8_reference`` is what that computes)."""
    t, h = x.shape
    k, (e, two_i, _) = ids.shape[1], gate_up.shape
    inter, n = two_i // 2, t * ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    block_m = block_m or min(64, max(16, triton.next_power_of_2(triton.cdiv(n, e))))
    native = native_fp8(x.device) if native is None else native
    (wg, sg, qg), (wd, sd, qd) = _operand(gate_up, native), _operand(down, native)
    if w8a8 is None:
        w8a8 = native and all(isinstance(w, Fp8Weight) and uses_w8a8(x, w) for w in (gate_up, down))
    elif w8a8 and not (native and sg is not None and sd is not None):
        raise ValueError("w8a8 experts need FP8 weights on a GPU with FP8 tensor cores (compute capability 8.9+)")
    for q, s in ((qg, sg), (qd, sd)):
        block_k = math.gcd(block_k, q[1]) if s is not None else block_k  # a K tile within one scale block
    block_k = max(block_k, 32) if w8a8 else block_k  # FP8 tl.dot's least K (the K blocks are multiples of 32)
    pair_of_row, expert_of_block = align(ids, e, block_m)
    rows = pair_of_row.shape[0]
    x = x.contiguous()
    route = weights.reshape(-1).float().contiguous()
    ieee = exact_products(x.dtype)
    xq, xs = quantize_activations(x, qg[1]) if w8a8 else (x, route)
    # w8a8 quantizes every row of act, so the padding rows the kernel never writes are zeros, not stale bytes
    act = (torch.zeros if w8a8 else torch.empty)(rows, inter, dtype=x.dtype, device=x.device)
    _moe_up_kernel[(rows // block_m, triton.cdiv(inter, block_n))](
        xq,
        xs,
        wg,
        route if sg is None else sg,
        pair_of_row,
        expert_of_block,
        act,
        n,
        h,
        inter,
        xq.stride(0),
        xs.stride(0),
        wg.stride(0),
        wg.stride(1),
        0 if sg is None else sg.stride(0),
        0 if sg is None else sg.stride(1),
        act.stride(0),
        K_TOP=k,
        QN=qg[0],
        QK=qg[1],
        HAS_SCALE=sg is not None,
        NATIVE=native,
        W8A8=w8a8,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=ieee,
        **launch,
    )
    aq, as_ = quantize_activations(act, qd[1]) if w8a8 else (act, route)
    out = torch.empty(n, h, dtype=torch.float32, device=x.device)
    _moe_down_kernel[(rows // block_m, triton.cdiv(h, block_n))](
        aq,
        as_,
        wd,
        route if sd is None else sd,
        pair_of_row,
        expert_of_block,
        route,
        out,
        n,
        h,
        inter,
        aq.stride(0),
        as_.stride(0),
        wd.stride(0),
        wd.stride(1),
        0 if sd is None else sd.stride(0),
        0 if sd is None else sd.stride(1),
        out.stride(0),
        QN=qd[0],
        QK=qd[1],
        HAS_SCALE=sd is not None,
        NATIVE=native,
        W8A8=w8a8,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=ieee,
        **launch,
    )
    return out.view(t, k, h).sum(1).to(x.dtype)
