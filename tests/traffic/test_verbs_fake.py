"""The verbs transport's data path — memory registration, queue-pair connection, work requests, completions —
through a fake RDMA device behind pyverbs' interface (tests/support/fake_pyverbs.py, installed here only): two
``VerbsTransport`` endpoints in this process move bytes by RDMA READ/WRITE through the fake, which checks keys,
bounds, access, addresses and packet sequence numbers as hardware would and completes only signaled work
requests (or failed ones)."""

import time

import pytest
import torch

from dualpath.core.config import TransportConfig
from dualpath.core.errors import PeerDeadError, TransferTimeoutError
from dualpath.traffic.transport import Op, Priority, Segment
from dualpath.traffic.transport import verbs
from fake_pyverbs import Enums, FakeFabric

REGION = 1 << 20
CONFIG = TransportConfig(name="verbs", chunk_bytes=64 << 10, op_timeout_s=2.0, kv_service_level=5, kv_traffic_class=96)


def _pattern(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["ib", "roce"])
def fabric(request, monkeypatch):
    fabric = FakeFabric(link_layer=request.param)
    monkeypatch.setattr(verbs, "import_pyverbs", lambda: fabric.pyverbs)
    return fabric


@pytest.fixture
def pair(fabric):
    """Endpoints "a" and "b", each with two registered regions (``b``'s hold a pattern); ``a`` knows ``b``."""
    a, b = verbs.VerbsTransport(CONFIG, "a"), verbs.VerbsTransport(CONFIG, "b")
    mems = {}
    for t in (a, b):
        mems[t.endpoint] = [t.allocate(REGION), t.allocate(REGION)]
        for m in mems[t.endpoint]:
            t.register(m)
    for i, m in enumerate(mems["b"]):
        m.tensor.copy_(_pattern(i, REGION))
    a.add_peer("b", b.address(), b.regions())
    yield fabric, a, b, mems
    a.close()
    b.close()


