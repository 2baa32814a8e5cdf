"""The block index's table at the edges its randomized test rarely reaches (found by ``bench/mutation.py``): keys
whose home is slot 0, many keys colliding behind occupied slots, and the bookkeeping the load factor is computed from
(keys, tombstones, when the table grows and to what size), on the Python path (a few ids) and the numpy one."""

import math
import struct

import numpy as np

from dualpath.scheduler.index import BlockIndex

BULK = 64  # ids per call: past the index's switch to numpy rounds (48)


def key(home: int, n: int, bits: int) -> bytes:
    """A block hash whose id has home slot ``home`` in a table of ``2**bits`` slots (its top bits)."""
    return struct.pack("<Q", (home << (64 - bits)) | (n << 1)) + bytes(8)


def _check_counts(index: BlockIndex) -> None:
    """The counts the load factor is computed from are the table's own, and it is at most a quarter used."""
    slots = index._slots
    tombstones = int(np.count_nonzero(slots == 2))
    assert (index._keys, index._deleted) == (int(np.count_nonzero(slots & np.uint64(1))), tombstones)
    assert np.count_nonzero(slots) <= 0.25 * len(slots)


def test_a_key_at_slot_0_is_found_and_stored_once():
    index = BlockIndex()  # 2**16 slots
    k0 = key(0, 1, 16)
    index.add([k0])
    index.add([k0])
    assert len(index) == 1
    index.remove([k0])
    assert index.hit_blocks(k0) == 0 and len(index) == 0
    index = BlockIndex()  # (the tombstone left at slot 0 would move the key to slot 1)
    bulk = [key(0, 1, 16)] + [key(7, n, 16) for n in range(2, BULK + 1)]
    index.add(bulk)
    index.add([key(0, 1, 16)] + [key(9, n, 16) for n in range(2, BULK + 1)])
    assert len(index) == 2 * BULK - 1
    assert index._slots[0] == np.uint64(1 << 1 | 1)  # (the key is at slot 0)
    index.remove([key(0, 1, 16)])
    assert index.hit_blocks(key(0, 1, 16)) == 0 and index.hit_blocks(b"".join(bulk[1:])) == BULK - 1
    _check_counts(index)


def test_keys_colliding_behind_occupied_slots_probe_past_them():
    index = BlockIndex()
    index.add([key(h, 1, 16) for h in (5, 6, 7)])
    crowd = [key(5, n, 16) for n in range(2, BULK + 2)]  # every one's home is taken, and the next two slots
    index.add(crowd)
    assert len(index) == BULK + 3 and index.hit_blocks(b"".join(crowd)) == BULK
    _check_counts(index)


def test_a_table_has_at_least_the_slots_asked_for_a_power_of_two():
    assert [len(BlockIndex(capacity=c)._slots) for c in (1, 16, 17, 1000)] == [16, 16, 32, 1024]


def test_tombstones_stay_until_the_table_must_grow_and_are_counted_until_then():
    index = BlockIndex(capacity=16)  # 16 slots: at most 4 used
    index.add([key(1, n, 4) for n in range(1, 5)])
    assert len(index._slots) == 16  # exactly a quarter used: no growth
    index = BlockIndex(capacity=16)
    index.add([key(1, n, 4) for n in range(1, 4)])
    index.remove([key(1, 1, 4)])
    index.add([key(2, 1, 4)])
    assert len(index._slots) == 16 and index._deleted == 1  # 3 keys and a tombstone: still a quarter
    _check_counts(index)
    index.add([key(3, 1, 4)])  # now past it: grows, dropping the tombstone
    assert len(index._slots) == 32 and index._deleted == 0
    _check_counts(index)

    big = BlockIndex(capacity=256)  # the numpy path: 64 ids exactly fill a quarter of 256 slots
    big.add([key(1, n, 8) for n in range(1, BULK + 1)])
    assert len(big._slots) == 256
    big = BlockIndex(capacity=1024)
    big.add([key(1, n, 10) for n in range(1, BULK + 1)])
    big.remove([key(1, n, 10) for n in range(1, 11)])
    big.add([key(2, n, 10) for n in range(1, BULK + 1)])
    assert len(big._slots) == 1024 and big._deleted == 10
    _check_counts(big)


def test_growth_leaves_headroom_and_churn_reclaims_tombstones():
    """Growing sizes the table for 1.5 times the quarter load (at most a sixth used after), and repeated adds and
    removes of a bulk of keys never fill it with tombstones."""
    index = BlockIndex(capacity=16)
    for round in range(12):
        keys = [key(round, n, 4) for n in range(1, BULK + 1)]
        index.add(keys)
        if round == 0:
            assert len(index._slots) == 2 ** math.ceil(math.log2(BULK * 6))
            assert 1 / 12 < len(index) / len(index._slots) <= 1 / 6
        _check_counts(index)
        assert index.hit_blocks(b"".join(keys)) == BULK
        index.remove(keys)
        _check_counts(index)
    assert len(index) == 0
