"""The transport contract's own bookkeeping (``traffic/transport/base.py``) on the in-process ``local`` backend, at
the edges the contract tests leave open (found by ``bench/mutation.py``): how a batch is cut into pieces, what a
handle reports, the priority gate's count, region descriptors, peers that move or leave, and validation limits."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dualpath.core.config import TransportConfig
from dualpath.core.errors import PeerDeadError, SegmentError, TransferTimeoutError, TransportError
from dualpath.traffic.memory import HostMemory
from dualpath.traffic.transport.base import (
    Op,
    Priority,
    RegionDesc,
    Segment,
    TransferHandle,
    _HighGate,
    _Lane,
    copy_bytes,
)
from dualpath.traffic.transport.local import LocalHub, LocalTransport

CONFIG = TransportConfig(name="local", op_timeout_s=5.0)


@pytest.fixture
def pair():
    hub = LocalHub()
    me, peer = LocalTransport(CONFIG, "me", hub), LocalTransport(CONFIG, "peer", hub)
    mine, theirs = HostMemory(1000), HostMemory(1000)
    theirs.tensor.copy_(torch.arange(1000) % 251)
    lid, rid = me.register(mine).region_id, peer.register(theirs).region_id
    me.add_peer("peer", peer.address(), peer.regions())
    yield me, peer, mine, lid, rid
    me.close()
    peer.close()


def _pieces(priority, segments, chunk=100):
    lane = _Lane.__new__(_Lane)
    lane.priority, lane.transport = priority, SimpleNamespace(config=SimpleNamespace(chunk_bytes=chunk))
    return list(lane._pieces(segments))


def test_low_priority_batches_are_cut_into_chunks_across_segments_and_high_ones_are_not():
    segs = [Segment(1, 0, 2, 500, 150), Segment(1, 1000, 2, 0, 130)]
    pieces = _pieces(Priority.LOW, segs)
    assert pieces == [
        [Segment(1, 0, 2, 500, 100)],
        [Segment(1, 100, 2, 600, 50), Segment(1, 1000, 2, 0, 50)],
        [Segment(1, 1050, 2, 50, 80)],
    ]
    assert _pieces(Priority.LOW, [Segment(1, 0, 2, 0, 200)]) == [
        [Segment(1, 0, 2, 0, 100)],
        [Segment(1, 100, 2, 100, 100)],
    ]
    assert _pieces(Priority.HIGH, segs) == [segs]
    assert _pieces(Priority.LOW, []) == []


def test_a_handle_reports_done_errors_and_calls_back_once():
    h = TransferHandle(10, Priority.LOW)
    assert not h.done() and h.finished_at is None and (h.nbytes, h.priority) == (10, Priority.LOW)
    with pytest.raises(TransferTimeoutError, match="10 bytes"):
        h.wait(0.01)
    calls = []
    h.add_done_callback(lambda: calls.append("early"))
    h._finish(TransportError("boom"))
    assert h.done() and h.finished_at >= h.submitted_at and calls == ["early"]
    h.add_done_callback(lambda: calls.append("late"))  # already done: at once
    assert calls == ["early", "late"]
    with pytest.raises(TransportError, match="boom"):
        h.wait(1)
    ok = TransferHandle(0, Priority.HIGH)
    ok._finish()
    ok.wait(0)


def test_the_gate_counts_high_priority_work_and_wakes_waiters_when_it_drains():
    gate = _HighGate()
    gate.wait_idle(0)  # idle: at once
    gate.enter()
    gate.enter()
    t = time.monotonic()
    gate.wait_idle(0.05)  # busy: waits out the timeout
    assert time.monotonic() - t >= 0.04
    gate.leave()
    done = threading.Event()
    threading.Thread(target=lambda: (gate.wait_idle(5), done.set()), daemon=True).start()
    assert not done.wait(0.05)  # one still in flight
    gate.leave()
    assert done.wait(2)


def test_regions_are_numbered_from_1_and_described(pair):
    me, peer, mine, lid, rid = pair
    assert lid == 1 and rid == 1
    t = torch.zeros(3, 4, dtype=torch.float32)
    desc = me.register(t)
    assert desc == RegionDesc("me", 2, 48, t.data_ptr(), "cpu", None, {})
    assert RegionDesc.from_dict(desc.to_dict()) == desc and desc.to_dict()["nbytes"] == 48
    assert [d.region_id for d in me.regions()] == [1, 2]
    assert me.describe(1).nbytes == 1000 and me.local_tensor(2).numel() == 48
    shm = HostMemory(64, shared=True)
    try:
        assert me.register(shm).shm_name == shm.name
    finally:
        shm.close()
    assert me.remote_desc("peer", rid) == peer.describe(rid)


def test_transfers_land_and_empty_batches_finish_at_once(pair):
    me, peer, mine, lid, rid = pair
    empty = me.submit("peer", Op.READ, [])
    assert empty.done() and empty.nbytes == 0 and not me._lanes  # no lane opened for nothing
    h = me.submit("peer", Op.READ, [Segment(lid, 0, rid, 250, 300)], Priority.LOW)
    h.wait(5)
    assert torch.equal(mine.tensor[:300], peer.local_tensor(rid)[250:550]) and h.nbytes == 300
    mine.tensor[:10] = 7
    me.submit("peer", Op.WRITE, [Segment(lid, 0, rid, 990, 10)], Priority.HIGH).wait(5)
    assert peer.local_tensor(rid)[990:].eq(7).all()


def test_segments_at_a_regions_edges(pair):
    me, peer, mine, lid, rid = pair
    me.submit("peer", Op.READ, [Segment(lid, 999, rid, 999, 1)]).wait(5)  # the last byte of both: fine
    for bad in (
        Segment(lid, 0, rid, 0, 0),
        Segment(lid, -1, rid, 0, 1),
        Segment(lid, 0, rid, -1, 1),
        Segment(lid, 1000, rid, 0, 1),
        Segment(lid, 0, rid, 1000, 1),
    ):
        with pytest.raises(SegmentError):
            me.submit("peer", Op.READ, [bad])


def test_a_backend_that_needs_shared_memory_refuses_a_region_outside_it(pair):
    me, peer, mine, lid, rid = pair
    me.remote_needs_shared_memory = True
    with pytest.raises(SegmentError, match="shared memory"):
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 1)])


def test_peers_learn_regions_move_and_leave(pair):
    me, peer, mine, lid, rid = pair
    me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)]).wait(5)
    lane = me._lanes[("peer", Priority.LOW)]
    extra = peer.register(HostMemory(50))
    me.update_peer_regions("peer", [extra])
    assert me.remote_desc("peer", extra.region_id) == extra and me.remote_desc("peer", rid).nbytes == 1000
    me.add_peer("peer", peer.address(), peer.regions())  # same address: lanes kept
    assert me._lanes[("peer", Priority.LOW)] is lane
    me.add_peer("peer", {"endpoint": "elsewhere"}, peer.regions())  # moved: old lanes dropped
    assert not me._lanes
    lane.join(2)
    assert not lane.is_alive()
    me.update_peer_regions("new", [extra])
    assert me.remote_desc("new", extra.region_id) == extra
    me.remove_peer("peer")
    assert "peer" not in me._peer_address and "peer" not in me._peer_regions
    with pytest.raises(SegmentError, match="unknown peer"):
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 1)])
    me.remove_peer("peer")  # twice: nothing


def test_a_closed_transport_refuses_work_and_closes_once(pair):
    me, peer, mine, lid, rid = pair
    me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)], Priority.HIGH).wait(5)
    lanes = list(me._lanes.values())
    with me:
        pass
    assert not me._lanes and all(not lane.is_alive() for lane in lanes) and "me" not in me.hub.endpoints
    with pytest.raises(TransportError, match="closed"):
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 1)])
    me.close()


def test_copy_bytes_copies():
    dst = torch.zeros(4, dtype=torch.uint8)
    copy_bytes(dst, torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert dst.tolist() == [1, 2, 3, 4]


class Recording(LocalTransport):
    """A backend double: the local backend, recording what the base hands its hooks, failing or stalling on demand."""

    def __init__(self, config, endpoint, hub):
        super().__init__(config, endpoint, hub)
        self.connects, self.checks, self.fail, self.stall = [], [], None, None

    def _connect(self, peer, address, priority):
        self.connects.append((peer, address, priority))
        return super()._connect(peer, address, priority)

    def _check_peer(self, peer, conn):
        self.checks.append(peer)
        super()._check_peer(peer, conn)

    def _describe(self, region):
        return {"rkey": 10 * region.region_id}

    def _execute(self, conn, op, segments):
        if self.stall is not None:
            self.stall.wait(10)
        if self.fail is not None:
            raise self.fail
        super()._execute(conn, op, segments)


@pytest.fixture
def recording():
    hub = LocalHub()
    config = TransportConfig(name="local", chunk_bytes=4096, op_timeout_s=0.3)
    me, peer = Recording(config, "me", hub), LocalTransport(config, "peer", hub)
    mine, theirs = HostMemory(1 << 19), HostMemory(1 << 19)
    lid, rid = me.register(mine).region_id, peer.register(theirs).region_id
    me.add_peer("peer", peer.address(), peer.regions())
    yield me, lid, rid
    me.close()
    peer.close()


def test_a_backend_is_handed_its_peer_and_one_lane_per_class(recording):
    me, lid, rid = recording
    assert me.describe(lid).extra == {"rkey": 10}
    h = me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)], Priority.HIGH)
    assert h.priority is Priority.HIGH
    h.wait(5)
    me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)]).wait(5)
    lane = me._lanes[("peer", Priority.LOW)]
    me.submit("peer", Op.WRITE, [Segment(lid, 0, rid, 0, 10)]).wait(5)
    assert me._lanes[("peer", Priority.LOW)] is lane and lane.peer == "peer"
    assert (lane.name, lane.daemon) == ("lane-local-peer-low", True)
    assert me.connects == [("peer", {"endpoint": "peer"}, Priority.HIGH), ("peer", {"endpoint": "peer"}, Priority.LOW)]
    assert set(me.checks) == {"peer"}


def test_a_lane_probes_its_peer_at_most_every_20_ms(recording):
    me, lid, rid = recording
    start = time.monotonic()
    me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 100 * 4096)]).wait(30)  # 100 pieces
    bound = (time.monotonic() - start) / 0.02 + 2
    assert 1 <= len(me.checks) <= min(bound, 50)


def test_a_backend_error_reaches_the_waiter_as_a_transport_error(recording):
    me, lid, rid = recording
    me.fail = ValueError("the disk")
    with pytest.raises(TransportError, match="local transfer to peer failed: ValueError") as e:
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)]).wait(5)
    assert type(e.value) is TransportError
    me.fail = PeerDeadError("gone")  # already a transport error: as raised
    with pytest.raises(PeerDeadError, match="gone"):
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)]).wait(5)


def test_low_priority_waits_for_high_priority_work_at_most_the_op_timeout(recording):
    me, lid, rid = recording
    me._gate.enter()  # a high-priority transfer that never ends
    try:
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)]).wait(5)
    finally:
        me._gate.leave()


def test_close_gives_a_stalled_lane_at_most_the_op_timeout(recording):
    me, lid, rid = recording
    me.stall = threading.Event()
    h = me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 10)])
    start = time.monotonic()
    me.close()
    assert time.monotonic() - start < 3 and not h.done()
    me.stall.set()
    h.wait(5)


def test_a_backend_that_needs_shared_memory_allocates_it():
    t = LocalTransport(TransportConfig(name="local"), "shared", LocalHub())
    t.remote_needs_shared_memory = True
    mem = t.allocate(64)
    try:
        assert mem.name is not None
    finally:
        mem.close()
        t.close()