def _segments(a, b, seed: int, n: int = 24, size: int = 20_000) -> list[Segment]:
    """``n`` segments over both regions of each side, none overlapping another on either side (odd offsets)."""
    g = torch.Generator().manual_seed(seed)
    local, remote = [r.region_id for r in a.regions()], [r.region_id for r in b.regions()]
    slots = REGION // (size + 64)
    lo, ro = torch.randperm(2 * slots, generator=g)[:n].tolist(), torch.randperm(2 * slots, generator=g)[:n].tolist()
    return [
        Segment(local[x // slots], x % slots * (size + 64), remote[y // slots], y % slots * (size + 64) + 17, size)
        for x, y in zip(lo, ro)
    ]


@pytest.mark.parametrize("priority", [Priority.LOW, Priority.HIGH])
def test_reads_and_writes_land_byte_exact_one_chain_a_piece_only_its_last_signaled(pair, priority):
    fabric, a, b, mems = pair
    segs = _segments(a, b, seed=int(priority))
    a.submit("b", Op.READ, segs, priority).wait(10)
    for s in segs:
        want = mems["b"][s.remote_region - 1].tensor[s.remote_offset : s.remote_offset + s.nbytes]
        assert torch.equal(mems["a"][s.local_region - 1].tensor[s.local_offset : s.local_offset + s.nbytes], want)
    reads = list(fabric.posted)
    for m in mems["a"]:
        m.tensor.copy_(_pattern(9, REGION))
    a.submit("b", Op.WRITE, segs, priority).wait(10)
    for s in segs:
        got = mems["b"][s.remote_region - 1].tensor[s.remote_offset : s.remote_offset + s.nbytes]
        assert torch.equal(got, mems["a"][s.local_region - 1].tensor[s.local_offset : s.local_offset + s.nbytes])

    writes = fabric.posted[len(reads) :]
    total = sum(s.nbytes for s in segs)
    # low priority: pieces of at most chunk_bytes, each one chain; high priority: the whole batch in one chain
    pieces = -(-total // CONFIG.chunk_bytes) if priority is Priority.LOW else 1
    for chains, opcode in ((reads, Enums.IBV_WR_RDMA_READ), (writes, Enums.IBV_WR_RDMA_WRITE)):
        assert len(chains) >= pieces and sum(wr.sg[0].length for _, c in chains for wr in c) == total
        for _, chain in chains:
            assert [wr.wr_id for wr in chain] == list(range(len(chain)))
            assert {wr.opcode for wr in chain} == {opcode} and {wr.num_sge for wr in chain} == {1}
            assert [bool(wr.send_flags & Enums.IBV_SEND_SIGNALED) for wr in chain] == [False] * (len(chain) - 1) + [
                True
            ]
            if priority is Priority.LOW:
                assert sum(wr.sg[0].length for wr in chain) <= CONFIG.chunk_bytes
    assert {qpn for qpn, _ in fabric.posted} == {a._lanes[("b", priority)].conn[1].qp_num}  # the class's lane
    # one completion a chain, each polled: nothing is left behind for the next transfer to mistake for its own
    assert all(qp.init.scq.pending() == 0 for qp in fabric.connected())


def test_each_class_has_its_queue_pair_on_its_service_level_connected_to_the_peers(pair):
    """One RC queue pair per peer and class each side; the KV (low-priority) one on ``kv_service_level`` (and on
    RoCE ``kv_traffic_class`` in its global route), the control one on 0; each addresses the other's QP number and
    port, and sends from the PSN the other expects."""
    fabric, a, b, _ = pair
    for p in (Priority.LOW, Priority.HIGH):
        a.submit("b", Op.READ, [Segment(1, 0, 1, 0, 4096)], p).wait(10)
    mine = {p: a._lanes[("b", p)].conn[1] for p in (Priority.LOW, Priority.HIGH)}
    assert len(fabric.connected()) == 4 and len(b._accepted) == 2
    for p, qp in mine.items():
        theirs = fabric.qps[qp.remote_qpn]
        assert theirs.remote_qpn == qp.qp_num and (theirs.pd, qp.pd) == (b.pd, a.pd)
        assert qp.sq_psn == theirs.rq_psn and theirs.sq_psn == qp.rq_psn
        low = p is Priority.LOW
        for side in (qp, theirs):
            assert side.ah.sl == (CONFIG.kv_service_level if low else 0)
            if fabric.link_layer == "roce":
                assert side.ah.is_global and side.ah.traffic_class == (CONFIG.kv_traffic_class if low else 0)
            else:
                assert not side.ah.is_global and side.ah.dlid == fabric.qps[side.remote_qpn].pd.ctx.lid


def test_a_failed_work_request_fails_its_transfer_and_the_next_one(pair):
    """The peer's regions deregistered (it closed): the READ completes with a remote access error, which is the
    waiter's ``PeerDeadError``; the queue pair is in error, so the next transfer fails too, never hangs."""
    fabric, a, b, _ = pair
    a.submit("b", Op.READ, [Segment(1, 0, 1, 0, 4096)]).wait(10)
    b.close()
    with pytest.raises(PeerDeadError, match=f"status {Enums.IBV_WC_REM_ACCESS_ERR}"):
        a.submit("b", Op.READ, [Segment(1, 0, 1, 0, 4096)]).wait(10)
    with pytest.raises(PeerDeadError, match="status"):
        a.submit("b", Op.READ, [Segment(1, 0, 1, 0, 4096)]).wait(10)


def test_a_transfer_without_completion_times_out(pair):
    fabric, a, _, _ = pair
    a.submit("b", Op.WRITE, [Segment(1, 0, 1, 0, 4096)]).wait(10)
    fabric.cut = True
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="no completion"):
        a.submit("b", Op.WRITE, [Segment(1, 0, 1, 0, 4096)]).wait(10)
    assert CONFIG.op_timeout_s <= time.monotonic() - start < CONFIG.op_timeout_s + 5
