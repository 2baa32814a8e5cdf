"""The prefetcher: a session's stored blocks read into spare buffer slots ahead of its next turn, served to the
turn's load from the buffer (bytes exact, no storage read), the first to go when a request needs room, freed and
counted wasted when unused, and never read while a demand read waits."""

import time

import pytest
import torch

from dualpath.core.config import StorageConfig, TransportConfig
from dualpath.core.geometry import KVGeometry
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.manager import TrafficManager
from dualpath.traffic.prefetch import OWNER, Prefetcher
from dualpath.traffic.storage import ReadAccounting, make_storage
from dualpath.traffic.transport import make_transport
from dualpath.traffic.transport.local import LocalHub

GEOM = KVGeometry(num_layers=4, block_size=8, kv_elems_per_token=6, dtype="float32")
FP = b"p" * 16


def manager(root, slots=8, share=0.5, bps=0.0):
    t = make_transport(TransportConfig(name="local"), "e", hub=LocalHub())
    mem = t.allocate(slots * GEOM.full_block_bytes)
    accounting = ReadAccounting(bps, GEOM.full_block_bytes / GEOM.block_size)
    storage = make_storage(StorageConfig(root=str(root)), GEOM, FP, accounting)
    m = TrafficManager(GEOM, storage, BufferPool(GEOM, slots, mem), t, t.register(mem).region_id)
    m.prefetcher = Prefetcher(m.buffer, lambda: m.storage, accounting, share)
    return m


def stored(m, n, seed=0):
    keys = [bytes([seed, i]) * 8 for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.randint(0, 256, (GEOM.full_block_bytes,), dtype=torch.uint8, generator=g) for _ in keys]
    assert m.store(keys, blocks).result() == [None] * n
    return keys, blocks


def settle(p, held, timeout=5.0):
    end = time.monotonic() + timeout
    while p.stats()["held"] != held and time.monotonic() < end:
        time.sleep(0.005)
    assert p.stats()["held"] == held, p.stats()


@pytest.fixture
def m(tmp_path):
    m = manager(tmp_path)
    yield m
    m.prefetcher.close()


def test_prefetched_blocks_are_served_from_the_buffer_exactly(m):
    keys, blocks = stored(m, 3)
    m.prefetch(keys, hold_s=30)
    settle(m.prefetcher, 3)
    before = m.snapshot().get("storage_read:kv", 0)
    slots = m.buffer.allocate(4, "turn")
    extra, _ = stored(m, 1, seed=9)  # one block the prefetch did not cover: read from storage
    assert m.load(keys + extra, slots).result() == [None] * 4
    for s, b in zip(slots, blocks):
        assert torch.equal(m.buffer.slot_bytes(s), b)
    snap = m.snapshot()
    assert snap["storage_read:kv"] - before == GEOM.full_block_bytes  # only the block not prefetched
    assert snap["prefetch_hit:kv"] == 3 * GEOM.full_block_bytes
    assert m.prefetcher.stats()["used"] == 3


def test_layerwise_loads_take_prefetched_blocks_and_read_the_rest_per_layer(m):
    keys, blocks = stored(m, 2)
    m.prefetch(keys[:1], hold_s=30)
    settle(m.prefetcher, 1)
    slots = m.buffer.allocate(2, "turn")
    futures = m.load_layers(keys, slots)
    assert [f.result(5) for f in futures] == [[None, None]] * GEOM.num_layers
    for s, b in zip(slots, blocks):
        assert torch.equal(m.buffer.slot_bytes(s), b)
    assert m.snapshot()["storage_read:kv"] == GEOM.full_block_bytes  # block 1, layer by layer


def test_a_request_that_needs_room_takes_prefetched_slots_first(m):
    keys, _ = stored(m, 4)
    m.prefetch(keys, hold_s=30)
    settle(m.prefetcher, 4)  # half the 8 slots: the share
    got = m.buffer.allocate(7, "demand", wait_s=0)  # needs 3 of the prefetched ones
    assert len(got) == 7 and len(m.buffer.allocator.owned_by(OWNER)) == 1
    s = m.prefetcher.stats()
    assert s["held"] == 1 and s["wasted"] == 3  # the least recently used went, never used
    assert m.prefetcher._ready and next(iter(m.prefetcher._ready)) == keys[3]


def test_share_bounds_what_prefetch_holds(m):
    keys, _ = stored(m, 6)
    m.prefetch(keys, hold_s=30)
    settle(m.prefetcher, 4)
    time.sleep(0.05)
    s = m.prefetcher.stats()
    assert s["held"] == 4 and s["skipped"] == 2 and m.buffer.num_free == 4


def test_unused_blocks_are_freed_after_their_hold_and_counted_wasted(m):
    keys, _ = stored(m, 2)
    m.prefetch(keys, hold_s=0.2)
    settle(m.prefetcher, 2)
    settle(m.prefetcher, 0, timeout=3.0)
    assert m.prefetcher.stats()["wasted"] == 2 and m.buffer.leaks() == {}


def test_prefetch_waits_while_demand_reads_wait(tmp_path):
    m = manager(tmp_path)
    try:
        keys, _ = stored(m, 2)
        m.prefetcher.accounting.enqueue(1, 1000)  # a demand read queued and not started
        m.prefetch(keys, hold_s=30)
        time.sleep(0.2)
        assert m.prefetcher.stats()["loaded"] == 0
        m.prefetcher.accounting.start(1000)
        m.prefetcher.accounting.finish(1000)
        settle(m.prefetcher, 2)
    finally:
        m.prefetcher.close()


def test_a_missing_block_ends_the_order_there(m):
    keys, _ = stored(m, 3)
    m.storage.delete([keys[1]]).result()
    m.prefetch(keys, hold_s=30)
    settle(m.prefetcher, 1)
    time.sleep(0.05)
    s = m.prefetcher.stats()
    assert s["loaded"] == 1 and s["skipped"] == 2 and m.buffer.num_free == 7


def test_an_order_stops_when_its_turn_comes_so_no_block_is_read_twice(tmp_path):
    m = manager(tmp_path, slots=16, bps=GEOM.full_block_bytes * 10)  # 10 blocks/s: the order takes 0.6 s
    try:
        keys, blocks = stored(m, 6)
        m.prefetch(keys, hold_s=30)
        settle(m.prefetcher, 1)
        slots = m.buffer.allocate(6, "turn")
        assert m.load(keys, slots).result(5) == [None] * 6  # the turn: what is not in yet comes from storage
        for s, b in zip(slots, blocks):
            assert torch.equal(m.buffer.slot_bytes(s), b)
        time.sleep(0.3)
        st = m.prefetcher.stats()
        assert st["loaded"] < 6 and st["loaded"] + st["skipped"] >= 6  # the rest of the order was dropped
        assert m.prefetcher._current.over
    finally:
        m.prefetcher.close()
