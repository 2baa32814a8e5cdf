"""Session TTLs in the store: pinned blocks survive eviction while their pin holds; expired or damaged pins are
removed and pin nothing; a scheduler pins a session's stored blocks within its tenant's quota."""

import time

import torch

from dualpath.core.config import StorageConfig
from dualpath.core.geometry import KVGeometry
from dualpath.traffic.storage import make_storage
from dualpath.traffic.storage.pins import PIN_DIR, pinned_keys, write_pin

GEOM = KVGeometry(num_layers=2, block_size=8, kv_elems_per_token=4, dtype="float32")
FP = b"q" * 16


def blocks(n, seed=0):
    keys = [bytes([seed, i]) * 8 for i in range(n)]
    return keys, [torch.full((GEOM.full_block_bytes,), i, dtype=torch.uint8) for i in range(n)]


def test_pinned_blocks_survive_eviction_until_the_pin_expires(tmp_path):
    probe = make_storage(StorageConfig(root=str(tmp_path)), GEOM, FP)
    cap = 10 * probe.file_bytes
    store = make_storage(StorageConfig(root=str(tmp_path), capacity_bytes=cap, rescan_s=0), GEOM, FP)
    old, data = blocks(6)
    assert store.write(old, data).result() == [None] * 6
    write_pin(store.dir, "s1", old[:3], time.time() + 60)  # the three least recently used: pinned
    time.sleep(0.02)
    new, data = blocks(6, seed=1)
    for k, d in zip(new, data):  # one at a time: past the cap, writes evict the least recently used
        assert store.write([k], [d]).result() == [None]
    store._evict()  # (and once more, by hand: to 90% of the cap, 9 blocks, whatever the writes' timing did)
    kept = dict(zip(old + new, store.contains(old + new)))
    gone = {k for k, there in kept.items() if not there}
    assert gone == set(old[3:])  # the three unpinned old ones; the pinned ones stay, although the least recent
    write_pin(store.dir, "s1", old[:3], time.time() - 1)  # the pin expired
    more, data = blocks(3, seed=2)
    assert store.write(more, data).result() == [None] * 3
    store._evict()
    assert not any(store.contains(old[:3])) and not (store.dir / PIN_DIR / "s1.pin").exists()


def test_damaged_pins_pin_nothing_and_go(tmp_path):
    (tmp_path / PIN_DIR).mkdir()
    (tmp_path / PIN_DIR / "bad.pin").write_bytes(b"garbage")
    write_pin(tmp_path, "good", [b"k" * 16], time.time() + 60)
    assert pinned_keys(tmp_path) == {b"k" * 16}
    assert not (tmp_path / PIN_DIR / "bad.pin").exists()
