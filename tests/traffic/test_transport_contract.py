"""One contract, every transport that can run here: byte-exact READ/WRITE batches between two processes,
bad segments rejected at submit, a dead peer reported within a timeout, and priority classes honoured."""

import time

import pytest
import torch

from dualpath.core.config import TransportConfig
from dualpath.core.errors import SegmentError, TransportError
from dualpath.traffic.transport import Op, Priority, Segment, make_transport
from dualpath.traffic.transport.local import LocalHub
from dualpath.traffic.transport.peer import PeerProcess, digest, pattern

BACKENDS = ["local", "shm", "ucx", "nixl"]
CONFIG = TransportConfig(op_timeout_s=5.0, chunk_bytes=1 << 20)
REGION_BYTES = 8 << 20


def _available(backend: str) -> bool:
    mod = {"ucx": "ucxx", "nixl": "nixl_cu12"}.get(backend)
    if mod is None:
        return True
    import importlib.util

    return importlib.util.find_spec(mod) is not None


class LocalPeer:
    """The same commands as a peer process, for the in-process ``local`` backend."""

    def __init__(self, hub, nbytes=REGION_BYTES):
        from dualpath.traffic.transport.local import LocalTransport

        self.t = LocalTransport(CONFIG, "peer", hub)
        self.mem = self.t.allocate(nbytes)
        self.mem.tensor.copy_(pattern(7, nbytes))
        self.t.register(self.mem)
        self.address, self.regions = self.t.address(), self.t.regions()

    def digest(self, lo, hi):
        return digest(self.mem.tensor[lo:hi])

    def kill(self):
        self.t.close()

    def stop(self):
        self.t.close()


def _peer(backend: str):
    if not _available(backend):
        pytest.skip(f"{backend} library not installed")
    hub = LocalHub() if backend == "local" else None
    config = TransportConfig(**{**CONFIG.__dict__, "name": backend})
    return (LocalPeer(hub) if backend == "local" else PeerProcess(config, REGION_BYTES)), config, hub


@pytest.fixture(scope="module", params=BACKENDS)
def shared_peer(request):
    """One peer process per backend for the tests that leave it as they found it (a peer's start is ~2 s of
    imports, most of this module's time)."""
    peer, config, hub = _peer(request.param)
    yield peer, config, hub
    peer.stop()


def _connected(peer, config, hub, name: str):
    me = make_transport(config, name, **({"hub": hub} if hub else {}))
    me.add_peer("peer", peer.address, peer.regions)
    mem = me.allocate(REGION_BYTES)
    local = me.register(mem)
    return me, mem, local.region_id, peer.regions[0].region_id, peer


@pytest.fixture
def pair(shared_peer, request):
    """This side's own new transport (named after the test: a peer sees each as a new agent) and the shared peer,
    whose region holds ``pattern(7)`` before and after every test."""
    peer, config, hub = shared_peer
    pair = _connected(peer, config, hub, f"me-{request.node.name}")
    yield pair
    pair[0].close()


@pytest.fixture(params=BACKENDS)
def own_pair(request):
    """A peer of the test's own, for a test that kills it."""
    peer, config, hub = _peer(request.param)
    pair = _connected(peer, config, hub, "me")
    yield pair
    pair[0].close()
    peer.stop()


