"""The storage contract: batched, asynchronous operations on Full Blocks named by their block hash.

Who calls it: an engine's traffic manager (reads of hit blocks, writes of filled blocks) and the scheduler's
index rebuild (``list_keys``). What an implementation may not do: return wrong bytes. A missing, short,
foreign or corrupt block is reported per key as a typed error (``BlockMissingError``, ``BlockCorruptError``),
so the engine recomputes those tokens instead, and a corrupt one is removed, so the write of its recomputed bytes
stores it again (a write of a stored key is a no-op); a full disk is reported (``StorageFullError``), never raised
into the caller's thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Callable, Iterator, Sequence

import torch

from dualpath.core.errors import StorageError
from dualpath.core.geometry import BlockHash

# Per key: None when the operation succeeded, else the error that names the block.
Results = list[StorageError | None]


class StorageBackend(ABC):
    @abstractmethod
    def contains(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Which keys are stored (a cheap metadata check; the bytes may still fail their checksum on read)."""

    @abstractmethod
    def read(
        self, keys: Sequence[BlockHash], into: Sequence[torch.Tensor], layers: tuple[int, int] | None = None
    ) -> "Future[Results]":
        """Read each key's Full Block (or only layers ``[first, last)``) into the matching uint8 tensor, which
        holds exactly those bytes. Resolves to per-key results; a failed key's destination bytes are undefined."""

    @abstractmethod
    def write(self, keys: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> "Future[Results]":
        """Store Full Blocks atomically and idempotently (writing an existing key is a no-op)."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockHash]) -> "Future[Results]":
        """Remove keys; removing a missing key is not an error."""

    @abstractmethod
    def list_keys(self) -> Iterator[BlockHash]:
        """Every stored key of this model fingerprint (to rebuild an index at start)."""

    @abstractmethod
    def usage(self) -> dict:
        """``{"used_bytes", "capacity_bytes", "num_blocks", "corrupt_removed"}`` (the last: blocks this store found
        corrupt on read and removed, since it opened)."""

    @abstractmethod
    def destroy(self) -> None:
        """Finish queued work, then remove every block of this fingerprint (its engine replaced the weights that
        computed them: nothing can hit them again). Other processes may be removing them at the same time."""

    def drop_cached(self, keys: Sequence[BlockHash]) -> None:
        """Make the next reads of ``keys`` come from the storage medium, not from this host's cache of it (the
        page cache), so that a read probe measures the medium. Only the engine's start-up read probe calls it.
        Best effort, never raises; a backend with no such cache does nothing."""

    def set_evict_callback(self, callback: Callable[[list[BlockHash]], None]) -> None:
        """Called with keys evicted to stay under capacity (so an index can forget them)."""
        self._on_evict = callback

    def set_corrupt_callback(self, callback: Callable[[list[BlockHash]], None]) -> None:
        """Called with keys this store found corrupt on read and removed (to be stored again)."""
        self._on_corrupt = callback

    def set_cleared_callback(self, callback: Callable[[], None]) -> None:
        """Called when this store finds every block of its fingerprint gone at once (another process removed them:
        a flush of the store, ``remove_stored``)."""
        self._on_cleared = callback

    def close(self) -> None:
        """Finish queued work and release resources."""
