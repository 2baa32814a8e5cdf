"""KV geometry and block identity, pinned where ``test_geometry`` leaves room (found by ``bench/mutation.py``): the
identity formulas written out independently (a stored block's key must not change between versions, or every
stored block stops hitting), the layouts' offsets and bounds at their edges, and how tensor-parallel ranks share
KV heads."""

import hashlib
import json
from types import SimpleNamespace

import pytest
import torch

from dualpath.core.errors import ConfigError
from dualpath.core.geometry import (
    HASH_BYTES,
    FullBlockSlots,
    HeadShard,
    KVGeometry,
    LayerMajorBlocks,
    block_hashes,
    chain_root,
    model_fingerprint,
)

FP = bytes(range(16))


def _blake(data: bytes, person: bytes = b"") -> bytes:
    return hashlib.blake2b(data, digest_size=16, person=person).digest()


def test_the_fingerprint_is_the_documented_hash_of_its_fields():
    model = SimpleNamespace(to_dict=lambda: {"architecture": "llama", "num_layers": 2})
    fields = {"layout": 1, "model": {"architecture": "llama", "num_layers": 2}, "dtype": "bfloat16", "block_size": 64}
    base = {**fields, "weights": "abc"}
    expect = _blake(json.dumps(base, sort_keys=True).encode())
    assert len(expect) == HASH_BYTES
    assert model_fingerprint(model, "bfloat16", 64, "abc") == expect
    assert model_fingerprint(model, "bfloat16", 64, "abc", "bfloat16") == expect  # the model's dtype: no field
    fp8 = _blake(json.dumps({**base, "kv_dtype": "float8_e4m3fn"}, sort_keys=True).encode())
    assert model_fingerprint(model, "bfloat16", 64, "abc", "float8_e4m3fn") == fp8


def test_block_hashes_chain_the_documented_hash_from_the_salted_and_adapted_root():
    toks = list(range(7, 7 + 2 * 4 + 3))
    salted = _blake(FP + b"tenant", b"dualpath-salt")
    root = _blake(salted + b"ad", b"dualpath-lora")
    assert chain_root(FP) == FP and chain_root(FP, salt="tenant") == salted
    assert chain_root(FP, adapter="ad") == _blake(FP + b"ad", b"dualpath-lora")
    assert chain_root(FP, salt="tenant", adapter="ad") == root
    h0 = _blake(root + b"".join(t.to_bytes(4, "little") for t in toks[:4]))
    h1 = _blake(h0 + b"".join(t.to_bytes(4, "little") for t in toks[4:8]))
    assert block_hashes(toks, FP, 4, salt="tenant", adapter="ad") == [h0, h1]


def test_geometry_sizes_for_each_dtype_and_its_degenerate_edges():
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1)):
        g = KVGeometry(3, 8, 10, dtype)
        assert (g.dtype_bytes, g.token_bytes, g.layer_block_bytes) == (size, 10 * size, 80 * size)
        assert g.full_block_bytes == 3 * 80 * size and g.layer_block_shape == (8, 10)
    KVGeometry(1, 1, 1, "float32")  # the smallest allowed
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ConfigError):
            KVGeometry(*bad, "float32")
    g = KVGeometry.for_model(SimpleNamespace(num_layers=5, kv_elems_per_token=12), "bfloat16", 32)
    assert g == KVGeometry(5, 32, 12, "bfloat16")


def test_layer_ranges_and_offsets_at_their_edges():
    g = KVGeometry(4, 2, 3, "float32")  # layer blocks of 24 bytes
    assert g.layer_range(0, 4) == (0, 96) and g.layer_range(3, 4) == (72, 24) and g.layer_range(0, 1) == (0, 24)
    assert g.layer_offset(3) == 72
    for first, last in ((-1, 2), (2, 5), (3, 3)):
        with pytest.raises(IndexError):
            g.layer_range(first, last)
    with pytest.raises(IndexError):
        g.layer_offset(-1)
    assert (g.num_full_blocks(5), g.num_blocks(5), g.num_blocks(4), g.num_blocks(0)) == (2, 3, 2, 0)


