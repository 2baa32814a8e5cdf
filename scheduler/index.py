"""The scheduler's index of stored KV blocks: which block hashes storage holds, so a prompt's hit length is a
lookup. Rebuilt from storage at start; kept current by engines' reports of what they store and evict."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Iterable

from dualpath.geometry import HASH_BYTES, BlockHash
from traffic.storage.fs import list_stored_keys

log = logging.getLogger(__name__)


class BlockIndex:
    def __init__(self):
        self._keys: set[BlockHash] = set()
        self._lock = threading.Lock()
        self.lookups = self.hit_blocks_total = self.blocks_total = 0

    def rebuild(self, root: Path, fingerprint: BlockHash) -> int:
        keys = set(list_stored_keys(Path(root) / fingerprint.hex()))
        with self._lock:
            self._keys |= keys
        log.info("block index: %d blocks found in %s", len(keys), root)
        return len(keys)

    def add(self, keys: Iterable[BlockHash]) -> None:
        with self._lock:
            self._keys.update(keys)

    def remove(self, keys: Iterable[BlockHash]) -> None:
        with self._lock:
            self._keys.difference_update(keys)

    def hit_blocks(self, packed: bytes) -> int:
        """How many leading blocks of a prompt are stored (``packed``: its chained hashes, concatenated)."""
        keys, n, total = self._keys, 0, len(packed) // HASH_BYTES
        with self._lock:
            for i in range(0, total * HASH_BYTES, HASH_BYTES):
                if packed[i:i + HASH_BYTES] not in keys:
                    break
                n += 1
            self.lookups += 1
            self.hit_blocks_total += n
            self.blocks_total += total
        return n

    def __len__(self) -> int:
        return len(self._keys)
