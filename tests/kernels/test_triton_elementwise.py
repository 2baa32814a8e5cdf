"""The fused element-wise kernels (RMSNorm with and without the residual add, rotary embedding of a QKV
projection into queries and the KV row, SwiGLU) against a float64 computation and against the torch reference
they replace. On CPU they run in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``); on a GPU on CUDA.

Tolerances: against float64, max |out - ref| / max |ref| under 1e-5 for float32 and 2e-2 for bfloat16 (the
attention kernels' bound: two roundings, which Triton's interpreter truncates where a GPU rounds to nearest);
against the torch reference, which rounds at the same places, within one bfloat16 step of the largest value per
rounding (the order of RMSNorm's sum and the exponential's last bit may differ too).
"""

import pytest
import torch

pytest.importorskip("triton")

from dualpath.kernels.activation import silu_and_mul  # noqa: E402
from dualpath.kernels.norm import add_rms_norm, rms_norm  # noqa: E402
from dualpath.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq, rope_qkv  # noqa: E402
from dualpath.core.config import RopeConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def same_as_torch(out: torch.Tensor, ref: torch.Tensor) -> bool:
    step = 2.0**-6 if out.dtype == torch.bfloat16 else 1e-6  # two bfloat16 steps: an intermediate and the output
    return out.dtype == ref.dtype and out.shape == ref.shape and rel_err(out, ref) <= step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 64), (7, 48), (3, 1500)])  # a token, a row not a power of two, a wide row
def test_rms_norm_against_float64_and_torch(dtype, t, n):
    x = torch.randn(t, n + 5, dtype=dtype, device=DEVICE)[:, 2 : n + 2]  # a strided view, as a slice of a projection
    res = torch.randn(t, n, dtype=dtype, device=DEVICE)
    w = (torch.rand(n, device=DEVICE) + 0.5).to(dtype)
    out = rms_norm(x, w, 1e-6, "triton")
    x64 = x.double()
    assert rel_err(out, w.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()) < TOL[dtype]
    assert same_as_torch(out, rms_norm(x, w, 1e-6))
    normed, h = add_rms_norm(x, res, w, 1e-6, "triton")
    ref_normed, ref_h = add_rms_norm(x, res, w, 1e-6)
    assert same_as_torch(h, ref_h)
    assert same_as_torch(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
# (query heads, KV heads, head dim, rotary dims): GQA, MHA with a head dim not a power of two, partial rotary
@pytest.mark.parametrize("hq,hk,d,rot", [(4, 2, 16, 16), (3, 3, 24, 24), (8, 1, 32, 16), (20, 2, 16, 16)])
def test_rope_qkv_against_float64_and_torch(dtype, hq, hk, d, rot):
    t = 9
    rope = RopeConfig(theta=10000.0, rotary_dim=rot)
    inv, factor = rope_inv_freq(rope)
    pos = torch.tensor([0, 1, 2, 7, 8, 100, 511, 512, 4000], device=DEVICE)
    cos, sin = rope_cos_sin(inv, pos, factor, dtype)
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype, device=DEVICE)
    q, kv = rope_qkv(qkv, cos, sin, hq, hk, d, "triton")
    assert q.shape == (t, hq, d) and kv.shape == (t, 2 * hk * d)
    q64, kv64 = rope_qkv(qkv.double(), cos.double(), sin.double(), hq, hk, d)  # the rotation of these angles
    assert rel_err(q, q64) < TOL[dtype] and rel_err(kv, kv64) < TOL[dtype]
    assert torch.equal(kv[:, hk * d :], qkv[:, (hq + hk) * d :])  # values copied as they are
    q_ref, kv_ref = rope_qkv(qkv, cos, sin, hq, hk, d)
    assert same_as_torch(q, q_ref) and same_as_torch(kv, kv_ref)
    # the torch form is the model's old composition: views, apply_rope, concatenation
    k = apply_rope(qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), cos, sin)
    assert torch.equal(kv_ref[:, : hk * d], k.reshape(t, -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("h,d,rot", [(3, 8, 8), (20, 24, 16)])  # MLA's rope part; a head with unrotated columns
def test_apply_rope_of_strided_views_into_a_row(dtype, interleaved, h, d, rot):
    """DeepSeek's use: the rope part of each query head (a strided view of the projection) into a new tensor, and
    the shared key's rope part of the KV-A projection straight into its place in the KV row."""
    t = 6
    inv, factor = rope_inv_freq(RopeConfig(theta=10000.0, rotary_dim=rot))
    cos, sin = rope_cos_sin(inv, torch.tensor([0, 1, 9, 64, 65, 3000], device=DEVICE), factor, dtype)
    q = torch.randn(t, h, 16 + d, dtype=dtype, device=DEVICE)[..., 16:]  # [T, H, d] inside [T, H, 16 + d]
    out = apply_rope(q, cos, sin, interleaved, "triton")
    ref = apply_rope(q, cos, sin, interleaved)
    assert rel_err(out, apply_rope(q.double(), cos.double(), sin.double(), interleaved)) < TOL[dtype]
    assert same_as_torch(out, ref)
    ckv = torch.randn(t, 32 + d, dtype=dtype, device=DEVICE)
    row = torch.full((t, 32 + d), float("nan"), dtype=dtype, device=DEVICE)
    apply_rope(ckv[:, 32:].view(t, 1, d), cos, sin, interleaved, "triton", out=row[:, 32:].view(t, 1, d))
    assert same_as_torch(row[:, 32:], apply_rope(ckv[:, 32:].view(t, 1, d), cos, sin, interleaved).view(t, d))
    assert row[:, :32].isnan().all()  # nothing written outside the view
    with pytest.raises(ValueError, match="unit column stride"):
        apply_rope(q, cos, sin, interleaved, "triton", out=torch.empty(t, d, h, dtype=dtype).transpose(1, 2))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rms_norm_into_part_of_a_row(backend):
    x, w = torch.randn(5, 40, device=DEVICE), torch.rand(32, device=DEVICE) + 0.5
    row = torch.full((5, 40), float("nan"), device=DEVICE)
    rms_norm(x[:, :32], w, 1e-6, backend, out=row[:, :32])
    assert same_as_torch(row[:, :32], rms_norm(x[:, :32].contiguous(), w, 1e-6))
    assert row[:, 32:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 40), (5, 1500)])  # one column block, two (the second partial)
