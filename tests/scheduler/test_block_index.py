"""The scheduler's block index against a plain Python set of hashes: same answers through growth, deletions and
re-insertions; the hit length is the leading run of stored blocks."""

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.scheduler.index import BlockIndex


def chain(n: int, seed: int) -> list[bytes]:
    return [bytes([seed % 256, seed // 256 % 256]) + os.urandom(14) for _ in range(n)]


def leading(keys: list[bytes], stored: set[bytes]) -> int:
    n = 0
    while n < len(keys) and keys[n] in stored:
        n += 1
    return n


# spans up to 120 keys: batches on both sides of the index's switch from a Python loop to numpy rounds (48 ids)
ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "ask"]), st.integers(0, 9), st.integers(0, 120), st.integers(0, 120)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_index_matches_a_set(script):
    chains = [chain(120, s) for s in range(10)]
    index, model = BlockIndex(capacity=16), set()  # tiny start: the script forces several resizes
    for op, c, a, b in script:
        keys = chains[c][min(a, b) : max(a, b)]
        if op == "add":
            index.add(keys)
            model.update(keys)
        elif op == "remove":
            index.remove(keys)
            model.difference_update(keys)
        else:
            assert index.hit_blocks(b"".join(chains[c])) == leading(chains[c], model)
        assert len(index) == len(model)
    for c in chains:
        assert index.hit_blocks(b"".join(c)) == leading(c, model)


def test_hit_length_stops_at_the_first_gap_and_counts_lookups():
    keys = chain(100, 1)
    index = BlockIndex()
    index.add(keys[:50] + keys[51:])
    assert index.hit_blocks(b"".join(keys)) == 50
    assert index.hit_blocks(b"".join(keys[51:])) == 49
    assert index.hit_blocks(b"") == 0
    index.add(keys[50:51] * 3)  # duplicates count once
    assert index.hit_blocks(b"".join(keys)) == 100 and len(index) == 100
    index.remove(keys[:1] + keys[:1])
    assert index.hit_blocks(b"".join(keys)) == 0 and len(index) == 99
    assert (index.lookups, index.hit_blocks_total, index.blocks_total) == (5, 199, 349)


def test_many_deletions_do_not_fill_the_table():
    index = BlockIndex(capacity=64)
    for round in range(200):
        keys = chain(20, round)
        index.add(keys)
        assert index.hit_blocks(b"".join(keys)) == 20
        index.remove(keys)
    assert len(index) == 0 and len(index._slots) <= 256  # deleted slots are reclaimed by a same-size rebuild


def test_rebuild_lists_a_store_in_batches(tmp_path):
    """Blocks stored as ``<root>/<fingerprint>/<hash[:2]>/<hash>.kv`` (other files ignored), added a batch at a
    time."""
    fp = bytes(range(16))
    keys = chain(7, 3)
    for k in keys:
        d = tmp_path / fp.hex() / k.hex()[:2]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{k.hex()}.kv").write_bytes(b"x")
    (tmp_path / fp.hex() / keys[0].hex()[:2] / "partial.tmp").write_bytes(b"")
    index, added = BlockIndex(), []
    index.add = lambda batch, _add=index.add: (added.append(len(list(batch))), _add(batch))
    assert index.rebuild(tmp_path, fp, batch=3) == 7
    assert added == [3, 3, 1] and index.hit_blocks(b"".join(keys)) == 7
    assert BlockIndex().rebuild(tmp_path, bytes(16)) == 0  # another model: nothing
