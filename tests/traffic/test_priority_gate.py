"""The priority gate of ``Transport`` (``traffic/transport/base.py``): while a high-priority transfer is in flight,
low-priority transfers stop between their pieces. Each class has a lane (thread) of its own, so on a link with room
for both the gate is invisible; here the lanes share one bounded link, as KV and control traffic share a NIC.

``SharedLinkTransport`` is a test double of a backend: a ``LocalTransport`` whose copies cross one link that moves
a quantum of bytes at a time, in the order the lanes asked (a ticket lock: two lanes moving at once share it
quantum by quantum, as two streams share a wire). The link logs each quantum's class, so the test asserts on order
and counts, not on timings of a busy machine."""

import threading
import time

from dualpath.core.config import TransportConfig
from dualpath.traffic.transport.base import Op, Priority, Segment
from dualpath.traffic.transport.local import LocalHub, LocalTransport

QUANTUM = 4096
CHUNK = 64 * 1024  # a low-priority piece: 16 quanta
LOW_BYTES, HIGH_BYTES = 8 << 20, 1 << 20


class Link:
    """One wire: a quantum at a time, lanes served in the order they asked (FIFO tickets)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._serving = 0
        self.log: list[Priority] = []

    def carry(self, priority: Priority, nbytes: int) -> None:
        for _ in range(0, nbytes, QUANTUM):
            with self._cond:
                ticket, self._next = self._next, self._next + 1
                self._cond.wait_for(lambda: self._serving == ticket)
            time.sleep(0.0002)  # the quantum on the wire (lets the other lane take its ticket meanwhile)
            with self._cond:
                self.log.append(priority)
                self._serving += 1
                self._cond.notify_all()


class SharedLinkTransport(LocalTransport):
    """Test double: ``LocalTransport`` whose every copy first crosses ``link``."""

    name = "shared-link"

    def __init__(self, config, endpoint, hub, link: Link):
        super().__init__(config, endpoint, hub)
        self.link = link

    def _connect(self, peer, address, priority):
        return super()._connect(peer, address, priority), priority

    def _check_peer(self, peer, conn):
        super()._check_peer(peer, conn[0])

    def _execute(self, conn, op, segments):
        target, priority = conn
        self.link.carry(priority, sum(s.nbytes for s in segments))
        super()._execute(target, op, segments)


def test_a_high_priority_transfer_overtakes_a_low_one_queued_first_on_a_shared_link():
    hub, link = LocalHub(), Link()
    config = TransportConfig(op_timeout_s=30.0, chunk_bytes=CHUNK)
    peer = LocalTransport(config, "peer", hub)
    me = SharedLinkTransport(config, "me", hub, link)
    try:
        remote = peer.register(peer.allocate(LOW_BYTES)).region_id
        me.add_peer("peer", peer.address(), peer.regions())
        local = me.register(me.allocate(LOW_BYTES)).region_id
        low = me.submit("peer", Op.READ, [Segment(local, 0, remote, 0, LOW_BYTES)], Priority.LOW)
        while len(link.log) < 64:  # the bulk is moving (4 pieces in)
            time.sleep(0.001)
        high = me.submit("peer", Op.READ, [Segment(local, 0, remote, 0, HIGH_BYTES)], Priority.HIGH)
        high.wait(60)
        low.wait(120)
    finally:
        me.close()
        peer.close()
    assert high.finished_at < low.finished_at  # completion order: the one submitted second ends first
    first = link.log.index(Priority.HIGH)
    last = len(link.log) - 1 - link.log[::-1].index(Priority.HIGH)
    during = link.log[first : last + 1].count(Priority.LOW)
    # while the urgent transfer moved, the bulk finished at most the piece it was in (16 quanta), not half the wire
    assert during <= CHUNK // QUANTUM, f"{during} low-priority quanta crossed the link during the high transfer"
    # waiting: the urgent transfer's first quantum came within one piece of the bulk after it was submitted
    assert link.log[:first].count(Priority.LOW) <= 64 + 2 * CHUNK // QUANTUM