def test_silu_and_mul_against_float64_and_torch(dtype, t, i):
    gate_up = torch.randn(t, 2 * i, dtype=dtype, device=DEVICE) * 3
    out = silu_and_mul(gate_up, "triton")
    g, u = gate_up.double().chunk(2, dim=-1)
    assert rel_err(out, torch.nn.functional.silu(g) * u) < TOL[dtype]
    assert same_as_torch(out, silu_and_mul(gate_up))


def test_empty_batches():
    x = torch.randn(0, 16, device=DEVICE)
    assert rms_norm(x, torch.ones(16, device=DEVICE), 1e-6, "triton").shape == (0, 16)
    assert silu_and_mul(torch.randn(0, 32, device=DEVICE), "triton").shape == (0, 16)
    q, kv = rope_qkv(
        torch.randn(0, 64, device=DEVICE),
        torch.randn(0, 8, device=DEVICE),
        torch.randn(0, 8, device=DEVICE),
        2,
        1,
        16,
        "triton",
    )
    assert q.shape == (0, 2, 16) and kv.shape == (0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_in_the_down_projection(dtype):
    """The fused path adds the MLP's output to the residual stream in the GEMM (in place); with a bias, or on the
    torch reference, it is the separate add transformers makes."""
    from dualpath.engines.models.base import add_linear

    res, x = torch.randn(9, 48, dtype=dtype, device=DEVICE), torch.randn(9, 80, dtype=dtype, device=DEVICE)
    w, b = torch.randn(48, 80, dtype=dtype, device=DEVICE) / 9, torch.randn(48, dtype=dtype, device=DEVICE)
    ref = res.double() + x.double() @ w.double().t()
    torch_out = add_linear(res, x, w, None, "torch")
    assert torch.equal(torch_out, res + torch.nn.functional.linear(x, w))
    held = res.clone()
    fused = add_linear(held, x, w, None, "triton")
    assert fused.data_ptr() == held.data_ptr() and rel_err(fused, ref) < TOL[dtype]
    assert same_as_torch(fused, torch_out)
    biased = add_linear(res.clone(), x, w, b, "triton")
    assert torch.equal(biased, res + torch.nn.functional.linear(x, w, b))
