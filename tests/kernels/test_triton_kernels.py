"""The Triton kernels against the torch reference computed in float64: fresh random inputs each run, outputs
poisoned (NaN) before each call, odd lengths, empty cached parts, single tokens, block boundaries. On CPU they
run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest); on a GPU the same tests run on CUDA.

Tolerance: max |out - ref| / max |ref| under 1e-3 for float32 inputs and 2e-2 for bfloat16.
"""

import pytest
import torch

pytest.importorskip("triton")

from dualpath.kernels import triton_attention as ta  # noqa: E402
from dualpath.kernels import triton_kv  # noqa: E402
from dualpath.kernels.attention import (
    PagedKV,
    choose_backend,
    gqa_split,
    mla_attention,  # noqa: E402
    varlen_attention,
)
from dualpath.kernels.kv_move import gather_blocks, scatter_blocks, write_tokens  # noqa: E402
from grid import covering  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
BS = 16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "the kernel left outputs unwritten"
    return float((out.double() - ref).abs().max() / ref.abs().max())


def paged(lens: list[int], width: int, dtype, blocks_extra: int = 3, bs: int = BS) -> PagedKV:
    """Random rows of each sequence in a shuffled paged cache of ``bs``-token blocks (tables padded with block 0)."""
    need = [-(-n // bs) for n in lens]
    cache = torch.randn(sum(need) + blocks_extra, bs, width, dtype=dtype, device=DEVICE)
    order = torch.randperm(cache.shape[0]).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    w = max(max(need), 1)
    table = torch.tensor([t + [0] * (w - len(t)) for t in tables], device=DEVICE)
    return PagedKV(cache, table, lens)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def reference(q, new_rows, cached: PagedKV, layout, new_lens, scale):
    c64 = PagedKV(cached.cache.double(), cached.block_tables, cached.lens)
    return varlen_attention(q.double(), new_rows.double(), c64, layout, new_lens, scale)


def gqa_inputs(heads, cached_lens, t, dtype, bs: int = BS):
    """Layout, paged cache, queries and new rows of ``t`` new tokens, and a poisoned output."""
    hq, hk, d = heads
    q = torch.randn(t, hq, d, dtype=dtype, device=DEVICE)
    new_rows = torch.randn(t, 2 * hk * d, dtype=dtype, device=DEVICE)
    cached = paged(cached_lens, 2 * hk * d, dtype, bs=bs)
    return gqa_split(hk, d), cached, q, new_rows, poisoned((t, hq, d), dtype)


CASES = [  # (cached lens, new lens): empty cached, single token, odd lengths, exactly one and two blocks
    ([0, 5, 16, 33], [1, 7, 16, 20]),
    ([0], [37]),
    ([31, 0, 64], [2, 1, 33]),
]


DTYPES = [torch.float32, torch.bfloat16]


# GQA, MHA with D not a power of 2, MQA, and a group wider than a row block (20 heads, block_m 16: a group spans
# row blocks unevenly); each pair of a dtype, a head layout and a length case (the whole grid: -m slow)
@pytest.mark.parametrize(
    *covering("dtype,heads,case", [DTYPES, [(4, 2, 16), (3, 3, 24), (8, 1, 32), (20, 1, 16)], CASES])
)
def test_prefill_kernel_against_float64(dtype, heads, case):
    cached_lens, new_lens = case
    layout, cached, q, new_rows, out = gqa_inputs(heads, cached_lens, sum(new_lens), dtype)
    ta.prefill_attention(
        q,
        new_rows,
        cached.cache,
        cached.block_tables,
        cached_lens,
        new_lens,
        layout,
        0.3,
        block_m=16,
        block_n=16,
        out=out,
    )
    assert rel_err(out, reference(q, new_rows, cached, layout, new_lens, 0.3)) < TOL[dtype]


# tiles of keys: two per cache block (one table entry each), and spanning two blocks (a table entry per row)
@pytest.mark.parametrize(*covering("dtype,tiles", [DTYPES, [(32, 16), (16, 32)]], strength=1))
def test_kernels_with_tiles_smaller_and_larger_than_a_block(dtype, tiles):
    bs, block_n = tiles
    cached_lens, new_lens = [0, 5, 16, 33, 71], [1, 7, 16, 20, 9]
    layout, cached, q, new_rows, out = gqa_inputs((4, 2, 16), cached_lens, sum(new_lens), dtype, bs)
    ta.prefill_attention(
        q,
        new_rows,
        cached.cache,
        cached.block_tables,
        cached_lens,
        new_lens,
        layout,
        0.3,
        block_m=16,
        block_n=block_n,
        out=out,
    )
    assert rel_err(out, reference(q, new_rows, cached, layout, new_lens, 0.3)) < TOL[dtype]
    b = len(cached_lens)
    out = poisoned((b, 4, 16), dtype)
    ta.decode_attention(
        q[:b],
        new_rows[:b],
        cached.cache,
        cached.block_tables,
        cached_lens,
        layout,
        0.3,
        num_splits=3,
        min_chunk=1,
        block_n=block_n,
        out=out,
    )
    assert rel_err(out, reference(q[:b], new_rows[:b], cached, layout, [1] * b, 0.3)) < TOL[dtype]


@pytest.mark.parametrize(*covering("dtype,heads", [DTYPES, [(4, 2, 16), (6, 6, 24)]], strength=1))
def test_decode_kernel_splits_long_and_short_sequences(dtype, heads):
    cached_lens = [0, 1, 15, 16, 17, 100]  # 4 splits of at least 16 keys: sequences of 1 to 4 splits in one batch
    b = len(cached_lens)
    layout, cached, q, new_rows, out = gqa_inputs(heads, cached_lens, b, dtype)
    ta.decode_attention(
        q,
        new_rows,
        cached.cache,
        cached.block_tables,
        cached_lens,
        layout,
        0.3,
        num_splits=4,
        min_chunk=16,
        block_n=16,
        out=out,
    )
    assert rel_err(out, reference(q, new_rows, cached, layout, [1] * b, 0.3)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_with_device_lengths_over_wide_tables(dtype):
    """A CUDA graph's call: lengths as a device tensor, tables 30 blocks wide whose unused columns hold other
    sequences' blocks, 32 splits of at least one 16-key tile (the longest sequence spans 19: the reduce reads
    them in two chunks of 16; the empty one uses one split, the others exit)."""
    cached_lens = [0, 15, 16, 17, 300, 47]
    b, width = len(cached_lens), 30
    layout, cached, q, new_rows, out = gqa_inputs((4, 2, 16), cached_lens, b, dtype)
    stale = torch.randint(0, cached.cache.shape[0], (b, width), device=DEVICE)
    used = cached.block_tables.shape[1]
    wide = torch.cat([cached.block_tables, stale[:, used:]], 1)
    lens = torch.tensor(cached_lens, dtype=torch.int32, device=DEVICE)
    ta.decode_attention(
        q, new_rows, cached.cache, wide, lens, layout, 0.3, num_splits=32, min_chunk=1, block_n=16, out=out
    )
    assert rel_err(out, reference(q, new_rows, cached, layout, [1] * b, 0.3)) < TOL[dtype]
    # the torch reference takes device lengths too (it reads them on the host)
    ref_dev = varlen_attention(
        q.double(), new_rows.double(), PagedKV(cached.cache.double(), wide, lens), layout, [1] * b, 0.3
    )
    assert rel_err(ref_dev.to(dtype), reference(q, new_rows, cached, layout, [1] * b, 0.3)) < TOL[dtype]


# new lens [3, 1, 5]: the prefill kernel, [1, 1, 1]: decode; (heads, latent, rope): a 32-wide key in one tile; and
# DeepSeek's form, a 48-wide key in two tiles (32 + 16) whose leading 32 columns are also the value (loaded once),
# with 40 heads: three decode head blocks, the last partial
@pytest.mark.parametrize(
    *covering("dtype,new_lens,shape", [DTYPES, [[3, 1, 5], [1, 1, 1]], [(4, 24, 8), (40, 32, 16)]])
)
def test_mla_absorbed_kernels_against_float64(dtype, new_lens, shape):
    h, r, dr = shape
    dn, dv = 8, 6
    cached_lens = [5, 0, 18]
    cached = paged(cached_lens, r + dr, dtype)
    t = sum(new_lens)
    q_nope, q_pe = (torch.randn(t, h, x, dtype=dtype, device=DEVICE) for x in (dn, dr))
    new_rows = torch.randn(t, r + dr, dtype=dtype, device=DEVICE)
    w_uk, w_uv = (torch.randn(h, x, r, dtype=dtype, device=DEVICE) * 0.3 for x in (dn, dv))
    out = mla_attention(q_nope, q_pe, new_rows, cached, new_lens, w_uk, w_uv, r, 0.2, backend="triton")
    c64 = PagedKV(cached.cache.double(), cached.block_tables, cached.lens)
    ref = mla_attention(
        q_nope.double(), q_pe.double(), new_rows.double(), c64, new_lens, w_uk.double(), w_uv.double(), r, 0.2
    )
    assert rel_err(out, ref) < TOL[dtype]


def test_dispatch_by_device_and_the_reference_switch():
    assert choose_backend("auto", "cpu") == "torch"
    assert choose_backend("torch", "cuda") == "torch"  # forced reference for debugging
    assert choose_backend("triton", "cpu") == "triton"
    from dualpath.core.errors import ConfigError

    with pytest.raises(ConfigError):
        choose_backend("cutlass", "cpu")
    q, rows = torch.randn(2, 2, 8), torch.randn(2, 32)
    with pytest.raises(ValueError, match="paged"):
        varlen_attention(q, rows, [torch.randn(0, 32)] * 2, gqa_split(2, 8), [1, 1], 0.3, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_gather_and_scatter_any_block_list(dtype):
    cache = torch.randn(12, BS, 40, dtype=dtype, device=DEVICE)
    ids = torch.tensor([7, 0, 11, 3], device=DEVICE)
    out = poisoned((4, BS, 40), dtype)
    assert torch.equal(triton_kv.gather_blocks(cache, ids, out=out), cache[ids])
    assert torch.equal(gather_blocks(cache, ids, backend="triton"), gather_blocks(cache, ids))
    blocks = torch.randn(4, BS, 40, dtype=dtype, device=DEVICE)
    mine, theirs = cache.clone(), cache.clone()
    scatter_blocks(mine, ids, blocks, backend="triton")
    scatter_blocks(theirs, ids, blocks)
    assert torch.equal(mine, theirs) and torch.equal(mine[ids], blocks)
    untouched = [i for i in range(12) if i not in ids.tolist()]
    assert torch.equal(mine[untouched], cache[untouched])
    assert gather_blocks(cache, ids[:0], backend="triton").shape == (0, BS, 40)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_full_blocks_of_every_layer_to_and_from_a_paged_cache(backend, dtype):
    """The decode engine's moves: a sequence's blocks of every layer as Full Block bytes (one gather, one host copy),
    the same bytes the per-layer packing makes, and back into other blocks of the cache."""
    from dualpath.core.geometry import KVGeometry
    from dualpath.kernels.kv_move import cache_to_full_blocks, full_blocks_to_cache, pack_full_blocks

    geom = KVGeometry(num_layers=3, block_size=BS, kv_elems_per_token=40, dtype=dtype)
    storage = torch.randn(3, 10, BS, 40, device=DEVICE).to(getattr(torch, dtype))
    ids = torch.tensor([7, 2, 5], device=DEVICE)
    full = cache_to_full_blocks(storage, ids, geom)
    assert full.dtype == torch.uint8 and full.shape == (3, geom.full_block_bytes)
    per_layer = [storage[layer, ids].reshape(-1, 40).cpu() for layer in range(3)]
    assert torch.equal(full.cpu(), pack_full_blocks(per_layer, geom))
    other = torch.tensor([0, 9, 4], device=DEVICE)
    before = storage.clone()
    full_blocks_to_cache(storage, other, full.cpu(), geom, backend)  # from host bytes, as the buffer's
    assert same(storage[:, other], before[:, ids])
    untouched = [b for b in range(10) if b not in (0, 9, 4)]
    assert same(storage[:, untouched], before[:, untouched])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (CPU torch has no ``equal`` for 8-bit floats)."""
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --- an 8-bit float cache (--kv-cache-dtype fp8) --------------------------------------------------------------
F8 = torch.float8_e4m3fn


def fp8_reference(q, new_rows, cached: PagedKV, layout, new_lens, scale):
    """Float64 attention over the cache's values and the new rows as the cache holds them (rounded to e4m3)."""
    from dualpath.kernels.kv_move import as_cached

    c64 = PagedKV(cached.cache.double(), cached.block_tables, cached.lens)
    return varlen_attention(q.double(), as_cached(new_rows, F8).double(), c64, layout, new_lens, scale)


@pytest.mark.parametrize(
    *covering("dtype,backend,new_lens", [DTYPES, ["torch", "triton"], [[1, 7, 16, 20], [1, 1, 1, 1]]])
)  # prefill, decode
def test_attention_over_an_fp8_cache_against_float64(dtype, backend, new_lens):
    """Queries in the model's dtype over e4m3 cached rows (widened as they load) and new rows as the cache will
    hold them. Without the rounding of new rows, or with tiles left in e4m3, the error is ~1e-2 (caught)."""
    cached_lens = [0, 5, 16, 33]
    layout, cached, q, new_rows, _ = gqa_inputs((4, 2, 16), cached_lens, sum(new_lens), dtype)
    cached = PagedKV(cached.cache.to(F8), cached.block_tables, cached.lens)
    new_rows = new_rows * 3  # some values past e4m3's coarse steps
    out = varlen_attention(q, new_rows, cached, layout, new_lens, 0.3, backend=backend)
    assert out.dtype == dtype
    assert rel_err(out, fp8_reference(q, new_rows, cached, layout, new_lens, 0.3)) < TOL[dtype]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("new_lens", [[3, 1, 5], [1, 1, 1]])
def test_mla_over_an_fp8_latent_cache_against_float64(backend, new_lens):
    from dualpath.kernels.kv_move import as_cached

    h, r, dr, dn, dv = 40, 32, 16, 8, 6
    cached = paged([5, 0, 18], r + dr, torch.float32)
    cached = PagedKV(cached.cache.to(F8), cached.block_tables, cached.lens)
    t = sum(new_lens)
    q_nope, q_pe = (torch.randn(t, h, x, device=DEVICE) for x in (dn, dr))
    new_rows = torch.randn(t, r + dr, device=DEVICE)
    w_uk, w_uv = (torch.randn(h, x, r, device=DEVICE) * 0.3 for x in (dn, dv))
    out = mla_attention(q_nope, q_pe, new_rows, cached, new_lens, w_uk, w_uv, r, 0.2, backend=backend)
    c64 = PagedKV(cached.cache.double(), cached.block_tables, cached.lens)
    ref = mla_attention(
        q_nope.double(),
        q_pe.double(),
        as_cached(new_rows, F8).double(),
        c64,
        new_lens,
        w_uk.double(),
        w_uv.double(),
        r,
        0.2,
    )
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("width", [40, 576])
def test_fp8_row_writes_saturate_and_match_between_backends(width):
    """Rows into an e4m3 cache: rounded to nearest, values past +-448 saturate (never NaN), the same bytes from
    the Triton kernel and the torch path; other slots untouched; blocks move as bytes."""
    from dualpath.kernels.kv_move import FP8_MAX

    cache = torch.randn(6, BS, width, device=DEVICE).to(F8)
    slots = torch.randperm(6 * BS, device=DEVICE)[:37]
    rows = torch.randn(37, width, device=DEVICE) * 100
    rows[0, :3] = torch.tensor([1e4, -1e4, 449.0])
    mine, theirs = cache.clone(), cache.clone()
    write_tokens(mine, slots, rows, backend="triton")
    write_tokens(theirs, slots, rows)
    assert same(mine, theirs)
    written = mine.view(-1, width)[slots].float()
    assert not written.isnan().any()
    assert written[0, :3].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    assert torch.equal(written[1:], rows[1:].to(F8).float())  # in range: e4m3 round-to-nearest
    untouched = torch.ones(6 * BS, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert same(mine.view(-1, width)[untouched], cache.view(-1, width)[untouched])
    ids = torch.tensor([4, 0, 5], device=DEVICE)
    assert same(gather_blocks(mine, ids, backend="triton"), mine[ids])
    other = cache.clone()
    scatter_blocks(other, ids, mine[ids], backend="triton")
    assert same(other[ids], mine[ids])


@pytest.mark.parametrize("width", [40, 576, 5000])  # under a power of two, MLA's row, more than one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_writes_into_cache_slots_match_index_copy(width, dtype):
    """A forward's new KV rows into scattered slots of a cache layer, other slots untouched. Rows come from a
    strided view, as a layer's KV slice of a wider tensor would."""
    cache = torch.randn(6, BS, width, dtype=dtype, device=DEVICE)
    slots = torch.randperm(6 * BS, device=DEVICE)[:37]
    rows = torch.randn(37, width + 3, dtype=dtype, device=DEVICE)[:, 1 : width + 1]
    mine, theirs = cache.clone(), cache.clone()
    write_tokens(mine, slots, rows, backend="triton")
    write_tokens(theirs, slots, rows)
    assert torch.equal(mine, theirs) and torch.equal(mine.view(-1, width)[slots], rows)
    write_tokens(mine, slots[:0], rows[:0], backend="triton")
    assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="cannot move pieces"):
        write_tokens(mine, slots, rows[:, :-1], backend="triton")


def test_row_writes_cast_to_the_cache_dtype():
    cache = torch.zeros(4, BS, 48, dtype=torch.bfloat16, device=DEVICE)
    slots, rows = torch.tensor([5, 63, 17], device=DEVICE), torch.randn(3, 48, device=DEVICE)
    write_tokens(cache, slots, rows, backend="triton")
    assert torch.equal(cache.view(-1, 48)[slots], rows.to(torch.bfloat16))
    assert cache.view(-1, 48)[[0, 1, 2, 3, 4, 6]].abs().sum() == 0


# ~12 s (llama) and ~13 s (deepseek_v3) in the interpreter; by default the kernels' own tests run, and a model's
# decode steps on them (test_decode_graphs); bench/gpu/run.sh runs these on a GPU
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3", "deepseek_v32"])
def test_models_generate_the_same_tokens_on_the_kernels(tiny_dirs, arch):
    """Whole models, paged cache, chunked prefill, batched decode: the kernels change no greedy token."""
    from dualpath.llm import LLM
    from dualpath.core.sampling_params import SamplingParams

    prompts = [list(range(3, 23)), [5, 6, 7], list(range(100, 111))]  # across a block, chunked (16 a step)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for kernels in ("torch", "triton"):
        llm = LLM(
            str(tiny_dirs[arch]),
            device=DEVICE,
            block_size=16,
            max_num_batched_tokens=16,
            kernels=kernels,
            kv_cache_bytes=64 << 20,
        )  # on CUDA the default takes 0.9 of the GPU: one LLM at a time
        assert llm.model.kernels == kernels
        outs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_the_layer_loop_copies_nothing_between_host_and_device(tiny_dirs, monkeypatch, arch):
    """On the Triton kernels a layer reads its batch's lengths from the forward context (one copy per forward)
    and MoE layers run the fused kernels (the torch reference asks the host which experts run), so the host never
    waits for the device inside the layer loop: checked for a chunked prefill over a cached part and a decode
    step."""
    from dualpath.core.geometry import KVGeometry
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.kv_cache import PagedKVCache
    from dualpath.engines.local import ModelRunner
    from dualpath.engines.models import load_model
    from dualpath.engines.sequence import Sequence
    from host_transfers import transfers_in_layers

    model = load_model(tiny_dirs[arch], DEVICE, kernels="triton")
    cache = PagedKVCache(KVGeometry.for_model(model.config, "float32", BS), 32, DEVICE)
    seqs = [Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=2)) for i, n in enumerate((20, 7))]
    for s in seqs:
        cache.reserve(s.seq_id, s.num_tokens + 1)
    runner = ModelRunner(model, cache)
    runner.forward(seqs, [5, 3])  # cached parts for the next forward
    inside = transfers_in_layers(monkeypatch, model)
    runner.forward(seqs, [15, 3])  # prefill over cached tokens
    runner.forward(seqs[1:], [1])  # decode
    assert inside == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 37])  # a single token, a decode batch, a prefill chunk
