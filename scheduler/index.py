"""The scheduler's index of stored KV blocks: which block hashes storage holds, so a prompt's hit length is a
lookup. Rebuilt from storage at start (in the background: a large store takes minutes to list); kept current by
engines' reports of what they store and evict.

At the paper's scale it holds tens of millions of blocks (48K agents x ~500 blocks), and every submission asks
about ~500 of them. A Python set pays one serialized cache miss per block (~0.1 ms per prompt at a million
blocks); this index is an open-addressing table of 64-bit key ids in one numpy array, probed for a whole prompt
at once, so the misses overlap (memory-level parallelism) and the table costs 8 bytes a slot.

Invariant: a key id is the first 8 bytes of the block hash with the low bit set (so 0 can mean empty and 2 a
deleted slot). Two distinct hashes share an id with probability ~2^-63 per pair; a false hit only makes an
engine find the block missing when it loads it, which it already handles by recomputing (``kv_load_failures``).
"""

from __future__ import annotations

import logging
import struct
import threading
from pathlib import Path
from typing import Iterable

import numpy as np

from dualpath.core.geometry import HASH_BYTES, BlockHash

log = logging.getLogger(__name__)

_EMPTY, _DELETED = np.uint64(0), np.uint64(2)
_MAX_LOAD = 0.25  # used slots (keys + deleted) per slot: a lookup costs as many numpy rounds as its longest probe
_FEW = 48  # up to this many ids, a Python loop beats numpy's per-call overhead (a turn stores ~10 new blocks)


