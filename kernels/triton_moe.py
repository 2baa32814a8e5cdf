"""Fused MoE for CUDA: a batch's routed experts in two Triton kernels, without the host learning which experts
were chosen, so a DeepSeek-V3 decode step can be captured as a CUDA graph. ``kernels.moe.routed_experts``
dispatches here for the triton backend; tests run it on CPU under ``TRITON_INTERPRET=1`` against float64.

The (token, expert) pairs are sorted by expert on the device and each expert's run padded to whole blocks of
``block_m`` rows, within a bound known from shapes alone (``T × k + E × (block_m - 1)`` rows), so every row block
belongs to one expert (or none, past the used rows). Kernel 1 computes ``silu(x @ gate^T) × (x @ up^T)`` for a
row block and a column block of the expert's intermediate size; kernel 2 multiplies by ``down^T`` and the pair's
routing weight into the pair's own output row; a token's k rows are then summed (in float32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention import _dot, exact_products


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
def _moe_up_kernel(x_ptr, w_ptr, pair_ptr, expert_ptr, act_ptr, n_pairs, H, I, stride_xt, stride_we, stride_wn,
                   stride_ar, K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """One program: a row block (one expert's pairs) by BLOCK_N intermediate columns: silu(gate) × up."""
    e, rows, pair, ok = _row_block(expert_ptr, pair_ptr, n_pairs, BLOCK_M)
    if e < 0:
        return
    nb = tl.program_id(1)
    tok = (pair // K_TOP).to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    w_e = w_ptr + e.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < H
        x = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_e + cols[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_e + (I + cols)[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        gate += _dot(x, wg, IEEE)
        up += _dot(x, wu, IEEE)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + rows[:, None] * stride_ar + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, pair_ptr, expert_ptr, route_ptr, out_ptr, n_pairs, H, I, stride_ar,
                     stride_we, stride_wn, stride_or, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """One program: a row block by BLOCK_N hidden columns: (act @ down^T) × the pair's routing weight, into the
    pair's output row."""
    e, rows, pair, ok = _row_block(expert_ptr, pair_ptr, n_pairs, BLOCK_M)
    if e < 0:
        return
    nb = tl.program_id(1)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w_e = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < I
        a = tl.load(act_ptr + rows[:, None] * stride_ar + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        wd = tl.load(w_e + cols[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, wd, IEEE)
    acc *= tl.load(route_ptr + pair, mask=ok, other=0.0)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_or + cols[None, :], acc, mask=ok[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, block_m: int | None = None, block_n: int = 64, block_k: int = 64,
              **launch) -> torch.Tensor:
    """``sum_j weights[t, j] × expert_{ids[t, j]}(x[t])`` for x ``[T, H]``, ``weights``/``ids`` ``[T, k]``,
    ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``. Returns ``[T, H]`` in x's dtype.
    ``block_m`` None: rows per block by the pairs per expert (16 for decode batches, up to 64)."""
    t, h = x.shape
    k, (e, two_i, _) = ids.shape[1], gate_up.shape
    inter, n = two_i // 2, t * ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    block_m = block_m or min(64, max(16, triton.next_power_of_2(triton.cdiv(n, e))))
    pair_of_row, expert_of_block = align(ids, e, block_m)
    rows = pair_of_row.shape[0]
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    route = weights.reshape(-1).float().contiguous()
    ieee = exact_products(x.dtype)
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _moe_up_kernel[(rows // block_m, triton.cdiv(inter, block_n))](
        x, gate_up, pair_of_row, expert_of_block, act, n, h, inter, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), act.stride(0), K_TOP=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
        **launch)
    out = torch.empty(n, h, dtype=torch.float32, device=x.device)
    _moe_down_kernel[(rows // block_m, triton.cdiv(h, block_n))](
        act, down, pair_of_row, expert_of_block, route, out, n, h, inter, act.stride(0), down.stride(0),
        down.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, **launch)
    return out.view(t, k, h).sum(1).to(x.dtype)