def _segments(local_id, remote_id, n=64, size=40_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randperm(REGION_BYTES // size - 1, generator=g)[:n].tolist()
    return [Segment(local_id, i * size, remote_id, s * size + 17, size) for i, s in enumerate(starts)]


def test_read_batch_lands_byte_exact(pair):
    me, mem, lid, rid, peer = pair
    segs = _segments(lid, rid)
    me.submit("peer", Op.READ, segs).wait(30)
    remote = pattern(7, REGION_BYTES)
    for s in segs:
        assert torch.equal(
            mem.tensor[s.local_offset : s.local_offset + s.nbytes], remote[s.remote_offset : s.remote_offset + s.nbytes]
        )


def test_write_batch_lands_byte_exact(pair):
    me, mem, lid, rid, peer = pair
    mem.tensor.copy_(pattern(99, REGION_BYTES))
    segs = _segments(lid, rid, seed=1)
    me.submit("peer", Op.WRITE, segs).wait(30)
    for s in segs:
        assert peer.digest(s.remote_offset, s.remote_offset + s.nbytes) == digest(
            mem.tensor[s.local_offset : s.local_offset + s.nbytes]
        )
    # bytes outside the segments are untouched
    first = min(s.remote_offset for s in segs)
    if first > 0:
        assert peer.digest(0, first) == digest(pattern(7, REGION_BYTES)[:first])
    original = pattern(7, REGION_BYTES)  # put the peer's bytes back, for the tests that share it
    for s in segs:
        mem.tensor[s.local_offset : s.local_offset + s.nbytes] = original[s.remote_offset : s.remote_offset + s.nbytes]
    me.submit("peer", Op.WRITE, segs).wait(30)
    assert peer.digest(0, REGION_BYTES) == digest(original)


def test_large_segments_are_chunked_and_exact(pair):
    me, mem, lid, rid, peer = pair
    seg = Segment(lid, 0, rid, 0, REGION_BYTES)  # 8 chunks of 1 MiB
    me.submit("peer", Op.READ, [seg]).wait(30)
    assert digest(mem.tensor) == digest(pattern(7, REGION_BYTES))


def test_bad_segments_raise_at_submit(pair):
    me, mem, lid, rid, peer = pair
    with pytest.raises(SegmentError, match="outside region"):
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, REGION_BYTES - 10, 20)])
    with pytest.raises(SegmentError, match="outside region"):
        me.submit("peer", Op.WRITE, [Segment(lid, REGION_BYTES, rid, 0, 1)])
    with pytest.raises(SegmentError, match="not registered"):
        me.submit("peer", Op.READ, [Segment(lid, 0, rid + 100, 0, 10)])
    with pytest.raises(SegmentError, match="not registered"):
        me.submit("peer", Op.READ, [Segment(999, 0, rid, 0, 10)])
    with pytest.raises(SegmentError, match="unknown peer"):
        me.submit("nobody", Op.READ, [Segment(lid, 0, rid, 0, 10)])


def test_dead_peer_errors_within_timeout(own_pair):
    me, mem, lid, rid, peer = own_pair
    me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 4096)]).wait(30)  # connected and working
    # far more data than can move before the kill lands
    big = [Segment(lid, 0, rid, 0, REGION_BYTES)] * 2000
    handle = me.submit("peer", Op.READ, big)
    time.sleep(0.05)
    peer.kill()
    start = time.monotonic()
    with pytest.raises(TransportError):
        handle.wait(CONFIG.op_timeout_s + 10)
    assert time.monotonic() - start < CONFIG.op_timeout_s + 10


@pytest.mark.parametrize(
    "backend",
    [
        "shm",
        pytest.param("ucx", marks=pytest.mark.slow),  # ~7 s each: a peer
        pytest.param("nixl", marks=pytest.mark.slow),
    ],
)  # process started twice
def test_a_peer_restarted_under_its_name_is_reached_at_its_new_address(backend):
    """An engine restarted by its supervisor comes back under its old name at a new address: ``add_peer`` with that
    address must drop the old lanes and mappings, or every transfer goes to the dead process."""
    peer, config, hub = _peer(backend)
    me, mem, lid, rid, _ = _connected(peer, config, hub, "me")
    try:
        me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 4096)]).wait(30)
        peer.kill()
        peer = PeerProcess(config, REGION_BYTES)
        me.add_peer("peer", peer.address, peer.regions)
        me.submit("peer", Op.READ, [Segment(lid, 0, peer.regions[0].region_id, 0, 8192)]).wait(30)
        assert digest(mem.tensor[:8192]) == peer.digest(0, 8192)
    finally:
        me.close()
        peer.stop()


def test_high_priority_overtakes_bulk_low_priority(pair):
    """A small high-priority transfer submitted while a bulk low-priority one is moving finishes first. On a busy
    machine the bulk can finish before the urgent one is even submitted: that is no overtaking to judge, so the
    bulk is doubled and the race run again (up to four times)."""
    me, mem, lid, rid, peer = pair
    me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 4096)], Priority.HIGH).wait(30)  # warm both lanes
    me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 4096)], Priority.LOW).wait(30)
    for blocks in (32, 64, 128, 256):
        bulk = me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, REGION_BYTES)] * blocks, Priority.LOW)
        time.sleep(0.01)
        in_flight = not bulk.done()
        urgent = me.submit("peer", Op.READ, [Segment(lid, 0, rid, 0, 65536)], Priority.HIGH)
        urgent.wait(30)
        bulk.wait(120)
        if in_flight and not bulk.finished_at <= urgent.submitted_at:
            break
    else:
        pytest.fail("the bulk transfer never was still moving when the urgent one was submitted")
    assert urgent.finished_at < bulk.finished_at