def test_full_block_slots_and_layer_major_offsets():
    g = KVGeometry(3, 2, 4, "float32")  # layer blocks of 32 bytes, full blocks of 96
    slots = FullBlockSlots(g, 5)
    assert slots.nbytes == 5 * 96 and slots.offset(2, 1) == 2 * 96 + 32
    cache = LayerMajorBlocks(g, 7)
    assert cache.nbytes == 3 * 7 * 32 and cache.offset(5, 2) == (2 * 7 + 5) * 32
    ws = LayerMajorBlocks(g, 7, num_layers=2)  # a two-slot workspace: layer l in slot l % 2
    assert ws.nbytes == 2 * 7 * 32 and ws.offset(5, 3) == (1 * 7 + 5) * 32 and ws.offset(4, 2) == 4 * 32


def test_ranks_split_kv_heads_or_replicate_them():
    split = [HeadShard(4, 3, r, 2) for r in range(2)]
    assert [(s.num_local, s.local_elems, s.first, s.primary, s.whole) for s in split] == [
        (2, 12, 0, True, False),
        (2, 12, 2, True, False),
    ]
    shared = [HeadShard(2, 3, r, 4) for r in range(4)]  # 2 heads on 4 ranks: each on 2
    assert [(s.num_local, s.first, s.primary) for s in shared] == [
        (1, 0, True),
        (1, 0, False),
        (1, 1, True),
        (1, 1, False),
    ]
    assert HeadShard(4, 3).whole and HeadShard(4, 3).local_elems == 24
    g = KVGeometry(2, 16, 24, "bfloat16")
    assert split[1].local_geometry(g) == KVGeometry(2, 16, 12, "bfloat16")
    for bad in ((3, 2, 0, 2), (2, 2, 0, 3), (4, 2, 2, 2), (4, 2, -1, 2)):
        with pytest.raises(ConfigError):
            HeadShard(*bad)


def test_mla_latent_is_one_replicated_head_that_rank_0_writes_back():
    assert HeadShard.replicated(10) == HeadShard(1, 5, 0, 1)
    s = HeadShard.replicated(10, rank=1, size=2)
    assert (s.num_kv_heads, s.head_dim, s.rank, s.size) == (1, 5, 1, 2)
    assert (s.num_local, s.first, s.primary, s.whole) == (1, 0, False, True)
    assert HeadShard.replicated(10, rank=0, size=2).primary
    with pytest.raises(ConfigError):
        HeadShard.replicated(9)


def test_a_rank_takes_and_puts_its_heads_of_a_canonical_row():
    rows = torch.arange(3 * 24, dtype=torch.float32).view(3, 24)  # [K heads 0..3 | V heads 0..3], head_dim 3
    s = HeadShard(4, 3, rank=1, size=2)
    local = s.take(rows)
    assert local.shape == (3, 12)
    assert local[0].tolist() == [6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23]
    out = torch.zeros(3, 24)
    s.put(out, torch.tensor([2, 0]), local[:2] + 100)
    assert out[1].eq(0).all()
    assert (
        out[2, 6:12].tolist() == (local[0, :6] + 100).tolist()
        and out[2, 18:24].tolist() == (local[0, 6:] + 100).tolist()
    )
    assert out[0, 6:12].tolist() == (local[1, :6] + 100).tolist() and out[2, :6].eq(0).all()


def test_ranks_sharing_a_head_take_it_from_rows_of_any_rank():
    """Rows ``[tokens, block, elems]`` (a block's KV): each rank's heads come out of every row; a head shared by
    two ranks (2 heads, 4 ranks) is the same for both, and MLA's replicated latent is the whole row."""
    rows = torch.arange(2 * 3 * 12, dtype=torch.float32).view(2, 3, 12)  # 2 KV heads of 3: [K0 K1 V0 V1]
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        local = HeadShard(2, 3, rank, 4).take(rows)
        assert local.shape == (2, 3, 6)
        assert torch.equal(local[..., :3], rows[..., 3 * head : 3 * head + 3])
        assert torch.equal(local[..., 3:], rows[..., 6 + 3 * head : 9 + 3 * head])
    latent = HeadShard.replicated(12, rank=1, size=2)
    assert torch.equal(latent.take(rows), rows)
    out = torch.zeros(2, 3, 12)
    latent.put(out, torch.tensor([1]), rows[:1] + 1)
    assert torch.equal(out[1], rows[0] + 1) and out[0].eq(0).all()
