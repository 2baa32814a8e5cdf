import pytest
from hypothesis import given, settings, strategies as st

from dualpath.core.config import ModelConfig
from dualpath.core.errors import ConfigError
from dualpath.core.geometry import KVGeometry, block_hashes, chain_root, model_fingerprint
from dualpath.core.messages import pack_tokens

FP = b"f" * 16


def test_layer_block_and_full_block_layout():
    g = KVGeometry(num_layers=30, block_size=64, kv_elems_per_token=2 * 3 * 64, dtype="bfloat16")
    assert g.token_bytes == 2 * 3 * 64 * 2
    assert g.layer_block_bytes == 64 * g.token_bytes
    assert g.full_block_bytes == 30 * g.layer_block_bytes
    assert g.layer_offset(0) == 0 and g.layer_offset(29) == 29 * g.layer_block_bytes
    assert g.layer_range(3, 7) == (3 * g.layer_block_bytes, 4 * g.layer_block_bytes)
    assert g.num_full_blocks(191) == 2 and g.num_blocks(191) == 3 and g.num_blocks(192) == 3
    with pytest.raises(IndexError):
        g.layer_offset(30)
    with pytest.raises(IndexError):
        g.layer_range(5, 5)
    with pytest.raises(ConfigError):
        KVGeometry(1, 64, 8, "int4")


def test_a_memory_budget_holds_whole_blocks_of_the_resident_layers():
    """Blocks of a prefill batch a KV budget holds: each keeps ``resident_layers`` layer blocks (all 30 for basic
    prefill, 2 for layerwise), rounded down to whole blocks."""
    g = KVGeometry(num_layers=30, block_size=64, kv_elems_per_token=2 * 3 * 64, dtype="bfloat16")
    budget = 10 * 30 * g.layer_block_bytes + g.layer_block_bytes  # ten blocks of every layer, and a spare layer
    assert g.budget_blocks(budget, 30) == 10 and isinstance(g.budget_blocks(budget, 30), int)
    assert g.budget_blocks(budget, 2) == 150  # 301 layer blocks, 2 a block
    assert g.budget_blocks(g.layer_block_bytes - 1, 1) == 0


def test_mla_geometry_uses_latent_plus_rope_dims(tiny_dirs):
    import json

    cfg = ModelConfig.from_hf(json.loads((tiny_dirs["deepseek_v3"] / "config.json").read_text()))
    assert cfg.kv_elems_per_token == 32 + 16
    sparse = ModelConfig.from_hf(json.loads((tiny_dirs["deepseek_v32"] / "config.json").read_text()))
    assert sparse.kv_elems_per_token == 32 + 16 + 32 and sparse.mla.key_width == 32 + 16  # + the indexer's key
    gqa = ModelConfig.from_hf(json.loads((tiny_dirs["llama"] / "config.json").read_text()))
    assert gqa.kv_elems_per_token == 2 * 2 * 16


def test_same_tokens_same_chain_and_partial_blocks_unhashed():
    toks = list(range(1000, 1000 + 64 * 3 + 10))
    h1, h2 = block_hashes(toks, FP, 64), block_hashes(list(toks), FP, 64)
    assert h1 == h2 and len(h1) == 3 and len(set(h1)) == 3
    assert block_hashes(toks[:63], FP, 64) == []
    assert block_hashes(toks[:64], FP, 64) == h1[:1]


def test_parent_continues_the_chain():
    toks = list(range(64 * 4))
    full = block_hashes(toks, FP, 64)
    assert block_hashes(toks[128:], FP, 64, parent=full[1]) == full[2:]


def test_packed_tokens_hash_as_their_ids():
    """The scheduler hashes prompts as the wire packs them (little-endian uint32s): the same chain as the ids',
    partial blocks, salts, adapters and a parent included."""
    toks = [7, 2**31 - 1, 0, 65_535] * 50 + [3] * 30  # 3 full blocks of 64 and a partial one
    packed = pack_tokens(toks)
    for kw in ({}, {"salt": "tenant"}, {"adapter": "a1"}):
        assert block_hashes(packed, FP, 64, **kw) == block_hashes(toks, FP, 64, **kw)
    full = block_hashes(toks, FP, 64)
    assert len(full) == 3 and block_hashes(packed[: 63 * 4], FP, 64) == []
    assert block_hashes(packed[64 * 4 :], FP, 64, parent=full[0]) == full[1:]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=64 * 4, max_size=64 * 4),
    st.integers(0, 64 * 4 - 1),
    st.integers(0, 2**31 - 1),
)
def test_any_token_change_changes_that_block_and_every_later_hash(toks, pos, new):
    if toks[pos] == new:
        new = (new + 1) % 2**31
    base = block_hashes(toks, FP, 64)
    changed = list(toks)
    changed[pos] = new
    after = block_hashes(changed, FP, 64)
    first = pos // 64
    assert after[:first] == base[:first]
    assert all(a != b for a, b in zip(after[first:], base[first:]))


def test_order_and_fingerprint_change_every_hash():
    toks = list(range(64 * 3))
    base = block_hashes(toks, FP, 64)
    swapped = toks[64:128] + toks[:64] + toks[128:]
    assert all(a != b for a, b in zip(block_hashes(swapped, FP, 64), base))
    assert all(a != b for a, b in zip(block_hashes(toks, b"g" * 16, 64), base))


def test_fingerprint_covers_dtype_block_size_and_weights(tiny_dirs):
    import json

    cfg = ModelConfig.from_hf(json.loads((tiny_dirs["llama"] / "config.json").read_text()))
    base = model_fingerprint(cfg, "float32", 64, "w1")
    assert base == model_fingerprint(cfg, "float32", 64, "w1")
    assert (
        len(
            {
                base,
                model_fingerprint(cfg, "bfloat16", 64, "w1"),
                model_fingerprint(cfg, "float32", 32, "w1"),
                model_fingerprint(cfg, "float32", 64, "w2"),
            }
        )
        == 4
    )


def test_a_salt_starts_its_own_chain_that_no_unsalted_block_can_join():
    toks = list(range(64 * 3))
    base = block_hashes(toks, FP, 64)
    a, b = block_hashes(toks, FP, 64, salt="tenant-a"), block_hashes(toks, FP, 64, salt="tenant-b")
    assert chain_root(FP) == FP and block_hashes(toks, FP, 64, salt="") == base
    assert len({*base, *a, *b}) == 9  # no block is shared across salts
    assert block_hashes(toks[64:], FP, 64, parent=a[0], salt="ignored") == a[1:]  # the parent carries the salt
    # A salt spelling a token block's bytes ("aaaa" is token 0x61616161) does not root the chain at that block's
    # hash: the salted root is a personalized hash, not the chain's own step.
    spelled = [0x61616161] * 64
    assert chain_root(FP, "a" * 256) != block_hashes(spelled, FP, 64)[0]
    assert chain_root(FP, "a" * 256) != chain_root(b"g" * 16, "a" * 256)  # and it follows the fingerprint
