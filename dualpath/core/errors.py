"""Typed errors shared by every layer.

Each error names the thing that failed (a block hash, a tensor name, a field) so that a user reading a log
knows what to fix, and so that callers can answer a failure precisely (recompute a block, reject a request).
"""

from __future__ import annotations


class DualPathError(Exception):
    """Base class of every error the project raises on purpose."""


class CheckpointError(DualPathError):
    """A model checkpoint directory is unusable: unknown architecture, missing or misshapen tensors."""


class ConfigError(DualPathError):
    """A configuration value is invalid or inconsistent with another one."""


class RequestError(DualPathError):
    """A request is malformed or cannot be served (too long, bad sampling parameters)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnavailableError(RequestError):
    """The cluster cannot take a request now (its queue is full, or no engines are registered yet); retry later."""


class EngineBusyError(DualPathError):
    """The engine holds work and cannot load new weights now."""


class OutOfBlocksError(DualPathError):
    """A paged cache or buffer pool has no free block for an allocation."""


class StorageError(DualPathError):
    """A KV storage operation failed. ``key`` names the block (hex) where one is involved."""

    def __init__(self, message: str, key: bytes | None = None):
        super().__init__(message)
        self.key = key


class BlockMissingError(StorageError):
    """The block is not in storage (never written, evicted or deleted)."""


class BlockCorruptError(StorageError):
    """The stored block is short, has a bad header, another model's fingerprint, or fails its checksum."""


class StorageFullError(StorageError):
    """Storage has no room for a write (disk full, quota, or the configured capacity with nothing to evict)."""


class TransportError(DualPathError):
    """A KV transfer failed."""


class SegmentError(TransportError):
    """A segment names an unregistered region or reaches outside one; raised when the batch is submitted."""


class PeerDeadError(TransportError):
    """The peer process or its endpoint is gone."""


class TransferTimeoutError(TransportError):
    """A transfer did not finish within its deadline."""


class RankLostError(DualPathError):
    """A rank of a tensor-parallel engine died or stopped answering: the engine leaves service as a whole."""