def test_fused_moe_against_float64(dtype, t):
    """Routed experts in the fused kernels: hidden 48 and intermediate 40 (not multiples of the tiles), 8 experts,
    2 per token, skewed so some experts get none and one gets most; against the per-expert reference in float64."""
    from dualpath.kernels.moe import routed_experts
    from dualpath.kernels.triton_moe import align

    e, k, h, inter = 8, 2, 48, 40
    x = torch.randn(t, h, dtype=dtype, device=DEVICE)
    gate_up = torch.randn(e, 2 * inter, h, dtype=dtype, device=DEVICE) * 0.2
    down = torch.randn(e, h, inter, dtype=dtype, device=DEVICE) * 0.2
    first = torch.where(torch.rand(t) < 0.7, 0, torch.randint(1, 4, (t,)))
    ids = torch.stack([first, first + 1 + torch.randint(0, 4, (t,))], 1).to(DEVICE)
    weights = torch.rand(t, k, device=DEVICE)
    out = routed_experts(x, weights, ids, gate_up, down, backend="triton")
    ref = routed_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    assert rel_err(out, ref) < TOL[dtype]
    pair_of_row, expert_of_block = align(ids, e, 16)  # every pair in exactly one row, of its expert's block
    valid = pair_of_row < t * k
    assert sorted(pair_of_row[valid].tolist()) == list(range(t * k))
    block_expert = expert_of_block.repeat_interleave(16)
    assert torch.equal(ids.reshape(-1)[pair_of_row[valid].long()], block_expert[valid].long())
