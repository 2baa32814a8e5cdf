"""The w8a16 GEMM for block-scaled FP8 weights (``dualpath.kernels.fp8``) on CUDA: ``x @ W^T`` with W read as e4m3 bytes
and dequantized tile by tile in registers, so a weight-bound decode step reads half of bfloat16's bytes. Tests run
it on CPU under ``TRITON_INTERPRET=1`` against float64.

A K tile never straddles two scale blocks (``BLOCK_K`` divides the scale block's ``bk``), so each tile needs one
scale per output column, and it scales the tile's float32 product (``BLOCK_M x BLOCK_N``), not its weights
(``BLOCK_K x BLOCK_N``): e4m3 values are exact in bfloat16, so the tile's products are x times the stored values,
and the scale's one rounding is float32's. (The torch reference rounds each dequantized weight to x's dtype; the
kernel is the closer to float64.) GPUs before compute capability 8.9 have no e4m3 conversion: there the bytes are
widened by bit arithmetic (``fp8_tile``). A grid of few programs (decode: few rows, so few row blocks) splits K
across programs, whose float32 partial sums are added once at the end.

Decode batches (``uses_swap_ab``: up to 64 rows) take the swap-AB kernel, as DeepGEMM's and TensorRT-LLM's small-M
GEMMs do: it computes ``W x^T``, so the weights' N fills the MMA's M side (64 rows, a Hopper warpgroup's) and the
batch sits in its N side (16 to 64); the weights are the left operand, widened in registers from their load (on
sm_90, Triton's warpgroup MMA takes it from registers, so they never go back through shared memory). K is split for
about four programs per multiprocessor, and the last split of a tile to arrive adds the others' float32 sums and
runs the epilogue, so the GEMM is one launch (the w8a16 kernel's splits are added by torch: three more launches).

Batches of prefill size (``uses_w8a8``) take the w8a8 GEMM instead, DeepSeek's recipe for FP8 tensor cores: each
row of x quantized to e4m3 per K block (``_act_quant_kernel``, one float32 scale per row and block), then every K
tile's FP8 x FP8 product, exact in float32, scaled by the row's and the column's block scales and summed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import torch
import triton
import triton.language as tl

from dualpath.kernels.kv_move import FP8, FP8_MAX

if TYPE_CHECKING:  # (types only: the torch reference dispatches to this module at run time)
    from dualpath.kernels.fp8 import Fp8Weight
from dualpath.kernels.triton_attention import _dot, _multiprocessors, exact_products


@triton.jit
def fp8_tile(w_ptrs, mask, scale, dtype, NATIVE: tl.constexpr):
    """The e4m3 weights at ``w_ptrs`` times ``scale`` (broadcast over the tile) in float32, rounded once to
    ``dtype``. Not ``NATIVE``: ``w_ptrs`` are bytes, moved into a float16's bits (sign, then exponent and mantissa
    shifted to its top), which reads 2^-8 of the e4m3 value for normals and subnormals alike (float16's exponent
    bias is 8 more), so the scale takes the 2^8 back: exact, as the conversion is."""
    if NATIVE:
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32) * scale
    else:
        b = tl.load(w_ptrs, mask=mask, other=0).to(tl.uint16)
        w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * (scale * 256.0)
    return w.to(dtype)


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    QN: tl.constexpr,
    QK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_OUT: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program: BLOCK_M rows by BLOCK_N output columns over K_SPLIT of K (split ``program_id(2)``).
    ``PARTIAL``: store the float32 sum at ``out + split × stride_os`` for the caller to add; otherwise the epilogue:
    bias, ``ADD_OUT`` (out += the product: the residual), one rounding."""
    rows, cols, row_ok, col_ok, rows64, cols64, s_row, k_start, k_end = _program_tile(
        tl.program_id(0), tl.program_id(1), M, N, K, K_SPLIT, s_ptr, stride_sn, QN, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_end
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        s = tl.load(s_row + k0 // QK, mask=col_ok, other=0.0)
        w = fp8_tile(
            w_ptr + cols64[None, :] * stride_wn + kk[:, None],
            k_ok[:, None] & col_ok[None, :],
            1.0,
            x_ptr.dtype.element_ty,
            NATIVE,
        )
        acc += _dot(x, w, IEEE) * s[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + tl.program_id(2) * stride_os + rows64[:, None] * stride_om + cols[None, :], acc, mask=mask)
        return
    _epilogue(acc, rows64, cols, col_ok, mask, b_ptr, out_ptr, stride_om, HAS_BIAS, ADD_OUT)


@triton.jit
def _program_tile(row_block, col_block, M, N, K, K_SPLIT, s_ptr, stride_sn, QN: tl.constexpr, BLOCK_M, BLOCK_N):
    """A w8a16 program's output rows and columns (which exist, and as int64 for addresses), its columns' row of
    block scales, and its split's part of K, ``[k_start, k_end)`` (split ``program_id(2)``)."""
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    s_row = s_ptr + (cols // QN).to(tl.int64) * stride_sn
    k_start = tl.program_id(2) * K_SPLIT
    return (
        rows,
        cols,
        rows < M,
        cols < N,
        rows.to(tl.int64),
        cols.to(tl.int64),
        s_row,
        k_start,
        tl.minimum(K, k_start + K_SPLIT),
    )


@triton.jit
def _epilogue(
    acc, rows64, cols, col_ok, mask, b_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr
):
    """The float32 product plus bias and, ``ADD_OUT``, what out holds (the residual), rounded once into out."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows64[:, None] * stride_om + cols[None, :]
    if ADD_OUT:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def native_fp8(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 itself (compute capability 8.9 and up); the interpreter does."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def weight_bytes(w: Fp8Weight, native: bool | None = None) -> torch.Tensor:
    """What the kernels read ``w.q`` as: e4m3, or its bytes where the GPU has no e4m3 conversion."""
    native = native_fp8(w.q.device) if native is None else native
    return w.q if native else w.q.view(torch.uint8)


def _num_splits(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """Splits of K that give the GPU about two programs per multiprocessor when the output tiles alone do not (a
    decode step's few rows), each split at least 8 K tiles; 1 off CUDA and for big grids."""
    if device.type != "cuda":
        return 1
    want = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(want // programs, k // (8 * block_k)))


def check_k_tile(block_k: int, bk: int, least: int) -> None:
    """A K tile lies in one scale block (it divides the block's ``bk``), at least ``least`` wide (a dot's K)."""
    if bk % block_k or block_k < least:
        raise ValueError(f"the K tile ({block_k}) must divide the scale block {bk} and be at least {least}")


def _weight_operands(w: Fp8Weight, dev: torch.device, native: bool | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Whether the kernel converts e4m3 natively (None: by the device), and the weight and scales as it reads them."""
    native = native_fp8(dev) if native is None else native
    return native, weight_bytes(w, native).contiguous(), w.scale.float().contiguous()


def k_pieces(k: int, splits: int, block_k: int) -> tuple[int, int]:
    """K cut into about ``splits`` pieces of whole K tiles: (keys of K per piece, pieces). Fewer pieces where
    the tiles do not go round, so that every piece holds some of K (the swap-AB kernel's last split to arrive
    must be one of them)."""
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


def _rows_and_out(x: torch.Tensor, n: int, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as contiguous rows ``[M, K]``, and where their product goes: a new ``[M, n]`` tensor, or the residual's
    rows, which the kernels write over."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if residual is None:
        return x2, torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    out = residual.view(-1, n)
    if out.stride(1) != 1:
        raise ValueError("the FP8 GEMMs write over residual: its rows must be contiguous")
    return x2, out


def w8a16_linear(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    native: bool | None = None,
    **launch,
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` in x's dtype for ``W [N, K]`` block-scaled FP8; with ``residual`` (x's shape but
    N wide, contiguous rows) the sum is written over it and returned. Tiles by default (from an H200's sweep,
    ``bench/gpu/fp8_tiles.py``): 16 rows for decode-sized batches (up to 64); up to 16 rows, 64 columns by 128 of K
    (a weight row's 128 bytes a load) in 4 stages; above, 128 x 128 where N and K are both 4,096 or more, else
    64 x 64 (smaller matrices need the smaller tiles' programs to fill the GPU), in 3 stages; K tiles fewer where
    bk is not a multiple. ``num_splits`` None: by the grid's size (``_num_splits``); ``native`` None: by the
    device (``native_fp8``)."""
    lead, k, n, block = x.shape[:-1], x.shape[-1], w.q.shape[0], w.block
    x2, out = _rows_and_out(x, n, residual)
    m = x2.shape[0]
    if m == 0:
        return out.view(*lead, n)
    block_m = block_m or min(64, max(16, triton.next_power_of_2(m)))
    big = m > 16 and min(n, k) >= 4096
    block_n = block_n or (128 if big else 64)
    block_k = block_k or math.gcd(128 if m <= 16 or big else 64, block[1])
    launch.setdefault("num_stages", 4 if m <= 16 else 3)
    check_k_tile(block_k, block[1], 16)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    k_split, splits = k_pieces(k, num_splits or _num_splits(grid[0] * grid[1], k, block_k, x.device), block_k)
    native, q, scale = _weight_operands(w, x.device, native)
    dest = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _w8a16_kernel[(*grid, splits)](
        x2,
        q,
        scale,
        bias if bias is not None else scale,
        dest,
        m,
        n,
        k,
        k_split,
        x2.stride(0),
        q.stride(0),
        scale.stride(0),
        dest.stride(-2),
        dest.stride(0),
        QN=block[0],
        QK=block[1],
        HAS_BIAS=bias is not None,
        ADD_OUT=residual is not None,
        PARTIAL=splits > 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NATIVE=native,
        IEEE=exact_products(x.dtype),
        **launch,
    )
    if splits > 1:  # the epilogue of the split sums: bias and residual added in float32, one rounding
        acc = dest.sum(0)
        if bias is not None:
            acc += bias.float()
        if residual is not None:
            acc += out.float()
        out.copy_(acc)
    return out.view(*lead, n)


SWAP_MAX_ROWS = 64  # rows up to which a batch fits the swap-AB kernel's N side (one tile of 16, 32 or 64)


def uses_swap_ab(x: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` takes the decode GEMM (``w8a16_swap_linear``): at most ``SWAP_MAX_ROWS`` rows."""
    return 0 < x.numel() <= SWAP_MAX_ROWS * x.shape[-1]


@triton.jit
def _w8a16_swap_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    K_SPLIT,
    SPLITS,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_ps,
    QN: tl.constexpr,
    QK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Swap-AB: one program computes ``W x^T`` for BLOCK_N weight rows (output columns, the MMA's M side: 64 fill
    a Hopper warpgroup's MMA) by BLOCK_M batch rows (its N side: 16 to 64) over K_SPLIT of K (split
    ``program_id(2)``). The weights are the left operand, widened in registers straight from their load; each K
    tile's float32 product is scaled by its rows' block scales. With ``SPLITS`` > 1 every split stores its sum
    to ``part`` and counts itself in at ``count``; the last to arrive adds the splits in split order
    (deterministic whatever the arrival order), resets the counter to 0 for the next launch and runs the
    epilogue, so the GEMM is one launch."""
    rows, cols, row_ok, col_ok, rows64, cols64, s_row, k_start, k_end = _program_tile(
        tl.program_id(1), tl.program_id(0), M, N, K, K_SPLIT, s_ptr, stride_sn, QN, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K  # (a split is whole K tiles: only K cuts a tile)
        w_ptrs = w_ptr + cols64[:, None] * stride_wn + kk[None, :]
        w = _widened(w_ptrs, col_ok[:, None] & k_ok[None, :], x_ptr, NATIVE, DIRECT)
        xt = tl.load(x_ptr + rows64[None, :] * stride_xm + kk[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        s = tl.load(s_row + k0 // QK, mask=col_ok, other=0.0)
        acc += _dot(w, xt, IEEE) * s[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLITS > 1:
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        acc, last = _split_sum(acc, part_ptr, count_ptr + tile, cols64, rows, col_ok, row_ok, M, SPLITS, stride_ps)
        if last:
            _epilogue(tl.trans(acc), rows64, cols, col_ok, mask, b_ptr, out_ptr, stride_om, HAS_BIAS, ADD_OUT)
    else:
        _epilogue(tl.trans(acc), rows64, cols, col_ok, mask, b_ptr, out_ptr, stride_om, HAS_BIAS, ADD_OUT)


@triton.jit
def _widened(w_ptrs, mask, x_ptr, NATIVE: tl.constexpr, DIRECT: tl.constexpr):
    """The e4m3 weights at ``w_ptrs`` in x's dtype, exact. ``DIRECT`` (native only): Triton's conversion straight
    to x's dtype, the fewest instructions (sm_90: e4m3x2 -> f16x2 per pair, then one f16 -> bf16 per element), but
    that last is a scalar conversion (F2F), of a quarter-rate pipe; otherwise ``fp8_tile``'s way through float32
    (per pair: e4m3x2 -> f16x2, two f16 -> f32 adds, one f32x2 -> bf16x2 pack, all on full-rate pipes), the w8a16
    kernel's. The H200 sweep (``bench/gpu/fp8_decode.py``) times both."""
    if NATIVE and DIRECT:
        return tl.load(w_ptrs, mask=mask, other=0.0).to(x_ptr.dtype.element_ty)
    else:
        return fp8_tile(w_ptrs, mask, 1.0, x_ptr.dtype.element_ty, NATIVE)


@triton.jit
def _split_sum(acc, part_ptr, counter, cols64, rows, col_ok, row_ok, M, SPLITS, stride_ps):
    """Serial split-K: store this split's ``acc [BLOCK_N, BLOCK_M]`` at ``part [split, col, row]``, count it in,
    and, for the last split of the tile, return the sum of every split's (in split order) and True. The barrier
    orders every thread's stores before the counter's release (CUTLASS's semaphore: a CTA barrier, then one
    release at GPU scope); the counter's acquire, then ``.cg`` loads (L2, never a stale L1 line) order the reads
    after every other split's stores. Nothing waits on another program, so no schedule can deadlock."""
    offs = cols64[:, None] * M + rows[None, :]
    mask = col_ok[:, None] & row_ok[None, :]
    tl.store(part_ptr + tl.program_id(2) * stride_ps + offs, acc, mask=mask)
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    if last:
        acc = tl.zeros_like(acc)
        for sp in range(0, SPLITS):
            acc += tl.load(part_ptr + sp * stride_ps + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return acc, last


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(dev: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``tiles`` output tiles of the swap-AB kernel, one buffer per device
    (grown, never freed: a CUDA graph may hold an old one). Every launch leaves them at zero, so launches that
    share them must be ordered on one stream, as an engine's compute is."""
    held = _COUNTERS.setdefault(dev, [])
    if not held or held[-1].numel() < tiles:
        held.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=dev))
    return held[-1]


def swap_splits(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Splits of K for about four programs per multiprocessor (each streams its weights in a few pipeline stages;
    four keep enough bytes in flight for a decode GEMM to read at copy bandwidth), each at least 4 K tiles."""
    want = 4 * _multiprocessors(device)
    return max(1, min(triton.cdiv(want, tiles), k // (4 * block_k)))


def w8a16_swap_linear(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    num_splits: int | None = None,
    native: bool | None = None,
    direct: bool = False,
    **launch,
) -> torch.Tensor:
    """``w8a16_linear``'s product for decode batches (up to ``SWAP_MAX_ROWS`` rows) by ``_w8a16_swap_kernel``:
    ``block_n`` weight rows a program (64 by default: one Hopper warpgroup MMA's M), the batch padded to 16, 32 or
    64 rows, K tiles of 128 (the scale block's size if smaller) in 4 stages, K split for about four programs per
    multiprocessor (``swap_splits``; ``num_splits`` overrides) and reduced in the same launch. ``direct``: widen
    e4m3 by Triton's direct conversion (``_widened``)."""
    lead, k, n, block = x.shape[:-1], x.shape[-1], w.q.shape[0], w.block
    x2, out = _rows_and_out(x, n, residual)
    m = x2.shape[0]
    if m == 0:
        return out.view(*lead, n)
    if m > SWAP_MAX_ROWS:
        raise ValueError(f"the swap-AB GEMM takes at most {SWAP_MAX_ROWS} rows, not {m}")
    block_k = block_k or math.gcd(128, block[1])
    check_k_tile(block_k, block[1], 16)
    block_m = max(16, triton.next_power_of_2(m))
    launch.setdefault("num_stages", 4)
    grid = (triton.cdiv(n, block_n), 1)
    k_split, splits = k_pieces(k, num_splits or swap_splits(grid[0], k, block_k, x.device), block_k)
    native, q, scale = _weight_operands(w, x.device, native)
    part = torch.empty(splits, n, m, dtype=torch.float32, device=x.device) if splits > 1 else out
    _w8a16_swap_kernel[(*grid, splits)](
        x2,
        q,
        scale,
        bias if bias is not None else scale,
        out,
        part,
        split_counters(x.device, grid[0] * grid[1]),
        m,
        n,
        k,
        k_split,
        splits,
        x2.stride(0),
        q.stride(0),
        scale.stride(0),
        out.stride(0),
        n * m,
        QN=block[0],
        QK=block[1],
        HAS_BIAS=bias is not None,
        ADD_OUT=residual is not None,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        NATIVE=native,
        DIRECT=direct,
        IEEE=exact_products(x.dtype),
        **launch,
    )
    return out.view(*lead, n)


W8A8_MIN_ROWS = 128  # rows from which a GEMM is compute-bound enough for FP8 tensor cores to pay (to be swept)
E4M3_MAX = tl.constexpr(FP8_MAX)  # what a kernel may read of the module: constants


def uses_w8a8(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether ``fp8_linear`` multiplies FP8 by FP8: a batch of at least ``W8A8_MIN_ROWS`` rows on a GPU with FP8
    tensor cores (compute capability 8.9 and up; the interpreter too), K blocks a multiple of 32 (FP8 ``tl.dot``'s
    least K)."""
    return x.numel() >= W8A8_MIN_ROWS * x.shape[-1] and native_fp8(x.device) and w.block[1] % 32 == 0


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    NG,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """Program (row, GROUPS groups of GROUP columns): each group's largest magnitude onto 448, as
    ``dualpath.kernels.fp8.quantize_blocks`` (scale 1 for an all-zero group; one correctly rounded division per element)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = tl.arange(0, BLOCK)
    cols = g[:, None] * GROUP + c[None, :]
    ok = (c[None, :] < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, E4M3_MAX), 1.0)
    q = round_e4m3(tl.clamp(tl.math.div_rn(x, scale[:, None]), -E4M3_MAX, E4M3_MAX))
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g, scale, mask=g < NG)


@triton.jit
def round_e4m3(v):
    """Float32 ``v`` (within +-448) rounded to the nearest e4m3 value, ties to even, still float32, so that the
    conversion after it is exact: normals keep 3 mantissa bits (the carry of a round-up moves into the exponent),
    subnormals (below 2^-6) are multiples of 2^-9 (the magnitude added to 1.5 x 2^14, whose float32 step is 2^-9,
    then v's sign, -0 included). The GPU's conversion rounds so too; Triton's interpreter loses the carry, so tests
    would not see the GPU's values."""
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    subnormal = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -0x80000000)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal).to(tl.float32, bitcast=True)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dualpath.kernels.fp8.quantize_activations`` on the GPU: rows ``x [M, K]`` as e4m3 and per-group float32 scales."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, triton.cdiv(k, group), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(group)
    groups = max(1, min(triton.next_power_of_2(scale.shape[1]), 1024 // block))  # ~1024 elements a program
    if m:
        _act_quant_kernel[(m, triton.cdiv(scale.shape[1], groups))](
            x,
            q,
            scale,
            k,
            scale.shape[1],
            x.stride(0),
            q.stride(0),
            scale.stride(0),
            GROUP=group,
            BLOCK=block,
            GROUPS=groups,
        )
    return q, scale


@triton.jit
def _w8a8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_om,
    QN: tl.constexpr,
    QK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program: BLOCK_M rows by BLOCK_N output columns over all of K. A K tile lies in one scale block
    (``BLOCK_K`` divides ``QK``): its product is scaled by one scale per row and one per column. Epilogue as the
    w8a16 kernel's: bias, ``ADD_OUT`` (the residual), one rounding."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    ws_row = ws_ptr + (cols // QN).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols64[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        xs = tl.load(xs_ptr + rows64 * stride_xsm + k0 // QK, mask=row_ok, other=0.0)
        ws = tl.load(ws_row + k0 // QK, mask=col_ok, other=0.0)
        acc += tl.dot(x, w, out_dtype=tl.float32) * xs[:, None] * ws[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    _epilogue(acc, rows64, cols, col_ok, mask, b_ptr, out_ptr, stride_om, HAS_BIAS, ADD_OUT)


def w8a8_linear(
    x: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int | None = None,
    **launch,
) -> torch.Tensor:
    """``w8a16_linear``'s product with x quantized too (``dualpath.kernels.fp8.w8a8_reference`` is what it computes): FP8
    tensor cores for prefill-sized batches. Tiles by default 64 rows, 128 columns, K tiles of the scale block up
    to 128."""
    lead, k, n, block = x.shape[:-1], x.shape[-1], w.q.shape[0], w.block
    block_k = block_k or math.gcd(128, block[1])
    check_k_tile(block_k, block[1], 32)
    x2, out = _rows_and_out(x, n, residual)
    m = x2.shape[0]
    if m == 0:
        return out.view(*lead, n)
    xq, xs = quantize_activations(x2, block[1])
    q, scale = w.q.contiguous(), w.scale.float().contiguous()
    _w8a8_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        xq,
        xs,
        q,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        xq.stride(0),
        xs.stride(0),
        q.stride(0),
        scale.stride(0),
        out.stride(0),
        QN=block[0],
        QK=block[1],
        HAS_BIAS=bias is not None,
        ADD_OUT=residual is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **launch,
    )
    return out.view(*lead, n)
