"""Planner, buffer pool, layer pipeline and verbs work requests: invariants checked on plain data."""

import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dualpath.core.errors import OutOfBlocksError, TransportError
from dualpath.core.geometry import FullBlockSlots, KVGeometry, LayerMajorBlocks
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.manager import LayerPipeline
from dualpath.traffic.memory import HostMemory
from dualpath.traffic.planner import merge_segments, plan_segments
from dualpath.traffic.transport.base import Op, Segment

GEOM = KVGeometry(num_layers=3, block_size=4, kv_elems_per_token=2, dtype="float32")  # 8 B/token, 32 B/layer block


def byte_map(segments):
    out = {}
    for s in segments:
        for i in range(s.nbytes):
            key = (s.local_region, s.local_offset + i)
            assert key not in out, "segments overlap on the local side"
            out[key] = (s.remote_region, s.remote_offset + i)
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_planned_segments_cover_exactly_the_requested_bytes(data):
    n = data.draw(st.integers(1, 6))
    local_slots = data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True))
    remote_slots = data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True))
    layers = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
    first = data.draw(st.integers(0, n * 4))
    last = data.draw(st.integers(first, n * 4))
    local = data.draw(st.sampled_from([FullBlockSlots(GEOM, 8), LayerMajorBlocks(GEOM, 8)]))
    remote = data.draw(st.sampled_from([FullBlockSlots(GEOM, 8), LayerMajorBlocks(GEOM, 8)]))
    segs = plan_segments(1, local, local_slots, 2, remote, remote_slots, layers, (first, last))
    expected = {}
    for layer in layers:
        for tok in range(first, last):
            j, t = divmod(tok, 4)
            for b in range(GEOM.token_bytes):
                lo = local.offset(local_slots[j], layer) + t * 8 + b
                expected[(1, lo)] = (2, remote.offset(remote_slots[j], layer) + t * 8 + b)
    assert byte_map(segs) == expected
    assert all(s.nbytes > 0 for s in segs)
    # merged: no two segments continue each other on both sides
    assert merge_segments(segs) == segs


def test_contiguous_runs_merge_into_one_segment():
    segs = plan_segments(1, FullBlockSlots(GEOM, 8), [2, 3, 4], 2, FullBlockSlots(GEOM, 8), [5, 6, 7], range(3))
    assert segs == [Segment(1, 2 * 96, 2, 5 * 96, 3 * 96)]
    paged = plan_segments(1, LayerMajorBlocks(GEOM, 8), [0, 1], 2, LayerMajorBlocks(GEOM, 8), [4, 5], [1])
    assert paged == [Segment(1, 8 * 32, 2, 12 * 32, 64)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 4)), max_size=40))
def test_buffer_pool_never_overlaps_or_leaks(ops):
    pool = BufferPool(GEOM, 8, HostMemory(8 * GEOM.full_block_bytes))
    held = {}
    for owner, n in ops:
        if n == 0:
            freed = pool.free_owner(owner)
            assert freed == len(held.pop(owner, []))
        else:
            try:
                held.setdefault(owner, []).extend(pool.allocate(n, owner))
            except OutOfBlocksError:
                assert pool.num_free < n
        pool.check()
        flat = [s for v in held.values() for s in v]
        assert len(flat) == len(set(flat)) and pool.num_free + len(flat) == 8
        assert {o: sorted(v) for o, v in pool.leaks().items()} == {o: sorted(v) for o, v in held.items() if v}


def test_buffer_slot_views_follow_the_full_block_layout():
    pool = BufferPool(GEOM, 4, HostMemory(4 * GEOM.full_block_bytes))
    pool.memory.tensor.copy_(torch.arange(pool.memory.nbytes) % 251)
    s = pool.slot_bytes(2)
    assert s.data_ptr() - pool.memory.address == 2 * GEOM.full_block_bytes
    rows = torch.empty(8, 2)
    pool.layer_to_device([3, 1], 2, rows)  # one layer of two slots, in the given order
    raw = rows.view(torch.uint8).reshape(-1)
    start = FullBlockSlots(GEOM, 4).offset(3, 2)
    assert torch.equal(raw[:32], pool.memory.tensor[start : start + 32])
    full = pool.full_blocks([3, 1])  # whole slots, in the given order
    assert torch.equal(full[0], pool.slot_bytes(3)) and torch.equal(full[1], pool.slot_bytes(1))


class FakeHandle:
    """Test double for a transfer: completes after ``delay`` seconds, or fails."""

    def __init__(self, delay=0.0, fail=False):
        self.ready = time.perf_counter() + delay
        self.fail = fail

    def wait(self, timeout=None):
        time.sleep(max(0.0, self.ready - time.perf_counter()))
        if self.fail:
            raise TransportError("boom")

    def add_done_callback(self, fn):
        threading.Timer(max(0.0, self.ready - time.perf_counter()), fn).start()


