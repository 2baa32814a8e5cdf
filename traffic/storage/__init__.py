"""KV storage backends by name: ``fs`` (any POSIX directory: local disk, 3FS FUSE, Lustre, GPFS, NFS) and
``hf3fs`` (3FS USRBIO, where its client library is installed)."""

from __future__ import annotations

from pathlib import Path

from dualpath.core.config import StorageConfig
from dualpath.core.errors import ConfigError
from dualpath.core.geometry import BlockHash, KVGeometry
from dualpath.core.paths import default_kv_store
from dualpath.traffic.storage.accounting import ReadAccounting
from dualpath.traffic.storage.base import StorageBackend

BACKENDS = ("fs", "hf3fs")


def make_storage(
    config: StorageConfig, geometry: KVGeometry, fingerprint: BlockHash, accounting: ReadAccounting | None = None
) -> StorageBackend:
    root = Path(config.root).expanduser() if config.root else default_kv_store()
    if config.backend == "fs":
        from dualpath.traffic.storage.fs import FsStorage

        return FsStorage(root, geometry, fingerprint, config, accounting)
    if config.backend == "hf3fs":
        from dualpath.traffic.storage.hf3fs import Hf3fsStorage

        return Hf3fsStorage(root, geometry, fingerprint, config, accounting)
    raise ConfigError(f"unknown storage backend {config.backend!r}; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "ReadAccounting", "StorageBackend", "make_storage"]
