"""Triton kernels for a layer's element-wise work, each one pass over its tensors where eager torch makes several
(RMSNorm: six kernels; rotary embedding of q and k plus the KV row: about twenty on strided views; SwiGLU: two).
CUDA devices use them when the model's kernels are "triton" (``dualpath.kernels.norm``, ``dualpath.kernels.rope``,
``dualpath.kernels.activation`` dispatch); tests run them on CPU under ``TRITON_INTERPRET=1``.

Each computes in float32 and rounds to the tensor dtype exactly where the torch reference does (a bfloat16
product is rounded before it is added), so the two backends agree to the last bit but for the order of a sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rnd(x, DTYPE: tl.constexpr):
    """Round float32 ``x`` to the tensors' dtype and back: where torch's reference rounds an intermediate."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    """One row: ``ADD``: h = x + residual (rounded, written to ``res_out``), else h = x; out = w * (h / rms(h))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        h = _rnd(h + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32), dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, h.to(dtype), mask=ok)
    normed = _rnd(h * tl.rsqrt(tl.sum(h * h, 0) / N + eps), dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(dtype), mask=ok)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of ``x [T, N]`` (of ``x + residual`` when given) into ``out`` (new if None; rows with
    unit column stride, e.g. columns of a larger row). Returns (normed, the summed rows: ``x`` itself without a
    residual)."""
    if x.dim() != 2:
        raise ValueError(f"rms_norm takes rows [T, N], got shape {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x) if out is None else out
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(
            f"rms_norm: out must be shaped as x {tuple(x.shape)} with unit column stride, got "
            f"{tuple(out.shape)} strided {out.stride()}"
        )
    res_out = x if residual is None else torch.empty_like(x)
    res = x if residual is None else residual.contiguous()
    if x.shape[0]:
        n = x.shape[-1]
        _rms_norm_kernel[(x.shape[0],)](
            x,
            res,
            weight,
            out,
            res_out,
            eps,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            res_out.stride(0),
            N=n,
            BLOCK=triton.next_power_of_2(n),
            ADD=residual is not None,
            num_warps=4 if n <= 4096 else 8,
        )
    return out, res_out


@triton.jit
def _rotate(src, cols, ok, rotates, cos_row, sin_row, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, dtype):
    """Head rows at ``src [H, 1]``: the first ``2 * HALF`` columns rotated (``rotates``), the rest copied. Output
    column j < HALF is a cos - b sin, column HALF + i is a cos + b sin, with (a, b) = (x[j], x[j + HALF]) and
    (x[HALF + i], x[i]) not interleaved (Llama), (x[2j], x[2j + 1]) and (x[2i + 1], x[2i]) interleaved (DeepSeek's
    pairs, written de-interleaved as Hugging Face's DeepSeek-V3 does)."""
    first = cols < HALF
    freq = cols % HALF
    angle_ok = cols < 2 * HALF
    if INTERLEAVED:
        a_col = tl.where(angle_ok, 2 * freq + (cols >= HALF).to(tl.int32), cols)
        b_col = 2 * freq + first.to(tl.int32)
    else:
        a_col = cols
        b_col = tl.where(first, cols + HALF, cols - HALF)
    x = tl.load(src + a_col[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + b_col[None, :], mask=ok & rotates, other=0.0).to(tl.float32)
    cos = tl.load(cos_row + freq, mask=angle_ok, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(sin_row + freq, mask=angle_ok, other=0.0).to(tl.float32)[None, :]
    a, b = _rnd(x * cos, dtype), _rnd(xp * sin, dtype)
    return tl.where(rotates, tl.where(first[None, :], a - b, a + b), x).to(dtype)


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    kv_ptr,
    stride_t,
    stride_ct,
    stride_qt,
    stride_kvt,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One token, ``BLOCK_H`` of its heads in ``qkv``'s order (query, key, value heads of ``D`` columns): query and
    key heads rotate (not interleaved), values are copied. Query heads go to ``q [T, HQ, D]``, key and value heads
    to the KV row ``[k | v]``."""
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, D_PAD)
    ok = (heads < HQ + 2 * HK)[:, None] & (cols < D)[None, :]
    rotates = (heads < HQ + HK)[:, None] & (cols < 2 * HALF)[None, :]
    y = _rotate(
        qkv_ptr + t * stride_t + heads[:, None] * D,
        cols,
        ok,
        rotates,
        cos_ptr + t * stride_ct,
        sin_ptr + t * stride_ct,
        HALF,
        False,
        q_ptr.dtype.element_ty,
    )
    is_q = heads < HQ
    tl.store(q_ptr + t * stride_qt + heads[:, None] * D + cols[None, :], y, mask=ok & is_q[:, None])
    tl.store(kv_ptr + t * stride_kvt + (heads - HQ)[:, None] * D + cols[None, :], y, mask=ok & ~is_q[:, None])


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    H: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """One token, ``BLOCK_H`` of its ``H`` heads of ``x [T, H, D]`` rotated into ``out`` (both strided views)."""
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, D_PAD)
    ok = (heads < H)[:, None] & (cols < D)[None, :]
    y = _rotate(
        x_ptr + t * stride_xt + heads[:, None] * stride_xh,
        cols,
        ok,
        ok & (cols < 2 * HALF)[None, :],
        cos_ptr + t * stride_ct,
        sin_ptr + t * stride_ct,
        HALF,
        INTERLEAVED,
        out_ptr.dtype.element_ty,
    )
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :], y, mask=ok)


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qkv [T, (Hq + 2 Hk) * D]`` -> (rotated queries ``[T, Hq, D]``, the KV row ``[T, 2 Hk D]``: rotated keys
    then values). Rotary embedding as Llama's (``dualpath.kernels.rope.apply_rope``, not interleaved) over the first
    ``2 * cos.shape[-1]`` columns of each head."""
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads, head_dim)
    kv = qkv.new_empty(t, 2 * num_kv_heads * head_dim)
    if t:
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        heads = num_heads + 2 * num_kv_heads
        block_h = min(16, triton.next_power_of_2(heads))
        _rope_qkv_kernel[(t, triton.cdiv(heads, block_h))](
            qkv,
            cos,
            sin,
            q,
            kv,
            qkv.stride(0),
            cos.stride(0),
            q.stride(0),
            kv.stride(0),
            HQ=num_heads,
            HK=num_kv_heads,
            D=head_dim,
            HALF=cos.shape[-1],
            D_PAD=triton.next_power_of_2(head_dim),
            BLOCK_H=block_h,
        )
    return q, kv


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``dualpath.kernels.rope.apply_rope`` in one pass: heads of ``x [T, H, D]`` (any strides but unit columns) rotated into
    ``out`` (same shape; new if None), which may be a view into a larger row (MLA's KV row)."""
    t, h, d = x.shape
    out = x.new_empty(t, h, d) if out is None else out
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(
            f"apply_rope: out must be shaped as x {tuple(x.shape)} with unit column stride, got "
            f"{tuple(out.shape)} strided {out.stride()}"
        )
    if t:
        x = x if x.stride(-1) == 1 else x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        block_h = min(16, triton.next_power_of_2(h))
        _rope_kernel[(t, triton.cdiv(h, block_h))](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            out.stride(0),
            out.stride(1),
            H=h,
            D=d,
            HALF=cos.shape[-1],
            D_PAD=triton.next_power_of_2(d),
            BLOCK_H=block_h,
            INTERLEAVED=interleaved,
        )
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t, j] = silu(x[t, j]) * x[t, N + j]``, silu rounded to the dtype before the product (as torch)."""
    t, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (_rnd(g / (1.0 + tl.exp(-g)), dtype) * u).to(dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate columns, then up) -> ``silu(gate) * up`` ``[T, I]``."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    t, n = gate_up.shape[0], gate_up.shape[-1] // 2
    out = gate_up.new_empty(t, n)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block)
    return out