def test_layer_pipeline_prefetches_ahead_and_overlaps():
    issued, events = [], []
    lock = threading.Lock()

    def fetch(layer):
        with lock:
            issued.append(layer)
        return FakeHandle(0.05)

    pipe = LayerPipeline(6, fetch, lambda layer: FakeHandle(0.0), depth=1)
    t = time.perf_counter()
    pipe.begin()
    assert issued == [0, 1]
    for layer in range(6):
        pipe.wait_layer(layer)
        events.append(("compute", layer, list(issued)))
        time.sleep(0.05)  # compute as long as a fetch: fetches hide behind it
        pipe.layer_done(layer)
    pipe.finish()
    elapsed = time.perf_counter() - t
    assert issued == list(range(6))
    assert events[0][2] == [0, 1]  # layer 1 is in flight while layer 0 computes
    assert events[1][2] == [0, 1, 2]  # layer 2 went out once layer 0 was done with its slot
    assert elapsed < 6 * 0.05 + 0.05 + 0.1  # not 6 × (fetch + compute)


def test_layer_pipeline_reports_failed_sends_at_finish():
    pipe = LayerPipeline(2, lambda layer: None, lambda layer: FakeHandle(fail=layer == 1))
    pipe.begin()
    for layer in range(2):
        pipe.wait_layer(layer)
        pipe.layer_done(layer)
    with pytest.raises(TransportError, match="boom"):
        pipe.finish()


def test_deferred_sends_start_in_order_once_computed_and_never_block_the_engine():
    """``layer_done(l, computed)`` returns at once; the sender thread starts layer l's send only after
    ``computed()`` returns (the device has run the layer), layer after layer."""
    done = [threading.Event() for _ in range(4)]
    sent, lock = [], threading.Lock()

    def send(layer):
        with lock:
            sent.append((layer, done[layer].is_set()))
        return FakeHandle(0.0)

    pipe = LayerPipeline(4, lambda layer: None, send, depth=1, timeout=5)
    pipe.begin()
    t = time.perf_counter()
    for layer in range(2):
        pipe.wait_layer(layer)
        pipe.layer_done(layer, done[layer].wait)
    assert time.perf_counter() - t < 0.5 and sent == []  # nothing computed yet: nothing sent, nobody blocked
    done[1].set()
    time.sleep(0.1)
    assert sent == []  # layer 1 is computed, but layer 0's send comes first
    done[0].set()
    for layer in range(2, 4):
        pipe.wait_layer(layer)  # fetched once the send of layer - 2 was out
        done[layer].set()
        pipe.layer_done(layer, done[layer].wait)
    pipe.finish()
    assert sent == [(0, True), (1, True), (2, True), (3, True)]
    assert pipe._sender is None  # the thread has ended


def test_a_send_failing_in_the_sender_thread_raises_in_the_engine_thread():
    def send(layer):
        if layer == 0:
            raise TransportError("peer gone")
        return FakeHandle(0.0)

    pipe = LayerPipeline(4, lambda layer: None, send, depth=1, timeout=5)
    pipe.begin()
    with pytest.raises(TransportError, match="peer gone"):  # at the latest at layer 2's wait: it is never fetched
        for layer in range(4):
            pipe.wait_layer(layer)
            pipe.layer_done(layer, lambda: None)
    assert layer <= 2
    pipe.abandon()
    assert pipe._sender is None


def test_abandoning_starts_no_more_sends():
    gate, sent = threading.Event(), []
    pipe = LayerPipeline(3, lambda layer: None, lambda layer: sent.append(layer), depth=1, timeout=5)
    pipe.begin()
    pipe.wait_layer(0)
    pipe.layer_done(0, gate.wait)
    threading.Timer(0.1, gate.set).start()  # the device finishes layer 0 while the engine gives up
    pipe.abandon()
    assert sent == [] and pipe._sender is None


