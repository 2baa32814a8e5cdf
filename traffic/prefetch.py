"""Session KV read ahead of its next turn into spare slots of an engine's DRAM buffer.

While an agent's tool runs, the scheduler orders the session's stored blocks read into the buffer of the engine that
will serve its next turn (``PrefetchOrder``); when the turn comes, the traffic manager copies those blocks from the
buffer instead of reading storage. A wrong guess costs buffer room nobody needed and storage bandwidth nobody used:

- reads go one block at a time, and only while no demand read waits on this engine's storage (``ReadAccounting``);
- prefetched blocks take only free slots, at most ``max_share`` of the buffer, and are the first to go: the buffer
  hands their slots to a request that needs room (``BufferPool.reclaimer``), least recently used first;
- a block no request used within its order's ``hold_s`` is freed (and counted wasted).

Who calls it: the traffic manager (``TrafficManager.prefetch``, ``served``). What it may not do: delay a demand read,
keep a slot a request waits for, or hand out bytes of a block whose read did not end intact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dualpath.core.errors import DualPathError
from dualpath.core.geometry import BlockHash
from dualpath.traffic.buffer import BufferPool
from dualpath.traffic.storage.accounting import ReadAccounting
from dualpath.traffic.storage.base import StorageBackend

log = logging.getLogger(__name__)

OWNER = "prefetch"  # the buffer owner of every prefetched slot
_IDLE_POLL_S = 0.005  # how often a prefetch waiting for demand reads to clear looks again


@dataclass
class _Entry:
    slot: int
    until: float  # freed after this (monotonic) unless used again
    used: bool = False


@dataclass
class _Order:
    keys: list[BlockHash]
    hold_s: float
    until: float  # an order not started by then is dropped (its turn has come and gone)
    over: bool = False  # its turn came: the demand reads what is not in yet, so this stops


class Prefetcher:
    def __init__(
        self,
        buffer: BufferPool,
        storage: Callable[[], StorageBackend],
        accounting: ReadAccounting,
        max_share: float = 0.5,
        read_timeout_s: float = 30.0,
        clock=time.monotonic,
    ):
        self.buffer, self.storage, self.accounting, self.clock = buffer, storage, accounting, clock
        self.max_slots = int(buffer.num_slots * max_share)
        self.read_timeout_s = read_timeout_s
        self.block_bytes = buffer.geometry.full_block_bytes
        self._lock = threading.Condition()
        self._ready: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently used first
        self._orders: deque[_Order] = deque()
        self._current: _Order | None = None
        self._reading = 0  # slots allocated for a read in flight
        self._stopping = False
        self._worker: threading.Thread | None = None
        self.counts = dict.fromkeys(("ordered", "loaded", "used", "wasted", "skipped", "hit_reads"), 0)
        buffer.reclaimer = self.reclaim

    # --- the scheduler's orders -------------------------------------------------------------------------------
    def order(self, keys: Sequence[BlockHash], hold_s: float) -> None:
        """Read ``keys`` (leading block first) into spare slots soon, and keep them ``hold_s`` seconds."""
        if not keys or self.max_slots <= 0:
            return
        with self._lock:
            self.counts["ordered"] += len(keys)
            self._orders.append(_Order(list(keys), hold_s, self.clock() + hold_s))
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, daemon=True, name="prefetch")
                self._worker.start()
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._orders or self._stopping, timeout=1.0)
                if self._stopping:
                    return
                order = self._current = self._orders.popleft() if self._orders else None
            self._expire()
            if order is not None:
                self._fetch(order)

    def _fetch(self, order: _Order) -> None:
        for i, key in enumerate(order.keys):
            if order.over:
                break
            if self._refresh(key, order.hold_s):
                continue
            if not self._wait_idle(order.until) or not self._read(key, order.hold_s):
                with self._lock:
                    self.counts["skipped"] += len(order.keys) - i
                return  # a hit is a leading run: past a block not prefetched the rest would not be used

    def _refresh(self, key: BlockHash, hold_s: float) -> bool:
        with self._lock:
            e = self._ready.get(key)
            if e is None:
                return False
            e.until = max(e.until, self.clock() + hold_s)
            self._ready.move_to_end(key)
            return True

    def _wait_idle(self, until: float) -> bool:
        """Wait until no demand read waits for this engine's storage (prefetch takes only idle bandwidth)."""
        while self.accounting.snapshot().waiting_bytes > 0:
            if self._stopping or self.clock() > until:
                return False
            time.sleep(_IDLE_POLL_S)
        return not self._stopping

    def _read(self, key: BlockHash, hold_s: float) -> bool:
        with self._lock:
            if len(self._ready) + self._reading >= self.max_slots or self.buffer.waiting:
                return False
            self._reading += 1
        try:
            slot = self.buffer.allocate(1, OWNER, reclaim=False)[0]
        except DualPathError:  # no free slot: demand holds the buffer
            with self._lock:
                self._reading -= 1
            return False
        ok = False
        try:
            ok = self.storage().read([key], [self.buffer.slot_bytes(slot)]).result(self.read_timeout_s)[0] is None
        except Exception as e:  # noqa: BLE001 - a failed prefetch costs nothing but the try
            log.debug("prefetch of %s failed: %s", key.hex(), e)
        with self._lock:
            self._reading -= 1
            if ok and not self._stopping:
                self._ready[key] = _Entry(slot, self.clock() + hold_s)
                self.counts["loaded"] += 1
                return True
        self.buffer.free([slot])
        return False

    def _expire(self) -> None:
        now = self.clock()
        with self._lock:
            gone = [k for k, e in self._ready.items() if e.until <= now]
            slots = [self._drop(k) for k in gone]
        if slots:
            self.buffer.free(slots)

    def _drop(self, key: BlockHash) -> int:
        """Forget a prefetched block (lock held); its slot, for the caller to free."""
        e = self._ready.pop(key)
        if not e.used:
            self.counts["wasted"] += 1
        return e.slot

    # --- the demand side --------------------------------------------------------------------------------------
    def served(self, keys: Sequence[BlockHash], dests: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each prefetched key's Full Block into its destination (a buffer slot's bytes); which were."""
        out = [False] * len(keys)
        with self._lock:  # (reclaim cannot take a slot while its bytes are copied out)
            self._turn_came(keys)
            for i, (key, dest) in enumerate(zip(keys, dests)):
                e = self._ready.get(key)
                if e is None:
                    continue
                dest.copy_(self.buffer.slot_bytes(e.slot))
                self._ready.move_to_end(key)
                self.counts["hit_reads"] += 1
                if not e.used:
                    e.used = True
                    self.counts["used"] += 1
                out[i] = True
        return out

    def _turn_came(self, keys: Sequence[BlockHash]) -> None:
        """A request loads ``keys``: orders for them end here (lock held), or the same blocks would be read twice."""
        wanted = set(keys)
        for order in [self._current, *self._orders]:
            if order is not None and not order.over and wanted.intersection(order.keys):
                order.over = True
                self.counts["skipped"] += sum(k not in self._ready for k in order.keys)
        while self._orders and self._orders[0].over:
            self._orders.popleft()

    def reclaim(self, n: int) -> int:
        """Free up to ``n`` prefetched slots, least recently used first: a request needs the room. Called by the
        buffer with its lock held."""
        with self._lock:
            gone = list(self._ready)[:n]
            slots = [self._drop(k) for k in gone]
        if slots:
            self.buffer.free(slots)
        return len(slots)

    def stats(self) -> dict:
        """Cumulative block counts, the blocks held now and the bytes of one block."""
        with self._lock:
            return {**self.counts, "held": len(self._ready), "block_bytes": self.block_bytes}

    def clear(self) -> None:
        """Free every prefetched block (the weights changed: no later request can hit them)."""
        with self._lock:
            self._orders.clear()
        self.reclaim(self.buffer.num_slots)

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=self.read_timeout_s)
        self.clear()
