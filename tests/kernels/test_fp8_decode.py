"""FP8 at decode: the swap-AB w8a16 GEMM (``w8a16_swap_linear``, decode batches of up to 64 rows) and decode
attention over an e4m3 KV cache, against float64. On CPU in Triton's interpreter (conftest), tiny shapes.

Tolerances as the other kernel tests: max |out - ref| / max |ref| under 1e-3 for float32 activations, 2e-2 for
bfloat16. The GEMM's reference is the exact product over the stored weights (their e4m3 values times the block
scales, in float64); attention's is float64 attention over the e4m3 values the cache holds.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from dualpath.kernels import triton_attention as ta  # noqa: E402
from dualpath.kernels import triton_fp8  # noqa: E402
from dualpath.kernels.attention import PagedKV, gqa_split, mla_split, varlen_attention  # noqa: E402
from dualpath.kernels.fp8 import Fp8Weight, fp8_linear, quantize_blocks  # noqa: E402
from dualpath.kernels.kv_move import as_cached  # noqa: E402
from grid import covering  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
F8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "the kernel left outputs unwritten"
    return float((out.double() - ref).abs().max() / ref.abs().max())


def fp8_weight(n: int, k: int, block: tuple[int, int]) -> Fp8Weight:
    """Rows of magnitudes spread over two decades, so block scales differ."""
    q, scale = quantize_blocks(torch.randn(n, k) * torch.logspace(-1, 1, n)[:, None], block)
    return Fp8Weight(q.to(DEVICE), scale.to(DEVICE), block)


def exact(x, w, bias=None, residual=None) -> torch.Tensor:
    out = x.double() @ w.dequantize(torch.float64).t()
    out += 0 if bias is None else bias.double()
    return out + (0 if residual is None else residual.double())


# (n, k, block, block_n, splits): N and K off the tiles (72 x 100 in blocks of 32: partial blocks both ways, a last
# K tile of 4), 3 splits of 32 + 32 + 36 -> tiles of 32: pieces 64 + 36 (2 splits), a split count that does not
# divide K; per-channel-like blocks (one block row per 16 rows, K blocks of 64) with 5 splits; DeepSeek's 128 blocks
# over 136 x 200 with the default split choice
SHAPES = [
    (72, 100, (32, 32), 32, 3),
    (80, 192, (16, 64), 64, 5),
    (136, 200, (128, 128), 64, None),
]


@pytest.mark.parametrize(
    *covering(
        "dtype,m,shape,native,epilogue",
        [[torch.float32, torch.bfloat16], [1, 16, 64, 7], SHAPES, [True, False], ["none", "bias", "residual", "both"]],
    )
)
def test_swap_ab_gemm_against_float64(dtype, m, shape, native, epilogue):
    """x @ W^T at decode rows (1, 16, 64 and an odd 7: batch tiles of 16 and 64, rows masked), the GPU's e4m3
    conversion and the byte-widening one, bias and a residual written over, K split so that splits end off the
    tiles; the outputs start as NaN."""
    n, k, block, block_n, splits = shape
    w = fp8_weight(n, k, block)
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE) if epilogue in ("bias", "both") else None
    residual = torch.randn(m, n, dtype=dtype, device=DEVICE) if epilogue in ("residual", "both") else None
    ref = exact(x, w, bias, residual)
    into = None if residual is None else residual.clone()
    out = triton_fp8.w8a16_swap_linear(x, w, bias, into, block_n=block_n, num_splits=splits, native=native)
    assert out.dtype == dtype and out.shape == (m, n) and rel_err(out, ref) < TOL[dtype]
    if into is not None:
        assert out.data_ptr() == into.data_ptr()  # written over the residual, as add_linear expects


def test_split_counters_are_left_at_zero_for_the_next_launch():
    """Every split counts itself in; the last resets its tile's counter, so a second launch (a CUDA graph's
    replay) reduces again; the same answer bit for bit (the splits are added in split order)."""
    w = fp8_weight(96, 256, (32, 32))
    x = torch.randn(3, 256, device=DEVICE)
    first = triton_fp8.w8a16_swap_linear(x, w, block_n=32, block_k=32, num_splits=4)
    assert not triton_fp8.split_counters(x.device, 3).any()
    again = triton_fp8.w8a16_swap_linear(x, w, block_n=32, block_k=32, num_splits=4)
    assert torch.equal(first, again) and rel_err(first, exact(x, w)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_widenings_give_the_same_products(dtype):
    """e4m3 widened straight to x's dtype (``direct``) or through float32: both exact, so the same output bit for
    bit, subnormal weights (a block of tiny values beside a large one) included."""
    w = fp8_weight(64, 96, (32, 32))
    w.q[:, :8] = torch.tensor([2**-9, -(2**-8), 3 * 2**-9, 2**-6, 448, -448, 0.5, 7 * 2**-9], dtype=F8).to(DEVICE)
    x = torch.randn(5, 96, dtype=dtype, device=DEVICE)
    direct = triton_fp8.w8a16_swap_linear(x, w, block_n=32, block_k=32, num_splits=2, direct=True)
    assert torch.equal(direct, triton_fp8.w8a16_swap_linear(x, w, block_n=32, block_k=32, num_splits=2))
    assert rel_err(direct, exact(x, w)) < TOL[dtype]


def test_k_pieces_always_hold_some_of_k():
    """Splits that the K tiles do not go round become fewer pieces: none is empty, so the count reaches them all."""
    for k, splits, block_k in [(100, 3, 32), (4096, 6, 128), (256, 64, 128), (14336, 4, 128), (48, 5, 16)]:
        k_split, pieces = triton_fp8.k_pieces(k, splits, block_k)
        assert k_split % block_k == 0 and pieces <= splits and (pieces - 1) * k_split < k <= pieces * k_split


def test_fp8_linear_takes_the_swap_ab_gemm_up_to_64_rows(monkeypatch):
    """The dispatch: up to ``SWAP_MAX_ROWS`` rows the swap-AB kernel, above it the w8a16 kernel of before (below
    the w8a8 rows); both agree with each other and with float64 where both apply."""
    w = fp8_weight(64, 128, (32, 32))
    calls = []
    real = triton_fp8.w8a16_swap_linear
    monkeypatch.setattr(triton_fp8, "w8a16_swap_linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    for m in (1, 16, 64, 65):
        x = torch.randn(m, 128, device=DEVICE)
        out = fp8_linear(x, w, backend="triton")
        assert rel_err(out, exact(x, w)) < TOL[torch.float32]
        assert rel_err(out, triton_fp8.w8a16_linear(x, w)) < 1e-5  # the kernel before, same answer
    assert calls == [(1, 128), (16, 128), (64, 128)]
    x3 = torch.randn(2, 3, 128, device=DEVICE)  # leading dims: rows are their product
    assert fp8_linear(x3, w, backend="triton").shape == (2, 3, 64) and calls[-1] == (2, 3, 128)


def test_swap_ab_refuses_prefill_rows_and_odd_tiles():
    w = fp8_weight(64, 128, (32, 32))
    with pytest.raises(ValueError, match="at most 64 rows"):
        triton_fp8.w8a16_swap_linear(torch.randn(65, 128, device=DEVICE), w)
    with pytest.raises(ValueError, match="must divide the scale block"):
        triton_fp8.w8a16_swap_linear(torch.randn(2, 128, device=DEVICE), w, block_k=64)


# --- decode attention over an e4m3 cache ---------------------------------------------------------------------
def fp8_paged(lens: list[int], width: int, bs: int) -> PagedKV:
    """Each sequence's rows in shuffled blocks of an e4m3 cache (values up to ~3x randn: some on e4m3's coarse
    steps)."""
    need = [-(-n // bs) for n in lens]
    cache = (torch.randn(sum(need) + 2, bs, width, device=DEVICE) * 3).to(F8)
    order = torch.randperm(cache.shape[0]).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n] + [0] * (max(need) - n))
        at += n
    return PagedKV(cache, torch.tensor(tables, device=DEVICE), lens)


def fp8_attention_reference(q, new_rows, cached: PagedKV, layout, scale):
    c64 = PagedKV(cached.cache.double(), cached.block_tables, cached.lens)
    rows = as_cached(new_rows, F8).double()
    return varlen_attention(q.double(), rows, c64, layout, [1] * q.shape[0], scale)


# (block size, block_n, splits, min_chunk): tiles inside a block (one table entry a tile), tiles spanning blocks
# (an entry per row), and the default tile (64 keys over an e4m3 cache) and least chunk (256 keys: 2 splits of
# the longest)
TILINGS = [(64, 32, 3, 32), (16, 32, 4, 16), (64, None, 2, 256)]


@pytest.mark.parametrize(*covering("dtype,tiling", [[torch.bfloat16, torch.float32], TILINGS]))
def test_decode_over_an_e4m3_cache_against_float64(dtype, tiling):
    """Lengths 0 (the new token alone), 1, one short of a tile, a whole tile, and several tiles with a partial
    last one: whole tiles, the partial tile, the new token folded in by the split that ends the sequence, and
    splits that hold no cached key. bfloat16 queries multiply as float16 over the e4m3 cache (``F16_MMA``)."""
    bs, block_n, splits, min_chunk = tiling
    lens = [0, 1, 31, 64, 97, 290]
    hq, hk, d = 4, 2, 32
    layout = gqa_split(hk, d)
    cached = fp8_paged(lens, 2 * hk * d, bs)
    q = torch.randn(len(lens), hq, d, dtype=dtype, device=DEVICE)
    new_rows = as_cached(torch.randn(len(lens), 2 * hk * d, dtype=dtype, device=DEVICE) * 3, F8)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype, device=DEVICE)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ta.decode_attention(
        q, new_rows, cached.cache, cached.block_tables, lens_dev, layout, 0.2,
        num_splits=splits, min_chunk=min_chunk, block_n=block_n, out=out,
    )  # fmt: skip
    assert rel_err(out, fp8_attention_reference(q, new_rows, cached, layout, 0.2)) < TOL[dtype]


def test_mla_decode_over_an_e4m3_latent_cache_in_bfloat16():
    """MLA's row (a 32-wide latent that is also the value, plus a 16-wide rope key: two key tiles) over e4m3,
    bfloat16 queries: the float16 products through the key's both tiles and the latent loaded once."""
    r, dr, h, lens = 32, 16, 20, [0, 9, 70]
    layout = mla_split(r, r + dr)
    cached = fp8_paged(lens, r + dr, 16)
    q = torch.randn(len(lens), h, r + dr, dtype=torch.bfloat16, device=DEVICE)
    new_rows = as_cached(torch.randn(len(lens), r + dr, dtype=torch.bfloat16, device=DEVICE), F8)
    lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = ta.decode_attention(
        q, new_rows, cached.cache, cached.block_tables, lens_dev, layout, 0.3, num_splits=2, min_chunk=16
    )
    assert rel_err(out, fp8_attention_reference(q, new_rows, cached, layout, 0.3)) < TOL[torch.bfloat16]


@pytest.mark.slow  # ~6 s: the whole bench's smoke under the interpreter (the default run keeps under 10 minutes)
def test_the_gpu_bench_smoke_mode_runs(tmp_path):
    """``bench/gpu/fp8_decode.py --smoke``: the GPU script's every part at toy shapes (the interpreter here), its
    JSON's summaries filled, the defaults' errors within the kernels' tolerance."""
    out = tmp_path / "fp8_decode.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu" / "fp8_decode.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {(r["shape"], r["rows"]) for r in result["gemm_summary"]} == {
        (s, m) for s in ("qkv", "down") for m in (1, 16, 64)
    }
    assert all(r["rel_err"] < TOL[torch.bfloat16] for r in result["gemm_summary"])
    assert [r["rows"] for r in result["layer"]] == [1, 16, 64]
    assert [r["ctx"] for r in result["attention_summary"]] == [40, 100]
    assert all(r["rel_err"] < TOL[torch.bfloat16] for r in result["attention"] if "rel_err" in r)