def test_verbs_queue_pairs_carry_the_kv_service_level_and_segments_map_to_work_requests():
    pytest.importorskip("dualpath.traffic.transport.verbs")
    from dualpath.core.config import TransportConfig
    from dualpath.core.errors import ConfigError
    from dualpath.traffic.transport.base import Priority
    from dualpath.traffic.transport.verbs import QPInfo, import_pyverbs, qp_attr, work_requests

    try:
        pv = import_pyverbs()
    except ConfigError:
        pytest.skip("pyverbs is not installed (apt install python3-pyverbs)")
    e = pv.enums
    cfg = TransportConfig(name="verbs", kv_service_level=5, kv_traffic_class=96)
    remote = QPInfo(qp_num=77, lid=3, gid="", psn=1234)
    low = qp_attr(cfg, Priority.LOW, remote, 4321)
    assert low.ah_attr.sl == 5 and low.dest_qp_num == 77 and low.rq_psn == 1234 and low.ah_attr.dlid == 3
    assert low.sq_psn == 4321  # sends from the PSN it told the peer, which expects it
    assert qp_attr(cfg, Priority.HIGH, remote, 4321).ah_attr.sl == 0
    roce = qp_attr(cfg, Priority.LOW, QPInfo(78, 0, "fe80:0000:0000:0000:0000:0000:0000:0001", 5), 6)
    assert roce.ah_attr.is_global == 1 and roce.ah_attr.traffic_class == 96
    segs = [Segment(1, 0, 9, 4096, 100), Segment(2, 64, 9, 0, 50)]
    wrs = work_requests(Op.READ, segs, {1: (1000, 11), 2: (5000, 22)}, {9: (1 << 20, 99)})
    assert [w.opcode for w in wrs] == [e.IBV_WR_RDMA_READ] * 2
    assert [w.num_sge for w in wrs] == [1, 1]
    assert wrs[0].send_flags == 0 and wrs[1].send_flags == e.IBV_SEND_SIGNALED
    assert [w.wr_id for w in wrs] == [0, 1]
    writes = work_requests(Op.WRITE, segs[:1], {1: (1000, 11)}, {9: (1 << 20, 99)})
    assert writes[0].opcode == e.IBV_WR_RDMA_WRITE


def test_verbs_without_a_device_is_a_clear_error():
    from dualpath.core.config import TransportConfig
    from dualpath.core.errors import ConfigError
    from dualpath.traffic.transport import make_transport

    with pytest.raises(ConfigError, match="RDMA|pyverbs"):
        make_transport(TransportConfig(name="verbs"), "me")


def test_segments_of_a_killed_process_are_removed_by_pid():
    """A SIGKILLed process cannot unlink its shared memory; whoever knows it is gone removes it by its pid."""
    import os
    import signal
    import subprocess
    import sys

    from dualpath.traffic.memory import SEGMENT_PREFIX, SHM_DIR, remove_segments

    code = (
        "import time; from dualpath.traffic.memory import HostMemory; m = HostMemory(1 << 16, shared=True); "
        "print(m.name, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name.startswith(f"{SEGMENT_PREFIX}{proc.pid}-") and os.path.exists(os.path.join(SHM_DIR, name))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert os.path.exists(os.path.join(SHM_DIR, name))  # leaked: nothing ran in the process
    assert remove_segments(proc.pid) == 1 and not os.path.exists(os.path.join(SHM_DIR, name))
    assert remove_segments(proc.pid) == 0


def test_a_full_buffer_is_waited_out_up_to_a_limit():
    """Slots freed by another thread (a request's KV moving on) satisfy a waiting allocation; a wait that ends
    unsatisfied, and a request larger than the arena (at once), raise."""
    pool = BufferPool(GEOM, 6, HostMemory(6 * GEOM.full_block_bytes))
    held = pool.allocate(5, "a")
    threading.Timer(0.2, pool.free_owner, args=("a",)).start()
    t = time.perf_counter()
    assert len(pool.allocate(4, "b", wait_s=10)) == 4
    assert 0.15 < time.perf_counter() - t < 5
    with pytest.raises(OutOfBlocksError):
        pool.allocate(3, "c", wait_s=0.1)
    t = time.perf_counter()
    with pytest.raises(OutOfBlocksError):
        pool.allocate(7, "d", wait_s=10)
    assert time.perf_counter() - t < 1 and pool.num_free == 2 and held


def test_work_queued_for_a_full_buffer_waits_while_it_moves_and_fails_when_it_is_stuck():
    """Slots freed one at a time, each within a window but all of them over several: the request waits its turn
    (a single bounded wait would have failed it). A window that frees nothing, or a request cancelled meanwhile,
    ends the wait with an error instead of a hang."""
    pool = BufferPool(GEOM, 4, HostMemory(4 * GEOM.full_block_bytes))
    held = pool.allocate(4, "a")
    for i, slot in enumerate(held):
        threading.Timer(0.15 * (i + 1), pool.free, args=([slot],)).start()
    t = time.perf_counter()
    assert len(pool.allocate_while_moving(4, "b", window_s=0.25)) == 4
    assert 0.5 < time.perf_counter() - t < 5
    t = time.perf_counter()
    with pytest.raises(OutOfBlocksError):  # nothing frees: one window, then an error
        pool.allocate_while_moving(1, "c", window_s=0.2)
    assert time.perf_counter() - t < 1
    threading.Timer(0.1, pool.free, args=(pool.allocator.owned_by("b")[:1],)).start()
    with pytest.raises(OutOfBlocksError):  # slots moved, but the request was cancelled: it stops waiting
        pool.allocate_while_moving(2, "d", window_s=0.2, go_on=lambda: False)