def key_ids(packed: bytes) -> np.ndarray:
    """The 64-bit ids of packed block hashes (each ``HASH_BYTES`` long), in order."""
    words = np.frombuffer(packed, dtype="<u8", count=len(packed) // 8)
    return words[:: HASH_BYTES // 8] | np.uint64(1)


_ID = struct.Struct(f"<Q{HASH_BYTES - 8}x")


def few_key_ids(packed: bytes) -> list[int]:
    """``key_ids`` as Python ints, distinct, first occurrence first (for a few hashes: no numpy calls)."""
    return list(dict.fromkeys(w | 1 for (w,) in _ID.iter_unpack(packed)))


class BlockIndex:
    def __init__(self, capacity: int = 1 << 16):
        self._bits = max(4, (capacity - 1).bit_length())
        self._slots = np.zeros(1 << self._bits, np.uint64)
        self._keys = self._deleted = 0
        self._lock = threading.Lock()
        self.lookups = self.hit_blocks_total = self.blocks_total = 0

    def rebuild(self, root: Path, fingerprint: BlockHash, batch: int = 1 << 16) -> int:
        """Add every block stored under ``root`` for the model ``fingerprint``, ``batch`` keys at a time (lookups
        meanwhile see the ones added so far: fewer hits, never wrong ones), logging progress on large stores."""
        model_dir = Path(root) / fingerprint.hex()
        if not model_dir.is_dir():  # nothing stored yet (a scheduler that never rebuilds needs no torch)
            log.info("block index: nothing stored in %s yet", root)
            return 0
        from dualpath.traffic.storage.fs import list_stored_keys  # imports torch

        found, pending = 0, []
        for key in list_stored_keys(model_dir):
            pending.append(key)
            if len(pending) == batch:
                self.add(pending)
                found, pending = found + batch, []
                if found % (16 * batch) == 0:
                    log.info("block index: %d blocks so far from %s", found, root)
        self.add(pending)
        found += len(pending)
        log.info("block index: %d blocks found in %s", found, root)
        return found

    def add(self, keys: Iterable[BlockHash]) -> None:
        self.add_packed(b"".join(keys))

    def remove(self, keys: Iterable[BlockHash]) -> None:
        self.remove_packed(b"".join(keys))

    def add_packed(self, packed: bytes) -> None:
        if len(packed) <= _FEW * HASH_BYTES:
            self._add_few(few_key_ids(packed))
            return
        ids = np.unique(key_ids(packed))
        with self._lock:
            ids = ids[self._find(ids) < 0]
            if self._keys + self._deleted + len(ids) > _MAX_LOAD * len(self._slots):
                self._resize(self._keys + len(ids))
            self._place(ids)
            self._keys += len(ids)

    def _add_few(self, ids: list[int]) -> None:
        """``add_packed`` for a few distinct ids, probed and placed one by one in Python."""
        with self._lock:
            slots, mask = self._slots, len(self._slots) - 1
            new = [i for i in ids if self._find_one(i, slots, mask) < 0]
            if self._keys + self._deleted + len(new) > _MAX_LOAD * len(self._slots):
                self._resize(self._keys + len(new))
            slots, mask = self._slots, len(self._slots) - 1
            for i in new:
                self._place_one(i, slots, mask)
            self._keys += len(new)

    def remove_packed(self, packed: bytes) -> None:
        ids = np.unique(key_ids(packed))
        with self._lock:
            at = self._find(ids)
            at = at[at >= 0]
            self._slots[at] = _DELETED
            self._keys -= len(at)
            self._deleted += len(at)

    def hit_blocks(self, packed: bytes) -> int:
        """How many leading blocks of a prompt are stored (``packed``: its chained hashes, concatenated)."""
        ids = key_ids(packed)
        with self._lock:
            n = self._first_missing(ids)
            self.lookups += 1
            self.hit_blocks_total += n
            self.blocks_total += len(ids)
        return n

    def __len__(self) -> int:
        return self._keys

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (ids >> np.uint64(64 - self._bits)).astype(np.int64)  # the hash's top bits are uniform

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """The slot holding each id, or -1. Probes every id one step per round, so rounds = the longest probe."""
        slots, mask = self._slots, len(self._slots) - 1
        if len(ids) <= _FEW:
            return np.array([self._find_one(i, slots, mask) for i in ids.tolist()], np.int64)
        where = np.full(len(ids), -1, np.int64)
        todo, pos = np.arange(len(ids)), self._home(ids)
        while len(todo):
            seen = slots[pos]
            hit = seen == ids[todo]
            where[todo[hit]] = pos[hit]
            go = ~hit & (seen != _EMPTY)  # a deleted slot does not end a probe sequence
            todo, pos = todo[go], (pos[go] + 1) & mask
        return where

    def _first_missing(self, ids: np.ndarray) -> int:
        """The index of the first id not in the table (``len(ids)``: none), probing as ``_find`` does but only
        the ids before the first one known missing (a probe that meets an empty slot)."""
        slots, mask = self._slots, len(self._slots) - 1
        if len(ids) <= _FEW:
            return next((k for k, i in enumerate(ids.tolist()) if self._find_one(i, slots, mask) < 0), len(ids))
        first = len(ids)
        todo, pos = np.arange(first), self._home(ids)
        while len(todo):
            seen = slots.take(pos)
            empty = seen == _EMPTY
            if empty.any():  # todo is ascending and below first: its first empty probe is a new earliest miss
                first = int(todo[empty.argmax()])
            go = (seen != ids.take(todo)) & ~empty & (todo < first)
            todo, pos = todo[go], (pos[go] + 1) & mask
        return first

    def _find_one(self, i: int, slots: np.ndarray, mask: int) -> int:
        pos = i >> (64 - self._bits)
        while (seen := int(slots[pos])) != i:
            if seen == 0:
                return -1
            pos = (pos + 1) & mask
        return pos

    def _place_one(self, i: int, slots: np.ndarray, mask: int) -> None:
        pos = i >> (64 - self._bits)
        while slots[pos]:
            pos = (pos + 1) & mask
        slots[pos] = i

    def _place(self, ids: np.ndarray) -> None:
        """Insert ids known to be absent and distinct: each walks from its home to the first empty slot; when
        several reach the same empty slot in a round, the first takes it and the others walk on."""
        slots, mask = self._slots, len(self._slots) - 1
        if len(ids) <= _FEW:
            for i in ids.tolist():
                self._place_one(i, slots, mask)
            return
        todo, pos = ids, self._home(ids)
        while len(todo):
            free = np.flatnonzero(slots[pos] == _EMPTY)
            _, first = np.unique(pos[free], return_index=True)
            won = free[first]
            slots[pos[won]] = todo[won]
            left = np.ones(len(todo), bool)
            left[won] = False
            todo, pos = todo[left], pos[left]
            taken = slots[pos] != _EMPTY
            pos[taken] = (pos[taken] + 1) & mask

    def _resize(self, keys: int) -> None:
        live = self._slots[(self._slots != _EMPTY) & (self._slots != _DELETED)]
        self._bits = max(self._bits, int(np.ceil(np.log2(keys / _MAX_LOAD * 1.5))))
        self._slots = np.zeros(1 << self._bits, np.uint64)
        self._deleted = 0
        self._place(live)
